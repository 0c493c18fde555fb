"""What the benchmarks share: run metadata, GPU and CPU timing, result files, one Markdown table writer.

Every benchmark runs from the repository root as a module (``python -m benchmarks.speed``) and imports this one as
``benchmarks.common``.
"""
from __future__ import annotations

import datetime
import glob
import gzip
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
MIN_REPS = 20  # a GPU median is taken over at least this many timed calls


# ---------------------------------------------------------------------------------------------
# run metadata


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def git(*args) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def versions(*names) -> dict:
    """``{distribution: installed version or None}`` of each of ``names``."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            out[n] = None
    return out


def command(argv=None, module=None) -> str:
    """How this process was started, as ``python -m benchmarks.<name> ARGS`` (``argv``: the arguments, default
    ``sys.argv[1:]``, each quoted for a shell where it needs it; ``module``: the program, default the one running)."""
    module = module or os.path.splitext(os.path.relpath(os.path.abspath(sys.argv[0]), ROOT))[0].replace(os.sep, ".")
    return " ".join(["python -m", module, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])


def run_info(cuda: bool = False, argv=None) -> dict:
    """Where and what ran: the device, the CPU, library versions, the commit (and the files of ``tritonkv/`` it
    did not include), the date and the command (``argv``: the arguments, default ``sys.argv[1:]``)."""
    import torch

    modified = [f for f in git("status", "--porcelain", "--untracked-files=no", "--", "tritonkv").split()
                if f.startswith("tritonkv/")]
    return dict(device=torch.cuda.get_device_name() if cuda else "cpu", cpu=cpu_model(), cores=os.cpu_count(),
                torch_threads=torch.get_num_threads(), python=platform.python_version(), torch=torch.__version__,
                **versions("triton", "transformers"),
                commit=git("rev-parse", "--short=10", "HEAD"), tritonkv_dirty=bool(modified),
                tritonkv_modified=modified, triton_interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
                date=now(), command=command(argv))


def describe(info: dict) -> str:
    """One line of Markdown: device, versions, commit, date."""
    dev = info["device"] if info["device"] != "cpu" else f"{info['cpu']} ({info['cores']} cores)"
    return (f"{dev}; torch {info['torch']}, triton {info['triton']}"
            f"{' (TRITON_INTERPRET=1)' if info.get('triton_interpret') else ''}; commit `{info['commit'] or '?'}`"
            f"{' plus changes to ' + ', '.join(info['tritonkv_modified']) if info.get('tritonkv_modified') else ''}"
            f"; {info['date']}")


def device_tag(info: dict) -> str:
    """The device of ``info`` as a file-name prefix: ``NVIDIA H200`` gives ``nvidia-h200``, ``cpu`` ``cpu``."""
    return info["device"].split(" (")[0].replace(" ", "-").lower()


# the random Llama of memory.py and cache_release.py (fp32, no download)
LLAMA_256 = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=32768 + 64)


def random_llama(max_positions: int = 4096, pad_token_id=None, seed: int = 0, **config):
    """The seeded random Llama of the CPU programs (2 layers, hidden 64, 4 query / 2 KV heads, vocab 1000; fp32,
    no download; ``config`` overrides any of it, e.g. ``**LLAMA_256``). ``pad_token_id`` also zeroes that token's
    embedding."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, pad_token_id=pad_token_id, max_position_embeddings=max_positions)
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **config})).eval()


