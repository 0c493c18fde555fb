"""Allocators against their oracles (budgets compared exactly) and the invariants of docs/algorithms.md §2.

AdaKV and SCORE run the shared select kernel (slow under the interpreter), so their tests use few
examples, small shapes and several checks per example; the other allocators are plain torch.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import reference.allocation as ref
import tritonkv
from tritonkv.allocation import (ALLOCATORS, AdaKV, Cake, Fixed, HeadKV, Pyramid, Score, SurfaceLogic, Uniform,
                                 adakv_budgets, adjust_budgets, cake_budgets, cake_preference, get_allocator,
                                 head_distance, head_means, head_means_from_queries, headkv_budgets,
                                 largest_remainder, pyramid_budgets, redundancy, sample_positions, score_budgets,
                                 score_head_budgets, score_layer_budgets, surfacelogic_budgets)
from tritonkv.allocation.base import floor_eps
from helpers import both_backends, on_backend  # noqa: E402

SLOW = settings(max_examples=8)


def rng_of(data):
    return np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))


def profile_of(data, L, H):
    """Continuous non-negative profiles: spread, peaked (forces capping), with zero rows/entries."""
    rng = rng_of(data)
    kind = data.draw(st.sampled_from(["exp", "peaked", "zeros", "constant"]))
    p = rng.exponential(1.0, (L, H))
    if kind == "peaked":
        p[rng.integers(L), rng.integers(H)] += 50.0 * p.sum()
    elif kind == "zeros":
        p[rng.random((L, H)) < 0.5] = 0.0
        if data.draw(st.booleans()):
            p[rng.integers(L)] = 0.0
    elif kind == "constant":
        p[:] = 0.25
    return p


# -- largest remainder -------------------------------------------------------------------------------
@given(data=st.data())
def test_largest_remainder_matches_oracle(data):
    rng = rng_of(data)
    rows, M = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 40))
    total = data.draw(st.integers(0, 400))
    w = rng.exponential(1.0, (rows, M)) * (rng.random((rows, M)) < data.draw(st.sampled_from([0.3, 1.0])))
    if data.draw(st.booleans()):  # few distinct weights: many equal fractional parts, the tie rule decides
        w = np.floor(w * 2) + (w > 0)
    x = np.where(w.sum(1, keepdims=True) > 0, total * w / np.maximum(w.sum(1, keepdims=True), 1e-300), total / M)
    cap = data.draw(st.one_of(st.none(), st.integers(0, 60)))
    got = largest_remainder(torch.from_numpy(x), total, cap=cap, weights=torch.from_numpy(w)).numpy()
    for r in range(rows):
        want = ref.largest_remainder(x[r], total, cap, w[r])
        np.testing.assert_array_equal(got[r], want)
        assert got[r].sum() == (total if cap is None else min(total, cap * M))
        if cap is not None:
            assert (got[r] <= cap).all()
        y = x[r] if cap is None else ref.cap_and_spread(x[r], cap, w[r])
        assert (got[r] >= np.floor(y - 1e-9)).all() and (got[r] <= np.floor(y + 1e-9) + 1).all()


def test_largest_remainder_ties_go_to_lower_index():
    x = torch.tensor([1.5, 1.5, 1.5, 1.5], dtype=torch.float64)
    assert largest_remainder(x, 6).tolist() == [2, 2, 1, 1]
    # excess of a capped entry is spread in proportion to the weights, then evenly over weight 0
    got = largest_remainder(torch.tensor([10.0, 1.0, 1.0, 0.0]), 12, cap=5, weights=torch.tensor([4.0, 3.0, 1.0, 0.0]))
    assert got.tolist() == [5, 5, 2, 0]
    got = largest_remainder(torch.tensor([18.0, 1.0, 1.0, 0.0]), 20, cap=5, weights=torch.tensor([4.0, 2.0, 1.0, 0.0]))
    assert got.tolist() == [5, 5, 5, 5]


@given(data=st.data())
def test_adjust_budgets_matches_oracle(data):
    rng = rng_of(data)
    L, cap = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 50))
    total = data.draw(st.integers(0, L * cap))
    p = rng.exponential(1.0, L) ** data.draw(st.sampled_from([1, 4]))
    x = total * p / p.sum()
    got = adjust_budgets(torch.from_numpy(x)[None], total, cap)[0].numpy()
    np.testing.assert_array_equal(got, ref.adjust_budgets(x, total, cap))
    assert (got >= 0).all() and (got <= cap).all() and got.sum() <= total  # the clamp can only lower a total


# -- uniform and pyramid -----------------------------------------------------------------------------
def test_uniform():
    out = Uniform()(shape=(2, 3, 50), budget=10, sink=4, window=8)
    assert out.dtype == torch.int32 and out.shape == (2, 3) and (out == 10).all()
    assert (Uniform()(scores=torch.full((1, 2, 20), float("nan")), budget=30, sink=2, window=2) == 16).all()


@given(L=st.integers(1, 40), b=st.integers(0, 300), avail=st.integers(0, 400),
       beta=st.one_of(st.just(20.0), st.floats(1.0, 60.0)), mode=st.sampled_from(["exact", "paper"]))
def test_pyramid(L, b, avail, beta, mode):
    got = pyramid_budgets(L, b, avail, beta=beta, mode=mode)
    assert got.dtype == torch.int32
    got = got.numpy()
    np.testing.assert_array_equal(got, ref.pyramid(L, b, avail, beta, mode))
    assert (np.diff(got) <= 0).all(), "non-increasing in l"
    assert (got >= 0).all() and (got <= avail).all() and got[0] <= avail
    kept = min(b, avail)
    if mode == "exact" or b >= avail:
        assert got.sum() == L * kept
    else:
        assert L * b <= got.sum() <= L * b + L * (L - 1) // 2
    if L == 1 or b >= avail:
        assert (got == kept).all()


@given(L=st.integers(2, 30), b=st.integers(1, 100), mode=st.sampled_from(["exact", "paper"]))
def test_pyramid_beta_one_is_uniform(L, b, mode):
    assert (pyramid_budgets(L, b, 10 * b, beta=1.0, mode=mode) == b).all()


def test_pyramid_object_reads_only_shapes():
    p = Pyramid()
    want = pyramid_budgets(6, 20, 100)
    for layer in range(6):
        out = p(scores=torch.full((2, 3, 112), float("nan")), budget=20, sink=4, window=8, layer=layer, num_layers=6)
        assert out.shape == (2, 3) and (out == want[layer]).all()
    assert set(p.needs) == {"layer", "num_layers"}


# -- AdaKV ---------------------------------------------------------------------------------------------
def adakv_case(data, max_bh=4):
    rng = rng_of(data)
    B = data.draw(st.integers(1, 2))
    H = data.draw(st.integers(1, max_bh // B))
    M = data.draw(st.integers(1, 90))
    kind = data.draw(st.sampled_from(["normal", "ties", "nan"]))
    s = rng.standard_normal((B, H, M)).astype(np.float32)
    if kind == "ties":
        s = rng.integers(0, 4, (B, H, M)).astype(np.float32)
    elif kind == "nan":
        s[rng.random((B, H, M)) < 0.2] = np.nan
    b = data.draw(st.integers(0, M + 2))
    alpha = data.draw(st.sampled_from([0.0, 0.2, 0.5, 0.29, 1.0]))
    return s, b, alpha


@SLOW
@given(data=st.data())
def test_adakv_matches_oracle(data):
    s, b, alpha = adakv_case(data)
    B, H, M = s.shape
    for mode in ("exact", "paper"):
        got = adakv_budgets(torch.from_numpy(s), b, alpha=alpha, mode=mode)
        assert got.dtype == torch.int32 and got.shape == (B, H)
        got = got.numpy()
        np.testing.assert_array_equal(got, ref.adakv(s, b, alpha, mode))
        kept, f = min(b, M), min(floor_eps(alpha * min(b, M)), min(b, M))
        assert (got >= (f if b < M else kept)).all() and (got <= M).all()
        if mode == "exact":
            assert (got.sum(1) == H * kept).all()
        else:
            assert (np.abs(got.sum(1) - H * kept) <= H).all()


@settings(max_examples=5)
@given(data=st.data())
def test_adakv_equivariance_and_rank_invariance(data):
    """Permuting heads permutes budgets; a strictly increasing transform of all scores (here: the
    ranks over each batch row) changes nothing; batch rows are independent."""
    rng = rng_of(data)
    B, H, M = 2, data.draw(st.integers(2, 3)), data.draw(st.integers(2, 60))
    s = rng.standard_normal((B, H, M)).astype(np.float32)  # continuous: no ties
    b = data.draw(st.integers(1, M - 1))
    alpha = data.draw(st.sampled_from([0.0, 0.5]))  # α = 0 skips the per-head kernel call (faster)
    base = adakv_budgets(torch.from_numpy(s), b, alpha=alpha)
    perm = rng.permutation(H)
    assert torch.equal(adakv_budgets(torch.from_numpy(s[:, perm].copy()), b, alpha=alpha), base[:, perm])
    ranks = np.argsort(np.argsort(s.reshape(B, -1), axis=1), axis=1).reshape(B, H, M).astype(np.float32)
    ranks = ranks * 1e-3 - 7.0  # still strictly increasing (integers below 2^24 scale exactly enough)
    assert torch.equal(adakv_budgets(torch.from_numpy(ranks), b, alpha=alpha), base)
    assert torch.equal(adakv_budgets(torch.from_numpy(s[1:]), b, alpha=alpha), base[1:])


@settings(max_examples=3)
@given(data=st.data())
def test_adakv_alpha_one_and_identical_heads(data):
    rng = rng_of(data)
    H, M = data.draw(st.integers(1, 4)), data.draw(st.integers(2, 80))
    b = data.draw(st.integers(1, M - 1))
    s = rng.standard_normal((1, H, M)).astype(np.float32)
    assert (adakv_budgets(torch.from_numpy(s), b, alpha=1.0) == b).all()
    same = np.repeat(s[:, :1], H, axis=1)
    got = adakv_budgets(torch.from_numpy(same), b, alpha=0.2)
    assert (got - b).abs().max() <= 1 and got.sum() == H * b


def test_adakv_object_ignores_protected_tokens():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(1, 3, 40, generator=g)
    out = AdaKV()(scores=s, budget=8, sink=2, window=4)
    s2 = s.clone()
    s2[:, 0, :2] = 1e9  # huge scores on protected positions must not pull budget to head 0
    s2[:, 1, -4:] = 1e9
    assert torch.equal(AdaKV()(scores=s2, budget=8, sink=2, window=4), out)
    assert torch.equal(out, adakv_budgets(s[:, :, 2:36], 8))


# -- HeadKV and SurfaceLogicKV -----------------------------------------------------------------------
@given(data=st.data(), mode=st.sampled_from(["exact", "paper"]))
def test_headkv(data, mode):
    L, H = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 6))
    p = profile_of(data, L, H)
    b, avail = data.draw(st.integers(0, 120)), data.draw(st.integers(0, 160))
    beta = data.draw(st.sampled_from([1.0, 1.01, 1.5, 3.0, 10.0]))
    got = headkv_budgets(torch.from_numpy(p), b, avail, beta=beta, mode=mode)
    assert got.dtype == torch.int32 and got.shape == (L, H)
    got = got.numpy()
    np.testing.assert_array_equal(got, ref.headkv(p, b, avail, beta, 1.0, mode))
    kept = min(b, avail)
    assert (got <= avail).all() and (got >= 0).all()
    if b < avail:
        assert (got >= b - floor_eps(b / beta)).all(), "every head keeps its fixed share"
    if mode == "exact":
        assert got.sum() == L * H * kept
    tau = data.draw(st.sampled_from([0.5, 2.0]))
    np.testing.assert_array_equal(headkv_budgets(torch.from_numpy(p), b, avail, beta=beta, tau=tau, mode=mode).numpy(),
                                  ref.headkv(p, b, avail, beta, tau, mode))


@given(data=st.data())
def test_headkv_permutation_and_large_beta(data):
    L, H = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
    p = rng_of(data).exponential(1.0, (L, H))
    b, avail = data.draw(st.integers(1, 80)), data.draw(st.integers(1, 120))
    base = headkv_budgets(torch.from_numpy(p), b, avail)
    perm = rng_of(data).permutation(L * H)
    flat = headkv_budgets(torch.from_numpy(p.reshape(-1)[perm].reshape(L, H).copy()), b, avail)
    np.testing.assert_array_equal(flat.reshape(-1).numpy(), base.reshape(-1).numpy()[perm])
    assert (headkv_budgets(torch.from_numpy(p), b, avail, beta=1e9) == min(b, avail)).all()


@given(data=st.data(), mode=st.sampled_from(["strict", "paper"]))
def test_surfacelogic(data, mode):
    L, H = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 6))
    inf = profile_of(data, L, H)
    if data.draw(st.booleans()):  # layers far below the 0.01 floor
        inf[: max(L // 2, 1)] *= 1e-4
    b, avail = data.draw(st.integers(0, 120)), data.draw(st.integers(0, 160))
    rho = data.draw(st.sampled_from([1.351, 1.0, 2.0]))
    got = surfacelogic_budgets(torch.from_numpy(inf), b, avail, rho=rho, mode=mode)
    assert got.dtype == torch.int32 and got.shape == (L, H)
    got = got.numpy()
    np.testing.assert_array_equal(got, ref.surfacelogic(inf, b, avail, rho, 0.01, mode))
    kept = min(b, avail)
    assert (got <= avail).all() and (got >= 0).all()
    if b >= avail:
        return
    small = floor_eps(b / rho)
    fixed, pool = b - small, small * L * H
    assert (got >= fixed).all(), "every head keeps its fixed share"
    tot = inf.sum()
    imp = np.maximum(inf.sum(1) / tot if tot > 0 else np.full(L, 1 / L), 0.01)
    uncapped = fixed + pool * imp.max() / (imp.sum() if mode == "strict" else 1.0) <= avail
    if mode == "strict":
        assert got.sum() == L * H * kept
        if uncapped:  # each layer's dynamic share >= its floor
            assert ((got - fixed).sum(1) >= 0.01 * pool / imp.sum() - H).all()
    elif uncapped:  # paper mode keeps the overshoot pool·(ΣI' − 1), up to per-entry rounding
        assert abs(got.sum() - (L * H * fixed + pool * imp.sum())) <= L * H / 2 + 1e-6


def test_surfacelogic_floor_renormalised_only_in_strict_mode():
    inf = np.random.default_rng(0).exponential(1.0, (4, 3))
    inf[:2] *= 1e-4  # two layers far below the 0.01 floor
    strict = surfacelogic_budgets(torch.from_numpy(inf), 20, 1000)
    paper = surfacelogic_budgets(torch.from_numpy(inf), 20, 1000, mode="paper")
    np.testing.assert_array_equal(strict.numpy(), ref.surfacelogic(inf, 20, 1000))
    assert strict.sum() == 240 and paper.sum() > 240
    assert (strict[:2] - 6).sum() >= 0.01 * 14 * 12 / 1.02 - 3


@given(data=st.data())
def test_surfacelogic_permuting_heads_within_a_layer(data):
    L, H = data.draw(st.integers(1, 5)), data.draw(st.integers(2, 6))
    inf = rng_of(data).exponential(1.0, (L, H))
    b, avail = data.draw(st.integers(1, 80)), data.draw(st.integers(1, 120))
    base = surfacelogic_budgets(torch.from_numpy(inf), b, avail).numpy()
    perm = rng_of(data).permutation(H)
    l = data.draw(st.integers(0, L - 1))
    inf2 = inf.copy()
    inf2[l] = inf[l, perm]
    want = base.copy()
    want[l] = base[l, perm]
    np.testing.assert_array_equal(surfacelogic_budgets(torch.from_numpy(inf2), b, avail).numpy(), want)


def test_profile_objects():
    p = torch.rand(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = headkv_budgets(p.view(4, 3, 2).mean(-1), 10, 40)  # a query-head profile is averaged per group
    for obj in (HeadKV(profile=p), HeadKV()):
        out = obj(shape=(2, 3, 50), budget=10, sink=4, window=6, layer=2, profile=None if obj.profile is not None else p)
        assert out.shape == (2, 3) and torch.equal(out, want[2].expand(2, 3))
    assert "profile" in HeadKV().needs and "profile" not in HeadKV(profile=p).needs
    sl = SurfaceLogic(profile=p)
    assert torch.equal(sl(shape=(1, 3, 50), budget=10, sink=4, window=6, layer=1),
                       surfacelogic_budgets(p.view(4, 3, 2).mean(-1), 10, 40)[1:2])
    with pytest.raises(ValueError, match="profile"):
        SurfaceLogic(profile_name="no-such-profile")(shape=(1, 3, 50), budget=10, layer=0)
    with pytest.raises(ValueError, match="profile"):
        HeadKV()(shape=(1, 3, 50), budget=10, layer=0)
    with pytest.raises(ValueError, match="profile"):
        HeadKV(profile=-p)
    with pytest.raises(ValueError, match="layer"):
        HeadKV(profile=p)(shape=(1, 3, 50), budget=10, layer=4)
    with pytest.raises(ValueError, match="num_layers"):
        HeadKV(profile=p)(shape=(1, 3, 50), budget=10, layer=1, num_layers=5)



@pytest.mark.parametrize("fn", [headkv_budgets, surfacelogic_budgets])
def test_budget_functions_refuse_nonfinite_profiles(fn):
    """NaN, inf or a negative entry is a ValueError, not budgets of -2**31 or plausible-looking ones."""
    p = torch.rand(4, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for bad in (float("nan"), float("inf"), -float("inf"), -0.5):
        q = p.clone()
        q[1, 2] = bad
        for given in (q, q.to(torch.float32), q.numpy(), q.tolist()):
            with pytest.raises(ValueError, match="profile must be finite and non-negative"):
                fn(given, 10, 40)
    assert int(fn(p, 10, 40).sum()) == 4 * 3 * 10


def test_query_head_profile_must_have_the_models_query_heads():
    """With queries (H_q known) a profile is [L, H_kv] or [L, H_q]; another multiple of H_kv is refused (it would be
    averaged over groups of the wrong size). Without them any multiple of H_kv is taken, as before."""
    g = torch.Generator().manual_seed(5)
    p6, p9 = torch.rand(4, 6, generator=g), torch.rand(4, 9, generator=g)
    q9, q6 = torch.randn(1, 9, 4, 8, generator=g), torch.randn(1, 6, 4, 8, generator=g)
    kw = dict(shape=(1, 3, 50), budget=10, layer=1, num_layers=4)
    for obj, fn in ((HeadKV(), headkv_budgets), (SurfaceLogic(), surfacelogic_budgets)):
        for p, q in ((p9, q9), (p6, q6), (p9[:, :3], q9), (p6, None)):
            want = fn(p.double().view(4, 3, -1).mean(-1), 10, 50)[1]
            assert torch.equal(obj(**kw, profile=p, **({} if q is None else {"queries": q}))[0], want)
        with pytest.raises(ValueError, match="expected H_kv = 3 or H_q = 9"):
            obj(**kw, profile=p6, queries=q9)
        with pytest.raises(ValueError, match="expected H_kv = 3 or H_q = 9"):
            type(obj)(profile=p6)(**kw, queries=q9)
    k = v = torch.randn(1, 3, 50, 8, generator=g)
    with pytest.raises(ValueError, match="expected H_kv = 3 or H_q = 9"):
        tritonkv.compress((k, v), tritonkv.policies.SnapKV(window=4), 20, allocation=HeadKV(profile=p6), layer=0,
                          num_layers=4, queries=q9)


def test_surfacelogic_rereads_a_rewritten_profile_file(tmp_path):
    """``profile_name`` as a path: a file rewritten in place gives its new budgets (a shipped name is read once)."""
    import json
    import os

    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"infsc_kv_heads": [[1.0, 0.0], [1.0, 0.0]]}))
    sl = SurfaceLogic(profile_name=str(path))
    first = sl(shape=(1, 2, 64), budget=16, layer=0, num_layers=2)
    assert first[0, 0] > first[0, 1]
    st = os.stat(path)
    path.write_text(json.dumps({"infsc_kv_heads": [[0.0, 1.0], [0.0, 1.0]]}))  # the same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a later write, whatever the clock's resolution
    for obj in (sl, SurfaceLogic(profile_name=str(path))):
        assert torch.equal(obj(shape=(1, 2, 64), budget=16, layer=0, num_layers=2), first.flip(-1))

def test_a_profile_written_through_numpy_gives_its_new_budgets():
    """The table an allocator computes once per profile object follows a write that bumps no version counter (a
    NumPy view's, ``.data``'s): the budgets are those of the profile as it is at the call."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 4, 200, 16, generator=g), torch.randn(1, 4, 200, 16, generator=g)
    arr = np.array([[1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    prof = torch.from_numpy(arr)
    lengths = lambda p: tritonkv.compress((k, v), "knorm", 40, allocation="headkv", layer=0, profile=p).lengths
    before = lengths(prof)
    arr[0] = [8.0, 0.1, 0.1, 0.1]
    after, fresh = lengths(prof), lengths(prof.clone())  # a new object: computed anew
    assert torch.equal(after, fresh) and not torch.equal(after, before), (before, after, fresh)


# -- SCORE ---------------------------------------------------------------------------------------------
def score_case(data):
    rng = rng_of(data)
    L, B, H, G = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), \
        data.draw(st.integers(1, 2))
    K, n = data.draw(st.integers(1, 3)), data.draw(st.integers(2, 10))
    rows = rng.exponential(1.0, (L, B, H * G, K, n))
    rows[rng.random(rows.shape) < 0.4] = 0.0
    rows /= np.maximum(rows.sum(-1, keepdims=True), 1e-30)
    M = data.draw(st.integers(1, 40))
    scores = rng.standard_normal((L, B, H, M)).astype(np.float32)
    return rows, scores, data.draw(st.integers(0, M + 1)), M


@SLOW
@given(data=st.data(), mode=st.sampled_from(["exact", "paper"]))
def test_score_matches_oracle(data, mode):
    rows, scores, b, M = score_case(data)
    L, B, H, _ = scores.shape
    m = head_means(torch.from_numpy(rows))
    got, hd = score_budgets(m, torch.from_numpy(scores), b, M, mode=mode)
    want, want_hd = ref.score(rows, scores, b, M, mode=mode)
    np.testing.assert_allclose(hd.numpy(), want_hd, rtol=1e-5, atol=1e-6)
    assert got.dtype == torch.int32 and got.shape == (L, B, H)
    np.testing.assert_array_equal(got.numpy(), want)
    got = got.numpy()
    assert (got >= 0).all() and (got <= M).all()
    if mode == "exact":
        assert (got.sum((0, 2)) == L * H * min(b, M)).all()
    # the Allocator object gives each layer's row, reading only the selectable scores
    obj, sink, window = Score(mode=mode), 2, 1
    full = np.concatenate([np.full((L, B, H, sink), 9.0, np.float32), scores, np.zeros((L, B, H, window), np.float32)], -1)
    l = data.draw(st.integers(0, L - 1))
    out = obj(scores=torch.from_numpy(full[l]), budget=b, sink=sink, window=window, layer=l, head_means=m)
    np.testing.assert_array_equal(out.numpy(), got[l])


@given(data=st.data())
def test_score_statistics(data):
    """D symmetric in [0, 1] (the cosine shortcut equals the pairwise definition); layer/head stats
    match the oracle."""
    rows, _, _, _ = score_case(data)
    L, B, Hq = rows.shape[:3]
    m = head_means(torch.from_numpy(rows))
    d = head_distance(m[0, 0]).numpy()
    np.testing.assert_array_equal(d, d.T)
    assert (d >= 0).all() and (d <= 1).all()
    for i in range(Hq):
        for j in range(Hq):
            assert abs(d[i, j] - ref.head_distance_rows(rows[0, 0, i], rows[0, 0, j])) < 1e-6
    ir, td, hd = redundancy(m)
    for r in range(B):
        wir, wtd, whd = ref.score_stats(rows[:, r])
        np.testing.assert_allclose(ir[r].numpy(), wir, atol=1e-6)
        np.testing.assert_allclose(td[r].numpy(), wtd, atol=1e-6)
        np.testing.assert_allclose(hd[:, r].numpy(), whd, atol=1e-6)


@given(data=st.data())
def test_score_layer_budgets(data):
    rng = rng_of(data)
    B, L, H = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 12)), data.draw(st.integers(1, 4))
    avail = data.draw(st.integers(1, 100))
    b = data.draw(st.integers(0, avail))
    ir = rng.random((B, L)) ** data.draw(st.sampled_from([1, 8]))
    td = rng.random((B, L)) * data.draw(st.sampled_from([0, 1]))
    for mode in ("exact", "paper"):
        got = score_layer_budgets(torch.from_numpy(ir), torch.from_numpy(td), b, H, avail, mode=mode).numpy()
        assert (got <= H * avail).all() and (got >= 0).all()
        for r in range(B):
            np.testing.assert_array_equal(got[r], ref.score_layers(ir[r], td[r], b, H, avail, mode=mode))
        if mode == "exact":
            assert (got.sum(1) == L * H * b).all()
    equal = score_layer_budgets(torch.full((B, L), 0.3, dtype=torch.float64), torch.zeros(B, L, dtype=torch.float64),
                                b, H, avail)
    assert (equal == H * b).all(), "equal N_l give uniform layers"


