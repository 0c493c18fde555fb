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
for spec in specs:
    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    for cap in (80, 90):
        src = ASTSource(fn=fn, signature=spec["signature"], constexprs=spec.get("constexprs", {}))
        k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=spec.get("options"))
        assert "cubin" in k.asm and len(k.asm["cubin"]) > 0, (spec["kernel"], cap)
        print("compiled", spec["kernel"], "sm_%d" % cap)
"""


def assert_compiles(*specs: dict) -> None:
    """Each spec: ``{"module", "kernel", "signature": {arg: type}, "constexprs": {arg: value}}``, and optionally
    ``"options": {"num_warps": n}`` (the compile options; default 4 warps).

    ``signature`` names every argument; constexpr arguments have type ``"constexpr"`` and a value
    in ``constexprs``.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _SNIPPET, json.dumps(list(specs))],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, f"AOT compile failed:\n{r.stdout}\n{r.stderr[-6000:]}"
