"""Sokoban evaluations by how many moves each level needs: where a policy's solved rate comes from.

    python experiments/sokoban/sokoban_by_length.py runs/<run>/eval/baseline runs/<run>/eval/final [--random 5]

Reads saved evaluation records (``records.jsonl`` of a run's ``eval/<phase>`` folder), rebuilds
each record's level from its task seed (the env's ``optimal_moves``: the shortest solution's
length) and prints, per folder, the solved rate in three bands of that length, beside the task's
own turn diagnostics (``noop_rate``: moves that changed nothing; ``lookahead_exact`` where the
replies write one) and how purposeful the moves that changed the state were: the share of plain
steps that brought the player closer to the box, and of pushes that brought the box closer to
its goal (Manhattan distances; one-box levels). ``--random N`` also plays the random agent (a random move that changes the
state, ``sample_reply``) N times on each level of the first folder: the same levels, the
reference any learned policy should beat. ``--scripted N`` plays three scripted agents the same way
(``scripted_move``): one that follows the aim's words (what using them is worth), one that
walks to the cell behind the box before pushing (what knowing where to stand adds), and one that
does exactly what the ``--reasoning subgoal`` words say (what following them is worth).
``--by-purpose`` also splits each folder's solved
rate by how purposeful an episode's steps were (does the reward favour stepping towards the box?).

With 10 moves allowed, a level that needs 7-8 leaves room for two or three wasted moves, so
the overall rate says little about which levels a policy solves; the bands do.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

import envs
from agents.evaluate import wilson_interval
from agents.record import load_records
from envs.base import extract_tag
from envs.sokoban.env import (ACTIONS, SokobanEnv, aim_words, blocked_move, lookahead_words, move_deltas, subgoal_moves,
                              move_index, parse_observed_board)

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


def _manhattan(a: int, b: int, width: int) -> int:
    return abs(a // width - b // width) + abs(a % width - b % width)


def progress(turns: list[tuple[str, str]]) -> dict[str, float]:
    """How purposeful the moves are (one box): ``towards_box``, the share of plain steps (no push)
    that bring the player closer to the box (Manhattan distance), and ``push_to_goal``, the share
    of pushes that bring the box closer to the goal (the random agent's shares are the reference)."""
    steps = closer = pushes = to_goal = 0
    for observation, reply in turns:
        level = parse_observed_board(observation or "")
        move = move_index(extract_tag(reply)) if isinstance(reply, str) else None
        if level is None or move is None or level.num_boxes != 1:
            continue
        width = level.width
        delta = move_deltas(width)[move]
        box, player = level.boxes[0], level.player
        if blocked_move(level.walls, level.box_mask(), player, delta) is not None:
            continue
        goal = int(np.flatnonzero(level.goals)[0])
        if player + delta == box:
            pushes += 1
            to_goal += _manhattan(box + delta, goal, width) < _manhattan(box, goal, width)
        else:
            steps += 1
            closer += _manhattan(player + delta, box, width) < _manhattan(player, box, width)
    return {"towards_box": closer / steps if steps else math.nan, "push_to_goal": to_goal / pushes if pushes else math.nan,
            "pushes": float(pushes)}


def solved_by_purpose(episodes: list[tuple[list[tuple[str, str]], bool]]) -> dict[str, tuple[float, int]]:
    """Whether the reward favours purposeful moves: the solved rate (and count) of the episodes
    whose plain steps go towards the box at least three times in four (``purposeful``), and of
    those where under half do (``aimless``); episodes without a plain step count in neither."""
    groups: dict[str, list[bool]] = {"purposeful": [], "aimless": []}
    for turns, success in episodes:
        share = progress(turns)["towards_box"]
        if share >= 0.75:
            groups["purposeful"].append(success)
        elif share < 0.5:
            groups["aimless"].append(success)
    return {k: (float(np.mean(v)) if v else math.nan, len(v)) for k, v in groups.items()}


def scripted_move(observation: str, kind: str, rng: np.random.Generator) -> str:
    """A scripted agent's move, read off the observed board (one box). ``subgoal`` does what
    :func:`subgoal_words` say: the push on the push spot, else a plain step the ``stand`` words
    name, else a random state-changing move. The other two push a box when the
    push brings it closer to its goal; otherwise ``aim`` takes a plain step named in the aim's
    ``box`` words (:func:`aim_words`: towards the box), ``spot`` a plain step that brings the
    player closer to a push spot (the cell behind the box, opposite a direction of its goal);
    else a random state-changing move. Neither plans a path around walls. ``aim`` is what the
    words ``--reasoning aim`` writes are worth when followed; ``spot`` shows what knowing where
    to stand adds."""
    level = parse_observed_board(observation)
    if level is None or level.num_boxes != 1:
        raise ValueError("scripted_move needs a one-box Sokoban board")
    width, boxes, player = level.width, level.box_mask(), level.player
    box, goal = level.boxes[0], int(np.flatnonzero(level.goals)[0])
    names = dict(zip(ACTIONS, move_deltas(width)))
    said = lookahead_words(level.walls, boxes, player, width).split()
    verdict = dict(zip(said[0::2], said[1::2]))
    moves = [m for m in ACTIONS if verdict[m] in ("move", "push")]
    pushes = [m for m in moves if verdict[m] == "push" and _manhattan(box + names[m], goal, width) < _manhattan(box, goal, width)]
    steps = [m for m in moves if verdict[m] == "move"]
    box_part, _, goal_part = aim_words(boxes, level.goals, player, width).partition(" goal")  # " box <dirs>", " <dirs>"
    box_words, goal_words = box_part.split()[1:], goal_part.split()
    if kind == "subgoal":  # the --reasoning subgoal words, followed: the push on the spot, else a named step
        return str(rng.choice(subgoal_moves(level.walls, boxes, level.goals, player, width) or moves))
    if kind == "aim":
        towards = [m for m in steps if m in box_words]
    elif kind == "spot":
        spots = [box - names[d] for d in goal_words]
        near = min(_manhattan(player, c, width) for c in spots)
        towards = [m for m in steps if min(_manhattan(player + names[m], c, width) for c in spots) < near]
    else:
        raise ValueError(f"kind must be aim, spot or subgoal, got {kind!r}")
    return str(rng.choice(pushes or towards or moves))


def _progress_text(turns: list[tuple[str, str]]) -> str:
    p = progress(turns)
    return f"steps towards the box {p['towards_box']:.2f}, pushes towards the goal {p['push_to_goal']:.2f} (n={int(p['pushes'])})"


def _row(name: str, by: dict[str, list[bool]], extra: str = "") -> str:
    cells = []
    for lo, hi in BANDS:
        v = by.get(f"{lo}-{hi}", [])
        cells.append(f"{np.mean(v):.3f} (n={len(v)})" if v else "n/a")
    every = [x for v in by.values() for x in v]
    lo, hi = wilson_interval(sum(every), len(every)) if every else (math.nan, math.nan)
    overall = f"{np.mean(every):.3f} [{lo:.3f}, {hi:.3f}]" if every else "n/a"
    return f"{name:<44} " + " ".join(f"{c:>15}" for c in cells) + f" {overall:>22} {extra}"


def play(env_kwargs: dict, seeds: list[int], episodes: int, reply,
         levels: Levels) -> tuple[dict[str, list[bool]], list[tuple[str, str]]]:
    """Play ``episodes`` episodes on each level seed, ``reply(env, observation_text, rng)``
    choosing every reply (one generator seeded 0 per agent); return the solved flags by band of
    the level's length and every (observation, reply) turn."""
    rng = np.random.default_rng(0)
    env = envs.make("freshper/Sokoban-v0", **env_kwargs)
    by: dict[str, list[bool]] = defaultdict(list)
    turns: list[tuple[str, str]] = []
    for seed in seeds:
        for _ in range(episodes):
            obs, _ = env.reset(seed=seed)
            done, info = False, {}
            while not done:
                text = reply(env.unwrapped, obs["text"], rng)
                turns.append((obs["text"], text))
                obs, _, terminated, truncated, info = env.step(text)
                done = terminated or truncated
            by[band(levels(seed))].append(bool(info["success"]))
    return by, turns


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="eval/<phase> folders of Sokoban runs")
    parser.add_argument("--random", type=int, default=0, help="also the random agent, N episodes per level")
    parser.add_argument("--scripted", type=int, default=0,
                        help="also the scripted agents of scripted_move (aim, spot, subgoal), N episodes per level each")
    parser.add_argument("--by-purpose", action="store_true",
                        help="also the solved rate of episodes whose steps go towards the box >= 3/4 of the time, and < 1/2")
    parser.add_argument("--env-kwargs", default='{"preset": "simple", "feedback": false, "board": "letters"}')
    args = parser.parse_args(argv)
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
        turns = [(t.observation, t.reply) for r in records for t in r.turns]
        diag = SokobanEnv.turn_diagnostics(turns)
        extra = f"no-op {diag['noop_rate']:.3f}" + (f", lookahead exact {diag['lookahead_exact']:.3f}" if "lookahead_exact" in diag else "") + (
            f", aim exact {diag['aim_exact']:.3f}" if "aim_exact" in diag else "") + (
            f", subgoal exact {diag['subgoal_exact']:.3f} followed {diag['subgoal_followed']:.3f} obeyed {diag['subgoal_obeyed']:.3f}" if "subgoal_exact" in diag else "")
        extra += f"; {_progress_text(turns)}"
        print(_row(str(folder)[-44:], by, extra))
        if args.by_purpose:
            split = solved_by_purpose([([(t.observation, t.reply) for t in r.turns], bool(r.success)) for r in records])
            print(f"{'':<44} solved: steps towards the box >= 3/4 {split['purposeful'][0]:.3f} (n={split['purposeful'][1]}),"
                  f" < 1/2 {split['aimless'][0]:.3f} (n={split['aimless'][1]})")
    agents = [(f"random agent, {args.random} per level", args.random, lambda env, text, rng: env.sample_reply(rng))]
    agents += [(f"scripted {kind}, {args.scripted} per level", args.scripted,
                lambda env, text, rng, kind=kind: SokobanEnv.format_reply(scripted_move(text, kind, rng)))
               for kind in ("aim", "spot", "subgoal")]
    for name, episodes, reply in agents:
        if episodes:
            by, turns = play(env_kwargs, seeds, episodes, reply, levels)
            print(_row(name, by, _progress_text(turns)))

if __name__ == "__main__":
    main()
