"""H2O-style heavy hitters, one-shot (``docs/algorithms.md`` §1.4): the column sums of the
last W queries' attention (φ = Aᵀ1 over the window rows), with the window protected."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from .base import register_policy
from .snapkv import WindowAttentionPolicy


@register_policy
@dataclasses.dataclass(kw_only=True)
class H2O(WindowAttentionPolicy):
    """H2O-style: attention received from the last W = 32 queries, summed over the rows (no pooling).

    Original H2O uses every query and spends half the budget on recent tokens; ``q_window = N`` with
    ``window = k // 2`` approximates it (window positions are scored by the causal column sums)."""

    name: ClassVar[str] = "h2o"

    window: int = 32
    kernel_size: int = 1
    row_reduce: str = "sum"
