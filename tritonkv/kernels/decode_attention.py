"""Split-K grouped-query decode attention over a ragged (or padded) KV cache.

One query token per (batch row, query head) attends to the kept tokens of its KV head. The cache
is either

* ragged (``tritonkv.RaggedKV``): flat ``K, V [T_cap, D]``, row ``r = b·H_kv + h`` owning
  ``[row_start[r], row_start[r] + length[r])``; or
* dense/padded: ``K, V [B, H_kv, cap, D]`` (any strides, last dim unit-stride) with optional
  ``lengths`` — the equal-capacity special case, served by the same kernel with row start 0 and
  the row's base pointer from the batch/head strides.

With ``softcap`` (Gemma 2's logit softcapping) each scaled logit s becomes ``softcap · tanh(s / softcap)``
before the softmax: a ``SOFTCAP`` variant of the split kernel (the merge is unchanged).

Two launches (``docs/architecture.md``, "Kernels"):

1. grid ``(S, R)``: program ``(s, r)`` takes the FIXED token range ``[s·SPLIT, (s+1)·SPLIT)`` of row
   r, so rows of very different lengths get balanced work; a split past the row's length exits at
   once. It loads the G query heads of KV head r together (padded to 16 for ``tl.dot`` on the
   GPU), streams its tokens in ``BLOCK_N`` tiles with an online softmax (base 2) and writes the
   normalised partial output ``[R, S, G, D]`` and its log-sum-exp ``[R, S, G]``. Two pipeline
   stages (one K/V tile in flight): 38 KB of shared memory at D = 128, 5 CTAs per H100 SM;
2. grid ``(D / BLOCK_D, R·G / HB)``: each program merges, for HB query heads and BLOCK_D channels
   (on the GPU one head and 32 channels: R·G·D/32 programs), the partials of the row's non-empty
   splits, BLOCK_S splits at a time (a tree sum within a step, an online rescaling between steps;
   the split count is re-derived from ``length``, so nothing is read back on the host). A row of
   length 0 gives zeros and an LSE of -inf, never NaN.

``S`` (the split count) is a static int: ``ceil(max_capacity / SPLIT)`` from a capacity the
caller knows (the padded cap, or ``RaggedKV.max_capacity``), never from the lengths' values.
``S`` and ``SPLIT`` are runtime kernel arguments that Triton does not specialise
(``do_not_specialize``) and the GPU block sizes do not depend on them, so a cache of a new size
(a new split size or count) launches the kernels already compiled.

On the CPU (outside the Triton interpreter) the same op runs ``_decode_torch``: rows padded to a
static length with a length mask (ragged rows gathered through a static index), fp32 matmuls per
KV head for its G query heads, the same zeros / -inf for empty rows and the same natural-log LSE.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (INTERPRET, LOG2E, check_device, check_int, check_kv_tensor, check_positive_float, launch,
                      next_pow2, on_host, pdl_wait, triton_op, use_triton)


# S and SPLIT change with the cache's size: runtime values, never specialised (no "=1" constant, no
# divisibility variant), so a new length bucket reuses the compiled kernels; block sizes stay constexpr
@triton.jit(do_not_specialize=["S", "SPLIT"])
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, start_ptr, len_ptr, po_ptr, plse_ptr,
                         H, G, D, S, SPLIT, sqb, sqh, skb, skh, skn, svb, svh, svn, qk_scale, cap_scale,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         GP: tl.constexpr, HAS_START: tl.constexpr, NATIVE_DOT: tl.constexpr, SOFTCAP: tl.constexpr,
                         PDL: tl.constexpr):
    """Stage 1: one (split, row) -> partial O [G, D] and LSE (base 2) [G]. ``SOFTCAP``: the logits are
    ``cap_scale · tanh(qk_scale · q·k)`` (``qk_scale = scale / softcap``, ``cap_scale = softcap · log2 e``), else
    ``qk_scale · q·k`` (``qk_scale = scale · log2 e``)."""
    pdl_wait(PDL)
    qk_scale = tl.cast(qk_scale, tl.float32)  # torch.compile passes Python floats as fp64: keep the arithmetic fp32
    cap_scale = tl.cast(cap_scale, tl.float32)
    s = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    length = tl.load(len_ptr + r).to(tl.int64)
    lo = s * SPLIT
    if lo < length:
        hi = tl.minimum(lo + SPLIT, length)
        if HAS_START:
            start = tl.load(start_ptr + r)
        else:
            start = tl.zeros([], dtype=tl.int64)
        b = r // H
        h = r % H
        g = tl.arange(0, GP)
        d = tl.arange(0, BLOCK_D)
        gmask = g < G
        dmask = d < D
        q = tl.load(q_ptr + b * sqb + (h * G + g.to(tl.int64))[:, None] * sqh + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        if not NATIVE_DOT:
            q = q.to(tl.float32)
        k_row = k_ptr + b * skb + h * skh
        v_row = v_ptr + b * svb + h * svh
        m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, BLOCK_D], dtype=tl.float32)
        for t0 in range(lo, hi, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            tmask = t < hi
            tok = start + t
            kvmask = tmask[:, None] & dmask[None, :]
            k = tl.load(k_row + tok[:, None] * skn + d[None, :], mask=kvmask, other=0.0)
            v = tl.load(v_row + tok[:, None] * svn + d[None, :], mask=kvmask, other=0.0)
            if NATIVE_DOT:  # fp16/bf16 operands, fp32 accumulation (GPU only)
                qk = tl.dot(q, tl.trans(k))
            else:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            qk = qk * qk_scale
            if SOFTCAP:  # tanh(x) = 2 / (1 + e^(-2x)) - 1: saturates to +-1, never NaN
                qk = (2.0 / (1.0 + tl.exp2(qk * (-2.0 * 1.4426950408889634))) - 1.0) * cap_scale
            qk = tl.where(tmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # every logit so far -inf (a -inf key): weights 0
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(qk - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if NATIVE_DOT:
                pv = tl.dot(p.to(v.dtype), v)
            else:
                pv = tl.dot(p, v, input_precision="ieee")
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        # a split whose logits are all -inf: weight 0 in the merge (o 0, lse -inf), not 0/0; a NaN passes through
        part = (r * S + s) * G + g.to(tl.int64)
        none = l_i == 0.0
        tl.store(po_ptr + part[:, None] * D + d[None, :], tl.where(none[:, None], 0.0, acc / l_i[:, None]),
                 mask=gmask[:, None] & dmask[None, :])
        tl.store(plse_ptr + part, tl.where(none, float("-inf"), m_i + tl.log2(l_i)), mask=gmask)


@triton.jit(do_not_specialize=["S", "SPLIT"])
def _decode_merge_kernel(po_ptr, plse_ptr, len_ptr, o_ptr, lse_ptr, G, D, S, SPLIT, NH,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HB: tl.constexpr, PDL: tl.constexpr):
    """Stage 2: program ``(c, i)`` merges, for the HB query heads ``j = i·HB + [0, HB)`` (global
    index ``j = r·G + g`` over ``NH = R·G``) and the channels ``[c·BLOCK_D, (c+1)·BLOCK_D)``, the
    non-empty splits of row ``r = j // G`` into O and the LSE (natural log). Splits are taken BLOCK_S
    at a time (a tree reduction per chunk, an online rescaling across chunks); their count is
    re-derived from ``length``. A row of length 0 gives zeros and -inf; a row whose logits hold a NaN or +inf (a
    non-finite key) gives NaN, as softmax attention does, never the zeros of an empty row."""
    pdl_wait(PDL)
    c = tl.program_id(0)
    j = tl.program_id(1).to(tl.int64) * HB + tl.arange(0, HB)
    jmask = j < NH
    r = j // G
    g = j % G
    length = tl.load(len_ptr + r, mask=jmask, other=0).to(tl.int64)
    n_split = tl.minimum((length + SPLIT - 1) // SPLIT, S)  # [HB]; 0 for masked heads
    n_max = tl.max(n_split, 0)
    d = c * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    sl = tl.arange(0, BLOCK_S)
    m = tl.full([HB], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([HB], dtype=tl.float32)
    acc = tl.zeros([HB, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_max, BLOCK_S):
        s = s0 + sl
        smask = s[None, :] < n_split[:, None]  # [HB, BLOCK_S]
        part = (r[:, None] * S + s[None, :]) * G + g[:, None]
        lse = tl.load(plse_ptr + part, mask=smask, other=float("-inf"))
        o = tl.load(po_ptr + part[:, :, None] * D + d[None, None, :],
                    mask=smask[:, :, None] & dmask[None, None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a head with no split yet: weights 0, not NaN
        alpha = tl.exp2(m - m_ref)
        w = tl.exp2(lse - m_ref[:, None])  # [HB, BLOCK_S], 0 for masked splits
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
        l_sum = l_sum * alpha + tl.sum(w, 1)
        m = m_new
    nonempty = n_split > 0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_sum, 1.0)[:, None], 0.0)
    tl.store(o_ptr + j[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=jmask[:, None] & dmask[None, :])
    if c == 0:
        lse_out = tl.where(nonempty, (m + tl.log2(tl.where(nonempty, l_sum, 1.0))) * 0.6931471805599453,
                           float("-inf"))
        tl.store(lse_ptr + j, lse_out, mask=jmask)


def merge_blocks(S: int, G: int, D: int):
    """``(BLOCK_S, BLOCK_D, HB, num_warps)`` of the merge. On the GPU they are fixed (a new split
    count ``S`` compiles nothing new): one query head and 32 channels per program, 64 splits per
    step, so R·G·D/32 programs share the merge. Under the interpreter (~0.5 ms per program) the
    fewest programs: every head of a group and all channels at once."""
    if INTERPRET:
        return min(next_pow2(S), 64), next_pow2(D), next_pow2(G), 4
    return 64, 32, 1, 2


def plan(max_capacity: int, total_tokens: int, split_tokens: Optional[int] = None, D: int = 128):
    """Static launch plan ``(SPLIT, BLOCK_N, S)`` from static ints only.

    ``SPLIT`` tokens per split (fixed for every row); ``S = ceil(max_capacity / SPLIT)`` splits per
    row. On the GPU the default aims at ~4 programs per SM over the whole cache (``total_tokens``),
    clamped to [BLOCK_N, 1024]; under the interpreter one split per row (fewest programs).
    """
    block_n = 64 if D <= 128 else 32
    if INTERPRET:
        block_n = min(256, max(16, next_pow2(max_capacity)))
    if split_tokens is None:
        if INTERPRET:
            split = min(max(16, next_pow2(max_capacity)), 4096)
        else:
            split = min(max(next_pow2(-(-total_tokens // (4 * 132))), block_n), 1024)
    else:
        if isinstance(split_tokens, bool) or not isinstance(split_tokens, int) or split_tokens < 1:
            raise ValueError(f"split_tokens must be a positive int, got {split_tokens!r}")
        split = split_tokens
    block_n = min(block_n, max(16, next_pow2(split)))
    return split, block_n, max(1, -(-max(max_capacity, 0) // split))


@triton_op("tritonkv::decode_attention", mutates_args={})
def decode_attention_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row_start: torch.Tensor,
                        lengths: torch.Tensor, scale: float, num_kv_heads: int, max_splits: int,
                        split_tokens: int, block_n: int, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw op. ``q [B, H_q, 1, D]``; ragged ``keys/values [T, D]`` with ``row_start`` int64 [>= R],
    or dense ``[B, H_kv, cap, D]`` with an empty ``row_start``; ``lengths`` int32 [R].

    Returns ``(out [B, H_q, 1, D] in q's dtype, lse fp32 [B, H_q])`` (natural-log LSE, -inf for
    empty rows). ``softcap`` > 0: logits ``softcap · tanh(scale · q·k / softcap)`` (0: none). CPU tensors run
    ``_decode_torch`` (outside the Triton interpreter).
    """
    if not use_triton(q):
        return _decode_torch(q, keys, values, row_start, lengths, scale, num_kv_heads, max_splits * split_tokens,
                             softcap)
    B, Hq, _, D = q.shape
    H = num_kv_heads
    G = Hq // H
    R = B * H
    S = max_splits
    dev = q.device
    out = torch.empty((B, Hq, 1, D), dtype=q.dtype, device=dev)
    lse = torch.empty((B, Hq), dtype=torch.float32, device=dev)
    part_o = torch.empty((R, S, G, D), dtype=torch.float32, device=dev)
    part_lse = torch.empty((R, S, G), dtype=torch.float32, device=dev)
    has_start = row_start.numel() > 0
    if has_start:
        kstr = (0, 0, keys.stride(0))
        vstr = (0, 0, values.stride(0))
    else:
        kstr = (keys.stride(0), keys.stride(1), keys.stride(2))
        vstr = (values.stride(0), values.stride(1), values.stride(2))
    native = (not INTERPRET) and q.dtype != torch.float32
    GP = next_pow2(G) if INTERPRET else max(16, next_pow2(G))
    BLOCK_D = next_pow2(D) if INTERPRET else max(16, next_pow2(D))
    if R > 0:
        # 2 stages: one K/V tile in flight while the current one is used (3 stages take 70 KB of
        # shared memory at D = 128: 3 CTAs/SM on an H100; 2 stages: 38 KB, 5 CTAs/SM)
        launch(_decode_split_kernel, (S, R), q, keys, values, row_start, lengths, part_o, part_lse,
               H, G, D, S, split_tokens, q.stride(0), q.stride(1), *kstr, *vstr,
               scale / softcap if softcap else scale * LOG2E, softcap * LOG2E,
               BLOCK_N=block_n, BLOCK_D=BLOCK_D, GP=GP, HAS_START=has_start, NATIVE_DOT=native, SOFTCAP=softcap > 0,
               num_warps=4, num_stages=2)
        BLOCK_S, BLOCK_DM, HB, warps = merge_blocks(S, G, D)
        NH = R * G
        launch(_decode_merge_kernel, (triton.cdiv(D, BLOCK_DM), triton.cdiv(NH, HB)), part_o, part_lse, lengths,
               out, lse, G, D, S, split_tokens, NH, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_DM, HB=HB, num_warps=warps)
    return out, lse


