"""Quality of tritonkv's policies and allocators on the real model (SmolLM2-135M-Instruct, CPU).

Three measurements, all on real text (``tritonkv.integrations.needle``'s haystack, the KJV Bible when
the ``bible`` CLI is installed):

- ``attn_err`` (cheap, one-shot compression of captured tensors): one full forward captures every
  layer's keys/values (RoPE applied) and queries. For each measured layer the prefix of ``N`` tokens is
  compressed with ``tritonkv.compress`` (window policies read the last 32 prefix queries), and the
  attention outputs over the prefix of the next ``F`` *future* queries are compared:
  ``‖o − ô‖₁ / ‖o‖₁`` per query head, averaged over the future queries (tokens between the prefix and
  a future query are left out of both). The value is the mean over measured layers and heads; the
  per-(layer, head) errors are kept in ``details`` of the JSON.
- ``needle`` and ``kl`` (full model runs through ``TritonKVCache``, mode ``after_prefill`` or
  ``blockwise``): a needle case is prefilled into a compressed cache, which is then frozen; the true key
  is ranked against 9 distractors by likelihood (``needle`` = 1 when it ranks first), and ``kl`` is
  KL(p_full ‖ p_compressed) of the next-token distributions at the prompt's last token and along the
  true key's tokens (teacher-forced), averaged.

Results: ``benchmarks/results/quality.json`` (rows: policy, allocation, mode, budget, context, metric,
value, trials), ``quality.md`` (tables + the papers' claims), ``quality_*.png``.

    TRITON_INTERPRET=1 python benchmarks/quality.py --quick        # a few minutes on 2 CPU cores
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import tritonkv  # noqa: E402
from tritonkv.api import Compressed, resolve_budget  # noqa: E402

POLICIES = ["knorm", "keydiff", "streaming_llm", "snapkv", "tova", "h2o", "lagkv", "criticalkv"]
ALLOCATORS = ["uniform", "adakv", "pyramid", "score", "surfacelogic"]
Q_WINDOW = 32  # queries handed to window policies (SnapKV/H2O/CriticalKV/SurfaceLogic observation window)
MODEL_NAME = "SmolLM2-135M-Instruct"


def _tqdm(it=None, **kw):
    try:
        from tqdm import tqdm
        return tqdm(it, **kw)
    except ImportError:  # progress is optional
        class _Dummy:
            def __init__(self, it):
                self.it = it

            def __iter__(self):
                return iter(self.it)

            def update(self, n=1):
                pass

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass
        return _Dummy(it)


# ------------------------------------------------------------------------------------------------
# capture


@torch.no_grad()
def capture(model, input_ids: torch.Tensor):
    """One full-cache forward of ``input_ids`` ``[1, T]``: per layer ``(keys, values, queries)`` with keys/values
    ``[1, H_kv, T, D]`` and queries ``[1, H_q, T, D]``, all with RoPE applied as the model applied it."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layers = model.model.layers
    qs: Dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn

        def hook(mod, args, kwargs, i=i):
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
            B, T, _ = h.shape
            q = mod.q_proj(h).view(B, T, -1, mod.head_dim).transpose(1, 2)
            qs[i] = apply_rotary_pos_emb(q, q, cos, sin)[0]

        hooks.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    from tritonkv.integrations.transformers import output_cache

    cache = output_cache(out)
    return [(cache.layers[i].keys, cache.layers[i].values, qs[i]) for i in range(len(layers))]


def kept_mask(out, n: int) -> torch.Tensor:
    """bool ``[B, H_kv, n]``: which prefix tokens a ``compress`` result kept."""
    if isinstance(out, Compressed):
        idx = out.indices
    else:
        idx = out.to_padded(with_positions=True)[3]
    B, H = idx.shape[:2]
    m = torch.zeros(B, H, n + 1, dtype=torch.bool)
    m.scatter_(2, torch.where(idx >= 0, idx, n).to(torch.int64), True)
    return m[:, :, :n]


