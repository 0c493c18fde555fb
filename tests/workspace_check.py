"""Plans' kept workspaces against fresh allocations, with kernels that really run (run by
``test_plan_workspace.py`` in a subprocess without ``TRITON_INTERPRET``; ``python tests/workspace_check.py`` runs
it directly).

CPU tensors take the Triton branch of every op and ``benchmarks.host_time.gpu_path_on_cpu``'s fake driver
answers device 0 (so launches go through the launch cache and plans, as on a GPU); every compiled kernel is a stub
whose launcher runs the kernel's Python source under Triton's interpreter on the bound arguments (the
``@triton.jit`` helpers it calls too). Each call is made with plans off (the reference), then from its plan; the
workspace the plan keeps is filled with garbage bytes before every repeat, and the result must equal the
reference exactly, bit for bit. Prints one JSON line."""
import json
import os
import sys

import torch


def interpreted_kernels():
    """Route CPU tensors to the Triton path with stub kernels that interpret the real ones."""
    from triton.runtime.interpreter import InterpretedFunction
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime.jit import JITFunction

    from benchmarks.host_time import gpu_path_on_cpu
    from tritonkv.kernels import _common

    gpu_path_on_cpu()
    _common._PDL_DEVICES[-1] = False  # the interpreter has no griddepcontrol: launch without PDL

    class Interpreted:  # what a compiled kernel offers the launch path
        function = packed_metadata = None

        def __init__(self, jit):
            self.fn = InterpretedFunction(jit.fn)

        def launch_metadata(self, grid, stream, *args):
            return None

        def run(self, g0, g1, g2, stream, function, packed, meta, enter, leave, *args):
            # as a device would: outside the torch ops a plan's recorder logs (the interpreter's own copies and
            # reads of the arguments are not the call's)
            rec = _common._recorder.rec
            if rec is not None:
                rec.checking = True
            try:
                with _disable_current_modes():
                    self.fn.run(*args, grid=(g0, g1, g2), warmup=False)
            finally:
                if rec is not None:
                    rec.checking = False

    def compile_stub(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = self.device_caches[device][0][key] = Interpreted(self)
        return kernel

    def helper(self, *args, **kwargs):  # a @triton.jit helper called from an interpreted kernel
        return InterpretedFunction(self.fn)(*args, **kwargs)

    JITFunction._do_compile = compile_stub
    JITFunction.__call__ = helper


def same(a, b) -> bool:
    """Bit-for-bit equal results (dtypes, shapes, strides, bytes); a ``RaggedKV``: its attributes and its rows'
    tokens (the keys and values in a row's free slots are undefined)."""
    if hasattr(a, "to_padded"):
        flat = {k: v for k, v in vars(a).items() if k not in ("keys", "values")}
        return (type(a) is type(b) and same(a.to_padded(with_positions=True), b.to_padded(with_positions=True))
                and same(tuple(flat.values()), tuple(vars(b)[k] for k in flat)))
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride() and torch.equal(a.contiguous().view(torch.uint8),
                                                             b.contiguous().view(torch.uint8)))
    if isinstance(a, tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dict__"):
        return type(a) is type(b) and vars(a).keys() == vars(b).keys() and all(
            same(vars(a)[k], vars(b)[k]) for k in vars(a))
    return a == b


def kept(plan) -> list:
    """The tensors of the plan's kept workspace (the slots its ``empty`` steps would fill)."""
    ws = plan.pool[0]
    return [ws.slots[slot] for slot, _, _, _ in plan.workspace[1]]


def main():
    interpreted_kernels()
    import tritonkv
    from tritonkv.kernels import _plan, score

    score.INTERPRET = True  # the penalty's exp without inline PTX, which the interpreter cannot run

    g = torch.Generator().manual_seed(0)
    B, H, N, D, W = 1, 4, 300, 32, 8
    keys = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    values = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    queries = torch.randn(B, 2 * H, W, D, generator=g).to(torch.bfloat16)
    lse = torch.randn(B, 2 * H, W, generator=g)
    hd = torch.rand(H, generator=g) + 0.1
    cases = [("knorm", 0.3, {}), ("keydiff", 0.25, {}), ("lagkv", 0.7, {}),
             ("snapkv", 0.3, dict(queries=queries, attn_lse=lse)), ("tova", 77, dict(queries=queries, attn_lse=lse)),
             ("score", 0.25, dict(queries=queries, hd=hd)),
             ("knorm", 0.4, dict(allocation="pyramid", layer=1, num_layers=4)),
             ("snapkv", 0.3, dict(allocation="adakv", queries=queries, attn_lse=lse))]
    out = dict(cases=0, repeats=0, kept_tensors=0)
    for name, budget, extra in cases:
        _plan._enabled[0] = False
        ref = tritonkv.compress((keys, values), name, budget, **extra)
        _plan._enabled[0] = True
        _plan._PLANS.clear()
        for _ in range(3):  # seen, recorded, repeated (the workspace is made)
            tritonkv.compress((keys, values), name, budget, **extra)
        plans = [p for p in _plan._PLANS.values() if p.__class__ is _plan._Plan]
        assert len(plans) == 1 and plans[0].pool, (name, extra, _plan._PLANS)
        ws = kept(plans[0])
        pointers = [t.data_ptr() for t in ws]
        out["kept_tensors"] += len(ws)
        for byte in (0x7F, 0xFF):
            for t in ws:
                t.untyped_storage().fill_(byte)
            got = tritonkv.compress((keys, values), name, budget, **extra)
            assert same(got, ref), (name, extra, byte)
            assert [t.data_ptr() for t in kept(plans[0])] == pointers, (name, extra)  # the same memory served
            out["repeats"] += 1
        out["cases"] += 1
    print(json.dumps(out))


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks, tritonkv
    main()
