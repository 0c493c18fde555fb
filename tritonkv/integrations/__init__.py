"""Integrations with model libraries: Hugging Face transformers (``tritonkv.integrations.transformers``),
the offline SmolLM2 model (``.model``) and the needle-by-likelihood check (``.needle``).

They need the ``hf`` extra (``pip install "tritonkv[hf]"``); without transformers, importing any of them
raises a ModuleNotFoundError that says so (the core, ``tritonkv.compress``, needs only torch and triton).
"""
import importlib.metadata
import importlib.util
import re

MIN_TRANSFORMERS = (5, 2)  # what pyproject.toml declares; `make test-transformers-min` tests it
INSTALL = 'pip install "tritonkv[hf]"'


def _check_transformers() -> None:
    try:
        found = importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ModuleNotFoundError(
            f"tritonkv.integrations needs Hugging Face transformers, which is not installed: {INSTALL} "
            f"(transformers>={'.'.join(map(str, MIN_TRANSFORMERS))}, plus gguf and accelerate for the SmolLM2 "
            f"model)", name="transformers")
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:  # importable without metadata (a source tree): trust it
        return
    m = re.match(r"(\d+)\.(\d+)", version)
    if m and (int(m.group(1)), int(m.group(2))) < MIN_TRANSFORMERS:
        raise ImportError(f"tritonkv.integrations needs transformers>={'.'.join(map(str, MIN_TRANSFORMERS))}, "
                          f"found {version}: pip install -U \"tritonkv[hf]\"", name="transformers")


_check_transformers()
