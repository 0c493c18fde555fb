"""Batch invariance of the transformers integration: every row of a left-padded batch gives the logits of the same
prompt run alone, and keeps the same tokens, in every mode, for every policy, with and without every allocation.

A seeded random sweep on a random Llama (2 layers, hidden 64, 4 query / 2 KV heads, vocab 1000; fp32, CPU, no
download). Case ``i`` takes the i-th policy, allocation and mode in turn (the three lists' lengths are co-prime, so
every combination comes up once the sweep is long enough) and draws the rest: 2-3 rows of 6-120 real tokens
(left-padded to the longest; at least one row padded), an int budget of 8-64 tokens per head over the policy's protected ones, blocks of 16 or 32,
re-compression every 8 decode steps (decoding mode), 12 new tokens greedily with ``tritonkv...generate``. Per row:
the largest logit difference from the row alone over every step, and its kept tokens per layer and head
(``kept_tokens()``, which must count real tokens only) against the row alone's.

    python -m benchmarks.batch_invariance --cases 240 --out benchmarks/results/batch_invariance.json
    python -m benchmarks.batch_invariance --model gemma3-sliding --cases 96 --out <out>.json
    python -m benchmarks.batch_invariance --model gpt-oss --cases 264 --out <out>.json   # attention sinks
    python -m benchmarks.batch_invariance --model gemma2-softcap --cases 264 --out <out>.json   # logit softcapping

``--model gemma3-sliding``: a random Gemma 3 of the same size whose first layer is a sliding-window one (window 24,
shorter than most rows) beside a full one; the cases whose policy is KNorm are left out there: Gemma 3 normalises its
keys (``k_norm``, whose weights a random model leaves at one), so their norms are near-ties that the ~1e-6
differences between a padded row's attention and the row alone's may reorder. ``--model gpt-oss`` (random attention
sinks) and ``--model gemma2-softcap`` (logit softcapping): the same shape and windows, attention written out.

(tests/test_transformers_padding.py runs the first cases of the same sweep.) Recursive LagKV (``"lagkv"`` in
``"decoding"`` mode) refuses padded batches by design; that combination runs ``"blockwise"`` instead.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks import common

ATOL = 1e-5  # fp32 round-off of logits of magnitude ~1 (measured differences: ~1e-7)
POLICIES = ["criticalkv", "h2o", "keydiff", "knorm", "lagkv", "score", "snapkv", "streaming_llm", "surfacelogic",
            "tova", "keydiff"]  # 11 entries (keydiff twice: the paper's policy)
ALLOCATIONS = [None, "uniform", "adakv", "pyramid", "surfacelogic", "headkv", "cake", "score"]  # 8
MODES = ["after_prefill", "blockwise", "decoding"]  # 3
LAYERS, H_KV, H_Q, VOCAB = 2, 2, 4, 1000


def random_llama():
    """``common.random_llama`` (``LAYERS`` layers, ``H_Q`` / ``H_KV`` heads, vocabulary ``VOCAB``), token 0 the pad."""
    return common.random_llama(pad_token_id=0)


def gemma3_sliding():
    """A seeded random Gemma 3 of the same shape (head dim 16): a sliding-window layer (window 24), then a full one."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=H_Q,
        num_key_value_heads=H_KV, head_dim=16, pad_token_id=0, max_position_embeddings=1024, sliding_window=24,
        layer_types=["sliding_attention", "full_attention"])).eval()


def gpt_oss_sinks():
    """A seeded random gpt-oss of the same shape: random attention sinks, a sliding-window layer (window 24), then a
    full one."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=H_Q,
        num_key_value_heads=H_KV, head_dim=16, pad_token_id=0, max_position_embeddings=1024, sliding_window=24,
        layer_types=["sliding_attention", "full_attention"], num_local_experts=2, num_experts_per_tok=1)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model


def gemma2_softcap():
    """A seeded random Gemma 2 of the same shape with attention logit softcapping (a cap of 0.02, below the random
    logits), a sliding-window layer (window 24), then a full one."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=H_Q,
        num_key_value_heads=H_KV, head_dim=16, pad_token_id=0, max_position_embeddings=1024, sliding_window=24,
        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=0.02)).eval()


MODELS = {"llama": random_llama, "gemma3-sliding": gemma3_sliding, "gpt-oss": gpt_oss_sinks,
          "gemma2-softcap": gemma2_softcap}
SKIP = {"gemma3-sliding": {"knorm"}}  # policies left out per model (see the module docstring)


def case_indices(cases: int, model: str = "llama") -> list[int]:
    """The first ``cases`` case indices of ``model``'s sweep (those whose policy it does not leave out)."""
    out, i = [], 0
    while len(out) < cases:
        if POLICIES[i % len(POLICIES)] not in SKIP.get(model, ()):
            out.append(i)
        i += 1
    return out


