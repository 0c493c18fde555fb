"""Split-K GQA decode attention against the per-row NumPy oracle (ragged, padded, through RaggedKV;
with and without logit softcapping): the Triton kernels (interpreted) and the CPU PyTorch body, and the
two against each other within a tolerance derived from fp32 round-off."""
import importlib.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from aot import assert_compiles
from reference.decode_attention import decode_padded, decode_ragged
from tritonkv.cache import RaggedKV
from tritonkv.kernels.decode_attention import decode_attention, decode_attention_ragged
from helpers import assert_raises_naming, both_backends, on_backend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Interpreted, the kernel computes in fp32 on the same rounded inputs: what is left is the
# output's own rounding (half an ulp). On the GPU fp16/bf16 run tl.dot on native operands and round
# the softmax weights P to the input dtype before P·V (as flash attention does): |error| <= ulp·max|v|.
RTOL = {torch.float32: 2e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}
GPU_HALF = DEVICE == "cuda"


def _check(out, lse, ref_o, ref_lse, dtype):
    assert out.dtype == dtype
    out, lse = out.cpu(), lse.cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    atol = 2 * RTOL[dtype] if GPU_HALF and dtype != torch.float32 else 2e-5  # inputs |v| < ~4
    torch.testing.assert_close(out.float().numpy().astype(np.float64), ref_o, rtol=RTOL[dtype], atol=atol)
    torch.testing.assert_close(lse.numpy().astype(np.float64), ref_lse, rtol=2e-5, atol=1e-4 if GPU_HALF else 2e-5)


def _np(t):
    return t.float().cpu().numpy()


def _dev(*ts):
    return tuple(t.to(DEVICE) for t in ts)


@st.composite
def ragged_case(draw):
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 3))
    G = draw(st.sampled_from([1, 3, 4, 8]))
    D = draw(st.sampled_from([16, 16, 16, 64, 128]))
    R = B * H
    kind = draw(st.sampled_from(["tiny", "one_huge", "random"]))
    if kind == "tiny":  # 0 < length <= a few tokens (and the odd empty row)
        lengths = [draw(st.integers(0, 4)) for _ in range(R)]
    elif kind == "one_huge":
        lengths = [draw(st.integers(1, 3)) for _ in range(R)]
        lengths[draw(st.integers(0, R - 1))] = draw(st.integers(100, 300))
    else:
        lengths = [draw(st.integers(0, 90)) for _ in range(R)]
    slack = [draw(st.integers(0, 5)) for _ in range(R)]
    split = draw(st.sampled_from([16, 32, 48, None]))
    scale = draw(st.sampled_from([None, 0.3]))
    softcap = draw(st.sampled_from([None, None, 0.5, 5.0]))  # Gemma 2's logit softcapping: tanh-bent logits
    return B, H, G, D, lengths, slack, split, scale, softcap, draw(st.integers(0, 2 ** 31 - 1))


def _ragged_inputs(dtype, case):
    """Flat rows with slack; the slack holds NaN (a body that read past a row's length would turn
    the output NaN)."""
    B, H, G, D, lengths, slack, split, scale, softcap, seed = case
    g = torch.Generator().manual_seed(seed)
    ln = torch.tensor(lengths, dtype=torch.int32)
    cap = ln.to(torch.int64) + torch.tensor(slack)
    row_start = torch.cat([torch.zeros(1, dtype=torch.int64), cap.cumsum(0)])
    T = int(row_start[-1]) + 3
    keys = torch.full((T, D), float("nan")).to(dtype)
    values = torch.full((T, D), float("nan")).to(dtype)
    for r in range(B * H):
        s, n = int(row_start[r]), lengths[r]
        keys[s:s + n] = (torch.randn(n, D, generator=g) * 2).to(dtype)
        values[s:s + n] = torch.randn(n, D, generator=g).to(dtype)
    q = (torch.randn(B, H * G, 1, D, generator=g) * 2).to(dtype)
    return _dev(q, keys, values, row_start, ln) + (int(cap.max()),)


