"""One-row matrix products that Inductor writes itself, in place of the BLAS library's.

A decode step multiplies one row of activations by each weight matrix. Inductor leaves such a
product to the BLAS library (Intel's MKL in torch's CPU builds), like every other matrix product.
A product of one row is a walk over the weights, so it can run no faster than memory delivers
them, and the library's need not come close: on the lab's AMD Zen 5 it reads them well below the
rate of a plain sum over the same bytes (``benchmarks/row_products.py`` times both, and
Inductor's own product, on any machine; BENCHMARKS.md has the figures).

Written as a multiply and a sum, ``(x * W).sum(-1)``, the product becomes a reduction that
Inductor generates: for each output, one vectorised dot product along a row of ``W``. That loop
streams only if ``W`` is stored row by row, as ``nn.Linear`` makes it; the lab's models store
their weights transposed (``Transformer.store_weights_column_major``), the layout the library
reads fastest, and along it the generated loop would stride across rows. So the rewrite applies
only to a weight whose rows are contiguous, and a step that wants it reads copies laid out by
rows (``row_major_copies``), not the model's own weights.

- ``OneRowProducts``: a graph pass for Inductor (``post_grad_custom_post_pass``) that rewrites
  each product of a one-row input and a row-major weight. Inductor has a rewrite of its own, off
  by default (``post_grad_fusion_options["decompose_mm_pass"]``), that sums along the transposed
  weight instead, across rows: on the lab's models it made the step slower (BENCHMARKS.md).
- ``row_major_copies``: the model's projection weights, copied row by row, by parameter name.

Whether the generated loop beats the library depends on the CPU, so ``labkit.aot`` builds a
one-row step both ways and keeps the generated one only if it is faster beyond noise
(``products="faster"``).
"""
from __future__ import annotations

import torch
from torch import Tensor, fx, nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import CallFunction, KeywordArg, Match, PatternMatcherPass, register_graph_pattern

aten = torch.ops.aten
_PASS = PatternMatcherPass(pass_name="labkit_one_row_products")


def _one_row_by_rows(match: Match) -> bool:
    """A product of one row ``x [1, K]`` and ``W^T``, where ``W [N, K]`` stores its rows contiguously."""
    x, w = (match.kwargs[name].meta.get("val") for name in ("x", "w"))
    return (isinstance(x, Tensor) and isinstance(w, Tensor) and x.dim() == 2 and w.dim() == 2 and x.shape[0] == 1
            and x.dtype == w.dtype and w.is_floating_point() and w.stride() == (w.shape[1], 1))


@register_graph_pattern(CallFunction(aten.mm, KeywordArg("x"), CallFunction(aten.permute, KeywordArg("w"), [1, 0])),
                        extra_check=_one_row_by_rows, pass_dict=_PASS)
def _rewrite(match: Match, x: fx.Node, w: fx.Node) -> None:
    def product(x: Tensor, w: Tensor) -> Tensor:
        return (x.unsqueeze(1) * w.unsqueeze(0)).sum(-1)  # [1, N]: a dot product along each row of w

    match.replace_by_example(product, [x, w])
    # the input gets a buffer of its own: otherwise Inductor may fold the work that makes it (a norm,
    # a SiLU) into the product's loop, and do it again for every output
    x.meta["inductor_realize_to_strides"] = True


class OneRowProducts(CustomGraphPass):
    """The rewrite, as Inductor runs a custom pass: ``rewritten`` counts the products it has rewritten."""

    def __init__(self) -> None:
        self.rewritten = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.rewritten += _PASS.apply(graph)

    def uuid(self) -> bytes:
        """What Inductor's caches key the pass by: this file."""
        return get_hash_for_files((__file__,))


def row_major_copies(model: nn.Module) -> dict[str, Tensor]:
    """A copy of each ``nn.Linear`` weight of ``model`` laid out row by row, by the name of the
    first ``nn.Linear`` that has it (a weight shared with an embedding, say, is copied once)."""
    copies, seen = {}, set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            key = f"{name}.weight" if name else "weight"  # a model that is one Linear: its own weight
            copies[key] = module.weight.detach().clone(memory_format=torch.contiguous_format)
    return copies
