"""Memory inside a model, measured: tritonkv's transformers integration against the stock ``model.generate``.

    python -m benchmarks.memory                     # random Llama, 3 modes x 4 policies + stock, N = 4K..32K
    python -m benchmarks.memory --smoke --out DIR   # N = 512, 1024, one policy per mode (the test's check)
    python -m benchmarks.memory --model gemma3 --out DIR   # a random Gemma 3: five sliding-window layers, one full
    python -m benchmarks.memory --model gpt-oss --out DIR  # a random gpt-oss: attention sinks, sliding and full layers

Each measurement runs in a fresh process forked from a forkserver: the peak RSS (on a GPU the CUDA allocator's
peak) during ``generate`` over what the process held before it, and the cache's resident bytes against the K/V it
keeps. Method, settings, targets and outputs: docs/benchmarks.md, "Memory inside a model (memory.py)".
"""
from __future__ import annotations

import argparse
import gc
import itertools
import multiprocessing
import os
import resource
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common import (LLAMA_256, RESULTS, in_processes, malloc_trim, pyplot, random_llama, rss_kb, run_info,
                               table, write_results)

MODES = ("after_prefill", "blockwise", "decoding")
POLICIES = (("keydiff", None), ("snapkv", None), ("snapkv", "adakv"), ("lagkv", None))
BUDGET, BLOCK, NEW_TOKENS, SMOKE_NEW_TOKENS = 0.1, 512, 64, 16
WARMUP_N, WARMUP_BUDGET = 1024, 0.5  # every path runs (compressions, 2 blocks) above LagKV's protected 16 + 240
TINY_NS = (4096, 8192, 16384, 32768)
SMOKE_NS = (512, 1024)
SMOKE_CONFIGS = (("after_prefill", "keydiff", None), ("blockwise", "snapkv", "adakv"), ("decoding", "lagkv", None))
TARGET_PEAK, TARGET_RESIDENT = 1.2, 1.1
MMAP_THRESHOLD = 128 * 1024  # glibc: a fixed threshold (no dynamic raise), so freed tensors leave the RSS
# the models: name -> (description, config). One is measured per run (``--model``; ``use_model``)
GEMMA3_WINDOW = 1024  # Gemma 3's sliding window
GPT_OSS_WINDOW = 128  # gpt-oss's sliding window
MODELS = {
    "tiny": ("random Llama (2 layers, 8/2 heads, head_dim 32, fp32; bf16 on a GPU)", dict(LLAMA_256)),
    "gemma3": (f"random Gemma 3 (6 layers: 5 sliding-window ({GEMMA3_WINDOW}), then 1 full; 8/2 heads, head_dim 32, "
               f"fp32; bf16 on a GPU)", dict(LLAMA_256, num_hidden_layers=6, sliding_window=GEMMA3_WINDOW,
                              layer_types=["sliding_attention"] * 5 + ["full_attention"])),
    # attention sinks (random, one per query head): stock runs the eager attention, the one that computes them
    "gpt-oss": (f"random gpt-oss (4 layers: sliding-window ({GPT_OSS_WINDOW}) and full in turn, random attention "
                f"sinks; 8/2 heads, head_dim 32, 2 experts, fp32; bf16 on a GPU)",
                dict(LLAMA_256, num_hidden_layers=4, sliding_window=GPT_OSS_WINDOW, num_local_experts=2,
                     num_experts_per_tok=1, layer_types=["sliding_attention", "full_attention"] * 2)),
}
STOCK_ATTENTION = {"gpt-oss": "eager"}  # the stock model's attention implementation (default: sdpa)
MODEL, MODEL_NAME = "tiny", MODELS["tiny"][0]


def label(policy, allocation) -> str:
    return "stock" if policy is None else policy + (f"+{allocation}" if allocation else "")


def config_key(model, mode, policy, allocation) -> str:
    """``model/mode/policy[+allocation]``; stock is ``model/stock/dynamic``."""
    return f"{model}/stock/dynamic" if policy is None else f"{model}/{mode}/{label(policy, allocation)}"


STOCK = config_key(MODEL, None, None, None)


def use_model(name: str) -> None:
    """Measure ``name`` of ``MODELS`` in this run (the keys, the stock row, the titles)."""
    global MODEL, MODEL_NAME, STOCK
    MODEL, MODEL_NAME = name, MODELS[name][0]
    STOCK = config_key(MODEL, None, None, None)


