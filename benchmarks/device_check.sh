#!/bin/bash
# A GPU machine's check of `--device cuda`, in one go (about 9 minutes on one H200):
#   1. `make train`'s default run on the GPU, SEEDS side by side (each process its own CUDA
#      context; pretraining included), stopped at RUN_SECONDS if not done;
#   2. meanwhile tests/learner/test_cuda.py (sampler and learner agree on the GPU, GPU log-probs match
#      the CPU's, text and image tasks train with replay, a GPU checkpoint resumes on the CPU);
#   3. then benchmarks/device_bench.py: pretraining step and RL iteration times, CPU and GPU side
#      by side.
# Usage: bash benchmarks/device_check.sh OUTDIR [SEED ...]   (default seeds 0-4)
# Where pip cannot reach an index, wheels of the missing packages in .whl/ are installed first.
# OUTDIR receives versions.txt, pytest_cuda.txt, device_bench.txt/.json and runs.tgz (each run's
# config, summaries, metrics.jsonl and log; no weights).
set -u
OUTDIR=${1:?usage: device_check.sh OUTDIR [SEED ...]}
shift
SEEDS=${*:-0 1 2 3 4}
RUN_SECONDS=${RUN_SECONDS:-420}
ITERATIONS=${ITERATIONS:-200}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUTDIR"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUTDIR/pip.txt" 2>&1 && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD FRESHPER_CACHE=$PWD/.cache/freshper PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
# bm25s takes JAX where it is installed; on the CPU, so it does not take the GPU's memory
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu} XLA_PYTHON_CLIENT_PREALLOCATE=false
{ nvidia-smi -L; nproc
  $PY -c "import torch, transformers, gymnasium; print('torch', torch.__version__, 'transformers', transformers.__version__,
'gymnasium', gymnasium.__version__, 'cuda', torch.cuda.is_available())"; } > "$OUTDIR/versions.txt" 2>&1
mkdir -p runs/device_check
start=$(date +%s)
for s in $SEEDS; do
  timeout "$RUN_SECONDS" $PY train.py --device "$DEVICE" --seed "$s" --iterations "$ITERATIONS" --threads 2 --update-threads 2 \
    --runs-root runs/device_check --run-name "gpu_s$s" --no-progress > "runs/device_check/gpu_s$s.log" 2>&1 &
done
timeout 300 $PY -m pytest -q -p no:cacheprovider tests/learner/test_cuda.py > "$OUTDIR/pytest_cuda.txt" 2>&1
echo "pytest rc $? after $(( $(date +%s) - start )) s" >> "$OUTDIR/versions.txt"
wait
echo "runs done after $(( $(date +%s) - start )) s" >> "$OUTDIR/versions.txt"
timeout 150 $PY benchmarks/device_bench.py --devices cpu "$DEVICE" --json "$OUTDIR/device_bench.json" \
  > "$OUTDIR/device_bench.txt" 2>&1
echo "bench rc $? after $(( $(date +%s) - start )) s" >> "$OUTDIR/versions.txt"
tar czf "$OUTDIR/runs.tgz" --exclude=checkpoints --exclude=best --exclude=reference --exclude=tensorboard --exclude='*.gif' runs/device_check
