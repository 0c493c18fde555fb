"""The logic the wrapped backends share (``common.py``), without an engine: the GPU backends' cache layout under
every physical stride order vLLM can give it, the compaction on it, the builder's plan and virtual block table,
the CUDA-graph answer and the start-time checks (a layer on an unwrapped backend refused); and the wrapped
``TRITON_ATTN`` run on the CPU with Triton's interpreter against the stock one (``triton_interp_run.py``)."""
import json
import os
import subprocess
import sys
import types

import helpers as H
import pytest
import torch

import tritonkv
from tritonkv.integrations.vllm import common
from tritonkv.integrations.vllm.config import TritonKVConfigError

HERE = os.path.dirname(os.path.abspath(__file__))


def _layouts():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return list(KVCacheLayout)


def flash_cache(layout, nb, h, bs, c, g):
    """A layer's cache as vLLM lays it out: logical ``[B, H, N, C]``, stored in ``layout``'s physical order."""
    order = layout.layer_view_order
    logical = (nb, h, bs, c)
    phys = torch.randn(*[logical[i] for i in order], generator=g)
    inverse = [order.index(i) for i in range(4)]
    kv = phys.permute(*inverse)
    assert kv.shape == logical and kv.data_ptr() == phys.data_ptr()
    return kv, phys


@pytest.fixture
def restore_seen():
    saved = list(common._SEEN)
    yield
    common._SEEN[:] = saved


@pytest.mark.parametrize("layout", _layouts(), ids=lambda x: x.name)
def test_flash_layout_gather_scatter(layout):
    """Keys in ``[..., :D]``, values in ``[..., D:]`` of ``[B, H_kv, N, 2 D]``, under each physical order: gather
    reads block by block, token-major; scatter writes only its blocks and its half, through to the storage."""
    nb, h, bs, d = 9, 3, 16, 8
    g = torch.Generator().manual_seed(1)
    kv, phys = flash_cache(layout, nb, h, bs, 2 * d, g)
    kc, vc = common.FLASH_LAYOUT.split(kv)
    blocks = torch.tensor([5, 2, 7])
    for half, cache in ((0, kc), (1, vc)):
        want = torch.empty(h, 3 * bs, d)
        for j, b in enumerate(blocks.tolist()):
            for i in range(bs):
                want[:, j * bs + i] = kv[b, :, i, half * d:(half + 1) * d]
        assert torch.equal(common.gather(cache, blocks), want)
    before = kv.clone()
    tokens = torch.randn(h, 2 * bs, d, generator=g)
    common.scatter(vc, torch.tensor([6, 1]), tokens)
    for j, b in enumerate((6, 1)):
        for i in range(bs):
            assert torch.equal(kv[b, :, i, d:], tokens[:, j * bs + i])
            assert torch.equal(kv[b, :, i, :d], before[b, :, i, :d])  # the keys' half is untouched
    others = [b for b in range(nb) if b not in (6, 1)]
    assert torch.equal(kv[others], before[others])
    assert not phys.is_contiguous() or kv.is_contiguous() or layout.layer_view_order != (0, 1, 2, 3)


@pytest.mark.parametrize("layout,dtype", [(x, t) for x in _layouts()[:2]
                                          for t in (torch.float32, torch.float16, torch.bfloat16)],
                         ids=lambda x: getattr(x, "name", str(x)))
