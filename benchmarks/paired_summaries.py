"""Paired difference of two settings' final held-out success over the same seeds.

    python benchmarks/paired_summaries.py docs/data/fl_credit/gigpo_s{0..4}/summary_400.json \
        -- docs/data/fl_credit/episode_s{0..4}/summary_400.json

The summaries before ``--`` (setting A) and after it (setting B) pair in order, one seed each;
the seed in each run's ``config.yaml`` must agree. Prints each pair's final sampled success and
difference, then the mean difference A - B with its 95% t-interval over seeds
(``learner.report.seed_interval``, the interval every table of the docs uses).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from learner.report import seed_interval  # noqa: E402


def final_success(summary: Path) -> tuple[int | None, float]:
    config = summary.parent / "config.yaml"
    seed = yaml.safe_load(config.read_text(encoding="utf-8")).get("seed") if config.exists() else None
    return seed, float(json.loads(summary.read_text(encoding="utf-8"))["evals"]["final"]["success"])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--" not in args:
        raise SystemExit(__doc__)
    cut = args.index("--")
    a, b = [Path(p) for p in args[:cut]], [Path(p) for p in args[cut + 1:]]
    if not a or len(a) != len(b):
        raise SystemExit(f"need the same number of summaries on both sides of --, got {len(a)} and {len(b)}")
    diffs = []
    for pa, pb in zip(a, b):
        (sa, fa), (sb, fb) = final_success(pa), final_success(pb)
        if sa != sb:
            raise SystemExit(f"{pa} (seed {sa}) and {pb} (seed {sb}) are not the same seed")
        diffs.append(fa - fb)
        print(f"seed {sa}: {fa:.3f} - {fb:.3f} = {fa - fb:+.3f}")
    lo, hi = seed_interval(diffs)
    print(f"paired A - B over {len(diffs)} seeds: {sum(diffs) / len(diffs):+.3f} [{lo:+.3f}, {hi:+.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
