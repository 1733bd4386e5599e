"""Does a legend-free instruction let RL learn to read the FrozenLake board?

The supervised board-format benchmark (``board_format_bench.py``) reads the board far sooner
without the instructions, which repeat the board's cell tokens (`` P``, `` G``, `` F``,
`` H``) in prose. This script asks the same of RL: it registers a FrozenLake variant whose
instructions are one sentence without the legend (a third-party task, through
``envs.register``), and runs the default ``train.py`` recipe on it. The tiny model is built
before the variant is registered, so it is the same model (same tokenizer corpus) as a
default run of that seed. Compare the summaries with default runs of the same seeds
(``python -m learner.report``); results are in docs/training.md.

    python benchmarks/instruction_ablation.py --seed 0 --run-name nolegend_s0   # ~8 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402  (sets OMP_WAIT_POLICY before torch loads)
import envs  # noqa: E402
from agents.tiny import build_tiny_model  # noqa: E402
from envs.frozenlake import FrozenLakeEnv  # noqa: E402

TASK = "freshper-bench/FrozenLakeNoLegend-v0"


class FrozenLakeNoLegend(FrozenLakeEnv):
    """FrozenLake with a one-sentence instruction that names no board symbol."""

    def instructions(self) -> str:
        return "FrozenLake. Reply with one move: <answer>Left|Down|Right|Up</answer>."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-name", default=None)
    parser.add_argument("--runs-root", default="runs")
    parser.add_argument("--time-budget", type=float, default=360.0, help="RL seconds (docs/training.md used 360)")
    parser.add_argument("--warmup-seconds", type=float, default=120.0, help="warm-up cap (docs/training.md used 120)")
    parser.add_argument("--update-threads", type=int, default=1, help="1: two runs side by side on 2 cores")
    args = parser.parse_args()
    model = build_tiny_model("text", seed=args.seed)  # before registering: the default run's model
    envs.register(TASK, FrozenLakeNoLegend, modality="text", description="FrozenLake without the legend",
                  source="benchmarks")
    cfg = train.Config(env_id=TASK, model=str(model), seed=args.seed, run_name=args.run_name or f"nolegend_s{args.seed}",
                       runs_root=args.runs_root, time_budget=args.time_budget, warmup_seconds=args.warmup_seconds,
                       update_threads=args.update_threads, progress=False)
    summary = train.train(cfg)
    print(summary["text"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
