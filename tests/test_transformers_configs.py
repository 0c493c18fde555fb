"""The transformers integration on tiny random models (no download).

* Llama, Qwen2 and Mistral (``MODELS``): with a budget >= the sequence every mode reproduces the stock model's
  greedy tokens and logits (ATOL 1e-4, fp32); compressed, block-wise prefill stays within budget + block_size slots
  per layer and decoding keeps going; ``answer`` and ``compressing`` (kvpress's patterns).
* The other grouped-query families transformers ships (``FAMILIES``): the same full-budget exactness test, with a
  left-padded row, in every mode. Each config is 2 layers, hidden size 64, 4 query heads over 2 KV heads; it keeps
  what sets the family apart (query/key norms, fused projections, attention multipliers, parallel blocks, NoPE
  layers, a query scale other than 1/sqrt(D), sliding-window layers whose window the 76-token sequences fit).
* Sliding-window layers shorter than the sequence (``WINDOWED``: Gemma 3 and Gemma 2 beside full layers, Mistral
  v0.1's every layer, Gemma 2 with attention logit softcapping, gpt-oss with attention sinks): the same exactness
  with a left-padded row in every mode, from a plain forward under ``use_tritonkv`` too; compressed, a sliding
  layer holds its window's last ``sliding_window - 1`` tokens and only the full layers compress.
* What the "tritonkv" attention function cannot compute exactly (``UNSUPPORTED``: chunked attention beyond a chunk,
  an encoder's bidirectional attention; a sliding window shorter than the sequence with recursive LagKV) must be a
  clear error naming the architecture and the feature, not silently different logits.
* Models a TritonKVCache cannot hold or compress (``UNSERVED``: attention outside transformers' AttentionInterface,
  a latent cache expanded per head, linear-attention layers) are a clear error too, never a cache that silently
  stays uncompressed; so is a cache used without the "tritonkv" attention function. Gemma 3's multimodal model
  serves text prompts (its decoder's config); an image in the prompt (bidirectional among its tokens) is a clear
  error, its vision tower exact under ``use_tritonkv``.
"""
import importlib
import warnings

import pytest
import torch
import transformers
from transformers import (BertConfig, BertLMHeadModel, BloomConfig, BloomForCausalLM, CohereConfig, CohereForCausalLM,
                          DeepseekV3Config, DeepseekV3ForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3Config,
                          Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig, GemmaConfig,
                          GemmaForCausalLM, Glm4Config, Glm4ForCausalLM, GPT2Config, GPT2LMHeadModel, GptOssConfig,
                          GptOssForCausalLM, GraniteConfig, GraniteForCausalLM, Llama4ForCausalLM, Llama4TextConfig,
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Olmo2Config,
                          Olmo2ForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM,
                          SiglipVisionConfig, SmolLM3Config, SmolLM3ForCausalLM, Starcoder2Config,
                          Starcoder2ForCausalLM)

from tritonkv.integrations import transformers as tt

# the module: ``tt.generate`` is the function
tt_generate = importlib.import_module("tritonkv.integrations.transformers.generate")

ATOL = 1e-4
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
}
SMALL = dict(COMMON, head_dim=16, pad_token_id=0)  # families whose default head_dim or pad id do not fit COMMON
SLIDING = ["sliding_attention", "full_attention"]
FAMILIES = {
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL)),  # q_norm / k_norm
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**SMALL)),  # fused qkv_proj and gate_up_proj
    "gemma": lambda: GemmaForCausalLM(GemmaConfig(**SMALL)),
    # sliding-window layers (window 128 > the 76 tokens) and a query scale of 1/sqrt(256); no logit softcapping
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(**SMALL, sliding_window=128, layer_types=SLIDING,
                                                     attn_logit_softcapping=None)),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**SMALL, sliding_window=128, layer_types=SLIDING)),
    "granite": lambda: GraniteForCausalLM(GraniteConfig(**SMALL, attention_multiplier=0.3, embedding_multiplier=2.0,
                                                        residual_multiplier=0.5, logits_scaling=2.0)),
    "olmo2": lambda: Olmo2ForCausalLM(Olmo2Config(**SMALL)),  # q_norm / k_norm over all heads
    "cohere": lambda: CohereForCausalLM(CohereConfig(**SMALL)),  # parallel attention + MLP, interleaved RoPE
    "starcoder2": lambda: Starcoder2ForCausalLM(Starcoder2Config(**SMALL)),  # biases, LayerNorm
    "smollm3": lambda: SmolLM3ForCausalLM(SmolLM3Config(**SMALL, no_rope_layers=[1, 0])),  # a NoPE layer
    # a chunked-attention layer (and a NoPE one) whose chunk of 128 the sequences fit
    "llama4": lambda: Llama4ForCausalLM(Llama4TextConfig(**SMALL, intermediate_size_mlp=96, attention_chunk_size=128,
                                                         num_local_experts=2, no_rope_layers=[1, 0])),
    # the multimodal model (how Gemma 3's 4B-27B checkpoints load) on text: its decoder's config holds the layers
    "gemma3-multimodal": lambda: Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=Gemma3TextConfig(**dict(SMALL, vocab_size=300), sliding_window=16, layer_types=SLIDING),
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                                            moe_intermediate_size=32)),  # mixture of experts
    "glm4": lambda: Glm4ForCausalLM(Glm4Config(**SMALL)),  # partial rotary, extra norms
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=512)),
}
if hasattr(transformers, "Gemma4ForCausalLM"):  # transformers >= 5.24: per-layer head dims and KV heads, K = V
    FAMILIES["gemma4"] = lambda: transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(
        **dict(SMALL, num_hidden_layers=4), global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=128, layer_types=SLIDING * 2, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8))
