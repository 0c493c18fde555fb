"""The shared select + compact kernel: the only top-k in tritonkv.

Per row r (= b·H_kv + h) of fp32 scores, keep exactly ``k_r = min(budget[r], N, k_max)`` tokens:
the protected ones (the first ``sink``, the last ``window``, and any ``forced``) and then the
highest scores, ties to the lower index, NaN lowest, -0 == +0. Kept tokens are written in
ascending original order, with their int64 indices, and the K/V rows are gathered in the same
pass. Budgets are an int32 device tensor that the host never reads.

Pipeline (``docs/architecture.md``, "Kernels"), each launch on grid (chunks, rows) so a long row is
split over many programs:

1. keys: NaN -> -inf, -0 -> +0, fp32 bits -> order-preserving uint32; protected -> 0xFFFFFFFF
   (a genuine +inf maps to 0xFF800000, so it never displaces a protected token);
2. three MSB radix passes (11 + 11 + 10 bits): each chunk histograms the next digit of the keys
   that match the prefix found so far and adds it into a global ``[R, 3, 2048]`` histogram with
   integer atomics (order-independent, so deterministic). Every later launch re-derives the
   prefix from the histograms, which makes kernel boundaries the grid-wide barrier;
3. count: per chunk, keys > t and keys == t for the final threshold t;
4. compact: an exclusive prefix over earlier chunks plus a local cumsum gives each kept token its
   output slot (ties at t go to the lowest indices), and the K/V rows are copied to the slot.

Fewer launches where shapes allow (issue 16): a scoring kernel may count the first radix pass itself
(``score_hist0``/``remember_pass0``: knorm, keydiff), an int budget and the padded layout need no
device fill (the kernels read the scalar and compute ``r·k_max``), and when every kept token is
protected (StreamingLLM) one launch copies them with nothing ranked. ``CHUNK``, ``C`` and the
budget-dependent scalars are runtime arguments that Triton does not specialise on, so a new N
compiles nothing new.

On the CPU (outside the Triton interpreter) the same op runs ``_select_torch``: one exact
``torch.topk`` over int64 keys that pack the kernel's uint32 key with the reversed index (so ties go
to the lower index), a sort of the kept indices, and ``index_select``/``index_copy_`` writes, with
static shapes only (torch.compile and torch.export trace it).
"""
from __future__ import annotations

import math
import weakref
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, check_device, check_int, check_kv_tensor, launch, next_pow2, triton_op, use_triton

NB = 2048  # bins per radix pass (digits of 11, 11 and 10 bits)


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
def _sortable_keys(s_ptr, f_ptr, offs, mask, N, sink, window, HAS_FORCED: tl.constexpr):
    """Order-preserving uint32 keys of one tile of scores; protected tokens get the maximum."""
    s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = _keys_of(s, offs, N, sink, window)
    if HAS_FORCED:
        u = tl.where(tl.load(f_ptr + offs, mask=mask, other=0) != 0, 0xFFFFFFFF, u)
    return u


@triton.jit
def _digit_hist(digit, match, NB: tl.constexpr):
    """Histogram over NB bins of the int32 ``digit``s of the lanes where ``match`` (no ``mask=``
    argument: the non-matching lanes are counted in bin 0 and taken out again)."""
    digit = tl.where(match, digit, 0)
    n_out = tl.sum(tl.where(match, 0, 1), 0)
    return tl.histogram(digit, NB) - tl.where(tl.arange(0, NB) == 0, n_out, 0)


@triton.jit
def score_hist0(s, offs, mask, N, sink, window, NB: tl.constexpr):
    """For scoring kernels that feed the select (``remember_pass0``): the first radix pass's
    ``[NB]`` histogram of a tile of fp32 scores, exactly as ``_select_hist_kernel[PASS=0]`` counts
    them once the scores are stored (the key of the in-register score is the key of the stored one).
    Accumulate over the program's tiles, then ``add_hist0`` once."""
    u = _keys_of(s, offs, N, sink, window)
    return _digit_hist((u >> 21).to(tl.int32), mask, NB)


