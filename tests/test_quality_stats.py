"""The statistics behind benchmarks/evaluate.py's verdicts (no model; fast)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks import evaluate_stats as S

pytestmark = pytest.mark.bench


def test_bootstrap_interval_covers_the_mean_of_a_known_distribution():
    # 300 samples of n = 50 from N(1, 2^2): a 95% percentile-bootstrap interval of the mean should cover 1 in
    # about 95% of them (the percentile interval runs slightly narrow at n = 50). Binomial(300, 0.95) has sd 3.8
    # cases, so [0.88, 0.99] is ~±2 sd wide plus the method's known undercoverage.
    rng = np.random.default_rng(123)
    hits = 0
    for i in range(300):
        x = rng.normal(1.0, 2.0, size=50)
        _, lo, hi = S.bootstrap_ci(x, n_boot=1000, seed=i)
        hits += lo <= 1.0 <= hi
    assert 0.88 <= hits / 300 <= 0.99


def test_bootstrap_interval_width_matches_the_standard_error():
    rng = np.random.default_rng(7)
    x = rng.normal(0.0, 1.0, size=400)
    est, lo, hi = S.bootstrap_ci(x, n_boot=4000, seed=1)
    se = x.std(ddof=1) / math.sqrt(len(x))
    assert est == pytest.approx(x.mean())
    assert (hi - lo) == pytest.approx(2 * 1.96 * se, rel=0.1)
    assert lo < est < hi


def test_bootstrap_is_deterministic_and_handles_tiny_samples():
    x = [0.1, 0.5, 0.3, 0.9]
    assert S.bootstrap_ci(x, seed=3) == S.bootstrap_ci(x, seed=3)
    est, lo, hi = S.bootstrap_ci([2.0])
    assert est == 2.0 and math.isnan(lo) and math.isnan(hi)
    # a constant sample has a zero-width interval
    assert S.bootstrap_ci([1, 1, 1, 1])[1:] == (1.0, 1.0)


def test_paired_bootstrap_uses_the_pairing():
    rng = np.random.default_rng(0)
    base = rng.normal(0, 10, size=60)  # large case-to-case spread
    a, b = base + 0.5, base  # a constant paired improvement
    d, lo, hi = S.paired_bootstrap(a, b)
    assert d == pytest.approx(0.5) and lo == pytest.approx(0.5) and hi == pytest.approx(0.5)
    with pytest.raises(ValueError, match="same shape"):
        S.paired_bootstrap([1, 2], [1, 2, 3])


def test_mcnemar_on_a_hand_computed_table():
    # 2x2 table: both right 20, only a right 10, only b right 2, both wrong 8
    a = [1] * 20 + [1] * 10 + [0] * 2 + [0] * 8
    b = [1] * 20 + [0] * 10 + [1] * 2 + [0] * 8
    r = S.mcnemar(a, b)
    assert (r["n10"], r["n01"]) == (10, 2)
    # exact two-sided: 2 * P(X <= 2), X ~ Bin(12, 1/2) = 2 * (1 + 12 + 66) / 4096
    assert r["p"] == pytest.approx(2 * 79 / 4096)
    # symmetric in a and b; no discordant pair -> p = 1; a balanced table -> p = 1 (capped)
    assert S.mcnemar(b, a)["p"] == pytest.approx(r["p"])
    assert S.mcnemar([1, 0, 1], [1, 0, 1])["p"] == 1.0
    assert S.mcnemar([1, 0], [0, 1])["p"] == 1.0


def test_verdict_is_read_off_the_interval():
    assert S.verdict(0.01, 0.2) == "reproduced"
    assert S.verdict(-0.2, -0.01) == "not reproduced"
    assert S.verdict(-0.5, 0.0) == "inconclusive" and S.verdict(0.0, 0.0) == "inconclusive"  # touching 0
    assert S.verdict(-0.1, 0.1) == "inconclusive"
    assert S.verdict(-0.3, -0.1, better="lower") == "reproduced"
    assert S.verdict(0.1, 0.3, better="lower") == "not reproduced"
    assert S.verdict(float("nan"), 1.0) == "inconclusive"
    # a claim's own bound: relative score >= 0.95
    assert S.verdict(0.96, 1.01, margin=0.95) == "reproduced"
    assert S.verdict(0.80, 0.94, margin=0.95) == "not reproduced"
    assert S.verdict(1.0, 1.0, margin=0.95) == "reproduced"
    assert S.verdict(0.90, 0.99, margin=0.95) == "inconclusive"
    with pytest.raises(ValueError):
        S.verdict(0, 1, better="bigger")


def test_ratio_and_head_fraction():
    r, lo, hi = S.ratio_bootstrap([1, 1, 0, 1], [1, 1, 1, 1])
    assert r == pytest.approx(0.75) and lo <= 0.75 <= hi
    rng = np.random.default_rng(5)
    b = np.array([[2.0, 1.0, 3.0]]) + rng.normal(0, 0.01, size=(40, 3))
    a = b + np.array([[-1.0, 1.0, 0.0]])
    a[:, 2] += np.where(np.arange(40) % 2, 0.01, -0.01)  # head 2: differences of mean exactly 0
    h = S.head_wise(a, b)
    # head 0 clearly lower, head 1 clearly higher, head 2 indistinguishable
    assert h["heads"] == 3 and h["sig_lower"] == pytest.approx(1 / 3) and h["sig_higher"] == pytest.approx(1 / 3)
    assert h["sig_lower"] <= h["lower"] <= 1 - h["sig_higher"]


def test_head_wise_intervals_are_simultaneous():
    """No head differs: with 200 heads, per-head 95 % intervals would call ~10 of them significant in every
    trial; simultaneous ones call any significant in ~5 % of trials (here at most 2 of 20 seeded trials)."""
    trials_with_any = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        a, b = rng.normal(1.0, 0.3, size=(30, 200)), rng.normal(1.0, 0.3, size=(30, 200))
        h = S.head_wise(a, b, n_boot=1000, seed=seed)
        trials_with_any += h["sig_lower"] + h["sig_higher"] > 0
    assert trials_with_any <= 2, trials_with_any


def test_clopper_pearson_known_values():
    # published exact intervals: 10/12 -> [0.5159, 0.9791]; 0/10 -> [0, 0.3085]; 5/10 -> [0.1871, 0.8129]
    assert S.clopper_pearson(10, 12) == pytest.approx((0.5159, 0.9791), abs=1e-4)
    assert S.clopper_pearson(0, 10) == pytest.approx((0.0, 0.3085), abs=1e-4)
    assert S.clopper_pearson(5, 10) == pytest.approx((0.1871, 0.8129), abs=1e-4)


def test_paired_accuracy_interval_agrees_with_mcnemar():
    a = [1] * 20 + [1] * 10 + [0] * 2 + [0] * 8  # the hand table above: n10 = 10, n01 = 2, n = 40
    b = [1] * 20 + [0] * 10 + [1] * 2 + [0] * 8
    r = S.paired_accuracy(a, b)
    assert r["diff"] == pytest.approx(8 / 40)
    assert (r["lo"], r["hi"]) == pytest.approx((0.3 * (2 * 0.5159 - 1), 0.3 * (2 * 0.9791 - 1)), abs=1e-4)
    assert r["p"] < 0.05 and r["lo"] > 0  # consistent with the exact test
    # 2 discordant cases, both for b: p = 0.5, and the interval contains 0
    r = S.paired_accuracy([1, 1, 0, 0, 1], [1, 1, 1, 1, 1])
    assert r["p"] == 0.5 and r["lo"] < 0 < r["hi"] and S.verdict(r["lo"], r["hi"]) == "inconclusive"
    # every case the same: nothing tells them apart
    r = S.paired_accuracy([1, 1, 1], [1, 1, 1])
    assert (r["lo"], r["hi"]) == (0.0, 0.0) and S.verdict(r["lo"], r["hi"]) == "inconclusive"
    # exhaustively: the interval excludes 0 exactly when p < 0.05
    for n10 in range(0, 12):
        for n01 in range(0, 12):
            x = [1] * n10 + [0] * n01
            y = [0] * n10 + [1] * n01
            r = S.paired_accuracy(x, y)
            if n10 + n01:
                assert (r["lo"] > 0 or r["hi"] < 0) == (r["p"] < 0.05), (n10, n01, r)


def test_median_interval_order_statistics_and_coverage():
    # hand-computed: n = 9 -> [x_(2), x_(8)], coverage 1 - 2·P(Bin(9, 1/2) <= 1) = 1 - 2·10/512; k = 3 would cover
    # only 1 - 2·46/512 = 0.82. n = 5 is too few for 95 %: [min, max] with coverage 1 - 2^-4.
    x = [9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0, 5.0]
    assert S.median_ci(x) == (5.0, 2.0, 8.0, 1 - 20 / 512)
    assert S.median_ci([3.0, 1.0, 2.0, 5.0, 4.0]) == (3.0, 1.0, 5.0, 1 - 2 / 32)
    assert S.median_ci([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], level=0.8)[1:3] == (3.0, 7.0)
    med, lo, hi, cover = S.median_ci([2.5])
    assert med == 2.5 and math.isnan(lo) and math.isnan(hi) and cover == 0.0
    # the coverage it states is the coverage it has: 4000 samples of n = 9 from an exponential (median ln 2);
    # Binomial(4000, 0.961) has sd 0.003, so +-0.012 is 4 sd
    rng = np.random.default_rng(11)
    hits = sum(lo <= math.log(2) <= hi for lo, hi in (S.median_ci(rng.exponential(size=9))[1:3] for _ in range(4000)))
    assert abs(hits / 4000 - (1 - 20 / 512)) < 0.012
