"""Entry points: a cache for a model, block-wise prefill, ``generate`` and greedy decoding with a ``TritonKVCache``."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
from typing import Optional

import torch

from ...api import _REQUIRED
from ...kernels._common import check_int
from .attention import check_model, text_config, use_tritonkv
from .cache import TritonKVCache

FORWARD_TOKENS = 512  # default: prompt tokens per model forward of a block-wise prefill (whole blocks, at least one)


@functools.lru_cache(maxsize=None)
def _forward_takes_cache(cls) -> bool:
    return "cache" in inspect.signature(cls.forward).parameters


def cache_kwarg(model) -> str:
    """The keyword ``model``'s ``forward`` and ``generate`` take a cache under: ``"cache"`` from transformers 5.24
    (where ``past_key_values`` is deprecated, and dropped from ``forward`` in 5.40), ``"past_key_values"`` before.
    A ``torch.compile``'d model is read through its original module.

        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})"""
    model = getattr(model, "_orig_mod", model)
    return "cache" if _forward_takes_cache(type(model)) else "past_key_values"


def output_cache(out):
    """The cache a model output or ``generate`` output carries (its ``cache`` field from transformers 5.24, its
    ``past_key_values`` before), without the deprecation warning the old name now raises."""
    names = {f.name for f in dataclasses.fields(out)} if dataclasses.is_dataclass(out) else set()
    return out.cache if "cache" in names else getattr(out, "past_key_values", None)


def _check_ids(name: str, ids, batch: Optional[int] = None) -> None:
    """``ids``: token ids, a 2-D integer tensor ``[B, T]`` with ``T >= 1`` (and ``B == batch`` when given); else a
    TypeError or ValueError naming ``name``."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor of token ids [B, T], got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got {ids.dtype}")
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"{name} must be token ids [B, T] with T >= 1 (a 1-D prompt: ids[None]), got shape "
                         f"{tuple(ids.shape)}")
    if batch is not None and ids.shape[0] != batch:
        raise ValueError(f"{name} must hold {batch} row(s) [{batch}, T], got shape {tuple(ids.shape)}")


def _check_mask(attention_mask, columns: int, input_ids) -> None:
    """``attention_mask`` (None, or ``[B, columns]`` for ``input_ids`` ``[B, T]``): else a ValueError."""
    if attention_mask is None:
        return
    want = (input_ids.shape[0], columns)
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != want:
        raise ValueError(f"attention_mask must be [B, {columns}] (the tokens already seen plus input_ids), got "
                         f"{tuple(getattr(attention_mask, 'shape', ())) or type(attention_mask).__name__}")


def _check_budget(fn: str, budget, kwargs: dict) -> None:
    """A budget given, and no kvpress ``compression_ratio`` (the fraction removed) beside or instead of it: else a
    TypeError saying what the budget is."""
    if "compression_ratio" in kwargs:
        from ...diagnostics import ratio_hint

        raise TypeError(f"{fn}() takes no compression_ratio: "
                        + ratio_hint(kwargs["compression_ratio"], f"{fn}(..., budget={{}})"))
    if budget is _REQUIRED:
        raise TypeError(f"{fn}() missing the budget: tokens kept per (batch row, KV head) as an int, or the "
                        f"fraction of the prompt kept as a float in (0, 1]")


def make_cache(model, policy, budget=_REQUIRED, *, mode="after_prefill", allocation=None, block_size=128,
               decode_every=None, prompt_length=None, **kwargs) -> TritonKVCache:
    """A ``TritonKVCache`` for ``model`` (its decoder's layer count filled in; a multimodal model's text config).
    A model whose layers the cache cannot hold is a NotImplementedError here (``check_model``)."""
    _check_budget("make_cache", budget, kwargs)
    check_model(model)
    return TritonKVCache(policy, budget, mode=mode, allocation=allocation, block_size=block_size,
                         decode_every=decode_every, prompt_length=prompt_length,
                         num_layers=text_config(model).num_hidden_layers, **kwargs)


