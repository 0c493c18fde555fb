"""Device launches per ``compress`` (Triton launches + torch-side device ops), counted by the dry
launch replay: CPU tensors routed to the Triton bodies, ``record_launches(execute=False)`` (nothing
runs, so no value can steer the count) and a ``TorchDispatchMode`` that logs every aten op that would
run on the device (fills, copies, arithmetic; views and ``empty`` allocations are no launches) and
every host read of a device value (a sync). Targets: the one-kernel-scorers Knorm and StreamingLLM
at most 4, KeyDiff (two scoring launches) at most 5, the window-attention policies at most 5, SCORE
(a window score, two selects and its penalty kernel) 9, CriticalKV (a window score, two selects and its norm
kernel) 9, none syncing with the host."""
import pytest
import torch

import tritonkv
from helpers import dry  # noqa: E402
from tritonkv.kernels import _common
from tritonkv.kernels.select import select_indices, select_kv

B, H, G, N, D, W = 1, 4, 2, 1500, 32, 8


def _inputs():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    values = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    queries = torch.randn(B, H * G, W, D, generator=g).to(torch.bfloat16)
    lse = torch.randn(B, H * G, W)
    hd = torch.rand(H, generator=g) + 0.1
    o_proj = torch.randn(H * G * D, H * G * D, generator=g).to(torch.bfloat16)
    return keys, values, dict(queries=queries, attn_lse=lse, hd=hd, o_proj=o_proj)


SELECT = ["_select_hist0_kernel", "_select_finish_kernel", "_select_tail_kernel", "_select_compact_kernel"]
LIMITS = {"knorm": 4, "streaming_llm": 4, "keydiff": 5, "snapkv": 5, "tova": 4, "h2o": 4, "surfacelogic": 4,
          "score": 9, "criticalkv": 9}


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_compress_launches_stay_few_and_never_sync(name):
    keys, values, pool = _inputs()
    pol = tritonkv.POLICIES[name]()
    inputs = {n: pool[n] for n in pol.needs}
    if "queries" in pol.needs:
        inputs["attn_lse"] = pool["attn_lse"]
    triton_launches, torch_ops, syncs = dry(lambda: tritonkv.compress((keys, values), pol, 0.25, **inputs))
    total = len(triton_launches) + len(torch_ops)
    assert total <= LIMITS[name] and not syncs, (name, triton_launches, torch_ops, syncs)
    assert triton_launches, name  # the kernels were reached (not the PyTorch bodies)


def test_select_alone_is_four_launches_and_three_with_the_score_pass():
    """The select is pass 0, finish, tail and compact (no memset, no count kernel); with a ``Hist0`` from
    the scoring kernel three; StreamingLLM's protected-only copy one."""
    keys, values, _ = _inputs()
    s = torch.randn(B, H, N)
    names, ops, syncs = dry(lambda: select_kv(s, 300, keys, values, 300, sink=2, window=5))
    assert names == SELECT and not ops
    names, ops, syncs = dry(lambda: select_indices(s, torch.arange(H, dtype=torch.int32) * 50, 300, with_mask=True))
    assert names == SELECT and not syncs
    names, ops, _ = dry(lambda: tritonkv.compress((keys, values), "knorm", 300))
    assert names == ["_knorm_kernel", *SELECT[1:]] and not ops
    names, ops, _ = dry(lambda: tritonkv.compress((keys, values), "streaming_llm", 300))
    assert names == ["_select_compact_kernel"] and not ops


def test_score_is_two_selects_around_one_penalty_launch():
    """SCORE (parallel, ``attn_lse`` given): the base's window score, the unpenalised select (four launches), the
    penalty kernel (r, Ã and the final select's first pass) and the final select's other three; no torch op, no host read,
    with a CPU ``hd`` (read on the host, as a list) and with a device one alike."""
    keys, values, pool = _inputs()
    for hd in (pool["hd"], pool["hd"].tolist()):
        names, ops, syncs = dry(lambda: tritonkv.compress((keys, values), "score", 300, queries=pool["queries"],
                                                          attn_lse=pool["attn_lse"], hd=hd))
        assert names == ["_window_score_kernel", *SELECT, "_score_penalty_kernel", *SELECT[1:]] and not syncs, \
            (names, syncs)
        assert not ops or isinstance(hd, list), ops


