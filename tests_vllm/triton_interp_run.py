"""The wrapped ``TRITON_ATTN`` backend run on the CPU with Triton's interpreter: ``python triton_interp_run.py
MODEL_DIR OUT.json`` (run by ``test_vllm_backends.py`` in its own process).

vLLM's CPU build disables Triton (``vllm.triton_utils`` hands its kernels a placeholder when Triton has no CPU
backend) and its cache writer asks CUDA for the device's capability; this script, and only it, points
``vllm.triton_utils`` at the real Triton (``TRITON_INTERPRET=1``) and answers the capability query before vLLM's
kernel modules are imported. Nothing else of vLLM is changed.

Two requests of different lengths are stepped through chunked prefill and decode with a paged cache whose block 0
is vLLM's null block; blocks below ``start(processed tokens)`` are freed as vLLM's manager frees them and handed to
the other request. Each step runs vLLM's cache writer, the plugin's builder and its impl's forward (vLLM's
``unified_attention`` kernel on the virtual table, then the compaction). The reference, written from the schedule's
definition, keeps each request's kept tokens per KV head in a dense list, lays them and the step's tokens out in a
fresh cache and runs the *stock* Triton builder and impl on it; the outputs must be identical, and so must the
tokens the plugin left in the trailing slots and those ``tritonkv.compress`` keeps of the dense region.
"""
from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.language.extra.libdevice as tldevice  # noqa: E402
import vllm.triton_utils as triton_utils  # noqa: E402

triton_utils.triton, triton_utils.tl, triton_utils.tldevice, triton_utils.HAS_TRITON = triton, tl, tldevice, True
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # a tile-size heuristic of the cache writer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import helpers as H  # noqa: E402

BS = 16  # the Triton kernel's block size is a multiple of 16
BUDGET = 40
G = 16
HQ, HKV, D = 4, 2, 32
POOL = 24
#: (prompt length, tokens decoded, prefill chunk)
REQUESTS = [(60, 30, 24), (30, 26, 16)]


