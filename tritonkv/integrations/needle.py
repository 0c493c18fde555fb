"""Needle-in-a-haystack cases scored by likelihood (``docs/architecture.md``, "The real model and the needle
check").

A case is a haystack of public-domain text cut on token boundaries, with the needle
"The pass key is {k}. Remember it. {k} is the pass key." inserted at a depth, followed by the
question "What is the pass key? The pass key is". It is scored by ranking the true key against 9
distractor 5-digit keys by the summed log-probability of their tokens given the prompt; the true
key ranking first is a pass. The prompt goes through a caller-supplied *prefill function*, which is
how a compression mode plugs in::

    model, tok = load_smollm2()
    case = build_case(tok, 1024, depth=0.5, seed=0)
    result = rank_candidates(model, full_prefill, case)      # result.top1 -> True

``build_case(..., subject="apple")`` words the fact and the question for a subject ("The pass key for the
apple is ..."; ``NEEDLE_FOR``/``QUESTION_FOR``): the wording SmolLM2 also answers greedily with the key on
real prose, which the demo uses. ``rank_candidates(..., batched=True)`` scores the 10 candidates in one
forward.

The haystack is the King James Bible from Debian's ``bible-kjv`` (the ``bible`` CLI), or, when that
is not installed, the classic synthetic pass-key filler.
"""
from __future__ import annotations

import copy
import functools
import random
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

NEEDLE = "The pass key is {k}. Remember it. {k} is the pass key."
QUESTION = "What is the pass key? The pass key is"
# the same fact and question naming what the key is for (``build_case(..., subject=...)``): SmolLM2's greedy answer
# then states the key on real prose as well, where with NEEDLE/QUESTION it often paraphrases ("a key that is used
# to ..."); the likelihood rank is unaffected. The wording of benchmarks/evaluate.py's needle task.
NEEDLE_FOR = "The pass key for the {s} is {k}. Remember it. {k} is the pass key for the {s}."
QUESTION_FOR = "What is the pass key for the {s}? The pass key for the {s} is"
SUBJECTS = ("apple", "river", "violin", "lantern", "garden", "rocket", "castle", "harbor", "meadow", "walnut")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
N_CANDIDATES = 10
KJV_RANGE = "gen1:1-rev22:21"


def _parse_kjv(raw: str) -> str:
    """The ``bible`` CLI output as one line of verses: chapter headers dropped, wrapped lines joined,
    verse numbers stripped."""
    verses: List[str] = []
    lines = raw.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^\s+\d+ (.*)$", line)
        if m:
            verses.append(m.group(1).strip())
        elif not line.strip():
            continue
        elif i + 1 < len(lines) and not lines[i + 1].strip():
            continue  # a chapter header ("Genesis 1") is followed by a blank line
        elif verses:
            verses[-1] += " " + line.strip()
    return " ".join(verses)


@functools.lru_cache(maxsize=None)
def _kjv_text() -> Optional[str]:
    exe = shutil.which("bible")
    if exe is None:
        return None
    out = subprocess.run([exe, KJV_RANGE], capture_output=True, text=True, check=True).stdout
    text = _parse_kjv(out)
    return text if len(text) > 100_000 else None


def install_kjv() -> bool:
    """Try ``apt-get install -y bible-kjv`` (then with ``sudo -n``); True when the CLI is then found."""
    for cmd in (["apt-get", "install", "-y", "-q", "bible-kjv"], ["sudo", "-n", "apt-get", "install", "-y", "-q", "bible-kjv"]):
        if shutil.which("bible"):
            break
        try:
            subprocess.run(cmd, capture_output=True, check=False, timeout=600)
        except (OSError, subprocess.TimeoutExpired):
            pass
    _kjv_text.cache_clear()
    return shutil.which("bible") is not None