def _positions(attention_mask, start: int, T: int, device=None):
    """RoPE positions of tokens [start, start + T): the number of real tokens before each one. Made on ``device``
    (the mask's when given): a host tensor copied to a GPU would make each forward wait for the device."""
    if attention_mask is None:
        return torch.arange(start, start + T, device=device).unsqueeze(0)
    pos = attention_mask.to(device).long().cumsum(-1) - 1
    return pos.clamp(min=0)[:, start:start + T]


def _row_blocks(attention_mask, start0: int, T: int, block_size: int):
    """``(end, rows ending a block there)`` for feeding columns ``[start0, start0 + T)`` of a left-padded batch so
    that every row's blocks start at its own first real token, as for the row alone: the forwards end at the union
    of the rows' block ends (``rows``: a bool per row; None without a mask)."""
    stop = start0 + T
    if attention_mask is None:
        return [(e, None) for e in range(start0 + block_size, stop, block_size)] + [(stop, None)]
    pads = (attention_mask[:, :stop] == 0).sum(-1).tolist()
    ends = sorted({e for p in pads for e in range(p + block_size, stop, block_size) if e > start0} | {stop})
    out = []
    for e in ends:
        out.append((e, [e == stop or (e - p) % block_size == 0 for p in pads]))
    return out


def _forwards(cache, full_mask, start0: int, blocks, forward_tokens: int) -> list:
    """``(end, rows, sizes)`` per model forward: consecutive ``blocks`` (``_row_blocks``) joined into forwards of
    at most ``forward_tokens`` tokens (at least one block each; ``sizes``: the token count of each, None for one)
    when ``cache`` is a ``TritonKVCache`` that then attends and compresses them one by one (``attend_blocks``)
    and no row has pads; else one forward per block."""
    from .cache import TritonKVLayer

    if not isinstance(cache, TritonKVCache) or cache._layer_class is not TritonKVLayer or \
            (full_mask is not None and not bool(full_mask.all())):
        return [(b, rows, None) for b, rows in blocks]
    out, a, first = [], start0, start0  # a: where the next block starts; first: where the last forward starts
    for b, rows in blocks:
        if out and b - first <= forward_tokens:
            out[-1] = (b, rows, out[-1][2] + [b - a])
        else:
            out.append((b, rows, [b - a]))
            first = a
        a = b
    return [(b, rows, sizes if len(sizes) > 1 else None) for b, rows, sizes in out]


@torch.no_grad()
def prefill(model, input_ids, cache: TritonKVCache, *, attention_mask=None, block_size: Optional[int] = None,
            logits_to_keep: int = 1, progress=None, forward_tokens: int = FORWARD_TOKENS):
    """Feed ``input_ids`` ``[B, T]`` into ``cache`` (in blocks of ``block_size`` in blockwise mode) with RoPE at
    the tokens' true positions; returns the logits of the last ``logits_to_keep`` tokens. ``progress``: an
    optional callable taking the number of tokens fed by each forward.

    Consecutive blocks go through the model together, up to ``forward_tokens`` tokens per forward (at least one
    block): inside each layer's attention a ``TritonKVCache`` still stores, attends and compresses one block after
    the other, so the result is that of one forward per block (the model's other operations act on each token
    alone), while its matrix products run on more rows at once. Smaller values bound the activation memory of a
    forward; ``forward_tokens=block_size`` feeds one block per forward.

    A left-padded batch (``attention_mask``) in blockwise mode is fed one block per forward, so that each row's
    blocks start at its first real token (forwards end wherever some row's block ends; a row compresses only at
    its own block ends): every row keeps what it would keep alone."""
    check_int("forward_tokens", forward_tokens, 1)
    _check_ids("input_ids", input_ids)
    if not hasattr(cache, "get_seq_length"):
        raise TypeError(f"cache must be a transformers cache (a TritonKVCache from make_cache, or any Cache), got "
                        f"{type(cache).__name__}")
    B, T = input_ids.shape
    if block_size is None:
        block_size = cache.block_size if getattr(cache, "mode", None) == "blockwise" else T
    check_int("block_size", block_size, 1)
    start0 = cache.get_seq_length()
    full_mask = attention_mask
    _check_mask(attention_mask, start0 + T, input_ids)
    return _feed(model, input_ids, cache, full_mask, start0, _row_blocks(full_mask, start0, T, block_size),
                 logits_to_keep, progress, forward_tokens)