@both_backends
@pytest.mark.parametrize("dtype", DTYPES)
@given(case=ragged_case())
def test_ragged_matches_oracle(backend, dtype, case):
    B, H, G, D, lengths, slack, split, scale, softcap, seed = case
    q, keys, values, row_start, ln, max_cap = _ragged_inputs(dtype, case)
    with on_backend(backend):
        out, lse = decode_attention_ragged(q, keys, values, row_start, ln, H, max_cap, scale=scale,
                                           split_tokens=split, return_lse=True, softcap=softcap)
    ref_o, ref_lse = decode_ragged(_np(q)[:, :, 0], _np(keys), _np(values), row_start.cpu().numpy(), lengths, H, scale,
                                   softcap)
    assert out.shape == (B, H * G, 1, D)
    _check(out[:, :, 0], lse, ref_o, ref_lse, dtype)
    for r, n in enumerate(lengths):  # an empty row gives exact zeros, LSE -inf
        if n == 0:
            b, h = divmod(r, H)
            assert (out[b, h * G:(h + 1) * G] == 0).all() and (lse[b, h * G:(h + 1) * G] == -math.inf).all()


@both_backends
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=15)
@given(data=st.data())
def test_padded_matches_oracle(backend, dtype, data):
    """Dense [B, H, cap, D] (+ lengths in every accepted shape, strided storage) = the same kernel."""
    B = data.draw(st.integers(1, 3))
    H = data.draw(st.integers(1, 3))
    G = data.draw(st.sampled_from([1, 3, 4, 8]))
    D = data.draw(st.sampled_from([16, 64]))
    cap = data.draw(st.integers(1, 70))
    form = data.draw(st.sampled_from(["none", "bh", "b", "flat"]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31 - 1)))
    base = torch.randn(B, cap, H, D, generator=g).to(dtype)  # HND-strided view, like some caches
    keys = base.permute(0, 2, 1, 3) if data.draw(st.booleans()) else base.permute(0, 2, 1, 3).contiguous()
    values = torch.randn(B, H, cap, D, generator=g).to(dtype)
    q = torch.randn(B, H * G, 1, D, generator=g).to(dtype)
    ln_bh = torch.randint(0, cap + 1, (B, H), generator=g, dtype=torch.int32)
    if form == "none":
        lengths, ln_bh = None, torch.full((B, H), cap, dtype=torch.int32)
    elif form == "b":
        ln_bh = ln_bh[:, :1].expand(B, H)
        lengths = ln_bh[:, 0].to(torch.int64)
    else:
        lengths = ln_bh if form == "bh" else ln_bh.flatten()
    split = data.draw(st.sampled_from([16, None]))
    softcap = data.draw(st.sampled_from([None, 0.7]))
    q, keys, values = _dev(q, keys, values)
    lengths = None if lengths is None else lengths.to(DEVICE)
    with on_backend(backend):
        out, lse = decode_attention(q, (keys, values), lengths, split_tokens=split, return_lse=True, softcap=softcap)
    ref_o, ref_lse = decode_padded(_np(q)[:, :, 0], _np(keys), _np(values), ln_bh.numpy(), softcap=softcap)
    _check(out[:, :, 0], lse, ref_o, ref_lse, dtype)


@both_backends
def test_split_count_does_not_change_result(backend):
    g = torch.Generator().manual_seed(1)
    B, H, G, cap, D = 1, 2, 4, 200, 16
    k, v = _dev(torch.randn(B, H, cap, D, generator=g), torch.randn(B, H, cap, D, generator=g))
    q, lengths = _dev(torch.randn(B, H * G, 1, D, generator=g), torch.tensor([[200, 37]]))
    with on_backend(backend):
        outs = [decode_attention(q, (k, v), lengths, split_tokens=s) for s in (16, 50, 64, 256)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-6)