def build_model(name: str):
    """A seeded random model of ``MODELS[name]`` with its stock attention (``STOCK_ATTENTION``; on the CPU)."""
    config = MODELS[name][1]
    if name == "tiny":
        return random_llama(**config, attn_implementation="sdpa")
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    if name == "gpt-oss":
        model = GptOssForCausalLM(GptOssConfig(**config, attn_implementation="eager")).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
        return model
    return Gemma3ForCausalLM(Gemma3TextConfig(**config, attn_implementation="sdpa")).eval()


def plan(smoke: bool, ns=None, modes=None, policies=None, block_size: int = BLOCK, forward_tokens=None) -> list:
    """Every measurement as a spec: smallest N first, stock first at each N (a run cut short keeps whole Ns).
    ``ns``, ``modes``, ``policies`` (labels): only these (stock always runs). ``block_size`` and
    ``forward_tokens`` (None: ``prefill``'s default): block-wise prefill's."""
    configs = SMOKE_CONFIGS if smoke else [(m, p, a) for m in MODES for p, a in POLICIES]
    configs = [c for c in configs if (not modes or c[0] in modes) and (not policies or label(c[1], c[2]) in policies)]
    return [dict(key=config_key(MODEL, mode, policy, allocation), model=MODEL, N=n, mode=mode, policy=policy,
                 allocation=allocation, budget=BUDGET, block_size=block_size if mode == "blockwise" else None,
                 new_tokens=SMOKE_NEW_TOKENS if smoke else NEW_TOKENS,
                 forward_tokens=forward_tokens if mode == "blockwise" else None)
            for n in ns or (SMOKE_NS if smoke else TINY_NS)
            for mode, policy, allocation in [(None, None, None)] + configs]


# ---------------------------------------------------------------------------------------------
# the worker: one measurement in this (fresh) process