@torch.no_grad()  # as model.generate: no autograd graph over the prompt's activations
def _feed(model, input_ids, cache, full_mask, start0: int, blocks, logits_to_keep: int = 1, progress=None,
          forward_tokens: int = FORWARD_TOKENS):
    """The ``(end, rows)`` of ``blocks`` (``_row_blocks``) over columns of ``input_ids`` (which starts at column
    ``start0``), fed in forwards of up to ``forward_tokens`` tokens (``_forwards``); returns the last forward's
    logits."""
    B = input_ids.shape[0]
    out = None
    a = start0
    with use_tritonkv(model):
        for b, rows, sizes in _forwards(cache, full_mask, start0, blocks, forward_tokens):
            ids = input_ids[:, a - start0:b - start0]
            pos = _positions(full_mask, a, ids.shape[1], input_ids.device)
            if isinstance(cache, TritonKVCache):
                cache._block_ends, cache._sub_blocks = rows, sizes
            try:
                out = model(input_ids=ids, position_ids=pos.expand(B, -1),
                            attention_mask=None if full_mask is None else full_mask[:, :b],
                            use_cache=True, logits_to_keep=logits_to_keep, **{cache_kwarg(model): cache})
            finally:
                if isinstance(cache, TritonKVCache):
                    cache._block_ends = cache._sub_blocks = None
            if sizes is not None and any(layer._pending is not None for layer in cache.layers):
                raise RuntimeError(f"{type(model).__name__}: a layer's attention did not go through the 'tritonkv' "
                                   f"attention function, so its keys were never stored; feed one block per "
                                   f"forward (forward_tokens={max(sizes)})")
            if progress is not None:
                progress(ids.shape[1])
            a = b
    return out.logits


def generate(model, input_ids, *, policy, budget=_REQUIRED, mode: str = "after_prefill", allocation=None,
             block_size: int = 128, decode_every: Optional[int] = None, attention_mask=None,
             cache_kwargs: Optional[dict] = None, return_cache: bool = False,
             forward_tokens: int = FORWARD_TOKENS, **generate_kwargs):
    """``model.generate`` with a ``TritonKVCache``: ``policy`` x ``budget`` (float = fraction of the prompt) x
    ``allocation``, in ``mode`` ``"after_prefill"``, ``"blockwise"`` (true chunked prefill in blocks of
    ``block_size``; blocks go through the model up to ``forward_tokens`` tokens per forward, each still
    compressed on its own: see ``prefill``) or ``"decoding"``. Other keywords go to ``model.generate`` (greedy or
    sampling, left-padded batches with ``attention_mask``). Returns the generated ids (and the cache with
    ``return_cache``)."""
    check_int("forward_tokens", forward_tokens, 1)
    _check_budget("generate", budget, generate_kwargs)
    _check_ids("input_ids", input_ids)
    _check_mask(attention_mask, input_ids.shape[1], input_ids)
    own = sorted(k for k in ("cache", "past_key_values") if k in generate_kwargs)
    if own:
        raise ValueError(f"generate makes its own TritonKVCache, so it takes no {own[0]}: for a cache of your own "
                         f"call model.generate inside use_tritonkv(model) (or compressing(model, ...))")
    _check_not_ours(policy, allocation, generate_kwargs)
    _check_use_cache(model, (), generate_kwargs)
    cache = make_cache(model, policy, budget, mode=mode, allocation=allocation, block_size=block_size,
                       decode_every=decode_every, prompt_length=input_ids.shape[1], **(cache_kwargs or {}))
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if mode == "blockwise":
        _prompt_tensors_only_in_ids(generate_kwargs)
        _blocks_but_the_last(model, input_ids, cache, attention_mask, block_size, forward_tokens, generate_kwargs)
    with use_tritonkv(model):
        out = model.generate(input_ids, attention_mask=attention_mask, **{cache_kwarg(model): cache}, **generate_kwargs)
    return (out, cache) if return_cache else out


