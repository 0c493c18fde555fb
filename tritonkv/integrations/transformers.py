"""tritonkv inside Hugging Face transformers: a compressed ``Cache`` and the attention function that reads it.

    from tritonkv.integrations.transformers import generate
    out = generate(model, input_ids, policy="keydiff", budget=0.25, mode="blockwise", max_new_tokens=32)

or, with ``model.generate`` directly::

    cache = TritonKVCache("keydiff", 512, mode="blockwise")
    with use_tritonkv(model):           # attn_implementation="tritonkv" while inside
        model.generate(input_ids, past_key_values=cache, prefill_chunk_size=cache.block_size, max_new_tokens=32)

How it fits together (``shared/DESIGN.md``, "Integration with transformers"):

- ``TritonKVCache`` holds, per layer, the kept keys/values ``[B, H_kv, slots, D]`` (one static-capacity buffer
  that grows only when an eager step needs more room) and the original sequence index of every slot
  (``pos``; padding and empty slots hold ``SENTINEL``), so attention never depends on where a token sits.
- The attention function ``"tritonkv"`` (registered in ``transformers.AttentionInterface``) attends over a
  layer's slots with ``allowed = pos <= query index`` — causal inside a block, every kept token before it,
  never a pad — then, in eager mode, compresses the layer with ``tritonkv.compress`` when it holds more
  than the budget: after every multi-token forward (the prompt, or each prefill block), and in
  ``"decoding"`` mode also every ``decode_every`` generated tokens. Window policies get the last queries
  (with RoPE) that the attention function saw.
- RoPE positions are whatever the model is given: ``generate`` and ``prefill`` here count tokens *seen*
  (``get_seq_length()`` returns tokens seen, never tokens stored).

Modes: ``"after_prefill"`` (the prompt in one forward, compressed once), ``"blockwise"`` (the prompt in
blocks of ``block_size``, compressed after each, KeyDiff Eq. 6: never more than ``budget + block_size``
slots per head), ``"decoding"`` (after-prefill plus re-compression back to the budget every
``decode_every`` steps). With a budget >= the sequence length nothing is evicted and the logits equal
the uncompressed model's up to fp32 round-off (the attention runs with an explicit mask).

torch.compile: under ``torch.compiler.is_compiling()`` ``update`` writes at a device-side fill index into
the static-capacity buffers (``TritonKVCache.reserve``) and the attention spans the whole capacity with the
``pos`` mask, so a decode step has no host read-back and no data-dependent shape; compression then runs
eagerly between steps (``TritonKVCache.compress_now``).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from ..api import Compressed, compress, resolve_budget
from ..kernels.decode_attention import decode_attention
from ..policies import Policy, get_policy

SENTINEL = 2**31 - 1  # ``pos`` of a slot that holds no token (empty, or a pad): attended by nobody
MODES = ("after_prefill", "blockwise", "decoding")
ATTN_IMPLEMENTATION = "tritonkv"

# (layer, keys and positions returned by its last update): how the attention function finds its layer
_ACTIVE: list = [None]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


# ------------------------------------------------------------------------------------------------
# policies seen through the cache


class _MaskedPolicy(Policy):
    """``base`` restricted to the slots that hold real tokens: other slots score -inf, and the sink is the
    first ``sink`` *real* tokens of each row (forced with +inf), so pads never displace real sink tokens.
    Used only while a layer holds padding or ragged gaps; otherwise the cache calls the policy itself."""

    def __init__(self, base: Policy, valid: torch.Tensor):
        self.base, self.valid = base, valid
        self.name, self.needs = base.name, base.needs

    def protected(self, n, budget):
        return 0, self.base.protected(n, budget)[1]

    def score(self, keys, values, **inputs):
        s = self.base.score(keys, values, **inputs).float()
        n, budget = keys.shape[2], inputs.get("budget", keys.shape[2])
        sink = self.base.protected(n, budget)[0]
        s = torch.where(self.valid, s.clamp(-3e38, 3e38), float("-inf"))  # finite reals, so +inf means "sink"
        if sink:
            rank = self.valid.to(torch.int32).cumsum(-1)
            s = torch.where(self.valid & (rank <= sink), float("inf"), s)
        return s

    def select(self, *args, **kwargs):
        return self.base.select(*args, **kwargs)


def _query_window(policy: Policy) -> int:
    """How many of the most recent queries a policy that ``needs`` them reads (its observation window)."""
    w = getattr(policy, "q_window", None) or getattr(policy, "window", None)
    return w if isinstance(w, int) and w > 0 else 32


# ------------------------------------------------------------------------------------------------
# one layer


class TritonKVLayer(CacheLayerMixin):
    """One layer's compressed storage.

    ``keys``/``values`` are ``[B, H_kv, capacity, D]`` buffers whose first ``n`` slots are in use; ``pos``
    (int32 ``[B, H_kv, capacity]``) holds each slot's original sequence index (0-based over every token fed,
    pads included), ``SENTINEL`` for pads and empty slots. ``seen`` counts the tokens fed so far.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, cache: "TritonKVCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.n = 0  # slots in use (host)
        self.seen = 0  # tokens fed (host)
        self.has_invalid = False  # some slot below n holds no token (a pad, or a gap of a shorter row)
        self.peak = 0  # most slots ever in use
        self.queries: Optional[torch.Tensor] = None  # the last queries, for window policies

    # -- storage -----------------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, _, D = key_states.shape
        self.keys = key_states.new_zeros(B, H, 0, D)
        self.values = value_states.new_zeros(B, H, 0, value_states.shape[-1])
        self.pos = torch.full((B, H, 0), SENTINEL, dtype=torch.int32, device=self.device)
        self.fill = torch.zeros((), dtype=torch.int64, device=self.device)  # n, on the device (compiled path)
        self.seen_dev = torch.zeros((), dtype=torch.int64, device=self.device)  # seen, on the device
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        return self.keys.shape[2] if self.is_initialized else 0

    def reserve(self, capacity: int) -> None:
        """Grow the buffers to hold at least ``capacity`` slots (eager; copies the slots in use)."""
        if capacity <= self.capacity:
            return
        B, H, _, D = self.keys.shape
        keys = self.keys.new_zeros(B, H, capacity, D)
        values = self.values.new_zeros(B, H, capacity, self.values.shape[-1])
        pos = self.pos.new_full((B, H, capacity), SENTINEL)
        keys[:, :, : self.n] = self.keys[:, :, : self.n]
        values[:, :, : self.n] = self.values[:, :, : self.n]
        pos[:, :, : self.n] = self.pos[:, :, : self.n]
        self.keys, self.values, self.pos = keys, values, pos
        if not _compiling():  # fixed data pointers: a compiled step (CUDA graphs) mutates them in place
            for t in (self.keys, self.values, self.pos, self.fill, self.seen_dev):
                torch._dynamo.mark_static_address(t)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T = key_states.shape[2]
        if _compiling():  # static shapes, no host state: write at the device fill index, return everything
            slot = self.fill + torch.arange(T, device=self.device)
            self.keys.index_copy_(2, slot, key_states)
            self.values.index_copy_(2, slot, value_states)
            p = (self.seen_dev + torch.arange(T, device=self.device)).to(torch.int32)
            self.pos.index_copy_(2, slot, p.expand(*self.pos.shape[:2], T))
            self.fill.add_(T)
            self.seen_dev.add_(T)
            keys, values, pos = self.keys, self.values, self.pos
        else:
            n = self.n
            if n + T > self.capacity:
                self.reserve(self.cache._grow_to(n + T))
            self.keys[:, :, n:n + T] = key_states
            self.values[:, :, n:n + T] = value_states
            self.pos[:, :, n:n + T] = torch.arange(self.seen, self.seen + T, device=self.device, dtype=torch.int32)
            self.n, self.seen = n + T, self.seen + T
            self.fill.fill_(self.n)
            self.seen_dev.fill_(self.seen)
            self.peak = max(self.peak, self.n)
            self.cache._record(self.layer_idx, self.n)
            keys, values, pos = self.keys[:, :, : self.n], self.values[:, :, : self.n], self.pos[:, :, : self.n]
        _ACTIVE[0] = (self, keys, pos)
        return keys, values

    def get_mask_sizes(self, query_length: int):
        return self.n + query_length, 0

    def get_seq_length(self):
        """Tokens seen (pads included), not tokens stored: new tokens get RoPE positions after them."""
        return self.seen_dev if _compiling() else self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self):
        if self.is_initialized:
            self.pos.fill_(SENTINEL)
            self.fill.zero_()
            self.seen_dev.zero_()
        self.n = self.seen = self.peak = 0
        self.has_invalid, self.queries = False, None

    def _index_batch(self, fn):
        if self.is_initialized:
            self.keys, self.values, self.pos = fn(self.keys), fn(self.values), fn(self.pos)
            if self.queries is not None:
                self.queries = fn(self.queries)

    def reorder_cache(self, beam_idx):
        self._index_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int):
        self._index_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        self._index_batch(lambda t: t[indices])

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError("TritonKVCache cannot crop: evicted tokens are gone")

    # -- attention and compression ---------------------------------------------------------------
    def mark_padding(self, real: torch.Tensor) -> None:
        """``real`` bool ``[B, T]``: which of the last ``T`` fed tokens are real (False = padding)."""
        T = real.shape[1]
        if bool(real.all()):
            return
        sl = slice(self.n - T, self.n)
        self.pos[:, :, sl] = torch.where(real[:, None, :], self.pos[:, :, sl], SENTINEL)
        keep = real[:, None, :, None].to(self.keys.dtype)  # zero pads: they add nothing to a key mean (KeyDiff)
        self.keys[:, :, sl] *= keep
        self.values[:, :, sl] *= keep
        self.has_invalid = True

    def attend(self, query, key, value, pos, scaling):
        """Attention of ``query`` ``[B, H_q, T, D]`` over the slots returned by ``update`` (``pos``: their sequence
        indices): a query at sequence index i sees every stored token with index <= i. Returns ``[B, T, H_q, D]``."""
        B, Hq, T, D = query.shape
        H, S = key.shape[1], key.shape[2]
        G = Hq // H
        if T == 1 and not self.has_invalid and self.cache._use_kernel(query):
            # split-K decode kernel: every slot below the fill index holds a token, so lengths say it all
            lengths = torch.full((B, H), S, dtype=torch.int32, device=key.device) if not _compiling() else \
                self.fill.to(torch.int32).expand(B, H)
            out = decode_attention(query, (key, value), lengths, scale=scaling)  # [B, H_q, 1, D]
        else:
            qidx = self.seen_dev - T + torch.arange(T, device=query.device)
            allowed = pos[:, :, None, :] <= qidx[:, None].to(torch.int32)  # [B, H, T, S]
            allowed = allowed | ~allowed.any(-1, keepdim=True)  # a pad query sees no token: keep its row finite
            q = query.reshape(B, H, G * T, D)  # query head h*G + g reads KV head h: no repeat_kv
            mask = allowed[:, :, None].expand(B, H, G, T, S).reshape(B, H, G * T, S)
            out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
            out = out.view(B, Hq, T, D)
        return out.transpose(1, 2).contiguous()

    def after_attention(self, query) -> None:
        """Keep the recent queries for window policies; compress when the schedule says so (eager only)."""
        cache = self.cache
        T = query.shape[2]
        if cache._wants_queries:
            W = cache.q_window
            self.queries = query[:, :, -W:] if self.queries is None or T >= W else \
                torch.cat([self.queries, query], dim=2)[:, :, -W:]
        cache._maybe_compress(self, prefill=T > 1)

    def valid(self) -> torch.Tensor:
        """bool ``[B, H, n]``: which slots hold a token."""
        return self.pos[:, :, : self.n] != SENTINEL

    def compress_to(self, k: int) -> None:
        """Evict down to ``k`` slots per head with the cache's policy (and allocator)."""
        cache, n = self.cache, self.n
        keys, values, pos = self.keys[:, :, :n], self.values[:, :, :n], self.pos[:, :, :n]
        policy = cache.policy if not self.has_invalid else _MaskedPolicy(cache.policy, pos != SENTINEL)
        inputs = dict(layer=self.layer_idx, positions=pos, **cache.inputs)
        if cache.num_layers is not None:
            inputs["num_layers"] = cache.num_layers
        if cache._wants_queries:
            inputs["queries"] = self.queries
        out = compress((keys, values), policy, k, allocation=cache.allocation, **inputs)
        if isinstance(out, Compressed):
            idx, kk, vv = out.indices, out.keys, out.values
        else:  # a RaggedKV (per-head budgets): its rows, padded back into slots (one host read)
            kk, vv, _, idx = out.to_padded(with_positions=True)
        m = idx.shape[2]
        newpos = torch.where(idx >= 0, pos.gather(2, idx.clamp(min=0).to(torch.int64)), SENTINEL)
        self.keys[:, :, :m] = kk
        self.values[:, :, :m] = vv
        self.pos[:, :, :m] = newpos
        self.pos[:, :, m:n] = SENTINEL
        self.n = m
        self.fill.fill_(m)
        self.has_invalid = bool((newpos == SENTINEL).any())
        cache._record(self.layer_idx, self.n)
        cache.compressions += 1


