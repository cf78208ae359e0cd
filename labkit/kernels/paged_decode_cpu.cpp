// Paged decode attention on the CPU: one new query per sequence attends to the keys and values
// the paged cache holds for it, read slot by slot through the sequence's block table, with no
// gathered copy. labkit/kernels/paged_decode_cpu.py builds this file and documents it.
//
// The sequences run in parallel on torch's own OpenMP threads (at::parallel_for). Each reads its
// blocks in turn. In a block, one query head at a time is scored against all the block's keys,
// then adds up all the block's values into its output. The first query head of a group (GQA)
// reads its KV head's rows from memory; the others find them in the L1 cache.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace {

struct Pools {
  const float *k, *v;
  int64_t k_block, k_slot, k_head, v_block, v_slot, v_head;  // strides, in floats
  int64_t block_size, kv_heads;
};

// Ask for a block's rows (`floats` of them from `row`) to be fetched from memory ahead of use.
void prefetch(const float* row, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(row + i);  // 16 floats: a 64-byte cache line
}

// One sequence, a block at a time (online softmax, as the Triton kernels do): the block's scores
// for every query head, then each head's running maximum m, sum l and output rescaled if the
// maximum grew, then the block's values added with weights exp(score - m). The next block is
// prefetched while this one is used. D > 0 fixes the head dimension at compile time, so that the
// loops over it unroll into a few vector instructions; D = 0 takes it from `dim`. Query head h
// reads KV head h / group. `work` holds heads * (block_size + 2) floats; `out` is [heads, dim].
template <int D>
void attend(const float* q, int64_t q_head_stride, int64_t group, int64_t dim, const Pools& pools,
            const int64_t* table, int64_t len, float scale, float* work, float* __restrict out) {
  const int64_t d_len = D > 0 ? D : dim, heads = group * pools.kv_heads, size = pools.block_size;
  float *score = work, *m = work + heads * size, *l = m + heads;
  std::fill(out, out + heads * d_len, 0.f);
  for (int64_t first = 0; first < len; first += size) {
    const int64_t n = std::min(size, len - first), block = table[first / size];
    const float *k_block = pools.k + block * pools.k_block, *v_block = pools.v + block * pools.v_block;
    if (first + size < len) {
      const int64_t next = table[first / size + 1];
      prefetch(pools.k + next * pools.k_block, size * pools.k_slot);
      prefetch(pools.v + next * pools.v_block, size * pools.v_slot);
    }
    for (int64_t h = 0; h < heads; ++h) {  // one head's query against every key of the block
      const float *qh = q + h * q_head_stride, *k_head = k_block + (h / group) * pools.k_head;
      for (int64_t j = 0; j < n; ++j) {
        const float* k = k_head + j * pools.k_slot;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < d_len; ++d) dot += qh[d] * k[d];
        score[h * size + j] = dot * scale;
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* p = score + h * size;
      const float top = std::max(*std::max_element(p, p + n), first ? m[h] : p[0]);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        p[j] = std::exp(p[j] - top);
        sum += p[j];
      }
      const float shrink = first ? std::exp(m[h] - top) : 0.f;  // the earlier blocks' weights, rescaled
      l[h] = (first ? l[h] * shrink : 0.f) + sum;
      m[h] = top;
      if (first && shrink != 1.f) {
        float* o = out + h * d_len;
#pragma omp simd
        for (int64_t d = 0; d < d_len; ++d) o[d] *= shrink;
      }
    }
    for (int64_t h = 0; h < heads; ++h) {  // every value of the block into one head's output
      const float *w = score + h * size, *v_head = v_block + (h / group) * pools.v_head;
      float* o = out + h * d_len;
      for (int64_t j = 0; j < n; ++j) {
        const float* v = v_head + j * pools.v_slot;
#pragma omp simd
        for (int64_t d = 0; d < d_len; ++d) o[d] += w[j] * v[d];
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.f / l[h];
    float* o = out + h * d_len;
#pragma omp simd
    for (int64_t d = 0; d < d_len; ++d) o[d] *= inv;
  }
}

// The sequences split into `parts` shares of about equal total length, one share per thread: the
// longest first, each to the share with the least so far. (Equal counts of sequences, as a plain
// parallel loop gives, can leave one thread with most of the work.) Each sequence is computed by
// one thread alone, so the results do not depend on the number of threads.
std::vector<std::vector<int64_t>> balanced_shares(const int64_t* len, int64_t batch, int64_t parts) {
  std::vector<int64_t> order(batch), load(std::max<int64_t>(1, std::min(parts, batch)), 0);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len[a] > len[b]; });
  std::vector<std::vector<int64_t>> shares(load.size());
  for (int64_t b : order) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    shares[least].push_back(b);
    load[least] += len[b];
  }
  return shares;
}

