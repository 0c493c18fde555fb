#!/usr/bin/env bash
# A GPU session in a few calls, for a machine that has torch + Triton but no network (docs/benchmarks.md, "A GPU
# session"). Parts, run in the order given; each writes under $OUT and prints a short summary last:
#   wheels   (here, with network) kvpress and gguf as wheels in .cache/wheels, to carry to the GPU machine
#   tests    the whole suite natively on the GPU, but the tests of the downloaded model (-m "not model")
#   speed    python -m benchmarks.speed (~2 min on an H200): every policy against its floor and kvpress
#   prefill  block-wise prefill inside a model at N = 8K and 32K (blocks of 512; PREFILL_N overrides) against the
#            stock model's one-shot and chunked (DynamicCache, the same blocks) prefill: KeyDiff (one block per forward,
#            and forwards of up to 8192 tokens), SnapKV+AdaKV, KNorm, each in an equal share of the part's time
#            (SmolLM2-135M's shape, or Llama-3-8B's with
#            PREFILL_SHAPE=llama8b; random weights, bf16, SDPA)
#   lagkv    Nsight Compute's warp-stall and scheduler sections of LagKV's kernel at N = 32K
#   kernels  each policy's device time per kernel at N = 32K (torch.profiler), where a compress spends its time (and
#            SnapKV's without attn_lse, as inside generate)
#   tuning   at 4K/32K/128K (8 rows, and one row of 64K and 256K; keep 25 %, CUDA graphs): the shared select for
#            each chunk size, LagKV for each tiling of kernels.lagkv.TILINGS at half, once and twice its automatic
#            partitions per program (defaults: the H100 run of 2026-11-26), the default tiling also with its
#            partitions software-pipelined (kernels.lagkv.STAGES = 2); Knorm, KeyDiff and StreamingLLM compress
#            at 4K/32K/128K for each pair of software-pipelined stages (key streams, compaction); SnapKV, TOVA, H2O
#            (and SnapKV without attn_lse) for each count of key tiles in flight in the window score kernel;
#            programmatic dependent launch on and off (kernels._common.PDL) for compress and decode attention
#   host     python -m benchmarks.host_time --gpu: speed.py's calls at 4K eager, host and device-done µs per call,
#            the share repeated from a plan and why a call was not recorded (~1 min, mostly compiling)
#   pack     everything under $OUT into $OUT/session.tgz (the device tool returns at most 8 files)
# Usage: OUT=<dir> benchmarks/gpu_session.sh tests speed     (PY=<python> to choose the interpreter; TIMEOUT=<s>
# bounds each part, 420 by default)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
T=${TIMEOUT:-420}
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d .cache/wheels ] && ! $PY -c "import kvpress" 2>/dev/null; then
    $PY -m pip install -q --no-deps .cache/wheels/*.whl
fi
for part in "$@"; do
    echo "== $part ($(date -u +%T))"
    case $part in
    wheels)
        $PY -m pip download -q --no-deps -d .cache/wheels "kvpress==0.5.5" "gguf==0.19.0" && ls .cache/wheels ;;
    tests)
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/device.csv"
        $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
            | tee "$OUT/versions.txt"
        timeout "$T" $PY -m pytest -v -p no:cacheprovider -p no:benchmark -n 16 -m "not model" --tb=short -rfs \
            --durations=15 tests > "$OUT/tests.txt" 2>&1  # -v: a run cut short still names its failures
        grep -E "^\[gw[0-9]+\].* FAILED" "$OUT/tests.txt" | sed 's/.* FAILED //' | sort -u | head -60
        tail -1 "$OUT/tests.txt" ;;
    speed)
        timeout "$T" $PY -m benchmarks.speed --time-budget $((T - 60)) --out "$OUT/speed" > "$OUT/speed.log" 2>&1
        tail -5 "$OUT/speed.log" ;;
    prefill)
        PREFILL_BUDGET=$((T - 20)) timeout "$T" $PY - > "$OUT/prefill.txt" 2>&1 <<'EOF'
import os, signal, time, torch
from transformers import DynamicCache
from benchmarks.common import random_llama
from tritonkv.integrations import transformers as tt
# block-wise prefill (blocks of 512) inside a model: the stock model's one-shot prefill, the stock chunked prefill
# (DynamicCache fed the same blocks) and tritonkv's block-wise caches, at each N of PREFILL_N; each variant gets an
# equal share of what is left of PREFILL_BUDGET seconds (warm-up and compilation included; SIGALRM ends it)
start = time.perf_counter()
NS = [int(n) for n in os.environ.get("PREFILL_N", "8192 32768").split()]
BLOCK, BUDGET = 512, float(os.environ.get("PREFILL_BUDGET", "400"))
dev = "cuda" if torch.cuda.is_available() else "cpu"
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
# PREFILL_SHAPE: smollm (SmolLM2-135M's shape: 30 layers, 9 query / 3 KV heads of 64) or llama8b (Llama-3-8B's:
# 32 layers, 32 query / 8 KV heads of 128, hidden 4096; 16 GB of weights, made on the device), random weights, bf16
# (fp32 on the CPU), SDPA
SHAPES = {"smollm": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64),
          "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128)}
shape = dict(SHAPES[os.environ.get("PREFILL_SHAPE", "smollm")])
shape["num_hidden_layers"] = LAYERS = int(os.environ.get("PREFILL_LAYERS", shape["num_hidden_layers"]))
dtype = torch.bfloat16 if dev == "cuda" else torch.float32
torch.set_default_dtype(dtype)
with torch.device(dev):
    model = random_llama(max_positions=max(NS) + 64, attn_implementation="sdpa", **shape)
torch.set_default_dtype(torch.float32)
print(f"model {os.environ.get('PREFILL_SHAPE', 'smollm')}: {shape}, {dtype}, {dev}", flush=True)
ids = torch.randint(0, shape["vocab_size"], (1, max(NS)), generator=torch.Generator().manual_seed(0)).to(dev)
kw = tt.cache_kwarg(model)


def one_shot(x):
    model(x, use_cache=True, logits_to_keep=1)


def chunked(x):
    cache = DynamicCache()
    for a in range(0, x.shape[1], BLOCK):
        b = min(x.shape[1], a + BLOCK)
        model(input_ids=x[:, a:b], position_ids=torch.arange(a, b, device=dev)[None], use_cache=True,
              logits_to_keep=1, **{kw: cache})


def blockwise(policy, allocation, forward_tokens=BLOCK):
    def run(x):
        cache = tt.make_cache(model, policy, 0.1, mode="blockwise", allocation=allocation, block_size=BLOCK,
                              prompt_length=x.shape[1])
        tt.prefill(model, x, cache, forward_tokens=forward_tokens)
    return run


class OverBudget(Exception):
    pass


def alarm(*_):
    raise OverBudget


signal.signal(signal.SIGALRM, alarm)
# "keydiff/8192": the same blocks in forwards of up to 8192 tokens (``prefill``'s ``forward_tokens``): the model's
# own per-forward host cost paid 16x less often
VARIANTS = {"one-shot": one_shot, "chunked": chunked, "keydiff": blockwise("keydiff", None),
            "keydiff/8192": blockwise("keydiff", None, 8192), "snapkv+adakv": blockwise("snapkv", "adakv"),
            "knorm": blockwise("knorm", None)}
best = {}  # (variant, N): (best seconds, runs)
with torch.no_grad():
    for i, (name, fn) in enumerate(VARIANTS.items()):
        share = (BUDGET - (time.perf_counter() - start)) / (len(VARIANTS) - i)
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, max(share, 1.0))
        try:
            fn(ids[:, :min(2048, max(NS))])  # warm-up: compilation, first launches, plans
            sync()
            for N in NS:
                for _ in range(3):
                    t = time.perf_counter()
                    fn(ids[:, :N])
                    sync()
                    t = time.perf_counter() - t
                    b, runs = best.get((name, N), (float("inf"), 0))
                    best[name, N] = (min(b, t), runs + 1)
                    if time.perf_counter() - t0 + t * (len(NS) - NS.index(N)) > share:
                        break  # leave this variant's share to its larger N
        except OverBudget:
            print(f"{name}: over its {share:.0f} s share", flush=True)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        print(f"{name}: {time.perf_counter() - t0:.0f} s, " + ", ".join(
            f"N={N} {best[name, N][0] * 1e3:.1f} ms (best of {best[name, N][1]})" for N in NS if (name, N) in best),
            flush=True)
device = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
print(f"\n== {device}, {model.dtype}, {LAYERS} layers, blocks of {BLOCK}, budget 0.1; block-wise / stock chunked, "
      f"/ one-shot")
for N in NS:
    forwards = -(-N // BLOCK)
    one, ch = best.get(("one-shot", N), (None,))[0], best.get(("chunked", N), (None,))[0]
    if one is None or ch is None:
        print(f"N={N}: no stock timing")
        continue
    print(f"N={N}: stock one-shot {one * 1e3:.1f} ms; stock chunked {ch * 1e3:.1f} ms ({ch / forwards * 1e3:.1f} ms "
          f"a forward of {BLOCK}, x{ch / one:.2f} one-shot)")
    for var in list(VARIANTS)[2:]:
        if (var, N) not in best:
            print(f"  {var}: not measured (its share ran out)")
            continue
        t = best[var, N][0]
        print(f"  {var}: {t * 1e3:.1f} ms, x{t / ch:.2f} chunked, x{t / one:.2f} one-shot, "
              f"{(t - ch) / (forwards * LAYERS) * 1e6:+.0f} us a layer-block over chunked")
if dev == "cuda" and BUDGET - (time.perf_counter() - start) > 20:  # host syncs of one block-wise prefill, by line
    import collections, warnings
    for var in list(VARIANTS)[2:]:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                VARIANTS[var](ids[:, :min(NS)])
            finally:
                torch.cuda.set_sync_debug_mode("default")
        where = collections.Counter(f"{w.filename.split('/')[-1]}:{w.lineno}" for w in caught
                                    if "synchroniz" in str(w.message))
        print(f"host syncs, {var} at N={min(NS)}: {sum(where.values())} {dict(where.most_common(6))}")
EOF
        cat "$OUT/prefill.txt" ;;
    lagkv)
        timeout "$T" ncu --section WarpStateStats --section SchedulerStats --section Occupancy -k regex:_lagkv -c 3 \
            $PY - > "$OUT/lagkv-ncu.txt" 2>&1 <<'EOF'
import torch, tritonkv
g = torch.Generator("cuda").manual_seed(0)
k, v = (torch.randn(1, 8, 32768, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
for _ in range(3):
    tritonkv.compress((k, v), "lagkv", 0.25)
torch.cuda.synchronize()
EOF
        grep -E "Stall|Warp Cycles|Issued|Eligible|Occupancy" "$OUT/lagkv-ncu.txt" | head -30 ;;
    kernels)
        timeout "$T" $PY - > "$OUT/kernels.txt" 2>&1 <<'EOF'
import torch, tritonkv
from torch.profiler import ProfilerActivity, profile
from benchmarks.common import policy_inputs, random_case
from benchmarks.speed import window_lse
keys, values, pool = random_case(32768, 1, 8, 4, 128, 32, torch.bfloat16, "cuda", seed=0)
pool["attn_lse"] = window_lse(keys, pool["queries"])
# and SnapKV scored from its window queries alone, as inside generate (the LSE pass over K runs too)
for name in sorted(tritonkv.POLICIES) + ["snapkv[no lse]"]:
    pol = tritonkv.POLICIES[name.split("[")[0]]()
    inputs = policy_inputs(pol, pool, attn_lse="[no lse]" not in name)
    fn = lambda: tritonkv.compress((keys, values), pol, 0.25, **inputs)  # noqa: E731
    try:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
    except Exception as e:
        print(name, "failed:", type(e).__name__, e)
        continue
    rows = [(e.self_device_time_total / 10, e.count // 10, e.key) for e in prof.key_averages()
            if e.self_device_time_total]
    print(f"{name}: {sum(r[0] for r in rows):.1f} us per compress on the device")
    for us, n, key in sorted(rows, reverse=True):
        print(f"  {us:8.1f} us  x{n}  {key[:110]}")
EOF
        head -80 "$OUT/kernels.txt" ;;
    tuning)
        timeout "$T" $PY - > "$OUT/tuning.txt" 2>&1 <<'EOF'
import torch
from benchmarks.common import gpu_time
from tritonkv.kernels.select import _blocks, select_kv
cuda = torch.cuda.is_available()
dev = "cuda" if cuda else "cpu"
g = torch.Generator(dev).manual_seed(0)
# programmatic dependent launch (kernels._common.PDL; sm_90+): each kernel of a compress launched while the one
# before runs, on and off, for the chains of 2-5 kernels (and decode attention's split + merge: 2); first, so that
# a part cut short by its TIMEOUT still has it
import tritonkv
from benchmarks.common import policy_inputs, random_case
from benchmarks.speed import window_lse
from tritonkv.kernels import _common, _plan
from tritonkv.kernels.decode_attention import decode_attention
if cuda and torch.cuda.get_device_capability()[0] >= 9:
    for N in (4096, 32768, 131072):
        keys, values, pool = random_case(N, 1, 8, 4, 128, 32, torch.bfloat16, dev, seed=0)
        pool["attn_lse"] = window_lse(keys, pool["queries"])
        q = pool["queries"][:, :, -1:]
        for name in ("knorm", "keydiff", "streaming_llm", "snapkv", "tova", "score", "snapkv+adakv", "decode"):
            if name == "decode":
                kv = tritonkv.compress((keys, values), "knorm", N // 4)[:2]
                fn = lambda: decode_attention(q, kv)  # noqa: E731
            else:
                pol = tritonkv.POLICIES[name.split("+")[0]]()
                inputs = policy_inputs(pol, pool)
                if "+" in name:
                    inputs.update(allocation=name.split("+")[1], layer=15, num_layers=30)
                fn = lambda: tritonkv.compress((keys, values), pol, N // 4, **inputs)  # noqa: E731
            row, ref = [f"pdl {name} N={N} (default {_common.PDL}):"], None
            for on in (False, True):
                _common.PDL = on
                _plan._PLANS.clear()
                out = fn()
                ref = out if ref is None else ref
                if isinstance(out, tuple):  # the same kept tokens and K/V rows (decode: outputs) either way
                    assert all(map(torch.equal, out, ref)), name
                eager = gpu_time(fn, cuda, graph=False)["us"]
                row.append(f"{'on' if on else 'off'}: {gpu_time(fn, cuda, graph=True)['us']:.1f} us graph, "
                           f"{eager:.1f} us eager")
            print(" ".join(row), flush=True)
    _common.PDL = True
    _plan._PLANS.clear()
# 8 rows, and one row (AdaKV's select over a layer's heads flattened: 8 x 32K = 256K tokens; at most 64 chunks a row)
for H, N in ((8, 4096), (8, 32768), (8, 131072), (1, 65536), (1, 262144)) if cuda else ((8, 512), (1, 1024)):
    keys, values = (torch.randn(1, H, N, 128, device=dev, generator=g).to(torch.bfloat16) for _ in range(2))
    scores = torch.randn(1, H, N, device=dev, generator=g)
    k = N // 4
    ref = select_kv(scores, k, keys, values, k)[2]
    row = [f"rows={H} N={N} default chunk {_blocks(N, H, None)[0]}:"]
    for chunk in (256, 512, 1024, 2048, 4096, 8192, 16384):
        if chunk > N:
            continue
        fn = lambda: select_kv(scores, k, keys, values, k, chunk=chunk)  # noqa: E731
        assert torch.equal(fn()[2], ref), chunk  # the same kept tokens whatever the chunk
        row.append(f"{chunk}: {gpu_time(fn, cuda, graph=cuda)['us']:.1f} us")
    print(" ".join(row), flush=True)
from tritonkv.kernels import lagkv as kl
from tritonkv.policies import LagKV
pol = LagKV()
# each tiling (tokens per chunk, warps; 0, 0 = the default) at its automatic partitions per program, half and twice
for N in (4096, 32768, 131072) if cuda else (1024,):
    keys, values = (torch.randn(1, 8, N, 128, device=dev, generator=g).to(torch.bfloat16) for _ in range(2))
    k = N // 4
    sink, window = pol.protected(N, k)
    p = kl.num_partitions(N, pol.sink, pol.lag)
    quota, rem = divmod(k - sink - window, p - 1)
    ref = kl.lagkv_compress(keys, values, k, sink=sink, lag=pol.lag, quota=quota, rem=rem, window=window)
    # each tiling as it is, and the default tiling software-pipelined over its partitions (kernels.lagkv.STAGES)
    for (tile, warps), stages in [(t, 1) for t in (kl.TILINGS if cuda else kl.TILINGS[:2])] + [((0, 0), 2)]:
        kl.STAGES = stages
        auto = kl._blocks(pol.lag, 128, 2, p - 1, 8, 0, tile, warps)[0]
        row = [f"LagKV N={N} ({p - 1} scored partitions a row) tile={tile} warps={warps} stages={stages}, parts:"]
        try:  # (stages 2 needs ~213 KB of shared memory a program: an H100/H200, not an A100)
            for parts in sorted({max(1, auto // 2), auto, min(32, 2 * auto)}):
                fn = lambda: kl.lagkv_compress(keys, values, k, sink=sink, lag=pol.lag, quota=quota,  # noqa: E731
                                               rem=rem, window=window, parts=parts, tile=tile, warps=warps)
                assert all(map(torch.equal, fn(), ref)), (tile, warps, parts)  # the same tokens, K/V rows bit for bit
                row.append(f"{parts}{'*' if parts == auto else ''}: {gpu_time(fn, cuda, graph=cuda)['us']:.1f} us")
        except Exception as e:  # an assertion or a launch that does not fit: said, and the part goes on
            row.append(f"failed: {type(e).__name__}: {str(e)[:200]}")
        print(" ".join(row), flush=True)
    kl.STAGES = 1
print("(* the automatic partitions per program)")
import tritonkv
from tritonkv.kernels import _plan, knorm as kn, select as ks
# software-pipelined stages: kernels.knorm.STREAM_STAGES (Knorm's and KeyDiff's anchor key streams) and
# kernels.select.COMPACT_STAGES (the compaction's batches); 1 = not pipelined (the kernels of the 2026-11-26 run)
defaults = kn.STREAM_STAGES, ks.COMPACT_STAGES
for N in (4096, 32768, 131072) if cuda else (1024,):
    keys, values = (torch.randn(1, 8, N, 128, device=dev, generator=g).to(torch.bfloat16) for _ in range(2))
    for policy in ("knorm", "keydiff", "streaming_llm"):
        ref, row = None, [f"stages {policy} N={N} (stream, compact; default {defaults}):"]
        for stages in ((1, 1), (2, 1), (3, 1), (4, 1), (1, 2), (3, 2), (3, 3)):
            kn.STREAM_STAGES, ks.COMPACT_STAGES = stages
            _plan._PLANS.clear()  # plans replay the launches they recorded
            fn = lambda: tritonkv.compress((keys, values), policy, N // 4)  # noqa: E731
            out = fn()
            ref = out if ref is None else ref
            assert all(map(torch.equal, out, ref)), stages  # the same kept tokens and K/V rows whatever the stages
            row.append(f"{stages[0]},{stages[1]}: {gpu_time(fn, cuda, graph=cuda)['us']:.1f} us")
        print(" ".join(row), flush=True)
kn.STREAM_STAGES, ks.COMPACT_STAGES = defaults
_plan._PLANS.clear()
# the window score kernel's key tiles in flight (kernels.window_attention.SCORE_STAGES; 2 = the 2026-11-26 run's),
# with the prefill's LSE given and, for SnapKV, without it (as inside generate: the LSE kernel runs too)
from benchmarks.common import policy_inputs, random_case
from benchmarks.speed import window_lse
from tritonkv.kernels import window_attention as wa
default = wa.SCORE_STAGES
for N in (4096, 32768, 131072) if cuda else (1024,):
    keys, values, pool = random_case(N, 1, 8, 4, 128, 32, torch.bfloat16, dev, seed=0)
    pool["attn_lse"] = window_lse(keys, pool["queries"])
    for name in ("snapkv", "tova", "h2o", "snapkv[no lse]"):
        pol = tritonkv.POLICIES[name.split("[")[0]]()
        inputs = policy_inputs(pol, pool, attn_lse="[no lse]" not in name)
        ref, row = None, [f"window stages {name} N={N} (default {default}):"]
        for stages in (2, 3, 4):
            wa.SCORE_STAGES = stages
            _plan._PLANS.clear()
            fn = lambda: tritonkv.compress((keys, values), pol, N // 4, **inputs)  # noqa: E731
            out = fn()
            ref = out if ref is None else ref
            assert all(map(torch.equal, out, ref)), stages  # the same kept tokens and K/V rows whatever the stages
            row.append(f"{stages}: {gpu_time(fn, cuda, graph=cuda)['us']:.1f} us")
        print(" ".join(row), flush=True)
wa.SCORE_STAGES = default
_plan._PLANS.clear()
EOF
        cat "$OUT/tuning.txt" ;;
    host)
        timeout "$T" $PY -m benchmarks.host_time --gpu --json "$OUT/host_time_gpu.json" > "$OUT/host_time_gpu.txt" 2>&1
        tail -30 "$OUT/host_time_gpu.txt" ;;
    pack)
        tar czf /tmp/session.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/session.tgz "$OUT/" ;;
    *)
        echo "unknown part: $part (wheels, tests, speed, prefill, lagkv, kernels, tuning, host, pack)" >&2; exit 2 ;;
    esac
done
