"""StreamingLLM (``docs/algorithms.md`` §1.3): the first ``sink`` tokens (attention sinks)
and the most recent ``k − sink``. No kernel of its own: in a dense ``compress()`` everything kept is
protected, so the shared select copies the protected rows directly (one launch, ``PROTECTED_ONLY``:
no ranking, the scores are never read, so ``compress_dense`` does not even fill them); ``score()``
gives constant zeros, which an allocation's per-head budgets (``Fixed``'s may exceed sink + window)
rank by index."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..kernels._common import check_kv_tensor, use_triton
from .base import Policy, register_policy


@register_policy
@dataclasses.dataclass(kw_only=True)
class StreamingLLM(Policy):
    """StreamingLLM: ``sink`` first tokens (default 4) plus a recent window of ``budget − sink``.
    The window follows the budget, so ``window`` must stay 0. Nothing is read but the shapes, so
    non-finite keys/values change nothing (they are copied as they are)."""

    name: ClassVar[str] = "streaming_llm"
    reads_values: ClassVar[bool] = False

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

    def compress_dense(self, keys: torch.Tensor, values: torch.Tensor, k: int, *, sink: int, window: int,
                       **inputs):
        """``compress()``'s dense path, one budget ``k`` for every head: every kept token is protected
        (sink + window = k), so the select's kernels never read the scores, which are left unwritten
        (no device fill; zeros where the PyTorch body runs). ``(keys, values, indices)``."""
        check_kv_tensor("keys", keys)
        scores = torch.empty(keys.shape[:3], dtype=torch.float32, device=keys.device) if use_triton(keys) \
            else self.score(keys, values)
        kout, vout, idx, _ = self.select(scores, k, keys, values, sink=sink, window=window, k_max=k, budget=k,
                                         **inputs)
        return kout, vout, idx