def extra_inputs(policy, allocation, batch: int, gen: torch.Generator) -> dict:
    """What the policy or allocator reads beyond the model (synthetic, but the same for a row alone: batched
    inputs are given per row and sliced)."""
    out = {}
    if policy == "score":
        out["hd"] = torch.rand(H_KV, generator=gen) + 0.5
    if allocation in ("headkv", "surfacelogic"):  # an [L, H] head profile (surfacelogic ships one for SmolLM2)
        out["profile"] = torch.rand(LAYERS, H_KV, generator=gen)
    if allocation == "cake":
        out["layer_preference"] = torch.rand(LAYERS, generator=gen) + 0.1
    if allocation == "score":
        out["head_means"] = torch.randn(LAYERS, batch, H_Q, 8, generator=gen)
    return out


def row_inputs(inputs: dict, b: int) -> dict:
    return {k: (v[:, b:b + 1] if k == "head_means" else v) for k, v in inputs.items()}


def draw(i: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed * 100_003 + i)
    policy, allocation, mode = POLICIES[i % len(POLICIES)], ALLOCATIONS[i % len(ALLOCATIONS)], MODES[i % len(MODES)]
    if policy == "lagkv" and mode == "decoding":
        mode = "blockwise"
    B = 2 + int(torch.randint(0, 2, (1,), generator=gen))
    longest = 400 if policy == "lagkv" else 120  # LagKV protects its first 16 and last 128-255 tokens
    lengths = torch.randint(6, longest + 1, (B,), generator=gen).tolist()
    if len(set(lengths)) == 1:
        lengths[0] = max(6, lengths[0] - 5)
    from tritonkv.policies import get_policy

    # sink + window, inside the budget (StreamingLLM's window is the budget's rest)
    pol = get_policy(policy)
    protected = 4 if policy == "streaming_llm" else max(sum(pol.protected(n, 10_000)) for n in range(6, longest + 1))
    case = dict(index=i, policy=policy, allocation=allocation, mode=mode, lengths=lengths,
                budget=protected + int(torch.randint(8, 65, (1,), generator=gen)),
                block_size=[16, 32][int(torch.randint(0, 2, (1,), generator=gen))])
    case["ids"] = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
    case["inputs"] = extra_inputs(policy, allocation, B, gen)
    return case


def run_case(model, case: dict, new_tokens: int = 12) -> dict:
    """Worst logit difference of any row from the row alone, whether every row keeps what it keeps alone, and
    whether any row evicted anything."""
    from tritonkv.integrations import transformers as tt

    L = max(case["lengths"])
    B = len(case["lengths"])
    ids = torch.zeros(B, L, dtype=torch.long)
    for b, row in enumerate(case["ids"]):
        ids[b, L - len(row):] = row
    mask = (torch.arange(L)[None] >= (L - torch.tensor(case["lengths"]))[:, None]).long()
    every = 8 if case["mode"] == "decoding" else None  # how often decoding mode compresses (the others never do)
    kw = dict(policy=case["policy"], budget=case["budget"], allocation=case["allocation"], mode=case["mode"],
              block_size=case["block_size"], decode_every=every, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0, return_cache=True)
    out, cache = tt.generate(model, ids, attention_mask=mask, cache_kwargs=case["inputs"], **kw)
    worst, kept_equal = 0.0, True
    held = [int(sum(k[b].sum() for k in cache.kept_tokens())) for b in range(B)]
    evicted = any(h < (n + new_tokens - 1) * LAYERS * H_KV for h, n in zip(held, case["lengths"]))
    for b, row in enumerate(case["ids"]):
        alone, acache = tt.generate(model, row[None], cache_kwargs=row_inputs(case["inputs"], b), **kw)
        worst = max(worst, max(float((x[b] - y[0]).abs().max()) for x, y in zip(out.logits, alone.logits)))
        kept_equal &= all(torch.equal(k[b], a[0]) for k, a in zip(cache.kept_tokens(), acache.kept_tokens()))
    return dict(worst=worst, kept_equal=kept_equal, evicted=evicted)


def sweep(cases: int, seed: int = 0, model: str = "llama", progress: bool = False) -> list[dict]:
    net = MODELS[model]()
    results = []
    for i in case_indices(cases, model):
        case = draw(i, seed)
        r = run_case(net, case)
        results.append({k: case[k] for k in ("index", "policy", "allocation", "mode", "lengths", "budget",
                                             "block_size")} | r)
        if progress:
            print(json.dumps(results[-1]), flush=True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=240)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    results = sweep(args.cases, args.seed, args.model, progress=True)
    bad = [r for r in results if not (r["worst"] <= ATOL and r["kept_equal"])]
    summary = dict(cases=len(results), invariant=len(results) - len(bad), atol=ATOL,
                   worst=max(r["worst"] for r in results), seconds=round(time.time() - t0, 1),
                   combinations=len({(r["policy"], r["allocation"], r["mode"]) for r in results}),
                   evicting=sum(r["evicted"] for r in results),
                   model=args.model, command=common.command(
                       ["--cases", str(args.cases), "--seed", str(args.seed), "--model", args.model]),
                   machine=common.describe(common.run_info()))
    print(json.dumps(summary))
    if args.out:
        common.write_json(args.out, dict(summary=summary, failures=bad, results=results))
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
