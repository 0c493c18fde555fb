"""Memory inside a model (tritonkv/integrations/transformers): no attention call on the prompt path builds an
``H·T·S`` tensor, a layer holds what it keeps (kept tokens + the stated slack, uniform and per-head budgets
alike), per-head budgets stay ragged through decoding, and float budgets are a fraction of the tokens seen.
On a small random Llama (2 layers, 8 query / 2 KV heads, head_dim 32); no download."""
import importlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from tritonkv.integrations import transformers as tt

H_KV, D = 2, 32


def _model(layers=2):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=H_KV, head_dim=D, max_position_embeddings=40000)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


def _ids(n, seed=0, batch=1):
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


class LargestTensor(TorchDispatchMode):
    """Records the largest allocation (in elements of its dtype) that any aten op makes: the storage of an output
    that is not a view of an input."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                n = t.untyped_storage().nbytes() // t.element_size()
                if n > self.largest:
                    self.largest, self.op = n, str(func)
        return out


@pytest.mark.parametrize("mode,padded", [("after_prefill", False), ("after_prefill", True), ("blockwise", False),
                                         ("blockwise", True)])
def test_prompt_path_builds_no_HTS_tensor(model, mode, padded):
    """A 2048-token prompt (T = S = 2048 in one forward, or blocks of 512 over the kept prefix), with and without a
    left-padded row: no op on the prompt path — attention, masks, scoring, selection — allocates H_kv·T·S
    elements (the old explicit mask alone was B·H_q·T·S)."""
    T = 2048
    ids = _ids(T, batch=2 if padded else 1)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :300] = 0
    cache = tt.make_cache(model, "keydiff", 0.25, mode=mode, block_size=512)
    with LargestTensor() as spy:
        tt.prefill(model, ids, cache, attention_mask=mask)
    assert spy.largest < H_KV * T * T, (spy.largest, spy.op)
    # 0.25 of the tokens seen; block-wise, the padded row's blocks start at its first real token (column 300), so
    # the forwards end at 512, 812, 1024, 1324, 1536, 1836 and 2048, and one row or the other compresses after each
    forwards = 1 if mode == "after_prefill" else 7 if padded else T // 512
    assert cache.compressions == 2 * forwards


def _kv_bytes(cache):
    """Bytes of the kept keys and values plus their positions: what the cache must hold."""
    total = 0
    for layer in cache.layers:
        st = layer.store
        pos_bytes = st.kv.positions.element_size() if st.ragged else st.pos.element_size()
        total += int(layer.kept_tokens().sum()) * (2 * D * layer.dtype.itemsize + pos_bytes)
    return total


def test_after_prefill_holds_what_it_keeps(model):
    """after_prefill at 4096 tokens, budget 0.1 (409 per head): each layer holds exactly 409 + slack_for(409) slots
    (dense), and nbytes is that formula — not the 4096-slot high-water mark."""
    n, k = 4096, math.floor(0.1 * 4096)
    cache = tt.make_cache(model, "keydiff", 0.1, mode="after_prefill", prompt_length=n)
    tt.prefill(model, _ids(n), cache)
    cap = k + tt.slack_for(k)
    per_layer = 1 * H_KV * cap * (2 * D * 4 + 4) + 2 * 8  # keys + values fp32, int32 positions, fill + seen
    assert [layer.store.capacity for layer in cache.layers] == [cap] * 2
    assert cache.nbytes == 2 * per_layer
    assert [c.tolist() for c in cache.kept_tokens()] == [[[k] * H_KV]] * 2
    assert cache.nbytes <= 1.1 * _kv_bytes(cache)


def test_per_head_budgets_stay_ragged(model):
    """AdaKV: a layer stores a RaggedKV whose flat storage is the kept tokens plus 16 slots per head (its winners
    copied into rows of capacity length + 16, a static size): no padding back to the longest head. Decode steps append in place (the storage's
    address does not move while slack lasts) and attend through the ragged decode attention, which equals plain
    attention over the same kept tokens."""
    n, k = 2048, 200
    cache = tt.make_cache(model, "keydiff", k, allocation="adakv", mode="after_prefill")
    logits = tt.prefill(model, _ids(n), cache)[:, -1]
    kept = cache.kept_tokens()
    assert all(int(c.sum()) == H_KV * k for c in kept)
    assert any(len(set(c.flatten().tolist())) > 1 for c in kept)  # genuinely per-head
    R, T_cap = H_KV, H_KV * k + H_KV * 16  # the layer total + the slack of every row
    for layer in cache.layers:
        assert layer.store.ragged and layer.store.kv.keys.shape[0] == T_cap
    # K, V fp32 and int64 positions per flat slot; row_start, length, next_position; fill and seen
    assert cache.nbytes == 2 * (T_cap * (2 * D * 4 + 8) + (R + 1) * 8 + R * 4 + R * 8 + 2 * 8)
    ptr = [layer.store.kv.keys.data_ptr() for layer in cache.layers]
    tt.decode(model, cache, logits, 5)
    assert [layer.store.kv.keys.data_ptr() for layer in cache.layers] == ptr
    assert all(int(c.sum()) == H_KV * (k + 4) for c in cache.kept_tokens())
    # the ragged decode path against masked attention over the padded view of the same rows
    layer = cache.layers[0]
    q = torch.randn(1, 8, 1, D, generator=torch.Generator().manual_seed(3))
    got = layer.attend(q, None, None, D ** -0.5)
    K, V, pos, _ = (*layer.store.to_dense().view(), None)
    want = tt.masked_attention(q, K, V, pos, torch.tensor([layer.seen]), D ** -0.5, ordered=False)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_masked_attention_takes_any_sdpa_output_layout(monkeypatch):
    """CUDA's SDPA kernels return ``[B, H, M, D]`` laid out as ``[B, M, H, D]`` (not contiguous; a per-head
    cache's block-wise prefill failed on an H100 with a ``view`` error): masked attention over grouped queries
    gives the same result from that layout as from a contiguous one."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 5, 16, generator=g)
    k, v = torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    pos = torch.stack([torch.randperm(9, generator=g) for _ in range(4)]).view(2, 2, 9).to(torch.int32)
    want = tt.masked_attention(q, k, v, pos, torch.arange(4, 9), 0.25, ordered=False)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: sdpa(*a, **kw).transpose(1, 2).contiguous().transpose(1, 2))
    assert torch.equal(tt.masked_attention(q, k, v, pos, torch.arange(4, 9), 0.25, ordered=False), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_elements", [None, 64])
def test_suffix_attention_shares_one_mask(monkeypatch, dtype, mask_elements):
    """Per-head rows (each (row, head)'s last ``lengths`` slots, the block last): the layers of a forward share one
    mask (``masks``), the last columns of the widest built, and get bit for bit what a mask of their own gives, over
    wider and narrower views in turn, grouped queries (G = 4), two batch rows, chunks of queries (``mask_elements``
    small); both equal masked attention over the same slots (the others ``SENTINEL``)."""
    at = importlib.import_module("tritonkv.integrations.transformers.attention")  # the package's name is the function
    if mask_elements is not None:
        monkeypatch.setattr(at, "MASK_ELEMENTS", mask_elements)
    g = torch.Generator().manual_seed(0)
    B, T, masks, widest = 2, 5 if mask_elements is None else 40, {}, 0  # 40 queries: chunks of 16, 16 and 8
    for S in (T + 7, T + 15, T + 4, T + 15, T + 11):
        q = torch.randn(B, 8, T, 16, generator=g).to(dtype)
        k, v = (torch.randn(B, 2, S, 16, generator=g).to(dtype) for _ in range(2))
        lengths = torch.randint(T, S + 1, (B, 2), generator=g)
        lengths[0, 0] = S  # a row over the whole view
        got = at.suffix_attention(q, k, v, lengths.tolist(), 0.25, masks)
        assert torch.equal(got, at.suffix_attention(q, k, v, lengths.tolist(), 0.25))
        j = torch.arange(S)
        pos = torch.where(j >= S - lengths[..., None], 100 + j, tt.SENTINEL).to(torch.int32)
        want = tt.masked_attention(q, k, v, pos, torch.arange(100 + S - T, 100 + S), 0.25)
        assert torch.allclose(got.float(), want.float(), atol=1e-6 if dtype == torch.float32 else 1e-2)
        widest = max(widest, S)
        assert len(masks) == 1 and (mask_elements or next(iter(masks.values())).shape[1] == widest)


def test_ragged_decode_sdpa_rows():
    """One decode query over per-head rows of two batch rows, one row empty (zeros), grouped queries (G = 4): each
    row's SDPA lands on its own query heads, as masked attention over the padded view of the same rows gives."""
    from tritonkv.cache import RaggedKV
    from tritonkv.integrations.transformers.storage import left_padded

    at = importlib.import_module("tritonkv.integrations.transformers.attention")
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, H_KV, 12, D, generator=g), torch.randn(2, H_KV, 12, D, generator=g)
    kv = RaggedKV.from_selection(torch.randn(2, H_KV, 12, generator=g), torch.tensor([5, 0, 12, 3]), keys, values)
    q = torch.randn(2, 4 * H_KV, 1, D, generator=g)
    got = at.ragged_decode_sdpa(q, kv, D ** -0.5)
    K, V, _, held = left_padded(kv)
    pos = torch.where(held, 0, tt.SENTINEL).to(torch.int32)  # every held token precedes the query (position 1)
    want = tt.masked_attention(q, K, V, pos, torch.tensor([1]), D ** -0.5)
    assert torch.allclose(got, torch.where(held.any(-1).repeat_interleave(4, 1)[:, None, :, None], want, 0.0),
                          atol=1e-6)
    assert not got[0, 0, 4:].any()  # the empty row (batch 0, KV head 1)


