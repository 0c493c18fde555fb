"""Window attention (algorithms.md §1.4): the kernel and the CPU PyTorch body against the NumPy
oracle and each other, and the four policies built on them (snapkv, tova, h2o, surfacelogic):
selection, invariants, protection, bad inputs, AOT."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tritonkv
from aot import assert_compiles
from reference import window_attention as ref
from reference.select import select as ref_select
from tritonkv.kernels import window_attention as kwa
from tritonkv.kernels.window_attention import window_attention_scores
from tritonkv.policies import H2O, TOVA, SnapKV, SurfaceLogicKV
from helpers import assert_raises_naming, assert_same_scores, both_backends, on_backend  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
POLICY_CLASSES = [SnapKV, TOVA, H2O, SurfaceLogicKV]


@st.composite
def wa_case(draw, dtypes=DTYPES, max_n=160, min_n=1):
    """(keys, queries): G ∈ {1, 3, 4}, N from 1 (W ≥ N included), awkward D; per-token key scales
    and a query temperature spread the attention from flat to peaked."""
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 3, 4]))
    N = draw(st.one_of(st.integers(1, 12), st.integers(13, max_n)) if min_n == 1 else st.integers(min_n, max_n))
    W = draw(st.sampled_from([1, 2, 5, 8, 17, 32, 40]))
    D = draw(st.sampled_from([3, 16, 33, 64]))
    dtype = draw(st.sampled_from(dtypes))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    temp = draw(st.sampled_from([0.5, 1.0, 2.0]))
    keys = torch.randn(B, H, N, D, generator=g) * torch.exp(torch.rand(B, H, N, 1, generator=g) - 0.5)
    queries = torch.randn(B, H * G, W, D, generator=g) * temp
    return keys.to(dtype), queries.to(dtype)


def oracle(keys, queries, **kw):
    """Oracle scores float64 [B, H, N] on the rounded inputs."""
    return np.stack([ref.scores(keys[b].double().numpy(), queries[b].double().numpy(), **kw)
                     for b in range(keys.shape[0])])


def oracle_lse(keys, queries, scale=None):
    return torch.tensor(np.stack([ref.lse(keys[b].double().numpy(), queries[b].double().numpy(), scale)
                                  for b in range(keys.shape[0])]), dtype=torch.float32)


def separated(s, lo, hi, rel=1e-5):
    """Distinct values of s[lo:hi] differ by more than rel·max (exact copies, e.g. from max pooling,
    are one value)."""
    v = np.unique(s[lo:hi])
    return len(v) < 2 or np.diff(v).min() > rel * np.abs(v).max()


def oracle_kw(kw):
    """The kernel's keyword settings under the oracle's names."""
    kw = dict(kw)
    return dict(kw, pool_mode=kw.pop("pool"), rows=kw.pop("row_reduce"))


def assert_scores_close(got, want):
    # fp32 arithmetic against fp64: the logits' rounding (≈1e-7·|τ q·k|) moves P by a relative ≈1e-6
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-5, atol=1e-9 * max(1.0, np.abs(want).max()))


SETTINGS = st.fixed_dictionaries({
    "kernel_size": st.sampled_from([1, 2, 3, 7]),
    "pool": st.sampled_from(["max", "avg"]),
    "row_reduce": st.sampled_from(["mean", "sum"]),
    "head_reduce": st.sampled_from(["mean", "max", "layer"]),
})


@both_backends
@given(case=wa_case(), kw=SETTINGS, lse=st.booleans(), scale=st.sampled_from([None, 0.3]))
def test_scores_match_oracle(backend, case, kw, lse, scale):
    with on_backend(backend):
        keys, queries = case
        attn_lse = oracle_lse(keys, queries, scale) if lse else None
        got = window_attention_scores(keys, queries, attn_lse=attn_lse, scale=scale, **kw)
        assert got.dtype == torch.float32 and got.shape == keys.shape[:3]
        want = oracle(keys, queries, scale=scale, **oracle_kw(kw))
        assert_scores_close(got, want)


@given(case=wa_case(), kw=SETTINGS, lse=st.booleans(), block=st.sampled_from([kwa.TORCH_BLOCK, 1, 300]))
def test_torch_body_matches_kernel(case, kw, lse, block):
    """The CPU PyTorch body against the Triton kernel (interpreter) on the same inputs: scores within
    fp32 round-off (the tolerance of the oracle tests: both are fp32 evaluations of one formula),
    whatever the body's token chunking (one chunk; one key per chunk, partial LSEs combined over N
    chunks; uneven chunks), with and without ``attn_lse``; and compress() with SnapKV on these
    settings keeps the same indices on both where the kernel's scores are separated."""
    keys, queries = case
    attn_lse = oracle_lse(keys, queries) if lse else None
    with on_backend("triton"):
        want = window_attention_scores(keys, queries, attn_lse=attn_lse, **kw)
    orig, kwa.TORCH_BLOCK = kwa.TORCH_BLOCK, block
    try:
        with on_backend("torch"):
            got = window_attention_scores(keys, queries, attn_lse=attn_lse, **kw)
    finally:
        kwa.TORCH_BLOCK = orig
    assert got.dtype == torch.float32 and got.shape == want.shape and got.is_contiguous()
    assert_scores_close(got, want.double().numpy())
    B, H, N, _ = keys.shape
    W = queries.shape[2]
    if N <= W + 1:
        return
    # compress() keeps the same tokens on both wherever the kernel's prefix scores are separated
    pol = SnapKV(window=W, **kw)
    k = W + (N - W) // 2
    inputs = dict(queries=queries, attn_lse=attn_lse)
    kept = []
    for backend in ("triton", "torch"):
        with on_backend(backend):
            kept.append(tritonkv.compress((keys, keys), pol, k, **inputs).indices)
    s = want.numpy()
    for b in range(B):
        for h in range(H):
            if separated(s[b, h], 0, N - W):
                assert torch.equal(kept[0][b, h], kept[1][b, h])


