"""The seeds' claims tested with their own metrics, at their budgets, paired over cases.

    OMP_NUM_THREADS=2 python -m benchmarks.evaluate --tasks mk_needle --contexts 2048 --seeds 0-49 --groups keydiff
    python -m benchmarks.evaluate_report       # summaries, claims, plots

SmolLM2-135M-Instruct on the CPU; per-case records in ``benchmarks/results/quality/<task>-<context>.jsonl.gz``. The
tasks, metrics, settings and how one forward serves every configuration: docs/benchmarks.md ("The quality
benchmark: method").
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib.util
import itertools
import math
import os
import pathlib
import platform
import random
import re
import shutil
import sys
import time
from typing import ClassVar, Dict, List, Sequence, Tuple

import torch

import tritonkv
from benchmarks.common import RESULTS, append_jsonl, git, jsonl_files, now, read_jsonl
from tritonkv.integrations.model import load_smollm2
from tritonkv.integrations.needle import FILLER, NEEDLE_FOR, QUESTION_FOR, _encode as _enc, _keys, _kjv_text
from tritonkv.allocation import get_allocator, head_means_from_queries, sample_positions
from tritonkv.integrations.transformers import cache_kwarg, make_cache, output_cache, prefill, use_tritonkv
from tritonkv.policies import POLICIES, KeyDiff, Policy, get_policy

OUT = os.path.join(RESULTS, "quality")
Q_WINDOW = 32
BLOCK = 128
CONT = 64  # continuation tokens of the lm task
TASKS = ("needle", "mk_needle", "vt1", "vt2", "cwe", "lm")
CWE_SHARE = 0.3  # the common word's share of the list
N_KEYS = {"needle": 1, "mk_needle": 4}  # facts per needle case (one asked, the others distractors)

# ------------------------------------------------------------------------------------------------
# text sources

LICENSES = "/usr/share/common-licenses"


@functools.lru_cache(maxsize=None)
def source_text(name: str) -> str:
    """Long text for haystacks and the lm task (whitespace-normalised)."""
    if name == "synthetic":
        return " ".join([FILLER] * 4000)
    if name == "licenses":
        files = [os.path.join(LICENSES, f) for f in sorted(os.listdir(LICENSES))]
        return re.sub(r"\s+", " ", " ".join(pathlib.Path(p).read_text(errors="replace") for p in files
                                            if os.path.isfile(p) and not os.path.islink(p)))
    if name == "pydoc":
        import pydoc_data.topics as t
        return re.sub(r"\s+", " ", " ".join(t.topics[k] for k in sorted(t.topics)))
    if name == "kjv":
        text = _kjv_text()
        if text is None:
            raise ValueError("kjv needs Debian's bible-kjv (the `bible` CLI)")
        return text
    raise ValueError(f"unknown source {name!r}")


def available_sources() -> List[str]:
    """The haystack sources this machine has (``synthetic`` always)."""
    found = dict(synthetic=True, licenses=os.path.isdir(LICENSES),
                 pydoc=importlib.util.find_spec("pydoc_data") is not None, kjv=shutil.which("bible") is not None)
    return [name for name, ok in found.items() if ok]


WORDS = ("apple river candle mountain pencil garden window rocket violin turtle anchor basket castle dragon "
         "engine forest guitar harbor island jacket kettle lantern magnet needle orange parrot quartz ribbon "
         "saddle tiger umbrella valley walnut yacht zebra bridge cactus dolphin feather glacier hammer igloo "
         "jungle koala ladder meadow nickel oyster pepper rabbit salmon tomato velvet wagon badger cherry "
         "donkey falcon ginger hornet insect jaguar lemon mango napkin olive panda quiver raven spider tulip "
         "walrus copper marble silver timber canyon desert lagoon prairie summit tunnel button pillow mirror "
         "carpet bottle blanket bucket candy cookie cotton diamond eagle goose honey lizard lobster monkey "
         "muffin onion peanut pickle pigeon planet potato pumpkin puzzle rocket saucer shovel spoon squirrel "
         "stapler sugar sweater teapot thunder toaster trumpet turnip violet whistle wizard").split()
WORDS = list(dict.fromkeys(WORDS))


# ------------------------------------------------------------------------------------------------
# cases


@dataclasses.dataclass
class Case:
    task: str
    seed: int
    source: str
    context: int
    ctx_ids: List[int]  # the context (compressed before the question in the agnostic setting)
    q_ids: List[int]  # the question (empty for lm)
    cands: List[List[int]] = dataclasses.field(default_factory=list)
    answer: int = 0
    cont_ids: List[int] = dataclasses.field(default_factory=list)  # lm: the held-out continuation

    @property
    def prompt(self) -> List[int]:
        return self.ctx_ids + self.q_ids

    @property
    def key(self) -> Tuple:
        return (self.task, self.seed, self.source, self.context)


def _hay(tok, source: str, n: int, rng: random.Random) -> List[int]:
    """``n`` tokens of ``source`` from a seeded offset (starting at a word boundary)."""
    text = source_text(source)
    span = n * 6 + 200
    if len(text) < span + 1:
        text = " ".join([text] * (span // max(len(text), 1) + 2))
    start = rng.randrange(0, len(text) - span)
    sp = text.find(" ", start)
    start = sp + 1 if 0 <= sp < start + 64 else start
    ids = _enc(tok, text[start:start + span])
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def _insert(hay: List[int], pieces: List[List[int]], depths: List[float]) -> List[int]:
    """``hay`` with ``pieces`` inserted at the given depths (sorted, in order)."""
    at = sorted(int(round(d * len(hay))) for d in depths)
    out, prev = [], 0
    for a, p in zip(at, pieces):
        out += hay[prev:a] + p
        prev = a
    return out + hay[prev:]


def _choice(tok, answer: str, distractors: List[str], rng: random.Random) -> Tuple[List[List[int]], int]:
    """The answer and the first 9 distractors in a seeded order: (their token ids, the answer's index)."""
    texts = [answer] + distractors[:9]
    order = list(range(len(texts)))
    rng.shuffle(order)
    return [_enc(tok, " " + texts[i]) for i in order], order.index(0)


def build_case(tok, task: str, context: int, seed: int, source: str = "synthetic") -> Case:
    """One case of ``task`` whose prompt (context + question) is exactly ``context`` tokens."""
    rng = random.Random(f"{task}/{context}/{source}/{seed}")
    if task == "lm":
        ids = _hay(tok, source, context + CONT, rng)
        return Case(task, seed, source, context, ids[:context], [], cont_ids=ids[context:])
    if task in N_KEYS:
        n_keys = N_KEYS[task]
        words = rng.sample(WORDS, n_keys)
        keys = _keys(rng, 10)
        facts = [_enc(tok, " " + NEEDLE_FOR.format(s=w, k=k)) for w, k in zip(words, keys[:n_keys])]
        ask = rng.randrange(n_keys)
        q = _enc(tok, "\n" + QUESTION_FOR.format(s=words[ask]))
        n_hay = context - len(q) - sum(map(len, facts))
        depths = [rng.uniform(0.05, 0.95) for _ in facts]
        order = list(range(n_keys))
        rng.shuffle(order)  # which fact goes where
        ctx = _insert(_hay(tok, source, n_hay, rng), [facts[i] for i in order], depths)
        answer, others = keys[ask], [k for i, k in enumerate(keys) if i != ask]
    elif task in ("vt1", "vt2"):
        hops = int(task[2])
        names: List[str] = []
        while len(names) < 3 * (hops + 1):
            nm = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
            if nm not in names:
                names.append(nm)
        vals = _keys(rng, 10)
        chains = [names[c * (hops + 1):(c + 1) * (hops + 1)] for c in range(3)]
        stmts = [_enc(tok, f" VAR {ch[j]} = {f'VAR {ch[j - 1]}' if j else vals[c]}.")
                 for c, ch in enumerate(chains) for j in range(hops + 1)]
        ask = rng.randrange(3)
        q = _enc(tok, f"\nWhat is the value of VAR {chains[ask][-1]}? The value of VAR {chains[ask][-1]} is")
        n_hay = context - len(q) - sum(map(len, stmts))
        # each chain's statements in order, chains interleaved at random depths
        depths = sorted(rng.uniform(0.05, 0.95) for _ in stmts)
        seq = [c for c in range(3) for _ in range(hops + 1)]
        rng.shuffle(seq)
        chain_stmts = [iter(stmts[c * (hops + 1):(c + 1) * (hops + 1)]) for c in range(3)]
        ctx = _insert(_hay(tok, source, n_hay, rng), [next(chain_stmts[c]) for c in seq], depths)
        answer, others = vals[ask], [v for i, v in enumerate(vals) if i != ask]
    elif task == "cwe":
        words = rng.sample(WORDS, 60)
        answer, rest = words[0], words[1:]
        head = _enc(tok, "Below is a numbered list of words. Some words appear several times.\n")
        q = _enc(tok, "\nQuestion: What is the most common word in the list above?\nAnswer: The most common word is")
        ctx, lst = list(head), []
        n_ctx = context - len(q)
        while True:
            w = answer if rng.random() < CWE_SHARE else rng.choice(rest)
            piece = _enc(tok, f"{len(lst) + 1}. {w}\n")
            if len(ctx) + len(piece) > n_ctx:
                break
            ctx += piece
            lst.append(w)
        ctx += _enc(tok, "\n" * 40)[: n_ctx - len(ctx)]  # pad to the exact length
        while len(ctx) < n_ctx:
            ctx += _enc(tok, "\n")
        ctx = ctx[:n_ctx]
        others = [w for w in dict.fromkeys(lst) if w != answer]
        rng.shuffle(others)
    else:
        raise ValueError(f"unknown task {task!r}")
    cands, ans = _choice(tok, answer, others, rng)
    return Case(task, seed, source, context, ctx, q, cands, ans)


# ------------------------------------------------------------------------------------------------
# configurations


@dataclasses.dataclass(frozen=True)
class Config:
    policy: str
    allocation: str = "uniform"
    mode: str = "after_prefill"  # after_prefill | blockwise | lagkv (recursive LagKV, paper mode)
    setting: str = "aware"  # aware | agnostic (context compressed before the question)
    budget: float = 1.0  # int tokens per head, or a fraction (of the compressed prefix; LagKV: the ratio r)

    @property
    def size(self):
        """The budget as ``compress`` and ``make_cache`` take it: tokens per head (int) or a fraction (float)."""
        return int(self.budget) if self.budget > 1 else float(self.budget)

    @property
    def name(self) -> str:
        return f"{self.policy}|{self.allocation}|{self.mode}|{self.setting}|{self.size}"


PAPER_PROFILE = "smollm2-135m-instruct-infsc-paper"  # tritonkv/data/<name>.json: the paper's 6 x 33 grid
FULL = Config("full", "uniform", "full", "aware", 1.0)

# the claims' cells at the papers' budgets, one group per claim (what each holds and why: docs/benchmarks.md)
GROUPS: Dict[str, List[Config]] = {
    "criticalkv": [Config(p, a, "after_prefill", "agnostic", b) for b in (0.2, 0.4)
                   for a in ("uniform", "adakv") for p in ("snapkv", "criticalkv")],
    "keydiff": [Config(p, "uniform", "blockwise", "aware", b) for b in (128, 64, 512)
                for p in ("keydiff", "tova", "snapkv", "streaming_llm")],
    "lagkv": [Config(p, "uniform", "lagkv", "aware", r) for p in ("lagkv", "lagkv_l512", "lagkv_l1024")
              for r in (0.5, 0.25)],
    "allocation": [Config(p, a, "after_prefill", "aware", b) for b in (128, 64)
                   for p, a in (("snapkv", "uniform"), ("snapkv", "pyramid"), ("snapkv", "adakv"),
                                ("snapkv", "score"), ("score", "score"), ("snapkv", "surfacelogic"),
                                ("surfacelogic", "surfacelogic"), ("snapkv_k1", "uniform"))],
    "compose": [Config(p, a, "blockwise", "aware", 64)
                for p, a in (("keydiff_critical", "surfacelogic"), ("keydiff_critical", "uniform"),
                             ("keydiff", "surfacelogic"), ("criticalkv", "uniform"), ("snapkv", "surfacelogic"),
                             ("surfacelogic", "surfacelogic"))],
    "profile": ([Config(p, "surfacelogic_paper", "after_prefill", "aware", b) for b in (128, 64)
                 for p in ("snapkv", "surfacelogic")]
                + [Config("keydiff_critical", "surfacelogic_paper", "blockwise", "aware", 64)]),
}


class LayerInputs(Policy):
    """``base`` with per-layer inputs (W_O for CriticalKV, HD for SCORE's selection) picked by the ``layer`` input
    that ``compress`` receives: ``TritonKVCache`` hands every layer the same ``**inputs``, and these differ by
    layer."""

    def __init__(self, base: Policy, per_layer: Dict[str, Sequence[torch.Tensor]]):
        self.base, self.per_layer = base, per_layer
        self.name = base.name
        self.needs = tuple(n for n in base.needs if n not in per_layer)
        self.sink, self.window = base.sink, base.window
        self.q_window = getattr(base, "q_window", None) or base.window

    def _with(self, inputs):
        layer = int(inputs["layer"])
        return {**inputs, **{n: v[layer] for n, v in self.per_layer.items()}}

    def protected(self, n, budget):
        return self.base.protected(n, budget)

    def score(self, keys, values, **inputs):
        return self.base.score(keys, values, **self._with(inputs))

    def select(self, *args, **inputs):
        return self.base.select(*args, **self._with(inputs))


# ------------------------------------------------------------------------------------------------
# the model side


class LayerOutputs:
    """Context manager: each layer's attention output (``o_proj``'s output) and the last layer's hidden state (the
    final norm's input) at the last position of every forward inside it, fp32 ``[D_model]`` (the last forward's);
    with ``q_rows``, each layer's queries at those positions too (RoPE applied), ``[1, H_q, len(q_rows), D]``."""

    def __init__(self, model, q_rows: Sequence[int] = ()):
        self.model, self.attn, self.hidden, self.hooks = model, {}, None, []
        self.rows, self.queries = torch.as_tensor(list(q_rows), dtype=torch.long), {}

    def __enter__(self):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        for i, layer in enumerate(self.model.model.layers):
            def hook(mod, args, out, i=i):
                self.attn[i] = out[0, -1].detach().to(torch.float32, copy=True)  # no view of [B, T, D]

            def q_hook(mod, args, kwargs, i=i):
                h = kwargs.get("hidden_states", args[0] if args else None)
                cos, sin = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
                q = mod.q_proj(h[:, self.rows]).view(1, len(self.rows), -1, mod.head_dim).transpose(1, 2)
                self.queries[i] = apply_rotary_pos_emb(q, q, cos[:, self.rows], sin[:, self.rows])[0]
            self.hooks.append(layer.self_attn.o_proj.register_forward_hook(hook))
            if len(self.rows):
                self.hooks.append(layer.self_attn.register_forward_pre_hook(q_hook, with_kwargs=True))

        def norm_hook(mod, args):
            self.hidden = args[0][0, -1].detach().to(torch.float32, copy=True)
        self.hooks.append(self.model.model.norm.register_forward_pre_hook(norm_hook))
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()

    def errors(self, ref: "LayerOutputs") -> Dict[str, object]:
        """CriticalKV's layer-wise perturbation against ``ref`` (the full cache at the same token): ‖Δ‖₁ of the
        final hidden state (``value``) and of every layer's attention output after W_O (``per_layer``)."""
        per = [float((self.attn[i] - ref.attn[i]).abs().sum()) for i in range(len(ref.attn))]
        return {"value": float((self.hidden - ref.hidden).abs().sum()), "per_layer": [float(f"{x:.5g}") for x in per]}


@torch.no_grad()
def capture(model, ids: List[int], q_rows: Sequence[int]):
    """One full forward of ``ids``: per layer ``(keys, values)`` ``[1, H_kv, N, D]`` (RoPE applied) and the queries
    at ``q_rows`` ``[1, H_q, len(q_rows), D]``, the last position's logits ``[V]`` and its ``LayerOutputs``."""
    with LayerOutputs(model, q_rows) as outs:
        out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    c = output_cache(out)
    kv = [(c.layers[i].keys, c.layers[i].values) for i in range(len(model.model.layers))]
    return kv, outs.queries, out.logits[0, -1].float(), outs


@dataclasses.dataclass
class ShiftedKeyDiff(KeyDiff):
    """KeyDiff's score plus one: 1 − cos(k, anchor) ∈ [0, 2], the same ranking, non-negative as CriticalKV's
    stage-2 product (s + ε)·‖v W_O‖₁ requires of its base."""

    nonnegative: ClassVar[bool] = True

    def score(self, keys, values, **inputs):
        return super().score(keys, values, **inputs) + 1.0


def lagkv_policy(name: str):
    """LagKV for a configuration's policy name: ``lagkv`` (L = 128) or ``lagkv_l<L>``."""
    lag = int(name[len("lagkv_l"):]) if name.startswith("lagkv_l") else 128
    return POLICIES["lagkv"](lag=lag)


def _policy_object(model, cfg: Config, hd=None):
    """The policy for ``cfg`` with its per-layer inputs attached."""
    if cfg.policy == "keydiff_critical":  # the composition: CriticalKV's two stages over KeyDiff's (shifted) scores
        return POLICIES["criticalkv"](base=ShiftedKeyDiff(), alpha=0.5)
    if cfg.policy == "criticalkv":
        wo = [l.self_attn.o_proj.weight.detach() for l in model.model.layers]
        return LayerInputs(get_policy("criticalkv"), {"o_proj": wo})
    if cfg.policy == "score":
        return LayerInputs(get_policy("score"), {"hd": [h for h in hd]})
    if cfg.policy == "full":
        return get_policy("streaming_llm")
    if cfg.policy == "snapkv_k1":
        return dataclasses.replace(get_policy("snapkv"), kernel_size=1)
    return get_policy(cfg.policy)


def _allocation(name: str):
    """The allocator of a configuration's ``allocation`` (None for uniform); ``surfacelogic`` reads the shipped
    default profile (4 lengths × 5 depths), ``surfacelogic_paper`` the one on the paper's grid (6 × 33)."""
    if name == "uniform":
        return None
    if name == "surfacelogic_paper":
        return dataclasses.replace(get_allocator("surfacelogic"), profile_name=PAPER_PROFILE)
    return name


def replay_cache(model, cfg: Config, kv, qwin, n: int, inputs: dict, hd=None):
    """A ``TritonKVCache`` for ``cfg`` that has seen the first ``n`` tokens of the captured forward: every layer is
    fed its captured keys/values (``update``) and its window queries (``after_attention``, which compresses as
    after a forward). ``qwin[l]``: the last ``Q_WINDOW`` queries before token ``n``."""
    if cfg.mode == "lagkv":
        cache = make_cache(model, lagkv_policy(cfg.policy), float(cfg.budget), mode="decoding")
    elif cfg.policy == "full":
        cache = make_cache(model, "streaming_llm", n + 10**6)
    else:
        cache = make_cache(model, _policy_object(model, cfg, hd), cfg.size, mode="after_prefill",
                           allocation=_allocation(cfg.allocation), prompt_length=n, **inputs)
    for l, (k, v) in enumerate(kv):
        cache.update(k[:, :, :n].clone(), v[:, :, :n].clone(), l)
        cache.layers[l].after_attention(qwin[l])
    cache.freeze()
    return cache


@torch.no_grad()
def feed(model, cache, ids: List[int], logits_to_keep: int = 1) -> torch.Tensor:
    """Feed ``ids`` (batch 1) through ``cache`` at their true positions; returns the last logits ``[T', V]``."""
    seen = int(cache.get_seq_length())
    x = torch.tensor([ids])
    with use_tritonkv(model):
        out = model(input_ids=x, position_ids=torch.arange(seen, seen + len(ids))[None], use_cache=True,
                    logits_to_keep=logits_to_keep, **{cache_kwarg(model): cache})
    return out.logits[0].float()


@torch.no_grad()
def score_choices(model, cache, first_logits: torch.Tensor, cands: List[List[int]], greedy_len: int,
                  answer: int, batched: bool = True):
    """``(candidate log-likelihoods, greedy token ids, log-distributions along the true answer [len, V])``.

    One decode loop over ``len(cands) + 1`` rows: row i feeds candidate i teacher-forced, the last row its own
    argmax (greedy); the first answer position's logits are ``first_logits`` (shared)."""
    lp0 = torch.log_softmax(first_logits.float(), -1)
    n = len(cands)
    steps = max(max(len(c) for c in cands), greedy_len) - 1
    scores = [float(lp0[c[0]]) for c in cands]
    greedy = [int(first_logits.argmax())]
    true_d = [lp0]
    seen = int(cache.get_seq_length())
    if not batched:  # LagKV's recursive state: one copy per row
        for i, c in enumerate(cands):
            if len(c) > 1:
                lp = torch.log_softmax(feed(model, copy.deepcopy(cache), c[:-1], logits_to_keep=0), -1)
                scores[i] += float(lp[torch.arange(len(c) - 1), torch.tensor(c[1:])].sum())
                if i == answer:
                    true_d += list(lp)
        g = copy.deepcopy(cache)
        for _ in range(greedy_len - 1):
            greedy.append(int(feed(model, g, [greedy[-1]])[-1].argmax()))
        return scores, greedy, torch.stack(true_d)
    # per-head (ragged) layers become padded working views (what a prefill block over them does): batch-expandable
    for layer in cache.layers:
        if getattr(layer, "store", None) is not None and layer.store.ragged:
            layer.store = layer.store.to_dense()
            layer.has_invalid = True
    cache.batch_repeat_interleave(n + 1)
    with use_tritonkv(model):
        for t in range(1, steps + 1):
            inp = [c[t - 1] if t - 1 < len(c) else c[-1] for c in cands] + [greedy[-1]]
            out = model(input_ids=torch.tensor(inp)[:, None], position_ids=torch.full((n + 1, 1), seen + t - 1),
                        use_cache=True, **{cache_kwarg(model): cache})
            lp = torch.log_softmax(out.logits[:, -1].float(), -1)
            for i, c in enumerate(cands):
                if t < len(c):
                    scores[i] += float(lp[i, c[t]])
            if t < len(cands[answer]):
                true_d.append(lp[answer])
            greedy.append(int(lp[n].argmax()))
    return scores, greedy[:greedy_len], torch.stack(true_d)


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    """Mean over rows of KL(p ‖ q) from log-probabilities."""
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


def accuracies(tok, case: Case, scores: List[float], greedy: List[int]) -> Dict[str, int]:
    """``acc_ll``: the true answer's log-likelihood ranks strictly first; ``acc_greedy``: the greedy answer starts
    with the true one (the whole word)."""
    g, a = tok.decode(greedy).strip(), tok.decode(case.cands[case.answer]).strip()
    return {"acc_ll": int(all(scores[case.answer] > s for i, s in enumerate(scores) if i != case.answer)),
            "acc_greedy": int(g.startswith(a) and (len(g) == len(a) or not g[len(a)].isalnum()))}


# ------------------------------------------------------------------------------------------------
# attention-output error after W_O (CriticalKV's metric)


@torch.no_grad()
def wo_errors(model, kv, q_last, qwin_ctx, n_ctx: int, configs: Sequence[Config], inputs: dict) -> Dict[str, list]:
    """Per configuration, ``‖(A − A′)·V·W_Oʰ‖₁`` per (layer, query head) at the query ``q_last[l]``
    ``[1, H_q, 1, D]`` (the prompt's last token) over the whole prompt, A′ with the first ``n_ctx`` tokens
    compressed by the configuration (window: ``qwin_ctx``, the context's last queries) and the question kept."""
    out = {c.name: [] for c in configs}
    for l, (k, v) in enumerate(kv):
        B, H, N, D = k.shape
        q = q_last[l]
        Hq = q.shape[1]
        G = Hq // H
        logits = torch.einsum("bhgd,bhnd->bhgn", q.float().reshape(B, H, G, D), k.float()) / math.sqrt(D)
        a = logits.softmax(-1)
        wo = model.model.layers[l].self_attn.o_proj.weight.detach().float()  # [D_model, H_q·D]
        for cfg in configs:
            res = tritonkv.compress((k[:, :, :n_ctx], v[:, :, :n_ctx]), _policy_object(model, cfg), cfg.size,
                                    allocation=_allocation(cfg.allocation), queries=qwin_ctx[l], layer=l,
                                    num_layers=len(kv), **inputs)
            # kept positions [B, H, k], -1 padding where the heads keep different numbers (a RaggedKV)
            idx = res.indices if isinstance(res, tritonkv.Compressed) else res.to_padded(with_positions=True)[3]
            keep = torch.zeros(B, H, N + 1, dtype=torch.bool)
            keep.scatter_(2, torch.where(idx >= 0, idx, N).to(torch.int64).clamp(max=N), True)
            keep = keep[:, :, :N]
            keep[:, :, n_ctx:] = True
            a2 = logits.masked_fill(~keep[:, :, None], -math.inf).softmax(-1)
            dv = torch.einsum("bhgn,bhnd->bhgd", a - a2, v.float()).reshape(Hq, D)  # (A − A′)V per query head
            err = torch.stack([(wo[:, h * D:(h + 1) * D] @ dv[h]).abs().sum() for h in range(Hq)])
            out[cfg.name].append(err.tolist())
    return out


# ------------------------------------------------------------------------------------------------
# records


class Store:
    """Per-case records as gzip-compressed JSON lines, one file per (task, context), one gzip member per
    (case, configuration) appended; ``done`` says what a rerun may skip. Plain ``.jsonl`` files are read too."""

    def __init__(self, out_dir: str = OUT):
        self.dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        # (case, configuration, metric) recorded; "seconds" is the last line of a complete (case, configuration):
        # a record cut short by a kill lacks it, and that case is measured again
        self.metrics = {(r["task"], r["seed"], r["source"], r["context"], r["config"], r["metric"])
                        for f in jsonl_files(out_dir) for r in read_jsonl(f) if "metric" in r}
        self.commit = git("rev-parse", "--short=10", "HEAD")

    def done(self, case: Case, cfg: Config) -> bool:
        """Whether ``cfg`` was measured on ``case`` with every metric it now records (a metric added later measures
        the configuration again; the index keeps a case's last record): ``layer_err`` for the
        context-compressed-before-the-question configurations of a question task."""
        k = (*case.key, cfg.name)
        need = ["seconds"] + (["layer_err"] if cfg.setting == "agnostic" and case.task != "lm" else [])
        return all((*k, m) in self.metrics for m in need)

    def add(self, case: Case, cfg: Config, metrics: Dict[str, object], seconds: float) -> None:
        path = os.path.join(self.dir, f"{case.task}-{case.context}.jsonl.gz")
        base = dict(task=case.task, seed=case.seed, source=case.source, context=case.context, config=cfg.name,
                    policy=cfg.policy, allocation=cfg.allocation, mode=cfg.mode, setting=cfg.setting,
                    budget=cfg.budget, prompt_tokens=len(case.prompt))
        recs = [dict(base, metric=m, **(v if isinstance(v, dict) else {"value": v})) for m, v in metrics.items()]
        append_jsonl(path, recs + [dict(base, metric="seconds", value=round(seconds, 3), commit=self.commit)])
        self.metrics.update((*case.key, cfg.name, m) for m in [*metrics, "seconds"])


# ------------------------------------------------------------------------------------------------
# one case, every configuration


def compresses(cfg: Config, n: int) -> bool:
    """Whether ``cfg`` evicts anything from an ``n``-token prompt: LagKV compresses a partition only once the next
    L tokens are there (S + 2L tokens), so L = 1024 at 2K is the full cache, not worth measuring."""
    if cfg.mode != "lagkv":
        return True
    pol = lagkv_policy(cfg.policy)
    return pol.sink + 2 * pol.lag <= n


def run_case(model, tok, case: Case, configs: Sequence[Config], store: Store, *, log=print) -> None:
    """Measure ``configs`` (and the full cache) on ``case``; records go to ``store`` as they are measured."""
    todo = [c for c in configs if not store.done(case, c) and compresses(c, len(case.prompt))]
    if not todo and store.done(case, FULL):
        return
    lm = case.task == "lm"
    n_ctx, n_all = len(case.ctx_ids), len(case.prompt)
    t0 = time.time()
    pos = sample_positions(n_all, k=200, window=Q_WINDOW, seed=case.seed)
    rows = sorted(set(range(n_ctx - Q_WINDOW, n_ctx)) | set(range(n_all - Q_WINDOW, n_all)) | set(pos.tolist()))
    kv, qs, last_logits, full_outs = capture(model, case.prompt, rows)
    r_index = {r: i for i, r in enumerate(rows)}
    sel = lambda rr: [qs[l][:, :, [r_index[r] for r in rr]] for l in range(len(kv))]  # noqa: E731 (per layer)
    qwin_all, qwin_ctx = sel(range(n_all - Q_WINDOW, n_all)), sel(range(n_ctx - Q_WINDOW, n_ctx))
    hm = torch.stack([head_means_from_queries(q, kv[l][0], pos) for l, q in enumerate(sel(pos.tolist()))])
    hd = get_allocator("score").hd(hm, kv[0][0].shape[1])  # [L, B, H_kv]
    t_cap = time.time() - t0
    log(f"  capture {t_cap:.1f}s")

    def run_one(cfg: Config):
        """``cfg``'s own metrics (lm: ``ll``; else the accuracies), its log-distributions along the continuation or
        the true answer, and the metrics only a compressed run records."""
        inputs = {"head_means": hm} if cfg.allocation == "score" else {}
        extra = {}
        if cfg.mode == "blockwise":
            # W_O comes from each layer's module inside the forward (the cache reads o_proj itself)
            pol = get_policy(cfg.policy) if cfg.policy in POLICIES else _policy_object(model, cfg, hd)
            cache = make_cache(model, pol, cfg.size, mode="blockwise", block_size=BLOCK, prompt_length=n_all,
                               allocation=_allocation(cfg.allocation))
            first = prefill(model, torch.tensor([case.prompt]), cache)[0, -1].float()
            cache.freeze()
        elif cfg.setting == "agnostic" and not lm:
            cache = replay_cache(model, cfg, kv, qwin_ctx, n_ctx, inputs, hd)
            with LayerOutputs(model) as outs:  # the first answer token's query is the question's last token
                first = feed(model, cache, case.q_ids)[-1]
            extra["layer_err"] = outs.errors(full_outs)
        else:
            cache = replay_cache(model, cfg, kv, qwin_all, n_all, inputs, hd)
            first = last_logits
        # tokens held per (layer, head) right after the compression (+ the question, agnostic)
        extra = {"kept_per_head": _kept(cache), **extra}
        if lm:
            lp = torch.log_softmax(torch.cat([first[None], feed(model, cache, case.cont_ids[:-1], 0)]), -1)
            return {"ll": float(lp[torch.arange(CONT), torch.tensor(case.cont_ids)].mean())}, lp, extra
        glen = max(len(c) for c in case.cands)
        s, g, d = score_choices(model, cache, first, case.cands, glen, case.answer, cfg.mode != "lagkv")
        return accuracies(tok, case, s, g), d, extra

    # the full cache (reference for every KL): always recomputed (cheap next to the capture), recorded once
    t = time.time()
    m_full, ref, _ = run_one(FULL)
    sec = time.time() - t
    if not store.done(case, FULL):
        store.add(case, FULL, m_full, sec + t_cap)
    log(f"  full {m_full} {sec:.1f}s")
    wo_cfgs = [c for c in todo if c in GROUPS["criticalkv"] and not lm]  # these record the error after W_O
    wo_metrics, per_cfg_t = {}, 0.0
    if wo_cfgs:
        t = time.time()
        errs = wo_errors(model, kv, sel([n_all - 1]), qwin_ctx, n_ctx, wo_cfgs, {})
        per_cfg_t = (time.time() - t) / len(wo_cfgs)
        wo_metrics = {c.name: {"value": float(torch.tensor(errs[c.name]).mean()),
                               "per_head": [[float(f"{x:.5g}") for x in row] for row in errs[c.name]]}
                      for c in wo_cfgs}
    for cfg in todo:
        t = time.time()
        try:
            m, d, extra = run_one(cfg)
        except ValueError as e:  # e.g. a budget below a policy's protected tokens
            log(f"  skip {cfg.name}: {e}")
            store.add(case, cfg, {"error": str(e)[:200]}, 0.0)
            continue
        m = {"kl": kl(ref, d), "dll": m["ll"] - m_full["ll"]} if lm else {**m, "kl_answer": kl(ref, d)}
        m.update(extra)
        sec = time.time() - t
        if cfg.name in wo_metrics:
            m["wo_err"] = wo_metrics[cfg.name]
            sec += per_cfg_t
        store.add(case, cfg, m, sec)
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items() if k != "wo_err"}
        log(f"  {cfg.name} {shown}{' wo_err %.4g' % m['wo_err']['value'] if 'wo_err' in m else ''} {sec:.1f}s")


