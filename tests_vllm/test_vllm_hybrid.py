"""Models whose sliding-window layers alternate with full ones, with the attention extras vLLM's backends compute
themselves: Gemma 2 (logits soft-capped) and gpt-oss (a learned sink logit per query head). One engine per model
(``engine_run.py hybrid``): keydiff at 48 tokens, 32-token blocks and chunks, three requests one after another.

The full layers compress (the plugin's ``TritonKVSpec`` group), the sliding ones stay vLLM's; each request's greedy
tokens must equal those of the transformers model fed the same chunks with the evicted tokens masked in the full
layers, the window's mask in the sliding ones, and the cap or the sinks written out (``helpers.reference_tokens``).
"""
import helpers as H
import pytest
from engine_run import AGAIN, BUDGET, POLICY, SEQUENTIAL

KINDS = ["gemma2", "gpt-oss"]


@pytest.fixture(scope="module", params=KINDS)
def hybrid(request, scenario, model_dirs):
    return request.param, scenario(f"hybrid:{request.param}"), model_dirs(request.param)


def _reference(run, model, rid, **kw):
    return H.reference_tokens(model, run["prompts"][rid], run["tokens"][rid], run["schedule"][rid],
                              POLICY["policy"], kw.pop("budget", BUDGET), **kw)


def test_only_the_full_layers_compress(hybrid):
    kind, run, _ = hybrid
    assert run["groups"] == ["SlidingWindowManager", "TritonKVManager"], (kind, run["groups"])
    bound = H.max_blocks(BUDGET)
    for rid, n, _, t in SEQUENTIAL:
        assert n > H.WINDOW  # the sliding layers drop tokens too
        peak = max(len(ids) for _, ids in run["blocks"][rid])  # the compressed group's blocks
        assert peak <= bound, (kind, rid, peak, bound)


def test_greedy_tokens_equal_the_masked_reference(hybrid):
    """48 of 48 greedy tokens per model; the same comparison without eviction, and with the cap or the sinks
    left out of the reference, fails (the test can fail on either)."""
    kind, run, model = hybrid
    matched = total = 0
    without_eviction = without_extra = 0
    for rid, n, _, t in SEQUENTIAL:
        assert len(run["tokens"][rid]) == t and run["schedule"][rid][:3] == [0, 32, 64]
        kept = []
        ref = _reference(run, model, rid, kept_log=kept)
        assert kept, f"{kind} {rid}: nothing was evicted"
        matched += sum(a == b for a, b in zip(ref, run["tokens"][rid]))
        total += t
        without_eviction += _reference(run, model, rid, budget=10 ** 6) != run["tokens"][rid]
        without_extra += _reference(run, model, rid, extras=False) != run["tokens"][rid]
    assert (matched, total) == (48, 48), kind
    assert without_eviction >= 1 and without_extra >= 1, (kind, without_eviction, without_extra)


def test_prefix_cache_serves_no_token_of_a_hybrid_model(hybrid):
    """A prompt again, after another request reused the freed blocks, with prefix caching on: the sliding layers'
    group alone would serve a hit and leave the compressed group's blocks for those tokens unwritten; the plugin's
    group takes part in the lookup and always misses, so nothing comes from the cache and the tokens repeat."""
    kind, run, _ = hybrid
    rid, n, seed, _ = AGAIN
    first = next(r for r, m, s, _ in SEQUENTIAL if (m, s) == (n, seed))
    assert run["prompts"][rid] == run["prompts"][first]
    assert run["cached"][rid] == 0, kind
    assert run["tokens"][rid] == run["tokens"][first], kind


def test_without_the_hybrid_manager_the_engine_is_refused(hybrid):
    """``disable_hybrid_kv_cache_manager=True`` (vLLM also turns it off by itself for some models and KV
    connectors): the sliding layers' specs become full-attention ones and join the plugin's layers in one plain
    group, which would run uncompressed; the engine is refused at start, the full layer named."""
    kind, run, _ = hybrid
    res = run["hybrid_manager_off"]
    assert not res["started"], kind
    assert res["error"].startswith("TritonKVConfigError: "), res["error"]
    layer = {"gemma2": "'model.layers.1.self_attn.attn'", "gpt-oss": "'model.layers.1.attn.attn'"}[kind]
    for part in (layer, "hybrid KV-cache manager is off"):
        assert part in res["error"], (kind, part, res["error"])
