"""Graph capture: ``torch.export`` (strict, i.e. through dynamo, which fails on a graph break) of
``compress()`` for every registered policy, in a subprocess WITHOUT the Triton interpreter
(``triton_op`` cannot be compiled under the interpreter; docs/contracts.md, "torch.compile and
torch.export"). Numerics are tested eagerly elsewhere; this checks that each launcher is one traceable
op with static output shapes."""
import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import torch, tritonkv
from tritonkv import POLICIES
B, H, G, N, D, W = 1, 2, 3, 64, 16, 4
def make(name):
    if name == "queries": return torch.randn(B, H * G, W, D)
    if name == "o_proj": return torch.randn(H * G * D, H * G * D)
    if name == "hd": return torch.rand(H) + 0.1
    raise KeyError(name)
class M(torch.nn.Module):
    def __init__(self, policy): super().__init__(); self.policy = policy
    def forward(self, k, v, inputs):
        out = tritonkv.compress((k, v), self.policy, 40, **inputs)
        return out.keys, out.values, out.indices
import warnings
for name, cls in sorted(POLICIES.items()):
    pol = cls()
    k, v = torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    inputs = {n: make(n) for n in pol.needs}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ep = torch.export.export(M(pol), (k, v, inputs), strict=True)
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("tritonkv" in o for o in ops), (name, ops)
    ours = [str(w.message) for w in caught if "tritonkv" in str(w.filename) or "lru_cache" in str(w.message)
            or "side effect" in str(w.message)]
    assert not ours, (name, ours)  # no warning of ours, nor dynamo's about our caches and memos
    print("exported", name, flush=True)
"""


def test_compress_exports_without_graph_break():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr[-5000:]
    from tritonkv import POLICIES

    exported = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("exported")}
    assert exported == set(POLICIES)


_ALLOCATED = r"""
import torch, tritonkv
B, H, G, N, D, W = 1, 2, 3, 64, 16, 4
class M(torch.nn.Module):
    def __init__(self, allocation, extra): super().__init__(); self.allocation, self.extra = allocation, extra
    def forward(self, k, v, q):
        out = tritonkv.compress((k, v), "snapkv", 40, queries=q, allocation=self.allocation, **self.extra)
        return out.keys, out.values, out.lengths
for name, extra in (("uniform", {}), ("pyramid", dict(layer=1, num_layers=4)), ("adakv", {})):
    k, v, q = torch.randn(B, H, N, D), torch.randn(B, H, N, D), torch.randn(B, H * G, W, D)
    ep = torch.export.export(M(name, extra), (k, v, q), strict=True)
    got, want = ep.module()(k, v, q)[2], tritonkv.compress((k, v), "snapkv", 40, queries=q, allocation=name,
                                                            **extra).lengths
    assert torch.equal(got, want), (name, got, want)
    print("exported", name, flush=True)
"""


def test_allocations_from_shapes_export_as_one_graph():
    """Uniform, pyramid (a table of host ints) and AdaKV (static sizes, H·b) read nothing back: an allocated
    compress exports whole (docs/contracts.md; the table-driven allocators read theirs back: a graph break)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _ALLOCATED], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr[-5000:]
    assert {line.split()[1] for line in r.stdout.splitlines() if line.startswith("exported")} == {
        "uniform", "pyramid", "adakv"}
