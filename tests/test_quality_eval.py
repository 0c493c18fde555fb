"""benchmarks/evaluate.py's shortcuts checked against the plain computation, on a tiny random Llama (no download):
a configuration's cache rebuilt from one captured forward equals the cache a real forward leaves; candidates
scored in one batched loop equal candidates scored on copies; the error after W_O is zero at full budget and
matches a direct computation; records resume."""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch

from benchmarks import evaluate as E
from benchmarks.common import read_jsonl
from tritonkv.policies import POLICIES

pytestmark = pytest.mark.bench


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


def _capture(model, ids, n):
    rows = sorted(set(range(n - E.Q_WINDOW, n)) | set(range(len(ids) - E.Q_WINDOW, len(ids))))
    kv, qs, last, _ = E.capture(model, ids, rows)
    r = {x: i for i, x in enumerate(rows)}
    qwin = [qs[l][:, :, [r[x] for x in range(n - E.Q_WINDOW, n)]] for l in range(len(kv))]
    return kv, qs, last, qwin, r


CONFIGS = [E.Config("snapkv", "uniform", budget=40), E.Config("snapkv", "adakv", budget=40),
           E.Config("criticalkv", "uniform", budget=40), E.Config("criticalkv", "adakv", budget=0.3),
           E.Config("tova", "uniform", budget=40), E.Config("keydiff", "pyramid", budget=40),
           E.Config("lagkv", "uniform", "lagkv", budget=0.5), E.Config("lagkv", "uniform", "lagkv", budget=0.25),
           E.Config("lagkv_l64", "uniform", "lagkv", budget=0.5)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_replayed_cache_equals_a_real_prefill(tiny, cfg):
    from tritonkv.integrations.transformers import make_cache, prefill

    torch.manual_seed(1)
    N = 300  # LagKV (S = 16, L = 128) compresses from S + 2L = 272 tokens
    ids = torch.randint(0, 256, (N,)).tolist()
    kv, _, last, qwin, _ = _capture(tiny, ids, N)
    replay = E.replay_cache(tiny, cfg, kv, qwin, N, {})
    if cfg.mode == "lagkv":
        lag = {"lagkv": 128, "lagkv_l64": 64}[cfg.policy]
        real = make_cache(tiny, POLICIES["lagkv"](lag=lag), float(cfg.budget), mode="decoding")
    else:
        b = int(cfg.budget) if cfg.budget > 1 else float(cfg.budget)
        real = make_cache(tiny, E._policy_object(tiny, cfg), b,
                          allocation=None if cfg.allocation == "uniform" else cfg.allocation, prompt_length=N)
    logits = prefill(tiny, torch.tensor([ids]), real)[0, -1]
    real.freeze()
    torch.testing.assert_close(logits.float(), last, rtol=1e-4, atol=1e-4)
    assert E._kept(replay) == E._kept(real) < N
    more = torch.randint(0, 256, (7,)).tolist()
    torch.testing.assert_close(E.feed(tiny, replay, more, 0), E.feed(tiny, real, more, 0), rtol=1e-4, atol=1e-4)


def test_batched_candidates_equal_candidates_on_copies(tiny):
    torch.manual_seed(2)
    N = 120
    ids = torch.randint(0, 256, (N,)).tolist()
    kv, _, last, qwin, _ = _capture(tiny, ids, N)
    cands = [torch.randint(0, 256, (k,)).tolist() for k in (3, 5, 5, 1, 4)]
    for cfg in (E.Config("snapkv", "adakv", budget=50), E.Config("snapkv", "uniform", budget=50), E.FULL):
        cache = E.replay_cache(tiny, cfg, kv, qwin, N, {})
        s1, g1, d1 = E.score_choices(tiny, copy.deepcopy(cache), last, cands, 6, answer=1, batched=True)
        s2, g2, d2 = E.score_choices(tiny, cache, last, cands, 6, answer=1, batched=False)
        assert s1 == pytest.approx(s2, rel=1e-4, abs=1e-4)
        assert g1 == g2 and len(g1) == 6
        torch.testing.assert_close(d1, d2, rtol=1e-4, atol=1e-4)


def test_error_after_wo(tiny):
    torch.manual_seed(3)
    N, n_ctx = 100, 80
    ids = torch.randint(0, 256, (N,)).tolist()
    kv, _, _, qwin, r = _capture(tiny, ids, n_ctx)
    q_last = [E.capture(tiny, ids, [N - 1])[1][l] for l in range(2)]
    big = E.Config("snapkv", "uniform", "after_prefill", "agnostic", 10_000)
    small = E.Config("snapkv", "uniform", "after_prefill", "agnostic", 40)
    err = E.wo_errors(tiny, kv, q_last, qwin, n_ctx, [big, small], {})
    assert torch.tensor(err[big.name]).abs().max() == 0  # nothing evicted: no perturbation
    e = torch.tensor(err[small.name])
    assert e.shape == (2, 6) and bool((e > 0).all())
    # direct: layer 1, query head 4 (KV head 2 of group size 3 -> kv head 1), by explicit softmax and W_O slice
    import tritonkv
    k, v = kv[1]
    kept = tritonkv.compress((k[:, :, :n_ctx], v[:, :, :n_ctx]), "snapkv", 40, queries=qwin[1]).indices[0, 1]
    q = q_last[1][0, 4, 0]
    logits = (k[0, 1] @ q) / math.sqrt(16)
    a = logits.softmax(-1)
    mask = torch.zeros(N, dtype=torch.bool)
    mask[kept] = True
    mask[n_ctx:] = True
    a2 = logits.masked_fill(~mask, -math.inf).softmax(-1)
    wo = tiny.model.layers[1].self_attn.o_proj.weight.detach()[:, 4 * 16:5 * 16]
    want = (wo @ ((a - a2) @ v[0, 1])).abs().sum()
    assert float(e[1, 4]) == pytest.approx(float(want), rel=1e-4)


def test_layer_errors_inside_the_compressed_run(tiny):
    """CriticalKV's layer-wise analysis: the perturbation of every layer's attention output (after W_O) and of the
    final hidden state at the first answer token, with the context compressed before the question, against the
    full cache. Layer 0 sees the same input in both runs, so its error is the isolated one, computed directly."""
    torch.manual_seed(4)
    N, n_ctx = 100, 80
    ids = torch.randint(0, 256, (N,)).tolist()
    rows = sorted(set(range(n_ctx - E.Q_WINDOW, n_ctx)) | {N - 1})
    kv, qs, _, full = E.capture(tiny, ids, rows)
    qwin = [qs[l][:, :, :E.Q_WINDOW] for l in range(2)]

    def run(budget):
        cache = E.replay_cache(tiny, E.Config("snapkv", "uniform", "after_prefill", "agnostic", budget), kv, qwin,
                               n_ctx, {})
        with E.LayerOutputs(tiny) as outs:
            E.feed(tiny, cache, ids[n_ctx:])
        return outs.errors(full)

    big, small = run(10_000), run(40)
    scale = float(full.hidden.abs().sum())
    assert big["value"] < 1e-4 * scale and max(big["per_layer"]) < 1e-4 * float(full.attn[0].abs().sum())
    assert small["value"] > 1e-3 * scale and len(small["per_layer"]) == 2 and min(small["per_layer"]) > 0
    import tritonkv
    k, v = kv[0]
    kept = tritonkv.compress((k[:, :, :n_ctx], v[:, :, :n_ctx]), "snapkv", 40, queries=qwin[0]).indices[0]
    q = qs[0][0, :, -1]  # [H_q, D]: the last token's queries
    dv = []
    for h in range(6):
        kh = h // 3
        logits = (k[0, kh] @ q[h]) / math.sqrt(16)
        mask = torch.zeros(N, dtype=torch.bool)
        mask[kept[kh]] = True
        mask[n_ctx:] = True
        dv.append((logits.softmax(-1) - logits.masked_fill(~mask, -math.inf).softmax(-1)) @ v[0, kh])
    want = (tiny.model.layers[0].self_attn.o_proj.weight.detach() @ torch.cat(dv)).abs().sum()
    assert small["per_layer"][0] == pytest.approx(float(want), rel=1e-3)


def test_records_resume(tmp_path):
    case = E.Case("needle", 3, "synthetic", 2048, [1, 2], [3])
    cfg = E.Config("snapkv", budget=64)
    st = E.Store(str(tmp_path))
    assert not st.done(case, cfg)
    st.add(case, cfg, {"acc_ll": 1, "wo_err": {"value": 0.5, "per_head": [0.5]}}, 1.5)
    again = E.Store(str(tmp_path))
    assert again.done(case, cfg) and not again.done(case, E.FULL)
    recs = read_jsonl(str(tmp_path / "needle-2048.jsonl.gz"))  # compressed, one gzip member per configuration
    assert [r["metric"] for r in recs] == ["acc_ll", "wo_err", "seconds"] and recs[1]["per_head"] == [0.5]
    # a metric added later measures the configurations that lack it again
    ag = E.Config("snapkv", setting="agnostic", budget=0.2)
    again.add(case, ag, {"acc_ll": 1}, 1.0)
    assert not E.Store(str(tmp_path)).done(case, ag)
    again.add(case, ag, {"acc_ll": 1, "layer_err": {"value": 2.0, "per_layer": [1.0]}}, 1.0)
    assert E.Store(str(tmp_path)).done(case, ag)
    lm = E.Case("lm", 3, "synthetic", 2048, [1, 2], [3])
    again.add(lm, ag, {"kl": 0.1}, 1.0)
    assert E.Store(str(tmp_path)).done(lm, ag)


def test_cases_have_the_exact_length():
    from tritonkv.integrations.model import converted_dir

    path = converted_dir()
    if not os.path.exists(os.path.join(path, "tokenizer.json")) and \
            not os.path.exists(os.path.join(path, "tokenizer_config.json")):
        pytest.skip("SmolLM2's tokenizer is not fetched")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    for task in E.TASKS:
        for src in E.available_sources()[:2]:
            c = E.build_case(tok, task, 1024, 5, src)
            if task == "lm":
                assert len(c.ctx_ids) == 1024 and len(c.cont_ids) == E.CONT and not c.q_ids
                continue
            assert len(c.prompt) == 1024, (task, src)
            assert len(c.cands) == 10 and len({tuple(x) for x in c.cands}) == 10
            # the asked answer is in the context (except for cwe, where it is the repeated word)
            ans = tok.decode(c.cands[c.answer]).strip()
            assert ans in tok.decode(c.ctx_ids)
            assert E.build_case(tok, task, 1024, 5, src).prompt == c.prompt  # seeded


def test_configuration_names():
    assert E.lagkv_policy("lagkv").lag == 128 and E.lagkv_policy("lagkv_l1024").lag == 1024
    assert E._allocation("uniform") is None and E._allocation("adakv") == "adakv"
    wide = E._allocation("surfacelogic_paper")
    assert wide.name == "surfacelogic" and wide.profile_name == E.PAPER_PROFILE
