"""Training on a served task with docs/hub.md's commands: ``python -m envs.serve`` with its default
session limit (64), and ``train.py --env-id freshper/Remote-v0`` with the default pretraining
(``--pretrain-batch 64``: one session per random-play stream). Pretraining never holds more
sessions at once than its streams, so the two fit (a few steps and iterations here)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def test_a_served_frozenlake_trains_with_the_documented_commands(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "FRESHPER_CACHE": str(tmp_path / "cache"), "OMP_WAIT_POLICY": "PASSIVE"}
    server = subprocess.Popen([sys.executable, "-m", "envs.serve", "freshper/FrozenLake-v0", "--port", str(port)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        assert "serving freshper/FrozenLake-v0" in line, line + server.stderr.read()
        assert httpx.get(url + "/health").json()["max_sessions"] == 64  # the documented default
        small = ["--runs-root", str(tmp_path / "runs"), "--run-name", "served", "--iterations", "1",
                 "--tasks-per-iter", "2", "--group-size", "2", "--pretrain-steps", "2", "--eval-every", "0",
                 "--eval-episodes", "2", "--final-eval-episodes", "2", "--checkpoint-every", "0", "--no-progress",
                 "--no-tensorboard", "--threads", "1"]
        out = subprocess.run([sys.executable, "train.py", "--env-id", "freshper/Remote-v0",
                              "--env-kwargs", json.dumps({"url": url, "feedback": False}), *small],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        summary = json.loads((tmp_path / "runs" / "served" / "summary.json").read_text())
        assert summary["iterations"] == 1 and summary["evals"]["final"]["episodes_eval"] == 2
        rows = [json.loads(l) for l in (tmp_path / "runs" / "served" / "metrics.jsonl").read_text().splitlines()]
        [pretrain] = [r for r in rows if r["kind"] == "pretrain"]
        assert pretrain["pretrain_steps"] == 2
        assert httpx.get(url + "/health").json()["sessions"] == 0  # the run closed every session it opened
    finally:
        server.terminate()
        server.wait(timeout=10)
