"""SCORE's head budgets kernel (``kernels/score_heads.py``) against the NumPy oracle (Eq. 12 with the largest
remainder) on both backends, over awkward shapes, ties and degenerate head distances; the PyTorch body and the
Triton kernel agree exactly; bad inputs; the AOT compile."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from aot import assert_compiles
from reference import allocation as ref
from tritonkv.allocation import score_head_budgets
from tritonkv.kernels.score_heads import MAX_HEADS, score_heads
from helpers import assert_raises_naming, on_backend  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BACKENDS = ["torch", "triton"]


def _hd(rng, kind: str, B: int, H: int) -> np.ndarray:
    """Head distances of one kind: distinct, a few tied values, all equal, all at the floor 1e-6 (identical
    heads), or zero (every weight 0: the counts are the shares)."""
    if kind == "distinct":
        return rng.uniform(1e-6, 1.0, (B, H))
    if kind == "ties":
        return rng.choice([1e-6, 0.25, 0.5], (B, H))
    if kind == "equal":
        return np.full((B, H), rng.choice([1e-6, 0.3, 1.0]))
    return np.zeros((B, H))


@st.composite
def cases(draw, max_h=19, max_m=40, free=False):
    """(mask bool [B, H, M], hd [B, H] of a dtype, total int32 [B]). The mask is a real global top-total of
    scores with ties (the counts sum to the capped total, as in the allocator) or, with ``free``, possibly any
    0/1 pattern (a formula the oracle's largest remainder, which adds at most one per head, does not follow)."""
    B = draw(st.integers(1, 3))
    H = draw(st.integers(1, max_h))
    M = draw(st.integers(0, max_m))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    total = rng.integers(-1, H * M + 3, B) if M else rng.integers(-1, 3, B)
    if not free or draw(st.booleans()):  # the shared select's mask of tied scores
        scores = rng.integers(0, draw(st.sampled_from([2, 5, 1000])), (B, H * M)).astype(np.float32)
        mask = np.zeros((B, H * M), dtype=bool)
        for b in range(B):
            mask[b, ref.select_row(scores[b], int(max(total[b], 0)))] = True
    else:
        mask = rng.random((B, H * M)) < rng.choice([0.0, 0.1, 0.5, 1.0])
    kind = draw(st.sampled_from(["distinct", "ties", "equal", "zero"]))
    dtype = draw(st.sampled_from(DTYPES))
    hd = torch.from_numpy(_hd(rng, kind, B, H)).to(dtype)
    return torch.from_numpy(mask.reshape(B, H, M)), hd, torch.from_numpy(total).to(torch.int32)


def oracle(mask, hd, total) -> np.ndarray:
    B, H, M = mask.shape
    t = mask.numpy().sum(-1)
    hd64 = hd.double().numpy()  # the dtype's values, exactly
    return np.stack([ref.score_head_shares(t[b], int(total[b]), hd64[b], M) for b in range(B)])


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_matches_oracle(backend, case):
    mask, hd, total = case
    with on_backend(backend):
        got = score_heads(mask, hd, total)
    assert got.dtype == torch.int32 and got.shape == hd.shape
    np.testing.assert_array_equal(got.numpy(), oracle(mask, hd, total))
    B, H, M = mask.shape
    want_sum = np.minimum(np.maximum(total.numpy(), 0), H * M)
    np.testing.assert_array_equal(got.sum(-1).numpy(), want_sum)
    assert (got >= 0).all() and (got <= M).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled kernel)")
@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_compiled_kernel_matches_oracle(case):
    """On a GPU: the compiled kernel's budgets equal the oracle's."""
    mask, hd, total = case
    got = score_heads(mask.cuda(), hd.cuda(), total.cuda())
    assert got.is_cuda and got.dtype == torch.int32
    np.testing.assert_array_equal(got.cpu().numpy(), oracle(mask, hd, total))


