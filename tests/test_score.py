"""SCORE redundancy-penalised selection (parallel and sequential) against the NumPy oracle."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tritonkv
from reference import score as ref
from tritonkv.kernels import select as ksel
from tritonkv.policies.score import ScoreSelect, _sequential_order
from helpers import GivenScores, SignedScores  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REL = 1e-5  # Ã in fp32 vs the float64 oracle


@st.composite
def cases(draw, max_n=120, overlap=True):
    """(A fp32 [B,H,N] distinct > 0 per row, kv [B,H,N,D], hd [H] or [B,H], sink, window, budgets [B*H]).

    With ``overlap`` the heads share a common preference (so their top-k overlap), plus noise."""
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 4 // B))
    N = draw(st.integers(1, max_n))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    sink = draw(st.integers(0, min(3, N)))
    window = draw(st.integers(0, min(6, N - sink)))
    budgets = [draw(st.integers(sink + window, N + 2)) for _ in range(B * H)]
    common = rng.random(N) if overlap else np.zeros(N)
    A = np.empty((B * H, N))
    for r in range(B * H):  # distinct values per row, ranked by common preference + noise
        order = np.argsort(-(common + rng.random(N) * draw(st.sampled_from([0.3, 1.0]))), kind="stable")
        A[r, order] = (N - np.arange(N)) / N
    ties = draw(st.booleans())
    hd_vals = rng.choice([0.2, 0.5], (B, H)) if ties else rng.uniform(0.1, 1.0, (B, H))
    hd = torch.tensor(hd_vals[0] if draw(st.booleans()) else hd_vals, dtype=torch.float32)
    D = draw(st.sampled_from([8, 16]))
    kv = torch.from_numpy(rng.standard_normal((B, H, N, D))).to(draw(st.sampled_from(DTYPES)))
    return (torch.from_numpy(A).float().view(B, H, N), kv, hd, sink, window,
            torch.tensor(budgets, dtype=torch.int32))


def hd_rows(hd, B, H):
    return np.broadcast_to(hd.double().numpy(), (B, H))


def run(pol, A, kv, hd, sink, window, budgets):
    """Kept bool masks [B, H, N] through policy.select (and the gathered rows checked)."""
    B, H, N = A.shape
    k_max = int(min(budgets.max(), N))
    ko, _, idx, lengths = pol.select(A, budgets, kv, kv, sink=sink, window=window, k_max=k_max, hd=hd)
    mask = np.zeros((B, H, N), dtype=bool)
    for b in range(B):
        for h in range(H):
            kept = idx[b, h, :lengths[b, h]].numpy()
            assert len(kept) == min(int(budgets[b * H + h]), N)
            assert (np.diff(kept) > 0).all() and torch.equal(ko[b, h, :len(kept)], kv[b, h, kept])
            mask[b, h, kept] = True
    return mask


def separated(at, kept, prot_budget):
    """True when the kept/evicted boundary of a row of Ã is unambiguous at fp32 precision."""
    b, sink, window = prot_budget
    P = ref.top_mask(np.zeros_like(at), 0, sink, window)
    k = kept & ~P
    e = ~kept & ~P
    if not k.any() or not e.any():
        return True
    lo, hi = at[k].min(), at[e].max()
    return lo - hi > REL * lo


def check_rows(mask, want, At, sink, window, budgets):
    """Exact per row where separated; otherwise the kept multiset of Ã agrees."""
    B, H, N = mask.shape
    for b in range(B):
        for h in range(H):
            if separated(At[b][h], want[b][h], (int(budgets[b * H + h]), sink, window)):
                np.testing.assert_array_equal(mask[b, h], want[b][h])
            else:
                np.testing.assert_allclose(np.sort(At[b][h][mask[b, h]]), np.sort(At[b][h][want[b][h]]), rtol=REL)


ALPHAS = [0.0, 0.004, 0.05, 0.3, 1.0]


@settings(max_examples=10)
@given(case=cases(), alpha=st.sampled_from(ALPHAS))
def test_parallel_matches_oracle(case, alpha):
    A, kv, hd, sink, window, budgets = case
    B, H, N = A.shape
    pol = ScoreSelect(base=GivenScores(scores=A, sink=sink, window=window), alpha=alpha)
    mask = run(pol, A, kv, hd, sink, window, budgets)
    hdn = hd_rows(hd, B, H)
    bud = budgets.view(B, H).numpy()
    outs = [ref.parallel(A[b].double().numpy(), bud[b], hdn[b], alpha, sink, window) for b in range(B)]
    check_rows(mask, [o[0] for o in outs], [o[3] for o in outs], sink, window, budgets)


@settings(max_examples=8)
@given(case=cases(), alpha=st.sampled_from(ALPHAS))
def test_sequential_matches_oracle(case, alpha):
    """Greedy in descending HD, ties to the lower head (per batch row when hd is [B, H])."""
    A, kv, hd, sink, window, budgets = case
    B, H, N = A.shape
    pol = ScoreSelect(base=GivenScores(scores=A, sink=sink, window=window), alpha=alpha, mode="sequential")
    mask = run(pol, A, kv, hd, sink, window, budgets)
    hdn = hd_rows(hd, B, H)
    bud = budgets.view(B, H).numpy()
    outs = [ref.sequential(A[b].double().numpy(), bud[b], hdn[b], alpha, sink, window) for b in range(B)]
    check_rows(mask, [o[0] for o in outs], [o[1] for o in outs], sink, window, budgets)


@settings(max_examples=5)
@given(case=cases(), mode=st.sampled_from(["parallel", "sequential"]))
def test_alpha_zero_is_plain_topk(case, mode):
    """Exact, with ties and zeros in the scores."""
    A, kv, hd, sink, window, budgets = case
    A = torch.floor(A * 4) / 4
    N = A.shape[-1]
    pol = ScoreSelect(base=GivenScores(scores=A, sink=sink, window=window), alpha=0.0, mode=mode)
    _, _, idx, lengths = pol.select(A, budgets, kv, kv, sink=sink, window=window, k_max=N, hd=hd)
    want = ksel.select_indices(A, budgets, N, sink=sink, window=window)
    assert torch.equal(idx, want[0]) and torch.equal(lengths, want[1])


@settings(max_examples=4)
@given(case=cases(max_n=80))
def test_parallel_invariants(case):
    """With U and r from the unpenalised selection: tokens no other head picked stay kept; a head
    swaps only toward less-shared tokens; its overlap Σ_{j∈kept} r[j] is non-increasing in α."""
    A, kv, hd, sink, window, budgets = case
    B, H, N = A.shape
    hdn = hd_rows(hd, B, H)
    bud = budgets.view(B, H).numpy()
    last = None
    for alpha in [0.0, 0.1, 1.0]:
        pol = ScoreSelect(base=GivenScores(scores=A, sink=sink, window=window), alpha=alpha)
        mask = run(pol, A, kv, hd, sink, window, budgets)
        overlap = np.zeros((B, H))
        for b in range(B):
            _, U, r, At = ref.parallel(A[b].double().numpy(), bud[b], hdn[b], alpha, sink, window)
            for h in range(H):
                kept = mask[b, h]
                assert kept[U[h] & (r[h] == 0)].all()
                x, y = np.flatnonzero(U[h] & ~kept), np.flatnonzero(kept & ~U[h])
                if len(x) and len(y):
                    assert r[h][y].max() < r[h][x].min()
                overlap[b, h] = r[h][kept].sum()
                sep = separated(At[h], kept, (int(bud[b, h]), sink, window))
                if last is not None and sep:
                    assert overlap[b, h] <= last[b, h]
        last = overlap


@settings(max_examples=5)
@given(case=cases(max_n=80))
def test_sequential_covers_at_least_the_unpenalised_union(case):
    """Sequential: the union of kept tokens over heads ⊇ the union at α = 0, and the first head
    visited keeps its unpenalised top-k."""
    A, kv, hd, sink, window, budgets = case
    B, H, N = A.shape
    base = GivenScores(scores=A, sink=sink, window=window)
    plain = run(ScoreSelect(base=base, alpha=0.0, mode="sequential"), A, kv, hd, sink, window, budgets)
    first = _sequential_order(hd.expand(B, H))[:, 0]
    mask = run(ScoreSelect(base=base, alpha=1.0, mode="sequential"), A, kv, hd, sink, window, budgets)
    for b in range(B):
        assert (mask[b].any(0) >= plain[b].any(0)).all()
        assert (mask[b, first[b]] == plain[b, first[b]]).all()


def test_parallel_union_can_shrink():
    """The notes' counterexample: not an invariant in parallel mode (so it is not tested as one)."""
    A = torch.tensor([[[1.0, 0.9]], [[1.0, 0.9]], [[1.0, 0.9]], [[0.5, 1.0]]]).view(1, 4, 2)
    kv = torch.zeros(1, 4, 2, 8)
    pol = ScoreSelect(base=GivenScores(scores=A), alpha=0.2)
    _, _, idx, _ = pol.select(A, 1, kv, kv, sink=0, window=0, k_max=1, hd=torch.ones(4))
    assert idx.view(-1).tolist() == [1, 1, 1, 1]  # all heads move to y; α = 0 keeps {x, y}


