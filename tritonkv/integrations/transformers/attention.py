"""The ``"tritonkv"`` attention function: attention over a ``TritonKVCache`` layer in memory linear in T and S.

transformers calls ``cache.update`` and then the attention function registered in ``AttentionInterface``; the layer
reaches the attention call through transformers' own attention kwargs (``cache.update`` receives the dict the model
then spreads into the attention call and adds ``LAYER_KWARG`` to it), or, where a transformers version does not hand
that dict to ``cache.update`` (before 5.24), through the context variable ``_LAYER_UPDATED_LAST`` (eager) or the
attribute ``_TRACED_HAND_OVER.pair`` (a step traced by torch.compile). Attention is by *position*, not slot: a query
at sequence index i sees every stored token with index <= i (every kept token precedes the block being fed; the
block itself is causal), never a pad or an empty slot. Three paths, none of which builds an ``[H, T, S]``
tensor:

- the prompt's first forward (no kept prefix, no padding): causal SDPA, ``is_causal=True`` with GQA — exactly
  what the stock model runs;
- a decode step over per-head (ragged) rows: the split-K decode kernel (``decode_attention``) on CUDA; on the CPU
  ``ragged_decode_sdpa``, SDPA per row over a strided view of its slots; over dense rows on CUDA the same kernel;
- a later prefill block over a kept prefix with no pads or gaps: ``block_attention``, SDPA over query chunks
  with a lower-right causal ``[chunk, S]`` mask shared by every head (every kept token precedes the block);
- per-head rows of a layer with no pads: ``suffix_attention`` on the CPU (each row's slots alone), else
  ``held_attention``, the shared causal mask plus a per-head bias at the empty slots;
- padded rows, compiled steps: ``masked_attention``, the same by sequence position with a per-head mask, its
  chunks kept under ``MASK_ELEMENTS`` elements;
- a CPU decode step over a dense layer: SDPA with the G query heads of a KV head packed (``decode_sdpa``);
- a sliding-window layer (``sliding_window`` W, which it keeps: ``TritonKVLayer.slide``) holding a slot out of some
  query's window: ``block_attention`` with ``window=W`` (a band mask shared by every head), or with pads
  ``masked_attention`` with ``window=W``; each chunk of queries over the slots its window reaches.

After attending, the layer compresses when its schedule says so (``TritonKVLayer.after_attention``). A forward of
several prompt blocks (``prefill``'s ``forward_tokens``) is attended block by block, each block stored, attended
and compressed before the next (``TritonKVLayer.attend_blocks``).
"""
from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ...kernels._common import on_host
from ...kernels.decode_attention import decode_attention
from .storage import SENTINEL

ATTN_IMPLEMENTATION = "tritonkv"
MASK_ELEMENTS = 1 << 21  # per query chunk: mask elements (8 MB as fp32)

LAYER_KWARG = "tritonkv_layer"  # the attention kwarg carrying (layer, the keys its update returned)
# the same pair where transformers does not hand the attention kwargs to ``cache.update`` (read once, then cleared)
_LAYER_UPDATED_LAST: contextvars.ContextVar = contextvars.ContextVar("tritonkv_layer_updated_last", default=None)


class _TracedHandOver:
    """The pair of an update traced by torch.compile, for the attention call traced after it: a traced step reads
    and writes an object's attribute, where it cannot set a context variable (torch 2.11); the graph holds the
    pair, the attribute is None again after it."""
    pair = None


_TRACED_HAND_OVER = _TracedHandOver()


def hand_over(layer, keys, update_kwargs: dict) -> None:
    """Tell the attention call that follows ``cache.update`` which layer (and which returned keys) it reads:
    through the attention kwargs when transformers passes them to ``update`` (as ``kwargs=``), else through
    ``_LAYER_UPDATED_LAST`` (eager) or ``_TRACED_HAND_OVER`` (traced by torch.compile)."""
    attn_kwargs = update_kwargs.get("kwargs")
    if isinstance(attn_kwargs, dict):
        attn_kwargs[LAYER_KWARG] = (layer, keys)
        if not torch.compiler.is_compiling() and _LAYER_UPDATED_LAST.get() is not None:
            _LAYER_UPDATED_LAST.set(None)  # left by an update no attention call followed: keep nothing alive
    elif torch.compiler.is_compiling():
        _TRACED_HAND_OVER.pair = (layer, keys)
    else:
        _LAYER_UPDATED_LAST.set((layer, keys))