def _check_not_ours(policy, allocation, kwargs: dict) -> None:
    """A TypeError for keywords of ``generate`` that ``model.generate`` would get but that belong to tritonkv: a
    setting of the policy or the allocator (it goes in their constructor), or an input of ``compress`` (it goes in
    ``cache_kwargs``). ``model.generate`` would refuse them without saying where they go."""
    from transformers import GenerationConfig

    from ...allocation import get_allocator
    from ...api import get_policy
    from ...diagnostics import _settings, accepted_inputs, unknown_inputs

    pol = get_policy(policy)
    alloc = get_allocator(allocation) if allocation is not None else None
    theirs = set(vars(GenerationConfig())) | {"attention_mask", "position_ids", "inputs_embeds", "token_type_ids"}
    settings = {*_settings(type(pol)), *(_settings(type(alloc)) if alloc is not None else ())} - theirs
    inputs = accepted_inputs(pol, alloc) - theirs
    bad = {k: v for k, v in kwargs.items() if k in settings}
    if bad:
        raise unknown_inputs(bad, pol, alloc, (), "generate()")
    bad = sorted(k for k in kwargs if k in inputs)
    if bad:
        raise TypeError(f"generate() got {', '.join(map(repr, bad))}, an input of the policy or the allocator: pass "
                        f"it in cache_kwargs={{{bad[0]!r}: ...}} (other keywords go to model.generate)")


def _setting(model, args: tuple, kwargs: dict, name: str):
    """A generation setting as ``model.generate(*args, **kwargs)`` will read it: the keyword, else the caller's
    ``generation_config`` (the keyword, or ``model.generate``'s second positional argument) where it differs from
    the library default, else the model's own ``generation_config`` (transformers merges the model's defaults
    into a caller's config the same way)."""
    from transformers import GenerationConfig

    if kwargs.get(name) is not None:
        return kwargs[name]
    mine = kwargs.get("generation_config")
    if mine is None and args and isinstance(args[0], GenerationConfig):
        mine = args[0]
    if mine is not None and getattr(mine, name, None) != getattr(GenerationConfig(), name, None):
        return getattr(mine, name)
    return getattr(model.generation_config, name, None)


def _check_use_cache(model, args: tuple, kwargs: dict) -> None:
    """``use_cache=False`` (a keyword or a generation config's): transformers then feeds the whole sequence at
    every step, into the cache it is given, so a compressed cache would serve wrong tokens while it looks bounded."""
    if _setting(model, args, kwargs, "use_cache") is False:
        raise ValueError("use_cache=False (here or in a generation_config) recomputes the whole sequence at every "
                         "step without a cache, so there is nothing to compress: drop it, or call the model "
                         "without tritonkv")


def _prompt_tensors_only_in_ids(kwargs: dict) -> None:
    """Block-wise prefill feeds the prompt's token ids block by block; a tensor input of the prompt beside them
    (``pixel_values``, ``token_type_ids``, audio features, ...) would reach only the last block: a ValueError."""
    extra = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k != "attention_mask")
    if extra:
        raise ValueError(f"mode='blockwise' feeds the prompt's input_ids block by block and cannot split {extra} "
                         f"with them (images, token types, audio: inputs of a multimodal prompt); a text prompt "
                         f"needs only input_ids and attention_mask; else use mode='after_prefill' or 'decoding'")


