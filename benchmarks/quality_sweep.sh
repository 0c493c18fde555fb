#!/usr/bin/env bash
# The committed quality sweep (benchmarks/results/quality.*): SmolLM2-135M-Instruct on the CPU, kernels
# under the Triton interpreter, ~1.5 h on 2 shared cores. Each step after the first appends to quality.json.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=1 HF_HUB_OFFLINE=1
Q="${PYTHON:-.venv/bin/python} benchmarks/quality.py"
ALL_LAYERS=$(seq 0 29)
# 1. attention-output error, every policy x budget, allocators over SnapKV (and CriticalKV over AdaKV), every
#    layer (so cross-layer allocators keep the same total as uniform), 1K context
$Q --context 1024 --layers $ALL_LAYERS --budgets 0.1 0.25 0.5 --trials 1 \
   --allocators uniform adakv pyramid score surfacelogic --skip-model
# 2. needle + KL through TritonKVCache, block-wise prefill (128-token blocks), 1K context, two needle depths,
#    at the small budgets of KeyDiff's claim
$Q --append --context 1024 --skip-attn --model-policies keydiff snapkv tova streaming_llm \
   --model-budgets 0.1 0.25 --modes blockwise --depths 0.25 0.75 --trials 1 --block-size 128
# 3. LagKV at a 2x ratio, block-wise and after prefill
$Q --append --context 1024 --skip-attn --model-policies lagkv --model-budgets 0.5 \
   --modes blockwise after_prefill --depths 0.25 0.75 --trials 1 --block-size 128
