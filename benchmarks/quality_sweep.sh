#!/usr/bin/env bash
# The committed quality evidence (benchmarks/results/quality/): SmolLM2-135M-Instruct on the CPU, one process.
# Resumable: every step appends per-case records and skips the (case, configuration) pairs already recorded, so
# the script can be killed and rerun at any point. Steps run in order of priority (cheapest claim cells first,
# seeds interleaved so that every cell grows together); a step's wall time on 2 shared cores is noted.
#
#   nohup benchmarks/quality_sweep.sh > /tmp/quality_sweep.log 2>&1 &
#   python -m benchmarks.evaluate_report        # summaries, verdicts, plots (any time)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
E="${PYTHON:-.venv/bin/python} -m benchmarks.evaluate --threads $OMP_NUM_THREADS"

chunk() {  # seeds $1: the 2K cells (needle and lm: every claim; mk_needle: after-prefill claims)
  $E --tasks needle lm --contexts 2048 --seeds "$1" --groups criticalkv keydiff lagkv allocation compose profile
  $E --tasks mk_needle --contexts 2048 --seeds "$1" --groups criticalkv lagkv allocation
}

# 1. 2K, first ten cases of every cell (~8 min a seed)
chunk 0-4
chunk 5-9
# 2. the >= 90 % gate: full-cache accuracy of every task at 2K, and of the needles at 4K and 8K
$E --tasks vt1 vt2 cwe --contexts 2048 --seeds 0-9 --groups full
$E --tasks needle mk_needle --contexts 4096 8192 --seeds 0-4 --groups full
# 3. 2K up to 50 cases per cell (two processes on disjoint seeds may run at once with --out to separate folders;
#    concatenate their .jsonl files afterwards: records are keyed by case and configuration)
for s in 10 15 20 25 30 35 40 45; do chunk "$s-$((s + 4))"; done
# 4. 4K: the after-prefill claims on the single needle and the held-out continuation (LagKV's L = 512 and 1024
#    compress here; ~5 min a seed)
$E --tasks needle lm --contexts 4096 --seeds 0-49 --groups criticalkv lagkv allocation
# 5. catch-up: cells and metrics added after a seed was measured (KeyDiff's 512-token budget, LagKV's L = 512 and
#    1024, CriticalKV's layer-wise error, the paper-grid SurfaceLogicKV profile) on every 2K seed, and the block-wise
#    cross-layer allocations (SurfaceLogicKV, the composition) dropped and re-measured after the one-table fix
chunk 0-49
# 6. 8K (SmolLM2's limit): the same after-prefill claims as at 4K (LagKV's L = 1024 compresses here too)
$E --tasks needle lm --contexts 8192 --seeds 0-49 --groups criticalkv lagkv allocation
# 7. mk_needle at 2K to 50 cases (its error metrics enter the CriticalKV, SCORE and SurfaceLogicKV claims; ~1 min a seed)
$E --tasks mk_needle --contexts 2048 --seeds 0-49 --groups criticalkv lagkv allocation
# 8. CriticalKV's selection claim (Table 1) had half its cells inconclusive at 50 cases, its intervals touching 0:
#    100 cases at 2K and 4K for the criticalkv group (~0.5 and ~1.5 min a seed and task)
$E --tasks needle lm --contexts 2048 4096 --seeds 50-99 --groups criticalkv
