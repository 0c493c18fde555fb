"""Left-padded batches in the transformers integration (a random Llama, and a random Gemma 3 with a sliding-window
layer; fp32, CPU; no download): every row gives the logits of the same prompt run alone and keeps the same tokens, in
every mode, for every policy, with and without every allocation; ``kept_tokens()`` counts real tokens only and no
per-head row keeps a pad slot.

The randomized sweep is ``benchmarks/batch_invariance.py`` (its first ``CASES`` cases here; the committed
``benchmarks/results/batch_invariance.json`` holds a longer run)."""
import pytest
import torch

from benchmarks import batch_invariance as bi
from helpers import on_backend
from tritonkv.integrations import transformers as tt

CASES = 33  # every policy in every mode, every allocation several times


@pytest.fixture(scope="module")
def model():
    return bi.random_llama()


def _issue_batch():
    """A 100-token prompt left-padded by 300 beside a 400-token one (the reproduction of the bug report)."""
    torch.manual_seed(0)
    s, o = torch.randint(3, 1000, (1, 100)), torch.randint(3, 1000, (1, 400))
    ids = torch.cat([torch.cat([torch.zeros(1, 300, dtype=torch.long), s], 1), o])
    return ids, (ids != 0).long(), s


@pytest.mark.parametrize("allocation", ["uniform", "adakv"])
def test_short_padded_row_with_per_head_budgets_keeps_no_pad(model, allocation):
    """Budget 200 per head: the padded row's 100 real tokens all fit. It must keep them and nothing else (it kept
    100 pad slots per head, read by decode attention: its logits differed from the prompt alone by 0.05-0.9)."""
    ids, mask, s = _issue_batch()
    kw = dict(policy="keydiff", budget=200, allocation=allocation, max_new_tokens=4, do_sample=False,
              output_logits=True, return_dict_in_generate=True, pad_token_id=0, return_cache=True)
    (b, cache), (a, alone) = tt.generate(model, ids, attention_mask=mask, **kw), tt.generate(model, s, **kw)
    assert max(float((x[0] - y[0]).abs().max()) for x, y in zip(b.logits, a.logits)) <= bi.ATOL
    for layer, kept, kept_alone in zip(cache.layers, cache.kept_tokens(), alone.kept_tokens()):
        assert kept[0].tolist() == kept_alone[0].tolist() == [103, 103]  # 100 prompt tokens + 3 decoded
        kv = layer.store.kv  # per-head budgets: ragged rows
        for h in range(2):  # the padded row's slots hold sequence indices 300..402 only: never a pad or an empty slot
            p = kv.positions[kv.row_start[h]:kv.row_start[h] + kv.length[h]]
            assert bool((p >= 300).all()) and bool((p < 403).all())


@pytest.mark.parametrize("i", range(CASES))
def test_batch_invariance_sweep(model, i):
    case = bi.draw(i)
    r = bi.run_case(model, case)
    assert r["kept_equal"], case
    assert r["worst"] <= bi.ATOL, (r["worst"], {k: case[k] for k in ("policy", "allocation", "mode", "lengths")})


@pytest.fixture(scope="module")
def windowed():
    return bi.gemma3_sliding()


@pytest.mark.parametrize("i", bi.case_indices(12, "gemma3-sliding"))
def test_batch_invariance_with_a_sliding_window_layer(windowed, i):
    """Gemma 3's sliding-window layer (window 24) keeps its window by column, pads included: each row attends and
    keeps what it does alone."""
    case = bi.draw(i)
    r = bi.run_case(windowed, case)
    assert r["kept_equal"], case
    assert r["worst"] <= bi.ATOL, (r["worst"], {k: case[k] for k in ("policy", "allocation", "mode", "lengths")})


@pytest.mark.parametrize("allocation", [None, "adakv"])
def test_prefill_and_decode_of_a_padded_batch_equal_each_row_alone(model, allocation):
    """``prefill`` (block-wise: each row's blocks from its first real token) and ``decode`` with the mask."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 1000, (n,), generator=g) for n in (90, 37, 61)]
    ids = torch.zeros(3, 90, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, 90 - len(r):] = r
    mask = (ids != 0).long()
    kw = dict(mode="blockwise", block_size=16, allocation=allocation)
    cache = tt.make_cache(model, "snapkv", 40, **kw)
    new = tt.decode(model, cache, tt.prefill(model, ids, cache, attention_mask=mask)[:, -1], 6, attention_mask=mask)
    for b, r in enumerate(rows):
        alone = tt.make_cache(model, "snapkv", 40, **kw)
        assert torch.equal(tt.decode(model, alone, tt.prefill(model, r[None], alone)[:, -1], 6), new[b:b + 1])
        assert all(torch.equal(k[b], a[0]) for k, a in zip(cache.kept_tokens(), alone.kept_tokens()))


@pytest.mark.parametrize("allocation", [None, "adakv"])
def test_compressing_blockwise_gives_each_row_of_a_padded_batch_as_alone(model, allocation):
    """``with compressing(model, ..., mode="blockwise"): model.generate(ids, attention_mask=mask)``: every block but
    the last goes through ``generate``'s row-aligned feed (it went through transformers' ``prefill_chunk_size``,
    whose chunks start at column 0: a row padded by 17 compressed on another schedule than alone, its logits off by
    0.88), the unpadded rows' blocks several per forward; each row equals the same prompt alone."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 1000, (n,), generator=g) for n in (70, 53)]
    ids = torch.zeros(2, 70, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, 70 - len(r):] = r
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0)
    forwards = []
    hook = model.model.register_forward_hook(lambda m, a, out: forwards.append(m))
    try:
        with tt.compressing(model, "keydiff", 24, mode="blockwise", block_size=16, allocation=allocation):
            out = model.generate(ids, attention_mask=(ids != 0).long(), **kw)
            alone = [model.generate(r[None], **kw) for r in rows]
    finally:
        hook.remove()
    for b, a in enumerate(alone):
        assert max(float((x[b] - y[0]).abs().max()) for x, y in zip(out.logits, a.logits)) <= bi.ATOL
    # the batch: forwards ending at 16, 32, 33, 48, 49, 64, 65 (each row's blocks from its first real token), then
    # the last block and 5 steps; alone: the blocks before the last in one forward (4 of the 70-token row, 3 of the
    # 53-token row), then the last block and 5 steps
    assert len(forwards) == (7 + 6) + (1 + 6) + (1 + 6)


