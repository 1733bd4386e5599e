"""What a run's training iterations looked like, one line per run folder.

    python -m learner.tools run-stats docs/data/sokoban_g32/g32_s0 docs/data/sokoban_cur/m4_s0

Reads each run's ``metrics.jsonl`` (or the archived ``.gz``) and prints: RL iterations, mean
training success and the number of successful training episodes, the share of GRPO groups whose returns differ (the groups that give a
gradient), turns per episode and invalid replies at the first iteration and over the last 10,
the range of the held-out action spread, and held-out sampled success at the start of RL and
at the end (200 tasks), and the median seconds per iteration of rollouts, the on-policy update
and the replay updates (all K of an iteration together). These are the columns of the per-task tables in docs/results/.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from learner.report import read_metrics


def stats(run: Path) -> dict[str, float]:
    rows = read_metrics(run / "metrics.jsonl")
    train = [r for r in rows if r.get("kind") == "train"]
    if not train:
        raise SystemExit(f"{run}: no training iterations in its metrics")
    sampled = {r.get("phase"): r for r in rows if r.get("kind") == "eval" and r.get("decoding") == "sampled"}
    spreads = [r["action_spread"] for r in sampled.values() if "action_spread" in r]
    last = train[-10:]
    episodes = np.diff([0] + [r["episodes"] for r in train])  # the counter is cumulative
    return {
        "iterations": len(train),
        "train_solved": int(round(sum(r["success"] * n for r, n in zip(train, episodes)))),
        "train_success": float(np.mean([r["success"] for r in train])),
        "groups_with_signal": float(np.mean([1 - r["groups_all_equal"] / r["groups"] for r in train])),
        "turns_first": train[0]["turns_mean"], "turns_last10": float(np.mean([r["turns_mean"] for r in last])),
        "invalid_first": train[0]["invalid_rate"], "invalid_last10": float(np.mean([r["invalid_rate"] for r in last])),
        "spread_min": min(spreads, default=float("nan")), "spread_max": max(spreads, default=float("nan")),
        # median seconds per iteration of each phase (a replay column only where the run replays)
        **{k: float(np.median([r[f"time_{k}_s"] for r in train if f"time_{k}_s" in r] or [np.nan]))
           for k in ("rollout", "update", "replay")},
        "start": sampled.get("baseline", {}).get("success", float("nan")),
        "final": sampled.get("final", {}).get("success", float("nan")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (live or archived)")
    runs = parser.parse_args(argv).runs
    missing = [str(r) for r in runs if not ((r / "metrics.jsonl").exists() or (r / "metrics.jsonl.gz").exists())]
    if missing:
        parser.error(f"no metrics.jsonl (or .gz) in: {', '.join(missing)}")
    print(f"{'run':<40} {'its':>4} {'train success':>13} {'solved':>6} {'groups w/ signal':>16} {'turns':>11} "
          f"{'invalid':>11} {'action spread':>13} {'held-out start -> final':>23} {'s: rollout update replay':>25}")
    for run in runs:
        s = stats(run)
        print(f"{str(run):<40} {s['iterations']:>4} {s['train_success']:>13.3f} {s['train_solved']:>6} {s['groups_with_signal']:>16.0%} "
              f"{s['turns_first']:>4.1f} -> {s['turns_last10']:<3.1f} {s['invalid_first']:>4.0%} -> {s['invalid_last10']:<3.0%} "
              f"{s['spread_min']:.3f}-{s['spread_max']:.3f} {s['start']:>14.3f} -> {s['final']:.3f} "
              f"{s['rollout']:>9.2f} {s['update']:>6.2f} {s['replay']:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
