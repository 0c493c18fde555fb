"""Storage of one layer of a ``TritonKVCache``: what the cache holds, and nothing more.

Two layouts, chosen per compression:

- ``DenseStore``: ``keys``/``values`` ``[B, H_kv, capacity, D]`` and ``pos`` int32 ``[B, H_kv, capacity]`` (the
  original sequence index of every slot; ``SENTINEL`` marks a pad or an empty slot). The first ``n`` slots are
  in use, in ascending position order. Used for uniform budgets, while a prefill block is attended and scored,
  and for compiled decoding (static capacity, ``reserve``).
- ``RaggedStore``: a ``tritonkv.RaggedKV`` (flat rows of different lengths, per-head budgets) whose
  ``positions`` hold sequence indices. Decode steps append in place and attend through the ragged split-K
  kernel; a prefill block (or a re-compression) turns it into a ``DenseStore`` working view for one forward
  (between the blocks of a prompt whose length the cache knows, a layer stays in that padded view: the next block
  would build it again).

Slack rule (``slack_for``): after a compression a layer holds its kept tokens plus
``max(16, ceil(kept / 16))`` free slots per head (at most 1/16 ≈ 6 % over the kept bytes once a head keeps
256 tokens or more), or ``decode_every`` free slots in ``"decoding"`` mode, so that decode steps append in
place; when they run out the store grows by the same rule (one copy per ~kept/16 steps). A dense layer compressed
between the blocks of a prompt whose length the cache knows keeps no free slot: the next block's ``append``
concatenates (one copy per tensor). A store never keeps
its high-water capacity after a compression, unless ``reserve``d for a compiled decode loop.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...cache import RaggedKV
from ...kernels._common import on_host
from ...kernels.select import _rows16

SENTINEL = 2**31 - 1  # ``pos`` of a slot that holds no token (empty, or a pad): attended by nobody
MIN_SLACK = 16


def slack_for(kept: int, decode_every: Optional[int] = None) -> int:
    """Free slots per head kept after a compression of ``kept`` tokens (see the module docstring)."""
    if decode_every is not None:
        return decode_every
    return max(MIN_SLACK, -(-kept // 16))


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _zero_rows(t: torch.Tensor, held: torch.Tensor) -> None:
    """Zero, in place, the slots of ``t`` ``[R, W, D]`` that ``held`` ``[R, W]`` marks False (on the CPU by index:
    several times faster than a masked fill broadcast over D)."""
    if on_host(held):
        t.view(-1, t.shape[-1]).index_fill_(0, (~held).view(-1).nonzero().squeeze(1), 0)
    else:
        t.masked_fill_(~held[..., None], 0)


def padded_width(kv: RaggedKV) -> int:
    """The width of ``kv``'s padded view (``to_padded()``'s): its longest row (one host read); with tensor
    parallelism (``TPRaggedKV``) the layer's longest row over the ranks."""
    return (int(kv.length.max()) if kv.length.numel() else 0) + getattr(kv, "extra", 0)


def left_padded(kv: RaggedKV, free: int = 0, width: Optional[int] = None):
    """``(K, V, positions, held)`` ``[B, H, W + free, ...]`` of the ragged rows of ``kv``, each row's tokens in its
    last slots before the ``free`` ones (W = ``width``, default ``padded_width``): K and V zero outside the rows,
    positions int64 as ``kv`` holds them (-1 outside), ``held`` bool marks the rows' slots. One row gather."""
    B, H, D, Dv = kv.batch, kv.num_heads, kv.head_dim, kv.values.shape[1]
    R, dev = B * H, kv.device
    width = padded_width(kv) if width is None else width
    S = width + free  # slots per row (explicit sizes below: S may be 0)
    j = torch.arange(S, device=dev)
    lead = width - kv.length.to(torch.int64).clamp(max=width)[:, None]  # empty slots before each row's tokens
    held = (j >= lead) & (j < width)
    if kv.keys.shape[0] == 0 or R == 0:
        K = kv.keys.new_zeros(R, S, D)
        V, p = kv.values.new_zeros(R, S, Dv), torch.full_like(j, -1).expand(R, S)
    else:
        src = (kv.row_start[:R, None] + j - lead).clamp(0, kv.keys.shape[0] - 1).view(-1)
        K = kv.keys.index_select(0, src).view(R, S, D)  # index_select: a plain row gather (fast on CPU)
        V = kv.values.index_select(0, src).view(R, S, Dv)
        for t in (K, V):
            _zero_rows(t, held)
        p = torch.where(held, kv.positions.index_select(0, src).view(R, S), -1)
    return K.view(B, H, S, D), V.view(B, H, S, Dv), p.reshape(B, H, S), held.view(B, H, S)


