"""The transformers integration on tiny random Llama, Qwen2 and Mistral models (no download): with a budget
>= the sequence every mode reproduces the stock model's greedy tokens and logits (ATOL 1e-4, fp32); compressed,
block-wise prefill stays within budget + block_size slots per layer and decoding keeps going."""
import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from tritonkv.integrations import transformers as tt

ATOL = 1e-4
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    torch.manual_seed(0)
    return MODELS[request.param]().eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mode", tt.MODES)
def test_full_budget_equals_stock(model, ids, mode):
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # a left-padded second row
    ref = model.generate(ids, attention_mask=mask, **kw)
    out = tt.generate(model, ids, attention_mask=mask, policy="keydiff", budget=10_000, mode=mode, block_size=32,
                      **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits)) <= ATOL


def test_blockwise_compressed_is_bounded(model, ids):
    out, cache = tt.generate(model, ids[:1], policy="keydiff", budget=24, mode="blockwise", block_size=16,
                             max_new_tokens=5, do_sample=False, return_cache=True,
                             cache_kwargs=dict(record=True))
    assert out.shape == (1, 75)
    assert max(n for _, n in cache.trace) <= 24 + 16
    assert cache.get_seq_length() == 74 and cache.stored_tokens() == [24 + 4] * 2


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


def test_compressing_context_manager(model, ids):
    """``with compressing(model, ...)``: model.generate gets a fresh TritonKVCache per call (exact at full budget,
    bounded when compressed); on exit generate and the attention implementation are the model's own again."""
    attn = model.config._attn_implementation
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    with tt.compressing(model, "keydiff", 10_000, mode="blockwise", block_size=16):
        out = model.generate(ids, **kw)
        assert isinstance(out.past_key_values, tt.TritonKVCache)
        assert torch.equal(out.sequences, ref.sequences)
    with tt.compressing(model, "keydiff", 0.25):
        out = model.generate(ids, **kw)
        assert out.past_key_values.stored_tokens() == [17 + 3] * 2  # 0.25 of the 70-token prompt, then 3 steps
    assert "generate" not in vars(model) and model.config._attn_implementation == attn
    with pytest.raises(TypeError, match="queris"):
        with tt.compressing(model, "snapkv", 0.25, queris=None):
            pass