@triton.jit
def add_hist0(hist_ptr, r, acc, NB: tl.constexpr):
    """Add a program's pass-0 counts into row ``r`` (int64) of the ``[R, 3, NB]`` histogram."""
    tl.atomic_add(hist_ptr + r * 3 * NB + tl.arange(0, NB), acc, sem="relaxed")


@triton.jit
def zero_hist(hist_ptr, r, c, C, NB: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``c`` of the ``C`` of row ``r`` zeroes its share of the row's ``[3, NB]`` histogram
    (for a kernel that runs before the first histogram pass: the launch boundary orders it)."""
    for i0 in range(c * BLOCK, 3 * NB, C * BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        tl.store(hist_ptr + r * 3 * NB + i, tl.zeros([BLOCK], dtype=tl.int32), mask=i < 3 * NB)


@triton.jit
def _row_budget(budget_ptr, r, N, k_max, UNIFORM: tl.constexpr):
    """k_r = clamp(min(budget[r], N, k_max), 0); ``UNIFORM``: no budget tensor, k_max is the budget."""
    if UNIFORM:
        k = k_max
    else:
        k = tl.minimum(tl.load(budget_ptr + r), k_max)
    return tl.maximum(tl.minimum(k, N), 0)


@triton.jit
def _radix_prefix(hist_ptr, k, PASSES: tl.constexpr, NB: tl.constexpr):
    """Walk the first PASSES histograms of a row: the key prefix of the k-th largest key and the
    number of keys still to take from inside that prefix group."""
    bins = tl.arange(0, NB)
    prefix = tl.zeros([], dtype=tl.uint32)
    k_rem = k
    for p in tl.static_range(PASSES):
        h = tl.load(hist_ptr + p * NB + bins)
        above = tl.sum(h, 0) - tl.cumsum(h, 0)  # keys in bins > i
        b = tl.max(tl.where(above + h >= k_rem, bins, -1), 0)  # k_rem >= 0 so b >= 0
        k_rem = k_rem - tl.sum(tl.where(bins == b, above, 0), 0)
        if p < 2:
            prefix = (prefix << 11) | b.to(tl.uint32)
        else:
            prefix = (prefix << 10) | b.to(tl.uint32)
    return prefix, k_rem


# CHUNK (tokens per program) and C (programs per row) are runtime arguments: a new N, or a new
# power-of-two bucket of N, reuses the compiled kernels. Loop steps (TILE) stay constexpr.

# Scalars that vary with N or the budget are not specialised on (divisibility by 16, == 1), so they
# never pick a new compiled variant either; N itself is (it aligns the rows of scores).
_RUNTIME = ["sink", "window", "k_max", "C", "CHUNK", "stride"]


@triton.jit(do_not_specialize=_RUNTIME[:3] + ["CHUNK"])
def _select_hist_kernel(s_ptr, f_ptr, budget_ptr, hist_ptr, N, sink, window, k_max, CHUNK,
                        PASS: tl.constexpr, TILE: tl.constexpr, NB: tl.constexpr,
                        HAS_FORCED: tl.constexpr, UNIFORM: tl.constexpr):
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    k = _row_budget(budget_ptr, r, N, k_max, UNIFORM)
    hrow = hist_ptr + r * 3 * NB
    prefix, k_rem = _radix_prefix(hrow, k, PASS, NB)
    acc = tl.zeros([NB], dtype=tl.int32)
    for t0 in range(0, CHUNK, TILE):
        offs = c * CHUNK + t0 + tl.arange(0, TILE)
        mask = offs < N
        u = _sortable_keys(s_ptr + r * N, f_ptr + r * N, offs, mask, N, sink, window, HAS_FORCED)
        if PASS == 0:
            match = mask
            digit = u >> 21
        elif PASS == 1:
            match = mask & ((u >> 21) == prefix)
            digit = (u >> 10) & 0x7FF
        else:
            match = mask & ((u >> 10) == prefix)
            digit = u & 0x3FF
        acc += _digit_hist(digit.to(tl.int32), match, NB)
    # integer counts: the order of the adds never matters and the next launch is the barrier,
    # so no fence is needed (the default acq_rel semantics adds one per atomic)
    tl.atomic_add(hrow + PASS * NB + tl.arange(0, NB), acc, sem="relaxed")


@triton.jit(do_not_specialize=_RUNTIME[:5])
def _select_count_kernel(s_ptr, f_ptr, budget_ptr, hist_ptr, cnt_ptr, N, sink, window, k_max, C, CHUNK,
                         TILE: tl.constexpr, NB: tl.constexpr, HAS_FORCED: tl.constexpr,
                         UNIFORM: tl.constexpr):
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    k = _row_budget(budget_ptr, r, N, k_max, UNIFORM)
    t, need_eq = _radix_prefix(hist_ptr + r * 3 * NB, k, 3, NB)
    n_gt = 0
    n_eq = 0
    for t0 in range(0, CHUNK, TILE):
        offs = c * CHUNK + t0 + tl.arange(0, TILE)
        mask = offs < N
        u = _sortable_keys(s_ptr + r * N, f_ptr + r * N, offs, mask, N, sink, window, HAS_FORCED)
        n_gt += tl.sum((mask & (u > t)).to(tl.int32), 0)
        n_eq += tl.sum((mask & (u == t)).to(tl.int32), 0)
    tl.store(cnt_ptr + (r * C + c) * 2, n_gt)
    tl.store(cnt_ptr + (r * C + c) * 2 + 1, n_eq)


@triton.jit
def _copy_kv_rows(k_ptr, v_ptr, ko_ptr, vo_ptr, bh_k, bh_v, skn, svn, src, dst, keep, D,
                  BLOCK_D: tl.constexpr):
    """``ko[dst] = k[src]`` and ``vo[dst] = v[src]`` for the rows where ``keep`` (int64 ``src``
    token and ``dst`` slot per row); both tiles are loaded before either is stored."""
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m2 = keep[:, None] & (d < D)[None, :]
        kv = tl.load(k_ptr + bh_k + src[:, None] * skn + d[None, :], mask=m2)
        vv = tl.load(v_ptr + bh_v + src[:, None] * svn + d[None, :], mask=m2)
        tl.store(ko_ptr + dst[:, None] * D + d[None, :], kv, mask=m2)
        tl.store(vo_ptr + dst[:, None] * D + d[None, :], vv, mask=m2)


@triton.jit(do_not_specialize=_RUNTIME)
def _select_compact_kernel(s_ptr, f_ptr, budget_ptr, hist_ptr, cnt_ptr, N, sink, window, k_max, C, CHUNK,
                           start_ptr, stride, idx_ptr, len_ptr, mask_ptr,
                           k_ptr, v_ptr, ko_ptr, vo_ptr, H, skb, skh, skn, svb, svh, svn, D,
                           TILE: tl.constexpr, NB: tl.constexpr, CB: tl.constexpr,
                           BLOCK_D: tl.constexpr, HAS_FORCED: tl.constexpr, HAS_KV: tl.constexpr,
                           WRITE_MASK: tl.constexpr, UNIFORM: tl.constexpr, HAS_START: tl.constexpr,
                           PROTECTED_ONLY: tl.constexpr):
    """Writes row r's kept tokens at ``start[r]`` (or ``r·stride`` without ``HAS_START``).

    ``PROTECTED_ONLY``: every kept token is protected (no forced tokens, and the protected count
    equals k_r), so nothing is ranked: program c writes output slots ``[c·TILE, (c+1)·TILE)``
    (the first ``sink`` tokens, then the last ``k_r − sink``), with no histogram and no scores read."""
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
        j = c * TILE + tl.arange(0, TILE)
        keep = j < k
        src = tl.where(j < sink, j, j + (N - k)).to(tl.int64)
        dst = base + j.to(tl.int64)
        tl.store(idx_ptr + dst, src, mask=keep)
        if HAS_KV:
            _copy_kv_rows(k_ptr, v_ptr, ko_ptr, vo_ptr, bh_k, bh_v, skn, svn, src, dst, keep, D, BLOCK_D)
    else:
        t, need_eq = _radix_prefix(hist_ptr + r * 3 * NB, k, 3, NB)
        # keys > t and keys == t in the earlier chunks of the row
        gt_before = 0
        eq_seen = 0
        for c0 in range(0, c, CB):
            cs = c0 + tl.arange(0, CB)
            before = cs < c
            gt_before += tl.sum(tl.load(cnt_ptr + (r * C + cs) * 2, mask=before, other=0), 0)
            eq_seen += tl.sum(tl.load(cnt_ptr + (r * C + cs) * 2 + 1, mask=before, other=0), 0)
        slot = gt_before + tl.minimum(eq_seen, need_eq)
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
                tl.store(mask_ptr + r * N + offs, keep.to(tl.int8), mask=mask)
            if HAS_KV:
                _copy_kv_rows(k_ptr, v_ptr, ko_ptr, vo_ptr, bh_k, bh_v, skn, svn, offs.to(tl.int64), dst, keep,
                              D, BLOCK_D)
            slot += tl.sum(keep_i, 0)
            eq_seen += tl.sum(eq, 0)


def _blocks(n: int, rows: int, chunk: Optional[int]):
    """(CHUNK, TILE, COMPACT_TILE): tokens per program, per loop step of the histogram and count
    passes, and per loop step of the compaction (which also moves K/V rows: a smaller tile keeps
    the K and V tiles in registers)."""
    if INTERPRET:  # one program costs ~0.5 ms: few, large programs
        tile = min(next_pow2(n), 4096)
    else:
        tile = 256
    if chunk is None:
        if INTERPRET:
            chunk = tile
        else:  # enough programs to fill ~2 waves of 132 SMs when rows are few
            want = max(1, -(-264 // rows))
            chunk = min(max(next_pow2(-(-n // want)), tile), 32768)
    chunk = next_pow2(chunk)
    tile = min(tile, chunk)
    return chunk, tile, tile if INTERPRET else min(COMPACT_TILE, tile)


COMPACT_TILE = 32  # tokens per step of the compaction on the GPU (K and V tiles of 32 x 128 stay in registers)
COMPACT_WARPS = 8
CB = 64  # earlier chunks' counts summed per step of the compaction's prefix


def _protected_only(n: int, sink: int, window: int, k_max: int, full_rows: bool, has_forced: bool,
                    write_mask: bool) -> bool:
    """Static: every kept token is protected (each row keeps k_max = min(sink + window, n) tokens)."""
    return full_rows and not has_forced and not write_mask and k_max == min(sink + window, n)


@triton_op("tritonkv::select_into",
           mutates_args={"out_idx", "out_lengths", "out_mask", "out_keys", "out_values", "hist"})
def select_into(scores: torch.Tensor, budgets: torch.Tensor, forced: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, out_start: torch.Tensor, out_idx: torch.Tensor, out_lengths: torch.Tensor,
                out_mask: torch.Tensor, out_keys: torch.Tensor, out_values: torch.Tensor, hist: torch.Tensor,
                sink: int, window: int, k_max: int, budget: int, full_rows: bool, chunk: int) -> None:
    """The raw op. Empty ``forced``/``keys``/``out_mask`` tensors mean "absent".

    scores fp32 [R, N] contiguous; budgets int32 [R], or empty: every row's budget is the int
    ``budget``; forced uint8 [R, N]; keys/values [B, H, N, D] (last dim unit-stride); out_start
    int64 [R] (first slot of each row in the outputs), or empty: the padded layout, row r at
    ``r·k_max``; out_idx int64 [T]; out_lengths int32 [R]; out_mask int8 [R, N]; out_keys/out_values
    [T, D]. ``hist``: empty, or int32 [R, 3, NB] holding the first radix pass of these scores
    (``score_hist0``) in ``hist[:, 0]`` and zeros in ``hist[:, 1:]`` (then that pass is skipped).
    ``full_rows``: a static promise that the outputs are the padded layout (``out_start[r] =
    r·k_max``, ``T = R·k_max``) and every row keeps ``k_max <= N`` tokens (budgets >= k_max); the
    PyTorch body then gathers straight into the outputs, and the kernels copy protected rows directly
    when they are all that is kept. CPU tensors run ``_select_torch`` (outside the Triton interpreter).
    """
    R, N = scores.shape
    if not use_triton(scores):
        if budgets.numel() == 0:
            budgets = torch.full((R,), budget, dtype=torch.int32, device=scores.device)
        if out_start.numel() == 0:
            out_start = torch.arange(R, device=scores.device, dtype=torch.int64) * k_max
        return _select_torch(scores, budgets, forced, keys, values, out_start, out_idx, out_lengths, out_mask,
                             out_keys, out_values, sink, window, k_max, full_rows)
    CHUNK, TILE, CTILE = _blocks(N, R, chunk if chunk > 0 else None)
    C = triton.cdiv(N, CHUNK)
    has_forced = forced.numel() > 0
    has_kv = keys.numel() > 0
    write_mask = out_mask.numel() > 0
    uniform = budgets.numel() == 0
    kb = min(budget, k_max) if uniform else k_max  # the kernels' k_max: the uniform budget folded in
    if has_kv:
        H, D = keys.shape[1], keys.shape[3]
        kstr = (keys.stride(0), keys.stride(1), keys.stride(2))
        vstr = (values.stride(0), values.stride(1), values.stride(2))
    else:
        H, D, kstr, vstr = 1, 1, (0, 0, 0), (0, 0, 0)
    flags = dict(HAS_FORCED=has_forced, UNIFORM=uniform)
    compact = dict(NB=NB, CB=CB, BLOCK_D=min(next_pow2(D), 128), HAS_KV=has_kv, WRITE_MASK=write_mask,
                   HAS_START=out_start.numel() > 0, num_warps=COMPACT_WARPS, **flags)
    tail = (out_start, k_max, out_idx, out_lengths, out_mask, keys, values, out_keys, out_values, H, *kstr, *vstr, D)
    if _protected_only(N, sink, window, k_max, full_rows, has_forced, write_mask):
        launch(_select_compact_kernel, (max(triton.cdiv(k_max, CTILE), 1), R), scores, forced, budgets, hist, hist,
               N, sink, window, kb, 1, CHUNK, *tail, TILE=CTILE, PROTECTED_ONLY=True, **compact)
        return
    common = (N, sink, window, kb)
    if hist.numel() == 0:
        hist = torch.zeros((R, 3, NB), dtype=torch.int32, device=scores.device)
        passes = range(3)
    else:
        passes = range(1, 3)
    for p in passes:
        launch(_select_hist_kernel, (C, R), scores, forced, budgets, hist, *common, CHUNK,
               PASS=p, TILE=TILE, NB=NB, **flags)
    cnt = torch.empty((R, C, 2), dtype=torch.int32, device=scores.device)
    launch(_select_count_kernel, (C, R), scores, forced, budgets, hist, cnt, *common, C, CHUNK,
           TILE=TILE, NB=NB, **flags)
    launch(_select_compact_kernel, (C, R), scores, forced, budgets, hist, cnt, *common, C, CHUNK, *tail,
           TILE=CTILE, PROTECTED_ONLY=False, **compact)


# ------------------------------------------------------------------------------------------------
# The first radix pass, fused into a scoring kernel. A policy whose score kernel also histograms its
# scores (``score_hist0``) registers the histogram with the scores; the next ``select_kv`` of those
# very scores (same tensor, not modified since: its version counter is unchanged) with the same sink
# and window and no ``forced`` mask takes it and skips the pass. Anything else (another tensor,
# different protection, an in-place change, tracing) runs the full pipeline: same result.

_pass0: list = [None]  # (weakref to the scores, their version, hist, sink, window)


def pass0_buffer(rows: int, device, zeroed: bool = True) -> torch.Tensor:
    """An int32 ``[rows, 3, NB]`` histogram for ``select_into``'s ``hist`` (zeroed, or to be zeroed
    by a kernel with ``zero_hist`` before the scoring kernel adds into it)."""
    return (torch.zeros if zeroed else torch.empty)((rows, 3, NB), dtype=torch.int32, device=device)


def protect_for(policy, keys, budget):
    """``(sink, window)`` that ``policy`` protects in rows of ``keys [B, H, N, D]`` at an int
    ``budget`` (what ``compress()`` passes the select), or None without one: a policy's ``score``
    then counts the select's first pass for exactly that protection."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0 or keys.dim() != 4:
        return None
    n = keys.shape[2]
    return policy.protected(n, min(budget, n))


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter: never remembered
        return None


