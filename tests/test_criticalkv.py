"""CriticalKV: projected-value norm kernel and CPU PyTorch body, and two-stage selection, against
the NumPy oracle and each other."""

import numpy as np
import pytest
import torch
import triton
from hypothesis import given, settings, strategies as st

import tritonkv
from aot import assert_compiles
from reference import criticalkv as ref
from reference.select import first_pass_histogram
from tritonkv.kernels import critical as kcrit
from tritonkv.kernels import select as ksel
from tritonkv.kernels.critical import value_norms
from tritonkv.policies import H2O, TOVA, SnapKV, SurfaceLogicKV
from tritonkv.policies.criticalkv import CriticalKV
from helpers import GivenScores, SignedScores, assert_same_scores, both_backends, on_backend  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REL = 1e-5  # fp32 norms differ from the float64 oracle by ~1e-6 (reduction order)


@st.composite
def cases(draw, max_n=160, dtypes=DTYPES):
    """(scores fp32 distinct > 0 [B,H,N], values, W_O, G, sink, window, budgets int [B*H])."""
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 4 // B))
    G = draw(st.sampled_from([1, 3, 4]))
    N = draw(st.integers(1, max_n))
    D = draw(st.sampled_from([8, 16, 33, 64]))
    DM = draw(st.sampled_from([16, 24, 48]))
    dtype = draw(st.sampled_from(dtypes))
    w_dtype = draw(st.sampled_from([dtype, dtype, torch.float32]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    sink = draw(st.integers(0, min(3, N)))
    window = draw(st.integers(0, min(8, N - sink)))
    budgets = [draw(st.integers(sink + window, N + 2)) for _ in range(B * H)]
    s = np.stack([(rng.permutation(N) + 1.0) / N for _ in range(B * H)]).reshape(B, H, N)
    scale = np.exp(rng.uniform(-1.5, 1.5, (B, H, N, 1)))
    values = torch.from_numpy(rng.standard_normal((B, H, N, D)) * scale).to(dtype)
    w = torch.from_numpy(rng.standard_normal((DM, H * G * D)) / np.sqrt(D)).to(w_dtype)
    return (torch.from_numpy(s).float(), values, w, G, sink, window,
            torch.tensor(budgets, dtype=torch.int32))


def oracle_norms(values, w, G):
    """float64 [B, H, N] oracle norms on the (rounded) inputs."""
    B, H = values.shape[:2]
    V, W = values.double().numpy(), w.double().numpy()
    return np.stack([[ref.value_norms(V[b, h], W, h, G) for h in range(H)] for b in range(B)])


EPS32 = float(np.finfo(np.float32).eps)


def oracle_norms_l2(values, w, G):
    """float64 ``[B, H, N]`` L2 oracle norms (``ref.value_norms(..., norm="l2")``: the projection's
    norm computed directly) and a rigorous bound on the error of the library's form, from its
    round-off: per token u = v/m (m a power of two: exact), p = u R_qᵀ with R_q the QR factor of
    W_O^q, R_qᵀ stored as bf16 hi + lo (to 2⁻¹⁶ of each entry) and u split as bf16 hi (truncated to
    8 bits: |u_lo| < 2⁻⁷|u|) + lo (rounded: 2⁻¹⁵|u|; the dropped u_lo·lo: 2⁻¹⁵), products exact,
    fp32 accumulation of 3d products: |Δp| <= (3d·ε + 5·2⁻¹⁶)·|u| |R_qᵀ| componentwise, so
    |Δ‖p‖| <= (3d·ε + 5·2⁻¹⁶)·‖|u| |R_qᵀ|‖, plus
    (d + 4)·ε·‖p‖ for the sum of squares and the square root, plus a few roundings of the product
    by m and the mean."""
    B_, H = values.shape[:2]
    D = values.shape[-1]
    V, W = values.double().numpy(), w.double().numpy()
    n = np.stack([[ref.value_norms(V[b, h], W, h, G, norm="l2") for h in range(H)] for b in range(B_)])
    tol = np.zeros_like(n)
    for b in range(B_):
        for h in range(H):
            v = V[b, h]
            m = np.abs(v).max(axis=1)
            m = np.where(m > 0, 2.0 ** np.floor(np.log2(np.where(m > 0, m, 1.0))), 1.0)
            u = v / m[:, None]
            for q in range(h * G, (h + 1) * G):
                wq = W[:, q * D:(q + 1) * D]
                R = np.linalg.qr(wq, mode="r")
                a = np.linalg.norm(np.abs(u) @ np.abs(R).T, axis=1)
                pn = np.linalg.norm(u @ wq.T, axis=1)
                tol[b, h] += m * ((3 * D * EPS32 + 5 * 2.0 ** -16) * a + (D + 4) * EPS32 * pn)
            tol[b, h] /= G
    return n, tol + 8 * EPS32 * n


def kept_rows(idx, lengths):
    lengths = lengths.reshape(-1)
    return [idx.reshape(len(lengths), -1)[r, :l].numpy() for r, l in enumerate(lengths.tolist())]


def check_row(kept, s, n, budget, sink, window, alpha, eps=1e-4, rel=REL):
    """Exact against the oracle when the stage-2 boundary is separated by more than ``rel`` (the
    norms' relative error bound); else the kept multiset."""
    P, S1, S2, s2 = ref.stages(s, n, budget, sink, window, alpha, eps)
    want = np.flatnonzero(P | S1 | S2)
    cand = ref.ranked(s2, np.flatnonzero(~P & ~S1))
    m = int(S2.sum())
    separated = m == 0 or m == len(cand) or s2[cand[m - 1]] - s2[cand[m]] > 2 * rel * s2[cand[m - 1]]
    if separated:
        np.testing.assert_array_equal(kept, want)
    else:
        got = np.zeros_like(P)
        got[kept] = True
        assert len(kept) == len(want) and (got[P | S1]).all()
        np.testing.assert_allclose(np.sort(s2[got & ~P & ~S1]), np.sort(s2[S2]), rtol=2 * rel)


@both_backends
@given(case=cases(max_n=200))
def test_value_norms_match_oracle(backend, case):
    with on_backend(backend):
        _, values, w, G, *_ = case
        n = value_norms(values, w)
        assert n.dtype == torch.float32 and n.shape == values.shape[:3]
        np.testing.assert_allclose(n.numpy(), oracle_norms(values, w, G), rtol=REL, atol=1e-6)


@given(case=cases(max_n=200), block=st.sampled_from([kcrit.TORCH_BLOCK, 1, 24 * 16 * 7]))
def test_torch_body_matches_kernel(case, block):
    """The CPU PyTorch body against the Triton kernel (interpreter): norms within fp32 round-off
    (both multiply in IEEE fp32), whatever the token chunking of the body (one token per chunk,
    uneven chunks, or one chunk)."""
    _, values, w, G, *_ = case
    with on_backend("triton"):
        want = value_norms(values, w)
    orig, kcrit.TORCH_BLOCK = kcrit.TORCH_BLOCK, block
    try:
        with on_backend("torch"):
            got = value_norms(values, w)
    finally:
        kcrit.TORCH_BLOCK = orig
    assert got.dtype == torch.float32 and got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=2 * REL, atol=1e-6)


@st.composite
def tiled_cases(draw):
    """(values, W_O, G) at head dims 64 and 128 (and an odd one), D_model off the column tile."""
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 3, 4]))
    N = draw(st.integers(1, 90))
    D = draw(st.sampled_from([64, 128, 40]))
    DM = draw(st.sampled_from([16, 40, 72]))
    dtype = draw(st.sampled_from(DTYPES))
    w_dtype = draw(st.sampled_from([dtype, torch.float32]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    scale = np.exp(rng.uniform(-1.5, 1.5, (B, H, N, 1)))
    values = torch.from_numpy(rng.standard_normal((B, H, N, D)) * scale).to(dtype)
    w = torch.from_numpy(rng.standard_normal((DM, H * G * D)) / np.sqrt(D)).to(w_dtype)
    return values, w, G


@settings(max_examples=12, deadline=None)
@given(case=tiled_cases(), blocks=st.sampled_from([(16, 16, 4), (32, 32, 4), (16, 64, 8)]))
def test_value_norm_kernel_in_tiles_matches_oracle(case, blocks):
    """The L1 kernel in GPU-like tiles (the interpreter's default is one tile of every kind): several
    token tiles, N off the token tile, and a column loop over every query head's D_model tiles with
    D_model off the column tile, against the float64 oracle."""
    values, w, G = case
    bn, bm, warps = blocks

    def tiles(n, d, dm, native):
        return bn, max(triton.next_power_of_2(d), 16), bm, warps, 1

    with on_backend("triton"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(kcrit, "_blocks", tiles)
        n = value_norms(values, w)
    np.testing.assert_allclose(n.numpy(), oracle_norms(values, w, G), rtol=REL, atol=1e-6)


@pytest.mark.parametrize("val", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_score_alike_on_both_backends(val):
    """A value with a NaN or ±inf element gives a NaN norm (the token ranks lowest), also where an
    infinite element meets an exact zero of W_O, on the kernel and the PyTorch body alike; the other
    tokens are unaffected."""
    g = torch.Generator().manual_seed(7)
    values = torch.randn(2, 2, 30, 16, generator=g)
    w = torch.randn(24, 2 * 3 * 16, generator=g)
    values[0, 1, 4, 3] = val
    values[1, 0, 9, 5] = val
    w[:, 5] = 0.0  # channel 5 of query head 0 (KV head 0's group): inf · 0 = NaN in every projection
    with on_backend("triton"):
        want = value_norms(values, w)
    with on_backend("torch"):
        got = value_norms(values, w)
    assert_same_scores(got, want, rtol=2 * REL, atol=1e-6)
    bad = torch.zeros(2, 2, 30, dtype=torch.bool)
    bad[0, 1, 4] = bad[1, 0, 9] = True
    assert torch.isnan(got[bad]).all() and torch.isnan(want[bad]).all()
    assert torch.isfinite(got[~bad]).all() and torch.isfinite(want[~bad]).all()


BASES = {"snapkv": lambda: SnapKV(window=6, kernel_size=1), "snapkv_pool3": lambda: SnapKV(window=6, kernel_size=3),
         "h2o": lambda: H2O(window=6), "tova": lambda: TOVA(), "surfacelogic": lambda: SurfaceLogicKV(window=6)}


@both_backends
@pytest.mark.parametrize("base", sorted(BASES))
@pytest.mark.parametrize("given_lse", [False, True])
def test_base_scores_a_non_finite_value_as_a_non_finite_key(backend, base, given_lse):
    """docs/contracts.md: a token whose value is not finite is scored by the base as if absent, i.e.
    exactly as the base scores it with its key made NaN. The window kernels read the values with the
    keys (no pass of their own): the same scores, bit for bit, with and without a given LSE."""
    g = torch.Generator().manual_seed(3)
    B, H, G, N, D, W = 2, 2, 2, 37, 16, 6
    keys = torch.randn(B, H, N, D, generator=g)
    values = torch.randn(B, H, N, 24, generator=g).to(torch.bfloat16)
    values[0, 1, 5, 2] = float("nan")
    values[1, 0, 9, :] = float("inf")
    values[1, 1, 20, 23] = float("-inf")
    keys[0, 0, 12, 1] = float("nan")  # a non-finite key as well
    inputs = {"queries": torch.randn(B, H * G, W, D, generator=g)}
    if given_lse:
        inputs["attn_lse"] = torch.rand(B, H * G, W, generator=g) + 3.0
    pol = CriticalKV(base=BASES[base]())
    nan_keys = torch.where(torch.isfinite(values).all(-1, keepdim=True), keys, float("nan"))
    with on_backend(backend):
        got = pol.score(keys, values, **inputs)
        want = pol.base.score(nan_keys, values, **inputs)
        plain = pol.base.score(keys, values, **inputs)  # what a base that never reads values gives
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(got[0, 1, 5]) and torch.isnan(got[1, 0, 9]) and torch.isnan(got[1, 1, 20])
    assert not torch.isnan(plain[0, 1, 5])


@both_backends
@given(case=cases(max_n=200), block=st.sampled_from([kcrit.TORCH_BLOCK, 1, 24 * 16 * 7]))
def test_l2_norms_match_oracle(backend, case, block):
    """norm="l2" (per-head QR factors of W_O) against the oracle's direct ‖W_O^q v‖₂ within the
    bound derived from the library's round-off; the PyTorch body under any token chunking."""
    _, values, w, G, *_ = case
    orig, kcrit.TORCH_BLOCK = kcrit.TORCH_BLOCK, block
    try:
        with on_backend(backend):
            n = value_norms(values, w, norm="l2")
    finally:
        kcrit.TORCH_BLOCK = orig
    want, tol = oracle_norms_l2(values, w, G)
    assert n.dtype == torch.float32 and n.shape == values.shape[:3]
    err = np.abs(n.numpy().astype(np.float64) - want)
    assert (err <= tol).all(), f"max error / bound {np.max(err / tol):.3g}"


@settings(max_examples=10)
@given(case=cases(max_n=100), blocks=st.sampled_from([(16, 16, 16, 4), (32, 16, 32, 4), (16, 32, 16, 2)]))
def test_l2_kernel_in_blocks_matches_oracle(case, blocks):
    """The L2 kernel as the GPU runs it, in pieces (the interpreter's default is one block of every
    kind): several token chunks, channel slices of u and output-column blocks (‖p‖² summed over the
    blocks), within the oracle bound."""
    _, values, w, G, *_ = case
    bn, bk, bc, warps = blocks

    def blocks_l2(n, d):
        block_d = max(triton.next_power_of_2(d), 16)
        return bn, block_d, min(bk, block_d), min(bc, block_d), warps

    with on_backend("triton"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(kcrit, "_blocks_l2", blocks_l2)
        n = value_norms(values, w, norm="l2")
    want, tol = oracle_norms_l2(values, w, G)
    err = np.abs(n.numpy().astype(np.float64) - want)
    assert (err <= tol).all(), f"max error / bound {np.max(err / tol):.3g}"


@both_backends
def test_l2_norm_is_the_projection_norm(backend):
    """Hand-checkable: one query head, W_O^q = diag(3, 4) padded: ‖W v‖₂ of v = (1, 1) is 5, and
    the group mean over G = 2 heads, one of them zero, halves it; the L1 norm of the same is 7/2."""
    with on_backend(backend):
        w = torch.zeros(3, 4)
        w[0, 0], w[1, 1] = 3.0, 4.0
        values = torch.tensor([[[[1.0, 1.0], [0.0, -2.0], [0.0, 0.0]]]])
        n = value_norms(values, w, norm="l2")
        assert n.tolist() == [[[2.5, 4.0, 0.0]]]
        assert value_norms(values, w).tolist() == [[[3.5, 4.0, 0.0]]]


@both_backends
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_no_overflow(backend, dtype):
    """Values near the top of the fp32 range: ‖R v‖² would overflow fp32; the per-token scaling
    keeps the norm finite and within the bound."""
    with on_backend(backend):
        g = torch.Generator().manual_seed(4)
        values = (torch.randn(1, 2, 9, 16, generator=g) * 1e30).to(dtype)
        w = torch.randn(24, 2 * 3 * 16, generator=g) / 4
        n = value_norms(values, w, norm="l2")
        want, tol = oracle_norms_l2(values, w, 3)
        assert torch.isfinite(n).all()
        assert (np.abs(n.numpy().astype(np.float64) - want) <= tol).all()


@pytest.mark.parametrize("val", [float("nan"), float("inf"), float("-inf")])
def test_l2_non_finite_values_score_alike_on_both_backends(val):
    """norm="l2": a value with a NaN or ±inf element gives NaN (the token ranks lowest), on the kernel
    and the PyTorch body alike; other tokens are unaffected."""
    g = torch.Generator().manual_seed(7)
    values = torch.randn(2, 2, 30, 16, generator=g)
    w = torch.randn(24, 2 * 3 * 16, generator=g)
    clean = {}
    for backend in ("triton", "torch"):
        with on_backend(backend):
            clean[backend] = value_norms(values, w, norm="l2")
    values[0, 1, 4, 3] = val
    values[1, 0, 9, 5] = val
    values[1, 0, 9, 6] = -val  # +inf and -inf in one token
    with on_backend("triton"):
        want = value_norms(values, w, norm="l2")
    with on_backend("torch"):
        got = value_norms(values, w, norm="l2")
    for f in (torch.isnan, torch.isinf):
        assert torch.equal(f(got), f(want))
    for r in ((0, 1, 4), (1, 0, 9)):
        assert torch.isnan(got[r]) and torch.isnan(want[r])
    bad = torch.zeros(2, 2, 30, dtype=torch.bool)
    bad[0, 1, 4] = bad[1, 0, 9] = True
    assert torch.equal(got[~bad], clean["torch"][~bad]) and torch.equal(want[~bad], clean["triton"][~bad])


@pytest.mark.parametrize("block", [kcrit.FACTOR_BLOCK, 1, 24 * 16 * 2])
@pytest.mark.parametrize("dm", [24, 9])
def test_head_factors(block, dm):
    """R_qᵀ for every query head: R_qᵀ R_q is the head's Gram matrix (W_O^q)ᵀ W_O^q, R_q upper
    triangular, zero rows past D_model when D_model < d, whatever the heads per QR; hi + lo of the
    bf16 split is R_qᵀ to 2⁻¹⁶ of each entry (two roundings to 8 significant bits)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(dm, 5 * 16, generator=g).to(torch.bfloat16)
    orig, kcrit.FACTOR_BLOCK = kcrit.FACTOR_BLOCK, block
    try:
        f = kcrit.head_factors(w, 16)
    finally:
        kcrit.FACTOR_BLOCK = orig
    assert f.dtype == torch.float64 and f.shape == (5, 16, 16)
    R = f.transpose(1, 2)
    assert torch.equal(R, R.triu()) and (R[:, dm:] == 0).all()
    wd = w.double().reshape(dm, 5, 16)
    gram = torch.einsum("mqc,mqe->qce", wd, wd)
    torch.testing.assert_close(f @ R, gram, rtol=1e-12, atol=1e-12 * float(gram.abs().max()))
    sp = kcrit.split_factors(f)
    assert sp.dtype == torch.bfloat16 and sp.shape == (2, 5, 16, 16)
    assert ((sp[0].double() + sp[1].double() - f).abs() <= 2.0 ** -16 * f.abs()).all()


@both_backends
@settings(max_examples=12)
@given(case=cases(), alpha=st.sampled_from([0.0, 0.25, 0.5, 1.0]))
def test_l2_selection_matches_oracle(backend, case, alpha):
    """CriticalKV(norm="l2"): the two-stage selection on the oracle's L2 norms, exact kept indices
    where the stage-2 boundary is wider than the norms' error bound."""
    with on_backend(backend):
        s, values, w, G, sink, window, budgets = case
        B, H, N = s.shape
        k_max = int(min(budgets.max(), N))
        pol = CriticalKV(base=GivenScores(scores=s, sink=sink, window=window), alpha=alpha, norm="l2")
        ko, vo, idx, lengths = pol.select(pol.score(values, values), budgets, values, values, sink=sink, window=window,
                                          k_max=k_max, o_proj=w)
        n, tol = oracle_norms_l2(values, w, G)
        for r, kept in enumerate(kept_rows(idx, lengths)):
            b, h = divmod(r, H)
            assert len(kept) == min(int(budgets[r]), N)
            rel = float(np.max(tol[b, h] / np.where(n[b, h] > 0, n[b, h], np.inf), initial=0.0)) + REL
            check_row(kept, s[b, h].double().numpy(), n[b, h], int(budgets[r]), sink, window, alpha, rel=rel)
            assert torch.equal(ko[b, h, :len(kept)], values[b, h, kept])


@both_backends
@settings(max_examples=12)
@given(case=cases(), alpha=st.sampled_from([0.0, 0.25, 0.5, 0.7, 1.0, 0.3]))
def test_selection_matches_oracle(backend, case, alpha):
    """Per-head budgets (as from AdaKV), B > 1, G in {1, 3, 4}, every dtype: exact kept indices."""
    with on_backend(backend):
        s, values, w, G, sink, window, budgets = case
        B, H, N = s.shape
        k_max = int(min(budgets.max(), N))
        pol = CriticalKV(base=GivenScores(scores=s, sink=sink, window=window), alpha=alpha)
        ko, vo, idx, lengths = pol.select(pol.score(values, values), budgets, values, values, sink=sink, window=window,
                                          k_max=k_max, o_proj=w)
        n = oracle_norms(values, w, G)
        for r, kept in enumerate(kept_rows(idx, lengths)):
            b, h = divmod(r, H)
            assert len(kept) == min(int(budgets[r]), N)
            check_row(kept, s[b, h].double().numpy(), n[b, h], int(budgets[r]), sink, window, alpha)
            assert torch.equal(ko[b, h, :len(kept)], values[b, h, kept])


@both_backends
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_dense_and_ragged(backend, dtype):
    """compress() with one budget (dense) and RaggedKV.from_policy with per-head budgets (B = 2)."""
    with on_backend(backend):
        rng = np.random.default_rng(3)
        B, H, G, N, D, sink, window = 2, 2, 3, 70, 16, 2, 5
        s = torch.from_numpy((np.stack([rng.permutation(N) for _ in range(B * H)]) + 1.0) / N).float().view(B, H, N)
        scale = np.exp(rng.uniform(-1, 1, (B, H, N, 1)))
        values = torch.from_numpy(rng.standard_normal((B, H, N, D)) * scale).to(dtype)
        keys = values.flip(-1)
        w = torch.from_numpy(rng.standard_normal((24, H * G * D))).to(dtype)
        n = oracle_norms(values, w, G)
        pol = CriticalKV(base=GivenScores(scores=s, sink=sink, window=window))
        out = tritonkv.compress((keys, values), pol, 0.3, o_proj=w)
        assert out.indices.shape == (B, H, 21)
        for b in range(B):
            for h in range(H):
                kept = out.indices[b, h].numpy()
                check_row(kept, s[b, h].double().numpy(), n[b, h], 21, sink, window, 0.5)
                assert torch.equal(out.keys[b, h], keys[b, h, kept])
                assert torch.equal(out.values[b, h], values[b, h, kept])
        budgets = torch.tensor([7, 30, 69, 12], dtype=torch.int32)
        rag = tritonkv.RaggedKV.from_policy(pol, s, budgets, keys, values, sink=sink, window=window, o_proj=w)
        K, _, lengths, pos = rag.to_padded(N, with_positions=True)
        assert lengths.view(-1).tolist() == budgets.tolist()
        for r in range(B * H):
            b, h = divmod(r, H)
            kept = pos[b, h, :budgets[r]].numpy()
            check_row(kept, s[b, h].double().numpy(), n[b, h], int(budgets[r]), sink, window, 0.5)
            assert torch.equal(K[b, h, :budgets[r]], keys[b, h, kept])


def _select_indices(pol, s, budgets, values, w, sink, window):
    N = s.shape[-1]
    _, _, idx, lengths = pol.select(s, budgets, values, values, sink=sink, window=window, k_max=N, o_proj=w)
    return idx, lengths


@both_backends
@settings(max_examples=4)
@given(case=cases(max_n=120), ties=st.booleans())
def test_alpha_one_is_base_and_alpha_zero_is_pure(backend, case, ties):
    """α = 1: the base selection; α = 0: plain selection on (s + ε)·n. Exact, ties included."""
    with on_backend(backend):
        s, values, w, G, sink, window, budgets = case
        if ties:  # few distinct values (zeros included): the tie rule decides
            s = torch.floor(s * 3) / 3
        base = GivenScores(scores=s, sink=sink, window=window)
        N = s.shape[-1]
        want = ksel.select_indices(s, budgets, N, sink=sink, window=window)
        got = _select_indices(CriticalKV(base=base, alpha=1.0), s, budgets, values, w, sink, window)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        pure = (s + 1e-4) * value_norms(values, w)
        want = ksel.select_indices(pure, budgets, N, sink=sink, window=window)
        got = _select_indices(CriticalKV(base=base, alpha=0.0), s, budgets, values, w, sink, window)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@both_backends
@settings(max_examples=4)
@given(case=cases(max_n=120), alpha=st.sampled_from([0.25, 0.5, 0.7]), data=st.data())
def test_invariants(backend, case, alpha, data):
    """Top ⌊αb⌋ by s always kept; W_O·c (c > 0) and permuting query heads within a group change
    nothing; permuting query heads across groups does (when it changes the norms)."""
    with on_backend(backend):
        s, values, w, G, sink, window, budgets = case
        B, H, N = s.shape
        pol = CriticalKV(base=GivenScores(scores=s, sink=sink, window=window), alpha=alpha)
        idx, lengths = _select_indices(pol, s, budgets, values, w, sink, window)
        rows = kept_rows(idx, lengths)
        n = oracle_norms(values, w, G)
        for r, kept in enumerate(rows):
            b, h = divmod(r, H)
            _, S1, _, _ = ref.stages(s[b, h].numpy(), n[b, h], int(budgets[r]), sink, window, alpha)
            assert set(np.flatnonzero(S1)) <= set(kept.tolist())
        # scaling W_O by a power of two is exact: identical indices, ties or not
        c = data.draw(st.sampled_from([0.25, 2.0, 8.0]))
        scaled = _select_indices(pol, s, budgets, values, w * c, sink, window)
        assert torch.equal(scaled[0], idx)
        # permuting the query heads inside each group (W_O column blocks)
        D = values.shape[-1]
        perm = np.concatenate([h * G + np.random.default_rng(data.draw(st.integers(0, 99))).permutation(G)
                               for h in range(H)])
        cols = torch.from_numpy(np.concatenate([np.arange(q * D, (q + 1) * D) for q in perm]))
        wp = w[:, cols]
        torch.testing.assert_close(value_norms(values, wp), value_norms(values, w), rtol=REL, atol=1e-6)
        perm_idx, perm_len = _select_indices(pol, s, budgets, values, wp, sink, window)
        for r, kept in enumerate(kept_rows(perm_idx, perm_len)):
            b, h = divmod(r, H)
            check_row(kept, s[b, h].numpy(), n[b, h], int(budgets[r]), sink, window, alpha)


@both_backends
def test_group_order_matters(backend):
    """The norm of KV head h reads exactly the columns of query heads h·G … h·G + G − 1."""
    with on_backend(backend):
        g = torch.Generator().manual_seed(0)
        values = torch.randn(1, 2, 5, 16, generator=g)
        w = torch.zeros(8, 2 * 2 * 16)
        w[:, 2 * 16:3 * 16] = torch.randn(8, 16, generator=g)  # only query head 2 (group of KV head 1)
        n = value_norms(values, w)
        assert (n[0, 0] == 0).all() and (n[0, 1] > 0).all()
        want = (values[0, 1] @ w[:, 32:48].T).abs().sum(-1) / 2
        torch.testing.assert_close(n[0, 1], want, rtol=1e-6, atol=0)


@both_backends
def test_strided_and_module_inputs(backend):
    with on_backend(backend):
        g = torch.Generator().manual_seed(1)
        base = torch.randn(2, 40, 3, 16, generator=g)
        values = base.permute(0, 2, 1, 3)  # [B, H, N, D] view of [B, N, H, D] storage
        lin = torch.nn.Linear(3 * 2 * 16, 24, bias=False)
        want = value_norms(values.contiguous(), lin.weight.detach().contiguous())
        assert torch.equal(value_norms(values, lin), want)
        assert torch.equal(value_norms(values, lin.weight.detach().T.contiguous().T), want)


@both_backends
@pytest.mark.parametrize("dtype", DTYPES)
def test_with_snapkv(backend, dtype):
    """The default base: SnapKV (window 32, max-pool 7) scores from queries."""
    with on_backend(backend):
        snap = pytest.importorskip("tritonkv.policies.snapkv")
        g = torch.Generator().manual_seed(2)
        B, H, G, N, D = 2, 2, 3, 90, 16
        keys = torch.randn(B, H, N, D, generator=g).to(dtype)
        values = (torch.randn(B, H, N, D, generator=g) * torch.rand(B, H, N, 1, generator=g) * 3).to(dtype)
        queries = torch.randn(B, H * G, 32, D, generator=g).to(dtype)
        w = (torch.randn(48, H * G * D, generator=g) / 4).to(dtype)
        pol = tritonkv.get_policy("criticalkv")
        assert isinstance(pol.base, snap.SnapKV) and (pol.alpha, pol.eps) == (0.5, 1e-4)
        assert set(pol.needs) == {"queries", "o_proj"} and pol.protected(N, 50) == (0, 32)
        out = tritonkv.compress((keys, values), pol, 50, queries=queries, o_proj=w)
        s = snap.SnapKV().score(keys, values, queries=queries)
        n = oracle_norms(values, w, G)
        for b in range(B):
            for h in range(H):
                check_row(out.indices[b, h].numpy(), s[b, h].double().numpy(), n[b, h], 50, 0, 32, 0.5)
        with pytest.raises(ValueError, match="o_proj"):
            tritonkv.compress((keys, values), pol, 50, queries=queries)


def test_bad_input():
    s = torch.rand(1, 2, 20)
    base = GivenScores(scores=s)
    with pytest.raises(ValueError, match="base.*non-negative"):
        CriticalKV(base=SignedScores(scores=s))
    with pytest.raises(ValueError, match="base"):
        CriticalKV(base=CriticalKV(base=base))
    with pytest.raises(TypeError, match="base"):
        CriticalKV(base="snapkv")
    for kw, arg in [({"alpha": -0.1}, "alpha"), ({"alpha": 1.5}, "alpha"), ({"eps": -1.0}, "eps"),
                    ({"alpha": float("nan")}, "alpha"), ({"norm": "L1"}, "norm"), ({"norm": 2}, "norm")]:
        with pytest.raises(ValueError, match=arg):
            CriticalKV(base=base, **kw)
    k = torch.randn(1, 2, 20, 16)
    pol = CriticalKV(base=base)
    assert pol.needs == ("o_proj",)
    with pytest.raises(ValueError, match="o_proj"):
        tritonkv.compress((k, k), pol, 5)
    with pytest.raises(ValueError, match="o_proj"):
        tritonkv.compress((k, k), pol, 5, o_proj=torch.randn(8, 2 * 16 + 3))
    with pytest.raises(ValueError, match="o_proj"):
        value_norms(k, torch.randn(8, 2 * 16).long())
    with pytest.raises(TypeError, match="o_proj"):
        value_norms(k, [[1.0]])
    with pytest.raises(TypeError, match="values"):
        value_norms(k.long(), torch.randn(8, 32))
    with pytest.raises(ValueError, match="norm"):
        value_norms(k, torch.randn(8, 32), norm="linf")
    assert CriticalKV(base=base).norm == "l1"  # the paper's norm is the default


@st.composite
def stage2_cases(draw):
    """(scores s > 0 [B,H,N] with a NaN, values, W_O, G, forced bool [B,H,N], sink, window, eps)."""
    s, values, w, G, sink, window, _ = draw(cases(max_n=120))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    forced = torch.from_numpy(rng.random(tuple(s.shape)) < draw(st.sampled_from([0.0, 0.2, 0.6])))
    if s.numel() > 1:
        s.view(-1)[int(rng.integers(s.numel()))] = float("nan")  # a NaN base score ranks lowest in stage 2 too
    return s, values, w, G, forced, sink, window, draw(st.sampled_from([1e-4, 0.0, 0.5]))


@settings(max_examples=16, deadline=None)
@given(case=stage2_cases(), norm=st.sampled_from(["l1", "l2"]), block=st.sampled_from([16, 32, 64, None]))
def test_stage2_scores_and_first_pass_from_the_norm_kernel(case, norm, block):
    """``value_norms(..., scores=, eps=, forced=, protect=)``: the kernel writes (s + ε)·n bit for bit as the
    norms it writes alone, combined in PyTorch (for L1 within ``REL`` of the float64 oracle), and its
    ``hist0`` slots sum to the NumPy first pass over them with sink, window and the forced tokens protected,
    in one token tile a row or several (``block``); a select fed with it keeps what a select counting its
    own first pass keeps, and the Hist0 names those very forced tokens."""
    s, values, w, G, forced, sink, window, eps = case
    B, H, N = s.shape
    with on_backend("triton"), pytest.MonkeyPatch.context() as mp:
        if block is not None:
            mp.setattr(kcrit, "_blocks", lambda n, d, dm, native: (block, max(triton.next_power_of_2(d), 16), 16, 4, 1))
            mp.setattr(kcrit, "_blocks_l2", lambda n, d: (block,) + (max(triton.next_power_of_2(d), 16),) * 3 + (4,))
        n = value_norms(values, w, norm=norm)
        s2, h0 = value_norms(values, w, norm=norm, scores=s, eps=eps, forced=forced, protect=(sink, window))
        torch.testing.assert_close(s2, (s + eps) * n, rtol=0, atol=0, equal_nan=True)
        assert h0 is not None and h0.forced is forced and (h0.sink, h0.window) == (sink, window)
        want = first_pass_histogram(s2.view(B * H, N).numpy(), sink, window, forced.view(B * H, N).numpy())
        np.testing.assert_array_equal(h0.hist[:, 1:].sum(1).numpy(), want)
        budgets = torch.tensor([min(N, sink + window + int(forced.view(B * H, N)[r].sum()) + 3) for r in range(B * H)],
                               dtype=torch.int32)
        k = int(budgets.max())
        plain = ksel.select_kv(s2, budgets, values, values, k, sink=sink, window=window, forced=forced)
        got = ksel.select_kv(s2, budgets, values, values, k, sink=sink, window=window, forced=forced, hist0=h0)
        assert all(torch.equal(a, b) for a, b in zip(got, plain))
    if norm == "l1":
        want = (s.double().numpy() + np.float32(eps)) * oracle_norms(values, w, G)
        np.testing.assert_allclose(s2.numpy(), want, rtol=2 * REL, atol=1e-6)


def test_many_norm_tiles_leave_the_first_pass_to_the_select(monkeypatch):
    """More than ``FUSED_MAX_SLOTS`` token tiles a row: the norm kernel writes the same stage-2 scores and no first
    pass (``hist0`` None), and CriticalKV's stage 2 counts its own: the same kept tokens."""
    g = torch.Generator().manual_seed(14)
    values = torch.randn(1, 2, 90, 16, generator=g).to(torch.bfloat16)
    w = torch.randn(24, 2 * 2 * 16, generator=g).to(torch.bfloat16)
    s = torch.rand(1, 2, 90, generator=g)
    forced = torch.rand(1, 2, 90, generator=g) < 0.2
    pol = CriticalKV(base=GivenScores(scores=s, sink=1, window=4))
    with on_backend("triton"):
        monkeypatch.setattr(kcrit, "_blocks", lambda n, d, dm, native: (16, 16, 16, 4, 1))
        fused, h0 = value_norms(values, w, scores=s, eps=1e-4, forced=forced, protect=(1, 4))
        want = pol.select(s, 30, values, values, sink=1, window=4, k_max=30, o_proj=w)
        monkeypatch.setattr(kcrit, "FUSED_MAX_SLOTS", 5)  # 6 tiles of 16 tokens a row
        plain, none = value_norms(values, w, scores=s, eps=1e-4, forced=forced, protect=(1, 4))
        got = pol.select(s, 30, values, values, sink=1, window=4, k_max=30, o_proj=w)
    assert h0 is not None and none is None and torch.equal(plain, fused)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_stage2_scores_on_the_pytorch_body(norm):
    """The PyTorch body: (s + ε)·n with the same PyTorch arithmetic as the norms combined outside, and no first
    pass (``hist0`` None: the select counts its own)."""
    g = torch.Generator().manual_seed(11)
    values = torch.randn(2, 2, 40, 16, generator=g).to(torch.bfloat16)
    w = torch.randn(24, 2 * 3 * 16, generator=g)
    s = torch.rand(2, 2, 40, generator=g)
    with on_backend("torch"):
        n = value_norms(values, w, norm=norm)
        assert torch.equal(value_norms(values, w, norm=norm, scores=s, eps=1e-4), (s + 1e-4) * n)
        s2, h0 = value_norms(values, w, norm=norm, scores=s, eps=1e-4, forced=s > 0.5, protect=(1, 3))
        assert torch.equal(s2, (s + 1e-4) * n) and h0 is None


def test_stage2_bad_input():
    """The stage-2 arguments of ``value_norms``, and a first pass counted with other forced tokens, name what is
    wrong."""
    g = torch.Generator().manual_seed(12)
    values = torch.randn(1, 2, 30, 16, generator=g)
    w = torch.randn(24, 2 * 16, generator=g)
    s = torch.rand(1, 2, 30, generator=g)
    forced = torch.zeros(1, 2, 30, dtype=torch.bool)
    with on_backend("triton"):
        with pytest.raises(TypeError, match="scores"):
            value_norms(values, w, scores=s.double())
        with pytest.raises(ValueError, match="scores"):
            value_norms(values, w, scores=s[:, :, :20].contiguous())
        with pytest.raises(ValueError, match="scores"):
            value_norms(values, w, scores=s.transpose(1, 2).contiguous().transpose(1, 2))  # not contiguous
        with pytest.raises(TypeError, match="forced"):
            value_norms(values, w, scores=s, forced=forced.float(), protect=(0, 0))
        with pytest.raises(ValueError, match="forced"):
            value_norms(values, w, scores=s, forced=forced)
        with pytest.raises(ValueError, match="protect"):
            value_norms(values, w, protect=(0, 0))
        s2, h0 = value_norms(values, w, scores=s, forced=forced, protect=(0, 2))
        for other in (None, forced.clone()):
            with pytest.raises(ValueError, match="hist0"):
                ksel.select_kv(s2, 10, values, values, 10, window=2, forced=other, hist0=h0)


@pytest.mark.parametrize("budget", [9, "rows"])
def test_keep_mask_and_a_shared_workspace(budget):
    """``keep_mask`` is ``select_mask``'s bytes (uint8); two selects sharing one ``workspace`` (CriticalKV's
    stages) keep what each keeps with scratch of its own, whatever ran before on the scratch."""
    g = torch.Generator().manual_seed(13)
    R, N = 3, 150
    s = torch.floor(torch.rand(1, R, N, generator=g) * 20)  # many ties
    kv = torch.randn(1, R, N, 8, generator=g)
    b = torch.tensor([5, 40, 150], dtype=torch.int32) if budget == "rows" else budget
    with on_backend("triton"):
        mask = ksel.keep_mask(s, b, sink=1, window=2)
        assert mask.dtype == torch.uint8 and mask.shape == (R, N)
        assert torch.equal(mask.view(1, R, N).bool(), ksel.select_mask(s, b, sink=1, window=2))
        work = ksel.workspace(R, N, s.device)
        for t in work:
            t.fill_(-7)  # garbage from an earlier select
        assert torch.equal(ksel.keep_mask(s, b, sink=1, window=2, work=work), mask)
        want = ksel.select_kv(s, b, kv, kv, 150, sink=1, window=2, forced=mask)
        got = ksel.select_kv(s, b, kv, kv, 150, sink=1, window=2, forced=mask, work=work)
        assert all(torch.equal(x, y) for x, y in zip(got, want))
        with pytest.raises(ValueError, match="work"):
            ksel.select_kv(s, b, kv, kv, 150, work=ksel.workspace(R, N + 1, s.device))


#: the stage-2 epilogue's arguments of both norm kernels, and its configurations: the norms alone, and CriticalKV's
#: stage 2 (scores, forced tokens, first radix pass; HIST_TILE one key per thread at least)
STAGE2_SIG = {"eps": "fp32", "C0": "i32", "sink": "i32", "window": "i32", "HAS_S": "constexpr",
              "HAS_FORCED": "constexpr", "HIST": "constexpr", "NB": "constexpr", "HIST_TILE": "constexpr"}
NORMS_ONLY = {"HAS_S": False, "HAS_FORCED": False, "HIST": False, "NB": 256}
STAGE2_NO_PASS = {"HAS_S": True, "HAS_FORCED": False, "HIST": False, "NB": 256}  # programs of < FUSED_MIN_CHUNK
STAGE2 = {"HAS_S": True, "HAS_FORCED": True, "HIST": True, "NB": 256}


def test_value_norm_kernel_compiles_ahead_of_time():
    """The GPU configurations of ``_blocks``: tensor-core tiles at d = 128 and 64, d = 256, and the IEEE
    fp32 tiles (fp32 and mixed dtypes); the norms alone and CriticalKV's stage 2 (what ``fused_chunk`` allows)."""
    sig = {"v_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32", "s_ptr": "*fp32", "f_ptr": "*u8", "h0_ptr": "*i32",
           "B": "i32", "H": "i32", "G": "i32", "N": "i32", "D": "i32", "DM": "i32", "svb": "i64", "svh": "i64",
           "svn": "i64", "swm": "i64", "swc": "i64", **STAGE2_SIG,
           "BLOCK_N": "constexpr", "BLOCK_D": "constexpr", "BLOCK_M": "constexpr", "NATIVE_DOT": "constexpr"}
    spec = {"module": "tritonkv.kernels.critical", "kernel": "_value_norm_kernel", "signature": sig}
    assert_compiles({**spec, "constexprs": {"BLOCK_N": 256, "BLOCK_D": 128, "BLOCK_M": 64, "NATIVE_DOT": True,
                                            **STAGE2, "HIST_TILE": 256}},
                    {**spec, "constexprs": {"BLOCK_N": 256, "BLOCK_D": 128, "BLOCK_M": 64, "NATIVE_DOT": True,
                                            **NORMS_ONLY, "HIST_TILE": 256}},
                    {**spec, "signature": {**sig, "v_ptr": "*fp16", "w_ptr": "*fp16"},
                     "constexprs": {"BLOCK_N": 256, "BLOCK_D": 64, "BLOCK_M": 64, "NATIVE_DOT": True, **STAGE2,
                                    "HIST_TILE": 256}},
                    {**spec, "constexprs": {"BLOCK_N": 64, "BLOCK_D": 256, "BLOCK_M": 64, "NATIVE_DOT": True,
                                            **STAGE2_NO_PASS, "HIST_TILE": 256}},
                    {**spec, "signature": {**sig, "v_ptr": "*fp32", "w_ptr": "*fp16"},
                     "constexprs": {"BLOCK_N": 32, "BLOCK_D": 128, "BLOCK_M": 32, "NATIVE_DOT": False,
                                    **STAGE2_NO_PASS, "HIST_TILE": 128}})


def test_value_norm_l2_kernel_compiles_ahead_of_time():
    sig = {"v_ptr": "*bf16", "f_ptr": "*bf16", "out_ptr": "*fp32", "s_ptr": "*fp32", "m_ptr": "*u8", "h0_ptr": "*i32",
           "H": "i32", "G": "i32", "N": "i32", "D": "i32", "svb": "i64", "svh": "i64", "svn": "i64", "sfs": "i64",
           **STAGE2_SIG, "BLOCK_N": "constexpr", "BLOCK_D": "constexpr", "BLOCK_K": "constexpr",
           "BLOCK_C": "constexpr", "SPLIT_U": "constexpr", "NATIVE_DOT": "constexpr"}
    spec = {"module": "tritonkv.kernels.critical", "kernel": "_value_norm_l2_kernel", "signature": sig}
    assert_compiles({**spec, "constexprs": {"BLOCK_N": 128, "BLOCK_D": 128, "BLOCK_K": 32, "BLOCK_C": 64,
                                            "SPLIT_U": False, "NATIVE_DOT": True, **STAGE2, "HIST_TILE": 256}},
                    {**spec, "signature": {**sig, "v_ptr": "*fp32"},
                     "constexprs": {"BLOCK_N": 64, "BLOCK_D": 64, "BLOCK_K": 32, "BLOCK_C": 64, "SPLIT_U": True,
                                    "NATIVE_DOT": True, **NORMS_ONLY, "HIST_TILE": 256}})
