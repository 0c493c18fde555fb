"""tritonkv inside Hugging Face transformers: a compressed ``Cache`` and the attention function that reads it.

    from tritonkv.integrations.transformers import generate
    out = generate(model, input_ids, policy="keydiff", budget=0.25, mode="blockwise", max_new_tokens=32)

or, with ``model.generate`` directly::

    cache = TritonKVCache("keydiff", 512, mode="blockwise")
    with use_tritonkv(model):           # attn_implementation="tritonkv" while inside
        model.generate(input_ids, cache=cache, prefill_chunk_size=cache.block_size, max_new_tokens=32)

(``cache=`` from transformers 5.24, ``past_key_values=`` before: ``cache_kwarg(model)`` names the keyword and
``output_cache(out)`` reads a model output's cache under either name.)

Where things are:

- ``storage.py``: what a layer holds — dense rows, or ragged per-head rows (``RaggedKV``) with per-head
  budgets — and the slack rule (kept tokens + ``max(16, kept/16)`` free slots per head after a compression);
- ``attention.py``: the ``"tritonkv"`` attention function (registered in ``transformers.AttentionInterface``):
  by position, never a pad, in memory linear in T and S (causal SDPA for the prompt's first forward, SDPA over
  query chunks for later blocks, the split-K decode kernel for decode steps);
- ``cache.py``: ``TritonKVCache`` and its layers — when a layer compresses (after every multi-token forward over
  the budget; in ``"decoding"`` mode every ``decode_every`` tokens), budget semantics, ``nbytes`` and
  ``kept_tokens()``; a sliding-window layer (transformers' ``sliding_window``) keeps its window instead;
- ``generate.py``: ``make_cache``, ``prefill`` (block-wise), ``generate``, ``decode``, ``cache_kwarg`` and
  ``output_cache`` (the cache's keyword across transformers versions); for kvpress users the
  ``compressing(model, policy, budget)`` context manager (``with compressing(...): model.generate(...)``) and
  ``answer(model, context_ids, questions, ...)`` (compress a context once, answer several questions).

Modes: ``"after_prefill"`` (the prompt in one forward, compressed once), ``"blockwise"`` (the prompt in blocks of
``block_size``, compressed after each, KeyDiff Eq. 6: never more than ``budget + block_size`` slots per head; the
model runs up to ``forward_tokens`` tokens per forward, each block still attended and compressed on its own),
``"decoding"`` (after-prefill plus re-compression back to the budget every ``decode_every`` steps). With a budget
>= the sequence length nothing is evicted and the logits equal the uncompressed model's up to fp32 round-off.

RoPE positions are whatever the model is given: ``generate`` and ``prefill`` here count tokens *seen*
(``get_seq_length()`` returns tokens seen, never tokens stored).

Left-padded batches are batch invariant: once a forward carries pads, each row is compressed on its own tokens and
schedule (``TritonKVLayer.compress_rows``), and block-wise ``prefill``/``generate`` start each row's blocks at its
first real token; every row gives the logits of the same prompt alone.

torch.compile: ``TritonKVCache.reserve(capacity)`` gives every layer static buffers (and window policies a fixed
buffer of their last queries); under ``torch.compiler.is_compiling()`` ``update`` writes at a device-side fill
index, the attention spans the whole capacity by position, the saved queries roll on the device and the mask size
is the static capacity, so a decode step has no host read-back, no data-dependent shape and no guard on the fill
level; compression then runs eagerly between steps (``TritonKVCache.compress_now``, after every step if wanted)
and writes into the reserved buffers in place.

transformers 5.2 to the newest: the layer answers both cache-layer interfaces (see ``TritonKVLayer``).
"""
from .attention import ATTN_IMPLEMENTATION, attention, masked_attention, use_tritonkv
from .cache import MODES, LagKVLayer, TritonKVCache, TritonKVLayer
from .generate import answer, cache_kwarg, compressing, decode, generate, make_cache, output_cache, prefill
from .storage import SENTINEL, DenseStore, RaggedStore, slack_for

__all__ = ["TritonKVCache", "TritonKVLayer", "LagKVLayer", "MODES", "SENTINEL", "ATTN_IMPLEMENTATION", "attention",
           "masked_attention", "use_tritonkv", "make_cache", "prefill", "generate", "decode", "compressing", "answer",
           "cache_kwarg", "output_cache", "DenseStore", "RaggedStore", "slack_for"]