def _maxrss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _reset_peak_rss() -> bool:
    """Reset the RSS high-water mark (and so ``ru_maxrss``) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _maxrss_kb() <= rss_kb() + 1024


def tensor_peak(prof) -> int:
    """The most bytes of CPU tensors allocated during a profiled call and alive at once: the running sum of the
    profiler's memory events (allocations +, frees -) in time order, at its maximum."""
    ev = sorted(((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                 if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")), key=lambda x: x[0])
    return max([0, *itertools.accumulate(b for _, b in ev)])


def held_bytes(cache) -> int:
    """Bytes of every distinct tensor storage reachable from ``cache.layers`` (attributes walked recursively
    through tritonkv / transformers objects, dicts, lists and tuples; a layer's back-reference to its cache
    is not followed). Independent of the cache's own ``nbytes``."""
    import torch

    storages, seen = {}, set()

    def visit(o, depth):
        if id(o) in seen or depth > 10:
            return
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.nbytes():
                storages[(o.device.type, o.device.index, st.data_ptr())] = st.nbytes()
            return
        if isinstance(o, dict):
            children = o.values()
        elif isinstance(o, (list, tuple)):
            children = o
        elif type(o).__module__.startswith(("tritonkv", "transformers.cache_utils")) and hasattr(o, "__dict__"):
            children = [v for k, v in vars(o).items() if k != "cache"]
        else:
            return
        for v in children:
            visit(v, depth + 1)

    for layer in cache.layers:
        visit(layer, 0)
    return sum(storages.values())


def _pos_size(layer) -> int:
    """Element size of the positions a tritonkv layer keeps for its tokens."""
    if hasattr(layer, "state"):  # LagKV's recursive state: int64 indices of C (U's are implicit)
        t = layer.state.c_indices
        return t.element_size() if t is not None else 8
    st = layer.store
    return st.kv.positions.element_size() if st.ragged else st.pos.element_size()


def cache_stats(cache) -> dict:
    """Resident bytes, kept tokens and kept bytes of a TritonKVCache or a transformers DynamicCache."""
    from tritonkv.integrations.transformers import TritonKVCache

    out = dict(held_bytes=held_bytes(cache))
    if isinstance(cache, TritonKVCache):
        per_head = cache.kept_tokens()
        kept = [int(k.sum()) for k in per_head]
        pairs = list(zip(cache.layers, kept))
        out.update(resident_bytes=int(cache.nbytes), kept_tokens=sum(kept),
                   kept_kv_bytes=sum(k * 2 * layer._shape[2] * layer.dtype.itemsize for layer, k in pairs),
                   kept_pos_bytes=sum(k * _pos_size(layer) for layer, k in pairs),  # _shape: (B, H_kv, D)
                   kept_per_head_max=max(int(c.max()) for c in per_head),
                   kept_per_head_mean=round(sum(kept) / sum(c.numel() for c in per_head), 1),
                   slots=cache.stored_tokens(), compressions=cache.compressions)
    else:  # DynamicCache: every token, keys and values only
        layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
        res = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
        kept = sum(layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2] for layer in layers)
        out.update(resident_bytes=res, kept_tokens=kept, kept_kv_bytes=res, kept_pos_bytes=0,
                   kept_per_head_max=max(layer.keys.shape[2] for layer in layers),
                   kept_per_head_mean=float(layers[0].keys.shape[2]), slots=[layer.keys.shape[2] for layer in layers],
                   compressions=0)
    kept_bytes = out["kept_kv_bytes"] + out["kept_pos_bytes"]
    out.update(resident_over_kept=round(out["resident_bytes"] / kept_bytes, 4),
               held_over_kept=round(out["held_bytes"] / kept_bytes, 4))
    return out


class AfterPrompt:
    """A ``generate`` streamer that reads the cache when the first new token comes out (the prompt is in, the
    first decode step has not run). The cache object is caught by a forward pre-hook on the model."""

    def __init__(self, model):
        self.cache, self.calls, self.stats = None, 0, None
        self.hook = model.register_forward_pre_hook(self._pre, with_kwargs=True)

    def _pre(self, module, args, kwargs):
        if self.cache is None:  # transformers >= 5.24 passes the cache to forward as ``cache``
            self.cache = next((kwargs[k] for k in ("past_key_values", "cache") if kwargs.get(k) is not None), None)

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.cache is not None:  # 1: the prompt ids, 2: the first new token
            self.stats = cache_stats(self.cache)

    def end(self):
        self.hook.remove()


def _forward(spec) -> dict:
    return {"forward_tokens": spec["forward_tokens"]} if spec.get("forward_tokens") else {}


def _generate(model, ids, spec, new_tokens, streamer=None):
    """One generate call of ``spec``'s configuration: ``(new_ids, cache)``."""
    import torch
    from tritonkv.integrations import transformers as tt

    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=streamer,
               pad_token_id=model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0)
    if spec["policy"] is None:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True, **gen)
        return out.sequences[:, ids.shape[1]:], tt.output_cache(out)
    out, cache = tt.generate(model, ids, policy=spec["policy"], budget=spec["budget"], mode=spec["mode"],
                             allocation=spec["allocation"], block_size=spec["block_size"] or 128, return_cache=True,
                             **_forward(spec), **gen)
    return out[:, ids.shape[1]:], cache


