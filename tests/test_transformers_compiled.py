"""A compiled decode loop over a compressing cache (tritonkv/integrations/transformers), on a random Llama (no download).

``make_cache(model, policy, 64, mode="decoding", decode_every=16)``, a 80-token prompt, ``cache.reserve(96)``, a
decode step compiled with ``fullgraph=True`` (CPU: the ``aot_eager`` backend, which functionalises the cache's
in-place writes as inductor does) and ``compress_now()`` after every step, for every policy the compiled path
serves (recursive LagKV decodes eagerly): no recompile after the first step (the fill level lives on the device,
never in a guard), and the logits of the eager loop to 1e-5 at every step — window policies included, whose saved
queries the compiled steps keep current. ``benchmarks/compiled_decode.py`` runs the same loop for 500 steps.
"""
import pytest
import torch

import tritonkv
from benchmarks.compiled_decode import compiled_vs_eager, random_llama
from tritonkv.integrations import transformers as tt

ATOL = 1e-5  # fp32 round-off (measured: ~1e-7)
POLICIES = sorted(p for p in tritonkv.POLICIES if p != "lagkv")
@pytest.fixture(scope="module")
def model():
    return random_llama()


@pytest.fixture
def no_attention_kwargs(monkeypatch):
    """Layers updated without the attention kwargs, as every transformers before 5.24 updates them (5.17 on the
    GPU images: its ``Cache.update`` takes ``**kwargs``, its attention layers pass none)."""
    from tritonkv.integrations.transformers.cache import TritonKVLayer

    update = TritonKVLayer.update

    def without_attention_kwargs(self, keys, values, *args, kwargs=None, **rest):
        return update(self, keys, values, *args, **rest)
    monkeypatch.setattr(TritonKVLayer, "update", without_attention_kwargs)


@pytest.mark.parametrize("policy", ["keydiff", "snapkv"])
def test_compiled_loop_without_attention_kwargs_matches_eager(model, policy, no_attention_kwargs):
    """A compiled step whose layers get no attention kwargs finds its layer through the traced hand-over (a context
    variable would break the graph): one graph, eager's logits, the same compressions."""
    worst, recompiles, compiled_n, eager_n = compiled_vs_eager(model, policy, steps=20)
    assert recompiles == 0
    assert compiled_n == eager_n == 2 * 2  # the prompt's compression and one decode one, per layer
    assert worst <= ATOL, worst


@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_loop_compressing_every_step_matches_eager(model, policy):
    """40 steps: the cache re-compresses at steps 16 and 32 in both loops; one graph, eager's logits."""
    worst, recompiles, compiled_n, eager_n = compiled_vs_eager(model, policy, steps=40)
    assert recompiles == 0
    assert compiled_n == eager_n == 2 * 3  # the prompt's compression and two decode ones, per layer
    assert worst <= ATOL, worst


@pytest.mark.parametrize("policy", ["keydiff", "snapkv"])
def test_compiled_loop_over_sliding_window_layers_matches_eager(policy):
    """Gemma 3's sliding-window layers (window 24) beside full ones, ``compress_now`` every fourth step: between two
    calls a reserved sliding layer holds up to 27 tokens, so its compiled attention masks by the window; one graph,
    eager's logits, and only the full layer compresses (its prompt's compression and two decode ones)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    gemma = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=24,
        layer_types=["sliding_attention", "full_attention"])).eval()
    worst, recompiles, compiled_n, eager_n = compiled_vs_eager(gemma, policy, steps=40, compress_every=4)
    assert recompiles == 0
    assert compiled_n == eager_n == 3
    assert worst <= ATOL, worst


def test_window_queries_stay_current_in_compiled_steps(model):
    """SnapKV's saved window after 16 compiled steps holds the 16 decode queries last, as eagerly."""
    ids = torch.randint(3, 1000, (1, 80), generator=torch.Generator().manual_seed(1))
    caches = []
    for compiled in (True, False):
        c = tt.make_cache(model, "snapkv", 64, mode="decoding", decode_every=1000)
        logits = tt.prefill(model, ids, c)[:, -1]
        if compiled:
            c.reserve(112)
        name = tt.cache_kwarg(model)
        step = (lambda t, p, c=c: model(input_ids=t, position_ids=p, use_cache=True, **{name: c}).logits[:, -1])
        run = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
        t = logits.argmax(-1, keepdim=True)
        with tt.use_tritonkv(model), torch.no_grad():
            for i in range(16):
                t = run(t, torch.tensor([[80 + i]])).argmax(-1, keepdim=True)
        c.compress_now()
        caches.append(c)
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert a.queries.shape == b.queries.shape == (1, 4, 32, 16)
        assert torch.allclose(a.queries, b.queries, atol=1e-6, rtol=0)


@pytest.mark.parametrize("budget", [96, 64])
def test_compiled_kernel_decode_of_a_left_padded_batch_matches_eager(model, budget):
    """The split-K decode kernel (``decode_kernel=True``: what CUDA takes by default) in compiled steps over a
    left-padded batch (pads 0 and 9): the kernel reads every slot below the fill, so while a layer holds pads (budget
    96, above the prompt: the prefill keeps them) the compiled step attends by position instead; one graph (no
    guard flips when a compression evicts the pads), eager's logits, the same compressions."""
    worst, recompiles, compiled_n, eager_n = compiled_vs_eager(model, "keydiff", steps=24, budget=budget,
                                                               pads=(0, 9), decode_kernel=True)
    assert recompiles == 0
    assert compiled_n == eager_n
    assert worst <= ATOL, worst


def test_a_compiled_step_needs_reserved_buffers(model):
    """A decode step traced by torch.compile over a cache that was not ``reserve``d is refused by name: its layers
    keep their device-side fill counters current only once reserved, and a traced update writes at them."""
    cache = tt.make_cache(model, "knorm", 64, mode="decoding", decode_every=16)
    ids = torch.randint(3, 1000, (1, 80), generator=torch.Generator().manual_seed(2))
    tt.prefill(model, ids, cache)
    layer = cache.layers[0]
    cfg = model.config
    k = torch.randn(1, cfg.num_key_value_heads, 1, cfg.hidden_size // cfg.num_attention_heads)
    step = torch.compile(lambda k, v: layer.update(k, v), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"cache\.reserve\(capacity\)"):
        step(k, k.clone())


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_compiled_loop_with_softcapping_and_sinks_matches_eager(family):
    """Gemma 2's attention logit softcapping and gpt-oss's attention sinks (random, one per query head), beside
    sliding-window layers (window 24): the compiled steps attend through the same written-out softmax as eager
    ones (``attention.Logits``), in one graph, with eager's logits; only the full layer compresses."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=24,
                  layer_types=["sliding_attention", "full_attention"])
    if family == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(**common, attn_logit_softcapping=0.02)).eval()
    else:
        model = GptOssForCausalLM(GptOssConfig(**common, num_local_experts=2, num_experts_per_tok=1)).eval()
        model.set_experts_implementation("batched_mm")  # grouped_mm traces only in bf16 on a CPU (5.2)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
    worst, recompiles, compiled_n, eager_n = compiled_vs_eager(model, "keydiff", steps=20, compress_every=4)
    assert recompiles == 0
    assert compiled_n == eager_n == 2
    assert worst <= ATOL, worst
