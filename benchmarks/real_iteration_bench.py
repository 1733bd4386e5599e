"""One RL iteration of the real-model recipe, split into rollout, update and replay: this tree
beside another revision of the project, on the same machine, start model and settings.

    .venv/bin/python -m benchmarks.real_iteration_bench --baseline 2d3233e [--iterations 4] [--repeats 2]
        [--settings full,lora] [--dtype bf16] [--current-dtype auto] [--start FOLDER] [--json out.json]

The start model is the recipe's start of RL (``configs/real_arithmetic.yaml``: SmolLM2-135M-Instruct
after its own-answer format warm-up): ``--start`` names its folder, or this tree's ``train.py``
makes it once (the warm-up is cached) and its ``reference/`` folder is taken. Each arm then runs
``train.py`` from its own tree (the baseline revision checked out with ``git worktree`` under the
system's temporary folder) with the recipe's RL settings given as flags both revisions know
(``--model START --pretrain-steps 0``, 8 problems x 8 samples, 16-token replies, FreshPER with
two replay updates of 16, KL 0.04) and ``--dtype`` (default bf16; ``--current-dtype`` gives this
tree's arm another, such as ``auto``, what the recipe now says, against the baseline recipe's
bf16), for ``--iterations`` iterations; the arms take
turns ``--repeats`` times, so a change of the machine's load falls on both. Settings: ``full``
(full fine-tuning, the recipe) and ``lora`` (``--lora-rank 8``).

Seconds are the run's own per-iteration timings from ``metrics.jsonl`` (``time_rollout_s``,
``time_update_s``, ``time_replay_s``; the first iteration is left out as warm-up), the median
over iterations and repeats; the iteration is their sum with the buffer's time. The sequence
and sampled token counts are printed beside them: the arms do the same work only where those
agree. The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/real_arithmetic.yaml"
#: The recipe's RL settings as flags every compared revision accepts.
RL_FLAGS = ["--env-id", "freshper/Arithmetic-v0", "--pretrain-steps", "0",
            "--tasks-per-iter", "8", "--group-size", "8", "--max-new-tokens", "16", "--lr", "1e-5",
            "--kl-coef", "0.04", "--replay", "fresh", "--replay-ratio", "2", "--replay-batch", "16",
            "--eval-every", "0", "--eval-episodes", "1", "--final-eval-episodes", "1", "--seed", "0"]
SETTINGS = {"full": [], "lora": ["--lora-rank", "8"]}
PARTS = ("time_rollout_s", "time_update_s", "time_replay_s")


def worktree(rev: str) -> Path:
    """A checkout of ``rev`` (reused when it is there)."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"freshper-baseline-{sha}"
    if not (path / "train.py").exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=REPO, check=True,
                       capture_output=True)
    return path


def start_model(root: Path) -> Path:
    """The recipe's start of RL, made by this tree's train.py (its warm-up is cached)."""
    run = root / "start"
    if not (run / "reference" / "config.json").exists():
        print("making the start model (the recipe's warm-up) ...", flush=True)
        subprocess.run([sys.executable, "train.py", "--config", CONFIG, "--iterations", "1", "--eval-every", "0",
                        "--eval-episodes", "1", "--final-eval-episodes", "1", "--runs-root", str(root),
                        "--run-name", "start"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return run / "reference"


def run_arm(tree: Path, start: Path, flags: list[str], iterations: int, root: Path, name: str) -> list[dict]:
    out = root / name
    cmd = [sys.executable, "train.py", "--model", str(start), *RL_FLAGS, *flags, "--iterations", str(iterations),
           "--runs-root", str(root), "--run-name", name]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("kind") == "train" and r.get("iteration", 0) > 1]
    print(f"  {name}: {len(rows)} timed iterations, {time.perf_counter() - t0:.0f} s wall", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="2d3233e", help="the revision to compare with (a git rev)")
    ap.add_argument("--current", default=None,
                    help="a revision to measure instead of this working tree (checked out the same way)")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settings", default="full,lora", help=f"comma-separated: {', '.join(SETTINGS)}")
    ap.add_argument("--start", default=None, help="the start model's folder (default: made by the recipe's warm-up)")
    ap.add_argument("--work", default=None,
                    help="folder for the runs, kept (default: a temporary one, removed at the end)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--dtype", default="bf16", help="--dtype of both arms (auto|bf16|fp16|fp32)")
    ap.add_argument("--current-dtype", default=None, help="--dtype of this tree's arm instead (default: --dtype)")
    a = ap.parse_args(argv)
    settings = [s for s in a.settings.split(",") if s]
    for s in settings:
        if s not in SETTINGS:
            ap.error(f"--settings: unknown {s!r} (known: {', '.join(SETTINGS)})")
    root = Path(a.work or tempfile.mkdtemp(prefix="freshper-iteration-bench-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    try:
        return measure(a, settings, root)
    finally:
        if a.work is None:  # the runs' checkpoints take gigabytes: a temporary folder goes
            shutil.rmtree(root, ignore_errors=True)


def measure(a, settings: list[str], root: Path) -> int:
    print(f"load average before: {os.getloadavg()}", flush=True)
    start = Path(a.start).resolve() if a.start else start_model(root)
    trees = {"baseline": worktree(a.baseline), "this tree": worktree(a.current) if a.current else REPO}
    rows: dict[tuple[str, str], list[dict]] = {}
    for rep in range(a.repeats):
        for setting in settings:
            for arm, tree in trees.items():
                name = f"{setting}_{'base' if arm == 'baseline' else 'new'}_r{rep}"
                dtype = a.current_dtype if arm == "this tree" and a.current_dtype else a.dtype
                rows.setdefault((setting, arm), []).extend(
                    run_arm(tree, start, ["--dtype", dtype, *SETTINGS[setting]], a.iterations, root, name))
    print(f"load average after: {os.getloadavg()}")
    dtypes = {"baseline": a.dtype, "this tree": a.current_dtype or a.dtype}
    result = {"baseline": a.baseline, "start": str(start), "iterations": a.iterations, "repeats": a.repeats,
              "dtypes": dtypes, "rows": []}
    print(f"\nSmolLM2-135M-Instruct, Arithmetic, 8 x 8 samples, 16-token replies, --dtype {dtypes['baseline']} "
          f"(baseline), {dtypes['this tree']} (this tree), two replay updates of 16; "
          f"baseline {a.baseline}; medians over {a.iterations - 1} iterations x {a.repeats} repeats")
    print("| setting | tree | dtype | rollout s | update s | replay s | iteration s | tokens a batch | sampled | "
          "iteration vs baseline |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for setting in settings:
        base_total = None
        for arm in trees:
            rs = rows[(setting, arm)]
            med = {p: statistics.median(r[p] for r in rs) for p in PARTS}
            total = statistics.median(sum(r[p] for p in PARTS) + r.get("time_buffer_s", 0.0) for r in rs)
            seq = statistics.median(r.get("seq_tokens", 0.0) for r in rs)
            sampled = statistics.median(r.get("tokens", 0.0) for r in rs)
            base_total = total if base_total is None else base_total
            print(f"| {setting} | {arm} | {dtypes[arm]} | {med['time_rollout_s']:.2f} | {med['time_update_s']:.2f} | "
                  f"{med['time_replay_s']:.2f} | {total:.2f} | {seq:.0f} | {sampled:.0f} | {base_total / total:.2f}x |")
            result["rows"].append({"setting": setting, "tree": arm, "dtype": dtypes[arm], **med, "iteration_s": total, "seq_tokens": seq,
                                   "sampled_tokens": sampled, "speedup": base_total / total})
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