class LagKVLayer(TritonKVLayer):
    """A layer kept by LagKV's recursive partitions (``tritonkv.policies.lagkv.LagKVState``): the state is the
    storage; each forward attends over its tokens plus the new ones, then appends the new ones to the state,
    which compresses every partition whose raw successor is complete (the result equals one-shot paper mode
    on all tokens seen, whatever the chunking). Eager only; batches without padding."""

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.state = self.cache.policy.new_state()
        self.pending = None

    def update(self, key_states, value_states, *args, **kwargs):
        if _compiling():
            raise NotImplementedError("recursive LagKV runs eagerly (its partitions have data-dependent sizes)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, T, _ = key_states.shape
        new_pos = torch.arange(self.seen, self.seen + T, device=self.device, dtype=torch.int32).expand(B, H, T)
        if len(self.state):
            keys = torch.cat([self.state.keys, key_states], dim=2)
            values = torch.cat([self.state.values, value_states], dim=2)
            pos = torch.cat([self.state.indices.to(torch.int32), new_pos], dim=2)
        else:
            keys, values, pos = key_states, value_states, new_pos
        self.pending = (key_states, value_states)
        self.keys, self.values, self.pos = keys, values, pos
        self.n, self.seen = keys.shape[2], self.seen + T
        self.fill.fill_(self.n)
        self.seen_dev.fill_(self.seen)
        self.peak = max(self.peak, self.n)
        self.cache._record(self.layer_idx, self.n)
        _ACTIVE[0] = (self, keys, pos)
        return keys, values

    def mark_padding(self, real):
        if not bool(real.all()):
            raise ValueError("recursive LagKV (mode='decoding') does not support padded batches; "
                             "use mode='after_prefill' or 'blockwise'")

    def after_attention(self, query):
        self.state.append(*self.pending)
        self.pending = None
        if len(self.state) < self.n:
            self.cache.compressions += 1
        self.n = len(self.state)
        self.cache._record(self.layer_idx, self.n)

    def reserve(self, capacity):
        pass

    def reset(self):
        super().reset()
        if self.is_initialized:
            self.state = self.cache.policy.new_state()


# ------------------------------------------------------------------------------------------------
# the cache


class TritonKVCache(Cache):
    """A transformers ``Cache`` that keeps at most ``budget`` tokens per (batch row, KV head) and layer.

    Args:
        policy: a tritonkv policy name (``"keydiff"``, ``"snapkv"``, ...) or object.
        budget: tokens kept per head (int), or the fraction kept (float in (0, 1]) of ``prompt_length``
            (or, without it, of the first forward's length).
        mode: ``"after_prefill"``, ``"blockwise"`` or ``"decoding"`` (see the module docstring). The cache
            compresses after every multi-token forward in every mode; ``blockwise`` also tells ``generate``
            and ``prefill`` to feed the prompt in blocks of ``block_size``; ``decoding`` re-compresses every
            ``decode_every`` generated tokens (default 16) — except for LagKV, which then runs its recursive
            partitions (``LagKVState``) over prompt and generated tokens alike, keeping ``ratio`` of each
            partition (a float ``budget`` sets the ratio; an int budget leaves the policy's own).
        allocation: optional allocator name/object (per-head budgets; the cache then holds ragged rows).
        num_layers: the model's layer count (allocators across layers read it).
        decode_kernel: ``"auto"`` (the Triton split-K decode kernel on CUDA, SDPA on the CPU), True or False.
        **inputs: extra inputs handed to every ``compress`` call (``o_proj`` is per layer: pass a model to
            ``attach``).
    """

    def __init__(self, policy, budget, *, mode: str = "after_prefill", allocation=None, block_size: int = 128,
                 decode_every: Optional[int] = None, prompt_length: Optional[int] = None,
                 num_layers: Optional[int] = None, decode_kernel="auto", grow: int = 256, record: bool = False,
                 **inputs):
        super().__init__(layers=[])
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if decode_every is not None and (isinstance(decode_every, bool) or not isinstance(decode_every, int)
                                         or decode_every < 1):
            raise ValueError(f"decode_every must be a positive int or None, got {decode_every!r}")
        self.policy = get_policy(policy)
        resolve_budget(budget, 1)  # type/range check now
        self.budget, self.mode, self.allocation = budget, mode, allocation
        self.block_size = block_size
        self.decode_every = (decode_every or 16) if mode == "decoding" else None
        self.prompt_length, self.num_layers = prompt_length, num_layers
        self.decode_kernel, self.grow, self.inputs = decode_kernel, grow, inputs
        self.q_window = _query_window(self.policy)
        self._wants_queries = "queries" in self.policy.needs
        self.k: Optional[int] = None if isinstance(budget, float) and prompt_length is None else \
            resolve_budget(budget, prompt_length or 1)
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
        self.record = record
        self.trace: list[tuple[int, int]] = []  # (layer, slots in use) after every change, when ``record``

    # -- transformers' Cache protocol -------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(self._layer_class(self, len(self.layers)))
        return self.layers[layer_idx].update(key_states, value_states)

    # -- bookkeeping ------------------------------------------------------------------------------
    def _record(self, layer_idx: int, n: int) -> None:
        if self.record:
            self.trace.append((layer_idx, n))

    def _grow_to(self, need: int) -> int:
        """Capacity for ``need`` slots: the bound of the mode when known, else ``need`` rounded up."""
        if self.k is not None:
            bound = self.k + (self.block_size if self.mode == "blockwise" else 0)
            if self.decode_every:
                bound = max(bound, self.k + self.decode_every)
            if need <= bound:
                return bound
        return -(-need // self.grow) * self.grow

    def _budget_for(self, n: int) -> int:
        if self.k is None:  # a float budget without prompt_length: the first forward fixes N
            self.k = resolve_budget(self.budget, n)
        return self.k

    def _maybe_compress(self, layer: TritonKVLayer, *, prefill: bool) -> None:
        if self.frozen or _compiling():
            return
        k = self._budget_for(layer.n)
        if prefill:
            due = layer.n > k
        else:
            due = self.decode_every is not None and layer.n >= k + self.decode_every
        if due:
            layer.compress_to(k)

    def _use_kernel(self, query) -> bool:
        return self.decode_kernel is True or (self.decode_kernel == "auto" and query.is_cuda)

    # -- public helpers ---------------------------------------------------------------------------
    def reserve(self, capacity: int) -> None:
        """Give every layer at least ``capacity`` slots (static buffers for a compiled decode loop)."""
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
            layer.n, layer.seen = int(layer.fill), int(layer.seen_dev)
            layer.peak = max(layer.peak, layer.n)
            self._maybe_compress(layer, prefill=False)

    def stored_tokens(self) -> list[int]:
        """Slots in use per layer (each slot holds one token of every (batch row, KV head))."""
        return [layer.n for layer in self.layers]

    def memory_bytes(self, peak: bool = False) -> int:
        """Bytes of K+V in the slots in use now (or at their peak), summed over layers."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                B, H, _, D = layer.keys.shape
                total += (layer.peak if peak else layer.n) * B * H * D * 2 * layer.keys.element_size()
        return total

    def __repr__(self):
        return (f"TritonKVCache(policy={self.policy.name!r}, budget={self.budget!r}, mode={self.mode!r}, "
                f"allocation={self.allocation!r}, slots={self.stored_tokens()})")


# ------------------------------------------------------------------------------------------------
# the attention function and its "mask"


def attention(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """``AttentionInterface`` entry ``"tritonkv"``. With a ``TritonKVCache`` it attends over the compressed
    layer and then compresses it when due; with any other cache it is plain causal SDPA."""
    active, _ACTIVE[0] = _ACTIVE[0], None
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    T = query.shape[2]
    if active is None or active[1] is not key:
        return _plain_attention(module, query, key, value, attention_mask, scaling)
    layer, _, pos = active
    if attention_mask is not None and T > 1 and not _compiling():
        layer.mark_padding(attention_mask[:, -T:].bool())
    out = layer.attend(query, key, value, pos, scaling)
    if not _compiling():
        layer.after_attention(query)
    return out, None


def _plain_attention(module, query, key, value, attention_mask, scaling):
    """Causal SDPA for caches other than ours; ``attention_mask`` is the 2D padding mask (or None)."""
    B, Hq, T, D = query.shape
    H, S = key.shape[1], key.shape[2]
    G = Hq // H
    qi = torch.arange(S - T, S, device=query.device)
    allowed = torch.arange(S, device=query.device)[None, :] <= qi[:, None]  # [T, S]
    allowed = allowed[None, None].expand(B, 1, T, S)
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, -S:].bool()
        allowed = allowed | ~allowed.any(-1, keepdim=True)
    q = query.reshape(B, H, G * T, D)
    mask = allowed[:, :, None].expand(B, 1, G, T, S).reshape(B, 1, G * T, S)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.view(B, Hq, T, D).transpose(1, 2).contiguous(), None


def _padding_mask(batch_size=None, q_length=None, kv_length=None, attention_mask=None, **kwargs):
    """``AttentionMaskInterface`` entry: hand the 2D padding mask (or None) to the attention function, which
    builds its own mask from the cache's token positions."""
    return attention_mask


AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _padding_mask)


@contextlib.contextmanager
def use_tritonkv(model):
    """Run ``model`` with ``attn_implementation="tritonkv"`` inside the block (restored afterwards)."""
    old = model.config._attn_implementation
    if old != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        yield model
    finally:
        if old != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(old)


# ------------------------------------------------------------------------------------------------
# entry points


def make_cache(model, policy, budget, *, mode="after_prefill", allocation=None, block_size=128,
               decode_every=None, prompt_length=None, **kwargs) -> TritonKVCache:
    """A ``TritonKVCache`` for ``model`` (its layer count filled in)."""
    return TritonKVCache(policy, budget, mode=mode, allocation=allocation, block_size=block_size,
                         decode_every=decode_every, prompt_length=prompt_length,
                         num_layers=model.config.num_hidden_layers, **kwargs)


def _positions(attention_mask, start: int, T: int):
    """RoPE positions of tokens [start, start + T): the number of real tokens before each one."""
    if attention_mask is None:
        return torch.arange(start, start + T).unsqueeze(0)
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)[:, start:start + T]


