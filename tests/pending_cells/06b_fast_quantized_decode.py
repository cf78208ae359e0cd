# The exercise cells of solutions/06b_fast_quantized_decode.ipynb, kept here until that notebook is written:
# tests/exercise_cells.py reads each "# %% exNN.M" section below as that exercise's cell in solutions/, and
# its release (solutions stripped) as the cell in notebooks/. Once the notebook holds these cells, delete
# this file (the tests say so: an exercise found in both places fails).

# %% ex06b.1
import torch


def int4_row_dot(packed_row: torch.Tensor, scales_row: torch.Tensor, zeros_row: torch.Tensor | None,
                 x: torch.Tensor, group_size: int) -> float:
    ### BEGIN SOLUTION
    scales = scales_row.tolist()
    zeros = [8] * len(scales) if zeros_row is None else zeros_row.tolist()
    xs = x.tolist()
    total = 0.0
    for j, byte in enumerate(packed_row.tolist()):
        for column, code in ((2 * j, byte & 0x0F), (2 * j + 1, byte >> 4)):
            group = column // group_size
            total += (code - zeros[group]) * scales[group] * xs[column]
    return total
    ### END SOLUTION


# %% ex06b.2
import torch

from labkit.quant import Scheme, dequantize, quantize


def awq_search(weight: torch.Tensor, x: torch.Tensor, scheme: Scheme, grid: int = 20) -> tuple[torch.Tensor, float]:
    ### BEGIN SOLUTION
    rows = x.reshape(-1, x.shape[-1]).float()
    weight = weight.float()
    mean_abs = rows.abs().mean(0)
    exact = rows @ weight.T
    best = None
    for k in range(grid + 1):
        alpha = k / grid
        s = mean_abs ** alpha
        s = s / (s.max() * s.min()).sqrt()
        w_q = dequantize(*quantize(weight * s, scheme))
        error = (exact - (rows / s) @ w_q.T).norm().item()
        if best is None or error < best[0]:
            best = (error, s, alpha)
    return best[1], best[2]
    ### END SOLUTION


# %% ex06b.3
import torch


def gptq_columns(weight: torch.Tensor, u: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bits: int) -> torch.Tensor:
    ### BEGIN SOLUTION
    w = weight.clone().float()
    codes = torch.empty(w.shape, dtype=torch.uint8)
    for i in range(w.shape[1]):
        q = (torch.round(w[:, i] / scale) + zero).clamp(0, 2 ** bits - 1)
        codes[:, i] = q.to(torch.uint8)
        err = (w[:, i] - (q - zero) * scale) / u[i, i]
        w[:, i + 1:] -= err[:, None] * u[i, i + 1:]
    return codes
    ### END SOLUTION
