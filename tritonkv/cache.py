"""``RaggedKV``: per-head KV caches of different lengths, stored without padding.

Per layer, keys and values are flat ``[T_cap, D]`` tensors. Row ``r = b·H_kv + h`` owns
``[row_start[r], row_start[r] + length[r])`` (``row_start`` int64 ``[R+1]``, ``length`` int32
``[R]``); the gap up to ``row_start[r+1]`` is slack, so a decode step appends one token per row in
place and copies nothing else. Each row's capacity is ``length + slack`` rounded up to ``align``
(16) tokens. The original position of every kept token (int64, -1 in the slack) is kept beside it:
policies and later compressions need it. The padded ``[B, H, cap, D]`` layout is the
equal-capacity special case; ``tritonkv.kernels.decode_attention`` serves both. The append op runs
a Triton kernel on CUDA and a vectorised PyTorch body on the CPU (``_ragged_append_torch``).

Static sizes. Shapes never depend on tensor values, so nothing here reads a budget back to the
host: the flat capacity ``T_cap`` is a static int. ``from_selection`` takes it from ``total``, a
static upper bound on the number of kept tokens of the layer (the allocator's total, e.g.
``B·H_kv·k``), and adds the worst-case slack and rounding, ``R·(slack + align - 1)``; without
``total`` it uses ``R·k_max`` (every row full), which is safe but frees no memory. A wrong (too
small) ``total`` cannot write out of bounds: rows past ``T_cap`` keep fewer tokens. ``T_cap`` is at
least 1, also when nothing is kept: the storage is never empty. Budgets given as host ints (a tuple)
lay the rows out on the host, and one int budget puts row r at ``r·cap``: both exact, with nothing
counted on the device. A budget tensor is laid out on the device in one launch
(``ragged_layout``: the rows' starts as a running sum of their capacities, clamped at ``T_cap``).
``from_kept`` copies tokens already chosen (AdaKV's winners, the same count in every batch row) with
``T_cap = B·K + R·slack``, the starts and lengths computed on the device. Host reads happen only in
``repack`` (when some row is full), ``to_padded()`` without ``cap``, and ``check()``.
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch
import triton
import triton.language as tl

from .kernels import select as _select
from .kernels._common import (FLOAT_DTYPES, INTERPRET, cdiv, check_device, check_int, check_kv_tensor, launch,
                              next_pow2, on_host, pdl_wait, triton_op, use_triton)


@triton.jit
def _ragged_append_kernel(k_ptr, v_ptr, ko_ptr, vo_ptr, pos_ptr, start_ptr, len_ptr, next_ptr,
                          H, D, skb, skh, svb, svh, sko, svo, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Row r: copy the new token of (b, h) to ``row_start[r] + length[r]`` if the row has room,
    record its position and bump ``length`` and the next position (one program per row: no race)."""
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    start = tl.load(start_ptr + r)
    end = tl.load(start_ptr + r + 1)
    n = tl.load(len_ptr + r)
    slot = start + n.to(tl.int64)
    if slot < end:
        b = r // H
        h = r % H
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        kv = tl.load(k_ptr + b * skb + h * skh + d, mask=dm)  # a plain copy: no arithmetic
        tl.store(ko_ptr + slot * sko + d, kv, mask=dm)
        vv = tl.load(v_ptr + b * svb + h * svh + d, mask=dm)
        tl.store(vo_ptr + slot * svo + d, vv, mask=dm)
        p = tl.load(next_ptr + r)
        tl.store(pos_ptr + slot, p)
        tl.store(next_ptr + r, p + 1)
        tl.store(len_ptr + r, n + 1)


@triton_op("tritonkv::ragged_append", mutates_args={"keys", "values", "positions", "length", "next_position"})
def ragged_append(k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  positions: torch.Tensor, row_start: torch.Tensor, length: torch.Tensor,
                  next_position: torch.Tensor, num_heads: int) -> None:
    """The raw op: ``k, v [B, H, 1, D]`` (unit-stride last dim) appended in place to the flat rows.
    CPU tensors run ``_ragged_append_torch`` (outside the Triton interpreter)."""
    if not use_triton(k):
        return _ragged_append_torch(k, v, keys, values, positions, row_start, length, next_position)
    R = k.shape[0] * k.shape[1]
    D = k.shape[3]
    if R > 0:
        launch(_ragged_append_kernel, (R,), k, v, keys, values, positions, row_start, length, next_position,
               num_heads, D, k.stride(0), k.stride(1), v.stride(0), v.stride(1), keys.stride(0), values.stride(0),
               BLOCK_D=next_pow2(D))


