"""Weight-only quantization: INT4 (and INT8) weights, dequantized on the fly.

A weight matrix ``[out, in]`` is cut, along each row, into groups of ``group_size`` inputs. Each
group gets its own grid of 2^bits evenly spaced levels, described by a scale and a zero point
(both stored in fp16):

    asymmetric:  lo = min(w_min, 0), hi = max(w_max, 0),  scale = (hi - lo) / (2^bits - 1),
                 zero = round(-lo / scale)
    symmetric:   scale = max|w| / (2^(bits-1) - 1),  zero = 2^(bits-1)   (fixed, not stored)

    code = clamp(round(w / scale) + zero, 0, 2^bits - 1)        w_hat = (code - zero) * scale

The range includes 0, so a zero weight stays exactly zero and ``zero`` is a valid code. A group
whose weights are all 0 gets scale 1. Two 4-bit codes share a byte: the even column in the low
nibble, the odd one in the high nibble. Per weight, INT4 with groups of g costs
4 + 16/g bits (symmetric) or 4 + 32/g bits (asymmetric), against 16 for fp16.

Rounding to nearest (RTN) treats every weight alone. GPTQ (Frantar et al., 2022) quantizes the
columns of W one at a time and spreads each column's rounding error over the columns not yet
quantized, weighted by the inverse of the layer's input Hessian H = 2 X^T X (X: calibration inputs
to the layer), so that the layer's *output* error ||X W^T - X W_hat^T|| stays small:

    err = (w_i - w_hat_i) / U_ii;   W[:, i+1:] -= err U_i,i+1:     with U the upper Cholesky factor of H^-1

``QuantLinear`` keeps the packed codes. Dequantizing the whole weight in PyTorch at every call
saves memory and costs time: the full-precision weight is rebuilt, written and read again. So for
a decode step (up to 8 rows of activations, 4-bit weights) it calls a fused kernel instead
(``labkit.kernels.int4_linear``: C++ on a CPU, Triton on a GPU), which reads the codes, scales and
zeros and never builds the weight; prefill, other widths and devices without a kernel take the
PyTorch path. ``use_fused(model, False)`` makes a model's layers always take the PyTorch path, to
compare the two: the outputs agree within float rounding.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from labkit.answers import answer_to
from labkit.kernels.int4_linear import int4_linear, why_not_int4_linear
from labkit.model import Transformer
from labkit.validate import is_int


@dataclass(frozen=True)
class Scheme:
    """How to quantize: ``group_size=None`` means one group per output row (per-channel)."""

    bits: int = 4
    group_size: int | None = 64
    symmetric: bool = False

    def __post_init__(self) -> None:
        if not is_int(self.bits) or not 2 <= self.bits <= 8:
            raise ValueError(f"bits={self.bits!r}: choose an int from 2 to 8")
        if self.group_size is not None and (not is_int(self.group_size) or self.group_size < 1):
            raise ValueError(f"group_size={self.group_size!r} must be an int of at least 1 (or None: one group "
                             f"per row)")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric={self.symmetric!r} must be True or False (a string such as 'no' would "
                             f"count as True)")

    def groups(self, in_features: int) -> int:
        """Groups per row; a row that the groups do not tile exactly is refused, not padded."""
        size = self.group_size or in_features
        if in_features % size:
            divisors = [g for g in (32, 64, 128, 256) if in_features % g == 0]
            raise ValueError(f"in_features={in_features} is not a multiple of group_size={size}; "
                             f"group sizes that fit: {divisors or 'none of 32-256, use group_size=None'}")
        return in_features // size

    def bits_per_weight(self, in_features: int) -> float:
        """Code bits plus each group's fp16 scale (and zero), shared by the group."""
        size = in_features // self.groups(in_features)
        return self.bits + 16 * (1 if self.symmetric else 2) / size

    @property
    def name(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        return f"INT{self.bits} {'per-channel' if self.group_size is None else f'g{self.group_size}'} {kind}"


@answer_to("ex06.1")
def group_params(groups: Tensor, bits: int, symmetric: bool) -> tuple[Tensor, Tensor]:
    """Scale (rounded to fp16, returned as fp32) and zero point of each group ``[..., size]``."""
    levels = 2 ** bits - 1
    if symmetric:
        scale = groups.abs().amax(-1) / (2 ** (bits - 1) - 1)
        zero = torch.full_like(scale, 2 ** (bits - 1))
    else:
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = (hi - lo) / levels
    scale = scale.half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if not symmetric:
        zero = torch.round(-lo / scale).clamp(0, levels)
    return scale, zero


def quantize(weight: Tensor, scheme: Scheme) -> tuple[Tensor, Tensor, Tensor]:
    """Round to nearest: uint8 codes ``[out, in]``, fp16 scales and zeros ``[out, groups]``."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out, in], got shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, scheme.groups(in_features), -1)
    scale, zero = group_params(groups, scheme.bits, scheme.symmetric)
    codes = torch.round(groups / scale[..., None]) + zero[..., None]
    codes = codes.clamp(0, 2 ** scheme.bits - 1).to(torch.uint8).reshape(out_features, in_features)
    return codes, scale.half(), zero.half()


def check_groups(codes: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int | None = None) -> None:
    """ValueError unless ``scales`` (and ``zeros``, unless None) are ``[out, in / group_size]`` for
    codes ``[out, in]``. Without ``group_size`` the group count is read from ``scales``, which then
    need only tile the row: a scale per group of ``in / scales.shape[1]`` columns."""
    if codes.dim() != 2:
        raise ValueError(f"codes must be [out, in], got shape {list(codes.shape)}")
    out_features, in_features = codes.shape
    if group_size is not None:
        if not is_int(group_size) or group_size < 1 or in_features % group_size:
            raise ValueError(f"group_size={group_size!r} must be an int that divides in={in_features}")
        expected = [out_features, in_features // group_size]
    elif (scales.dim() == 2 and scales.shape[0] == out_features and scales.shape[1] >= 1
          and in_features % scales.shape[1] == 0):
        expected = list(scales.shape)
    else:
        raise ValueError(f"scales {list(scales.shape)} must be [out, in / group_size] = [{out_features}, n], "
                         f"n dividing in={in_features}")
    for name, tensor in (("scales", scales), ("zeros", zeros)):
        if tensor is not None and list(tensor.shape) != expected:
            raise ValueError(f"{name} {list(tensor.shape)} must be [out, in / group_size] = {expected}")


@answer_to("ex06.3", "ex06b.1")  # ex06b.1 dequantizes too, inside its dot product
def dequantize(codes: Tensor, scales: Tensor, zeros: Tensor, dtype: torch.dtype = torch.float32, *,
               group_size: int | None = None) -> Tensor:
    """w_hat = (code - zero) * scale, each group's scale and zero repeated over its columns. The
    group size is ``in / scales.shape[1]``; given ``group_size`` (as ``QuantLinear`` gives its
    scheme's), the shapes are checked against it too (``check_groups``)."""
    check_groups(codes, scales, zeros, group_size)
    out_features, in_features = codes.shape
    groups = codes.reshape(out_features, scales.shape[-1], -1).to(dtype)
    return ((groups - zeros[..., None].to(dtype)) * scales[..., None].to(dtype)).reshape(out_features, in_features)


def check_codes(codes: Tensor, bits: int) -> None:
    """ValueError unless every code fits in ``bits`` bits (a byte would wrap the others)."""
    if codes.numel() and not 0 <= int(codes.min()) <= int(codes.max()) < 2 ** bits:
        raise ValueError(f"codes {int(codes.min())}..{int(codes.max())} do not fit in {bits} bits "
                         f"(0..{2 ** bits - 1})")


@answer_to("ex06.2")
def pack_int4(codes: Tensor) -> Tensor:
    """Two 4-bit codes per byte along the last dimension: even column low, odd column high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack {codes.shape[-1]} codes per row into bytes: the count must be even")
    check_codes(codes, 4)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


@answer_to("ex06.2", "ex06b.1")  # ex06b.1 unpacks too
def unpack_int4(packed: Tensor) -> Tensor:
    """The inverse of ``pack_int4``: ``[..., n]`` bytes to ``[..., 2n]`` codes."""
    if packed.dtype != torch.uint8:  # a signed byte shifts its sign bit in: codes of -8..-1
        raise ValueError(f"packed must be uint8 (two 4-bit codes a byte), got {packed.dtype}")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


class QuantLinear(nn.Module):
    """A Linear layer (no bias) whose weight is kept as codes with fp16 scales and zeros, and
    dequantized to the input's dtype at every call. 4-bit codes are packed two to a byte; codes of
    any other width take a byte each (INT8 fills it; 2, 3 and 5-7 bits are for experiments)."""

    def __init__(self, codes: Tensor, scales: Tensor, zeros: Tensor | None, scheme: Scheme) -> None:
        super().__init__()
        if codes.dim() != 2:
            raise ValueError(f"codes must be [out, in], got shape {list(codes.shape)}")
        self.scheme = scheme
        self.out_features, self.in_features = codes.shape
        if zeros is None and not scheme.symmetric:
            raise ValueError(f"{scheme.name} needs zeros [out, in / group_size]; only a symmetric grid has none")
        scheme.groups(self.in_features)  # a row the scheme's groups do not tile is refused here
        check_groups(codes, scales, zeros, self.group_size)
        if scheme.bits != 4:  # pack_int4 checks 4-bit codes
            check_codes(codes, scheme.bits)
        # contiguous, whatever the layout of the weight they came from (a checkpoint may hold a transpose):
        # the fused kernel reads them row by row
        packed = pack_int4(codes) if scheme.bits == 4 else codes.to(torch.uint8)
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("scales", scales.half().contiguous())
        # a symmetric grid's zero is the fixed 2^(bits-1): nothing to store
        self.register_buffer("zeros", None if scheme.symmetric else zeros.half().contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: Scheme) -> QuantLinear:
        if linear.bias is not None:
            raise ValueError("QuantLinear has no bias; this Linear has one")
        return cls(*quantize(linear.weight.detach(), scheme), scheme)

    def codes(self, rows: Tensor | None = None) -> Tensor:
        """The codes unpacked, of every row or only of ``rows``."""
        packed = self.packed if rows is None else self.packed[rows]
        return unpack_int4(packed) if self.scheme.bits == 4 else packed

    @property
    def group_size(self) -> int:
        """Columns per scale: the scheme's group size, or the whole row (``group_size=None``)."""
        return self.scheme.group_size or self.in_features

    def zero_points(self) -> Tensor:
        if self.zeros is not None:
            return self.zeros
        return torch.full_like(self.scales, 2 ** (self.scheme.bits - 1))

    def dequantized_weight(self, dtype: torch.dtype = torch.float32, rows: Tensor | None = None) -> Tensor:
        """The weight ``[out, in]``, or only its ``rows``, as ``dtype``."""
        pick = slice(None) if rows is None else rows
        return dequantize(self.codes(rows), self.scales[pick], self.zero_points()[pick], dtype,
                          group_size=self.group_size)

    fused = True  # take the fused INT4 kernel where it applies (``use_fused``); else dequantize in PyTorch

    def forward(self, x: Tensor) -> Tensor:
        # under torch.compile, the PyTorch path: Inductor fuses the dequantization into the matmul itself
        if self.fused and self.scheme.bits == 4 and not torch.compiler.is_compiling():
            if why_not_int4_linear(x, self.packed, self.scales, self.zeros, self.group_size) is None:
                return int4_linear(x, self.packed, self.scales, self.zeros, self.group_size, check=False)
        return F.linear(x, self.dequantized_weight(x.dtype))

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and zeros."""
        return sum(t.nbytes for t in (self.packed, self.scales, self.zeros) if t is not None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.name}"


def use_fused(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Make every ``QuantLinear`` of ``model`` take the fused kernel where it applies (``enabled``)
    or always dequantize in PyTorch; returns ``model``."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.fused = enabled
    return model


class QuantEmbedding(nn.Module):
    """An embedding that reads its rows from a QuantLinear (the LM head, when the two are tied):
    only the looked-up rows are dequantized."""

    def __init__(self, table: QuantLinear) -> None:
        super().__init__()
        self.table = table

    def forward(self, tokens: Tensor) -> Tensor:
        weight = self.table.dequantized_weight(rows=tokens.flatten())
        return weight.reshape(*tokens.shape, self.table.in_features)


def hessian(inputs: Tensor) -> Tensor:
    """H = 2 X^T X / n over the n rows of the inputs ``[..., in]`` a layer saw."""
    x = inputs.reshape(-1, inputs.shape[-1]).float()
    return 2 * x.T @ x / len(x)


def inverse_hessian_factor(h: Tensor, damp: float = 0.01) -> Tensor:
    """U, the upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, in float32 (computed in float64):
    the damping keeps H invertible where inputs are few or correlated."""
    h = h.double() + damp * h.diagonal().double().mean() * torch.eye(len(h), dtype=torch.float64, device=h.device)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()


@answer_to("ex06b.3")
def gptq(weight: Tensor, h: Tensor, scheme: Scheme, damp: float = 0.01, block: int = 128
         ) -> tuple[Tensor, Tensor, Tensor]:
    """GPTQ for one weight ``[out, in]`` given its input Hessian ``[in, in]``: codes, scales and
    zeros as ``quantize`` returns them, each group's grid set from the weights as they stand (already
    corrected for the earlier columns' errors) when the group is reached. Columns go in blocks: an
    error updates the rest of its block at once and the columns past it in one matmul per block."""
    w = weight.detach().float().clone()
    out_features, in_features = w.shape
    size = in_features // scheme.groups(in_features)
    block = max(block // size, 1) * size  # whole groups per block, so a group's columns are up to date
    h = h.double().clone()
    dead = h.diagonal() == 0  # an input that was always 0: its column cannot matter
    h[dead, dead] = 1
    w[:, dead] = 0
    u = inverse_hessian_factor(h, damp)
    codes = torch.empty(out_features, in_features, dtype=torch.uint8, device=w.device)
    scales, zeros = [], []
    for start in range(0, in_features, block):
        end = min(start + block, in_features)
        errors = torch.empty(out_features, end - start, device=w.device)
        for i in range(start, end):
            if i % size == 0:
                scale, zero = group_params(w[:, i:i + size], scheme.bits, scheme.symmetric)
                scales.append(scale)
                zeros.append(zero)
            code = (torch.round(w[:, i] / scale) + zero).clamp(0, 2 ** scheme.bits - 1)
            codes[:, i] = code.to(torch.uint8)
            errors[:, i - start] = (w[:, i] - (code - zero) * scale) / u[i, i]
            w[:, i + 1:end] -= errors[:, i - start, None] * u[i, i + 1:end]
        w[:, end:] -= errors @ u[start:end, end:]
    return codes, torch.stack(scales, 1).half(), torch.stack(zeros, 1).half()


@contextmanager
def hooked(handles: list) -> Iterator[None]:
    """Run the block without gradients, then remove the hooks ``handles`` (from ``register_forward_hook``
    and the like), even if it raised: a model is never left recording."""
    try:
        with torch.no_grad():
            yield
    finally:
        for handle in handles:
            handle.remove()


def _targets(model: Transformer, head: bool) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of each Linear to quantize, in the order the model runs them."""
    found = [(parent, name) for block in model.blocks for parent in (block.attn, block.mlp)
             for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    return found + [(model, "lm_head")] if head else found


def _calibrate_gptq(model: Transformer, calibration: Tensor, scheme: Scheme, head: bool, batch_size: int = 8) -> None:
    """Quantize block by block, in place: a block's Hessians come from the inputs that the
    already-quantized blocks before it produce, so each block corrects for their errors too."""
    targets = {id(getattr(p, n)): (p, n) for p, n in _targets(model, head)}
    seen: dict[int, list] = {}  # id of a Linear -> [sum of its Hessians, weighted by rows; rows]

    def record(module: nn.Module, args: tuple[Tensor]) -> None:
        rows = args[0].shape[:-1].numel()
        total = seen.setdefault(id(module), [0, 0])
        total[0] = total[0] + hessian(args[0]) * rows
        total[1] += rows

    def run(stage, xs: list[Tensor]) -> list[Tensor]:
        """Record the stage's inputs, quantize its layers, then run it again quantized."""
        for x in xs:
            stage(x)
        for key, (h, rows) in seen.items():
            parent, name = targets[key]
            setattr(parent, name, QuantLinear(*gptq(getattr(parent, name).weight, h / rows, scheme), scheme))
        seen.clear()
        return [stage(x) for x in xs]

    hooks = [getattr(p, n).register_forward_pre_hook(record) for p, n in targets.values()]
    positions = torch.arange(calibration.shape[1], device=calibration.device)[None]
    rope = model.rotary(positions)
    with hooked(hooks):
        xs = [model.embed(chunk) for chunk in calibration.split(batch_size)]
        for block in model.blocks:
            xs = run(lambda x: block(x, positions, rope, None), xs)
        if head:
            run(model.head, xs)


def quantize_model(model: Transformer, scheme: Scheme = Scheme(), method: str = "rtn",
                   calibration: Tensor | None = None, head: bool = False) -> Transformer:
    """A copy of ``model`` whose blocks' Linear layers are QuantLinear (and the LM head too if
    ``head``; a tied embedding then reads the same quantized table). ``method`` is ``"rtn"``
    (round to nearest), ``"gptq"`` or ``"awq"`` (``labkit.awq``'s scales folded into the blocks,
    then round to nearest; a quantized head is rounded unscaled); the last two need ``calibration`` token ids ``[n, length]``."""
    if method not in ("rtn", "gptq", "awq"):
        raise ValueError(f"method={method!r}: choose 'rtn', 'gptq' or 'awq'")
    if method != "rtn" and (calibration is None or calibration.dim() != 2):
        raise ValueError(f"{method.upper()} needs calibration token ids shaped [n, length]")
    tied = model.lm_head.weight is model.embed.weight
    quantized = copy.deepcopy(model)
    if method == "gptq":
        _calibrate_gptq(quantized, calibration, scheme, head)
    else:
        if method == "awq":
            from labkit.awq import scale_model  # labkit.awq builds on this module's quantize
            scale_model(quantized, calibration, scheme)
        for parent, name in _targets(quantized, head):
            setattr(parent, name, QuantLinear.from_linear(getattr(parent, name), scheme))
    if head and tied:
        quantized.embed = QuantEmbedding(quantized.lm_head)
    return quantized


def output_errors(model: Transformer, quantized: Transformer, tokens: Tensor) -> dict[str, float]:
    """||X W_hat^T - X W^T|| / ||X W^T|| for each quantized Linear, X being the inputs that the
    original ``model`` feeds that layer on ``tokens`` ``[n, length]``. ValueError where no layer is
    a Linear in ``model`` and a QuantLinear in ``quantized`` (the two swapped, say)."""
    if not any(isinstance(m, QuantLinear) for m in quantized.modules()):
        swapped = sum(isinstance(m, QuantLinear) for m in model.modules())
        raise ValueError("quantized holds no QuantLinear layers: output_errors takes the full-precision model "
                         "first, then its quantized copy" + (f" (model holds {swapped}: are the two swapped?)"
                                                             if swapped else ""))
    inputs: dict[str, Tensor] = {}
    names = {id(m): name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    hooks = [m.register_forward_pre_hook(lambda m, args: inputs.__setitem__(names[id(m)], args[0]))
             for m in model.modules() if id(m) in names]
    with hooked(hooks):
        model(tokens)
    errors = {}
    for name, x in inputs.items():
        layer = quantized.get_submodule(name)
        if isinstance(layer, QuantLinear):
            exact = x @ model.get_submodule(name).weight.T
            errors[name] = ((x @ layer.dequantized_weight().T - exact).norm() / exact.norm()).item()
    if not errors:
        raise ValueError("no layer is a Linear in model and a QuantLinear in quantized: model must be the "
                         "full-precision original of quantized")
    return errors


def weight_bytes(model: nn.Module, float_bytes: int = 2) -> int:
    """Bytes of the weights as they would be stored: quantized layers as they are (codes, scales,
    zeros), every other parameter at ``float_bytes`` each (2: fp16). Shared tensors count once."""
    quantized = sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))
    return quantized + float_bytes * sum(p.numel() for p in model.parameters())  # a shared tensor once
