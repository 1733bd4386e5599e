"""Sokoban evaluations by how many moves each level needs: where a policy's solved rate comes from.

    python benchmarks/sokoban_by_length.py runs/<run>/eval/baseline runs/<run>/eval/final [--random 5]

Reads saved evaluation records (``records.jsonl`` of a run's ``eval/<phase>`` folder), rebuilds
each record's level from its task seed (the env's ``optimal_moves``: the shortest solution's
length) and prints, per folder, the solved rate in three bands of that length, beside the task's
own turn diagnostics (``noop_rate``: moves that changed nothing; ``lookahead_exact`` where the
replies write one). ``--random N`` also plays the random agent (a random move that changes the
state, ``sample_reply``) N times on each level of the first folder: the same levels, the
reference any learned policy should beat.

With 10 moves allowed, a level that needs 7-8 leaves room for two or three wasted moves, so
the overall rate says little about which levels a policy solves; the bands do.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import envs  # noqa: E402
from agents.record import load_records  # noqa: E402
from envs.sokoban.env import SokobanEnv  # noqa: E402
from agents.evaluate import wilson_interval  # noqa: E402

BANDS = ((2, 4), (5, 6), (7, 8))


def band(moves: int) -> str:
    for lo, hi in BANDS:
        if lo <= moves <= hi:
            return f"{lo}-{hi}"
    return f"{moves}"


class Levels:
    """The shortest solution's length of each task seed, from the env itself (cached)."""

    def __init__(self, env_kwargs: dict) -> None:
        self.env = envs.make("freshper/Sokoban-v0", **env_kwargs)
        self.moves: dict[int, int] = {}

    def __call__(self, seed: int) -> int:
        if seed not in self.moves:
            _, info = self.env.reset(seed=seed)
            self.moves[seed] = int(info["optimal_moves"])
        return self.moves[seed]


def _row(name: str, by: dict[str, list[bool]], extra: str = "") -> str:
    cells = []
    for lo, hi in BANDS:
        v = by.get(f"{lo}-{hi}", [])
        cells.append(f"{np.mean(v):.3f} (n={len(v)})" if v else "n/a")
    every = [x for v in by.values() for x in v]
    lo, hi = wilson_interval(sum(every), len(every)) if every else (math.nan, math.nan)
    overall = f"{np.mean(every):.3f} [{lo:.3f}, {hi:.3f}]" if every else "n/a"
    return f"{name:<44} " + " ".join(f"{c:>15}" for c in cells) + f" {overall:>22} {extra}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="eval/<phase> folders of Sokoban runs")
    parser.add_argument("--random", type=int, default=0, help="also the random agent, N episodes per level")
    parser.add_argument("--env-kwargs", default='{"preset": "simple", "feedback": false, "board": "letters"}')
    args = parser.parse_args(argv)
    import json

    env_kwargs = json.loads(args.env_kwargs)
    levels = Levels(env_kwargs)
    print(f"{'records':<44} " + " ".join(f"{f'{lo}-{hi} moves':>15}" for lo, hi in BANDS)
          + f" {'all [95% CI]':>22} task diagnostics")
    seeds: list[int] = []
    for folder in args.folders:
        records = [r for r in load_records(folder) if not r.failed]
        if not records:
            raise SystemExit(f"no records in {folder}")
        by: dict[str, list[bool]] = defaultdict(list)
        for rec in records:
            by[band(levels(rec.seed))].append(bool(rec.success))
        seeds = seeds or sorted({r.seed for r in records})
        diag = SokobanEnv.turn_diagnostics([(t.observation, t.reply) for r in records for t in r.turns])
        extra = f"no-op {diag['noop_rate']:.3f}" + (f", lookahead exact {diag['lookahead_exact']:.3f}" if "lookahead_exact" in diag else "")
        print(_row(str(folder)[-44:], by, extra))
    if args.random:
        rng = np.random.default_rng(0)
        env = envs.make("freshper/Sokoban-v0", **env_kwargs)
        by = defaultdict(list)
        for seed in seeds:
            for _ in range(args.random):
                env.reset(seed=seed)
                done, info = False, {}
                while not done:
                    _, _, terminated, truncated, info = env.step(env.unwrapped.sample_reply(rng))
                    done = terminated or truncated
                by[band(levels(seed))].append(bool(info["success"]))
        print(_row(f"random agent, {args.random} per level", by))


if __name__ == "__main__":
    main()
