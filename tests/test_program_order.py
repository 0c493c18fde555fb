"""Program order: on a GPU any program of a launch may run first or last, and the interpreter runs them in grid
order, so a kernel whose output depends on which program finishes a row (the select's last-block-done finish
and tail), on the order of atomic slot claims (the tail's candidate buffer) or on a row-wide reduction across
programs (KeyDiff's anchor, the fused first radix pass) could pass every interpreted test and differ on a GPU.
Here the kernels run under the interpreter with their programs reversed and in seeded random orders
(``helpers.programs_out_of_order``), in rows split over many programs: kept indices exactly the NumPy oracle's,
and every output bit for bit the grid order's. (The select's loops in several steps run out of order in
``test_select_tail.test_every_loop_in_several_steps``.)"""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings, strategies as st

import tritonkv
from helpers import on_backend, programs_out_of_order, ulps
from reference import lagkv as ref_lagkv
from reference.select import first_pass_histogram, select as ref_select
from tritonkv.kernels import keydiff, knorm, score, select as sel, window_attention as wa
from tritonkv.kernels.decode_attention import decode_attention
from tritonkv.kernels.lagkv import lagkv_compress
from tritonkv.kernels.select import NB, select_indices, select_kv
from workspace_check import same

pytestmark = pytest.mark.skipif(not sel.INTERPRET, reason="program order is the interpreter's (TRITON_INTERPRET=1)")

ORDERS = st.sampled_from([None, 0, 1, 2, 3])  # None: reversed; an int: the seed of a random permutation


@triton.jit
def _ticket_kernel(counter_ptr, out_ptr):
    p = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(out_ptr + p, tl.atomic_add(counter_ptr, 1))


def _tickets(seed=False):
    counter, out = torch.zeros(1, dtype=torch.int32), torch.full((15,), -1, dtype=torch.int32)
    if seed is False:
        _ticket_kernel[(5, 3)](counter, out)
        return out, []
    with programs_out_of_order(seed) as launches:
        _ticket_kernel[(5, 3)](counter, out)
    return out, launches


def test_programs_run_once_each_in_the_order_asked():
    """The helper itself: in grid order program (x, y) takes ticket 3x + y; reversed, the last ticket first; a seed,
    another permutation (the same for the same seed); every program once."""
    grid, _ = _tickets()
    assert grid.tolist() == list(range(15))
    rev, launches = _tickets(None)
    assert rev.tolist() == list(range(14, -1, -1)) and launches == [15]
    shuffled = [_tickets(s)[0].tolist() for s in (0, 0, 1)]
    assert shuffled[0] == shuffled[1] and shuffled[0] != shuffled[2]
    for t in shuffled:
        assert sorted(t) == list(range(15)) and t not in (grid.tolist(), rev.tolist())