def worker(spec: dict) -> dict:
    """The row of ``spec``, measured in this process: set-up times, the peaks of the measured call, the cache after
    the prompt and after ``generate``."""
    t_import = time.perf_counter()
    import torch

    from tritonkv.integrations import transformers as tt

    t_import = time.perf_counter() - t_import
    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    # bf16 on a GPU, as users run it: in fp32 SDPA has no fused kernel for grouped-query attention on CUDA and falls
    # back to its math kernel, whose N x N weights would make the stock baseline quadratic in memory
    model = build_model(spec["model"]).to("cuda", torch.bfloat16) if cuda else build_model(spec["model"])
    ids, warm = (torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
                 .to(model.device) for n, seed in ((spec["N"], 1), (WARMUP_N, 2)))
    load_s = time.perf_counter() - t0
    t = time.perf_counter()
    with torch.no_grad():
        _generate(model, warm, dict(spec, budget=WARMUP_BUDGET), 2)  # lazy imports, one-time set-up of this path
    warmup_s = time.perf_counter() - t
    gc.collect()
    res = dict(spec, pid=os.getpid(), device=torch.cuda.get_device_name() if cuda else "cpu",
               threads=torch.get_num_threads(), import_s=round(t_import, 2), load_s=round(load_s, 2),
               warmup_s=round(warmup_s, 2), malloc_trim=malloc_trim(), maxrss_before_reset_kb=_maxrss_kb())
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cuda_base = torch.cuda.memory_allocated()
    res["peak_reset"] = _reset_peak_rss()
    base = rss_kb()
    probe = AfterPrompt(model)
    t = time.perf_counter()
    with torch.no_grad():
        new, cache = _generate(model, ids, spec, spec["new_tokens"], streamer=probe)
    if cuda:
        torch.cuda.synchronize()
        cuda_peak = torch.cuda.max_memory_allocated()
        res.update(cuda_base_bytes=cuda_base, cuda_peak_bytes=cuda_peak, cuda_peak_increase_bytes=cuda_peak - cuda_base)
    res["wall_s"] = round(time.perf_counter() - t, 3)
    peak = _maxrss_kb()
    res.update(rss_base_kb=base, peak_rss_kb=peak, peak_increase_kb=peak - base, generated=int(new.shape[1]))
    res.update(after_generate=cache_stats(cache), after_prompt_in_generate=probe.stats)
    del cache, new
    gc.collect()
    if spec.get("tensor_peak") and not cuda:  # the same call again, its tensor allocations logged
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, torch.no_grad():
            _generate(model, ids, spec, spec["new_tokens"])
        res["tensor_peak_bytes"] = tensor_peak(prof)
        del prof
        gc.collect()
    if spec["policy"] is None or spec["N"] > spec.get("prefill_run_max_n", 1 << 30):
        res["after_prompt"], res["after_prompt_source"] = probe.stats, "generate"  # the cache inside generate
    else:
        res["after_prompt_source"] = "prefill"
        c = tt.make_cache(model, spec["policy"], spec["budget"], mode=spec["mode"], allocation=spec["allocation"],
                          block_size=spec["block_size"] or 128, prompt_length=spec["N"])
        t = time.perf_counter()
        tt.prefill(model, ids, c, **_forward(spec))
        res["prefill_wall_s"] = round(time.perf_counter() - t, 3)
        res["after_prompt"] = cache_stats(c)
    return res


# ---------------------------------------------------------------------------------------------
# the driver: one fresh process per measurement


def machine() -> dict:
    """``benchmarks.common.run_info`` with the usable cores and the memory (Linux, as are the RSS readings)."""
    with open("/proc/meminfo") as f:
        mem = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) // 1024
    return dict(run_info(), affinity=len(os.sched_getaffinity(0)), mem_total_mb=mem)


PRELOAD = ["torch", "transformers", "transformers.models.llama.modeling_llama", "transformers.generation.utils",
           "tritonkv", "tritonkv.integrations.transformers"]


def run(args) -> dict:
    """Every measurement of ``args``, ``args.jobs`` at a time (one by default: their wall times then compare), the
    results rewritten after each (with ``args.out``); none starts after ``args.time_budget`` seconds."""
    specs = [dict(s, tensor_peak=args.tensor_peak, prefill_run_max_n=args.prefill_run_max_n)
             for s in plan(args.smoke, args.n, args.modes, args.policies, args.block_size, args.forward_tokens)]
    if not args.default_malloc:  # read by glibc when the forkserver starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    from tritonkv.integrations.transformers.generate import FORWARD_TOKENS

    m = machine()
    res = dict(machine=m, command=m["command"], smoke=args.smoke, jobs=args.jobs,
               malloc_env={k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
               settings=dict(budget=BUDGET, block_size=args.block_size,
                             forward_tokens=args.forward_tokens or FORWARD_TOKENS,
                             new_tokens=SMOKE_NEW_TOKENS if args.smoke else NEW_TOKENS,
                             warmup_tokens=WARMUP_N, warmup_budget=WARMUP_BUDGET, models={MODEL: MODEL_NAME},
                             model_config=MODELS[MODEL][1],
                             targets=dict(peak_after_prefill=TARGET_PEAK, resident_over_kept=TARGET_RESIDENT)),
               configurations=sorted({s["key"] for s in specs}), rows=[], skipped=[], complete=False)
    # the forkserver: a process started once that imports PRELOAD (and runs nothing); every measurement is a child
    # forked from it, a fresh process that skips the imports (a timeout or a death becomes the row's error)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    t0 = time.perf_counter()

    def task(spec):
        if time.perf_counter() - t0 > args.time_budget:
            return None  # not started
        t = time.perf_counter()
        row = in_processes(ctx, worker, [spec], args.timeout)[0]
        return dict(row, process_s=round(time.perf_counter() - t, 1), process="fork")

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for i, (spec, row) in enumerate(zip(specs, pool.map(task, specs))):
            if row is None:
                res["skipped"].append(dict(key=spec["key"], N=spec["N"]))
                continue
            res["rows"].append(dict(row, commit=m["commit"]))
            msg = row["error"].strip().splitlines()[-1] if "error" in row else \
                (f"peak +{row['peak_increase_kb'] / 1024:.1f} MiB, resident "
                 f"{row['after_generate']['resident_bytes'] / 2**20:.2f} MiB, {row['wall_s']:.1f} s")
            print(f"[{i + 1}/{len(specs)} {time.perf_counter() - t0:.0f}s] {spec['key']} N={spec['N']}: {msg}",
                  flush=True)
            res["wall_s"] = round(time.perf_counter() - t0, 1)
            if args.out:
                write(res, args.out)
    res["complete"] = not res["skipped"]
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


# ---------------------------------------------------------------------------------------------
# tables, targets, plot


def _ok(rows):
    return [r for r in rows if "error" not in r]


def _bytes(b):
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 1024:.0f} KiB"