@settings(max_examples=6)
@given(data=st.data())
def test_score_head_budgets_invariants(data):
    rng = rng_of(data)
    B, H, M = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 50))
    s = torch.from_numpy(rng.standard_normal((B, H, M)).astype(np.float32))
    bl = torch.from_numpy(rng.integers(0, H * M + 1, B)).to(torch.int32)
    t = torch.stack([torch.from_numpy(np.bincount(ref.select_row(s[r].reshape(-1).numpy(), int(bl[r])) // M,
                                                  minlength=H)) for r in range(B)]).to(torch.int32)
    equal = score_head_budgets(s, bl, torch.full((B, H), 0.4))
    assert torch.equal(equal, t), "equal HD give B_{l,h} = T_h"
    hd = torch.from_numpy(rng.random((B, H)) + 1e-3)
    got = score_head_budgets(s, bl, hd)
    assert torch.equal(got.sum(1), bl) and (got >= 0).all() and (got <= M).all()
    assert ((t == 0) <= (got == 0)).all(), "a head with no token in the layer's top keeps none"


def test_score_sampling_and_head_means_from_queries():
    a, b = sample_positions(500, 200, 32, seed=3), sample_positions(500, 200, 32, seed=3)
    assert torch.equal(a, b) and len(set(a.tolist())) == 200 and a.min() >= 32 and a.max() < 468
    assert len(sample_positions(100, 200, 32)) == 36 and len(sample_positions(60, 200, 32)) == 0
    g = torch.Generator().manual_seed(0)
    B, H, G, N, D = 1, 2, 2, 12, 8
    keys = torch.randn(B, H, N, D, generator=g)
    pos = torch.tensor([3, 7, 11])
    q = torch.randn(B, H * G, 3, D, generator=g)
    m = head_means_from_queries(q, keys, pos, chunk=2)
    kk = keys.repeat_interleave(G, dim=1)  # test-side reference only
    logits = torch.einsum("bqkd,bqnd->bqkn", q, kk) / D ** 0.5
    logits = logits.masked_fill(torch.arange(N)[None, :] > pos[:, None], -torch.inf)
    torch.testing.assert_close(m, head_means(torch.softmax(logits, -1)), rtol=1e-5, atol=1e-6)