@pytest.mark.parametrize("policy", ["keydiff", "snapkv"])
def test_blockwise_float_budget_is_a_fraction_of_tokens_seen(policy):
    """Streaming 32,768 tokens block-wise at 0.1 with no prompt_length keeps floor(0.1 · 32768) = 3276 tokens per
    head (not 10 % of the first block, compounded), and the layer never holds more than that + one block."""
    model = _model(layers=1)
    n, block = 32768, 1024
    cache = tt.make_cache(model, policy, 0.1, mode="blockwise", block_size=block, record=True)
    tt.prefill(model, _ids(n, seed=2), cache)
    assert cache.kept_tokens()[0].tolist() == [[3276] * H_KV]
    assert max(m for _, m in cache.trace) <= 3276 - 102 + block  # the bound before the last block: 0.1·31744 + block


def _held_bytes(cache) -> int:
    """Bytes of every storage a tensor held by the cache keeps alive (views count their whole storage)."""
    seen, total = set(), 0
    for layer in cache.layers:
        st = layer.store
        if isinstance(layer, tt.LagKVLayer):  # the recursive state is the storage
            ts = [getattr(layer.state, a) for a in ("c_keys", "c_values", "c_indices", "u_keys", "u_values")]
            assert st is None  # no materialised copy of the state between forwards
        elif st.ragged:
            ts = [st.kv.keys, st.kv.values, st.kv.positions, st.kv.row_start, st.kv.length, st.kv.next_position]
        else:
            ts = [st.keys, st.values, st.pos]
        for t in ts + [layer.fill, layer.seen_dev, layer.queries]:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("policy,mode,allocation", [("snapkv", "blockwise", None), ("snapkv", "blockwise", "adakv"),
                                                    ("snapkv", "after_prefill", None), ("lagkv", "decoding", None)])