def attention_error(keys, values, queries, keep: torch.Tensor) -> torch.Tensor:
    """``‖o − ô‖₁/‖o‖₁`` per query head (mean over the queries): ``queries`` ``[1, H_q, F, D]`` attend to every
    prefix key (o) or only the kept ones (ô, ``keep`` bool ``[1, H_kv, N]``). Returns fp32 ``[H_q]``."""
    B, Hq, F, D = queries.shape
    H = keys.shape[1]
    q = queries.float().reshape(B, H, Hq // H, F, D)
    logits = torch.einsum("bhgfd,bhnd->bhgfn", q, keys.float()) / math.sqrt(D)
    o = torch.einsum("bhgfn,bhnd->bhgfd", logits.softmax(-1), values.float())
    oh = torch.einsum("bhgfn,bhnd->bhgfd", logits.masked_fill(~keep[:, :, None, None], -math.inf).softmax(-1),
                      values.float())
    err = (o - oh).abs().sum(-1) / o.abs().sum(-1).clamp_min(1e-30)
    return err.mean(-1).reshape(Hq)


# ------------------------------------------------------------------------------------------------
# model runs


def _logprobs_along(model, cache, first_logits, ids: List[int], tritonkv_cache: bool):
    """Log-softmax distributions at the prompt's last token and after each of ``ids[:-1]``: ``[len(ids), V]``."""
    from tritonkv.integrations.transformers import cache_kwarg, use_tritonkv
    import contextlib

    dists = [torch.log_softmax(first_logits.float().reshape(-1), -1)]
    if len(ids) > 1:
        c = copy.deepcopy(cache)
        seen = int(c.get_seq_length())
        x = torch.tensor([ids[:-1]], dtype=torch.long)
        pos = torch.arange(seen, seen + len(ids) - 1)[None]
        with use_tritonkv(model) if tritonkv_cache else contextlib.nullcontext():
            out = model(input_ids=x, position_ids=pos, use_cache=True, **{cache_kwarg(model): c})
        dists += list(torch.log_softmax(out.logits[0].float(), -1))
    return torch.stack(dists)


@torch.no_grad()
def score_case(model, case, policy=None, budget=None, mode="after_prefill", allocation=None, block_size=256,
               cache_inputs: Optional[dict] = None):
    """``(candidate log-likelihoods, true-key distributions [n, V])`` for one needle case; ``policy=None`` is the
    full cache."""
    from tritonkv.integrations.needle import full_prefill
    from tritonkv.integrations.transformers import make_cache, prefill

    ids = case.input_ids
    if policy is None:
        logits, cache = full_prefill(model, ids)
        tk = False
    else:
        cache = make_cache(model, policy, budget, mode=mode, allocation=allocation, block_size=block_size,
                           prompt_length=ids.shape[1], **(cache_inputs or {}))
        logits = prefill(model, ids, cache)[:, -1]
        cache.freeze()
        tk = True
    scores, true_dists = [], None
    for j, cand in enumerate(case.candidate_ids):
        d = _logprobs_along(model, cache, logits, cand, tk)
        scores.append(float(d[torch.arange(len(cand)), torch.tensor(cand)].sum()))
        if j == case.answer:
            true_dists = d
    return scores, true_dists


def _top1(scores, case) -> int:
    """1 when the true key scores strictly above every distractor (ties count against it)."""
    return int(all(scores[case.answer] > x for i, x in enumerate(scores) if i != case.answer))


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    """Mean over rows of KL(p ‖ q) from log-probabilities."""
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


# ------------------------------------------------------------------------------------------------
# the sweep


def _meta(command: str) -> dict:
    import transformers
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"device": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
            "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "triton": tv,
                         "transformers": transformers.__version__, "tritonkv": getattr(tritonkv, "__version__", "")},
            "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "model": MODEL_NAME}


class Results:
    """Rows plus metadata, written to disk after every addition (a killed run keeps what it measured)."""

    def __init__(self, out_dir: str, meta: dict, write: bool = True):
        self.out_dir, self.meta, self.write = out_dir, meta, write
        self.rows: List[dict] = []
        self.details: Dict[str, list] = {}

    def add(self, **row):
        self.rows.append(row)
        self.save()

    def save(self):
        if not self.write:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, "quality.json")
        with open(path + ".tmp", "w") as f:
            json.dump({**self.meta, "rows": self.rows, "details": self.details}, f, indent=1)
        os.replace(path + ".tmp", path)
        with open(os.path.join(self.out_dir, "quality.md"), "w") as f:
            f.write(markdown({**self.meta, "rows": self.rows, "details": self.details}))


