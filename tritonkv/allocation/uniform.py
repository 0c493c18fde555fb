"""Uniform allocation (docs/algorithms.md §2.1): every head keeps ``min(b, avail)`` selectable tokens."""
from __future__ import annotations

import dataclasses

import torch

from .base import Allocator, check_budget, register_allocator


def uniform_budgets(b: int, avail: int, shape=(1,), device="cpu") -> torch.Tensor:
    """int32 budgets of ``shape``, all ``min(b, avail)`` (and >= 0)."""
    check_budget(b, avail)
    return torch.full(tuple(shape), max(min(b, avail), 0), dtype=torch.int32, device=device)


@register_allocator
@dataclasses.dataclass
class Uniform(Allocator):
    """The same selectable budget for every head (reads only shapes)."""

    name = "uniform"
    tp_mode = "replicated"  # every head's budget from shapes and replicated inputs: no collective

    def host(self, ctx, **inputs):
        return max(ctx["b"], 0)

    def allocate(self, scores, ctx, **inputs):
        return uniform_budgets(ctx["b"], ctx["avail"], (ctx["B"], ctx["H"]), ctx["device"])