def main(model: str, out_path: str) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl, TritonAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import tritonkv
    from tritonkv.integrations.vllm.spec import TritonKVSpec
    from tritonkv.integrations.vllm.triton_attn import TritonKVTritonBackend, TritonKVTritonBuilder

    cfg = {"policy": "keydiff", "budget": BUDGET, "decode_every": G}
    args = EngineArgs(**H.engine_kwargs(model, cfg, block_size=BS))
    vcfg = args.create_engine_config()
    g = torch.Generator().manual_seed(0)
    with set_current_vllm_config(vcfg):
        spec = TritonKVTritonBackend.customize_spec(FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D,
                                                                      dtype=torch.float32))
        assert isinstance(spec, TritonKVSpec) and spec.tkv_granularity == G, spec
        builder = TritonKVTritonBackend.get_builder_cls()(spec, ["model.layers.0.self_attn.attn"], vcfg,
                                                           torch.device("cpu"))
        assert isinstance(builder, TritonKVTritonBuilder) and builder.tkv is not None
        stock_builder = TritonAttentionMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], vcfg,
                                                       torch.device("cpu"))
        impl = TritonKVTritonBackend.get_impl_cls()(HQ, D, D ** -0.5, HKV, None, None, "auto")
        assert impl.tkv_policy is not None
    stock = TritonAttentionImpl(HQ, D, D ** -0.5, HKV, None, None, "auto")
    policy = tritonkv.get_policy("keydiff")

    class Layer:  # what the impl reads of vLLM's Attention layer
        _k_scale = _v_scale = _q_scale = torch.ones(())

    layer = Layer()
    kv = torch.randn(POOL, BS, HKV, 2 * D, generator=g).transpose(1, 2)  # vLLM's LBNHC: [B, H, N, C] logically
    free = list(range(1, POOL))  # block 0: vLLM's null block (random data: it must never be read)
    width = 1 + max(p + t for p, t, _ in REQUESTS) // BS
    reqs = []
    for i, (p, t, chunk) in enumerate(REQUESTS):
        total = p + t
        reqs.append(dict(k=torch.randn(total, HKV, D, generator=g), v=torch.randn(total, HKV, D, generator=g),
                         q=torch.randn(total, HQ, D, generator=g), prompt=p, total=total, chunk=chunk, n=0,
                         table=[], kept_k=torch.zeros(HKV, 0, D), kept_v=torch.zeros(HKV, 0, D)))
    steps = compactions = decode_steps = 0
    max_dropped = 0
    while any(r["n"] < r["total"] for r in reqs):
        rows = [r for r in reqs if r["n"] < r["total"]]
        for r in rows:  # the manager: free the blocks below start(processed), null them, allocate the tail
            s = H.kept_start(r["n"], BUDGET, G)
            for j in range(s // BS):
                if r["table"][j]:
                    free.append(r["table"][j])
                    r["table"][j] = 0
            r["q_len"] = min(r["chunk"], r["prompt"] - r["n"]) if r["n"] < r["prompt"] else 1
            while len(r["table"]) * BS < r["n"] + r["q_len"]:
                r["table"].append(free.pop(0))
        pos = [torch.arange(r["n"], r["n"] + r["q_len"]) for r in rows]
        slots = torch.cat([torch.tensor(r["table"])[p // BS] * BS + p % BS for r, p in zip(rows, pos)])
        key = torch.cat([r["k"][p] for r, p in zip(rows, pos)])
        value = torch.cat([r["v"][p] for r, p in zip(rows, pos)])
        query = torch.cat([r["q"][p] for r, p in zip(rows, pos)])
        impl.do_kv_cache_update(layer, key, value, kv, slots)  # vLLM's Triton cache writer
        seq = [r["n"] + r["q_len"] for r in rows]
        qsl = torch.tensor([0] + [sum(r["q_len"] for r in rows[: i + 1]) for i in range(len(rows))],
                           dtype=torch.int32)
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, : len(r["table"])] = torch.tensor(r["table"])
        cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
                                     seq_lens=torch.tensor(seq, dtype=torch.int32), num_reqs=len(rows),
                                     num_actual_tokens=int(qsl[-1]), max_query_len=max(r["q_len"] for r in rows),
                                     max_seq_len=max(seq), block_table_tensor=table, slot_mapping=slots,
                                     seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32))
        md = builder.build(0, cm)
        out = torch.full((len(query), HQ, D), float("nan"))
        impl.forward(layer, query, key, value, kv, md, out)
        compactions += len(md.compactions)

        # the reference: the kept tokens and this step's, laid out afresh, through the stock builder and impl
        ref_cache = torch.full((1 + sum(-(-(n - H.kept_start(r["n"], BUDGET, G)) // BS) for r, n in zip(rows, seq)),
                                HKV, BS, 2 * D), float("nan"))
        ref_table = torch.zeros(len(rows), width, dtype=torch.int32)
        ref_len, nxt, regions = [], 1, []
        for i, (r, p) in enumerate(zip(rows, pos)):
            s0 = H.kept_start(r["n"], BUDGET, G)
            rk = torch.cat([r["kept_k"], r["k"][p].transpose(0, 1)], dim=1)  # [H, n - s0, D]
            rv = torch.cat([r["kept_v"], r["v"][p].transpose(0, 1)], dim=1)
            assert rk.shape[1] == seq[i] - s0
            regions.append((rk, rv, s0))
            for t in range(rk.shape[1]):
                if t % BS == 0:
                    ref_table[i, t // BS] = nxt
                    nxt += 1
                ref_cache[ref_table[i, t // BS], :, t % BS, :D] = rk[:, t]
                ref_cache[ref_table[i, t // BS], :, t % BS, D:] = rv[:, t]
            ref_len.append(rk.shape[1])
            max_dropped = max(max_dropped, s0)
        ref_cm = cm.replace(block_table_tensor=ref_table, seq_lens=torch.tensor(ref_len, dtype=torch.int32),
                            max_seq_len=max(ref_len), seq_lens_cpu_upper_bound=torch.tensor(ref_len, dtype=torch.int32),
                            slot_mapping=torch.full_like(slots, -1))
        ref_out = torch.full_like(out, float("nan"))
        stock.forward(layer, query, key, value, ref_cache, stock_builder.build(0, ref_cm), ref_out)
        assert torch.equal(out, ref_out), (steps, (out - ref_out).abs().max())

        for i, (r, (rk, rv, s0)) in enumerate(zip(rows, regions)):
            n = seq[i]
            s1 = H.kept_start(n, BUDGET, G)
            if s1 > s0:
                kept = tritonkv.compress((rk[None], rv[None]), policy, n - s1)
                rk, rv = kept.keys[0], kept.values[0]
            r["kept_k"], r["kept_v"] = rk, rv
            # what the plugin left in the request's logical slots [s1, n), read from definition
            tab = r["table"]
            got_k = torch.stack([kv[tab[t // BS], :, t % BS, :D] for t in range(s1, n)], dim=1)
            got_v = torch.stack([kv[tab[t // BS], :, t % BS, D:] for t in range(s1, n)], dim=1)
            assert torch.equal(got_k, rk) and torch.equal(got_v, rv), (steps, i)
            r["n"] = n
        decode_steps += all(r["q_len"] == 1 for r in rows)
        steps += 1
    json.dump(dict(steps=steps, compactions=compactions, decode_steps=decode_steps, max_dropped=max_dropped),
              open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
