"""The launch cache against Triton's own launch path, argument by argument (run by
``test_launch_cache.py`` in a subprocess without ``TRITON_INTERPRET``; ``python tests/launch_cache_check.py``
runs it against whatever Triton is importable, e.g. 3.6 put first on ``PYTHONPATH``).

CPU tensors take the Triton branch of every op; ``benchmarks.host_time.gpu_path_on_cpu``'s fake driver answers
device 0, stream 7, target sm_90, and its ``JITFunction._do_compile`` returns one recording stub per Triton cache key (what Triton caches like a
compiled kernel). Every launch of every ``compress`` below runs twice: through ``JITFunction.run`` and
through ``_common._cached_run``; the stub of each records what it was called with (itself, grid, stream,
function, packed metadata, launch metadata and hooks, every kernel argument), and the two records must be
identical: the same objects for tensors and stubs, equal values of equal types for the rest. Shapes,
dtypes, strides and alignments are chosen so that specialisations change between calls (N divisible by
16 or not, H_kv = 1 makes strides and ints equal 1, an address not 16-byte aligned, fp32/fp16/bf16).
Prints one JSON line: launches compared, launches the cache served, distinct compiled kernels."""
import json
import os
import sys

import torch


def main():
    from triton.runtime.jit import JITFunction

    from benchmarks.host_time import gpu_path_on_cpu

    import tritonkv
    from tritonkv.kernels import _common, _plan

    assert not _common.INTERPRET, "run without TRITON_INTERPRET"
    assert _common._AUDITED is not None, "this Triton's run() is not one the launch cache serves"
    records = []

    class Stub:  # what a compiled kernel offers JITFunction.run
        def __init__(self, key):
            self.key, self.function, self.packed_metadata = key, object(), object()

        def launch_metadata(self, grid, stream, *args):
            records.append(("launch_metadata", self, grid, stream) + args)
            return ("metadata", self)

        def run(self, *args):
            records.append(("run", self) + args)

    gpu_path_on_cpu(make_stub=Stub, stream=7)
    cached_run = _common._cached_run
    served = [0]
    compared = [0]

    def both(kernel, grid, args, kwargs):
        del records[:]
        JITFunction.run(kernel, *args, grid=grid, warmup=False, **dict(kwargs))
        normal = list(records)
        del records[:]
        calls = []
        kernel.run = lambda *a, **k: calls.append(1) or JITFunction.run(kernel, *a, **k)  # counts misses
        try:
            cached_run(kernel, grid, args, kwargs)
        finally:
            del kernel.run
        served[0] += not calls
        compared[0] += 1
        assert len(normal) == len(records) == 2, (normal, records)
        for a, b in zip(normal, records):
            assert len(a) == len(b), (kernel, a, b)
            for x, y in zip(a, b):
                same = x is y or (type(x) is type(y) and not isinstance(x, torch.Tensor) and x == y)
                assert same, (kernel.fn.__name__, a, b)
        return normal[1][1]

    _common._cached_run = both
    _plan._enabled[0] = False  # every launch through ``both``; plans are checked below

    def inputs(B, H, N, D, dtype, layout):
        g = torch.Generator().manual_seed(N + D)
        shape = (B, H, N, D)
        if layout == "unaligned":  # an address that is not a multiple of 16 bytes
            n = B * H * N * D
            buf = torch.randn(2 * n + 1, generator=g).to(dtype)
            keys, values = buf[1:n + 1].view(shape), buf[n + 1:].view(shape)
        elif layout == "transposed":  # [B, N, H, D] storage, as a model's projection leaves it
            keys = torch.randn(B, N, H, D, generator=g).to(dtype).transpose(1, 2)
            values = torch.randn(B, N, H, D, generator=g).to(dtype).transpose(1, 2)
        else:
            keys, values = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
        Hq, W = H * 2, 8
        pool = dict(queries=torch.randn(B, Hq, W, D, generator=g).to(dtype), attn_lse=torch.randn(B, Hq, W, generator=g),
                    o_proj=torch.randn(Hq * D, Hq * D, generator=g).to(dtype), hd=torch.rand(H, generator=g) + 0.1,
                    layer=1, num_layers=4)
        return keys, values, pool

    cases = [(1, 8, 1024, 128, torch.bfloat16, "plain"), (2, 4, 1000, 64, torch.float16, "plain"),
             (1, 1, 512, 32, torch.float32, "plain"), (1, 17, 512, 32, torch.float32, "plain"),
             (1, 2, 777, 48, torch.bfloat16, "unaligned"),
             (2, 3, 300, 64, torch.float16, "transposed"), (1, 8, 1024, 128, torch.bfloat16, "unaligned")]
    needs = {"snapkv": ("queries", "attn_lse"), "tova": ("queries", "attn_lse"), "h2o": ("queries",),
             "surfacelogic": ("queries",), "score": ("queries", "hd"), "criticalkv": ("queries", "o_proj")}
    names = ["knorm", "keydiff", "lagkv", "streaming_llm", "snapkv", "tova", "h2o", "surfacelogic", "score",
             "criticalkv"]
    for rnd in range(2):  # the second round finds every specialisation cached
        for case in cases:
            keys, values, pool = inputs(*case)
            for name in names:
                extra = {n: pool[n] for n in needs.get(name, ())}
                for budget in (0.25, 0.5 if rnd else 0.75):
                    try:
                        tritonkv.compress((keys, values), name, budget, **extra)
                    except ValueError as e:  # LagKV's protected tail exceeds a small budget of a short row
                        assert "protected" in str(e), e
            tritonkv.compress((keys, values), "knorm", 0.3, allocation="pyramid", layer=1, num_layers=4)
    # ints of every width Triton tells apart (i32, i64, u64), and near them, at one position of one kernel
    from tritonkv.kernels.knorm import _knorm_kernel

    k, o = torch.empty(64, dtype=torch.bfloat16), torch.empty(64)
    for rnd in range(2):
        for skn in (16, 1, 17, -16, 2 ** 31 - 16, 2 ** 31, 2 ** 31 + 1, -2 ** 31, -2 ** 31 - 16, 2 ** 32, 2 ** 63 - 1,
                    2 ** 63, 2 ** 63 + 16, 2 ** 64 - 1):
            _common.launch(_knorm_kernel, (1, 1), k, o, o, 1, 16, 16, skn, 4, 4, 1, 1, 0, 0, TILE=16, BLOCK_D=16,
                           STAGES=1, HIST=False, NB=256, HIST_TILE=128, num_warps=4)
    variants = sum(len(k.device_caches[0][0]) for k in _kernels())
    _common._cached_run = cached_run
    replayed = _check_plans(tritonkv, _common, _plan, records, cases, inputs, names, needs)
    print(json.dumps(dict(compared=compared[0], served=served[0], variants=variants, replayed=replayed,
                          triton=__import__("triton").__version__)))


