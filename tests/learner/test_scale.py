"""Real-model features on the CPU with real parts: mixed precision, the chunked fp32 log-softmax,
gradient checkpointing, LoRA adapters through peft (train, checkpoint, resume, play, merge), the
base model's generation config kept in checkpoints, and the best policy loaded in place."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import learner.run
import train
from agents.policies.policy import Policy
from learner.checkpoint import list_checkpoints, save_checkpoint
from learner.config import Config, make_config, parse_config
from learner.loss import LossSettings
from learner.report import read_metrics
from learner.update import AdapterReference, policy_update

TINY = dict(tasks_per_iter=2, group_size=2, max_new_tokens=4, pretrain_steps=0, eval_every=2, eval_episodes=2,
            final_eval_episodes=2, checkpoint_every=2, progress=False, tensorboard=False, threads=1)


def tiny_config(tmp_path: Path, **overrides) -> Config:
    return make_config(runs_root=str(tmp_path), **{**TINY, **overrides})


def _setup(modality: str, seeds=(11, 12)):
    from agents.rollout.runner import Runner
    from agents.policies.tiny import build_tiny_model

    torch.manual_seed(0)
    path = build_tiny_model(modality)
    env = "freshper/FrozenLake-v0" if modality == "text" else "freshper/FrozenLakeVision-v0"
    policy = Policy.from_pretrained(path)
    records, _ = Runner(policy, env, group_size=2, max_new_tokens=4, seed=3).collect(list(seeds), policy_version=0)
    records = [dataclasses.replace(r, advantage=a) for r, a in zip(records, np.linspace(-1, 1, len(records)))]
    return path, policy, records


def _loss_and_grads(policy, records, ref=None, kl=0.0) -> tuple[float, dict[str, torch.Tensor]]:
    """One replay-style update's loss and gradients (the step itself not taken)."""
    opt = torch.optim.SGD([p for p in policy.model.parameters() if p.requires_grad], lr=0.0)
    n = len(records)
    stats = policy_update(policy, ref, opt, None, records, np.linspace(0.5, 1.5, n), np.arange(n, dtype=float),
                          loss_cfg=LossSettings(kl_coef=kl), on_policy=False, max_grad_norm=1e9)
    grads = {k: p.grad.clone() for k, p in policy.model.named_parameters() if p.grad is not None}
    return stats["loss"], grads


@pytest.mark.parametrize("modality", ["text", "vision"])
def test_the_gradient_checkpointing_path_equals_the_shared_prefix_path_in_loss_and_gradients(modality: str) -> None:
    path, policy, records = _setup(modality)
    loss_a, grads_a = _loss_and_grads(policy, records)
    checkpointed = Policy.from_pretrained(path)
    checkpointed.enable_gradient_checkpointing()
    assert checkpointed.gradient_checkpointing
    from learner.prefix import scoring_path

    checkpointed.model.train()
    assert scoring_path(checkpointed) == "packed"
    checkpointed.model.eval()
    loss_b, grads_b = _loss_and_grads(checkpointed, records)
    assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for k in grads_a:
        torch.testing.assert_close(grads_b[k], grads_a[k], rtol=1e-4, atol=1e-6, msg=k)


def test_the_chunked_fp32_log_softmax_equals_the_whole_one_in_values_and_gradients(monkeypatch) -> None:
    import agents.policies.policy

    _, policy, _ = _setup("text")
    torch.manual_seed(1)
    logits = torch.randn(3, 7, policy.model.config.vocab_size, requires_grad=True)
    targets = torch.randint(0, policy.model.config.vocab_size, (3, 7))
    whole = policy.logprobs_of(logits, targets, 0.7)
    (g_whole,) = torch.autograd.grad(whole.sum(), logits)
    monkeypatch.setattr(agents.policies.policy, "LOGPROB_CHUNK_ELEMENTS", 2 * policy.model.config.vocab_size + 5)
    chunked = policy.logprobs_of(logits, targets, 0.7)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(g_chunked, g_whole, rtol=0, atol=1e-7)


