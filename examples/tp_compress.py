"""Tensor-parallel KV-cache compression: each rank keeps exactly its heads' share of what one process keeps.

    torchrun --nproc-per-node 2 examples/tp_compress.py                       # gloo on the CPU, NCCL on GPUs
    torchrun --nproc-per-node 2 examples/tp_compress.py --policy keydiff --budget 0.1 --allocation adakv

Every rank builds the same seeded random Llama (8 KV heads, 16 query heads), rank 0 saves it and every rank loads
it with transformers' TP plan (``tp_plan="auto"``: ``k_proj``/``v_proj``/``q_proj`` split by columns, ``o_proj``
by rows), so a rank's cache holds ``8 / world`` KV heads. The cache gets the TP group as ``process_group``: per-head
policies need no communication, cross-head allocators (AdaKV, HeadKV, SCORE, ...) one all-gather per compressed
layer. Each rank prints its kept tokens and resident bytes, and (``--check``, on by default) whether its heads kept
the tokens that the same model in one process keeps.
"""
import argparse
import os
import tempfile

import torch
import torch.distributed as dist

from tritonkv.distributed import tp_group
from tritonkv.integrations import transformers as tt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--budget", type=float, default=0.25, help="fraction of the prompt kept per KV head")
    ap.add_argument("--allocation", default="adakv", help="an allocator name, or 'none'")
    ap.add_argument("--mode", default="blockwise", choices=tt.MODES)
    ap.add_argument("--tokens", type=int, default=512, help="prompt length (random ids)")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the single-process comparison")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")

    import transformers

    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=16, num_key_value_heads=8, head_dim=32,
                                   max_position_embeddings=4096)
    path = [tempfile.mkdtemp(prefix="tritonkv-tp-") if rank == 0 else None]
    dist.broadcast_object_list(path)
    if rank == 0:
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(path[0])
    dist.barrier()
    tp = dict(distributed_config=transformers.DistributedConfig(tp_plan="auto")) \
        if hasattr(transformers, "DistributedConfig") else dict(tp_plan="auto")  # tp_plan= before transformers 5.x
    model = transformers.AutoModelForCausalLM.from_pretrained(path[0], dtype=torch.float32, **tp).eval()
    group = tp_group(model)  # the TP device mesh (None if nothing is sharded)

    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(1)).to(device)
    alloc = None if args.allocation == "none" else args.allocation
    cache = tt.make_cache(model, args.policy, args.budget, mode=args.mode, allocation=alloc, block_size=128,
                          prompt_length=args.tokens, process_group=group)
    logits = tt.prefill(model, ids, cache)[:, -1]
    new = tt.decode(model, cache, logits, 8)
    kept = [k.sum().item() for k in cache.kept_tokens()]

    same = None
    if args.check:  # the same model in this process, uncompressed heads and all
        single = transformers.AutoModelForCausalLM.from_pretrained(path[0], dtype=torch.float32).to(device).eval()
        ref = tt.make_cache(single, args.policy, args.budget, mode=args.mode, allocation=alloc, block_size=128,
                            prompt_length=args.tokens)
        ref_new = tt.decode(single, ref, tt.prefill(single, ids, ref)[:, -1], 8)
        hl = cache.kept_tokens()[0].shape[1]
        same = torch.equal(new, ref_new) and all(
            [row[rank * hl:(rank + 1) * hl] for row in _positions(a)] == _positions(b)
            for a, b in zip(ref.layers, cache.layers))

    lines = [None] * world
    line = (f"rank {rank}/{world}: {cache.kept_tokens()[0].shape[1]} KV heads, kept tokens per layer {kept} "
            f"(total {sum(kept)}), cache {cache.nbytes / 2**10:.1f} KiB"
            + ("" if same is None else f", same tokens as one process: {same}"))
    dist.all_gather_object(lines, line)
    if rank == 0:
        print(f"{args.policy} budget {args.budget} allocation {alloc} mode {args.mode}, prompt {args.tokens} tokens, "
              f"{dist.get_backend()} on {device.type}")
        print("\n".join(lines))
        print(f"generated: {new.tolist()}")
    dist.barrier()
    dist.destroy_process_group()


def _positions(layer):
    """Kept sequence positions of one cache layer: per batch row, per head, ascending."""
    from tritonkv.integrations.transformers import SENTINEL

    st = layer.store.to_dense() if layer.store.ragged else layer.store
    pos = st.view()[2]
    return [[sorted(int(p) for p in pos[b, h] if p != SENTINEL) for h in range(pos.shape[1])]
            for b in range(pos.shape[0])]


if __name__ == "__main__":
    main()