@both_backends
@pytest.mark.parametrize("split", [16, 8])
def test_a_split_of_minus_inf_logits_weighs_nothing(backend, split):
    """A kept key with a -inf element gives a logit of -inf: weight 0, as softmax gives it. Alone in its split
    (the newest token after N = 16k tokens) that split's partial was 0/0, and the merge zeroed the whole head."""
    g = torch.Generator().manual_seed(3)
    D = 16
    k, v = torch.randn(1, 1, 17, D, generator=g), torch.randn(1, 1, 17, D, generator=g)
    q = torch.randn(1, 1, 1, D, generator=g).abs() + 0.1
    k[0, 0, 16, 3] = float("-inf")  # q > 0: token 16's logit is -inf
    want = torch.softmax(q[0, 0, 0] @ k[0, 0, :16].T / math.sqrt(D), 0) @ v[0, 0, :16]
    with on_backend(backend):
        o, lse = decode_attention(*_dev(q), _dev(k, v), split_tokens=split, return_lse=True)
    torch.testing.assert_close(o[0, 0, 0].cpu(), want, rtol=1e-5, atol=1e-6)
    assert math.isfinite(float(lse))


@both_backends
def test_a_non_finite_logit_gives_nan_as_softmax_attention_does(backend):
    """A NaN (or +inf) logit poisons its head as it does in softmax attention (SDPA): NaN, never the zeros and
    -inf of an empty row, which a sink or an LSE merge would then silently drop. Other heads and an empty row keep
    their values."""
    g = torch.Generator().manual_seed(4)
    B, H, G, N, D = 1, 3, 2, 40, 16
    k, v = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    q = torch.randn(B, H * G, 1, D, generator=g).abs() + 0.1
    k[0, 0, 5, 3] = float("nan")
    k[0, 1, 7, 2] = float("inf")  # q > 0: a +inf logit
    lengths = torch.tensor([[N, N, 0]])
    with on_backend(backend):
        o, lse = decode_attention(*_dev(q), _dev(k, v), *_dev(lengths), split_tokens=16, return_lse=True)
    o, lse = o.cpu(), lse.cpu()
    sdpa = torch.nn.functional.scaled_dot_product_attention(q[:, :4], k[:, :2].repeat_interleave(G, 1),
                                                            v[:, :2].repeat_interleave(G, 1))
    assert torch.isnan(sdpa).all() and torch.isnan(o[0, :4]).all() and torch.isnan(lse[0, :4]).all()
    assert (o[0, 4:] == 0).all() and (lse[0, 4:] == float("-inf")).all()


@both_backends
@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_cache_equals_its_padded_form(backend, dtype):
    """RaggedKV from a selection, appended to: ragged attention == padded attention == oracle."""
    with on_backend(backend):
        _ragged_cache_equals_its_padded_form(dtype, exact=backend == "triton")


def _ragged_cache_equals_its_padded_form(dtype, exact: bool):
    g = torch.Generator().manual_seed(2)
    B, H, N, D, G = 2, 2, 60, 64, 3
    keys, values = _dev(torch.randn(B, H, N, D, generator=g).to(dtype), torch.randn(B, H, N, D, generator=g).to(dtype))
    scores, budgets = _dev(torch.randn(B, H, N, generator=g), torch.tensor([1, 40, 7, 60]))
    cache = RaggedKV.from_selection(scores, budgets, keys, values, sink=1, window=0, slack=2, total=108)
    for _ in range(3):  # crosses the slack: one re-pack
        cache.append(*_dev(torch.randn(B, H, 1, D, generator=g).to(dtype), torch.randn(B, H, 1, D, generator=g).to(dtype)))
    q, = _dev(torch.randn(B, H * G, 1, D, generator=g).to(dtype))
    out, lse = decode_attention(q, cache, split_tokens=16, return_lse=True)
    K, V, L = cache.to_padded()
    out_p, lse_p = decode_attention(q, (K, V), L, split_tokens=16, return_lse=True)
    if exact:  # the kernels: same tokens, same splits, same order
        torch.testing.assert_close(out, out_p, rtol=0, atol=0)
    else:  # the PyTorch body pads the rows to different static lengths: BLAS may sum in another order
        tol = _fp32_tolerance(q, cache.keys, cache.values, cache.row_start, cache.length, H, 1 / math.sqrt(D))
        _assert_same_fp32((out, lse), (out_p, lse_p), tol)
    ref_o, ref_lse = decode_padded(_np(q)[:, :, 0], _np(K), _np(V), L.cpu().numpy())
    _check(out[:, :, 0], lse, ref_o, ref_lse, dtype)