def test_nbytes_is_what_the_cache_keeps_alive(model, policy, mode, allocation):
    """Block-wise SnapKV (it keeps its last window of queries between blocks), after-prefill, recursive LagKV: the
    storages the cache keeps alive add up to ``nbytes`` — no view of a whole prefill block (queries, keys) hides
    behind a small tensor — through the prompt and a few decode steps."""
    cache = tt.make_cache(model, policy, 0.1, mode=mode, block_size=512, allocation=allocation)
    logits = tt.prefill(model, _ids(2048), cache)[:, -1]
    assert _held_bytes(cache) == cache.nbytes
    tt.decode(model, cache, logits, 3)
    assert _held_bytes(cache) == cache.nbytes


@pytest.mark.parametrize("policy,mode,allocation", [
    ("snapkv", "after_prefill", None), ("snapkv", "blockwise", "adakv"), ("criticalkv", "after_prefill", None),
    ("keydiff", "decoding", None), ("lagkv", "decoding", None)])
def test_a_cache_is_freed_with_its_last_reference(model, policy, mode, allocation):
    """No reference cycle: with the cyclic collector off, a cache's memory goes when the last reference to it goes
    (a cycle would keep every request's KV alive until Python happened to collect, GBs at long context).
    Two requests run unmeasured: the first imports modules and registers ops (torch.library leaves one-time cyclic
    garbage there, no KV; whether that ran earlier in this process depends on the test order), the second records
    the plans of its compress calls (on a GPU: a plan is recorded the second time its key is seen). The collector
    then runs until it finds nothing, so that garbage of earlier tests cannot count as this request's."""
    import gc
    import weakref

    def request():
        cache = tt.make_cache(model, policy, 0.25, mode=mode, block_size=128, allocation=allocation)
        logits = tt.prefill(model, _ids(300), cache)[:, -1]
        tt.decode(model, cache, logits, 3)
        return cache

    request()
    request()
    for _ in range(10):  # freeing garbage can make more (finalizers, weakref callbacks: torch.compile's of earlier
        if gc.collect() == 0:  # tests in this process), found only by the next collection: start from none at all
            break
    gc.disable()
    try:
        cache = request()
        ref, stores = weakref.ref(cache), [weakref.ref(layer.store) for layer in cache.layers
                                           if getattr(layer, "store", None) is not None]
        del cache
        assert ref() is None and all(s() is None for s in stores)
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_a_window_policy_layer_keeps_the_last_window_of_queries(model):
    """The layer always reads the last W queries fed, over prefill blocks and decode steps of any length, and
    holds exactly those (one W-query copy: resident memory counts it)."""
    cache = tt.make_cache(model, "snapkv", 10**6, mode="blockwise")
    layer = cache._layer_class(cache, 0)
    W = cache.q_window
    g = torch.Generator().manual_seed(0)
    fed = []
    for T in (40, 1, 1, 5, 1, 30, 1, 1, 33, 2) + (1,) * 40:
        q = torch.randn(1, 8, T, D, generator=g)
        fed.append(q)
        layer.after_attention(q)
        assert layer.queries.shape[2] == min(W, sum(f.shape[2] for f in fed))
        if T == 1 and len(fed) % 3 == 0:
            assert torch.equal(layer.queries, torch.cat(fed, dim=2)[:, :, -W:])
    assert torch.equal(layer.queries, torch.cat(fed, dim=2)[:, :, -W:])


