"""Seconds per pretraining step by think format, side by side in one process.

    python benchmarks/pretrain_speed.py --env-id freshper/Sokoban-v0 --reasoning lookahead aim --steps 20 --rounds 3 --threads 1

For each ``--reasoning`` mode the untrained embedded model of the task's modality is pretrained
with ``learner.pretrain`` (the recipe ``train.py`` uses, 64 examples a step) for ``--steps``
steps; the modes take turns for ``--rounds`` rounds, so they share whatever load the machine
carries. Each step is timed on its own (the held-out losses ``pretrain`` measures before and
after are left out, and so is the first step of every round, which warms the caches). Prints
the median seconds per step of each mode and its ratio to the first mode's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from envs.base import REASONINGS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-id", default="freshper/Sokoban-v0")
    parser.add_argument("--reasoning", nargs="+", default=["lookahead", "aim"], choices=REASONINGS,
                        help="the modes to compare; the first is the baseline of the ratios")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode and round (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="turns each mode takes (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.steps < 2 or args.rounds < 1:
        parser.error("--steps must be >= 2 and --rounds >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    import envs
    from agents.policy import Policy
    from agents.runner import default_env_kwargs
    from agents.tiny import build_tiny_model
    from learner.pretrain import PretrainConfig, pretrain

    kwargs = default_env_kwargs(args.env_id, "window:0")
    base = build_tiny_model(envs.task_spec(args.env_id).modality, seed=args.seed)
    policies = {mode: Policy.from_pretrained(base) for mode in args.reasoning}
    per_step: dict[str, list[float]] = {mode: [] for mode in args.reasoning}
    for round_ in range(args.rounds):
        for mode in args.reasoning:
            marks: list[float] = []
            start = time.monotonic()
            pretrain(policies[mode], args.env_id, kwargs, PretrainConfig(steps=args.steps, reasoning=mode),
                     seed=args.seed + round_, on_step=lambda step, stats: marks.append(time.monotonic()))
            per_step[mode] += np.diff(marks).tolist()  # step k's time, k >= 1 (the first one warms up)
            print(f"round {round_ + 1}/{args.rounds} {mode}: {time.monotonic() - start:.1f} s with held-out losses",
                  file=sys.stderr, flush=True)
    first = float(np.median(per_step[args.reasoning[0]]))
    print(f"{'reasoning':<12} {'steps':>6} {'s/step (median)':>16} {'vs ' + args.reasoning[0]:>14}")
    for mode in args.reasoning:
        med = float(np.median(per_step[mode]))
        print(f"{mode:<12} {len(per_step[mode]):>6} {med:>16.3f} {med / first:>14.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