def _blocks_but_the_last(model, input_ids, cache, attention_mask, block_size: int, forward_tokens: int,
                         generate_kwargs: dict, args: tuple = ()) -> None:
    """Block-wise mode before ``model.generate``: feed every block of the prompt but the last (each row's blocks
    from its first real token, ``forward_tokens`` per forward); ``model.generate`` then prefills the last one. With
    several sequences per prompt (``num_return_sequences``, ``num_beams``: ``model.generate`` repeats the prompt's
    rows, not a cache's) the cache's rows are repeated alike."""
    blocks = _row_blocks(attention_mask, 0, input_ids.shape[1], block_size)
    if len(blocks) > 1:
        _feed(model, input_ids, cache, attention_mask, 0, blocks[:-1], forward_tokens=forward_tokens)
        repeats = max(_setting(model, args, generate_kwargs, "num_beams") or 1,
                      _setting(model, args, generate_kwargs, "num_return_sequences") or 1)
        if repeats > 1:  # as transformers expands the prompt's rows: max(num_beams, num_return_sequences)
            cache.batch_repeat_interleave(repeats)


@torch.no_grad()
def decode(model, cache, logits, max_new_tokens: int, *, attention_mask=None, eos_token_id=None, progress=None):
    """Greedy decoding from a prefilled ``cache`` (ours, or any transformers cache) given the last logits
    ``[B, V]`` (or ``prefill``'s ``[B, T, V]``, whose last position is read): returns the new token ids
    ``[B, <= max_new_tokens]``. RoPE positions continue from the tokens seen; with the prompt's ``attention_mask``
    ``[B, T]`` (a left-padded batch) from each row's real tokens."""
    check_int("max_new_tokens", max_new_tokens, 1)
    if not isinstance(logits, torch.Tensor) or logits.dim() not in (2, 3):
        raise ValueError(f"logits must be the last logits [B, V] (or prefill's [B, T, V]), got "
                         f"{tuple(getattr(logits, 'shape', ())) or type(logits).__name__}")
    if logits.dim() == 3:
        logits = logits[:, -1]
    B = logits.shape[0]
    real = None if attention_mask is None else attention_mask.long().sum(-1, keepdim=True).to(logits.device)
    out = []
    with use_tritonkv(model) if isinstance(cache, TritonKVCache) else contextlib.nullcontext():
        for i in range(max_new_tokens):
            nxt = logits.argmax(-1, keepdim=True)
            out.append(nxt)
            if progress is not None:
                progress(1)
            if i == max_new_tokens - 1 or (eos_token_id is not None and bool((nxt == eos_token_id).all())):
                break
            if real is None:
                pos = torch.full((B, 1), int(cache.get_seq_length()), dtype=torch.long, device=nxt.device)
            else:
                pos = real + i
            if attention_mask is not None:  # caches other than ours read the pads from it
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=1)
            logits = model(input_ids=nxt, position_ids=pos, attention_mask=attention_mask, use_cache=True,
                           **{cache_kwarg(model): cache}).logits[:, -1]
    return torch.cat(out, dim=1)


