"""Statistics for ``benchmarks/evaluate.py``: percentile-bootstrap intervals, paired comparisons, McNemar's exact
test, and the verdict rule (an interval decides, never a hand-set threshold). Plain Python + NumPy (no model, no
torch), seeded: a summary recomputed from the same records is the same summary.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

N_BOOT = 2000
LEVEL = 0.95


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
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
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


def median_ci(values: Sequence[float], level: float = LEVEL) -> Tuple[float, float, float, float]:
    """``(median, lo, hi, coverage)``: the sample median of ``values`` and the distribution-free interval
    ``[x_(k), x_(n+1-k)]`` of the population median from the order statistics. It covers the median with
    probability ``1 − 2·P(Bin(n, ½) ≤ k − 1)`` whatever the (continuous) distribution; ``k`` is the largest for which
    that is at least ``level``. With too few values for ``level`` (n < 6 at 95 %) it is ``[min, max]``, whose lower
    coverage ``1 − 2^(1−n)`` is returned: read it. NaN interval (coverage 0) for fewer than 2 values."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    n = x.shape[0]
    if n < 2:
        return (float(x[0]) if n else float("nan")), float("nan"), float("nan"), 0.0
    k = 1
    while k + 1 <= (n + 1) // 2 and 1.0 - 2.0 * _binom_cdf(k, n, 0.5) >= level:
        k += 1
    return float(np.median(x)), float(x[k - 1]), float(x[n - k]), 1.0 - 2.0 * _binom_cdf(k - 1, n, 0.5)


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
    return {"n10": n10, "n01": n01, "p": min(1.0, 2.0 * _binom_cdf(min(n10, n01), n, 0.5)) if n else 1.0}


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X ≤ k) for X ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    return sum(math.comb(n, i) * p ** i * (1.0 - p) ** (n - i) for i in range(k + 1))


def clopper_pearson(k: int, n: int, level: float = LEVEL) -> Tuple[float, float]:
    """The exact (Clopper–Pearson) interval of a binomial proportion ``k / n`` (bisection, no scipy)."""
    if n <= 0:
        return float("nan"), float("nan")
    a = (1.0 - level) / 2.0

    def solve(f):  # the p in (0, 1) where the decreasing f(p) crosses a
        lo, hi = 0.0, 1.0
        for _ in range(80):
            mid = (lo + hi) / 2.0
            if f(mid) > a:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2.0

    lower = 0.0 if k == 0 else 1.0 - solve(lambda p: 1.0 - _binom_cdf(k - 1, n, 1.0 - p))
    upper = 1.0 if k == n else solve(lambda p: _binom_cdf(k, n, p))
    return lower, upper


def paired_accuracy(a: Sequence[int], b: Sequence[int], level: float = LEVEL) -> Dict[str, float]:
    """Accuracy difference of paired 0/1 outcomes with an interval consistent with McNemar's exact test:
    ``diff = (n10 − n01) / n``; conditional on the ``d = n10 + n01`` discordant cases, the Clopper–Pearson interval
    ``[πL, πU]`` of ``π = n10 / d`` gives ``[(d/n)(2πL − 1), (d/n)(2πU − 1)]``, which excludes 0 exactly when the
    exact test's two-sided p < 1 − level. No discordant case: ``[0, 0]`` (nothing to tell the two apart)."""
    m = mcnemar(a, b)
    n = len(a)
    d = m["n10"] + m["n01"]
    diff = (m["n10"] - m["n01"]) / n if n else float("nan")
    if d == 0:
        return {**m, "n": n, "diff": diff, "lo": 0.0, "hi": 0.0}
    pl, pu = clopper_pearson(m["n10"], d, level)
    return {**m, "n": n, "diff": diff, "lo": d / n * (2 * pl - 1), "hi": d / n * (2 * pu - 1)}


def verdict(lo: float, hi: float, *, better: str = "higher", margin: float = 0.0) -> str:
    """The verdict of a claim "a beats b" from the interval ``[lo, hi]`` of a − b (or of a ratio): ``"reproduced"``
    when it lies strictly on the claimed side of ``margin`` (``better="higher"``: above, ``"lower"``: below), ``"not
    reproduced"`` strictly on the other side, ``"inconclusive"`` when it contains or touches ``margin`` or is
    undefined (a zero-width interval at ``margin``, two configurations right on the same cases, tells nothing
    apart). ``margin`` is a claim's own bound (LagKV's "< 5 % loss": a ratio of 0.95), never a tolerance picked here."""
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return "inconclusive"
    if better not in ("higher", "lower"):
        raise ValueError(f"better must be 'higher' or 'lower', got {better!r}")
    above, below = lo > margin, hi < margin
    if better == "higher":
        return "reproduced" if above else "not reproduced" if below else "inconclusive"
    return "reproduced" if below else "not reproduced" if above else "inconclusive"


def head_wise(a: np.ndarray, b: np.ndarray, *, n_boot: int = N_BOOT, level: float = LEVEL,
              seed: int = 0) -> Dict[str, float]:
    """CriticalKV's head-wise statistic. ``a``, ``b``: ``[cases, heads]`` errors of two selections on the same
    cases. Returns the fraction of heads whose mean error is lower under ``a`` (``lower``), and the fractions of
    heads whose interval of the mean difference a − b lies wholly below 0 (``sig_lower``) or wholly above 0
    (``sig_higher``). The intervals are simultaneous: mean ± c · its standard error for every head, with one c,
    the ``level`` quantile over paired bootstrap resamples of cases (the same for every head) of the largest
    studentised deviation |mean* − mean| / se* over heads. So with probability ~``level`` every head lies in its
    interval at once, and the true fraction of heads improved lies in ``[sig_lower, 1 − sig_higher]`` (per-head
    intervals would not bound it: with hundreds of heads, some 5 % of them look significant by chance)."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    n, h = d.shape
    if n < 2:
        nan = float("nan")
        return {"heads": h, "lower": float((d.mean(0) < 0).mean()) if n else nan, "sig_lower": nan,
                "sig_higher": nan}
    mean, se = d.mean(0), d.std(0, ddof=1) / np.sqrt(n)
    worst = np.empty(n_boot)
    for j, i in enumerate(np.random.default_rng(seed).integers(0, n, size=(n_boot, n))):
        x = d[i]
        se_x = x.std(0, ddof=1) / np.sqrt(n)
        worst[j] = np.divide(np.abs(x.mean(0) - mean), se_x, out=np.zeros(h), where=se_x > 0).max()
    c = float(np.quantile(worst, level))
    lo, hi = mean - c * se, mean + c * se
    return {"heads": h, "lower": float((mean < 0).mean()), "sig_lower": float((hi < 0).mean()),
            "sig_higher": float((lo > 0).mean())}


def summarise(values: Sequence[float], *, seed: int = 0) -> Dict[str, Optional[float]]:
    """``{"n", "mean", "lo", "hi"}`` of a metric over cases."""
    est, lo, hi = bootstrap_ci(values, seed=seed)
    return {"n": len(values), "mean": est, "lo": lo, "hi": hi}
