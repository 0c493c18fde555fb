"""TOVA: the last query's attention (``docs/algorithms.md`` §1.4): window-attention scores
with W = 1 and no pooling; the last token is protected."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from .base import register_policy
from .snapkv import WindowAttentionPolicy


@register_policy
@dataclasses.dataclass(kw_only=True)
class TOVA(WindowAttentionPolicy):
    """TOVA: the last query's attention over the keys. ``head_reduce="group"`` (default, alias of
    ``"mean"``: the mean over each KV head's query group, the KeyDiff paper's GQA treatment) or
    ``"layer"`` (the mean over all query heads, one ranking shared by every KV head, as TOVA and
    kvpress)."""

    name: ClassVar[str] = "tova"

    window: int = 1
    kernel_size: int = 1
    head_reduce: str = "group"
