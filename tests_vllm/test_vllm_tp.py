"""Tensor parallel 2 on the CPU (gloo, one KV head per rank): each rank compresses its own heads with the count
``start(n)`` gives every rank, without communicating; the tokens must be those of TP = 1."""
import re

import pytest
from conftest import two_cpus
from engine_run import SEQUENTIAL


@pytest.mark.skipif(len(two_cpus()) < 2, reason="tensor parallel 2 on the CPU needs 2 CPUs (one per worker)")
def test_tp2_gives_the_tokens_of_tp1(scenario):
    tp2, tp1 = scenario("tp2"), scenario("compressed")
    for rid, *_ in SEQUENTIAL:
        assert tp2["tokens"][rid] == tp1["tokens"][rid], rid
    # the front end, the engine core and both workers each registered the plugin once
    pids = re.findall(r"tritonkv vLLM plugin registered \(pid (\d+)\)", tp2["log"])
    assert len(set(pids)) >= 3 and len(pids) == len(set(pids)), tp2["log"][-3000:]