def kept_padded(kept: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, free_for):
    """The ``DenseStore`` that ``left_padded`` gives of ``RaggedKV.from_kept(kept, keys, values)``, built with one
    copy: ``kept`` int64 ``[B, K]`` holds each batch row's kept tokens as ascending flat indices ``h·N + j`` into
    ``keys``/``values`` ``[B, H, N, D]`` (unit-stride last dim) whose slots are at sequence indices ``pos`` int32
    ``[B, H, N]``. Each head's tokens take the last of ``W`` slots (W: the longest head's count, one host read),
    then ``free_for(W)`` free slots; K and V zero and ``pos`` ``SENTINEL`` outside the rows."""
    B, H, N, D = keys.shape
    Dv, K = values.shape[3], kept.shape[1]
    dev = keys.device
    head = kept // N
    row = (head + torch.arange(0, B * H, H, device=dev)[:, None]).view(-1)  # [B·K]: row b·H + h of each entry
    counts = torch.bincount(row, minlength=B * H)  # tokens of each row
    width = int(counts.max())
    S = width + free_for(width)
    # flat entry t, the i-th token of its row, goes to slot W - count + i = W + t - (the tokens of rows <= its own)
    dst = row * S + (width + torch.arange(B * K, device=dev)) - counts.cumsum(0)[row]
    out, src = [], None
    for t in (keys, values):
        sb, sh, sn, _ = t.stride()
        if src is None or t.stride() != keys.stride():  # token j of head h: b·sb + h·sh + j·sn, j = kept - h·N
            src = (kept * sn + head * (sh - N * sn) + torch.arange(0, B * sb, sb, device=dev)[:, None]).view(-1)
        flat = t.as_strided(((B - 1) * sb + (H - 1) * sh + (N - 1) * sn + 1, t.shape[3]), (1, 1))
        o = t.new_zeros(B * H * S, t.shape[3])
        wide = _rows16(o)  # 16-byte elements where the layout allows: index_copy_ pays per element
        wide.index_copy_(0, dst, flat.index_select(0, src).view(wide.dtype))
        out.append(o)
    P = torch.full((B * H * S,), SENTINEL, dtype=torch.int32, device=dev)
    P.index_copy_(0, dst, pos.reshape(B, H * N).gather(1, kept).view(-1))
    return DenseStore(out[0].view(B, H, S, D), out[1].view(B, H, S, Dv), P.view(B, H, S), width)


