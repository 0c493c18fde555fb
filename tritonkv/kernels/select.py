"""The shared select + compact kernel: the only top-k in tritonkv.

Per row r (= b·H_kv + h) of fp32 scores, keep exactly ``k_r = min(budget[r], N, k_max)`` tokens:
the protected ones (the first ``sink``, the last ``window``, and any ``forced``) and then the
highest scores, ties to the lower index, NaN lowest, -0 == +0. Kept tokens are written in
ascending original order, with their int64 indices, and the K/V rows are gathered in the same
pass. Budgets are an int32 device tensor that the host never reads.

Pipeline (``shared/notes/kernels.md`` §3), each launch on grid (chunks, rows) so a long row is
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

from ._common import INTERPRET, check_device, check_int, check_kv_tensor, launch, next_pow2, triton_op, use_triton

NB = 2048  # bins per radix pass (digits of 11, 11 and 10 bits)


@triton.jit
def _sortable_keys(s_ptr, f_ptr, offs, mask, N, sink, window, HAS_FORCED: tl.constexpr):
    """Order-preserving uint32 keys of one tile of scores; protected tokens get the maximum."""
    s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.where(s != s, float("-inf"), s)  # NaN ranks lowest
    s = tl.where(s == 0.0, 0.0, s)  # -0 == +0
    b = s.to(tl.uint32, bitcast=True)
    u = tl.where((b >> 31) != 0, ~b, b | 0x80000000)
    prot = (offs < sink) | (offs >= N - window)
    if HAS_FORCED:
        prot = prot | (tl.load(f_ptr + offs, mask=mask, other=0) != 0)
    return tl.where(prot, 0xFFFFFFFF, u)


@triton.jit
def _row_budget(budget_ptr, r, N, k_max):
    k = tl.load(budget_ptr + r)
    return tl.maximum(tl.minimum(tl.minimum(k, N), k_max), 0)


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


@triton.jit
def _select_hist_kernel(s_ptr, f_ptr, budget_ptr, hist_ptr, N, sink, window, k_max,
                        PASS: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
                        NB: tl.constexpr, HAS_FORCED: tl.constexpr):
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    k = _row_budget(budget_ptr, r, N, k_max)
    hrow = hist_ptr + r * 3 * NB
    prefix, k_rem = _radix_prefix(hrow, k, PASS, NB)
    bins = tl.arange(0, NB)
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
        digit = tl.where(match, digit, 0).to(tl.int32)
        # non-matching lanes were counted in bin 0: take them out again
        n_out = TILE - tl.sum(match.to(tl.int32), 0)
        acc += tl.histogram(digit, NB) - tl.where(bins == 0, n_out, 0)
    # integer counts: the order of the adds never matters and the next launch is the barrier,
    # so no fence is needed (the default acq_rel semantics adds one per atomic)
    tl.atomic_add(hrow + PASS * NB + bins, acc, sem="relaxed")


@triton.jit
def _select_count_kernel(s_ptr, f_ptr, budget_ptr, hist_ptr, cnt_ptr, N, sink, window, k_max, C,
                         CHUNK: tl.constexpr, TILE: tl.constexpr, NB: tl.constexpr,
                         HAS_FORCED: tl.constexpr):
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    k = _row_budget(budget_ptr, r, N, k_max)
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
def _select_compact_kernel(s_ptr, f_ptr, budget_ptr, hist_ptr, cnt_ptr, N, sink, window, k_max, C,
                           start_ptr, idx_ptr, len_ptr, mask_ptr,
                           k_ptr, v_ptr, ko_ptr, vo_ptr, H, skb, skh, skn, svb, svh, svn, D,
                           CHUNK: tl.constexpr, TILE: tl.constexpr, NB: tl.constexpr, CP2: tl.constexpr,
                           BLOCK_D: tl.constexpr, HAS_FORCED: tl.constexpr, HAS_KV: tl.constexpr,
                           WRITE_MASK: tl.constexpr):
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    k = _row_budget(budget_ptr, r, N, k_max)
    t, need_eq = _radix_prefix(hist_ptr + r * 3 * NB, k, 3, NB)
    cs = tl.arange(0, CP2)
    before = cs < c
    gt_before = tl.sum(tl.load(cnt_ptr + (r * C + cs) * 2, mask=before, other=0), 0)
    eq_seen = tl.sum(tl.load(cnt_ptr + (r * C + cs) * 2 + 1, mask=before, other=0), 0)
    slot = gt_before + tl.minimum(eq_seen, need_eq)
    if c == 0:
        tl.store(len_ptr + r, k)
    base = tl.load(start_ptr + r)  # int64 first output slot of this row
    bh_k = (r // H) * skb + (r % H) * skh
    bh_v = (r // H) * svb + (r % H) * svh
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
            src = offs.to(tl.int64)
            for d0 in range(0, D, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                m2 = keep[:, None] & (d < D)[None, :]
                kv = tl.load(k_ptr + bh_k + src[:, None] * skn + d[None, :], mask=m2)
                tl.store(ko_ptr + dst[:, None] * D + d[None, :], kv, mask=m2)
                vv = tl.load(v_ptr + bh_v + src[:, None] * svn + d[None, :], mask=m2)
                tl.store(vo_ptr + dst[:, None] * D + d[None, :], vv, mask=m2)
        slot += tl.sum(keep_i, 0)
        eq_seen += tl.sum(eq, 0)


def _blocks(n: int, rows: int, chunk: Optional[int]):
    """(CHUNK, TILE): tokens per program and per loop step."""
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
    return chunk, min(tile, chunk)


@triton_op("tritonkv::select_into", mutates_args={"out_idx", "out_lengths", "out_mask", "out_keys", "out_values"})
def select_into(scores: torch.Tensor, budgets: torch.Tensor, forced: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, out_start: torch.Tensor, out_idx: torch.Tensor, out_lengths: torch.Tensor,
                out_mask: torch.Tensor, out_keys: torch.Tensor, out_values: torch.Tensor,
                sink: int, window: int, k_max: int, full_rows: bool, chunk: int) -> None:
    """The raw op. Empty ``forced``/``keys``/``out_mask`` tensors mean "absent".

    scores fp32 [R, N] contiguous; budgets int32 [R]; forced uint8 [R, N]; keys/values [B, H, N, D]
    (last dim unit-stride); out_start int64 [R] (first slot of each row in the outputs);
    out_idx int64 [T]; out_lengths int32 [R]; out_mask int8 [R, N]; out_keys/out_values [T, D].
    ``full_rows``: a static promise that the outputs are the padded layout (``out_start[r] =
    r·k_max``, ``T = R·k_max``) and every row keeps ``k_max <= N`` tokens (budgets >= k_max); the
    PyTorch body then gathers straight into the outputs (the kernels need no hint).
    CPU tensors run ``_select_torch`` (outside the Triton interpreter).
    """
    if not use_triton(scores):
        return _select_torch(scores, budgets, forced, keys, values, out_start, out_idx, out_lengths, out_mask,
                             out_keys, out_values, sink, window, k_max, full_rows)
    R, N = scores.shape
    CHUNK, TILE = _blocks(N, R, chunk if chunk > 0 else None)
    C = triton.cdiv(N, CHUNK)
    has_forced = forced.numel() > 0
    has_kv = keys.numel() > 0
    write_mask = out_mask.numel() > 0
    hist = torch.zeros((R, 3, NB), dtype=torch.int32, device=scores.device)
    cnt = torch.empty((R, C, 2), dtype=torch.int32, device=scores.device)
    common = (N, sink, window, k_max)
    for p in range(3):
        launch(_select_hist_kernel, (C, R), scores, forced, budgets, hist, *common,
               PASS=p, CHUNK=CHUNK, TILE=TILE, NB=NB, HAS_FORCED=has_forced)
    launch(_select_count_kernel, (C, R), scores, forced, budgets, hist, cnt, *common, C,
           CHUNK=CHUNK, TILE=TILE, NB=NB, HAS_FORCED=has_forced)
    if has_kv:
        H, D = keys.shape[1], keys.shape[3]
        kstr = (keys.stride(0), keys.stride(1), keys.stride(2))
        vstr = (values.stride(0), values.stride(1), values.stride(2))
    else:
        H, D, kstr, vstr = 1, 1, (0, 0, 0), (0, 0, 0)
    launch(_select_compact_kernel, (C, R), scores, forced, budgets, hist, cnt, *common, C,
           out_start, out_idx, out_lengths, out_mask, keys, values, out_keys, out_values,
           H, *kstr, *vstr, D,
           CHUNK=CHUNK, TILE=TILE, NB=NB, CP2=max(next_pow2(C), 2),
           BLOCK_D=min(next_pow2(D), 128), HAS_FORCED=has_forced, HAS_KV=has_kv, WRITE_MASK=write_mask)


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


def select_indices(scores, budgets, k_max: int, *, sink: int = 0, window: int = 0, forced=None,
                   with_mask: bool = False, chunk: Optional[int] = None):
    """Kept indices only. Returns ``(indices int64 [..., k_max] padded with -1, lengths int32 [...])``
    and, with ``with_mask``, a bool keep-mask shaped like ``scores``."""
    s = _scores_2d(scores)
    R, N = s.shape
    dev = s.device
    k_max = _static_args(k_max, chunk)
    check_protected(budgets, N, k_max, sink, window)
    b = budget_tensor(budgets, R, dev)
    idx = torch.full((R * k_max,), -1, dtype=torch.int64, device=dev)
    lengths = torch.empty(R, dtype=torch.int32, device=dev)
    mask = torch.empty((R, N) if with_mask else (0,), dtype=torch.int8, device=dev)
    start = torch.arange(R, device=dev, dtype=torch.int64) * k_max
    if N > 0 and R > 0:
        select_into(s, b, _forced_2d(forced, (R, N), dev), _empty(dev), _empty(dev), start, idx, lengths,
                    mask, _empty(dev), _empty(dev), sink, window, k_max, _full_rows(budgets, N, k_max), chunk or 0)
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
    b = budget_tensor(budgets, R, dev)
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    full = out is None and _full_rows(budgets, N, k_max)
    if out is None:
        alloc = torch.empty if full else torch.zeros
        ko = alloc((R * k_max, D), dtype=keys.dtype, device=dev)
        vo = alloc((R * k_max, values.shape[-1]), dtype=values.dtype, device=dev)
        idx = torch.full((R * k_max,), -1, dtype=torch.int64, device=dev)
        start = torch.arange(R, device=dev, dtype=torch.int64) * k_max
        lengths = torch.empty(R, dtype=torch.int32, device=dev)
        dst = Out(ko, vo, idx, start, lengths)
    else:
        dst = out
    if N > 0 and R > 0:
        select_into(s, b, _forced_2d(forced, (R, N), dev), keys, values, dst.start, dst.indices, dst.lengths,
                    _empty(dev, torch.int8), dst.keys, dst.values, sink, window, k_max, full, chunk or 0)
    else:
        dst.lengths.zero_()
    if out is not None:
        return out
    return (dst.keys.view(B, H, k_max, D), dst.values.view(B, H, k_max, values.shape[-1]),
            dst.indices.view(B, H, k_max), dst.lengths.view(B, H))
