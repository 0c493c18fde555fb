"""``tritonkv.compress``: the front door, usable inside any custom model.

    kept = tritonkv.compress((keys, values), "keydiff", 0.25)
    kept.keys, kept.values, kept.indices          # [B, H_kv, k, D], [B, H_kv, k, D], int64 [B, H_kv, k]

With one budget for every head the result is dense (``Compressed``); with an ``allocation``
(per-head budgets) it is a ``RaggedKV`` that stores each head's kept tokens without padding.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from .kernels._common import FLOAT_DTYPES, check_kv_tensor
from .policies import get_policy


class Compressed(NamedTuple):
    """Dense result: kept keys/values ``[B, H_kv, k, D]`` and their original positions (int64)."""

    keys: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor


def resolve_budget(budget, n: int) -> int:
    """Tokens kept per (batch row, KV head): an int as is, a float f in (0, 1] as max(1, floor(f·n)).

    (kvpress's ``compression_ratio`` is the fraction *removed*: ``budget = 1 - compression_ratio``.)
    """
    if isinstance(budget, bool) or not isinstance(budget, (numbers.Integral, float)):
        raise TypeError(f"budget must be an int (tokens kept per head) or a float in (0, 1] (fraction kept), "
                        f"got {type(budget).__name__}")
    if isinstance(budget, numbers.Integral):
        if budget <= 0:
            raise ValueError(f"budget must be a positive number of tokens, got {budget}")
        return int(budget)
    if not (0.0 < budget <= 1.0) or math.isnan(budget):
        raise ValueError(f"budget as a float is the fraction of tokens kept and must lie in (0, 1], got {budget}")
    return max(1, math.floor(budget * n + 1e-6))


def _split_kv(kv):
    if isinstance(kv, (tuple, list)) and len(kv) == 2:
        keys, values = kv
    elif hasattr(kv, "keys") and hasattr(kv, "values") and isinstance(getattr(kv, "keys"), torch.Tensor):
        keys, values = kv.keys, kv.values
    else:
        raise TypeError("kv must be a (keys, values) pair of [B, H_kv, N, D] tensors")
    check_kv_tensor("keys", keys)
    check_kv_tensor("values", values)
    if values.shape != keys.shape:
        raise ValueError(f"values must have the shape of keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    if values.dtype != keys.dtype:
        raise TypeError(f"values must have the dtype of keys ({keys.dtype}), got {values.dtype}")
    if values.device != keys.device:
        raise ValueError(f"values must be on the device of keys ({keys.device}), got {values.device}")
    if keys.shape[2] == 0:
        raise ValueError("keys: the cache is empty (N = 0); there is nothing to compress")
    return keys, values


def _check_inputs(keys, inputs: dict) -> None:
    """Shape/device checks of the named extra inputs that several policies share."""
    B, H, N, D = keys.shape
    q = inputs.get("queries")
    if q is not None:
        check_kv_tensor("queries", q)
        if q.shape[0] != B or q.shape[3] != D or q.shape[1] % H != 0:
            raise ValueError(f"queries must be [B={B}, H_q (a multiple of H_kv={H}), W, D={D}], got {tuple(q.shape)}")
        if q.device != keys.device:
            raise ValueError(f"queries must be on the device of keys ({keys.device}), got {q.device}")
    w = inputs.get("o_proj")
    if w is not None:
        w = getattr(w, "weight", w)  # an nn.Linear or its weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError("o_proj must be the output projection weight W_O [D_model, H_q * D] (nn.Linear layout)")
        if w.dtype not in FLOAT_DTYPES:
            raise TypeError(f"o_proj must be float32, float16 or bfloat16, got {w.dtype}")
        width = None if q is None else q.shape[1] * D
        if (width is not None and w.shape[1] != width) or w.shape[1] == 0 or w.shape[1] % (H * D):
            want = f"H_q * D = {width}" if width is not None else f"a multiple of H_kv * D = {H * D}"
            raise ValueError(f"o_proj must be W_O [D_model, H_q * D] with {want} columns, got {tuple(w.shape)}")
        if w.device != keys.device:
            raise ValueError(f"o_proj must be on the device of keys ({keys.device}), got {w.device}")


def compress(kv, policy, budget, *, allocation=None, **inputs):
    """Evict tokens from one layer's KV cache.

    Args:
        kv: ``(keys, values)``, each ``[B, H_kv, N, D]`` (fp32/fp16/bf16, keys with RoPE applied).
        policy: a name (``"keydiff"``, ``"snapkv"``, ... — see ``tritonkv.POLICIES``) or a policy object
            such as ``tritonkv.policies.SnapKV(window=32, kernel_size=7)``.
        budget: tokens kept per (batch row, KV head) as an int, or the fraction kept as a float in
            (0, 1]. Protected tokens (the policy's sink and recent window) count inside it.
        allocation: optional allocator (a name such as ``"adakv"``/``"pyramid"`` or an allocator
            object) that spreads the same total over heads (and layers: pass ``layer=`` and
            ``num_layers=``); the result is then a ``RaggedKV``.
        **inputs: what the policy or allocator needs, named after what it is: ``queries`` (the last
            window of queries, ``[B, H_q, W, D]``), ``attn_lse``, ``o_proj`` (W_O), ``layer``, ...

    Returns:
        ``Compressed(keys, values, indices)`` with ``[B, H_kv, k, D]`` tensors and int64 original
        positions in ascending order; the input tensors themselves (and ``arange`` indices) when
        ``k >= N``. With ``allocation``: a ``tritonkv.RaggedKV``.
    """
    keys, values = _split_kv(kv)
    pol = get_policy(policy)
    B, H, N, D = keys.shape
    k = resolve_budget(budget, N)
    missing = pol.missing(inputs)
    if missing:
        raise ValueError(f"policy {pol.name!r} needs the input(s) {missing}; pass them to compress() by name")
    _check_inputs(keys, inputs)
    if allocation is None and k >= N:
        idx = torch.arange(N, device=keys.device).expand(B, H, N)
        return Compressed(keys, values, idx)
    kk = min(k, N)
    sink, window = pol.protected(N, kk)
    if sink + window > kk:
        raise ValueError(f"budget {k} is smaller than the protected tokens of {pol.name!r} "
                         f"(sink {sink} + window {window}); raise the budget or lower sink/window")
    scores = pol.score(keys, values, budget=kk, **inputs)
    if allocation is None:
        kout, vout, idx, _ = pol.select(scores, kk, keys, values, sink=sink, window=window, k_max=kk,
                                        budget=kk, **inputs)
        return Compressed(kout, vout, idx)
    return _compress_allocated(pol, allocation, scores, keys, values, kk, sink, window, inputs)


def layer_budgets(allocation, scores, budget: int, *, sink: int, window: int, **inputs) -> torch.Tensor:
    """Per-head budgets (protected tokens included), int32 ``[B, H_kv]`` on the device."""
    from .allocation import get_allocator

    alloc = get_allocator(allocation)
    missing = [n for n in getattr(alloc, "needs", ()) if inputs.get(n) is None]
    if missing:
        raise ValueError(f"allocation {getattr(alloc, 'name', alloc)!r} needs the input(s) {missing}")
    sel = alloc(scores=scores, budget=budget - sink - window, sink=sink, window=window, **inputs)
    return sel.to(torch.int32) + (sink + window)


def _compress_allocated(pol, allocation, scores, keys, values, k, sink, window, inputs):
    from .cache import RaggedKV

    budgets = layer_budgets(allocation, scores, k, sink=sink, window=window, **inputs)
    # The ragged storage is sized to what is actually kept: one read-back of two ints per
    # compression (never per decode step), so that per-head budgets free memory for real.
    total, k_max = torch.stack([budgets.sum(), budgets.max()]).tolist()
    return RaggedKV.from_policy(pol, scores, budgets, keys, values, sink=sink, window=window,
                                total=int(total), k_max=int(k_max), **inputs)
