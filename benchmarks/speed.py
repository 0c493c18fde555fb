"""Kernel-level speed benchmark on a GPU: every policy, every allocator, decode attention, and scaling in N.

    python -m benchmarks.speed --out $OUT                   # on the GPU machine: all four parts (~2 min on an H200)
    python -m benchmarks.speed --scaling                    # one part only (also --compress/--allocation/--decode)
    TRITON_INTERPRET=1 python -m benchmarks.speed --smoke   # CPU check of the program (writes nothing)

Shapes, row kinds and columns, floors, timing and output files: docs/benchmarks.md ("Speed: how it is measured").
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import types

if "--smoke" in sys.argv[1:]:  # run as a script: the interpreter must be on before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import tritonkv  # noqa: E402
from tritonkv import POLICIES  # noqa: E402
from tritonkv.kernels import _plan  # noqa: E402
from tritonkv.kernels.select import select_indices  # noqa: E402

from benchmarks import baselines, decode_attention as da  # noqa: E402
from benchmarks.common import (RESULTS, copy_bandwidth, device_tag, gpu_time, matmul_tflops,  # noqa: E402
                               policy_inputs, pyplot, random_case, run_info, table, write_results)

KV_POLICIES = {"lagkv", "criticalkv"}  # scores read V too
PARTS = ("compress", "allocation", "decode", "scaling")
# the method's version, in each result: 2 times eager calls with the host's work (``common.host_timed``), compares
# kvpress with the call without attn_lse where a policy takes one, and gives LagKV's floor the kept K+V written once
# and CriticalKV's its W_O; runs of version 1 (no ``method`` field) did none of these
METHOD = 2
OLD_METHOD = ("This run used version 1 of the method, which version 2 corrects: eager times are device times (`do_bench` "
              "calls while its L2 flush runs, so the host's work went unseen below ~90 µs); the kvpress ratios of "
              "SnapKV, TOVA and CriticalKV gave tritonkv the `attn_lse` that kvpress computes itself; LagKV's floor "
              "re-read the kept K+V (its kernel writes them from the partition it has just read) and CriticalKV's left "
              "out reading W_O.")

# (B, H_kv, G, D, W): W window queries
SHAPE, SMOKE_SHAPE = (1, 8, 4, 128, 32), (1, 2, 2, 16, 4)
NS, SMOKE_NS = [4096, 32768, 131072], [160]
SCALING_NS, SMOKE_SCALING_NS = [4096 << i for i in range(8)], [128, 192, 256]  # 4K .. 512K
SCALING_POLICIES = ["knorm", "keydiff", "snapkv", "lagkv"]
ALLOCATIONS = ["uniform", "pyramid", "adakv", "headkv", "score", "surfacelogic", "cake", "fixed"]
ALLOC_POLICY, LAYER, NUM_LAYERS = "snapkv", 15, 30
PROFILE = "smollm2-135m-instruct-infsc"
KEEP = 0.25  # the fraction of tokens kept
COPY_BYTES = 1 << 30  # the floor's bandwidth: one copy of this many bytes
# policies whose tritonkv defaults are kvpress's press exactly: ``same_kept`` only for these (docs/benchmarks.md)
SAME_SETTINGS = {"knorm", "keydiff"}


# ---------------------------------------------------------------------------------------------
# timing


def measure_graph(fn, cuda: bool, what: str) -> tuple[dict, str]:
    """``(gpu_time(...), "graph")`` from a CUDA graph replay, or the eager time when capture fails."""
    if not cuda:
        return gpu_time(fn, cuda, host=True), "eager"
    # a call that synchronises with the host cannot be captured: find out without a capture, whose failure can
    # leave the default CUDA generator unusable outside graphs
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        why = None
    except RuntimeError as e:
        why = f"synchronises with the host ({e})"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if why is None:
        try:
            return gpu_time(fn, cuda, graph=True), "graph"
        except Exception as e:  # a host sync inside
            why = f"CUDA graph capture failed ({type(e).__name__}: {e})"
            torch.cuda.synchronize()
    print(f"{what}: {why}; eager time reported", file=sys.stderr)
    return gpu_time(fn, cuda, host=True), "eager"


def eager_time(fn, cuda: bool) -> tuple[dict, dict]:
    """``gpu_time`` of the eager calls, and the columns that say whether they were repeated from a plan
    (``tritonkv/kernels/_plan.py``): the share of them that were, and why the call was not recorded if it was not."""
    counts = _plan.counts
    calls, replayed, failed = sum(counts.values()), counts["replayed"], counts["not recorded"]
    t = gpu_time(fn, cuda, host=True)
    calls = sum(counts.values()) - calls
    failed = counts["not recorded"] - failed
    return t, dict(eager_planned=round((counts["replayed"] - replayed) / calls, 2) if calls else None,
                   not_recorded=_plan.why[-1] if failed else None)


# ---------------------------------------------------------------------------------------------
# inputs and checks


def window_lse(keys, queries) -> torch.Tensor:
    """fp32 ``[B, H_q, W]``: the log-sum-exp over the keys of each window query's logits (scale 1/√D,
    causal inside the window) — what the prefill's attention gives a model — in key chunks."""
    B, H, N, D = keys.shape
    Hq, W = queries.shape[1], queries.shape[2]
    q = queries.float().view(B, H, Hq // H * W, D) / math.sqrt(D)
    qpos = (N - W + torch.arange(W, device=keys.device)).repeat(Hq // H)
    lse = torch.full(q.shape[:3], float("-inf"), device=keys.device)
    for a in range(0, N, 8192):
        t = torch.einsum("bhqd,bhnd->bhqn", q, keys[:, :, a:a + 8192].float())
        t = t.masked_fill(torch.arange(a, a + t.shape[-1], device=keys.device) > qpos[:, None], float("-inf"))
        lse = torch.logaddexp(lse, t.logsumexp(-1))
    return lse.view(B, Hq, W)


def check_kept(keys, values, out) -> bool:
    """The kept tokens of a ``Compressed`` or ``RaggedKV`` are the input's at their ascending positions."""
    if isinstance(out, tritonkv.RaggedKV):
        K, V, lens, idx = out.to_padded(with_positions=True)
    else:
        K, V, idx = out
        lens = torch.full(idx.shape[:2], idx.shape[2], device=idx.device)
    valid = torch.arange(idx.shape[2], device=idx.device) < lens[..., None]
    N = keys.shape[2]
    g = idx.clamp(0, N - 1)[..., None].expand(-1, -1, -1, keys.shape[3])
    inc = (idx[..., 1:] > idx[..., :-1]) | ~valid[..., 1:]
    return bool(((idx >= 0) & (idx < N) | ~valid).all() and inc.all()
                and (torch.where(valid[..., None], keys.gather(2, g) == K, True)).all()
                and (torch.where(valid[..., None], values.gather(2, g) == V, True)).all())


def score_reads(name, keys, inputs=None) -> int:
    """Bytes the policy's scoring must read: K; K and V for lagkv and criticalkv, and criticalkv's W_O too (its
    exact stage multiplies every value by it); none for streaming_llm."""
    if name == "streaming_llm":
        return 0
    w = inputs["o_proj"] if name == "criticalkv" else None
    w = getattr(w, "weight", w)
    return (keys.numel() * keys.element_size() * (2 if name in KV_POLICIES else 1)
            + (w.numel() * w.element_size() if w is not None else 0))


def kept_moves(name) -> int:
    """How often the floor moves the kept K+V: read again once the selection is known, and written (2); LagKV's
    selection is within the partition it has just read, so its kept tokens are only written (1)."""
    return 1 if name == "lagkv" else 2


# ---------------------------------------------------------------------------------------------
# kvpress (optional)


def import_kvpress():
    """kvpress, with stubs for the modules its import pulls in that a press never uses; None where it fails."""
    stubs = dict(datasets=dict(load_dataset=lambda *a, **k: None), fire=dict(load_dataset=lambda *a, **k: None),
                 cachetools=dict(LRUCache=lambda *a, **k: None, cached=lambda *a, **k: (lambda f: f)))
    try:
        for name, attrs in stubs.items():
            if name not in sys.modules:
                sys.modules[name] = types.ModuleType(name)
                vars(sys.modules[name]).update(attrs)
        import kvpress

        return kvpress
    except Exception as e:  # not installed, or incompatible transformers
        print(f"kvpress unavailable ({type(e).__name__}: {e}); kvpress columns are null", file=sys.stderr)
        return None


def kvpress_case(kvpress, name, keys, values, queries, W):
    """``(press_fn, scores_fn)`` for a policy's kvpress counterpart, or None."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding, apply_rotary_pos_emb

    B, H, N, D = keys.shape
    Hq = queries.shape[1]
    presses = dict(knorm="KnormPress", keydiff="KeyDiffPress", streaming_llm="StreamingLLMPress", lagkv="LagKVPress",
                   tova="TOVAPress", snapkv="SnapKVPress", criticalkv="SnapKVPress")
    if name not in presses:
        return None
    snap = dict(window_size=W, kernel_size=7) if presses[name] == "SnapKVPress" else {}
    press = getattr(kvpress, presses[name])(compression_ratio=1.0 - KEEP, **snap)
    if name == "criticalkv":
        press = kvpress.CriticalKVPress(press)
    cfg = LlamaConfig(hidden_size=Hq * D, num_attention_heads=Hq, num_key_value_heads=H, head_dim=D,
                      num_hidden_layers=1, intermediate_size=128, max_position_embeddings=N + 16)
    cfg._attn_implementation = "sdpa"
    attn = LlamaAttention(cfg, layer_idx=0).to(device=keys.device, dtype=keys.dtype)
    rope = LlamaRotaryEmbedding(cfg).to(keys.device)
    attn.rotary_emb = rope
    g = torch.Generator(device=keys.device).manual_seed(N)  # not the default generator (see measure_graph)
    hidden = torch.randn(B, N, Hq * D, generator=g, device=keys.device, dtype=keys.dtype)
    cos, sin = rope(hidden, torch.arange(N, device=keys.device)[None])
    kwargs = {"position_embeddings": (cos, sin), "hidden_states": hidden}
    # the same window queries for tritonkv: q_proj of the last W hidden states, with RoPE
    q = attn.q_proj(hidden[:, -W:]).view(B, W, Hq, D).transpose(1, 2)
    q, _ = apply_rotary_pos_emb(q, q, cos[:, -W:], sin[:, -W:])
    queries.copy_(q)
    return (lambda: press.compress(attn, hidden, keys, values, None, kwargs),
            lambda: press.score(attn, hidden, keys, values, None, kwargs))


# ---------------------------------------------------------------------------------------------
# the parts


class Ctx:
    """Settings shared by the parts, the wall-clock budget, and the copy bandwidth of the floors."""

    def __init__(self, args):
        self.args = args
        self.cuda = torch.cuda.is_available() and not args.smoke
        self.device = "cuda" if self.cuda else "cpu"
        self.dtype = torch.bfloat16
        self.B, self.H, self.G, self.D, self.W = SMOKE_SHAPE if args.smoke else SHAPE
        self.ns, self.scaling_ns = (SMOKE_NS, SMOKE_SCALING_NS) if args.smoke else (NS, SCALING_NS)
        self.t0 = time.perf_counter()
        self.skipped = []
        # every floor at the bandwidth of one 1 GiB device copy (1 MiB in the CPU smoke run)
        self.copy_bytes = COPY_BYTES if self.cuda else 1 << 20
        self.copy_GBps = copy_bandwidth(self.cuda, self.copy_bytes)
        # CriticalKV's exact stage is compute-bound: its floor is its flops at the rate of a large bf16 matmul
        self.mm_TFLOPS = matmul_tflops(self.cuda, 8192 if self.cuda else 256)

    def case(self, N, seed=0):
        """Random K/V ``[B, H, N, D]`` and the inputs (``common.random_case``), with the window queries' lse."""
        keys, values, pool = random_case(N, self.B, self.H, self.G, self.D, self.W, self.dtype, self.device, seed=seed)
        return keys, values, dict(pool, attn_lse=window_lse(keys, pool["queries"]))

    def base(self, N) -> dict:
        return dict(B=self.B, H_kv=self.H, H_q=self.H * self.G, D=self.D, N=N,
                    dtype=str(self.dtype).replace("torch.", ""), keep=KEEP)

    def over_budget(self, what: str) -> bool:
        """True (and ``what`` recorded as skipped) once ``--time-budget`` seconds have passed."""
        if time.perf_counter() - self.t0 > self.args.time_budget:
            self.skipped.append(what)
            print(f"skipped (time budget {self.args.time_budget:.0f} s): {what}", file=sys.stderr)
            return True
        return False

    def cases(self, kind: str, ns, seed: int = 0):
        """``(N, keys, values, pool, k)`` for each N of ``ns`` that starts within the time budget (``case`` at
        ``seed``; k: the kept tokens per head); the device's cache is emptied after each."""
        for N in ns:
            if not self.over_budget(f"{kind} N={N}"):
                yield (N, *self.case(N, seed), tritonkv.resolve_budget(KEEP, N))
                self.free()

    def free(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def compute_floor(self, name, t: dict, keys, inputs) -> dict:
        """CriticalKV's exact L1 stage, ``‖W_O^q v_j‖₁`` for every token and query head: 2·B·H_q·N·d·D_model
        flops; its floor at the measured matmul rate and the time over it (empty for the other policies)."""
        if name != "criticalkv":
            return {}
        B, H, N, d = keys.shape
        flops = 2 * B * inputs["queries"].shape[1] * N * d * inputs["o_proj"].shape[0]
        floor_us = flops / (self.mm_TFLOPS * 1e6)
        return dict(floor_flops=flops, compute_floor_us=round(floor_us, 2),
                    x_compute_floor=round(t["us"] / floor_us, 2))

    def timed(self, t: dict, timing: str, keys, reads: int, kept_tokens: int, moves: int = 2) -> dict:
        """A timed row's columns: ``gpu_time``'s median, spread and count, how it was timed, and its floor: read
        ``reads`` bytes, then move the kept K+V of ``kept_tokens`` tokens ``moves`` times (``kept_moves``: read and
        write, or write), at the copy bandwidth."""
        us, fb = t["us"], reads + moves * 2 * kept_tokens * keys.shape[-1] * keys.element_size()
        floor_us = fb / (self.copy_GBps * 1e3)
        return dict(tritonkv_us=us, p20_us=t["p20_us"], p80_us=t["p80_us"], reps=t["reps"], timing=timing,
                    floor_bytes=fb, floor_us=round(floor_us, 2), x_floor=round(us / floor_us, 2),
                    achieved_TBps=round(fb / us / 1e6, 3), pct_copy_bw=round(100 * floor_us / us, 1))


def error_row(kind, name, N, e, **extra):
    print(f"{kind} {name} N={N}: {type(e).__name__}: {e}", file=sys.stderr)
    return dict(kind=kind, policy=name, N=N, error=f"{type(e).__name__}: {e}", **extra)


def emit(rows, row):
    rows.append(row)
    print(json.dumps(row), flush=True)


def checked_call(rows, kind, name, N, keys, values, fn, allocation=None):
    """``(out, ok)``: ``fn()``'s result and ``check_kept`` of it, or None after an error row (a policy that cannot
    run at this shape is reported, not hidden)."""
    try:
        out = fn()
    except Exception as e:
        emit(rows, error_row(kind, name, N, e, allocation=allocation))
        return None
    return out, check_kept(keys, values, out)


def run_compress(ctx: Ctx, rows: list) -> None:
    """Every policy's dense compress at each N (kind ``compress``)."""
    kvpress = None if ctx.args.smoke else import_kvpress()
    for N, keys, values, pool, k in ctx.cases("compress", ctx.ns):
        for name in ctx.args.policies or sorted(POLICIES):
            pol = POLICIES[name]()
            # per policy: its own queries (kvpress_case writes the press's RoPE'd window queries there, and the lse
            # follows them), and kvpress works on copies of K/V, so nothing a policy or press does reaches the next
            mine = dict(pool, queries=pool["queries"].clone())
            kv_ref = kvpress and kvpress_case(kvpress, name, keys.clone(), values.clone(), mine["queries"], ctx.W)
            if kv_ref:
                mine["attn_lse"] = window_lse(keys, mine["queries"])
            inputs = policy_inputs(pol, mine)
            fn = lambda: tritonkv.compress((keys, values), pol, k, **inputs)  # noqa: E731
            if not (res := checked_call(rows, "compress", name, N, keys, values, fn)):
                continue
            out, ok = res
            eager, planned = eager_time(fn, ctx.cuda)
            t, timing = measure_graph(fn, ctx.cuda, f"compress {name} N={N}") if ctx.cuda else (eager, "eager")
            kv_us = kv_graph = same = None
            mine_eager, mine_t, mine_timing = eager, t, timing  # tritonkv's side of the kvpress ratios
            if kv_ref:
                press_fn, scores_fn = kv_ref
                press_fn()
                kv_us = gpu_time(press_fn, ctx.cuda, host=True)["us"]
                if ctx.cuda:  # kvpress under a CUDA graph where it allows one (a host sync inside does not)
                    g, g_timing = measure_graph(press_fn, ctx.cuda, f"kvpress {name} N={N}")
                    kv_graph = g["us"] if g_timing == "graph" else None
                if "attn_lse" in inputs:  # kvpress computes the softmax normaliser itself: the same work is the call
                    bare = {a: b for a, b in inputs.items() if a != "attn_lse"}  # without attn_lse (as in generate)
                    bare_fn = lambda: tritonkv.compress((keys, values), pol, k, **bare)  # noqa: E731
                    bare_fn()
                    mine_eager, _ = eager_time(bare_fn, ctx.cuda)
                    mine_t, mine_timing = (measure_graph(bare_fn, ctx.cuda, f"compress {name} N={N} without lse")
                                           if ctx.cuda else (mine_eager, "eager"))
                if name in SAME_SETTINGS:
                    sink, window = pol.protected(N, k)
                    ref_idx, _ = select_indices(scores_fn().float(), k, k, sink=sink, window=window)
                    same = bool(torch.equal(ref_idx, out.indices))
            emit(rows, dict(kind="compress", policy=name, allocation=None, **ctx.base(N),
                            kept_tokens=ctx.B * ctx.H * k, tritonkv_eager_us=eager["us"], **planned,
                            **ctx.timed(t, timing, keys, score_reads(name, keys, inputs), ctx.B * ctx.H * k,
                                        kept_moves(name)),
                            **ctx.compute_floor(name, t, keys, mine),
                            kvpress_us=kv_us, kvpress_graph_us=kv_graph,
                            no_lse_us=mine_t["us"] if mine_t is not t else None,
                            no_lse_eager_us=mine_eager["us"] if mine_eager is not eager else None,
                            x_kvpress_eager=round(kv_us / mine_eager["us"], 2) if kv_us else None,
                            x_kvpress_graph=(round(kv_graph / mine_t["us"], 2) if kv_graph and mine_timing == "graph"
                                             else None),
                            torch_compile_us=None, same_kept=same, ok=ok))


def allocation_case(name, N, k, pol, keys, ctx):
    """``(allocation, inputs, extra bytes read, description)``: what a user passes with allocator ``name``."""
    from tritonkv.allocation import Fixed, headkv_budgets
    from tritonkv.allocation.profiler import load_profile

    dev, H = keys.device, keys.shape[1]
    prof = load_profile(PROFILE)  # [30, 3] INF scores of SmolLM2-135M's KV heads
    prof = prof[:, [h % prof.shape[1] for h in range(H)]].to(dev)
    layer = dict(layer=LAYER, num_layers=NUM_LAYERS)
    if name == "headkv" or name == "surfacelogic":
        return name, dict(profile=prof, **layer), 0, f"{PROFILE} profile, heads tiled to {H}"
    if name == "fixed":
        sink, window = pol.protected(N, k)
        avail = N - sink - window
        return (Fixed(budgets=headkv_budgets(prof, k - sink - window, avail)), layer, 0,
                f"HeadKV budgets from the {PROFILE} profile, precomputed")
    g = torch.Generator(device=dev).manual_seed(1)
    if name == "score":
        m = torch.rand(NUM_LAYERS, keys.shape[0], H * ctx.G, N, generator=g, device=dev)
        m = m / m.norm(dim=-1, keepdim=True)
        desc = f"random unit head_means {list(m.shape)}"
        return name, dict(head_means=m, **layer), m.numel() * m.element_size(), desc
    if name == "cake":
        pref = torch.rand(NUM_LAYERS, generator=g, device=dev) + 0.5
        return name, dict(layer_preference=pref, **layer), 0, f"random layer_preference [{NUM_LAYERS}]"
    return name, layer, 0, "shapes and layer only" if name in ("uniform", "pyramid") else "the policy's scores"


def run_allocation(ctx: Ctx, rows: list) -> None:
    """snapkv compress with every allocator (kind ``allocation``): a RaggedKV with per-head budgets."""
    pol = POLICIES[ALLOC_POLICY]()
    for N, keys, values, pool, k in ctx.cases("allocation", ctx.ns, seed=1):
        inputs = policy_inputs(pol, pool)
        for name in ALLOCATIONS:
            alloc, extra, extra_bytes, desc = allocation_case(name, N, k, pol, keys, ctx)
            fn = lambda: tritonkv.compress((keys, values), pol, k, allocation=alloc, **inputs, **extra)  # noqa: E731
            if not (res := checked_call(rows, "allocation", ALLOC_POLICY, N, keys, values, fn, allocation=name)):
                continue
            out, ok = res
            kept, k_max = (int(x) for x in torch.stack([out.length.sum(), out.length.max()]).tolist())
            del out, res
            eager, planned = eager_time(fn, ctx.cuda)
            # a CUDA graph where the call can be captured (no host read-back), else eager with the reason printed
            t, timing = measure_graph(fn, ctx.cuda, f"allocation {name} N={N}") if ctx.cuda else (eager, "eager")
            emit(rows, dict(kind="allocation", policy=ALLOC_POLICY, allocation=name, **ctx.base(N),
                            layer=LAYER, num_layers=NUM_LAYERS, kept_tokens=kept, k_max=k_max,
                            tritonkv_eager_us=eager["us"], **planned,
                            **ctx.timed(t, timing, keys, score_reads(ALLOC_POLICY, keys) + extra_bytes, kept),
                            inputs=desc, ok=ok))


def run_decode(ctx: Ctx, rows: list) -> None:
    """``decode_attention.py``'s cases (kind ``decode_attention``)."""
    for case in da.SMOKE_CASES if ctx.args.smoke else da.CASES:
        if ctx.over_budget(f"decode_attention {case}"):
            continue
        try:
            row = da.run_case(*case, cuda=ctx.cuda, copy_GBps=ctx.copy_GBps)
        except Exception as e:
            emit(rows, error_row("decode_attention", None, None, e, case=list(case)))
            continue
        emit(rows, dict(kind="decode_attention", policy=None, allocation=None, tritonkv_us=row["ragged_us"],
                        timing="graph" if ctx.cuda else "eager", copy_GBps=round(ctx.copy_GBps, 1), **row))
        ctx.free()


def run_scaling(ctx: Ctx, rows: list) -> dict:
    """Time vs N for a few policies (kind ``scaling``); returns the per-policy fits."""
    for N, keys, values, pool, k in ctx.cases("scaling", ctx.scaling_ns, seed=2):
        for name in SCALING_POLICIES:
            pol = POLICIES[name]()
            inputs = policy_inputs(pol, pool)
            fn = lambda: tritonkv.compress((keys, values), pol, k, **inputs)  # noqa: E731
            if not (res := checked_call(rows, "scaling", name, N, keys, values, fn)):
                continue
            ok = res[1]
            del res
            t, timing = measure_graph(fn, ctx.cuda, f"scaling {name} N={N}")
            emit(rows, dict(kind="scaling", policy=name, allocation=None, **ctx.base(N),
                            ns_per_token=round(t["us"] * 1e3 / N, 4), copy_GBps=round(ctx.copy_GBps, 1),
                            **ctx.timed(t, timing, keys, score_reads(name, keys, inputs), ctx.B * ctx.H * k,
                                        kept_moves(name)), ok=ok))
    return {name: fit([(r["N"], r["tritonkv_us"]) for r in rows if r.get("kind") == "scaling"
                       and r["policy"] == name and "tritonkv_us" in r]) for name in SCALING_POLICIES}


def fit(points) -> dict:
    """Least squares time_us = intercept_us + slope·N (slope in ns/token), R², and the log-log exponent
    over N >= 64K (over the upper half of the points when fewer than two are that large)."""
    pts = sorted(points)
    out = dict(points=len(pts), slope_ns_per_token=None, intercept_us=None, r2=None, exponent=None,
               exponent_from_N=None)
    if len(pts) < 2:
        return out
    xs, ys = [float(x) for x, _ in pts], [float(y) for _, y in pts]
    slope, icpt = statistics.linear_regression(xs, ys)
    sst = sum((y - statistics.fmean(ys)) ** 2 for y in ys)
    sse = sum((y - icpt - slope * x) ** 2 for x, y in zip(xs, ys))
    big = [(x, y) for x, y in zip(xs, ys) if x >= 65536]
    if len(big) < 2:
        big = list(zip(xs, ys))[len(xs) // 2 - (len(xs) == 2):]
    expo = statistics.linear_regression([math.log(x) for x, _ in big], [math.log(max(y, 1e-9)) for _, y in big]).slope
    out.update(slope_ns_per_token=round(slope * 1e3, 5), intercept_us=round(icpt, 2),
               r2=round(1 - sse / sst, 5) if sst > 0 else 1.0, exponent=round(expo, 3), exponent_from_N=int(big[0][0]))
    return out


def run_torch_compile(ctx: Ctx, rows: list) -> None:
    """Fill ``torch_compile_us`` of the compress rows (last: each (policy, N) is a full inductor compile)."""
    if not ctx.cuda:
        return
    import torch._dynamo
    timed = [r for r in rows if r.get("kind") == "compress" and "tritonkv_us" in r]
    for N in sorted({r["N"] for r in timed}):
        keys, values, pool = ctx.case(N)
        for r in (r for r in timed if r["N"] == N):
            if ctx.over_budget(f"torch.compile {r['policy']} N={N}"):
                continue
            pipe = baselines.pipeline(r["policy"], keys, values, tritonkv.resolve_budget(r["keep"], N), pool)
            try:
                torch._dynamo.reset()  # one code object serves every (policy, N): avoid its recompile limit
                compiled = torch.compile(pipe)
                compiled()
                r["torch_compile_us"] = gpu_time(compiled, ctx.cuda)["us"]
                print(json.dumps({"torch_compile": r["policy"], "N": N, "us": r["torch_compile_us"]}), flush=True)
            except Exception as e:
                print(f"torch.compile {r['policy']} N={N}: {type(e).__name__}: {e}", file=sys.stderr)
        del keys, values, pool
        ctx.free()


def run(args):
    ctx = Ctx(args)
    parts = [p for p in PARTS if getattr(args, p)] or list(PARTS)
    res = dict(run_info(ctx.cuda), method=METHOD, parts=parts,
               settings=dict(B=ctx.B, H_kv=ctx.H, H_q=ctx.H * ctx.G, D=ctx.D, W=ctx.W, dtype="bfloat16", keep=KEEP,
                             allocation_policy=ALLOC_POLICY, layer=LAYER, num_layers=NUM_LAYERS,
                             time_budget_s=args.time_budget),
               copy_GBps=round(ctx.copy_GBps, 1), copy_bytes=ctx.copy_bytes, matmul_TFLOPS=round(ctx.mm_TFLOPS, 1),
               phase_s={}, scaling_fit={}, skipped=ctx.skipped, complete=False, rows=[],
               load_average=[round(x, 2) for x in os.getloadavg()])  # eager times are host-bound: a busy host shows
    rows = res["rows"]
    steps = [(p, {"compress": run_compress, "allocation": run_allocation, "decode": run_decode,
                  "scaling": run_scaling}[p]) for p in parts]
    if "compress" in parts:
        steps.append(("torch_compile", run_torch_compile))
    for name, step in steps:
        t = time.perf_counter()
        out = step(ctx, rows)
        if name == "scaling":
            res["scaling_fit"] = out
        res["phase_s"][name] = round(time.perf_counter() - t, 1)
        res["wall_s"] = round(time.perf_counter() - ctx.t0, 1)
        res["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        print(f"== {name}: {res['phase_s'][name]} s (total {res['wall_s']} s)", flush=True)
        _dense_ratio(rows)
        if args.out and name != "torch_compile":  # a run cut short keeps the parts it finished
            write(res, args.out)
    res["complete"] = True
    return res


def _dense_ratio(rows):
    """``x_dense_eager`` of allocation rows: their eager time over the dense snapkv compress's at that N; ``x_dense``:
    their time over the dense compress's, both as timed (graph against graph where both were captured)."""
    dense = {r["N"]: r for r in rows
             if r.get("kind") == "compress" and r["policy"] == ALLOC_POLICY and "tritonkv_eager_us" in r}
    for r in rows:
        if r.get("kind") == "allocation" and "tritonkv_us" in r and r["N"] in dense:
            d = dense[r["N"]]
            r["x_dense_eager"] = round(r["tritonkv_eager_us"] / d["tritonkv_eager_us"], 2)
            r["x_dense"] = round(r["tritonkv_us"] / d["tritonkv_us"], 2) if r["timing"] == d["timing"] else None


# ---------------------------------------------------------------------------------------------
# output


def markdown(result) -> str:
    """The Markdown tables (one per kind, bold titles so the README's headings stay as they are)."""
    s = result.get("settings", {})
    rows = result["rows"]
    of = lambda kind: [r for r in rows if r.get("kind") == kind and "error" not in r]  # noqa: E731
    out = [f"Device: {result['device']}; torch {result['torch']}, triton {result['triton']}; commit "
           f"{result['commit']}; {result['date']}; copy {result['copy_GBps']} GB/s (one "
           f"{result.get('copy_bytes', 1 << 30) >> 20} MiB clone)"
           + (f"; bf16 matmul {result['matmul_TFLOPS']} TFLOP/s" if result.get("matmul_TFLOPS") else "")
           + f"; run {result.get('wall_s')} s", ""]
    new = result.get("method", 1) >= 2
    if not new:
        out += [OLD_METHOD, ""]
    shape = (f"B={s.get('B')}, H_kv={s.get('H_kv')}, H_q={s.get('H_q')}, D={s.get('D')}, {s.get('dtype')}, "
             f"keep {s.get('keep')}")
    kinds = [("compress", f"**Compress** (one layer's `tritonkv.compress`, {shape}; µs, median; floor = bytes that "
                           "must move over the copy bandwidth; x_compute_floor, CriticalKV only: time over its exact "
                           "stage's flops at the bf16 matmul rate"
                           + ("; no_lse_us: the call without `attn_lse` (as inside `generate`), the side of the "
                              "kvpress ratios for a policy that takes one, since kvpress computes its softmax "
                              "normaliser itself; eager times include the host's)" if new else ")"),
              ["policy", "N", "tritonkv_us", "timing", "floor_us", "x_floor", "x_compute_floor", "pct_copy_bw"]
              + ["no_lse_us"] * new + ["kvpress_us",
               "x_kvpress_eager", "kvpress_graph_us", "x_kvpress_graph", "torch_compile_us", "same_kept", "ok"]),
             ("allocation", f"**Allocation** (`compress(..., \"{s.get('allocation_policy')}\", allocation=...)` as "
                            f"layer {s.get('layer')} of {s.get('num_layers')}, RaggedKV output; the score "
                            "allocator's floor also reads its head_means; x_dense = time over the dense compress "
                            "timed alike, x_dense_eager = the same for the eager calls)",
              ["allocation", "N", "kept_tokens", "k_max", "tritonkv_us", "timing", "tritonkv_eager_us", "floor_us",
               "x_floor", "pct_copy_bw", "x_dense", "x_dense_eager", "ok"]),
             ("decode_attention", "**Decode attention** (one query per head over a RaggedKV with AdaKV-like budgets; "
                                  "µs, CUDA graph; see `benchmarks/decode_attention.py`)", da.COLUMNS)]
    for kind, title, cols in kinds:
        if of(kind):
            out += [title, ""] + table(of(kind), cols) + [""]
    sc = of("scaling")
    if sc:
        names = list(dict.fromkeys(r["policy"] for r in sc))
        floor = lambda r: "floor " + ("K+V" if r["policy"] in KV_POLICIES else "K")  # noqa: E731
        by_n = {}  # per N: each policy's "time (ns per token)", the floors of K-only and K+V scoring
        for r in sc:
            by_n.setdefault(r["N"], {"N": r["N"]})[r["policy"]] = f"{r['tritonkv_us']} ({r['ns_per_token']})"
            by_n[r["N"]][floor(r)] = r["floor_us"]
        fl = list(dict.fromkeys(map(floor, sc)))
        prow = [by_n[N] for N in sorted(by_n)]
        out += [f"**Scaling in N** ({shape}; µs (ns per token); floor µs reads K or K+V"
                + (" (LagKV), then copies the kept K+V (LagKV: writes them)" if new else ", then copies the kept K+V)"),
                ""]
        out += table(prow, ["N"] + names + fl,
                     ["N"] + [f"{n} µs (ns/token)" for n in names] + [f + " µs" for f in fl])
        out += ["", "Least-squares fit time = intercept + slope·N; exponent = log-log slope over the larger N "
                "(1 = linear)", ""]
        frows = [dict(policy=n, **result.get("scaling_fit", {}).get(n, {})) for n in names]
        out += table(frows, ["policy", "slope_ns_per_token", "intercept_us", "r2", "exponent", "exponent_from_N",
                             "points"]) + [""]
    errs = [r for r in rows if "error" in r]
    if errs or result.get("skipped"):
        out += ["Not measured: " + "; ".join([f"{r['kind']} {r.get('policy') or ''} {r.get('allocation') or ''} "
                                              f"N={r.get('N')}: {r['error']}" for r in errs] + list(result["skipped"]))]
    return "\n".join(out).rstrip() + "\n"


def base_name(result) -> str:
    tag = device_tag(result)
    parts = result.get("parts") or list(PARTS)
    return f"{tag}-speed" if set(parts) == set(PARTS) else f"{tag}-speed-only-{'-'.join(parts)}"


def write(result, out_dir):
    """JSON, Markdown and the two plots against N (log2): compress time over the floor, and the scaling part's
    time with its floors (log); returns the path stem."""
    base = write_results(os.path.join(out_dir, base_name(result)), result, markdown(result))
    plt = pyplot()
    rows = [r for r in result["rows"] if "error" not in r]
    figures = [("compress", "x_floor", ".png", (7, 4), "time / HBM floor", "compress"),
               ("scaling", "tritonkv_us", "-scaling.png", (7, 4.5), "µs (median)", "compress time vs N")]
    for kind, y, suffix, size, ylabel, title in figures:
        of_kind = [r for r in rows if r.get("kind") == kind]
        if plt is None or not of_kind:
            continue
        scaling = kind == "scaling"  # its policies in the order measured, its time on a log axis, and its floors
        fig, ax = plt.subplots(figsize=size)
        names = dict.fromkeys(r["policy"] for r in of_kind) if scaling else sorted({r["policy"] for r in of_kind})
        for name in names:
            mine = sorted((r for r in of_kind if r["policy"] == name), key=lambda r: r["N"])
            ax.plot([r["N"] for r in mine], [r[y] for r in mine], marker="o", label=name)
        for kv, style in ((False, "--"), (True, ":")) if scaling else ():
            fr = {r["N"]: r["floor_us"] for r in of_kind if (r["policy"] in KV_POLICIES) == kv}
            if fr:
                ax.plot(sorted(fr), [fr[n] for n in sorted(fr)], style, color="grey",
                        label="copy floor (read K+V, write the kept)" if kv else "copy floor (read K)")
        ax.set_xscale("log", base=2)
        if scaling:
            ax.set_yscale("log")
        ax.set_xlabel("N (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}, {result['device']}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(base + suffix, dpi=120)
        plt.close(fig)
    return base


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for part in PARTS:
        p.add_argument(f"--{part}", action="store_true", help=f"run the {part} part (no part flag: all of them)")
    p.add_argument("--policies", nargs="*", help="compress policies (default: all registered)")
    p.add_argument("--time-budget", type=float, default=500.0,
                   help="seconds after which no new case starts (the rest are listed as skipped)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, to check the program")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results; --smoke: write nothing)")
    return p


def main(argv=None):
    a = parser().parse_args(argv)
    a.out = a.out or (None if a.smoke else RESULTS)
    with torch.no_grad():  # inference, as in a model's forward (the window queries come from q_proj's weights)
        res = run(a)
    if a.out:
        print("wrote", write(res, a.out))
    else:
        print(markdown(res))
    return res


if __name__ == "__main__":
    main()
