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
def model_dirs(tmp_path_factory):
    """The tiny random models (``helpers.MODELS``), each saved once per session when first asked for."""
    import helpers

    made: dict = {}

    def get(kind: str) -> str:
        if kind not in made:
            made[kind] = helpers.make_model(str(tmp_path_factory.mktemp(f"tiny-{kind}")), kind=kind)
        return made[kind]

    return get


@pytest.fixture(scope="session")
def model_dir(model_dirs):
    return model_dirs("llama")


def run_scenario(name: str, model: str, tmp: str, *, in_process: bool, plugins: bool = True, env=None,
                 key: str | None = None) -> dict:
    """``engine_run.py NAME`` in a subprocess (once per session and ``key``, by default ``name``): its JSON, plus
    its output as ``"log"``."""
    key = key or name
    if key in _RUNS:
        return _RUNS[key]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=ROOT, **(env or {}))
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    if not plugins:
        env["VLLM_PLUGINS"] = ""  # an allowlist that matches no plugin: vLLM without tritonkv
    out = os.path.join(tmp, f"{key.replace(':', '-')}.json")
    r = subprocess.run([sys.executable, os.path.join(HERE, "engine_run.py"), name, model, out], env=env,
                       capture_output=True, text=True, timeout=600, cwd=tmp)
    assert r.returncode == 0, f"engine_run.py {name} failed:\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
    with open(out) as f:
        res = json.load(f)
    res["log"] = r.stdout + r.stderr
    _RUNS[key] = res
    return res


def two_cpus() -> list:
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:2] if len(cpus) >= 2 else []


@pytest.fixture(scope="session")
def scenario(model_dirs, tmp_path_factory):
    """``scenario(name)``: the JSON of ``engine_run.py`` for a scenario on the tiny Llama, or ``"hybrid:KIND"`` for
    the ``hybrid`` scenario on the tiny model ``KIND``."""
    tmp = str(tmp_path_factory.mktemp("engines"))
    settings = {"compressed": dict(in_process=True), "bad": dict(in_process=True), "preempted": dict(in_process=True),
                "full": dict(in_process=False), "stock": dict(in_process=True, plugins=False),
                # one CPU per worker: vLLM's automatic binding wants a NUMA node per worker
                "tp2": dict(in_process=False, env={"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, two_cpus()))})}

    def run(name: str) -> dict:
        if name.startswith("hybrid:"):
            kind = name.split(":", 1)[1]
            return run_scenario("hybrid", model_dirs(kind), tmp, in_process=True, key=name)
        return run_scenario(name, model_dirs("llama"), tmp, **settings[name])

    return run