WINDOW = 16  # sliding windows shorter than the 70-token sequences
WINDOWED = {
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**SMALL, sliding_window=WINDOW, layer_types=SLIDING)),
    # a window of 40: attention chunks of 16 queries, shorter than the window
    "gemma3-40": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**SMALL, sliding_window=40, layer_types=SLIDING)),
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(**SMALL, sliding_window=WINDOW, layer_types=SLIDING,
                                                     attn_logit_softcapping=None)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=WINDOW)),  # every layer slides
    # attention logit softcapping (a cap of 0.02, below the random logits: every one is bent)
    # (eager: transformers 5.2 picks SDPA for Gemma 2 by default, which drops the cap)
    "gemma2-softcap": lambda: _eager(Gemma2ForCausalLM(Gemma2Config(
        **SMALL, sliding_window=WINDOW, layer_types=SLIDING, attn_logit_softcapping=0.02))),
    "gpt_oss": lambda: _with_sinks(GptOssForCausalLM(GptOssConfig(
        **SMALL, sliding_window=WINDOW, layer_types=SLIDING, num_local_experts=2, num_experts_per_tok=1))),
}
# architecture/feature the attention function cannot serve exactly -> words its error must contain
UNSUPPORTED = {
    # chunks of 32 tokens (only the model's mask says so), shorter than the 70-token sequences
    "llama4-chunked": (lambda: Llama4ForCausalLM(Llama4TextConfig(
        **SMALL, intermediate_size_mlp=96, attention_chunk_size=32, num_local_experts=2, no_rope_layers=[1, 0])),
        ("llama4_text", "chunked attention", "attention_chunk_size=32")),
    # an encoder's attention (no is_decoder=True): bidirectional, which a cache of earlier tokens cannot serve
    "bert-encoder": (lambda: BertLMHeadModel(BertConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                                        num_hidden_layers=2, num_attention_heads=4)),
                     ("bert", "bidirectional")),
}

# models a TritonKVCache cannot hold or compress -> words the NotImplementedError of ``generate`` must contain
UNSERVED = {
    # its attention is its own (not through AttentionInterface): the cache would never be compressed
    "bloom": (lambda: BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4)),
              ("bloomforcausallm", "attentioninterface", "never be compressed")),
    # multi-head latent attention: the cache holds a latent that the model expands per head after the update (from
    # transformers 5.24), or keys and values of different head dims (before)
    "deepseek_v3": (lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=512)), ("deepseek", "latent")),
    "qwen3_next": (lambda: Qwen3NextForCausalLM(Qwen3NextConfig(
        **dict(SMALL, num_hidden_layers=4), linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)), ("qwen3_next", "linear_attention")),
}


def _eager(model):
    model.set_attn_implementation("eager")
    return model


