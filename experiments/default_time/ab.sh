#!/usr/bin/env bash
# The embedded default's iteration time, this tree beside another revision, alternating:
#   experiments/default_time/ab.sh BASE_REV [ITERATIONS] [REPEATS]
# Each arm runs `train.py` from its own checkout (the base in a git worktree under /tmp) with the
# default recipe and the same seed; prints per-arm medians of the run's own timings
# (metrics.jsonl: time_rollout_s, time_update_s, time_replay_s; the first iteration left out)
# and the final held-out success of each run.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BASE=$(git -C "$REPO" rev-parse --short "${1:?a base revision}")
ITERS=${2:-20}
REPEATS=${3:-2}
TREE=/tmp/freshper-baseline-$BASE
[ -f "$TREE/train.py" ] || git -C "$REPO" worktree add --detach "$TREE" "$BASE" >/dev/null
WORK=$(mktemp -d)
export FRESHPER_CACHE=${FRESHPER_CACHE:-$REPO/.cache/freshper}
for r in $(seq 1 "$REPEATS"); do
    for arm in base current; do
        tree=$REPO; [ "$arm" = base ] && tree=$TREE
        (cd "$tree" && "$REPO/.venv/bin/python" train.py --iterations "$ITERS" --seed 0 \
            --runs-root "$WORK/$arm" --run-name "r$r" >/dev/null 2>&1)
        echo "$arm r$r done" >&2
    done
done
"$REPO/.venv/bin/python" - "$WORK" <<'PY'
import json, statistics, sys
from pathlib import Path
work = Path(sys.argv[1])
for arm in ("base", "current"):
    parts = {k: [] for k in ("time_rollout_s", "time_update_s", "time_replay_s")}
    finals = []
    for run in sorted((work / arm).iterdir()):
        rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
        rows = [r for r in rows if "time_update_s" in r][1:]
        for k in parts:
            parts[k] += [r.get(k, 0.0) for r in rows]
        summary = json.loads((run / "summary.json").read_text())
        finals.append(summary["evals"]["final"]["success"])
    med = {k: statistics.median(v) for k, v in parts.items()}
    print(f"{arm}: rollout {med['time_rollout_s']:.3f} s, update {med['time_update_s']:.3f} s, replay "
          f"{med['time_replay_s']:.3f} s, sum {sum(med.values()):.3f} s; final success of each run {finals}")
PY