def _grid(rows):
    """``{key: {N: row}}`` of the measurements (stock first, then in the order of ``plan``) and their sorted Ns."""
    grid = {}
    for r in _ok(rows):
        grid.setdefault(r["key"], {})[r["N"]] = r
    order = [STOCK] + [config_key(MODEL, m, p, a) for m in MODES for p, a in POLICIES]
    keys = sorted(grid, key=lambda k: order.index(k) if k in order else len(order))
    return {k: grid[k] for k in keys}, sorted({n for g in grid.values() for n in g})


def _name(key):
    _, mode, pol = key.split("/")
    return f"stock (DynamicCache, {STOCK_ATTENTION.get(MODEL, 'sdpa')})" if mode == "stock" else f"{mode} · {pol}"


def grid_table(rows, cell, last=None, stock_name=None) -> str:
    """One line per configuration, one column per N: ``cell(row, stock_row, is_stock)`` (the stock row None where
    stock was not measured at that N) gives the text, or None for "—". ``last = (title, f(key, {N: row}))``: one
    more column; ``stock_name``: the stock line's name."""
    grid, ns = _grid(rows)
    stock = grid.get(STOCK, {})
    lines = []
    for key, g in grid.items():
        cells = [cell(g[n], stock.get(n), key == STOCK) if n in g else None for n in ns]
        name = stock_name if stock_name and key == STOCK else _name(key)
        lines.append([name] + ["—" if c is None else c for c in cells] + ([last[1](key, g)] if last else []))
    head = ["configuration"] + [f"N={n}" for n in ns] + ([last[0]] if last else [])
    return "\n".join(table(lines, None, head, right=True))


def value_table(rows, field, scale=1.0, fmt=".1f", ratio=True) -> str:
    """``field / scale`` of each measurement, with its ratio to stock at the same N (``ratio``); "" when no row
    has ``field``."""
    if not any(field in r for r in _ok(rows)):
        return ""

    def cell(r, s, is_stock):
        if field not in r:
            return None
        with_ratio = ratio and s and s.get(field) and not is_stock
        return f"{r[field] / scale:{fmt}}" + (f" ({r[field] / s[field]:.2f}×)" if with_ratio else "")
    return grid_table(rows, cell)


def resident_table(rows, when) -> str:
    """Resident bytes (``when``: after_prompt / after_generate) with resident / kept and, where it differs by more
    than 1 %, the bytes actually held (the storage walk)."""
    def cell(r, s, st):
        st = r.get(when)
        if not st:
            return None
        held = abs(st["held_bytes"] - st["resident_bytes"]) > 0.01 * st["resident_bytes"]
        return (f"{_bytes(st['resident_bytes'])} ({st['resident_over_kept']:.3f}×)"
                + (f" held {_bytes(st['held_bytes'])} ({st['held_over_kept']:.2f}×)" if held else ""))
    return grid_table(rows, cell)


def peak_kb(r) -> float:
    """The call's peak increase where the model runs, KiB: the device's allocations on a GPU (where the model, its
    activations and its cache live), the process's RSS on the CPU."""
    return r["cuda_peak_increase_bytes"] / 1024 if "cuda_peak_increase_bytes" in r else r["peak_increase_kb"]