@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_criticalkv_is_two_selects_around_the_norm_launch(norm):
    """CriticalKV (SnapKV base, ``attn_lse`` given): the window score and pooling (which counts stage 1's first
    radix pass), stage 1's other three select launches (its keep-mask), the norm kernel (which writes
    (s + ε)·n and stage 2's first pass, the stage-1 tokens protected) and stage 2's other three: 9 launches, no
    host read; the L1 norm no torch op either (the L2 norm factors W_O in PyTorch)."""
    keys, values, pool = _inputs()
    pol = tritonkv.POLICIES["criticalkv"](norm=norm)
    names, ops, syncs = dry(lambda: tritonkv.compress((keys, values), pol, 0.25, queries=pool["queries"],
                                                      attn_lse=pool["attn_lse"], o_proj=pool["o_proj"]))
    kernel = "_value_norm_kernel" if norm == "l1" else "_value_norm_l2_kernel"
    assert names == ["_window_score_kernel", "_window_pool_kernel", *SELECT[1:], kernel, *SELECT[1:]], names
    assert not syncs and (norm == "l2" or not ops), (ops, syncs)


def test_rows_over_two_to_the_31_elements_index_in_int64():
    """R·N > 2^31 scores (each row < 2^31): every select kernel offsets its row by the int64 program
    id (``r * N`` and ``r * (C + 1)`` never wrap) and the launcher passes N < 2^31 as a plain int."""
    import inspect

    from tritonkv.kernels import select

    for k in (select._select_hist0_kernel, select._select_finish_kernel, select._select_tail_kernel,
              select._select_compact_kernel):
        src = inspect.getsource(k.fn)
        assert "r = tl.program_id(1).to(tl.int64)" in src, k.fn.__name__
    R, n = 2, 2 ** 30 + 5  # 2^31 + 10 scores: 8 GB of address space, never touched by a dry replay
    s = torch.empty(R, n)
    with _common.record_launches(execute=False) as log:
        old, _common._cpu[0] = _common._cpu[0], "triton"
        try:
            select_indices(s, 7, 7)
        finally:
            _common._cpu[0] = old
    assert [x.name for x in log] == SELECT
    assert all(x.grid[1] == R and x.args["N"] == n for x in log)


def _allocated_cases():
    keys, values, pool = _inputs()
    g = torch.Generator().manual_seed(1)
    from tritonkv.allocation import AdaKV, head_means

    snap = dict(queries=pool["queries"], attn_lse=pool["attn_lse"])
    return keys, values, {
        "snapkv+adakv": ("snapkv", "adakv", snap),
        "knorm+adakv": ("knorm", "adakv", {}),
        "knorm+adakv paper": ("knorm", AdaKV(mode="paper"), {}),
        "knorm+uniform": ("knorm", "uniform", {}),
        "knorm+pyramid": ("knorm", "pyramid", dict(layer=3, num_layers=6)),
        "knorm+cake": ("knorm", "cake", dict(layer=3, layer_preference=torch.rand(6, generator=g))),
        "knorm+headkv": ("knorm", "headkv", dict(layer=3, profile=torch.rand(6, H, generator=g))),
        "knorm+surfacelogic": ("knorm", "surfacelogic", dict(layer=3, profile=torch.rand(6, H, generator=g))),
        "knorm+score": ("knorm", "score", dict(layer=3, head_means=head_means(torch.rand(6, B, H * G, 5, N,
                                                                                          generator=g)))),
        "knorm+score list": ("knorm", "score", dict(layer=2, head_means=list(head_means(torch.rand(
            6, B, H * G, 5, N, generator=g))))),
    }