def _with_sinks(model):
    """gpt-oss with random attention sinks (one logit per query head), so that they change every softmax."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(generator=torch.Generator().manual_seed(layer.self_attn.layer_idx))
    return model


def _build(make):
    torch.manual_seed(0)
    return make().eval()


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return _build(MODELS[request.param])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return _build(FAMILIES[request.param])


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def windowed(request):
    return _build(WINDOWED[request.param])


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(1))


def _padded_mask(ids):
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # a left-padded second row
    return mask


def _full_budget_equals_stock(model, ids, mode):
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    mask = _padded_mask(ids)
    ref = model.generate(ids, attention_mask=mask, **kw)
    out = tt.generate(model, ids, attention_mask=mask, policy="keydiff", budget=10_000, mode=mode, block_size=32,
                      **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits)) <= ATOL


@pytest.mark.parametrize("mode", tt.MODES)
def test_full_budget_equals_stock(model, ids, mode):
    _full_budget_equals_stock(model, ids, mode)


@pytest.mark.parametrize("mode", tt.MODES)
def test_family_full_budget_equals_stock(family, ids, mode):
    _full_budget_equals_stock(family, ids, mode)


@pytest.mark.parametrize("mode", tt.MODES)
def test_sliding_window_full_budget_equals_stock(windowed, ids, mode):
    _full_budget_equals_stock(windowed, ids, mode)


@pytest.mark.parametrize("mode", tt.MODES)
def test_sliding_window_without_pads_equals_stock(windowed, ids, mode):
    """No pads (the band-mask path): the prompt in one forward, or block-wise in blocks of 8 with several blocks per
    forward, each block attended over its window and the layer slid after it."""
    kw = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True,
              attention_mask=torch.ones_like(ids[:1]))  # no pads (token 0 is the pad id of some configs)
    ref = windowed.generate(ids[:1], **kw)
    out, cache = tt.generate(windowed, ids[:1], policy="keydiff", budget=10_000, mode=mode, block_size=8,
                             forward_tokens=32, return_cache=True, cache_kwargs=dict(record=True), **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits)) <= ATOL
    if mode == "blockwise":
        window = cache.layers[0].window
        assert max(n for layer, n in cache.trace if cache.layers[layer].window) < window + 8  # slid after each block


@pytest.mark.parametrize("pads", [False, True])
def test_sliding_window_under_tritonkv_with_a_stock_cache_equals_stock(windowed, ids, pads):
    """A plain forward under ``use_tritonkv`` (transformers' own cache): the window and the pads masked as the stock
    attention masks them (the real tokens' logits; a pad's own query sees nothing)."""
    mask = _padded_mask(ids) if pads else torch.ones_like(ids)
    with torch.no_grad():
        ref = windowed(ids, attention_mask=mask).logits
        with tt.use_tritonkv(windowed):
            out = windowed(ids, attention_mask=mask).logits
    real = mask.bool()
    assert float((out[real] - ref[real]).abs().max()) <= ATOL


@pytest.mark.parametrize("mode", ["after_prefill", "blockwise"])
def test_sliding_window_layers_keep_their_window(ids, mode):
    """Compressed (budget 24): each sliding layer holds the last WINDOW - 1 tokens of every row, its pads never
    counted, and is never scored; the full layers keep the budget."""
    model = _build(WINDOWED["gemma3"])
    out, cache = tt.generate(model, ids, attention_mask=_padded_mask(ids), policy="keydiff", budget=24, mode=mode,
                             block_size=32, max_new_tokens=5, do_sample=False, return_cache=True)
    assert [layer.window for layer in cache.layers] == [WINDOW, None]
    assert cache.kept_tokens()[0].tolist() == [[WINDOW - 1] * 2] * 2
    assert cache.stored_tokens()[0] == WINDOW - 1
    assert cache.kept_tokens()[1].max() <= 24 + 4
    sliding, full = cache.layers
    assert sliding.since == sliding.seen and full.since < full.seen  # only the full layer ever compressed


def test_sliding_window_with_recursive_lagkv_is_a_clear_error(ids):
    """Recursive LagKV keeps every partition's pick in its own state: a window shorter than the sequence is refused."""
    model = _build(WINDOWED["gemma3"])
    with pytest.raises(NotImplementedError, match=r"(?i)gemma3.*sliding.*lagkv"):
        tt.generate(model, ids, policy="lagkv", budget=0.5, mode="decoding", max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_attention_is_a_clear_error(case, ids):
    """Chunked attention over more than a chunk, or an encoder's bidirectional attention: NotImplementedError naming
    the architecture, the feature and what is supported — from ``generate`` and from a plain forward under
    ``use_tritonkv`` (before, both silently ran causal attention over every token)."""
    make, words = UNSUPPORTED[case]
    model = _build(make)
    with pytest.raises(NotImplementedError) as exc:
        tt.generate(model, ids, policy="keydiff", budget=10_000, max_new_tokens=2, do_sample=False)
    msg = str(exc.value).lower()
    assert all(w in msg for w in words), msg
    with pytest.raises(NotImplementedError):
        with tt.use_tritonkv(model):
            model(ids)


@pytest.mark.parametrize("case", sorted(UNSERVED))
def test_unserved_model_is_a_clear_error(case, ids):
    """A model the cache cannot hold or compress: NotImplementedError naming the model and the feature, from
    ``generate`` in every mode (before the old code's unbounded cache, shape errors or different logits)."""
    make, words = UNSERVED[case]
    model = _build(make)
    for mode in tt.MODES:
        with pytest.raises(NotImplementedError) as exc:
            tt.generate(model, ids, policy="keydiff", budget=24, mode=mode, block_size=16, max_new_tokens=2,
                        do_sample=False)
        msg = str(exc.value).lower()
        assert all(w in msg for w in words), msg
    assert model.config._attn_implementation != "tritonkv"  # use_tritonkv restored (or never switched) it


def test_multimodal_prompt_is_a_clear_error_and_its_vision_tower_exact(ids):
    """Gemma 3's multimodal model: an image in the prompt makes its tokens attend to each other both ways, which the
    causal attention function cannot serve — a NotImplementedError (the mask's overlay is checked), and block-wise
    prefill cannot split ``pixel_values`` with the blocks — a ValueError naming them; before, the image tokens
    silently attended causally. The vision tower (an encoder, no cache) attends both ways under ``use_tritonkv``
    exactly as the stock one, and a text prompt with the processor's all-zero ``token_type_ids`` stays exact."""
    model = _build(FAMILIES["gemma3-multimodal"])
    image = torch.tensor([[297] + [299] * 4 + [298]])  # begin, the 4 tokens of one image, end
    prompt = torch.cat([ids[:1, :10], image, ids[:1, 10:40]], dim=1)
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    kw = dict(pixel_values=pixels, token_type_ids=(prompt == 299).long(), max_new_tokens=2, do_sample=False)
    for mode in ("after_prefill", "decoding"):
        with pytest.raises(NotImplementedError, match="later tokens"):
            tt.generate(model, prompt, policy="keydiff", budget=10_000, mode=mode, **kw)
    with pytest.raises(ValueError, match=r"\['pixel_values', 'token_type_ids'\]"):
        tt.generate(model, prompt, policy="keydiff", budget=10_000, mode="blockwise", block_size=16, **kw)
    tower = model.model.vision_tower
    with torch.no_grad():
        ref = tower(pixel_values=pixels).last_hidden_state
        with tt.use_tritonkv(model):
            out = tower(pixel_values=pixels).last_hidden_state
    assert float((out - ref).abs().max()) <= ATOL
    text = dict(token_type_ids=torch.zeros_like(ids[:1]), attention_mask=torch.ones_like(ids[:1]), max_new_tokens=4,
                do_sample=False, output_logits=True, return_dict_in_generate=True)  # (token 0 is the pad id)
    ref = model.generate(ids[:1], **text)
    for mode in ("after_prefill", "decoding"):
        out = tt.generate(model, ids[:1], policy="keydiff", budget=10_000, mode=mode, **text)
        assert torch.equal(out.sequences, ref.sequences)
        assert max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits)) <= ATOL