def remember_pass0(scores: torch.Tensor, hist: torch.Tensor, sink: int, window: int) -> None:
    """Register ``hist`` (``select_into``'s layout, pass 0 of ``scores`` with these protected tokens)
    for the next select of ``scores``. Eager calls only."""
    v = _version(scores) if type(scores) is torch.Tensor and not torch.compiler.is_compiling() else None
    _pass0[0] = None if v is None else (weakref.ref(scores), v, hist, int(sink), int(window))


def _take_pass0(scores, sink: int, window: int, forced) -> torch.Tensor:
    """The registered pass-0 histogram of ``scores`` (then forgotten), or an empty tensor."""
    m = _pass0[0]
    if m is not None and type(scores) is torch.Tensor and not torch.compiler.is_compiling():
        ref, v, hist, s, w = m
        obj = ref()
        if obj is None:
            _pass0[0] = None
        elif obj is scores:
            _pass0[0] = None
            if forced is None and (s, w) == (sink, window) and _version(scores) == v:
                return hist
    return torch.empty(0, dtype=torch.int32, device=scores.device)


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
    prot = (pos < sink) | (pos >= N - window)
    if forced.numel() > 0:
        prot = prot | (forced != 0)
    return torch.where(prot, ((2 ** 32 - 1) << _IDX_BITS) - 2 ** 62 + low, (signed.to(torch.int64) << _IDX_BITS) + low)


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
    start: torch.Tensor  # int64 [R]
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
        return budget.reshape(rows).to(device=device, dtype=torch.int32).contiguous()
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
    rows = scores.numel() // scores.shape[-1] if scores.shape[-1] else math.prod(scores.shape[:-1])  # N = 0 too
    return scores.reshape(rows, scores.shape[-1]).to(torch.float32).contiguous()