def random_case(N, B, H, G, D, W, dtype=None, device="cpu", d_model=None, seed: int = 0):
    """Seeded random K/V ``[B, H, N, D]`` and what policies take: window queries ``[B, H·G, W, D]``, W_O
    ``[d_model, H·G·D]`` (default square) and SCORE's head distinctness ``hd [H]``; drawn in fp32 on ``device``,
    cast to ``dtype`` (default fp32). Returns ``(keys, values, {"queries", "o_proj", "hd"})``."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.float32)  # noqa: E731
    keys, values, queries = rnd(B, H, N, D), rnd(B, H, N, D), rnd(B, H * G, W, D)
    o_proj = rnd(d_model or H * G * D, H * G * D) / math.sqrt(H * G * D)
    hd = torch.rand(H, generator=g, device=device) + 0.1
    keys, values, queries, o_proj = (t.to(dtype or torch.float32) for t in (keys, values, queries, o_proj))
    return keys, values, {"queries": queries, "o_proj": o_proj, "hd": hd}


def policy_inputs(pol, pool: dict, attn_lse: bool = True) -> dict:
    """What a model hands ``pol``: its needs found in ``pool``, plus ``attn_lse`` where its scoring takes one (the
    prefill attention's log-sum-exp, which saves window policies a pass over K) and ``attn_lse`` is True (False:
    as inside ``generate``, which has none to give)."""
    import inspect

    inputs = {n: pool[n] for n in pol.needs if n in pool}
    if attn_lse and "attn_lse" in inspect.signature(getattr(pol, "base", pol).score).parameters:
        inputs["attn_lse"] = pool["attn_lse"]
    return inputs


def rss_kb() -> int:
    """The resident set size of this process, KiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def malloc_trim() -> bool:
    """Give the C heap's free memory back to the system (glibc ``malloc_trim(0)``); False where there is none."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


# ---------------------------------------------------------------------------------------------
# timing


def cuda_graph(fn):
    """``fn`` captured in a CUDA graph (after two warm-up calls on a side stream); returns its ``replay``."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def gpu_time(fn, cuda: bool, graph: bool = False, host: bool = False) -> dict:
    """``{us, p20_us, p80_us, reps}`` of ``fn()`` (already called once): ``triton.testing.do_bench``'s per-call CUDA
    event times (L2 flushed before each) over ~100 ms and at least ``MIN_REPS`` calls, replayed from a CUDA graph
    with ``graph``. ``do_bench`` does not wait for the flush before calling ``fn``, so the host's work on a call
    overlaps the flush and goes unseen: a device time. ``host``: an eager call's time as a caller meets it, the
    host's work included (``host_timed``). Without ``cuda`` (a smoke run checks the program, not the speed): one
    timed call."""
    if not cuda:
        t = time.perf_counter()
        fn()
        us = round((time.perf_counter() - t) * 1e6, 2)
        return dict(us=us, p20_us=us, p80_us=us, reps=1)
    import triton.testing

    f = cuda_graph(fn) if graph else fn
    bench = host_timed if host and not graph else triton.testing.do_bench
    ts = list(bench(f, warmup=25, rep=100, return_mode="all"))
    if len(ts) < MIN_REPS:  # slow calls: repeat long enough for a median
        ts = list(bench(f, warmup=25, rep=int(1.2 * MIN_REPS * statistics.median(ts)) + 1, return_mode="all"))
    q = statistics.quantiles(ts, n=5) if len(ts) > 1 else [ts[0]] * 4
    return dict(us=round(statistics.median(ts) * 1e3, 2), p20_us=round(q[0] * 1e3, 2), p80_us=round(q[3] * 1e3, 2),
                reps=len(ts))


def host_timed(fn, warmup: float = 25, rep: float = 100, return_mode: str = "all") -> list:
    """Milliseconds of each eager ``fn()`` from an idle device, as ``do_bench``'s ``return_mode="all"`` lists them:
    L2 flushed, the device waited for, then CUDA events around the call, so that the host's work before and
    between the call's launches counts (the device has nothing queued to hide it behind). ``warmup`` and ``rep``:
    milliseconds of wall time spent calling (flushes and waits included), as in ``do_bench``."""
    import torch

    assert return_mode == "all"
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def once():
        flush.zero_()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    for _ in range(5):
        once()
    per = max((time.perf_counter() - t) * 1e3 / 5, 1e-3)  # ms of wall time per call, the flush and wait included
    for _ in range(max(1, int(warmup / per))):
        once()
    return [once() for _ in range(max(1, int(rep / per)))]


def copy_bandwidth(cuda: bool, nbytes: int) -> float:
    """GB/s of one ``clone()`` of ``nbytes`` on the device (bytes read + written): the floors' bandwidth."""
    import torch

    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda" if cuda else "cpu").normal_()
    x.clone()
    return 2 * x.numel() * x.element_size() / gpu_time(lambda: x.clone(), cuda)["us"] / 1e3


def matmul_tflops(cuda: bool, n: int) -> float:
    """TFLOP/s of one bf16 ``[n, n] @ [n, n]`` on the device (2n³ flops): the compute floors' rate."""
    import torch

    dev = "cuda" if cuda else "cpu"
    a, b = (torch.randn(n, n, device=dev).to(torch.bfloat16) for _ in range(2))
    a @ b
    return 2 * n ** 3 / gpu_time(lambda: a @ b, cuda)["us"] / 1e6