// q [B, n_heads, d]; pools [num_blocks, block_size, n_kv_heads, d]; tables [B, max_blocks];
// lengths [B]. The Python wrapper checks the shapes and dtypes with clearer messages; this checks
// them again, and checks each length and each block a sequence reads (ValueError in Python).
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& tables, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kFloat &&
                  v_pool.scalar_type() == at::kFloat,
              "paged_decode: q and the pools must be float32");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes() && q.size(2) == k_pool.size(3),
              "paged_decode: expected q [B, n_heads, d] and pools [num_blocks, block_size, n_kv_heads, d]");
  TORCH_CHECK(k_pool.size(1) > 0 && k_pool.size(2) > 0 && q.size(1) % k_pool.size(2) == 0,
              "paged_decode: n_heads must be a multiple of n_kv_heads, and blocks must hold slots");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && lengths.dim() == 1 && lengths.size(0) == q.size(0),
              "paged_decode: expected tables [B, max_blocks] and lengths [B]");
  TORCH_CHECK(q.stride(2) == 1 && k_pool.stride(3) == 1 && v_pool.stride(3) == 1,
              "paged_decode: the head dimension must be contiguous");
  const at::Tensor table = tables.to(at::kLong).contiguous(), length = lengths.to(at::kLong).contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), width = table.size(1);
  const int64_t *tab = table.data_ptr<int64_t>(), *len = length.data_ptr<int64_t>();
  const int64_t block = k_pool.size(1), num_blocks = k_pool.size(0);
  for (int64_t b = 0; b < batch; ++b) {  // every block a sequence reads must exist: no read outside the pools
    TORCH_CHECK_VALUE(len[b] >= 1 && len[b] <= width * block, "paged_decode: every length must be in [1, ",
                      width * block, "] (the slots the tables name), but sequence ", b, " has length ", len[b]);
    for (int64_t i = 0; i < (len[b] + block - 1) / block; ++i)
      TORCH_CHECK_VALUE(tab[b * width + i] >= 0 && tab[b * width + i] < num_blocks, "paged_decode: sequence ", b,
                        " reads block ", tab[b * width + i], ", but the pools hold blocks 0..", num_blocks - 1);
  }
  at::Tensor out = at::empty({batch, heads, dim}, q.options());
  const Pools pools{k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), k_pool.stride(0), k_pool.stride(1),
                    k_pool.stride(2),         v_pool.stride(0),         v_pool.stride(1), v_pool.stride(2),
                    k_pool.size(1),           k_pool.size(2)};
  const float* Q = q.data_ptr<float>();
  float* O = out.data_ptr<float>();
  auto run = dim == 48 ? attend<48> : dim == 64 ? attend<64> : dim == 128 ? attend<128> : attend<0>;
  const std::vector<std::vector<int64_t>> shares = balanced_shares(len, batch, at::get_num_threads());
  at::parallel_for(0, static_cast<int64_t>(shares.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work(heads * (block + 2));
    for (int64_t i = begin; i < end; ++i)
      for (int64_t b : shares[i])
        run(Q + b * q.stride(0), q.stride(1), heads / pools.kv_heads, dim, pools, tab + b * width, len[b],
            static_cast<float>(scale), work.data(), O + b * heads * dim);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(labkit, m) {
  m.def("paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lengths, float scale) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
