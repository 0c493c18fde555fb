"""One rank of the tensor-parallel equivalence tests (``tests/test_distributed.py`` starts ``world`` of them).

    python tests/tp_worker.py RANK WORLD PORT OUT_DIR SUITES [MODEL_DIR]

Every rank builds the same seeded inputs, computes the single-process result on the whole layer itself (same
inputs, same process: no transport of results needed) and the tensor-parallel one on its own heads with
``process_group``, and writes ``OUT_DIR/rank<r>.json``: per case, whether its heads' kept (layer, head, token)
sets equal the single-process ones, and how many collectives the TP call issued (``torch.distributed`` is
instrumented: every collective function counts its calls). The union over ranks equals the single-process result
when every rank reports equality for its heads.

Suites: ``compress`` (``compress()`` on random ``[B, 8, N, D]`` inputs split by heads, queries by their groups,
W_O by columns) and ``model`` (a random Llama with 8 KV heads loaded with ``tp_plan="auto"`` next to the same model
in one process, ``TritonKVCache`` in after_prefill and blockwise modes).
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_gather_object", "all_reduce",
               "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "gather", "scatter", "barrier", "send", "recv", "isend", "irecv")
CALLS = {"n": 0}


def instrument() -> None:
    """Count every call of a ``torch.distributed`` collective (looked up by name at call time by tritonkv)."""
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_counted", False):
            continue

        def counted(*a, _fn=fn, **k):
            CALLS["n"] += 1
            return _fn(*a, **k)

        counted._counted = True
        setattr(dist, name, counted)


def calls() -> int:
    return CALLS["n"]


# -- kept sets ---------------------------------------------------------------------------------------------------
def kept_rows(out) -> list[list[list[int]]]:
    """Kept positions per (batch row, head) of a ``compress`` result, ascending, and the kept keys' checksum."""
    from tritonkv.api import Compressed

    if isinstance(out, Compressed):
        idx = out.indices
        return [[sorted(int(i) for i in idx[b, h] if i >= 0) for h in range(idx.shape[1])] for b in range(idx.shape[0])]
    _, _, lengths, pos = out.to_padded(with_positions=True)
    return [[sorted(int(p) for p in pos[b, h] if p >= 0) for h in range(pos.shape[1])] for b in range(pos.shape[0])]


def kept_keys(out) -> torch.Tensor:
    """The kept keys ``[B, H, k, D]`` in position order, zero-padded to the longest row of the tensor."""
    from tritonkv.api import Compressed

    if isinstance(out, Compressed):
        return out.keys
    K, _, _ = out.to_padded(int(out.length.max()))
    return K


def compare(single, tp, heads: slice, B: int):
    """None when this rank's heads keep the single-process tokens (and keys), else a description."""
    s, t = kept_rows(single), kept_rows(tp)
    for b in range(B):
        want = s[b][heads]
        if t[b] != want:
            bad = [h for h in range(len(want)) if t[b][h] != want[h]]
            h = bad[0]
            return (f"row {b}, local head {h} (global {heads.start + h}): tp {t[b][h][:12]}.. ({len(t[b][h])}) vs "
                    f"single {want[h][:12]}.. ({len(want[h])})")
    ks, kt = kept_keys(single)[:, heads], kept_keys(tp)
    n = min(ks.shape[2], kt.shape[2])
    if not torch.equal(ks[:, :, :n], kt[:, :, :n]):
        return "kept keys differ"
    return None


# -- the compress suite ------------------------------------------------------------------------------------------
B, H, N, D, G, L, LAYER, D_MODEL = 2, 8, 80, 16, 2, 3, 1, 32


def inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, N, D, generator=g)
    values = torch.randn(B, H, N, D, generator=g)
    queries = torch.randn(B, H * G, 8, D, generator=g)
    m = torch.rand(L, B, H * G, N, generator=g)
    head_means = m / m.norm(dim=-1, keepdim=True)
    forced = torch.zeros(B, H, N, dtype=torch.bool)
    forced[:, :, 10] = True
    forced[0, 3, 40:43] = True
    return dict(keys=keys, values=values, queries=queries, o_proj=torch.randn(D_MODEL, H * G * D, generator=g),
                hd=torch.rand(H, generator=g) + 0.1, profile=torch.rand(L, H, generator=g),
                profile_q=torch.rand(L, H * G, generator=g), head_means=head_means,
                layer_preference=torch.rand(L, generator=g) + 0.1,
                fixed=torch.randint(0, 40, (L, H), generator=g), forced=forced,
                positions=torch.arange(N).expand(B, H, N).contiguous(), scores=torch.rand(B, H, N, generator=g))


def compress_cases(x: dict):
    """``(name, policy, allocation, budget, input names, expected collectives)``."""
    from tritonkv.allocation import AdaKV, Cake, Fixed, HeadKV, Pyramid, Score, SurfaceLogic, Uniform
    from tritonkv.policies import (H2O, TOVA, CriticalKV, KeyDiff, Knorm, LagKV, ScoreSelect, SnapKV, StreamingLLM,
                                   SurfaceLogicKV)

    snap = SnapKV(window=8, kernel_size=5)
    q = ("queries",)
    cases = [
        # per-head-local policies, one budget for every head: no collective
        ("knorm", Knorm(), None, 20, (), 0),
        ("keydiff", KeyDiff(), None, 20, (), 0),
        ("keydiff window_share", KeyDiff(window_share=0.2, sink=2), None, 20, (), 0),
        ("keydiff forced", KeyDiff(), None, 20, ("forced", "positions"), 0),
        ("lagkv", LagKV(sink=4, lag=16), None, 40, (), 0),
        ("streaming_llm", StreamingLLM(sink=4), None, 20, (), 0),
        ("snapkv", snap, None, 20, q, 0),
        ("snapkv avg pool", SnapKV(window=8, kernel_size=5, pool="avg"), None, 20, q, 0),
        ("h2o", H2O(window=8), None, 20, q, 0),
        ("tova group", TOVA(), None, 20, q, 0),
        ("tova layer", TOVA(head_reduce="layer"), None, 20, q, 1),
        ("snapkv layer pooled", SnapKV(window=8, kernel_size=5, head_reduce="layer"), None, 20, q, 1),
        ("surfacelogic policy", SurfaceLogicKV(window=8), None, 20, q, 0),
        ("criticalkv", CriticalKV(base=snap), None, 20, q + ("o_proj",), 0),
        ("score policy parallel", ScoreSelect(base=SnapKV(window=8)), None, 20, q + ("hd",), 1),
        ("score policy sequential", ScoreSelect(base=SnapKV(window=8), mode="sequential", alpha=0.5), None, 20,
         q + ("hd",), 1),
        ("score policy full budget", ScoreSelect(base=SnapKV(window=8)), None, N, q + ("hd",), 0),
        # allocators
        ("adakv snapkv", snap, AdaKV(), 20, q, 1),
        ("adakv snapkv candidates", SnapKV(window=4, kernel_size=5), AdaKV(), 10, q, 1),
        ("adakv keydiff candidates", KeyDiff(), AdaKV(), 8, (), 1),
        # forced: every rank reserves the most forced tokens of any row on any rank (one more collective)
        ("adakv keydiff forced", KeyDiff(), AdaKV(), 8, ("forced",), 2),
        ("adakv paper", snap, AdaKV(mode="paper"), 20, q, 1),
        ("adakv alpha 0", KeyDiff(), AdaKV(alpha=0.0), 12, (), 1),
        ("adakv full budget", snap, AdaKV(), N, q, 0),
        ("criticaladakv", CriticalKV(base=snap), AdaKV(), 20, q + ("o_proj",), 1),
        ("adakv lagkv cross", LagKV(sink=4, lag=16, cross_scoring=True), AdaKV(), 44, (), 1),
        ("adakv tova layer", TOVA(head_reduce="layer"), AdaKV(), 12, q, 2),
        ("adakv cap 1e9", KeyDiff(), AdaKV(balance_ranks=1e9), 8, (), 1),
        ("uniform", snap, Uniform(), 20, q, 0),
        ("pyramid", snap, Pyramid(), 20, q + ("layer", "num_layers"), 0),
        ("headkv", KeyDiff(), HeadKV(), 20, ("profile", "layer"), 0),
        ("headkv query profile", KeyDiff(), HeadKV(), 20, ("profile_q", "layer"), 0),
        ("surfacelogic", SurfaceLogicKV(window=8), SurfaceLogic(), 20, q + ("profile", "layer"), 0),
        ("cake", snap, Cake(), 20, q + ("layer_preference", "layer"), 0),
        ("fixed", KeyDiff(), Fixed(budgets=x["fixed"]), 20, ("layer",), 0),
        ("score allocator", SnapKV(window=8), Score(), 20, q + ("head_means", "layer"), 1),
        ("score allocator + policy", ScoreSelect(base=SnapKV(window=8)), Score(), 20,
         q + ("head_means", "layer", "hd"), 2),
    ]
    return cases


