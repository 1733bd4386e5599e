"""``python -m learner.tools TOOL [ARGS]``: one command for the run tools.

    python -m learner.tools                      # the tools, one line each
    python -m learner.tools paper-table --help   # a tool's own options

A tool's name may be written with ``-`` or ``_`` (``paper-table``, ``paper_table``); each is also
``python -m learner.tools.<module>``.
"""

from __future__ import annotations

import importlib
import sys

#: command name -> (module under learner.tools, what it does); the former ``benchmarks/<module>.py``
TOOLS = {
    "sweep": ("sweep", "run settings x seeds of train.py side by side, resumably, and compare them"),
    "paper-table": ("paper_table", "on-policy vs PER vs FreshPER vs uniform replay: run and write a results page"),
    "paired-summaries": ("paired_summaries", "paired difference of two settings' final success over the same seeds"),
    "spread-curves": ("spread_curves", "held-out success and action spread along training, per run"),
    "run-stats": ("run_stats", "what a run's training iterations looked like, one line per run"),
    "first-divergence": ("first_divergence", "the first iteration where two runs of one seed part"),
    "buffer-drift": ("buffer_drift", "how far the policy has drifted from its replay buffer, by age"),
    "update-directions": ("update_directions", "how a run's weights moved between consecutive checkpoints"),
    "policy-probe": ("policy_probe", "what a saved model's moves depend on (the policy diagnostics)"),
    "random-baselines": ("random_baselines", "scores of policies that read nothing, on the held-out tasks"),
    "archive": ("archive", "pack finished runs into light folders (docs/data's form) the tools read as they are"),
}


def usage() -> str:
    width = max(map(len, TOOLS))
    lines = ["usage: python -m learner.tools TOOL [ARGS]   (TOOL --help for its options)", "", "tools:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in TOOLS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name = argv[0].replace("_", "-")
    if name not in TOOLS:
        print(f"no tool {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"learner.tools.{TOOLS[name][0]}")
    sys.argv = [f"python -m learner.tools {name}", *argv[1:]]  # argparse's usage line names the command
    return module.main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