def test_score_without_positions_is_uniform():
    s = torch.randn(2, 1, 3, 20)
    out, hd = score_budgets(None, s, 5, 20)
    assert (out.sum(-1) == 15).all() and (hd == 1).all()


# -- CAKE ----------------------------------------------------------------------------------------------
@given(data=st.data(), mode=st.sampled_from(["exact", "paper"]))
def test_cake(data, mode):
    rng = rng_of(data)
    L, avail = data.draw(st.integers(1, 10)), data.draw(st.integers(1, 80))
    b = data.draw(st.integers(0, avail + 2))
    attn = rng.exponential(1.0, (L, 2, 3, 4, 9))
    attn /= attn.sum(-1, keepdims=True)
    pref = torch.stack([cake_preference(torch.from_numpy(attn[l])) for l in range(L)])  # [L, B]
    for r in range(2):
        np.testing.assert_allclose(pref[:, r].numpy(), [ref.cake_preference(attn[l, r]) for l in range(L)], rtol=1e-9)
    pref = pref ** data.draw(st.sampled_from([1.0, 6.0]))
    got = cake_budgets(pref, b, avail, mode=mode).numpy()
    for r in range(2):
        np.testing.assert_array_equal(got[r], ref.cake(pref[:, r].numpy(), b, avail, mode))
    assert (got >= 0).all() and (got <= avail).all()
    if mode == "exact":
        assert (got.sum(1) == L * min(b, avail)).all()
    np.testing.assert_array_equal(cake_budgets(pref * 1024.0, b, avail, mode=mode).numpy(), got)