def drop_hand_over() -> None:
    """Forget an eager hand-over that no attention call took (an update followed by the model's own attention, or
    an error in between): a later attention call must not mistake it for its own."""
    _LAYER_UPDATED_LAST.set(None)


def _take_layer(kwargs: dict):
    """The (layer, keys) handed over by ``hand_over`` for this attention call, or None."""
    active = kwargs.pop(LAYER_KWARG, None)
    if active is None and torch.compiler.is_compiling():
        active, _TRACED_HAND_OVER.pair = _TRACED_HAND_OVER.pair, None
    elif active is None:
        active = _LAYER_UPDATED_LAST.get()
        if active is not None:
            _LAYER_UPDATED_LAST.set(None)
    return active


def _chunk(T: int, per_query: int) -> int:
    """Queries per chunk so that a chunk's mask holds at most ~``MASK_ELEMENTS`` elements (at least 16 queries)."""
    return max(1, min(T, max(16, MASK_ELEMENTS // max(1, per_query))))


class Logits(NamedTuple):
    """What a model's attention does to its logits besides scaling them (transformers' ``softcap`` and ``s_aux``
    attention kwargs): ``softcap`` (Gemma 2: each logit s becomes ``softcap · tanh(s / softcap)`` before the mask)
    and ``sinks`` (gpt-oss: one learned logit per query head, ``[H_q]``, in each softmax's denominator only)."""
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None


def _logits(kwargs: dict) -> Optional[Logits]:
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    return None if softcap is None and sinks is None else Logits(softcap, sinks)


def _head_sinks(logits: Optional[Logits], h0: int = 0, n: Optional[int] = None):
    """The sinks of query heads ``h0 .. h0 + n`` (all by default) as ``[1, n, 1, 1]``: queries laid out by head."""
    if logits is None or logits.sinks is None:
        return None
    sinks = logits.sinks if n is None else logits.sinks[h0:h0 + n]
    return sinks.view(1, -1, 1, 1)


def _packed_sinks(logits: Optional[Logits], H: int, c: int):
    """The sinks of queries packed as ``[B, H_kv, G·c, D]`` (row g·c + i: query head h·G + g) as ``[1, H_kv, G·c,
    1]``."""
    if logits is None or logits.sinks is None:
        return None
    sinks = logits.sinks.view(H, -1, 1)
    return sinks.expand(H, sinks.shape[1], c).reshape(1, H, -1, 1)


def _sdpa(q, k, v, attn_mask=None, scale=None, is_causal=False, enable_gqa=False, logits: Optional[Logits] = None,
          sinks=None):
    """``F.scaled_dot_product_attention`` of ``q`` ``[B, H, T, D]`` over ``k``/``v`` ``[B, H_kv, S, D]``; with
    ``logits`` (softcapping, sinks: ``sinks`` laid out as ``q``'s rows, ``_head_sinks``/``_packed_sinks``) the
    same written out, in fp32, in chunks of rows whose scores stay under ``MASK_ELEMENTS`` elements: the stock
    model's eager attention, which SDPA cannot express."""
    if logits is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal,
                                              enable_gqa=enable_gqa)
    B, H, T, D = q.shape
    Hk, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hk  # query head h·G + g reads KV head h: rows packed per KV head, no repeated K or V
    kf, vf = k.float().transpose(-1, -2), v.float()
    outs = []
    rows = max(1, MASK_ELEMENTS // max(1, B * H * S))
    for r0 in range(0, T, rows):
        r = min(rows, T - r0)
        n = min(S, r0 + r) if is_causal else S  # causal, top-left aligned (SDPA's): query i sees keys j <= i
        s = (q[:, :, r0:r0 + r].reshape(B, Hk, G * r, D).float() @ kf[..., :n]).view(B, H, r, n) * scale
        if logits.softcap is not None:
            s = torch.tanh(s / logits.softcap) * logits.softcap
        if is_causal:
            s = s.masked_fill(~torch.ones(r, n, dtype=torch.bool, device=q.device).tril(r0), float("-inf"))
        if attn_mask is not None:
            m = attn_mask if attn_mask.shape[-2] == 1 else attn_mask[..., r0:r0 + r, :]
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
        if sinks is not None:
            sk = sinks if sinks.shape[-2] == 1 else sinks[..., r0:r0 + r, :]
            s = torch.cat([s, sk.float().expand(B, H, r, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)
        if sinks is not None:
            p = p[..., :n]
        outs.append((p.reshape(B, Hk, G * r, n) @ vf[:, :, :n]).view(B, H, r, Dv))
    return (torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]).to(q.dtype)


def block_attention(query, key, value, scaling, masks: Optional[dict] = None, window: Optional[int] = None,
                    logits: Optional[Logits] = None):
    """Attention of a block of T queries over ``S`` slots that all hold tokens, in position order, the block's own
    T tokens last (a kept prefix, then the block): slot j is visible to query i iff ``j <= S - T + i``, the same
    for every head. Chunks of queries with a ``[chunk, S]`` mask shared by all heads; ``masks``: reuse it between
    calls (``lower_right_mask``, e.g. the layers of one forward). A sliding ``window`` (slots one per sequence
    index) also hides the slots ``j <= S - T + i - window``: chunks of about ``window / 4`` queries (at least 16)
    then read only the slots their window reaches (~1.25·window: a quarter of the products are masked). Returns
    ``[B, T, H_q, D]``."""
    B, Hq, T, D = query.shape
    S = key.shape[2]
    out = query.new_empty(B, T, Hq, value.shape[-1])
    chunk = _chunk(T, S) if window is None else min(_chunk(T, min(S, 2 * window)), max(16, window // 4))
    masks = {} if masks is None else masks  # every chunk of a full width shares one mask
    for c0 in range(0, T, chunk):
        c = min(chunk, T - c0)
        s = S - T + c0 + c  # slots up to the chunk's last query
        lo = 0 if window is None else max(0, s - c - window + 1)  # the first slot in its first query's window
        # a float mask: SDPA turns a bool one into this one (three more device ops) on every call
        mask = lower_right_mask(c, s - lo, query.dtype, query.device, masks, window)
        o = _sdpa(query[:, :, c0:c0 + c], key[:, :, lo:s], value[:, :, lo:s], attn_mask=mask, scale=scaling,
                  enable_gqa=Hq != key.shape[1], logits=logits, sinks=_head_sinks(logits))
        out[:, c0:c0 + c] = o.transpose(1, 2)
    return out


def held_suffix(pos):
    """Per batch row and head (nested lists ``[B][H_kv]``), how many slots hold a token, when those are the row's
    last slots (every ``SENTINEL`` slot before them: a padded view of per-head rows); None when some row has a
    gap after its first token, or off the CPU (the check reads values back)."""
    if not on_host(pos):
        return None
    held = pos != SENTINEL
    count = held.sum(-1)
    S = pos.shape[-1]
    if not torch.equal(held, torch.arange(S, device=pos.device) >= (S - count)[..., None]):
        return None
    return count.tolist()


def lower_right_mask(c: int, s: int, dtype, device, masks: Optional[dict] = None,
                     window: Optional[int] = None) -> torch.Tensor:
    """Float ``[c, s]``: 0 where slot j is visible to query i (``j <= s - c + i``: the c queries are the last
    tokens; with a sliding ``window`` also ``j > s - c + i - window``), -inf elsewhere. The mask depends on
    ``s - j`` alone, so the last ``s`` columns of a wider one are this one: ``masks`` (a dict the caller keeps
    between calls, e.g. for the layers of one forward) holds the widest built, one entry, and serves every call of
    the same ``c``, window, dtype and device that it covers."""
    key = (c, window, dtype, device)
    mask = None if masks is None else masks.get(key)
    if mask is None or mask.shape[1] < s:
        visible = torch.ones(c, s, dtype=torch.bool, device=device).tril(s - c)
        if window is not None:
            visible = visible.triu(s - c - window + 1)
        mask = torch.zeros(c, s, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        if masks is not None:
            masks.clear()  # one mask kept: at most MASK_ELEMENTS elements
            masks[key] = mask
    return mask[:, mask.shape[1] - s:]


def _rows_view(t, b: int, h: int, heads: int, s0: int, s1: int):
    """``t[b:b+1, h:h+heads, s0:s1]`` of ``t`` ``[B, H, S, D]``, as one view op."""
    st = t.stride()
    return t.as_strided((1, heads, s1 - s0, t.shape[3]), st, t.storage_offset() + b * st[0] + h * st[1] + s0 * st[2])


def suffix_attention(query, key, value, lengths, scaling, masks: Optional[dict] = None,
                     logits: Optional[Logits] = None):
    """Attention of a block of T queries over rows whose tokens are each (batch row, KV head)'s last
    ``lengths[b][h]`` (>= T) slots, in position order, the block's own T tokens last (``held_suffix``): per row,
    ``block_attention`` of its G query heads over those slots alone (no per-head mask, no slot of another row's
    length; each row's SDPA over strided views, its output joined by one ``cat``). ``masks``: reuse the mask
    between calls (``lower_right_mask``). Returns ``[B, T, H_q, D]``."""
    B, Hq, T, D = query.shape
    H, S = key.shape[1], key.shape[2]
    G = Hq // H
    chunk = _chunk(T, S)
    chunks = []
    for c0 in range(0, T, chunk):
        c = min(chunk, T - c0)
        s = S - T + c0 + c  # slots up to the chunk's last query
        mask = lower_right_mask(c, s, query.dtype, query.device, masks)  # a row's: its last columns
        q = query if c == T else query[:, :, c0:c0 + c]
        rows = []
        for b in range(B):
            heads = []
            for h in range(H):
                s0 = S - lengths[b][h]
                heads.append(_sdpa(
                    _rows_view(q, b, h * G, G, 0, c), _rows_view(key, b, h, 1, s0, s), _rows_view(value, b, h, 1, s0, s),
                    attn_mask=mask[:, s0:], scale=scaling, enable_gqa=G > 1, logits=logits,
                    sinks=_head_sinks(logits, h * G, G)).transpose(1, 2))  # [1, c, G, D]
            rows.append(torch.cat(heads, dim=2))
        chunks.append(torch.cat(rows) if B > 1 else rows[0])
    return torch.cat(chunks, dim=1) if len(chunks) > 1 else chunks[0]


def held_attention(query, key, value, pos, scaling, masks: Optional[dict] = None, logits: Optional[Logits] = None):
    """``masked_attention`` of a block with no pads whose T queries' own tokens are the last T slots, every slot
    before them a kept token in position order or empty (``SENTINEL``; gaps anywhere): a query then sees the held
    slots up to its own, so its mask is the lower-right causal one (shared by every row and head, ``masks``) plus
    a per-(row, head) bias, -inf at the empty slots. One add per chunk of queries instead of comparing positions;
    no host read, so the same on a GPU (where ``held_suffix`` cannot look). Returns ``[B, T, H_q, D]``."""
    B, Hq, T, D = query.shape
    H, S = key.shape[1], key.shape[2]
    G = Hq // H
    out = query.new_empty(B, T, Hq, value.shape[-1])
    bias = torch.zeros(B, H, 1, S, dtype=query.dtype, device=query.device)
    bias.masked_fill_((pos == SENTINEL)[:, :, None], float("-inf"))
    chunk = _chunk(T, B * Hq * S)
    for c0 in range(0, T, chunk):
        c = min(chunk, T - c0)
        s = S - T + c0 + c  # slots up to the chunk's last query
        causal = lower_right_mask(c, s, query.dtype, query.device, masks).repeat(G, 1)  # rows (g, i): as q's
        q = query[:, :, c0:c0 + c].reshape(B, H, G * c, D)  # query head h*G + g reads KV head h: no repeat_kv
        o = _sdpa(q, key[:, :, :s], value[:, :, :s], attn_mask=causal + bias[..., :s], scale=scaling, logits=logits,
                  sinks=_packed_sinks(logits, H, c))
        out[:, c0:c0 + c] = o.reshape(B, Hq, c, -1).transpose(1, 2)
    return out


def masked_attention(query, key, value, pos, qpos, scaling, *, ordered: bool = True, window: Optional[int] = None,
                     logits: Optional[Logits] = None):
    """Attention of ``query`` ``[B, H_q, T, D]`` over slots ``key``/``value`` ``[B, H_kv, S, D]`` whose sequence
    indices are ``pos`` int32 ``[B, H_kv, S]``; the queries are at sequence indices ``qpos`` int ``[T]``. A query
    sees the slots with ``pos <= qpos`` (``SENTINEL`` slots: none), and with a sliding ``window`` only those with
    ``pos > qpos - window`` (transformers' sliding-window mask); a query that sees nothing (a pad) gets a finite
    row. ``ordered``: slots are in ascending position order with the T queries' own tokens last, so a chunk needs
    only the slots up to its last query; with a ``window`` they must also be one slot per sequence index (a pad's
    slot included, as a sliding-window layer keeps them), so a chunk reads only the slots its window reaches.
    Returns ``[B, T, H_q, D]``.

    The mask is per (batch row, head): chunks of queries keep it under ~``MASK_ELEMENTS`` elements (never
    ``H·T·S``)."""
    B, Hq, T, D = query.shape
    H, S = key.shape[1], key.shape[2]
    G = Hq // H
    out = query.new_empty(B, T, Hq, value.shape[-1])
    sliding = window is not None and ordered  # a chunk of c <= max(16, window) queries reads at most c + window slots
    chunk = min(_chunk(T, B * Hq * min(S, 2 * window)), max(16, window)) if sliding else _chunk(T, B * Hq * S)
    qpos = qpos.to(torch.int32)
    for c0 in range(0, T, chunk):
        c = min(chunk, T - c0)
        s = S - T + c0 + c if ordered else S
        lo = max(0, S - T + c0 - window + 1) if sliding else 0  # the chunk's first query sees no slot before it
        p, qp = pos[:, :, None, lo:s], qpos[c0:c0 + c, None]
        allowed = p <= qp  # [B, H, c, s - lo]
        if window is not None:
            allowed &= p > qp - window
        allowed = allowed | ~allowed.any(-1, keepdim=True)
        q = query[:, :, c0:c0 + c].reshape(B, H, G * c, D)  # query head h*G + g reads KV head h: no repeat_kv
        mask = allowed[:, :, None].expand(B, H, G, c, s - lo).reshape(B, H, G * c, s - lo)
        o = _sdpa(q, key[:, :, lo:s], value[:, :, lo:s], attn_mask=mask, scale=scaling, logits=logits,
                  sinks=_packed_sinks(logits, H, c))
        out[:, c0:c0 + c] = o.reshape(B, Hq, c, -1).transpose(1, 2)  # CUDA SDPA may return a [B, M, H, D] layout
    return out


def causal_attention(query, key, value, scaling, logits: Optional[Logits] = None):
    """Plain causal attention of a block over itself (the prompt's first forward): ``[B, T, H_q, D]``."""
    out = _sdpa(query, key, value, is_causal=query.shape[2] > 1, scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1], logits=logits, sinks=_head_sinks(logits))
    return out.transpose(1, 2).contiguous()


def decode_sdpa(query, key, value, scaling, logits: Optional[Logits] = None):
    """One query token per head over slots that all precede it (no pads, no gaps): the G query heads of a KV head
    packed as G rows, as the stock model's SDPA path does. ``[B, 1, H_q, D]``."""
    B, Hq, _, D = query.shape
    H = key.shape[1]
    out = _sdpa(query.reshape(B, H, Hq // H, D), key, value, scale=scaling, logits=logits,
                sinks=_packed_sinks(logits, H, 1))
    return out.reshape(B, 1, Hq, -1)


def ragged_decode_sdpa(query, kv, scaling, logits: Optional[Logits] = None):
    """One query token per head over per-head (ragged) rows ``kv`` (a ``RaggedKV`` on the CPU, whose tokens all
    precede the query): per row, SDPA of its G query heads packed as G rows over the row's slots, read in place
    (no padded copy, each row one strided view of the flat storage at the start and length ``kv.host_rows()``
    keeps on the host); an empty row gives zeros (as ``decode_attention``). ``[B, 1, H_q, D]``."""
    B, Hq, _, D = query.shape
    H, (K, V) = kv.num_heads, (kv.keys, kv.values)
    starts, lengths = kv.host_rows()
    outs = []
    G = Hq // H
    for r, (q, start, n) in enumerate(zip(query.reshape(B * H, 1, G, D).split(1), starts, lengths)):  # row b·H + h
        if n == 0:
            outs.append(q.new_zeros(*q.shape[:3], V.shape[1]))
            continue
        k, v = (t.as_strided((1, 1, n, t.shape[1]), (0, 0, t.stride(0), t.stride(1)), t.storage_offset()
                             + start * t.stride(0)) for t in (K, V))
        sinks = None if logits is None or logits.sinks is None else logits.sinks[r % H * G:][:G].view(1, 1, G, 1)
        outs.append(_sdpa(q, k, v, scale=scaling, logits=logits, sinks=sinks))
    return torch.cat(outs).view(B, 1, Hq, -1)


def kernel_decode(query, kv, scaling, logits: Optional[Logits] = None, lengths=None):
    """One decode query per head through the split-K kernel (``decode_attention`` over a ``RaggedKV`` or a dense
    ``(K, V)`` pair with optional ``lengths``): ``[B, 1, H_q, D]``. Softcapping is the kernel's own (``softcap``);
    attention sinks are applied to its output by its log-sum-exp: a sink logit s joins each softmax's denominator,
    so the output scales by ``1 / (1 + exp(s - lse)) = sigmoid(lse - s)`` (0 for an empty row)."""
    softcap = None if logits is None else logits.softcap
    if logits is None or logits.sinks is None:
        out = decode_attention(query, kv, lengths, scale=scaling, softcap=softcap)
    else:
        out, lse = decode_attention(query, kv, lengths, scale=scaling, return_lse=True, softcap=softcap)
        out = (out.float() * torch.sigmoid(lse - logits.sinks.float())[..., None, None]).to(out.dtype)
    return out.transpose(1, 2).contiguous()


def attention(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """``AttentionInterface`` entry ``"tritonkv"``. With a ``TritonKVCache`` it attends over the compressed
    layer and then compresses it when due; with any other cache it is plain causal attention."""
    active = _take_layer(kwargs)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    ours = active is not None and active[1] is key
    if active is not None and not ours:
        _refuse(module, "attention over keys other than the ones its cache.update returned (e.g. a latent cache "
                        "expanded per head: multi-head latent attention), which the cache cannot compress")
    if ours and value.shape[-1] != key.shape[-1]:
        _refuse(module, f"values of head dim {value.shape[-1]} beside keys of head dim {key.shape[-1]} (e.g. "
                        f"multi-head latent attention expanded per head), which the cache's policies cannot compress")
    compiling = torch.compiler.is_compiling()
    layer = active[0] if ours else None
    pending = ours and layer._pending is not None  # a forward of several prompt blocks: stored as they are attended
    if ours and not compiling:  # the tokens seen once this forward's are in
        seen = layer.seen + key.shape[2] if pending else layer.seen
    else:
        seen = key.shape[2]
    window, logits = kwargs.get("sliding_window"), _logits(kwargs)
    if not ours and getattr(module, "is_causal", True) is False:  # no cache: an encoder (a vision tower, ...)
        return _bidirectional_attention(query, key, value, attention_mask, scaling, logits), None
    check_supported(module, kwargs, seen, sliding=not ours or layer.slides)
    if not ours:
        return _plain_attention(query, key, value, attention_mask, scaling, window, logits), None
    T = query.shape[2]
    layer.module = weakref.ref(module)  # its o_proj is CriticalKV's W_O (a weak reference: copies of a cache share it)
    if window is not None and layer.slides:  # a sliding-window layer: it keeps its window (``slide``)
        layer.window = window
    if pending:  # no pads (prefill groups blocks only then)
        return layer.attend_blocks(query, scaling, logits), None
    # pads: in any multi-token forward, and in a one-token block of a row-aligned prefill (never in decode steps)
    if attention_mask is not None and not compiling and (T > 1 or layer.cache._block_ends is not None):
        layer.mark_padding(attention_mask[:, -T:].bool())
    out = layer.attend(query, key, value, scaling, logits)
    if compiling:
        layer.roll_queries(query)  # window policies: the saved queries stay current, on the device
    else:
        layer.after_attention(query)
    return out, None


SUPPORTED = ("causal softmax attention over every earlier token, at any scale, with or without logit softcapping "
             "and attention sinks (Llama, Qwen2/Qwen3, Mistral, Phi-3, Gemma 1-4, gpt-oss, GLM-4, Granite, OLMo 2, "
             "Cohere, StarCoder2, SmolLM3, ...), and sliding-window layers (Gemma 2/3, gpt-oss, Mistral v0.1, ...; "
             "with recursive LagKV only while the sequence fits the window)")


def check_supported(module, kwargs, seen: int, sliding: bool = True) -> None:
    """A NotImplementedError naming the architecture and the feature for attention the cache cannot serve exactly:
    attention that is not causal, chunked attention (Llama 4's ``chunked_attention`` layers, which only the model's
    mask describes) over more tokens than a chunk, or — where ``sliding`` is False (a recursive LagKV layer) — a
    sliding window shorter than the tokens seen (a window or a chunk that still covers every token is plain causal
    attention). Logit softcapping and attention sinks are served (``Logits``)."""
    window, chunk = kwargs.get("sliding_window"), _attention_chunk(module)
    if getattr(module, "is_causal", True) is False:  # a cache under an encoder's attention (no is_decoder=True)
        what = "bidirectional (not causal) attention over its cache"
    elif chunk is not None and seen > chunk:
        what = f"chunked attention (attention_chunk_size={chunk}: a token sees its own chunk only) over {seen} tokens"
    elif window is not None and seen > window and not sliding:  # transformers masks kv_idx <= q_idx - window
        what = f"sliding-window attention (sliding_window={window}) over {seen} tokens with recursive LagKV"
    else:
        return
    _refuse(module, f"{what}, which the 'tritonkv' attention function does not support")


def _attention_chunk(module) -> Optional[int]:
    """The attention chunk of a ``chunked_attention`` layer (its config's ``attention_chunk_size``), else None."""
    config, i = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if types is None or i is None or i >= len(types) or types[i] != "chunked_attention":
        return None
    return getattr(config, "attention_chunk_size", None)


ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")  # layer types a cache layer serves
NO_ATTENTION_LAYERS = ("moe", "mlp")  # layer types with no attention (no cache layer)


def text_config(model):
    """The config of ``model``'s decoder (a multimodal model's text config, e.g. Gemma 3's ``text_config``); a
    TypeError for what is not a loaded transformers model (a module without a config, a model id)."""
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"model must be a loaded transformers model (e.g. AutoModelForCausalLM.from_pretrained(...)), "
                        f"got {type(model).__name__}")
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def check_model(model) -> None:
    """A NotImplementedError naming the model type and the feature, before any forward, for a model whose layers a
    TritonKVCache cannot hold: layers other than softmax attention (``layer_types``: linear attention, state-space
    or convolution layers, indexed or compressed attention), keys and values shared across layers (KV sharing), or
    attention that is not causal (``use_bidirectional_attention``)."""
    config = text_config(model)
    types = getattr(config, "layer_types", None) or ()
    other = sorted({t for t in types if t not in ATTENTION_LAYERS + NO_ATTENTION_LAYERS})
    shared = "reuse" in (getattr(config, "kv_sharing_modes", None) or ()) or \
        (getattr(config, "num_kv_shared_layers", 0) or 0) > 0
    if other:
        what = f"layers other than softmax attention (layer_types {other})"
    elif shared:
        what = "keys and values shared across layers (KV sharing: a layer attends over another layer's cache)"
    elif getattr(config, "use_bidirectional_attention", None) in (True, "all"):
        what = "bidirectional (not causal) attention"
    else:
        return
    raise NotImplementedError(f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)!r}) has "
                              f"{what}, which a TritonKVCache cannot hold: tritonkv supports {SUPPORTED}")


def _refuse(module, what: str):
    """The NotImplementedError for an attention module the cache cannot serve: its class, model type and layer."""
    config = getattr(module, "config", None)
    raise NotImplementedError(
        f"{type(module).__name__} (model_type {getattr(config, 'model_type', None)!r}, layer "
        f"{getattr(module, 'layer_idx', None)}) uses {what}: it supports {SUPPORTED}")


def _plain_attention(query, key, value, attention_mask, scaling, window: Optional[int] = None,
                     logits: Optional[Logits] = None):
    """Causal attention for caches other than ours (their ``S`` slots: the last ``S`` columns, one each);
    ``attention_mask`` is the 2D padding mask (or None), ``window`` a sliding window (or None)."""
    B, T, S = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is None or bool(attention_mask[:, -S:].all()):
        if window is not None and S > window:  # some slot out of some query's window
            return block_attention(query, key, value, scaling, window=window, logits=logits)
        if T == S:
            return causal_attention(query, key, value, scaling, logits)
        return block_attention(query, key, value, scaling, logits=logits)
    pos = torch.arange(S, device=key.device, dtype=torch.int32).expand(B, key.shape[1], S)
    if attention_mask is not None:
        pos = torch.where(attention_mask[:, None, -S:].bool(), pos, SENTINEL)
    return masked_attention(query, key, value, pos, torch.arange(S - T, S, device=key.device), scaling, window=window,
                            logits=logits)


def _bidirectional_attention(query, key, value, attention_mask, scaling, logits: Optional[Logits] = None):
    """An encoder's attention with no cache (a multimodal model's vision tower, which ``use_tritonkv`` switches
    too): every query sees every key but the pads of the 2D ``attention_mask`` (or None). ``[B, T, H_q, D]``."""
    mask = None
    if attention_mask is not None and attention_mask.dim() == 2:
        mask = attention_mask[:, None, None, -key.shape[2]:].bool()
    elif attention_mask is not None:  # a mask built by the model itself: as it is
        mask = attention_mask
    out = _sdpa(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
                logits=logits, sinks=_head_sinks(logits))
    return out.transpose(1, 2).contiguous()


def _padding_mask(batch_size=None, q_length=None, kv_length=None, attention_mask=None, **kwargs):
    """``AttentionMaskInterface`` entry: hand the 2D padding mask (or None) to the attention function, which
    builds its own (chunked) mask from the cache's token positions. A mask transformers marks as more than causal
    (``allow_is_causal_skip`` False: a model's own overlay, e.g. Gemma 3's bidirectional image tokens) is checked
    first (``_check_no_future``)."""
    fn = kwargs.get("mask_function")
    if fn is not None and kwargs.get("allow_is_causal_skip") is False and not torch.compiler.is_compiling():
        positions = kwargs.get("cache_position")  # transformers before 5.24 passes the queries' positions
        T = q_length if q_length is not None else (positions.shape[0] if positions is not None else None)
        if T is not None and T > 1 and kv_length is not None:
            device = attention_mask.device if attention_mask is not None else kwargs.get("device", "cpu")
            _check_no_future(fn, batch_size or 1, T, kv_length, device, kwargs.get("config"))
    return attention_mask


def _check_no_future(fn, B: int, T: int, S: int, device, config) -> None:
    """A NotImplementedError if the mask function ``fn`` (transformers' ``(batch, head, q_idx, kv_idx) -> bool``,
    padding aside) lets a query of this forward see a later token of it (bidirectional attention among an image's
    tokens, a prefix-LM prompt): the attention function attends causally. The forward's T tokens are the mask's
    last T columns; rows in chunks of at most ~``MASK_ELEMENTS`` pairs."""
    idx = torch.arange(S - T, S, device=device)
    b, h = torch.arange(B, device=device)[:, None, None, None], torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    rows = max(1, MASK_ELEMENTS // max(1, B * T))
    for r0 in range(0, T - 1, rows):
        q = idx[r0:r0 + rows]
        kv = idx[r0 + 1:]  # only later tokens can be a future a query must not see
        sees = torch.as_tensor(fn(b, h, q[None, None, :, None], kv[None, None, None, :]), device=device)
        if bool((sees & (kv[None, :] > q[:, None])).any()):
            raise NotImplementedError(
                f"the attention mask of model_type {getattr(config, 'model_type', None)!r} lets a token see later "
                f"tokens of the prompt (bidirectional attention, e.g. among an image's tokens), which the 'tritonkv' "
                f"attention function does not support: it attends causally; use a text-only prompt")


AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _padding_mask)


@contextlib.contextmanager
def use_tritonkv(model):
    """Run ``model`` with ``attn_implementation="tritonkv"`` inside the block (restored afterwards). A model whose
    attention does not go through transformers' ``AttentionInterface`` (transformers then keeps its own attention
    and only logs a warning) is a NotImplementedError: its cache would never be compressed."""
    text_config(model)  # a TypeError for what is not a transformers model
    old = model.config._attn_implementation
    drop_hand_over()
    if old != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise NotImplementedError(
                f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', None)!r}) cannot switch to "
                f"the 'tritonkv' attention function: its attention does not go through transformers' "
                f"AttentionInterface, so a TritonKVCache would never be compressed; tritonkv supports {SUPPORTED}")
    try:
        yield model
    finally:
        if old != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(old)