def test_visit_order_matches_oracle():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        hd = torch.randint(1, 4, (3, 5), generator=g).float() / 4
        perm = _sequential_order(hd)
        for b in range(3):
            assert perm[b].tolist() == ref.visit_order(hd[b].numpy())


def test_compress_end_to_end():
    """compress() with hd (dense) and RaggedKV.from_policy with per-head budgets."""
    rng = np.random.default_rng(4)
    B, H, N, D, sink, window = 2, 3, 60, 16, 1, 4
    common = rng.random(N)
    A = np.stack([(common + 0.3 * rng.random(N)) for _ in range(B * H)])
    A = torch.from_numpy(A).float().view(B, H, N)
    kv = torch.from_numpy(rng.standard_normal((B, H, N, D))).bfloat16()
    hd = torch.tensor([0.3, 0.1, 0.6])
    pol = ScoreSelect(base=GivenScores(scores=A, sink=sink, window=window), alpha=0.05)
    assert pol.needs == ("hd",) and pol.protected(N, 20) == (sink, window)
    out = tritonkv.compress((kv, kv), pol, 20, hd=hd)
    budgets = torch.tensor([20] * B * H, dtype=torch.int32)
    mask = run(pol, A, kv, hd, sink, window, budgets)
    for b in range(B):
        for h in range(H):
            assert out.indices[b, h].tolist() == np.flatnonzero(mask[b, h]).tolist()
    budgets = torch.tensor([5, 20, 33, 59, 6, 12], dtype=torch.int32)
    rag = tritonkv.RaggedKV.from_policy(pol, A, budgets, kv, kv, sink=sink, window=window, hd=hd)
    K, _, lengths, pos = rag.to_padded(N, with_positions=True)
    mask = run(pol, A, kv, hd, sink, window, budgets)
    assert lengths.view(-1).tolist() == budgets.tolist()
    for b in range(B):
        for h in range(H):
            assert pos[b, h, :lengths[b, h]].tolist() == np.flatnonzero(mask[b, h]).tolist()


