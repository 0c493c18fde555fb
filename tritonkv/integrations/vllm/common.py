"""What every wrapped attention backend shares: the step's plan (built on the host by the metadata builder), the
virtual block table, and the compaction of a layer's kept tokens after its attention, parameterised by how the
backend's paged cache holds keys and values (``PagedLayout``).

vLLM hands every attention backend a layer's cache as ``[blocks, H_kv, block, C]``: the CPU backend packs keys and
values per (block, head) in an ISA-dependent order (found by a probe, ``backend.py``); FlashAttention and Triton
keep ``C = 2 D``, the key in ``[..., :D]`` and the value in ``[..., D:]``, in whatever physical stride order vLLM's
KV-cache layout gives the tensor (``FLASH_LAYOUT``).

The backends are subclasses of vLLM's (``backend.py`` for the CPU, ``triton_attn.py``, ``flash_attn.py``), each
mixing in ``TritonKVBuilderMixin``, ``TritonKVImplMixin`` and ``TritonKVBackendMixin``. With no ``"tritonkv"``
entry in ``additional_config`` every method is the stock one.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import NamedTuple, Optional

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.kv_cache_interface import FullAttentionSpec

from .config import TritonKVConfig, TritonKVConfigError, kept_start, parse_config
from .spec import MIXED_GROUP, TritonKVSpec

# The settings and vLLM config this process last saw (the builder and impl run inside vLLM's config context; the
# spec hook may be called outside it).
_SEEN: list = [None, None]
_WHERE = "tritonkv vLLM plugin"


def current_config(vllm_config=None) -> Optional[TritonKVConfig]:
    """The checked ``additional_config["tritonkv"]`` of ``vllm_config`` (or of vLLM's current config)."""
    vllm_config = vllm_config if vllm_config is not None else get_current_vllm_config_or_none()
    if vllm_config is None:
        return _SEEN[0]
    cfg = parse_config(vllm_config)
    _SEEN[:] = [cfg, vllm_config]
    return cfg


def check_engine(vllm_config) -> None:
    """What the plugin does not support, refused at start with ``TritonKVConfigError``."""
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise TritonKVConfigError(f"{_WHERE}: speculative decoding is not supported (rejected drafts would cross a "
                                  f"compression)")
    cache = vllm_config.cache_config
    if str(getattr(cache, "cache_dtype", "auto")) != "auto":
        raise TritonKVConfigError(f"{_WHERE}: a quantized KV cache ({cache.cache_dtype}) is not supported; use "
                                  f"kv_cache_dtype='auto'")
    parallel = getattr(vllm_config, "parallel_config", None)
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if (getattr(parallel, name, 1) or 1) > 1:
            raise TritonKVConfigError(f"{_WHERE}: context parallelism ({name} > 1) is not supported (a rank holds "
                                      f"an interleaved share of each request's tokens)")
    comp = getattr(vllm_config, "compilation_config", None)
    mode = getattr(comp, "cudagraph_mode", None)
    if mode is not None and mode.has_full_cudagraphs() and not mode.has_piecewise_cudagraphs():
        raise TritonKVConfigError(f"{_WHERE}: cudagraph_mode={mode.name} captures attention in a full CUDA graph, "
                                  f"which would freeze the compression; use PIECEWISE or FULL_AND_PIECEWISE (the "
                                  f"plugin's layers then run outside the graphs)")


#: the module of vLLM's ``Attention`` layer (``check_layer`` looks only at instances of it)
_ATTENTION_MODULE = "vllm.model_executor.layers.attention.attention"


def compressible(layer) -> bool:
    """A layer the plugin compresses: vLLM's plain ``Attention``, a decoder layer with full attention (a
    ``FullAttentionSpec`` without sliding window) and its own KV cache."""
    mod = sys.modules.get(_ATTENTION_MODULE)
    return (mod is not None and isinstance(layer, mod.Attention)
            and type(layer).get_kv_cache_spec is mod.Attention.get_kv_cache_spec  # not its own kind (chunked, sink...)
            and getattr(layer, "attn_type", None) == "decoder" and getattr(layer, "sliding_window", None) is None
            and getattr(layer, "kv_sharing_target_layer_name", None) is None)


def check_layer(layer, vllm_config) -> None:
    """Refuse with ``TritonKVConfigError`` a layer the plugin should compress (``compressible``) that vLLM gave an
    attention backend the plugin does not wrap: that layer would run uncompressed. Does nothing without the
    plugin's settings."""
    if not compressible(layer) or vllm_config is None or current_config(vllm_config) is None:
        return
    backend = layer.get_attn_backend()
    if isinstance(backend, type) and issubclass(backend, TritonKVBackendMixin):
        return
    from . import BACKENDS

    name = backend.get_name() if hasattr(backend, "get_name") else "?"
    where = f"{getattr(backend, '__module__', '?')}.{getattr(backend, '__qualname__', backend)}"
    raise TritonKVConfigError(
        f"{_WHERE}: vLLM chose the attention backend {name} ({where}) for the full-attention layer "
        f"{getattr(layer, 'layer_name', '?')!r}; it is not one of the plugin's wrappers of {', '.join(BACKENDS)}"
        + (f" (another plugin registered its own class over {name}?)" if name in BACKENDS else "")
        + ": with additional_config['tritonkv'] set, that layer would run uncompressed. Pick a wrapped backend: "
        "--attention-backend FLASH_ATTN (or TRITON_ATTN; in Python attention_config={'backend': 'FLASH_ATTN'}; a "
        "per-kind choice in attention_config['backend_per_kind']['full_attention'] overrides it), or remove the "
        "'tritonkv' entry")


def check_group(layer_names, vllm_config) -> None:
    """Refuse with ``TritonKVConfigError`` a KV-cache group without the plugin's spec that holds a layer the plugin
    compresses: vLLM merged its layers with another kind into one plain full-attention group, which happens when its
    hybrid KV-cache manager is off for a model that mixes layer kinds; those layers would run uncompressed."""
    from vllm.config import get_layers_from_vllm_config

    layers = [n for n, layer in get_layers_from_vllm_config(vllm_config, torch.nn.Module, layer_names).items()
              if compressible(layer)]
    if layers:
        more = " ..." if len(layers) > 3 else ""
        raise TritonKVConfigError(f"{_WHERE}: the full-attention layers {layers[:3]}{more} {MIXED_GROUP}")


def on_module_registered(module, name, submodule):
    """torch's global module-registration hook (``register()`` installs it): each vLLM ``Attention`` layer is
    checked (``check_layer``) as the model that holds it is built, inside vLLM's config context (the worker)."""
    if sys.modules.get(_ATTENTION_MODULE) is not None:
        check_layer(submodule, get_current_vllm_config_or_none())
    return None


def compresses(kv_cache_spec, vllm_config=None) -> bool:
    """Whether the plugin is on and ``kv_cache_spec`` is one of its layers' (a ``TritonKVSpec``)."""
    return isinstance(kv_cache_spec, TritonKVSpec) and current_config(vllm_config) is not None


# ---- the plan and the virtual block table (host side, in the builder) -------------------------------------------


class Compaction(NamedTuple):
    """One request row whose ``start`` moves in this step: the (kernel) block ids of the logical slots
    ``[s_old, n)`` (a device tensor), and the three slot counts."""

    blocks: torch.Tensor
    s_old: int
    n: int
    s_new: int


def _host_seq_lens(cm, r: int) -> list:
    """The rows' sequence lengths on the host: vLLM's CPU copy when it has one (exact without speculative decoding,
    which the plugin refuses), else a copy of the device tensor."""
    host = getattr(cm, "seq_lens_cpu_upper_bound", None)
    if host is None:
        host = cm.seq_lens[:r].cpu()
    return [int(x) for x in host[:r].tolist()]


def plan_step(cm, block_size: int, budget, granularity: int, min_keep: int = 1):
    """The metadata the stock builder should see and this step's compactions, for vLLM's
    ``CommonAttentionMetadata`` ``cm``.

    Per row, ``s_old = start(seq_len - query_len)`` (what the cache holds before this step) and
    ``s_new = start(seq_len)``. The stock kernel gets the row's block table from block ``s_old / block_size`` on
    (entries past the end are 0) and the length ``seq_len - s_old``; a row with ``s_new > s_old`` is listed for
    compaction. The host lists come from vLLM's CPU copies; the tables are gathered on ``cm``'s device (no wait on
    it). Returns ``(cm', [Compaction, ...])``; ``cm'`` is ``cm`` when no row has dropped a block yet."""
    r = cm.num_reqs
    qsl = cm.query_start_loc_cpu[: r + 1].tolist()
    n_new = _host_seq_lens(cm, r)
    q_len = [qsl[i + 1] - qsl[i] for i in range(r)]
    old = [kept_start(n - q, budget, granularity, min_keep) if n > 0 else 0 for n, q in zip(n_new, q_len)]
    new = [kept_start(n, budget, granularity, min_keep) if n > 0 else 0 for n in n_new]
    table = cm.block_table_tensor
    compactions = []
    for i, (s0, s1, n) in enumerate(zip(old, new, n_new)):
        if s1 > s0:
            blocks = table[i, s0 // block_size: -(-n // block_size)].to(torch.long, copy=True)
            compactions.append(Compaction(blocks, s0, n, s1))
    if not any(old):
        return cm, compactions
    rows, width = table.shape
    pad = [0] * (rows - r)
    shift = torch.tensor([s // block_size for s in old] + pad, dtype=torch.long).to(table.device, non_blocking=True)
    cols = torch.arange(width, device=table.device).unsqueeze(0) + shift.unsqueeze(1)
    virtual = torch.where(cols < width, table.gather(1, cols.clamp(max=width - 1)), torch.zeros((), dtype=table.dtype,
                                                                                               device=table.device))
    dropped = torch.tensor(old + [0] * (cm.seq_lens.shape[0] - r), dtype=cm.seq_lens.dtype)
    fields = dict(block_table_tensor=virtual, seq_lens=cm.seq_lens - dropped.to(cm.seq_lens.device, non_blocking=True),
                  max_seq_len=max([n - s for n, s in zip(n_new, old)], default=0))
    if getattr(cm, "seq_lens_cpu_upper_bound", None) is not None:
        ub = cm.seq_lens_cpu_upper_bound
        fields["seq_lens_cpu_upper_bound"] = ub - torch.tensor(old + [0] * (ub.shape[0] - r), dtype=ub.dtype)
    if hasattr(cm, "_num_computed_tokens_cache"):
        fields["_num_computed_tokens_cache"] = None  # derived from seq_lens: recomputed from the virtual lengths
    return cm.replace(**fields), compactions


_WITH_PLAN: dict = {}


def with_plan(md, compactions: list):
    """The stock metadata ``md``, its class swapped in place for a subclass of its dataclass with a
    ``compactions`` field (every attribute the stock builder set is kept; nothing is copied)."""
    cls = type(md)
    sub = _WITH_PLAN.get(cls)
    if sub is None:
        sub = dataclasses.make_dataclass(f"TritonKV{cls.__name__}",
                                         [("compactions", list, dataclasses.field(default_factory=list))],
                                         bases=(cls,), namespace={"__module__": __name__})
        _WITH_PLAN[cls] = sub
        _WITH_PLAN[sub] = sub
    md.__class__ = sub
    md.compactions = compactions
    return md


# ---- the paged cache: gather, scatter, compact (device side, in the impl) ---------------------------------------


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """How a backend's layer cache ``[blocks, H_kv, block, C]`` holds keys and values.

    ``packed`` False (FlashAttention, Triton): ``C = 2 D``, keys ``[..., :D]`` and values ``[..., D:]``.
    ``packed`` True (CPU): per (block, head), ``block * D`` key elements then ``block * D`` value elements, in the
    order given by ``key_order`` / ``value_order`` (int64 ``[H_kv, block * D]``: entry ``h, i * D + d`` is where
    token ``i``'s dimension ``d`` lies among head ``h``'s elements)."""

    packed: bool = False
    key_order: Optional[torch.Tensor] = None
    value_order: Optional[torch.Tensor] = None

    def split(self, kv_cache: torch.Tensor):
        """(keys, values) views ``[blocks, H_kv, block, D]`` of ``kv_cache`` (writes through them land in it)."""
        if self.packed:
            nb, h, bs, _ = kv_cache.shape
            kv = kv_cache.view(nb, h, 2 * bs, -1)
            return kv[:, :, :bs], kv[:, :, bs:]
        d = kv_cache.shape[-1] // 2
        return kv_cache[..., :d], kv_cache[..., d:]


#: FlashAttention's and Triton's cache (vLLM >= 0.32): ``[blocks, H_kv, block, 2 D]``, any physical stride order
FLASH_LAYOUT = PagedLayout()


def gather(cache: torch.Tensor, blocks: torch.Tensor, order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Tokens of ``blocks`` (``cache`` ``[blocks, H, block, D]`` from ``PagedLayout.split``) as
    ``[H, len(blocks) * block, D]``, token-major, read through ``order`` when given."""
    m = blocks.numel()
    _, h, bs, d = cache.shape
    raw = cache[blocks]
    if order is not None:
        raw = raw.reshape(m, h, bs * d).gather(2, order.expand(m, h, bs * d)).view(m, h, bs, d)
    return raw.permute(1, 0, 2, 3).reshape(h, m * bs, d)


def scatter(cache: torch.Tensor, blocks: torch.Tensor, tokens: torch.Tensor,
            order: Optional[torch.Tensor] = None) -> None:
    """Write ``tokens`` ``[H, len(blocks) * block, D]`` into ``blocks`` of ``cache`` (in ``order`` when given)."""
    m = blocks.numel()
    _, h, bs, d = cache.shape
    plain = tokens.reshape(h, m, bs, d).permute(1, 0, 2, 3)
    if order is not None:
        flat = plain.reshape(m, h, bs * d)
        plain = torch.empty_like(flat).scatter_(2, order.expand(m, h, bs * d), flat).view(m, h, bs, d)
    cache[blocks] = plain


def compact(kv_cache: torch.Tensor, plan, policy, layout: PagedLayout) -> None:
    """For each ``Compaction(blocks, s_old, n, s_new)``: score the layer's kept tokens ``[s_old, n)`` with
    ``policy``, keep ``n - s_new`` per KV head and write them, in original order, into slots ``[s_new, n)``. The
    slot counts are host ints; the tokens never leave the cache's device."""
    from ...api import compress

    key_cache, value_cache = layout.split(kv_cache)
    bs = key_cache.shape[2]
    for blocks, s0, n, s1 in plan:
        keys = gather(key_cache, blocks, layout.key_order)
        values = gather(value_cache, blocks, layout.value_order)
        kept = compress((keys[None, :, : n - s0], values[None, :, : n - s0]), policy, n - s1)
        lo = s1 - s0  # a block boundary: s0 and s1 are multiples of the block size
        keys[:, lo: n - s0] = kept.keys[0]
        values[:, lo: n - s0] = kept.values[0]
        tail = blocks[lo // bs:]
        scatter(key_cache, tail, keys[:, lo:], layout.key_order)
        scatter(value_cache, tail, values[:, lo:], layout.value_order)


# ---- the mixins -------------------------------------------------------------------------------------------------


class TritonKVBuilderMixin:
    """Put before a stock ``AttentionMetadataBuilder``: ``build`` hands the stock builder the virtual block table
    and attaches the step's compactions to its metadata (``plan_step``). Layers the plugin does not compress (no
    ``TritonKVSpec``, e.g. sliding window) and an engine without the plugin's settings get the stock builder."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        self.tkv = current_config(vllm_config)
        self.tkv_granularity = 0
        self.tkv_block_size = kv_cache_spec.block_size  # the kernel's block size (vLLM may split manager blocks)
        if self.tkv is not None and isinstance(kv_cache_spec, TritonKVSpec):
            check_engine(vllm_config)
            self.tkv_granularity = kv_cache_spec.tkv_granularity
            if self.tkv_granularity % self.tkv_block_size:
                raise TritonKVConfigError(f"decode_every {self.tkv_granularity} is not a multiple of the attention "
                                          f"kernel's block size {self.tkv_block_size}")
            # vLLM may reuse one group's metadata for another with a new block table: that would skip the shift
            self.supports_update_block_table = False
        elif self.tkv is not None:
            check_group(layer_names, vllm_config)
            self.tkv = None  # a group the plugin does not compress (sliding-window layers...): stock

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        """NEVER for the plugin's layers: vLLM then runs them outside full CUDA graphs (it turns
        FULL_AND_PIECEWISE into PIECEWISE); ``check_engine`` refuses a FULL-only mode."""
        if compresses(kv_cache_spec, vllm_config):
            from vllm.v1.attention.backend import AttentionCGSupport

            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False, **kwargs):
        if self.tkv is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build, **kwargs)
        cm, plan = plan_step(common_attn_metadata, self.tkv_block_size, self.tkv.budget, self.tkv_granularity,
                             self.tkv.min_keep)
        # no shared prefix: the rows' kept blocks differ (a cascade over physical blocks would be wrong)
        md = super().build(0, cm, fast_build, **kwargs)
        return with_plan(md, plan)


class TritonKVImplMixin:
    """Put before a stock ``AttentionImpl``: ``forward`` runs the stock attention, then compacts the rows the
    builder listed (``compact``) in the layout ``tkv_layout`` gives."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = current_config()
        self.tkv_policy = None
        if cfg is None:
            return
        self.tkv_policy = cfg.make_policy()
        if getattr(self, "alibi_slopes", None) is not None:
            raise TritonKVConfigError(f"{_WHERE}: attention with ALiBi is not supported")
        if getattr(self, "kv_sharing_target_layer_name", None) is not None:
            raise TritonKVConfigError(f"{_WHERE}: layers that share another layer's KV cache are not supported (the "
                                      f"owner compacts the cache the sharer still reads)")

    def tkv_layout(self, layer, kv_cache: torch.Tensor) -> PagedLayout:
        return FLASH_LAYOUT

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        plan = getattr(attn_metadata, "compactions", None)
        if plan and self.tkv_policy is not None and kv_cache.numel():
            compact(kv_cache, plan, self.tkv_policy, self.tkv_layout(layer, kv_cache))
        return out


class TritonKVBackendMixin:
    """Put before a stock ``AttentionBackend``: ``customize_spec`` gives each full-attention decoder layer a
    ``TritonKVSpec`` (the schedule travels to the scheduler with it)."""

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        cfg = current_config()
        if cfg is None or type(spec) is not FullAttentionSpec or spec.sliding_window is not None:
            return spec
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
        in_flight = getattr(_SEEN[1], "max_in_flight_tokens", 0) or 0
        return TritonKVSpec(**fields, tkv_budget=cfg.budget, tkv_granularity=cfg.granularity(spec.block_size),
                            tkv_min_keep=cfg.min_keep, tkv_in_flight=int(in_flight))