# -- registry and interface -------------------------------------------------------------------------
def test_registry_and_errors():
    assert {"uniform", "pyramid", "adakv", "headkv", "surfacelogic", "score", "cake", "fixed"} <= set(ALLOCATORS)
    assert isinstance(get_allocator("pyramid"), Pyramid) and get_allocator(AdaKV).alpha == 0.2
    a = AdaKV(alpha=0.5)
    assert get_allocator(a) is a and tritonkv.get_allocator("uniform").name == "uniform"
    with pytest.raises(ValueError, match="uniform"):
        get_allocator("nope")
    with pytest.raises(TypeError, match="allocation"):
        get_allocator(3)
    with pytest.raises(ValueError, match="budget"):
        Uniform()(shape=(1, 1, 10), budget=-1)
    with pytest.raises(ValueError, match="sink"):
        Uniform()(shape=(1, 1, 10), budget=2, sink=8, window=4)
    with pytest.raises(ValueError, match="num_layers"):
        Pyramid()(shape=(1, 1, 10), budget=2, layer=0)
    with pytest.raises(ValueError, match="mode"):
        AdaKV(mode="fast")
    with pytest.raises(ValueError, match="alpha"):
        AdaKV(alpha=2.0)
    with pytest.raises(ValueError, match="beta"):
        Pyramid(beta=0.0)
    for bad in (0.5, float("inf")):  # below 1 the ramp would rise with the layer; the docs' beta >= 1
        with pytest.raises(ValueError, match="beta"):
            Pyramid(beta=bad)
    with pytest.raises(ValueError, match="gamma"):
        Score(gamma=2.0)  # a moving average's weight, in [0, 1]
    with pytest.raises(ValueError, match="tau"):
        HeadKV(profile=torch.ones(2, 2), tau=float("inf"))
    assert AdaKV(alpha=np.float32(0.25)).alpha == np.float32(0.25)  # NumPy numbers are numbers
    inf_profile = torch.tensor([[1.0, float("inf")], [1.0, 2.0]])
    for cls in (HeadKV, SurfaceLogic):
        with pytest.raises(ValueError, match="profile must be finite"):
            cls(profile=inf_profile)
    kv = torch.randn(1, 2, 12, 4)
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="layer_preference must be finite"):
            tritonkv.compress((kv, kv), "knorm", 4, allocation="cake", layer=0,
                              layer_preference=torch.tensor([1.0, bad, 2.0]))
        means = [torch.randn(1, 4, 6) for _ in range(3)]
        means[1][0, 0, 0] = bad
        with pytest.raises(ValueError, match="head_means must be finite"):
            tritonkv.compress((kv, kv), "knorm", 4, allocation="score", layer=1, head_means=means)
    with pytest.raises(ValueError, match="head_means"):
        Score()(scores=torch.zeros(1, 2, 10), budget=2, layer=0)
    with pytest.raises(ValueError, match="layer_preference"):
        Cake()(shape=(1, 2, 10), budget=2, layer=0)
    fixed = Fixed(torch.tensor([[3, 9], [1, 2]]))
    assert fixed(shape=(2, 2, 10), budget=4, sink=1, window=1, layer=0).tolist() == [[3, 8], [3, 8]]
    assert Cake()(shape=(2, 3, 20), budget=4, layer=1, layer_preference=torch.tensor([1.0, 3.0])).tolist() == [[6] * 3] * 2


