#!/usr/bin/env bash
# Two ablations run beside the tiny report (docs/experiments.md, "Ablations beside the tiny
# report"), seed 0, every setting the tiny suite's except the one named; not report rows.
#   1. FoX's retrieval models with the forget-gate bias started at 5 instead of 0.
#   2. FIRE's LM with its threshold L started at the training length (64) instead of 512.
# Usage: bash scripts/ablations_tiny.sh [RUNS_DIR]   (default runs/ablations; ~40 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${1:-runs/ablations}"
PY="${PYTHON:-.venv/bin/python}"
for task in passkey niah; do
  "$PY" -m experiments.train --config "configs/retrieval_tiny.py:$task,fox" \
    --config.model.fox_gate_bias_init=5.0 --config.progress_bar=False --workdir "$RUNS/${task}_fox_b5"
done
"$PY" -m experiments.evaluate --workdir "$RUNS/passkey_fox_b5" --evals passkey \
  --multipliers 1,2,4,8,16 --num_examples 64 --out "$RUNS/passkey_fox_b5_eval"
"$PY" -m experiments.evaluate --workdir "$RUNS/niah_fox_b5" --evals niah \
  --multipliers 1,2,4,8,16 --num_examples 16 --out "$RUNS/niah_fox_b5_eval"
# The tiny suite's LM overrides (goat_jax/reproduce/suites.py, SUITES['tiny'].lm_overrides).
"$PY" -m experiments.train --config configs/lm_tiny.py:fire --config.seq_len=64 \
  --config.global_batch_size=32 --config.model.kv_num_heads=4 --config.num_train_steps=1000 \
  --config.eval_every_steps=1000 --config.checkpoint_every_steps=200 \
  --config.model.fire_threshold_init=64.0 --config.progress_bar=False --workdir "$RUNS/lm_fire_L64"
"$PY" -m experiments.evaluate --workdir "$RUNS/lm_fire_L64" --evals extrapolation \
  --multipliers 1,2,4,8,16,32,64 --out "$RUNS/lm_fire_L64_eval"