def _zero_invalid(v, valid, fresh: bool):
    """``v`` ``[B, H, L, D]`` in fp32 with the slots ``valid`` ``[B, H, 1, L]`` marks False zeroed (whatever they
    hold must not reach the output: 0 · NaN is NaN). Eagerly, the invalid rows are filled in place (on a copy
    unless ``fresh``): several times faster on the CPU than a ``where`` broadcast over D."""
    if not on_host(v):  # traced, meta or fake tensors: no data-dependent shapes
        return torch.where(valid.transpose(-1, -2), v.float(), 0.0)
    v = (v.float() if fresh or v.dtype != torch.float32 else v.clone()).contiguous()
    bad = (~valid).reshape(-1).nonzero().squeeze(1)
    v.view(-1, v.shape[-1]).index_fill_(0, bad, 0.0)
    return v


def _decode_torch(q, keys, values, row_start, lengths, scale: float, H: int, limit: int, softcap: float = 0.0):
    """``decode_attention_op`` in PyTorch: every row padded to the static ``L = min(limit, cap)``
    tokens (``limit`` = splits x split tokens, the most the kernels read; ``cap`` the dense capacity or
    the ragged storage size), ragged rows gathered through the static ``[R, L]`` index
    ``row_start[r] + j``, tokens ``j >= length[r]`` masked (their logits -inf, their values 0, so
    whatever the slack holds never leaks in). Then one fp32 matmul per row for the ``[G, L]`` logits of
    the row's G query heads (no repeat_kv), a softmax and a matmul with V. Empty rows give zeros and an
    LSE of -inf; a NaN or +inf logit gives NaN, as softmax attention does; the LSE is natural-log, as the merge
    kernel writes it."""
    B, Hq, _, D = q.shape
    G, R = Hq // H, B * H
    ragged = row_start.numel() > 0
    L = min(limit, keys.shape[0] if ragged else keys.shape[2])
    dev = q.device
    if L == 0 or R == 0:
        return torch.zeros_like(q), torch.full((B, Hq), float("-inf"), device=dev)
    j = torch.arange(L, device=dev)
    valid = (j < lengths[:, None]).view(B, H, 1, L)
    if ragged:  # index_select: a plain row gather, several times faster on the CPU than indexing with a 2-D index
        idx = (row_start[:R, None] + j).clamp(0, keys.shape[0] - 1).view(-1)
        k, v = keys.index_select(0, idx).view(B, H, L, D), values.index_select(0, idx).view(B, H, L, D)
    else:
        k, v = keys[:, :, :L], values[:, :, :L]
    logits = torch.matmul(q.reshape(B, H, G, D).float(), k.float().transpose(-1, -2)) * scale  # [B, H, G, L]
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = torch.where(valid, logits, float("-inf"))
    m = logits.amax(-1, keepdim=True)
    p = torch.exp2((logits - torch.where(m == float("-inf"), 0.0, m)).mul_(LOG2E))  # exp2: see _common.LOG2E
    l_sum = p.sum(-1, keepdim=True)
    o = torch.matmul(p, _zero_invalid(v, valid, ragged))  # [B, H, G, D]
    nonempty = (lengths > 0).view(B, H, 1, 1)
    o = torch.where(nonempty, o / torch.where(nonempty, l_sum, 1.0), 0.0)
    lse = torch.where(nonempty, m + torch.log(torch.where(nonempty, l_sum, 1.0)), float("-inf"))
    return o.to(q.dtype).view(B, Hq, 1, D), lse.view(B, Hq)


