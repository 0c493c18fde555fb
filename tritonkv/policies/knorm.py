"""Knorm (Devoto et al.; ``docs/algorithms.md`` §1.1): keep the keys of smallest L2 norm.
Kernel in ``kernels/knorm.py``."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..kernels.knorm import knorm_scores
from .base import Policy, register_policy


@register_policy
@dataclasses.dataclass(kw_only=True)
class Knorm(Policy):
    """Knorm: score ``−‖k_i‖₂`` (fp32). No sink and no window by default; both are accepted.

    Devoto et al. leave the first two layers uncompressed; that is a per-layer decision for the
    caller (compress only the layers you want), not a setting of the score.

    Non-finite keys: a key holding a NaN or ±inf element scores NaN, which ranks lowest (evicted
    first; among equal scores the lower index is kept). Values are copied, never read."""

    name: ClassVar[str] = "knorm"
    reads_values: ClassVar[bool] = False

    def score(self, keys: torch.Tensor, values: torch.Tensor, **inputs) -> torch.Tensor:
        """fp32 ``[B, H_kv, N]`` = −‖k_i‖₂ (≤ 0), NaN for a key with a non-finite element."""
        return knorm_scores(keys)

    def score_and_hist0(self, keys: torch.Tensor, values: torch.Tensor, *, sink: int, window: int, **inputs):
        """The scores and, from the same kernel, the select's first radix pass for this protection
        (None with ``forced`` tokens, which change the select's keys)."""
        if inputs.get("forced") is not None:
            return self.score(keys, values, **inputs), None
        return knorm_scores(keys, protect=(sink, window))
