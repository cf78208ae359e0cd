// Fused INT4 dequantize-and-multiply on the CPU, for decode: y = x W^T with W kept as packed 4-bit
// codes and fp16 scales and zero points, never rebuilt in full precision.
// labkit/kernels/int4_matmul_cpu.py builds this file and documents it (the formula, the layout).
//
// A weight row is read a block at a time: LANES words of 4 bytes, 8 codes each (with AVX-512, 16
// words: 64 bytes, 128 inputs). One vector lane per word: lane l of block b holds the codes of
// inputs 8 (LANES b + l) + k, k = 0..7, in its nibbles (k = 0 lowest). The activations are
// rearranged once per call to match: for each k, the LANES inputs that nibble k multiplies, then
// each word's sum of inputs (the zero point's share). All arithmetic is on 32-bit lanes, in GCC's
// vector types, so that the compiler keeps it in the machine's widest registers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t MAX_ROWS = 8;  // activation rows per call: decode (1), or a few (speculative verification)
#ifdef __AVX512F__
constexpr int LANES = 16;  // words per block: a vector of floats fills one register, so that the
#else                      // permute of the scales is one instruction (GCC splits a wider one lane by lane)
constexpr int LANES = 8;
#endif
constexpr int64_t FEATURES = 32;  // output features whose scales and zero points are converted together

using Floats = float __attribute__((vector_size(LANES * sizeof(float))));
using Ints = int32_t __attribute__((vector_size(LANES * sizeof(int32_t))));

Floats load(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}

// The activations of one call, laid out block by block to match the codes.
struct Blocks {
  int64_t count;                     // blocks per row: in / (8 LANES), rounded up (the last may be partly filled)
  std::vector<float> x;              // [rows][count][9][LANES]: planes k = 0..7, then the words' sums of x
  std::vector<int64_t> first_group;  // [count]: the group of each block's first word
  std::vector<Ints> lane_group;      // [count]: each lane's group, counted from first_group (0 past the row)
};

Blocks arrange(const float* x, int64_t rows, int64_t in, int64_t group_size) {
  const int64_t words = in / 8, count = (words + LANES - 1) / LANES;
  Blocks blocks{count, std::vector<float>(rows * count * 9 * LANES, 0.f), std::vector<int64_t>(count),
                std::vector<Ints>(count)};
  for (int64_t b = 0; b < count; ++b) {
    blocks.first_group[b] = 8 * LANES * b / group_size;
    for (int64_t l = 0; l < LANES && LANES * b + l < words; ++l)
      blocks.lane_group[b][l] = static_cast<int32_t>(8 * (LANES * b + l) / group_size - blocks.first_group[b]);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t w = 0; w < words; ++w) {
      float* planes = blocks.x.data() + (r * count + w / LANES) * 9 * LANES + w % LANES;
      float sum = 0.f;
      for (int k = 0; k < 8; ++k) {
        planes[k * LANES] = x[r * in + 8 * w + k];
        sum += planes[k * LANES];
      }
      planes[8 * LANES] = sum;
    }
  return blocks;
}

// fp16 to fp32 by moving the bits (exponent and mantissa shift up by 13, then one multiply rebiases
// the exponent by 127 - 15 and also turns fp16's subnormals into normal floats), a loop GCC
// vectorises; it converts one value at a time with F16C's instruction. Infinities and NaNs, which
// scales and zero points never are, would come out as finite numbers.
void to_float(const at::Half* half, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t h = half[i].x;
    const float magnitude = std::bit_cast<float>((h & 0x7fffu) << 13) * 0x1p112f;
    out[i] = std::bit_cast<float>(std::bit_cast<uint32_t>(magnitude) | (h & 0x8000u) << 16);
  }
}

// One block into each row's accumulator: the words `v`, their codes converted once to floats and
// used for all R rows. Per lane, with s and z the scale and zero point of the word's group:
//     acc += s * (sum_k code_k * x_k  -  z * sum_k x_k)  =  sum_k (code_k - z) * s * x_k
template <int R>
inline void accumulate(const Ints& v, int64_t b, const float* scale, const float* zero, const Blocks& blocks,
                       Floats* acc) {
  const int64_t g = blocks.first_group[b];
  const Floats s = __builtin_shuffle(load(scale + g), blocks.lane_group[b]);  // a permute: one instruction
  const Floats z = __builtin_shuffle(load(zero + g), blocks.lane_group[b]);
  Floats codes[8];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) codes[k] = __builtin_convertvector((v >> (4 * k)) & 15, Floats);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const float* x = blocks.x.data() + (r * blocks.count + b) * 9 * LANES;
    Floats dot = codes[0] * load(x);
#pragma GCC unroll 8
    for (int k = 1; k < 8; ++k) dot += codes[k] * load(x + k * LANES);
    acc[r] += s * (dot - z * load(x + 8 * LANES));
  }
}

