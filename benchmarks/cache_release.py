"""A returned cache is freed with its last reference: `generate` at 8K (random Llama of benchmarks/memory.py,
SnapKV at 0.1), the cache dropped three times; RSS (after malloc_trim) against before. Usage: python
benchmarks/cache_release.py after_prefill"""
import ctypes, gc, os, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from tritonkv.integrations import transformers as tt
libc = ctypes.CDLL("libc.so.6")
def rss():
    libc.malloc_trim(0)
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=40000)
m = LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, 1024, (1, 8192), generator=torch.Generator().manual_seed(1))
mode = sys.argv[1]
out = tt.generate(m, ids, policy="snapkv", budget=0.1, mode=mode, block_size=512, max_new_tokens=8, return_cache=True)
base = rss()
for i in range(3):
    out = tt.generate(m, ids, policy="snapkv", budget=0.1, mode=mode, block_size=512, max_new_tokens=8, return_cache=True)
    cache = out[1] if isinstance(out, tuple) else out.past_key_values
    held = cache.nbytes / 2**20
    del out, cache
    print(f"{mode} iter {i}: cache {held:.2f} MiB, RSS after dropping it {rss() - base:+.2f} MiB vs before")
gc.collect(); print(f"after gc.collect: {rss() - base:+.2f} MiB")
