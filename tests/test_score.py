"""SCORE redundancy-penalised selection (parallel and sequential) against the NumPy oracle, and its penalty
kernel (``kernels/score.py``) against the oracle's Eq. 13 on both backends, with the select's first pass it
counts, bad inputs and the AOT compile."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tritonkv
from aot import assert_compiles
from reference import score as ref
from tritonkv.kernels import select as ksel
from tritonkv.kernels._common import record_launches
from tritonkv.kernels.score import score_penalty
from tritonkv.policies.criticalkv import row_budgets
from tritonkv.policies.score import ScoreSelect, _sequential_order
from helpers import GivenScores, SignedScores, assert_raises_naming, both_backends, on_backend  # noqa: E402

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


# -- the penalty kernel ------------------------------------------------------------------------------------------


@st.composite
def penalty_case(draw):
    """(A [B, H, N] in a float dtype, non-negative with zeros/ties/NaN, U bool [B, H, N] top-k masks of A with
    budgets 0, 1, N − 1, N or any, hd [B, H] in a float dtype, alpha)."""
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 4))
    N = draw(st.one_of(st.just(1), st.integers(2, 9), st.integers(10, 300)))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    A = rng.random((B, H, N))
    kind = draw(st.sampled_from(["plain", "ties", "nan"]))
    if kind == "ties":
        A = np.floor(A * 4) / 4  # zeros and exact ties
    elif kind == "nan":
        A[rng.random((B, H, N)) < 0.2] = np.nan
    A = torch.from_numpy(A).to(draw(st.sampled_from(DTYPES)))
    U = np.zeros((B, H, N), dtype=bool)
    for b in range(B):
        for h in range(H):
            k = draw(st.sampled_from([0, 1, N - 1, N, int(rng.integers(0, N + 1))]))
            U[b, h] = ref.top_mask(A[b, h].double().numpy(), k)
    hd = torch.from_numpy(rng.choice([0.2, 0.5], (B, H)) if draw(st.booleans()) else rng.uniform(0.05, 2.0, (B, H)))
    return A, torch.from_numpy(U), hd.to(draw(st.sampled_from(DTYPES))), draw(st.sampled_from(ALPHAS))


def penalty_oracle(A, U, hd, alpha, picks=None):
    return np.stack([ref.penalty(A[b].double().numpy(), U[b].numpy(), hd[b].double().numpy(), alpha,
                                 None if picks is None else picks[b].double().numpy()) for b in range(A.shape[0])])


def assert_penalty(got, A, U, hd, alpha, picks=None):
    """NaN where the oracle has NaN; elsewhere the fp32 formula's forward error bound around the float64 oracle.

    With u = 2^-24: the rate α·(1/HD) carries three roundings (α to fp32, the reciprocal, the product) and the
    exponent x = −rate·r a fourth, so x is off by up to 4u·|x|, which exp turns into a relative error of 4u·|x|;
    exp adds up to 2 ulp (4u: CUDA's expf; NumPy's and PyTorch's CPU exp are within 1 ulp), the product with A one
    more rounding (u): |got − Ã| <= (4|x| + 5)·u·Ã to first order (the check allows 6u for the higher orders),
    plus 2^-126 where a factor or product below fp32's smallest normal is flushed to zero (A <= 1). A constant
    relative tolerance cannot hold: at |x| ~ 27 (Ã ~ 1e-12) the rounding of x alone may reach 4u·27 ~ 6e-6."""
    assert got.dtype == torch.float32 and got.is_contiguous()
    got = got.double().numpy()
    want = penalty_oracle(A, U, hd, alpha, picks)
    x = 0.0 - np.log(penalty_oracle(torch.ones(A.shape, dtype=torch.float64), U, hd, alpha, picks))  # |exponent|
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    fin = ~np.isnan(want)
    bound = (4 * x[fin] + 6) * 2.0 ** -24 * np.abs(want[fin]) + 2.0 ** -126
    err = np.abs(got[fin] - want[fin])
    ratio = err / bound
    assert (ratio <= 1).all(), (f"{int((ratio > 1).sum())} of {err.size} beyond the bound; worst err/bound "
                                f"{ratio.max():.3g} at |x| = {float(x[fin][np.argmax(ratio)]):.3g}")


@both_backends
@settings(max_examples=25, deadline=None)
@given(case=penalty_case(), chunk=st.sampled_from([0, 16]), mask_bool=st.booleans())
def test_penalty_matches_oracle(backend, case, chunk, mask_bool):
    A, U, hd, alpha = case
    with on_backend(backend):
        got = score_penalty(A, U if mask_bool else U.to(torch.int8), hd, alpha, chunk=chunk)
    assert_penalty(got, A, U, hd, alpha)


@both_backends
@settings(max_examples=10, deadline=None)
@given(case=penalty_case(), data=st.data())
def test_penalty_with_every_ranks_picks(backend, case, data):
    """Tensor parallel: the picks of every head (here: these heads' plus up to 3 other ranks' heads)."""
    A, U, hd, alpha = case
    B, H, N = A.shape
    extra = torch.from_numpy(np.random.default_rng(data.draw(st.integers(0, 99))).integers(0, 4, (B, N)))
    picks = U.sum(1).float() + extra
    with on_backend(backend):
        got = score_penalty(A, U, hd, alpha, picks=picks)
    assert_penalty(got, A, U, hd, alpha, picks)


@both_backends
def test_penalty_far_exponents(backend):
    """Factors exp(x) from 1 down past fp32's normal range (|x| up to 120: HD 0.05, α 1, six other picks), where
    the exponent's rounding dominates the error and factors below 2^-126 may be flushed."""
    g = torch.Generator().manual_seed(7)
    B, H, N = 1, 4, 256
    A = torch.rand(B, H, N, generator=g)
    U = torch.rand(B, H, N, generator=g) < 0.5
    picks = U.sum(1).float() + torch.randint(0, 4, (B, N), generator=g)  # r = picks − U in [0, 6]
    hd = torch.tensor([[0.05, 0.07, 0.2, 1.0]])
    with on_backend(backend):
        got = score_penalty(A, U, hd, 1.0, picks=picks)
    assert_penalty(got, A, U, hd, 1.0, picks)


@settings(max_examples=10, deadline=None)
@given(case=penalty_case(), chunk=st.sampled_from([0, 16]))
def test_penalty_torch_body_matches_kernel(case, chunk):
    """Both bodies within fp32 round-off (NumPy's exp and PyTorch's may differ in the last bit), NaN alike."""
    A, U, hd, alpha = case
    with on_backend("triton"):
        want = score_penalty(A, U, hd, alpha, chunk=chunk)
    with on_backend("torch"):
        got = score_penalty(A, U, hd, alpha, chunk=chunk)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    torch.testing.assert_close(got, want, rtol=4e-7, atol=0, equal_nan=True)


def former_chain(s, budgets, hd, alpha, sink, window, k_max):
    """The penalty as a chain of PyTorch ops (how the policy computed it before the kernel)."""
    B, H, N = s.shape
    b = row_budgets(budgets, s, k_max).view(B, H)
    u = ksel.select_mask(s, b, sink=sink, window=window).to(torch.float32)
    rate = (alpha / hd.to(torch.float32).clamp_min(1e-6).expand(B, H))[..., None]
    return s * torch.exp(-rate * (u.sum(1, keepdim=True) - u))


@settings(max_examples=10, deadline=None)
@given(case=cases(), alpha=st.sampled_from(ALPHAS))
def test_torch_body_is_the_former_chain_bit_for_bit(case, alpha):
    """On the PyTorch body the policy's Ã is the former chain of PyTorch ops, bit for bit (so the kept sets are)."""
    A, kv, hd, sink, window, budgets = case
    B, H, N = A.shape
    k_max = int(min(budgets.max(), N))
    pol = ScoreSelect(base=GivenScores(scores=A, sink=sink, window=window), alpha=alpha)
    with on_backend("torch"):
        got = pol.penalised(A, budgets, hd, sink=sink, window=window, k_max=k_max)
        want = former_chain(A, budgets, hd, alpha, sink, window, k_max)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("sink, window, chunk", [(0, 0, 0), (2, 5, 0), (1, 3, 16), (0, 7, 32)])
def test_first_pass_from_the_penalty_kernel_feeds_the_select(sink, window, chunk):
    """``protect=`` makes the penalty kernel also write the select's first radix pass: the select then skips its
    own pass-0 launch and keeps the same tokens (NaN and tied scores included); the PyTorch body returns None."""
    g = torch.Generator().manual_seed(sink + window + chunk)
    B, H, N = 2, 3, 90
    A = torch.floor(torch.rand(B, H, N, generator=g) * 8) / 8  # many exact ties
    A[0, 1, 10:20] = float("nan")
    U = torch.rand(B, H, N, generator=g) < 0.3
    hd = torch.rand(B, H, generator=g) + 0.1
    kv = torch.randn(B, H, N, 8, generator=g).to(torch.bfloat16)
    with on_backend("triton"):
        s, h0 = score_penalty(A, U, hd, 0.3, chunk=chunk, protect=(sink, window))
        assert (h0.sink, h0.window) == (sink, window)
        torch.testing.assert_close(s, score_penalty(A, U, hd, 0.3, chunk=chunk), rtol=0, atol=0, equal_nan=True)
        want = ksel.select_kv(s, 30, kv, kv, 30, sink=sink, window=window)[2]
        for _ in range(2):  # the ticket is reset: the same pass serves another select
            with record_launches() as log:
                idx = ksel.select_kv(s, 30, kv, kv, 30, sink=sink, window=window, hist0=h0)[2]
            assert torch.equal(idx, want) and [x.name for x in log] == ["_select_finish_kernel", "_select_tail_kernel",
                                                                        "_select_compact_kernel"]
    with on_backend("torch"):
        s, h0 = score_penalty(A, U, hd, 0.3, protect=(sink, window))
        assert h0 is None


@both_backends
def test_penalty_edges(backend):
    """α = 0 and H = 1 leave the scores as they are; a tiny HD is clamped to 1e-6 (a factor of 0, not NaN)."""
    g = torch.Generator().manual_seed(1)
    A = torch.rand(2, 3, 17, generator=g)
    U = torch.rand(2, 3, 17, generator=g) < 0.5
    hd = torch.rand(2, 3, generator=g) + 0.1
    with on_backend(backend):
        assert torch.equal(score_penalty(A, U, hd, 0.0), A)
        assert torch.equal(score_penalty(A[:, :1], U[:, :1], hd[:, :1], 1.0), A[:, :1])
        tiny = score_penalty(A, torch.ones_like(U), torch.full((2, 3), 1e-30), 1.0)
    assert torch.equal(tiny, torch.zeros_like(A))


@pytest.mark.parametrize("make, exc, words", [
    (lambda: score_penalty(torch.rand(2, 3), torch.zeros(2, 3, dtype=torch.int8), torch.ones(2), 0.1),
     TypeError, ["scores"]),
    (lambda: score_penalty(torch.rand(1, 2, 5).double(), torch.zeros(1, 2, 5, dtype=torch.int8), torch.ones(1, 2), 0.1),
     TypeError, ["scores"]),
    (lambda: score_penalty(torch.rand(1, 2, 5), torch.zeros(1, 2, 5), torch.ones(1, 2), 0.1), TypeError, ["mask"]),
    (lambda: score_penalty(torch.rand(1, 2, 5), torch.zeros(1, 2, 4, dtype=torch.int8), torch.ones(1, 2), 0.1),
     TypeError, ["mask"]),
    (lambda: score_penalty(torch.rand(1, 2, 5), torch.zeros(1, 2, 5, dtype=torch.int8), torch.ones(2), 0.1),
     TypeError, ["hd"]),
    (lambda: score_penalty(torch.rand(1, 2, 5), torch.zeros(1, 2, 5, dtype=torch.int8), torch.ones(1, 2), -1.0),
     ValueError, ["alpha"]),
    (lambda: score_penalty(torch.rand(1, 2, 5), torch.zeros(1, 2, 5, dtype=torch.int8), torch.ones(1, 2), 0.1,
                           picks=torch.ones(1, 4)), ValueError, ["picks"]),
    (lambda: score_penalty(torch.rand(1, 2, 5), torch.zeros(1, 2, 5, dtype=torch.int8), torch.ones(1, 2), 0.1,
                           chunk=-1), ValueError, ["chunk"]),
])
def test_penalty_bad_inputs(make, exc, words):
    assert_raises_naming(make, exc, words)


def test_penalty_aot_compiles():
    sig = {"s_ptr": "*fp32", "u_ptr": "*i8", "p_ptr": "*fp32", "hd_ptr": "*fp32", "out_ptr": "*fp32",
           "h0_ptr": "*i32", "H": "i32", "shb": "i32", "shh": "i32", "alpha": "fp32", "N": "i32", "CHUNK": "i32",
           "C0": "i32", "sink": "i32", "window": "i32", "TILE": "constexpr", "HAS_PICKS": "constexpr",
           "PRECISE_EXP": "constexpr", "HIST": "constexpr", "NB": "constexpr"}
    spec = {"module": "tritonkv.kernels.score", "kernel": "_score_penalty_kernel"}
    assert_compiles(dict(spec, signature=sig, constexprs={"TILE": 256, "HAS_PICKS": False, "PRECISE_EXP": True,
                                                          "HIST": True, "NB": 256}),
                    dict(spec, signature=dict(sig, s_ptr="*bf16", hd_ptr="*fp16"),
                         constexprs={"TILE": 256, "HAS_PICKS": True, "PRECISE_EXP": False, "HIST": False, "NB": 256}))