@torch.no_grad()
def prefill(model, input_ids, cache: TritonKVCache, *, attention_mask=None, block_size: Optional[int] = None,
            logits_to_keep: int = 1, progress=None):
    """Feed ``input_ids`` ``[B, T]`` into ``cache`` (in blocks of ``block_size`` in blockwise mode) with RoPE at
    the tokens' true positions; returns the logits of the last ``logits_to_keep`` tokens. ``progress``: an
    optional callable taking the number of tokens fed by each block."""
    B, T = input_ids.shape
    if block_size is None:
        block_size = cache.block_size if cache.mode == "blockwise" else T
    start0 = cache.get_seq_length()
    full_mask = attention_mask
    if attention_mask is not None and attention_mask.shape[1] != start0 + T:
        raise ValueError(f"attention_mask must cover the tokens already seen plus input_ids "
                         f"({start0 + T} columns), got {attention_mask.shape[1]}")
    out = None
    with use_tritonkv(model):
        for s in range(0, T, block_size):
            ids = input_ids[:, s:s + block_size]
            a, b = start0 + s, start0 + s + ids.shape[1]
            pos = _positions(full_mask, a, ids.shape[1]).to(input_ids.device)
            out = model(input_ids=ids, position_ids=pos.expand(B, -1),
                        attention_mask=None if full_mask is None else full_mask[:, :b],
                        past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)
            if progress is not None:
                progress(ids.shape[1])
    return out.logits


