"""When does a run's policy look at the board? Held-out success and action spread along training.

    python -m learner.tools spread-curves runs/fl_credit/episode_s* runs/shipped/seed_s* --out docs/img/spread.png

For each run folder, from the sampled held-out evaluations in its ``metrics.jsonl``: success and
``action_spread`` (the mean total-variation distance between the policy's action distributions
on different states; 0 = the same distribution on every board) against the iteration, one line
per run, and a table of when each run's spread first fell below ``--low`` and when it next rose
above ``--high`` (the policy going blind, then reading the board again), and when its periodic
evaluations first reached ``--target`` success (0.60).

``--at N`` compares runs of different lengths at one iteration: the periodic (64-task)
evaluations at or before N, their last success and spread and the mean success of the last five
(320 episodes), e.g. a short pilot against the same seeds of a longer run:

    python -m learner.tools spread-curves docs/data/fl_pilot/kl02_s2 docs/data/fl_credit/episode_s2 --at 150

``--at-seconds S`` does the same at S seconds of RL iterations (the ``time_total_s`` the run had
reached at each evaluation), for settings whose iterations cost different times run side by side.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from learner.report import kept_policy_row, read_metrics


def curve(run: Path, periodic_only: bool = False, rows: list[dict] | None = None) -> list[tuple[int, float, float]]:
    """(iteration, success, spread) of the sampled evaluations; with ``periodic_only`` only the
    ``iter_N`` ones (not the 200-task start and final evaluations)."""
    rows = read_metrics(run / "metrics.jsonl") if rows is None else rows
    seen: dict[int, tuple[int, float, float]] = {}
    for r in rows:
        if kept_policy_row(r) or (periodic_only and not str(r.get("phase", "")).startswith("iter_")):
            continue
        if r.get("kind") == "eval" and r.get("decoding") == "sampled" and "action_spread" in r:
            seen[r["iteration"]] = (r["iteration"], r["success"], r["action_spread"])
    return [seen[k] for k in sorted(seen)]


def seconds_at(rows: list[dict]) -> dict[int, float]:
    """Seconds of RL iterations (``time_total_s``, resumed sessions included) at each iteration."""
    return {r["iteration"]: r["time_total_s"] for r in rows if r.get("kind") == "train" and "time_total_s" in r}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="write the plot here (PNG)")
    parser.add_argument("--low", type=float, default=0.05)
    parser.add_argument("--high", type=float, default=0.25)
    parser.add_argument("--target", type=float, default=0.60,
                        help="success level whose first crossing (periodic evaluations) is reported")
    parser.add_argument("--at", type=int, default=None, metavar="N",
                        help="also print each run's periodic evaluations at iteration N (last, and mean of the last five)")
    parser.add_argument("--at-seconds", type=float, default=None, metavar="S",
                        help="the same at S seconds of RL iterations instead of an iteration")
    args = parser.parse_args(argv)
    metrics = {run: read_metrics(run / "metrics.jsonl") for run in args.runs
               if (run / "metrics.jsonl").exists() or (run / "metrics.jsonl.gz").exists()}
    curves = {run: curve(run, rows=rows) for run, rows in metrics.items()}
    if not curves:
        raise SystemExit("no run folder with a metrics.jsonl among the arguments")
    print(f"{'run':<34} {'spread < ' + str(args.low) + ' first at':>22} {'then > ' + str(args.high) + ' at':>18} "
          f"{'success >= ' + format(args.target, 'g') + ' first at':>24} {'final success':>14} {'final spread':>13}")
    for run, c in curves.items():
        low = next((i for i, _, a in c if a < args.low), None)
        rise = next((i for i, _, a in c if low is not None and i > low and a > args.high), None)
        reached = next((i for i, s, _ in curve(run, periodic_only=True, rows=metrics[run]) if s >= args.target), None)
        print(f"{run.parent.name + '/' + run.name:<34} {str(low):>22} {str(rise):>18} {str(reached):>24} "
              f"{c[-1][1]:14.3f} {c[-1][2]:13.2f}")
    for at, unit in ((args.at, "iteration"), (args.at_seconds, "seconds of RL")):
        if at is None:
            continue
        print(f"\nperiodic evaluations at or before " + (f"iteration {at}:" if unit == "iteration" else f"{at:g} {unit}:"))
        print(f"{'run':<34} {'iteration':>9} {'success':>8} {'spread':>7} {'mean success, last 5':>21}")
        for run in curves:
            when = seconds_at(metrics[run]) if unit != "iteration" else {}
            c = [e for e in curve(run, periodic_only=True, rows=metrics[run])
                 if (e[0] if unit == "iteration" else when.get(e[0], float("inf"))) <= at]
            if not c:
                print(f"{run.parent.name + '/' + run.name:<34} {'-':>9}")
                continue
            last5 = [s for _, s, _ in c[-5:]]
            print(f"{run.parent.name + '/' + run.name:<34} {c[-1][0]:9d} {c[-1][1]:8.3f} {c[-1][2]:7.2f} "
                  f"{sum(last5) / len(last5):21.3f}")
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for k, (run, c) in enumerate(curves.items()):
            its = [i for i, _, _ in c]
            label = f"{run.parent.name}/{run.name}"
            axes[0].plot(its, [s for _, s, _ in c], color=f"C{k % 10}", lw=1.2, label=label)
            axes[1].plot(its, [a for _, _, a in c], color=f"C{k % 10}", lw=1.2, label=label)
        axes[0].set_ylabel("held-out success (sampled, 64 tasks)")
        axes[1].set_ylabel("action spread (0 = the same on every board)")
        for ax in axes:
            ax.set_xlabel("iteration")
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=7, ncol=2)
        fig.tight_layout()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out, dpi=100)
        print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
