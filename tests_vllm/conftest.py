"""The vLLM tests: they need vLLM (the ``.venv-vllm`` environment that ``make test-vllm`` builds) and are skipped
without it. Each engine runs in its own subprocess (``engine_run.py``), once per session."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

_RUNS: dict = {}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    import helpers

    return helpers.make_model(str(tmp_path_factory.mktemp("tiny-llama")))


def run_scenario(name: str, model: str, tmp: str, *, in_process: bool, plugins: bool = True, env=None) -> dict:
    """``engine_run.py NAME`` in a subprocess (once per session): its JSON, plus its output as ``"log"``."""
    if name in _RUNS:
        return _RUNS[name]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=ROOT, **(env or {}))
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    if not plugins:
        env["VLLM_PLUGINS"] = ""  # an allowlist that matches no plugin: vLLM without tritonkv
    out = os.path.join(tmp, f"{name}.json")
    r = subprocess.run([sys.executable, os.path.join(HERE, "engine_run.py"), name, model, out], env=env,
                       capture_output=True, text=True, timeout=600, cwd=tmp)
    assert r.returncode == 0, f"engine_run.py {name} failed:\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
    with open(out) as f:
        res = json.load(f)
    res["log"] = r.stdout + r.stderr
    _RUNS[name] = res
    return res


def two_cpus() -> list:
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:2] if len(cpus) >= 2 else []


@pytest.fixture(scope="session")
def scenario(model_dir, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("engines"))
    settings = {"compressed": dict(in_process=True), "bad": dict(in_process=True),
                "full": dict(in_process=False), "stock": dict(in_process=True, plugins=False),
                # one CPU per worker: vLLM's automatic binding wants a NUMA node per worker
                "tp2": dict(in_process=False, env={"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, two_cpus()))})}
    return lambda name: run_scenario(name, model_dir, tmp, **settings[name])