@given(data=st.data())
def test_cross_layer_table_at_the_sequence_length(data):
    """With ``seq_len`` (block-wise: a layer's view is shorter than the sequence), an allocator over every layer
    reads its table at ``seq_len - sink - window`` and caps the row at the layer's own avail; one that allocates
    within a layer (uniform, adakv) ignores it."""
    L, H = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 4))
    sink, window = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    N = data.draw(st.integers(sink + window, 90))
    S = data.draw(st.integers(N, 160))
    b, l = data.draw(st.integers(0, 100)), data.draw(st.integers(0, L - 1))
    p = profile_of(data, L, H)
    t, row = S - sink - window, N - sink - window
    want = {"headkv": ref.headkv(p, b, t), "surfacelogic": ref.surfacelogic(p, b, t),
            "pyramid": np.broadcast_to(np.asarray(ref.pyramid(L, b, t))[:, None], (L, H))}
    for name, table in want.items():
        got = get_allocator(name)(shape=(1, H, N), budget=b, sink=sink, window=window, layer=l, num_layers=L,
                                  seq_len=S, profile=torch.from_numpy(p))
        np.testing.assert_array_equal(got[0].numpy(), np.minimum(table[l], row), err_msg=name)
    s = torch.from_numpy(rng_of(data).standard_normal((1, H, N)).astype(np.float32))
    for name in ("uniform", "adakv"):
        kw = dict(scores=s, budget=b, sink=sink, window=window)
        assert torch.equal(get_allocator(name)(seq_len=S, **kw), get_allocator(name)(**kw)), name
    for name in ("pyramid", "uniform"):
        with pytest.raises(ValueError, match="seq_len"):
            get_allocator(name)(shape=(1, H, N), budget=b, layer=0, num_layers=L, seq_len=-1)