def _ragged_append_torch(k, v, keys, values, positions, row_start, length, next_position) -> None:
    """``ragged_append`` in PyTorch: row r's token goes to ``row_start[r] + length[r]`` when that slot
    is below ``row_start[r+1]`` (one ``index_copy_`` per tensor, rows without room redirected with
    ``select.redirect_invalid``), then ``length`` and ``next_position`` grow by one where it fit."""
    B, H, _, D = k.shape
    R = B * H
    if R == 0 or keys.shape[0] == 0:
        return
    slot = row_start[:R] + length
    room = slot < row_start[1:R + 1]
    if on_host(room) and bool(room.all()):  # eagerly on the CPU, every row has room (the usual step): plain copies
        keys.index_copy_(0, slot, k.reshape(R, D))
        values.index_copy_(0, slot, v.reshape(R, D))
        positions.index_copy_(0, slot, next_position)
        next_position.add_(1)
        length.add_(1)
        return
    pick, any_room = _select.redirect_invalid(room)
    dst = torch.where(any_room, slot[pick], 0)
    slot0 = [t[:1].clone() for t in (keys, values, positions)]
    keys.index_copy_(0, dst, k.reshape(R, D)[pick])
    values.index_copy_(0, dst, v.reshape(R, D)[pick])
    positions.index_copy_(0, dst, next_position[pick])
    for t, s0 in zip((keys, values, positions), slot0):  # no row had room: slot 0 was overwritten, put it back
        t[:1].copy_(torch.where(any_room, t[:1], s0))
    next_position.add_(room.to(next_position.dtype))
    length.add_(room.to(length.dtype))


@triton.jit
def _count_below(row_ptr, K, x, P: tl.constexpr):
    """How many of the ``K`` ascending int64 entries at ``row_ptr`` are below ``x``: a P-ary search that
    loads ``P`` probes per step (two or three dependent loads for any realistic ``K``)."""
    lo = tl.full([], 0, tl.int64)  # every entry before lo is below x
    width = tl.full([], 0, tl.int64) + K  # the count lies in [lo, lo + width]
    p = tl.arange(0, P).to(tl.int64)
    while width > 0:
        step = (width + P - 1) // P
        q = lo + (p + 1) * step - 1  # probe i closes the i-th of P slices of [lo, lo + width)
        ok = q < lo + width
        below = tl.sum((ok & (tl.load(row_ptr + q, mask=ok, other=0) < x)).to(tl.int64), 0)
        lo += below * step
        width = tl.minimum(step - 1, width - below * step)
    return lo


@triton.jit(do_not_specialize=["K", "slack", "SPAN"])
def _ragged_from_kept_kernel(idx_ptr, k_ptr, v_ptr, ko_ptr, vo_ptr, pos_ptr, start_ptr, len_ptr, next_ptr,
                             H, N, K, slack, SPAN, skb, skh, skn, svb, svh, svn, D,
                             BATCH: tl.constexpr, BLOCK_D: tl.constexpr, P: tl.constexpr, PDL: tl.constexpr):
    """Row r = b·H + h of a ragged cache from batch row b's kept tokens ``idx[b, :K]`` (ascending flat
    indices h·N + j): the row's tokens are the entries in ``[h·N, (h+1)·N)``, found by two searches; it
    starts at ``b·K + (kept tokens of the heads before h) + r·slack`` (a closed form: no scan over rows).
    Program c copies row slots ``[c·SPAN, (c+1)·SPAN)`` (K/V and positions; -1 in the slack); program 0
    writes the row's start, length and next position (and the last row the end of the storage)."""
    pdl_wait(PDL)
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    b = r // H
    h = r % H
    row = idx_ptr + b * K
    lo = _count_below(row, K, h * N, P)
    n = _count_below(row, K, (h + 1) * N, P) - lo
    start = b * K + lo + r * slack
    if c == 0:
        tl.store(start_ptr + r, start)
        tl.store(len_ptr + r, n.to(tl.int32))
        tl.store(next_ptr + r, tl.full([], 0, tl.int64) + N)
        if r == tl.num_programs(1) - 1:
            tl.store(start_ptr + r + 1, start + n + slack)
    bh_k = b * skb + h * skh
    bh_v = b * svb + h * svh
    for j0 in range(c * SPAN, tl.minimum((c + 1) * SPAN, n + slack), BATCH):
        j = j0 + tl.arange(0, BATCH).to(tl.int64)
        keep = j < n
        src = tl.load(row + lo + j, mask=keep, other=0) - h * N
        dst = start + j
        tl.store(pos_ptr + dst, tl.where(keep, src, -1), mask=j < n + slack)
        _select._copy_kv_rows(k_ptr, v_ptr, ko_ptr, vo_ptr, bh_k, bh_v, skn, svn, src, dst, keep, D, BLOCK_D)


