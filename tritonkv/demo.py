"""``python -m tritonkv demo``: SmolLM2-135M-Instruct reads a long haystack with a hidden pass key while
tritonkv keeps a quarter of its KV cache, prefilling block by block.

For the full cache and each policy it prints: the peak KV memory against the uncompressed cache, the
prefill and decode speed, the pass key's likelihood rank among 10 candidate keys (1 = it survived;
``docs/architecture.md``, "The real model and the needle check") and the model's own greedy answer. On
the CPU every op runs its native PyTorch body (no Triton interpreter); the default context is 1K tokens
there and 6K on a GPU (``--tokens`` up to the model's 8K).
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

DEMO_POLICIES = ("keydiff", "knorm", "streaming_llm", "snapkv", "tova", "lagkv")


def _policy(name: str, n_tokens: int):
    """The demo's setting of a policy: LagKV's lag shrinks on short contexts so that its protected
    tokens (16 sinks + a tail of up to 2L - 1) fit a 25% budget."""
    from .policies import get_policy

    pol = get_policy(name)
    if name == "lagkv" and n_tokens < 4096:
        pol = type(pol)(lag=64)
    return pol


def _row(label, cache_bytes, full_bytes, prefill_s, n_tokens, decode_s, n_decoded, rank, answer):
    return {"policy": label, "kv_mb": cache_bytes / 2**20, "kv_pct": 100.0 * cache_bytes / full_bytes,
            "prefill_tok_s": n_tokens / prefill_s, "decode_ms": 1000.0 * decode_s / max(n_decoded, 1),
            "rank": rank, "answer": answer}


def _table(rows, key: str) -> str:
    head = f"{'policy':<16} {'peak KV':>16} {'prefill':>11} {'decode':>11} {'key rank':>9}  answer"
    lines = [head, "-" * len(head)]
    for r in rows:
        ok = "ok" if r["rank"] == 1 else "lost"
        lines.append(f"{r['policy']:<16} {r['kv_mb']:7.1f} MB {r['kv_pct']:4.0f}% {r['prefill_tok_s']:7.0f} t/s "
                     f"{r['decode_ms']:6.1f} ms/t {r['rank']:>4} {ok:<4}  {r['answer']!r}")
    lines.append(f"(true key {key}; key rank = likelihood rank among 10 candidate keys, 1 = the needle survived)")
    return "\n".join(lines)


def run(device: str = "auto", n_tokens: int = 0, budget: float = 0.25, mode: str = "blockwise", block_size: int = 128,
        policies=DEMO_POLICIES, new_tokens: int = 12, depth: float = 0.5, seed: int = 0, out=print):
    """Run the demo and return its rows (a list of dicts)."""
    from tqdm.auto import tqdm

    from . import POLICIES
    from .integrations.model import load_smollm2
    from .integrations.needle import build_case, full_prefill, rank_candidates
    from .integrations.transformers import decode, make_cache, prefill, use_tritonkv

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    n_tokens = n_tokens or (6144 if device == "cuda" else 1024)
    model, tok = load_smollm2(device=device)
    case = build_case(tok, n_tokens, depth=depth, seed=seed)
    cfg = model.config
    per_token = cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2 * 4
    full_bytes = n_tokens * per_token
    names = [p for p in policies if p in POLICIES]
    missing = [p for p in policies if p not in POLICIES]
    out(f"SmolLM2-135M-Instruct on {device}: a {n_tokens}-token {case.source} haystack, pass key at depth {depth}; "
        f"budget {budget:.0%} of the prompt, {mode} ({block_size}-token blocks)"
        + (f"; not available: {', '.join(missing)}" if missing else ""))
    ids = case.input_ids.to(device)
    rows = []
    bar = tqdm(total=(len(names) + 1) * (n_tokens + new_tokens), unit="tok", desc="full cache")

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    # the uncompressed reference
    t = time.perf_counter()
    logits, cache = full_prefill(model, ids)
    sync()
    t_prefill = time.perf_counter() - t
    bar.update(n_tokens)
    rank = rank_candidates(model, lambda m, x: (logits, cache), case).rank + 1
    t = time.perf_counter()
    ans = decode(model, cache, logits, new_tokens, progress=bar.update)
    sync()
    rows.append(_row("full cache", full_bytes, full_bytes, t_prefill, n_tokens, time.perf_counter() - t,
                     ans.shape[1], rank, tok.decode(ans[0])))

    for name in names:
        bar.set_description(name)
        pol = _policy(name, n_tokens)
        cache = make_cache(model, pol, budget, mode=mode, block_size=block_size, prompt_length=n_tokens)
        t = time.perf_counter()
        logits = prefill(model, ids, cache, progress=bar.update)[:, -1]
        sync()
        t_prefill = time.perf_counter() - t
        peak = cache.memory_bytes(peak=True)
        frozen = copy.deepcopy(cache).freeze()  # the candidates are scored against the cache the prompt left
        with use_tritonkv(model):
            rank = rank_candidates(model, lambda m, x: (logits, frozen), case).rank + 1
        t = time.perf_counter()
        ans = decode(model, cache, logits, new_tokens, progress=bar.update)
        sync()
        label = name if name != "lagkv" or pol.lag == 128 else f"lagkv (L={pol.lag})"
        rows.append(_row(label, peak, full_bytes, t_prefill, n_tokens, time.perf_counter() - t, ans.shape[1], rank,
                         tok.decode(ans[0])))
    bar.close()
    out(_table(rows, case.key))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="tritonkv demo", description=__doc__.replace("``", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--tokens", type=int, default=0, help="prompt length (default 1024 on CPU, 6144 on GPU)")
    p.add_argument("--budget", type=float, default=0.25, help="fraction of the prompt kept per head (default 0.25)")
    p.add_argument("--mode", default="blockwise", choices=("after_prefill", "blockwise", "decoding"),
                   help="when the cache compresses (default blockwise: after every prefill block)")
    p.add_argument("--block-size", type=int, default=128, help="prefill block in blockwise mode (default 128)")
    p.add_argument("--policies", default=",".join(DEMO_POLICIES), help="comma-separated policy names")
    p.add_argument("--new-tokens", type=int, default=12, help="tokens of the model's answer")
    p.add_argument("--depth", type=float, default=0.5, help="where the needle sits in the haystack (0..1)")
    p.add_argument("--seed", type=int, default=0, help="which pass key and haystack cut (default 0)")
    a = p.parse_args(argv)
    run(a.device, a.tokens, a.budget, a.mode, a.block_size, [s for s in a.policies.split(",") if s], a.new_tokens,
        a.depth, a.seed)