# ------------------------------------------------------------------------------------------------
# Python wrappers


def _check_q(q, D: Optional[int], H: int, B: Optional[int]):
    check_kv_tensor("q", q)
    if q.shape[2] != 1:
        raise ValueError(f"q must be one decode token per head, [B, H_q, 1, D]; got shape {tuple(q.shape)}")
    if q.shape[1] % H != 0:
        raise ValueError(f"q: H_q = {q.shape[1]} must be a multiple of the {H} KV heads")
    if D is not None and q.shape[3] != D:
        raise ValueError(f"q: head dim {q.shape[3]} differs from the cache's {D}")
    if B is not None and q.shape[0] != B:
        raise ValueError(f"q: batch {q.shape[0]} differs from the cache's {B}")


def _lengths_tensor(lengths, B: int, H: int, cap: int, device) -> torch.Tensor:
    if lengths is None:
        return torch.full((B * H,), cap, dtype=torch.int32, device=device)
    if not isinstance(lengths, torch.Tensor) or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise TypeError("lengths must be an integer tensor of shape [B], [B, H_kv] or [B*H_kv]")
    if lengths.shape in ((B,), (B, 1)):
        lengths = lengths.reshape(B, 1).expand(B, H)
    elif lengths.numel() != B * H:
        raise ValueError(f"lengths must have shape [B]={B}, [B, H_kv]=({B}, {H}) or [B*H_kv], got {tuple(lengths.shape)}")
    check_device("lengths", lengths, device, "q", cpu_ok=True)
    if on_host(lengths) and lengths.numel() and not bool(((lengths >= 0) & (lengths <= cap)).all()):
        raise ValueError(f"lengths must lie in [0, cap = {cap}], got min {int(lengths.min())}, "
                         f"max {int(lengths.max())}")
    # values on the device are never read back: they are clamped to [0, cap]
    return lengths.reshape(B * H).to(device=device, dtype=torch.int32).clamp(0, cap).contiguous()


