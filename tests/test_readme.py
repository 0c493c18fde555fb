"""The documentation runs as written: every ```python block of README.md, and every block of docs/*.md marked
``<!-- test: run -->`` on the line before its fence, is executed (each in a fresh namespace). That every link and
file name in them resolves is ``test_references.py``'s.

The blocks run on the CPU through the ops' native PyTorch bodies (``cpu_kernels("torch")``: the suite sets
TRITON_INTERPRET=1 for the kernel tests, users never need it). Blocks that use a Hugging Face model say so
("model: a Llama-style HF model") and do not build one: HIDDEN PRELUDE — ``_prelude()`` below, which is not in
the README, gives every block a tiny random ``LlamaForCausalLM`` as ``model`` and a 256-token prompt as
``input_ids``, so nothing is downloaded.
"""
import glob
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
RUN_MARK = "<!-- test: run -->"
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")


def code_blocks(path: str):
    """``(first line number, language, source, marked)`` of every fenced block of a Markdown file; ``marked``:
    the last non-blank line before the fence is ``<!-- test: run -->``."""
    lines = open(path, encoding="utf-8").read().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2).lower()
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence[:3]):
            j += 1
        out.append((i + 2, lang, "\n".join(lines[i + 1:j]) + "\n", prev == RUN_MARK))
        i = j + 1
    return out


def runnable():
    cases = [(README, line, src) for line, lang, src, _ in code_blocks(README) if lang == "python"]
    for path in DOCS:
        cases += [(path, line, src) for line, _, src, marked in code_blocks(path) if marked]
    return cases


CASES = runnable()


def _id(case):
    return f"{os.path.relpath(case[0], ROOT)}:{case[1]}"


@pytest.fixture(scope="module")
def _prelude():
    """HIDDEN PRELUDE (not in the README): what the transformers snippets call ``model`` and ``input_ids``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).eval()
    input_ids = torch.randint(0, 256, (1, 256), generator=torch.Generator().manual_seed(1))
    return {"model": model, "input_ids": input_ids}


def test_blocks_are_found():
    """The extraction sees the README's snippets (Use, the last window of queries, transformers) and marked docs
    blocks, so a broken parser cannot make the tests below vacuous."""
    files = {os.path.basename(p) for p, _, _ in CASES}
    assert sum(p == README for p, _, _ in CASES) >= 3
    assert {"contracts.md", "kvpress.md"} <= files


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_block_runs(case, _prelude):
    from tritonkv.kernels._common import cpu_kernels

    path, line, src = case
    code = compile("\n" * (line - 1) + src, path, "exec")  # tracebacks point at the Markdown file's lines
    ns = {"__name__": "__doc_block__", **_prelude}
    with cpu_kernels("torch"):
        exec(code, ns)
