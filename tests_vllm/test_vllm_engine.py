"""The plugin inside a running vLLM engine (one engine for the module: ``engine_run.py compressed``): keydiff at a
budget of 48 tokens, 32-token blocks and prefill chunks, a 16-block pool, vLLM's prefix caching on (its default).

Each request's greedy tokens must equal those of transformers' Llama fed the same chunks with the evicted tokens
masked per layer and KV head (``helpers.reference_tokens``); the blocks a request holds, read from the
scheduler's block pool after every step, must stay bounded, and blocks a running request freed must serve
another request in the same run.
"""
import helpers as H
import pytest
from engine_run import AGAIN, BUDGET, CONCURRENT, POLICY, PREEMPTED, SEQUENTIAL, SHORT


@pytest.fixture(scope="module")
def run(scenario):
    return scenario("compressed")


def _reference(run, model_dir, rid, **kw):
    return H.reference_tokens(model_dir, run["prompts"][rid], run["tokens"][rid], run["schedule"][rid],
                              POLICY["policy"], BUDGET, **kw)


def test_greedy_tokens_equal_the_masked_reference(run, model_dir):
    """48 of 48 greedy tokens over three requests of different lengths, prefilled in 32-token chunks."""
    matched = total = 0
    per_head_differs = False
    for rid, n, _, t in SEQUENTIAL:
        assert len(run["tokens"][rid]) == t
        assert run["schedule"][rid][:3] == [0, 32, 64]  # chunked prefill
        kept = []
        ref = _reference(run, model_dir, rid, kept_log=kept)
        assert kept, f"{rid}: nothing was evicted"  # the budget bites
        per_head_differs |= any(len({tuple(h) for h in heads}) > 1 for _, _, heads in kept)
        matched += sum(a == b for a, b in zip(ref, run["tokens"][rid]))
        total += t
        assert ref == run["tokens"][rid], rid
    assert (matched, total) == (48, 48)
    assert per_head_differs  # heads kept different tokens (the same count)


def test_eviction_changes_the_output(run, model_dir):
    """The comparison above can fail: without eviction the reference gives other tokens."""
    differ = 0
    for rid, *_ in SEQUENTIAL:
        full = H.reference_tokens(model_dir, run["prompts"][rid], run["tokens"][rid], run["schedule"][rid],
                                  POLICY["policy"], 10 ** 6)
        differ += full != run["tokens"][rid]
    assert differ >= 1


def test_concurrent_requests_do_not_disturb_each_other(run, model_dir):
    """Three requests of 90, 300 and 420 tokens decoding together: each equals its own reference, which knows
    nothing of the others."""
    together = [step for step in run["running"] if {r for r, *_ in CONCURRENT} <= set(step)]
    assert together, "the concurrent requests never ran together"
    for rid, *_ in CONCURRENT:
        assert _reference(run, model_dir, rid) == run["tokens"][rid], rid


def test_blocks_per_request_stay_bounded(run):
    bound = H.max_blocks(BUDGET)  # ceil((48 + 32) / 32) + 1 = 4
    for rid, steps in run["blocks"].items():
        n = len(run["prompts"][rid]) + len(run["tokens"][rid])
        peak = max(len(ids) for _, ids in steps)
        assert peak <= bound, (rid, peak, bound)
        if n > 200:
            assert peak < -(-n // H.BLOCK) // 2, (rid, peak)  # far below what the request would hold uncompressed


def test_freed_blocks_serve_another_request(run):
    """A block that the long request held and then freed while still running is held by the late request; and
    the three concurrent requests needed more blocks uncompressed than the pool has."""
    long, late = run["blocks"]["long"], run["blocks"]["late"]
    last_long = long[-1][0]
    held_by_long = {}
    for step, ids in long:
        for b in ids:
            held_by_long.setdefault(b, step)
    long_at = dict(long)
    reused = [(step, b) for step, ids in late for b in ids
              if b in held_by_long and held_by_long[b] < step < last_long and b not in long_at.get(step, ())]
    assert reused, (long[:5], late)
    need = sum(-(-(n + t) // H.BLOCK) for _, n, _, t in CONCURRENT)
    assert need > run["pool"] - 1  # one block of the pool is vLLM's null block


def test_request_under_the_budget_is_untouched(run, scenario):
    """50 tokens under a budget of 48 + 32 never compress: the tokens of vLLM without the plugin, every block
    kept."""
    rid, n, _, t = SHORT
    stock = scenario("stock")
    assert run["tokens"][rid] == stock["tokens"][rid]
    assert max(len(ids) for _, ids in run["blocks"][rid]) == -(-(n + t - 1) // H.BLOCK)


def test_prefix_cache_serves_no_compressed_block(run):
    """The same prompt again, with prefix caching on: nothing comes from the cache (a compressed layer's blocks no
    longer hold the prompt's tokens) and the tokens repeat."""
    rid, n, seed, t = AGAIN
    first = next(r for r, m, s, _ in SEQUENTIAL if (m, s) == (n, seed))
    assert run["prompts"][rid] == run["prompts"][first]
    assert run["cached"][rid] == 0
    assert run["tokens"][rid] == run["tokens"][first]


def test_a_preempted_request_is_recomputed_with_the_same_tokens(scenario):
    """Three requests the pool cannot hold at once, at a budget none reaches: vLLM preempts one (its computed
    tokens drop) and recomputes it from its prompt and generated tokens; every request gives the tokens of the same
    requests on a pool that holds them all, and every block comes back."""
    run = scenario("preempted")
    small, large = run["small"], run["large"]
    assert any(b < a for c in small["computed"].values() for a, b in zip(c, c[1:])), "nothing was preempted"
    assert not any(b < a for c in large["computed"].values() for a, b in zip(c, c[1:]))
    for rid, _, _, t in PREEMPTED:
        assert len(small["tokens"][rid]) == t and small["tokens"][rid] == large["tokens"][rid], rid
    for r in (small, large):
        assert r["free_after"] == r["free_before"]
