"""The cache layer's contract with transformers across the supported range (``make test-transformers-min`` runs this
file on the lowest supported transformers, ``make test`` on the installed one), and the errors for misuse.

* adapters: transformers 5.2's abstract ``get_max_cache_shape`` and its ``get_mask_sizes(cache_position)``
  (a tensor of positions, not a length) next to 5.24's ``get_max_length`` and ``get_mask_sizes(query_length)``;
* plumbing: the layer reaches the attention call through transformers' attention kwargs where ``cache.update``
  receives them, else through a named context variable that each attention call clears — no module global;
* the storage views ``keys``/``values`` refuse writes (they used to drop them silently);
* a cache used with a model it was not made for (layer count, KV heads, head dim) is a ValueError that says so;
* per-head (ragged) layers in decoding mode hold ``decode_every`` free slots per row from the first rebuild.
"""
import importlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tritonkv.integrations import transformers as tt
tta = importlib.import_module("tritonkv.integrations.transformers.attention")  # the module (the package exports
# a function of the same name)


def _llama(layers=2, kv_heads=2, head_dim=16):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return _llama()


def _ids(n, seed=0):
    return torch.randint(3, 1000, (1, n), generator=torch.Generator().manual_seed(seed))


def test_a_cache_updates_and_answers_both_interfaces():
    k = torch.randn(1, 2, 8, 16)
    cache = tt.TritonKVCache("knorm", 0.25)
    keys, values = cache.update(k, k, 0)  # 5.2: TypeError (abstract get_max_cache_shape) before the adapter
    assert torch.equal(keys, k) and cache.get_seq_length() == 8
    layer = cache.layers[0]
    assert layer.get_max_length() == layer.get_max_cache_shape() == -1
    assert layer.get_mask_sizes(3) == layer.get_mask_sizes(torch.arange(8, 11)) == (11, 0)


def test_the_layer_reaches_attention_without_a_module_global(model):
    """After a forward nothing is left in the context variable (transformers 5.24: never set; 5.2: cleared by the
    attention call), and two caches interleaved on two models keep their own layers."""
    other = _llama(head_dim=32)
    caches = [tt.make_cache(m, "keydiff", 8) for m in (model, other)]
    with tt.use_tritonkv(model), tt.use_tritonkv(other), torch.no_grad():
        for step in range(3):
            for m, c in zip((model, other), caches):
                m(input_ids=_ids(12, step), use_cache=True, **{tt.cache_kwarg(m): c})
                assert tta._LAYER_UPDATED_LAST.get() is None
    assert not hasattr(tta, "_ACTIVE")
    assert [c.get_seq_length() for c in caches] == [36, 36]
    assert [c.layers[0].store.keys.shape[-1] for c in caches] == [16, 32]


def test_storage_views_refuse_writes(model):
    cache = tt.make_cache(model, "keydiff", 8)
    tt.prefill(model, _ids(12), cache)
    layer = cache.layers[0]
    for name in ("keys", "values"):
        with pytest.raises(AttributeError, match=f"{name} is a read-only view"):
            setattr(layer, name, torch.zeros(1))


@pytest.mark.parametrize("other,words", [
    (dict(layers=3), "made for a model of 2 layers"),
    (dict(kv_heads=4), "2 KV heads of dim 16"),
    (dict(head_dim=32), "2 KV heads of dim 16"),
])
def test_a_cache_used_with_another_model_is_a_clear_error(model, other, words):
    cache = tt.make_cache(model, "keydiff", 8)
    tt.prefill(model, _ids(12), cache)
    with pytest.raises(ValueError, match=words):  # was: RuntimeError "The expanded size of the tensor ..."
        tt.prefill(_llama(**other), _ids(4), cache)


def test_ragged_decoding_slack_from_the_first_rebuild(model):
    """Per-head budgets in decoding mode: after the prompt's compression every row has ``decode_every`` free slots
    (it had 16, and was re-copied 16 steps later), so ``decode_every`` steps append in place; the rows never
    hold more than budget + decode_every (rounded up to 16) slots."""
    every, budget = 48, 64
    cache = tt.make_cache(model, "keydiff", budget, allocation="adakv", mode="decoding", decode_every=every)
    logits = tt.prefill(model, _ids(200), cache)[:, -1]
    kvs = [layer.store.kv for layer in cache.layers]
    starts = [kv.row_start.clone() for kv in kvs]
    assert all(int((kv.capacity - kv.lengths).min()) >= every for kv in kvs)
    tt.decode(model, cache, logits, every)  # every - 1 appends: no re-pack, no re-compression yet
    for layer, kv, start in zip(cache.layers, kvs, starts):
        assert layer.store.kv is kv and torch.equal(kv.row_start, start)
        assert int(kv.capacity.max()) <= -(-(kv.lengths.max() - (every - 1) + every) // 16) * 16