def haystack_text(source: str = "auto", install: bool = False, min_chars: int = 200_000) -> str:
    """Long filler text.

    ``source``: ``"kjv"`` (the King James Bible via the ``bible`` CLI; ValueError if unavailable),
    ``"synthetic"`` (the pass-key filler repeated to ``min_chars``), or ``"auto"`` (KJV when the CLI is
    installed, else synthetic). ``install=True`` first tries ``apt-get install -y bible-kjv`` when the
    CLI is missing (only do this where asked, e.g. the demo)."""
    if source not in ("auto", "kjv", "synthetic"):
        raise ValueError(f"source must be 'auto', 'kjv' or 'synthetic', got {source!r}")
    if source != "synthetic":
        if install and shutil.which("bible") is None:
            install_kjv()
        text = _kjv_text()
        if text is not None:
            return text
        if source == "kjv":
            raise ValueError("source='kjv' needs the `bible` CLI (apt-get install bible-kjv)")
    reps = -(-min_chars // (len(FILLER) + 1))
    return " ".join([FILLER] * reps)


def haystack_source(source: str = "auto") -> str:
    """Which text ``haystack_text(source)`` gives: ``"kjv"`` or ``"synthetic"``."""
    if source == "auto":
        return "kjv" if _kjv_text() is not None else "synthetic"
    return source


@dataclass
class NeedleCase:
    """One needle test. ``input_ids`` int64 ``[1, T]`` is the whole prompt (haystack with the needle,
    then the question); ``needle_positions`` int64 ``[n]`` are the needle's token positions in it;
    ``candidates`` are 10 five-digit keys (the true one at ``answer``) and ``candidate_ids`` their
    token ids (``" " + digits``)."""

    input_ids: torch.Tensor
    needle_positions: torch.Tensor
    key: str
    candidates: List[str]
    candidate_ids: List[List[int]]
    answer: int
    depth: float
    seed: int
    source: str = "synthetic"
    question_start: int = 0

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]


