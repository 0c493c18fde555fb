"""Packaging: the console script and its help, the license, the extras, and what a user without
the ``hf`` extra sees. Commands run in subprocesses, as a user runs them."""
import ast
import os
import subprocess
import sys

import pytest

try:
    import tomllib  # Python >= 3.11
except ModuleNotFoundError:  # Python 3.10, which pyproject's requires-python still allows: tomli is the same parser
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPROJECT = os.path.join(ROOT, "pyproject.toml")


def _run(*args, code=None, timeout=120):
    """``python -m tritonkv ARGS`` (or ``python -c CODE``) from the repository root, without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable] + (["-c", code] if code is not None else ["-m", "tritonkv", *args])
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _project():
    """pyproject.toml's ``[project]`` table; the tests reading it skip on Python 3.10 without tomli (only they do:
    the package and its other tests run on 3.10)."""
    if tomllib is None:
        pytest.skip("reading pyproject.toml needs Python >= 3.11 (tomllib) or pip install tomli")
    with open(PYPROJECT, "rb") as f:
        return tomllib.load(f)["project"]


def test_help_lists_every_command():
    from tritonkv.__main__ import COMMANDS

    r = _run("--help")
    assert r.returncode == 0, r.stderr
    assert set(COMMANDS) >= {"demo", "profile", "fetch"}
    for name, (_, _, help_) in COMMANDS.items():
        assert f"\n  {name} " in r.stdout, (name, r.stdout)
        assert help_.endswith("."), name  # a whole sentence, not a first line cut mid-sentence
    # the help text is printed whole (wrapped, never cut): every word of every command's help is there
    words = " ".join(r.stdout.split())
    for _, _, help_ in COMMANDS.values():
        assert " ".join(help_.split()) in words
    assert "bench" not in COMMANDS  # benchmarks/ is not part of the installed package


EACH_HELP = """
import contextlib, io, sys
from tritonkv.__main__ import COMMANDS, main
for argv in [[name, "--help"] for name in COMMANDS] + [["dmeo"]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    print(repr((argv[0], code, out.getvalue(), err.getvalue())))
"""


@pytest.fixture(scope="module")
def helps():
    """``{command: (exit code, stdout, stderr)}`` of ``tritonkv <command> --help`` and of ``tritonkv dmeo``,
    from one process (each start imports torch and triton)."""
    r = _run(code=EACH_HELP)
    assert r.returncode == 0, r.stderr
    return {name: rest for name, *rest in map(ast.literal_eval, r.stdout.splitlines())}


def test_each_command_has_its_own_help(helps):
    from tritonkv.__main__ import COMMANDS

    for name in COMMANDS:
        code, out, err = helps[name]
        assert code in (0, None), (name, code, err)
        assert out.startswith("usage: ") and name in out.splitlines()[0], (name, out)


def test_demo_help_description_is_whole(helps):
    description = helps["demo"][1].split("\n\n")[1]  # usage, description, options
    assert " ".join(description.split()).endswith("."), description


def test_unknown_command_suggests_the_near_one(helps):
    code, _, err = helps["dmeo"]
    assert code == 2 and "unknown command 'dmeo'; did you mean 'demo'?" in err, err


def test_console_script_points_at_main():
    import importlib

    target = _project()["scripts"]["tritonkv"]
    module, func = target.split(":")
    assert importlib.import_module(module).main is getattr(importlib.import_module(module), func)
    assert target == "tritonkv.__main__:main"


def test_license_and_metadata():
    project = _project()
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert project["authors"] == [{"name": "tritonkv developers"}]
    assert "urls" not in project  # none is known: none is invented
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert text.lstrip().startswith("Apache License\n") and "Version 2.0, January 2004" in text
    for section in ("1. Definitions.", "4. Redistribution.", "9. Accepting Warranty or Additional Liability.",
                    "END OF TERMS AND CONDITIONS", "APPENDIX: How to apply the Apache License to your work."):
        assert section in text, section


def _imports(path):
    """Top-level names of the modules ``path`` imports (absolute imports only)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


# Optional imports of the commands: (module, extra that has it). The command runs without them and says which extra
# to install (the demo's plot: tests/test_demo.py::test_plot_without_matplotlib_says_what_to_install).
OPTIONAL = {"tritonkv/demo.py": {"matplotlib": "bench"}}


def _names(reqs):
    return {d.split(">")[0].split("=")[0].split("[")[0].split(";")[0].strip().replace("-", "_") for d in reqs}


def test_commands_need_only_core_and_hf():
    """Every third-party module the shipped commands import is a core dependency or in the hf extra, or an optional
    import (``OPTIONAL``) in the extra the command names."""
    project = _project()
    extras = project["optional-dependencies"]
    declared = _names(project["dependencies"] + extras["hf"])
    stdlib = set(sys.stdlib_module_names)
    for rel in ("tritonkv/demo.py", "tritonkv/__main__.py", "tritonkv/allocation/profiler.py",
                "tritonkv/integrations/model.py", "tritonkv/integrations/needle.py"):
        optional = OPTIONAL.get(rel, {})
        third = _imports(os.path.join(ROOT, rel)) - stdlib - {"tritonkv", "__future__"} - set(optional)
        assert third <= declared, (rel, third - declared)
        for module, extra in optional.items():
            assert module in _names(extras[extra]), (rel, module, extra)
            with open(os.path.join(ROOT, rel)) as f:
                assert f'pip install "tritonkv[{extra}]"' in f.read(), (rel, module)


NO_TRANSFORMERS = """
import sys
sys.modules["transformers"] = None  # as if it were not installed
import tritonkv                      # the core needs no transformers
tritonkv.compress
try:
    import tritonkv.integrations.transformers
except ImportError as e:
    print(type(e).__name__, e)
"""


def test_missing_transformers_says_what_to_install():
    r = _run(code=NO_TRANSFORMERS)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ModuleNotFoundError ") and 'pip install "tritonkv[hf]"' in r.stdout, r.stdout