def _policy_inputs(policy: str, layer_idx: int, model, queries, extra: dict) -> dict:
    inputs = dict(queries=queries[:, :, -Q_WINDOW:], layer=layer_idx, num_layers=model.config.num_hidden_layers)
    if policy == "criticalkv":
        inputs["o_proj"] = model.model.layers[layer_idx].self_attn.o_proj.weight.detach()
    inputs.update(extra)
    return inputs


def run_attention(model, tok, res: Results, *, context: int, future: int, layers: Sequence[int],
                  policies: Sequence[str], budgets: Sequence[float], allocators: Sequence[str], trials: int,
                  alloc_policy: str = "snapkv"):
    """The ``attn_err`` sweep: ``policies`` x ``budgets`` with uniform allocation, plus ``allocators`` over
    ``alloc_policy``, on ``trials`` real-text windows of ``context + future`` tokens."""
    from tritonkv.integrations.needle import build_case
    from tritonkv.allocation import head_means_from_queries, sample_positions

    configs = [(p, "uniform", b) for b in budgets for p in policies]
    configs += [(alloc_policy, a, b) for b in budgets for a in allocators if a != "uniform"]
    if "criticalkv" in policies and "adakv" in allocators:  # CriticalKV over AdaKV, against AdaKV over SnapKV
        configs += [("criticalkv", "adakv", b) for b in budgets]
    errs: Dict[tuple, list] = {c: [] for c in configs}
    kept: Dict[tuple, list] = {c: [] for c in configs}
    bar = _tqdm(total=trials * len(configs) * len(layers), desc="attn_err", file=sys.stderr)
    for t in range(trials):
        case = build_case(tok, context + future, depth=0.5, seed=1000 + t)
        cap = capture(model, case.input_ids)
        extra_alloc: dict = {}
        if "score" in allocators:  # SCORE's allocator reads every layer's head means (query rows over the prefix)
            pos = sample_positions(context, k=64, window=Q_WINDOW, seed=t)
            extra_alloc["head_means"] = torch.stack([
                head_means_from_queries(q[:, :, pos], k[:, :, :context], pos) for k, _, q in cap])
        for cfg in configs:
            policy, alloc, b = cfg
            for li in layers:
                k, v, q = cap[li]
                kp, vp, qp, qf = k[:, :, :context], v[:, :, :context], q[:, :, :context], q[:, :, context:]
                extra = extra_alloc if alloc == "score" else {}
                try:
                    out = tritonkv.compress((kp, vp), policy, b, allocation=None if alloc == "uniform" else alloc,
                                            **_policy_inputs(policy, li, model, qp, extra))
                except ValueError as e:  # e.g. a budget below the policy's protected tokens (LagKV's tail)
                    bar.write(f"skip {cfg} layer {li}: {e}")
                    bar.update(len(layers) - layers.index(li))
                    break
                keep = kept_mask(out, context)
                errs[cfg].append(attention_error(kp, vp, qf, keep).tolist())
                kept[cfg].append(float(keep.float().sum(-1).mean()))
                bar.update(1)
                bar.set_postfix_str(f"{policy}/{alloc}/{b}")
    bar.close()
    for cfg in configs:
        policy, alloc, b = cfg
        if not errs[cfg]:
            res.add(policy=policy, allocation=alloc, mode="after_prefill", budget=b, context=context,
                    metric="attn_err", value=None, trials=0, note="budget below the policy's protected tokens")
            continue
        per = torch.tensor(errs[cfg])  # [trials * layers, H_q]
        per_lh = per.reshape(-1, len(layers), per.shape[-1]).mean(0)  # [layers, H_q], mean over trials
        key = f"attn_err/{policy}/{alloc}/{b}/{context}"
        res.details[key] = {"layers": list(layers), "per_layer_head": per_lh.tolist()}
        res.add(policy=policy, allocation=alloc, mode="after_prefill", budget=b, context=context, metric="attn_err",
                value=float(per.mean()), trials=trials, kept_per_head=sum(kept[cfg]) / len(kept[cfg]))