NONFINITE_PLANTS = [("keys", (0, 1, 2, 3)), ("keys", (0, 0, -1, 0)), ("queries", (0, 2, -1, 1)),
                    ("queries", (0, -1, 0, 2)), ("attn_lse", (0, 3, -1))]


@pytest.mark.parametrize("N, W", [(40, 8), (6, 8), (70, 1)])
@pytest.mark.parametrize("which, where", NONFINITE_PLANTS)
@pytest.mark.parametrize("val", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("Hq", [6, 4])
def test_non_finite_inputs_score_alike_on_both_backends(Hq, val, which, where, N, W):
    """A NaN/±inf key, query or given LSE (W > N included: rows that see nothing): NaN and ±inf at the
    same places on the kernel (one key tile, causally masked, or tiles of 16 keys: the first unmasked; one row
    block or blocks of one head) and the PyTorch body (one chunk and many), for every reduction and pooling, the
    finite scores within the oracle tests' tolerance. G = 3 pads the row block with a head (a zeroed query), G = 2
    at W = 8 fills it (16 rows)."""
    g = torch.Generator().manual_seed(8)
    t = {"keys": torch.randn(1, 2, N, 16, generator=g), "queries": torch.randn(1, Hq, W, 16, generator=g),
         "attn_lse": torch.rand(1, Hq, W, generator=g) + 3 if which == "attn_lse" else None}
    t[which][where] = val
    for kw in (dict(), dict(kernel_size=5), dict(head_reduce="max", row_reduce="sum"),
               dict(head_reduce="layer", pool="avg", kernel_size=4)):
        with on_backend("triton"):
            want = window_attention_scores(t["keys"], t["queries"], attn_lse=t["attn_lse"], **kw)
            # row blocks of one head (the row weights come from row_weights, not the kernel); tiles of 16 keys
            for blocks in (dict(GB=1, BW=16), dict(BLOCK_N=16), dict(GB=1, BW=16, BLOCK_N=16)):
                orig = kwa._config
                kwa._config = lambda *a: {**orig(*a), **blocks}
                try:
                    blocked = window_attention_scores(t["keys"], t["queries"], attn_lse=t["attn_lse"], **kw)
                finally:
                    kwa._config = orig
                assert_same_scores(blocked, want, rtol=2e-5, atol=1e-9)
        for block in (kwa.TORCH_BLOCK, 50):
            orig, kwa.TORCH_BLOCK = kwa.TORCH_BLOCK, block
            try:
                with on_backend("torch"):
                    got = window_attention_scores(t["keys"], t["queries"], attn_lse=t["attn_lse"], **kw)
            finally:
                kwa.TORCH_BLOCK = orig
            assert_same_scores(got, want, rtol=2e-5, atol=1e-9)


@both_backends
@settings(max_examples=15)
@given(case=wa_case(), kw=SETTINGS)
def test_lse_given_equals_lse_computed(backend, case, kw):
    with on_backend(backend):
        keys, queries = case
        computed = window_attention_scores(keys, queries, **kw)
        given_ = window_attention_scores(keys, queries, attn_lse=oracle_lse(keys, queries), **kw)
        torch.testing.assert_close(given_, computed, rtol=2e-5, atol=1e-9 * max(1.0, computed.abs().max().item()))


@settings(max_examples=15)
@given(case=wa_case(max_n=100), kw=SETTINGS, chunk=st.sampled_from([16, 32]), lse=st.booleans(),
       hoist=st.booleans())
def test_small_blocks_and_many_chunks(case, kw, chunk, lse, hoist):
    """Several key chunks per row (partial LSEs combined), key tiles smaller than a chunk (tiles every window row
    sees, unmasked, then the causally masked ones), and query rows either in one block (hoisted) or split into blocks
    of one head × 16 rows (no hoisting) give the oracle's scores."""
    keys, queries = case
    orig = kwa._config

    def small(N, G, W, D, ch):
        cfg = orig(N, G, W, D, ch)
        return {**cfg, "BLOCK_N": 16} if hoist else {**cfg, "GB": 1, "BW": 16, "BLOCK_N": 16}

    attn_lse = oracle_lse(keys, queries) if lse else None
    try:
        kwa._config = small
        got = window_attention_scores(keys, queries, attn_lse=attn_lse, chunk=chunk, **kw)
    finally:
        kwa._config = orig
    want = oracle(keys, queries, **oracle_kw(kw))
    assert_scores_close(got, want)


@pytest.mark.parametrize("W", [1, 8, 17])
@pytest.mark.parametrize("hoist", [True, False])
def test_every_window_alignment_with_the_key_tiles(W, hoist):
    """Tiles of 16 keys: the tiles every window row sees run unmasked, the rest with the causal mask. For every N
    from W to W + 33, so that the window starts at each offset of a tile (and a tile ends right before the first
    key a window row does not see), the scores, with the LSE computed and given, match the oracle's."""
    orig = kwa._config

    def small(*a):
        return {**orig(*a), "BLOCK_N": 16} if hoist else {**orig(*a), "GB": 1, "BW": 16, "BLOCK_N": 16}

    g = torch.Generator().manual_seed(W)
    for N in range(W, W + 34):
        keys, queries = torch.randn(1, 2, N, 16, generator=g), torch.randn(1, 4, W, 16, generator=g)
        want = oracle(keys, queries)
        with on_backend("triton"):
            kwa._config = small
            try:
                got = [window_attention_scores(keys, queries, attn_lse=lse)
                       for lse in (None, oracle_lse(keys, queries))]
            finally:
                kwa._config = orig
        for x in got:
            assert_scores_close(x, want)


@both_backends
@given(case=wa_case(min_n=20), data=st.data())
def test_policies_select_oracle_indices(backend, case, data):
    """compress() with each policy keeps exactly the oracle's selection (on separated scores)."""
    with on_backend(backend):
        keys, queries = case
        B, H, N, _ = keys.shape
        cls = data.draw(st.sampled_from(POLICY_CLASSES))
        kw = {}
        if data.draw(st.booleans()):
            kw = dict(window=data.draw(st.integers(1, 12)), kernel_size=data.draw(st.sampled_from([1, 3, 5])),
                      pool=data.draw(st.sampled_from(["max", "avg"])), sink=data.draw(st.integers(0, 3)),
                      head_reduce=data.draw(st.sampled_from(["group", "max", "layer"])))
            if data.draw(st.booleans()):
                kw["q_window"] = data.draw(st.integers(1, 45))
        pol = cls(**kw)
        sink, window = pol.protected(N, N)
        if sink + window >= N:
            return
        k = data.draw(st.integers(sink + window, N - 1))
        inputs = {"queries": queries}
        if data.draw(st.booleans()):
            inputs["attn_lse"] = oracle_lse(keys, queries)
        out = tritonkv.compress((keys, torch.randn_like(keys)), pol, k, **inputs)
        assert out.indices.shape == (B, H, k)
        w_q = min(queries.shape[2], pol.q_window or pol.window)
        q_used = queries[:, :, -w_q:]
        opts = dict(scale=pol.scale, rows=pol.row_reduce, head_reduce=pol.head_reduce)
        want = oracle(keys, q_used, kernel_size=pol.kernel_size, pool_mode=pol.pool, **opts)
        unpooled = oracle(keys, q_used, **opts)
        for b in range(B):
            for h in range(H):
                if separated(want[b, h], sink, N - window) and separated(unpooled[b, h], sink, N - window):
                    np.testing.assert_array_equal(out.indices[b, h].numpy(), ref_select(want[b, h], k, sink, window))
                i = out.indices[b, h]
                assert torch.equal(out.keys[b, h], keys[b, h, i])


@both_backends
@settings(max_examples=15)
@given(case=wa_case(dtypes=[torch.float32]), seed=st.integers(0, 1000), head_reduce=st.sampled_from(["mean", "max"]))
def test_adding_a_vector_to_every_key_leaves_scores_unchanged(backend, case, seed, head_reduce):
    with on_backend(backend):
        keys, queries = case
        g = torch.Generator().manual_seed(seed)
        shift = torch.randn(keys.shape[0], keys.shape[1], 1, keys.shape[3], generator=g)
        s0 = window_attention_scores(keys, queries, kernel_size=3, head_reduce=head_reduce)
        s1 = window_attention_scores(keys + shift, queries, kernel_size=3, head_reduce=head_reduce)
        # each row's logits shift by τ·q_i·c; fp32 logits of size ≈10 carry ≈1e-6 absolute error
        torch.testing.assert_close(s1, s0, rtol=5e-5, atol=1e-9)


@both_backends
@settings(max_examples=15)
@given(case=wa_case(), g=st.sampled_from([2, 3, 4]), kw=SETTINGS)
def test_identical_query_heads_equal_one_head(backend, case, g, kw):
    with on_backend(backend):
        keys, queries = case
        queries = queries[:, : keys.shape[1]]  # one query head per KV head
        one = window_attention_scores(keys, queries, **kw)
        many = window_attention_scores(keys, queries.repeat_interleave(g, dim=1), **kw)
    rtol = identical_heads_rtol(keys, queries, g, kw["kernel_size"])
    torch.testing.assert_close(many, one, rtol=rtol, atol=torch.finfo(torch.float32).tiny)


def identical_heads_rtol(keys, queries, g: int, kernel_size: int) -> float:
    """The relative round-off between the scores of G = g identical query heads and of one head.

    Both calls evaluate the same formula on the same numbers, in different orders: the D-term fp32
    dot products q·k go through matrix tiles whose shapes follow G (BLAS blocking on the CPU, the
    kernel's tl.dot tiles), and the kernel's LSE sums the N keys in blocks whose size follows G. An
    n-term fp32 sum taken in another order moves by about √n·ε·Σ|terms| (ε = 2⁻²⁴; the
    probabilistic bound of Higham & Mary, 2019, rather than the worst case n·ε), so:

    * the exponent x = τ·q·k − lse moves by ≲ √D·ε·A + (√N + max|lse|)·ε, with A the largest
      τ·Σ_d |q_d·k_d| over visible pairs. P = exp(x), so that is P's relative error, and every score
      is a positive combination of P's: it carries the same relative error. Both calls err: ×2;
    * the sums over the W rows and over the κ pooled neighbours (positive terms): ≲ (√W + √κ)·ε;
    * the group reduction: g equal fp32 values summed (≤ (g − 1)·ε), and the scale 1/(W·g) rounded
      to fp32 and applied, against 1/W for one head (≤ 4ε).

    The largest ratio measured to this bound, in a hypothesis search maximising it (1,500 examples
    on the PyTorch body, 400 on the kernel), was 0.36. atol is fp32's smallest normal number:
    below it results are subnormal and lose relative precision."""
    B, H, N, D = keys.shape
    W = queries.shape[2]
    q, k = queries.double(), keys.double()
    visible = torch.arange(N)[None, :] <= (N - W + torch.arange(W))[:, None]  # [W, N]
    dots = torch.einsum("bhwd,bhnd->bhwn", q.abs(), k.abs()) / math.sqrt(D)
    A = float(torch.where(visible, dots, 0.0).max()) if N else 0.0
    lse = oracle_lse(keys, queries)
    L = float(lse[torch.isfinite(lse)].abs().max()) if torch.isfinite(lse).any() else 0.0
    eps = 2.0 ** -24
    return eps * (2 * (math.sqrt(D) * A + math.sqrt(N) + L) + math.sqrt(W) + math.sqrt(kernel_size) + g + 3)


@both_backends
@settings(max_examples=6)
@given(case=wa_case(), head_reduce=st.sampled_from(["group", "layer"]), data=st.data())
def test_tova_is_snapkv_with_one_query_and_no_pooling(backend, case, head_reduce, data):
    with on_backend(backend):
        keys, queries = case
        N = keys.shape[2]
        tova = TOVA(head_reduce=head_reduce)
        snap = SnapKV(window=1, kernel_size=1, head_reduce=head_reduce)
        assert tova.protected(N, N) == snap.protected(N, N) == (0, 1)
        s_t = tova.score(keys, keys, queries=queries)
        assert torch.equal(s_t, snap.score(keys, keys, queries=queries))
        assert torch.equal(s_t, window_attention_scores(keys, queries[:, :, -1:], head_reduce=tova.head_reduce))
        if head_reduce == "layer":  # one ranking shared by every KV head
            assert torch.equal(s_t, s_t[:, :1].expand_as(s_t))
        if N > 1:
            k = data.draw(st.integers(1, N - 1))
            a = tritonkv.compress((keys, keys), tova, k, queries=queries)
            b = tritonkv.compress((keys, keys), snap, k, queries=queries)
            assert torch.equal(a.indices, b.indices) and (a.indices[..., -1] == N - 1).all()


@both_backends
@settings(max_examples=15)
@given(case=wa_case(), head_reduce=st.sampled_from(["mean", "max", "layer"]))
def test_mean_scores_are_a_sub_distribution(backend, case, head_reduce):
    """u ≥ 0 and, in mean form, Σ_{j < N−W} u[h, j] ≤ 1 (each row's softmax sums to 1 over ≥ that range)."""
    with on_backend(backend):
        keys, queries = case
        W = queries.shape[2]
        s = window_attention_scores(keys, queries, head_reduce=head_reduce)
        assert (s >= 0).all()
        if head_reduce != "max":
            assert (s[..., : max(keys.shape[2] - W, 0)].double().sum(-1) <= 1 + 1e-5).all()
        h2o = window_attention_scores(keys, queries, row_reduce="sum", head_reduce=head_reduce)
        torch.testing.assert_close(h2o, s * W, rtol=1e-5, atol=1e-12)


@both_backends
@pytest.mark.parametrize("cls", POLICY_CLASSES)
def test_defaults_and_short_rows(backend, cls):
    """Table defaults; a row no longer than W is all window: the most recent `budget` tokens are kept."""
    with on_backend(backend):
        pol = cls()
        assert pol.nonnegative and pol.needs == ("queries",)
        defaults = {SnapKV: (32, 7, "max", "mean"), TOVA: (1, 1, "max", "mean"), H2O: (32, 1, "max", "sum"),
                    SurfaceLogicKV: (32, 1, "max", "mean")}[cls]
        assert (pol.window, pol.kernel_size, pol.pool, pol.row_reduce) == defaults and pol.head_reduce == "mean"
        W = pol.window
        g = torch.Generator().manual_seed(3)
        keys = torch.randn(1, 2, W, 16, generator=g)
        queries = torch.randn(1, 6, W, 16, generator=g)
        if W > 1:
            assert pol.protected(W, 5) == (0, 5)
            out = tritonkv.compress((keys, keys), pol, 5, queries=queries)
            assert out.indices[0, 0].tolist() == list(range(W - 5, W))
        long_keys = torch.randn(1, 2, W + 20, 16, generator=g)
        assert pol.protected(W + 20, W + 3) == (0, W)
        if W > 1:
            with pytest.raises(ValueError, match="budget"):
                tritonkv.compress((long_keys, long_keys), pol, W - 1, queries=queries)


@both_backends
def test_queries_beyond_the_window_are_ignored(backend):
    with on_backend(backend):
        g = torch.Generator().manual_seed(4)
        keys = torch.randn(1, 2, 60, 16, generator=g)
        queries = torch.randn(1, 4, 20, 16, generator=g)
        lse = oracle_lse(keys, queries[:, :, -8:])
        pol = SnapKV(window=8, kernel_size=3)
        want = window_attention_scores(keys, queries[:, :, -8:], kernel_size=3)
        assert torch.equal(pol.score(keys, keys, queries=queries), want)
        full_lse = torch.cat([torch.zeros(1, 4, 12), lse], dim=2)
        torch.testing.assert_close(pol.score(keys, keys, queries=queries, attn_lse=full_lse), want, rtol=2e-5, atol=1e-9)
        # H2O over every query with a smaller protected window (the original H2O's setting)
        h2o = H2O(window=4, q_window=60)
        q_all = torch.randn(1, 4, 60, 16, generator=g)
        assert torch.equal(h2o.score(keys, keys, queries=q_all), window_attention_scores(keys, q_all, row_reduce="sum"))
        assert h2o.protected(60, 30) == (0, 4)


K = torch.randn(1, 2, 40, 16)
Q = torch.randn(1, 4, 8, 16)
BAD = [
    ("queries missing", lambda: tritonkv.compress((K, K), "snapkv", 35), ValueError, ["queries"]),
    ("queries not a tensor", lambda: window_attention_scores(K, [1, 2]), TypeError, ["queries"]),
    ("queries wrong D", lambda: window_attention_scores(K, torch.randn(1, 4, 8, 8)), ValueError, ["queries", "D=16"]),
    ("queries heads", lambda: window_attention_scores(K, torch.randn(1, 3, 8, 16)), ValueError, ["queries", "H_q"]),
    ("queries empty window", lambda: window_attention_scores(K, torch.randn(1, 4, 0, 16)), ValueError, ["queries", "W"]),
    ("queries batch", lambda: window_attention_scores(K, torch.randn(2, 4, 8, 16)), ValueError, ["queries", "B=1"]),
    ("queries int", lambda: window_attention_scores(K, torch.ones(1, 4, 8, 16, dtype=torch.int32)), TypeError, ["queries"]),
    ("keys 3-d", lambda: window_attention_scores(K[0], Q), ValueError, ["keys"]),
    ("lse shape", lambda: window_attention_scores(K, Q, attn_lse=torch.zeros(1, 4, 7)), ValueError, ["attn_lse", "[B, H_q, W]"]),
    ("lse int", lambda: window_attention_scores(K, Q, attn_lse=torch.zeros(1, 4, 8, dtype=torch.long)), TypeError, ["attn_lse"]),
    ("scale", lambda: window_attention_scores(K, Q, scale=0.0), ValueError, ["scale"]),
    ("kernel_size", lambda: window_attention_scores(K, Q, kernel_size=0), ValueError, ["kernel_size"]),
    ("pool", lambda: window_attention_scores(K, Q, pool="mean"), ValueError, ["pool", "avg"]),
    ("row_reduce", lambda: window_attention_scores(K, Q, row_reduce="max"), ValueError, ["row_reduce", "sum"]),
    ("head_reduce", lambda: window_attention_scores(K, Q, head_reduce="min"), ValueError, ["head_reduce", "layer"]),
    ("policy window 0", lambda: SnapKV(window=0), ValueError, ["window"]),
    ("policy kernel_size", lambda: SnapKV(kernel_size=1.5), ValueError, ["kernel_size"]),
    ("policy pool", lambda: SnapKV(pool="sum"), ValueError, ["pool"]),
    ("policy head_reduce", lambda: TOVA(head_reduce="all"), ValueError, ["head_reduce"]),
    ("policy q_window", lambda: H2O(q_window=0), ValueError, ["q_window"]),
    ("policy scale", lambda: SurfaceLogicKV(scale=-1.0), ValueError, ["scale"]),
    ("budget below window", lambda: tritonkv.compress((K, K), SnapKV(window=8), 5, queries=Q), ValueError, ["budget"]),
]


@pytest.mark.parametrize("what,call,exc,words", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(what, call, exc, words):
    assert_raises_naming(call, exc, words, what)


def test_kernels_compile_ahead_of_time():
    """Every kernel for sm_80 and sm_90: bf16 operands straight into tl.dot (one hoisted row block, values read),
    fp32 inputs (IEEE dot, several row blocks, group max) and fp16 (one hoisted row block, group max), the last two
    with the select's first pass; pooling max and avg + layer mean."""
    mod = "tritonkv.kernels.window_attention"
    i32 = lambda *names: {n: "i32" for n in names}  # noqa: E731
    kq = i32("H", "G", "N", "W", "D", "skb", "skh", "skn", "sqb", "sqh", "sqw", "DV", "svb", "svh", "svn")
    specs = []
    # the fp32 build takes its scales as fp64, the type torch.compile (Inductor) gives a Python float
    for dt, cast, gmax, hoist, has_v, gb, bw in (("bf16", False, False, True, True, 4, 32),
                                                 ("fp32", True, True, False, False, 1, 16),
                                                 ("fp16", False, True, True, False, 4, 32)):
        f = "fp64" if dt == "fp32" else "fp32"
        blocks = {"BLOCK_N": 64, "GB": gb, "BW": bw, "BLOCK_D": 128}
        tail = {"CAST_FP32": cast, "DOT_PREC": "ieee"}
        vals = {"BLOCK_DV": 128, "HAS_V": True} if has_v else {"BLOCK_DV": 16, "HAS_V": False}  # values read or not
        lse_sig = {"k_ptr": f"*{dt}", "q_ptr": f"*{dt}", "v_ptr": f"*{dt}", "part_ptr": "*fp32", **kq, "C": "i32",
                   "scale": f, "CHUNK": "i32"}
        score_sig = {"k_ptr": f"*{dt}", "q_ptr": f"*{dt}", "v_ptr": f"*{dt}", "lse_ptr": "*fp32", "u_ptr": "*fp32",
                     **kq,
                     **i32("slb", "slh", "slc", "slg", "slw", "NC"), "w_ptr": "*fp32", "scale": f,
                     "h0_ptr": "*i32", **i32("sink", "window"), "CHUNK": "i32"}
        lse_c = {**blocks, **tail, **vals}
        score_c = {**blocks, "GROUP_MAX": gmax, "HOIST": hoist, **tail,  # hoisted: weights from the block
                   "HAS_LSE": hoist, "ROW_MEAN": hoist, "HEAD_MEAN": not gmax, **vals,
                   "HIST": not has_v, "NB": 256, "HIST_TILE": 512}  # the select's first pass (no pooling)
        warps = 8 if gb * bw * 64 >= 8192 else 4  # as _config sets them; the stages as the launches do
        specs.append({"module": mod, "kernel": "_window_lse_kernel", "constexprs": lse_c,
                      "signature": {**lse_sig, **{c: "constexpr" for c in lse_c}},
                      "options": {"num_warps": warps, "num_stages": 2}})
        specs.append({"module": mod, "kernel": "_window_score_kernel", "constexprs": score_c,
                      "signature": {**score_sig, **{c: "constexpr" for c in score_c}},
                      "options": {"num_warps": warps, "num_stages": 2 if has_v else kwa.SCORE_STAGES}})
    pool_sig = {"u_ptr": "*fp32", "out_ptr": "*fp32", "h0_ptr": "*i32",
                **i32("H", "N", "n_pool", "C0", "sink", "window")}
    for ks, mx, layer, hist in ((7, True, False, True), (5, False, True, False)):  # with the select's first pass
        c = {"KSIZE": ks, "POOL_MAX": mx, "LAYER": layer, "BLOCK": 1024, "HIST": hist, "NB": 256, "HIST_TILE": 512}
        specs.append({"module": mod, "kernel": "_window_pool_kernel", "constexprs": c,
                      "signature": {**pool_sig, **{k: "constexpr" for k in c}}})
    assert_compiles(*specs)


def test_values_are_checked():
    """``values`` (read with the keys for a policy that reads values): [B, H_kv, N, D_v] like the keys."""
    keys, q = torch.randn(1, 2, 10, 16), torch.randn(1, 4, 3, 16)
    for bad, exc in ((torch.randn(1, 2, 9, 16), ValueError), (torch.randn(2, 10, 16), ValueError),
                     (torch.zeros(1, 2, 10, 16, dtype=torch.int32), TypeError), ([1.0], TypeError)):
        with pytest.raises(exc, match="values"):
            window_attention_scores(keys, q, values=bad)
    v = torch.randn(1, 2, 10, 8)
    torch.testing.assert_close(window_attention_scores(keys, q, values=v), window_attention_scores(keys, q))