def _canonical(recs, inputs):
    """The stub records of one call with every tensor replaced by what a launcher reads of it (storage, view,
    dtype, 16-byte alignment) and its role: the input it views exactly (an alias such as ``detach()`` included), or
    its first appearance in the call."""
    def where(t):
        return (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)

    known = {where(t): i for i, t in enumerate(inputs)}
    seen = {}
    out = []
    for rec in recs:
        row = []
        for x in rec:
            if isinstance(x, torch.Tensor):
                w = where(x)
                role = ("input", known[w]) if w in known else ("made", seen.setdefault(w, len(seen)))
                row.append(role + w[1:] + (x.data_ptr() % 16,))
            else:
                row.append(x)
        out.append(tuple(row))
    return out


def _layout(out):
    """A result's structure: its type, its tensors' shapes, dtypes and strides, its other attributes."""
    items = enumerate(out) if isinstance(out, tuple) else sorted(vars(out).items())
    return type(out), [(k, (v.shape, v.dtype, v.stride()) if isinstance(v, torch.Tensor) else v) for k, v in items]


def _check_plans(tritonkv, _common, _plan, records, cases, inputs, names, needs):
    """Plans (``kernels/_plan.py``): every launch of a call repeated from its plan against the launches of the
    same call through Triton's own ``run``, argument by argument (tensors by role). Every call is made twice
    first (seen, recorded), then once more with Triton's ``run`` and once from the plan, so that a plan
    served to a call it does not fit (another layout, alignment or dtype of the same shape) shows."""
    replays = [0]
    replay = _plan._Plan.replay

    def counted(self, tensors):
        out = replay(self, tensors)
        replays[0] += out is not _plan._MISS
        return out

    _plan._Plan.replay = counted
    _plan._enabled[0] = True
    calls = []
    for case in cases:
        keys, values, pool = inputs(*case)
        for name in names:
            extra = {n: pool[n] for n in needs.get(name, ())}
            for budget in (0.25, 0.75, 3):
                calls.append(((keys, values), name, budget, extra))
        B, H, N = keys.shape[:3]
        g = torch.Generator().manual_seed(N)
        for alloc, extra in (("pyramid", dict(layer=1, num_layers=4)),
                             ("headkv", dict(layer=1, profile=torch.rand(4, H, generator=g))),
                             ("surfacelogic", dict(layer=2, profile=torch.rand(4, H, generator=g))),
                             ("cake", dict(layer=1, layer_preference=torch.rand(4, generator=g) + 0.1)),
                             ("score", dict(layer=1, head_means=torch.rand(4, B, 2 * H, N, generator=g))),
                             ("adakv", dict(queries=pool["queries"], attn_lse=pool["attn_lse"]))):
            name = "snapkv" if alloc == "adakv" else "knorm"
            for budget in (0.3, 0.6):
                calls.append(((keys, values), name, budget, dict(extra, allocation=alloc)))
    ok = []
    for kv, name, budget, extra in calls:
        try:
            for _ in range(2):
                tritonkv.compress(kv, name, budget, **extra)
            ok.append((kv, name, budget, extra))
        except ValueError as e:  # LagKV's protected tail exceeds a small budget of a short row
            assert "protected" in str(e), e
    for kv, name, budget, extra in ok:
        tensors = (*kv, *[t for t in extra.values() if isinstance(t, torch.Tensor)])
        _common._launch_cache[0] = False  # Triton's own run, no plan
        del records[:]
        ref = tritonkv.compress(kv, name, budget, **extra)
        want = _canonical(records, tensors)
        _common._launch_cache[0] = True
        del records[:]
        before = replays[0]
        got = tritonkv.compress(kv, name, budget, **extra)
        assert replays[0] == before + 1, (name, budget)
        assert _canonical(records, tensors) == want, (name, budget, kv[0].shape, kv[0].dtype)
        assert _layout(got) == _layout(ref), (name, extra.get("allocation"))
    _plan._Plan.replay = replay
    assert replays[0] == len(ok) > 200, (replays[0], len(ok))
    return replays[0]


def _kernels():
    from triton.runtime.jit import JITFunction

    import tritonkv.kernels as ks
    out = []
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith(ks.__name__ + "."):
            out += [v for v in vars(mod).values() if type(v) is JITFunction and 0 in v.device_caches]
    return out


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks, tritonkv
    main()
