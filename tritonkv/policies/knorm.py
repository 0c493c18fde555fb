"""Knorm (Devoto et al.; ``docs/algorithms.md`` §1.1): keep the keys of smallest L2 norm.
Kernel in ``kernels/knorm.py``."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..kernels.knorm import knorm_scores
from ..kernels.select import protect_for
from .base import Policy, register_policy


@register_policy
@dataclasses.dataclass
class Knorm(Policy):
    """Knorm: score ``−‖k_i‖₂`` (fp32). No sink and no window by default; both are accepted.

    Devoto et al. leave the first two layers uncompressed; that is a per-layer decision for the
    caller (compress only the layers you want), not a setting of the score.

    Non-finite keys: a key holding NaN scores NaN, one holding ±inf scores −inf; both rank lowest
    (evicted first; among equal scores the lower index is kept). Values are copied, never read."""

    name: ClassVar[str] = "knorm"

    def score(self, keys: torch.Tensor, values: torch.Tensor, **inputs) -> torch.Tensor:
        """fp32 ``[B, H_kv, N]`` = −‖k_i‖₂ (≤ 0). Given the ``budget`` (as ``compress()`` does), the
        kernel also counts the select's first pass for this budget's protected tokens."""
        return knorm_scores(keys, protect=protect_for(self, keys, inputs.get("budget")))