@pytest.mark.parametrize("allocation", [None, "adakv"])
def test_blockwise_keeps_no_queries_once_the_prompt_is_in(model, allocation):
    """Block-wise SnapKV over a known prompt (``generate``) keeps the window of queries while blocks follow (a last
    block shorter than the window reads the one before it), then none: after the prompt and through decoding the
    cache holds what after-prefill's holds for the same kept total (the same bytes, uniform and per-head budgets),
    no window of queries on top (8 query heads · 32 · 32 fp32 per layer, ~8 % of the kept K/V here)."""
    ids, got = _ids(1000), {}
    for mode in ("blockwise", "after_prefill"):
        seen = []

        def probe(module, args, kwargs, out):  # each layer's saved window after its attention call
            seen.append(cache.layers[module.layer_idx].queries is not None)

        cache = tt.make_cache(model, "snapkv", 0.1, mode=mode, block_size=256, allocation=allocation,
                              prompt_length=ids.shape[1])
        hooks = [layer.self_attn.register_forward_hook(probe, with_kwargs=True) for layer in model.model.layers]
        try:
            logits = tt.prefill(model, ids, cache, forward_tokens=256)[:, -1]  # one forward (hook call) per block
            after_prompt = cache.nbytes
            tt.decode(model, cache, logits, 3)
        finally:
            for h in hooks:
                h.remove()
        got[mode] = after_prompt, cache.nbytes, seen
    (bw0, bw1, seen), (ap0, ap1, _) = got["blockwise"], got["after_prefill"]
    assert seen == [True] * 6 + [False] * 6  # 2 layers: blocks 1-3 keep the window; the last block, 2 steps not
    assert (bw0, bw1) == (ap0, ap1)  # the same kept total per layer: the same storage


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_elements", [None, 64])
def test_held_attention_is_masked_attention_of_ordered_slots(monkeypatch, dtype, mask_elements):
    """A block with no pads over slots in position order, its own T tokens last, empty slots (``SENTINEL``) anywhere
    before them (gaps, short heads): the shared causal mask plus a bias at the empty slots gives what comparing
    positions gives, bit for bit, with grouped queries (G = 4), two batch rows and chunks of queries
    (``mask_elements`` small), and a mask shared between calls (``masks``)."""
    at = importlib.import_module("tritonkv.integrations.transformers.attention")
    if mask_elements is not None:
        monkeypatch.setattr(at, "MASK_ELEMENTS", mask_elements)
    g = torch.Generator().manual_seed(1)
    B, H, T, masks = 2, 2, 5 if mask_elements is None else 40, {}
    for S in (T + 9, T + 3, T + 17, T):
        q = torch.randn(B, 4 * H, T, 16, generator=g).to(dtype)
        k, v = (torch.randn(B, H, S, 16, generator=g).to(dtype) for _ in range(2))
        held = torch.rand(B, H, S, generator=g) < 0.6
        held[..., S - T:] = True  # the block's own tokens
        held[0, 1, :S - T] = False  # a head holding the block alone
        pos = torch.where(held, 100 + torch.arange(S), tt.SENTINEL).to(torch.int32)
        want = tt.masked_attention(q, k, v, pos, torch.arange(100 + S - T, 100 + S), 0.25)
        got = at.held_attention(q, k, v, pos, 0.25, masks)
        assert torch.equal(got, at.held_attention(q, k, v, pos, 0.25))
        assert torch.equal(got, want)  # the same SDPA over the same 0 / -inf mask, bit for bit
        assert torch.isfinite(got).all()


