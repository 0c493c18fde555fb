"""Every pointer in the repository resolves inside it: relative links in Markdown, file paths named in code,
docstrings, comments and docs (``docs/x.md``, ``benchmarks/y.py``, a bare ``name.md``), and no reference to what a
clone does not have (notes kept beside the checkout, issue numbers of a tracker)."""
import ast
import io
import os
import re
import tokenize


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {".git", ".hypothesis", "__pycache__", ".cache", "build", "dist"}  # and every .venv* (environments)
SUFFIXES = (".py", ".md", ".sh", ".toml", ".cfg", ".txt")
TOP = ("docs", "benchmarks", "tritonkv", "tests", "examples", ".ci")
# a path from the repository root: docs/x.md, benchmarks/results/y.json, tritonkv/kernels/z.py
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(map(re.escape, TOP)) + r")/[\w./-]*\w\.(?:md|py|json|sh|png|gz|toml))")
# a bare file name: must be the name of some file of the repository
BARE = re.compile(r"(?<![\w./<>*-])([A-Za-z_][\w-]*\.(?:md|py))\b")
GENERATED = {"cpu-speed.md", "cpu-decode_attention.md"}  # written by a benchmark's smoke run, never committed
LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTSIDE = [re.compile(r"(?:\.\./)?\bshared/(?:notes|DESIGN|seeds)|\.\./shared"), re.compile(r"\bissues? #?\d+", re.I)]



def files(root):
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv")]
        for n in names:
            if n.endswith(SUFFIXES) or n == "Makefile":
                path = os.path.join(dirpath, n)
                if os.path.relpath(path, root) != os.path.join("tests", "test_references.py"):
                    yield path


def prose(path):
    """``{line number: text}`` of a Python file's comments and docstrings, where a bare file name is a pointer (in
    code, ``args.md`` is an attribute and ``"script.py"`` a file a test writes); other files: every line."""
    src = open(path, encoding="utf-8", errors="replace").read()
    if not path.endswith(".py"):
        return dict(enumerate(src.splitlines(), 1))
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = out.get(tok.start[0], "") + " " + tok.string
    lines = src.splitlines()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            for i in range(body[0].lineno, body[0].end_lineno + 1):
                out[i] = lines[i - 1]
    return out


def hits(root=ROOT):
    """``{(file, text): "file:line"}`` of every pointer under ``root`` that does not resolve."""
    known = {n for _, _, ns in os.walk(root) for n in ns}
    out = {}
    for path in files(root):
        rel = os.path.relpath(path, root)
        text = prose(path)
        for i, line in enumerate(open(path, encoding="utf-8", errors="replace"), 1):
            bad = [p for p in PATH.findall(line) if not os.path.exists(os.path.join(root, p))]
            bad += [n for n in BARE.findall(text.get(i, "")) if n not in known | GENERATED]
            bad += [m.group(0) for rx in OUTSIDE for m in rx.finditer(line)]
            if path.endswith(".md"):
                for t in LINK.findall(line):
                    if re.match(r"[a-z]+:", t) or t.startswith("#"):
                        continue
                    full = os.path.normpath(os.path.join(os.path.dirname(path), t.split("#")[0]))
                    if not (full.startswith(root) and os.path.exists(full)):
                        bad.append(t)
            for b in bad:
                out.setdefault((rel, b), f"{rel}:{i}")
    return out


def test_the_scanner_finds_what_dangles(tmp_path):
    """The patterns catch each kind of dangling pointer and pass the ones that resolve (so the test below cannot
    be vacuous)."""
    line = ("see docs/nowhere.md, docs/algorithms.md, kernels.md, algorithms.md, issue 16, ../shared/notes, "
            "[x](missing.md) [y](algorithms.md) `<device>-speed.md` benchmarks/results/quality/*.jsonl.gz\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "algorithms.md").write_text(line)
    assert sorted(t for _, t in hits(str(tmp_path))) == ["../shared/notes", "docs/nowhere.md", "issue 16",
                                                         "kernels.md", "missing.md"]


def test_every_pointer_resolves():
    found = hits()
    assert not found, "dangling pointers:\n" + "\n".join(f"{v}: {t}" for (_, t), v in sorted(found.items(), key=str))



def test_bare_names_count_in_prose_only(tmp_path):
    """In Python, a bare file name is a pointer in a comment or docstring, not in code (an attribute, a file the
    code writes)."""
    (tmp_path / "m.py").write_text('"""See gone.md."""\nx = args.md  # and lost.md\nopen("script.py")\n')
    assert sorted(t for _, t in hits(str(tmp_path))) == ["gone.md", "lost.md"]