def _encode(tok, text: str) -> List[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _keys(rng: random.Random, n: int) -> List[str]:
    keys: List[str] = []
    while len(keys) < n:
        k = str(rng.randint(10000, 99999))
        if k not in keys:
            keys.append(k)
    return keys


def build_case(tok, n_tokens: int, depth: float, seed: int = 0, *, source: str = "auto",
               text: Optional[str] = None, subject: Optional[str] = None) -> NeedleCase:
    """A needle case of exactly ``n_tokens`` prompt tokens.

    The haystack is a window of the text starting at a seeded random offset, tokenised
    (``add_special_tokens=False``) and cut to ``n_tokens`` minus the needle and the question; the
    needle is inserted after haystack token ``round(depth * n_haystack)``. The true key and 9
    distinct distractors are drawn from ``random.Random(seed)``; the true key's slot among the
    candidates is seeded too. ``text`` overrides ``haystack_text(source)``. ``subject`` (e.g. ``"apple"``)
    words the needle and question with ``NEEDLE_FOR``/``QUESTION_FOR`` ("the pass key for the apple"), which the
    model answers greedily with the key; the random draws (keys, cut, candidate order) do not depend on it."""
    if not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed)
    keys = _keys(rng, N_CANDIDATES)
    key = keys[0]
    if subject is None:
        needle = _encode(tok, " " + NEEDLE.format(k=key))
        question = _encode(tok, "\n" + QUESTION)
    else:
        needle = _encode(tok, " " + NEEDLE_FOR.format(k=key, s=subject))
        question = _encode(tok, "\n" + QUESTION_FOR.format(s=subject))
    n_hay = int(n_tokens) - len(needle) - len(question)
    if n_hay < 1:
        raise ValueError(f"n_tokens must exceed the needle and question ({len(needle) + len(question)} tokens), got {n_tokens}")
    custom = text is not None
    text = text if custom else haystack_text(source)
    span = n_hay * 8 + 64  # characters: ample for n_hay tokens (~3.6 characters per token)
    if len(text) < span:
        text = " ".join([text] * (-(-span // max(len(text), 1)) + 1))
    start = rng.randrange(0, len(text) - span + 1)
    # begin at a word boundary, so the first token is a whole word
    sp = text.find(" ", start)
    start = sp + 1 if 0 <= sp < start + 64 else start
    hay = _encode(tok, text[start:start + span])
    while len(hay) < n_hay:  # only for pathological texts
        hay = hay + hay
    hay = hay[:n_hay]
    at = int(round(float(depth) * n_hay))
    ids = hay[:at] + needle + hay[at:] + question
    order = list(range(N_CANDIDATES))
    rng.shuffle(order)  # candidates[i] = keys[order[i]]; the true key is keys[0]
    candidates = [keys[j] for j in order]
    return NeedleCase(
        input_ids=torch.tensor([ids], dtype=torch.long),
        needle_positions=torch.arange(at, at + len(needle), dtype=torch.long),
        key=key, candidates=candidates,
        candidate_ids=[_encode(tok, " " + c) for c in candidates],
        answer=order.index(0), depth=float(depth), seed=int(seed),
        source="custom" if custom else haystack_source(source),
        question_start=len(ids) - len(question),
    )


PrefillFn = Callable[[torch.nn.Module, torch.Tensor], Tuple[torch.Tensor, object]]


@torch.no_grad()
def full_prefill(model, input_ids: torch.Tensor):
    """The reference prefill: the whole prompt, full cache. Returns ``(last logits [B, V], cache)``."""
    from .transformers import output_cache

    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1], output_cache(out)


def drop_positions_prefill(positions) -> PrefillFn:
    """A prefill that removes the given token positions from the prompt before running it: the
    needle-removed control (a "cache" that lost exactly those tokens)."""
    drop = torch.as_tensor(positions, dtype=torch.long)

    def prefill(model, input_ids):
        keep = torch.ones(input_ids.shape[1], dtype=torch.bool)
        keep[drop] = False
        return full_prefill(model, input_ids[:, keep.to(input_ids.device)])

    return prefill


@dataclass
class RankResult:
    """Summed log-probabilities of the candidates (``scores[i]`` for ``case.candidates[i]``)."""

    scores: List[float]
    answer: int
    rank: int = field(init=False)  # 0 = the true key scored highest (ties count against it)

    def __post_init__(self):
        s = self.scores[self.answer]
        self.rank = sum(1 for i, x in enumerate(self.scores) if i != self.answer and x >= s)

    @property
    def top1(self) -> bool:
        return self.rank == 0


@torch.no_grad()
def rank_candidates(model, prefill_fn: PrefillFn, case: NeedleCase, *, batched: bool = False) -> RankResult:
    """Prefill ``case.input_ids`` once with ``prefill_fn(model, input_ids) -> (logits, cache)`` (the
    last position's logits ``[1, V]`` or ``[1, T, V]``, and the resulting cache), then score every
    candidate on a deep copy of the cache. The cache's ``get_seq_length()`` must count tokens seen,
    so the candidates get their true RoPE positions.

    ``batched=True`` scores all candidates in one forward over one copy of the cache expanded along the
    batch (``cache.batch_repeat_interleave``; shorter candidates are padded at their end, which no scored
    token attends to): one forward instead of one per candidate, the same scores up to float round-off.
    Caches that cannot be expanded (per-head ragged rows) fall back to a copy per candidate."""
    dev = next(model.parameters()).device
    from .transformers import cache_kwarg

    kw = cache_kwarg(model)
    logits, cache = prefill_fn(model, case.input_ids.to(dev))
    if logits.dim() == 3:
        logits = logits[:, -1]
    first = torch.log_softmax(logits[0].float(), -1)
    scores = [float(first[ids[0]]) for ids in case.candidate_ids]
    longest = max(len(ids) for ids in case.candidate_ids)
    if longest == 1:
        return RankResult(scores=scores, answer=case.answer)
    if batched and _expandable(cache):
        c = copy.deepcopy(cache)
        c.batch_repeat_interleave(len(case.candidate_ids))
        rows = [ids[:-1] + [ids[-1]] * (longest - len(ids)) for ids in case.candidate_ids]
        out = model(input_ids=torch.tensor(rows, dtype=torch.long, device=dev), use_cache=True, **{kw: c})
        lp = torch.log_softmax(out.logits.float(), -1)
        for i, ids in enumerate(case.candidate_ids):
            n = len(ids) - 1
            scores[i] += float(lp[i, torch.arange(n, device=dev), torch.tensor(ids[1:], device=dev)].sum())
        return RankResult(scores=scores, answer=case.answer)
    for i, ids in enumerate(case.candidate_ids):
        if len(ids) > 1:
            c = copy.deepcopy(cache)
            x = torch.tensor([ids[:-1]], dtype=torch.long, device=dev)
            out = model(input_ids=x, use_cache=True, **{kw: c})
            lp = torch.log_softmax(out.logits[0].float(), -1)
            scores[i] += float(lp[torch.arange(len(ids) - 1, device=dev), torch.tensor(ids[1:], device=dev)].sum())
    return RankResult(scores=scores, answer=case.answer)


def _expandable(cache) -> bool:
    """Whether ``cache`` can be expanded along the batch for batched scoring."""
    if not hasattr(cache, "batch_repeat_interleave"):
        return False
    return not any(getattr(getattr(layer, "store", None), "ragged", False) for layer in getattr(cache, "layers", []))