@pytest.mark.parametrize("window", [1, 3, 16, 24, 200])
@pytest.mark.parametrize("mask_elements", [None, 64])
def test_sliding_window_attention_is_the_windowed_softmax(monkeypatch, window, mask_elements):
    """``block_attention`` and ``masked_attention`` with a ``window`` over slots one per sequence index (a sliding-window
    layer's), the block's T queries last: each query's softmax over the slots j with ``q - window < j <= q`` (and
    not a pad), written out with a dense [T, S] mask per row and head; windows shorter and longer than a chunk of
    queries (``mask_elements`` small: chunks of 16), grouped queries (G = 4), a left-padded second row; band masks
    kept between calls (``masks``) as the layers of one forward keep them."""
    at = importlib.import_module("tritonkv.integrations.transformers.attention")
    if mask_elements is not None:
        monkeypatch.setattr(at, "MASK_ELEMENTS", mask_elements)
    g = torch.Generator().manual_seed(2)
    B, H, G, T, D, masks = 2, 2, 4, 40, 16, {}
    for S in (T, T + 7, T + 60):
        q = torch.randn(B, H * G, T, D, generator=g)
        k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(2))
        col = torch.arange(S)
        qcol = col[S - T:]
        inside = (col[None] <= qcol[:, None]) & (col[None] > qcol[:, None] - window)  # [T, S]
        scores = torch.einsum("bhgtd,bhsd->bhgts", q.view(B, H, G, T, D), k) * 0.25
        want = torch.softmax(scores.masked_fill(~inside, float("-inf")), -1) @ v[:, :, None]  # [B, H, G, T, D]
        want = want.reshape(B, H * G, T, D).transpose(1, 2)
        assert torch.allclose(at.block_attention(q, k, v, 0.25, window=window), want, atol=1e-5, rtol=0)
        assert torch.allclose(at.block_attention(q, k, v, 0.25, masks, window), want, atol=1e-5, rtol=0)
        pos = col.to(torch.int32).expand(B, H, S).clone()
        assert torch.allclose(tt.masked_attention(q, k, v, pos, qcol, 0.25, window=window), want, atol=1e-5, rtol=0)
        pads = 5  # the second row's first 5 slots are pads: nobody sees them
        pos[1, :, :pads] = tt.SENTINEL
        padded = scores[1:].masked_fill(~(inside & (col >= pads)), float("-inf"))
        want_1 = (torch.softmax(padded, -1) @ v[1:, :, None]).reshape(1, H * G, T, D).transpose(1, 2)
        got = tt.masked_attention(q, k, v, pos, qcol, 0.25, window=window)
        real = qcol >= pads  # a pad's own query sees nothing (any finite row)
        assert torch.allclose(got[1:, real], want_1[:, real], atol=1e-5, rtol=0)
        assert torch.isfinite(got).all()


