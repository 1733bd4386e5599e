"""``--device cuda``: the policy, its pretraining, its updates and its checkpoints on a GPU.

Skipped where torch sees no CUDA device (CI's machines); run on a GPU machine with
``python -m pytest -q tests/learner/test_cuda.py``. What they check: the sampler and the learner agree
on the GPU as they do on the CPU (the on-policy update's gap between stored and recomputed
log-probs), the GPU's log-probs match the CPU's for the same weights and tokens, text and image
tasks train end to end with replay, and a run checkpointed on the GPU resumes on the CPU.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import learner.run
from learner.config import make_config, parse_config
from learner.report import read_metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

TINY = dict(tasks_per_iter=2, group_size=4, max_new_tokens=8, eval_every=2, eval_episodes=4, final_eval_episodes=4,
            checkpoint_every=1, progress=False, tensorboard=False, threads=1)


def _train_rows(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]


def test_text_run_trains_on_the_gpu_and_resumes_on_the_cpu(tmp_path: Path) -> None:
    cfg = make_config(runs_root=str(tmp_path), run_name="gpu", device="cuda", iterations=2, replay="fresh",
                       replay_ratio=2, replay_batch=4, buffer_capacity=16, kl_coef=0.04, pretrain_steps=4,
                       pretrain_batch=8, **TINY)
    learner.run.train(cfg)
    rows = _train_rows(tmp_path / "gpu")
    assert [r["iteration"] for r in rows] == [1, 2]
    assert all(r["skipped"] == 0.0 and math.isfinite(r["loss"]) for r in rows)
    assert all("replay_loss" in r for r in rows)
    # The on-policy update recomputes the sampled tokens' log-probs: the sampler's stored ones agree.
    assert max(r["behavior_logprob_gap"] for r in rows) < 1e-3
    env = json.loads((tmp_path / "gpu" / "environment.json").read_text())
    assert env[0]["device"].startswith("cuda") and env[0]["gpu"]
    resumed = parse_config(["--resume", str(tmp_path / "gpu"), "--iterations", "3", "--device", "cpu"])
    assert resumed.model.device == "cpu"
    learner.run.train(resumed)
    rows = _train_rows(tmp_path / "gpu")
    assert [r["iteration"] for r in rows] == [1, 2, 3] and math.isfinite(rows[-1]["loss"])
    assert json.loads((tmp_path / "gpu" / "environment.json").read_text())[-1]["device"] == "cpu"


def test_gpu_logprobs_match_the_cpu_ones_for_the_same_weights_and_tokens() -> None:
    from agents.policies.policy import Policy
    from agents.rollout.runner import Runner
    from agents.policies.tiny import build_tiny_model
    from learner.batch import batch_logprobs, make_batches

    path = build_tiny_model("text")
    cpu, gpu = Policy.from_pretrained(path), Policy.from_pretrained(path, device="cuda")
    assert gpu.device.type == "cuda"
    torch.manual_seed(0)
    records, _ = Runner(cpu, "freshper/FrozenLake-v0", group_size=4, max_new_tokens=8, seed=1).collect([5, 6], policy_version=0)
    for batch in make_batches(records):
        on_cpu = batch_logprobs(cpu, batch)
        on_gpu = batch_logprobs(gpu, batch.to(gpu.device))
        assert on_gpu.device.type == "cuda"
        np.testing.assert_allclose(on_gpu.detach().cpu().numpy(), on_cpu.detach().numpy(), atol=1e-4)
        # and both match what the CPU sampler stored
        np.testing.assert_allclose(on_cpu.detach().numpy() * batch.mask.numpy(), batch.behavior_logprobs.numpy(),
                                   atol=1e-4)


def test_image_task_trains_on_the_gpu_with_replay(tmp_path: Path) -> None:
    cfg = make_config(runs_root=str(tmp_path), run_name="vision", device="cuda", env_id="freshper/FrozenLakeVision-v0",
                       iterations=2, replay="fresh", replay_batch=4, pretrain_steps=2, pretrain_batch=4,
                       **{**TINY, "eval_every": 0})
    summary = learner.run.train(cfg)
    rows = _train_rows(tmp_path / "vision")
    assert len(rows) == 2 and all(r["skipped"] == 0.0 and math.isfinite(r["loss"]) for r in rows)
    assert max(r["behavior_logprob_gap"] for r in rows) < 1e-3
    assert summary["iterations"] == 2
