"""A returned cache is freed with its last reference: ``generate`` at 8K on the random Llama, the cache dropped three
times, the RSS against before (method: docs/benchmarks.md, "Cache release (cache_release.py)"). Results:
``benchmarks/results/cache_release.md``.

    python -m benchmarks.cache_release [after_prefill|blockwise|decoding]
"""
from __future__ import annotations

import functools
import gc
import sys

import torch

from benchmarks.common import LLAMA_256, malloc_trim, random_llama, rss_kb
from tritonkv.integrations import transformers as tt


def rss_mib() -> float:
    malloc_trim()  # freed heap memory back to the system first
    return rss_kb() / 1024


def main(mode: str = "after_prefill", n: int = 8192) -> None:
    model = random_llama(**LLAMA_256, attn_implementation="sdpa")
    ids = torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(1))
    run = functools.partial(tt.generate, model, ids, policy="snapkv", budget=0.1, mode=mode, block_size=512,
                            max_new_tokens=8, return_cache=True)
    run()  # warm-up: lazy imports and one-time set-up
    base = rss_mib()
    for i in range(3):
        held = run()[1].nbytes / 2**20  # the returned (ids, cache) is dropped at the end of this line
        print(f"{mode} iter {i}: cache {held:.2f} MiB, RSS after dropping it {rss_mib() - base:+.2f} MiB vs before")
    gc.collect()
    print(f"after gc.collect: {rss_mib() - base:+.2f} MiB")


if __name__ == "__main__":
    main(*sys.argv[1:2])
