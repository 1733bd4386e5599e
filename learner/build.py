"""What a run trains with, built from its resolved settings (:class:`~learner.config.Resolved`):
:func:`build_learner` chooses the learner once (:class:`learner.learners.LocalLearner`, or under
torchrun :class:`learner.distributed.ShardedLearner`) and builds it: the policy (full weights or
LoRA adapters, in the spec's compute precision), a sharded learner's shard of it, the run state
(optimizer, schedule, replay buffer), the update step and its KL reference.
:func:`serve_rank` is the life of a torchrun rank other than 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agents.policies.spec import PolicySpec
from learner import distributed
from learner.config import Config, Resolved, resolve
from learner.learners import Learner, LocalLearner, UpdateStep
from learner.state import ReplaySettings, TrainerState


def load_policy(cfg: Config, model_path: Path, spec: PolicySpec, *, sampler: bool = False, device: str | None = None):
    """The policy a run trains, from a model folder (or a LoRA run's adapter folder on resume):
    fp32 weights computing in ``--dtype`` under autocast, or with ``--lora-rank`` a frozen base
    in ``--dtype`` with fp32 adapters; gradient checkpointing as asked. ``sampler``: the copy a
    sharded learner's rank 0 plays with (weights in ``--dtype``, no checkpointing)."""
    from agents.policies.lora import add_lora, has_lora
    from agents.policies.policy import Policy

    device = device or cfg.model.device
    compute = spec.compute_dtype
    weights = compute if (spec.lora or sampler) else torch.float32
    policy = Policy.from_pretrained(model_path, device=device, dtype=weights, compute_dtype=compute)
    if cfg.rollout.system_prompt is not None:  # saved with every checkpoint from here on
        policy.set_system_prompt(cfg.rollout.system_prompt)
    if spec.lora and not has_lora(policy.model):
        add_lora(policy, spec.lora)
    elif has_lora(policy.model) and not spec.lora:
        raise ValueError(f"{model_path} holds LoRA adapters: train it with the --lora-rank it was trained with "
                         f"({policy.lora.rank}), or merge it first (python -m agents.merge_lora)")
    if cfg.model.gradient_checkpointing and not sampler:
        policy.enable_gradient_checkpointing()
    return policy


def load_sharded_learner(cfg: Config, model_path: Path, spec: PolicySpec):
    """This rank's shard of the trained policy (FSDP2, :mod:`learner.distributed`): loaded on the
    CPU in fp32, adapters and checkpointing added, then sharded onto the rank's device."""
    policy = load_policy(cfg, model_path, spec, device="cpu")
    if policy.is_vision and policy.model.config.model_type not in ("qwen2_vl", "qwen2_5_vl"):
        raise ValueError(f"the sharded learner supports text models and Qwen2-VL-family VLMs, got "
                         f"{policy.model.config.model_type}")
    distributed.shard_policy(policy, spec.compute_dtype)
    if torch.device(cfg.model.device).type == "cuda":
        policy.model.to(torch.device(cfg.model.device))
    return policy


def trainer_state(cfg: Config, policy, replay: ReplaySettings) -> TrainerState:
    """The optimizer (over the trainable parameters: all, or the LoRA adapters), schedule,
    replay buffer and counters of a run."""
    rl = cfg.rl
    return TrainerState([p for p in policy.model.parameters() if p.requires_grad], rl.lr, rl.lr_warmup_steps,
                        replay, (rl.adam_beta1, rl.adam_beta2), fp16=policy.compute_dtype == torch.float16,
                        device=policy.device)


def reference_policy(policy, run_dir: Path, spec: PolicySpec):
    """The KL reference of the trained ``policy``: the base with the adapters off for a LoRA
    policy (no copy), else the policy RL started from (``run_dir/reference``), frozen, in the
    compute dtype (one unsharded copy per rank in a sharded learner)."""
    from agents.policies.lora import has_lora
    from agents.policies.policy import Policy
    from learner.update import AdapterReference

    if has_lora(policy.model):
        return AdapterReference(policy)
    ref = Policy.from_pretrained(run_dir / "reference", device=policy.device, dtype=spec.compute_dtype)
    ref.model.requires_grad_(False)
    return ref


def think_span(policy) -> tuple[int, int]:
    """The token ids of ``<think>`` and ``</think>`` (``--no-think-loss``); each must be one token."""
    ids = [policy.tokenizer.encode(tag, add_special_tokens=False) for tag in ("<think>", "</think>")]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"--no-think-loss needs <think> and </think> to be single tokens of the model's vocabulary; "
                         f"they encode as {ids[0]} and {ids[1]}")
    return ids[0][0], ids[1][0]


def update_step(r: Resolved, trained, state: TrainerState, run_dir: Path) -> UpdateStep:
    """One rank's update of ``trained`` (its KL reference, ``run_dir/reference``, loaded on first use)."""
    skip_span = None if r.cfg.rl.think_loss else think_span(trained)
    return UpdateStep(trained, state, r.cfg, r.update_threads, skip_span,
                      lambda: reference_policy(trained, run_dir, r.spec))


def build_learner(r: Resolved, model_path: Path, run_dir: Path) -> Learner:
    """The run's learner, trained from ``model_path``: in this process, or (``r.sharded``) this
    rank's shard with an unsharded sampler copy for rank 0 to play and evaluate with."""
    cfg = r.cfg
    if r.sharded:
        policy = load_policy(cfg, model_path, r.spec, sampler=True)
        trained = load_sharded_learner(cfg, model_path, r.spec)
    else:
        policy = trained = load_policy(cfg, model_path, r.spec)
    state = trainer_state(cfg, trained, cfg.replay)
    step = update_step(r, trained, state, run_dir)
    return distributed.ShardedLearner(trained, policy, state, step) if r.sharded else LocalLearner(policy, state, step)


def serve_rank(cfg: Config) -> int:
    """A non-zero rank of a sharded learner: build this rank's shard of the start rank 0 chose
    (or of the checkpoint it resumes), then carry out rank 0's commands until it stops."""
    from agents.policies.policy import configure_threads

    command, payload = distributed.broadcast()
    if command != "start":
        return 2  # rank 0 refused to start; it says why
    model_path, run_dir, resume = payload
    r = resolve(cfg, world=distributed.world_size())
    configure_threads(cfg.model.threads)
    trained = load_sharded_learner(r.cfg, Path(model_path), r.spec)
    state = trainer_state(r.cfg, trained, ReplaySettings("none"))
    learner = distributed.ShardedLearner(trained, None, state, update_step(r, trained, state, Path(run_dir)))
    if resume is not None:
        learner.load(Path(resume))
    distributed.serve(learner)
    return 0


def check_reasoning(cfg: Config, env_kwargs: dict[str, Any]) -> None:
    """Refuse ``--reasoning lookahead|state|...`` (and ``--pretrain-follow-steps``) at start for
    a task that lacks what it needs."""
    import envs
    from learner.pretrain import follow_moves, think_text

    mode = cfg.pretrain.reasoning
    env = envs.make(cfg.rollout.env_id, **dict(env_kwargs))
    try:
        env.reset(seed=0)
        think_text(env.unwrapped, mode)  # its optional capabilities (envs.capabilities) the mode needs
        if cfg.pretrain.follow_steps > 0:
            follow_moves(env.unwrapped)
    except NotImplementedError as exc:
        raise ValueError(f"--reasoning {mode}: {exc or type(env.unwrapped).__name__ + ' has no text notation of its state'}") from None
    finally:
        env.close()
