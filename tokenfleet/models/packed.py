"""Linear layers through oneDNN's prepacked float32 products on CPU.

PyTorch's CPU `F.linear` calls the BLAS it was built with (MKL in the wheels); oneDNN, also
inside PyTorch, multiplies by a weight reordered once into its own blocked layout. Which is
faster depends on the CPU: on an AMD EPYC (Zen 4, one thread) the packed products took
0.24 ms against 0.69 ms for a decoder layer's gate/up product on 3 rows, 2.6 against 3.7 ms
on 64 rows and 19 against 26 ms on 512, and the 49,152-row vocabulary 12.8 against 26.5 ms
(MKL in blocks) on 16 rows; so `faster` times both on the model's own weights at load. The
sums are the same up to their order (float32 rounding, ~1e-6 apart).

The op is PyTorch's own (`torch.ops.mkldnn._linear_pointwise`, what `torch.compile`'s CPU
backend calls for a frozen linear layer); it is private, hence `available()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def available() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear products."""
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] float32 CPU weight in oneDNN's layout (a new tensor; `weight` is kept)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) with `packed` = pack(weight); x is [rows, in]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An nn.Linear whose weight lives only in oneDNN's layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # A plain attribute, not a parameter or buffer: an opaque oneDNN tensor that no
        # state dict, `.to()` or optimizer should see.
        self.packed = pack(linear.weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


def best_time(f: Callable[[], object], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return min(times)


# The rows a step's products have: a decode of one stream, a few, a full batch of decodes.
PROBE_ROWS = (1, 4, 64)


def faster(weight: torch.Tensor, repeats: int = 3) -> bool:
    """Whether the packed products beat `F.linear` on this weight here, summed over
    PROBE_ROWS (each the best of `repeats`)."""
    packed = pack(weight)
    plain = packed_total = 0.0
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            x = torch.randn(rows, weight.shape[1])
            plain += best_time(lambda x=x: F.linear(x, weight), repeats)
            packed_total += best_time(lambda x=x: packed_linear(x, packed, None), repeats)
    return packed_total < plain


def pack_linears(model: nn.Module) -> None:
    """Replace every nn.Linear in `model` with a PackedLinear."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