@both_backends
def test_scale_argument(backend):
    g = torch.Generator().manual_seed(3)
    k, v, q = _dev(torch.randn(1, 1, 9, 16, generator=g), torch.randn(1, 1, 9, 16, generator=g),
                   torch.randn(1, 2, 1, 16, generator=g))
    with on_backend(backend):
        a = decode_attention(q, (k, v), scale=0.5)
        b = decode_attention(q * 2, (k, v), scale=0.25)
    torch.testing.assert_close(a, b)
    ref, _ = decode_padded(_np(q)[:, :, 0], _np(k), _np(v), np.array([[9]]), scale=0.5)
    torch.testing.assert_close(a[:, :, 0].double().cpu().numpy(), ref, rtol=1e-5, atol=1e-6)


def _fp32_tolerance(q, keys, values, row_start, lengths, H, scale, softcap=None):
    """How far two fp32 evaluations of the same attention (same rounded inputs, any summation order)
    can be apart, per query head: each is within E of the exact result, so they are within 2E.

    With u = 2^-24, n the row's length, A = scale · max_j Σ_i |q_i k_ji| and V = max |v|:
    a logit (a D-term dot product, then scaled) is off by at most e_s = (D + 3) u A; the softmax
    weights by a relative 2 e_s + (n + 4) u (exp, an n-term sum, a division); so
    |o - o*| <= V (2 e_s + (2n + 4) u) (their weighted sum of V adds an n-term sum) and
    |lse - lse*| <= e_s + (n + 2) u + u |lse|. With a ``softcap`` c the logit c·tanh(s/c) moves by at most
    what s moves (tanh' <= 1) plus the tanh's own error, 8 u c for the kernel's 2 / (1 + e^(-2x)) - 1 (an exp, a
    sum, a division and the subtraction, each scaled by c), and |lse| <= c + log n. First order in u; returns
    ``(tol_o, tol_lse)`` [B, H_q]."""
    u = 2.0 ** -24
    q = q[:, :, 0].double().cpu().numpy()
    B, Hq, D = q.shape
    G = Hq // H
    tol_o, tol_lse = np.zeros((B, Hq)), np.zeros((B, Hq))
    for r in range(B * H):
        b, h = divmod(r, H)
        s, n = int(row_start[r]), int(lengths[r])
        if n == 0:
            continue
        k, v = keys[s:s + n].double().cpu().numpy(), values[s:s + n].double().cpu().numpy()  # the row's tokens only
        heads = slice(h * G, (h + 1) * G)
        a = scale * (np.abs(q[b, heads]) @ np.abs(k).T).max(1)  # [G]
        e_s = (D + 3) * u * a + (0.0 if softcap is None else 8 * u * softcap)
        top = a if softcap is None else np.minimum(a, softcap)  # the largest logit's size
        tol_o[b, heads] = 2 * np.abs(v).max() * (2 * e_s + (2 * n + 4) * u)
        tol_lse[b, heads] = 2 * (e_s + (n + 2) * u + u * (top + np.log(n)))  # |lse| <= A + log n
    return tol_o, tol_lse


def _assert_same_fp32(a, b, tol):
    """Two ``(out, lse)`` results agree within ``tol`` (``_fp32_tolerance``); fp16/bf16 outputs may
    also differ by one rounding to the output dtype; empty rows are exactly zeros and -inf on both."""
    (o_a, lse_a), (o_b, lse_b) = a, b
    dtype = o_a.dtype
    assert o_b.dtype == dtype and lse_a.dtype == lse_b.dtype == torch.float32
    o_a, o_b = o_a[:, :, 0].double().cpu().numpy(), o_b[:, :, 0].double().cpu().numpy()
    ulp = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    assert (np.abs(o_a - o_b) <= tol[0][..., None] + ulp * np.abs(o_a)).all()
    lse_a, lse_b = lse_a.double().cpu().numpy(), lse_b.double().cpu().numpy()
    empty = np.isneginf(lse_a)
    assert (empty == np.isneginf(lse_b)).all() and (o_b[empty] == 0).all()
    assert (np.abs(lse_a[~empty] - lse_b[~empty]) <= tol[1][~empty]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=15)
