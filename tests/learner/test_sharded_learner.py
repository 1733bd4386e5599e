"""The sharded learner (FSDP2 over torch.distributed, gloo on the CPU) with real processes:
``torchrun --nproc_per_node 2``. Its first update equals the one-process update on the same
batch (loss, statistics, every gradient), and a 2-process ``train.py`` run trains with replay,
checkpoints its shards, and resumes exactly after ``kill -9``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
#: Gradients of the 2-process update equal the 1-process ones to float32 summation order.
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")]


def torchrun(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kw)


def kill_job(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it, at once (the ranks first, so none goes on)."""
    from envs.reasoning import _descendants

    for victim in [*reversed(_descendants(pid)), pid]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finished(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.parametrize("modality", ["text", "vision"])
def test_the_first_sharded_update_equals_the_one_process_update_on_the_same_batch(modality: str, tmp_path: Path) -> None:
    sys.path.insert(0, str(FIXTURES))
    from sharded_records import fixed_records

    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model
    from learner.loss import LossSettings
    from learner.update import policy_update

    build_tiny_model(modality)  # cached before the two processes read it
    out = tmp_path / "sharded.pt"
    finished(torchrun([str(FIXTURES / "sharded_update.py"), str(out), modality, "0.04"]))
    sharded = torch.load(out, weights_only=False)

    records = fixed_records(modality)
    path = build_tiny_model(modality)
    policy, ref = Policy.from_pretrained(path), Policy.from_pretrained(path)
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.0)
    n = len(records)
    stats = policy_update(policy, ref, opt, None, records, np.linspace(0.5, 1.5, n), np.arange(n, dtype=float),
                          loss_cfg=LossSettings(kl_coef=0.04), on_policy=False, max_grad_norm=1e9, micro_batch=3)
    for key in ("loss", "grad_norm", "ratio_mean", "clip_frac", "kl"):
        assert sharded["stats"][key] == pytest.approx(stats[key], rel=1e-5, abs=1e-7), key
    assert sharded["stats"]["tokens"] == stats["tokens"] and sharded["stats"]["seq_tokens"] == stats["seq_tokens"]
    grads = {k: p.grad for k, p in policy.model.named_parameters() if p.grad is not None}
    assert grads.keys() == sharded["grads"].keys()
    for key, grad in grads.items():
        torch.testing.assert_close(sharded["grads"][key], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=key)
    # gather_into's tensor-by-tensor stream lands every weight in rank 0's copy, as the whole state has it
    assert sharded["gathered_equal"] == sharded["whole"] and len(sharded["whole"]) >= len(grads)


TRAIN = ["train.py", "--tasks-per-iter", "2", "--group-size", "4", "--max-new-tokens", "4", "--pretrain-steps", "20",
         "--pretrain-batch", "16", "--pretrain-until-exact", "0", "--eval-every", "2", "--eval-episodes", "2",
         "--final-eval-episodes", "2", "--checkpoint-every", "2", "--no-progress", "--no-tensorboard",
         "--threads", "1", "--update-threads", "1", "--replay", "fresh", "--replay-ratio", "1", "--replay-batch", "4",
         "--buffer-capacity", "16", "--kl-coef", "0.04", "--lr", "3e-3", "--no-diagnostics", "--no-eval-both"]


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["kind"] in ("train", "eval") and not str(r.get("phase", "")).startswith("final")]
    return [{k: v for k, v in r.items() if not ("time" in k or k.endswith("per_s"))} for r in rows]


