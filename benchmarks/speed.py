"""Kernel-level speed benchmark: every policy's full compress (score + select + compact) on a GPU.

For each policy at B=1, H_kv=8 (32 query heads), D=128, bf16, keep 25%, N in {4K, 32K, 128K}:

- ``tritonkv_us``: ``tritonkv.compress`` (replayed from a CUDA graph when capture works; the eager
  time is ``tritonkv_eager_us``);
- ``floor_us``: the bytes that must move (read what the score needs — K, or K and V — then read and
  write the kept K+V) divided by the copy bandwidth of ``K.clone()`` measured in the same run;
- ``kvpress_us``: kvpress 0.5.5's matching press on the same tensors (``pip install --no-deps
  kvpress==0.5.5``; null where it has none or it is not installed);
- ``torch_compile_us``: a ``torch.compile``d PyTorch pipeline (score, topk, sort, gather; null where
  none is written);
- ``same_kept``: tritonkv's kept set equals the one from kvpress's scores under the same selection
  rule (null without kvpress). Settings are aligned with kvpress where they differ from the papers.

Writes ``benchmarks/results/<device>-speed.json`` (device, torch, triton, commit, date, copy_GBps,
rows), a Markdown table and a PNG plot. ``--smoke`` runs tiny shapes on the CPU (Triton interpreter)
to check the program itself.

    python benchmarks/speed.py                 # on the GPU machine
    TRITON_INTERPRET=1 python benchmarks/speed.py --smoke --out /tmp/speed
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
import types

import torch

import tritonkv
from tritonkv import POLICIES

KV_POLICIES = {"lagkv", "criticalkv"}  # scores read V too


# ---------------------------------------------------------------------------------------------
# timing


def bench(fn, cuda: bool, graph: bool = False) -> float:
    """Median microseconds of ``fn()``."""
    if not cuda:
        fn()
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return sorted(ts)[1] * 1e6
    import triton.testing

    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return triton.testing.do_bench(g.replay, warmup=25, rep=100) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3


# ---------------------------------------------------------------------------------------------
# inputs


def make_case(N, B, H, G, D, W, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    keys = torch.randn(B, H, N, D, generator=g).to(device=device, dtype=dtype)
    values = torch.randn(B, H, N, D, generator=g).to(device=device, dtype=dtype)
    queries = torch.randn(B, H * G, W, D, generator=g).to(device=device, dtype=dtype)
    o_proj = (torch.randn(H * G * D, H * G * D, generator=g) / math.sqrt(H * G * D)).to(device=device, dtype=dtype)
    hd = (torch.rand(H, generator=g) + 0.1).to(device)
    return keys, values, {"queries": queries, "o_proj": o_proj, "hd": hd}


def policy_inputs(pol, pool):
    return {n: pool[n] for n in pol.needs}


# ---------------------------------------------------------------------------------------------
# kvpress (optional)


def import_kvpress():
    try:
        for name in ("datasets", "fire"):
            if name not in sys.modules:
                m = types.ModuleType(name)
                m.load_dataset = lambda *a, **k: None
                sys.modules[name] = m
        if "cachetools" not in sys.modules:
            ct = types.ModuleType("cachetools")
            ct.LRUCache = lambda *a, **k: None
            ct.cached = lambda *a, **k: (lambda f: f)
            sys.modules["cachetools"] = ct
        import kvpress

        return kvpress
    except Exception as e:  # not installed, or incompatible transformers
        print(f"kvpress unavailable ({type(e).__name__}: {e}); kvpress columns are null", file=sys.stderr)
        return None


def kvpress_case(kvpress, name, keys, values, queries, keep, W):
    """``(press_fn, scores_fn)`` for a policy's kvpress counterpart, or None."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    B, H, N, D = keys.shape
    Hq = queries.shape[1]
    r = 1.0 - keep
    presses = {
        "knorm": lambda: kvpress.KnormPress(compression_ratio=r),
        "keydiff": lambda: kvpress.KeyDiffPress(compression_ratio=r),
        "streaming_llm": lambda: kvpress.StreamingLLMPress(compression_ratio=r),
        "lagkv": lambda: kvpress.LagKVPress(compression_ratio=r),
        "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=r, window_size=W, kernel_size=7),
        "tova": lambda: kvpress.TOVAPress(compression_ratio=r),
        "criticalkv": lambda: kvpress.CriticalKVPress(kvpress.SnapKVPress(compression_ratio=r, window_size=W,
                                                                           kernel_size=7)),
    }
    if name not in presses:
        return None
    press = presses[name]()
    cfg = LlamaConfig(hidden_size=Hq * D, num_attention_heads=Hq, num_key_value_heads=H, head_dim=D,
                      num_hidden_layers=1, intermediate_size=128, max_position_embeddings=N + 16)
    cfg._attn_implementation = "sdpa"
    attn = LlamaAttention(cfg, layer_idx=0).to(device=keys.device, dtype=keys.dtype)
    rope = LlamaRotaryEmbedding(cfg).to(keys.device)
    attn.rotary_emb = rope
    hidden = torch.randn(B, N, Hq * D, device=keys.device, dtype=keys.dtype)
    cos, sin = rope(hidden, torch.arange(N, device=keys.device)[None])
    kwargs = {"position_embeddings": (cos, sin), "hidden_states": hidden}
    # the same window queries for tritonkv: q_proj of the last W hidden states, with RoPE
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q = attn.q_proj(hidden[:, -W:]).view(B, W, Hq, D).transpose(1, 2)
    q, _ = apply_rotary_pos_emb(q, q, cos[:, -W:], sin[:, -W:])
    queries.copy_(q)

    def press_fn():
        return press.compress(attn, hidden, keys, values, None, kwargs)

    def scores_fn():
        return press.score(attn, hidden, keys, values, None, kwargs)

    return press_fn, scores_fn, attn


