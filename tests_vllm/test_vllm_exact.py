"""Exactness at full budget and the plugin's loading: the same requests through vLLM without the plugin
(``VLLM_PLUGINS=""``) and with it at a budget no request reaches, the latter with vLLM's usual processes."""
import re

from engine_run import CONCURRENT, SEQUENTIAL, SHORT


def test_full_budget_gives_the_tokens_of_vllm_without_the_plugin(scenario):
    full, stock = scenario("full"), scenario("stock")
    rids = [r for r, *_ in SEQUENTIAL + [SHORT] + CONCURRENT]
    assert set(full["tokens"]) == set(rids)
    for rid in rids:
        assert full["tokens"][rid] == stock["tokens"][rid], rid


def test_plugin_loads_in_every_process_once(scenario):
    """The front end and the engine core (which hosts the worker at TP = 1) each register the plugin once, although
    vLLM calls the entry point several times; with ``VLLM_PLUGINS=""`` it is not loaded."""
    log = scenario("full")["log"]
    pids = re.findall(r"tritonkv vLLM plugin registered \(pid (\d+)\)", log)
    assert len(set(pids)) >= 2, log[-3000:]
    assert len(pids) == len(set(pids))  # once per process
    assert "EngineCore" in log
    assert "tritonkv vLLM plugin registered" not in scenario("stock")["log"]
