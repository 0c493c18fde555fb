"""SnapKV (window-query attention, pooled) and the settings shared by the window-attention family
(``docs/algorithms.md`` §1.4; kernel in ``kernels/window_attention.py``).

The last W queries attend to every key (causal inside the window); the softmax is reduced over the
window rows and over the G query heads of each KV head, then pooled over the positions before the
window. The W window positions are protected. ``tova``, ``h2o`` and ``surfacelogic`` are the same
policy with other defaults.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import torch

from ..kernels._common import check_kv_tensor
from ..kernels.window_attention import HEAD_REDUCE, POOLS, ROW_REDUCE, window_attention_scores
from .base import Policy, register_policy


def _positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


@dataclasses.dataclass(kw_only=True)
class WindowAttentionPolicy(Policy):
    """Settings of the window-attention family.

    * ``window`` W: the last W queries are read and the last W tokens protected;
      ``q_window`` reads a different number of queries (None = W; e.g. H2O over all queries with a
      smaller protected window). Queries beyond it are ignored, fewer are used as given.
    * ``kernel_size`` κ and ``pool`` (``"max"`` ignores the padding, ``"avg"`` counts it as zeros):
      pooling over the positions before the window; κ = 1 means none.
    * ``row_reduce``: ``"mean"`` or ``"sum"`` (H2O) over the window rows.
    * ``head_reduce``: over the G query heads of a KV head, ``"mean"`` (alias ``"group"``) or
      ``"max"``; ``"layer"`` averages all H_q heads so every KV head gets the same scores.
    * ``scale``: attention scale τ (None = 1/√D).

    Inputs: ``queries`` ``[B, H_q, W, D]`` (RoPE applied) and, optionally, ``attn_lse``
    ``[B, H_q, W]`` (natural-log softmax normalisers from the prefill attention at the same scale),
    which saves a pass over the keys.

    Non-finite inputs (``docs/contracts.md``): a key with a NaN or ±inf element is masked out of
    every window row's softmax and scores NaN (ranks lowest; with ``head_reduce="layer"`` in every
    head), so the other tokens are scored as if it were absent; a window query row with a
    non-finite element (or a non-finite given ``attn_lse``) is left out of the means. Pooling treats
    a NaN neighbour as a hole, like the padding. Values are copied, never read.
    """

    needs: ClassVar[tuple[str, ...]] = ("queries",)
    nonnegative: ClassVar[bool] = True
    reads_values: ClassVar[bool] = False  # unless a wrapper asks (``read_values``), as CriticalKV does

    window: int = 32
    kernel_size: int = 1
    pool: str = "max"
    row_reduce: str = "mean"
    head_reduce: str = "mean"
    scale: Optional[float] = None
    q_window: Optional[int] = None

    def __post_init__(self):
        super().__post_init__()
        _positive_int("window", self.window)
        _positive_int("kernel_size", self.kernel_size)
        if self.q_window is not None:
            _positive_int("q_window", self.q_window)
        if self.head_reduce == "group":
            self.head_reduce = "mean"
        for name, options in (("pool", POOLS), ("row_reduce", ROW_REDUCE), ("head_reduce", HEAD_REDUCE)):
            if getattr(self, name) not in options:
                raise ValueError(f"{name} must be one of {options}, got {getattr(self, name)!r}")
        if self.scale is not None and (isinstance(self.scale, bool) or not isinstance(self.scale, (int, float))
                                       or not 0 < self.scale < float("inf")):
            raise ValueError(f"scale must be None (1/sqrt(D)) or a positive float, got {self.scale!r}")

    def protected(self, n: int, budget: int) -> tuple[int, int]:
        """``(sink, window)``: the last W tokens, clipped to the row. A row no longer than W lies
        entirely in the window: then the most recent ``budget − sink`` tokens are protected."""
        sink = min(self.sink, n)
        window = min(self.window, n - sink)
        if n <= self.window:
            window = min(window, max(budget - sink, 0))
        return sink, window

    def score(self, keys: torch.Tensor, values: torch.Tensor, queries: Optional[torch.Tensor] = None,
              attn_lse: Optional[torch.Tensor] = None, *, read_values: bool = False, **inputs) -> torch.Tensor:
        """fp32 ``[B, H_kv, N]`` window attention (≥ 0); the window positions keep unpooled values.
        ``read_values`` (for a wrapper that reads values, CriticalKV): a token whose value has a
        non-finite element is scored like one whose key has (the kernels read the values with the keys)."""
        if queries is None:
            raise ValueError(f"policy {self.name!r} needs queries: the last window of queries [B, H_q, W, D]")
        check_kv_tensor("queries", queries)
        w = self.q_window or self.window
        if queries.shape[2] > w:
            queries = queries[:, :, -w:]
            if isinstance(attn_lse, torch.Tensor) and attn_lse.dim() == 3:
                attn_lse = attn_lse[:, :, -w:]
        if self.head_reduce == "layer" and inputs.get("process_group") is not None:
            from ..distributed import group_info, window_scores_layer_mean

            tp = group_info(inputs["process_group"])
            if tp is not None:  # the mean over every rank's heads: one collective
                return window_scores_layer_mean(keys, queries, tp, attn_lse=attn_lse, scale=self.scale,
                                                kernel_size=self.kernel_size, pool=self.pool,
                                                row_reduce=self.row_reduce, values=values if read_values else None)
        return window_attention_scores(keys, queries, attn_lse=attn_lse, scale=self.scale,
                                       kernel_size=self.kernel_size, pool=self.pool, row_reduce=self.row_reduce,
                                       head_reduce=self.head_reduce, values=values if read_values else None,
                                       protect=inputs.get("protect"))

    def score_and_hist0(self, keys: torch.Tensor, values: torch.Tensor, *, sink: int, window: int, **inputs):
        """The scores and, from the pooling kernel (when one runs), the select's first radix pass for this
        protection (None with ``forced`` tokens, which change the select's keys, or a tensor-parallel layer mean)."""
        tp_mean = self.head_reduce == "layer" and inputs.get("process_group") is not None
        if inputs.get("forced") is not None or tp_mean:
            return self.score(keys, values, **inputs), None
        out = self.score(keys, values, **inputs, protect=(sink, window))
        return out if isinstance(out, tuple) else (out, None)


@register_policy
@dataclasses.dataclass(kw_only=True)
class SnapKV(WindowAttentionPolicy):
    """SnapKV: window W = 32, max-pool κ = 7, mean over the window rows and the query group (the
    AdaKV/CriticalKV setting). SnapKV's own code and kvpress use ``pool="avg"`` (kvpress: W = 64,
    κ = 5) and pool before the group mean; here the group is reduced first."""

    name: ClassVar[str] = "snapkv"

    window: int = 32
    kernel_size: int = 7
    pool: str = "max"