# ---------------------------------------------------------------------------------------------
# torch.compile reference pipelines (score -> topk -> sort -> gather)


def torch_scores(name, keys, values, queries, W):
    k = keys.float()
    if name == "knorm":
        return -k.norm(dim=-1)
    if name == "keydiff":
        a = torch.nn.functional.normalize(k, dim=-1).mean(dim=2, keepdim=True)
        return -torch.nn.functional.cosine_similarity(k, a, dim=-1)
    if name == "streaming_llm":
        return torch.zeros(k.shape[:3], device=k.device)
    if name in ("snapkv", "tova", "h2o", "surfacelogic"):
        B, H, N, D = k.shape
        G = queries.shape[1] // H
        q = queries.float().view(B, H, G * queries.shape[2], D)
        logits = torch.einsum("bhqd,bhnd->bhqn", q, k) / math.sqrt(D)
        w = queries.shape[2]
        causal = torch.arange(N, device=k.device)[None, :] > (N - w + torch.arange(w, device=k.device))[:, None]
        logits = logits.masked_fill(causal.repeat(G, 1), float("-inf"))
        return logits.softmax(-1).mean(2)
    return None


def torch_pipeline(name, keys, values, queries, k, W):
    def run():
        s = torch_scores(name, keys, values, queries, W)
        idx = s.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
        g = idx[..., None].expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, g), values.gather(2, g), idx

    return run if torch_scores(name, keys[..., :4, :], values[..., :4, :], queries[..., :1, :], 1) is not None else None


# ---------------------------------------------------------------------------------------------


def floor_bytes(name, keys, k):
    row = keys.shape[-1] * keys.element_size()
    kept = 2 * keys.shape[0] * keys.shape[1] * k * row  # kept K + V
    read = 0 if name == "streaming_llm" else keys.numel() * keys.element_size() * (2 if name in KV_POLICIES else 1)
    return read + 2 * kept  # read the score inputs, re-read the kept K+V, write them


