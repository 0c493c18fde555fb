"""A compiled decode loop over a compressing cache against the eager loop, per policy (random Llama, CPU).

``make_cache(model, policy, 64, mode="decoding", decode_every=16)``, an 80-token prompt, ``cache.reserve(96)``, the
decode step compiled with ``torch.compile(fullgraph=True, backend="aot_eager")``, ``compress_now()`` after every
step (the cache re-compresses every 16 steps), greedy decoding; the eager loop decodes the same prompt with another
cache. Per policy: the largest logit difference over all steps, graphs compiled after the first step (a recompile
raises: ``torch._dynamo.config.error_on_recompile``), and the compressions of each loop.

    python -m benchmarks.compiled_decode --steps 500 --out benchmarks/results/compiled_decode.json

(tests/test_transformers_compiled.py runs 40 steps of the same loop.)
"""
from __future__ import annotations

import argparse
import inspect
import json
import time

import torch

import tritonkv
from benchmarks import common
from benchmarks.common import random_llama
from tritonkv.integrations import transformers as tt


def cache_inputs(model, policy):
    """What a policy needs beyond the model (SCORE: head distinctness per KV head)."""
    return {"hd": torch.ones(model.config.num_key_value_heads)} if policy == "score" else {}


def compiled_vs_eager(model, policy, steps: int, *, prompt: int = 80, budget: int = 64, decode_every: int = 16,
                      compress_every: int = 1, pads: tuple = (0,), **cache_kwargs):
    """Greedy-decode ``steps`` tokens with the compiled step (``compress_now`` after every ``compress_every``-th)
    and eagerly, from the same prompt; returns (largest logit difference, graphs compiled after the first step,
    compressions of each). A recompile after the first step raises (``torch._dynamo.config.error_on_recompile``).
    ``pads``: one batch row per entry, left-padded by that many tokens; ``cache_kwargs`` go to ``make_cache``."""
    from torch._dynamo.utils import counters

    B = len(pads)
    ids = torch.randint(3, model.config.vocab_size, (B, prompt), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(prompt) >= torch.tensor(pads)[:, None]).long()
    real = mask.sum(-1, keepdim=True)  # each row's next position
    caches, first = [], []
    for _ in range(2):
        c = tt.make_cache(model, policy, budget, mode="decoding", decode_every=decode_every,
                          **cache_inputs(model, policy), **cache_kwargs)
        first.append(tt.prefill(model, ids, c, attention_mask=mask if any(pads) else None)[:, -1])
        caches.append(c)
    cache, ref = caches
    cache.reserve(budget + 2 * decode_every)
    name = tt.cache_kwarg(model)
    # a forward that still takes ``cache_position`` (transformers < 5.24) gets it as generate passes it: Gemma 3's
    # would otherwise build it from ``get_seq_length()``, a device value in a traced step
    at = (lambda p: {"cache_position": p[0]}) if "cache_position" in inspect.signature(type(model).forward).parameters \
        else (lambda p: {})

    def step(t, p):
        return model(input_ids=t, position_ids=p, use_cache=True, **at(p), **{name: cache}).logits[:, -1]

    torch._dynamo.reset()
    counters.clear()
    cstep = torch.compile(step, fullgraph=True, backend="aot_eager")
    t_c, t_r = first[0].argmax(-1, keepdim=True), first[1].argmax(-1, keepdim=True)
    worst, graphs = 0.0, None
    try:
        with tt.use_tritonkv(model), torch.no_grad():
            for i in range(steps):
                p = real + i
                torch._dynamo.config.error_on_recompile = i > 0  # a recompile after warm-up raises
                lc = cstep(t_c, p).clone()
                if i % compress_every == compress_every - 1:
                    cache.compress_now()
                if i == 0:
                    graphs = counters["stats"]["unique_graphs"]
                lr = model(input_ids=t_r, position_ids=p, use_cache=True, **at(p), **{name: ref}).logits[:, -1]
                worst = max(worst, float((lc - lr).abs().max()))
                t_c, t_r = lc.argmax(-1, keepdim=True), lr.argmax(-1, keepdim=True)
    finally:
        torch._dynamo.config.error_on_recompile = False
    assert cache.get_seq_length() == ref.get_seq_length() == prompt + steps
    return worst, counters["stats"]["unique_graphs"] - graphs, cache.compressions, ref.compressions


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, rows = random_llama(), []
    for policy in sorted(p for p in tritonkv.POLICIES if p != "lagkv"):  # recursive LagKV decodes eagerly
        t0 = time.time()
        worst, graphs, compiled_n, eager_n = compiled_vs_eager(model, policy, args.steps)
        rows.append(dict(policy=policy, steps=args.steps, max_abs_logit_diff=worst, graphs_after_first_step=graphs,
                         compressions_compiled=compiled_n, compressions_eager=eager_n,
                         seconds=round(time.time() - t0, 1)))
        print(json.dumps(rows[-1]), flush=True)
    summary = dict(command=common.command(["--steps", str(args.steps)]), machine=common.describe(common.run_info()),
                   recompiles=sum(r["graphs_after_first_step"] for r in rows),
                   worst=max(r["max_abs_logit_diff"] for r in rows))
    print(json.dumps(summary))
    if args.out:
        common.write_json(args.out, dict(summary=summary, results=rows))


if __name__ == "__main__":
    main()