def cpu_times(fns, runs: int) -> list:
    """Wall-clock seconds of ``runs`` alternating calls of each of ``fns`` (already warmed up), so that every
    function sees the same machine load: one list of times per function."""
    out = [[] for _ in fns]
    for _ in range(runs):
        for f, t in zip(fns, out):
            t0 = time.perf_counter()
            f()
            t.append(time.perf_counter() - t0)
    return out


# ---------------------------------------------------------------------------------------------
# result files


def write_json(path: str, data) -> str:
    """``data`` as indented JSON at ``path`` (the folder made if needed; what JSON cannot hold as its ``str``)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    return path


def write_results(base: str, data: dict, markdown: str) -> str:
    """The JSON and Markdown files ``<base>.json`` and ``<base>.md`` (the folder made if needed); returns ``base``."""
    write_json(base + ".json", data)
    with open(base + ".md", "w") as f:
        f.write(markdown)
    return base


def read_jsonl(path: str) -> list:
    """The records of a JSON-lines file, plain or gzip-compressed (``.jsonl.gz``, read transparently). A blank
    line, or one cut short by a kill while it was written, is left out, as is a compressed tail cut short."""
    out = []
    try:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except (EOFError, gzip.BadGzipFile, zlib.error):
        pass
    return out


def jsonl_files(folder: str, skip=("runs.jsonl",)) -> list:
    """The JSON-lines files of ``folder`` (``*.jsonl.gz`` and ``*.jsonl``), sorted, but those named in ``skip``."""
    return sorted(f for pat in ("*.jsonl.gz", "*.jsonl") for f in glob.glob(os.path.join(folder, pat))
                  if os.path.basename(f) not in skip)


def append_jsonl(path: str, records) -> None:
    """Append ``records`` to a JSON-lines file; a ``.gz`` path gets them as one more gzip member."""
    text = "".join(json.dumps(r) + "\n" for r in records)
    with (gzip.open(path, "at") if path.endswith(".gz") else open(path, "a")) as f:
        f.write(text)


def table(rows, cols, head=None, right: bool = False, align: str = "") -> list:
    """Markdown table lines. ``rows``: dicts read at ``cols`` (None and absent keys show as "–"), or lists of cells;
    ``head``: the column titles (default ``cols``); ``right``: every column but the first right-aligned; ``align``:
    instead, one letter per column, ``l`` left- or ``r`` right-aligned."""
    head = head or cols
    cells = [[("–" if r.get(c) is None else r[c]) for c in cols] if isinstance(r, dict) else r for r in rows]
    rule = ("|" + "".join("---:|" if a == "r" else "---|" for a in align) if align
            else "|---|" + ("---:|" if right else "---|") * (len(head) - 1))
    return ["| " + " | ".join(map(str, head)) + " |", rule] + ["| " + " | ".join(map(str, r)) + " |" for r in cells]


# --- bmem ---
# fresh processes (memory.py, tp_memory.py)


def _in_process(target, spec, conn):
    """The body of one of ``in_processes``' children: ``target(spec)`` sent back, or ``spec`` with the traceback as
    its ``error``."""
    import traceback

    try:
        conn.send(target(spec))
    except BaseException:  # noqa: BLE001  (reported in the row)
        conn.send(dict(spec, error=traceback.format_exc()[-3000:]))
    finally:
        conn.close()


def in_processes(ctx, target, specs, timeout: float) -> list:
    """``target(spec)`` for each of ``specs``, all at once, each in a fresh process of the multiprocessing context
    ``ctx``: the results in order. A process that raises, dies or is still running ``timeout`` seconds after the
    start (then killed) gives ``dict(spec, error=...)``."""
    procs = []
    for spec in specs:
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_in_process, args=(target, spec, send), daemon=True)
        p.start()
        send.close()
        procs.append((spec, p, recv))
    deadline = time.monotonic() + timeout
    out = []
    for spec, p, recv in procs:
        ready = recv.poll(max(deadline - time.monotonic(), 0))
        try:
            row = recv.recv() if ready else dict(spec, error=f"timed out after {timeout:.0f} s")
        except EOFError:  # it died before sending its result
            row = None
        if not ready:
            p.kill()
        p.join()
        out.append(dict(spec, error=f"the process died (exit code {p.exitcode})") if row is None else row)
    return out
