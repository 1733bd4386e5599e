"""What the replay log costs on the default run: bytes per iteration and iteration time, with
the log and without it, side by side.

    python benchmarks/replay_log_bench.py                  # 8 iterations of the default run each way
    python benchmarks/replay_log_bench.py --iterations 4 --set tasks_per_iter=2 group_size=2

Two runs of ``train.py``'s default settings (the cached pretrained start model, FrozenLake, 64
episodes and two replay updates of 16 per iteration), one with ``--replay-log-mb 64`` (the
default) and one with ``--replay-log-mb 0``, are set up side by side and stepped in turns, one
iteration each (so load from other work on the machine falls on both alike); each iteration is
timed from outside (``learner.run.iteration`` plus writing its metrics line). Printed: the median
iteration time of each and their ratio, the log's own seconds per iteration (what its calls
measured), its bytes per iteration, and whether both runs computed the same metrics (they
must: the log draws no random numbers and changes no computation). docs/performance_replay.md
records a result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="settings (flag names, learner.config) over the default (values as JSON where they parse)")
    args = parser.parse_args(argv)

    import learner.run
    from learner.config import make_config
    from learner.replay_log import log_size

    extra = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            extra[key] = value
    root = Path(tempfile.mkdtemp(prefix="replay-log-bench-"))
    runs = {}
    for name, mb in (("with log", 64.0), ("without", 0.0)):
        cfg = make_config(runs_root=str(root), run_name=name.replace(" ", "_"), iterations=args.iterations,
                          progress=False, tensorboard=False, eval_every=0, replay_log_mb=mb, **extra)
        run = learner.run.setup(cfg)
        run.policy.save_pretrained(run.dir / "reference")  # what start_of_rl saves; its evaluations are not timed
        run.learner.reference()  # loaded before the timed iterations, as the loop does
        runs[name] = run
    times: dict[str, list[float]] = {name: [] for name in runs}
    rows: dict[str, list[dict]] = {name: [] for name in runs}
    try:
        for it in range(args.iterations):
            for name, run in runs.items():
                t0 = time.perf_counter()
                row = learner.run.iteration(run)
                run.metrics.log(row)
                times[name].append(time.perf_counter() - t0)
                rows[name].append(row)
            print(f"iteration {it + 1}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in runs), flush=True)
    finally:
        for run in runs.values():
            run.close()
    log_seconds = runs["with log"].replay_log.total_seconds / args.iterations
    size = log_size(runs["with log"].dir)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time_") and k != "tokens_per_s"} for r in rs]
    same = strip(rows["with log"]) == strip(rows["without"])
    on, off = statistics.median(times["with log"]), statistics.median(times["without"])
    print(f"\nreplay log on the default run ({args.iterations} iterations each, "
          f"{extra or 'train.py defaults'}):")
    print(f"{'':22s}{'with log':>12s}{'without':>12s}{'ratio':>8s}")
    print(f"{'median iteration (s)':22s}{on:12.3f}{off:12.3f}{on / off:8.3f}")
    print(f"{'mean iteration (s)':22s}{statistics.mean(times['with log']):12.3f}{statistics.mean(times['without']):12.3f}"
          f"{statistics.mean(times['with log']) / statistics.mean(times['without']):8.3f}")
    print(f"the log's own time: {1000 * log_seconds:.1f} ms per iteration ({100 * log_seconds / off:.2f}% of an iteration)")
    print(f"the log's size: {size['bytes']:,} bytes over {size['iterations']} iterations, "
          f"{size['bytes_per_iteration']:,.0f} bytes per iteration")
    print(f"the same metrics with and without the log: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