@pytest.mark.parametrize("family", ["gpt_oss", "gemma2-softcap"])
@pytest.mark.parametrize("allocation", [None, "adakv"])
def test_sinks_and_softcapping_through_the_decode_kernel(ids, family, allocation):
    """gpt-oss's attention sinks and Gemma 2's softcapping in decode steps through the split-K kernel
    (``decode_kernel=True``, the GPU's default; the cap in the kernel, sinks applied by its log-sum-exp) over dense
    and per-head rows: the logits of the PyTorch paths at every step, compressed (budget 24, re-compressed while
    decoding) and at full budget (the stock model's)."""
    model = _build(WINDOWED[family])
    kw = dict(attention_mask=_padded_mask(ids), mode="decoding", decode_every=4, block_size=16, max_new_tokens=8,
              do_sample=False, output_logits=True, return_dict_in_generate=True, allocation=allocation)
    for budget in (24, 10_000):
        runs = [tt.generate(model, ids, policy="keydiff", budget=budget, cache_kwargs=dict(decode_kernel=k), **kw)
                for k in (True, False)]
        assert torch.equal(runs[0].sequences, runs[1].sequences)
        assert max(float((a - b).abs().max()) for a, b in zip(runs[0].logits, runs[1].logits)) <= ATOL
    kw.pop("allocation")
    ref = model.generate(ids, **{k: v for k, v in kw.items() if k not in ("mode", "decode_every", "block_size")})
    assert max(float((a - b).abs().max()) for a, b in zip(runs[0].logits, ref.logits)) <= ATOL


