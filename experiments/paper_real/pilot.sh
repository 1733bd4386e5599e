#!/usr/bin/env bash
# The drift pilot of the real-model replay comparison: how far SmolLM2-135M-Instruct's policy
# moves per update on Arithmetic under settings of the drift knobs (learning rate, KL penalty),
# from one start, with FreshPER replay (tau 10, one replay update of B x G per
# iteration) so the buffer holds data of every age the run reaches.
#   1. the start: the recipe's own-answer warm-up (configs/real_arithmetic.yaml), one iteration
#   2. five settings x 10 iterations (one of them on-policy: does replay cause a collapse?), two side by side (learner.tools sweep)
#   3. the buffer's drift by age at each run's last checkpoint (learner.tools buffer-drift)
# Usage: experiments/paper_real/pilot.sh [OUT]   (default runs/paper_real)
set -euo pipefail
OUT=${1:-runs/paper_real}
PY=${PYTHON:-.venv/bin/python}
if [ ! -f "$OUT/start/summary.json" ]; then
  $PY train.py --config configs/real_arithmetic.yaml --iterations 1 --eval-every 0 --runs-root "$OUT" --run-name start --no-progress
fi
$PY -m learner.tools sweep --out "$OUT/pilot" --seeds 0 --jobs 2 \
  --arm lr1e5_kl="--lr 1e-5 --kl-coef 0.04" \
  --arm lr5e5="--lr 5e-5 --kl-coef 0" \
  --arm lr15e5="--lr 1.5e-4 --kl-coef 0" \
  --arm lr2e5="--lr 2e-5 --kl-coef 0" \
  --arm lr5e5_onpolicy="--lr 5e-5 --kl-coef 0 --replay none" \
  -- --config configs/real_arithmetic.yaml --model "$OUT/start/reference" --pretrain-steps 0 \
     --replay fresh --replay-ratio 1 --replay-batch none --tau 10 \
     --iterations 10 --eval-every 0 --final-eval-episodes 64
$PY -m learner.tools buffer-drift "$OUT"/pilot/lr1e5_kl_s0 "$OUT"/pilot/lr2e5_s0 "$OUT"/pilot/lr5e5_s0 \
  "$OUT"/pilot/lr15e5_s0 --by-setting --json "$OUT/pilot/drift.jsonl" \
  --plot "$OUT/pilot/drift.png"