def _forced_2d(forced, shape, device) -> torch.Tensor:
    if forced is None:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if not isinstance(forced, torch.Tensor) or forced.dtype.is_floating_point or forced.dtype.is_complex:
        raise TypeError(f"forced must be a bool (or integer) tensor shaped like scores, got "
                        f"{getattr(forced, 'dtype', type(forced).__name__)}")
    if forced.numel() != shape[0] * shape[1]:
        raise ValueError(f"forced must have the shape of scores {tuple(shape)}, got {tuple(forced.shape)}")
    check_device("forced", forced, device, "scores", cpu_ok=True)
    return forced.reshape(shape).to(device=device, dtype=torch.uint8).contiguous()


def _static_args(k_max, chunk) -> int:
    """Checked ``k_max`` (int >= 0) and ``chunk`` (None or an int >= 0; 0 = automatic)."""
    if chunk is not None:
        check_int("chunk", chunk)
    return check_int("k_max", k_max)


def _full_rows(budgets, n: int, k_max: int) -> bool:
    """Static: an int budget keeps ``k_max <= n`` tokens in every row (``select_into``'s ``full_rows``)."""
    return isinstance(budgets, int) and not isinstance(budgets, bool) and k_max <= n and min(budgets, n) >= k_max


def _empty(device, dtype=torch.float32):
    return torch.empty(0, dtype=dtype, device=device)