KEPT_BATCH = 64  # rows copied per step of ``_ragged_from_kept_kernel``
KEPT_PROBES = 1024  # probes per step of its searches


@triton_op("tritonkv::ragged_from_kept",
           mutates_args={"out_keys", "out_values", "positions", "row_start", "length", "next_position"})
def ragged_from_kept(kept: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out_keys: torch.Tensor,
                     out_values: torch.Tensor, positions: torch.Tensor, row_start: torch.Tensor, length: torch.Tensor,
                     next_position: torch.Tensor, slack: int, longest: int) -> None:
    """The raw op: ragged rows ``[T = B·K + B·H·slack, D]`` from ``kept`` int64 ``[B, K]`` (each batch row's kept
    tokens as ascending flat indices ``h·N + j`` into ``keys``/``values [B, H, N, D]``, unit-stride last dim);
    ``longest`` (static) bounds every row's length. CPU tensors run ``_ragged_from_kept_torch`` (outside the
    Triton interpreter)."""
    if not use_triton(keys):
        return _ragged_from_kept_torch(kept, keys, values, out_keys, out_values, positions, row_start, length,
                                       next_position, slack)
    B, H, N, D = keys.shape
    span = max(next_pow2(longest + slack), KEPT_BATCH) if INTERPRET else 1024
    launch(_ragged_from_kept_kernel, (max(cdiv(longest + slack, span), 1), B * H), kept, keys, values, out_keys,
           out_values, positions, row_start, length, next_position, H, N, kept.shape[1], slack, span,
           *keys.stride()[:3], *values.stride()[:3], D, BATCH=KEPT_BATCH, BLOCK_D=min(next_pow2(D), 128),
           P=KEPT_PROBES, num_warps=_select.COMPACT_WARPS)


