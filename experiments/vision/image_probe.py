"""The safe-move probe of an image task's evaluation, with the transcriptions of its replies.

    python experiments/vision/image_probe.py runs/<vision run>                 # its final evaluation
    python experiments/vision/image_probe.py runs/<vision run> --phase baseline

The safe-move probe (``turn_diagnostics`` of FrozenLake: how often the policy takes the safe move
where exactly one of Down/Right is a hole; 0.5 = board-blind) reads the board from each turn's
observation text, which an image task's observation does not show. ``train.py`` evaluations
replay each episode on the task to rebuild the boards (``learner.report.replayed_state_turns``:
the record's task seed, its replies, ``render_text()`` of every state; it checks that each
replayed episode ends with the record's return), and this script does the same for any run
folder, archived ones included (``records.jsonl.gz``; the images are not needed). Prints the probe
with a 95% Wilson interval (the interval the summaries use) and the task success, beside the
counts. Where replies transcribe the image before they answer (``--reasoning state``), it also
prints how often the think tag is the turn's board exactly and how often it puts the player on
its cell.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

import envs
from agents.record import load_records
from agents.evaluate import wilson_interval
from envs.base import extract_tag
from envs.frozenlake import parse_board
from learner.report import replayed_state_turns


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
    args = parser.parse_args(argv)
    print(f"{'run':<34} {'episodes':>8} {'success':>8} {'probe states':>12} {'safe-move probe':>16} {'95% CI':>15} "
          f"{'transcribed':>11} {'player':>6}")
    for run in args.runs:
        config = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
        folder = run / "eval" / args.phase
        if not (folder / "records.jsonl").exists() and not (folder / "records.jsonl.gz").exists():
            raise SystemExit(f"{folder}: no evaluation records (runs save them for the baseline and final evaluations)")
        records = load_records(folder, images=False)
        try:
            turns = replayed_state_turns(config["env_id"], dict(config.get("env_kwargs") or {}), records)
        except ValueError as exc:
            raise SystemExit(f"{run}: {exc}") from exc
        diag = envs.task_class(config["env_id"]).turn_diagnostics(turns)
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
