"""Plans' kept workspaces (``tritonkv/kernels/_plan.py``, ``_Plan``): the temporaries of a repeated call are
allocated once per thread, device and stream and reused, never shared by two calls at once, never kept during
CUDA graph capture, never the memory of a result, small only (per plan and in all); a workspace full of garbage
gives the same result, bit for bit, as a call with plans off (``workspace_check.py``: every kernel interpreted,
several policies and allocators)."""
import json
import os
import subprocess
import sys

import pytest
import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run(code: str):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITONKV_CPU_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9),
                    reason="Triton < 3.9's interpreter cannot take a scalar argument as a loop bound under NumPy 2 "
                           "(seen with 3.6 on the GPU images; there test_workspace_on_a_gpu checks compiled kernels)")
def test_garbage_in_the_workspace_changes_nothing():
    res = _run("import workspace_check; workspace_check.main()")
    assert res["cases"] == 8 and res["repeats"] == 16 and res["kept_tensors"] > 30, res


ALIASED = """
import json, torch, workspace_check
workspace_check.interpreted_kernels()
import tritonkv
from tritonkv.kernels import _plan

g = torch.Generator().manual_seed(0)
k1, k2, v2 = (torch.randn(1, 2, 128, 16, generator=g) for _ in range(3))
for _ in range(2):  # keys that are the values (a key-only caller): seen, then recorded
    tritonkv.compress((k1, k1), "knorm", 32)
got = [tritonkv.compress((k2, v2), "knorm", 32), tritonkv.compress((k2, k2), "knorm", 32)]
counts = dict(_plan.counts)
_plan._enabled[0] = False
ref = [tritonkv.compress((k2, v2), "knorm", 32), tritonkv.compress((k2, k2), "knorm", 32)]
print(json.dumps(dict(counts=counts, same=[workspace_check.same(a, b) for a, b in zip(got, ref)])))
"""


@pytest.mark.skipif(tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9),
                    reason="Triton < 3.9's interpreter cannot take a scalar argument as a loop bound under NumPy 2")
def test_a_plan_of_keys_that_are_the_values_serves_no_call_with_other_values():
    """A plan records each input object as one slot: recorded from ``(k, k)``, it must not serve ``(k2, v2)``
    (it would score and gather the values), only calls whose inputs coincide the same way."""
    res = _run(ALIASED)
    assert res["same"] == [True, True], res
    assert res["counts"] == {"first": 2, "recorded": 1, "replayed": 1}, res


MECHANICS = """
import json, threading, torch
from benchmarks.host_time import gpu_path_on_cpu
from triton.runtime import driver
gpu_path_on_cpu()
import tritonkv
from tritonkv.kernels import _plan

def plan_of(call):
    _plan._PLANS.clear()
    outs = [call() for _ in range(3)]  # seen, recorded, repeated
    plans = [p for p in _plan._PLANS.values() if p.__class__ is _plan._Plan]
    assert len(plans) == 1, _plan._PLANS
    return plans[0], outs[-1]

def kept(plan):
    return [plan.pool[0].slots[slot].data_ptr() for slot, _, _, _ in plan.workspace[1]]

def storages(out):
    ts = out if isinstance(out, tuple) else [v for v in vars(out).values() if isinstance(v, torch.Tensor)]
    return {t.untyped_storage().data_ptr() for t in ts}

out = {}
g = torch.Generator().manual_seed(0)
k, v = torch.randn(1, 8, 1024, 64, generator=g), torch.randn(1, 8, 1024, 64, generator=g)
q = torch.randn(1, 16, 8, 64, generator=g)
calls = dict(knorm=lambda: tritonkv.compress((k, v), "knorm", 0.25),
             score=lambda: tritonkv.compress((k, v), "score", 0.25, queries=q, hd=torch.ones(8)),
             adakv=lambda: tritonkv.compress((k, v), "snapkv", 0.25, queries=q, allocation="adakv"))
for name, call in calls.items():
    plan, last = plan_of(call)
    first = kept(plan)
    results = [call() for _ in range(3)]
    out[name + "_reused"] = kept(plan) == first and len(first) > 0
    out[name + "_apart"] = all(not storages(r) & set(first) for r in results + [last])
    out[name + "_fresh_results"] = not storages(results[0]) & storages(results[1])
    out[name + "_bytes"] = sum(plan.pool[0].slots[s].nbytes for s, _, _, _ in plan.workspace[1])

plan, _ = plan_of(calls["knorm"])
first = kept(plan)
stream = driver.active.get_current_stream
driver.active.get_current_stream = lambda device=None: 5  # another stream: another workspace, then kept for it
calls["knorm"]()
out["stream"] = [kept(plan) != first, plan.pool[0].owner[2]]
driver.active.get_current_stream = stream
calls["knorm"]()
second = kept(plan)
t = threading.Thread(target=calls["knorm"])  # another thread: another workspace
t.start()
t.join()
out["thread"] = kept(plan) != second and plan.pool[0].owner[0] != threading.get_ident()

held = plan._take(0, 0)  # a call holds the workspace: a concurrent (or nested) call makes its own
other = plan._take(0, 0)
out["one_call_at_a_time"] = all(held.slots[s] is not other.slots[s] for s, _, _, _ in plan.workspace[1])

capturing = torch.cuda.is_current_stream_capturing
plan.cuda = True  # as if the plan's temporaries were on a GPU whose stream is being captured
torch.cuda.is_current_stream_capturing = lambda: True
out["captured"] = plan._take(0, 0) is None
torch.cuda.is_current_stream_capturing = capturing

big_k, big_v = torch.randn(1, 8, 65536, 16, generator=g), torch.randn(1, 8, 65536, 16, generator=g)
plan, _ = plan_of(lambda: tritonkv.compress((big_k, big_v), "knorm", 0.25))
sizes = [plan.pool[0].slots[s].nbytes for s, _, _, _ in plan.workspace[1]]
out["big"] = [sum(sizes), len(plan.workspace[1]), sum(1 for s in plan.workspace[0] if hasattr(s, "alloc"))]

class Squeezes(tritonkv.policies.Knorm):  # changes a temporary's shape in place
    def score_and_hist0(self, keys, values, **kw):
        s, h = super().score_and_hist0(keys, values, **kw)
        return s.unsqueeze_(0).squeeze_(0), h

plan, _ = plan_of(lambda: tritonkv.compress((k, v), Squeezes(), 0.25))
out["in_place_view"] = plan.workspace is None

del plan, held, other
_plan._PLANS.clear()
out["kept_after_clear"] = _plan._kept[0]  # every workspace freed with its plan
_plan._KEPT_BYTES = 0  # all plans' workspaces together are capped: over it, temporaries are allocated per call
plan, _ = plan_of(calls["knorm"])
out["over_total"] = [plan.workspace is not None, plan.pool, _plan._kept[0]]
print(json.dumps(out))
"""


