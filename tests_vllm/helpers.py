"""Shared pieces of the vLLM tests: the tiny random models, the engine settings, stepping an engine while recording
its schedule and block pool, and the Hugging Face reference that masks the evicted tokens.

The reference is written from the schedule's definition (``start(n)`` and "compress the kept tokens plus the new
ones, keep ``n - start(n)`` per KV head") and from the attention's definition (sliding window, logit soft cap,
learned sinks), not from the plugin: it runs the transformers model with every token in its cache and a per-head
mask of what is kept.
"""
from __future__ import annotations

import math
import os

import torch

BLOCK = 32
VOCAB = 512
#: the shape every tiny model shares: 2 layers, hidden 128, 4 query heads, 2 KV heads of 32
SHAPE = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=4096, initializer_range=0.08, tie_word_embeddings=False)
#: the hybrid models' window: shorter than the longer prompts, so their sliding layers drop tokens too
WINDOW = 64


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**SHAPE, intermediate_size=256))


def _gemma2():
    """Gemma 2: a sliding-window layer then a full one, attention logits soft-capped at 2 (low, so that the cap
    changes the outputs of a random model; Gemma 2 itself uses 50). vLLM's Gemma 2 ties the embeddings; with them
    at transformers' initialisation and its zero norm weights the tiny model repeats one token, so the norm weights
    are drawn from N(0, 3) and the embeddings scaled by 0.3 (its greedy tokens then vary)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = Gemma2ForCausalLM(Gemma2Config(**{**SHAPE, "tie_word_embeddings": True}, intermediate_size=256,
                                           sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                                           attn_logit_softcapping=2.0, query_pre_attn_scalar=32))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 3.0)
        model.model.embed_tokens.weight.mul_(0.3)
    return model


def _gpt_oss():
    """gpt-oss: a sliding-window layer then a full one, a learned sink logit per query head (drawn from N(0, 1):
    transformers initialises them to 0), 4 experts, 2 per token."""
    from transformers import GptOssConfig, GptOssForCausalLM

    model = GptOssForCausalLM(GptOssConfig(**SHAPE, intermediate_size=128, sliding_window=WINDOW,
                                           layer_types=["sliding_attention", "full_attention"],
                                           num_local_experts=4, num_experts_per_tok=2))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return model


MODELS = {"llama": _llama, "gemma2": _gemma2, "gpt-oss": _gpt_oss}


def make_model(path: str, seed: int = 0, kind: str = "llama") -> str:
    """A tiny random model of ``kind`` (``MODELS``), fp32, saved to ``path``."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    model = MODELS[kind]().to(torch.float32)
    model.config.torch_dtype = torch.float32
    model.save_pretrained(path, safe_serialization=True)
    return path


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


def engine_kwargs(model: str, tritonkv: dict | None = None, **over) -> dict:
    kw = dict(model=model, skip_tokenizer_init=True, dtype="float32", block_size=BLOCK, enforce_eager=True,
              gpu_memory_utilization=0.3, max_model_len=1024, max_num_batched_tokens=64, max_num_seqs=8,
              enable_prefix_caching=False, seed=0)
    if tritonkv is not None:
        kw["additional_config"] = {"tritonkv": tritonkv}
    kw.update(over)
    return kw


def kept_start(n: int, budget: int, g: int) -> int:
    """``start(n)`` written from its definition: the first slot still held, a multiple of ``g``."""
    return 0 if n <= budget else (n - budget) // g * g