def _kept(cache) -> float:
    """Mean tokens held per (layer, KV head) of the compressed prefix + what was fed after it."""
    return float(torch.stack([k.float().mean() for k in cache.kept_tokens()]).mean())


# ------------------------------------------------------------------------------------------------


def _seeds(spec: str) -> List[int]:
    """The seeds of ``0-49``, ``0,3,7`` or both (``0-4,9``)."""
    out: List[int] = []
    for part in filter(None, spec.split(",")):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=["mk_needle"], choices=TASKS)
    p.add_argument("--contexts", nargs="+", type=int, default=[2048])
    p.add_argument("--seeds", default="0-49", help="e.g. 0-49 or 0,3,7")
    p.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS) + ["full"])
    p.add_argument("--out", default=OUT)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    sources = available_sources()  # rotated over seeds
    real = [s for s in sources if s != "synthetic"]
    if "lm" in a.tasks and not real:
        p.error("task lm needs a real-text source (the Python licenses or pydoc_data; see available_sources)")
    model, tok = load_smollm2()
    store = Store(a.out)
    configs = [c for g in a.groups if g != "full" for c in GROUPS[g]]
    meta = {"date": now(), "commit": store.commit,
            "argv": argv if argv is not None else sys.argv[1:], "threads": torch.get_num_threads(),
            "device": f"cpu ({platform.machine()})", "torch": torch.__version__}
    append_jsonl(os.path.join(a.out, "runs.jsonl"), [meta])
    for seed, ctx, task in itertools.product(_seeds(a.seeds), a.contexts, a.tasks):
        # lm continues real text only (the synthetic filler is five sentences in a loop); cwe counts synthetic words
        pool = ["synthetic"] if task == "cwe" else real if task == "lm" else sources
        src = pool[seed % len(pool)]
        case = build_case(tok, task, ctx, seed, src)
        if store.done(case, FULL) and all(store.done(case, c) for c in configs):
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {task} ctx={ctx} seed={seed} src={src} prompt={len(case.prompt)}",
              flush=True)
        run_case(model, tok, case, configs, store, log=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