def test_a_one_token_block_of_a_row_aligned_prefill_marks_its_pads(model):
    """Rows padded by 0, 17 and 35 of 40 columns, blocks of 16: the forwards end at 16, 32, 33 and 40, and the
    one-token forward [32, 33) holds a pad of the third row, which must not be kept as a token."""
    g = torch.Generator().manual_seed(5)
    lengths = [40, 23, 5]
    case = dict(policy="keydiff", allocation="adakv", mode="blockwise", lengths=lengths, budget=12, block_size=16,
                ids=[torch.randint(3, 1000, (n,), generator=g) for n in lengths], inputs={})
    r = bi.run_case(model, case)
    assert r["kept_equal"] and r["worst"] <= bi.ATOL, r


@pytest.mark.parametrize("allocation", [None, "adakv"])
def test_a_one_token_last_forward_that_ends_a_row_block_reads_its_query(model, allocation):
    """Rows of 17, 86 and 92 tokens in blocks of 16: the row-aligned prefill's last forwards are [86, 91) and the one
    token [91, 92), which ends the 6-token last block of the second row. SnapKV's window for that compression must
    hold the query of token 91, although no query window is kept once the prompt is in (it lacked it: logits off
    the row alone, by 0.73 in sweep case 61 with HeadKV budgets)."""
    g = torch.Generator().manual_seed(61)
    lengths = [17, 86, 92]
    case = dict(policy="snapkv", allocation=allocation, mode="blockwise", lengths=lengths, budget=40 + 10,
                block_size=16, ids=[torch.randint(3, 1000, (n,), generator=g) for n in lengths], inputs={})
    r = bi.run_case(model, case)
    assert r["evicted"] and r["kept_equal"] and r["worst"] <= bi.ATOL, r


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("policy", ["snapkv", "h2o", "surfacelogic", "keydiff", "knorm"])
def test_a_head_with_empty_slots_scores_as_alone(policy, backend):
    """Per-head rows of different lengths share one view whose shorter heads start with empty slots (what a layer
    with per-head budgets or pads hands its policy): a head's real tokens score as that head's tokens alone. The empty
    slots held zero keys, which counted in every window row's softmax: a head's scores shrank with its empty slots
    (AdaKV then compares them across heads)."""
    from tritonkv import POLICIES
    from tritonkv.integrations.transformers.cache import _MaskedPolicy

    g = torch.Generator().manual_seed(0)
    B, H, G, N, D, W, empty = 1, 2, 2, 64, 16, 8, 24
    keys, values = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    keys[:, 1, :empty] = 0.0  # head 1's first slots hold no token
    q = torch.randn(B, H * G, W, D, generator=g)
    valid = torch.ones(B, H, N, dtype=torch.bool)
    valid[:, 1, :empty] = False
    pol = POLICIES[policy](window=W) if policy in ("snapkv", "h2o", "surfacelogic") else POLICIES[policy]()
    inputs = {"queries": q} if "queries" in pol.needs else {}
    with on_backend(backend):  # the ops' PyTorch bodies, or the Triton kernels (the interpreter)
        got = _MaskedPolicy(pol, valid).score(keys, values, **inputs)
        heads = ((0, 0), (1, empty))  # (head, its first real slot)
        alones = [pol.score(keys[:, h:h + 1, start:], values[:, h:h + 1, start:],
                            **({"queries": q[:, h * G:(h + 1) * G]} if inputs else {})) for h, start in heads]
    assert bool((got[:, 1, :empty] == float("-inf")).all())
    for (h, start), alone in zip(heads, alones):
        mine = got[:, h:h + 1, start:]
        torch.testing.assert_close(mine, alone, rtol=1e-5, atol=1e-7)
        assert torch.equal(torch.argsort(mine, dim=-1, descending=True, stable=True)[..., :16],
                           torch.argsort(alone, dim=-1, descending=True, stable=True)[..., :16])
