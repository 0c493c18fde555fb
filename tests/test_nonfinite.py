"""Non-finite inputs, every policy (docs/contracts.md, "Non-finite inputs").

The rule: a token whose key (or value, for a policy that reads values) has a NaN or ±inf element ranks
lowest, and every statistic over tokens (softmax normalisers, anchors, means) is taken over the finite
tokens only, so the other tokens are scored as if the non-finite ones were absent; a window query row
with a non-finite element is left out of the window's means. Checked here on the CPU PyTorch bodies and
on the Triton kernels (interpreter):

(a) a non-finite token is never kept unless protected;
(b) the kept set equals that of the same input with the non-finite tokens removed (indices mapped back);
(c) a policy that never reads values ignores non-finite values (same kept set as with finite ones).
"""
import pytest
import torch

import tritonkv
from tritonkv.policies import (H2O, TOVA, CriticalKV, KeyDiff, Knorm, LagKV, ScoreSelect, SnapKV, StreamingLLM,
                               SurfaceLogicKV)
from helpers import both_backends, on_backend  # noqa: E402

B, H, G, N, D, W, BUDGET = 2, 2, 2, 40, 16, 8, 16
BAD = (5, 17, 18)  # injected tokens: outside every policy's sinks (≤ 4) and recent window (last 8)
BAD_VALUE = 11  # a token whose value (only) is injected


#: one small instance per registered policy (pooling off where removal could not match: see ``POOLED``)
POLICY_CASES = {
    "criticalkv": lambda: CriticalKV(base=SnapKV(window=W, kernel_size=1)),
    "h2o": lambda: H2O(window=W),
    "keydiff": lambda: KeyDiff(),
    "knorm": lambda: Knorm(),
    "lagkv": lambda: LagKV(sink=4, lag=8),
    "score": lambda: ScoreSelect(base=SnapKV(window=W, kernel_size=1)),
    "snapkv": lambda: SnapKV(window=W, kernel_size=1),
    "streaming_llm": lambda: StreamingLLM(sink=4),
    "surfacelogic": lambda: SurfaceLogicKV(window=W),
    "tova": lambda: TOVA(),
}
#: pooled settings: (a) only — pooling runs over positions, so a removed token's neighbours see other
#: neighbours than around the hole the non-finite token leaves
POOLED = {"snapkv_pool7": lambda: SnapKV(window=W, kernel_size=7),
          "criticalkv_pool7": lambda: CriticalKV(base=SnapKV(window=W, kernel_size=7)),
          "surfacelogic_avg": lambda: SurfaceLogicKV(window=W, kernel_size=5, pool="avg")}
#: LagKV's partitions are positional: removing a token moves every later partition boundary, so (b) does not
#: apply; its form of the rule (the lag reference over finite tokens, non-finite tokens last in their partition) is
#: tested in tests/test_lagkv.py (test_non_finite_token_is_left_out)
POSITIONAL = {"lagkv"}
READS_VALUES = {"criticalkv", "lagkv"}
NAMES = sorted(tritonkv.POLICIES)


def test_every_policy_is_covered():
    assert set(POLICY_CASES) == set(tritonkv.POLICIES)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, N, D, generator=g) * torch.exp(torch.rand(B, H, N, 1, generator=g) - 0.5)
    values = torch.randn(B, H, N, D, generator=g)
    extra = {"queries": torch.randn(B, H * G, W, D, generator=g), "o_proj": torch.randn(24, H * G * D, generator=g),
             "hd": torch.tensor([0.5, 1.0])}
    return keys, values, extra


def _needed(policy, extra):
    return {k: v for k, v in extra.items() if k in policy.needs}


def _kept(policy, keys, values, extra) -> torch.Tensor:
    return tritonkv.compress((keys, values), policy, BUDGET, **_needed(policy, extra)).indices


def _poison(keys, values, extra, name):
    """Non-finite keys at BAD (NaN, +inf, −inf elements, every head of every row), values at
    BAD_VALUE for value readers, and the first window query row of every head for query readers."""
    keys, values = keys.clone(), values.clone()
    keys[:, :, BAD[0], 3] = float("nan")
    keys[:, :, BAD[1], 0] = float("inf")
    keys[:, :, BAD[2], :] = float("-inf")
    bad = list(BAD)
    if name in READS_VALUES:
        values[:, :, BAD_VALUE, 7] = float("nan")
        values[:, :, BAD_VALUE, 2] = float("inf")
        bad.append(BAD_VALUE)
    extra = dict(extra)
    if "queries" in extra:
        extra["queries"] = extra["queries"].clone()
        extra["queries"][:, :, 0, 1] = float("nan")  # row 0 of every head: left out as if absent
    return keys, values, extra, sorted(bad)


