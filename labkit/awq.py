"""Activation-aware weight quantization (AWQ; Lin et al., 2023): scale the salient channels up, then round.

A few input channels of a projection carry far larger activations than the rest (the outlier
features of LLM.int8() and SmoothQuant). An error e_j in the weights of input channel j costs
x_j e_j in the output, so the weights that meet large x_j are the salient ones: rounding them as
coarsely as the rest costs the most. AWQ protects them without keeping any weight at more bits,
with a scale s_j > 0 per input channel:

    y = x W^T = (x / s) (W diag(s))^T          and it is W diag(s) that is rounded

Scaled up by s_j, column j fills more of its group's range while the step, set by the group's
other weights, hardly moves: its output error (x_j / s_j) * err(s_j w_j) shrinks about s_j times.
Channels scaled down err more, where x is small. The scales come from the activations,
s = mean|x|^alpha (divided by sqrt(max s * min s): only ratios matter), and alpha is chosen on a
grid over [0, 1] (0: plain RTN) for the least output error on calibration inputs X:

    ||X W^T - (X / s) Q(W diag(s))^T||^2 = n/2 tr(dW H dW^T),   dW = W - Q(W diag(s)) / s,   H = 2 X^T X / n

(H is the Hessian GPTQ uses: the search never needs X itself). The division by s costs nothing at
run time: it is folded into what makes the projection's input, so the model computes the same
function as before until its weights are rounded:

    attn.wqkv    rms_norm(x) * g        g / s: the attention norm's weight
    mlp.gate_up  rms_norm(x) * g        g / s: the MLP norm's weight
    attn.wo      attention(q, k, v)     the v rows of wqkv / s (attention is linear in v; the query
                                        heads sharing a KV head share its scales)
    mlp.down     silu(gate) * up        the up rows of gate_up / s (linear in up)

Then every projection is rounded to nearest (``quant.quantize``); ``quant.quantize_model(...,
"awq", calibration)`` does both, and is ``quantize_model(folded, scheme)`` with ``folded`` a copy
of the model that ``scale_model`` scaled. Compare the rounded layers with ``folded``'s
(``quant.output_errors(folded, quantized, tokens)``): the original model's layers see X, the
rounded ones X / s. (The paper also searches a clipping range for each group's weights; this
module leaves that out.)
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from labkit.answers import answer_to
from labkit.model import Block, ModelConfig, Transformer
from labkit.quant import Scheme, dequantize, hessian, hooked, quantize

KINDS = ("attn.wqkv", "attn.wo", "mlp.gate_up", "mlp.down")  # a block's projections, in the order they run


def input_statistics(model: Transformer, calibration: Tensor, batch_size: int = 8) -> dict[str, tuple[Tensor, Tensor]]:
    """For each projection of the blocks, by name (``blocks.0.attn.wqkv``): the mean |x| of each
    input channel and the Hessian H = 2 X^T X / n of its inputs X on ``calibration`` ids ``[n, length]``."""
    sums: dict[str, list] = {}  # name -> [sum of |x|, sum of H weighted by rows, rows]

    def recorder(name: str):
        def record(module: nn.Module, args: tuple[Tensor]) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            total = sums.setdefault(name, [0, 0, 0])
            total[0] = total[0] + x.abs().sum(0)
            total[1] = total[1] + hessian(x) * len(x)
            total[2] += len(x)
        return record

    names = [f"blocks.{i}.{kind}" for i in range(len(model.blocks)) for kind in KINDS]
    hooks = [model.get_submodule(name).register_forward_pre_hook(recorder(name)) for name in names]
    with hooked(hooks):
        for chunk in calibration.split(batch_size):
            model(chunk)
    return {name: (abs_sum / rows, h / rows) for name, (abs_sum, h, rows) in sums.items()}


@answer_to("ex06b.2")
def output_error(weight: Tensor, w_hat: Tensor, h: Tensor, reference: Tensor | None = None) -> float:
    """||X W_hat^T - X W^T|| / ||X W^T||, from the inputs' Hessian H = 2 X^T X / n alone. ``reference``:
    ``squared_output(weight.float(), h)``, for a caller that sets many ``w_hat`` against one weight."""
    weight = weight.float()
    reference = squared_output(weight, h) if reference is None else reference
    return (squared_output(w_hat.float() - weight, h) / reference).sqrt().item()


def squared_output(weight: Tensor, h: Tensor) -> Tensor:
    """||X W^T||^2 (times 2 / n) from H = 2 X^T X / n: the sum of W H W^T's diagonal."""
    return ((weight @ h) * weight).sum()


