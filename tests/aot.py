"""Ahead-of-time compile of a kernel for sm_80 and sm_90, with no GPU (docs/architecture.md, "Testing").

The interpreter accepts code the compiler rejects, so every kernel is also compiled
ttir -> cubin here, in a subprocess without TRITON_INTERPRET (in an interpreted process the
decorated kernel is an InterpretedFunction that cannot be compiled).
"""
import json
import os
import subprocess
import sys

_SNIPPET = r"""
import importlib, json, sys
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
specs = json.loads(sys.argv[1])
MEMORY = ("ld.global", "st.global", "atom.global", "red.global", "cp.async", "ld.volatile.global")
for spec in specs:
    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    for cap in (80, 90):
        sig, const = dict(spec["signature"]), dict(spec.get("constexprs", {}))
        pdl = "PDL" in fn.arg_names and "PDL" not in sig
        if pdl:  # programmatic dependent launch: what an sm_90 GPU launches (kernels._common.pdl), none on sm_80
            sig["PDL"], const["PDL"] = "constexpr", cap >= 90
        options = dict(spec.get("options") or {}, **({"launch_pdl": True} if pdl and cap >= 90 else {}))
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", cap, 32),
                           options=options)
        assert "cubin" in k.asm and len(k.asm["cubin"]) > 0, (spec["kernel"], cap)
        if pdl and cap >= 90:  # the wait precedes every global memory access of the kernel
            ptx = k.asm["ptx"]
            wait = ptx.find("griddepcontrol.wait")
            first = min([i for i in (ptx.find(m) for m in MEMORY) if i >= 0] or [len(ptx)])
            assert 0 <= wait < first and "griddepcontrol.launch_dependents" in ptx, (spec["kernel"], ptx[:4000])
            assert k.metadata.launch_pdl, spec["kernel"]
        print("compiled", spec["kernel"], "sm_%d" % cap, "PDL" if pdl and cap >= 90 else "")
"""


def assert_compiles(*specs: dict) -> None:
    """Each spec: ``{"module", "kernel", "signature": {arg: type}, "constexprs": {arg: value}}``, and optionally
    ``"options": {"num_warps": n}`` (the compile options; default 4 warps). A kernel with a ``PDL`` constexpr
    that the spec leaves out is compiled as a GPU launches it (``kernels._common.pdl``): with programmatic dependent
    launch for sm_90 (its PTX checked: ``griddepcontrol.wait`` before any global load, store or atomic), without
    for sm_80.

    ``signature`` names every argument; constexpr arguments have type ``"constexpr"`` and a value
    in ``constexprs``.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _SNIPPET, json.dumps(list(specs))],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, f"AOT compile failed:\n{r.stdout}\n{r.stderr[-6000:]}"