@given(case=ragged_case())
def test_torch_body_matches_kernel(dtype, case):
    """The PyTorch body and the interpreted kernels on the same ragged caches: outputs within the fp32
    round-off of ``_fp32_tolerance`` (fp16/bf16 outputs: plus one rounding to the output dtype),
    LSE likewise, empty rows exactly zeros and -inf on both."""
    B, H, G, D, lengths, slack, split, scale, softcap, seed = case
    q, keys, values, row_start, ln, max_cap = _ragged_inputs(dtype, case)
    res = {}
    for backend in ("triton", "torch"):
        with on_backend(backend):
            res[backend] = decode_attention_ragged(q, keys, values, row_start, ln, H, max_cap, scale=scale,
                                                   split_tokens=split, return_lse=True, softcap=softcap)
    assert res["torch"][0].dtype == dtype
    _assert_same_fp32(res["triton"], res["torch"],
                      _fp32_tolerance(q, keys, values, row_start, lengths, H, scale or 1 / math.sqrt(D), softcap))


def test_meta_tensors_give_shapes():
    """Meta tensors (shape inference) run the PyTorch body."""
    q, k = torch.randn(2, 6, 1, 16, device="meta"), torch.randn(2, 3, 40, 16, device="meta")
    out, lse = decode_attention(q, (k, k), return_lse=True)
    assert out.shape == q.shape and out.device.type == "meta" and lse.shape == (2, 6) and lse.dtype == torch.float32
    out, lse = decode_attention_ragged(q, k[0, 0], k[0, 0], torch.zeros(7, dtype=torch.int64, device="meta"),
                                       torch.zeros(6, dtype=torch.int32, device="meta"), 3, 8, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 6)


K0, V0 = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
Q0 = torch.randn(1, 4, 1, 16)
BAD = [
    ("q two tokens", lambda: decode_attention(torch.randn(1, 4, 2, 16), (K0, V0)), ValueError, ["q", "[B, H_q, 1, D]"]),
    ("q heads", lambda: decode_attention(torch.randn(1, 3, 1, 16), (K0, V0)), ValueError, ["q", "multiple"]),
    ("q head dim", lambda: decode_attention(torch.randn(1, 4, 1, 32), (K0, V0)), ValueError, ["q", "head dim"]),
    ("dtype mix", lambda: decode_attention(Q0.half(), (K0, V0)), TypeError, ["dtype"]),
    ("values shape", lambda: decode_attention(Q0, (K0, V0[:, :, :4])), ValueError, ["values"]),
    ("lengths shape", lambda: decode_attention(Q0, (K0, V0), torch.tensor([1, 2, 3])), ValueError, ["lengths"]),
    ("lengths float", lambda: decode_attention(Q0, (K0, V0), torch.tensor([1.0])), TypeError, ["lengths"]),
    ("kv type", lambda: decode_attention(Q0, K0), TypeError, ["kv"]),
    ("split", lambda: decode_attention(Q0, (K0, V0), split_tokens=0), ValueError, ["split_tokens"]),
    ("softcap", lambda: decode_attention(Q0, (K0, V0), softcap=0.0), ValueError, ["softcap", "positive"]),
    ("softcap type", lambda: decode_attention(Q0, (K0, V0), softcap="50"), TypeError, ["softcap"]),
    ("ragged lengths", lambda: decode_attention_ragged(Q0, K0[0, 0], V0[0, 0], torch.tensor([0, 4, 8]),
                                                      torch.tensor([1, 2]), 2, 4), ValueError, ["lengths", "int32"]),
]