@given(data=st.data())
def test_compress_reads_the_cross_layer_table_at_the_budget_given(data):
    """``compress`` with ``seq_len`` on a layer whose view holds fewer tokens than the budget (block-wise: a layer
    the table gives few tokens): its heads get the row of the same table as every other layer, at the budget as
    given, capped at the view (not a table computed at the view's length, which shrank such a layer further)."""
    L, H = data.draw(st.integers(2, 5)), data.draw(st.integers(1, 3))
    N = data.draw(st.integers(2, 40))
    S = data.draw(st.integers(N + 1, 200))
    b, l = data.draw(st.integers(N, S)), data.draw(st.integers(0, L - 1))
    p = profile_of(data, L, H)
    keys = torch.from_numpy(rng_of(data).standard_normal((1, H, N, 8)).astype(np.float32))
    cases = {"headkv": (ref.headkv(p, b, S), dict(profile=torch.from_numpy(p))),
             "pyramid": (np.broadcast_to(np.asarray(ref.pyramid(L, b, S))[:, None], (L, H)), {})}
    for name, (table, extra) in cases.items():
        out = tritonkv.compress((keys, keys), "knorm", b, allocation=name, layer=l, num_layers=L, seq_len=S, **extra)
        np.testing.assert_array_equal(out.lengths[0].numpy(), np.minimum(table[l], N), err_msg=name)


