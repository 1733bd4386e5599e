"""The safe-move probe of an image task's evaluation: replays each episode on the text task.

    python benchmarks/image_probe.py runs/<vision run>                 # its final evaluation
    python benchmarks/image_probe.py runs/<vision run> --phase baseline

The safe-move probe (``turn_diagnostics`` of FrozenLake: how often the policy takes the safe move
where exactly one of Down/Right is a hole; 0.5 = board-blind) reads the board from each turn's
observation text, and an image task's observations show none, so a run's summary has no probe
for it. The held-out tasks are seeded, so this script rebuilds each turn's board: it resets the
text task (``--text-env``, by default the run's env id without ``Vision``, with the run's
``env_kwargs``) on the record's task seed and steps it with the record's replies, checks that the
replayed episode ends with the record's return, and scores the probe on the rebuilt boards with
the record's replies. Prints the probe with a 95% Wilson interval (the interval the summaries
use) and the task success, beside the counts. Where replies transcribe the image before they
answer (``--reasoning state``), it also prints how often the think tag is the turn's board
exactly and how often it puts the player on its cell. Reads ``eval/<phase>/records.jsonl`` or, in an
archived run, ``records.jsonl.gz`` (the images are not needed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import envs  # noqa: E402
from agents.record import load_records  # noqa: E402
from agents.evaluate import wilson_interval  # noqa: E402
from envs.base import extract_tag  # noqa: E402
from envs.frozenlake import parse_board  # noqa: E402


def rebuilt_turns(records, text_env_id: str, env_kwargs: dict) -> list[tuple[str, str]]:
    """(text observation, reply) of every turn of ``records``, replayed on the text task."""
    env = envs.make(text_env_id, **env_kwargs)
    turns: list[tuple[str, str]] = []
    for rec in records:
        obs, _ = env.reset(seed=int(rec.seed))
        total = 0.0
        for turn in rec.turns:
            turns.append((obs["text"] if isinstance(obs, dict) else obs, turn.reply))
            obs, reward, terminated, truncated, _ = env.step(turn.reply)
            total += float(reward)
            if terminated or truncated:
                break
        if abs(total - float(rec.episode_return)) > 1e-6:
            raise SystemExit(f"episode of task seed {rec.seed}: the text task returns {total} for its replies, "
                             f"the record {rec.episode_return}; {text_env_id} with {env_kwargs} is not this "
                             "task's twin")
    return turns


def transcribed_exactly(turns: list[tuple[str, str]]) -> tuple[int, int, int]:
    """(turns whose reply has a think tag, of those the ones whose tag is the turn's state text
    exactly, cell for cell, and the ones that put the player, alone, on its cell): how well a
    ``--reasoning state`` policy transcribes what it is shown."""
    thought = exact = player = 0
    for observation, reply in turns:
        think = extract_tag(reply, "think") if isinstance(reply, str) else None
        if think is None:
            continue
        thought += 1
        board, truth = parse_board(think), parse_board(observation)
        exact += board is not None and board == truth
        if board is not None and truth is not None:
            cells = lambda b: [(r, c) for r, row in enumerate(b) for c, ch in enumerate(row) if ch == "P"]  # noqa: E731
            player += cells(board) == cells(truth)
    return thought, exact, player


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--phase", default="final", help="evaluation folder under eval/ (final, baseline, ...)")
    parser.add_argument("--text-env", default=None, help="the text task to replay on (default: the id without 'Vision')")
    args = parser.parse_args(argv)
    print(f"{'run':<34} {'episodes':>8} {'success':>8} {'probe states':>12} {'safe-move probe':>16} {'95% CI':>15} "
          f"{'transcribed':>11} {'player':>6}")
    for run in args.runs:
        config = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
        folder = run / "eval" / args.phase
        if not (folder / "records.jsonl").exists() and not (folder / "records.jsonl.gz").exists():
            raise SystemExit(f"{folder}: no evaluation records (runs save them for the baseline and final evaluations)")
        records = load_records(folder, images=False)
        text_env = args.text_env or config["env_id"].replace("Vision", "")
        kwargs = dict(config.get("env_kwargs") or {})
        turns = rebuilt_turns(records, text_env, kwargs)
        diag = envs.task_class(text_env).turn_diagnostics(turns)
        thought, exact, player = transcribed_exactly(turns)
        n = int(diag.get("probe_down_right", 0))
        safe = round(diag.get("probe_safe_rate", float("nan")) * n) if n else 0
        low, high = wilson_interval(safe, n) if n else (float("nan"), float("nan"))
        success = sum(r.success for r in records) / len(records)
        print(f"{run.parent.name + '/' + run.name:<34} {len(records):8d} {success:8.3f} {n:12d} "
              f"{diag.get('probe_safe_rate', float('nan')):16.2f} {f'[{low:.2f}, {high:.2f}]':>15} "
              f"{f'{exact / thought:.2f}' if thought else '-':>11} {f'{player / thought:.2f}' if thought else '-':>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