def split_inputs(x: dict, names, rank: int, world: int) -> tuple[dict, dict]:
    """The single-process inputs and this rank's (heads, query heads, W_O columns, HD sliced; model-level
    statistics whole)."""
    Hl = H // world
    hs, qs = slice(rank * Hl, (rank + 1) * Hl), slice(rank * Hl * G, (rank + 1) * Hl * G)
    full, mine = {}, {}
    for n in names:
        if n == "queries":
            full[n], mine[n] = x[n], x[n][:, qs].contiguous()
        elif n == "o_proj":
            full[n], mine[n] = x[n], x[n][:, qs.start * D:qs.stop * D].contiguous()
        elif n in ("hd", "forced", "positions"):
            full[n], mine[n] = x[n], x[n][..., hs, :].contiguous() if x[n].dim() == 3 else x[n][hs].contiguous()
        elif n == "profile_q":
            full["profile"] = mine["profile"] = x[n]
        elif n == "layer":
            full[n] = mine[n] = LAYER
        elif n == "num_layers":
            full[n] = mine[n] = L
        else:
            full[n] = mine[n] = x[n]
    return full, mine


def run_compress(rank: int, world: int, pg) -> dict:
    import tritonkv
    from tritonkv.allocation import AdaKV

    x = inputs()
    Hl = H // world
    heads = slice(rank * Hl, (rank + 1) * Hl)
    res = {}
    for name, pol, alloc, budget, names, want_calls in compress_cases(x):
        t0 = time.perf_counter()
        try:
            full, mine = split_inputs(x, names, rank, world)
            single = tritonkv.compress((x["keys"], x["values"]), pol, budget, allocation=alloc, **full)
            before = calls()
            tp = tritonkv.compress((x["keys"][:, heads].contiguous(), x["values"][:, heads].contiguous()), pol,
                                   budget, allocation=alloc, process_group=pg, **mine)
            n = calls() - before
            err = compare(single, tp, heads, B)
            if err is None and n != want_calls:
                err = f"{n} collectives, expected {want_calls}"
            if err is None and alloc is not None:  # the rank's own total was read back (storage sized to it)
                want_total = sum(len(r) for b in kept_rows(single) for r in b[heads])
                if int(tp.length.sum()) != want_total:
                    err = f"rank total {int(tp.length.sum())} != {want_total}"
            res[f"compress/{name}"] = dict(ok=err is None, error=err, collectives=n,
                                           seconds=round(time.perf_counter() - t0, 3))
        except Exception:
            res[f"compress/{name}"] = dict(ok=False, error=traceback.format_exc()[-1500:])
    # balance_ranks=True: every rank keeps H_l·b selectable tokens = AdaKV over its own heads alone
    for name, budget in (("balance_ranks", 8), ("balance_ranks large", 30)):
        try:
            from tritonkv.policies import KeyDiff

            k, v = x["keys"][:, heads].contiguous(), x["values"][:, heads].contiguous()
            before = calls()
            bal = tritonkv.compress((k, v), KeyDiff(), budget, allocation=AdaKV(balance_ranks=True), process_group=pg)
            n = calls() - before
            alone = tritonkv.compress((k, v), KeyDiff(), budget, allocation=AdaKV())
            err = None if kept_rows(bal) == kept_rows(alone) else "balanced != AdaKV within the rank"
            if err is None and bal.lengths.sum(1).tolist() != [Hl * budget] * B:
                err = f"rank totals {bal.lengths.sum(1).tolist()} != {Hl * budget}"
            if err is None and n != 1:
                err = f"{n} collectives"
            res[f"compress/{name}"] = dict(ok=err is None, error=err, collectives=n)
        except Exception:
            res[f"compress/{name}"] = dict(ok=False, error=traceback.format_exc()[-1500:])
    # a softer cap: each rank's total within its cap, layer total H·b, and the capped greedy's order respected
    try:
        from tritonkv.policies import KeyDiff

        k, v = x["keys"][:, heads].contiguous(), x["values"][:, heads].contiguous()
        out = tritonkv.compress((k, v), KeyDiff(), 8, allocation=AdaKV(balance_ranks=1.25), process_group=pg)
        mine = out.lengths.sum(1)
        every = torch.stack(pg_gather(pg, mine)).sum(0)
        err = None
        if not bool((mine <= int(1.25 * Hl * 8)).all()):
            err = f"rank total {mine.tolist()} above the cap"
        elif every.tolist() != [H * 8] * B:
            err = f"layer total {every.tolist()} != {H * 8}"
        res["compress/balance_ranks 1.25"] = dict(ok=err is None, error=err)
    except Exception:
        res["compress/balance_ranks 1.25"] = dict(ok=False, error=traceback.format_exc()[-1500:])
    # helpers
    try:
        from tritonkv.distributed import gather_heads, shard_heads

        hm = x["head_means"]
        local = shard_heads(hm, pg, dim=2)
        ok = torch.equal(gather_heads(local, pg, dim=2), hm) and local.shape[2] == H * G // world
        res["compress/gather_heads shard_heads"] = dict(ok=ok, error=None if ok else "round trip differs")
    except Exception:
        res["compress/gather_heads shard_heads"] = dict(ok=False, error=traceback.format_exc()[-1500:])
    # head_means of one rank's query heads under TP: a clear error, on every rank (no hang)
    try:
        from tritonkv.allocation import Score
        from tritonkv.distributed import shard_heads
        from tritonkv.policies import SnapKV

        k, v = x["keys"][:, heads].contiguous(), x["values"][:, heads].contiguous()
        q = x["queries"][:, rank * Hl * G:(rank + 1) * Hl * G]
        try:
            tritonkv.compress((k, v), SnapKV(window=8), 20, allocation=Score(), queries=q, layer=1,
                              head_means=shard_heads(x["head_means"], pg, dim=2), process_group=pg)
            err = "no error"
        except ValueError as e:
            err = None if "gather_heads" in str(e) else str(e)
        dist.barrier(group=pg)  # every rank is still in step
        res["compress/score local head_means"] = dict(ok=err is None, error=err)
    except Exception:
        res["compress/score local head_means"] = dict(ok=False, error=traceback.format_exc()[-1500:])
    return res


