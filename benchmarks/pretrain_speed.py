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

import numpy as np
import torch

from envs.capabilities import REASONINGS


def interleaved_step_seconds(jobs: dict, env_id: str, kwargs: dict, rounds: int, seed: int = 0,
                             log: bool = False) -> dict[str, list[float]]:
    """Seconds of every pretraining step (``learner.pretrain``) of each ``jobs[name] = (policy,
    PretrainSettings)``, the jobs taking turns for ``rounds`` rounds (round ``k`` with seed
    ``seed + k``) so they share the machine's load. The first step of a round warms up and is
    left out, and so are the held-out losses ``pretrain`` measures before and after."""
    from learner.pretrain import pretrain

    per_step: dict[str, list[float]] = {name: [] for name in jobs}
    for round_ in range(rounds):
        for name, (policy, cfg) in jobs.items():
            marks: list[float] = []
            start = time.monotonic()
            pretrain(policy, env_id, kwargs, cfg, seed=seed + round_, on_step=lambda step, stats: marks.append(time.monotonic()))
            per_step[name] += np.diff(marks).tolist()
            if log:
                print(f"round {round_ + 1}/{rounds} {name}: {time.monotonic() - start:.1f} s with held-out losses",
                      file=sys.stderr, flush=True)
    return per_step


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
    from agents.policies.policy import Policy
    from agents.rollout.runner import default_env_kwargs
    from agents.policies.tiny import build_tiny_model
    from learner.pretrain import PretrainSettings

    kwargs = default_env_kwargs(args.env_id, "window:0")
    base = build_tiny_model(envs.task_spec(args.env_id).modality, seed=args.seed)
    jobs = {mode: (Policy.from_pretrained(base), PretrainSettings(steps=args.steps, reasoning=mode)) for mode in args.reasoning}
    per_step = interleaved_step_seconds(jobs, args.env_id, kwargs, args.rounds, seed=args.seed, log=True)
    first = float(np.median(per_step[args.reasoning[0]]))
    print(f"{'reasoning':<12} {'steps':>6} {'s/step (median)':>16} {'vs ' + args.reasoning[0]:>14}")
    for mode in args.reasoning:
        med = float(np.median(per_step[mode]))
        print(f"{mode:<12} {len(per_step[mode]):>6} {med:>16.3f} {med / first:>14.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