# the Triton launches and torch-side device ops of an allocated compress, after a first call (which computes the
# model-level tables on the host and, for inputs on the device, reads them back once)
ALLOCATED = {
    # AdaKV: the per-head top-⌊α·b⌋ select (its mask; its first pass counted by the scoring kernel, as in the dense
    # policy), the global top-H·(b + sink + window) select, whose winners are copied into ragged rows: 10 launches,
    # no torch op (the dense SnapKV: 5)
    "snapkv+adakv": (["_window_score_kernel", "_window_pool_kernel", *SELECT[1:], *SELECT, "_ragged_from_kept_kernel"],
                     []),
    "knorm+adakv": (["_knorm_kernel", *SELECT[1:], *SELECT, "_ragged_from_kept_kernel"], []),
    # one budget for every head: the dense launches, rows at r·cap (positions -1, row starts, next positions)
    "knorm+uniform": (["_knorm_kernel", *SELECT[1:]], ["full", "arange", "full"]),
    "knorm+pyramid": (["_knorm_kernel", *SELECT[1:]], ["full", "arange", "full"]),
    "knorm+cake": (["_knorm_kernel", *SELECT[1:]], ["full", "arange", "full"]),
    # per-head host tables: the budgets and row starts copied from cached device tensors
    "knorm+headkv": (["_knorm_kernel", *SELECT[1:]], ["clone", "full", "clone", "full"]),
    "knorm+surfacelogic": (["_knorm_kernel", *SELECT[1:]], ["clone", "full", "clone", "full"]),
    # SCORE: the layer's global top-B_l (its mask), the head budgets from it in one launch, the rows laid out from
    # them in one more, the per-head select (its first pass counted by the scoring kernel); positions -1
    "knorm+score": (["_knorm_kernel", *SELECT, "_score_heads_kernel", "_ragged_layout_kernel", *SELECT[1:]],
                    ["full"]),
}


def test_allocated_compress_never_syncs():
    """``compress`` with an allocator reads no device value back once its model-level tables are computed: the
    RaggedKV is sized from host ints (AdaKV: ``H·(b + sink + window)`` per batch row; host tables: their values;
    SCORE: its layer totals, read back once per ``head_means`` tensor or list of tensors; AdaKV's paper mode: a
    static bound), so the call can be captured in a CUDA graph. The launches are those of ``ALLOCATED`` (SnapKV +
    AdaKV: 10 Triton launches and no torch op; the dense SnapKV: 5; Knorm + SCORE: 10 launches and 1 torch op, where
    its head budgets and ragged layout took some 145 torch ops)."""
    keys, values, cases = _allocated_cases()
    dense, ops, _ = dry(lambda: tritonkv.compress((keys, values), "snapkv", 0.25, **cases["snapkv+adakv"][2]))
    assert len(ALLOCATED["snapkv+adakv"][0]) <= 2 * (len(dense) + len(ops))  # 10 <= 2 x 5
    for name, (pol, alloc, inputs) in cases.items():
        tritonkv.compress((keys, values), pol, 0.25, allocation=alloc, **inputs)  # the tables, once
        names, ops, syncs = dry(lambda: tritonkv.compress((keys, values), pol, 0.25, allocation=alloc, **inputs))
        assert not syncs, (name, syncs)
        if name in ALLOCATED:
            assert (names, ops) == ALLOCATED[name], (name, names, ops)


def test_allocated_compress_is_the_selection_of_its_budgets():
    """The fast paths keep what the general one keeps (a select per head with the allocator's budgets): AdaKV's
    winners, host-table budgets and one budget for every head give the same rows, lengths and kept tokens."""
    from tritonkv.cache import RaggedKV
    from tritonkv.api import layer_budgets

    keys, values, cases = _allocated_cases()
    for name, (pol, alloc, inputs) in cases.items():
        pol = tritonkv.get_policy(pol)
        got = tritonkv.compress((keys, values), pol, 0.25, allocation=alloc, **inputs)
        scores = pol.score(keys, values, **inputs)
        sink, window = pol.protected(N, int(0.25 * N))
        rest = {k: v for k, v in inputs.items() if k not in ("queries", "attn_lse")}
        budgets = layer_budgets(alloc, scores, int(0.25 * N), sink=sink, window=window, **rest)
        want = RaggedKV.from_selection(scores, budgets.flatten(), keys, values, sink, window)
        assert torch.equal(got.lengths, want.lengths), name
        K, V, L, P = got.to_padded(with_positions=True)
        K2, V2, L2, P2 = want.to_padded(with_positions=True)
        assert torch.equal(P, P2) and torch.equal(K, K2) and torch.equal(V, V2), name