@pytest.mark.parametrize("what,call,exc,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input(what, call, exc, words):
    assert_raises_naming(call, exc, words, what)


def test_decode_kernels_compile_ahead_of_time():
    mod = "tritonkv.kernels.decode_attention"
    names = ["q_ptr", "k_ptr", "v_ptr", "start_ptr", "len_ptr", "po_ptr", "plse_ptr", "H", "G", "D", "S", "SPLIT",
             "sqb", "sqh", "skb", "skh", "skn", "svb", "svh", "svn", "qk_scale", "cap_scale"]
    consts = ["BLOCK_N", "BLOCK_D", "GP", "HAS_START", "NATIVE_DOT", "SOFTCAP"]

    def split(dt, has_start, native, scalar="fp32", softcap=False):
        types = ["*" + dt] * 3 + ["*i64", "*i32", "*fp32", "*fp32"] + ["i32"] * 5 + ["i64"] * 8 + [scalar] * 2
        sig = dict(zip(names, types)) | {c: "constexpr" for c in consts}
        return {"module": mod, "kernel": "_decode_split_kernel", "signature": sig,
                "constexprs": {"BLOCK_N": 64, "BLOCK_D": 128, "GP": 16, "HAS_START": has_start, "NATIVE_DOT": native,
                               "SOFTCAP": softcap}}

    def merge(dt, block_s, block_d, hb):
        return {"module": mod, "kernel": "_decode_merge_kernel",
                "signature": {"po_ptr": "*fp32", "plse_ptr": "*fp32", "len_ptr": "*i32", "o_ptr": "*" + dt,
                              "lse_ptr": "*fp32", "G": "i32", "D": "i32", "S": "i32", "SPLIT": "i32", "NH": "i32",
                              "BLOCK_S": "constexpr", "BLOCK_D": "constexpr", "HB": "constexpr"},
                "constexprs": {"BLOCK_S": block_s, "BLOCK_D": block_d, "HB": hb}}
    # torch.compile (Inductor) types a Python float argument fp64: the fp64 builds are what a compiled model runs
    assert_compiles(split("bf16", True, True), split("fp16", False, True), split("fp32", True, False),
                    split("fp32", False, False, "fp64"), split("bf16", True, True, "fp64"),
                    split("bf16", True, True, softcap=True), split("bf16", False, True, "fp64", softcap=True),
                    merge("bf16", 64, 32, 1), merge("fp32", 16, 128, 4))


_MERGE_CONFIGS = {"interpreter": None, "gpu (1 head, 32 channels, 64 splits a step)": (64, 32, 1, 2),
                  "4 splits a step, 4 heads (across rows when G = 3)": (4, 16, 4, 4), "1 split a step": (1, 64, 2, 4)}


@pytest.mark.parametrize("config", list(_MERGE_CONFIGS), ids=list(_MERGE_CONFIGS))
@settings(max_examples=5)
@given(data=st.data())
def test_merge_of_many_splits_matches_oracle(config, data):
    """The merge over many splits (more than one step of BLOCK_S: up to 80 splits of 4 tokens), in the
    GPU's layout (one query head and a channel block per program) and others, with empty rows and
    rows of one token next to long ones: equal to the oracle (the interpreted kernels)."""
    from tritonkv.kernels import decode_attention as mod

    dtype = torch.bfloat16  # the merge is fp32 whatever the dtype
    B, H = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    G, D = data.draw(st.sampled_from([1, 3, 4])), data.draw(st.sampled_from([16, 64]))
    R = B * H
    lengths = [data.draw(st.sampled_from([0, 1, 5, 64, 257, 320])) for _ in range(R)]
    lengths[data.draw(st.integers(0, R - 1))] = 320  # 80 splits of 4 tokens
    case = (B, H, G, D, lengths, [0] * R, 4, None, None, data.draw(st.integers(0, 2 ** 31 - 1)))
    q, keys, values, row_start, ln, max_cap = _ragged_inputs(dtype, case)
    with on_backend("triton"), pytest.MonkeyPatch.context() as mp:
        if _MERGE_CONFIGS[config] is not None:
            mp.setattr(mod, "merge_blocks", lambda S, G, D: _MERGE_CONFIGS[config])
        out, lse = decode_attention_ragged(q, keys, values, row_start, ln, H, max_cap, split_tokens=4,
                                           return_lse=True)
    ref_o, ref_lse = decode_ragged(_np(q)[:, :, 0], _np(keys), _np(values), row_start.cpu().numpy(), lengths, H)
    _check(out[:, :, 0], lse, ref_o, ref_lse, dtype)
    for r, n in enumerate(lengths):
        if n == 0:
            b, h = divmod(r, H)
            assert (out[b, h * G:(h + 1) * G] == 0).all() and (lse[b, h * G:(h + 1) * G] == -math.inf).all()


_NO_RECOMPILE = r"""
import json, os, sys
from benchmarks import kernel_stats as ks  # drops TRITON_INTERPRET; Triton's own JIT binder gives the compiled variant
import torch
from tritonkv.kernels.decode_attention import decode_attention_ragged
keys, splits = {}, {}
for n in (4096, 30000, 131072, 524288):  # tokens per row: four different split sizes / counts
    row_start = torch.arange(9, dtype=torch.int64) * n
    k = torch.empty(8 * n, 128, dtype=torch.bfloat16)
    q = torch.randn(1, 32, 1, 128).to(torch.bfloat16)
    lengths = torch.full((8,), n, dtype=torch.int32)
    log, _, err = ks.dry(lambda: decode_attention_ragged(q, k, k, row_start, lengths, 8, n))
    assert err is None, err
    for rec in log:
        keys.setdefault(rec.name, set()).add(ks.config_key(rec)[0])
        splits.setdefault(rec.name, set()).add((rec.args["S"], rec.args["SPLIT"]))
print(json.dumps({k: [len(v), len(splits[k])] for k, v in keys.items()}))
"""


def test_new_length_bucket_compiles_nothing_new():
    """Decode over caches of 4K to 512K tokens per row (different split sizes and counts): each kernel
    has one compiled variant (the constexprs and Triton's argument specialisation of every launch are
    the same; S and SPLIT are runtime values), as Triton's JIT binder computes it without a GPU."""
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITONKV_CPU_KERNELS")}
    root = os.path.join(os.path.dirname(__file__), "..")
    r = subprocess.run([sys.executable, "-c", _NO_RECOMPILE], capture_output=True, text=True, env=env, timeout=600,
                       cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(res) == {"_decode_split_kernel", "_decode_merge_kernel"}
    for name, (variants, split_sizes) in res.items():
        assert variants == 1 and split_sizes == 4, (name, variants, split_sizes)


_EXPORT = r"""
import torch
from tritonkv.cache import RaggedKV
from tritonkv.kernels.decode_attention import decode_attention, decode_attention_ragged
class Dense(torch.nn.Module):
    def forward(self, q, k, v, lengths):
        return decode_attention(q, (k, v), lengths)
class Ragged(torch.nn.Module):
    def forward(self, q, k, v, row_start, lengths):
        return decode_attention_ragged(q, k, v, row_start, lengths, 2, 32)
q, k, v = torch.randn(1, 6, 1, 16), torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
for m, args in ((Dense(), (q, k, v, torch.tensor([[5, 32]], dtype=torch.int32))),
                (Ragged(), (q, k[0, 0], v[0, 0], torch.tensor([0, 16, 32]), torch.tensor([3, 9], dtype=torch.int32)))):
    ep = torch.export.export(m, args, strict=True)
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("tritonkv" in o for o in ops), ops
    print("exported", type(m).__name__)
    cm = torch.compile(m, fullgraph=True, backend="aot_eager")
    assert torch.equal(cm(*args), m(*args))
    assert torch.equal(ep.module()(*args), m(*args))
    print("compiled", type(m).__name__)
"""


def test_decode_attention_exports_without_graph_break():
    """torch.export (strict) sees one traceable op and ``torch.compile(fullgraph=True)`` (aot_eager)
    has no graph break, both equal to eager (no interpreter in the subprocess, so CPU tensors run the
    PyTorch body)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITONKV_CPU_KERNELS")}
    r = subprocess.run([sys.executable, "-c", _EXPORT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert r.stdout.count("exported") == 2 and r.stdout.count("compiled") == 2


@pytest.mark.skipif(DEVICE == "cuda", reason="the smoke run is the CPU check of the GPU program")
def test_benchmark_program_smoke(tmp_path):
    """benchmarks/decode_attention.py runs end to end on a tiny case and its numbers check out."""
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "decode_attention.py")
    spec = importlib.util.spec_from_file_location("bench_decode_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.adakv_budgets(2, 8, 100).tolist()[:8] == [400] + [57] * 7  # max = 4 x mean at H_kv = 8
    res = bench.main(["--smoke", "--out", str(tmp_path)])
    (row,) = res["rows"]
    assert row["ok"] and row["rel_err_ragged"] < 1e-2 and row["mem_ragged_MB"] > 0
    assert os.path.exists(tmp_path / "cpu-decode_attention.json") and os.path.exists(tmp_path / "cpu-decode_attention.md")
