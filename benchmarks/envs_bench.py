"""Environment throughput, and freshper's Sokoban generator side by side with gym-sokoban's.

    .venv/bin/python benchmarks/envs_bench.py            # full run (~1-2 min on 2 cores)
    .venv/bin/python benchmarks/envs_bench.py --quick    # shorter timings, fewer peer levels
    .venv/bin/python benchmarks/envs_bench.py --no-peer  # skip the gym-sokoban comparison

Part 1 times every (task, mode) case in ``CASES``: resets/s (for Sokoban a reset generates a
level) and episodes/s of random legal replies to the end. Add a task by appending a ``Case``.

Part 2 times ``generate_room(dim, num_boxes)`` of gym-sokoban 0.0.6 (the generator ROLL and
RAGEN use), installed into a throw-away venv (``.cache/bench_venv_envs``, never a project
dependency) and run in a subprocess, against freshper's generator with the preset's solution
cap. gym-sokoban's ``RuntimeWarning("score == 0")`` is retried, as its env does on reset.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import venv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

import gymnasium

import envs  # noqa: F401  (registers the tasks)
from envs.sokoban import PRESETS, generate_room

PEER_VENV = ROOT / ".cache" / "bench_venv_envs"
PEER_REQUIREMENTS = ["gym-sokoban==0.0.6", "gym==0.26.2", "numpy<2"]


@dataclass(frozen=True)
class Case:
    """One row of the throughput table: a registered task, a render mode label and kwargs."""

    task: str
    mode: str  # "text" or "image": what the agent observes
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.kwargs.items())
        return f"{self.task}[{extra}]" if extra else self.task


# The table of cases; other tasks (FrozenLake, ...) append their rows here.
CASES: list[Case] = [
    Case("freshper/Sokoban-v0", "text", {"preset": p}) for p in ("simple", "hard", "large")
] + [Case("freshper/SokobanVision-v0", "image", {"preset": p}) for p in ("simple", "hard", "large")]
# FrozenLake: 4x4 (the trained default) and 8x8; a reset draws a new random map.
CASES += [Case("freshper/FrozenLake-v0", "text", {"size": n}) for n in (4, 8)]
CASES += [Case("freshper/FrozenLakeVision-v0", "image", {"size": n}) for n in (4, 8)]

# (room size incl. walls, boxes, freshper preset, gym-sokoban levels to time in quick/full runs)
PEER_CASES: list[tuple[int, int, str, int, int]] = [
    (6, 1, "simple", 50, 300),
    (8, 2, "hard", 10, 40),
    (10, 3, "large", 1, 3),
]

_PEER_SCRIPT = """
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import numpy as np
from gym_sokoban.envs.room_utils import generate_room
dim, boxes, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
np.random.seed(0)
retries = 0
t0 = time.perf_counter()
for _ in range(n):
    while True:
        try:
            generate_room(dim=(dim, dim), num_boxes=boxes)
            break
        except (RuntimeError, RuntimeWarning):
            retries += 1
print(json.dumps({"seconds": time.perf_counter() - t0, "levels": n, "retries": retries}))
"""


def random_reply(env: gymnasium.Env, rng: np.random.Generator) -> str:
    """A random legal move in the task's reply format (falls back to a fixed reply)."""
    base = env.unwrapped
    if hasattr(base, "legal_actions") and hasattr(base, "format_reply"):
        actions = base.legal_actions()
        return base.format_reply(actions[int(rng.integers(len(actions)))])
    return "<answer>0</answer>"


def time_case(case: Case, seconds: float) -> dict[str, float]:
    """Resets/s and episodes/s (random legal replies) of one case, each for ~``seconds``."""
    env = gymnasium.make(case.task, **case.kwargs)
    rng = np.random.default_rng(0)
    env.reset(seed=0)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        env.reset(seed=n)
        n += 1
    resets = n / (time.perf_counter() - t0)
    episodes, steps, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        env.reset(seed=episodes)
        done = False
        while not done:
            _, _, term, trunc, _ = env.step(random_reply(env, rng))
            steps += 1
            done = term or trunc
        episodes += 1
    elapsed = time.perf_counter() - t0
    return {"resets_per_s": resets, "episodes_per_s": episodes / elapsed, "steps_per_s": steps / elapsed}


