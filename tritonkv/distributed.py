"""Tensor parallelism on ``torch.distributed``: each rank holds a contiguous slice of a layer's KV heads.

Under transformers' TP plan (``tp_plan="auto"``) ``k_proj``/``v_proj``/``q_proj`` are split column-wise and
``o_proj`` row-wise, so rank ``r`` of a group of ``world`` holds KV heads ``[r·H_l, (r+1)·H_l)`` with their
query groups, and its cache sees only those heads. ``compress(..., process_group=pg)`` (and a
``TritonKVCache(..., process_group=pg)``, which forwards it) then keeps, on every rank, exactly the tokens of its
heads that the single-process ``compress`` would keep on the whole layer::

    kept = tritonkv.compress((k_local, v_local), "snapkv", 0.25, allocation="adakv",
                             queries=q_local, process_group=pg)        # RaggedKV of this rank's heads

Contract: every rank of ``pg`` calls ``compress`` for the same layer with the same B, N, D, budget, policy and
allocator settings and the same number of KV heads ``H_l``; the layer has ``H = world·H_l`` heads (head counts come
from tensor shapes, never from a model config). Inputs with a head dimension that are computed from the rank's
own heads (``queries``, ``attn_lse``, ``o_proj`` columns, ``hd``, ``positions``, ``forced``) are the rank's
slices; model-level statistics (``profile``, ``head_means``, ``layer_preference``, ``Fixed`` budgets) are the
whole model's, the same on every rank (``gather_heads`` builds them from per-rank parts once).

What communicates (one ``all_gather`` each, of a buffer whose size every rank knows; nothing else):

==============================  =============================================================================
per-head-local, no collective   knorm, keydiff, lagkv, streaming_llm, snapkv / h2o / surfacelogic / tova
                                (group head reduction), criticalkv (its ‖v W_O‖₁ reads its own heads' W_O
                                columns); allocators uniform, pyramid, cake, headkv, surfacelogic, fixed
                                (their inputs are replicated; every rank computes all heads' budgets)
one collective per layer        adakv (each head's top-min(avail, H·b) selectable scores: the global top H·b
                                needs no more), score allocator (the layer's scores), any other
                                allocator that reads scores (its scores, gathered); window attention with
                                ``head_reduce="layer"`` (the per-head rows, averaged over all heads); the
                                score policy (``"parallel"``: per-token pick counts; ``"sequential"``: scores,
                                budgets and HD)
one more with ``forced``        any allocator given a ``forced`` mask: the most forced tokens of a row on any
                                rank, which every head's budget holds beside its share
==============================  =============================================================================

Every rank then runs the same arithmetic on the same gathered tensor (the select kernel, largest remainder), so
the budgets agree across ranks and with one process, bit for bit where the per-head scores do. (They do for
every policy on the CPU at the sizes the tests use; the window-attention CPU body and kernel choose their token
chunks from B·H, so with fewer heads per rank a long row may be summed in other chunks and its scores differ from
one process's in the last bits: the kept sets can then differ at near-ties only. The ranks always agree.) Each rank keeps
its own heads' budgets; ``_compress_allocated`` takes the rank's own total and the layer's longest row from
the host tables of the replicated allocators, reads them back once for the others (AdaKV, SCORE), and
returns a ``TPRaggedKV`` whose padded working view spans that longest row on every rank, so a later compression
of the same layer again sees the same N everywhere.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .cache import RaggedKV


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """A resolved process group: the group, this process's rank in it and the group size (> 1)."""

    group: object
    rank: int
    world: int

    def heads(self, local: int) -> slice:
        """This rank's slice of ``world·local`` heads."""
        return slice(self.rank * local, (self.rank + 1) * local)

    def gather(self, *parts: torch.Tensor) -> list[torch.Tensor]:
        """One ``all_gather`` of every part (same shapes and dtypes on every rank): returns each part stacked
        over ranks, ``[world, *shape]``, in rank order, in the part's dtype, on the part's device.

        The parts travel in one flat buffer, fp64 when any part is fp64 or int64 (values kept exactly), else
        fp32 (fp32 scores exactly; ints below 2^24 exactly: budgets, counts)."""
        import torch.distributed as dist

        if not parts:
            return []
        dev = parts[0].device
        wide = any(p.dtype in (torch.float64, torch.int64) for p in parts)
        dtype = torch.float64 if wide else torch.float32
        flat = [p.detach().reshape(-1).to(device=dev, dtype=dtype) for p in parts]
        buf = torch.cat(flat) if len(flat) > 1 else flat[0].contiguous()
        comm = _comm_device(self.group, dev)
        buf = buf.to(comm)
        out = torch.empty(self.world * buf.numel(), dtype=dtype, device=comm)
        fn = getattr(dist, "all_gather_single", None)
        if fn is None:
            fn = dist.all_gather_into_tensor
        fn(out, buf, group=self.group)
        out = out.to(dev).view(self.world, -1)
        res, at = [], 0
        for p in parts:
            n = p.numel()
            res.append(out[:, at:at + n].reshape(self.world, *p.shape).to(p.dtype))
            at += n
        return res

    def cat_heads(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's ``t`` concatenated along ``dim`` (the head dimension), in rank order: one collective."""
        g = self.gather(t)[0]
        dim = dim % t.dim()
        return torch.cat(g.unbind(0), dim=dim)


def _comm_device(group, device: torch.device) -> torch.device:
    """Where the buffer travels: NCCL (and other accelerator backends) on the device, gloo on the CPU."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if device.type == "cpu":
        if "gloo" in backend or "mpi" in backend:
            return device
        if torch.cuda.is_available():  # an NCCL-only group and CPU tensors
            return torch.device("cuda", torch.cuda.current_device())
        return device
    if device.type == "cuda" and "nccl" not in backend:
        return torch.device("cpu")  # gloo: host buffers
    return device


def group_info(process_group) -> Optional[TPGroup]:
    """``TPGroup`` of ``process_group`` (a ``torch.distributed`` ProcessGroup, a DeviceMesh — its ``"tp"``
    dimension when it has one —, a ``TPGroup``, or None). None when there is nothing to communicate: no group,
    or a group of one process (then everything runs as in one process)."""
    if process_group is None:
        return None
    if isinstance(process_group, TPGroup):
        return process_group
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("process_group: torch.distributed is not initialised in this process (call "
                         "torch.distributed.init_process_group first, or pass process_group=None for one process)")
    group = process_group
    if hasattr(group, "get_group") and hasattr(group, "mesh_dim_names"):  # a DeviceMesh
        names = group.mesh_dim_names or ()
        if "tp" in names:
            group = group.get_group("tp")
        elif group.ndim == 1:
            group = group.get_group()
        else:
            raise ValueError(f"process_group: a {group.ndim}-D DeviceMesh without a 'tp' dimension; pass the "
                             f"tensor-parallel group (mesh.get_group(dim))")
    try:
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
    except Exception as e:  # not a group, or this process is not in it
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup (or a DeviceMesh) that this "
                        f"process belongs to, got {type(process_group).__name__} ({e})") from None
    if rank < 0:
        raise ValueError("process_group: this process is not a member of the group")
    if world == 1:
        return None
    return TPGroup(group, rank, world)


def tp_group(model):
    """The tensor-parallel group of a model loaded with a TP plan (``from_pretrained(..., tp_plan="auto")``): the
    device mesh of its first sharded (DTensor) attention weight, or None when nothing is sharded. Pass it as
    ``process_group`` (``make_cache(model, ..., process_group=tp_group(model))``)."""
    for name, p in model.named_parameters():
        if ("k_proj" in name or "qkv" in name) and hasattr(p, "device_mesh") and hasattr(p, "placements"):
            return p.device_mesh
    return None


def gather_heads(t: torch.Tensor, process_group, dim: int = 1) -> torch.Tensor:
    """Every rank's ``t`` concatenated along its head dimension ``dim`` (one collective; ``t`` as is with no
    group). For model-level statistics computed per rank once, e.g. SCORE's ``head_means`` ``[L, B, H_q/world,
    n]`` (``dim=2``) gathered into the whole model's ``[L, B, H_q, n]``."""
    tp = group_info(process_group)
    return t if tp is None else tp.cat_heads(t, dim)


