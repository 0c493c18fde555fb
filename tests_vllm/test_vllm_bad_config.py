"""Bad settings are refused when the engine starts (before any request) with ``TritonKVConfigError`` naming what is
wrong; so is a layer on an attention backend the plugin does not wrap."""
import pytest

CASES = {
    "unknown_policy": ["unknown policy 'snapvk'", "did you mean 'snapkv'"],
    "budget_zero": ["['budget']", "positive"],
    "needs_queries": ["'snapkv' needs the input(s) ['queries']", "cannot supply"],
    "unknown_setting": ["'decode_evry'", "did you mean 'decode_every'"],
    # a full-attention layer on a backend the plugin does not wrap would run uncompressed: refused, named
    "unwrapped_backend": ["attention backend FLEX_ATTENTION", "'model.layers.0.self_attn.attn'",
                          "wrappers of CPU_ATTN, TRITON_ATTN, FLASH_ATTN", "--attention-backend FLASH_ATTN"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_at_engine_start(scenario, case):
    res = scenario("bad")[case]
    assert not res["started"]
    assert res["error"].startswith("TritonKVConfigError: "), res["error"]
    for part in CASES[case]:
        assert part in res["error"], (part, res["error"])