def ensure_peer_venv() -> Path | None:
    """Python of the throw-away gym-sokoban venv, created on first use; None if it cannot be."""
    python = PEER_VENV / "bin" / "python"
    check = [str(python), "-c", "import gym_sokoban.envs.room_utils"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"creating {PEER_VENV} with {' '.join(PEER_REQUIREMENTS)} ...", flush=True)
    try:
        venv.create(PEER_VENV, with_pip=True, clear=True)
        pip = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *PEER_REQUIREMENTS], capture_output=True, text=True, timeout=900
        )
        if pip.returncode != 0:
            print(f"gym-sokoban install failed, skipping the comparison:\n{pip.stderr[-2000:]}")
            return None
        probe = subprocess.run(check, capture_output=True, text=True)
        if probe.returncode != 0:
            print(f"gym-sokoban does not import, skipping the comparison:\n{probe.stderr[-2000:]}")
            return None
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"could not create the gym-sokoban venv ({exc}); skipping the comparison")
        return None
    return python


def time_peer(python: Path, dim: int, boxes: int, n: int) -> float | None:
    """gym-sokoban ms per level, or None if the run failed."""
    try:
        out = subprocess.run(
            [str(python), "-c", _PEER_SCRIPT, str(dim), str(boxes), str(n)],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        print(f"gym-sokoban {dim}x{dim}/{boxes} timed out")
        return None
    if out.returncode != 0:
        print(f"gym-sokoban {dim}x{dim}/{boxes} failed:\n{out.stderr[-1500:]}")
        return None
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return 1000.0 * result["seconds"] / result["levels"]


def time_freshper_generator(preset: str, seconds: float) -> tuple[float, int, int]:
    """freshper ms per level, levels timed, and the largest optimal solution seen (moves)."""
    p = PRESETS[preset]
    rng = np.random.default_rng(0)
    n, worst, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 5:
        room = generate_room(rng, p.size[0], p.size[1], p.num_boxes, p.max_solution_moves)
        worst = max(worst, room.optimal_moves)
        n += 1
    return 1000.0 * (time.perf_counter() - t0) / n, n, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter timings and fewer gym-sokoban levels")
    parser.add_argument("--no-peer", action="store_true", help="skip the gym-sokoban comparison")
    parser.add_argument("--seconds", type=float, default=None, help="seconds per timing (default 2, quick 0.5)")
    args = parser.parse_args()
    seconds = args.seconds or (0.5 if args.quick else 2.0)

    print("| task | mode | resets/s (levels/s) | episodes/s (random moves) | steps/s |")
    print("|---|---|---:|---:|---:|")
    for case in CASES:
        r = time_case(case, seconds)
        print(
            f"| {case.label} | {case.mode} | {r['resets_per_s']:.0f} | {r['episodes_per_s']:.0f} | {r['steps_per_s']:.0f} |",
            flush=True,
        )

    python = None if args.no_peer else ensure_peer_venv()
    print()
    print("| room, boxes | gym-sokoban 0.0.6 ms/level | freshper ms/level | speed-up | freshper cap / max_turns (max optimal seen) |")
    print("|---|---:|---:|---:|---|")
    for dim, boxes, preset, n_quick, n_full in PEER_CASES:
        ours, n, worst = time_freshper_generator(preset, seconds)
        peer = time_peer(python, dim, boxes, n_quick if args.quick else n_full) if python else None
        p = PRESETS[preset]
        peer_s = f"{peer:.1f}" if peer is not None else "n/a"
        ratio = f"{peer / ours:.0f}x" if peer is not None else "n/a"
        print(
            f"| {dim}x{dim}, {boxes} | {peer_s} | {ours:.2f} | {ratio} | "
            f"{p.max_solution_moves} / {p.max_turns} moves ({worst}, {n} levels) |",
            flush=True,
        )


if __name__ == "__main__":
    main()
