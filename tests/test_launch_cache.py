"""The eager launch cache (``tritonkv.kernels._common._cached_run``) launches exactly what
``JITFunction.run`` launches: ``launch_cache_check.py`` compares the two paths argument by argument for
every launch of every dense policy over shapes, dtypes and layouts that change Triton's specialisation
(a subprocess without ``TRITON_INTERPRET``: fake driver, recording stub kernels, no GPU needed); calls repeated
from their plans (``tritonkv/kernels/_plan.py``) likewise."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run(code: str, **env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITONKV_CPU_KERNELS")}
    env.update(env_extra, PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_cached_launches_are_the_launches_of_triton_run():
    res = _run(f"import sys; sys.path.insert(0, {HERE!r}); import launch_cache_check; launch_cache_check.main()")
    # every launch compared; all but the first of each specialisation served from the cache
    assert res["compared"] > 1000 and res["variants"] > 50, res
    assert res["served"] >= res["compared"] - 2 * res["variants"], res
    assert res["replayed"] > 150, res  # calls repeated from their plans, each checked against Triton's run


def test_environment_switch_turns_the_cache_off():
    code = ("import json; from tritonkv.kernels import _common; "
            "print(json.dumps(dict(on=_common._launch_cache[0], audited=_common._AUDITED is not None)))")
    assert _run(code, TRITONKV_LAUNCH_CACHE="0") == dict(on=False, audited=True)
    assert _run(code) == dict(on=True, audited=True)


# a policy that reads a value back on the host, for the two scripts below ({READS} in them)
READS = """
class Reads(Knorm):  # reads a value back on the host
    def score_and_hist0(self, keys, values, **kw):
        keys.sum(-1).tolist()
        return self.score(keys, values), None
"""

PLAN_GUARDS = """
import json, warnings, torch
from benchmarks.host_time import gpu_path_on_cpu
gpu_path_on_cpu()
import tritonkv
from tritonkv.kernels import _common, _plan
from tritonkv.policies import CriticalKV, Knorm, SnapKV

def plans():
    return sorted(type(p).__name__ if p else str(p) for p in _plan._PLANS.values())

out = {}
k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 4, 16)  # more heads than tokens: a warning each call
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    for _ in range(4):
        tritonkv.compress((k, v), "knorm", 2)
out["warned"], out["warning_plans"] = len(w), plans()
_plan._PLANS.clear()

{READS}
k, v = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
for _ in range(3):
    tritonkv.compress((k, v), Reads(), 16)
out["read_plans"] = plans()
_plan._PLANS.clear()
for _ in range(3):
    tritonkv.compress((k, v), "knorm", 16)
with _common.record_launches(execute=False) as log:  # patches Triton's run: no plan may serve the call
    tritonkv.compress((k, v), "knorm", 16)
out["logged"] = len(log)
q, w = torch.randn(1, 4, 8, 16), torch.randn(64, 64)
for sink in (0, 4, 0, 4, 0, 4):  # a policy object's settings, nested policies too, are part of the key
    tritonkv.compress((k, v), Knorm(sink=sink), 16)
    tritonkv.compress((k, v), CriticalKV(base=SnapKV(window=4 + sink)), 16, queries=q, o_proj=w)
out["settings_plans"] = plans()
_plan._PLANS.clear()
kg, qg = k.clone().requires_grad_(), q.clone().requires_grad_()  # a call is not differentiable: planned detached
want = [tritonkv.compress((k, v), "knorm", 16), tritonkv.compress((k, v), SnapKV(window=8), 16, queries=q)]
_plan._PLANS.clear()
for _ in range(3):
    got = [tritonkv.compress((kg, v), "knorm", 16), tritonkv.compress((kg, v), SnapKV(window=8), 16, queries=qg)]
out["grad_plans"] = plans()
out["grad_same"] = all(a.shape == b.shape and a.dtype == b.dtype and not b.requires_grad  # stub kernels: no values
                      for w, g in zip(want, got) for a, b in zip(w, g))
_plan._PLANS.clear()
for _ in range(3):  # nothing dropped: the input itself comes back, so the call stays off plans
    whole = tritonkv.compress((kg, v), "knorm", 64)
out["grad_whole"] = [plans(), whole.keys is kg]
_plan._PLANS.clear()
with torch.autocast("cpu", dtype=torch.bfloat16):  # replayed ops would be cast again: autocast keeps plans off
    for _ in range(3):
        tritonkv.compress((k, v), "knorm", 16)
out["autocast_plans"] = plans()
_plan._PLANS.clear()
served = []
replay = _plan._Plan.replay
_plan._Plan.replay = lambda self, t: served.append(replay(self, t)) or served[-1]
hm = torch.rand(4, 1, 8, 64)  # more elements than the plan key holds by value
for m in (hm, hm, hm, hm, torch.rand(4, 1, 8, 64), hm):  # a table cached per head_means object
    tritonkv.compress((k, v), "knorm", 0.5, allocation="score", layer=1, head_means=m)