def _written_out(q, k, v, visible, scale, softcap=None, sinks=None):
    """Attention from its definition, per query head (query head h·G + g reads KV head h): logits q·k·scale, bent
    to ``softcap·tanh(s / softcap)``, -inf where ``visible`` ``[B, H_kv, T, S]`` is False, one sink logit per query
    head in the softmax's denominator (its value none); a row that sees nothing gives zeros. ``[B, T, H_q, D]``."""
    B, Hq, T, _ = q.shape
    H = k.shape[1]
    G = Hq // H
    s = torch.einsum("bhgtd,bhsd->bhgts", q.double().view(B, H, G, T, -1), k.double()) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible[:, :, None], float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True).clamp(min=-1e30))  # a row that sees nothing: all zeros
    z = e.sum(-1, keepdim=True)
    if sinks is not None:
        m = s.amax(-1, keepdim=True).clamp(min=-1e30)
        z = z + torch.exp(sinks.double().view(1, H, G, 1, 1) - m)
    out = (e / z.clamp(min=1e-300)) @ v.double()[:, :, None]  # [B, H, G, T, D]; an empty row: zeros
    return out.reshape(B, Hq, T, -1).transpose(1, 2)


@pytest.mark.parametrize("mask_elements", [None, 64])
@pytest.mark.parametrize("softcap, sinks", [(2.0, False), (None, True), (0.5, True)])
def test_every_attention_path_serves_softcapping_and_sinks(monkeypatch, mask_elements, softcap, sinks):
    """Each attention path with the model's logit softcapping and attention sinks (``Logits``: Gemma 2, gpt-oss)
    gives attention as defined, written out here per query head: causal over a first block, a later block over a
    kept prefix (with and without a sliding window), ordered slots with empty ones (``held_attention``), per-head
    rows (``suffix_attention``), slots by position with pads (``masked_attention``), a decode step over dense and
    per-head rows (PyTorch and the split-K kernel, an empty row included); grouped queries (G = 4), two batch
    rows, chunks of rows (``mask_elements`` small)."""
    from tritonkv.cache import RaggedKV
    from tritonkv.integrations.transformers.storage import left_padded

    at = importlib.import_module("tritonkv.integrations.transformers.attention")
    if mask_elements is not None:
        monkeypatch.setattr(at, "MASK_ELEMENTS", mask_elements)
    g = torch.Generator().manual_seed(3)
    B, H, G, T, Dh, scale = 2, 2, 4, 12, 16, 0.3
    sink = torch.randn(H * G, generator=g) if sinks else None
    lg = at.Logits(softcap, sink)
    close = lambda got, want: torch.allclose(got.double(), want, atol=1e-5, rtol=0)  # noqa: E731
    q = torch.randn(B, H * G, T, Dh, generator=g) * 3
    for S in (T, T + 9):
        k, v = (torch.randn(B, H, S, Dh, generator=g) for _ in range(2))
        col, qcol = torch.arange(S), torch.arange(S - T, S)
        causal = (col[None] <= qcol[:, None]).expand(B, H, T, S)
        want = _written_out(q, k, v, causal, scale, softcap, sink)
        if S == T:
            assert close(at.causal_attention(q, k, v, scale, lg), want)
        assert close(at.block_attention(q, k, v, scale, {}, logits=lg), want)
        window = causal & (col[None] > qcol[:, None] - 3)
        assert close(at.block_attention(q, k, v, scale, {}, 3, lg), _written_out(q, k, v, window, scale, softcap, sink))
        held = torch.rand(B, H, S, generator=g) < 0.6
        held[..., S - T:] = True
        pos = torch.where(held, col, tt.SENTINEL).to(torch.int32)
        want = _written_out(q, k, v, causal & held[:, :, None], scale, softcap, sink)
        assert close(at.held_attention(q, k, v, pos, scale, {}, lg), want)
        assert close(at.masked_attention(q, k, v, pos, qcol, scale, logits=lg), want)
        lengths = torch.randint(T, S + 1, (B, H), generator=g)
        rows = col >= S - lengths[..., None]
        want = _written_out(q, k, v, causal & rows[:, :, None], scale, softcap, sink)
        assert close(at.suffix_attention(q, k, v, lengths.tolist(), scale, {}, lg), want)
        pads = torch.where(col < 4, tt.SENTINEL, col).to(torch.int32).expand(B, H, S).clone()
        pads[0] = col  # the second row left-padded by 4
        visible = causal & (pads != tt.SENTINEL)[:, :, None]
        got = at.masked_attention(q, k, v, pads, qcol, scale, window=5, logits=lg)
        want = _written_out(q, k, v, visible & (col[None] > qcol[:, None] - 5), scale, softcap, sink)
        real = visible.any(-1)[:, 0].T  # [T, B]: a pad's own query sees nothing (any finite row)
        assert close(got.transpose(0, 1)[real], want.transpose(0, 1)[real])
    q1 = q[:, :, -1:]
    want = _written_out(q1, k, v, torch.ones(B, H, 1, S, dtype=torch.bool), scale, softcap, sink)
    assert close(at.decode_sdpa(q1, k, v, scale, lg), want)
    assert close(at.kernel_decode(q1, (k, v), scale, lg), want)  # the split-K kernel: cap inside, sinks by its LSE
    kv = RaggedKV.from_selection(torch.randn(B, H, S, generator=g), torch.tensor([5, 0, S, 3]), k, v)
    K, V, _, held = left_padded(kv)
    want = _written_out(q1, K, V, held[:, :, None], scale, softcap, sink)
    assert close(at.ragged_decode_sdpa(q1, kv, scale, lg), want)
    assert close(at.kernel_decode(q1, kv, scale, lg), want)