class DenseStore:
    """Equal-capacity rows ``[B, H_kv, capacity, D]``; see the module docstring."""

    ragged = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, n: int):
        self.keys, self.values, self.pos, self.n = keys, values, pos, n
        self.static = False  # reserved for a compiled loop: never reallocated by a compression

    @classmethod
    def wrap(cls, keys, values, pos) -> "DenseStore":
        """Hold the given tensors as they are (full: capacity = n)."""
        return cls(keys, values, pos, keys.shape[2])

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def resize(self, capacity: int) -> None:
        """Move the slots in use into buffers of ``capacity`` slots (>= n)."""
        B, H, _, D = self.keys.shape
        keys = self.keys.new_zeros(B, H, capacity, D)
        values = self.values.new_zeros(B, H, capacity, self.values.shape[-1])
        pos = self.pos.new_full((B, H, capacity), SENTINEL)
        n = self.n
        keys[:, :, :n], values[:, :, :n], pos[:, :, :n] = self.keys[:, :, :n], self.values[:, :, :n], self.pos[:, :, :n]
        self.keys, self.values, self.pos = keys, values, pos

    def append(self, keys, values, pos, slack: int) -> None:
        """Write ``T`` new slots after the ``n`` in use, growing to ``n + T + slack`` when they do not fit."""
        T, n = keys.shape[2], self.n
        if n + T > self.capacity:
            if self.static:
                raise RuntimeError(f"the reserved capacity ({self.capacity} slots) is full: reserve() more for a "
                                   f"compiled decode loop")
            if n == self.capacity:  # full (a store just compressed between prompt blocks): one copy per tensor
                self._grow_by_cat(keys, values, pos, slack)
                return
            self.resize(n + T + slack)
        self.keys[:, :, n:n + T] = keys
        self.values[:, :, n:n + T] = values
        self.pos[:, :, n:n + T] = pos
        self.n = n + T

    def _grow_by_cat(self, keys, values, pos, slack: int) -> None:
        """``append`` to a full store: the slots in use, the new ones and ``slack`` free ones (zero K/V, ``SENTINEL``
        positions, as ``resize`` leaves them) concatenated into new buffers."""
        B, H = self.keys.shape[:2]
        T = keys.shape[2]
        grown = []
        for old, new, fill in ((self.keys, keys, 0), (self.values, values, 0),
                               (self.pos, pos.expand(B, H, T), SENTINEL)):
            parts = [old, new.to(old.dtype)]
            if slack:
                parts.append(old.new_full((B, H, slack, *old.shape[3:]), fill))
            grown.append(torch.cat(parts, dim=2))
        self.keys, self.values, self.pos = grown
        self.n += T

    def view(self):
        """``(keys, values, pos)`` of the slots in use."""
        n = self.n
        return self.keys[:, :, :n], self.values[:, :, :n], self.pos[:, :, :n]

    def replace(self, keys, values, pos, slack: int) -> None:
        """Hold exactly the given slots (the result of a compression) plus ``slack`` free ones; a static store
        writes them in place instead (its buffers keep their addresses)."""
        m = keys.shape[2]
        if self.static:
            self.keys[:, :, :m], self.values[:, :, :m], self.pos[:, :, :m] = keys, values, pos
            self.pos[:, :, m:self.n] = SENTINEL
            self.n = m
            return
        self.keys, self.values, self.pos, self.n = keys, values, pos, m
        if slack:
            self.resize(m + slack)

    def keep_last(self, m: int, slack: int) -> None:
        """Hold only the last ``m`` slots in use (a sliding window) plus ``slack`` free ones: ``replace`` with views of
        them, which ``resize`` copies into new buffers (one copy; ``slack`` > 0 so that the old buffers go), or
        a static store copies to its front in place (from a clone: the ranges overlap)."""
        n = self.n
        kept = [t[:, :, n - m:n] for t in (self.keys, self.values, self.pos)]
        if self.static:
            kept = [t.clone() for t in kept]
        self.replace(*kept, max(slack, 1))

    def kept_tokens(self) -> torch.Tensor:
        """int64 ``[B, H_kv]`` tokens held per (batch row, KV head)."""
        return (self.view()[2] != SENTINEL).sum(-1)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys, self.values, self.pos)

    def index_batch(self, fn) -> None:
        self.keys, self.values, self.pos = fn(self.keys), fn(self.values), fn(self.pos)