class Recorder:
    """Drives ``LLMEngine.step()`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and records, per request,
    the computed-token count after each step (its chunk schedule), the generated tokens, and the blocks it holds
    in the scheduler's block pool after each step."""

    def __init__(self, llm):
        self.engine = llm.llm_engine
        core = self.engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self.managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        # the compressed group's manager (a hybrid model also has its sliding-window group's)
        self.manager = next((m for m in self.managers if type(m).__name__ == "TritonKVManager"), self.managers[0])
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.computed: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[tuple[int, list[int]]]] = {}  # (step, the non-null block ids held after it)
        self.steps = 0
        self.running: list[list[str]] = []  # per step: the requests holding blocks after it
        self.prompts: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}  # prompt tokens served from vLLM's prefix cache

    def add(self, rid: str, ids: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        self.engine.add_request(rid, {"prompt_token_ids": ids}, params)
        self.prompts[rid] = ids
        self.computed[rid], self.tokens[rid], self.blocks[rid] = [0], [], []

    def step(self) -> None:
        self.steps += 1
        self.running.append([])
        for out in self.engine.step():
            self.tokens[out.request_id] = list(out.outputs[0].token_ids)
            self.cached[out.request_id] = out.num_cached_tokens or 0
        for internal, req in self.scheduler.requests.items():
            rid = internal.rsplit("-", 1)[0]  # vLLM appends "-<8 random characters>" to the caller's id
            if rid in self.computed and self.computed[rid][-1] != req.num_computed_tokens:
                self.computed[rid].append(req.num_computed_tokens)
            held = self.manager.req_to_blocks.get(internal)
            if held is not None and rid in self.blocks:
                self.blocks[rid].append((self.steps, [b.block_id for b in held if not b.is_null]))
                self.running[-1].append(rid)

    def run(self, until=None) -> None:
        while self.engine.has_unfinished_requests() and not (until and until()):
            self.step()

    def schedule(self, rid: str) -> list[int]:
        """Chunk boundaries of the request's forwards: prefill chunks as observed, then one token per step."""
        p, t = len(self.prompts[rid]), len(self.tokens[rid])
        pre = sorted({c for c in self.computed[rid] if c <= p} | {0, p})
        return pre + list(range(p + 1, p + t))


def reference_tokens(model_path: str, ids: list[int], generated: list[int], bounds: list[int], policy,
                     budget: int, g: int = BLOCK, margins: list | None = None, kept_log: list | None = None,
                     extras: bool = True) -> list[int]:
    """Greedy tokens of the Hugging Face model at ``model_path`` fed ``ids + generated`` in the chunks ``bounds``
    (teacher forcing), where after each chunk ``[c, e)`` every full-attention layer keeps, per KV head, the
    ``e - start(e)`` tokens that ``tritonkv.compress(policy)`` picks among its kept tokens and the chunk whenever
    ``start(e) > start(c)``, and a query attends only to kept tokens and to the chunk (causally). A sliding-window
    layer keeps everything and a query at ``i`` sees the keys ``j`` with ``i - W < j <= i``. Logits are
    soft-capped (``cap * tanh(s / cap)``) and a learned sink logit per query head joins the softmax when the model
    has them (``extras=False`` leaves both out: the tests' check that they matter)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    import tritonkv

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    model.eval()
    cfg = model.config
    hkv = cfg.num_key_value_heads
    alive = [[[] for _ in range(hkv)] for _ in range(cfg.num_hidden_layers)]  # kept positions per layer/head
    span = {}

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
               softcap=None, s_aux=None, **kwargs):
        layer = module.layer_idx
        c, e = span["c"], span["e"]
        b, hq, q, d = query.shape
        assert key.shape[2] == e
        group = hq // hkv
        out = torch.empty(b, hq, q, d)
        rows, every = torch.arange(c, e)[:, None], torch.arange(e)[None, :]
        new_alive = []
        for h in range(hkv):
            if sliding_window:  # uncompressed: every token, the window's mask
                cols = torch.arange(e)
                vis = (every <= rows) & (every > rows - sliding_window)
            else:
                old = torch.tensor(alive[layer][h], dtype=torch.long)
                cols = torch.cat([old, torch.arange(c, e)])
                assert len(cols) == e - kept_start(c, budget, g), (layer, h, len(cols), c, e)
                vis = torch.cat([torch.ones(q, len(old), dtype=torch.bool), every[:, c:] <= rows], dim=1)
            k, v = key[0, h, cols], value[0, h, cols]
            for j in range(group):
                qh = query[0, h * group + j]
                s = (qh @ k.T) * scaling
                if softcap and extras:
                    s = softcap * torch.tanh(s / softcap)
                s = s.masked_fill(~vis, float("-inf"))
                if s_aux is not None and extras:  # a column that takes probability mass and no value
                    s = torch.cat([s, s_aux[h * group + j].expand(q, 1).float()], dim=1)
                out[0, h * group + j] = torch.softmax(s, dim=-1)[:, : len(cols)] @ v
            new_alive.append(cols)
        s0, s1 = kept_start(c, budget, g), kept_start(e, budget, g)
        if s1 > s0 and not sliding_window:  # compress: per head, keep e - s1, as the library would on these tensors
            kk = torch.stack([key[0, h, new_alive[h]] for h in range(hkv)])[None]
            vv = torch.stack([value[0, h, new_alive[h]] for h in range(hkv)])[None]
            kept = tritonkv.compress((kk, vv), policy, e - s1)
            new_alive = [new_alive[h][kept.indices[0, h]] for h in range(hkv)]
            if kept_log is not None:
                kept_log.append((layer, e, [x.tolist() for x in new_alive]))
        alive[layer] = [x.tolist() for x in new_alive]
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("tritonkv_masked_reference", attend)
    model.set_attn_implementation("tritonkv_masked_reference")
    seq = list(ids) + list(generated)
    cache = DynamicCache()  # no config: full layers that keep every token, the sliding ones too
    out = []
    with torch.no_grad():
        for c, e in zip(bounds[:-1], bounds[1:]):
            span.update(c=c, e=e)
            x = torch.tensor([seq[c:e]])
            logits = model(input_ids=x, past_key_values=cache, use_cache=True,
                           position_ids=torch.arange(c, e)[None]).logits
            if e >= len(ids):
                out.append(int(logits[0, -1].argmax()))
                if margins is not None:  # top-1 minus top-2 logit: how far the greedy choice is from a tie
                    top = logits[0, -1].topk(2).values
                    margins.append(float(top[0] - top[1]))
    return out


def max_blocks(budget: int, block: int = BLOCK) -> int:
    """The bound a running request's held blocks must keep: ceil((budget + block) / block) + 1."""
    return math.ceil((budget + block) / block) + 1