def test_check_model_refuses_kv_sharing_and_bidirectional_attention():
    """Layers that attend over another layer's cache (Gemma 3n, Gemma 4's small models) or attention that is not
    causal: ``make_cache`` refuses them by name; a config with full and sliding layers only passes."""
    from types import SimpleNamespace

    def model(**config):
        base = dict(model_type="toy", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
        return SimpleNamespace(config=SimpleNamespace(**{**base, **config}))

    tt.make_cache(model(), "keydiff", 16)
    tt.make_cache(model(num_kv_shared_layers=0, use_bidirectional_attention=None), "keydiff", 16)
    for config, words in [(dict(num_kv_shared_layers=1), "kv sharing"),
                          (dict(kv_sharing_modes=[None, "reuse"]), "kv sharing"),
                          (dict(use_bidirectional_attention="all"), "bidirectional"),
                          (dict(layer_types=["full_attention", "mamba"]), "['mamba']")]:
        with pytest.raises(NotImplementedError, match="toy") as exc:
            tt.make_cache(model(**config), "keydiff", 16)
        assert words in str(exc.value).lower()


def test_cache_without_the_tritonkv_attention_is_a_clear_error(model, ids):
    """A TritonKVCache handed to ``model.generate`` outside ``use_tritonkv``: the model attends with its own
    function, which never compresses; the second write of a layer is a RuntimeError that says what to do, and
    leaves no hand-over behind for a later call (before transformers 5.24 a stale one looked like a latent cache).
    Under ``use_tritonkv`` the same call runs and compresses."""
    kw = dict(max_new_tokens=3, do_sample=False)
    cache = tt.make_cache(model, "keydiff", 24, mode="blockwise", block_size=16)
    with pytest.raises(RuntimeError, match=r"use_tritonkv\(model\)"):
        model.generate(ids[:1], **{tt.cache_kwarg(model): cache}, **kw)
    with torch.no_grad():  # nothing left behind: a plain forward under use_tritonkv (a stock cache) is exact
        ref = model(ids[:1]).logits
        with tt.use_tritonkv(model):
            assert float((model(ids[:1]).logits - ref).abs().max()) <= ATOL
    cache = tt.make_cache(model, "keydiff", 24, mode="blockwise", block_size=16)
    with tt.use_tritonkv(model):
        model.generate(ids[:1], **{tt.cache_kwarg(model): cache}, prefill_chunk_size=16, **kw)
    assert cache.compressions > 0 and cache.stored_tokens() == [24 + 2] * 2


def test_blockwise_compressed_is_bounded(model, ids):
    out, cache = tt.generate(model, ids[:1], policy="keydiff", budget=24, mode="blockwise", block_size=16,
                             max_new_tokens=5, do_sample=False, return_cache=True,
                             cache_kwargs=dict(record=True))
    assert out.shape == (1, 75)
    assert max(n for _, n in cache.trace) <= 24 + 16
    assert cache.get_seq_length() == 74 and cache.stored_tokens() == [24 + 4] * 2


@pytest.mark.parametrize("allocation", [None, "adakv"])
def test_blockwise_prompt_ending_in_a_one_token_block_is_compressed(model, ids, allocation):
    """A prompt whose last block is one token (65 = 4 blocks of 16 + 1) compresses after that block too, as after
    every other: the one-token forward lies in the known prompt, so it is a prompt block, not a decode step. Every
    row then holds at most its budget (the layer total H·b with AdaKV, in ragged per-head rows), also in a left-padded
    batch whose first row ends in a one-token block and whose second (9 pads) in an 8-token one."""
    budget, H = 24, model.config.num_key_value_heads
    for x, mask in ((ids[:1, :65], None), (ids[:, :65], _padded_mask(ids[:, :65]))):
        kw = {} if mask is None else dict(attention_mask=mask)
        _, cache = tt.generate(model, x, policy="keydiff", budget=budget, mode="blockwise", block_size=16,
                               allocation=allocation, max_new_tokens=1, do_sample=False, return_cache=True, **kw)
        assert cache.get_seq_length() == 65  # the last block went through the model; no decode step followed
        for layer, kept in zip(cache.layers, cache.kept_tokens()):
            if allocation is None:
                assert int(kept.max()) == budget
            else:
                assert kept.sum(-1).tolist() == [H * budget] * x.shape[0] and layer.store.ragged


@pytest.mark.parametrize("allocation", ["adakv", "pyramid"])
def test_blockwise_allocation_keeps_the_sink_in_every_head(model, ids, allocation):
    """Block-wise prefill with an allocation and a policy sink: after the first compression a layer's rows are
    ragged, and every later compression forces the sink on the first real tokens (``forced``), which each head's
    budget holds beside its share: every head of every layer still holds tokens 0-3 at the end, and pyramid's
    layers together keep L·H·b (its table read at the prompt's length, whatever a layer's view holds)."""
    from tritonkv.policies import KeyDiff

    budget, L, H = 8, model.config.num_hidden_layers, model.config.num_key_value_heads
    cache = tt.make_cache(model, KeyDiff(sink=4), budget, mode="blockwise", block_size=16, allocation=allocation,
                          prompt_length=70)
    tt.prefill(model, ids[:1], cache)
    for layer in cache.layers:
        _, _, lengths, pos = layer.store.kv.to_padded(with_positions=True)
        for h in range(H):
            assert {0, 1, 2, 3} <= set(pos[0, h, :int(lengths[0, h])].tolist()), (layer.layer_idx, h)
    assert sum(int(k.sum()) for k in cache.kept_tokens()) == L * H * budget


def test_blockwise_with_several_sequences_per_prompt(model, ids):
    """``num_beams`` / ``num_return_sequences`` in block-wise mode: ``model.generate`` repeats the prompt's rows,
    and the blocks fed before it are repeated alike in the cache. At full budget beam search equals the stock
    model's; compressed, two sampled sequences of one prompt equal those of the prompt given twice (the same random
    draws over the same rows), through ``generate`` and ``compressing`` alike."""
    x, kw = ids[:1], dict(max_new_tokens=4, pad_token_id=0)
    beams = dict(kw, num_beams=2, num_return_sequences=2, do_sample=False)
    ref = model.generate(x, attention_mask=torch.ones_like(x), **beams)
    assert torch.equal(tt.generate(model, x, policy="keydiff", budget=10_000, mode="blockwise", block_size=16,
                                   **beams), ref)
    sample = dict(kw, do_sample=True, top_k=0)
    runs = []
    for prompt, extra in ((x, dict(num_return_sequences=2)), (x.repeat(2, 1), {})):
        torch.manual_seed(0)
        runs.append(tt.generate(model, prompt, policy="keydiff", budget=24, mode="blockwise", block_size=16,
                                **sample, **extra))
        torch.manual_seed(0)
        with tt.compressing(model, "keydiff", 24, mode="blockwise", block_size=16):
            runs.append(model.generate(prompt, **sample, **extra))
    assert runs[0].shape == (2, 74) and all(torch.equal(r, runs[0]) for r in runs)


def _lagkv(ratio=0.5):
    from tritonkv.policies.lagkv import LagKV

    return LagKV(sink=4, lag=8, ratio=ratio)  # partitions that a 70-token sequence fills


def _lagkv_rows(cache):
    return [(layer.state.indices, layer.state.keys) for layer in cache.layers]


def test_recursive_lagkv_freeze_holds_tokens_whole(model, ids):
    """Recursive LagKV (mode="decoding") honours ``freeze``: the tokens fed while frozen are all kept, after the
    state's; once thawed they join the state in order, so the first layer's state (whose keys and values are the
    tokens' own projections, whatever the attention saw) equals that of a cache never frozen (LagKV's result is the
    same whatever the chunking). ``compress_now`` leaves such a cache as it is."""
    x = ids[:1]
    cache, plain = (tt.make_cache(model, _lagkv(), 10_000, mode="decoding") for _ in range(2))
    for c in (cache, plain):
        tt.prefill(model, x[:, :40], c)
    before = cache.stored_tokens()
    assert before[0] < 40  # compressed
    cache.freeze()
    tt.prefill(model, x[:, 40:60], cache)
    assert cache.stored_tokens() == [n + 20 for n in before]
    cache.compress_now()
    assert cache.stored_tokens() == [n + 20 for n in before]
    cache.frozen = False
    tt.prefill(model, x[:, 60:], cache)
    tt.prefill(model, x[:, 40:60], plain)
    tt.prefill(model, x[:, 60:], plain)
    (i, k), (pi, pk) = _lagkv_rows(cache)[0], _lagkv_rows(plain)[0]
    assert torch.equal(i, pi) and torch.equal(k, pk)
    assert cache.stored_tokens() == plain.stored_tokens() and cache.stored_tokens()[0] < 70


def test_recursive_lagkv_reorders_its_rows(model, ids):
    """Beam search over recursive LagKV: ``reorder_cache`` moves every tensor of a layer's state (and its frozen
    tokens), so a reordered cache equals one built from the reordered rows; at ratio 1 (every token kept) beam search
    equals the stock model's."""
    swapped = torch.tensor([1, 0])
    caches = [tt.make_cache(model, _lagkv(), 10_000, mode="decoding") for _ in range(2)]
    tt.prefill(model, ids[:, :50], caches[0])
    tt.prefill(model, ids[swapped, :50], caches[1])
    for c in caches:
        c.freeze()
        tt.prefill(model, ids[:, 50:53] if c is caches[0] else ids[swapped, 50:53], c)
    caches[0].reorder_cache(swapped)
    for (i, k), (ri, rk) in zip(_lagkv_rows(caches[0]), _lagkv_rows(caches[1])):
        assert torch.equal(i, ri) and torch.equal(k, rk)
    logits = [tt.prefill(model, ids[swapped, 53:], c) for c in caches]
    assert torch.equal(logits[0], logits[1])
    beams = dict(max_new_tokens=4, num_beams=2, do_sample=False, pad_token_id=0)
    ref = model.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), **beams)
    assert torch.equal(tt.generate(model, ids[:1], policy=_lagkv(1.0), budget=10_000, mode="decoding", **beams), ref)