def _ragged_from_kept_torch(kept, keys, values, out_keys, out_values, positions, row_start, length, next_position,
                            slack: int) -> None:
    """``ragged_from_kept`` in PyTorch, with static shapes: every slot ``t`` of the storage finds its row (a
    search in the row starts) and gathers its token, or holds -1 in the slack."""
    B, H, N, D = keys.shape
    R, K = B * H, kept.shape[1]
    dev = keys.device
    first = torch.searchsorted(kept, (torch.arange(H + 1, device=dev) * N).expand(B, H + 1).contiguous())
    lo = first[:, :-1].reshape(R)
    n = (first[:, 1:] - first[:, :-1]).reshape(R)
    r = torch.arange(R, device=dev)
    start = (r // H) * K + lo + r * slack
    row_start.copy_(torch.cat([start, (start[-1:] + n[-1:] + slack)]))
    length.copy_(n)
    next_position.fill_(N)
    t = torch.arange(positions.shape[0], device=dev)
    row = torch.searchsorted(row_start[1:], t, right=True).clamp(max=R - 1)
    j = t - row_start[row]
    valid = j < n[row]
    src = kept.reshape(-1)[((row // H) * K + lo[row] + j).clamp(0, max(B * K - 1, 0))] - (row % H) * N
    src = torch.where(valid, src, 0)
    positions.copy_(torch.where(valid, src, -1))
    for t, out in ((keys, out_keys), (values, out_values)):  # a plain row gather: fast on the CPU
        flat = _select._rows(t, src.new_zeros(R, 0))[0]
        sb, sh, sn, _ = t.stride()
        torch.index_select(flat, 0, (row // H) * sb + (row % H) * sh + src * sn, out=out)


_UPLOADS: dict = {}  # (device, values) -> (pinned host copy, device copy)


def upload(values: tuple, device, dtype=torch.int32) -> torch.Tensor:
    """A fresh 1-D ``device`` tensor of host ints ``values`` without a host sync: the first upload of given values
    goes through pinned memory (``non_blocking``), later ones copy the cached device tensor on the device, so a
    CUDA graph captured after one eager call records a device copy only (the CPU keeps a cached tensor too)."""
    device = torch.device(device)
    key = (str(device), dtype, values)
    hit = _UPLOADS.get(key)
    if hit is None:
        if len(_UPLOADS) >= 512:
            _UPLOADS.pop(next(iter(_UPLOADS)))
        host = torch.tensor(values, dtype=dtype)
        if device.type != "cpu":
            host = host.pin_memory()
        hit = _UPLOADS[key] = (host, host.to(device, non_blocking=True))
    return hit[1].clone()


def _round_up(x: torch.Tensor, align: int) -> torch.Tensor:
    return (x + (align - 1)) // align * align


def _starts(cap: torch.Tensor) -> torch.Tensor:
    """int64 ``[R+1]``: 0 then the inclusive cumsum of the row capacities (on the device)."""
    return torch.cat([cap.new_zeros(1), cap.cumsum(0)]).to(torch.int64)


@triton.jit(do_not_specialize=["k_max", "slack", "align", "T", "N"])
def _ragged_layout_kernel(b_ptr, start_ptr, len_ptr, next_ptr, R, k_max, slack, align, T, N, BLOCK_R: tl.constexpr,
                          PDL: tl.constexpr):
    """One program: the rows' starts (a running sum of the capacities over ``BLOCK_R`` rows at a time, clamped at
    ``T``), the lengths their room allows and the next positions (``N``)."""
    pdl_wait(PDL)
    tl.store(start_ptr, tl.full([], 0, tl.int64))
    carry = tl.full([], 0, tl.int64)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        m = r < R
        want = tl.load(b_ptr + r, mask=m, other=0).to(tl.int64)
        want = tl.minimum(tl.maximum(want, 0), k_max)
        cap = tl.where(m, (want + slack + align - 1) // align * align, 0)  # every term >= 0: // is a floor
        end = carry + tl.cumsum(cap, 0)
        end_t = tl.minimum(end, T)
        tl.store(start_ptr + 1 + r, end_t, mask=m)
        tl.store(len_ptr + r, tl.minimum(want, end_t - tl.minimum(end - cap, T)).to(tl.int32), mask=m)
        tl.store(next_ptr + r, tl.zeros([BLOCK_R], dtype=tl.int64) + N, mask=m)
        carry += tl.sum(cap, 0)


LAYOUT_BLOCK = 1024  # rows per step of ``_ragged_layout_kernel``


@triton_op("tritonkv::ragged_layout", mutates_args=())
def ragged_layout(budgets: torch.Tensor, k_max: int, slack: int, align: int, total_capacity: int,
                  n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw op: rows laid out from device budgets int32 ``[R]`` (contiguous), each clamped to ``[0, k_max]``,
    its capacity ``budget + slack`` rounded up to ``align``, one after another from 0 and clamped at
    ``total_capacity`` -> ``(row_start int64 [R+1], length int32 [R], next_position int64 [R])``, a row past
    ``total_capacity`` shrunk to its room, every next position ``n`` (the rows were selected from ``n`` tokens).
    CPU tensors run ``_ragged_layout_torch`` (outside the Triton interpreter)."""
    if not use_triton(budgets):
        return _ragged_layout_torch(budgets, k_max, slack, align, total_capacity, n)
    R = budgets.shape[0]
    row_start = torch.empty(R + 1, dtype=torch.int64, device=budgets.device)
    length = torch.empty(R, dtype=torch.int32, device=budgets.device)
    next_position = torch.empty(R, dtype=torch.int64, device=budgets.device)
    launch(_ragged_layout_kernel, (1,), budgets, row_start, length, next_position, R, k_max, slack, align,
           total_capacity, n, BLOCK_R=min(max(next_pow2(R), 16), LAYOUT_BLOCK))
    return row_start, length, next_position


def _ragged_layout_torch(budgets, k_max: int, slack: int, align: int, total_capacity: int, n: int):
    """``ragged_layout`` in PyTorch."""
    want = budgets.to(torch.int64).clamp(0, k_max)
    row_start = _starts(_round_up(want + slack, align)).clamp(max=total_capacity)
    length = torch.minimum(want, row_start[1:] - row_start[:-1]).to(torch.int32)
    return row_start, length, torch.full_like(want, n)


class RaggedKV:
    """One layer's compressed KV cache with per-row lengths and slack (see the module docstring).

    Attributes:
        keys, values: ``[T_cap, D]`` flat storage.
        row_start: int64 ``[R+1]`` (monotone; ``row_start[R] <= T_cap``).
        length: int32 ``[R]`` tokens held by each row (``lengths`` is the ``[B, H_kv]`` view).
        batch, num_heads: B and H_kv (R = B·H_kv).
        max_capacity: static int bounding every row's capacity (sets decode attention's split count).
        slack, align: free tokens (at least) per row after a build or re-pack, and the rounding.
    """

    def __init__(self, keys, values, positions, row_start, length, next_position, *, batch: int, num_heads: int,
                 max_capacity: int, slack: int = 16, align: int = 16, free: int = 0):
        R = check_int("batch", batch, 1) * check_int("num_heads", num_heads, 1)
        check_int("max_capacity", max_capacity)
        check_kv_tensor("keys", keys, ndim=2)
        check_kv_tensor("values", values, ndim=2)
        if values.shape != keys.shape or values.dtype != keys.dtype:
            raise ValueError(f"values must have the shape and dtype of keys {tuple(keys.shape)} {keys.dtype}, "
                             f"got {tuple(values.shape)} {values.dtype}")
        check_device("values", values, keys.device, "keys")
        T = keys.shape[0]
        for name, t, dtype, n in (("positions", positions, torch.int64, T),
                                  ("row_start", row_start, torch.int64, R + 1), ("length", length, torch.int32, R),
                                  ("next_position", next_position, torch.int64, R)):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != (n,):
                raise ValueError(f"{name} must be a {dtype} tensor of shape ({n},), got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
            check_device(name, t, keys.device, "keys")
        self.keys, self.values = keys, values
        self._positions = positions
        self.row_start, self.length = row_start, length
        self.next_position = next_position  # int64 [R]: position given to the next appended token
        self.batch, self.num_heads = batch, num_heads
        self.max_capacity = max_capacity
        self.slack, self.align = slack, align
        self._free = free  # host-side lower bound on every row's free slots (0: unknown)
        self._host = None  # (row_start, length) as host lists once read (``host_rows``), kept current by ``append``

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def allocate(cls, capacity: torch.Tensor, total_capacity: int, B: int, H: int, D: int, dtype=torch.bfloat16,
                 device=None, *, max_capacity: Optional[int] = None, slack: int = 16, align: int = 16) -> "RaggedKV":
        """Empty rows with the given capacities (int ``[B*H]`` device tensor).

        ``total_capacity`` (static int) is ``T_cap``; capacities beyond it are cut. ``max_capacity``
        (static int, default ``total_capacity``) must bound every row's capacity. ``row_start`` is a
        device cumsum: nothing is read back.
        """
        R = check_int("B", B, 1) * check_int("H", H, 1)
        total_capacity = check_int("total_capacity", total_capacity)
        check_int("D", D, 1)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        if not isinstance(capacity, torch.Tensor) or capacity.numel() != R or capacity.dtype.is_floating_point:
            raise ValueError(f"capacity must be an integer tensor of B*H = {R} entries")
        device = capacity.device if device is None else torch.device(device)
        cap = capacity.reshape(R).to(device=device, dtype=torch.int64).clamp(min=0)
        row_start = _starts(cap).clamp(max=total_capacity)
        T = max(total_capacity, 1)
        return cls(torch.empty((T, D), dtype=dtype, device=device), torch.empty((T, D), dtype=dtype, device=device),
                   torch.full((T,), -1, dtype=torch.int64, device=device), row_start,
                   torch.zeros(R, dtype=torch.int32, device=device), torch.zeros(R, dtype=torch.int64, device=device),
                   batch=B, num_heads=H, max_capacity=total_capacity if max_capacity is None else int(max_capacity),
                   slack=check_int("slack", slack), align=check_int("align", align, 1))

    @classmethod
    def from_selection(cls, scores, budgets, keys, values, sink: int = 0, window: int = 0, slack: int = 16,
                       forced=None, *, total: Optional[int] = None, k_max: Optional[int] = None,
                       align: int = 16) -> "RaggedKV":
        """Select with the shared kernel straight into ragged rows (no padded intermediate).

        ``scores`` fp32 ``[B, H, N]``, ``budgets`` an int, an int ``[B*H]`` device tensor or a tuple of ``B*H``
        host ints (tokens kept per row, protected ones included; host ints lay the rows out on the host: the
        storage is exact and nothing is counted on the device), ``keys``/``values`` ``[B, H, N, D]``. Static ints:
        ``k_max`` bounds every row's budget (default N); ``total`` bounds the sum of the kept
        tokens (default ``B*H*k_max``); see the module docstring.
        """
        def select(eff, k_max, out):
            return _select.select_kv(scores, eff, keys, values, k_max, sink=sink, window=window, forced=forced,
                                     out=out)

        if isinstance(keys, torch.Tensor) and keys.dim() == 4:
            n = keys.shape[2]
            _select.check_protected(budgets, n, n if k_max is None else k_max, sink, window)
        return cls._build(select, budgets, keys, values, slack, total, k_max, align)

    @classmethod
    def from_policy(cls, policy, scores, budgets, keys, values, *, sink: int = 0, window: int = 0, slack: int = 16,
                    total: Optional[int] = None, k_max: Optional[int] = None, align: int = 16,
                    **inputs) -> "RaggedKV":
        """Like ``from_selection`` through ``policy.select`` (score-transform policies such as
        CriticalKV and SCORE override it and write into the same ragged ``out``)."""
        def select(eff, k_max, out):
            return policy.select(scores, eff, keys, values, sink=sink, window=window, k_max=k_max, out=out, **inputs)

        return cls._build(select, budgets, keys, values, slack, total, k_max, align)

    @classmethod
    def from_kept(cls, kept: torch.Tensor, keys, values, *, longest: int, slack: int = 16) -> "RaggedKV":
        """The cache of tokens already chosen, with no selection: ``kept`` int64 ``[B, K]`` holds each batch row's
        kept tokens as ascending flat indices ``h·N + j`` into ``keys``/``values [B, H, N, D]`` (the same count
        ``K`` in every batch row, e.g. AdaKV's winners, ``allocation.adakv.adakv_kept``). Row ``h`` gets the
        entries in ``[h·N, (h+1)·N)`` and ``slack`` free slots (capacity = length + slack, not rounded): its
        start is the kept tokens before it plus ``r·slack``, so ``T_cap = B·K + B·H·slack`` is static and
        lengths and starts are computed on the device. ``longest`` (static int) must bound every row's length
        (rows longer are cut in the copy, not in ``length``: a caller's bound, e.g. ``Kept.longest``)."""
        check_kv_tensor("keys", keys)
        check_kv_tensor("values", values)
        if values.shape != keys.shape or values.dtype != keys.dtype:
            raise ValueError(f"values must have the shape and dtype of keys {tuple(keys.shape)} {keys.dtype}, "
                             f"got {tuple(values.shape)} {values.dtype}")
        B, H, N, D = keys.shape
        if not isinstance(kept, torch.Tensor) or kept.dtype != torch.int64 or kept.dim() != 2 \
                or kept.shape[0] != B or not 0 < kept.shape[1] <= H * N:
            raise ValueError(f"kept must be an int64 [B = {B}, K] tensor of flat token indices (0 < K <= H·N = "
                             f"{H * N}), got {getattr(kept, 'dtype', type(kept).__name__)} "
                             f"{tuple(getattr(kept, 'shape', ()))}")
        dev = keys.device
        check_device("values", values, dev, "keys")
        check_device("kept", kept, dev, "keys")
        slack, longest = check_int("slack", slack), min(check_int("longest", longest), N)
        R = B * H
        T = B * kept.shape[1] + R * slack
        keys = keys if keys.stride(-1) == 1 else keys.contiguous()
        values = values if values.stride(-1) == 1 else values.contiguous()
        i64 = dict(dtype=torch.int64, device=dev)
        out = cls(torch.empty((T, D), dtype=keys.dtype, device=dev),
                  torch.empty((T, D), dtype=values.dtype, device=dev), torch.empty((T,), **i64), torch.empty((R + 1,), **i64),
                  torch.empty((R,), dtype=torch.int32, device=dev), torch.empty((R,), **i64), batch=B, num_heads=H,
                  max_capacity=max(longest + slack, 1), slack=slack, align=1, free=slack)
        ragged_from_kept(kept.contiguous(), keys, values, out.keys, out.values, out._positions, out.row_start,
                         out.length, out.next_position, slack, longest)
        return out

    @classmethod
    def _build(cls, select, budgets, keys, values, slack, total, k_max, align) -> "RaggedKV":
        check_kv_tensor("keys", keys)
        check_kv_tensor("values", values)
        if values.shape != keys.shape or values.dtype != keys.dtype:
            raise ValueError(f"values must have the shape and dtype of keys {tuple(keys.shape)} {keys.dtype}, "
                             f"got {tuple(values.shape)} {values.dtype}")
        check_device("values", values, keys.device, "keys")
        slack, align = check_int("slack", slack), check_int("align", align, 1)
        B, H, N, D = keys.shape
        R = B * H
        dev = keys.device
        k_max = N if k_max is None else min(check_int("k_max", k_max), N)
        if total is not None:
            check_int("total", total)
        if isinstance(budgets, tuple):  # host ints, one per row: the layout is computed on the host
            if len(budgets) != R:
                raise ValueError(f"budgets must have {R} entries (one per batch row and KV head), got {len(budgets)}")
            want = tuple(min(max(int(v), 0), k_max) for v in budgets)
            caps = [-(-(w + slack) // align) * align for w in want]
            starts = (0, *itertools.accumulate(caps))
            T = max(starts[-1], 1)
            row_start = upload(starts, dev, torch.int64)
            out = _select.Out(keys=torch.empty((T, D), dtype=keys.dtype, device=dev),
                              values=torch.empty((T, D), dtype=values.dtype, device=dev),
                              indices=torch.full((T,), -1, dtype=torch.int64, device=dev), start=row_start[:-1],
                              lengths=torch.empty(R, dtype=torch.int32, device=dev))
            select(upload(want, dev), max(want), out)
            return cls(out.keys, out.values, out.indices, row_start, out.lengths,
                       torch.full((R,), N, dtype=torch.int64, device=dev), batch=B, num_heads=H,
                       max_capacity=max(max(caps), 1), slack=slack, align=align, free=slack)
        if isinstance(budgets, int) and not isinstance(budgets, bool):
            k = min(max(budgets, 0), k_max)
            cap = -(-(k + slack) // align) * align
            if cap <= N:  # one budget for every row: rows at r·cap, a static layout (nothing to count or scan)
                T = max(R * cap, 1)
                out = _select.Out(keys=torch.empty((T, D), dtype=keys.dtype, device=dev),
                                  values=torch.empty((T, D), dtype=values.dtype, device=dev),
                                  indices=torch.full((T,), -1, dtype=torch.int64, device=dev), start=None,
                                  lengths=torch.empty(R, dtype=torch.int32, device=dev))
                select(k, cap, out)
                starts = torch.arange(0, (R + 1) * cap, cap, device=dev) if cap else \
                    torch.zeros(R + 1, dtype=torch.int64, device=dev)  # budget 0, no slack: empty rows at 0
                return cls(out.keys, out.values, out.indices, starts, out.lengths,
                           torch.full((R,), N, dtype=torch.int64, device=dev), batch=B, num_heads=H,
                           max_capacity=max(cap, 1), slack=slack, align=align, free=cap - k)
        total = R * k_max if total is None else check_int("total", total)
        T = max(total + R * (slack + align - 1), 1)  # static: worst-case slack + rounding on every row
        want = _select.budget_tensor(budgets, R, dev)
        row_start, eff, next_position = ragged_layout(want, k_max, slack, align, T, N)  # rows past T shrink
        out = _select.Out(keys=torch.empty((T, D), dtype=keys.dtype, device=dev),
                          values=torch.empty((T, D), dtype=values.dtype, device=dev),
                          indices=torch.full((T,), -1, dtype=torch.int64, device=dev),
                          start=row_start[:-1], lengths=torch.empty(R, dtype=torch.int32, device=dev))
        select(eff, k_max, out)
        return cls(out.keys, out.values, out.indices, row_start, out.lengths, next_position, batch=B, num_heads=H,
                   max_capacity=max(-(-(k_max + slack) // align) * align, 1), slack=slack, align=align, free=slack)

    # -- views ------------------------------------------------------------------------------------
    @property
    def lengths(self) -> torch.Tensor:
        """int32 ``[B, H_kv]`` tokens held per row."""
        return self.length.view(self.batch, self.num_heads)

    @property
    def capacity(self) -> torch.Tensor:
        """int64 ``[B, H_kv]`` capacity of each row (length + free slots)."""
        return (self.row_start[1:] - self.row_start[:-1]).view(self.batch, self.num_heads)

    @property
    def positions(self) -> torch.Tensor:
        """int64 ``[T_cap]`` original position of every stored token (-1 in the slack)."""
        return self._positions

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def head_dim(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held by the storage and its metadata."""
        ts = (self.keys, self.values, self._positions, self.row_start, self.length, self.next_position)
        return sum(t.numel() * t.element_size() for t in ts)

    def __repr__(self):
        return (f"RaggedKV(B={self.batch}, H_kv={self.num_heads}, D={self.head_dim}, T_cap={self.keys.shape[0]}, "
                f"max_capacity={self.max_capacity}, dtype={self.dtype}, device={self.device})")

    # -- decoding ---------------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor) -> "RaggedKV":
        """Append one token per row (``k, v [B, H_kv, 1, D]``) in place; ``length += 1``.

        No host read while the static bound on free slots lasts (``slack`` appends after a build
        or re-pack); then one read of the true minimum, and a ``repack`` if some row is full.
        """
        for name, t in (("k", k), ("v", v)):
            check_kv_tensor(name, t)
            if tuple(t.shape) != (self.batch, self.num_heads, 1, self.head_dim):
                raise ValueError(f"{name} must be [B, H_kv, 1, D] = {(self.batch, self.num_heads, 1, self.head_dim)}, "
                                 f"got {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise TypeError(f"{name} must have the cache's dtype {self.dtype}, got {t.dtype}")
            check_device(name, t, self.device, "the cache")
        if self._free <= 0:
            self._free = int((self.capacity - self.lengths).amin()) if self.length.numel() else 1
            if self._free <= 0:
                self.repack()
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        ragged_append(k, v, self.keys, self.values, self._positions, self.row_start, self.length,
                      self.next_position, self.num_heads)
        self._free -= 1
        if self._host is not None and torch.compiler.is_compiling():  # traced, host lists would be baked in
            self._host = None  # read again when asked
        elif self._host is not None:  # the op's rule on the host: a row grows where it had room
            starts, lengths = self._host
            self._host = starts, [n + (s + n < e) for s, e, n in zip(starts, starts[1:], lengths)]
        return self

    def host_rows(self) -> tuple[list, list]:
        """``(row_start, length)`` as host lists (``R + 1`` and ``R`` ints): read back once per layout (a build or a
        ``repack``), then kept current on the host by ``append``. For host code that walks the rows (the CPU)."""
        if self._host is None:
            self._host = self.row_start.tolist(), self.length.tolist()
        return self._host

    def repack(self, slack: Optional[int] = None) -> "RaggedKV":
        """Re-lay rows with ``capacity = round_up(length + max(slack, 1), align)`` (copies the cache;
        one host read for the new static sizes)."""
        slack = max(self.slack if slack is None else check_int("slack", slack), 1)
        R = self.length.numel()
        length = self.length.to(torch.int64)
        cap = _round_up(length + slack, self.align)
        start = _starts(cap)
        total, max_cap = (torch.stack([start[-1], cap.max()]).tolist() if R else (0, 0))
        t = torch.arange(max(total, 1), device=self.device)
        r = torch.searchsorted(start[1:], t, right=True).clamp(max=max(R - 1, 0))
        j = t - start[r]
        valid = j < length[r]
        src = (self.row_start[r] + j).clamp(0, self.keys.shape[0] - 1)
        self.keys = torch.where(valid[:, None], self.keys[src], 0)
        self.values = torch.where(valid[:, None], self.values[src], 0)
        self._positions = torch.where(valid, self._positions[src], -1)
        self.row_start = start
        self.max_capacity = max(int(max_cap), 1)
        self._free, self._host = slack, None
        return self

    def to_padded(self, cap: Optional[int] = None, *, with_positions: bool = False):
        """``(K [B, H, cap, D], V, lengths int32 [B, H])`` zero-padded (and int64 positions, -1 padded).

        ``cap`` defaults to the longest row (one host read); rows longer than ``cap`` are cut.
        """
        if cap is None:
            cap = int(self.length.max()) if self.length.numel() else 0
        cap = check_int("cap", cap)
        B, H, D = self.batch, self.num_heads, self.head_dim
        j = torch.arange(cap, device=self.device)
        valid = j[None, :] < self.length[:, None]
        src = (self.row_start[:-1, None] + j[None, :]).clamp(0, self.keys.shape[0] - 1)
        K = torch.where(valid[..., None], self.keys[src], 0).view(B, H, cap, D)
        V = torch.where(valid[..., None], self.values[src], 0).view(B, H, cap, D)
        lengths = self.length.clamp(max=cap).view(B, H)
        if with_positions:
            return K, V, lengths, torch.where(valid, self._positions[src], -1).view(B, H, cap)
        return K, V, lengths

    def check(self) -> None:
        """Validate the layout invariants on the host (debugging and tests; reads the metadata back)."""
        rs = self.row_start.cpu()
        ln = self.length.cpu().to(torch.int64)
        cap = rs[1:] - rs[:-1]
        if rs.numel() != ln.numel() + 1 or rs[0] != 0 or not bool((cap >= 0).all()):
            raise ValueError("row_start must start at 0 and be non-decreasing")
        if int(rs[-1]) > self.keys.shape[0]:
            raise ValueError(f"row_start ends at {int(rs[-1])}, past T_cap = {self.keys.shape[0]}")
        if not bool(((ln >= 0) & (ln <= cap)).all()):
            raise ValueError("length must lie in [0, capacity] for every row")
        if ln.numel() and int(cap.max()) > self.max_capacity:
            raise ValueError(f"a row's capacity {int(cap.max())} exceeds max_capacity {self.max_capacity}")