def pg_gather(pg, t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(out, t, group=pg)
    return out


# -- the model suite ---------------------------------------------------------------------------------------------
PROMPT, NEW = 72, 4


def model_cases():
    """``(name, policy, allocation, mode, budget, block_size, input names)``."""
    from tritonkv.allocation import AdaKV, Cake, HeadKV, Pyramid, Score, SurfaceLogic
    from tritonkv.policies import (H2O, TOVA, CriticalKV, KeyDiff, Knorm, LagKV, ScoreSelect, SnapKV, StreamingLLM,
                                   SurfaceLogicKV)

    snap = SnapKV(window=8, kernel_size=5)
    out = []
    for mode, budget, bs in (("after_prefill", 24, 128), ("blockwise", 24, 16)):
        out += [
            (f"{mode}/knorm", Knorm(), None, mode, budget, bs, ()),
            (f"{mode}/keydiff", KeyDiff(), None, mode, budget, bs, ()),
            (f"{mode}/snapkv", snap, None, mode, budget, bs, ()),
            (f"{mode}/h2o", H2O(window=8), None, mode, budget, bs, ()),
            (f"{mode}/tova layer", TOVA(head_reduce="layer"), None, mode, budget, bs, ()),
            (f"{mode}/streaming_llm", StreamingLLM(sink=4), None, mode, budget, bs, ()),
            (f"{mode}/lagkv", LagKV(sink=4, lag=8), None, mode, budget, bs, ()),
            (f"{mode}/criticalkv", CriticalKV(base=snap), None, mode, budget, bs, ()),
            (f"{mode}/score policy", ScoreSelect(base=SnapKV(window=8)), None, mode, budget, bs, ("hd",)),
            (f"{mode}/adakv snapkv", snap, AdaKV(), mode, budget, bs, ()),
            (f"{mode}/adakv keydiff", KeyDiff(), AdaKV(), mode, 12, bs, ()),
            (f"{mode}/criticaladakv", CriticalKV(base=snap), AdaKV(), mode, budget, bs, ()),
            (f"{mode}/pyramid", snap, Pyramid(), mode, budget, bs, ()),
            (f"{mode}/headkv", KeyDiff(), HeadKV(), mode, budget, bs, ("profile",)),
            (f"{mode}/surfacelogic", SurfaceLogicKV(window=8), SurfaceLogic(), mode, budget, bs, ("profile",)),
            (f"{mode}/cake", snap, Cake(), mode, budget, bs, ("layer_preference",)),
            (f"{mode}/score", ScoreSelect(base=SnapKV(window=8)), Score(), mode, budget, bs, ("head_means", "hd")),
        ]
    out.append(("decoding/adakv snapkv", snap, AdaKV(), "decoding", 24, 128, ()))  # re-compressed every 2 steps
    out.append(("blockwise/adakv wrong config", snap, AdaKV(), "blockwise", 24, 16, ()))
    out.append(("after_prefill/budget >= N", snap, AdaKV(), "after_prefill", PROMPT + NEW + 8, 128, ()))
    out.append(("blockwise/budget >= N", KeyDiff(), None, "blockwise", PROMPT + NEW + 8, 16, ()))
    return out


def model_kept(cache) -> list:
    """Per layer, per (batch row, head): the kept sequence positions, ascending."""
    from tritonkv.integrations.transformers import SENTINEL

    out = []
    for layer in cache.layers:
        st = layer.store.to_dense() if layer.store.ragged else layer.store
        pos = st.view()[2]
        out.append([[sorted(int(p) for p in pos[b, h] if p != SENTINEL) for h in range(pos.shape[1])]
                    for b in range(pos.shape[0])])
    return out


def run_model(rank: int, world: int, pg, model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    import tritonkv.integrations.transformers.cache as cache_mod
    from tritonkv.distributed import shard_heads
    from tritonkv.integrations import transformers as tt

    res = {}
    t0 = time.perf_counter()
    single = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    try:
        from transformers import DistributedConfig

        plan = dict(distributed_config=DistributedConfig(tp_plan="auto"))
    except ImportError:
        plan = dict(tp_plan="auto")
    tp = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **plan).eval()
    cfg = single.config
    Hkv, Hq, nl = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.num_hidden_layers
    Hl = Hkv // world
    res["model/load"] = dict(ok=tp.model.layers[0].self_attn.k_proj.weight.to_local().shape[0] == Hl * cfg.head_dim,
                             seconds=round(time.perf_counter() - t0, 2), error=None)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, PROMPT), generator=g)
    m = torch.rand(nl, 1, Hq, PROMPT, generator=g)
    stats = dict(hd=torch.rand(Hkv, generator=g) + 0.1, profile=torch.rand(nl, Hkv, generator=g),
                 layer_preference=torch.rand(nl, generator=g) + 0.1, head_means=m / m.norm(dim=-1, keepdim=True))

    per_call = []
    real_compress = cache_mod.compress

    extra = []

    def counting(*a, **k):
        before = calls()
        out = real_compress(*a, **k)
        per_call.append(calls() - before)
        extra.append(getattr(out, "extra", 0))  # the layer's longest row is on another rank's head
        return out

    cache_mod.compress = counting
    with torch.no_grad():
        ref_tokens = tt.decode(single, *_prefilled(single, ids, None), NEW).tolist()  # a plain DynamicCache
    for name, pol, alloc, mode, budget, bs, names in model_cases():
        t1 = time.perf_counter()
        try:
            full = {n: stats[n] for n in names}
            mine = {n: (shard_heads(v, pg, dim=0) if n == "hd" else v) for n, v in full.items()}
            wrong = "wrong config" in name
            if wrong:  # head counts must come from the tensors
                tp.config.num_key_value_heads, tp.config.num_attention_heads = 3, 5
            every = dict(decode_every=2) if mode == "decoding" else {}
            cs = tt.make_cache(single, pol, budget, mode=mode, allocation=alloc, block_size=bs, **every, **full)
            ct = tt.make_cache(tp, pol, budget, mode=mode, allocation=alloc, block_size=bs, process_group=pg, **every,
                               **mine)
            tok_s = tt.decode(single, cs, tt.prefill(single, ids, cs)[:, -1], NEW).tolist()
            per_call.clear()
            extra.clear()
            tok_t = tt.decode(tp, ct, tt.prefill(tp, ids, ct)[:, -1], NEW).tolist()
            if wrong:
                tp.config.num_key_value_heads, tp.config.num_attention_heads = Hkv, Hq
            ks, kt = model_kept(cs), model_kept(ct)
            err = None
            for l in range(nl):
                if [r[rank * Hl:(rank + 1) * Hl] for r in ks[l]] != kt[l]:
                    err = f"layer {l}: kept sets differ"
                    break
            if err is None and tok_s != tok_t:
                err = f"tokens {tok_t} != single {tok_s}"
            if err is None and "budget >= N" in name and tok_t != ref_tokens:
                err = f"tokens {tok_t} != uncompressed {ref_tokens}"
            if err is None and (cs.compressions != ct.compressions):
                err = f"{ct.compressions} compressions != {cs.compressions}"
            if err is None and per_call and max(per_call) > 2:
                err = f"collectives per compression {per_call}"
            res[f"model/{name}"] = dict(ok=err is None, error=err, collectives=per_call[:],
                                        compressions=ct.compressions, longer_elsewhere=max(extra, default=0), nbytes=ct.nbytes,
                                        seconds=round(time.perf_counter() - t1, 3))
        except Exception:
            res[f"model/{name}"] = dict(ok=False, error=traceback.format_exc()[-2000:])
    cache_mod.compress = real_compress
    return res


def _prefilled(model, ids, _):
    from transformers import DynamicCache

    from tritonkv.integrations.transformers import cache_kwarg

    cache = DynamicCache()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache}).logits[:, -1]
    return cache, logits


def main(argv):
    rank, world, port, out_dir, suites = int(argv[1]), int(argv[2]), int(argv[3]), argv[4], argv[5].split(",")
    model_dir = argv[6] if len(argv) > 6 else None
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    instrument()
    pg = dist.group.WORLD
    res = {}
    t0 = time.perf_counter()
    if "compress" in suites:
        res.update(run_compress(rank, world, pg))
    if "model" in suites:
        res.update(run_model(rank, world, pg, model_dir))
    res["_seconds"] = round(time.perf_counter() - t0, 2)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)
    # every rank done before any tears gloo down; then leave without the interpreter's finalisation: a rank was seen
    # to abort after its work ("terminate called without an active exception", C++ teardown of gloo's threads; 1 of
    # 3 fresh-clone runs, with or without the barrier). The results are written and closed above.
    dist.barrier(group=pg)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