class RaggedStore:
    """Per-head rows of different lengths (a ``RaggedKV`` whose positions are sequence indices)."""

    ragged = True
    static = False

    def __init__(self, kv: RaggedKV):
        self.kv = kv
        self.n = int(kv.length.max())  # the longest row (host), for the width of a padded working view

    @classmethod
    def from_selection(cls, kv: RaggedKV, pos: torch.Tensor, seen: int, slack: int) -> "RaggedStore":
        """``kv`` as ``compress`` built it from a working view whose slots had sequence indices ``pos``
        ``[B, H, N]`` (its ``positions`` index those slots): map them to sequence indices, continue positions at
        ``seen``, and grow by ``slack`` per row when a row fills up."""
        R, N = kv.length.numel(), pos.shape[2]
        t = torch.arange(kv.keys.shape[0], device=kv.keys.device)
        row = torch.searchsorted(kv.row_start[1:], t, right=True).clamp(max=R - 1)  # the row owning each slot
        slot = kv.positions
        seq = pos.reshape(R, N).to(torch.int64)[row, slot.clamp(min=0)]
        kv._positions = torch.where(slot >= 0, seq, -1)
        kv.next_position.fill_(seen)
        if slack > kv._free:  # built with fewer free slots per row than this layer's rule: re-lay them now, not
            kv.repack(slack)  # after the first few decode steps
        kv.slack = slack
        return cls(kv)

    @classmethod
    def from_padded(cls, keys, values, pos, seen: int, slack: int, held=None) -> "RaggedStore":
        """Ragged rows holding exactly the slots of ``keys``/``values`` ``[B, H, N, D]`` marked by ``held`` (bool;
        default: those whose sequence index ``pos`` is not ``SENTINEL``), in order (the shared select kernel copies
        them), with ``slack`` free slots per row."""
        valid = pos != SENTINEL if held is None else held
        if pos.shape[2] == 0:  # every row empty (an allocator gave this layer nothing): one empty slot to select from
            keys, values = keys.new_zeros(*keys.shape[:2], 1, keys.shape[3]), values.new_zeros(*keys.shape[:2], 1,
                                                                                              values.shape[3])
            pos, valid = pos.new_full((*pos.shape[:2], 1), SENTINEL), valid.new_zeros(*pos.shape[:2], 1)
        lengths = valid.sum(-1).reshape(-1)
        total, longest = torch.stack([lengths.sum(), lengths.max()]).tolist()
        scores = torch.where(valid, 0.0, float("-inf"))  # every real slot, and only those, is in its row's top-k
        kv = RaggedKV.from_selection(scores, lengths, keys, values, slack=slack, total=int(total),
                                     k_max=int(longest))
        return cls.from_selection(kv, pos, seen, slack)

    def padded(self):
        """``(keys, values, pos, held)`` ``[B, H, longest row, D]``: each row's tokens last, ``SENTINEL`` slots
        before them; ``held`` (bool ``[B, H, longest row]``) marks the row's slots (a kept slot may hold no token)."""
        K, V, pos, held = left_padded(self.kv)
        return K, V, torch.where(held & (pos >= 0), pos, SENTINEL).to(torch.int32), held

    def append(self, keys, values) -> None:
        """One new token per row, in place (``RaggedKV.append``)."""
        self.kv.append(keys, values)
        self.n += 1

    def to_dense(self, free: int = 0) -> DenseStore:
        """The padded working view for a prefill block or a re-compression: each row's tokens last, ``SENTINEL``
        slots before them (the layout a policy sees of a layer with gaps, ``cache._compact``'s), and ``free``
        empty slots after the longest row (a prefill block is then written in place)."""
        K, V, p, held = left_padded(self.kv, free)
        return DenseStore(K, V, torch.where(held & (p >= 0), p, SENTINEL).to(torch.int32), K.shape[2] - free)

    def kept_tokens(self) -> torch.Tensor:
        return self.kv.lengths.to(torch.int64)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def index_batch(self, fn) -> None:
        raise NotImplementedError("per-head (ragged) budgets do not support beam search / batch reindexing")