def test_answer_questions_from_one_compressed_context(model, ids):
    """kvpress's context/question pattern: with a budget >= N each answer equals the stock model's greedy
    continuation of context + question; compressed, the context is compressed once (questions are not evicted)."""
    context, questions = ids[:1, :60], [ids[1:, 60:65], ids[1:, 62:70]]
    got = tt.answer(model, context, questions, policy="keydiff", budget=10_000, max_new_tokens=5)
    for q, a in zip(questions, got):
        ref = model.generate(torch.cat([context, q], 1), attention_mask=torch.ones(1, 60 + q.shape[1], dtype=torch.long),
                             max_new_tokens=5, do_sample=False)
        assert torch.equal(a, ref[:, 60 + q.shape[1]:])
    small = tt.answer(model, context, questions, policy="keydiff", budget=16, max_new_tokens=3)
    assert [a.shape for a in small] == [(1, 3)] * 2


def test_compressing_context_manager(model, ids, monkeypatch):
    """``with compressing(model, ...)``: model.generate gets a fresh TritonKVCache per call (exact at full budget,
    bounded when compressed); on exit generate and the attention implementation are the model's own again."""
    attn = model.config._attn_implementation
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    with tt.compressing(model, "keydiff", 10_000, mode="blockwise", block_size=16):
        out = model.generate(ids, **kw)
        assert isinstance(tt.output_cache(out), tt.TritonKVCache)
        assert torch.equal(out.sequences, ref.sequences)
    with tt.compressing(model, "keydiff", 0.25):
        out = model.generate(ids, **kw)
        assert tt.output_cache(out).stored_tokens() == [17 + 3] * 2  # 0.25 of the 70-token prompt, then 3 steps
    made = []
    # a cache of the caller's own, under either name, is used (handed on under the name this transformers takes:
    # no error where generate takes only one, no deprecation warning where it warns on the other) and no other made
    with tt.compressing(model, "keydiff", 0.25), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monkeypatch.setattr(tt_generate, "make_cache", lambda *a, **k: made.append(1))
        for name in ("past_key_values", "cache"):
            own = tt.make_cache(model, "keydiff", 10_000)
            out = model.generate(ids, **kw, **{name: own})
            assert tt.output_cache(out) is own and torch.equal(out.sequences, ref.sequences)
        with pytest.raises(ValueError, match="past_key_values or cache"):
            model.generate(ids, **kw, past_key_values=own, cache=own)
        monkeypatch.undo()
    assert made == [] and [str(w.message) for w in caught if "past_key_values" in str(w.message)] == []
    assert "generate" not in vars(model) and model.config._attn_implementation == attn
    # the prompt by keyword (model.generate's inputs= and input_ids=), and a block inside another: the outer
    # block's generate is back when the inner one exits, the model's own after both
    with tt.compressing(model, "keydiff", 10_000, mode="blockwise", block_size=16):
        for name in ("inputs", "input_ids"):
            out = model.generate(**{name: ids}, **kw)
            assert isinstance(tt.output_cache(out), tt.TritonKVCache) and torch.equal(out.sequences, ref.sequences)
        with tt.compressing(model, "knorm", 0.25):
            assert tt.output_cache(model.generate(ids, **kw)).policy.name == "knorm"
        assert tt.output_cache(model.generate(ids, **kw)).policy.name == "keydiff"
    assert "generate" not in vars(model) and model.config._attn_implementation == attn
    with pytest.raises(TypeError, match="queris"):
        with tt.compressing(model, "snapkv", 0.25, queris=None):
            pass