def test_a_bf16_iteration_trains_on_the_cpu_with_fp32_master_weights(tmp_path: Path) -> None:
    if not torch.backends.cpu.get_cpu_capability():  # pragma: no cover
        pytest.skip("no CPU capability report")
    cfg = tiny_config(tmp_path, run_name="bf16", dtype="bf16", iterations=2, replay="fresh", replay_batch=4,
                      kl_coef=0.04)
    run = learner.run.setup(cfg)
    try:
        assert run.policy.compute_dtype == torch.bfloat16
        assert all(p.dtype == torch.float32 for p in run.policy.model.parameters())  # master weights
        learner.run.start_of_rl(run)
        learner.run.loop(run)
        assert next(run.learner.reference().model.parameters()).dtype == torch.bfloat16  # the reference: compute dtype, frozen
        state = run.state.optimizer.state
        assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())
    finally:
        run.close()
    rows = [r for r in read_metrics(tmp_path / "bf16" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(rows) == 2 and all(r["skipped"] == 0.0 and np.isfinite(r["loss"]) for r in rows)
    assert rows[0]["kl"] < 1e-3  # the reference is the start: only bf16 rounding between them


def test_a_policy_computes_in_bf16_under_autocast_and_samples_the_same_records_shape() -> None:
    from agents.rollout.runner import Runner
    from agents.policies.tiny import build_tiny_model

    policy = Policy.from_pretrained(build_tiny_model("text"), compute_dtype="bf16")
    seen = []
    hook = policy.model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    records, _ = Runner(policy, "freshper/FrozenLake-v0", group_size=2, max_new_tokens=4, seed=3).collect(
        [5], policy_version=0)
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}
    assert all(s.behavior_logprobs.dtype == np.float32 or s.behavior_logprobs.dtype == np.float64
               for r in records for s in r.samples)
    loaded = Policy.from_pretrained(build_tiny_model("text"), dtype="bf16")
    assert next(loaded.model.parameters()).dtype == torch.bfloat16 and loaded.compute_dtype == torch.bfloat16


def test_lora_starts_at_the_base_and_its_reference_is_the_base_with_adapters_off() -> None:
    from agents.policies.lora import LoraSettings, add_lora, has_lora

    path, base, records = _setup("text")
    policy = Policy.from_pretrained(path)
    add_lora(policy, LoraSettings(rank=4))
    assert has_lora(policy.model)
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("visual" in n or "lm_head" in n or "embed" in n for n in trainable)
    # B = 0 at the start: the same log-probs as the base; the KL to the reference is 0.
    loss_base, _ = _loss_and_grads(base, records)
    loss_lora, grads = _loss_and_grads(policy, records, ref=AdapterReference(policy), kl=0.1)
    assert loss_lora == pytest.approx(loss_base, abs=1e-6)
    assert grads and all("lora_" in k for k in grads)
    with pytest.raises(ValueError, match="matches no layer"):
        add_lora(Policy.from_pretrained(path), LoraSettings(rank=2, targets="no_such_proj"))


def test_a_lora_vision_policy_adapts_the_language_model_and_never_the_vision_tower() -> None:
    from agents.policies.lora import LoraSettings, add_lora

    path, _, records = _setup("vision")
    policy = Policy.from_pretrained(path)
    add_lora(policy, LoraSettings(rank=4))
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and not any("visual" in n for n in trainable)
    loss, grads = _loss_and_grads(policy, records)
    assert np.isfinite(loss) and grads


def test_a_lora_run_trains_checkpoints_adapters_resumes_exactly_plays_and_merges(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    kw = dict(iterations=4, replay="fresh", replay_ratio=1, replay_batch=4, buffer_capacity=8, kl_coef=0.04,
              lora_rank=4, lr=1e-2, pretrain_steps=30, pretrain_batch=16, group_size=4)
    learner.run.train(tiny_config(tmp_path, run_name="whole", **kw))
    learner.run.train(tiny_config(tmp_path, run_name="split", **{**kw, "iterations": 2}))
    with pytest.raises(ValueError, match="--lora-rank"):
        parse_config(["--resume", str(tmp_path / "split"), "--iterations", "4", "--lora-rank", "8"])
    learner.run.train(parse_config(["--resume", str(tmp_path / "split"), "--iterations", "4"]))

    def rows(run):
        return [{k: v for k, v in r.items() if not ("time" in k or k.endswith("per_s"))}
                for r in read_metrics(tmp_path / run / "metrics.jsonl")
                if r["kind"] in ("train", "eval") and not str(r.get("phase", "")).startswith("final")]

    assert rows("whole") == rows("split")
    ckpt = list_checkpoints(tmp_path / "whole" / "checkpoints")[-1] / "model"
    names = sorted(p.name for p in ckpt.iterdir())
    assert "adapter_config.json" in names and "adapter_model.safetensors" in names
    assert not any(n.startswith("model") and n.endswith(".safetensors") for n in names)  # no full copy
    a = load_file(str(ckpt / "adapter_model.safetensors"))
    b = load_file(str(list_checkpoints(tmp_path / "split" / "checkpoints")[-1] / "model" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)  # the adapters trained
    # The checkpoint plays (base + adapters loaded from its folder), as agents.play does.
    from agents.play import main as play_main

    assert play_main(["freshper/FrozenLake-v0", "--model", str(ckpt), "--auto", "--seed", "3"]) == 0
    # Merged, it is a plain model folder with the same log-probs.
    from agents.merge_lora import main as merge_main
    from learner.batch import batch_logprobs, make_batches

    assert merge_main([str(ckpt), str(tmp_path / "merged")]) == 0
    lora_policy, merged = Policy.from_pretrained(ckpt), Policy.from_pretrained(tmp_path / "merged")
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    _, _, records = _setup("text", seeds=(21,))
    batch = make_batches(records)[0]
    with torch.no_grad():
        torch.testing.assert_close(batch_logprobs(merged, batch), batch_logprobs(lora_policy, batch), atol=1e-5, rtol=0)


def test_checkpoints_keep_the_base_models_generation_config(tmp_path: Path) -> None:
    from conftest import build_tiny_qwen25vl

    folder = build_tiny_qwen25vl(tmp_path / "base", do_sample=True, top_k=5, top_p=0.8, temperature=0.7,
                                 eos_token_id=[2, 7])
    policy = Policy.from_pretrained(folder)
    assert policy.model.generation_config.top_k in (None, 0, 50)  # sampling itself is neutral
    policy.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "generation_config.json").read_text())
    assert (saved["top_k"], saved["top_p"], saved["temperature"], saved["eos_token_id"]) == (5, 0.8, 0.7, [2, 7])


def test_the_run_delivers_its_best_policy_loaded_in_place_after_freeing_adams_state(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    from learner.evaluation import BEST_DIR

    loads = []
    real = Policy.from_pretrained.__func__

    def counting(cls, path, **kw):
        loads.append(str(path))
        return real(cls, path, **kw)

    cfg = tiny_config(tmp_path, run_name="best", iterations=2, eval_every=0, kl_coef=0.0)
    run = learner.run.setup(cfg)
    try:
        learner.run.start_of_rl(run)
        learner.run.loop(run)
        # A best policy of an earlier iteration, with weights of its own (the run's, shifted).
        trained = {k: v.clone() for k, v in run.policy.model.state_dict().items()}
        with torch.no_grad():
            for p in run.policy.model.parameters():
                p.add_(0.01)
        shifted = {k: v.clone() for k, v in run.policy.model.state_dict().items()}
        save_checkpoint(run.dir / BEST_DIR, 1,
                        lambda tmp: run.policy.save_pretrained(tmp / "model"), keep=1 << 30)
        run.policy.model.load_state_dict(trained)
        run.state.counters.best_iteration = 1
        monkeypatch.setattr(Policy, "from_pretrained", classmethod(counting))
        learner.run.finish(run)
        assert loads == []  # no second model built
        assert not run.state.optimizer.state  # Adam's moments freed first
        own = run.policy.model.state_dict()
        assert all(torch.equal(own[k], v) for k, v in shifted.items())
        assert json.loads((tmp_path / "best" / "summary.json").read_text())["selected_iteration"] == 1
    finally:
        run.close()


def test_dtype_and_lora_settings_are_checked_before_any_work(tmp_path: Path, capsys) -> None:
    assert train.main(["--dtype", "fp8", "--runs-root", str(tmp_path)]) == 2
    assert "--dtype must be one of auto|bf16|fp16|fp32" in capsys.readouterr().err
    assert train.main(["--lora-rank", "4", "--lora-targets", "q_proj;rm", "--runs-root", str(tmp_path)]) == 2
    assert "--lora-targets" in capsys.readouterr().err
    assert train.main(["--lora-rank", "4", "--model", str(tmp_path), "--pretrain-steps", "5",
                       "--runs-root", str(tmp_path)]) == 2
    assert "pretrain --model in a run of its own" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_fp16_compute_trains_with_a_loss_scale_and_an_overflow_skips_the_step_without_stopping_the_run(
        tmp_path: Path) -> None:
    from learner.update import stepped

    path, _, records = _setup("text")
    policy = Policy.from_pretrained(path, compute_dtype="fp16")
    opt = torch.optim.Adam(policy.model.parameters(), lr=1e-3)
    n = len(records)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    # A loss scale far too large: the scaled gradients overflow, the step is skipped, the scale halves.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)
    stats = policy_update(policy, None, opt, None, records, np.ones(n), np.zeros(n), loss_cfg=LossSettings(),
                          on_policy=True, scaler=scaler)
    assert stats["fp16_overflow"] == 1.0 and stats["skipped"] == 0.0 and not stepped(stats)
    assert scaler.get_scale() == 2.0 ** 126
    assert all(torch.equal(before[k], v) for k, v in policy.model.state_dict().items())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    stats = policy_update(policy, None, opt, None, records, np.ones(n), np.zeros(n), loss_cfg=LossSettings(),
                          on_policy=True, scaler=scaler)
    assert stepped(stats) and stats["grad_norm"] > 0
    assert not all(torch.equal(before[k], v) for k, v in policy.model.state_dict().items())
    # A run in fp16 builds its loss scale, trains, and checkpoints it.
    learner.run.train(tiny_config(tmp_path, run_name="fp16", dtype="fp16", iterations=2, kl_coef=0.0))
    saved = torch.load(list_checkpoints(tmp_path / "fp16" / "checkpoints")[-1] / "trainer.pt", weights_only=True)
    assert saved["scaler"] and saved["scaler"]["scale"] > 0


def test_adam_takes_its_fused_kernel_only_for_large_plain_models() -> None:
    from agents.policies.tiny import build_tiny_model
    from learner.state import FUSED_ADAM_PARAMETERS, fused_adam

    tiny = Policy.from_pretrained(build_tiny_model("text"))
    assert not fused_adam(tiny.model.parameters())  # the embedded default keeps its numbers
    big = [torch.nn.Parameter(torch.zeros(FUSED_ADAM_PARAMETERS // 2 + 1)) for _ in range(2)]
    assert fused_adam(big)
    assert not fused_adam([*big, torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)])
