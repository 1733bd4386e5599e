"""--report-to: a real tiny train.py run reports its metrics and the replay figures to
TensorBoard, Weights & Biases (offline) and Trackio (its local store) at once, each read back
with the tracker's own format and compared with metrics.jsonl and the replay log."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
from learner.trackers import parse_report_to


def test_report_to_names() -> None:
    assert parse_report_to(None) == ["tensorboard"]
    assert parse_report_to(None, tensorboard=False) == []
    assert parse_report_to("trackio, wandb,tensorboard") == ["tensorboard", "wandb", "trackio"]
    assert parse_report_to("wandb,tensorboard", tensorboard=False) == ["wandb"]
    assert parse_report_to("none") == []
    with pytest.raises(ValueError, match="--report-to takes tensorboard|wandb|trackio"):
        parse_report_to("mlflow")


def wandb_history(path: Path) -> list[dict]:
    """The history rows of a W&B run file (its leveldb-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunk, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last part of one
            rec = pb.Record()
            rec.ParseFromString(chunk)
            chunk = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trackers")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(root / "wandb-config"),
           "WANDB_CACHE_DIR": str(root / "wandb-cache"), "TRACKIO_DIR": str(root / "trackio")}
    env.pop("WANDB_API_KEY", None)
    args = ["--runs-root", str(root), "--run-name", "tracked", "--iterations", "2", "--tasks-per-iter", "2",
            "--group-size", "2", "--max-new-tokens", "4", "--pretrain-steps", "0", "--eval-every", "0",
            "--final-eval-episodes", "2", "--eval-episodes", "2", "--no-progress", "--threads", "1",
            "--replay-batch", "4", "--no-diagnostics", "--report-to", "tensorboard,wandb,trackio"]
    out = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return root


def test_the_metrics_and_replay_figures_reach_every_tracker(tracked: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from learner.replay_log import read_replay_log

    run = tracked / "tracked"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    log = read_replay_log(run)
    drawn_mean = {}
    for it in (1, 2):
        ages = [a for d in log if d["type"] == "draw" and d["iteration"] == it for a in d["ages"]]
        drawn_mean[train[it - 1]["episodes"]] = float(np.mean(ages))

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0}).Reload()
    assert {e.step: e.value for e in acc.Scalars("train/success")} == {r["episodes"]: r["success"] for r in train}
    assert {e.step: e.value for e in acc.Scalars("replay/drawn_age_mean")} == pytest.approx(drawn_mean)
    assert [h.step for h in acc.Histograms("replay/drawn_ages")] == sorted(drawn_mean)

    (wandb_file,) = run.glob("wandb/offline-run-*/run-*.wandb")
    history = wandb_history(wandb_file)
    by_step = {}
    for h in history:
        by_step.setdefault(h["_step"], {}).update(h)
    for r in train:
        assert by_step[r["episodes"]]["train/success"] == pytest.approx(r["success"])
        assert by_step[r["episodes"]]["replay/drawn_age_mean"] == pytest.approx(drawn_mean[r["episodes"]])
        assert by_step[r["episodes"]]["replay/drawn_ages/_type"] == "histogram"

    code = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage; "
            "print(json.dumps(SQLiteStorage.get_logs('freshper', 'tracked'), default=str))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRACKIO_DIR": str(tracked / "trackio")},
                         capture_output=True, text=True, timeout=120, check=True)
    logs = json.loads(out.stdout.strip().splitlines()[-1])
    got = {}
    for entry in logs:
        got.setdefault(entry["step"], {}).update(entry)
    for r in train:
        assert got[r["episodes"]]["train/success"] == pytest.approx(r["success"])
        assert got[r["episodes"]]["replay/tau"] == pytest.approx(r["tau"])
