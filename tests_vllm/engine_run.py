"""One vLLM engine per process (vLLM spawns processes and keeps global state, so each test module starts this in a
subprocess): ``python engine_run.py SCENARIO MODEL_DIR OUT.json``. Writes what the tests check as JSON.

Scenarios:
* ``compressed``: keydiff at 64 tokens, 32-token blocks and chunks, a 16-block pool, in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the scheduler's block pool can be read after every step;
* ``full``: the same requests at a budget no request reaches, with vLLM's usual processes (front end + engine
  core), to check exactness and that the plugin loads in each process;
* ``stock``: the same requests with plugins disabled (``VLLM_PLUGINS=""``): vLLM without tritonkv;
* ``tp2``: the ``compressed`` settings at tensor parallel 2 (two CPU workers over gloo, one KV head each), the
  sequential requests one at a time;
* ``hybrid``: the ``compressed`` settings and the sequential requests on a model whose sliding-window layers
  alternate with full ones (Gemma 2 with a logit soft cap, gpt-oss with learned sinks): only the full layers
  compress;
* ``bad``: engines with bad settings, each expected to fail at start, and one whose layers get a backend the plugin
  does not wrap (vLLM's FlexAttention registered over ``CPU_ATTN``).
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import helpers as H  # noqa: E402

BUDGET = 48  # not a multiple of the block: blocks are freed in other steps than those that allocate
POOL = 16  # blocks (one is vLLM's null block): the concurrent requests need 28 uncompressed
#: (id, prompt length, prompt seed, tokens generated)
SEQUENTIAL = [("s100", 100, 1, 16), ("s150", 150, 2, 16), ("s250", 250, 3, 16)]
SHORT = ("short", 30, 4, 20)  # 50 tokens: under the budget
CONCURRENT = [("c300", 300, 5, 24), ("c90", 90, 6, 24), ("c420", 420, 9, 24)]
REUSE = [("long", 400, 7, 40), ("late", 40, 8, 8)]
AGAIN = ("again", 150, 2, 16)  # the prompt of s150 again: vLLM's prefix cache (on) must not serve compressed blocks
#: three requests whose 264 tokens each (9 blocks) the pool cannot hold at once: vLLM preempts and recomputes
PREEMPTED = [("p1", 200, 11, 64), ("p2", 200, 12, 64), ("p3", 200, 13, 64)]
POLICY = {"policy": "keydiff", "budget": BUDGET}


def _llm(model: str, cfg, **over):
    from vllm import LLM

    return LLM(**H.engine_kwargs(model, cfg, **over))


def compressed(model: str) -> dict:
    llm = _llm(model, POLICY, num_gpu_blocks_override=POOL, max_num_batched_tokens=H.BLOCK,
               enable_prefix_caching=True)  # vLLM's default: the plugin's layers opt out of it
    rec = H.Recorder(llm)
    for rid, n, seed, t in SEQUENTIAL + [SHORT]:  # one at a time: each alone in its steps
        rec.add(rid, H.prompt(n, seed), t)
        rec.run()
    for rid, n, seed, t in CONCURRENT:
        rec.add(rid, H.prompt(n, seed), t)
    rec.run()
    # reuse: "long" alone until its prompt is in and it has freed blocks, then "late" joins while it runs
    rid, n, seed, t = REUSE[0]
    rec.add(rid, H.prompt(n, seed), t)
    rec.run(until=lambda: rec.computed["long"][-1] >= n + 2)
    free_blocks = rec.pool.get_num_free_blocks()
    rid2, n2, seed2, t2 = REUSE[1]
    rec.add(rid2, H.prompt(n2, seed2), t2)
    rec.run()
    rid, n, seed, t = AGAIN
    rec.add(rid, H.prompt(n, seed), t)
    rec.run()
    return dict(prompts=rec.prompts, tokens=rec.tokens, schedule={r: rec.schedule(r) for r in rec.prompts},
                blocks=rec.blocks, running=rec.running, cached=rec.cached, free_blocks_after_prefill=free_blocks, pool=POOL,
                budget=BUDGET)


def hybrid(model: str) -> dict:
    # prefix caching on (vLLM's default): the sliding layers' group could serve the prompt again; the plugin's must
    # not (its blocks for those tokens would be fresh, never written), so neither may
    llm = _llm(model, POLICY, num_gpu_blocks_override=2 * POOL, max_num_batched_tokens=H.BLOCK,
               enable_prefix_caching=True)
    rec = H.Recorder(llm)
    for rid, n, seed, t in SEQUENTIAL + [AGAIN]:
        rec.add(rid, H.prompt(n, seed), t)
        rec.run()
    out = dict(prompts=rec.prompts, tokens=rec.tokens, schedule={r: rec.schedule(r) for r in rec.prompts},
               blocks=rec.blocks, groups=[type(m).__name__ for m in rec.managers], cached=rec.cached)
    del rec, llm
    # without vLLM's hybrid KV-cache manager the sliding layers join the full ones in one plain group: refused
    out["hybrid_manager_off"] = _start(lambda: _llm(model, POLICY, disable_hybrid_kv_cache_manager=True))
    return out


def tp2(model: str) -> dict:
    from vllm import SamplingParams

    llm = _llm(model, POLICY, tensor_parallel_size=2, num_gpu_blocks_override=POOL, max_num_batched_tokens=H.BLOCK,
               enable_prefix_caching=True)
    tokens = {}
    for rid, n, seed, t in SEQUENTIAL:  # one at a time, as in ``compressed``: the same chunks
        params = SamplingParams(max_tokens=t, temperature=0.0, ignore_eos=True, detokenize=False)
        out = llm.generate([{"prompt_token_ids": H.prompt(n, seed)}], params, use_tqdm=False)[0]
        tokens[rid] = list(out.outputs[0].token_ids)
    return dict(tokens=tokens)


def preempted(model: str) -> dict:
    """``PREEMPTED`` at a budget no request reaches, on the ``POOL``-block pool (vLLM preempts a request and later
    recomputes it from its prompt and generated tokens) and on one that holds them all: tokens, computed-token
    counts, and the free blocks before and after."""
    out = {}
    for name, pool in (("small", POOL), ("large", 4 * POOL)):
        llm = _llm(model, {**POLICY, "budget": 100_000}, num_gpu_blocks_override=pool,
                   max_num_batched_tokens=2 * H.BLOCK, max_model_len=448)
        rec = H.Recorder(llm)
        free = rec.pool.get_num_free_blocks()
        for rid, n, seed, t in PREEMPTED:
            rec.add(rid, H.prompt(n, seed), t)
        rec.run()
        out[name] = dict(tokens=rec.tokens, computed=rec.computed, free_before=free,
                         free_after=rec.pool.get_num_free_blocks())
        del rec, llm
    return out


def generate(model: str, cfg) -> dict:
    from vllm import SamplingParams

    llm = _llm(model, cfg)
    reqs = SEQUENTIAL + [SHORT] + CONCURRENT
    outs = llm.generate([{"prompt_token_ids": H.prompt(n, seed)} for _, n, seed, _ in reqs],
                        [SamplingParams(max_tokens=t, temperature=0.0, ignore_eos=True, detokenize=False)
                         for *_, t in reqs], use_tqdm=False)
    return dict(tokens={rid: list(o.outputs[0].token_ids) for (rid, *_), o in zip(reqs, outs)})


BAD = {
    "unknown_policy": {"policy": "snapvk", "budget": 64},
    "budget_zero": {"policy": "keydiff", "budget": 0},
    "needs_queries": {"policy": "snapkv", "budget": 64},
    "unknown_setting": {"policy": "keydiff", "budget": 64, "decode_evry": 32},
}


def _unwrapped_backend(model: str):
    """An engine whose layers get a backend the plugin does not wrap. vLLM's CPU platform always picks
    ``CPU_ATTN``, so vLLM's own FlexAttention backend is registered over it (as another plugin could) and the
    selector's cached choice is dropped; run last, the engines before it keep the plugin's backend."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import _cached_get_attn_backend

    from tritonkv.integrations.vllm import register

    register()  # the plugin's backends first (a second call does nothing), then FlexAttention over CPU_ATTN
    register_backend(AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.FLEX_ATTENTION.value)
    _cached_get_attn_backend.cache_clear()
    return _llm(model, POLICY)


