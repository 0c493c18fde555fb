"""Bad settings are refused when the engine starts (before any request) with ``TritonKVConfigError`` naming what is
wrong."""
import pytest

CASES = {
    "unknown_policy": ["unknown policy 'snapvk'", "did you mean 'snapkv'"],
    "budget_zero": ["['budget']", "positive"],
    "needs_queries": ["'snapkv' needs the input(s) ['queries']", "cannot supply"],
    "unknown_setting": ["'decode_evry'", "did you mean 'decode_every'"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_at_engine_start(scenario, case):
    res = scenario("bad")[case]
    assert not res["started"]
    assert res["error"].startswith("TritonKVConfigError: "), res["error"]
    for part in CASES[case]:
        assert part in res["error"], (part, res["error"])