def worst_resident(g) -> tuple:
    """``(resident / kept, N, when, held)`` at its worst over ``{N: row}``, after the prompt and after ``generate``:
    the larger of what ``nbytes`` says and what the cache's storages hold (``held``: the storages, by over 1 %)."""
    return max((max(st["resident_over_kept"], st["held_over_kept"]), n, when,
                st["held_over_kept"] > st["resident_over_kept"] + 0.01)
               for n, r in sorted(g.items()) for when in ("after_prompt", "after_generate") if (st := r.get(when)))


def targets(data) -> list:
    """``[{target, model, configuration, status, detail}]`` for the three targets."""
    out = []
    grid, ns = _grid(data["rows"])
    stock = grid.get(STOCK, {})
    for key, g in grid.items():
        def add(target, ok, detail):
            out.append(dict(target=target, model=MODEL, configuration=key, status="holds" if ok else "misses",
                            detail=detail))
        mode = key.split("/")[1]
        ratios = {n: peak_kb(g[n]) / peak_kb(stock[n]) for n in ns if n in g and n in stock}
        tensor = {n: g[n]["tensor_peak_bytes"] / stock[n]["tensor_peak_bytes"] for n in ratios
                  if g[n].get("tensor_peak_bytes") and stock[n].get("tensor_peak_bytes")}
        detail = ", ".join(f"{n}: {x:.2f}×" + (f" (tensors {tensor[n]:.2f}×)" if n in tensor else "")
                           for n, x in ratios.items())
        if mode == "after_prefill" and ratios:
            add(f"peak ≤ {TARGET_PEAK}× stock (after_prefill, every N)", max(ratios.values()) <= TARGET_PEAK, detail)
        if mode == "blockwise" and len(ratios) >= 2:
            xs = [ratios[n] for n in sorted(ratios)]
            add("blockwise peak below stock as N grows", xs[-1] < 1 and xs[-1] < xs[0], detail)
        if mode != "stock":
            x, n, when, held = worst_resident(g)
            add(f"resident ≤ {TARGET_RESIDENT}× kept K/V + positions", x <= TARGET_RESIDENT,
                f"worst {x:.3f}× at N={n} {when.replace('_', ' ')}"
                + (" (the storages held; nbytes says less)" if held else ""))
    return out


def markdown(data) -> str:
    m = data["machine"]
    rows = data["rows"]
    nt = data["settings"]["new_tokens"]
    out = ["# Memory inside a model: tritonkv vs stock `model.generate`", "",
           f"Machine: {m['cpu']}, {m['cores']} cores ({m.get('affinity')} usable), {m.get('mem_total_mb')} MiB; "
           f"torch {m['torch']}, transformers {m['transformers']}, triton {m['triton']}"
           f"{' (TRITON_INTERPRET=1)' if m.get('triton_interpret') else ''}; commit `{(m['commit'] or '')[:10]}`"
           f"{' plus uncommitted changes to ' + ', '.join(m['tritonkv_modified']) if m.get('tritonkv_dirty') else ''}"
           f"; {m['date']}; run {data.get('wall_s')} s.",
           "", f"Command: `{data['command']}`", "",
           f"Budget {BUDGET} of the prompt per KV head, blockwise blocks of {data['settings']['block_size']} "
           f"(forwards of up to {data['settings'].get('forward_tokens', BLOCK)} tokens), {nt} new tokens (greedy); "
           "every number comes from its own process. **Peak** = the growth of the process's peak RSS "
           "(`ru_maxrss`, reset just before the call) over the RSS before `generate`, in MiB, with the ratio to "
           "stock at the same N. **Resident** = `cache.nbytes` (stock: the DynamicCache's K/V tensors) with the "
           "ratio to the kept K/V bytes + their positions; where the tensors reachable from the cache ('held', "
           "an independent walk of its storages) differ from `nbytes` by more than 1 %, both are shown. "
           "Method: the docstring of `benchmarks/memory.py`."]
    if data.get("smoke"):
        out += ["", "**Smoke run** (tiny N): a check of the program, not a result."]
    if _ok(rows):
        gen_n = sorted({r["N"] for r in _ok(rows) if r["policy"] and r.get("after_prompt_source") == "generate"})
        src = f"; at N={', '.join(map(str, gen_n))} the cache inside `generate` right after the prompt" if gen_n else ""
        sections = [("Peak RSS increase during `generate` (MiB, × stock)",
                     value_table(rows, "peak_increase_kb", 1024)),
                    ("Absolute peak RSS (MiB; the model and the libraries included)",
                     value_table(rows, "peak_rss_kb", 1024, ratio=False)),
                    ("Peak of live tensor bytes during `generate` (MiB, × stock; the profiler's allocation log, "
                     "independent of the C heap)", value_table(rows, "tensor_peak_bytes", 2**20)),
                    ("CUDA peak allocated increase (MiB, × stock; on a GPU the targets read this table)",
                     value_table(rows, "cuda_peak_increase_bytes", 2**20)),
                    (f"Resident cache after the prompt (prefill-only run{src}; × kept K/V + positions)",
                     resident_table(rows, "after_prompt")),
                    (f"Resident cache after {nt} generated tokens (× kept K/V + positions)",
                     resident_table(rows, "after_generate")),
                    (f"Kept tokens per KV head: after the prompt / after {nt} tokens (max over heads after {nt})",
                     grid_table(rows, lambda r, s, st: f"{r['after_prompt']['kept_per_head_mean']:g} / "
                                f"{r['after_generate']['kept_per_head_mean']:g} "
                                f"(max {r['after_generate']['kept_per_head_max']})")),
                    ("Wall time of `generate` (s, × stock)", value_table(rows, "wall_s", fmt=".2f"))]
        out += ["", f"## {MODEL_NAME}"]
        for title, text in sections:
            if text:  # a table of a field no row has (the tensor or CUDA peaks) is left out
                out += ["", f"**{title}**", "", text]
    checked = [[t["target"], t["model"], t["configuration"].split("/", 1)[1], t["status"], t["detail"]]
               for t in targets(data)]
    out += ["", "## Targets (checked, not asserted)", ""]
    out += table(checked, None, ["target", "model", "configuration", "status", "numbers"])
    checks = cross_checks(data)
    if checks:
        out += ["", "## Cross-checks", ""] + [f"- {c}" for c in checks]
    errors = [r for r in rows if "error" in r]
    if errors:
        out += ["", "## Errors", ""] + [f"- `{r['key']}` N={r['N']}: {r['error'].strip().splitlines()[-1]}"
                                        for r in errors]
    if data.get("skipped"):
        out += ["", "## Skipped (time budget)", "", ", ".join(f"`{s['key']}` N={s['N']}" for s in data["skipped"])]
    return "\n".join(out) + "\n"