def test_with_snapkv():
    snap = pytest.importorskip("tritonkv.policies.snapkv")
    g = torch.Generator().manual_seed(5)
    B, H, G, N, D = 1, 2, 3, 70, 16
    keys = torch.randn(B, H, N, D, generator=g).bfloat16()
    queries = torch.randn(B, H * G, 32, D, generator=g).bfloat16()
    pol = tritonkv.get_policy("score")
    assert isinstance(pol.base, snap.SnapKV) and pol.base.kernel_size == 1
    assert (pol.alpha, pol.mode) == (0.004, "parallel") and set(pol.needs) == {"queries", "hd"}
    hd = torch.tensor([0.2, 0.05])
    out = tritonkv.compress((keys, keys), pol, 40, queries=queries, hd=hd)
    A = snap.SnapKV(kernel_size=1).score(keys, keys, queries=queries)
    kept, _, _, At = ref.parallel(A[0].double().numpy(), [40, 40], hd.double().numpy(), 0.004, 0, 32)
    mask = np.zeros((1, H, N), dtype=bool)
    for h in range(H):
        mask[0, h, out.indices[0, h].numpy()] = True
    check_rows(mask, [kept], [At], 0, 32, torch.tensor([40, 40]))
    with pytest.raises(ValueError, match="hd"):
        tritonkv.compress((keys, keys), pol, 40, queries=queries)


def test_bad_input():
    A = torch.rand(1, 2, 20)
    base = GivenScores(scores=A)
    with pytest.raises(ValueError, match="base.*non-negative"):
        ScoreSelect(base=SignedScores(scores=A))
    with pytest.raises(ValueError, match="base"):
        ScoreSelect(base=ScoreSelect(base=base))
    with pytest.raises(TypeError, match="base"):
        ScoreSelect(base=None)
    with pytest.raises(ValueError, match="mode"):
        ScoreSelect(base=base, mode="greedy")
    with pytest.raises(ValueError, match="alpha"):
        ScoreSelect(base=base, alpha=-0.1)
    k = torch.randn(1, 2, 20, 8)
    pol = ScoreSelect(base=base)
    with pytest.raises(ValueError, match="hd"):
        tritonkv.compress((k, k), pol, 5)
    for hd, exc in [(torch.ones(3), ValueError), (torch.ones(2, 2), ValueError), (torch.tensor([1.0, 0.0]), ValueError),
                    (torch.tensor([1.0, -2.0]), ValueError), (torch.tensor([1.0, float("nan")]), ValueError),
                    (torch.ones(2, dtype=torch.bool), TypeError), ("high", TypeError)]:
        with pytest.raises(exc, match="hd"):
            tritonkv.compress((k, k), pol, 5, hd=hd)
    out = tritonkv.compress((k, k), pol, 5, hd=[0.5, 0.25])  # a plain list is accepted
    assert out.indices.shape == (1, 2, 5)
