"""The SurfaceLogicKV INFsc profile: its arithmetic and its files (``docs/algorithms.md`` §2.5, a reconstruction).

Per answer step and query head, with ``a`` the attention row over the prompt's positions, ``N`` the needle's
positions and ``TopK`` the top-``|N|`` positions of ``a`` (from the shared select kernel)::

    WO = Σ_{TopK∩N} a    WD = Σ_{TopK∖N} a    WS = Σ_{N∖TopK} a

averaged over steps and trials (ratios of means), then

    SF = WO / (WO + WD + ε)    LG = (WD + WS) / max_heads(WD + WS)    INF = 2·SF·LG / (SF + LG + ε)

with the maximum over every (layer, query head). The KV-head profile is the mean of INF over each
KV head's query-head group. ``load_profile(name)`` reads a shipped profile from ``tritonkv/data``.

This module needs only torch: running a model to collect the attention rows is
``tritonkv.integrations.profiler`` (``profile_infsc``, ``answer_attention`` and the ``profile`` command), next
to the model code it runs. Those names stay importable from here (resolved lazily, so importing this module
never imports the integrations)::

    python -m tritonkv.integrations.profiler --out tritonkv/data/smollm2-135m-instruct-infsc.json \\
        --lengths 1024,2048,3072,4096 --depths 0.1,0.3,0.5,0.7,0.9 --steps 1 --source kjv

writes the shipped default profile (its ``grid`` records these settings).
"""
from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass, field
from typing import Dict

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
        """Add ``[L, H_q, S]`` weights of one trial's S steps (``[L, H_q]`` like the sums so far)."""
        if not wo.shape == wd.shape == ws.shape or wo.dim() != 3:
            raise ValueError(f"wo, wd, ws must be [L, H_q, S] of one shape, got {tuple(wo.shape)}, "
                             f"{tuple(wd.shape)}, {tuple(ws.shape)}")
        s = [t.to(torch.float64).sum(-1) for t in (wo, wd, ws)]
        if self.wo is not None and s[0].shape != self.wo.shape:
            raise ValueError(f"weights of [L, H_q] = {list(s[0].shape)} cannot be added to sums of "
                             f"{list(self.wo.shape)} (other layers or heads)")
        if self.wo is None:
            self.wo, self.wd, self.ws = s
        else:
            self.wo, self.wd, self.ws = self.wo + s[0], self.wd + s[1], self.ws + s[2]
        self.count += wo.shape[-1]

    def state(self) -> dict:
        return {"wo": self.wo, "wd": self.wd, "ws": self.ws, "count": self.count}

    def load(self, st: dict) -> None:
        """Restore ``state()``'s dict: three ``[L, H_q]`` sums of one shape and their step count (or empty sums)."""
        if not isinstance(st, dict):
            raise TypeError(f"state must be a dict from WeightSums.state(), got {type(st).__name__}")
        t, count = [st.get(k) for k in ("wo", "wd", "ws")], st.get("count")
        if all(x is None for x in t) and count == 0:
            self.wo = self.wd = self.ws = None
            self.count = 0
            return
        if not all(isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape == t[0].shape for x in t) \
                or not isinstance(count, int) or count < 1:
            shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in t]
            raise ValueError(f"state must hold sums wo, wd, ws of one [L, H_q] shape and a count >= 1, got "
                             f"{shapes} and count {count!r}")
        self.wo, self.wd, self.ws = (x.to(torch.float64) for x in t)
        self.count = count

    def profile(self, num_kv_heads: int, grid: dict, model: str = "") -> Profile:
        if not self.count:
            raise ValueError("no trials were profiled (the grid is empty)")
        wo, wd, ws = (t / self.count for t in (self.wo, self.wd, self.ws))
        sf, lg, inf = infsc_scores(wo, wd, ws)
        f = lambda t: t.to(torch.float32)  # noqa: E731
        return Profile(f(inf), f(group_mean(inf, num_kv_heads)), f(sf), f(lg), f(wo), f(wd), f(ws), grid, model)


def save_profile(profile: Profile, path: str) -> None:
    """Write ``profile`` as JSON (``model``, ``grid``, ``infsc_query_heads``, ``infsc_kv_heads``, ..., ``date``)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(profile.to_json(), f, indent=1)
        f.write("\n")


def is_path(name: str) -> bool:
    """True when the profile ``name`` names a file (it ends in ``.json`` or holds a path separator)."""
    return name.endswith(".json") or os.sep in name or bool(os.altsep and os.altsep in name)


def profile_path(name: str) -> str:
    """The file of profile ``name``: ``tritonkv/data/<name>.json`` for a shipped name, ``name`` itself for a path
    (see ``is_path``); a bare ``<stem>.json`` that is no file here but a shipped one is the shipped one."""
    if not is_path(name):
        return os.path.join(DATA_DIR, f"{name}.json")
    shipped = os.path.join(DATA_DIR, name)
    if os.path.basename(name) == name and not os.path.exists(name) and os.path.isfile(shipped):
        return shipped
    return name


def load_profile(name: str, heads: str = "kv") -> torch.Tensor:
    """An INFsc profile as fp32 ``[L, H_kv]`` (``heads="kv"``) or ``[L, H_q]`` (``"query"``).

    ``name`` is a shipped profile, a file stem in ``tritonkv/data`` (e.g. ``"smollm2-135m-instruct-infsc"``,
    ``.json`` optional), or a path to a profile: a name ending in ``.json`` or holding a path separator."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"profile must be a profile name (str), got {name!r}")
    if heads not in ("kv", "query"):
        raise ValueError(f"heads must be 'kv' or 'query', got {heads!r}")
    path = profile_path(name)
    if not os.path.isfile(path):
        avail = sorted(f[:-5] for f in os.listdir(DATA_DIR) if f.endswith(".json")) if os.path.isdir(DATA_DIR) else []
        raise ValueError(f"profile {name!r} not found (no file {path}); shipped profiles: {avail}")
    try:
        with open(path) as f:
            data = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"profile file {path} is not valid JSON ({e})") from None
    key = "infsc_kv_heads" if heads == "kv" else "infsc_query_heads"
    if not isinstance(data, dict) or key not in data:
        raise ValueError(f"profile file {path} has no {key!r} entry")
    try:
        t = torch.tensor(data[key], dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"profile file {path}: {key} must be an [L, H] list of rows of numbers ({e})") from None
    if t.dim() != 2 or 0 in t.shape:
        raise ValueError(f"profile file {path}: {key} must be an [L, H] list of rows of numbers, got shape "
                         f"{tuple(t.shape)}")
    return t
