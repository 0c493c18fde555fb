"""The shared select + compact kernel: the only top-k in tritonkv.

Per row r (= b·H_kv + h) of fp32 scores, keep exactly ``k_r = min(budget[r], N, k_max)`` tokens:
the protected ones (the first ``sink``, the last ``window``, and any ``forced``) and then the
highest scores, ties to the lower index, NaN lowest, -0 == +0. Kept tokens are written in
ascending original order, with their int64 indices, and the K/V rows are gathered in the same
pass. Budgets are an int32 device tensor (or one int) that the host never reads.

Keys: NaN -> -inf, -0 -> +0, fp32 bits -> order-preserving uint32; protected -> 0xFFFFFFFF (a
genuine +inf maps to 0xFF800000, so it never displaces a protected token). The threshold t (the
k-th largest key) is found by an MSB radix select over four 8-bit digits (256-bin histograms:
cheap on every Triton, see ``docs/architecture.md``, "Kernels"). Four launches on the grid
(chunks, rows), none of them a memset, none of them spinning; every one keeps all programs busy
(the work a row's last program does alone is proportional to the candidates, never to N; on sm_90+ each is
launched while the one before runs and waits for it first, ``_common.pdl``):

1. **pass 0** (``_select_hist0_kernel``, or fused into a scoring kernel with ``hist0_of_chunk``):
   each chunk writes the 256-bin histogram of its keys' top byte to its own slot of an int32
   ``hist0 [R, 1 + C0, 256]`` with plain stores; program 0 of a row zeroes slot 0, the row's
   control block (tickets, a counter).
2. **finish** (``_select_finish_kernel``): every program sums the row's pass-0 slots (the first
   byte of t; its chunk's first scores are loaded before, in flight meanwhile), histograms the
   second byte of its chunk's keys that match it into its own slot, and
   takes a ticket (``atomic_add``). The last program of the row (last-block-done: no program waits
   on another, so it also runs under the interpreter, where programs run one after another) sums
   those slots: the top 16 bits P of t and the keys still to take. It reads no key.
3. **tail** (``_select_tail_kernel``): every program counts its chunk's keys above P, histograms
   the third byte of its candidates (keys whose top 16 bits are P) into its slot and appends them,
   each as int64 ``key << 32 | index``, to a per-row buffer (an atomic reservation per tile). The
   row's last program picks the third byte from the slots and the fourth from the candidates alone
   (by then few, except for heavy ties; read with their keys, no score read again), counts each
   chunk's candidates above and equal to t, and one ordered scan over the
   chunks gives every chunk its first output slot and the number of keys equal to t before it
   (ties at t go to the lowest indices). It writes them, t and the ties to keep, and resets the
   control block.
4. **compact** (``_select_compact_kernel``): each program recomputes its chunk's keep flags in
   ``TILE`` steps (a local cumsum from its first slot), writes the kept int64 indices, then copies
   the kept K/V rows in dense batches of ``BATCH`` rows (their indices read back; K and V loaded
   before either is stored; ``COMPACT_STAGES`` batches in flight), so the gather moves only kept rows.

When every kept token is protected (StreamingLLM) one launch copies them with nothing ranked.
``CHUNK``, ``C`` and the budget-dependent scalars are runtime arguments that Triton does not
specialise on, so a new N compiles nothing new.

On the CPU (outside the Triton interpreter) the same op runs ``_select_torch``: one exact
``torch.topk`` over int64 keys that pack the kernel's uint32 key with the reversed index (so ties go
to the lower index), a sort of the kept indices, and ``index_select``/``index_copy_`` writes, with
static shapes only (torch.compile and torch.export trace it).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._common import (INTERPRET, cdiv, check_device, check_int, check_kv_tensor, host_cache, launch, next_pow2,
                      pdl_wait, triton_op, use_triton)

NB = 256  # bins per radix pass: four 8-bit digits of the 32-bit keys


@triton.jit
def _keys_of(s, offs, N, sink, window):
    """Order-preserving uint32 keys of a tile of fp32 scores ``s`` at tokens ``offs``; the first
    ``sink`` and the last ``window`` tokens of a row of ``N`` get the maximum."""
    s = tl.where(s != s, float("-inf"), s)  # NaN ranks lowest
    s = tl.where(s == 0.0, 0.0, s)  # -0 == +0
    b = s.to(tl.uint32, bitcast=True)
    u = tl.where((b >> 31) != 0, ~b, b | 0x80000000)
    prot = (offs < sink) | (offs >= N - window)
    return tl.where(prot, 0xFFFFFFFF, u)


@triton.jit
def _load_tile(s_ptr, f_ptr, offs, mask, HAS_FORCED: tl.constexpr):
    """One tile of scores (fp32) and, with ``HAS_FORCED``, of the forced mask (else the scores again: unused)."""
    s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_FORCED:
        f = tl.load(f_ptr + offs, mask=mask, other=0)
    else:
        f = s
    return s, f


@triton.jit
def _tile_keys(s, f, offs, N, sink, window, HAS_FORCED: tl.constexpr):
    """``_keys_of`` a tile loaded by ``_load_tile``, forced tokens at the maximum too."""
    u = _keys_of(s, offs, N, sink, window)
    if HAS_FORCED:
        u = tl.where(f != 0, 0xFFFFFFFF, u)
    return u


@triton.jit
def _sortable_keys(s_ptr, f_ptr, offs, mask, N, sink, window, HAS_FORCED: tl.constexpr):
    """Order-preserving uint32 keys of one tile of scores; protected tokens get the maximum."""
    s, f = _load_tile(s_ptr, f_ptr, offs, mask, HAS_FORCED)
    return _tile_keys(s, f, offs, N, sink, window, HAS_FORCED)


@triton.jit
def _digit_hist(u, shift: tl.constexpr, match, NB: tl.constexpr):
    """256-bin histogram of the byte ``(u >> shift) & 0xFF`` of the lanes where ``match``. Callers
    pass 1-D tiles of at least one element per thread (never a replicated layout)."""
    return tl.histogram(((u >> shift) & 0xFF).to(tl.int32), NB, mask=match)


@triton.jit
def hist0_of_chunk(s_ptr, f_ptr, h0_ptr, r, c, C0, N, CHUNK, sink, window, TILE: tl.constexpr,
                   NB: tl.constexpr, HAS_FORCED: tl.constexpr):
    """Pass 0 for chunk ``c`` (tokens ``[c·CHUNK, (c+1)·CHUNK)``) of row ``r`` (int64): the histogram
    of its keys' top byte into slot ``1 + c`` of ``hist0 [R, 1 + C0, NB]``; program 0 zeroes slot 0
    (the control block the finish kernel takes its ticket from). ``s_ptr``/``f_ptr`` point at the
    row. A scoring kernel calls it after storing its chunk's scores and a ``tl.debug_barrier()``:
    it re-reads them (from L1/L2) in ``TILE``-element 1-D tiles, one key per thread or more."""
    acc = tl.zeros([NB], dtype=tl.int32)
    for t0 in range(0, CHUNK, TILE):
        j = t0 + tl.arange(0, TILE)
        offs = c * CHUNK + j
        mask = (offs < N) & (j < CHUNK)
        u = _sortable_keys(s_ptr, f_ptr, offs, mask, N, sink, window, HAS_FORCED)
        acc += _digit_hist(u, 24, mask, NB)
    row = h0_ptr + r * (C0 + 1) * NB
    bins = tl.arange(0, NB)
    tl.store(row + (c + 1) * NB + bins, acc)
    if c == 0:
        tl.store(row + bins, tl.zeros([NB], dtype=tl.int32))


@triton.jit
def _row_budget(budget_ptr, r, N, k_max, UNIFORM: tl.constexpr):
    """k_r = clamp(min(budget[r], N, k_max), 0); ``UNIFORM``: no budget tensor, k_max is the budget."""
    if UNIFORM:
        k = k_max
    else:
        k = tl.minimum(tl.load(budget_ptr + r), k_max)
    return tl.maximum(tl.minimum(k, N), 0)


@triton.jit
def _sum_slots(p_ptr, n, NB: tl.constexpr, SB: tl.constexpr):
    """Sum of ``n`` histograms of ``NB`` bins stored one after another at ``p_ptr`` (read through
    L2: other programs of the grid wrote them)."""
    bins = tl.arange(0, NB)
    acc = tl.zeros([NB], dtype=tl.int32)
    for i0 in range(0, n, SB):
        i = i0 + tl.arange(0, SB)
        acc += tl.sum(tl.load(p_ptr + i[:, None] * NB + bins[None, :], mask=(i < n)[:, None], other=0,
                              cache_modifier=".cg"), 0)
    return acc


@triton.jit
def _pick(h, k_rem, NB: tl.constexpr):
    """The bin holding the ``k_rem``-th largest key of histogram ``h`` (uint32) and how many keys
    are still to take from inside that bin (``k_rem`` >= 0)."""
    bins = tl.arange(0, NB)
    above = tl.sum(h, 0) - tl.cumsum(h, 0)  # keys in bins > i
    b = tl.max(tl.where(above + h >= k_rem, bins, -1), 0)
    k_rem = k_rem - tl.sum(tl.where(bins == b, above, 0), 0)
    return b.to(tl.uint32), k_rem


# CHUNK (tokens per program) and C (programs per row) are runtime arguments: a new N, or a new
# power-of-two bucket of N, reuses the compiled kernels. Loop steps (TILE) stay constexpr.
# Scalars that vary with N or the budget are not specialised on (divisibility by 16, == 1), so they
# never pick a new compiled variant either; N itself is (it aligns the rows of scores).
_RUNTIME = ["sink", "window", "k_max", "C", "CHUNK", "stride", "C0"]


@triton.jit(do_not_specialize=["sink", "window", "CHUNK", "C0"])
def _select_hist0_kernel(s_ptr, f_ptr, h0_ptr, N, sink, window, CHUNK, C0,
                         TILE: tl.constexpr, NB: tl.constexpr, HAS_FORCED: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    hist0_of_chunk(s_ptr + r * N, f_ptr + r * N, h0_ptr, r, c, C0, N, CHUNK, sink, window, TILE, NB, HAS_FORCED)


@triton.jit(do_not_specialize=_RUNTIME)
def _select_finish_kernel(s_ptr, f_ptr, budget_ptr, h0_ptr, C0, p1_ptr, cnt_ptr, N, sink, window, k_max, CHUNK,
                          TILE: tl.constexpr, NB: tl.constexpr, SB: tl.constexpr,
                          HAS_FORCED: tl.constexpr, UNIFORM: tl.constexpr, PDL: tl.constexpr):
    """Pass 1 per chunk; the last program of each row sums the pass-1 slots (no row read) and writes
    ``cnt[r, C] = (P, k_rem)``: the top 16 bits of t and the keys still to take from those with them."""
    pdl_wait(PDL)
    c = tl.program_id(0)
    C = tl.num_programs(0)
    r = tl.program_id(1).to(tl.int64)
    s_row = s_ptr + r * N
    f_row = f_ptr + r * N
    end = c * CHUNK + tl.minimum(N - c * CHUNK, CHUNK)  # the chunk's end: a TILE over CHUNK is masked to it
    offs = c * CHUNK + tl.arange(0, TILE)
    s, f = _load_tile(s_row, f_row, offs, offs < end, HAS_FORCED)  # in flight while the slots are summed
    k = _row_budget(budget_ptr, r, N, k_max, UNIFORM)
    h0_row = h0_ptr + r * (C0 + 1) * NB
    p0, k_rem = _pick(_sum_slots(h0_row + NB, C0, NB, SB), k, NB)
    acc = tl.zeros([NB], dtype=tl.int32)
    for t0 in range(0, CHUNK, TILE):
        mask = offs < end
        u = _tile_keys(s, f, offs, N, sink, window, HAS_FORCED)
        offs += TILE
        s, f = _load_tile(s_row, f_row, offs, offs < end, HAS_FORCED)  # the next tile, in flight meanwhile
        acc += _digit_hist(u, 16, mask & ((u >> 24) == p0), NB)
    tl.store(p1_ptr + (r * C + c) * NB + tl.arange(0, NB), acc)
    tl.debug_barrier()  # every thread's slot stores precede the release of the ticket
    ticket = tl.atomic_add(h0_row, 1, sem="acq_rel", scope="gpu")
    if ticket == C - 1:  # the last program of the row: every pass-1 slot is written
        b1, k_rem = _pick(_sum_slots(p1_ptr + r * C * NB, C, NB, SB), k_rem, NB)
        state = cnt_ptr + (r * (C + 1) + C) * 2
        tl.store(state, ((p0 << 8) | b1).to(tl.int32))
        tl.store(state + 1, k_rem)
        tl.store(h0_row, 0)  # the ticket is reset: the same hist0 serves the next select too


@triton.jit
def _count_at_t(state, cand, m, t, CHUNK):
    """Counts the candidates ``cand`` (int64 ``key << 32 | index``, where ``m``) above and equal to ``t`` into
    their chunks' ``(> t, == t)`` pairs of ``state`` (global atomics)."""
    u = (cand >> 32).to(tl.uint32)
    at = state + ((cand & 0xFFFFFFFF) // CHUNK) * 2
    tl.atomic_add(at, 1, mask=m & (u > t), sem="relaxed")
    tl.atomic_add(at + 1, 1, mask=m & (u == t), sem="relaxed")


@triton.jit(do_not_specialize=_RUNTIME)
def _select_tail_kernel(s_ptr, f_ptr, h0_ptr, C0, p2_ptr, cnt_ptr, cand_ptr, N, sink, window, CHUNK,
                        TILE: tl.constexpr, CT: tl.constexpr, NB: tl.constexpr, SB: tl.constexpr, CB: tl.constexpr,
                        HAS_FORCED: tl.constexpr, PDL: tl.constexpr):
    """Passes 2-3 and the chunks' output offsets, proportional to the candidates (the keys whose top
    16 bits are P). Each program re-reads its chunk: it counts the keys above P (``cnt[r, c, 0]``),
    histograms the third byte of its candidates into its slot of ``p2 [R, C, NB]`` and appends them,
    int64 ``key << 32 | index``, to the row's ``cand [R, N]`` (one atomic reservation per tile, in the
    control block of ``hist0``). The last program of the row (a ticket) picks the third byte from the
    slots and the fourth from the candidates alone, counts each chunk's candidates > t and == t (global
    atomics on ``cnt``), then one ordered scan over the chunks (``CB`` at a time) writes ``cnt[r, c] =
    (first output slot of chunk c, keys == t in chunks < c)`` and ``cnt[r, C] = (t, keys == t to keep)``:
    ties at t go to the lowest indices. Candidate order in ``cand`` does not matter (integer counts).
    The last program reads the candidates ``CT`` at a time (its work grows with them, not with N), each
    with its key (no second read of the scores), the first ``CT`` in flight with the slots it sums."""
    pdl_wait(PDL)
    c = tl.program_id(0)
    C = tl.num_programs(0)
    r = tl.program_id(1).to(tl.int64)
    s_row = s_ptr + r * N
    f_row = f_ptr + r * N
    ctl = h0_ptr + r * (C0 + 1) * NB  # [1]: this kernel's ticket, [2]: candidates appended
    cand = cand_ptr + r * N
    state = cnt_ptr + r * (C + 1) * 2
    prefix = tl.load(state + C * 2).to(tl.uint32, bitcast=True)
    k_rem = tl.load(state + C * 2 + 1)
    acc = tl.zeros([NB], dtype=tl.int32)
    n_gt = 0
    end = c * CHUNK + tl.minimum(N - c * CHUNK, CHUNK)  # the chunk's end: a TILE over CHUNK is masked to it
    for t0 in range(0, CHUNK, TILE):
        offs = c * CHUNK + t0 + tl.arange(0, TILE)
        mask = offs < end
        u = _sortable_keys(s_row, f_row, offs, mask, N, sink, window, HAS_FORCED)
        n_gt += tl.sum((mask & ((u >> 16) > prefix)).to(tl.int32), 0)
        is_c = mask & ((u >> 16) == prefix)
        n = tl.sum(is_c.to(tl.int32), 0)
        if n > 0:
            acc += _digit_hist(u, 8, is_c, NB)
            at = tl.atomic_add(ctl + 2, n, sem="relaxed")
            c_i = is_c.to(tl.int32)
            tl.store(cand + at + tl.cumsum(c_i, 0) - c_i, (u.to(tl.int64) << 32) | offs.to(tl.int64), mask=is_c)
    tl.store(p2_ptr + (r * C + c) * NB + tl.arange(0, NB), acc)
    tl.store(state + c * 2, n_gt)
    tl.store(state + c * 2 + 1, 0)
    tl.debug_barrier()  # every thread's stores precede the release of the ticket
    ticket = tl.atomic_add(ctl + 1, 1, sem="acq_rel", scope="gpu")
    if ticket == C - 1:  # the last program of the row: every slot and candidate is written
        n_cand = tl.atomic_xchg(ctl + 2, 0, sem="relaxed")  # read and reset for the next select
        j = tl.arange(0, CT)
        first = tl.load(cand + j, mask=j < n_cand, other=0, cache_modifier=".cg")  # in flight with the slots
        b2, k_rem = _pick(_sum_slots(p2_ptr + r * C * NB, C, NB, SB), k_rem, NB)
        prefix = (prefix << 8) | b2
        u = (first >> 32).to(tl.uint32)
        acc = _digit_hist(u, 0, (j < n_cand) & ((u >> 8) == prefix), NB)
        for i0 in range(CT, n_cand, CT):
            m = i0 + j < n_cand
            u = (tl.load(cand + i0 + j, mask=m, other=0, cache_modifier=".cg") >> 32).to(tl.uint32)
            acc += _digit_hist(u, 0, m & ((u >> 8) == prefix), NB)
        b3, need_eq = _pick(acc, k_rem, NB)
        t = (prefix << 8) | b3
        _count_at_t(state, first, j < n_cand, t, CHUNK)
        for i0 in range(CT, n_cand, CT):
            m = i0 + j < n_cand
            _count_at_t(state, tl.load(cand + i0 + j, mask=m, other=0, cache_modifier=".cg"), m, t, CHUNK)
        tl.debug_barrier()  # the counts are complete before the scan reads them
        slot = 0
        eq_seen = 0
        for c0 in range(0, C, CB):
            cc = c0 + tl.arange(0, CB)
            m = cc < C
            gt = tl.load(state + cc * 2, mask=m, other=0, cache_modifier=".cg")
            eq = tl.load(state + cc * 2 + 1, mask=m, other=0, cache_modifier=".cg")
            gt_before = slot + tl.cumsum(gt, 0) - gt
            eq_before = eq_seen + tl.cumsum(eq, 0) - eq
            tl.store(state + cc * 2, gt_before + tl.minimum(eq_before, need_eq), mask=m)
            tl.store(state + cc * 2 + 1, eq_before, mask=m)
            slot += tl.sum(gt, 0)
            eq_seen += tl.sum(eq, 0)
        tl.store(state + C * 2, t.to(tl.int32, bitcast=True))
        tl.store(state + C * 2 + 1, need_eq)
        tl.store(ctl + 1, 0)  # the ticket is reset


@triton.jit
def _copy_kv_rows(k_ptr, v_ptr, ko_ptr, vo_ptr, bh_k, bh_v, skn, svn, src, dst, keep, D,
                  BLOCK_D: tl.constexpr):
    """``ko[dst] = k[src]`` and ``vo[dst] = v[src]`` for the rows where ``keep``, every head dim."""
    for d0 in range(0, D, BLOCK_D):
        _copy_kv_cols(k_ptr, v_ptr, ko_ptr, vo_ptr, bh_k, bh_v, skn, svn, src, dst, keep, D, d0, BLOCK_D)


@triton.jit
def _copy_kv_cols(k_ptr, v_ptr, ko_ptr, vo_ptr, bh_k, bh_v, skn, svn, src, dst, keep, D, d0,
                  BLOCK_D: tl.constexpr):
    """``ko[dst, d] = k[src, d]`` and ``vo[dst, d] = v[src, d]`` for the rows where ``keep`` (int64 ``src``
    token and ``dst`` slot per row) and the head dims ``d`` in ``[d0, d0 + BLOCK_D)``; both tiles are loaded
    before either is stored."""
    d = d0 + tl.arange(0, BLOCK_D)
    m2 = keep[:, None] & (d < D)[None, :]
    kv = tl.load(k_ptr + bh_k + src[:, None] * skn + d[None, :], mask=m2)
    vv = tl.load(v_ptr + bh_v + src[:, None] * svn + d[None, :], mask=m2)
    tl.store(ko_ptr + dst[:, None] * D + d[None, :], kv, mask=m2)
    tl.store(vo_ptr + dst[:, None] * D + d[None, :], vv, mask=m2)


@triton.jit(do_not_specialize=_RUNTIME[:6])
def _select_compact_kernel(s_ptr, f_ptr, budget_ptr, cnt_ptr, N, sink, window, k_max, C, CHUNK,
                           start_ptr, stride, idx_ptr, len_ptr, mask_ptr,
                           k_ptr, v_ptr, ko_ptr, vo_ptr, H, skb, skh, skn, svb, svh, svn, D,
                           TILE: tl.constexpr, BATCH: tl.constexpr, STAGES: tl.constexpr,
                           BLOCK_D: tl.constexpr, HAS_FORCED: tl.constexpr, HAS_KV: tl.constexpr,
                           WRITE_MASK: tl.constexpr, UNIFORM: tl.constexpr, HAS_START: tl.constexpr,
                           PROTECTED_ONLY: tl.constexpr, PDL: tl.constexpr):
    """Writes row r's kept tokens at ``start[r]`` (or ``r·stride`` without ``HAS_START``).

    ``PROTECTED_ONLY``: every kept token is protected (no forced tokens, and the protected count
    equals k_r), so nothing is ranked: program c writes output slots ``[c·BATCH, (c+1)·BATCH)``
    (the first ``sink`` tokens, then the last ``k_r − sink``), with no select state and no scores read."""
    pdl_wait(PDL)
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    k = _row_budget(budget_ptr, r, N, k_max, UNIFORM)
    if HAS_START:
        base = tl.load(start_ptr + r)  # int64 first output slot of this row
    else:
        base = r * stride
    if c == 0:
        tl.store(len_ptr + r, k)
    bh_k = (r // H) * skb + (r % H) * skh
    bh_v = (r // H) * svb + (r % H) * svh
    if PROTECTED_ONLY:
        j = c * BATCH + tl.arange(0, BATCH)
        keep = j < k
        src = tl.where(j < sink, j, j + (N - k)).to(tl.int64)
        dst = base + j.to(tl.int64)
        tl.store(idx_ptr + dst, src, mask=keep)
        if HAS_KV:
            _copy_kv_rows(k_ptr, v_ptr, ko_ptr, vo_ptr, bh_k, bh_v, skn, svn, src, dst, keep, D, BLOCK_D)
    else:
        state = cnt_ptr + r * (C + 1) * 2
        t = tl.load(state + C * 2).to(tl.uint32, bitcast=True)
        need_eq = tl.load(state + C * 2 + 1)
        first = tl.load(state + c * 2)
        slot = first
        eq_seen = tl.load(state + c * 2 + 1)
        for t0 in range(0, CHUNK, TILE):
            offs = c * CHUNK + t0 + tl.arange(0, TILE)
            mask = offs < N
            u = _sortable_keys(s_ptr + r * N, f_ptr + r * N, offs, mask, N, sink, window, HAS_FORCED)
            eq = (mask & (u == t)).to(tl.int32)
            eq_rank = eq_seen + tl.cumsum(eq, 0) - eq
            keep = (mask & (u > t)) | ((eq != 0) & (eq_rank < need_eq))
            keep_i = keep.to(tl.int32)
            dst = base + (slot + tl.cumsum(keep_i, 0) - keep_i).to(tl.int64)
            tl.store(idx_ptr + dst, offs.to(tl.int64), mask=keep)
            if WRITE_MASK:
                tl.store(mask_ptr + r * N + offs, keep.to(mask_ptr.dtype.element_ty), mask=mask)
            slot += tl.sum(keep_i, 0)
            eq_seen += tl.sum(eq, 0)
        if HAS_KV:  # the kept rows, dense: their indices were just written by this program
            tl.debug_barrier()
            for d0 in range(0, D, BLOCK_D):  # once but for head dims over 128: the batch loop is the inner one
                for j0 in tl.range(first, slot, BATCH, num_stages=STAGES):  # software-pipelined: batches in flight
                    j = j0 + tl.arange(0, BATCH)
                    m = j < slot
                    dst = base + j.to(tl.int64)
                    src = tl.load(idx_ptr + dst, mask=m, other=0)
                    _copy_kv_cols(k_ptr, v_ptr, ko_ptr, vo_ptr, bh_k, bh_v, skn, svn, src, dst, m, D, d0, BLOCK_D)


@host_cache(1024)  # pure; called on every launch (the result is shared: read only)
def _blocks(n: int, rows: int, chunk: Optional[int]):
    """(CHUNK, TILE): tokens per program of the select and per loop step of its compaction.

    On the GPU a row gets about ``ceil(264 / rows)`` programs (two waves of 132 SMs when rows are few) of at
    least ``MIN_CHUNK`` and at most 32768 tokens, a power of two, and at most ``MAX_CHUNKS`` of them (more only
    in chunks of 32768): every finish program sums all of its row's pass-0 slots, so a row's slot reads grow
    with the square of its chunks."""
    if INTERPRET:  # one program costs ~0.5 ms: few, large programs
        tile = min(next_pow2(n), 4096)
    else:
        tile = 256
    if chunk is None:
        if INTERPRET:
            chunk = tile
        else:
            want = max(1, -(-264 // rows))
            chunk = min(max(next_pow2(-(-n // want)), next_pow2(-(-n // MAX_CHUNKS)), MIN_CHUNK), 32768)
    chunk = next_pow2(chunk)
    return chunk, min(tile, chunk)


def _pass_tile(n: int) -> int:
    """Keys per histogram step of pass 0, finish and tail: ``PASS_TILE`` on the GPU whatever the chunk (a step
    over a smaller chunk is masked to it), so a new N or chunk compiles nothing new; a whole row (up to 4096)
    under the interpreter."""
    return min(next_pow2(n), 4096) if INTERPRET else PASS_TILE


def _cand_tile(tile: int) -> int:
    """Candidates per step of the tail's last program: ``CAND_TILE`` on the GPU, the compaction's tile (a whole
    row up to 4096) under the interpreter."""
    return tile if INTERPRET else CAND_TILE


# Tokens per program at least. An H100 run (Triton 3.6, ``benchmarks/gpu_session.sh tuning``: select_kv
# alone, 8 rows, keep 25%, CUDA graph), µs by chunk: N = 4K: 256: 27.6, 512: 29.3, 2048: 47.3; 32K: 1024: 63.6,
# 2048: 65.2; 128K: 2048: 176.6, 4096: 169.4. With 264 / rows programs a row, 256 picks the fastest chunk at all
# three (256, 1024, 4096; the former minimum, 2048, took 47.3 µs at 4K). Timed with pass steps of min(1024, chunk)
# keys, not yet with the 1024-key step masked to the chunk that ``_pass_tile`` now gives every chunk.
MIN_CHUNK = 256
# Chunks a row at most (outside chunks of 32768): with 8 rows the 264 / rows rule never reaches it; with one or
# two rows it keeps the finish kernel's slot reads (chunks x chunks x 1 KB per row) at most 4 MB, where 256-token
# chunks of a 64K-token row would read 70 MB (untimed on a GPU; the former 2048-token minimum gave 32 there).
MAX_CHUNKS = 64
BATCH = 64  # kept K/V rows copied per step of the compaction (64 x 128 K and V tiles: 32 KB in flight)
COMPACT_WARPS = 8
COMPACT_STAGES = 2  # software-pipelined stages of the compaction's batch loop (1: a batch in flight at a time)
PASS_TILE = 1024  # keys per histogram step of pass 0, finish and tail (a 256-bin histogram costs the same
# shared atomics per call whatever the keys per thread on Triton 3.6: few large steps)
CAND_TILE = 512  # candidates per step of the tail's last program (2 per thread; 1024 spills on Triton 3.6)
CB = 256  # chunks per step of the tail's ordered offset scan
FINISH_WARPS = 8
SB = 32  # pass-0/1/2 slots summed per step: one step (one L2 round trip) for the 8-32 chunks a row of 8-32 rows


def _protected_only(n: int, sink: int, window: int, k_max: int, full_rows: bool, has_forced: bool,
                    write_mask: bool) -> bool:
    """Static: every kept token is protected (each row keeps k_max = min(sink + window, n) tokens)."""
    return full_rows and not has_forced and not write_mask and k_max == min(sink + window, n)


def hist0_buffer(rows: int, chunks: int, device) -> torch.Tensor:
    """Uninitialised int32 ``[rows, 1 + chunks, NB]`` for the pass-0 slots of ``chunks`` programs per
    row (``hist0_of_chunk`` writes all of it)."""
    return torch.empty((rows, 1 + chunks, NB), dtype=torch.int32, device=device)


class Hist0(NamedTuple):
    """The select's first radix pass over a row's scores, made by the kernel that wrote them: the
    int32 ``[R, 1 + C0, NB]`` slots (``hist0_of_chunk``) and the protection they were counted with.
    Pass it to ``select_kv(..., hist0=)`` with those very scores, the same sink and window and the
    same ``forced`` tokens (None: none; else that very tensor); it may serve any number of such
    selects (in stream order)."""

    hist: torch.Tensor
    sink: int
    window: int
    forced: Optional[torch.Tensor] = None


def workspace(rows: int, n: int, device, chunk: Optional[int] = None) -> tuple:
    """Scratch of the select's finish and tail passes over ``rows`` x ``n`` scores (``chunk`` as given to the
    selects): ``(p1 int32 [rows, C, NB], cnt int32 [rows, C + 1, 2], cand int64 [rows, n])``, C its programs a
    row. Any number of such selects may share it (``select_kv(..., work=)``, ``keep_mask``), one after another
    in stream order: each writes what it reads before reading it."""
    C = cdiv(n, _blocks(n, rows, chunk)[0])
    return (torch.empty((rows, C, NB), dtype=torch.int32, device=device),
            torch.empty((rows, C + 1, 2), dtype=torch.int32, device=device),
            torch.empty((rows, n), dtype=torch.int64, device=device))


_WORK_DTYPES = (torch.int32, torch.int32, torch.int64)  # p1, cnt, cand (``workspace``)


def _work_args(work, rows: int, n: int, chunk: int) -> tuple:
    """``select_into``'s ``(work_p1, work_cnt, work_cand)`` from a ``workspace`` (or None), checked by shape and
    dtype."""
    if work is None:
        return None, None, None
    C = cdiv(n, _blocks(n, rows, chunk or None)[0])
    want = ((rows, C, NB), (rows, C + 1, 2), (rows, n))
    if (not isinstance(work, tuple) or len(work) != 3 or any(not isinstance(t, torch.Tensor) for t in work)
            or tuple(tuple(t.shape) for t in work) != want or tuple(t.dtype for t in work) != _WORK_DTYPES):
        got = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in work] \
            if isinstance(work, tuple) else work
        raise ValueError(f"work must be select.workspace({rows}, {n}, device) (int32, int32, int64 {want}), got "
                         f"{got!r}")
    return work


# no default on a mutated argument: torch < 2.12 drops trailing arguments equal to their default before it
# indexes the mutated ones by position (IndexError under a dispatch mode, torch.compile or export)
@triton_op("tritonkv::select_into",
           mutates_args={"out_idx", "out_lengths", "out_mask", "out_keys", "out_values", "hist0", "work_p1",
                         "work_cnt", "work_cand"})
def select_into(scores: torch.Tensor, budgets: Optional[torch.Tensor], forced: Optional[torch.Tensor],
                keys: Optional[torch.Tensor], values: Optional[torch.Tensor], out_start: Optional[torch.Tensor],
                out_idx: torch.Tensor, out_lengths: torch.Tensor, out_mask: Optional[torch.Tensor],
                out_keys: Optional[torch.Tensor], out_values: Optional[torch.Tensor], hist0: Optional[torch.Tensor],
                sink: int, window: int, k_max: int, budget: int, full_rows: bool, chunk: int,
                work_p1: Optional[torch.Tensor], work_cnt: Optional[torch.Tensor],
                work_cand: Optional[torch.Tensor]) -> None:
    """The raw op. ``None`` means "absent" for every optional tensor.

    scores fp32 [R, N] contiguous; budgets int32 [R], or None: every row's budget is the int
    ``budget``; forced uint8 [R, N]; keys/values [B, H, N, D] (last dim unit-stride); out_start
    int64 [R] (first slot of each row in the outputs), or None: the padded layout, row r at
    ``r·k_max``; out_idx int64 [T]; out_lengths int32 [R]; out_mask int8 or uint8 [R, N]; out_keys/out_values
    [T, D] (contiguous; the outputs may come in any shape of as many elements, such as [B, H, k_max, D]).
    ``hist0``: None, or the int32 ``[R, 1 + C0, NB]`` first radix pass of these scores with
    these sink/window and forced tokens (``hist0_of_chunk``; its ticket word is used and reset).
    ``full_rows``: a static promise that the outputs are the padded layout (``out_start[r] =
    r·k_max``, ``T = R·k_max``) and every row keeps ``k_max <= N`` tokens (budgets >= k_max); the
    PyTorch body then gathers straight into the outputs, and the kernels copy protected rows directly
    when they are all that is kept. ``work_p1``/``work_cnt``/``work_cand``: the finish and tail passes'
    scratch (``workspace``; allocated here when None or shaped for another chunk, unused by the PyTorch
    body). CPU tensors run ``_select_torch`` (outside the Triton interpreter).
    """
    R, N = scores.shape
    dev = scores.device
    if not use_triton(scores):
        if budgets is None:
            budgets = torch.full((R,), budget, dtype=torch.int32, device=dev)
        if out_start is None:
            out_start = torch.arange(R, device=dev, dtype=torch.int64) * k_max
        e = scores.new_empty(0)
        out_idx, out_lengths = out_idx.view(-1), out_lengths.view(-1)
        if out_keys is not None:
            out_keys, out_values = out_keys.view(-1, out_keys.shape[-1]), out_values.view(-1, out_values.shape[-1])
        return _select_torch(scores, budgets, _or(forced, e, torch.uint8), _or(keys, e), _or(values, e), out_start,
                             out_idx, out_lengths, _or(out_mask, e, torch.int8), _or(out_keys, e),
                             _or(out_values, e), sink, window, k_max, full_rows)
    CHUNK, TILE = _blocks(N, R, chunk if chunk > 0 else None)
    C = cdiv(N, CHUNK)
    has_kv = keys is not None
    write_mask = out_mask is not None
    uniform = budgets is None
    kb = min(budget, k_max) if uniform else k_max  # the kernels' k_max: the uniform budget folded in
    if has_kv:
        H, D = keys.shape[1], keys.shape[3]
        kstr, vstr = keys.stride()[:3], values.stride()[:3]
    else:
        H, D, kstr, vstr = 1, 1, (0, 0, 0), (0, 0, 0)
    # absent tensors are passed as ``scores`` (never read: the constexpr flags switch them off)
    f, b = _or(forced, scores), _or(budgets, scores)
    flags = dict(HAS_FORCED=forced is not None, UNIFORM=uniform)
    compact = dict(BATCH=BATCH, STAGES=COMPACT_STAGES, BLOCK_D=min(next_pow2(D), 128), HAS_KV=has_kv,
                   WRITE_MASK=write_mask, HAS_START=out_start is not None, num_warps=COMPACT_WARPS, **flags)
    tail = (_or(out_start, scores), k_max, out_idx, out_lengths, _or(out_mask, scores), _or(keys, scores),
            _or(values, scores), _or(out_keys, scores), _or(out_values, scores), H, *kstr, *vstr, D)
    if _protected_only(N, sink, window, k_max, full_rows, forced is not None, write_mask):
        launch(_select_compact_kernel, (max(cdiv(k_max, compact["BATCH"]), 1), R), scores, f, b, scores,
               N, sink, window, kb, 1, CHUNK, *tail, TILE=TILE, PROTECTED_ONLY=True, **compact)
        return
    pt = _pass_tile(N)  # keys per step of the passes: 4-8 per thread on the GPU
    if hist0 is None:
        hist0 = hist0_buffer(R, C, dev)
        launch(_select_hist0_kernel, (C, R), scores, f, hist0, N, sink, window, CHUNK, C, TILE=pt, NB=NB,
               HAS_FORCED=forced is not None)
    # pass-1 slots, then the tail's pass-2 slots; the row's state; the tail's candidates (key, index), at most N a row
    p1, cnt, cand = work_p1, work_cnt, work_cand
    if p1 is None or p1.shape != (R, C, NB) or cnt.shape != (R, C + 1, 2) or cand.shape != (R, N) or \
            cand.dtype != torch.int64:
        p1, cnt, cand = workspace(R, N, dev, CHUNK)
    launch(_select_finish_kernel, (C, R), scores, f, b, hist0, hist0.shape[1] - 1, p1, cnt, N, sink, window, kb,
           CHUNK, TILE=pt, NB=NB, SB=SB, num_warps=FINISH_WARPS, **flags)
    launch(_select_tail_kernel, (C, R), scores, f, hist0, hist0.shape[1] - 1, p1, cnt, cand, N, sink, window, CHUNK,
           TILE=pt, CT=_cand_tile(TILE), NB=NB, SB=SB, CB=CB, num_warps=FINISH_WARPS,
           HAS_FORCED=forced is not None)
    launch(_select_compact_kernel, (C, R), scores, f, b, cnt, N, sink, window, kb, C, CHUNK, *tail,
           TILE=TILE, PROTECTED_ONLY=False, **compact)


def _or(t: Optional[torch.Tensor], other: torch.Tensor, dtype=None) -> torch.Tensor:
    """``t``, or ``other`` (as an empty tensor of ``dtype`` when given) where ``t`` is None."""
    if t is not None:
        return t
    return other if dtype is None else other.new_empty(0, dtype=dtype)


# ------------------------------------------------------------------------------------------------
# The PyTorch body (CPU outside the interpreter). torch.compile and torch.export trace it with fake
# tensors, so it has static shapes only: no host reads, no data-dependent sizes.

_IDX_BITS = 31  # composite key = (sortable score key << 31) | (N - 1 - index), N < 2**31


def _composite_keys(scores: torch.Tensor, forced: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """int64 ``[R, N]``: ``(u << 31) | (N - 1 - index)`` with u the kernel's order-preserving uint32
    key of the score (NaN -> -inf, -0 -> +0; protected tokens 0xFFFFFFFF, above a genuine +inf).
    The keys of a row are distinct, and descending key order is the kernel's ranking (ties to the
    lower index). Computed as ``(signed key << 31) + 2**62 + N - 1 - index``, the same number."""
    N = scores.shape[1]
    pos = torch.arange(N, device=scores.device)
    s = torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    b = torch.where(s == 0, 0.0, s).view(torch.int32)  # -0 -> +0
    signed = b ^ ((b >> 31) & 0x7FFFFFFF)  # int32 order == float order
    low = (2 ** 62 + N - 1) - pos
    keys = (signed.to(torch.int64) << _IDX_BITS) + low
    if not sink and not window and forced.numel() == 0:  # nothing protected
        return keys
    prot = (pos < sink) | (pos >= N - window)
    if forced.numel() > 0:
        prot = prot | (forced != 0)
    return torch.where(prot, ((2 ** 32 - 1) << _IDX_BITS) - 2 ** 62 + low, keys)


def redirect_invalid(valid: torch.Tensor):
    """Make a masked scatter static-shaped: every entry is written, the invalid ones as copies of a
    valid one. Returns ``(pick, any_valid)``: ``pick[e] = e`` for a valid entry, else the first valid
    entry, whose destination and value the caller then uses (duplicated indices with identical values
    give a defined result). When no entry is valid every write goes to slot 0, which the caller
    restores (``any_valid`` is False)."""
    e = torch.arange(valid.numel(), device=valid.device)
    return torch.where(valid, e, valid.to(torch.int32).argmax()), valid.any()


def _rows(t: torch.Tensor, tok: torch.Tensor):
    """For ``t [B, H, N, D]`` of any strides (unit-stride last dim) and token indices ``tok [R, kk]``:
    a ``[span, D]`` view whose row x starts x elements into ``t``, and the row of that view holding
    ``t[b, h, tok[r, j]]`` (``r = b·H + h``) for every entry, flattened ``[R·kk]``."""
    B, H, N, D = t.shape
    sb, sh, sn, _ = t.stride()
    flat = t.as_strided(((B - 1) * sb + (H - 1) * sh + (N - 1) * sn + 1, D), (1, 1))
    r = torch.arange(B * H, device=t.device)
    return flat, ((r // H * sb + r % H * sh)[:, None] + tok * sn).flatten()


def _copy_rows(out: torch.Tensor, dst: torch.Tensor, t: torch.Tensor, tok: torch.Tensor, pick: torch.Tensor) -> None:
    """``out[dst[e]] = t[b, h, tok[r, j]]`` for the entries ``(r, j) = pick[e]`` (see ``_rows``):
    ``index_select`` then ``index_copy_``, in 512 KB pieces through one buffer (a large temporary
    costs more in page faults than the copy itself)."""
    flat, off = _rows(t, tok)
    off = off[pick]
    wide = _rows16(out)
    step = min(max(1, (512 << 10) // (t.shape[-1] * t.element_size())), dst.numel())
    buf = t.new_empty((step, t.shape[-1]))
    for a in range(0, dst.numel(), step):
        rows = torch.index_select(flat, 0, off[a:a + step], out=buf[:min(step, dst.numel() - a)])
        wide.index_copy_(0, dst[a:a + step], rows.view(wide.dtype))


def _rows16(t: torch.Tensor) -> torch.Tensor:
    """``t [T, D]`` viewed as 16-byte elements (complex128) when its layout allows: eager
    ``index_copy_`` pays per element, so moving the same bits in 16-byte pieces is 2-4x faster on the
    CPU. Not while compiling (the compiler writes its own copy; inductor has no complex codegen)."""
    es = t.element_size()
    if torch.compiler.is_compiling() or t.stride(-1) != 1:
        return t
    if all(x * es % 16 == 0 for x in (t.shape[-1], t.stride(0), t.storage_offset())):
        return t.view(torch.complex128)
    return t


def _select_torch(scores, budgets, forced, keys, values, out_start, out_idx, out_lengths, out_mask, out_keys,
                  out_values, sink: int, window: int, k_max: int, full_rows: bool) -> None:
    """``select_into`` in PyTorch, keeping the same tokens as the kernels: an exact ``torch.topk`` of
    ``min(k_max, N)`` distinct int64 composite keys per row (``_composite_keys``), of which the first
    ``k_r`` are kept; their indices sorted ascending; indices, mask and K/V rows written at
    ``out_start[r] + j`` (``j < k_r``) with ``index_copy_`` (see ``redirect_invalid``), or, with
    ``full_rows``, gathered straight into the padded outputs with ``index_select``."""
    R, N = scores.shape
    kk = min(k_max, N)
    dev = scores.device
    k = budgets.to(torch.int64).clamp(0, kk)  # k_r = clamp(min(budget, N, k_max), 0)
    out_lengths.copy_(k)
    if kk == 0 or R == 0:
        out_mask.zero_()
        return
    key = _composite_keys(scores, forced, sink, window)
    top = torch.topk(key, kk, dim=1).values  # descending: row r keeps its first k_r
    if out_mask.numel() > 0:
        thr = top.gather(1, (k - 1).clamp(min=0)[:, None])
        out_mask.copy_((key >= thr) & (k[:, None] > 0))
    if out_idx.numel() == 0:
        return
    if full_rows and kk == k_max and out_idx.numel() == R * kk:  # every slot is written: no scatter
        tok = ((N - 1) - (top & (2 ** _IDX_BITS - 1))).sort(dim=1).values
        out_idx.copy_(tok.flatten())
        if keys.numel() > 0:
            for t, o in ((keys, out_keys), (values, out_values)):
                flat, off = _rows(t, tok)
                torch.index_select(flat, 0, off, out=o)
        return
    j = torch.arange(kk, device=dev)
    valid = j < k[:, None]
    # kept indices ascending, then N - 1 where j >= k_r (in bounds; those entries are redirected)
    tok = torch.where(valid, (N - 1) - (top & (2 ** _IDX_BITS - 1)), N - 1).sort(dim=1).values
    pick, any_valid = redirect_invalid(valid.flatten())
    dst = torch.where(any_valid, (out_start[:, None] + j).flatten()[pick], 0)
    outs = (out_idx, out_keys, out_values) if keys.numel() > 0 else (out_idx,)
    slot0 = [o[:1].clone() for o in outs]
    out_idx.index_copy_(0, dst, tok.flatten()[pick])
    if keys.numel() > 0:
        _copy_rows(out_keys, dst, keys, tok, pick)
        _copy_rows(out_values, dst, values, tok, pick)
    for o, s0 in zip(outs, slot0):  # no valid entry: slot 0 was overwritten, put it back
        o[:1].copy_(torch.where(any_valid, o[:1], s0))


# ------------------------------------------------------------------------------------------------
# Python wrappers


class Out(NamedTuple):
    """A preallocated destination: flattened rows ``[T, D]``, row ``r`` starting at ``start[r]``."""

    keys: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor  # int64 [T]
    start: Optional[torch.Tensor]  # int64 [R]; None: the padded layout, row r at r·k_max
    lengths: torch.Tensor  # int32 [R]


def budget_tensor(budget, rows: int, device) -> torch.Tensor:
    """An int32 ``[rows]`` device tensor from an int >= 0 or an integer tensor of ``rows`` entries
    (on ``device``, or on the CPU: then it is copied over). Tensor values are never read: negative
    budgets keep nothing."""
    if isinstance(budget, torch.Tensor):
        if budget.numel() != rows:
            raise ValueError(f"budgets must have {rows} entries (one per batch row and KV head), got shape {tuple(budget.shape)}")
        if budget.dtype.is_floating_point or budget.dtype.is_complex or budget.dtype == torch.bool:
            raise TypeError(f"budgets must be an integer tensor, got {budget.dtype}")
        check_device("budgets", budget, device, "scores", cpu_ok=True)
        if budget.shape != (rows,):
            budget = budget.reshape(rows)
        return budget.to(device=device, dtype=torch.int32).contiguous()
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"budget must be an int or an int tensor, got {type(budget).__name__}")
    check_int("budget", budget)
    return torch.full((rows,), budget, dtype=torch.int32, device=device)


def check_protected(budget, n: int, k_max: int, sink: int, window: int) -> None:
    """Static check that an int ``budget`` holds the protected tokens (the first ``sink`` and the last
    ``window`` of a row of ``n``). Tensor budgets are never read on the host: a row whose budget is
    below its protected count keeps its first ``budget`` protected tokens."""
    check_int("sink", sink)
    check_int("window", window)
    check_int("k_max", k_max)
    if isinstance(budget, int) and not isinstance(budget, bool):
        if min(sink + window, n) > min(check_int("budget", budget), n, k_max):
            raise ValueError(f"budget {budget} (k_max {k_max}) is smaller than the protected tokens "
                             f"(sink {sink} + window {window}) of a row of {n}")


def _scores_2d(scores: torch.Tensor) -> torch.Tensor:
    if not isinstance(scores, torch.Tensor) or scores.dim() not in (2, 3):
        raise ValueError("scores must be a [R, N] or [B, H, N] tensor")
    if not scores.dtype.is_floating_point:
        raise TypeError(f"scores must be a float tensor (higher = keep), got {scores.dtype}")
    if scores.dim() == 3:
        rows = scores.numel() // scores.shape[-1] if scores.shape[-1] else math.prod(scores.shape[:-1])  # N = 0 too
        scores = scores.reshape(rows, scores.shape[-1])
    return scores.to(torch.float32).contiguous()


def _forced_2d(forced, shape, device) -> Optional[torch.Tensor]:
    if forced is None:
        return None
    if not isinstance(forced, torch.Tensor) or forced.dtype.is_floating_point or forced.dtype.is_complex:
        raise TypeError(f"forced must be a bool (or integer) tensor shaped like scores, got "
                        f"{getattr(forced, 'dtype', type(forced).__name__)}")
    if forced.numel() != shape[0] * shape[1]:
        raise ValueError(f"forced must have the shape of scores {tuple(shape)}, got {tuple(forced.shape)}")
    check_device("forced", forced, device, "scores", cpu_ok=True)
    if forced.shape != shape:
        forced = forced.reshape(shape)
    return forced.to(device=device, dtype=torch.uint8).contiguous()


def _static_args(k_max, chunk) -> int:
    """Checked ``k_max`` (int >= 0) and ``chunk`` (None or an int >= 0; 0 = automatic)."""
    if chunk is not None:
        check_int("chunk", chunk)
    return check_int("k_max", k_max)


def _full_rows(budgets, n: int, k_max: int) -> bool:
    """Static: an int budget keeps ``k_max <= n`` tokens in every row (``select_into``'s ``full_rows``)."""
    return isinstance(budgets, int) and not isinstance(budgets, bool) and k_max <= n and min(budgets, n) >= k_max


def _budget_args(budget, rows: int, device):
    """``select_into``'s ``(budgets, budget)``: a tensor budget as ``budget_tensor``; an int one as
    None and the int (no device fill)."""
    if isinstance(budget, torch.Tensor):
        return budget_tensor(budget, rows, device), 0
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"budget must be an int or an int tensor, got {type(budget).__name__}")
    return None, check_int("budget", budget)


def _indices(shape: tuple, full: bool, device) -> torch.Tensor:
    """int64 output indices of ``shape``: unwritten when every slot is written (``full``), else -1."""
    if full:
        return torch.empty(shape, dtype=torch.int64, device=device)
    return torch.full(shape, -1, dtype=torch.int64, device=device)


def select_indices(scores, budgets, k_max: int, *, sink: int = 0, window: int = 0, forced=None,
                   with_mask: bool = False, chunk: Optional[int] = None, hist0: Optional[Hist0] = None):
    """Kept indices only. Returns ``(indices int64 [..., k_max] padded with -1, lengths int32 [...])``
    and, with ``with_mask``, a bool keep-mask shaped like ``scores``. ``hist0``: as for ``select_kv``."""
    s = _scores_2d(scores)
    R, N = s.shape
    dev = s.device
    k_max = _static_args(k_max, chunk)
    check_protected(budgets, N, k_max, sink, window)
    b, bi = _budget_args(budgets, R, dev)
    full = _full_rows(budgets, N, k_max)
    idx = _indices((R * k_max,), full and R > 0 and N > 0, dev)
    lengths = torch.empty(R, dtype=torch.int32, device=dev)
    mask = torch.empty((R, N) if with_mask else (0,), dtype=torch.int8, device=dev)
    h0 = _hist0_arg(hist0, R, sink, window, forced)
    if N > 0 and R > 0:  # no out_start: the padded layout
        select_into(s, b, _forced_2d(forced, (R, N), dev), None, None, None, idx, lengths, mask if with_mask else None,
                    None, None, h0, sink, window, k_max, bi, full, chunk or 0, work_p1=None, work_cnt=None,
                    work_cand=None)
    else:
        lengths.zero_()
        mask.zero_()
    lead = scores.shape[:-1]
    out = (idx.view(*lead, k_max), lengths.view(lead))
    return out + (mask.view(scores.shape).view(torch.bool),) if with_mask else out  # 0/1 bytes: no copy


def select_mask(scores, budgets, *, sink: int = 0, window: int = 0, forced=None, chunk: Optional[int] = None):
    """Bool keep-mask shaped like ``scores`` (for allocators and score transforms)."""
    mask = keep_mask(scores, budgets, sink=sink, window=window, forced=forced, chunk=chunk)
    return mask.view(scores.shape).view(torch.bool)  # 0/1 bytes: no copy


def keep_mask(scores, budgets, *, sink: int = 0, window: int = 0, forced=None, chunk: Optional[int] = None,
              hist0: Optional[Hist0] = None, work: Optional[tuple] = None) -> torch.Tensor:
    """uint8 keep-mask ``[R, N]`` (1 = kept) of the select of ``budgets`` tokens a row, as the ``forced`` tokens
    of a further select (a two-stage selection): ``select_mask``'s bytes, with no index of its own returned.
    ``hist0``, ``work``: as for ``select_kv``."""
    s = _scores_2d(scores)
    R, N = s.shape
    dev = s.device
    _static_args(N, chunk)
    check_protected(budgets, N, N, sink, window)
    b, bi = _budget_args(budgets, R, dev)
    k_max = min(bi, N) if b is None else N  # the output capacity a row needs (its indices are not kept)
    full = _full_rows(budgets, N, k_max)
    work = _work_args(work, R, N, chunk)
    if work[0] is None or not use_triton(s):  # the indices and lengths written where kept, never read back
        idx = torch.empty(R * k_max, dtype=torch.int64, device=dev)
        lengths = torch.empty(R, dtype=torch.int32, device=dev)
    else:  # ... into the workspace's candidates and pass-1 slots, which the compaction does not read (int32)
        idx, lengths = work[2], work[0]
    mask = torch.empty((R, N), dtype=torch.uint8, device=dev)
    h0 = _hist0_arg(hist0, R, sink, window, forced)
    if N > 0 and R > 0:
        select_into(s, b, _forced_2d(forced, (R, N), dev), None, None, None, idx, lengths, mask, None, None, h0, sink,
                    window, k_max, bi, full, chunk or 0, work_p1=work[0], work_cnt=work[1], work_cand=work[2])
    else:
        mask.zero_()
    return mask


def select_kv(scores, budgets, keys, values, k_max: int, *, sink: int = 0, window: int = 0, forced=None,
              out: Optional[Out] = None, chunk: Optional[int] = None, hist0: Optional[Hist0] = None,
              work: Optional[tuple] = None):
    """Select and gather K/V.

    ``scores`` fp32 ``[B, H, N]``; ``keys``/``values`` ``[B, H, N, D]``; ``budgets`` an int or int32
    ``[B*H]``; ``k_max`` the static output capacity per row (>= every budget that must fit).

    Without ``out``: returns ``(keys [B,H,k_max,D], values, indices int64 [B,H,k_max], lengths
    int32 [B,H])``; rows kept shorter than ``k_max`` are zero-padded (indices -1). With ``out``:
    writes row r at ``out.start[r]`` of the flattened ``out`` tensors and returns ``out``.
    ``hist0``: the first radix pass of these scores made by their scoring kernel (a ``Hist0``, with
    this sink and window and the same ``forced``; a ValueError otherwise): the select then runs one launch
    fewer. ``work``: the scratch of its passes (``workspace(B*H, N, device, chunk)``), shared with other
    selects of that size (none allocated here). The kept tokens are the same either way.
    """
    check_kv_tensor("keys", keys)
    check_kv_tensor("values", values)
    B, H, N, D = keys.shape
    if values.shape != keys.shape:
        raise ValueError(f"values must have the shape of keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    if values.dtype != keys.dtype:
        raise TypeError(f"values must have the dtype of keys ({keys.dtype}), got {values.dtype}")
    dev = keys.device
    check_device("values", values, dev, "keys")
    s = _scores_2d(scores)
    R = B * H
    if s.shape != (R, N):
        raise ValueError(f"scores must be [B, H_kv, N] = {(B, H, N)}, got {tuple(scores.shape)}")
    check_device("scores", scores, dev, "keys")
    k_max = _static_args(k_max, chunk)
    check_protected(budgets, N, k_max, sink, window)
    k_max = min(k_max, N)
    b, bi = _budget_args(budgets, R, dev)
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    full = out is None and _full_rows(budgets, N, k_max)
    if out is None:  # allocated in the shapes returned (select_into reads them as [T, D], [T], [R])
        alloc = torch.empty if full else torch.zeros
        ko = alloc((B, H, k_max, D), dtype=keys.dtype, device=dev)
        vo = alloc((B, H, k_max, values.shape[-1]), dtype=values.dtype, device=dev)
        idx = _indices((B, H, k_max), full and R > 0 and N > 0, dev)
        lengths = torch.empty((B, H), dtype=torch.int32, device=dev)
        dst = Out(ko, vo, idx, None, lengths)  # no start: the padded layout
    else:
        dst = out
    h0 = _hist0_arg(hist0, R, sink, window, forced)
    p1, cnt, cand = _work_args(work, R, N, chunk)
    if N > 0 and R > 0:
        select_into(s, b, _forced_2d(forced, (R, N), dev), keys, values, dst.start, dst.indices, dst.lengths,
                    None, dst.keys, dst.values, h0, sink, window, k_max, bi, full, chunk or 0, work_p1=p1,
                    work_cnt=cnt, work_cand=cand)
    else:
        dst.lengths.zero_()
    if out is not None:
        return out
    return dst.keys, dst.values, dst.indices, dst.lengths


def _hist0_arg(hist0, rows: int, sink: int, window: int, forced) -> Optional[torch.Tensor]:
    """``select_kv``'s ``hist0`` checked against the select it is passed to (static checks only)."""
    if hist0 is None:
        return None
    if not isinstance(hist0, Hist0) or not isinstance(hist0.hist, torch.Tensor):
        raise TypeError(f"hist0 must be a tritonkv.kernels.select.Hist0, got {type(hist0).__name__}")
    h = hist0.hist
    if h.dtype != torch.int32 or h.dim() != 3 or h.shape[0] != rows or h.shape[1] < 2 or h.shape[2] != NB:
        raise ValueError(f"hist0.hist must be int32 [{rows}, 1 + chunks, {NB}], got {h.dtype} {tuple(h.shape)}")
    if forced is not hist0.forced or (hist0.sink, hist0.window) != (sink, window):
        counted = "no forced tokens" if hist0.forced is None else "its forced tokens"
        given = "no forced tokens" if forced is None else ("other forced tokens" if hist0.forced is not None
                                                           else "forced tokens")
        raise ValueError(f"hist0 was counted with sink {hist0.sink}, window {hist0.window} and {counted}; "
                         f"this select has sink {sink}, window {window} and {given}")
    return h