def decode_attention(q: torch.Tensor, kv, lengths: Optional[torch.Tensor] = None, *, scale: Optional[float] = None,
                     split_tokens: Optional[int] = None, return_lse: bool = False, softcap: Optional[float] = None):
    """Attention of one decode token per head over a compressed cache.

    Args:
        q: ``[B, H_q, 1, D]`` queries (RoPE applied), ``H_q = G·H_kv``; query head ``j`` reads KV
            head ``j // G``.
        kv: a ``tritonkv.RaggedKV``, or a ``(keys, values)`` pair of dense ``[B, H_kv, cap, D]``.
        lengths: dense caches only: valid tokens per row, ``[B]`` or ``[B, H_kv]`` (default ``cap``).
        scale: softmax scale (default ``1/sqrt(D)``).
        split_tokens: tokens per split (default from the cache's static size).
        return_lse: also return the natural-log LSE ``fp32 [B, H_q]`` (-inf for empty rows), to
            merge with attention over other tokens.
        softcap: logit softcapping (Gemma 2's ``attn_logit_softcapping``): each scaled logit s becomes
            ``softcap · tanh(s / softcap)`` before the softmax (default: none).

    Returns ``out [B, H_q, 1, D]`` in q's dtype (zeros for rows of length 0), and the LSE if asked.
    """
    if hasattr(kv, "row_start"):  # RaggedKV: it keeps its layout invariants (RaggedKV.check) itself
        return _ragged(q, kv.keys, kv.values, kv.row_start, kv.length, kv.num_heads, kv.max_capacity, scale,
                       split_tokens, return_lse, clamp=False, softcap=softcap)
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise TypeError("kv must be a RaggedKV or a (keys, values) pair of [B, H_kv, cap, D] tensors")
    keys, values = kv
    check_kv_tensor("keys", keys)
    check_kv_tensor("values", values)
    if values.shape != keys.shape:
        raise ValueError(f"values must have the shape of keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    B, H, cap, D = keys.shape
    _check_q(q, D, H, B)
    _check_dtypes(q, keys, values)
    lens = _lengths_tensor(lengths, B, H, cap, q.device)
    split, block_n, S = plan(cap, B * H * cap, split_tokens, D)
    keys, values = _unit_stride(keys), _unit_stride(values)
    out, lse = decode_attention_op(_unit_stride(q), keys, values, _empty_start(q.device), lens,
                                   _scale(scale, D), H, S, split, block_n, _softcap(softcap))
    return (out, lse) if return_lse else out


def decode_attention_ragged(q, keys, values, row_start, lengths, num_kv_heads: int, max_capacity: int, *,
                            scale: Optional[float] = None, split_tokens: Optional[int] = None,
                            return_lse: bool = False, softcap: Optional[float] = None):
    """Decode attention over flat ragged rows: ``keys/values [T, D]``, row ``r = b·H_kv + h`` at
    ``[row_start[r], row_start[r] + lengths[r])``. ``max_capacity`` (static int) must bound every
    row's length: it fixes the split count without reading ``lengths``.

    Memory safety: ``row_start``/``lengths`` are checked on the host when they are there
    (``0 <= lengths <= max_capacity``, rows inside ``keys``); on the device they are clamped (rows
    start in ``[0, T]``, lengths in ``[0, min(max_capacity, T - start)]``), so no value makes the
    kernel read outside ``keys``/``values``."""
    return _ragged(q, keys, values, row_start, lengths, num_kv_heads, max_capacity, scale, split_tokens, return_lse,
                   clamp=True, softcap=softcap)


def _ragged(q, keys, values, row_start, lengths, num_kv_heads, max_capacity, scale, split_tokens, return_lse, *,
            clamp: bool, softcap: Optional[float] = None):
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
    max_capacity = check_int("max_capacity", max_capacity)
    check_kv_tensor("keys", keys, ndim=2)
    check_kv_tensor("values", values, ndim=2)
    if values.shape != keys.shape:
        raise ValueError(f"values must have the shape of keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    D = keys.shape[1]
    _check_q(q, D, num_kv_heads, None)
    _check_dtypes(q, keys, values)
    R = q.shape[0] * num_kv_heads
    if not isinstance(row_start, torch.Tensor) or row_start.dtype != torch.int64 or row_start.numel() < R:
        raise ValueError(f"row_start must be an int64 tensor with at least R = B*H_kv = {R} entries")
    if not isinstance(lengths, torch.Tensor) or lengths.numel() != R or lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be an int32 tensor of R = B*H_kv = {R} entries, got "
                         f"{getattr(lengths, 'dtype', type(lengths).__name__)} {tuple(getattr(lengths, 'shape', ()))}")
    check_device("row_start", row_start, q.device, "q")
    check_device("lengths", lengths, q.device, "q")
    T = keys.shape[0]
    start, lengths = row_start.reshape(-1)[:R], lengths.reshape(R)
    if clamp:
        if on_host(lengths) and on_host(row_start) and R:
            if not bool(((lengths >= 0) & (lengths <= max_capacity)).all()):
                raise ValueError(f"lengths must lie in [0, max_capacity = {max_capacity}], got min "
                                 f"{int(lengths.min())}, max {int(lengths.max())}")
            if not bool(((start >= 0) & (start + lengths <= T)).all()):
                raise ValueError(f"row_start: every row [row_start, row_start + length) must lie inside the "
                                 f"{T} stored tokens")
        start = start.clamp(0, T)
        lengths = torch.minimum(lengths.to(torch.int64).clamp(0, max_capacity), T - start).to(torch.int32)
    split, block_n, S = plan(max_capacity, T, split_tokens, D)
    out, lse = decode_attention_op(_unit_stride(q), _unit_stride(keys), _unit_stride(values), start.contiguous(),
                                   lengths.contiguous(), _scale(scale, D), num_kv_heads, S, split, block_n,
                                   _softcap(softcap))
    return (out, lse) if return_lse else out


def _check_dtypes(q, keys, values):
    if keys.dtype != q.dtype or values.dtype != q.dtype:
        raise TypeError(f"q, keys and values must share one dtype, got {q.dtype}, {keys.dtype}, {values.dtype}")
    if keys.device != q.device or values.device != q.device:
        raise ValueError(f"q, keys and values must be on one device, got {q.device}, {keys.device}, {values.device}")


def _scale(scale, D: int) -> float:
    return 1.0 / math.sqrt(D) if scale is None else check_positive_float("scale", scale, "the softmax scale")


def _softcap(softcap) -> float:
    """The op's ``softcap`` argument (0.0: none) from the wrappers' (None: none; else a positive finite float)."""
    return 0.0 if softcap is None else check_positive_float("softcap", softcap, "logit softcapping")


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _empty_start(device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)
