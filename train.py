"""Train an LLM/VLM agent with IS-corrected GRPO and freshness-aware prioritized replay.

    python train.py                                   # the default: tiny model, FrozenLake 4x4, ~8 min on 2 CPUs
    python train.py --config configs/frozenlake_fresh.yaml
    python train.py --iterations 100 --replay fresh --replay-ratio 1
    python train.py --resume runs/<name>              # continue exactly from the newest checkpoint
    python train.py --help                            # every flag, documented

One iteration: collect B tasks x G rollouts with the current policy -> one on-policy update ->
add the records to the replay buffer -> K replay updates on prioritized batches (PER weights
applied) -> periodic evaluation on held-out maps. Outputs go to ``runs/<run_name>/`` (see
``docs/training.md``). The loss is in ``learner/loss.py``; checkpoints in ``learner/checkpoint.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

# Idle OpenMP threads sleep instead of spinning: 2 spinning threads on 2 cores that another
# process also uses made updates 2-10x slower; sleeping costs ~10% on idle cores (measured,
# docs/performance_train.md). Must be set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
import yaml  # noqa: E402

from agents.evaluate import EVAL_SEED_OFFSET
from learner.cli import dataclass_parser, field_docs, replace_checked
from learner.checkpoint import (CheckpointError, list_checkpoints, resolve_resume, rng_state, save_checkpoint,
                                set_rng_state, verify_checkpoint)
from learner.loss import LossConfig, grpo_loss, ratio_stats, token_ratios
from learner.prefix import sampled_logprobs
from learner.report import MetricsLogger, board_probe, plot_curves, read_metrics, summarize

logger = logging.getLogger("train")

#: Seed blocks: training maps, warm-up maps and held-out evaluation maps never overlap.
TRAIN_SEED_BLOCK = 100_000_000  # per run seed: training task seeds are seed * BLOCK + i * B + b
WARMUP_SEED_BASE = 1_500_000_000
EVAL_SEED_BASE = EVAL_SEED_OFFSET  # held-out maps: the same seeds as python -m agents.evaluate
#: RL seconds of the default run (`python train.py`): the whole run stays under 10 min on 2 CPUs.
DEFAULT_TIME_BUDGET = 300.0


@dataclass
class Config:
    """Every knob of a run. Each field is a CLI flag (``--field-name``) and a YAML key."""

    # -- run -------------------------------------------------------------------------------
    run_name: str | None = None
    """outputs go to runs_root/run_name; default: <task>__s<seed>__<date-time>"""
    runs_root: str = "runs"
    """folder holding the run folders"""
    seed: int = 0
    """seed of everything (model init, maps, sampling, replay)"""
    device: str = "cpu"
    """torch device for the policy"""
    threads: int | None = None
    """torch intra-op threads for rollouts and evaluations (default: agents.policy's, 1 on <= 2 CPUs)"""
    update_threads: int | None = None
    """torch intra-op threads for the warm-up and the updates (default: available CPUs, at most 8)"""

    # -- task and model --------------------------------------------------------------------
    env_id: str = "freshper/FrozenLake-v0"
    """registered task id (python -m envs list)"""
    env_kwargs: dict | None = None
    """keyword arguments of the task (JSON on the command line); default: {"feedback": false} for tasks whose board is their whole state (FrozenLake, Sokoban) in window:0 context, else {}"""
    context: str = "window:0"
    """prompt context: 'full' (whole conversation) or 'window:k' (instructions + last k turns)"""
    model: str | None = None
    """local model folder (HF layout); default: the embedded tiny model of the task's modality"""
    max_new_tokens: int = 8
    """reply length limit per turn, in tokens"""
    max_context_tokens: int = 1024
    """per-episode context budget; an episode that would overflow is truncated cleanly"""
    temperature: float = 1.0
    """sampling temperature of rollouts (log-probs are taken at the same temperature)"""

    # -- format warm-up (supervised, reply format only) -------------------------------------
    warmup_seconds: float | None = None
    """time cap of the format warm-up on scripted random legal replies; default 100 s for the tiny model, 0 with --model"""
    warmup_steps: int | None = 300
    """warm-up optimizer steps (the warm-up ends at whichever of steps/seconds comes first)"""
    warmup_lr: float = 3e-3
    """learning rate of the warm-up"""
    warmup_tasks: int = 4
    """maps per warm-up step (scripted episodes: warmup_tasks x group_size)"""

    # -- rollouts and the RL schedule -------------------------------------------------------
    tasks_per_iter: int = 8
    """B: tasks (maps) per iteration"""
    group_size: int = 8
    """G: rollouts per task, the GRPO group"""
    iterations: int | None = None
    """stop after this many iterations"""
    time_budget: float | None = None
    """stop the RL phase after this many seconds; if neither this nor --iterations is set: 300"""

    # -- the loss --------------------------------------------------------------------------
    loss: str = "clip"
    """'clip': clipped surrogate with dual clip; 'tis': truncated importance sampling"""
    clip_low: float = 0.2
    """lower clip: ratios below 1 - clip_low are clipped"""
    clip_high: float = 0.2
    """upper clip: ratios above 1 + clip_high are clipped"""
    dual_clip: float | None = 3.0
    """dual-clip constant c for negative advantages (none: off)"""
    tis_cap: float = 2.0
    """truncation C of the 'tis' loss"""
    sequence_ratio: bool = False
    """use one (geometric-mean) ratio per sequence instead of per token"""
    kl_coef: float = 0.04
    """weight of the k3 KL to the reference (post-warm-up) policy; 0: off"""
    lr: float = 3e-4
    """Adam learning rate of the RL phase"""
    lr_warmup_steps: int = 0
    """linear learning-rate warm-up over this many optimizer steps"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    micro_batch: int = 256
    """sequences per forward/backward pass (gradients accumulate over the batch)"""
    max_nonfinite: int = 5
    """stop the run after this many consecutive updates with a non-finite loss or gradient"""

    # -- replay ----------------------------------------------------------------------------
    replay: str = "none"
    """'none' (on-policy only), 'fresh' (FreshPER), 'per' (no age decay), 'uniform'"""
    replay_ratio: int = 1
    """K: replay updates per iteration"""
    replay_batch: int | None = None
    """trajectories per replay update; default B x G"""
    buffer_capacity: int = 640
    """trajectories kept in the buffer (FIFO)"""
    priority: str = "return"
    """base priority: 'return' (|R| + eps) or 'advantage' (|A| + eps)"""
    priority_eps: float = 1e-2
    """floor of the base priority"""
    alpha: float = 1.0
    """priority exponent"""
    tau: float = 10.0
    """freshness decay in optimizer steps (sampling half-life tau ln2 / alpha)"""
    beta: float = 0.4
    """initial IS-correction exponent, annealed linearly to beta_final"""
    beta_final: float = 1.0
    """final IS-correction exponent"""
    beta_anneal_steps: int | None = None
    """optimizer steps over which beta anneals; default the run's expected steps"""

    # -- evaluation, checkpoints, logging ---------------------------------------------------
    eval_every: int = 10
    """evaluate on held-out maps every this many iterations (0: never during training)"""
    eval_episodes: int = 64
    """episodes of a periodic evaluation"""
    initial_eval_episodes: int = 64
    """episodes of the evaluation before the warm-up (the untrained model replies junk for 8 turns)"""
    final_eval_episodes: int = 200
    """episodes of the start-of-RL (post-warm-up) and final evaluations: the learning claim compares these"""
    eval_greedy: bool = False
    """greedy decoding in evaluations; default sampled at --temperature (the policy being trained: early in
    training greedy decoding of the tiny model collapses to one move)"""
    eval_both: bool = True
    """also evaluate with the other decoding at the start of RL and at the end (reported beside the verdict)"""
    checkpoint_every: int = 25
    """write a checkpoint every this many iterations (and at the end)"""
    keep_checkpoints: int = 2
    """how many checkpoints to keep"""
    resume: str | None = None
    """continue from a checkpoint, a checkpoints/ folder or a run folder"""
    tensorboard: bool = True
    """write TensorBoard events to runs/<name>/tensorboard"""
    progress: bool = True
    """show a progress bar"""
    gifs: int = 4
    """GIFs of evaluation episodes to save for image tasks"""


# -- config: CLI and YAML (the generic part is learner/cli.py) ---------------------------------
def build_parser() -> argparse.ArgumentParser:
    """``--config`` plus one documented flag per Config field."""
    return dataclass_parser(Config, description=__doc__)


def config_from_dict(values: dict[str, Any], base: Config | None = None) -> Config:
    """A Config with ``values`` applied over ``base``; unknown keys are a clear error."""
    return replace_checked(base or Config(), values)


def parse_config(argv: Sequence[str] | None = None) -> Config:
    """Defaults <- ``--config`` YAML <- the resumed run's config <- flags given on the command line."""
    args = vars(build_parser().parse_args(argv))
    cfg = Config()
    path = args.pop("config", None)
    if path:
        with open(path, encoding="utf-8") as fh:
            cfg = config_from_dict(yaml.safe_load(fh) or {}, cfg)
    resume = args.get("resume")
    if resume:
        ckpt = resolve_resume(resume)
        saved = yaml.safe_load((ckpt / "config.yaml").read_text(encoding="utf-8")) if (ckpt / "config.yaml").exists() else {}
        cfg = config_from_dict(saved, cfg)
    cfg = config_from_dict(args, cfg)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Raise ValueError on settings that cannot work, saying which flag to change."""
    checks = [
        (cfg.replay in ("none", "fresh", "per", "uniform"), f"--replay must be none|fresh|per|uniform, got {cfg.replay!r}"),
        (cfg.priority in ("return", "advantage"), f"--priority must be return|advantage, got {cfg.priority!r}"),
        (cfg.loss in ("clip", "tis"), f"--loss must be clip|tis, got {cfg.loss!r}"),
        (cfg.tasks_per_iter >= 1 and cfg.group_size >= 1, "--tasks-per-iter and --group-size must be >= 1"),
        (cfg.seed >= 0 and cfg.seed * TRAIN_SEED_BLOCK < WARMUP_SEED_BASE, f"--seed must be in [0, {WARMUP_SEED_BASE // TRAIN_SEED_BLOCK})"),
        (cfg.micro_batch >= 1 and cfg.max_nonfinite >= 1, "--micro-batch and --max-nonfinite must be >= 1"),
        (cfg.context == "full" or cfg.context.startswith("window:"), f"--context must be 'full' or 'window:k', got {cfg.context!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


# -- helpers ---------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train_seeds(cfg: Config, iteration: int) -> list[int]:
    """Task seeds of one iteration: a function of the iteration counter (exact resume), disjoint
    from warm-up and evaluation seeds."""
    start = cfg.seed * TRAIN_SEED_BLOCK + iteration * cfg.tasks_per_iter
    if start + cfg.tasks_per_iter > (cfg.seed + 1) * TRAIN_SEED_BLOCK:
        raise ValueError("ran out of training seeds for this run seed")
    return list(range(start, start + cfg.tasks_per_iter))


class TrajectoryCodec:
    """Replay-buffer codec: a record's own lossless, pickle-free blob."""

    def encode(self, item: Any) -> bytes:
        return item.to_bytes()

    def decode(self, data: bytes) -> Any:
        from agents.record import Trajectory

        return Trajectory.from_bytes(data)


class NonFiniteError(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


def _pad(rows: list[np.ndarray], t_max: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(len(rows), t_max, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(np.asarray(r), dtype=dtype)
    return out


def masked(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Zero the log-probs of unsampled positions (prompt tokens may be -inf, e.g. image pads)."""
    return torch.where(mask > 0, logp, torch.zeros_like(logp))


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class torch_threads:
    """Context manager: ``torch.set_num_threads(n)`` inside, the previous count restored after
    (cheap; lets updates use every core while generation keeps its own setting)."""

    def __init__(self, n: int | None) -> None:
        self.n = n

    def __enter__(self) -> None:
        self.previous = torch.get_num_threads()
        if self.n:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.previous)


def policy_update(policy, ref, optimizer, scheduler, trajs: list, weights: np.ndarray, ages: np.ndarray,
                  cfg: Config, loss_cfg: LossConfig, on_policy: bool) -> dict[str, float]:
    """One optimizer step on ``trajs`` (every sampled token carries its trajectory's stored
    advantage and PER weight). On the on-policy update the behaviour log-probs are the current
    ones, detached, so the ratio is exactly 1; the gap to the stored ones is logged.

    Returns statistics; ``skipped`` is 1 when the loss or gradient was not finite (no step taken).
    """
    rows = [(i, s) for i, t in enumerate(trajs) for s in t.samples if s.num_sampled > 0]
    n_tokens = float(sum(s.num_sampled for _, s in rows))
    optimizer.zero_grad(set_to_none=True)
    if not rows:
        return {"skipped": 0.0, "tokens": 0.0}
    policy.model.train()
    total_loss, clip_tokens, kl_sum, gap, seen_tokens = 0.0, 0.0, 0.0, 0.0, 0
    ratios, token_ages = [], []
    for start in range(0, len(rows), cfg.micro_batch):
        chunk = rows[start : start + cfg.micro_batch]
        samples = [s for _, s in chunk]
        images = [[trajs[i].images[k] for k in s.image_ids] for i, s in chunk]
        t_max = max(len(s.token_ids) for s in samples)
        seen_tokens += sum(len(s.token_ids) for s in samples)
        mask = _pad([s.loss_mask for s in samples], t_max, torch.float32)
        mu = _pad([s.behavior_logprobs for s in samples], t_max, torch.float32)
        logp = masked(sampled_logprobs(policy, samples, images, cfg.temperature), mask)
        if on_policy:
            gap = max(gap, float(((logp.detach() - mu).abs() * mask).max().item()))
            mu = logp.detach()
        ref_lp = None
        if loss_cfg.kl_coef != 0.0:
            with torch.no_grad():
                ref_lp = masked(sampled_logprobs(ref, samples, images, cfg.temperature), mask)
        adv = torch.tensor([trajs[i].advantage for i, _ in chunk], dtype=torch.float32)
        w = torch.tensor([float(weights[i]) for i, _ in chunk], dtype=torch.float32)
        age = torch.tensor([float(ages[i]) for i, _ in chunk], dtype=torch.float32)
        loss, st = grpo_loss(logp, mu, mask, adv, w, loss_cfg, ref_lp, age, num_tokens=n_tokens)
        if not torch.isfinite(loss):
            optimizer.zero_grad(set_to_none=True)
            return {"skipped": 1.0, "nonfinite": "loss"}  # type: ignore[dict-item]
        loss.backward()
        total_loss += float(loss.item())
        clip_tokens += st["clip_frac"] * st["tokens"]
        kl_sum += st["kl"] * st["tokens"]
        on = mask > 0
        ratios.append(token_ratios(logp.detach(), mu, mask, cfg.sequence_ratio)[on])
        token_ages.append(age[:, None].expand_as(mask)[on])
    params = [p for p in policy.model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return {"skipped": 1.0, "nonfinite": "grad"}  # type: ignore[dict-item]
    optimizer.step()
    scheduler.step()
    policy.model.eval()
    stats = ratio_stats(torch.cat(ratios), torch.cat(token_ages))
    stats.update(loss=total_loss, clip_frac=clip_tokens / n_tokens, kl=kl_sum / n_tokens, grad_norm=float(grad_norm),
                 tokens=n_tokens, seq_tokens=float(seen_tokens), skipped=0.0, weight_mean=float(np.mean(weights)))
    if on_policy:
        stats["behavior_logprob_gap"] = gap
    return stats


def warmup(policy, cfg: Config, seconds: float) -> dict[str, float]:
    """Supervised format warm-up: maximise the likelihood of scripted replies that are random
    legal moves, so the model learns the reply format but no preference between moves."""
    from agents.runner import Runner

    rng = random.Random(cfg.seed)

    def random_legal_reply(obs, info, env) -> str:
        task = env.unwrapped
        return type(task).format_reply(rng.choice(task.legal_actions()))

    runner = Runner(policy, cfg.env_id, env_kwargs=cfg.env_kwargs, group_size=cfg.group_size, context=cfg.context,
                    max_new_tokens=cfg.max_new_tokens, temperature=1.0, max_context_tokens=cfg.max_context_tokens,
                    seed=cfg.seed)
    optimizer = torch.optim.Adam(policy.model.parameters(), lr=cfg.warmup_lr)
    start, step, losses = time.monotonic(), 0, []
    while time.monotonic() - start < seconds and (cfg.warmup_steps is None or step < cfg.warmup_steps):
        seeds = [WARMUP_SEED_BASE + step * cfg.warmup_tasks + b for b in range(cfg.warmup_tasks)]
        records, _ = runner.collect(seeds, policy_version=0, reply_fn=random_legal_reply)
        samples = [s for r in records for s in r.samples if s.num_sampled > 0]
        images = [[r.images[k] for k in s.image_ids] for r in records for s in r.samples if s.num_sampled > 0]
        policy.model.train()
        optimizer.zero_grad(set_to_none=True)
        n = float(sum(s.num_sampled for s in samples))
        loss_total = 0.0
        for i in range(0, len(samples), cfg.micro_batch):
            part = samples[i : i + cfg.micro_batch]
            mask = _pad([s.loss_mask for s in part], max(len(s.token_ids) for s in part), torch.float32)
            loss = -masked(sampled_logprobs(policy, part, images[i : i + cfg.micro_batch]), mask).sum() / n
            loss.backward()
            loss_total += float(loss.item())
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        policy.model.eval()
        losses.append(loss_total)
        step += 1
    return {"warmup_steps": float(step), "warmup_seconds": time.monotonic() - start,
            "warmup_loss_first": losses[0] if losses else float("nan"), "warmup_loss_last": losses[-1] if losses else float("nan")}


def run_eval(policy, cfg: Config, episodes: int, tag: str, greedy: bool | None = None) -> tuple[dict[str, Any], list]:
    """Evaluate on held-out maps (seeds from EVAL_SEED_BASE, never trained on); return a flat
    dict (success with its 95% Wilson CI, return, invalid rate, turns, board probe) and the records."""
    from agents.evaluate import evaluate

    greedy = cfg.eval_greedy if greedy is None else greedy
    result = evaluate(policy, cfg.env_id, episodes=episodes, seed=EVAL_SEED_BASE, greedy=greedy,
                      env_kwargs=cfg.env_kwargs, context=cfg.context, max_new_tokens=cfg.max_new_tokens,
                      temperature=cfg.temperature, max_context_tokens=cfg.max_context_tokens)
    out: dict[str, Any] = {
        "phase": tag, "decoding": "greedy" if greedy else "sampled", "episodes_eval": result.episodes,
        "success": result.success_rate, "success_ci_low": result.success_ci[0], "success_ci_high": result.success_ci[1],
        "return_mean": result.mean_return, "invalid_rate": result.invalid_reply_rate, "turns_mean": result.mean_turns,
    }
    out.update(board_probe(result.records))
    return out, result.records


def save_eval_outputs(records: list, run_dir: Path, tag: str, cfg: Config, is_vision: bool) -> None:
    """Evaluation records (and GIFs of a few episodes for image tasks) under runs/<name>/eval/<tag>/."""
    from agents.evaluate import save_gifs
    from agents.record import save_records

    folder = run_dir / "eval" / tag
    save_records(records, folder)
    if is_vision and cfg.gifs > 0:
        save_gifs(records, folder, limit=cfg.gifs)


def evaluate_phase(policy, cfg: Config, metrics: MetricsLogger, run_dir: Path, tag: str, episodes: int,
                   state: dict[str, Any], evals: dict[str, dict[str, Any]], both: bool) -> None:
    """Run the evaluation of a phase (and, if ``both``, the other decoding mode too), log and save it."""
    modes = [cfg.eval_greedy] + ([not cfg.eval_greedy] if both else [])
    for k, greedy in enumerate(modes):
        key = tag if k == 0 else f"{tag}_{'greedy' if greedy else 'sampled'}"
        evals[key], recs = run_eval(policy, cfg, episodes, key, greedy)
        metrics.log({"kind": "eval", "iteration": state["iteration"], "episodes": state["episodes"], **evals[key]})
        save_eval_outputs(recs, run_dir, key, cfg, policy.is_vision)


def make_buffer(cfg: Config, total_steps: int):
    from replay.buffer import ReplayBuffer

    return ReplayBuffer(cfg.buffer_capacity, mode=cfg.replay, alpha=cfg.alpha, tau=cfg.tau, beta=cfg.beta,
                        beta_final=cfg.beta_final, beta_anneal_steps=cfg.beta_anneal_steps or total_steps,
                        eps=cfg.priority_eps, seed=cfg.seed)


# -- the run ---------------------------------------------------------------------------------
def train(cfg: Config) -> dict[str, Any]:
    """Run the whole job (warm-up, RL loop, evaluations) and return the summary."""
    from tqdm.auto import tqdm

    from agents.policy import Policy, configure_threads
    from agents.runner import Runner, default_env_kwargs

    validate(cfg)
    if cfg.env_kwargs is None:
        cfg.env_kwargs = default_env_kwargs(cfg.env_id, cfg.context)
    configure_threads(cfg.threads)
    update_threads = cfg.update_threads or max(1, min(8, available_cpus()))
    wall_start = time.monotonic()
    resume_ckpt = resolve_resume(cfg.resume) if cfg.resume else None
    if resume_ckpt is not None:
        verify_checkpoint(resume_ckpt)
        run_dir = resume_ckpt.parent.parent
    else:
        task = cfg.env_id.split("/")[-1]
        cfg.run_name = cfg.run_name or f"{task}__s{cfg.seed}__{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = Path(cfg.runs_root) / cfg.run_name
        if list_checkpoints(run_dir / "checkpoints"):
            raise FileExistsError(f"{run_dir} already has checkpoints: pass --resume {run_dir} or another --run-name")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")
    print(f"run folder: {run_dir}\n{to_yaml(cfg)}")
    time_budget = cfg.time_budget if (cfg.time_budget is not None or cfg.iterations is not None) else DEFAULT_TIME_BUDGET
    steps_per_iter = 1 + (cfg.replay_ratio if cfg.replay != "none" else 0)
    expected_iters = cfg.iterations or int((time_budget or DEFAULT_TIME_BUDGET) / 2.0)
    loss_cfg = LossConfig(loss=cfg.loss, clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
                          tis_cap=cfg.tis_cap, sequence_ratio=cfg.sequence_ratio, kl_coef=cfg.kl_coef)
    metrics = MetricsLogger(run_dir, cfg.tensorboard, resume_iteration=None if resume_ckpt is None else
                            int(verify_checkpoint(resume_ckpt)["iteration"]))

    # -- the policy, its reference, optimizer, buffer: fresh or from the checkpoint ---------
    import envs  # noqa: F401  (registers the tasks)

    modality = envs.task_spec(cfg.env_id).modality
    evals: dict[str, dict[str, Any]] = {}
    if resume_ckpt is None:
        seed_everything(cfg.seed)
        if cfg.model is None:
            from agents.tiny import build_tiny_model

            model_path = build_tiny_model(modality, seed=cfg.seed)
        else:
            model_path = Path(cfg.model)
        policy = Policy.from_pretrained(model_path, device=cfg.device)
        warm_seconds = cfg.warmup_seconds if cfg.warmup_seconds is not None else (100.0 if cfg.model is None else 0.0)
        start = {"iteration": 0, "episodes": 0}
        if warm_seconds > 0 and cfg.warmup_steps != 0:
            evaluate_phase(policy, cfg, metrics, run_dir, "initial", cfg.initial_eval_episodes, start, evals, False)
            with torch_threads(update_threads):
                wstats = warmup(policy, cfg, warm_seconds)
            metrics.log({"kind": "warmup", "iteration": 0, "episodes": 0, **wstats})
            print(f"format warm-up: {wstats['warmup_steps']:.0f} steps in {wstats['warmup_seconds']:.0f} s, "
                  f"loss {wstats['warmup_loss_first']:.3f} -> {wstats['warmup_loss_last']:.3f}")
        evaluate_phase(policy, cfg, metrics, run_dir, "baseline", cfg.final_eval_episodes, start, evals, cfg.eval_both)
        policy.save_pretrained(run_dir / "reference")  # the KL reference: the policy RL starts from
    else:
        policy = Policy.from_pretrained(resume_ckpt / "model", device=cfg.device)
        for row in read_metrics(run_dir / "metrics.jsonl"):
            if row.get("kind") == "eval" and str(row.get("phase")).startswith(("initial", "baseline")):
                evals[row["phase"]] = row
    ref = None
    if cfg.kl_coef != 0.0:
        ref = Policy.from_pretrained(run_dir / "reference", device=cfg.device)
        ref.model.requires_grad_(False)
    optimizer = torch.optim.Adam(policy.model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, cfg.lr_warmup_steps)))
    buffer = make_buffer(cfg, expected_iters * steps_per_iter) if cfg.replay != "none" else None
    state = {"iteration": 0, "global_step": 0, "episodes": 0, "rl_seconds": 0.0, "nonfinite_total": 0,
             "nonfinite_consecutive": 0}
    if resume_ckpt is not None:
        try:
            saved = torch.load(resume_ckpt / "trainer.pt", weights_only=True)
            optimizer.load_state_dict(saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
            state.update(saved["state"])
            set_rng_state(saved["rng"])
            if buffer is not None:
                from replay.buffer import ReplayBuffer

                buffer = ReplayBuffer.load(resume_ckpt / "replay.npz", TrajectoryCodec())
        except Exception as exc:  # noqa: BLE001 - any failure here means the checkpoint is unusable
            raise CheckpointError(f"cannot restore training state from {resume_ckpt}: {exc}") from exc
        print(f"resumed from {resume_ckpt} at iteration {state['iteration']}")

    def write_checkpoint() -> Path:
        def write(folder: Path) -> None:
            policy.save_pretrained(folder / "model")
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "state": dict(state),
                        "rng": rng_state()}, folder / "trainer.pt")
            if buffer is not None:
                buffer.save(folder / "replay.npz", TrajectoryCodec())
            (folder / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")

        return save_checkpoint(run_dir / "checkpoints", state["iteration"], write, keep=cfg.keep_checkpoints)

    if resume_ckpt is None:
        write_checkpoint()  # iteration 0: the post-warm-up policy, so a resume never reruns the warm-up

    # -- the RL loop ---------------------------------------------------------------------------
    by_iter = cfg.iterations is not None
    bar = tqdm(total=cfg.iterations if by_iter else int(time_budget), initial=state["iteration"] if by_iter else int(state["rl_seconds"]),
               unit="it" if by_iter else "s", disable=not cfg.progress, dynamic_ncols=True)
    loop_start = time.monotonic() - state["rl_seconds"]
    try:
        while (cfg.iterations is None or state["iteration"] < cfg.iterations) and \
                (time_budget is None or time.monotonic() - loop_start < time_budget):
            it = state["iteration"]
            seed_everything(cfg.seed * 1_000_003 + it)  # everything random in an iteration follows from its counter
            t0 = time.monotonic()
            # 1. collect B tasks x G rollouts with the current policy
            runner = Runner(policy, cfg.env_id, env_kwargs=cfg.env_kwargs, group_size=cfg.group_size,
                            context=cfg.context, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                            max_context_tokens=cfg.max_context_tokens, seed=cfg.seed * 1_000_003 + it)
            records, rstats = runner.collect(train_seeds(cfg, it), policy_version=state["global_step"])
            good = [r for r in records if not r.failed]
            t1 = time.monotonic()
            # 2. one on-policy update (ratio exactly 1)
            ones, zeros = np.ones(len(good)), np.zeros(len(good))
            with torch_threads(update_threads):
                upd = policy_update(policy, ref, optimizer, scheduler, good, ones, zeros, cfg, loss_cfg, on_policy=True)
            t2 = time.monotonic()
            # 3. add the records to the buffer, 4. K replay updates on prioritized batches
            replay_stats: list[dict[str, float]] = []
            if buffer is not None and good:
                base = [abs(r.episode_return) if cfg.priority == "return" else abs(r.advantage) for r in good]
                buffer.add(good, np.asarray(base) + cfg.priority_eps, step=state["global_step"])
            state["global_step"] += int(not upd["skipped"])
            t3 = time.monotonic()
            for _ in range(cfg.replay_ratio if buffer is not None else 0):
                batch = buffer.sample(cfg.replay_batch or cfg.tasks_per_iter * cfg.group_size, step=state["global_step"])
                with torch_threads(update_threads):
                    rst = policy_update(policy, ref, optimizer, scheduler, list(batch.items), batch.weights,
                                        batch.ages, cfg, loss_cfg, on_policy=False)
                replay_stats.append(rst)
                state["global_step"] += int(not rst["skipped"])
            t4 = time.monotonic()
            for st in [upd, *replay_stats]:
                state["nonfinite_consecutive"] = state["nonfinite_consecutive"] + 1 if st["skipped"] else 0
                state["nonfinite_total"] += int(st["skipped"])
                if st["skipped"]:
                    logger.warning("iteration %d: non-finite %s, update skipped (%d in a row)", it,
                                   st.get("nonfinite"), state["nonfinite_consecutive"])
                if state["nonfinite_consecutive"] >= cfg.max_nonfinite:
                    raise NonFiniteError(
                        f"{state['nonfinite_consecutive']} consecutive updates had a non-finite loss or gradient "
                        f"(last: {st.get('nonfinite')}); stopping. The last good checkpoint is intact in "
                        f"{run_dir / 'checkpoints'}; lower --lr, check --kl-coef, or inspect the data.")
            state["iteration"] += 1
            state["episodes"] += len(records)
            state["rl_seconds"] = time.monotonic() - loop_start
            # 5. log
            returns = np.array([r.episode_return for r in good]) if good else np.zeros(1)
            groups: dict[int, list[float]] = {}
            for r in good:
                groups.setdefault(r.group_id, []).append(r.episode_return)
            row: dict[str, Any] = {
                "kind": "train", "iteration": state["iteration"], "episodes": state["episodes"],
                "global_step": state["global_step"], "return_mean": float(returns.mean()),
                "success": float(np.mean([r.success for r in good])) if good else 0.0,
                "invalid_rate": float(np.mean([not t.action_is_valid for r in good for t in r.turns])) if good else 0.0,
                "turns_mean": float(np.mean([r.num_turns for r in good])) if good else 0.0,
                "groups_all_equal": sum(1 for g in groups.values() if np.ptp(g) == 0), "groups": len(groups),
                "failed_records": len(records) - len(good), "nonfinite_total": state["nonfinite_total"],
                **{k: v for k, v in upd.items() if isinstance(v, float)},
                "time_rollout_s": t1 - t0, "time_update_s": t2 - t1, "time_buffer_s": t3 - t2, "time_replay_s": t4 - t3,
                "time_total_s": state["rl_seconds"], "tokens_per_s": upd.get("seq_tokens", 0.0) / max(t2 - t1, 1e-9),
            }
            if replay_stats:
                for k in sorted({k for st in replay_stats for k in st if isinstance(st[k], float)}):
                    row[f"replay_{k}" if not k.startswith("ess") else k] = float(np.mean([st[k] for st in replay_stats if k in st]))
                ages = buffer.age_stats(state["global_step"])
                row.update(buffer_size=ages["size"], buffer_age_mean=ages.get("age_mean", 0.0),
                           buffer_age_max=ages.get("age_max", 0.0))
            metrics.log(row)
            # 6. evaluate on held-out maps, checkpoint
            if cfg.eval_every and state["iteration"] % cfg.eval_every == 0:
                ev, _ = run_eval(policy, cfg, cfg.eval_episodes, f"iter_{state['iteration']}")
                metrics.log({"kind": "eval", "iteration": state["iteration"], "episodes": state["episodes"], **ev})
                bar.write(f"iter {state['iteration']}: held-out success {ev['success']:.2f} "
                          f"[{ev['success_ci_low']:.2f}, {ev['success_ci_high']:.2f}]")
            if cfg.checkpoint_every and state["iteration"] % cfg.checkpoint_every == 0:
                write_checkpoint()
            bar.set_postfix(ret=f"{row['return_mean']:.2f}", succ=f"{row['success']:.2f}",
                            eps_s=f"{len(records) / max(t4 - t0, 1e-9):.0f}", tok_s=f"{row['tokens_per_s']:.0f}")
            bar.update(1 if by_iter else max(0, int(state["rl_seconds"]) - bar.n))
    finally:
        bar.close()
    if not list_checkpoints(run_dir / "checkpoints") or list_checkpoints(run_dir / "checkpoints")[-1].name != f"iter_{state['iteration']:06d}":
        write_checkpoint()

    # -- final evaluation and summary ----------------------------------------------------------
    evaluate_phase(policy, cfg, metrics, run_dir, "final", cfg.final_eval_episodes, state, evals, cfg.eval_both)
    metrics.close()
    summary = summarize(evals, state, time.monotonic() - wall_start)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    (run_dir / "summary.txt").write_text(summary["text"] + "\n", encoding="utf-8")
    plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png", title=summary["verdict"])
    print(summary["text"])
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    cfg = parse_config(argv)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # process-wide: restored on return
    try:
        train(cfg)
    except (NonFiniteError, CheckpointError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.use_deterministic_algorithms(previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