def _start(start) -> dict:
    """Start an engine with ``start()``: ``started`` and, when it raised, the error chain and the seconds it took."""
    t0 = time.time()
    try:
        llm = start()
    except Exception as e:  # noqa: BLE001 - what the engine raised is the result
        chain, x = [], e
        while x is not None:
            chain.append(f"{type(x).__name__}: {x}")
            x = x.__cause__ or x.__context__
        return dict(started=False, error=" | ".join(chain), seconds=time.time() - t0)
    del llm
    return dict(started=True)


def bad(model: str) -> dict:
    starts = [(name, lambda cfg=cfg: _llm(model, cfg)) for name, cfg in BAD.items()]
    starts.append(("unwrapped_backend", lambda: _unwrapped_backend(model)))  # last: it replaces CPU_ATTN
    return {name: _start(start) for name, start in starts}


def main(argv) -> None:
    scenario, model, path = argv
    t0 = time.time()
    if scenario == "compressed":
        res = compressed(model)
    elif scenario == "full":
        res = generate(model, {**POLICY, "budget": 100_000})
    elif scenario == "stock":
        res = generate(model, None)
    elif scenario == "hybrid":
        res = hybrid(model)
    elif scenario == "tp2":
        res = tp2(model)
    elif scenario == "preempted":
        res = preempted(model)
    elif scenario == "bad":
        res = bad(model)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    res["seconds"] = time.time() - t0
    with open(path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1:])