def run(args):
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16
    B, H, G, D, W = (1, 8, 4, 128, 32) if not args.smoke else (1, 2, 2, 16, 4)
    Ns = args.n or ([4096, 32768, 131072] if not args.smoke else [96])
    names = args.policies or sorted(POLICIES)
    kvpress = None if (args.no_kvpress or args.smoke) else import_kvpress()
    rows, copy = [], {}
    for N in Ns:
        keys, values, pool = make_case(N, B, H, G, D, W, dtype, device)
        copy_us = bench(lambda: keys.clone(), cuda)
        copy[N] = 2 * keys.numel() * keys.element_size() / copy_us / 1e3  # GB/s
        k = max(1, math.floor(args.keep * N + 1e-6))
        for name in names:
            pol = POLICIES[name]()
            inputs = policy_inputs(pol, pool)
            kv_ref = kvpress_case(kvpress, name, keys, values, pool["queries"], args.keep, W) if kvpress else None
            fn = lambda: tritonkv.compress((keys, values), pol, k, **inputs)  # noqa: E731
            try:
                out = fn()
            except Exception as e:  # a policy that cannot run at this shape is reported, not hidden
                print(f"{name} N={N}: {type(e).__name__}: {e}", file=sys.stderr)
                rows.append(dict(policy=name, N=N, error=f"{type(e).__name__}: {e}"))
                continue
            eager = bench(fn, cuda)
            try:
                t_us = bench(fn, cuda, graph=True) if cuda else eager
            except Exception as e:
                print(f"{name}: CUDA graph capture failed ({e}); eager time reported", file=sys.stderr)
                t_us = eager
            fb = floor_bytes(name, keys, k)
            floor_us = fb / (copy[N] * 1e3)
            kv_us = same = None
            if kv_ref is not None:
                press_fn, scores_fn, _ = kv_ref
                kv_us = bench(press_fn, cuda)
                s_kv = scores_fn().float()
                sink, window = pol.protected(N, k)
                from tritonkv.kernels.select import select_indices

                ref_idx, _ = select_indices(s_kv, k, k, sink=sink, window=window)
                same = bool(torch.equal(ref_idx, out.indices))
            tc_us = None
            pipe = torch_pipeline(name, keys, values, pool["queries"], k, W) if not args.no_compile else None
            if pipe is not None and cuda:
                compiled = torch.compile(pipe)
                compiled()
                tc_us = bench(compiled, cuda)
            row = dict(policy=name, B=B, H_kv=H, D=D, N=N, dtype=str(dtype).replace("torch.", ""), keep=args.keep,
                       tritonkv_us=round(t_us, 2), tritonkv_eager_us=round(eager, 2), floor_us=round(floor_us, 2),
                       floor_bytes=fb, x_floor=round(t_us / floor_us, 2),
                       achieved_TBps=round(fb / t_us / 1e6, 3), pct_copy_bw=round(100 * floor_us / t_us, 1),
                       kvpress_us=None if kv_us is None else round(kv_us, 2),
                       torch_compile_us=None if tc_us is None else round(tc_us, 2), same_kept=same)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return dict(device=torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)", torch=torch.__version__,
                triton=__import__("triton").__version__, commit=_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                copy_GBps={str(n): round(v, 1) for n, v in copy.items()}, command=" ".join(sys.argv), rows=rows)


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        return None


def write(result, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    tag = result["device"].split(" (")[0].replace(" ", "-").lower()
    base = os.path.join(out_dir, f"{tag}-speed")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    cols = ["policy", "N", "tritonkv_us", "floor_us", "x_floor", "pct_copy_bw", "kvpress_us", "torch_compile_us",
            "same_kept"]
    lines = [f"Device: {result['device']}; torch {result['torch']}, triton {result['triton']}; commit "
             f"{result['commit']}; {result['date']}; copy GB/s {result['copy_GBps']}", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in result["rows"]:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name in sorted({r["policy"] for r in result["rows"] if "tritonkv_us" in r}):
            rs = [r for r in result["rows"] if r["policy"] == name and "x_floor" in r]
            ax.plot([r["N"] for r in rs], [r["x_floor"] for r in rs], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (tokens)")
        ax.set_ylabel("time / HBM floor")
        ax.set_title(result["device"])
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(base + ".png", dpi=120)
    except ImportError:
        pass
    return base


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="*", help="sequence lengths (default 4096 32768 131072)")
    p.add_argument("--policies", nargs="*", help="policy names (default: all registered)")
    p.add_argument("--keep", type=float, default=0.25, help="fraction of tokens kept")
    p.add_argument("--no-kvpress", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, to check the program")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = p.parse_args(argv)
    res = run(a)
    print("wrote", write(res, a.out))
    return res


if __name__ == "__main__":
    main()
