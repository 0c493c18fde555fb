"""``TritonKVCache``: a transformers ``Cache`` whose layers keep at most a budget of tokens, and the schedule that
says when a layer compresses.

Per layer (``TritonKVLayer``) the storage is a ``storage.DenseStore`` or, with per-head budgets (an allocator),
a ``storage.RaggedStore``; ``update`` stores the new tokens, the ``"tritonkv"`` attention function attends
(``attention.py``), then ``after_attention`` compresses when due:

- after every prompt forward (the prompt, or each prefill block: a multi-token forward, or one token of a known
  ``prompt_length``) when the layer holds more than the budget;
- in ``"decoding"`` mode also when a layer reaches budget + ``decode_every`` tokens (LagKV instead runs its
  recursive partitions, ``LagKVLayer``).

Budgets. An int is tokens kept per (batch row, KV head). A float is the fraction of the tokens *seen* by the
layer at each compression, or of ``prompt_length`` when it is given (``generate`` passes the prompt's length):
streaming 32K tokens block-wise at 0.1 keeps ~3.3K per head, never a fraction of the first block.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ...api import Compressed, check_input_names, compress, compress_kept, resolve_budget
from ...policies import Policy, get_policy
from ...kernels._common import on_host, use_triton
from .attention import (block_attention, causal_attention, decode_sdpa, drop_hand_over, hand_over, held_attention,
                        held_suffix, kernel_decode, masked_attention, ragged_decode_sdpa, suffix_attention)
from .storage import SENTINEL, DenseStore, RaggedStore, kept_padded, left_padded, padded_width, slack_for

MODES = ("after_prefill", "blockwise", "decoding")


def _compiling() -> bool:
    return torch.compiler.is_compiling()


class _MaskedPolicy(Policy):
    """``base`` restricted to the slots that hold real tokens: other slots score -inf and the sink is not the first
    slots (the cache forces the first real tokens of each row through the select kernel's ``forced`` mask). Used
    only while a layer holds pads or ragged gaps; otherwise the cache calls the policy itself. Its selection is
    the base's: ``Policy.select`` (a plain top-k of the scores, which ``compress`` may fuse with an allocator's,
    e.g. AdaKV's winners), or through ``_MaskedSelectPolicy`` a selection of the base's own."""

    def __init__(self, base: Policy, valid: torch.Tensor):
        self.base, self.valid = base, valid
        self.name, self.needs = base.name, base.needs

    @staticmethod
    def wrap(base: Policy, valid: torch.Tensor) -> "_MaskedPolicy":
        plain = type(base).select is Policy.select
        return (_MaskedPolicy if plain else _MaskedSelectPolicy)(base, valid)

    def protected(self, n, budget):
        return 0, self.base.protected(n, budget)[1]

    def score(self, keys, values, **inputs):
        # the empty slots enter the base as non-finite tokens, which every statistic over tokens leaves out (softmax
        # normalisers, means, partition ranges): each head's real tokens score as they would alone, whatever the
        # other heads hold (a zero key there counted in every window row's softmax)
        # NaN at the holes from one broadcast add of -0.0 or NaN (x + -0.0 is x, bit for bit): a masked_fill with a
        # mask broadcast over the head dim is ~10x slower on the CPU
        hole = torch.where(self.valid, -0.0, float("nan"))[..., None]
        keys = keys + hole.to(keys.dtype)
        if self.base.reads_values:  # else a copy nobody reads
            values = values + hole.to(values.dtype)
        return torch.where(self.valid, self.base.score(keys, values, **inputs).float(), float("-inf"))


class _MaskedSelectPolicy(_MaskedPolicy):
    """``_MaskedPolicy`` of a base with its own ``select`` (a score-transform policy: CriticalKV, SCORE)."""

    def select(self, *args, **kwargs):
        return self.base.select(*args, **kwargs)


def _query_window(policy: Policy) -> int:
    """How many of the most recent queries a policy that ``needs`` them reads (its observation window)."""
    w = getattr(policy, "q_window", None) or getattr(policy, "window", None)
    return w if isinstance(w, int) and w > 0 else 32


def _read_only(name: str):
    def setter(self, value):
        if value is None and getattr(self, "store", None) is None:  # the mixin's constructor
            return
        raise AttributeError(f"TritonKVLayer.{name} is a read-only view of the layer's storage: write through "
                             f"update() (new tokens) or compress_to() (eviction)")
    return setter


def _compact(keys, values, pos, trim: bool = False):
    """Each head's slots that hold a token moved to the end (in order), ``SENTINEL`` slots before them; ``trim``: cut
    to the longest head's count (one host read). What a policy sees of a layer with pads or per-head rows: its
    recent window (the last slots) is every head's last real tokens, never a gap, and a row looks as it would
    alone."""
    valid = pos != SENTINEL
    order = torch.sort(valid.to(torch.int8), dim=-1, stable=True).indices
    if trim:
        order = order[..., pos.shape[-1] - int(valid.sum(-1).max()):]
    take = order[..., None].expand(*order.shape, keys.shape[-1])
    return keys.gather(2, take), values.gather(2, take), pos.gather(2, order)


# the batch dimension of compress() inputs that have one (a padded batch's row gets its own slice)
_BATCH_DIM = {"head_means": 1, "layer_preference": 1, "attn_lse": 0}


def _row_inputs(inputs: dict, b: int, batch: int) -> dict:
    """``inputs`` for batch row ``b`` alone: the batched ones sliced to that row."""
    out = dict(inputs)
    for name, dim in _BATCH_DIM.items():
        t = inputs.get(name)
        if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == batch:
            out[name] = t.narrow(dim, b, 1)
    return out


def output_projection(module) -> torch.Tensor:
    """W_O of an attention module in ``nn.Linear``'s layout ``[D_model, H_q·d]`` (CriticalKV's ``o_proj``): its
    ``o_proj`` (most decoders), ``out_proj`` or ``dense`` weight, or GPT-2's ``c_proj`` (a ``Conv1D``, whose weight is
    ``[in, out]``: its transpose, a view). Another layout is a NotImplementedError naming the module."""
    from transformers.pytorch_utils import Conv1D

    for name in ("o_proj", "c_proj", "out_proj", "dense"):
        proj = getattr(module, name, None)
        if isinstance(proj, torch.nn.Linear):
            return proj.weight
        if isinstance(proj, Conv1D):
            return proj.weight.t()
    raise NotImplementedError(f"criticalkv reads each layer's output projection W_O, and {type(module).__name__} "
                              f"has none of o_proj, c_proj, out_proj or dense as an nn.Linear (or Conv1D)")


def _pad_to(t, width: int, fill):
    """``t`` ``[B, H, m, ...]`` padded with ``fill`` to ``width`` slots on dim 2."""
    if t.shape[2] == width:
        return t
    extra = t.new_full((*t.shape[:2], width - t.shape[2], *t.shape[3:]), fill)
    return torch.cat([t, extra], dim=2)


class TritonKVLayer(CacheLayerMixin):
    """One layer: its ``store`` (dense or ragged), the tokens seen so far and the last queries (window policies).

    ``keys``/``values``/``pos`` are read-only views of the storage (``pos``: each slot's sequence index,
    ``SENTINEL`` for pads and empty slots); ``n`` the slots in use (the longest row of a ragged store).

    Left-padded batches: once a forward carries pads (``mark_padding``), the layer keeps per-row counters (``pads``,
    ``row_n``, ``row_since``, ``row_alloc``) and decides and runs each compression per batch row on that row's own
    tokens (``compress_rows``), exactly as the row alone would: a row's logits do not depend on its neighbours."""

    is_compileable = False
    is_sliding = False
    is_croppable = False
    slides = True  # can serve a sliding-window layer (``window``)

    def __init__(self, cache: "TritonKVCache", layer_idx: int):
        super().__init__()
        self._cache, self.layer_idx = weakref.ref(cache), layer_idx
        self.store = None
        self.seen = 0  # tokens fed (host), pads included
        self.since = 0  # tokens fed since the last compression
        self.allocated = False  # compressed with per-head budgets: every later block is over the layer total
        self.has_invalid = False  # some slot below n holds no token (a pad, or a gap of a shorter row)
        self.peak = 0  # most slots ever in use
        self.queries: Optional[torch.Tensor] = None  # the last queries, for window policies
        self._suffix = None  # within one attention call: ((store, n), held_suffix of its slots) for compress_to
        self._pending = None  # (keys, values) of a forward of several prompt blocks, until its attention call
        self._unattended = False  # an eager update no "tritonkv" attention call followed yet (``_expect_attention``)
        self.window: Optional[int] = None  # a sliding-window layer's window (set by the attention call): see ``slide``
        self._qbuf = self._qcount = None  # reserved: a fixed window of queries kept current on the device
        self.pads: Optional[list[int]] = None  # per batch row, pads fed (set by the first padded forward)
        self.row_n: list[int] = []  # per row: the longest head's tokens held (pads never count)
        self.row_since: list[int] = []  # per row: real tokens fed since its last compression
        self.row_alloc: list[bool] = []  # per row: last compressed with per-head budgets
        self.row_block: list[int] = []  # per row: real tokens fed since the row's last block end

    # the owning cache, held weakly: a strong back-reference would put every cache in a reference cycle, so its
    # tensors would outlive the last reference until Python's cyclic collector ran (GBs at long context)
    cache = property(lambda self: self._cache())

    # the mixin's attributes, read from the store
    keys = property(lambda self: None if self.store is None else self._dense().keys, _read_only("keys"))
    values = property(lambda self: None if self.store is None else self._dense().values, _read_only("values"))
    pos = property(lambda self: None if self.store is None else self._dense().pos)
    n = property(lambda self: 0 if self.store is None else self.store.n)

    def _dense(self) -> DenseStore:
        return self.store.to_dense() if self.store.ragged else self.store

    # -- storage -----------------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, _, D = key_states.shape
        self._shape = (B, H, D)
        self._empty = (key_states.new_zeros(B, H, 0, D), value_states.new_zeros(B, H, 0, value_states.shape[-1]),
                       torch.full((B, H, 0), SENTINEL, dtype=torch.int32, device=self.device))
        self.store = DenseStore.wrap(*self._empty)
        # n and seen on the device, for a compiled step: kept current once the layer is reserved (``_sync_fill``)
        self.fill = torch.zeros((), dtype=torch.int64, device=self.device)
        self.seen_dev = torch.zeros((), dtype=torch.int64, device=self.device)
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        return 0 if self.store is None or self.store.ragged else self.store.capacity

    def reserve(self, capacity: int) -> None:
        """Static buffers of at least ``capacity`` slots for a compiled decode loop: later compressions write into
        them in place (their addresses stay fixed for CUDA graphs) instead of shrinking the layer."""
        if self.store.ragged:
            raise NotImplementedError("compiled decoding needs one budget for every head (no allocation): "
                                      "per-head (ragged) layers decode eagerly")
        if capacity > self.store.capacity:
            self.store.resize(capacity)
        self.store.static = True
        self._sync_fill(seen=True)
        static = [self.store.keys, self.store.values, self.store.pos, self.fill, self.seen_dev]
        if self.cache._wants_queries and self._qbuf is None and self.queries is not None:
            # window policies: the last W queries in a fixed buffer that compiled steps roll on the device
            W, q = self.cache.q_window, self.queries
            self._qbuf = q.new_zeros(*q.shape[:2], W, q.shape[-1])
            self._qbuf[:, :, W - q.shape[2]:] = q
            self._qcount = torch.full((), q.shape[2], dtype=torch.int64, device=self.device)
            static += [self._qbuf, self._qcount]
        if not _compiling():  # fixed data pointers: a compiled step (CUDA graphs) mutates them in place
            for t in static:
                torch._dynamo.mark_static_address(t)

    def roll_queries(self, query) -> None:
        """Window policies in a reserved (compiled) layer: shift the fixed window of saved queries by the new ones, in
        place on the device (no shape or host value changes, so no recompile)."""
        if self._qbuf is None:
            return
        W = self._qbuf.shape[2]
        self._qbuf.copy_(torch.cat([self._qbuf, query], dim=2)[:, :, -W:])
        self._qcount.add_(query.shape[2])

    def _reserved_queries(self):
        """The saved window of a reserved layer: its last ``min(queries fed, W)`` queries (one host read)."""
        W = self._qbuf.shape[2]
        return self._qbuf[:, :, W - min(int(self._qcount), W):]

    def _check_shape(self, key_states) -> None:
        B, H, _, D = key_states.shape
        if (B, H, D) != self._shape:
            raise ValueError(
                f"this TritonKVCache layer {self.layer_idx} holds keys for batch {self._shape[0]}, "
                f"{self._shape[1]} KV heads of dim {self._shape[2]}, but the model gave [B, H_kv, T, D] = "
                f"{tuple(key_states.shape)}: a cache belongs to one model and batch (make a new one with make_cache)")

    def _expect_attention(self) -> None:
        """An eager update: the "tritonkv" attention call must follow it (``after_attention`` clears the mark). A
        second update of a layer with none in between means the model attends without it — it was not run under
        ``use_tritonkv``, or its attention does not go through transformers' ``AttentionInterface`` — and the cache
        would grow without ever compressing: a RuntimeError, not a silently unbounded cache."""
        if self._unattended:
            drop_hand_over()
            raise RuntimeError(
                f"layer {self.layer_idx} of this TritonKVCache was written twice with no 'tritonkv' attention call in "
                f"between: the model attends with its own attention function, so the cache would never compress. Run "
                f"the model inside `use_tritonkv(model)` (tritonkv's `generate`, `prefill` and `compressing` do) or "
                f"load it with attn_implementation='tritonkv'; a model whose attention does not go through "
                f"transformers' AttentionInterface cannot use this cache")
        self._unattended = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif not _compiling():
            self._check_shape(key_states)
        if not _compiling():
            self._expect_attention()
        T = key_states.shape[2]
        if _compiling():  # static shapes, no host state: write at the device fill index, return everything
            if not self.store.static:  # the device counters are kept current for reserved layers only
                raise RuntimeError("a step traced by torch.compile needs static buffers: call "
                                   "cache.reserve(capacity) after the prompt and before compiled decode steps")
            st = self.store
            slot = self.fill + torch.arange(T, device=self.device)
            st.keys.index_copy_(2, slot, key_states)
            st.values.index_copy_(2, slot, value_states)
            p = (self.seen_dev + torch.arange(T, device=self.device)).to(torch.int32)
            st.pos.index_copy_(2, slot, p.expand(*st.pos.shape[:2], T))
            self.fill.add_(T)
            self.seen_dev.add_(T)
            hand_over(self, st.keys, kwargs)
            return st.keys, st.values
        if self.cache._sub_blocks is not None:  # several prompt blocks in one forward: written block by block by
            self._pending = (key_states, value_states)  # the attention call (``attend_blocks``)
            hand_over(self, key_states, kwargs)
            return key_states, value_states
        out = self._write(key_states, value_states)
        hand_over(self, out[0], kwargs)
        return out

    def _write(self, key_states, value_states):
        """Store the ``T`` new tokens of an eager forward (or of one block of it) and count them; returns the keys
        and values the attention call reads."""
        T = key_states.shape[2]
        if self.store.ragged and T == 1 and self.cache._block_ends is None:  # a decode step over per-head rows
            self.store.append(key_states, value_states)
            out = key_states, value_states
        else:
            if self.store.ragged:  # a prefill block over per-head rows: a padded working view for this forward
                self.store = self.store.to_dense(free=T)
                self.has_invalid = True
            pos = torch.arange(self.seen, self.seen + T, device=self.device, dtype=torch.int32)
            if self.store.n == 0 and not self.store.static:
                self.store = DenseStore.wrap(key_states, value_states, pos.expand(*key_states.shape[:2], T).clone())
            else:  # no slack while more of the prompt follows: this block's compression replaces the store
                slack = 0 if T > 1 and self._more_prompt(self.seen + T) else self._slack(self.store.n + T)
                self.store.append(key_states, value_states, pos, slack)
            out = self.store.view()[:2]
        self.seen += T
        self.since += T
        if self.pads is not None:  # a padded batch: every row counts the new tokens (mark_padding takes pads off)
            self.row_n = [n + T for n in self.row_n]
            self.row_since = [n + T for n in self.row_since]
            self.row_block = [n + T for n in self.row_block]
        self._sync_fill(seen=True)
        self.peak = max(self.peak, self.n)
        self.cache._record(self.layer_idx, self.n)
        return out

    def _slack(self, kept: int) -> int:
        return slack_for(kept, self.cache.decode_every)

    def _sync_fill(self, seen: bool = False) -> None:
        """Write ``n`` (and ``seen``) to the device-side counters that compiled steps read, for a reserved layer only:
        an eager layer never reads them, and each write is a device launch per layer and forward."""
        if self.store.static:
            self.fill.fill_(self.n)
            if seen:
                self.seen_dev.fill_(self.seen)

    def get_mask_sizes(self, query_length):
        """``(kv_length, kv_offset)``. Before transformers 5.x's length argument a tensor of cache positions came
        here (its length is the query length). Compiled: the static capacity, so that the fill level is never a
        host value that dynamo guards on (the attention function masks by position, not by this size)."""
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        if _compiling():
            return self.store.capacity, 0
        return self.n + query_length, 0

    def get_seq_length(self):
        """Tokens seen (pads included), not tokens stored: new tokens get RoPE positions after them."""
        return self.seen_dev if _compiling() else self.seen

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # the same question under its name before transformers 5.x

    def reset(self):
        if self.is_initialized:
            if self.store.static:  # keep the reserved buffers (their addresses) for the compiled loop
                self.store.pos.fill_(SENTINEL)
                self.store.n = 0
            else:
                self.store = DenseStore.wrap(*self._empty)
            self.fill.zero_()
            self.seen_dev.zero_()
        self.seen = self.peak = self.since = 0
        self.has_invalid, self.allocated, self.queries, self._pending = False, False, None, None
        self._unattended = False
        if self._qbuf is not None:
            self._qbuf.zero_()
            self._qcount.zero_()
        self.pads, self.row_n, self.row_since, self.row_alloc, self.row_block = None, [], [], [], []

    def _index_batch(self, fn, repeats: int = 0):
        """``fn`` applied to every tensor with a batch dimension; ``repeats``: ``fn`` repeats each row that many
        times in place (``batch_repeat_interleave``), which the per-row counters of a left-padded batch follow."""
        if self.is_initialized:
            if self.pads is not None and not repeats:
                raise NotImplementedError("beam search / batch reindexing of a left-padded batch is not supported")
            self.store.index_batch(fn)
            if self.pads is not None:
                for name in ("pads", "row_n", "row_since", "row_alloc", "row_block"):
                    setattr(self, name, [x for x in getattr(self, name) for _ in range(repeats)])
            if self.queries is not None:
                self.queries = fn(self.queries)
            self._shape = (self.store.keys.shape[0],) + self._shape[1:]

    def reorder_cache(self, beam_idx):
        self._index_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int):
        self._index_batch(lambda t: t.repeat_interleave(repeats, dim=0), repeats)

    def batch_select_indices(self, indices):
        self._index_batch(lambda t: t[indices])

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError("TritonKVCache cannot crop: evicted tokens are gone")

    # -- attention and compression ---------------------------------------------------------------
    def mark_padding(self, real: torch.Tensor) -> None:
        """``real`` bool ``[B, T]``: which of the last ``T`` fed tokens are real (False = padding). The first forward
        with pads starts the per-row counters (see the class docstring)."""
        T = real.shape[1]
        if self.pads is None:
            if bool(real.all()):
                return
            B = real.shape[0]
            self.pads, self.row_n, self.row_since = [0] * B, [self.n] * B, [self.since] * B
            self.row_alloc, self.row_block = [self.allocated] * B, [T] * B
        pads = (~real).sum(-1).tolist()
        if not any(pads):
            return
        self.pads = [p + q for p, q in zip(self.pads, pads)]
        self.row_n = [n - q for n, q in zip(self.row_n, pads)]
        self.row_since = [n - q for n, q in zip(self.row_since, pads)]
        self.row_block = [n - q for n, q in zip(self.row_block, pads)]
        st = self.store
        sl = slice(st.n - T, st.n)
        st.pos[:, :, sl] = torch.where(real[:, None, :], st.pos[:, :, sl], SENTINEL)
        keep = real[:, None, :, None].to(st.keys.dtype)  # zero pads: they add nothing to a key mean (KeyDiff)
        st.keys[:, :, sl] *= keep
        st.values[:, :, sl] *= keep
        self.has_invalid = True

    def attend(self, query, key, value, scaling, logits=None):
        """Attention of ``query`` ``[B, H_q, T, D]`` over this layer (see ``attention.py``): ``[B, T, H_q, D]``.
        ``logits``: the model's softcapping and sinks (``attention.Logits``), or None (the decode kernel serves
        both: ``kernel_decode``)."""
        B, Hq, T, D = query.shape
        st = self.store
        kernel = self.cache._use_kernel(query)
        if st.ragged:  # T == 1: the split-K decode kernel over the per-head rows (on the CPU: SDPA per row)
            if kernel or not on_host(query):
                return kernel_decode(query, st.kv, scaling, logits)
            return ragged_decode_sdpa(query, st.kv, scaling, logits)
        if _compiling():  # the whole static capacity, by position
            qpos = self.seen_dev - T + torch.arange(T, device=query.device)
            # the kernel reads every slot below the fill: only where all of them hold a token (a padded batch's
            # pads and its shorter rows' gaps are masked by position; ``pads`` never changes once traced: no guard
            # flips when a compression evicts them)
            if T == 1 and kernel and self.window is None and self.pads is None and not self.has_invalid:
                lengths = self.fill.to(torch.int32).expand(B, key.shape[1])
                return kernel_decode(query, (key, value), scaling, logits, lengths)
            return masked_attention(query, key, value, st.pos, qpos, scaling, ordered=False, window=self.window,
                                    logits=logits)
        S = key.shape[2]
        if self.window is not None and S > self.window:  # some slot is out of some query's window
            if not self.has_invalid:  # one slot per token seen, none a pad
                return block_attention(query, key, value, scaling, self.cache._masks, self.window, logits)
            qpos = torch.arange(self.seen - T, self.seen, device=query.device)
            return masked_attention(query, key, value, st.view()[2], qpos, scaling, window=self.window,
                                    logits=logits)
        if not self.has_invalid:
            if S == T:  # the prompt's first forward
                return causal_attention(query, key, value, scaling, logits)
            if T == 1:
                if kernel:
                    return kernel_decode(query, (key, value), scaling, logits)
                return decode_sdpa(query, key, value, scaling, logits)
            return block_attention(query, key, value, scaling, self.cache._masks, logits=logits)
        pos = st.view()[2]
        if self.pads is None:  # the block's own T tokens are the last T slots, every slot before them in order
            lengths = self._held_suffix(pos)
            if lengths is None:  # off the CPU (nothing is read back), or a row with a gap
                return held_attention(query, key, value, pos, scaling, self.cache._masks, logits)
            if min(min(row) for row in lengths) >= T:  # per-head rows, each ending in the block: each row alone
                return suffix_attention(query, key, value, lengths, scaling, self.cache._masks, logits)
        qpos = torch.arange(self.seen - T, self.seen, device=query.device)
        return masked_attention(query, key, value, pos, qpos, scaling, logits=logits)

    def attend_blocks(self, query, scaling, logits=None):
        """The attention call of a forward of several prompt blocks (``TritonKVCache._sub_blocks``, set by
        ``prefill``): per block, in order, store its tokens, attend its queries and compress when due, exactly as
        one forward per block would (the model's other operations act on each token alone). Returns
        ``[B, T, H_q, D]``."""
        (keys, values), self._pending = self._pending, None
        outs, s = [], 0
        for t in self.cache._sub_blocks:
            q = query[:, :, s:s + t]
            outs.append(self.attend(q, *self._write(keys[:, :, s:s + t], values[:, :, s:s + t]), scaling, logits))
            self.after_attention(q)
            s += t
        return torch.cat(outs, dim=1)

    def _held_suffix(self, pos):
        """``held_suffix(pos)`` of the store's slots in use, read once per forward: the attention call's answer is
        reused by the compression that follows it (the same store, nothing written in between)."""
        key = (self.store, self.store.n)
        if self._suffix is None or self._suffix[0] != key:
            self._suffix = (key, held_suffix(pos))
        return self._suffix[1]

    def after_attention(self, query) -> None:
        """Keep the recent queries for window policies; compress when the schedule says so (eager only)."""
        cache = self.cache
        self._unattended = False
        T = query.shape[2]
        keep = self._keeps_queries(self.seen) and self.window is None
        if cache._wants_queries and self.window is None:  # a sliding-window layer is never scored
            # this forward's compression may read the window: a multi-token forward, or one whose queries were kept
            # before it (decoding mode; the prompt's last forward, which may be one token of a padded batch's
            # row-aligned blocks that ends a row's block)
            if T > 1 or self._keeps_queries(self.seen - T):
                W = cache.q_window
                recent = query if self.queries is None or T >= W else torch.cat([self.queries, query], dim=2)
                self.queries = recent[:, :, -W:].clone()  # a copy: a view would keep the whole block's queries alive
            self.roll_queries(query)  # a reserved layer's buffer too (mixed eager and compiled steps)
        cache._maybe_compress(self, prefill=self._prompt_forward(T))
        self._suffix = None  # it holds the store: keep no old one alive
        if self.layer_idx == len(cache.layers) - 1:
            cache._masks.clear()  # the forward's last layer: no mask is kept between forwards
        if not keep:  # only this forward's compression reads them: keep none between forwards
            self.queries = None

    def _prompt_forward(self, T: int) -> bool:
        """Whether the forward of ``T`` tokens that just ended is a prompt block (compressed when over the budget)
        rather than a decode step (compressed on the ``decode_every`` schedule): a multi-token forward, or one whose
        tokens all lie in a known prompt (``prompt_length``) — a prompt's last block may be a single token."""
        prompt = self.cache.prompt_length
        return T > 1 or (prompt is not None and self.seen <= prompt)

    def _keeps_queries(self, seen: int) -> bool:
        """Whether the window of queries is kept after ``seen`` tokens: a later compression reads queries of earlier
        forwards in ``"decoding"`` mode (its re-compressions) and block-wise until a known prompt
        (``prompt_length``) is in (a last block shorter than the window reads the block before it); never in
        ``"after_prefill"`` mode, nor block-wise after the prompt, where the compression of a later multi-token
        forward reads that forward's own queries (as in ``"after_prefill"`` mode)."""
        cache = self.cache
        if cache.mode == "blockwise":
            return not cache.prompt_length or seen < cache.prompt_length
        return cache.mode == "decoding"

    def kept_tokens(self) -> torch.Tensor:
        """int64 ``[B, H_kv]`` tokens held per (batch row, KV head)."""
        return self.store.kept_tokens()

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor this layer holds: keys, values, positions, bookkeeping, the kept queries."""
        if not self.is_initialized:
            return 0
        extra = [self.fill, self.seen_dev] + ([self.queries] if self.queries is not None else [])
        return self.store.nbytes + sum(t.numel() * t.element_size() for t in extra)

    def compress_to(self, k: int) -> None:
        """Evict down to ``k`` tokens per head with the cache's policy (and allocator)."""
        if self.store.ragged:
            self.store = self.store.to_dense()
            self.has_invalid = True
        keys, values, pos = self.store.view()
        suffix = self._held_suffix(pos) if self.has_invalid else ()
        self._suffix = None  # it holds the store: keep no old one alive
        if suffix is None:
            keys, values, pos = _compact(keys, values, pos)
        ahead = self._next_block()
        out = self._select(keys, values, pos, k, invalid=self.has_invalid, queries=self.queries, seq_len=self.seen,
                           padded=ahead)
        if isinstance(out, RaggedStore):
            self.store = out
            self.has_invalid, self.allocated = False, True
        elif isinstance(out, DenseStore):  # per-head rows in their padded working view, room for the next block
            if self.store.static:
                self.store.replace(*out.view(), 0)
            else:
                self.store = out
            self.has_invalid, self.allocated = True, True
        else:
            # between prompt blocks no slack: the next block's update grows the store by one concatenation
            self.store.replace(*out, 0 if ahead else self._slack(out[0].shape[2]))
            # kept slots of a view that held a token in every slot all hold one: no read-back (a device sync)
            self.has_invalid = self.has_invalid and bool((out[2] == SENTINEL).any())
        self._compressed()

    def slide(self) -> None:
        """A sliding-window layer (``window`` W, transformers' ``sliding_window``: a query sees itself and the W - 1
        tokens before it): keep the last W - 1 slots, all that a later query can see, as the stock model's sliding
        cache does. Its slots stay one per token seen (pads included), so a chunk of queries attends only the
        slots its window reaches; the policy never scores it (nothing outside the window is ever seen again)."""
        keep = self.window - 1
        if self.store.ragged or self.store.n <= keep:
            return
        self.store.keep_last(keep, max(self._slack(keep), self._next_block()))  # room for the next prompt block
        self._sync_fill()
        self.cache._record(self.layer_idx, self.n)

    def _more_prompt(self, seen: int) -> bool:
        """Whether more of a known prompt (``prompt_length``) is to come block-wise after ``seen`` tokens (a batch
        without pads)."""
        cache = self.cache
        return cache.mode == "blockwise" and bool(cache.prompt_length) and self.pads is None and \
            seen < cache.prompt_length

    def _next_block(self) -> int:
        """Tokens of the next prompt block when more of a known prompt is to come block-wise (``_more_prompt``),
        else 0. A dense compression between prompt blocks then keeps no slack (the next block's update
        concatenates: one copy, where free slots cost an allocation, a fill and a copy here and a copy there), and
        per-head rows stay in their padded working view with room for that block (the next block would build it
        again)."""
        cache = self.cache
        if not self._more_prompt(self.seen):
            return 0
        return min(cache.block_size, cache.prompt_length - self.seen)

    def _compressed(self) -> None:
        cache = self.cache
        self.since = 0
        self._sync_fill()
        cache._record(self.layer_idx, self.n)
        cache.compressions += 1

    def _select(self, keys, values, pos, k: int, *, invalid: bool, queries, seq_len: int, offset: int = 0,
                row: Optional[int] = None, padded: int = 0):
        """Run the policy (and allocator) over the slots ``keys``/``values`` ``[B, H, N, D]`` at sequence indices
        ``pos`` (``invalid``: some hold no token). Returns ``(keys, values, pos)`` of the kept slots, or a
        ``RaggedStore`` (per-head budgets) that holds no empty slot. ``offset``: subtracted from the positions the
        policy sees (a padded row's pads), ``seq_len``: the tokens of the sequence (allocators' tables), ``row``: the
        batch row these slots belong to (its slice of batched inputs). ``padded`` (the next prompt block's tokens):
        per-head rows come back in their padded working view (``RaggedStore.to_dense``'s layout) with room for that
        block and the slack, a ``DenseStore``, not ragged."""
        cache = self.cache
        policy, forced = cache.policy, None
        if invalid:
            valid = pos != SENTINEL
            sink = policy.protected(pos.shape[2], k)[0]
            policy = _MaskedPolicy.wrap(policy, valid)
            if sink:  # a padded row's sink is its first real tokens: forced, not +inf scores
                forced = valid & (valid.to(torch.int32).cumsum(-1) <= sink)
        seen_pos = pos if not offset else torch.where(pos != SENTINEL, pos - offset, SENTINEL)
        extra = cache.inputs if row is None else _row_inputs(cache.inputs, row, self._shape[0])
        inputs = dict(layer=self.layer_idx, positions=seen_pos, **extra)
        if forced is not None:
            inputs["forced"] = forced
        if cache.num_layers is not None:
            inputs["num_layers"] = cache.num_layers
        if cache.allocation is not None:  # one table over the layers, whatever each layer's view holds
            inputs["seq_len"] = seq_len
        if cache._wants_queries:
            inputs["queries"] = queries
        module = getattr(self, "module", lambda: None)()
        if "o_proj" in policy.needs and "o_proj" not in inputs and module is not None:
            inputs["o_proj"] = output_projection(module)  # CriticalKV: this layer's W_O
        if padded and cache.allocation is not None and not use_triton(keys):  # the PyTorch path: AdaKV's winners
            out = compress_kept((keys, values), policy, k, allocation=cache.allocation, **inputs)  # laid out below
        else:
            out = compress((keys, values), policy, k, allocation=cache.allocation, **inputs)
        if isinstance(out, Compressed):
            return out.keys, out.values, pos.gather(2, out.indices)
        if padded:  # the layout RaggedStore.to_dense gives
            from ...allocation.adakv import Kept  # imported by compress already

            if isinstance(out, Kept):  # straight from the winners: one copy, no ragged rows in between
                return kept_padded(out.indices, keys, values, pos, lambda width: max(self._slack(width), padded))
            width = padded_width(out)
            K, V, p, held = left_padded(out, max(self._slack(width), padded), width)
            P = torch.where(held & (p >= 0), pos.gather(2, p.clamp(min=0)), SENTINEL)
            return DenseStore(K, V, P, width)
        # a RaggedKV (per-head budgets): stored as it is, no padding back
        return RaggedStore.from_selection(out, pos, self.seen, self._slack(k))

    _tensor_parallel = property(lambda self: self.cache.inputs.get("process_group") is not None)

    def rows_due(self) -> list:
        """Per batch row of a padded layer: the row's budget when its own schedule (the rule of
        ``TritonKVCache._maybe_compress`` on its own counters) says it compresses now, else None. A row's forward
        is its block: the real tokens fed since its last block end (several forwards of a row-aligned prefill)."""
        cache = self.cache
        ends = cache._block_ends  # rows whose prefill block ends with this forward (None: every row's)
        due = []
        for b, pad in enumerate(self.pads):
            k = resolve_budget(cache.budget, max(1, (cache.prompt_length or self.seen) - pad))
            n, since, alloc = self.row_n[b], self.row_since[b], self.row_alloc[b]
            if ends is not None and not ends[b]:
                due.append(None)
                continue
            prefill, self.row_block[b] = self._prompt_forward(self.row_block[b]), 0
            if prefill:
                now = n > k or (alloc and since > 0)
            else:
                now = cache.decode_every is not None and (since if alloc else n - k) >= cache.decode_every
            due.append(k if now else None)
        return due

    def compress_rows(self, due: list) -> None:
        """A padded layer: compress each row whose entry of ``due`` is a budget, on that row's own tokens (its pads
        and empty slots removed, positions counted from its first real token, its own queries and length), and
        keep the other rows as they are; the rows then share one dense store (shorter rows end in empty slots) or,
        with per-head budgets, one ragged store."""
        st = self.store.to_dense() if self.store.ragged else self.store
        keys, values, pos = st.view()
        parts = []  # per row: keys, values, positions and which slots hold what the row keeps
        for b, k in enumerate(due):
            kb, vb, pb = _compact(keys[b:b + 1], values[b:b + 1], pos[b:b + 1], trim=not self._tensor_parallel)
            if k is not None:
                real = self.seen - self.pads[b]
                q = self.queries
                q = None if q is None else q[b:b + 1, :, q.shape[2] - min(q.shape[2], real):]
                out = self._select(kb, vb, pb, k, invalid=self.row_alloc[b] or bool((pb == SENTINEL).any()),
                                   queries=q, seq_len=real, offset=self.pads[b], row=b)
                if isinstance(out, RaggedStore):  # its rows as they are (an allocator may give a head empty slots)
                    kb, vb, pb, held = out.padded()
                else:
                    kb, vb, pb = out
                    held = pb != SENTINEL
                self.row_since[b], self.row_alloc[b] = 0, self.cache.allocation is not None
                self.row_n[b] = int(held.sum(-1).max())
            else:
                held = pb != SENTINEL
            parts.append((kb, vb, pb, held))
        width = max(p[0].shape[2] for p in parts)
        K, V, P, held = (torch.cat([_pad_to(p[i], width, fill) for p in parts])
                         for i, fill in ((0, 0), (1, 0), (2, SENTINEL), (3, False)))
        if self.cache.allocation is not None:
            self.store = RaggedStore.from_padded(K, V, P, self.seen, self._slack(max(due, key=lambda k: k or 0)), held)
            self.has_invalid, self.allocated = False, True
        else:
            if self.store.ragged or not self.store.static:
                self.store = DenseStore.wrap(K, V, P)
            self.store.replace(K, V, P, self._slack(width))
            self.has_invalid = bool((P == SENTINEL).any())
        self._compressed()