@settings(max_examples=80, deadline=None)
@given(case=cases(free=True), layout=st.sampled_from(["contiguous", "strided", "int8"]))
def test_kernel_is_the_pytorch_formula(case, layout):
    """The Triton kernel (interpreter) and the PyTorch body give the same budgets, bit for bit; hd may be a
    strided view, the mask int8."""
    mask, hd, total = case
    if layout == "strided":
        hd = torch.stack([hd, torch.full_like(hd, 7.0)], -1)[..., 0]
    if layout == "int8":
        mask = mask.to(torch.int8)
    with on_backend("torch"):
        want = score_heads(mask, hd, total)
    with on_backend("triton"):
        got = score_heads(mask, hd, total)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_heads_and_long_rows(backend):
    """The largest block the kernel holds (MAX_HEADS heads) and rows longer than one mask tile; above MAX_HEADS the
    op runs the PyTorch formula on every device."""
    rng = np.random.default_rng(3)
    for H, M in ((MAX_HEADS, 70), (5, 5000), (MAX_HEADS + 3, 9)):
        mask = torch.from_numpy(rng.random((2, H, M)) < 0.3)
        hd = torch.from_numpy(rng.choice([1e-6, 0.4, 0.7], (2, H))).float()
        total = torch.tensor([H * M // 3, H * M + 5], dtype=torch.int32)
        with on_backend(backend):
            got = score_heads(mask, hd, total)
        np.testing.assert_array_equal(got.numpy(), oracle(mask, hd, total))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_score_head_budgets_is_the_oracle(backend, data):
    """The allocator's entry point (the global select of the layer's scores, then the kernel) against the
    oracle's select + Eq. 12, on scores with ties and NaN."""
    B, H, M = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 9)), data.draw(st.integers(1, 30))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    scores = rng.integers(0, data.draw(st.sampled_from([3, 1000])), (B, H, M)).astype(np.float32)
    scores[rng.random((B, H, M)) < 0.1] = np.nan
    bl = rng.integers(0, H * M + 3, B)
    hd = _hd(rng, data.draw(st.sampled_from(["distinct", "ties", "equal", "zero"])), B, H).astype(np.float32)
    with on_backend(backend):
        got = score_head_budgets(torch.from_numpy(scores), torch.from_numpy(bl), torch.from_numpy(hd))
    for b in range(B):
        np.testing.assert_array_equal(got[b].numpy(), ref.score_heads(scores[b], bl[b], hd[b].astype(np.float64)))


def test_empty_shapes():
    for shape in ((0, 3, 4), (2, 0, 4), (2, 3, 0)):
        for backend in BACKENDS:
            with on_backend(backend):
                got = score_heads(torch.zeros(shape, dtype=torch.bool), torch.ones(shape[:2]),
                                  torch.full((shape[0],), 5, dtype=torch.int32))
            assert got.shape == shape[:2] and not got.any(), (shape, backend)


@pytest.mark.parametrize("make, exc, words", [
    (lambda: score_heads(torch.zeros(1, 2, 3), torch.ones(1, 2), torch.ones(1, dtype=torch.int32)), TypeError,
     ["mask"]),
    (lambda: score_heads(torch.zeros(1, 2, 3, dtype=torch.bool), torch.ones(1, 3), torch.ones(1, dtype=torch.int32)),
     TypeError, ["hd"]),
    (lambda: score_heads(torch.zeros(1, 2, 3, dtype=torch.bool), torch.ones(1, 2, dtype=torch.int32),
                         torch.ones(1, dtype=torch.int32)), TypeError, ["hd"]),
    (lambda: score_heads(torch.zeros(1, 2, 3, dtype=torch.bool), torch.ones(1, 2), torch.ones(1)), TypeError,
     ["total"]),
    (lambda: score_heads(torch.zeros(1, 2, 3, dtype=torch.bool), torch.ones(1, 2), torch.ones(2, dtype=torch.int32)),
     TypeError, ["total"]),
    (lambda: score_heads(torch.zeros(1, 2, 3, dtype=torch.bool), torch.ones(1, 2, device="meta"),
                         torch.ones(1, dtype=torch.int32)), ValueError, ["hd"]),
])
def test_bad_inputs(make, exc, words):
    assert_raises_naming(make, exc, words)


def test_aot_compiles():
    sig = {"u_ptr": "*i8", "hd_ptr": "*fp32", "lb_ptr": "*i32", "out_ptr": "*i32", "H": "i32", "M": "i32",
           "shb": "i32", "shh": "i32", "slb": "i32", "BLOCK_H": "constexpr", "BLOCK_M": "constexpr",
           "HD_F64": "constexpr"}
    spec = {"module": "tritonkv.kernels.score_heads", "kernel": "_score_heads_kernel"}
    assert_compiles(dict(spec, signature=sig, constexprs={"BLOCK_H": 8, "BLOCK_M": 512, "HD_F64": False}),
                    dict(spec, signature=dict(sig, u_ptr="*i1", hd_ptr="*bf16"),
                         constexprs={"BLOCK_H": 1, "BLOCK_M": 4096, "HD_F64": False}),
                    dict(spec, signature=dict(sig, hd_ptr="*fp64"),
                         constexprs={"BLOCK_H": MAX_HEADS, "BLOCK_M": 32, "HD_F64": True}))
