"""Seconds per RL iteration of the default run at several replay ratios, side by side.

    python benchmarks/replay_ratio_time.py                      # K = 1 and 2, 40 iterations each, twice
    python benchmarks/replay_ratio_time.py --ratios 0 1 2 --iterations 20 --repeats 1

Runs ``train.py --seed S --replay-ratio K --iterations N`` (the default run otherwise, its
pretrained model from the cache; no periodic evaluations, a short final one) one at a time,
the settings alternating so that load drifts hit them alike, and prints from each run's
``metrics.jsonl`` (``learner/tools/run_stats.py``) the median seconds per iteration of rollouts,
the on-policy update and all replay updates, and the ratio of their sum to the first setting's.
Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

from learner.tools.run_stats import stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", type=int, nargs="+", default=[1, 2], help="replay ratios K to time")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting, alternating")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    parts: dict[int, list[dict[str, float]]] = {k: [] for k in args.ratios}
    with tempfile.TemporaryDirectory() as root:
        for rep in range(args.repeats):
            for k in args.ratios:
                name = f"k{k}_r{rep}"
                cmd = [sys.executable, str(REPO / "train.py"), "--seed", str(args.seed), "--replay-ratio", str(k),
                       "--iterations", str(args.iterations), "--eval-every", str(10 * args.iterations),
                       "--final-eval-episodes", "8", "--no-diagnostics", "--no-progress", "--no-tensorboard",
                       "--gifs", "0", "--select", "last", "--runs-root", root, "--run-name", name]
                print(f"running K = {k}, repeat {rep + 1} of {args.repeats} ...", flush=True)
                subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, env=dict(os.environ))
                parts[k].append(stats(Path(root) / name))
    base = None
    print(f"{'K':>3} {'rollout s':>10} {'update s':>9} {'replay s':>9} {'iteration s':>12} {'ratio':>6}")
    for k, runs in parts.items():
        med = {p: float(np.mean([r[p] for r in runs])) for p in ("rollout", "update", "replay")}
        total = med["rollout"] + med["update"] + (0.0 if np.isnan(med["replay"]) else med["replay"])
        base = total if base is None else base
        print(f"{k:>3} {med['rollout']:>10.2f} {med['update']:>9.2f} {med['replay']:>9.2f} {total:>12.2f} {total / base:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