def _budget_args(budget, rows: int, device):
    """``select_into``'s ``(budgets, budget)``: a tensor budget as ``budget_tensor``; an int one as an
    empty tensor and the int (no device fill)."""
    if isinstance(budget, torch.Tensor):
        return budget_tensor(budget, rows, device), 0
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"budget must be an int or an int tensor, got {type(budget).__name__}")
    return _empty(device, torch.int32), check_int("budget", budget)


def _indices(rows: int, k_max: int, full: bool, device) -> torch.Tensor:
    """int64 ``[rows·k_max]`` output indices: unwritten when every slot is written (``full``), else -1."""
    if full:
        return torch.empty((rows * k_max,), dtype=torch.int64, device=device)
    return torch.full((rows * k_max,), -1, dtype=torch.int64, device=device)


def select_indices(scores, budgets, k_max: int, *, sink: int = 0, window: int = 0, forced=None,
                   with_mask: bool = False, chunk: Optional[int] = None):
    """Kept indices only. Returns ``(indices int64 [..., k_max] padded with -1, lengths int32 [...])``
    and, with ``with_mask``, a bool keep-mask shaped like ``scores``."""
    s = _scores_2d(scores)
    R, N = s.shape
    dev = s.device
    k_max = _static_args(k_max, chunk)
    check_protected(budgets, N, k_max, sink, window)
    b, bi = _budget_args(budgets, R, dev)
    full = _full_rows(budgets, N, k_max)
    idx = _indices(R, k_max, full and R > 0 and N > 0, dev)
    lengths = torch.empty(R, dtype=torch.int32, device=dev)
    mask = torch.empty((R, N) if with_mask else (0,), dtype=torch.int8, device=dev)
    if N > 0 and R > 0:  # empty out_start: the padded layout
        select_into(s, b, _forced_2d(forced, (R, N), dev), _empty(dev), _empty(dev), _empty(dev, torch.int64), idx,
                    lengths, mask, _empty(dev), _empty(dev), _empty(dev, torch.int32), sink, window, k_max, bi, full,
                    chunk or 0)
    else:
        lengths.zero_()
        mask.zero_()
    lead = scores.shape[:-1]
    out = (idx.view(*lead, k_max), lengths.view(lead))
    return out + (mask.view(scores.shape).bool(),) if with_mask else out