def _removed(keys, values, extra, bad):
    """The same input without the tokens ``bad`` (and without the first query row)."""
    keep = torch.tensor([j for j in range(N) if j not in bad])
    extra = dict(extra)
    if "queries" in extra:
        extra["queries"] = extra["queries"][:, :, 1:]  # row 0 was at position N − W: the rest keep theirs
    return keys[:, :, keep], values[:, :, keep], extra, keep


@both_backends
@pytest.mark.parametrize("name", NAMES)
def test_non_finite_tokens_are_scored_as_if_absent(backend, name):
    policy = POLICY_CASES[name]()
    keys, values, extra = _inputs()
    pk, pv, pextra, bad = _poison(keys, values, extra, name)
    with on_backend(backend):
        got = _kept(policy, pk, pv, pextra)
        rk, rv, rextra, keep = _removed(keys, values, pextra, bad)
        want = keep[_kept(policy, rk, rv, rextra)]
    assert not torch.isin(got, torch.tensor(bad)).any(), "a non-finite token was kept"  # (a)
    if name not in POSITIONAL:
        assert torch.equal(got, want)  # (b)


@both_backends
@pytest.mark.parametrize("name", sorted(POOLED))
def test_pooled_policies_never_keep_non_finite_tokens(backend, name):
    policy = POOLED[name]()
    keys, values, extra = _inputs(1)
    pk, pv, pextra, bad = _poison(keys, values, extra, "criticalkv" if "criticalkv" in name else name)
    with on_backend(backend):
        got = _kept(policy, pk, pv, pextra)
    assert got.shape[-1] == BUDGET and not torch.isin(got, torch.tensor(bad)).any()


@both_backends
@pytest.mark.parametrize("name", sorted(set(tritonkv.POLICIES) - READS_VALUES))
def test_key_only_policies_ignore_non_finite_values(backend, name):
    """(c): a policy that never reads values keeps the same tokens whatever the values hold."""
    policy = POLICY_CASES[name]()
    keys, values, extra = _inputs(2)
    bad_values = values.clone()
    bad_values[:, :, 3, 0] = float("nan")
    bad_values[:, :, 20, :] = float("inf")
    with on_backend(backend):
        assert torch.equal(_kept(policy, keys, bad_values, extra), _kept(policy, keys, values, extra))


@both_backends
def test_a_head_without_finite_query_rows_is_left_out_of_the_group_mean(backend):
    """Every window row of query head 1 non-finite: KV head 0's scores are query head 0's alone."""
    keys, _, extra = _inputs(3)
    q = extra["queries"].clone()
    q[:, 1, :, 0] = float("nan")
    from tritonkv.kernels.window_attention import window_attention_scores

    with on_backend(backend):
        got = window_attention_scores(keys, q)
        alone = window_attention_scores(keys[:, :1], q[:, :1])  # one KV head, its first query head only
    torch.testing.assert_close(got[:, 0], alone[:, 0], rtol=1e-5, atol=1e-9)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_rows_is_exact(dtype):
    """The CPU bodies' check of which tokens are finite (``finite_rows``: a shortcut through the row sums, then the
    exact check on the rows whose sum is not finite) against ``isfinite(x).all(-1)``: a row of huge finite
    elements whose sum overflows is finite; a NaN, a +inf, a -inf or both infinities (a NaN sum) make a row
    non-finite; every other row is finite."""
    from tritonkv.kernels._common import finite_rows

    big = torch.finfo(dtype).max / 2
    x = torch.randn(3, 4, 10, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[0, 0, 1] = big  # finite: its sum overflows to +inf
    x[1, 3, 9, :4] = -big
    x[0, 1, 2, 3] = float("nan")
    x[1, 2, 3, 0] = float("inf")
    x[2, 3, 4, 5] = float("-inf")
    x[2, 0, 5, 1], x[2, 0, 5, 6] = float("inf"), float("-inf")
    want = torch.isfinite(x).all(-1)
    assert int((~want).sum()) == 4
    fin, every = finite_rows(x)
    assert torch.equal(fin, want) and not every
    fin, every = finite_rows(x[2:, 1:3])  # every row finite: the shortcut alone
    assert fin.all() and every