def generate(model, input_ids, *, policy, budget, mode: str = "after_prefill", allocation=None,
             block_size: int = 128, decode_every: Optional[int] = None, attention_mask=None,
             cache_kwargs: Optional[dict] = None, return_cache: bool = False, **generate_kwargs):
    """``model.generate`` with a ``TritonKVCache``: ``policy`` x ``budget`` (float = fraction of the prompt) x
    ``allocation``, in ``mode`` ``"after_prefill"``, ``"blockwise"`` (true chunked prefill in blocks of
    ``block_size``) or ``"decoding"``. Other keywords go to ``model.generate`` (greedy or sampling, left-padded
    batches with ``attention_mask``). Returns the generated ids (and the cache with ``return_cache``)."""
    cache = make_cache(model, policy, budget, mode=mode, allocation=allocation, block_size=block_size,
                       decode_every=decode_every, prompt_length=input_ids.shape[1], **(cache_kwargs or {}))
    if mode == "blockwise":
        generate_kwargs.setdefault("prefill_chunk_size", block_size)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    with use_tritonkv(model):
        out = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache, **generate_kwargs)
    return (out, cache) if return_cache else out


@torch.no_grad()
def decode(model, cache, logits, max_new_tokens: int, *, attention_mask=None, eos_token_id=None, progress=None):
    """Greedy decoding from a prefilled ``cache`` (ours, or any transformers cache) given the last logits
    ``[B, V]``: returns the new token ids ``[B, <= max_new_tokens]``. RoPE positions continue from the tokens
    seen; with the prompt's ``attention_mask`` ``[B, T]`` (a left-padded batch) from each row's real tokens."""
    B = logits.shape[0]
    real = None if attention_mask is None else attention_mask.long().sum(-1, keepdim=True).to(logits.device)
    out = []
    with use_tritonkv(model) if isinstance(cache, TritonKVCache) else contextlib.nullcontext():
        for i in range(max_new_tokens):
            nxt = logits.argmax(-1, keepdim=True)
            out.append(nxt)
            if progress is not None:
                progress(1)
            if i == max_new_tokens - 1 or (eos_token_id is not None and bool((nxt == eos_token_id).all())):
                break
            if real is None:
                pos = torch.full((B, 1), int(cache.get_seq_length()), dtype=torch.long, device=nxt.device)
            else:
                pos = real + i
            if attention_mask is not None:  # caches other than ours read the pads from it
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=1)
            logits = model(input_ids=nxt, position_ids=pos, attention_mask=attention_mask, past_key_values=cache,
                           use_cache=True).logits[:, -1]
    return torch.cat(out, dim=1)