@given(data=st.data())
@settings(max_examples=25)
def test_compress_with_an_allocation_keeps_every_forced_token(data):
    """``forced`` tokens are kept like the sink and window with an allocation too: every head's budget holds its
    forced tokens beside its share (a head the allocator gives few or no tokens keeps them). AdaKV keeps at most
    H·b in all (exactly H·b with no forced token; less only where a head's share and the reserve exceed its row),
    and every token at a budget >= N; more forced tokens in a row than the budget is a ValueError, not a silent
    drop."""
    H, N = data.draw(st.integers(1, 4)), data.draw(st.integers(4, 40))
    k = data.draw(st.integers(1, N))
    g = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    keys = torch.from_numpy(g.standard_normal((1, H, N, 8)).astype(np.float32))
    counts = [data.draw(st.integers(0, k)) for _ in range(H)]
    forced = torch.zeros(1, H, N, dtype=torch.bool)
    for h, c in enumerate(counts):
        forced[0, h, torch.from_numpy(g.permutation(N)[:c])] = True
    for name, extra in (("pyramid", dict(layer=1, num_layers=2)), ("adakv", {}), ("uniform", {})):
        out = tritonkv.compress((keys, keys), "knorm", k, allocation=name, forced=forced, **extra)
        K, V, lengths, idx = out.to_padded(with_positions=True)
        for h in range(H):
            held = set(idx[0, h, :int(lengths[0, h])].tolist())
            assert set(forced[0, h].nonzero().flatten().tolist()) <= held, (name, h)
        if name == "adakv":
            total = int(lengths.sum())
            assert total == H * k if not any(counts) else total <= H * k
        if k == N:
            assert lengths.tolist() == [[N] * H], name
    forced[0, 0] = True
    if k < N:
        with pytest.raises(ValueError, match="forced"):
            tritonkv.compress((keys, keys), "knorm", k, allocation="adakv", forced=forced)


def test_dense_compress_with_more_protected_tokens_than_the_budget():
    """A dense ``compress`` reads nothing back, so it does not refuse a ``forced`` mask that, with the sink and
    window, exceeds the budget (an allocation does, above): the documented rule keeps the lowest-index protected
    tokens, the window's newest lost first; within the budget every protected token is kept."""
    from tritonkv.policies import Knorm

    keys = torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(0))
    forced = torch.zeros(1, 2, 16, dtype=torch.bool)
    forced[..., 3:10] = True  # sink 0, forced 3-9, window 14-15: ten protected tokens
    got = tritonkv.compress((keys, keys), Knorm(sink=1, window=2), 6, forced=forced).indices
    assert got.tolist() == [[[0, 3, 4, 5, 6, 7]] * 2]
    got = tritonkv.compress((keys, keys), Knorm(sink=1, window=2), 11, forced=forced).indices
    assert all({0, *range(3, 10), 14, 15} <= set(row) for row in got[0].tolist())


def test_score_table_at_the_sequence_length_fits_the_row():
    """SCORE's layer totals read at ``seq_len``, each lowered to what the layer's row holds (H·avail)."""
    g = torch.Generator().manual_seed(0)
    L, H, N = 3, 2, 12
    m = head_means(torch.rand(L, 1, H, 6, 8, generator=g))
    s = torch.randn(1, H, N, generator=g)
    for b in (8, 11, 30):  # layer totals below and above what a row holds
        table = score_layer_budgets(*redundancy(m, 0.5)[:2], b, H, 400)[0]
        for l in range(L):
            out = Score()(scores=s, budget=b, layer=l, head_means=m, seq_len=400)
            assert int(out.max()) <= N and int(out.sum()) == min(H * N, int(table[l]))


@both_backends
def test_score_head_means_as_a_list_is_cached_per_object(backend):
    """Head means given as a list of per-layer tensors allocate as the stacked tensor does; the layer totals are
    computed once for those objects (no read-back per call) and again after an in-place change or a new element."""
    from tritonkv.allocation import base

    g = torch.Generator().manual_seed(5)
    L, B, H, N = 4, 2, 3, 40
    m = head_means(torch.rand(L, B, 2 * H, 5, 30, generator=g))
    keys = torch.randn(B, H, N, 8, generator=g)
    items = list(m.clone())

    def run(hm, layer):
        out = tritonkv.compress((keys, keys), "knorm", 0.3, allocation="score", layer=layer, head_means=hm)
        return out.lengths

    with on_backend(backend):
        for layer in range(L):
            assert torch.equal(run(items, layer), run(m, layer)), layer
        cached = len(base._MEMO)
        run(items, 1)
        assert len(base._MEMO) == cached  # a hit: nothing recomputed
        items[2].mul_(torch.rand(B, 2 * H, 30, generator=g))  # in place: a new version
        m2 = torch.stack(items)
        for layer in range(L):
            assert torch.equal(run(items, layer), run(m2, layer)), layer
        items[0] = torch.flip(items[0], (1,))  # a new object in the list
        m3 = torch.stack(items)
        assert torch.equal(run(items, 0), run(m3, 0))


