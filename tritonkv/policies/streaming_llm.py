"""StreamingLLM (``docs/algorithms.md`` §1.3): the first ``sink`` tokens (attention sinks)
and the most recent ``k − sink``. No kernel of its own: everything kept is protected, so the shared
select copies the protected rows directly (one launch, ``PROTECTED_ONLY``: no ranking, the scores
are never read, so ``compress()`` does not even fill them); ``score()`` gives constant zeros."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..kernels._common import check_kv_tensor, use_triton
from .base import Policy, register_policy


@register_policy
@dataclasses.dataclass
class StreamingLLM(Policy):
    """StreamingLLM: ``sink`` first tokens (default 4) plus a recent window of ``budget − sink``.
    The window follows the budget, so ``window`` must stay 0. Nothing is read but the shapes, so
    non-finite keys/values change nothing (they are copied as they are)."""

    name: ClassVar[str] = "streaming_llm"

    sink: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.window != 0:
            raise ValueError(f"window must be 0: StreamingLLM's window is budget - sink, got {self.window!r}")

    def protected(self, n: int, budget: int) -> tuple[int, int]:
        """``(min(sink, n), budget − sink)``, the window clipped to [0, n − sink]."""
        sink = min(self.sink, n)
        return sink, max(0, min(budget - sink, n - sink))

    def score(self, keys: torch.Tensor, values: torch.Tensor, **inputs) -> torch.Tensor:
        """Constant fp32 zeros ``[B, H_kv, N]`` (selection is decided by ``protected`` alone)."""
        check_kv_tensor("keys", keys)
        return torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)

    def score_and_hist0(self, keys: torch.Tensor, values: torch.Tensor, *, sink: int, window: int, **inputs):
        """For a select that keeps only protected tokens (``compress()``'s dense path): the kernels
        never read the scores, so they are left unwritten there (no device fill); zeros where the
        PyTorch body runs."""
        check_kv_tensor("keys", keys)
        if not use_triton(keys):
            return self.score(keys, values), None
        return torch.empty(keys.shape[:3], dtype=torch.float32, device=keys.device), None