@st.composite
def select_case(draw):
    rows = draw(st.integers(1, 3))
    n = draw(st.integers(1, 300))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["normal", "ties", "ulps", "special"]))
    if kind == "normal":
        s = rng.standard_normal((rows, n)).astype(np.float32)
    elif kind == "ties":
        s = rng.integers(0, 3, (rows, n)).astype(np.float32)
    elif kind == "ulps":
        s = np.stack([ulps(rng.permutation(n) // 2) for _ in range(rows)])
    else:
        vals = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, 1.0, -1.0], np.float32)
        s = rng.choice(vals, (rows, n)).astype(np.float32)
    sink = draw(st.integers(0, min(3, n)))
    window = draw(st.integers(0, min(5, n - sink)))
    forced = rng.random((rows, n)) < 0.1 if draw(st.booleans()) else None
    low = sink + window + (0 if forced is None else int(forced.sum(1).max()))
    budgets = np.array([draw(st.integers(min(low, n), n + 2)) for _ in range(rows)])
    return s, budgets, sink, window, forced


@settings(max_examples=16, deadline=None)
@given(case=select_case(), chunk=st.sampled_from([16, 64]), order=ORDERS)
def test_select_out_of_order_keeps_the_oracles_tokens(case, chunk, order):
    """The shared select (first pass, finish, tail, compaction) with rows split over 1-19 programs run out of
    order: kept indices exactly the oracle's, the compacted K/V rows those tokens', as in grid order."""
    s, budgets, sink, window, forced = case
    rows, n = s.shape
    k_max = int(min(budgets.max(), n))
    g = torch.Generator().manual_seed(n)
    keys, values = torch.randn(1, rows, n, 4, generator=g), torch.randn(1, rows, n, 4, generator=g)
    args = (torch.from_numpy(s).view(1, rows, n), torch.from_numpy(budgets).to(torch.int32), keys, values, k_max)
    kw = dict(sink=sink, window=window, chunk=chunk, forced=None if forced is None else torch.from_numpy(forced))
    with on_backend("triton"):
        grid = select_kv(*args, **kw)
        with programs_out_of_order(order) as launches:
            got = select_kv(*args, **kw)
    assert launches and max(launches) == rows * -(-n // chunk)
    assert same(got, grid)
    k, v, idx, lengths = got
    for r in range(rows):
        want = ref_select(s[r], int(budgets[r]), sink, window, None if forced is None else forced[r])
        np.testing.assert_array_equal(idx[0, r, : lengths[0, r]].numpy(), want)
        assert torch.equal(k[0, r, : len(want)], keys[0, r, want]) and torch.equal(v[0, r, : len(want)],
                                                                                   values[0, r, want])


def _scorers(keys, values, queries, chunk, protect):
    """(name, scores and first pass) of every kernel that writes scores with the select's first pass."""
    g = torch.Generator().manual_seed(5)
    B, H, N = keys.shape[:3]
    a, u = torch.rand(B, H, N, generator=g), torch.rand(B, H, N, generator=g) < 0.3
    hd = torch.rand(B, H, generator=g) + 0.1
    return {
        "knorm": lambda: knorm.knorm_scores(keys, chunk=chunk, protect=protect),
        "keydiff": lambda: keydiff.keydiff_scores(keys, chunk=chunk, protect=protect),
        "keydiff raw": lambda: keydiff.keydiff_scores(keys, anchor="raw", chunk=chunk, protect=protect),
        "window": lambda: wa.window_attention_scores(keys, queries, chunk=chunk, protect=protect, kernel_size=1,
                                                     head_reduce="mean"),
        "window pooled": lambda: wa.window_attention_scores(keys, queries, chunk=chunk, protect=protect,
                                                            kernel_size=5, head_reduce="max"),
        "window values": lambda: wa.window_attention_scores(keys, queries, values=values, chunk=chunk,
                                                            protect=protect, kernel_size=1, head_reduce="mean"),
        "penalty": lambda: score.score_penalty(a, u, hd, 0.4, chunk=chunk, protect=protect),
    }


@pytest.mark.parametrize("order", [None, 5])
def test_scoring_kernels_and_their_first_pass_out_of_order(order):
    """Every kernel that scores a row in several programs (KeyDiff's anchor summed over the row's chunk partials,
    the window softmax, pooling) and counts the select's first pass into per-chunk slots: scores bit for bit the
    grid order's, the slots summing to the NumPy histogram, and a select fed with them keeping the oracle's
    tokens — all with programs out of order."""
    g = torch.Generator().manual_seed(3)
    B, H, G, N, D, W = 1, 2, 2, 150, 16, 8
    keys = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    values = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    queries = torch.randn(B, H * G, W, D, generator=g).to(torch.bfloat16)
    sink, window, k = 2, W, 40
    with on_backend("triton"):
        for name, run in _scorers(keys, values, queries, 16, (sink, window)).items():
            s, h0 = run()
            with programs_out_of_order(order) as launches:
                s2, h02 = run()
                assert max(launches) >= -(-N // 16) * B * H, name  # each row in many programs
                idx, lengths = select_indices(s2, k, k, sink=sink, window=window, hist0=h02)
            assert same(s2, s), name
            rows = s.view(B * H, N).numpy()
            want = first_pass_histogram(rows, sink, window, bins=NB)
            np.testing.assert_array_equal(h02.hist[:, 1:].sum(1).numpy(), want, err_msg=name)
            for r in range(B * H):
                np.testing.assert_array_equal(idx.view(B * H, k)[r, : lengths.view(-1)[r]].numpy(),
                                              ref_select(rows[r], k, sink, window), err_msg=name)


@pytest.fixture
def many_programs(monkeypatch):
    """Rows split over many programs in every launch ``compress`` makes, as on a GPU (the interpreter's own
    choice is one program a row): 16-token chunks for the scoring kernels, the pooling and the select."""
    blocks = sel._blocks

    def small(n, rows, chunk=None):
        return blocks(n, rows, chunk or 16)

    token_blocks, config, pool = knorm.token_blocks, wa._config, wa._pool_block
    for mod in (sel, score):
        monkeypatch.setattr(mod, "_blocks", small)
    for mod in (knorm, keydiff):
        monkeypatch.setattr(mod, "token_blocks", lambda n, rows, d, chunk=0: token_blocks(n, rows, d, chunk or 16))
    monkeypatch.setattr(wa, "_config", lambda N, G, W, D, chunk: config(N, G, W, D, chunk or 16))
    monkeypatch.setattr(wa, "_pool_block", lambda n: min(pool(n), 16))


def _inputs(N=160, H=3, G=2, D=16, W=8):
    g = torch.Generator().manual_seed(11)
    keys = torch.randn(1, H, N, D, generator=g).to(torch.bfloat16)
    values = torch.randn(1, H, N, D, generator=g).to(torch.bfloat16)
    pool = dict(queries=torch.randn(1, H * G, W, D, generator=g).to(torch.bfloat16),
                attn_lse=torch.randn(1, H * G, W, generator=g), hd=torch.rand(H, generator=g) + 0.1,
                o_proj=torch.randn(H * G * D, H * G * D, generator=g).to(torch.bfloat16))
    return keys, values, pool


POLICIES = sorted(n for n in tritonkv.POLICIES if not n.startswith("test_"))
ALLOCATIONS = [("snapkv", "adakv"), ("knorm", "adakv"), ("knorm", "pyramid"), ("knorm", "headkv"),
               ("knorm", "score")]


def _compress(policy, allocation=None):
    from tritonkv.allocation import head_means

    keys, values, pool = _inputs()
    pol = tritonkv.POLICIES[policy]()
    inputs = {n: pool[n] for n in pol.needs}
    if "queries" in pol.needs:
        inputs["attn_lse"] = pool["attn_lse"]
    g = torch.Generator().manual_seed(2)
    extra = {"pyramid": dict(layer=1, num_layers=4), "headkv": dict(layer=1, profile=torch.rand(4, 3, generator=g)),
             "score": dict(layer=1, head_means=head_means(torch.rand(4, 1, 6, 5, keys.shape[2], generator=g)))}
    if allocation is not None:
        inputs.update(extra.get(allocation, {}), allocation=allocation)
    return tritonkv.compress((keys, values), pol, 0.3, **inputs)


@pytest.mark.parametrize("policy,allocation", [(p, None) for p in POLICIES] + ALLOCATIONS)
def test_compress_out_of_order_equals_grid_order(many_programs, policy, allocation):
    """``compress`` for every policy, and with allocators (AdaKV's global select, per-head budgets, SCORE's head
    budgets and ragged layout), rows of 160 tokens in 16-token programs: with every launch's programs reversed or
    permuted, every output (K, V, lengths, row starts, positions) bit for bit the grid order's."""
    with on_backend("triton"):
        grid = _compress(policy, allocation)
        for order in (None, 7):
            with programs_out_of_order(order) as launches:
                got = _compress(policy, allocation)
            assert launches, policy
            assert same(got, grid), (policy, allocation, order)


@pytest.mark.parametrize("tile,parts", [(4, 1), (8, 2), (0, 3)])
def test_lagkv_and_decode_attention_out_of_order(tile, parts):
    """LagKV's one kernel (a program per group of partitions, the protected tokens by the last programs of a row)
    and decode attention's split and merge over a ragged cache: outputs bit for bit the grid order's."""
    g = torch.Generator().manual_seed(tile + parts)
    keys, values = torch.randn(1, 2, 90, 16, generator=g), torch.randn(1, 2, 90, 16, generator=g)
    q = torch.randn(1, 4, 1, 16, generator=g)
    lengths = torch.tensor([[90, 37]], dtype=torch.int32)
    S, L, quota, rem = 3, 16, 6, 1
    window = ref_lagkv.tail_len(90, S, L)
    k = S + window + quota * (ref_lagkv.num_partitions(90, S, L) - 1) + rem
    runs = [lambda: lagkv_compress(keys, values, k, sink=S, lag=L, quota=quota, rem=rem, window=window, tile=tile,
                                   parts=parts),
            lambda: decode_attention(q, (keys, values), lengths, split_tokens=16, return_lse=True)]
    with on_backend("triton"):
        for run in runs:
            grid = run()
            for order in (None, parts):
                with programs_out_of_order(order):
                    assert same(run(), grid)