def test_blockwise_feed_builds_no_autograd_graph(model, ids):
    """``generate`` and ``compressing`` feed the prompt's blocks before ``model.generate`` (which runs without
    gradients): those forwards too run without an autograd graph over their activations, whatever the caller's
    grad mode (they recorded one: memory held and time spent for nothing)."""
    assert torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())
    grad = []
    hook = model.model.register_forward_hook(lambda m, a, out: grad.append(out.last_hidden_state.requires_grad))
    try:
        tt.generate(model, ids, policy="keydiff", budget=16, mode="blockwise", block_size=16, max_new_tokens=2,
                    do_sample=False)
        with tt.compressing(model, "keydiff", 16, mode="blockwise", block_size=16):
            model.generate(ids, max_new_tokens=2, do_sample=False)
    finally:
        hook.remove()
    assert len(grad) == 2 * (1 + 2) and not any(grad)  # per call: the blocks before the last, then generate's 2


def test_cache_keyword_follows_the_model(model, ids):
    """tritonkv hands its cache to ``forward`` and ``generate`` under the keyword the installed transformers takes
    (``cache`` from 5.24, where ``past_key_values`` is deprecated and leaves ``forward`` in 5.40), so its own calls
    raise no deprecation warning; ``output_cache`` reads an output's cache under either name."""
    import inspect

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return None

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None):
            return None

    assert tt.cache_kwarg(Old()) == "past_key_values" and tt.cache_kwarg(New()) == "cache"
    wrapped = torch.nn.Module()
    wrapped._orig_mod = New()  # what torch.compile(model) returns
    assert tt.cache_kwarg(wrapped) == "cache"
    takes = "cache" in inspect.signature(type(model).forward).parameters
    assert tt.cache_kwarg(model) == ("cache" if takes else "past_key_values")

    deprecated = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, cache = tt.generate(model, ids, policy="keydiff", budget=16, mode="blockwise", block_size=32,
                                 max_new_tokens=2, do_sample=False, return_cache=True, return_dict_in_generate=True)
        assert tt.output_cache(out) is cache
        logits = tt.prefill(model, ids[:1], tt.make_cache(model, "snapkv", 0.5))
        assert tt.output_cache(model(input_ids=ids[:1], use_cache=True)) is not None
        tt.decode(model, tt.make_cache(model, "snapkv", 0.5), logits[:, -1], 2)
        with tt.compressing(model, "keydiff", 0.5):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
        deprecated = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert deprecated == []


