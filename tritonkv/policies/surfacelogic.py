"""SurfaceLogicKV selection (a reconstruction of its Eqs. 7–8, blank in the text;
``docs/algorithms.md`` §1.4): a head longer than its budget keeps the window plus the top
prefix tokens by window attention (mean over rows and the query group)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from .base import register_policy
from .snapkv import WindowAttentionPolicy


@register_policy
@dataclasses.dataclass(kw_only=True)
class SurfaceLogicKV(WindowAttentionPolicy):
    """SurfaceLogicKV's per-head selection: W = 32, mean window attention, no pooling by default
    (the text mentions none; HeadKV's code max-pools with κ = 7: ``kernel_size=7``). Per-head
    budgets come from the SurfaceLogicKV allocator; a head whose length is within its budget
    keeps everything."""

    name: ClassVar[str] = "surfacelogic"

    window: int = 32
    kernel_size: int = 1
    pool: str = "max"