def test_layer_budgets_adds_protected_tokens():
    from tritonkv.api import layer_budgets

    s = torch.randn(1, 3, 40, generator=torch.Generator().manual_seed(2))
    out = layer_budgets("adakv", s, 14, sink=2, window=4)
    assert torch.equal(out, adakv_budgets(s[:, :, 2:36], 8) + 6) and out.dtype == torch.int32


def test_surfacelogic_loads_the_shipped_profile_lazily(monkeypatch):
    from tritonkv.allocation import profiler, surfacelogic

    prof = torch.rand(5, 3, generator=torch.Generator().manual_seed(4))
    seen = []
    monkeypatch.setattr(profiler, "load_profile", lambda name: seen.append(name) or prof)
    surfacelogic._shipped.cache_clear()
    try:
        out = SurfaceLogic()(shape=(2, 3, 64), budget=16, sink=4, window=4, layer=3, num_layers=5)
    finally:
        surfacelogic._shipped.cache_clear()
    assert seen == [surfacelogic.DEFAULT_PROFILE]
    assert torch.equal(out, surfacelogic_budgets(prof, 16, 56)[3].expand(2, 3))


def test_compress_with_allocation():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 3, 40, 16, generator=g), torch.randn(1, 3, 40, 16, generator=g)
    out = tritonkv.compress((k, v), "knorm", 12, allocation="pyramid", layer=0, num_layers=4)
    assert out.lengths.tolist() == [[int(pyramid_budgets(4, 12, 40)[0])] * 3]
    out = tritonkv.compress((k, v), "knorm", 12, allocation="adakv")
    assert out.lengths.sum() == 36 and torch.equal(out.lengths, adakv_budgets(tritonkv.get_policy("knorm").score(k, v), 12))


class _Given(tritonkv.policies.Policy):
    """A plain top-k policy whose scores are given (``compress`` sees them as its own)."""

    name = ""

    def __init__(self, scores, sink, window):
        super().__init__(sink=sink, window=window)
        self.scores = scores

    def score(self, keys, values, **inputs):
        return self.scores


@both_backends
@SLOW
@given(data=st.data())
def test_compress_with_adakv_keeps_the_oracles_selection(backend, data):
    """``compress(..., allocation="adakv")`` (exact mode: the global winners copied into rows, no per-head select)
    against the NumPy oracles: each head keeps ``ref.adakv``'s budget of its selectable tokens plus the protected
    ones, and its kept tokens are ``reference.select``'s top-k of that budget — ties, NaN scores and edge budgets
    included; also with a paper-mode allocator (a per-head select of its budgets, sized by a static bound)."""
    from reference.select import select as ref_select

    s, b, alpha = adakv_case(data)
    B, H, M = s.shape
    sink, window = data.draw(st.integers(0, 2)), data.draw(st.integers(0, 3))
    b = max(b, 1 - sink - window)  # compress keeps at least one token
    N = M + sink + window
    scores = np.concatenate([np.zeros((B, H, sink), np.float32), s, np.zeros((B, H, window), np.float32)], 2)
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(B, H, N, 16, generator=g), torch.randn(B, H, N, 16, generator=g)
    pol = _Given(torch.from_numpy(scores), sink, window)
    for mode in ("exact", "paper"):
        with on_backend(backend):
            out = tritonkv.compress((keys, values), pol, b + sink + window, allocation=AdaKV(alpha=alpha, mode=mode))
        want = ref.adakv(s, b, alpha, mode) + sink + window
        assert out.lengths.tolist() == want.tolist(), mode
        K, V, L, P = out.to_padded(with_positions=True)
        for r in range(B * H):
            kept = ref_select(scores[r // H, r % H], want.flat[r], sink, window)
            assert P[r // H, r % H, :len(kept)].tolist() == kept.tolist(), (mode, r)
            assert torch.equal(K[r // H, r % H, :len(kept)], keys[r // H, r % H, kept])
        if mode == "exact" and 0 < b < M:  # the static size: H·(b + sink + window) per batch row + 16 per row
            assert out.keys.shape[0] == B * H * (b + sink + window + 16)


@pytest.mark.parametrize("name", ["knorm", "snapkv"])
def test_adakv_reuses_the_scoring_kernels_first_pass(name):
    """With a scoring kernel that counts the select's first radix pass (Knorm, SnapKV's pooling kernel), AdaKV's
    per-head select reuses it: the kept tokens are those of the same scores given as they are (no first pass to
    reuse; checked against the oracles above), over budgets that leave many ties and every edge of the per-head
    select."""
    from tritonkv.policies import Knorm, SnapKV

    B, H, N, D = 2, 3, 70, 16
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    keys[:, :, 10:30] = keys[:, :, 10:11]  # equal scores across the threshold
    inputs = {"queries": torch.randn(B, 2 * H, 6, D, generator=g)} if name == "snapkv" else {}
    pol = SnapKV(window=6) if name == "snapkv" else Knorm(sink=3)
    with on_backend("triton"):
        scores = pol.score(keys, values, **inputs)
        for budget in (pol.sink + pol.window + 1, 20, 45, N - 1):
            for alpha in (0.2, 1.0):
                got = tritonkv.compress((keys, values), pol, budget, allocation=AdaKV(alpha=alpha), **inputs)
                want = tritonkv.compress((keys, values), _Given(scores, pol.sink, pol.window), budget,
                                         allocation=AdaKV(alpha=alpha))
                assert torch.equal(got.lengths, want.lengths), (budget, alpha)
                assert all(torch.equal(a, b) for a, b in zip(got.to_padded(with_positions=True),
                                                             want.to_padded(with_positions=True))), (budget, alpha)


def test_the_fixed_allocator_by_name_says_it_needs_budgets():
    k = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"Fixed\(budgets="):
        tritonkv.compress((k, k), "knorm", 16, allocation="fixed")
