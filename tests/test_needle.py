"""Needle-in-a-haystack utilities (tritonkv/integrations/needle.py; docs/architecture.md, "The real model and the
needle check")."""
import contextlib

import pytest
import torch

from tritonkv.integrations import needle
from tritonkv.integrations.needle import (NEEDLE, QUESTION, build_case, drop_positions_prefill, full_prefill,
                                          haystack_text, rank_candidates)
from helpers import CharTok, tiny_llama

SAMPLE = """
Genesis 1

  1 In the beginning God created the heaven and the earth.
  2 And the earth was without form, and void; and darkness was upon the face of
the deep. And the Spirit of God moved upon the face of the waters.
Genesis 2

  1 Thus the heavens and the earth were finished.
"""


def test_parse_kjv_unwraps_and_strips_numbers_and_headers():
    text = needle._parse_kjv(SAMPLE)
    assert text == ("In the beginning God created the heaven and the earth. And the earth was without form, "
                    "and void; and darkness was upon the face of the deep. And the Spirit of God moved upon "
                    "the face of the waters. Thus the heavens and the earth were finished.")


def test_haystack_sources():
    syn = haystack_text("synthetic", min_chars=5000)
    assert len(syn) >= 5000 and syn.startswith(needle.FILLER)
    assert needle.haystack_source("synthetic") == "synthetic"
    with pytest.raises(ValueError, match="source"):
        haystack_text("wikipedia")


@pytest.mark.parametrize("n_tokens,depth", [(300, 0.0), (300, 0.1), (517, 0.5), (1000, 0.9), (400, 1.0)])
def test_build_case_places_needle_at_depth(n_tokens, depth):
    tok = CharTok()
    case = build_case(tok, n_tokens, depth, seed=3, source="synthetic")
    ids = case.input_ids[0].tolist()
    assert case.length == n_tokens and case.input_ids.dtype == torch.long
    text_needle = " " + NEEDLE.format(k=case.key)
    pos = case.needle_positions.tolist()
    assert pos == list(range(pos[0], pos[0] + len(text_needle)))
    assert tok.decode([ids[p] for p in pos]) == text_needle
    n_hay = n_tokens - len(text_needle) - len("\n" + QUESTION)
    assert pos[0] == round(depth * n_hay)
    assert tok.decode(ids[case.question_start:]) == "\n" + QUESTION
    assert case.question_start == n_tokens - len("\n" + QUESTION)
    # the haystack around the needle is the filler text, unbroken
    hay = ids[:pos[0]] + ids[pos[-1] + 1:case.question_start]
    assert len(hay) == n_hay and tok.decode(hay) in haystack_text("synthetic")


def test_build_case_candidates_and_determinism():
    tok = CharTok()
    a = build_case(tok, 400, 0.5, seed=7, source="synthetic")
    b = build_case(tok, 400, 0.5, seed=7, source="synthetic")
    c = build_case(tok, 400, 0.5, seed=8, source="synthetic")
    assert torch.equal(a.input_ids, b.input_ids) and a.candidates == b.candidates and a.answer == b.answer
    assert a.key != c.key
    assert len(a.candidates) == 10 and len(set(a.candidates)) == 10
    assert a.candidates[a.answer] == a.key
    assert all(len(k) == 5 and k.isdigit() and k[0] != "0" for k in a.candidates)
    assert a.candidate_ids[a.answer] == [ord(ch) for ch in " " + a.key]
    # the true key's slot varies with the seed
    assert len({build_case(tok, 400, 0.5, seed=s, source="synthetic").answer for s in range(8)}) > 1


def test_build_case_with_a_subject():
    """``subject=`` words the fact and the question for it (benchmarks/evaluate.py's wording); the random draws do
    not depend on it."""
    tok = CharTok()
    plain = build_case(tok, 400, 0.5, seed=7, source="synthetic")
    case = build_case(tok, 400, 0.5, seed=7, source="synthetic", subject="apple")
    assert case.length == 400 and case.key == plain.key and case.candidates == plain.candidates
    pos = case.needle_positions.tolist()
    assert tok.decode(case.input_ids[0, pos].tolist()) == " " + needle.NEEDLE_FOR.format(k=case.key, s="apple")
    assert tok.decode(case.input_ids[0, case.question_start:].tolist()) == "\n" + needle.QUESTION_FOR.format(s="apple")
    assert "pass key for the apple is" in needle.QUESTION_FOR.format(s="apple")


def test_build_case_bad_input():
    tok = CharTok()
    with pytest.raises(ValueError, match="depth"):
        build_case(tok, 400, 1.5, source="synthetic")
    with pytest.raises(ValueError, match="n_tokens"):
        build_case(tok, 50, 0.5, source="synthetic")


# ------------------------------------------------------------------------------------------------
# the real model (docs/architecture.md, "The real model and the needle check"): full cache finds the key, the
# needle-removed control does not


@pytest.fixture(scope="module")
def smollm2():
    from tritonkv.integrations.model import load_smollm2

    return load_smollm2()


@pytest.mark.model
def test_full_cache_ranks_true_key_first(smollm2):
    model, tok = smollm2
    case = build_case(tok, 1024, 0.5, seed=1, source="synthetic")
    ids = case.input_ids[0]
    assert tok.decode(ids[case.needle_positions]).strip() == NEEDLE.format(k=case.key)
    assert [tok.decode([t]) for t in case.candidate_ids[case.answer]] == [" "] + list(case.key)
    r = rank_candidates(model, full_prefill, case)
    assert r.top1, r.scores


@pytest.mark.model
def test_needle_removed_control_is_near_chance(smollm2):
    model, tok = smollm2
    cases = [build_case(tok, 1024, d, seed=s, source="synthetic") for s, d in enumerate((0.1, 0.5, 0.9))]
    hits = [rank_candidates(model, drop_positions_prefill(c.needle_positions), c).top1 for c in cases]
    assert sum(hits) <= 1, hits


@pytest.mark.parametrize("policy", [None, "keydiff", "snapkv"])
def test_batched_ranking_matches_one_copy_per_candidate(policy):
    """``rank_candidates(..., batched=True)`` (one forward over the cache expanded along the batch) gives the
    per-candidate scores, on the full cache and on a compressed ``TritonKVCache``; candidates of different lengths
    are padded at their end."""
    from tritonkv.integrations.transformers import make_cache, prefill, use_tritonkv

    model = tiny_llama()
    case = build_case(CharTok(), 300, 0.5, seed=2, source="synthetic")
    case.candidate_ids[1] = case.candidate_ids[1][:3]  # a shorter candidate
    if policy is None:
        fn = full_prefill
        ctx = contextlib.nullcontext()
    else:
        cache = make_cache(model, policy, 0.25, mode="blockwise", block_size=64, prompt_length=300)
        logits = prefill(model, case.input_ids, cache)[:, -1]
        cache.freeze()
        fn = lambda m, x: (logits, cache)  # noqa: E731
        ctx = use_tritonkv(model)
    with ctx:
        one = rank_candidates(model, fn, case)
        batched = rank_candidates(model, fn, case, batched=True)
    torch.testing.assert_close(torch.tensor(batched.scores), torch.tensor(one.scores), rtol=1e-5, atol=1e-4)
    assert batched.rank == one.rank