def run_model(model, tok, res: Results, *, context: int, policies: Sequence[str], budgets: Sequence[float],
              modes: Sequence[str], allocators: Sequence[str], depths: Sequence[float], trials: int,
              block_size: int):
    """The ``needle`` and ``kl`` sweep through ``TritonKVCache`` (full model, real attention)."""
    from tritonkv.integrations.needle import build_case

    cases = [build_case(tok, context, depth=d, seed=t) for t in range(trials) for d in depths]
    ref = [score_case(model, c) for c in cases]
    full_acc = sum(_top1(s, c) for (s, _), c in zip(ref, cases))
    res.add(policy="full", allocation="uniform", mode="full", budget=1.0, context=context, metric="needle",
            value=full_acc / len(cases), trials=len(cases))
    configs = [(p, a, m, b) for b in budgets for m in modes for a in allocators for p in policies]
    bar = _tqdm(total=len(configs) * len(cases), desc="needle+kl", file=sys.stderr)
    for policy, alloc, mode, b in configs:
        hits, kls, err = [], [], None
        for c, (_, ref_d) in zip(cases, ref):
            inputs = {}
            try:
                s, d = score_case(model, c, policy, b, mode, None if alloc == "uniform" else alloc, block_size,
                                  inputs)
            except (ValueError, TypeError) as e:
                err = str(e)
                bar.write(f"skip {policy}/{alloc}/{mode}/{b}: {e}")
                bar.update(1)
                break
            hits.append(_top1(s, c))
            kls.append(kl(ref_d, d))
            bar.update(1)
            bar.set_postfix_str(f"{policy}/{alloc}/{mode}/{b}")
        n = len(hits)
        common = dict(policy=policy, allocation=alloc, mode=mode, budget=b, context=context, trials=n)
        if err and not n:
            common["note"] = err[:200]
        res.add(metric="needle", value=(sum(hits) / n) if n else None, **common)
        res.add(metric="kl", value=(sum(kls) / n) if n else None, **common)
    bar.close()


# ------------------------------------------------------------------------------------------------
# Markdown, plots, claims


def _fmt(v, metric):
    if v is None:
        return "–"
    return f"{v:.2f}" if metric == "needle" else f"{v:.4f}"


