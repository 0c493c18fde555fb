"""KeyDiff (KeyDiff §3.2, Eqs. 7–8; ``docs/algorithms.md`` §1.2): keep the keys least
similar to the anchor (the mean unit key of the row). Kernel in ``kernels/keydiff.py``."""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from ..kernels.keydiff import ANCHORS, keydiff_scores
from .base import Policy, register_policy


@register_policy
@dataclasses.dataclass(kw_only=True)
class KeyDiff(Policy):
    """KeyDiff: score ``−cos(k_i, a)`` with the anchor a over all n tokens of the row.

    * ``anchor``: ``"normalized"`` (default; mean of the unit keys, Table 15 and kvpress) or
      ``"raw"`` (mean of the keys, the §3.2 variant).
    * Sliding-window variant (Table 14): ``window_share`` ∈ [0, 1) protects the last
      ⌊window_share·k⌋ tokens of a budget of k (the paper uses 0.1 and 0.2), or ``window`` protects
      a fixed number; set at most one of them. ``sink`` (default 0) protects the first tokens.
      Protection changes only the selection: the anchor still spans every token.

    Non-finite keys: a key holding a NaN or ±inf element scores NaN (ranks lowest) and is left out of
    the anchor (a mean over the row's finite keys), so the other tokens score exactly as if it were
    absent; a row whose keys are all non-finite keeps its protected tokens, then its first by index.
    """

    name: ClassVar[str] = "keydiff"
    reads_values: ClassVar[bool] = False

    window_share: float = 0.0
    anchor: str = "normalized"

    def __post_init__(self):
        super().__post_init__()
        s = self.window_share
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 <= s < 1.0:
            raise ValueError(f"window_share must be a float in [0, 1) (fraction of the budget kept as a "
                             f"recent window), got {s!r}")
        if s > 0 and self.window > 0:
            raise ValueError(f"set window (a token count, got {self.window}) or window_share (a fraction of "
                             f"the budget, got {s}), not both")
        if self.anchor not in ANCHORS:
            raise ValueError(f"anchor must be one of {ANCHORS}, got {self.anchor!r}")

    def protected(self, n: int, budget: int) -> tuple[int, int]:
        """``(sink, window)`` with window = ``window`` or ⌊window_share·budget⌋, clipped to the row."""
        sink = min(self.sink, n)
        window = self.window or math.floor(self.window_share * budget + 1e-6)
        return sink, min(window, n - sink)

    def score(self, keys: torch.Tensor, values: torch.Tensor, **inputs) -> torch.Tensor:
        """fp32 ``[B, H_kv, N]`` = −cos(k_i, a), in [−1, 1]; NaN for a key with a non-finite element."""
        return keydiff_scores(keys, anchor=self.anchor)

    def score_and_hist0(self, keys: torch.Tensor, values: torch.Tensor, *, sink: int, window: int, **inputs):
        """The scores and, from the scoring kernels, the select's first radix pass for this
        protection (None with ``forced`` tokens, which change the select's keys)."""
        if inputs.get("forced") is not None:
            return self.score(keys, values, **inputs), None
        return keydiff_scores(keys, anchor=self.anchor, protect=(sink, window))