def select_mask(scores, budgets, *, sink: int = 0, window: int = 0, forced=None, chunk: Optional[int] = None):
    """Bool keep-mask shaped like ``scores`` (for allocators and score transforms)."""
    n = scores.shape[-1]
    return select_indices(scores, budgets, n, sink=sink, window=window, forced=forced, with_mask=True, chunk=chunk)[2]


def select_kv(scores, budgets, keys, values, k_max: int, *, sink: int = 0, window: int = 0, forced=None,
              out: Optional[Out] = None, chunk: Optional[int] = None):
    """Select and gather K/V.

    ``scores`` fp32 ``[B, H, N]``; ``keys``/``values`` ``[B, H, N, D]``; ``budgets`` an int or int32
    ``[B*H]``; ``k_max`` the static output capacity per row (>= every budget that must fit).

    Without ``out``: returns ``(keys [B,H,k_max,D], values, indices int64 [B,H,k_max], lengths
    int32 [B,H])``; rows kept shorter than ``k_max`` are zero-padded (indices -1). With ``out``:
    writes row r at ``out.start[r]`` of the flattened ``out`` tensors and returns ``out``.
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
    if out is None:
        alloc = torch.empty if full else torch.zeros
        ko = alloc((R * k_max, D), dtype=keys.dtype, device=dev)
        vo = alloc((R * k_max, values.shape[-1]), dtype=values.dtype, device=dev)
        idx = _indices(R, k_max, full and R > 0 and N > 0, dev)
        lengths = torch.empty(R, dtype=torch.int32, device=dev)
        dst = Out(ko, vo, idx, _empty(dev, torch.int64), lengths)  # empty start: the padded layout
    else:
        dst = out
    if N > 0 and R > 0:
        hist = _take_pass0(scores, sink, window, forced)
        select_into(s, b, _forced_2d(forced, (R, N), dev), keys, values, dst.start, dst.indices, dst.lengths,
                    _empty(dev, torch.int8), dst.keys, dst.values, hist, sink, window, k_max, bi, full, chunk or 0)
    else:
        dst.lengths.zero_()
    if out is not None:
        return out
    return (dst.keys.view(B, H, k_max, D), dst.values.view(B, H, k_max, values.shape[-1]),
            dst.indices.view(B, H, k_max), dst.lengths.view(B, H))
