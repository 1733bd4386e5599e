"""Run settings x seeds of ``train.py`` side by side, resumably, and compare them.

    python -m learner.tools sweep --out runs/fl_credit --seeds 0-4 --jobs 2 \\
        --arm episode= --arm gigpo="--advantage gigpo" -- --iterations 300

Every (arm, seed) is one ``train.py`` run in ``--out/<arm>_s<seed>`` with its log beside it
(``<arm>_s<seed>.log``), ``--jobs`` at a time (each with one update thread, so two runs share 2
cores evenly). A finished run (``summary.json``) is not rerun; an interrupted one resumes from
its newest checkpoint. Arms of one seed start together, so settings compared run under the same
load. At the end the runs are compared with ``learner.report`` (a table per arm, and
``--out/compare.png``). Iteration budgets (``--iterations``) make the results independent of the
machine's load; time budgets do not.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]  # the checkout: train.py and configs/


def parse_seeds(text: str) -> list[int]:
    """``"0-4"`` -> [0..4], ``"0,2,5"`` -> [0, 2, 5]."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def job_command(out: Path, arm: str, seed: int, flags: list[str], common: list[str]) -> list[str]:
    name = f"{arm}_s{seed}"
    run = out / name
    if (run / "checkpoints").is_dir() and any((run / "checkpoints").glob("iter_*")):
        return [sys.executable, str(REPO / "train.py"), "--resume", str(run), "--no-progress"]
    return [sys.executable, str(REPO / "train.py"), "--run-name", name, "--runs-root", str(out), "--seed", str(seed),
            "--update-threads", "1", "--no-progress", *common, *flags]


def run_sweep(out: Path, arms: dict[str, list[str]], seeds: list[int], common: list[str], jobs: int,
              on_finish: Callable[[Path], None] | None = None) -> list[str]:
    """Run every (arm, seed) not yet finished, ``jobs`` at a time; return the failed run names.
    ``on_finish`` is called with each run folder that finished well, as it finishes."""
    out.mkdir(parents=True, exist_ok=True)
    queue = [(arm, s) for s in seeds for arm in arms if not (out / f"{arm}_s{s}" / "summary.json").exists()]
    total, done, failed = len(queue), 0, []
    running: list[tuple[str, subprocess.Popen, float]] = []
    print(f"{total} runs to do in {out} ({len(arms) * len(seeds) - total} already finished)", flush=True)
    while queue or running:
        while queue and len(running) < jobs:
            arm, seed = queue.pop(0)
            name = f"{arm}_s{seed}"
            cmd = job_command(out, arm, seed, arms[arm], common)
            log = (out / f"{name}.log").open("a", encoding="utf-8")
            log.write(f"$ {shlex.join(cmd)}\n")
            log.flush()
            # runs side by side share the cores: their OpenMP threads sleep when idle (train.py)
            env = dict(os.environ)
            if jobs > 1:
                env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            running.append((name, subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env),
                            time.monotonic()))
        time.sleep(2)
        for item in list(running):
            name, proc, started = item
            if proc.poll() is None:
                continue
            running.remove(item)
            done += 1
            status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}, see {out / (name + '.log')})"
            if proc.returncode != 0:
                failed.append(name)
            elif on_finish is not None:
                on_finish(out / name)
            print(f"[{done}/{total}] {name}: {status} in {time.monotonic() - started:.0f} s", flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    common: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, common = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder of the sweep's run folders")
    parser.add_argument("--arm", action="append", required=True, metavar="NAME=FLAGS",
                        help="a setting: its name and its train.py flags (quoted), e.g. gigpo='--advantage gigpo'")
    parser.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 0,2,5")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    args = parser.parse_args(argv)
    arms = {}
    for item in args.arm:
        name, sep, flags = item.partition("=")
        if not sep or not name.isidentifier():
            parser.error(f"--arm wants NAME=FLAGS with NAME a plain word, got {item!r}")
        arms[name] = shlex.split(flags)
    out = Path(args.out)
    seeds = parse_seeds(args.seeds)
    failed = run_sweep(out, arms, seeds, common, args.jobs)
    from learner.report import compare_runs

    finished = {arm: [out / f"{arm}_s{s}" for s in seeds if (out / f"{arm}_s{s}" / "summary.json").exists()]
                for arm in arms}
    finished = {k: v for k, v in finished.items() if v}
    if finished:
        print(compare_runs(finished, out / "compare.png"))
        print(f"plot: {out / 'compare.png'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
