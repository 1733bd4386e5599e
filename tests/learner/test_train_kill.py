"""A run killed with SIGKILL at an arbitrary moment resumes from its last complete checkpoint
and ends exactly where an uninterrupted run ends (metrics and weights)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import train
from learner.checkpoint import list_checkpoints
from learner.report import read_metrics

REPO = Path(__file__).resolve().parents[2]
ITERATIONS = 6
FLAGS = [
    "--iterations", str(ITERATIONS), "--tasks-per-iter", "2", "--group-size", "4", "--max-new-tokens", "4",
    # A short pretraining, so replies differ within groups and every update moves the weights.
    "--pretrain-steps", "15", "--pretrain-batch", "16", "--pretrain-lr", "3e-3", "--eval-every", "0", "--final-eval-episodes", "2",
    "--checkpoint-every", "1", "--keep-checkpoints", "2", "--replay", "fresh", "--replay-batch", "4",
    "--buffer-capacity", "8", "--threads", "1", "--no-progress", "--no-tensorboard",
]


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model" / "model.safetensors"))


def _train_rows(run: Path) -> list[dict]:
    """Training rows without wall-clock fields (the only thing allowed to differ)."""
    rows = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    return [{k: v for k, v in r.items() if not ("time" in k or k.endswith("per_s"))} for r in rows]


def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    assert train.main([*FLAGS, "--runs-root", str(tmp_path), "--run-name", "whole"]) == 0

    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *FLAGS, "--runs-root", str(tmp_path),
                             "--run-name", "killed"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    try:
        # Kill as soon as the third iteration's checkpoint is complete: the run is somewhere
        # inside iteration 4 (collecting, updating, or writing the next checkpoint).
        while not (killed / "checkpoints" / "iter_000003" / "manifest.json").exists():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint appeared in time"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert len(_train_rows(killed)) < ITERATIONS

    assert train.main(["--resume", str(killed)]) == 0

    whole = _train_rows(tmp_path / "whole")
    assert all(r["grad_norm"] > 0 for r in whole)  # the comparison below is not vacuous
    assert _train_rows(killed) == whole
    wa = _weights(list_checkpoints(tmp_path / "whole" / "checkpoints")[-1])
    wb = _weights(list_checkpoints(killed / "checkpoints")[-1])
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