def test_a_two_process_run_trains_with_replay_and_resumes_exactly_after_kill_9(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from learner.checkpoint import list_checkpoints, verify_checkpoint

    root = ["--runs-root", str(tmp_path)]
    out = finished(torchrun([*TRAIN, *root, "--run-name", "whole", "--iterations", "4"]))
    assert "the agent:" in out
    # The same run, killed with SIGKILL (every process of the job) once its first checkpoint exists.
    proc = torchrun([*TRAIN, *root, "--run-name", "split", "--iterations", "100"])
    first = tmp_path / "split" / "checkpoints" / "iter_000002"
    deadline = time.monotonic() + 600
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    kill_job(proc.pid)  # torchrun's agent and its ranks (which it starts in process groups of their own)
    out, _ = proc.communicate()
    assert first.exists() and proc.returncode == -signal.SIGKILL, out[-3000:]
    newest = list_checkpoints(tmp_path / "split" / "checkpoints")[-1]
    manifest = verify_checkpoint(newest)
    assert any(name.startswith("sharded/") and name.endswith(".distcp") for name in manifest["files"])
    assert sum(name.endswith(".distcp") for name in manifest["files"]) == 2  # one shard file per rank
    finished(torchrun(["train.py", "--resume", str(tmp_path / "split"), "--iterations", "4", "--no-progress"]))
    whole, split = _rows(tmp_path / "whole"), _rows(tmp_path / "split")
    assert [r["iteration"] for r in split if r["kind"] == "train"] == [1, 2, 3, 4]
    assert whole == split
    train_rows = [r for r in whole if r["kind"] == "train"]
    assert any(r.get("replay_loss") is not None for r in train_rows)
    # the updates moved the weights: every one with a group of unequal rewards (one whose groups
    # all tie while the policy is still its reference has no gradient)
    assert any(r["grad_norm"] > 0 for r in train_rows)
    assert all(r["grad_norm"] > 0 for r in train_rows if r["groups_all_equal"] < r["groups"])
    a = load_file(str(list_checkpoints(tmp_path / "whole" / "checkpoints")[-1] / "model" / "model.safetensors"))
    b = load_file(str(list_checkpoints(tmp_path / "split" / "checkpoints")[-1] / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    environment = json.loads((tmp_path / "whole" / "environment.json").read_text())
    assert environment[0]["world_size"] == 2


class _Marker:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_a_tampered_sharded_checkpoint_never_runs_code_on_a_torchrun_resume(tmp_path: Path) -> None:
    """The repro: ``sharded/.metadata`` replaced by a pickle that creates a marker file, its sha256
    and size rewritten in ``manifest.json``, then ``torchrun --nproc_per_node 2 train.py --resume
    RUN``: torch's reader unpickled it on resume and the marker appeared. Now every rank refuses
    the file by name before anything is loaded, and the job ends."""
    import hashlib
    import pickle

    from learner.checkpoint import list_checkpoints

    finished(torchrun([*TRAIN, "--runs-root", str(tmp_path), "--run-name", "run", "--iterations", "2"]))
    ckpt = list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    marker = tmp_path / "marker"
    payload = pickle.dumps(_Marker(marker))
    (ckpt / "sharded" / ".metadata").write_bytes(payload)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["sharded/.metadata"] = {"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    proc = torchrun(["train.py", "--resume", str(tmp_path / "run"), "--iterations", "4", "--no-progress"])
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0 and ".metadata is refused: it names posix.system" in out, out[-3000:]
    assert not marker.exists()


def test_a_two_process_run_with_ray_rollout_workers_trains_as_with_in_process_shards(tmp_path: Path) -> None:
    """Rank 0 of the sharded learner drives Ray rollout workers: after every update it gathers the
    sharded weights and publishes them, so iteration 2's rollouts (and everything after) equal
    those of the same 2-process run collecting in-process in the same shards."""
    pytest.importorskip("ray")
    from safetensors.torch import load_file

    from learner.checkpoint import list_checkpoints

    root = ["--runs-root", str(tmp_path), "--iterations", "3", "--checkpoint-every", "3"]
    out = finished(torchrun([*TRAIN, *root, "--run-name", "ray", "--rollout-workers", "2"]))
    assert "the agent:" in out
    finished(torchrun([*TRAIN, *root, "--run-name", "local", "--rollout-shards", "2"]))
    collector = ("worker_restarts", "stale_dropped", "staleness_mean", "staleness_max")
    ray_rows = [{k: v for k, v in r.items() if k not in collector} for r in _rows(tmp_path / "ray")]
    local_rows = [{k: v for k, v in r.items() if k not in collector} for r in _rows(tmp_path / "local")]
    assert [r["iteration"] for r in ray_rows if r["kind"] == "train"] == [1, 2, 3]
    assert ray_rows == local_rows
    a = load_file(str(list_checkpoints(tmp_path / "ray" / "checkpoints")[-1] / "model" / "model.safetensors"))
    b = load_file(str(list_checkpoints(tmp_path / "local" / "checkpoints")[-1] / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_serving_rank_leaves_with_its_code_and_its_output_flushed() -> None:
    # Piped stdout is block-buffered: without the flush the line would be lost with os._exit.
    code = ("import atexit, sys; from learner.distributed import exit_serving_rank; "
            "atexit.register(lambda: print('finalized')); print('served', end=''); exit_serving_rank(3)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (done.returncode, done.stdout) == (3, "served"), done.stderr  # no interpreter finalization: no atexit