@answer_to("ex06b.2")
def rtn_scaled(weight: Tensor, s: Tensor, scheme: Scheme) -> Tensor:
    """The weight the layer has in effect once W diag(s) is rounded to nearest and its input divided
    by s: Q(W diag(s)) / s."""
    return dequantize(*quantize(weight.float() * s, scheme)) / s


@answer_to("ex06b.2")
def awq_scales(mean_abs: Tensor, alpha: float) -> Tensor:
    """s = mean|x|^alpha, divided by sqrt(max s * min s) so that the scales straddle 1."""
    s = mean_abs.float().pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


@answer_to("ex06b.2")
def search_scales(weight: Tensor, mean_abs: Tensor, h: Tensor, scheme: Scheme, grid: int = 20
                  ) -> tuple[Tensor, float, float]:
    """AWQ's search for one layer ``[out, in]``: over alpha = 0, 1/grid, ..., 1, the scales
    ``awq_scales(mean_abs, alpha)`` whose rounded weight has the least output error on the inputs
    of Hessian ``h``. Returns the scales, their alpha and their relative output error."""
    best, reference = None, squared_output(weight.float(), h)
    for alpha in torch.linspace(0, 1, grid + 1).tolist():
        s = awq_scales(mean_abs, alpha)
        error = output_error(weight, rtn_scaled(weight, s, scheme), h, reference)
        if best is None or error < best[2]:
            best = (s, alpha, error)
    return best


def shared_by_kv_heads(mean_abs: Tensor, config: ModelConfig) -> Tensor:
    """wo's input channels ``[n_heads * head_dim]`` averaged over the query heads that read the same KV
    head: one v row feeds all of them, so they must share a scale."""
    groups = mean_abs.view(config.n_kv_heads, config.group_size, config.head_dim)
    return groups.mean(1, keepdim=True).expand_as(groups).flatten()


def fold_scales(block: Block, kind: str, s: Tensor) -> None:
    """Multiply the input columns of the projection ``kind`` by ``s`` and divide what makes its input
    by ``s`` (see the module's table), in place: the block computes the same function."""
    c = block.attn.config
    if kind == "attn.wo":  # one scale per KV channel: those of the first query head of each group
        v_rows = block.attn.wqkv.weight[(c.n_heads + c.n_kv_heads) * c.head_dim:]
        v_rows.div_(s.view(c.n_kv_heads, c.group_size, c.head_dim)[:, 0].reshape(-1, 1).to(v_rows.dtype))
    elif kind == "mlp.down":
        up_rows = block.mlp.gate_up.weight[c.d_ff:]
        up_rows.div_(s[:, None].to(up_rows.dtype))
    else:
        norm = block.attn_norm if kind == "attn.wqkv" else block.mlp_norm
        norm.weight.div_(s.to(norm.weight.dtype))
    weight = block.get_submodule(kind).weight
    weight.mul_(s.to(weight.dtype))


def scale_model(model: Transformer, calibration: Tensor, scheme: Scheme, grid: int = 20) -> dict[str, Tensor]:
    """Search AWQ's scales for every projection of the blocks and fold them in, in place: the model's
    function is unchanged, its weights still float, ready to be rounded. The inputs are those of
    the model as it is, on ``calibration`` ids ``[n, length]``. Returns the scales by projection name."""
    statistics = input_statistics(model, calibration)
    chosen = {}
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            for kind in KINDS:
                name = f"blocks.{i}.{kind}"
                mean_abs, h = statistics[name]
                if kind == "attn.wo":
                    mean_abs = shared_by_kv_heads(mean_abs, model.config)
                chosen[name], _, _ = search_scales(block.get_submodule(kind).weight, mean_abs, h, scheme, grid)
                fold_scales(block, kind, chosen[name])
    return chosen