hm.mul_(2)  # changed in place: its version moves on
tritonkv.compress((k, v), "knorm", 0.5, allocation="score", layer=1, head_means=hm)
out["served"] = [r is not _plan._MISS and r is not _plan._STALE for r in served]
del served[:]
from tritonkv.allocation import Fixed
b1, b2 = torch.full((4, 2), 8, dtype=torch.int32), torch.full((4, 2), 4, dtype=torch.int32)
for b in (b1, b1, b1, b1, b2, b1):  # an allocator's tensor attribute: read on the host once per object
    tritonkv.compress((k, v), "knorm", 0.5, allocation=Fixed(budgets=b), layer=1)
b1.fill_(6)  # changed in place
tritonkv.compress((k, v), "knorm", 0.5, allocation=Fixed(budgets=b1), layer=1)
out["fixed_served"] = [r is not _plan._MISS and r is not _plan._STALE for r in served]
print(json.dumps(out))
"""


def test_plans_repeat_only_what_they_may():
    """A warning, a value read back to the host, a patched Triton ``run`` (``record_launches``), autocast, or
    keys that require grad returned as they are, keep a call off plans (inputs that require grad are planned
    detached); a policy object's settings are part of the plan key; a plan that used a table cached per input
    object (or an allocator's tensor attribute) serves that object only, unchanged."""
    res = _run(PLAN_GUARDS.replace("{READS}", READS))
    assert res["warned"] == 4 and res["warning_plans"] == ["False"], res
    assert res["read_plans"] == ["False"], res
    assert res["logged"] == 4, res  # knorm: score + finish + tail + compact
    assert res["settings_plans"] == ["_Plan"] * 5, res  # "knorm" and four policy objects
    assert res["grad_plans"] == ["_Plan", "_Plan"] and res["grad_same"], res  # repeated detached, no output needs grad
    assert res["grad_whole"] == [[], True], res
    assert res["autocast_plans"] == [], res
    # served from the plan: the 3rd and 4th calls; not another head_means object (the plan is then recorded again,
    # for hm, by the 6th call), nor hm changed in place
    assert res["served"] == [True, True, False, False], res
    assert res["fixed_served"] == [True, True, False, False], res  # likewise Fixed's budgets


SPEED_CALLS = """
import json, torch
from benchmarks.host_time import gpu_path_on_cpu, speed_calls
gpu_path_on_cpu()
from tritonkv.kernels import _plan
from tritonkv.policies import CriticalKV, Knorm, SnapKV

out = {}
with torch.no_grad():  # as benchmarks/speed.py calls compress
    for case, call in speed_calls():
        before = dict(_plan.counts)
        for _ in range(4):
            call()
        out[case] = {k: v - before.get(k, 0) for k, v in _plan.counts.items() if v != before.get(k, 0)}

{READS}
import numpy as np
import tritonkv
k, v = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
for _ in range(3):
    tritonkv.compress((k, v), Reads(), 16)
out["why"] = list(_plan.why)
# what compress reads as it reads a tensor or a Python number: W_O as an nn.Linear or a module's Parameter (that
# requires grad), NumPy numbers (a budget, a layer index), kv as a list
q, lin, ckv = torch.randn(1, 4, 8, 16), torch.nn.Linear(64, 64, bias=False), CriticalKV(base=SnapKV(window=4))
calls = {"o_proj Linear": lambda: tritonkv.compress((k, v), ckv, 16, queries=q, o_proj=lin),
         "o_proj Parameter": lambda: tritonkv.compress((k, v), ckv, 16, queries=q, o_proj=lin.weight),
         "numpy budget": lambda: tritonkv.compress((k, v), "knorm", np.float32(0.25)),
         "numpy layer": lambda: tritonkv.compress((k, v), "knorm", 16, allocation="pyramid", layer=np.int64(1),
                                                  num_layers=np.int64(4)),
         "kv list": lambda: tritonkv.compress([k, v], "knorm", 16)}
for case, call in calls.items():
    before = dict(_plan.counts)
    res = [call() for _ in range(4)]
    out[case] = {k: v - before.get(k, 0) for k, v in _plan.counts.items() if v != before.get(k, 0)}
    out[case + " grad"] = any(t.requires_grad for r in res for t in vars(r).values() if isinstance(t, torch.Tensor)) \
        if hasattr(r := res[-1], "__dict__") else any(t.requires_grad for t in res[-1])
print(json.dumps(out))
"""


def test_speed_benchmark_calls_repeat_from_plans():
    """``benchmarks/speed.py``'s own calls (policy objects, an int budget, the window LSE, allocators as layer 15 of
    30 with its inputs), as ``benchmarks/host_time.py`` drives them on the CPU: the second call of each is recorded,
    later ones repeated from the plan (``_plan.counts``), and so are calls with W_O as an ``nn.Linear`` or a
    ``Parameter``, NumPy numbers or kv as a list (no output requires grad); a call that cannot be recorded says why
    (``_plan.why``)."""
    res = _run(SPEED_CALLS.replace("{READS}", READS))
    why = res.pop("why")
    grads = {case: res.pop(case) for case in list(res) if case.endswith(" grad")}
    assert len(res) == 14 and not any(grads.values()), (res, grads)
    # W_O's Parameter: the call of its Linear, whose plan it repeats from the start
    assert res.pop("o_proj Parameter") == {"replayed": 4}, res
    for case, counts in res.items():
        assert counts == {"first": 1, "recorded": 1, "replayed": 2}, (case, counts)
    assert len(why) == 1 and why[0].startswith("Tensor.tolist of values the key does not determine"), why
