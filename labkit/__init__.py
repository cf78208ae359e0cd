"""labkit: LLM inference optimization, built from scratch in PyTorch and measured live.

One module per technique; the notebooks in ``notebooks/`` import them. Start with
``notebooks/00_welcome.ipynb``.
"""
import labkit.kernels.runtime  # noqa: F401  first: it chooses Triton's interpreter before anything imports triton
from labkit.bench import compare, measure
from labkit.check import check
from labkit.device import describe, get_device
from labkit.load import load

__version__ = "0.1.0"

__all__ = ["check", "compare", "describe", "get_device", "load", "measure", "__version__"]