def test_workspace_is_kept_per_owner_and_apart_from_results():
    res = _run(MECHANICS)
    for name in ("knorm", "score", "adakv"):
        assert res[name + "_reused"] and res[name + "_apart"] and res[name + "_fresh_results"], (name, res)
        assert 0 < res[name + "_bytes"] <= 1 << 20, (name, res)
    assert res["stream"] == [True, 5], res
    assert res["thread"] and res["one_call_at_a_time"] and res["captured"], res
    total, n_kept, n_fresh = res["big"]  # scores of 2 MiB: allocated per call; the small temporaries kept
    assert total <= 1 << 20 and n_kept > 0 and n_fresh >= 5, res  # 3 outputs, scores, candidates
    assert res["in_place_view"], res
    assert res["kept_after_clear"] == 0 and res["over_total"] == [True, [], 0], res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_workspace_on_a_gpu():
    """Compiled kernels: a workspace filled with garbage between repeats gives the unplanned result exactly; a
    call captured into a CUDA graph uses no kept workspace, and its replay matches too."""
    import tritonkv
    from tritonkv.kernels import _plan

    g = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(2, 4, 1000, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    values = torch.randn(2, 4, 1000, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    queries = torch.randn(2, 8, 16, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    hd = torch.rand(4, device="cuda", generator=g) + 0.1  # on the device: nothing copied from the host in capture
    for name, extra in (("knorm", {}), ("snapkv", dict(queries=queries)), ("score", dict(queries=queries, hd=hd))):
        _plan._enabled[0] = False
        ref = tritonkv.compress((keys, values), name, 0.25, **extra)
        _plan._enabled[0] = True
        _plan._PLANS.clear()
        for _ in range(3):
            tritonkv.compress((keys, values), name, 0.25, **extra)
        plan = next(p for p in _plan._PLANS.values() if p.__class__ is _plan._Plan)
        kept = [plan.pool[0].slots[slot] for slot, _, _, _ in plan.workspace[1]]
        for byte in (0x7F, 0xFF):
            for t in kept:
                t.untyped_storage().fill_(byte)
            got = tritonkv.compress((keys, values), name, 0.25, **extra)
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), (name, byte)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            tritonkv.compress((keys, values), name, 0.25, **extra)  # warm-up on the side stream: its own workspace
        torch.cuda.current_stream().wait_stream(stream)
        before = list(plan.pool)
        with torch.cuda.graph(graph):
            captured = tritonkv.compress((keys, values), name, 0.25, **extra)
        assert len(before) == 1 and plan.pool[0] is before[0], name  # untouched by the capture
        for t in [before[0].slots[slot] for slot, _, _, _ in plan.workspace[1]]:
            t.untyped_storage().fill_(0x7F)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, ref)), name