def shard_heads(t: torch.Tensor, process_group, dim: int = -1) -> torch.Tensor:
    """This rank's contiguous slice of ``t`` along ``dim`` (e.g. ``Score.hd(...)`` ``[L, B, H_kv]`` → the
    ``hd`` of this rank's heads). ``t`` as is with no group."""
    tp = group_info(process_group)
    if tp is None:
        return t
    n = t.shape[dim]
    if n % tp.world:
        raise ValueError(f"a dimension of {n} heads does not split over {tp.world} ranks")
    return t.narrow(dim, tp.rank * (n // tp.world), n // tp.world)


class TPRaggedKV(RaggedKV):
    """A ``RaggedKV`` of one rank's heads whose padded view (``to_padded()`` without ``cap``) spans the longest
    row of the *layer* over all ranks, not only this rank's: a cache that turns it into a dense working view for
    the next prefill block (``RaggedStore.to_dense``) then gives every rank the same N, as the TP contract of
    ``compress`` needs, and the same slot layout as one process. ``extra`` is how much longer the layer's
    longest row is than this rank's (it stays so: a decode step appends one token to every row)."""

    extra: int = 0

    def to_padded(self, cap: Optional[int] = None, *, with_positions: bool = False):
        if cap is None:
            cap = (int(self.length.max()) if self.length.numel() else 0) + self.extra
        return super().to_padded(cap, with_positions=with_positions)


def pool_rows(u: torch.Tensor, window: int, kernel_size: int, pool: str) -> torch.Tensor:
    """The window-attention pooling over ``[0, N − W)`` (``kernels/window_attention.pool_torch``: max ignores the
    padding, avg counts it as zeros, NaN neighbours are holes; window positions keep their values), on reduced
    rows ``[B, H, N]``."""
    from .kernels.window_attention import pool_torch

    return pool_torch(u, max(u.shape[-1] - window, 0), kernel_size, pool)


def window_scores_layer_mean(keys, queries, tp: TPGroup, *, attn_lse=None, scale=None, kernel_size: int = 1,
                             pool: str = "max", row_reduce: str = "mean", values=None) -> torch.Tensor:
    """Window attention with ``head_reduce="layer"`` over the heads of all ranks: each rank's per-KV-head rows
    (the group mean, unpooled) are gathered (one collective), averaged over all ``world·H_l`` heads in head
    order, expanded to this rank's heads and pooled — the single-process CPU computation, step for step."""
    from .kernels.window_attention import window_attention_scores

    u = window_attention_scores(keys, queries, attn_lse=attn_lse, scale=scale, kernel_size=1, pool=pool,
                                row_reduce=row_reduce, head_reduce="mean", values=values)
    B, Hl, N = u.shape
    full = tp.cat_heads(u, 1)
    lay = (full.sum(1, keepdim=True) / full.shape[1]).expand(B, Hl, N)
    return pool_rows(lay, queries.shape[2], kernel_size, pool)


__all__ = ["TPGroup", "group_info", "tp_group", "gather_heads", "shard_heads", "TPRaggedKV", "pool_rows",
           "window_scores_layer_mean"]