@contextlib.contextmanager
def compressing(model, policy, budget=_REQUIRED, *, mode: str = "after_prefill", allocation=None,
                block_size: int = 128, decode_every: Optional[int] = None, forward_tokens: int = FORWARD_TOKENS,
                **cache_kwargs):
    """kvpress's ``with press(model): model.generate(...)``: inside the block, every ``model.generate`` call that
    passes no cache of its own gets a fresh ``TritonKVCache`` (``policy``, ``budget`` as a fraction of that call's
    prompt, ``mode``, ``allocation``) and the ``"tritonkv"`` attention function; in blockwise mode every block of
    the prompt but the last is fed first, as ``generate`` feeds it (each row of a left-padded batch from its first
    real token, up to ``forward_tokens`` per forward). A caller's own cache, passed as ``past_key_values`` or
    ``cache``, is used as it is and handed on under the keyword the installed transformers takes
    (``cache_kwarg``). The model's ``generate`` and attention implementation are restored on exit.

        with compressing(model, "snapkv", 0.25, allocation="adakv"):
            out = model.generate(input_ids, max_new_tokens=64)
    """
    check_int("forward_tokens", forward_tokens, 1)
    _check_budget("compressing", budget, cache_kwargs)
    make_cache(model, policy, budget, mode=mode, allocation=allocation, block_size=block_size,
               decode_every=decode_every, **cache_kwargs)  # argument checks now, not at the first call
    stock = model.generate
    had_own = "generate" in vars(model)  # an enclosing ``compressing`` block's: restored on exit

    def generate_compressed(inputs=None, *args, **kwargs):
        if inputs is None:  # the prompt under model.generate's other name for it
            inputs = kwargs.pop("input_ids", None)
        input_ids = inputs
        # a caller's own cache, under either name, is kept and handed on under the name this transformers takes
        own = [kwargs.pop(k) for k in ("past_key_values", "cache") if kwargs.get(k) is not None]
        if len(own) > 1:
            raise ValueError("pass one cache to generate: past_key_values or cache, not both")
        if own:
            kwargs[cache_kwarg(model)] = own[0]
        elif input_ids is not None or kwargs.get("inputs_embeds") is not None:  # the prompt as ids or embeddings
            _check_use_cache(model, args, kwargs)
            prompt = input_ids if input_ids is not None else kwargs["inputs_embeds"]
            cache = kwargs[cache_kwarg(model)] = make_cache(
                model, policy, budget, mode=mode, allocation=allocation, block_size=block_size,
                decode_every=decode_every, prompt_length=prompt.shape[1], **cache_kwargs)
            if mode == "blockwise":
                _prompt_tensors_only_in_ids(kwargs)  # embeddings alone: a ValueError
                if kwargs.get("attention_mask") is None:
                    kwargs["attention_mask"] = torch.ones_like(input_ids)
                _blocks_but_the_last(model, input_ids, cache, kwargs["attention_mask"], block_size, forward_tokens,
                                     kwargs, args)
        return stock(inputs, *args, **kwargs)

    model.generate = generate_compressed
    try:
        with use_tritonkv(model):
            yield model
    finally:
        if had_own:
            model.generate = stock  # the enclosing block's
        else:
            del model.generate  # back to the class's method


@torch.no_grad()
def answer(model, context_ids, questions, *, policy, budget, max_new_tokens: int = 32, allocation=None,
           mode: str = "after_prefill", block_size: int = 128, eos_token_id=None, **cache_kwargs):
    """kvpress's context/question pattern: compress a long ``context_ids`` ``[1, N]`` once, without seeing any
    question, then answer each question (token ids ``[1, T_q]``) greedily from a copy of the compressed cache
    (the question's tokens are not evicted). ``budget`` is tokens per head (int) or a fraction of the context
    (float). Returns one tensor of new token ids ``[1, <= max_new_tokens]`` per question. With a budget >= N the
    answers equal greedy decoding of context + question with the full cache."""
    _check_ids("context_ids", context_ids, batch=1)
    if not isinstance(questions, (list, tuple)):
        if isinstance(questions, torch.Tensor) and questions.dim() == 2 and questions.shape[0] > 1:
            raise ValueError(f"questions must be one [1, T_q] tensor or a list of them, got a "
                             f"{tuple(questions.shape)} tensor (several questions: list(questions.split(1)))")
        questions = [questions]
    for i, q in enumerate(questions):
        _check_ids(f"questions[{i}]", q, batch=1)
    cache = make_cache(model, policy, budget, mode=mode, allocation=allocation, block_size=block_size,
                       prompt_length=context_ids.shape[1], **cache_kwargs)
    prefill(model, context_ids, cache)
    cache.freeze()  # the context is compressed; questions and answers are kept whole
    answers = []
    for q in questions:
        c = copy.deepcopy(cache)
        logits = prefill(model, q.to(context_ids.device), c, block_size=q.shape[1])[:, -1]
        answers.append(decode(model, c, logits, max_new_tokens, eos_token_id=eos_token_id))
    return answers
