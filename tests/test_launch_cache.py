"""The eager launch cache (``tritonkv.kernels._common._cached_run``) launches exactly what
``JITFunction.run`` launches: ``launch_cache_check.py`` compares the two paths argument by argument for
every launch of every dense policy over shapes, dtypes and layouts that change Triton's specialisation
(a subprocess without ``TRITON_INTERPRET``: fake driver, recording stub kernels, no GPU needed)."""
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


def test_environment_switch_turns_the_cache_off():
    code = ("import json; from tritonkv.kernels import _common; "
            "print(json.dumps(dict(on=_common._launch_cache[0], audited=_common._AUDITED is not None)))")
    assert _run(code, TRITONKV_LAUNCH_CACHE="0") == dict(on=False, audited=True)
    assert _run(code) == dict(on=True, audited=True)
