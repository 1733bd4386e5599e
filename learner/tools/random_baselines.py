"""Scores of policies that read nothing, on the held-out tasks every evaluation uses.

    python -m learner.tools random-baselines --episodes 200
    python -m learner.tools random-baselines --tasks freshper/Sokoban-v0 --env-kwargs '{"max_solution_moves": 4}'

Per task: the random agent (``sample_reply``: a uniformly drawn effective action each turn, the
random well-formed replies the embedded model is pretrained on), where the task skips no-op
moves there (Sokoban) a uniformly drawn legal move beside it, and, for FrozenLake, the
board-blind Down/Right habit (a random one of Down/Right each turn). Seeds are the held-out
evaluation seeds (``agents.rollout.seeds.EVAL_SEED_BASE`` on), so the numbers sit beside a run's final
evaluation. ``--env-kwargs`` (JSON) builds the tasks with those keyword arguments, e.g. the
easier levels of a curriculum (``train.py --train-env-kwargs``). Prints a table of success (95% Wilson interval) and mean return.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import envs
from agents.evaluate import wilson_interval
from agents.rollout.seeds import EVAL_SEED_BASE

TASKS = ["freshper/FrozenLake-v0", "freshper/Sokoban-v0", "freshper/SearchQA-v0"]


def play(env_id: str, episodes: int, choose, kwargs: dict | None = None) -> tuple[float, tuple[float, float], float]:
    env = envs.make(env_id, **(kwargs or {}))
    rng = np.random.default_rng(0)
    wins, returns = 0, []
    for k in range(episodes):
        env.reset(seed=EVAL_SEED_BASE + k)
        total, done, info = 0.0, False, {}
        while not done:
            _, r, term, trunc, info = env.step(choose(env.unwrapped, rng))
            total += r
            done = term or trunc
        wins += bool(info.get("success"))
        returns.append(total)
    env.close()
    return wins / episodes, wilson_interval(wins, episodes), float(np.mean(returns))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--tasks", nargs="*", default=TASKS)
    parser.add_argument("--env-kwargs", type=json.loads, default=None, metavar="JSON",
                        help="keyword arguments of every task in --tasks")
    args = parser.parse_args(argv)
    rows = []
    for env_id in args.tasks:
        rows.append((env_id, "random agent (sample_reply)", *play(env_id, args.episodes, lambda t, rng: t.sample_reply(rng),
                                                                    args.env_kwargs)))
        probe = envs.make(env_id, **(args.env_kwargs or {}))
        skips = probe.unwrapped.skips_noop_moves()
        probe.close()
        if skips:  # the task's random replies skip no-op moves: every legal move beside them
            rows.append((env_id, "random legal move (no-ops too)", *play(
                env_id, args.episodes, lambda t, rng: t.format_reply(t.legal_actions()[int(rng.integers(len(t.legal_actions())))]),
                args.env_kwargs)))
        if "FrozenLake" in env_id:
            rows.append((env_id, "random Down/Right", *play(
                env_id, args.episodes, lambda t, rng: t.format_reply(("Down", "Right")[int(rng.integers(2))]),
                args.env_kwargs)))
    print(f"held-out seeds {EVAL_SEED_BASE}..+{args.episodes - 1}\n")
    print(f"{'task':<28} {'policy':<30} {'success':>8}  {'95% CI':<16} {'return':>7}")
    for env_id, name, rate, (lo, hi), ret in rows:
        print(f"{env_id:<28} {name:<30} {rate:8.3f}  [{lo:.3f}, {hi:.3f}]  {ret:7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
