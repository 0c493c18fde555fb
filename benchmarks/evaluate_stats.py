"""Statistics for ``benchmarks/evaluate.py``: percentile-bootstrap intervals, paired comparisons, McNemar's exact
test, and the verdict rule (an interval decides, never a hand-set threshold).

Everything is plain Python + NumPy (no model, no torch), seeded, so a summary recomputed from the same records is
the same summary.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

N_BOOT = 2000
LEVEL = 0.95


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def bootstrap_ci(values: Sequence[float], stat: Callable[[np.ndarray], float] = np.mean, *, n_boot: int = N_BOOT,
                 level: float = LEVEL, seed: int = 0) -> Tuple[float, float, float]:
    """``(estimate, lo, hi)``: ``stat`` of ``values`` and its percentile-bootstrap interval (cases resampled with
    replacement). ``values`` may be ``[n]`` or ``[n, ...]`` (rows are the resampled unit; ``stat`` gets the
    resampled array). NaN interval for fewer than 2 cases."""
    x = np.asarray(values, dtype=np.float64)
    n = x.shape[0]
    est = float(stat(x)) if n else float("nan")
    if n < 2:
        return est, float("nan"), float("nan")
    idx = _rng(seed).integers(0, n, size=(n_boot, n))
    if x.ndim == 1 and stat is np.mean:  # vectorised fast path
        boots = x[idx].mean(1)
    else:
        boots = np.array([stat(x[i]) for i in idx])
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(boots, [a, 1.0 - a])
    return est, float(lo), float(hi)


def paired_bootstrap(a: Sequence[float], b: Sequence[float], *, n_boot: int = N_BOOT, level: float = LEVEL,
                     seed: int = 0) -> Tuple[float, float, float]:
    """``(mean(a − b), lo, hi)`` over paired cases (``a[i]`` and ``b[i]`` measured on the same case)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired samples must have the same shape, got {a.shape} and {b.shape}")
    return bootstrap_ci(a - b, n_boot=n_boot, level=level, seed=seed)


def ratio_bootstrap(a: Sequence[float], b: Sequence[float], *, n_boot: int = N_BOOT, level: float = LEVEL,
                    seed: int = 0) -> Tuple[float, float, float]:
    """``(mean(a) / mean(b), lo, hi)`` with cases resampled in pairs (relative score of a compressed cache ``a``
    against the full cache ``b`` on the same cases). NaN where a resample has ``mean(b) == 0``."""
    x = np.stack([np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)], 1)

    def stat(v):
        d = v[:, 1].mean()
        return v[:, 0].mean() / d if d else float("nan")

    return bootstrap_ci(x, stat, n_boot=n_boot, level=level, seed=seed)


def mcnemar(a: Sequence[int], b: Sequence[int]) -> Dict[str, float]:
    """McNemar's exact (binomial) test on paired 0/1 outcomes: ``n10`` = cases only ``a`` got right, ``n01`` = only
    ``b``; two-sided ``p = min(1, 2·P(X ≤ min(n10, n01)))`` with ``X ~ Binomial(n10 + n01, ½)`` (``p = 1`` when
    there is no discordant pair)."""
    a, b = np.asarray(a).astype(int), np.asarray(b).astype(int)
    if a.shape != b.shape:
        raise ValueError(f"paired outcomes must have the same shape, got {a.shape} and {b.shape}")
    n10 = int(((a == 1) & (b == 0)).sum())
    n01 = int(((a == 0) & (b == 1)).sum())
    n = n10 + n01
    if n == 0:
        return {"n10": n10, "n01": n01, "p": 1.0}
    k = min(n10, n01)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return {"n10": n10, "n01": n01, "p": min(1.0, 2.0 * tail)}


def verdict(lo: float, hi: float, *, better: str = "higher", margin: float = 0.0) -> str:
    """The verdict of a claim "a beats b" (``better="higher"``: the difference a − b, or a ratio minus ``margin``,
    should be > 0; ``"lower"``: < 0) from the interval ``[lo, hi]`` of that difference:

    - ``"reproduced"``: the whole interval is on the claimed side of ``margin``;
    - ``"not reproduced"``: the whole interval is on the other side (or touches ``margin`` from it);
    - ``"inconclusive"``: the interval contains ``margin`` (or is undefined).

    ``margin`` is where a claim states its own bound (LagKV: "< 5 % loss" → a ratio of 0.95), never a tolerance
    picked here."""
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return "inconclusive"
    if better == "higher":
        if lo > margin:
            return "reproduced"
        if hi <= margin:
            return "not reproduced"
        return "inconclusive"
    if better == "lower":
        if hi < margin:
            return "reproduced"
        if lo >= margin:
            return "not reproduced"
        return "inconclusive"
    raise ValueError(f"better must be 'higher' or 'lower', got {better!r}")


def head_wise(a: np.ndarray, b: np.ndarray, *, n_boot: int = N_BOOT, level: float = LEVEL,
              seed: int = 0) -> Dict[str, float]:
    """CriticalKV's head-wise statistic. ``a``, ``b``: ``[cases, heads]`` errors of two selections on the same
    cases. Per head, the paired-bootstrap interval of the mean difference a − b over cases (the same resamples
    for every head). Returns the fraction of heads whose mean error is lower under ``a`` (``lower``), and the
    fractions whose interval lies wholly below 0 (``sig_lower``) or wholly above 0 (``sig_higher``): the true
    fraction of heads improved is bounded by ``[sig_lower, 1 − sig_higher]`` (each head at its own 95 %)."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    n, h = d.shape
    if n < 2:
        nan = float("nan")
        return {"heads": h, "lower": float((d.mean(0) < 0).mean()) if n else nan, "sig_lower": nan,
                "sig_higher": nan}
    idx = _rng(seed).integers(0, n, size=(n_boot, n))
    boots = np.stack([d[i].mean(0) for i in idx])  # [n_boot, heads]
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(boots, [alpha, 1.0 - alpha], axis=0)
    return {"heads": h, "lower": float((d.mean(0) < 0).mean()), "sig_lower": float((hi < 0).mean()),
            "sig_higher": float((lo > 0).mean())}


def summarise(values: Sequence[float], *, seed: int = 0) -> Dict[str, Optional[float]]:
    """``{"n", "mean", "lo", "hi"}`` of a metric over cases."""
    est, lo, hi = bootstrap_ci(values, seed=seed)
    return {"n": len(values), "mean": est, "lo": lo, "hi": hi}