def test_criticalkv_reads_each_familys_output_projection(family, ids, monkeypatch):
    """CriticalKV in every family: each compressing layer's W_O, in nn.Linear's layout, is that layer's output
    projection less its bias (GPT-2's ``c_proj`` is a ``Conv1D``, whose weight is stored transposed)."""
    from tritonkv.policies import criticalkv

    seen = []
    real = criticalkv.value_norms
    monkeypatch.setattr(criticalkv, "value_norms", lambda v, w, **kw: seen.append(w) or real(v, w, **kw))
    _, cache = tt.generate(family, ids[:1], policy="criticalkv", budget=40, max_new_tokens=2, do_sample=False,
                           return_cache=True)
    modules = [layer.module() for layer in cache.layers if layer.window is None]  # sliding layers never compress
    assert len(seen) == len(modules) > 0
    for w, module in zip(seen, modules):
        proj = next(getattr(module, n) for n in ("o_proj", "c_proj") if hasattr(module, n))
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0))
        bias = 0 if proj.bias is None else proj.bias
        torch.testing.assert_close(torch.nn.functional.linear(x, w), proj(x) - bias)


def test_criticalkv_reads_each_layers_o_proj(model, ids, monkeypatch):
    """CriticalKV inside a model: each layer's compression scores values through that layer's own W_O."""
    from tritonkv.policies import criticalkv

    seen = []
    real = criticalkv.value_norms
    monkeypatch.setattr(criticalkv, "value_norms", lambda v, w, **kw: seen.append(w) or real(v, w, **kw))
    out, cache = tt.generate(model, ids[:1], policy="criticalkv", budget=40, mode="blockwise", block_size=32,
                             max_new_tokens=2, do_sample=False, return_cache=True)
    layers = model.model.layers
    assert [w.data_ptr() for w in seen] == [l.self_attn.o_proj.weight.data_ptr() for l in layers] * 2  # blocks 2, 3
    assert cache.stored_tokens() == [40 + 1] * 2
