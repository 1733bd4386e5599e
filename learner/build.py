"""What a run trains with, built from its :class:`~learner.config.Config`: the policy (full
weights or LoRA adapters, in the compute precision), a sharded learner's shard of it under
torchrun, its KL reference, the run state (optimizer, schedule, replay buffer) and the update
each rank carries out. :func:`serve_rank` is the life of a torchrun rank other than 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from learner import distributed
from agents.policies.spec import PolicySpec
from learner.config import Config, policy_spec
from learner.machine import available_cpus, torch_threads
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


def update_function(cfg: Config, policy, state: TrainerState, run_dir: Path, skip_span, spec: PolicySpec):
    """One rank's update of a sharded learner: ``(trajs, weights, ages, on_policy, shard) ->
    stats``, with its KL reference loaded on first use (after rank 0 wrote it)."""
    from learner.update import policy_update

    refs: list = []

    def reference():
        if cfg.loss.kl_coef == 0.0:
            return None
        if not refs:
            refs.append(reference_policy(policy, run_dir, spec))
        return refs[0]

    def update(trajs, weights, ages, on_policy, shard):
        threads = cfg.model.update_threads or max(1, min(8, available_cpus() // distributed.world_size()))
        with torch_threads(threads):
            return policy_update(policy, reference(), state.optimizer, state.scheduler, trajs, weights, ages,
                                 loss_cfg=cfg.loss, temperature=cfg.rollout.temperature, micro_batch=cfg.rl.micro(),
                                 max_grad_norm=cfg.rl.max_grad_norm, on_policy=on_policy, skip_span=skip_span,
                                 scaler=state.scaler, shard=shard)

    return update


def serve_rank(cfg: Config) -> int:
    """A non-zero rank of a sharded learner: build this rank's shard of the start rank 0 chose
    (or of the checkpoint it resumes), then carry out rank 0's commands until it stops."""
    from agents.policies.policy import configure_threads

    command, payload = distributed.broadcast()
    if command != "start":
        return 2  # rank 0 refused to start; it says why
    model_path, run_dir, resume = payload
    configure_threads(cfg.model.threads)
    spec = policy_spec(cfg)
    policy = load_sharded_learner(cfg, Path(model_path), spec)
    state = trainer_state(cfg, policy, ReplaySettings("none"))
    if resume is not None:
        state.load(Path(resume))
        distributed.load_sharded(policy, state.optimizer, Path(resume))
    skip_span = None if cfg.rl.think_loss else think_span(policy)
    distributed.serve(distributed.ShardedLearner(policy, None, state,
                                                 update_function(cfg, policy, state, Path(run_dir), skip_span, spec)))
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