class LagKVLayer(TritonKVLayer):
    """A layer kept by LagKV's recursive partitions (``tritonkv.policies.lagkv.LagKVState``): the state is the
    storage; each forward attends over its tokens plus the new ones, then appends the new ones to the state,
    which compresses every partition whose raw successor is complete (the result equals one-shot paper mode
    on all tokens seen, whatever the chunking). While the cache is frozen (``TritonKVCache.freeze``) the new tokens
    are held whole after the state's (``held``) and appended to it, in order, at the first forward after it thaws.
    Eager only; batches without padding."""

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.state = self.cache.policy.new_state()
        self.pending = None
        self.held = None  # (keys, values) of the tokens seen while frozen, after the state's

    def update(self, key_states, value_states, *args, **kwargs):
        if _compiling():
            raise NotImplementedError("recursive LagKV runs eagerly (its partitions have data-dependent sizes)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        else:
            self._check_shape(key_states)
        self._expect_attention()
        B, H, T, _ = key_states.shape
        parts = [(self.state.keys, self.state.values, self.state.indices.to(torch.int32))] if len(self.state) else []
        if self.held is not None:  # the tokens seen while frozen: positions [state.seen, seen)
            parts.append(self.held + (self._positions(self.state.seen, self.held[0].shape[2]),))
        parts.append((key_states, value_states, self._positions(self.seen, T)))
        keys, values, pos = (torch.cat(t, dim=2) if len(parts) > 1 else t[0] for t in zip(*parts))
        self.pending = (key_states, value_states)
        self.store = DenseStore.wrap(keys, values, pos)  # this forward's view; the state is the storage
        self.seen += T
        self._sync_fill(seen=True)
        self.peak = max(self.peak, self.n)
        self.cache._record(self.layer_idx, self.n)
        hand_over(self, keys, kwargs)
        return keys, values

    slides = False  # its state keeps every partition's pick: a window is refused once the sequence exceeds it

    def mark_padding(self, real):
        if not bool(real.all()):
            raise ValueError("recursive LagKV (mode='decoding') does not support padded batches; "
                             "use mode='after_prefill' or 'blockwise'")

    def _positions(self, start: int, T: int) -> torch.Tensor:
        B, H, _ = self._shape
        return torch.arange(start, start + T, device=self.device, dtype=torch.int32).expand(B, H, T)

    def after_attention(self, query):
        self._unattended = False
        if self.cache.frozen:  # kept whole, after the state's tokens
            self.held = self.pending if self.held is None else tuple(
                torch.cat([a, b], dim=2) for a, b in zip(self.held, self.pending))
        else:
            if self.held is not None:  # thawed: the frozen tokens first, so the state sees every token in order
                self.state.append(*self.held)
                self.held = None
            self.state.append(*self.pending)
        self.pending = None
        n = self.store.n
        self.store = None  # the forward's working view goes; the state holds the tokens
        if self.n < n:
            self.cache.compressions += 1
            self.since = 0
        self.cache._record(self.layer_idx, self.n)

    n = property(lambda self: self.store.n if self.store is not None else len(self.state) + (
        0 if self.held is None else self.held[0].shape[2]) if self.is_initialized else 0)

    def _index_batch(self, fn):
        """Beam search and batch expansion: every tensor of the state (and the held tokens) indexed alike."""
        if self.is_initialized:
            st = self.state
            for name in st.TENSORS:
                if getattr(st, name) is not None:
                    setattr(st, name, fn(getattr(st, name)))
            if self.held is not None:
                self.held = tuple(fn(t) for t in self.held)
            self._empty = tuple(fn(t) for t in self._empty)
            self._shape = (self._empty[0].shape[0],) + self._shape[1:]

    def kept_tokens(self) -> torch.Tensor:
        B, H, _ = self._shape
        return torch.full((B, H), self.n, dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        st = self.state
        parts = [getattr(st, a) for a in st.TENSORS]
        parts += list(self.held or ())
        return sum(t.numel() * t.element_size() for t in parts + [self.fill, self.seen_dev] if t is not None)

    def reserve(self, capacity):
        pass

    def reset(self):
        if self.is_initialized:
            self.store = DenseStore.wrap(*self._empty)
            self.state = self.cache.policy.new_state()
            self.held = None
        super().reset()


# inputs every layer's compression gets from the cache itself (queries: its captured window; o_proj: the attention
# module's; num_layers: when the cache knows it)
_SUPPLIED = ("layer", "positions", "forced", "seq_len", "queries", "o_proj")


def _check_supplied(policy, allocation, inputs: dict, num_layers: Optional[int]) -> None:
    """A ValueError now for an input the policy or the allocator needs that neither the cache computes nor
    ``inputs`` holds (``compress`` would raise it at the first compression, after a forward)."""
    from ...allocation import get_allocator

    given = {**dict.fromkeys(_SUPPLIED + (("num_layers",) if num_layers is not None else ()), True), **inputs}
    owners = [(f"policy {policy.name!r}", policy.missing(given), "; an input that differs by layer (SCORE's hd) is "
               "for compress() on captured tensors")]
    if allocation is not None:
        alloc = get_allocator(allocation)
        owners.append((f"allocation {getattr(alloc, 'name', alloc)!r}",
                       [n for n in getattr(alloc, "needs", ()) if given.get(n) is None], ""))  # as compress checks
    for owner, missing, note in owners:
        if missing:
            raise ValueError(f"{owner} needs the input(s) {missing}, which the cache does not compute: pass them to "
                             f"the cache by name (make_cache; generate: cache_kwargs=), handed alike to every "
                             f"layer{note}")


class TritonKVCache(Cache):
    """A transformers ``Cache`` that keeps at most ``budget`` tokens per (batch row, KV head) and layer.

    Args:
        policy: a tritonkv policy name (``"keydiff"``, ``"snapkv"``, ...) or object.
        budget: tokens kept per head (int), or the fraction kept (float in (0, 1]) of ``prompt_length`` when given,
            else of the tokens the layer has seen at each compression.
        mode: ``"after_prefill"``, ``"blockwise"`` or ``"decoding"`` (see the package docstring). The cache
            compresses after every prompt forward in every mode (a multi-token forward, or one whose tokens lie in
            a known ``prompt_length``); ``blockwise`` also tells ``generate`` and ``prefill`` to feed the prompt in
            blocks of ``block_size`` (at least 2); ``decoding`` re-compresses every
            ``decode_every`` generated tokens (default 16) — except for LagKV, which then runs its recursive
            partitions (``LagKVState``) over prompt and generated tokens alike, keeping ``ratio`` of each
            partition (a float ``budget`` sets the ratio; an int budget leaves the policy's own).
        allocation: optional allocator name/object: per-head budgets, stored as ragged rows (``RaggedKV``) that
            hold each head's kept tokens and no padding.
        num_layers: the model's layer count (allocators across layers read it).
        decode_kernel: ``"auto"`` (the Triton split-K decode kernel on CUDA, SDPA on the CPU), True or False.
        record: keep ``trace``, the (layer, slots in use) after every change.
        **inputs: extra inputs handed to every ``compress`` call.

    Memory: ``nbytes`` (every tensor held) and ``kept_tokens()`` (per layer and head). After a compression a layer
    holds its kept tokens plus a small decode slack (``storage.slack_for``), not its high-water mark. A
    sliding-window layer (its attention call's ``sliding_window``) holds the last ``sliding_window - 1`` tokens
    after every forward, as the stock model's sliding cache does, and is never compressed (``TritonKVLayer.slide``).
    """

    def __init__(self, policy, budget, *, mode: str = "after_prefill", allocation=None, block_size: int = 128,
                 decode_every: Optional[int] = None, prompt_length: Optional[int] = None,
                 num_layers: Optional[int] = None, decode_kernel="auto", record: bool = False, **inputs):
        super().__init__(layers=[])
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if mode == "blockwise" and block_size < 2:
            raise ValueError("block_size must be at least 2 in mode='blockwise': a forward of one token is a decode "
                             "step, which block-wise mode does not compress")
        if decode_kernel not in ("auto", True, False):
            raise ValueError(f"decode_kernel must be 'auto', True or False, got {decode_kernel!r}")
        if decode_every is not None and (isinstance(decode_every, bool) or not isinstance(decode_every, int)
                                         or decode_every < 1):
            raise ValueError(f"decode_every must be a positive int or None, got {decode_every!r}")
        if decode_every is not None and mode != "decoding":
            raise ValueError(f"decode_every={decode_every} sets how often mode='decoding' compresses while decoding; "
                             f"mode={mode!r} never compresses after the prompt: drop it or use mode='decoding'")
        if prompt_length is not None and (isinstance(prompt_length, bool) or not isinstance(prompt_length, int)
                                          or prompt_length < 1):
            raise ValueError(f"prompt_length must be a positive int or None, got {prompt_length!r}")
        self.policy = get_policy(policy)
        # a wrong keyword fails now, not at the first compression
        check_input_names(inputs, self.policy, allocation, f"{type(self).__name__}()")
        _check_supplied(self.policy, allocation, inputs, num_layers)  # likewise a missing input
        resolve_budget(budget, 1)  # type/range check now
        self.budget, self.mode, self.allocation = budget, mode, allocation
        self.block_size = block_size
        self.decode_every = (decode_every or 16) if mode == "decoding" else None
        self.prompt_length, self.num_layers = prompt_length, num_layers
        self.decode_kernel, self.inputs = decode_kernel, inputs
        self.q_window = _query_window(self.policy)
        self._wants_queries = "queries" in self.policy.needs
        self._layer_class = TritonKVLayer
        if mode == "decoding" and hasattr(self.policy, "new_state"):  # LagKV: its recursive partitions
            if allocation is not None:
                raise ValueError("allocation: recursive LagKV (mode='decoding') keeps m tokens per partition in "
                                 "every head; per-head budgets do not apply")
            if isinstance(budget, float):
                self.policy = dataclasses.replace(self.policy, ratio=budget)
            self._layer_class = LagKVLayer
        self.compressions = 0
        self.frozen = False
        self._block_ends: Optional[list[bool]] = None  # set by ``prefill`` around row-aligned blocks of a padded batch
        self._sub_blocks: Optional[list[int]] = None  # set by ``prefill`` around a forward of several prompt blocks
        self._masks: dict = {}  # the attention mask that the layers of one forward share (suffix_attention)
        self.record = record
        self.trace: list[tuple[int, int]] = []  # (layer, slots in use) after every change, when ``record``

    # -- transformers' Cache protocol -------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.num_layers is not None and not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"this TritonKVCache was made for a model of {self.num_layers} layers, but layer "
                             f"{layer_idx} wrote to it: a cache belongs to one model (make a new one with make_cache)")
        while len(self.layers) <= layer_idx:
            self.layers.append(self._layer_class(self, len(self.layers)))
        return self.layers[layer_idx].update(key_states, value_states, **kwargs)

    # -- the schedule -----------------------------------------------------------------------------
    def _record(self, layer_idx: int, n: int) -> None:
        if self.record:
            self.trace.append((layer_idx, n))

    def budget_for(self, seen: int) -> int:
        """Tokens per head kept by a compression after ``seen`` tokens (see the class docstring)."""
        return resolve_budget(self.budget, self.prompt_length or seen)

    def _maybe_compress(self, layer: TritonKVLayer, *, prefill: bool) -> None:
        if _compiling():
            return
        if layer.window is not None:  # a sliding-window layer keeps its window (frozen or not), never a policy's pick
            layer.slide()
            return
        if self.frozen:
            return
        if layer.pads is not None:  # a left-padded batch: each row on its own schedule and tokens
            due = layer.rows_due()
            if any(k is not None for k in due):
                layer.compress_rows(due)
            return
        k = self.budget_for(layer.seen)
        if prefill:  # over budget; per-head layers are over the layer total after any new token
            due = layer.n > k or (layer.allocated and layer.since > 0)
        else:  # decode_every tokens over the budget
            due = self.decode_every is not None and \
                (layer.since if layer.allocated else layer.n - k) >= self.decode_every
        if due:
            layer.compress_to(k)

    def _use_kernel(self, query) -> bool:
        return self.decode_kernel is True or (self.decode_kernel == "auto" and query.is_cuda)

    # -- public helpers ---------------------------------------------------------------------------
    def reserve(self, capacity: int) -> None:
        """Give every layer static buffers of at least ``capacity`` slots (a compiled decode loop)."""
        for layer in self.layers:
            layer.reserve(capacity)

    def freeze(self) -> "TritonKVCache":
        """Stop compressing (e.g. to score continuations against the cache as the prompt left it: a
        forward's own logits never depend on the eviction that follows its attention)."""
        self.frozen = True
        return self

    def compress_now(self) -> None:
        """Apply the decoding schedule eagerly (for decode steps that ran compiled)."""
        for layer in self.layers:
            if isinstance(layer, LagKVLayer):  # eager only: its partitions compressed as they filled
                continue
            if not layer.store.static:  # an eager layer: its host counters are current
                self._maybe_compress(layer, prefill=False)
                continue
            n, layer.seen = int(layer.fill), int(layer.seen_dev)
            step = n - layer.store.n
            layer.since += step
            if layer.pads is not None:
                layer.row_n = [r + step for r in layer.row_n]
                layer.row_since = [r + step for r in layer.row_since]
            layer.store.n = n
            layer.peak = max(layer.peak, layer.n)
            if layer._qbuf is not None:
                layer.queries = layer._reserved_queries()
            self._maybe_compress(layer, prefill=False)

    def stored_tokens(self) -> list[int]:
        """Slots in use per layer (the longest row of a per-head layer)."""
        return [layer.n for layer in self.layers]

    def kept_tokens(self) -> list[torch.Tensor]:
        """Per layer, int64 ``[B, H_kv]``: tokens held per (batch row, KV head)."""
        return [layer.kept_tokens() for layer in self.layers]

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (keys, values, positions, bookkeeping), summed over layers."""
        return sum(layer.nbytes for layer in self.layers)

    def memory_bytes(self, peak: bool = False) -> int:
        """Bytes of K+V in the slots in use now (or at their peak), summed over layers."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                B, H, D = layer._shape
                total += (layer.peak if peak else layer.n) * B * H * D * 2 * layer.dtype.itemsize
        return total

    def __repr__(self):
        return (f"TritonKVCache(policy={self.policy.name!r}, budget={self.budget!r}, mode={self.mode!r}, "
                f"allocation={self.allocation!r}, slots={self.stored_tokens()})")
