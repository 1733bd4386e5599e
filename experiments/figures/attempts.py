"""Success by question and by attempt in a figure task's evaluation episodes.

    python experiments/figures/attempts.py runs/<run>/eval/baseline/records.jsonl runs/<run>/eval/selected/records.jsonl \\
        <swapped evaluation>/records.jsonl

For each ``records.jsonl`` (``agents.evaluate --save`` or a run's ``eval/<phase>/``): per question
kind (ChartQA's largest, smallest, value; read from the first observation's words), the share of
episodes answered right at the first attempt and the share answered right at all. With two
attempts a picture-blind policy that changes its answer after "not correct" succeeds far more
often than at its first attempt, so the first attempt is the measure of reading the picture.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def kind(observation: str) -> str:
    return "largest" if "largest" in observation else "smallest" if "smallest" in observation else "value"


def tally(path: Path) -> dict[str, list[int]]:
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # episodes, right at once, right at all
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        turns = record["turns"]
        at_once = bool(record["success"]) and len(turns) == 1
        for key in (kind(turns[0]["observation"]), "all"):
            counts[key][0] += 1
            counts[key][1] += at_once
            counts[key][2] += bool(record["success"])
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="+", type=Path)
    args = parser.parse_args()
    print(f"{'records':<60} {'question':<9} {'episodes':>8} {'first attempt':>13} {'success':>8}")
    for path in args.records:
        for key, (n, once, ever) in sorted(tally(path).items()):
            print(f"{str(path):<60} {key:<9} {n:>8} {once / n:>13.3f} {ever / n:>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
