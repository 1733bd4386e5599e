"""Where two runs of one seed part: the first iteration whose training return differs.

    python -m learner.tools first-divergence docs/data/shipped/seed_s0 docs/data/fl_credit/episode_s0

Reads both runs' ``metrics.jsonl`` (or ``.gz``) and prints the largest loss difference over the
iterations before they part (floating-point summation order, e.g. 1 vs 2 threads) and the first
iteration where the sampled episodes' mean return differs (a sampled token flipped).
"""

from __future__ import annotations

import sys
from pathlib import Path

from learner.report import read_metrics


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit(__doc__)
    a, b = ({r["iteration"]: r for r in read_metrics(Path(p) / "metrics.jsonl") if r.get("kind") == "train"}
            for p in argv)
    common = sorted(set(a) & set(b))
    first = next((i for i in common if a[i]["return_mean"] != b[i]["return_mean"]), None)
    before = [i for i in common if first is None or i < first]
    gap = max((abs(a[i]["loss"] - b[i]["loss"]) for i in before), default=0.0)
    print(f"{len(common)} common iterations; largest loss difference before they part: {gap:.2e}")
    print(f"first iteration with a different mean return: {first}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