def test_flash_layout_compaction(layout, dtype):
    """Tokens written at their logical slots into scattered blocks; ``compact`` keeps, per head, what
    ``tritonkv.compress`` keeps of the region, in the trailing slots, and leaves every other block alone."""
    h, bs, d, n, s0, s1 = 2, 16, 32, 150, 32, 96  # region [32, 150): 8 blocks, keep 54 in [96, 150)
    table = torch.tensor([11, 2, 9, 4, 0, 5, 13, 1, 8, 3])
    g = torch.Generator().manual_seed(0)
    kv, _ = flash_cache(layout, 14, h, bs, 2 * d, g)
    strides = kv.stride()
    kv = kv.to(dtype)
    assert kv.stride() == strides  # the physical order survives the cast
    k = torch.randn(n, h, d, generator=g).to(dtype)
    v = torch.randn(n, h, d, generator=g).to(dtype)
    for t in range(n):
        kv[table[t // bs], :, t % bs, :d] = k[t]
        kv[table[t // bs], :, t % bs, d:] = v[t]
    before = kv.clone()
    policy = tritonkv.get_policy("keydiff")
    plan = [common.Compaction(table[s0 // bs: -(-n // bs)], s0, n, s1)]
    common.compact(kv, plan, policy, common.FLASH_LAYOUT)
    want = tritonkv.compress((k[s0:].transpose(0, 1)[None], v[s0:].transpose(0, 1)[None]), policy, n - s1)
    assert not torch.equal(want.indices[0, 0], want.indices[0, 1])  # heads keep different tokens
    got_k = torch.stack([kv[table[t // bs], :, t % bs, :d] for t in range(s1, n)], dim=1)
    got_v = torch.stack([kv[table[t // bs], :, t % bs, d:] for t in range(s1, n)], dim=1)
    assert torch.equal(got_k, want.keys[0]) and torch.equal(got_v, want.values[0])
    tail = table[s1 // bs: -(-n // bs)].tolist()
    untouched = [b for b in range(14) if b not in tail]
    assert torch.equal(kv[untouched], before[untouched])


def _cm(rows, width, bs, pad_rows=1):
    """A ``CommonAttentionMetadata`` for rows ``(seq_len, query_len)`` with scattered block ids (and a padding row,
    as vLLM's padded batches have)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    g = torch.Generator().manual_seed(3)
    r = len(rows)
    table = torch.randint(1, 1000, (r + pad_rows, width), generator=g, dtype=torch.int32)
    q = [ql for _, ql in rows] + [0] * pad_rows
    qsl = torch.tensor([0] + [sum(q[: i + 1]) for i in range(len(q))], dtype=torch.int32)
    seq = torch.tensor([n for n, _ in rows] + [0] * pad_rows, dtype=torch.int32)
    return CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=r,
                                   num_actual_tokens=int(qsl[-1]), max_query_len=max(q),
                                   max_seq_len=max(n for n, _ in rows), block_table_tensor=table,
                                   slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.long),
                                   seq_lens_cpu_upper_bound=seq.clone())


def test_plan_and_virtual_table():
    """Per row: ``s_old = start(n - q)``, ``s_new = start(n)``; the stock builder sees the table from block
    ``s_old / block`` on (0 past the end) and the length ``n - s_old``; rows with ``s_new > s_old`` are listed with
    the block ids of ``[s_old, n)``. Kernel blocks (16) smaller than ``G`` (32)."""
    bs, budget, g, width = 16, 48, 32, 12
    rows = [(150, 1), (112, 1), (40, 40), (100, 64), (177, 1)]
    cm = _cm(rows, width, bs)
    table = cm.block_table_tensor.clone()
    cm2, plan = common.plan_step(cm, bs, budget, g)
    old = [H.kept_start(n - q, budget, g) for n, q in rows]
    new = [H.kept_start(n, budget, g) for n, _ in rows]
    assert old == [96, 32, 0, 0, 128] and new == [96, 64, 0, 32, 128]
    for i, (n, q) in enumerate(rows):
        shift = old[i] // bs
        want = [int(table[i, shift + j]) if shift + j < width else 0 for j in range(width)]
        assert cm2.block_table_tensor[i].tolist() == want
        assert int(cm2.seq_lens[i]) == n - old[i] == int(cm2.seq_lens_cpu_upper_bound[i])
        assert int(cm2.compute_num_computed_tokens()[i]) == n - q - old[i]
    assert torch.equal(cm2.block_table_tensor[-1], table[-1]) and int(cm2.seq_lens[-1]) == 0  # the padding row
    assert cm2.max_seq_len == max(n - s for (n, _), s in zip(rows, old))
    assert torch.equal(cm.block_table_tensor, table)  # vLLM's persistent table is not written
    assert [(p.s_old, p.n, p.s_new) for p in plan] == [(32, 112, 64), (0, 100, 32)]
    for p, i in zip(plan, (1, 3)):
        assert p.blocks.dtype == torch.long and p.blocks.tolist() == table[i, p.s_old // bs: -(-p.n // bs)].tolist()
    # nothing dropped yet: the metadata is vLLM's own
    cm3 = _cm([(40, 40), (90, 30)], width, bs)
    same, plan3 = common.plan_step(cm3, bs, budget, g)
    assert same is cm3 and [(p.s_old, p.n, p.s_new) for p in plan3] == [(0, 90, 32)]


def test_with_plan_keeps_the_stock_metadata():
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

    t = torch.zeros(2, dtype=torch.int32)
    md = TritonAttentionMetadata(num_actual_tokens=1, max_query_len=1, query_start_loc=t, max_seq_len=3,
                                 seq_lens=t, block_table=t, slot_mapping=t, seq_threshold_3D=4,
                                 num_par_softmax_segments=16, softmax_segm_output=t, softmax_segm_max=t,
                                 softmax_segm_expsum=t, causal=True)
    md.extra = "set by a builder after construction"
    out = common.with_plan(md, ["x"])
    assert isinstance(out, TritonAttentionMetadata) and out.compactions == ["x"] and out.max_seq_len == 3
    assert out.extra == "set by a builder after construction" and out.block_table is t
    assert type(common.with_plan(out, [])) is type(out) and out.compactions == []


def _vllm_config(cudagraph="NONE", tritonkv=True, **over):
    from vllm.config import CUDAGraphMode

    cfg = dict(additional_config={"tritonkv": {"policy": "knorm", "budget": 64}} if tritonkv else {},
               speculative_config=None, cache_config=types.SimpleNamespace(cache_dtype="auto"),
               parallel_config=types.SimpleNamespace(decode_context_parallel_size=1,
                                                     prefill_context_parallel_size=1),
               compilation_config=types.SimpleNamespace(cudagraph_mode=getattr(CUDAGraphMode, cudagraph)))
    cfg.update(over)
    return types.SimpleNamespace(**cfg)


def test_cuda_graphs_and_engine_checks(restore_seen):
    """The plugin's layers report no full-CUDA-graph support (vLLM then runs them piecewise); a FULL-only mode,
    context parallelism and a quantized cache are refused at start."""
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from tritonkv.integrations.vllm.backend import TritonKVCPUBuilder
    from tritonkv.integrations.vllm.flash_attn import TritonKVFlashBuilder
    from tritonkv.integrations.vllm.spec import TritonKVSpec
    from tritonkv.integrations.vllm.triton_attn import TritonKVTritonBuilder

    base = dict(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16)
    ours, plain = TritonKVSpec(**base, tkv_budget=64, tkv_granularity=16), FullAttentionSpec(**base)
    for cls, stock in ((TritonKVTritonBuilder, TritonAttentionMetadataBuilder),
                       (TritonKVFlashBuilder, FlashAttentionMetadataBuilder)):
        on, off = _vllm_config(), _vllm_config(tritonkv=False)
        assert cls.get_cudagraph_support(on, ours) == AttentionCGSupport.NEVER
        assert cls.get_cudagraph_support(on, plain) == stock.get_cudagraph_support(on, plain)
        assert cls.get_cudagraph_support(off, ours) == stock.get_cudagraph_support(off, ours)
    assert TritonKVCPUBuilder.get_cudagraph_support(_vllm_config(), ours) == AttentionCGSupport.NEVER
    for mode in ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE"):
        common.check_engine(_vllm_config(mode))
    for mode in ("FULL", "FULL_DECODE_ONLY"):
        with pytest.raises(TritonKVConfigError, match=f"cudagraph_mode={mode} .* use PIECEWISE"):
            common.check_engine(_vllm_config(mode))
    with pytest.raises(TritonKVConfigError, match="decode_context_parallel_size"):
        common.check_engine(_vllm_config(parallel_config=types.SimpleNamespace(decode_context_parallel_size=2)))
    with pytest.raises(TritonKVConfigError, match="quantized KV cache"):
        common.check_engine(_vllm_config(cache_config=types.SimpleNamespace(cache_dtype="fp8")))


def test_wrapped_backends_import_and_subclass():
    """The GPU wrappers import on vLLM's CPU build and are the stock classes underneath."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from tritonkv.integrations import vllm as plugin

    plugin.register()
    for member in ("TRITON_ATTN", "FLASH_ATTN", "CPU_ATTN"):
        cls = getattr(AttentionBackendEnum, member).get_class()
        stock_path = getattr(AttentionBackendEnum, member).value
        mod, name = stock_path.rsplit(".", 1)
        stock = getattr(__import__(mod, fromlist=[name]), name)
        assert issubclass(cls, stock) and cls is not stock and cls.get_name() == stock.get_name()
        assert issubclass(cls.get_builder_cls(), stock.get_builder_cls())
        assert issubclass(cls.get_impl_cls(), stock.get_impl_cls())
        assert issubclass(cls.get_impl_cls(), common.TritonKVImplMixin)


def test_triton_backend_under_the_interpreter(model_dir, tmp_path):
    """vLLM's Triton kernels (cache writer, unified attention 2D and 3D) on the CPU with Triton's interpreter: the
    wrapped backend's output equals the stock backend's on the kept tokens at every step, and the trailing slots
    hold what ``tritonkv.compress`` keeps (``triton_interp_run.py`` asserts both)."""
    out = tmp_path / "interp.json"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "triton_interp_run.py"), model_dir, str(out)], env=env,
                       capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    res = json.loads(out.read_text())
    assert res["compactions"] >= 4 and res["decode_steps"] >= 20 and res["max_dropped"] >= 48, res


def _attention_layer(backend, cls=None, **attrs):
    """A vLLM ``Attention`` layer (or subclass ``cls``) as ``check_layer`` reads it, on ``backend``, built without
    vLLM's config context."""
    from vllm.model_executor.layers.attention.attention import Attention

    layer = object.__new__(cls or Attention)
    torch.nn.Module.__init__(layer)
    fields = dict(attn_type="decoder", sliding_window=None, kv_sharing_target_layer_name=None,
                  layer_name="model.layers.3.self_attn.attn", attn_backend=backend)
    fields.update(attrs)
    for k, v in fields.items():
        setattr(layer, k, v)
    return layer


def test_unwrapped_backend_refused(restore_seen):
    """With the plugin's settings, a full-attention decoder layer on a backend the plugin does not wrap (here
    FlashInfer, FlexAttention, or the stock TRITON_ATTN class another plugin put back) is refused, naming the
    backend, the layer and how to pick a wrapped one; wrapped backends, layers the plugin leaves alone and an
    engine without its settings pass. (The engine-level test: ``test_vllm_bad_config.py``.)"""
    from vllm.model_executor.layers.attention.chunked_local_attention import ChunkedLocalAttention
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    from tritonkv.integrations.vllm.backend import TritonKVCPUBackend
    from tritonkv.integrations.vllm.triton_attn import TritonKVTritonBackend

    class FlashInferBackend:  # FlashInfer does not import on the CPU build: its name is what the check reads
        @staticmethod
        def get_name():
            return "FLASHINFER"

    on, off = _vllm_config(), _vllm_config(tritonkv=False)
    for backend, name in ((FlashInferBackend, "FLASHINFER"), (FlexAttentionBackend, "FLEX_ATTENTION"),
                          (TritonAttentionBackend, "TRITON_ATTN")):
        with pytest.raises(TritonKVConfigError) as e:
            common.check_layer(_attention_layer(backend), on)
        msg = str(e.value)
        for part in (f"attention backend {name} (", "'model.layers.3.self_attn.attn'", "run uncompressed",
                     "--attention-backend FLASH_ATTN", "attention_config={'backend': 'FLASH_ATTN'}",
                     "wrappers of CPU_ATTN, TRITON_ATTN, FLASH_ATTN"):
            assert part in msg, (part, msg)
        assert ("another plugin" in msg) == (name == "TRITON_ATTN"), msg
        common.check_layer(_attention_layer(backend), off)  # no "tritonkv" entry: vLLM as it is
        common.check_layer(_attention_layer(backend), None)  # outside vLLM's config context
        for attrs in (dict(sliding_window=128), dict(attn_type="encoder_only"),
                      dict(kv_sharing_target_layer_name="model.layers.0.self_attn.attn")):
            common.check_layer(_attention_layer(backend, **attrs), on)  # not a layer the plugin compresses
        common.check_layer(_attention_layer(backend, ChunkedLocalAttention), on)  # its own spec kind
        common.check_layer(torch.nn.Linear(2, 2), on)  # not an attention layer
    for backend in (TritonKVCPUBackend, TritonKVTritonBackend):
        common.check_layer(_attention_layer(backend), on)