// y[r * y_stride] for the R rows and one output feature: its codes (in / 2 bytes) and its scales
// and zero points as floats (followed by LANES more, so that a vector load from any group stays inside).
template <int R>
void output_feature(const uint8_t* codes, int64_t in, const float* scale, const float* zero, const Blocks& blocks,
                    float* y, int64_t y_stride) {
  Floats acc[R] = {};
  const int64_t full = in / (8 * LANES);
  for (int64_t b = 0; b < full; ++b) {
    Ints v;
    std::memcpy(&v, codes + 4 * LANES * b, sizeof v);
    accumulate<R>(v, b, scale, zero, blocks, acc);
  }
  if (full < blocks.count) {  // the last block, partly filled: its missing words are zero, as are their x
    Ints v = {};
    std::memcpy(&v, codes + 4 * LANES * full, in / 2 - 4 * LANES * full);
    accumulate<R>(v, full, scale, zero, blocks, acc);
  }
  for (int r = 0; r < R; ++r) {
    float sum = 0.f;
    for (int l = 0; l < LANES; ++l) sum += acc[r][l];
    y[r * y_stride] = sum;
  }
}

using Kernel = void (*)(const uint8_t*, int64_t, const float*, const float*, const Blocks&, float*, int64_t);
constexpr Kernel KERNELS[MAX_ROWS] = {output_feature<1>, output_feature<2>, output_feature<3>, output_feature<4>,
                                      output_feature<5>, output_feature<6>, output_feature<7>, output_feature<8>};

// x [..., in] fp32, 1 to MAX_ROWS rows in all; packed [out, in / 2] uint8; scales and zeros
// [out, in / group_size] fp16 (zeros absent: symmetric, zero point 8); y [..., out] fp32. The Python
// side checks these with clearer messages; the operator checks them again, so that a direct call
// cannot read outside the tensors.
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const std::optional<at::Tensor>& zeros, int64_t group_size) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kByte &&
                  scales.scalar_type() == at::kHalf && (!zeros || zeros->scalar_type() == at::kHalf),
              "int4_matmul: expected x float32, packed uint8, scales and zeros float16");
  TORCH_CHECK(x.dim() >= 1 && packed.dim() == 2 && scales.dim() == 2,
              "int4_matmul: expected x [..., in], packed and scales 2-d");
  const int64_t rows = c10::multiply_integers(x.sizes().slice(0, x.dim() - 1)), in = x.size(-1);
  const int64_t out = packed.size(0);
  TORCH_CHECK(rows >= 1 && rows <= MAX_ROWS, "int4_matmul: x must have 1 to ", MAX_ROWS, " rows, got ", rows);
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && in % group_size == 0,
              "int4_matmul: group_size must be a multiple of 8 that divides in_features");
  const int64_t groups = in / group_size;
  TORCH_CHECK(packed.size(1) * 2 == in && scales.size(0) == out && scales.size(1) == groups &&
                  (!zeros || zeros->sizes() == scales.sizes()),
              "int4_matmul: expected packed [out, in / 2], scales and zeros [out, in / group_size]");
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous() && scales.is_contiguous() &&
                  (!zeros || zeros->is_contiguous()),
              "int4_matmul: the tensors must be contiguous");
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out;
  at::Tensor y = at::empty(shape, x.options());
  const Blocks blocks = arrange(x.data_ptr<float>(), rows, in, group_size);
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const at::Half *S = scales.data_ptr<at::Half>(), *Z = zeros ? zeros->data_ptr<at::Half>() : nullptr;
  float* Y = y.data_ptr<float>();
  const Kernel kernel = KERNELS[rows - 1];
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(in, 1));  // tasks of 32K weights or more
  at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scale(FEATURES * groups + LANES), zero(FEATURES * groups + LANES, 8.f);
    for (int64_t first = begin; first < end; first += FEATURES) {
      const int64_t n = std::min(FEATURES, end - first);
      to_float(S + first * groups, scale.data(), n * groups);  // one long loop: a row may have only a few groups
      if (Z) to_float(Z + first * groups, zero.data(), n * groups);
      for (int64_t i = 0; i < n; ++i)
        kernel(P + (first + i) * (in / 2), in, scale.data() + i * groups, zero.data() + i * groups, blocks,
               Y + first + i, out);
    }
  });
  return y;
}

}  // namespace

// a fragment: paged_decode_cpu.cpp opens the namespace `labkit` (TORCH_LIBRARY, once per process)
TORCH_LIBRARY_FRAGMENT(labkit, m) {
  m.def("int4_matmul(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, int group_size) -> Tensor");
  m.impl("int4_matmul", c10::DispatchKey::CPU, TORCH_FN(int4_matmul));
}
