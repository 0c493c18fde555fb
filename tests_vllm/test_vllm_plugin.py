"""The plugin's pieces without an engine: registration (idempotent), the settings, the schedule, and the
compaction on a cache written by vLLM's own CPU cache writer."""
import math

import helpers as H
import pytest
import torch

import tritonkv
from tritonkv.integrations import vllm as plugin
from tritonkv.integrations.vllm.config import TritonKVConfigError, kept_start, parse_config


def test_register_twice_is_a_no_op():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import _REGISTRY_KVCACHESPEC_LIST, KVCacheSpecRegistry

    from tritonkv.integrations.vllm.spec import TritonKVManager, TritonKVSpec

    plugin.register()
    before = dict(_REGISTRY_KVCACHESPEC_LIST)
    path = AttentionBackendEnum.CPU_ATTN.get_path()
    plugin.register()
    assert dict(_REGISTRY_KVCACHESPEC_LIST) == before and plugin._REGISTERED == [1]
    assert path.endswith("backend.TritonKVCPUBackend") and AttentionBackendEnum.CPU_ATTN.get_path() == path
    # the GPU backends are overridden too (vLLM imports them only when it selects them)
    assert AttentionBackendEnum.TRITON_ATTN.get_path().endswith("triton_attn.TritonKVTritonBackend")
    assert AttentionBackendEnum.FLASH_ATTN.get_path().endswith("flash_attn.TritonKVFlashBackend")
    spec = dict(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    # the built-in specs stay registered (the registry fills them only while empty)
    assert KVCacheSpecRegistry.get_manager_class(FullAttentionSpec(**spec)) is FullAttentionManager
    assert KVCacheSpecRegistry.get_manager_class(TritonKVSpec(**spec)) is TritonKVManager
    # a group that merges the plugin's layers with plain full-attention ones (the hybrid manager off, a full layer
    # first) is refused, not an AttributeError; the plugin's layers merge as before
    with pytest.raises(TritonKVConfigError, match="hybrid KV-cache manager is off"):
        TritonKVSpec.merge([TritonKVSpec(**spec), FullAttentionSpec(**spec)])
    assert TritonKVSpec.merge([TritonKVSpec(**spec, tkv_budget=8)] * 2).tkv_budget == 8


def test_settings():
    assert parse_config({}) is None and parse_config({"other": 1}) is None
    cfg = parse_config({"tritonkv": {"policy": "streaming_llm", "budget": 0.25, "sink": 8}})
    assert cfg.budget == 0.25 and cfg.make_policy().sink == 8
    cfg = parse_config({"tritonkv": {"policy": "lagkv", "budget": 256, "policy_args": {"lag": 32}}})
    assert cfg.make_policy().lag == 32 and cfg.granularity(32) == 32
    bad = [({"policy": "knrom", "budget": 8}, "did you mean 'knorm'"),
           ({"policy": "knorm", "budget": 0}, "positive"),
           ({"policy": "knorm", "budget": 1.5}, "(0, 1]"),
           ({"policy": "knorm", "budget": True}, "budget"),
           ({"policy": "h2o", "budget": 64}, "needs the input(s) ['queries']"),
           ({"policy": "criticalkv", "budget": 64}, "o_proj"),
           ({"policy": "streaming_llm", "budget": 2, "sink": 4}, "smaller than the protected"),
           ({"policy": "knorm", "budget": 8, "window": -1}, "'window'"),
           ({"policy": "knorm", "budget": 8, "policy_args": {"lag": 3}}, "refuses its settings"),
           ({"policy": "lagkv", "budget": 64}, "below LagKV"),
           ({"budget": 8}, "needs 'policy'"),
           ("knorm", "must be a dict")]
    for raw, part in bad:
        with pytest.raises(TritonKVConfigError) as e:
            parse_config({"tritonkv": raw})
        assert part in str(e.value), (raw, str(e.value))
    with pytest.raises(TritonKVConfigError, match="multiple of the KV cache block size 32"):
        parse_config({"tritonkv": {"policy": "knorm", "budget": 8, "decode_every": 48}}).granularity(32)


def test_schedule():
    for budget in (1, 48, 64, 100):
        for g in (32, 64):
            prev = 0
            for n in range(0, 600):
                s = kept_start(n, budget, g)
                assert s == H.kept_start(n, budget, g) and s % g == 0 and s >= prev
                assert n - s <= max(budget + g - 1, n if n <= budget else 0)
                prev = s
    prev = 0
    for n in range(1, 2000):  # a fraction keeps floor(f n) (at least 1), start never goes back
        s = kept_start(n, 0.25, 32)
        assert s >= prev and s % 32 == 0 and n - s >= max(1, math.floor(0.25 * n))
        prev = s


@pytest.mark.parametrize("cfg, min_keep", [
    ({"policy": "keydiff", "budget": 0.1, "window": 64}, 64),  # the window
    ({"policy": "streaming_llm", "budget": 0.1}, 4),  # the sink
    ({"policy": "lagkv", "budget": 0.25}, 16 + 2 * 128 - 1),  # the sink and the longest tail: a lag and lag - 1 more
    ({"policy": "lagkv", "budget": 0.25, "policy_args": {"lag": 32}}, 16 + 2 * 32 - 1),
    ({"policy": "knorm", "budget": 0.1}, 1)])
def test_a_fraction_keeps_at_least_the_protected_tokens(cfg, min_keep):
    """A float budget keeps ``max(min_keep, floor(f·n))`` tokens, ``min_keep`` the fewest that hold the policy's
    protected ones, so that no compression of the schedule is refused when it runs (it was, in the attention
    forward of a running engine, for keydiff's window and LagKV's defaults): every region of prompts of 300, 600
    and 1500 tokens fed in chunks of 32 or 1024, then 200 tokens decoded, compressed as the workers compress it
    (``tritonkv.compress`` to ``n - start(n)`` tokens)."""
    c = parse_config({"tritonkv": cfg})
    assert c.min_keep == min_keep
    pol, f, g = c.make_policy(), c.budget, 32
    for prompt in (300, 600, 1500):
        for chunk in (32, 1024):
            s0 = n = compressions = 0
            while n < prompt + 200:
                n = min(n + chunk, prompt) if n < prompt else n + 1
                s1 = kept_start(n, f, g, min_keep)
                assert n - s1 >= min(n, max(min_keep, math.floor(f * n))) and s1 % g == 0
                if s1 > s0:
                    keys = torch.randn(1, 2, n - s0, 8, generator=torch.Generator().manual_seed(n))
                    assert tritonkv.compress((keys, keys), pol, n - s1).keys.shape[2] == n - s1
                    compressions += 1
                s0 = s1
            assert compressions > 0


def test_compaction_on_vllms_cache_layout():
    """Tokens written by vLLM's CPU cache writer into scattered blocks; ``compact`` keeps, per head, what
    ``tritonkv.compress`` keeps of them, in the trailing slots, and leaves other blocks alone."""
    from vllm import _custom_ops as ops

    from tritonkv.integrations.vllm.backend import cache_layout
    from tritonkv.integrations.vllm.common import compact, gather

    h, bs, d, n, s0, s1 = 2, 32, 32, 150, 32, 96  # region [32, 150): 4 blocks, keep 54 in [96, 150)
    table = torch.tensor([7, 2, 9, 4, 0, 5])  # logical block -> physical block
    g = torch.Generator().manual_seed(0)
    k = torch.randn(n, h, d, generator=g)
    v = torch.randn(n, h, d, generator=g)
    cache = torch.zeros(10, h, bs, 2 * d)
    layout = cache_layout("vec", torch.float32, h, bs, d)
    kc, vc = layout.split(cache)
    pos = torch.arange(n)
    slots = table[pos // bs] * bs + pos % bs
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, "vec")
    before = cache.clone()
    policy = tritonkv.get_policy("keydiff")
    blocks = table[s0 // bs: -(-n // bs)]
    compact(cache, [(blocks, s0, n, s1)], policy, layout)
    want = tritonkv.compress((k[s0:].transpose(0, 1)[None], v[s0:].transpose(0, 1)[None]), policy, n - s1)
    assert not torch.equal(want.indices[0, 0], want.indices[0, 1])  # heads keep different tokens
    tail = table[s1 // bs: -(-n // bs)]
    got_k = gather(kc, tail, layout.key_order)[:, : n - s1]
    got_v = gather(vc, tail, layout.value_order)[:, : n - s1]
    assert torch.equal(got_k, want.keys[0]) and torch.equal(got_v, want.values[0])
    untouched = [b for b in range(10) if b not in tail.tolist()]
    assert torch.equal(cache[untouched], before[untouched])
