"""Paired difference of two settings' final held-out success over the same seeds.

    python -m learner.tools paired-summaries docs/data/fl_credit/gigpo_s{0..4}/summary_400.json \
        -- docs/data/fl_credit/episode_s{0..4}/summary_400.json

The summaries before ``--`` (setting A) and after it (setting B) pair in order, one seed each;
the seed in each run's ``config.yaml`` must agree. Prints each pair's final sampled success and
difference, then the mean difference A - B with its 95% t-interval over seeds
(``learner.report.seed_interval``, the interval every table of the docs uses).

``--phase-a/--phase-b selected`` compare the policy a run delivered (``--select best``; the
last iteration's where that validated best) instead of the last iteration's, e.g. both of the
same runs:

    python -m learner.tools paired-summaries --phase-a selected --bar 0.60,0.75 \
        docs/data/select/seed_s{0..4}/summary.json -- docs/data/select/seed_s{0..4}/summary.json

``--bar S,P`` also counts the runs of each side whose success is >= S and safe-move probe >= P.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from learner.report import seed_interval


def evaluation(summary: Path, phase: str = "final") -> tuple[int | None, dict]:
    """The run's seed and its ``phase`` evaluation (``selected`` falls back to ``final``)."""
    config = summary.parent / "config.yaml"
    seed = yaml.safe_load(config.read_text(encoding="utf-8")).get("seed") if config.exists() else None
    evals = json.loads(summary.read_text(encoding="utf-8"))["evals"]
    return seed, evals.get(phase) or evals["final"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    options = {"--phase-a": "final", "--phase-b": "final", "--bar": None}
    for flag in options:  # options go before the "--"
        head = args[:args.index("--")] if "--" in args else args
        if flag in head:
            k = head.index(flag)
            options[flag] = args[k + 1]
            del args[k:k + 2]
    if "--" not in args:
        raise SystemExit(__doc__)
    cut = args.index("--")
    a, b = [Path(p) for p in args[:cut]], [Path(p) for p in args[cut + 1:]]
    if not a or len(a) != len(b):
        raise SystemExit(f"need the same number of summaries on both sides of --, got {len(a)} and {len(b)}")
    bar = None if options["--bar"] is None else tuple(float(x) for x in options["--bar"].split(","))
    diffs, meets = [], [0, 0]
    for pa, pb in zip(a, b):
        (sa, ea), (sb, eb) = evaluation(pa, options["--phase-a"]), evaluation(pb, options["--phase-b"])
        if sa != sb:
            raise SystemExit(f"{pa} (seed {sa}) and {pb} (seed {sb}) are not the same seed")
        fa, fb = float(ea["success"]), float(eb["success"])
        diffs.append(fa - fb)
        line = f"seed {sa}: {fa:.3f} - {fb:.3f} = {fa - fb:+.3f}"
        if bar is not None:
            ok = [e["success"] >= bar[0] and e.get("probe_safe_rate", float("nan")) >= bar[1] for e in (ea, eb)]
            meets = [m + int(o) for m, o in zip(meets, ok)]
            line += (f"   probes {ea.get('probe_safe_rate', float('nan')):.2f} / {eb.get('probe_safe_rate', float('nan')):.2f}"
                     f", meets {bar[0]:.2f} and probe {bar[1]:.2f}: {'yes' if ok[0] else 'no'} / {'yes' if ok[1] else 'no'}")
        print(line)
    lo, hi = seed_interval(diffs)
    print(f"paired A - B over {len(diffs)} seeds: {sum(diffs) / len(diffs):+.3f} [{lo:+.3f}, {hi:+.3f}]")
    if bar is not None:
        print(f"meet the bar: A {meets[0]} of {len(diffs)}, B {meets[1]} of {len(diffs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