def cross_checks(data) -> list:
    """Where the prefill-only run and the state inside ``generate`` after the prompt disagree, and where the RSS
    peak could not be reset."""
    out = []
    for r in _ok(data["rows"]):
        a, b = r.get("after_prompt"), r.get("after_prompt_in_generate")
        if a and b and (a["kept_tokens"] != b["kept_tokens"] or a["resident_bytes"] != b["resident_bytes"]):
            out.append(f"`{r['key']}` N={r['N']}: after the prompt, prefill-only holds {a['resident_bytes']} B / "
                       f"{a['kept_tokens']} tokens, inside generate {b['resident_bytes']} B / "
                       f"{b['kept_tokens']} tokens")
        if not r.get("peak_reset"):
            out.append(f"`{r['key']}` N={r['N']}: the RSS peak could not be reset before the call")
        if r.get("generated") != r.get("new_tokens"):
            out.append(f"`{r['key']}` N={r['N']}: generated {r.get('generated')} tokens, not {r.get('new_tokens')}")
    return out


def plot(data, path) -> None:
    """Peak increase and resident bytes after ``generate`` against N, one line per configuration."""
    plt = pyplot()
    rows = _ok(data["rows"])
    nt = data["settings"]["new_tokens"]
    if plt is None or not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    styles = {"after_prefill": "-", "blockwise": "--", "decoding": ":"}
    colors = {"keydiff": "tab:blue", "snapkv": "tab:orange", "snapkv+adakv": "tab:green", "lagkv": "tab:red"}
    for key, g in _grid(rows)[0].items():
        _, mode, pol = key.split("/")
        ns = sorted(g)
        kw = dict(color="black", lw=2.2, marker="s") if mode == "stock" else \
            dict(color=colors.get(pol, "grey"), ls=styles.get(mode, "-"), marker="o", ms=3)
        axes[0].plot(ns, [peak_kb(g[n]) / 1024 for n in ns], label=_name(key), **kw)
        axes[1].plot(ns, [g[n]["after_generate"]["resident_bytes"] / 2**20 for n in ns], label=_name(key), **kw)
    peak = "CUDA peak allocated" if any("cuda_peak_increase_bytes" in r for r in rows) else "peak RSS"
    titles = (f"{peak} increase during generate (MiB)", f"resident cache after {nt} tokens (MiB)")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt length N (tokens)")
        ax.set_title(f"{title}\n{MODEL_NAME}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(data, out_dir) -> str:
    base = write_results(os.path.join(out_dir, "memory"), data, markdown(data))
    plot(data, base + ".png")
    return base


def readme_section(data, results_dir=RESULTS, rel="") -> str:
    """The README summary from ``memory.json``: per configuration the peak RSS increase as a multiple of stock at
    each N and the worst resident / kept."""
    m = data["machine"]
    commits = sorted({(r.get("commit") or m["commit"] or "")[:10] for r in _ok(data["rows"])})
    out = [f"Memory inside a model on the CPU ({m['cpu']}), commit{'s' if len(commits) > 1 else ''} "
           f"{', '.join(f'`{c}`' for c in commits)} (memory.md says which rows come from which), "
           f"{m['date'][:10]}: peak RSS increase during `generate` as a multiple of the stock `model.generate` "
           f"(DynamicCache, {STOCK_ATTENTION.get(MODEL, 'sdpa')}) at the same prompt length, budget {BUDGET}, "
           f"{NEW_TOKENS} new tokens, each in its "
           f"own process; resident = the larger of `cache.nbytes` and the bytes of the storages it holds, over the "
           f"kept K/V + positions (worst over N, after the prompt and after {NEW_TOKENS} tokens). Full tables, method "
           f"and plot: [memory.md]({os.path.join(rel, 'memory.md')}).", ""]
    if _ok(data["rows"]):
        def cell(r, s, is_stock):
            if is_stock:
                return f"{r['peak_increase_kb'] / 1024:.1f} MiB"
            return f"{r['peak_increase_kb'] / s['peak_increase_kb']:.2f}×" if s else None
        worst = ("resident / kept", lambda key, g: 1 if key == STOCK else f"{worst_resident(g)[0]:.3f}")
        out += [f"**{MODEL_NAME}**", "", grid_table(data["rows"], cell, worst, "stock (peak increase)"), ""]
    checks = targets(data)
    out += [f"Targets: {sum(t['status'] == 'holds' for t in checks)} of {len(checks)} checks hold (see the table in "
            "memory.md).", ""]
    if os.path.exists(os.path.join(results_dir, "memory.png")):
        out.append(f"![peak and resident memory vs N]({os.path.join(rel, 'memory.png')})")
    return "\n".join(out).strip()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="N = 512, 1024, one policy per mode (writes only with --out)")
    p.add_argument("--n", type=int, nargs="*", help="prompt lengths")
    p.add_argument("--modes", nargs="*", choices=MODES, help="only these modes (stock always runs)")
    p.add_argument("--policies", nargs="*", help="only these labels (keydiff snapkv snapkv+adakv lagkv)")
    p.add_argument("--time-budget", type=float, default=1500.0,
                   help="seconds after which no new measurement starts (the rest are listed as skipped)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one measurement may take")
    p.add_argument("--default-malloc", action="store_true",
                   help=f"leave glibc's dynamic mmap threshold on (default: MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD})")
    p.add_argument("--tensor-peak", action="store_true",
                   help="also run each call again under the profiler: the peak of live CPU tensor bytes")
    p.add_argument("--prefill-run-max-n", type=int, default=16384,
                   help="the prefill-only run (resident after the prompt) up to this N; above it the cache inside "
                        "generate right after the prompt is read instead (equal wherever both ran)")
    p.add_argument("--block-size", type=int, default=BLOCK, help=f"block-wise prefill's blocks (default {BLOCK})")
    p.add_argument("--forward-tokens", type=int, default=None,
                   help="prompt tokens per model forward of a block-wise prefill (default: prefill's)")
    p.add_argument("--model", choices=sorted(MODELS), default=MODEL, help="the random model measured (default tiny)")
    p.add_argument("--jobs", type=int, default=None, help="measurements at a time (default 1; --smoke: 2)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results; --smoke: none)")
    a = p.parse_args(argv)
    use_model(a.model)
    a.out = a.out or (None if a.smoke else RESULTS)
    a.jobs = a.jobs or (2 if a.smoke else 1)
    res = run(a)
    if a.out:
        print("wrote", write(res, a.out) + ".{json,md,png}")
    else:
        print(markdown(res))
    return res


if __name__ == "__main__":
    main()