def table(rows: List[dict], metric: str, mode: str, allocation: Optional[str] = "uniform",
          by: str = "policy", context: Optional[int] = None) -> str:
    """A Markdown table of ``metric``: one line per policy (or allocation), one column per budget (rows of
    one ``context`` when given)."""
    sel = [r for r in rows if r["metric"] == metric and r["mode"] in (mode, "full")
           and (context is None or r["context"] == context)
           and (allocation is None or r["allocation"] == allocation or r["policy"] == "full")]
    if not sel:
        return ""
    budgets = sorted({r["budget"] for r in sel if r["policy"] != "full"})
    if not budgets:
        return ""
    names = list(dict.fromkeys(r[by] if r["policy"] != "full" else "full" for r in sel))
    head = f"| {by} | " + " | ".join(f"{b:g}" for b in budgets) + " |"
    lines = [head, "|" + "---|" * (len(budgets) + 1)]
    for n in names:
        vals = []
        for b in budgets:
            r = [x for x in sel if (x[by] if x["policy"] != "full" else "full") == n
                 and (x["budget"] == b or x["policy"] == "full")]
            vals.append(_fmt(r[-1]["value"], metric) if r else "")
        lines.append(f"| {n} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def _get(rows, **kw):
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r["value"]
    return None


def claims(data: dict) -> List[dict]:
    """The papers' claims checked against the measured rows: status reproduced / not reproduced / not measured."""
    rows, details = data["rows"], data.get("details", {})
    out = []
    small = sorted({r["budget"] for r in rows if r["policy"] != "full"})[:2]

    # 1. KeyDiff >= TOVA, StreamingLLM, SnapKV under block-wise prefill at small budgets
    ev, ok, measured = [], True, False
    for metric, better in (("needle", 1), ("kl", -1)):
        for b in small:
            kd = _get(rows, policy="keydiff", allocation="uniform", mode="blockwise", budget=b, metric=metric)
            if kd is None:
                continue
            for other in ("tova", "streaming_llm", "snapkv"):
                o = _get(rows, policy=other, allocation="uniform", mode="blockwise", budget=b, metric=metric)
                if o is None:
                    continue
                measured = True
                good = (kd - o) * better >= -1e-12
                ok &= good
                ev.append(f"{metric}@{b:g}: keydiff {_fmt(kd, metric)} vs {other} {_fmt(o, metric)}"
                          f"{'' if good else ' ✗'}")
    out.append(dict(claim="KeyDiff ≥ TOVA, StreamingLLM, SnapKV under block-wise prefill at small budgets "
                          "(needle accuracy higher or equal, KL lower or equal)",
                    status=("reproduced" if ok else "not reproduced") if measured else "not measured",
                    evidence="; ".join(ev)))

    # 2. CriticalKV lowers attention-output error vs SnapKV for most heads
    ev, fracs = [], []
    for key, d in details.items():
        parts = key.split("/")
        if parts[0] != "attn_err" or parts[1] != "criticalkv" or parts[2] not in ("uniform", "adakv"):
            continue
        base = details.get("/".join(["attn_err", "snapkv"] + parts[2:]))
        if base is None:
            continue
        c, s = torch.tensor(d["per_layer_head"]), torch.tensor(base["per_layer_head"])
        frac = float((c < s).float().mean())
        fracs.append(frac)
        name = "SnapKV" if parts[2] == "uniform" else "AdaKV (SnapKV scores)"
        ev.append(f"vs {name}, budget {parts[3]}, context {parts[4]}: lower on {frac:.0%} of {c.numel()} "
                  f"(layer, head) pairs, mean {float(c.mean()):.4f} vs {float(s.mean()):.4f}")
    out.append(dict(claim="CriticalKV lowers the attention-output error ‖o−ô‖₁/‖o‖₁ vs its base SnapKV / AdaKV "
                          "for most heads (the paper: over 90% of heads)",
                    status=("reproduced" if all(f > 0.5 for f in fracs) else "not reproduced") if fracs
                    else "not measured", evidence="; ".join(ev)))

    # 3. LagKV near the full cache at 2x ratio (budget 0.5)
    ev, st = [], "not measured"
    near = []
    for r in rows:
        if r["policy"] == "lagkv" and r["budget"] == 0.5 and r["value"] is not None:
            if r["metric"] == "attn_err":
                others = [x["value"] for x in rows if x["metric"] == "attn_err" and x["budget"] == 0.5
                          and x["allocation"] == "uniform" and x["value"] is not None and x["policy"] != "lagkv"]
                best = min(others) if others else None
                near.append(r["value"] <= 0.05)
                ev.append(f"attn_err@0.5 {r['value']:.4f} (best other policy {best:.4f})" if best is not None
                          else f"attn_err@0.5 {r['value']:.4f}")
            elif r["metric"] == "needle":
                full = _get(rows, policy="full", metric="needle")
                near.append(full is None or r["value"] >= full)
                ev.append(f"needle@0.5 ({r['mode']}) {r['value']:.2f} vs full {full}")
            elif r["metric"] == "kl":
                near.append(r["value"] <= 0.05)
                ev.append(f"kl@0.5 ({r['mode']}) {r['value']:.4f}")
    if near:
        st = "reproduced" if all(near) else "not reproduced"
    out.append(dict(claim="LagKV stays near the full cache at a 2× compression ratio (budget 0.5): "
                          "attention-output error ≤ 0.05, KL ≤ 0.05 nats, needle accuracy = full cache's",
                    status=st, evidence="; ".join(ev)))

    # 4. SCORE / SurfaceLogicKV allocation >= uniform at equal total
    ev, ok, measured = [], True, False
    for alloc in ("score", "surfacelogic"):
        for r in rows:
            if r["allocation"] != alloc or r["value"] is None:
                continue
            u = [x for x in rows if x["allocation"] == "uniform" and x["policy"] == r["policy"]
                 and x["metric"] == r["metric"] and x["mode"] == r["mode"] and x["budget"] == r["budget"]
                 and x["value"] is not None]
            if not u:
                continue
            u = u[-1]
            better = 1 if r["metric"] == "needle" else -1
            good = (r["value"] - u["value"]) * better >= -1e-12
            tot = ""
            if "kept_per_head" in r and "kept_per_head" in u:
                tot = f" (kept/head {r['kept_per_head']:.1f} vs {u['kept_per_head']:.1f})"
                if abs(r["kept_per_head"] - u["kept_per_head"]) > 0.02 * u["kept_per_head"]:
                    ev.append(f"{alloc} {r['metric']}@{r['budget']:g}: {_fmt(r['value'], r['metric'])} vs uniform "
                              f"{_fmt(u['value'], r['metric'])}{tot}: unequal total on the measured layers, not counted")
                    continue
            measured = True
            ok &= good
            ev.append(f"{alloc} {r['metric']}@{r['budget']:g}: {_fmt(r['value'], r['metric'])} vs uniform "
                      f"{_fmt(u['value'], r['metric'])}{tot}{'' if good else ' ✗'}")
    out.append(dict(claim="SCORE / SurfaceLogicKV allocation ≥ uniform allocation at equal total budget "
                          "(same base policy)",
                    status=("reproduced" if ok else "not reproduced") if measured else "not measured",
                    evidence="; ".join(ev) + ("" if any("surfacelogic" in e for e in ev) else
                                              "; SurfaceLogicKV: not in this run")))
    return out


def markdown(data: dict) -> str:
    rows = data["rows"]
    ctx = sorted({r["context"] for r in rows})
    parts = [f"# Quality on {data.get('model', MODEL_NAME)} (CPU)", "",
             f"Measured {data.get('date', '')} at commit `{data.get('commit', '')[:10]}` on {data.get('device', '')}; "
             f"command `{data.get('command', '')}`. Context {', '.join(map(str, ctx))} tokens of real text "
             "(haystack from `tritonkv.integrations.needle`). Budgets are fractions of the context kept per head.", ""]
    sections = [("attn_err", "after_prefill", "uniform", "policy",
                 "Attention-output error ‖o−ô‖₁/‖o‖₁ of future queries (lower is better), one-shot compression"),
                ("attn_err", "after_prefill", None, "allocation",
                 "Attention-output error by allocator (base policy snapkv)"),
                ("needle", "blockwise", "uniform", "policy", "Needle accuracy by likelihood, block-wise prefill"),
                ("kl", "blockwise", "uniform", "policy", "KL(full ‖ compressed) in nats, block-wise prefill"),
                ("needle", "after_prefill", "uniform", "policy", "Needle accuracy by likelihood, after prefill"),
                ("kl", "after_prefill", "uniform", "policy", "KL(full ‖ compressed) in nats, after prefill")]
    for metric, mode, alloc, by, title in sections:
        sel = rows if by == "policy" else [r for r in rows if r["policy"] == "snapkv"]
        for c in ctx:
            t = table(sel, metric, mode, alloc, by, context=c)
            if t:
                parts += [f"## {title}, context {c}", "", t, ""]
    parts += ["## The papers' claims", "", "| claim | status | evidence |", "|---|---|---|"]
    for c in claims(data):
        parts.append(f"| {c['claim']} | **{c['status']}** | {c['evidence'] or '–'} |")
    parts += ["", "A claim that does not reproduce here is a finding about this model, context and budget, "
              "not something tuned away. Small samples: see `trials` in quality.json.", ""]
    return "\n".join(parts)


def plots(data: dict, out_dir: str) -> List[str]:
    """``quality_<metric>.png``: quality vs budget, one line per policy (uniform allocation)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    rows = data["rows"]
    for metric in ("attn_err", "needle", "kl"):
        sel = [r for r in rows if r["metric"] == metric and r["allocation"] == "uniform" and r["value"] is not None
               and r["policy"] != "full"]
        if not sel:
            continue
        panels = sorted({(r["mode"], r["context"]) for r in sel})
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
        for ax, (mode, ctx) in zip(axes[0], panels):
            here = [r for r in sel if r["mode"] == mode and r["context"] == ctx]
            for p in dict.fromkeys(r["policy"] for r in here):
                pts = sorted((r["budget"], r["value"]) for r in here if r["policy"] == p)
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
            ax.set_xlabel("budget (fraction kept)")
            ax.set_ylabel(metric)
            ax.set_title(f"{metric} ({mode}, {ctx} tokens)")
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"quality_{metric}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def write_reports(data: dict, out_dir: str) -> None:
    with open(os.path.join(out_dir, "quality.md"), "w") as f:
        f.write(markdown(data))
    plots(data, out_dir)


# ------------------------------------------------------------------------------------------------


def main(argv=None, model_tok=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="~1K context, few policies/trials: a few minutes on CPU")
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--future", type=int, default=16, help="future queries for attn_err")
    p.add_argument("--layers", type=int, nargs="*", help="layers measured by attn_err (default: spread over the model)")
    p.add_argument("--policies", nargs="*")
    p.add_argument("--model-policies", nargs="*", help="policies of the full-model runs (needle, kl)")
    p.add_argument("--budgets", type=float, nargs="*")
    p.add_argument("--model-budgets", type=float, nargs="*")
    p.add_argument("--allocators", nargs="*")
    p.add_argument("--modes", nargs="*", choices=("after_prefill", "blockwise"))
    p.add_argument("--depths", type=float, nargs="*")
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--skip-attn", action="store_true")
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--append", action="store_true", help="add to the rows already in quality.json")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--no-write", action="store_true", help="compute only (tests)")
    a = p.parse_args(argv)
    q = a.quick
    context = a.context or (1024 if q else 2048)
    budgets = a.budgets or [0.1, 0.25, 0.5]
    policies = a.policies or POLICIES
    allocators = a.allocators if a.allocators is not None else (["uniform", "adakv", "score"] if q else ALLOCATORS)
    trials = a.trials or (1 if q else 3)
    if model_tok is None:
        from tritonkv.integrations.model import load_smollm2
        model_tok = load_smollm2()
    model, tok = model_tok
    L = model.config.num_hidden_layers
    layers = a.layers if a.layers is not None else sorted({round(i * (L - 1) / 4) for i in range(5)} if q
                                                           else range(0, L, 3))
    if "surfacelogic" in allocators:
        try:
            from tritonkv.allocation.profiler import load_profile
            load_profile("smollm2-135m-instruct-infsc")
        except (ValueError, TypeError, OSError) as e:
            print(f"surfacelogic allocation not measured: {e}", file=sys.stderr)
            allocators = [x for x in allocators if x != "surfacelogic"]
    command = "TRITON_INTERPRET=1 python benchmarks/quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    res = Results(a.out, _meta(command), write=not a.no_write)
    if a.append and os.path.exists(os.path.join(a.out, "quality.json")):
        with open(os.path.join(a.out, "quality.json")) as f:
            old = json.load(f)
        res.rows, res.details = old.get("rows", []), old.get("details", {})
        res.meta["command"] = f"{old.get('command', '')} && {command}"  # every run behind the rows
        res.meta["seconds_before"] = old.get("seconds", 0) + old.get("seconds_before", 0)
    t0 = time.time()
    if not a.skip_attn:
        run_attention(model, tok, res, context=context, future=a.future, layers=list(layers), policies=policies,
                      budgets=budgets, allocators=allocators, trials=trials)
    if not a.skip_model:
        run_model(model, tok, res, context=context,
                  policies=a.model_policies or (["keydiff", "snapkv", "tova", "streaming_llm"] if q else
                                                [x for x in POLICIES if x != "criticalkv"]),
                  budgets=a.model_budgets or ([0.1] if q else budgets),
                  modes=a.modes or (["blockwise"] if q else ["after_prefill", "blockwise"]),
                  allocators=["uniform"], depths=a.depths or ([0.5] if q else [0.1, 0.5, 0.9]),
                  trials=trials, block_size=a.block_size or (512 if q else 256))
    res.meta["seconds"] = round(time.time() - t0, 1)
    res.save()
    if not a.no_write:
        write_reports({**res.meta, "rows": res.rows, "details": res.details}, a.out)
    return {**res.meta, "rows": res.rows, "details": res.details}


if __name__ == "__main__":
    main()
