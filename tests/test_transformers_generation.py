"""Generation options users combine with tritonkv's ``generate`` and ``compressing`` (a seeded random Llama; fp32,
CPU; no download): each either gives the stock ``model.generate``'s tokens at a budget that keeps everything, or is
refused with a ValueError that says why, never a run that is silently wrong or silently uncompressed."""
import pytest
import torch
from transformers import GenerationConfig

from helpers import tiny_llama
from tritonkv.integrations import transformers as tt

FULL = 4096  # a budget above every sequence here: the stock model's tokens


@pytest.fixture(scope="module")
def model():
    m = tiny_llama()
    m.generation_config.pad_token_id = 0
    return m


def _ids(B=2, T=40, seed=1):
    return torch.randint(1, 256, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("where", ["keyword", "generation_config", "compressing"])
def test_use_cache_false_is_refused(model, where):
    """Without a cache transformers feeds the whole sequence at every step, into the cache it is handed: the tokens
    were wrong, even at a full budget, while the cache looked bounded."""
    ids = _ids()
    with pytest.raises(ValueError, match="use_cache=False"):
        if where == "keyword":
            tt.generate(model, ids, policy="keydiff", budget=8, max_new_tokens=4, use_cache=False)
        elif where == "generation_config":
            tt.generate(model, ids, policy="keydiff", budget=8,
                        generation_config=GenerationConfig(max_new_tokens=4, use_cache=False))
        else:
            with tt.compressing(model, "keydiff", 8) as m:
                m.generate(ids, max_new_tokens=4, use_cache=False)


def test_compressing_with_embeddings_alone_compresses(model):
    """``model.generate(inputs_embeds=...)`` inside ``compressing``: a TritonKVCache sized from the embeddings' length
    (it ran on a stock, uncompressed cache), the same tokens as the same prompt given as ids."""
    ids = _ids(1)
    emb = model.get_input_embeddings()(ids).detach()
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    with tt.compressing(model, "keydiff", 8) as m:
        by_emb, by_ids = m.generate(inputs_embeds=emb, **kw), m.generate(ids, **kw)
    cache = tt.output_cache(by_emb)
    assert isinstance(cache, tt.TritonKVCache)
    assert [int(k.max()) for k in cache.kept_tokens()] == [8 + 5] * 2  # the budget, then the decoded tokens
    assert torch.equal(by_emb.sequences, by_ids.sequences[:, ids.shape[1]:])


def test_blockwise_repeats_the_rows_transformers_will_expand(model):
    """Block-wise mode feeds the prompt's first blocks before ``model.generate``, which then expands the rows by
    ``max(num_beams, num_return_sequences)``: read as transformers reads them (a positional generation config, the
    model's defaults merged into a caller's config), not from the keywords alone (a batch mismatch error)."""
    ids = _ids()
    beams = GenerationConfig(num_beams=3, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with tt.compressing(model, "keydiff", FULL, mode="blockwise", block_size=16) as m:
        assert torch.equal(m.generate(ids, beams), model.generate(ids, beams))
    saved = model.generation_config.num_beams, model.generation_config.do_sample
    model.generation_config.num_beams, model.generation_config.do_sample = 3, False
    try:
        mine = GenerationConfig(max_new_tokens=6)  # num_beams left unset: the model's 3
        want = model.generate(ids, generation_config=mine)
        got = tt.generate(model, ids, policy="keydiff", budget=FULL, mode="blockwise", block_size=16,
                          generation_config=mine)
    finally:
        model.generation_config.num_beams, model.generation_config.do_sample = saved
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["after_prefill", "blockwise"])
def test_left_padded_batch_with_several_sequences_per_prompt(model, mode):
    """A left-padded batch with ``num_return_sequences``: block-wise mode repeats the cache's rows and each row's
    pad counters (it refused: 'beam search ... of a left-padded batch'); top_k=1 sampling is greedy, so the
    stock model's tokens at a full budget."""
    ids = _ids(2, 40)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    kw = dict(attention_mask=mask, do_sample=True, top_k=1, num_return_sequences=2, max_new_tokens=5)
    got = tt.generate(model, ids, policy="keydiff", budget=FULL, mode=mode, block_size=16, **kw)
    assert torch.equal(got, model.generate(ids, **kw))
    small = tt.generate(model, ids, policy="keydiff", budget=16, mode=mode, block_size=16, return_cache=True, **kw)
    assert small[0].shape == got.shape and all(int(k.max()) <= 16 + 4 for k in small[1].kept_tokens())