@pytest.mark.parametrize("sinks", [False, True])
def test_an_encoder_without_a_cache_attends_both_ways(sinks):
    """An encoder's attention under ``use_tritonkv`` (a multimodal model's vision tower: ``is_causal`` False, no
    cache): every query sees every key but the pads of a 2D mask, or every key with no mask (written out)."""
    at = importlib.import_module("tritonkv.integrations.transformers.attention")
    g = torch.Generator().manual_seed(4)
    B, H, G, T, Dh = 2, 2, 4, 7, 16
    q = torch.randn(B, H * G, T, Dh, generator=g)
    k, v = (torch.randn(B, H, T, Dh, generator=g) for _ in range(2))
    lg = at.Logits(None, torch.randn(H * G, generator=g)) if sinks else None
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :3] = 0  # the second row's first 3 tokens are pads
    encoder = type("Encoder", (), {"is_causal": False})()
    for m in (None, mask):
        visible = (torch.ones(B, T, dtype=torch.bool) if m is None else m.bool())[:, None, None, :].expand(B, H, T, T)
        want = _written_out(q, k, v, visible, 0.25, None, None if lg is None else lg.sinks)
        got, _ = at.attention(encoder, q, k, v, m, scaling=0.25, **({"s_aux": lg.sinks} if sinks else {}))
        assert torch.allclose(got.double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("allocation", ["adakv", "pyramid"])
def test_per_head_rows_off_the_host_attend_as_before(model, monkeypatch, allocation):
    """Block-wise SnapKV with per-head budgets where ``held_suffix`` cannot look (a GPU: it reads nothing back) and
    the layers attend with ``held_attention``: the same logits, decoded tokens and kept tokens, bit for bit, as
    comparing positions (``masked_attention``, which that path ran before)."""
    cm = importlib.import_module("tritonkv.integrations.transformers.cache")
    monkeypatch.setattr(cm, "held_suffix", lambda pos: None)  # as off the host

    def by_position(query, key, value, pos, scaling, masks=None, logits=None):
        T = query.shape[2]
        return tt.masked_attention(query, key, value, pos, pos[0, 0, -T:], scaling)  # the block's own positions

    runs = []
    for attend in (cm.held_attention, by_position):
        calls = []  # the path's calls, counted
        monkeypatch.setattr(cm, "held_attention", lambda *a, f=attend, **k: calls.append(1) or f(*a, **k))
        cache = tt.make_cache(model, "snapkv", 48, mode="blockwise", block_size=32, allocation=allocation)
        logits = tt.prefill(model, _ids(150), cache)[:, -1]
        runs.append((logits, tt.decode(model, cache, logits, 4), cache.kept_tokens(), len(calls)))
    (l0, d0, k0, n0), (l1, d1, k1, n1) = runs
    assert n0 == n1 > 0  # the path ran, in every later block of every layer
    assert torch.equal(l0, l1) and torch.equal(d0, d1) and all(torch.equal(a, b) for a, b in zip(k0, k1))
