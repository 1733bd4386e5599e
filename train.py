"""Train an LLM/VLM agent with IS-corrected GRPO and freshness-aware prioritized replay.

    python train.py                                   # the default: tiny model, FrozenLake 4x4, ~20 min on 2 CPUs (~18 with its pretrained model cached)
    python train.py --config configs/sokoban_simple.yaml
    python train.py --iterations 100 --replay fresh --replay-ratio 1
    python train.py --resume runs/<name>              # continue exactly from the newest checkpoint
    python train.py --help                            # every flag, documented

A run: set up (run folder, the start model: by default the embedded tiny model pretrained on the
task's own transitions, cached) -> start of RL (held-out evaluation, KL reference, checkpoint 0)
-> the RL loop -> final evaluation and summary. One iteration: collect B tasks x G rollouts
with the current policy -> one on-policy update -> add the records to the replay buffer -> K
replay updates on prioritized batches (PER weights applied) -> periodic held-out evaluation.
Outputs go to ``runs/<run_name>/`` (``docs/training.md``). The loss is ``learner/loss.py``, the
updates ``learner/update.py``, pretraining ``learner/pretrain.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np


def busy_cores(seconds: float = 0.5) -> float | None:
    """How many cores other work keeps busy right now: the machine's non-idle CPU time over a
    short window (``/proc/stat``), less this process's own, in cores. None where there is no
    ``/proc/stat``."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="utf-8") as fh:
            values = [int(v) for v in fh.readline().split()[1:]]
        return sum(values), values[3] + (values[4] if len(values) > 4 else 0)  # total, idle + iowait

    try:
        own0, wall0 = time.process_time(), time.monotonic()
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
        own1, wall1 = time.process_time(), time.monotonic()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    machine = (1.0 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)
    return max(0.0, machine - (own1 - own0) / max(wall1 - wall0, 1e-9))


#: What :func:`busy_cores` measured when this module chose the wait policy (environment.json).
BUSY_CORES_AT_START: float | None = None


def default_omp_wait_policy() -> str:
    """How idle OpenMP threads wait, chosen once at start (torch reads it when it loads).

    Spinning (``ACTIVE``) makes the tiny model's updates and pretraining ~1.5x faster than
    sleeping on an otherwise idle machine, but ~1.7x slower than sleeping when another process
    keeps a core busy (measured, docs/performance_train.md). So: ``ACTIVE`` when the machine is
    idle at start, else ``PASSIVE``. Idle is measured now, over 0.5 s (under half a core busy):
    the 1-minute load average, the fallback where ``/proc/stat`` is missing, stays high for
    minutes after work that has ended, such as ``make``'s own set-up or a test run just before.
    ``OMP_WAIT_POLICY`` in the environment wins; ``learner/tools/sweep.py`` sets ``PASSIVE`` for
    runs side by side.
    """
    global BUSY_CORES_AT_START
    busy = BUSY_CORES_AT_START = busy_cores()
    if busy is not None:
        return "ACTIVE" if busy < 0.5 else "PASSIVE"
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform: the safe choice
        return "PASSIVE"
    return "ACTIVE" if load < 0.5 else "PASSIVE"


if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = default_omp_wait_policy()
import torch  # noqa: E402
import yaml  # noqa: E402

from envs.base import REASONINGS  # noqa: E402
from learner.checkpoint import (CheckpointError, checkpoint_name, clean_stale_temporaries, list_checkpoints,  # noqa: E402
                                resolve_resume, save_checkpoint, verify_checkpoint)
from learner.cli import dataclass_parser, load_config_file, replace_checked  # noqa: E402
from learner.loss import LossConfig  # noqa: E402
from learner.replay_log import NullReplayLog, open_replay_log  # noqa: E402
from learner.report import MetricsLogger, plot_curves, read_metrics, summarize, task_turn_diagnostics  # noqa: E402
from learner.trackers import parse_report_to  # noqa: E402
from learner.seeds import EVAL_SEED_BASE, MAX_RUN_SEED, VALID_SEED_BASE, train_seed  # noqa: E402
from learner import distributed  # noqa: E402
from learner.state import ReplaySettings, TrainerState  # noqa: E402

logger = logging.getLogger("train")

#: RL iterations of the default run (``python train.py``): with two replay updates per iteration
#: the delivered policy meets 0.60 held-out success and a 0.75 safe-move probe on 5 of 5 seeds
#: on 2 CPU cores and 4 of 5 on a GPU after 200 (docs/results/frozenlake.md#two-hundred-iterations).
DEFAULT_ITERATIONS = 200
#: The default pretraining goes on past its 400 steps until the model writes this share of
#: held-out next boards exactly: most seeds pass 0.80 at 400 steps, a few stall near 0.1 there
#: (docs/results/frozenlake.md#pretraining-until-the-model-writes-the-next-board).
DEFAULT_PRETRAIN_EXACT = 0.5
#: Pretraining steps of the embedded default when --pretrain-steps is not given.
DEFAULT_PRETRAIN_STEPS = 400


@dataclass
class Config:
    """Every knob of a run. Each field is a CLI flag (``--field-name``) and a YAML key."""

    # -- run -------------------------------------------------------------------------------
    run_name: str | None = None
    """outputs go to runs_root/run_name; default: <task>__s<seed>__<date-time>"""
    runs_root: str = "runs"
    """folder holding the run folders"""
    seed: int = 0
    """seed of everything (model init and pretraining unless --start-seed, tasks, sampling, replay)"""
    start_seed: int | None = None
    """seed of the start model alone (the embedded model's initialisation and its pretraining); default: --seed. Runs of several --seed values with one --start-seed share one start (built and cached once), so their spread is RL's alone, not the pretraining's"""
    device: str = "cpu"
    """torch device of the policy, its pretraining and its updates: cpu, cuda, cuda:N, or auto (CUDA where torch sees it)"""
    dtype: str = "auto"
    """compute precision of the policy, its KL reference, the sampler and vLLM: auto (bf16 on a GPU that supports it, else fp16; fp32 on the CPU), bf16, fp16 or fp32. Below fp32 the trained weights and Adam's state stay fp32 and forward passes run under autocast (mixed precision); log-probs are always fp32 (docs/scaling.md)"""
    gradient_checkpointing: bool = False
    """recompute each layer's activations in the backward pass: activation memory of one layer instead of all, for ~1/3 more compute; the learner then scores each sequence in one forward without the shared-prefix KV cache (docs/scaling.md)"""
    lora_rank: int = 0
    """train LoRA adapters of this rank on the language model's projections instead of every weight (0: full fine-tuning); the base stays frozen (in --dtype), the KL reference is the base with the adapters off, checkpoints hold the adapters alone (python -m agents.merge_lora merges one)"""
    lora_alpha: float | None = None
    """LoRA scale alpha (the update is B A alpha / rank); default 2 x --lora-rank"""
    lora_targets: str = "all-linear"
    """LoRA target modules: 'all-linear' (q,k,v,o,gate,up,down projections of the language model; never the vision tower or the LM head) or a comma-separated list of module names, e.g. q_proj,v_proj"""
    lora_dropout: float = 0.0
    """dropout on the LoRA branch's input while training"""
    threads: int | None = None
    """torch intra-op threads for rollouts and evaluations (default: agents.policy's, 1 on <= 2 CPUs)"""
    update_threads: int | None = None
    """torch intra-op threads for pretraining and the updates (default: available CPUs, at most 8)"""

    # -- task and model --------------------------------------------------------------------
    env_id: str = "freshper/FrozenLake-v0"
    """registered task id (python -m envs list)"""
    env_kwargs: dict | None = None
    """keyword arguments of the task (JSON on the command line); default: {"feedback": false} for tasks whose board is their whole state (FrozenLake, Sokoban) in window:0 context, else {}"""
    train_env_kwargs: dict | None = None
    """keyword arguments merged over --env-kwargs for the training tasks only, a curriculum (JSON; e.g. {"max_solution_moves": 4}: easier Sokoban levels); held-out evaluations, diagnostics and pretraining keep --env-kwargs, so success is still measured on the task"""
    context: str = "window:0"
    """prompt context: 'full' (whole conversation) or 'window:k' (instructions + last k turns)"""
    model: str | None = None
    """local model folder (HF layout); default: the embedded tiny model of the task's modality, pretrained on the task"""
    max_new_tokens: int = 8
    """reply length limit per turn, in tokens"""
    max_context_tokens: int = 1024
    """per-episode context budget; an episode that would overflow is truncated cleanly"""
    temperature: float = 1.0
    """sampling temperature of rollouts (log-probs are taken at the same temperature)"""

    tiny_width: int = 128
    """hidden size of the embedded tiny model (a multiple of 64; without --model): 128, ~1M parameters; 256, ~3.7M, reads twice as many held-out SearchQA answers out of its passages when told the answer (experiments/searchqa/search_copy_ceiling.py) and is configs/searchqa.yaml's width; it costs more per step (docs/results/searchqa.md#a-model-twice-as-wide)"""
    # -- pretraining on the task's own transitions (learner/pretrain.py) ---------------------
    pretrain_steps: int | None = None
    """pretraining optimizer steps; default 400 for the embedded model (built once and cached), 0 with --model"""
    pretrain_batch: int = 64
    """examples per pretraining step"""
    pretrain_lr: float = 1e-3
    """Adam learning rate of pretraining"""
    pretrain_dynamics: float = 0.5
    """share of dynamics examples (state + move -> what it leads to); the rest are random well-formed replies; 0: a format-only warm-up"""
    pretrain_observe: float = 0.0
    """share of observation examples (the state as shown -> the state as text), taken from the dynamics share: perception alone, for image tasks"""
    pretrain_seconds: float | None = None
    """stop pretraining after this many seconds (a capped pretraining is not cached)"""
    pretrain_until_exact: float | None = None
    """after --pretrain-steps, keep pretraining in rounds of 100 steps until the model writes this share of held-out next states exactly (greedy; on two held-out random-play transitions per --pretrain-batch stream, at most 128), up to --pretrain-max-steps; 0: off. Default 0.5 when --pretrain-steps is not given (the embedded default's recipe), else 0"""
    pretrain_max_steps: int | None = None
    """with --pretrain-until-exact: stop there even below the bar (default: 4x --pretrain-steps)"""
    pretrain_follow_steps: int = 0
    """a second pretraining stage of this many steps, with --reasoning subgoal: --pretrain-follow of its format replies play a move that does what the think tag's subgoal words say (the task's subgoal_moves), so the model learns what its words mean as a move; the first stage is cached on its own. 0: none"""
    pretrain_success: float = 0.0
    """share of the pretraining's format examples that are turns of random-play episodes that succeeded (imitation of random play's successes, the only part of the pretraining that uses the task's reward; the episodes random play takes to find them count in the pretraining's episodes); for tasks whose random play sometimes succeeds and whose RL start too rarely does (SearchQA). 0: off"""
    pretrain_follow: float = 1.0
    """with --pretrain-follow-steps: the share of the second stage's format replies whose move follows the words (the rest stay random); 1 measured well ahead of 0.5 on Sokoban (docs/results/sokoban.md#following-the-words)"""
    reasoning: str = "none"
    """what a reply writes before its answer, in a think tag taught by the pretraining's format replies: 'none'; 'lookahead': what each legal action leads to (the task's lookahead_text); 'state': the state in the task's text notation (render_text; an image task's policy transcribes the image, then answers); 'aim': where the agent's target lies (the task's aim_text, e.g. Sokoban's 'box Up Left goal Down'), then the lookahead; 'subgoal': the next place to reach and what to do there (the task's subgoal_text, e.g. Sokoban's 'stand Up Left push Right'), then the lookahead. Needs --max-new-tokens room for it"""
    think_loss: bool = True
    """train the tokens of a reply's think tag like its other sampled tokens; --no-think-loss leaves <think> ... </think> out of the RL loss (the answer alone is trained)"""

    # -- rollouts and the RL schedule -------------------------------------------------------
    tasks_per_iter: int = 8
    """B: tasks (maps) per iteration"""
    group_size: int = 8
    """G: rollouts per task, the GRPO group"""
    iterations: int | None = None
    """stop after this many iterations; if neither this nor --time-budget is set: 200"""
    time_budget: float | None = None
    """stop the RL phase after this many seconds"""
    advantage: str = "episode"
    """'episode': the GRPO advantage of the episode return on every turn; 'gigpo': plus a turn-level advantage (discounted return-to-go normalised among identical states of a group), window:k contexts only"""
    gigpo_gamma: float = 0.95
    """discount of the turn-level return-to-go ('gigpo')"""
    step_weight: float = 1.0
    """weight of the turn-level advantage added to the episode advantage ('gigpo')"""

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
    """weight of the k3 KL to the reference policy (the policy RL starts from); 0: off"""
    lr: float = 3e-4
    """Adam learning rate of the RL phase"""
    lr_warmup_steps: int = 0
    """linear learning-rate warm-up over this many optimizer steps"""
    lr_decay: str = "none"
    """none|linear|cosine: lower the RL learning rate towards 0 over the run's iterations (iteration i of N
    uses lr x (1 - i/N), or lr x (1 + cos(pi i/N)) / 2); needs an iteration count, not a time budget alone"""
    adam_beta1: float = 0.9
    """Adam's first-moment (momentum) decay of the RL phase; 0: no momentum, each step follows its own batch's gradient"""
    adam_beta2: float = 0.999
    """Adam's second-moment decay of the RL phase"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    micro_batch: int = 256
    """sequences per forward/backward pass (gradients accumulate over the batch)"""
    max_nonfinite: int = 5
    """stop the run after this many consecutive updates with a non-finite loss or gradient"""

    # -- replay ----------------------------------------------------------------------------
    replay: str = "fresh"
    """'fresh' (FreshPER, the default), 'per' (no age decay), 'uniform', or 'none' (on-policy only)"""
    replay_ratio: int = 2
    """K: replay updates per iteration (0: none, the on-policy update only)"""
    replay_batch: int | None = 16
    """trajectories per replay update (none: B x G, as many as one iteration collects)"""
    buffer_capacity: int = 640
    """trajectories kept in the buffer (FIFO)"""
    priority: str = "return"
    """base priority: 'return' (|R| + eps) or 'advantage' (|A| + eps)"""
    priority_eps: float = 1e-2
    """floor of the base priority"""
    alpha: float = 1.0
    """priority exponent"""
    tau: float | str = 10.0
    """freshness decay in optimizer steps (sampling half-life tau ln2 / alpha); 'auto': set online from the measured policy drift so replayed tokens keep --tau-target-ess (starting at 10)"""
    tau_target_ess: float = 0.9
    """with --tau auto --tau-signal ess: the IS effective sample size (per token, normalised) replayed data should keep"""
    tau_signal: str = "ess"
    """with --tau auto: what tau keeps at its target, 'ess' (--tau-target-ess) or 'clip': the share of replayed tokens outside the clip range (--tau-target-clip)"""
    tau_target_clip: float = 0.05
    """with --tau auto --tau-signal clip: the share of replayed tokens whose ratio may lie outside the clip range"""
    beta: float = 0.4
    """initial IS-correction exponent, annealed linearly to beta_final"""
    beta_final: float = 1.0
    """final IS-correction exponent"""
    is_weights: str = "base"
    """PER importance weights: 'base' (correct the base-priority bias, keep the age decay) or 'classical' ((N P(i))^-beta normalised over the buffer, as Schaul et al.)"""
    beta_anneal_steps: int = 1000
    """optimizer steps over which beta anneals (a fixed horizon, so a run extended on resume anneals as one run would)"""

    # -- evaluation, checkpoints, logging ---------------------------------------------------
    eval_every: int = 10
    """evaluate on validation tasks every this many iterations (0: never during training): seeds disjoint from training and from the test tasks of the start-of-RL and final evaluations"""
    eval_episodes: int = 64
    """episodes of a periodic (validation) evaluation"""
    select: str = "best"
    """the policy the run delivers and scores on the test tasks beside the last iteration's: 'best' (the iteration with the highest validation success; the last one on ties and without periodic evaluations) or 'last'"""
    final_eval_episodes: int = 200
    """episodes of the start-of-RL and final evaluations: the learning claim compares these"""
    eval_greedy: bool = False
    """greedy decoding in evaluations; default sampled at --temperature (the policy being trained)"""
    eval_both: bool = True
    """also evaluate with the other decoding at the start of RL and at the end (reported beside the verdict)"""
    diagnostics: bool = True
    """log what the policy looks at with each held-out evaluation (action spread across states, counterfactual probes)"""
    checkpoint_every: int = 25
    """write a checkpoint every this many iterations (and at the end)"""
    keep_checkpoints: int = 2
    """how many checkpoints to keep"""
    resume: str | None = None
    """continue from a checkpoint, a checkpoints/ folder or a run folder"""
    tensorboard: bool = True
    """write TensorBoard events to runs/<name>/tensorboard (--no-tensorboard: leave TensorBoard out of --report-to)"""
    report_to: str | None = None
    """experiment trackers that get the metrics and the replay figures, comma-separated: tensorboard, wandb (offline unless WANDB_API_KEY or WANDB_MODE=online), trackio (its local store), or none; default tensorboard (learner/trackers.py)"""
    replay_log_mb: float = 64.0
    """cap of runs/<name>/replay_log, the per-update record of which buffer items were replayed (ids, ages, priorities, probabilities, IS weights, advantages, token IS ratios) that the viewer's replay page reads, in MiB: past it the oldest iterations are deleted (learner/replay_log.py); 0: none"""
    progress: bool = True
    """show a progress bar"""
    gifs: int = 4
    """GIFs of evaluation episodes to save for image tasks"""

    # -- scale-out: rollout workers, asynchronous collection, the engine (docs/scaling.md) -------
    rollout_workers: int = 0
    """Ray rollout workers that play each iteration's episodes (0: this process); $RAY_ADDRESS joins a running cluster, else a local one starts"""
    rollout_shards: int | None = None
    """collect each iteration in this many shards of whole task groups, each with its own sampling seed, so records depend on the shards and not on which process plays them; default: one per worker (1 in process)"""
    async_collect: bool = False
    """asynchronous collection (also --async): workers collect the next iterations with the last published weights while the learner updates; records keep their policy version, updates are IS-corrected"""
    max_staleness: int | None = None
    """asynchronous collection: records more than this many optimizer steps behind the learner are dropped and re-collected (counted and logged); workers collect max_staleness // (steps per iteration) iterations ahead; default: one iteration's steps"""
    max_restarts: int = 3
    """rollout-worker deaths survived within one collect (a dead worker is replaced and its episodes re-collected)"""
    worker_gpus: float = 0.0
    """GPUs each Ray rollout worker reserves (its vLLM engine runs on them); 0: CPU workers"""
    engine: str = "hf"
    """sampling engine of training rollouts: 'hf' (the policy's own sampler) or 'vllm' (a vLLM engine in its own process, weights pushed in memory after each update; text tasks and Qwen2-VL/Qwen2.5-VL image tasks)"""
    vllm_python: str | None = None
    """python of the environment vLLM is installed in; default $FRESHPER_VLLM_PYTHON, else .venv-vllm/bin/python, else this one"""
    vllm_args: dict | None = None
    """vLLM engine settings (JSON): dtype (default: the learner's compute dtype), max_model_len (default --max-context-tokens), gpu_memory_utilization, enforce_eager (default: on CPUs only), weight_sync (memory|files), lora (adapter|merged), colocate, max_images, engine_args (further vllm.LLM arguments); docs/scaling.md"""


#: Settings that shape what a run has already done; a resume refuses to change them.
LOCKED_ON_RESUME = ("env_id", "env_kwargs", "train_env_kwargs", "context", "model", "tiny_width", "seed", "start_seed", "tasks_per_iter", "group_size",
                    "pretrain_steps", "pretrain_batch", "pretrain_lr", "pretrain_dynamics", "pretrain_observe", "pretrain_seconds",
                    "pretrain_until_exact", "pretrain_max_steps", "pretrain_follow_steps", "pretrain_follow", "pretrain_success", "reasoning",
                    "lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "advantage", "gigpo_gamma", "step_weight", "replay", "buffer_capacity", "priority",
                    "priority_eps", "alpha", "tau", "tau_target_ess", "tau_signal", "tau_target_clip", "is_weights", "beta", "beta_final", "beta_anneal_steps", "lr_decay", "runs_root", "run_name")


# -- config: CLI and YAML (the generic part is learner/cli.py) ---------------------------------
def build_parser():
    """``--config`` plus one documented flag per Config field (and ``--async`` for ``--async-collect``)."""
    parser = dataclass_parser(Config, description=__doc__)
    parser.add_argument("--async", dest="async_collect", action="store_true", default=argparse.SUPPRESS,
                        help="same as --async-collect")
    return parser


def config_from_dict(values: dict[str, Any], base: Config | None = None) -> Config:
    """A Config with ``values`` applied over ``base``; unknown keys are a clear error."""
    return replace_checked(base or Config(), values)


def parse_config(argv: Sequence[str] | None = None) -> Config:
    """Defaults <- ``--config`` YAML <- flags. On ``--resume`` the run's saved config is the base
    and the flags and YAML may change only what may change mid-run (others are refused)."""
    args = vars(build_parser().parse_args(argv))
    given: dict[str, Any] = {}
    path = args.pop("config", None)
    if path:
        given.update(load_config_file(path))
    given.update(args)
    cfg = config_from_dict(given)
    if cfg.resume:
        ckpt = resolve_resume(cfg.resume)
        saved_path = ckpt / "config.yaml"
        if not saved_path.exists():
            raise CheckpointError(f"{ckpt} has no config.yaml: it is not a train.py checkpoint")
        saved = config_from_dict(load_config_file(saved_path, follow_links=False))
        changed = [k for k in LOCKED_ON_RESUME if k in given and given[k] != getattr(saved, k)]
        if changed:
            flags = ", ".join(f"--{k.replace('_', '-')} ({getattr(saved, k)!r} -> {given[k]!r})" for k in changed)
            raise ValueError(f"cannot change {flags} when resuming {ckpt}: the run was trained with the saved "
                             "values; start a new run (--run-name) to train with other ones")
        cfg = config_from_dict({k: v for k, v in given.items() if k not in LOCKED_ON_RESUME}, saved)
        if saved.lr_decay != "none" and planned_iterations(cfg) != planned_iterations(saved):
            raise ValueError(f"cannot change the iterations ({planned_iterations(saved)} -> {planned_iterations(cfg)}) "
                             f"when resuming {ckpt}: its --lr-decay {saved.lr_decay} runs over them; resume with the "
                             "same --iterations, or start a new run")
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Raise ValueError on settings that cannot work, saying which flag to change."""
    from agents.policy import resolve_device

    from agents.precision import resolve_dtype

    device = resolve_device(cfg.device)
    resolve_dtype(cfg.dtype, device)
    if cfg.lora_rank:
        from agents.lora import LoraSettings

        LoraSettings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.lora_dropout)
    window = cfg.context.split(":", 1)
    checks = [
        (cfg.replay in ("none", "fresh", "per", "uniform"), f"--replay must be none|fresh|per|uniform, got {cfg.replay!r}"),
        (cfg.priority in ("return", "advantage"), f"--priority must be return|advantage, got {cfg.priority!r}"),
        (cfg.is_weights in ("base", "classical"), f"--is-weights must be base|classical, got {cfg.is_weights!r}"),
        (cfg.loss in ("clip", "tis"), f"--loss must be clip|tis, got {cfg.loss!r}"),
        (cfg.lr_decay in ("none", "linear", "cosine"), f"--lr-decay must be none|linear|cosine, got {cfg.lr_decay!r}"),
        (cfg.select in ("best", "last"), f"--select must be best|last, got {cfg.select!r}"),
        (cfg.lr_decay == "none" or cfg.iterations is not None or cfg.time_budget is None,
         "--lr-decay follows the iterations: give --iterations with --time-budget"),
        (cfg.advantage in ("episode", "gigpo"), f"--advantage must be episode|gigpo, got {cfg.advantage!r}"),
        (cfg.advantage != "gigpo" or cfg.context != "full", "--advantage gigpo needs a window:k context (one sample per turn)"),
        (cfg.tasks_per_iter >= 1, "--tasks-per-iter must be >= 1"),
        (cfg.group_size >= 2, "--group-size must be >= 2: GRPO's advantage compares the rollouts of a task, one alone always gets 0"),
        (cfg.run_name is None or (cfg.run_name not in ("", ".", "..") and "/" not in cfg.run_name and "\\" not in cfg.run_name),
         f"--run-name must be a plain folder name inside --runs-root, got {cfg.run_name!r}"),
        (0 <= cfg.seed < MAX_RUN_SEED, f"--seed must be in [0, {MAX_RUN_SEED})"),
        (cfg.start_seed is None or 0 <= cfg.start_seed < MAX_RUN_SEED, f"--start-seed must be in [0, {MAX_RUN_SEED})"),
        (cfg.micro_batch >= 1 and cfg.max_nonfinite >= 1, "--micro-batch and --max-nonfinite must be >= 1"),
        (cfg.context == "full" or (window[0] == "window" and len(window) == 2 and window[1].isdigit()),
         f"--context must be 'full' or 'window:k', got {cfg.context!r}"),
        (math.isfinite(cfg.lr) and cfg.lr > 0, f"--lr must be a positive number, got {cfg.lr}"),
        (0.0 <= cfg.adam_beta1 < 1.0 and 0.0 <= cfg.adam_beta2 < 1.0,
         f"--adam-beta1 and --adam-beta2 must be in [0, 1), got {cfg.adam_beta1} and {cfg.adam_beta2}"),
        (cfg.pretrain_steps is None or cfg.pretrain_steps >= 0, "--pretrain-steps must be >= 0"),
        (0.0 <= cfg.pretrain_dynamics <= 1.0, "--pretrain-dynamics must be in [0, 1]"),
        (0.0 <= cfg.pretrain_observe <= cfg.pretrain_dynamics, "--pretrain-observe must be in [0, --pretrain-dynamics]"),
        (cfg.pretrain_until_exact is None or 0.0 <= cfg.pretrain_until_exact <= 1.0,
         "--pretrain-until-exact must be in [0, 1]"),
        (cfg.pretrain_max_steps is None or cfg.pretrain_max_steps >= (DEFAULT_PRETRAIN_STEPS if cfg.pretrain_steps is None else cfg.pretrain_steps),
         "--pretrain-max-steps must be >= --pretrain-steps (400 by default)"),
        (cfg.iterations is None or cfg.iterations >= 1, "--iterations must be >= 1"),
        (cfg.time_budget is None or (math.isfinite(cfg.time_budget) and cfg.time_budget > 0), "--time-budget must be > 0 seconds"),
        (cfg.replay == "none" or cfg.replay_batch is None or 1 <= cfg.replay_batch <= cfg.buffer_capacity,
         f"--replay-batch must be between 1 and --buffer-capacity ({cfg.buffer_capacity})"),
        (cfg.pretrain_batch >= 1 and math.isfinite(cfg.pretrain_lr) and cfg.pretrain_lr > 0,
         "--pretrain-batch must be >= 1 and --pretrain-lr a positive number"),
        (math.isfinite(cfg.kl_coef) and cfg.kl_coef >= 0, f"--kl-coef must be a number >= 0, got {cfg.kl_coef}"),
        (math.isfinite(cfg.max_grad_norm) and cfg.max_grad_norm > 0, "--max-grad-norm must be > 0"),
        (cfg.clip_low >= 0 and cfg.clip_high >= 0, "--clip-low and --clip-high must be >= 0"),
        (cfg.eval_every >= 0 and cfg.eval_episodes >= 1 and cfg.final_eval_episodes >= 1,
         "--eval-every must be >= 0 and the evaluation episodes >= 1"),
        (cfg.checkpoint_every >= 0 and cfg.keep_checkpoints >= 1, "--checkpoint-every must be >= 0 and --keep-checkpoints >= 1"),
        (cfg.max_context_tokens > cfg.max_new_tokens, "--max-context-tokens must exceed --max-new-tokens"),
        (cfg.replay_ratio >= 0, "--replay-ratio must be >= 0"),
        (cfg.beta_anneal_steps >= 0, "--beta-anneal-steps must be >= 0"),
        (cfg.tau == "auto" or (isinstance(cfg.tau, (int, float)) and math.isfinite(cfg.tau) and cfg.tau > 0),
         f"--tau must be a positive number or 'auto', got {cfg.tau!r}"),
        (0.0 < cfg.tau_target_ess < 1.0, "--tau-target-ess must be in (0, 1)"),
        (cfg.tau_signal in ("ess", "clip"), f"--tau-signal must be ess|clip, got {cfg.tau_signal!r}"),
        (0.0 < cfg.tau_target_clip < 1.0, "--tau-target-clip must be in (0, 1)"),
        (cfg.tau != "auto" or cfg.replay == "fresh", "--tau auto needs --replay fresh"),
        (math.isfinite(cfg.replay_log_mb) and cfg.replay_log_mb >= 0, "--replay-log-mb must be >= 0 (0: no replay log)"),
        (cfg.replay == "none" or (cfg.buffer_capacity >= 1 and cfg.alpha >= 0),
         "--buffer-capacity must be >= 1 and --alpha >= 0"),
        (cfg.max_new_tokens >= 1, "--max-new-tokens must be >= 1"),
        (cfg.reasoning in REASONINGS, f"--reasoning must be one of {'|'.join(REASONINGS)}, got {cfg.reasoning!r}"),
        (0.0 <= cfg.pretrain_success <= 1.0, "--pretrain-success must be in [0, 1]"),
        (cfg.tiny_width >= 64 and cfg.tiny_width % 64 == 0, "--tiny-width must be a multiple of 64"),
        (cfg.model is None or cfg.tiny_width == 128,
         "--tiny-width sizes the embedded model; --model brings its own (with a config that sets tiny_width, "
         "such as configs/searchqa.yaml, add --tiny-width 128)"),
        (cfg.pretrain_follow_steps >= 0 and 0.0 <= cfg.pretrain_follow <= 1.0,
         "--pretrain-follow-steps must be >= 0 and --pretrain-follow in [0, 1]"),
        (not cfg.pretrain_follow_steps or cfg.reasoning == "subgoal",
         f"--pretrain-follow-steps needs --reasoning subgoal (the words a move follows), got --reasoning {cfg.reasoning}"),
        (not cfg.pretrain_follow_steps or cfg.pretrain_seconds is None,
         "--pretrain-follow-steps builds on a cached first stage: drop --pretrain-seconds"),
        (cfg.temperature > 0 and math.isfinite(cfg.temperature), "--temperature must be a positive number"),
        (cfg.rollout_workers >= 0 and (cfg.rollout_shards is None or cfg.rollout_shards >= 1) and cfg.max_restarts >= 0
         and cfg.worker_gpus >= 0, "--rollout-workers, --max-restarts and --worker-gpus must be >= 0, --rollout-shards >= 1"),
        (cfg.engine in ("hf", "vllm"), f"--engine must be hf|vllm, got {cfg.engine!r}"),
        (cfg.lora_rank >= 0, "--lora-rank must be >= 0 (0: full fine-tuning)"),
        (not cfg.lora_rank or cfg.model is None or not (cfg.pretrain_steps or cfg.pretrain_follow_steps),
         "--lora-rank trains adapters over a fixed base: pretrain --model in a run of its own (without "
         "--lora-rank), then train LoRA from its checkpoint's model folder"),
        (not cfg.async_collect or cfg.rollout_workers >= 1, "--async needs rollout workers (--rollout-workers N)"),
        (cfg.max_staleness is None or cfg.max_staleness >= steps_per_iteration(cfg),
         f"--max-staleness must be >= the optimizer steps of one iteration ({steps_per_iteration(cfg)}: "
         "1 + the replay updates), else every asynchronous batch would be dropped"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


# -- small helpers -----------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train_seeds(cfg: Config, iteration: int) -> list[int]:
    """Task seeds of one iteration: a function of the iteration counter (exact resume)."""
    return [train_seed(cfg.seed, iteration, cfg.tasks_per_iter, b) for b in range(cfg.tasks_per_iter)]


def collect_request(cfg: Config, iteration: int) -> dict[str, Any]:
    """What iteration ``iteration`` collects: its task seeds, sampling seed and first group id
    (an asynchronous collector starts later iterations from this plan)."""
    return {"seeds": train_seeds(cfg, iteration), "rng_seed": cfg.seed * 1_000_003 + iteration,
            "group_base": iteration * cfg.tasks_per_iter}


def steps_per_iteration(cfg: Config) -> int:
    """Optimizer steps one iteration makes: the on-policy update and the replay updates."""
    return 1 + (cfg.replay_ratio if cfg.replay != "none" else 0)


class NonFiniteError(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


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


# -- the run -----------------------------------------------------------------------------------
@dataclass
class Run:
    """What a run holds while it trains (built by :func:`setup`)."""

    cfg: Config
    dir: Path
    policy: Any
    state: TrainerState
    collector: Any  # agents.runner.Runner, B x G rollouts
    evaluator: Any  # agents.runner.Runner, group size 1, held-out seeds
    metrics: MetricsLogger
    loss_cfg: LossConfig
    update_threads: int
    resumed_from: Path | None
    lock: Any
    ref: Any = None
    skip_span: tuple[int, int] | None = None  # token ids (open, close) of spans out of the loss
    sharded: Any = None  # learner.distributed.ShardedLearner under torchrun (``policy`` is then rank 0's sampler)
    replay_log: Any = field(default_factory=NullReplayLog)  # learner.replay_log.ReplayLog (no-op without replay)
    start_report: dict[str, Any] = field(default_factory=dict)
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)
    wall_start: float = field(default_factory=time.monotonic)

    def close(self) -> None:
        if self.sharded is not None:
            self.sharded.stop()  # the other ranks leave their command loop
        self.collector.close()
        self.evaluator.close()
        self.replay_log.close()
        self.metrics.close()
        self.lock.release()


def environment_record() -> dict[str, Any]:
    """What a run's floating-point results depend on besides its settings: the packages, the
    CPU and the kernels torch picked for it. Runs of one seed on different records may differ
    (docs/results/frozenlake.md#same-seed-another-machine)."""
    import importlib.metadata
    import platform

    versions = {}
    for name in ("torch", "transformers", "tokenizers", "numpy", "safetensors", "gymnasium"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu": cpu,
            "cpus": available_cpus(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "packages": versions,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "world_size": distributed.world_size(),
            "busy_cores_at_start": None if BUSY_CORES_AT_START is None else round(BUSY_CORES_AT_START, 3)}


def record_environment(run_dir: Path, rollout_threads: int, update_threads: int, resumed_at: int | None,
                       device: str = "cpu") -> None:
    """Append this start's environment to ``<run>/environment.json`` (a list: the first start,
    then one entry per resume), with the torch device the policy ran on (and the GPU's name)."""
    path = run_dir / "environment.json"
    try:
        entries = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
        if not isinstance(entries, list):
            entries = []
    except (OSError, json.JSONDecodeError):  # an unreadable record is replaced, never fatal
        entries = []
    entries.append({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resumed_at_iteration": resumed_at,
                    "rollout_threads": rollout_threads, "update_threads": update_threads, **environment_record(),
                    "device": device})
    if device.startswith("cuda"):
        entries[-1]["gpu"] = torch.cuda.get_device_name(torch.device(device))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(entries, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def setup(cfg: Config) -> Run:
    """Validate, then create or reopen the run folder, the start model, the run state and the
    runners. Nothing is written before every check has passed."""
    import envs
    from agents.distributed import EngineOptions, build_collector
    from agents.policy import configure_threads
    from agents.precision import vllm_dtype
    from agents.runner import RolloutConfig, default_env_kwargs
    from learner.checkpoint import RunLock, loading, verify_resume

    validate(cfg)
    if cfg.env_kwargs is None:
        cfg.env_kwargs = default_env_kwargs(cfg.env_id, cfg.context)
    train_kwargs = {**cfg.env_kwargs, **(cfg.train_env_kwargs or {})}  # the training tasks' (a curriculum's)
    if cfg.train_env_kwargs:  # a curriculum the task cannot build fails here, not at the first collect
        try:
            envs.make(cfg.env_id, **train_kwargs).close()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--train-env-kwargs {json.dumps(cfg.train_env_kwargs)}: {cfg.env_id} cannot be built "
                             f"with them: {exc}") from exc
    modality = envs.task_spec(cfg.env_id).modality
    if cfg.reasoning != "none":
        check_reasoning(cfg.reasoning, cfg.env_id, cfg.env_kwargs, follow=cfg.pretrain_follow_steps > 0)
    configure_threads(cfg.threads)
    update_threads = cfg.update_threads or max(1, min(8, available_cpus()))
    resume = resolve_resume(cfg.resume) if cfg.resume else None
    if resume is not None:
        manifest = verify_resume(resume)
        run_dir = resume.parent.parent
        missing = [p for p in (run_dir / "config.yaml", run_dir / "reference") if not p.exists()]
        if missing:
            raise CheckpointError(f"{resume} is not inside its run folder ({', '.join(map(str, missing))} missing): "
                                  "resume a checkpoint in place, under <run>/checkpoints/")
    else:
        task = cfg.env_id.split("/")[-1]
        cfg.run_name = cfg.run_name or f"{task}__s{cfg.seed}__{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = Path(cfg.runs_root) / cfg.run_name
        if list_checkpoints(run_dir / "checkpoints"):
            raise FileExistsError(f"{run_dir} already has checkpoints: pass --resume {run_dir} or another --run-name")
    lock = RunLock(run_dir)
    try:
        rollout = RolloutConfig(cfg.env_id, dict(cfg.env_kwargs), cfg.context, cfg.group_size, cfg.max_new_tokens,
                                cfg.temperature, cfg.max_context_tokens)
        training = dataclasses.replace(rollout, env_kwargs=train_kwargs)
        start_report: dict[str, Any] = {}
        if resume is not None:
            model_path = resume / "model"
        elif cfg.model is None and (cfg.pretrain_steps is None or cfg.pretrain_steps > 0):
            from learner.pretrain import pretrained_default

            with torch_threads(update_threads):
                model_path, start_report = pretrained_default(cfg.env_id, cfg.env_kwargs, pretrain_config(cfg),
                                                              seed=start_seed(cfg), micro_batch=cfg.micro_batch,
                                                              progress=cfg.progress, device=cfg.device,
                                                              width=cfg.tiny_width)
        elif cfg.model is None:
            from agents.tiny import build_tiny_model

            model_path = build_tiny_model(modality, seed=start_seed(cfg), width=cfg.tiny_width)
        else:
            model_path = Path(cfg.model)
        sharded = distributed.is_distributed()
        if sharded:  # the other ranks build their shards of the same start
            distributed.broadcast(("start", (str(model_path), str(run_dir), None if resume is None else str(resume))))
        seed_everything(cfg.seed)
        with loading(model_path):
            if sharded:
                policy = load_policy(cfg, model_path, sampler=True)  # rank 0 plays and evaluates with it
                learner_policy = load_sharded_learner(cfg, model_path)
            else:
                policy = learner_policy = load_policy(cfg, model_path)
        if policy.is_vision != (modality == "vision"):
            raise ValueError(f"--model {model_path} is a {'vision' if policy.is_vision else 'text'} model but "
                             f"{cfg.env_id} is a {modality} task")
        auto_tau = cfg.tau == "auto"
        replay = ReplaySettings(cfg.replay, cfg.buffer_capacity, cfg.alpha, 10.0 if auto_tau else float(cfg.tau),
                                cfg.beta, cfg.beta_final, cfg.beta_anneal_steps, cfg.priority_eps, cfg.seed,
                                auto_tau=auto_tau, target_ess=cfg.tau_target_ess, is_weights=cfg.is_weights,
                                tau_signal=cfg.tau_signal, target_clip=cfg.tau_target_clip)
        state = trainer_state(cfg, learner_policy, replay)
        if resume is not None:
            state.load(resume)
            if sharded:
                distributed.load_sharded(learner_policy, state.optimizer, resume)
            restore_best(run_dir, state.counters)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")
        record_environment(run_dir, torch.get_num_threads(), update_threads,
                           None if resume is None else int(manifest["iteration"]), str(policy.device))
        metrics = MetricsLogger(run_dir, cfg.tensorboard,
                                resume_iteration=None if resume is None else int(manifest["iteration"]),
                                report_to=parse_report_to(cfg.report_to, cfg.tensorboard))
        replay_log = open_replay_log(run_dir, replay=cfg.replay, max_mb=cfg.replay_log_mb, reporter=metrics,
                                     resume_iteration=None if resume is None else int(manifest["iteration"]),
                                     header={"alpha": cfg.alpha, "tau": cfg.tau, "replay_ratio": cfg.replay_ratio,
                                             "clip": [cfg.clip_low, cfg.clip_high], "env_id": cfg.env_id})
        collector = build_collector(policy, model_path, training, seed=cfg.seed, workers=cfg.rollout_workers,
                                    shards=cfg.rollout_shards, asynchronous=cfg.async_collect,
                                    max_staleness=cfg.max_staleness, steps_per_iteration=steps_per_iteration(cfg),
                                    plan=lambda i: collect_request(cfg, i), start_iteration=state.counters.iteration,
                                    engine=EngineOptions(cfg.engine, cfg.vllm_python,
                                                         {"dtype": vllm_dtype(policy.compute_dtype), **(cfg.vllm_args or {})}),
                                    max_restarts=cfg.max_restarts, log_path=run_dir / "vllm_engine.log",
                                    worker_gpus=cfg.worker_gpus)
    except BaseException:
        lock.release()
        raise
    skip_span = None if cfg.think_loss else think_span(policy)
    learner = None
    if sharded:
        learner = distributed.ShardedLearner(learner_policy, policy, state,
                                             update_function(cfg, learner_policy, state, run_dir, skip_span))
    run = Run(cfg, run_dir, policy, state, collector,
              rollout.runner(policy, seed=EVAL_SEED_BASE, group_size=1), metrics, loss_config(cfg),
              update_threads, resume, lock, start_report=start_report, skip_span=skip_span, sharded=learner,
              replay_log=replay_log)
    if resume is not None:
        for row in read_metrics(run_dir / "metrics.jsonl"):
            if row.get("kind") == "eval" and str(row.get("phase")).startswith("baseline"):
                run.evals[row["phase"]] = row
    print(f"run folder: {run_dir}\n{to_yaml(cfg)}")
    return run


def load_policy(cfg: Config, model_path: Path, *, sampler: bool = False, device: str | None = None):
    """The policy a run trains, from a model folder (or a LoRA run's adapter folder on resume):
    fp32 weights computing in ``--dtype`` under autocast, or with ``--lora-rank`` a frozen base
    in ``--dtype`` with fp32 adapters; gradient checkpointing as asked. ``sampler``: the copy a
    sharded learner's rank 0 plays with (weights in ``--dtype``, no checkpointing)."""
    from agents.lora import LoraSettings, add_lora, has_lora
    from agents.policy import Policy
    from agents.precision import resolve_dtype

    device = device or cfg.device
    compute = resolve_dtype(cfg.dtype, device)
    weights = compute if (cfg.lora_rank or sampler) else torch.float32
    policy = Policy.from_pretrained(model_path, device=device, dtype=weights, compute_dtype=compute)
    if cfg.lora_rank and not has_lora(policy.model):
        add_lora(policy, LoraSettings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.lora_dropout))
    elif has_lora(policy.model) and not cfg.lora_rank:
        raise ValueError(f"{model_path} holds LoRA adapters: train it with the --lora-rank it was trained with "
                         f"({policy.model.freshper_lora.rank}), or merge it first (python -m agents.merge_lora)")
    if cfg.gradient_checkpointing and not sampler:
        policy.enable_gradient_checkpointing()
    return policy


def load_sharded_learner(cfg: Config, model_path: Path):
    """This rank's shard of the trained policy (FSDP2, :mod:`learner.distributed`): loaded on the
    CPU in fp32, adapters and checkpointing added, then sharded onto the rank's device."""
    from agents.precision import resolve_dtype

    policy = load_policy(cfg, model_path, device="cpu")
    if policy.is_vision and policy.model.config.model_type not in ("qwen2_vl", "qwen2_5_vl"):
        raise ValueError(f"the sharded learner supports text models and Qwen2-VL-family VLMs, got "
                         f"{policy.model.config.model_type}")
    distributed.shard_policy(policy, resolve_dtype(cfg.dtype, cfg.device))
    if torch.device(cfg.device).type == "cuda":
        policy.model.to(torch.device(cfg.device))
    return policy


def trainer_state(cfg: Config, policy, replay: ReplaySettings) -> TrainerState:
    """The optimizer (over the trainable parameters: all, or the LoRA adapters), schedule,
    replay buffer and counters of a run."""
    return TrainerState([p for p in policy.model.parameters() if p.requires_grad], cfg.lr, cfg.lr_warmup_steps,
                        replay, (cfg.adam_beta1, cfg.adam_beta2), fp16=policy.compute_dtype == torch.float16,
                        device=policy.device)


def update_function(cfg: Config, policy, state: TrainerState, run_dir: Path, skip_span):
    """One rank's update of a sharded learner: ``(trajs, weights, ages, on_policy, shard) ->
    stats``, with its KL reference loaded on first use (after rank 0 wrote it)."""
    from learner.update import policy_update

    loss_cfg = loss_config(cfg)
    refs: list = []

    def reference():
        if cfg.kl_coef == 0.0:
            return None
        if not refs:
            refs.append(reference_policy(policy, run_dir))
        return refs[0]

    def update(trajs, weights, ages, on_policy, shard):
        threads = cfg.update_threads or max(1, min(8, available_cpus() // distributed.world_size()))
        with torch_threads(threads):
            return policy_update(policy, reference(), state.optimizer, state.scheduler, trajs, weights, ages,
                                 loss_cfg=loss_cfg, temperature=cfg.temperature, micro_batch=cfg.micro_batch,
                                 max_grad_norm=cfg.max_grad_norm, on_policy=on_policy, skip_span=skip_span,
                                 scaler=state.scaler, shard=shard)

    return update


def loss_config(cfg: Config) -> LossConfig:
    return LossConfig(loss=cfg.loss, clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
                      tis_cap=cfg.tis_cap, sequence_ratio=cfg.sequence_ratio, kl_coef=cfg.kl_coef)


def serve_rank(cfg: Config) -> int:
    """A non-zero rank of a sharded learner: build this rank's shard of the start rank 0 chose
    (or of the checkpoint it resumes), then carry out rank 0's commands until it stops."""
    from agents.policy import configure_threads

    command, payload = distributed.broadcast()
    if command != "start":
        return 2  # rank 0 refused to start; it says why
    model_path, run_dir, resume = payload
    configure_threads(cfg.threads)
    policy = load_sharded_learner(cfg, Path(model_path))
    state = trainer_state(cfg, policy, ReplaySettings("none"))
    if resume is not None:
        state.load(Path(resume))
        distributed.load_sharded(policy, state.optimizer, Path(resume))
    skip_span = None if cfg.think_loss else think_span(policy)
    distributed.serve(distributed.ShardedLearner(policy, None, state,
                                                 update_function(cfg, policy, state, Path(run_dir), skip_span)))
    return 0


def reference_policy(policy, run_dir: Path):
    """The KL reference of the trained ``policy``: the base with the adapters off for a LoRA
    policy (no copy), else the policy RL started from (``run_dir/reference``), frozen, in the
    compute dtype (one unsharded copy per rank in a sharded learner)."""
    from agents.lora import has_lora
    from agents.policy import Policy
    from agents.precision import resolve_dtype
    from learner.update import AdapterReference

    if has_lora(policy.model):
        return AdapterReference(policy)
    dtype = getattr(policy.model, "freshper_compute_dtype", None) or policy.compute_dtype
    ref = Policy.from_pretrained(run_dir / "reference", device=policy.device, dtype=resolve_dtype(dtype))
    ref.model.requires_grad_(False)
    return ref


def think_span(policy) -> tuple[int, int]:
    """The token ids of ``<think>`` and ``</think>`` (``--no-think-loss``); each must be one token."""
    ids = [policy.tokenizer.encode(tag, add_special_tokens=False) for tag in ("<think>", "</think>")]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"--no-think-loss needs <think> and </think> to be single tokens of the model's vocabulary; "
                         f"they encode as {ids[0]} and {ids[1]}")
    return ids[0][0], ids[1][0]


def check_reasoning(mode: str, env_id: str, env_kwargs: dict[str, Any], follow: bool = False) -> None:
    """Refuse ``--reasoning lookahead|state|...`` (and ``--pretrain-follow-steps``, ``follow``)
    at start for a task that lacks what it needs."""
    import envs
    from envs.base import reasoning_text

    env = envs.make(env_id, **dict(env_kwargs))
    try:
        env.reset(seed=0)
        reasoning_text(env.unwrapped, mode)
        if follow:
            env.unwrapped.subgoal_moves()
    except NotImplementedError as exc:
        raise ValueError(f"--reasoning {mode}: {exc or type(env.unwrapped).__name__ + ' has no text notation of its state'}") from None
    finally:
        env.close()


def start_seed(cfg: Config) -> int:
    """The seed the start model is built and pretrained with (``--start-seed``, else ``--seed``)."""
    return cfg.seed if cfg.start_seed is None else cfg.start_seed


def pretrain_config(cfg: Config):
    from learner.pretrain import PretrainConfig

    until = cfg.pretrain_until_exact
    if until is None:
        until = DEFAULT_PRETRAIN_EXACT if cfg.pretrain_steps is None else 0.0
    return PretrainConfig(steps=DEFAULT_PRETRAIN_STEPS if cfg.pretrain_steps is None else cfg.pretrain_steps, batch=cfg.pretrain_batch,
                          lr=cfg.pretrain_lr, dynamics_fraction=cfg.pretrain_dynamics, observe_fraction=cfg.pretrain_observe,
                          reasoning=cfg.reasoning,
                          max_grad_norm=cfg.max_grad_norm,
                          seconds=cfg.pretrain_seconds, until_exact=until, max_steps=cfg.pretrain_max_steps or 0,
                          follow_steps=cfg.pretrain_follow_steps, follow_fraction=cfg.pretrain_follow,
                          success_fraction=cfg.pretrain_success)


def start_of_rl(run: Run) -> None:
    """Pretrain a given model if asked, evaluate the start of RL (the learning claim's baseline),
    save the KL reference and checkpoint 0, so a resume never repeats any of it."""
    cfg = run.cfg
    if cfg.model is not None and (cfg.pretrain_steps or cfg.pretrain_follow_steps):
        from learner.pretrain import pretrain

        with torch_threads(run.update_threads):
            run.start_report = pretrain(run.policy, cfg.env_id, cfg.env_kwargs, pretrain_config(cfg), seed=start_seed(cfg),
                                        micro_batch=cfg.micro_batch, progress=cfg.progress)
    if run.start_report:
        rep = run.start_report
        run.metrics.log({"kind": "pretrain", "iteration": 0, "episodes": 0,
                         **{k: v for k, v in rep.items() if isinstance(v, (int, float, bool))}})
        print(f"pretraining on {cfg.env_id}'s transitions: {steps_phrase(rep)}{success_phrase(rep)} in {rep['pretrain_seconds']:.0f} s"
              f"{' (cached)' if rep.get('cached') else ''}, loss {rep['pretrain_loss_first']:.3f} -> "
              f"{rep['pretrain_loss_last']:.3f}{exact_phrase(rep, cfg)}")
    evaluate_phase(run, "baseline", cfg.final_eval_episodes, cfg.eval_both)
    run.policy.save_pretrained(run.dir / "reference")  # the KL reference: the policy RL starts from
    write_checkpoint(run)


def write_checkpoint(run: Run) -> Path:
    def write(folder: Path) -> None:
        run.policy.save_pretrained(folder / "model")
        if run.sharded is not None:  # every rank writes its shards of the weights and of Adam's state
            run.sharded.save(folder)
            run.state.save(folder, optimizer_state={})
        else:
            run.state.save(folder)
        (folder / "config.yaml").write_text(to_yaml(run.cfg), encoding="utf-8")

    path = save_checkpoint(run.dir / "checkpoints", run.state.counters.iteration, write, keep=run.cfg.keep_checkpoints)
    prune_best(run.dir, run.state.counters.best_iteration, run.state.counters.iteration)
    return path


def update(run: Run, trajs: list, weights, ages, on_policy: bool, observe=None) -> dict[str, Any]:
    from learner.update import policy_update

    cfg = run.cfg
    if run.sharded is not None:  # every rank takes its part (learner/distributed.py)
        return run.sharded.update(trajs, weights, ages, on_policy)
    with torch_threads(run.update_threads):
        return policy_update(run.policy, run.ref, run.state.optimizer, run.state.scheduler, trajs, weights, ages,
                             loss_cfg=run.loss_cfg, temperature=cfg.temperature, micro_batch=cfg.micro_batch,
                             max_grad_norm=cfg.max_grad_norm, on_policy=on_policy, skip_span=run.skip_span,
                             scaler=run.state.scaler, observe=observe)


def base_priorities(cfg: Config, records: list) -> np.ndarray:
    from replay.priorities import abs_advantage_priority, abs_return_priority

    if cfg.priority == "return":
        return abs_return_priority([r.episode_return for r in records], cfg.priority_eps)
    return abs_advantage_priority([r.advantage for r in records], cfg.priority_eps)


def planned_iterations(cfg: Config) -> int | None:
    """The run's iteration count: ``--iterations``, else the default's unless a time budget alone ends it."""
    return cfg.iterations if (cfg.iterations is not None or cfg.time_budget is not None) else DEFAULT_ITERATIONS


def lr_factor(decay: str, it: int, iterations: int | None) -> float:
    """The ``--lr-decay`` multiplier of iteration ``it`` (0-based) of ``iterations``."""
    if decay == "none" or not iterations:
        return 1.0
    x = min(1.0, max(0.0, it / iterations))
    return 1.0 - x if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * x))


def iteration(run: Run) -> dict[str, Any]:
    """Collect, update on-policy, add to the buffer, replay; return the iteration's log row."""
    from agents.record import assign_step_advantages
    from learner.update import stepped

    cfg, c, buffer = run.cfg, run.state.counters, run.state.buffer
    it = c.iteration
    if cfg.lr_decay != "none":
        run.state.set_lr(cfg.lr * lr_factor(cfg.lr_decay, it, planned_iterations(cfg)))
    seed_everything(cfg.seed * 1_000_003 + it)  # everything random in an iteration follows from its counter
    t0 = time.monotonic()
    # 1. collect B tasks x G rollouts with the current policy (group advantages stored)
    records, collected = run.collector.collect(**collect_request(cfg, it), policy_version=c.global_step)
    if cfg.advantage == "gigpo":
        assign_step_advantages(records, gamma=cfg.gigpo_gamma, weight=cfg.step_weight)
    good = [r for r in records if not r.failed]
    t1 = time.monotonic()
    # 2. one update on the fresh records: on-policy (ratio exactly 1) unless asynchronous
    # collection sampled them with older weights (then IS-corrected, with their ages)
    ages = np.array([c.global_step - r.policy_version for r in good], dtype=np.float64)
    upd = update(run, good, np.ones(len(good)), ages, on_policy=not ages.any())
    t2 = time.monotonic()
    # 3. add the records to the buffer (at the step they were sampled), 4. K replay updates
    if buffer is not None and good:
        for version in sorted({r.policy_version for r in good}):
            part = [r for r in good if r.policy_version == version]
            run.replay_log.added(it, version, buffer.add(part, base_priorities(cfg, part), step=version), part)
    c.global_step += int(stepped(upd))
    t_buffer = time.monotonic()
    replays = []
    for _ in range(cfg.replay_ratio if buffer is not None else 0):
        batch = buffer.sample(min(cfg.replay_batch or cfg.tasks_per_iter * cfg.group_size, len(buffer)), step=c.global_step)
        replays.append(update(run, list(batch.items), batch.weights, batch.ages, on_policy=False,
                              observe=run.replay_log.observer(batch.items)))
        run.replay_log.drawn(it, c.global_step, batch, replays[-1], buffer.tau)
        c.global_step += int(stepped(replays[-1]))
        if run.state.tau_controller is not None and run.state.tau_controller.observe(
                replays[-1].get(run.state.tau_controller.metric)):
            buffer.set_tau(run.state.tau_controller.tau)
    t3 = time.monotonic()
    if run.sharded is not None:  # the sampler takes the sharded learner's new weights
        run.sharded.gather()
    publish = getattr(run.collector, "publish", None)  # rollout workers / engines take the new weights
    if publish is not None:
        publish(c.global_step)
    check_nonfinite(run, [upd, *replays], it)
    c.iteration += 1
    c.episodes += len(records)
    c.rl_seconds += t3 - t0
    if buffer is not None:
        run.replay_log.end_iteration(it, c, buffer, upd, run.state.tau_controller)
    return log_row(run, records, collected, upd, replays, (t0, t1, t2, t_buffer, t3))


def check_nonfinite(run: Run, updates: list[dict[str, Any]], it: int) -> None:
    c = run.state.counters
    for st in updates:
        c.nonfinite_consecutive = c.nonfinite_consecutive + 1 if st["skipped"] else 0
        c.nonfinite_total += int(st["skipped"])
        if st["skipped"]:
            logger.warning("iteration %d: non-finite %s, update skipped (%d in a row)", it, st.get("nonfinite"),
                           c.nonfinite_consecutive)
        if c.nonfinite_consecutive >= run.cfg.max_nonfinite:
            raise NonFiniteError(
                f"{c.nonfinite_consecutive} consecutive updates had a non-finite loss or gradient "
                f"(last: {st.get('nonfinite')}); stopping. The last good checkpoint is intact in "
                f"{run.dir / 'checkpoints'}; lower --lr, check --kl-coef, or inspect the data.")


def log_row(run: Run, records: list, collected: dict[str, float], upd: dict[str, Any], replays: list[dict[str, Any]],
            times: tuple[float, ...]) -> dict[str, Any]:
    c, buffer = run.state.counters, run.state.buffer
    t0, t1, t2, t_buffer, t3 = times
    groups: dict[int, list[float]] = {}
    for r in records:
        if not r.failed:
            groups.setdefault(r.group_id, []).append(r.episode_return)
    row: dict[str, Any] = {
        "kind": "train", "iteration": c.iteration, "episodes": c.episodes, "global_step": c.global_step,
        "return_mean": collected["mean_return"], "success": collected["success_rate"],
        "invalid_rate": collected["invalid_reply_rate"], "turns_mean": collected["mean_turns"],
        "groups_all_equal": sum(1 for g in groups.values() if np.ptp(g) == 0), "groups": len(groups),
        "failed_records": int(collected["failed"]), "nonfinite_total": c.nonfinite_total,
        "lr": float(run.state.optimizer.param_groups[0]["lr"]),
        **{k: v for k, v in upd.items() if isinstance(v, float)},
        "time_rollout_s": t1 - t0, "time_update_s": t2 - t1, "time_buffer_s": t_buffer - t2,
        "time_replay_s": t3 - t_buffer,
        "time_total_s": c.rl_seconds, "tokens_per_s": upd.get("seq_tokens", 0.0) / max(t2 - t1, 1e-9),
        **collected.get("log", {}),  # distributed collection: worker restarts, stale drops, staleness
    }
    if replays:
        for k in sorted({k for st in replays for k in st if isinstance(st[k], float)}):
            row[f"replay_{k}" if not k.startswith("ess") else k] = float(np.mean([st[k] for st in replays if k in st]))
        ages = buffer.age_stats(c.global_step)
        row.update(buffer_size=ages["size"], buffer_age_mean=ages.get("age_mean", 0.0),
                   buffer_age_max=ages.get("age_max", 0.0), tau=buffer.tau)
        if ages.get("age_hist") is not None:
            row["buffer_age_hist"] = ages["age_hist"]
            row["buffer_age_mass"] = ages["age_mass"]
    return row


def loop(run: Run) -> None:
    """The RL loop: iterate until --iterations or --time-budget, evaluating and checkpointing."""
    from tqdm.auto import tqdm

    cfg, c = run.cfg, run.state.counters
    if run.ref is None and cfg.kl_coef != 0.0 and run.sharded is None:
        run.ref = reference_policy(run.policy, run.dir)
    iterations = planned_iterations(cfg)
    by_iter = iterations is not None
    bar = tqdm(total=iterations if by_iter else int(cfg.time_budget), initial=c.iteration if by_iter else int(c.rl_seconds),
               unit="it" if by_iter else "s", disable=not cfg.progress, dynamic_ncols=True)
    try:
        while (iterations is None or c.iteration < iterations) and (cfg.time_budget is None or c.rl_seconds < cfg.time_budget):
            row = iteration(run)
            run.metrics.log(row)
            if cfg.eval_every and c.iteration % cfg.eval_every == 0:
                ev = validate_policy(run)
                bar.write(f"iter {c.iteration}: validation success {ev['success']:.2f} "
                          f"[{ev['success_ci_low']:.2f}, {ev['success_ci_high']:.2f}]"
                          f"{' (best so far)' if c.best_iteration == c.iteration else ''}")
            if cfg.checkpoint_every and c.iteration % cfg.checkpoint_every == 0:
                write_checkpoint(run)
            bar.set_postfix(ret=f"{row['return_mean']:.2f}", succ=f"{row['success']:.2f}",
                            tok_s=f"{row['tokens_per_s']:.0f}")
            bar.update(1 if by_iter else max(0, int(c.rl_seconds) - bar.n))
    finally:
        bar.close()


def steps_phrase(rep: dict[str, Any]) -> str:
    """``"2000 steps (the last 400 following the subgoal words)"``: the steps of a pretraining
    report, and of its follow stage where it had one."""
    follow = rep.get("pretrain_follow_steps")
    return f"{rep['pretrain_steps']} steps" + (f" (the last {follow} following the subgoal words)" if follow else "")


def success_phrase(rep: dict[str, Any]) -> str:
    """``", imitating 812 successful random episodes of 16,400"``: where the pretraining
    imitated random play's successes (``--pretrain-success``), how many it found and in how
    many random episodes in all; empty elsewhere."""
    found = rep.get("pretrain_successes_imitated")
    return f", imitating {found:,} successful random episodes of {rep['pretrain_episodes']:,}" if found else ""


def exact_phrase(rep: dict[str, Any], cfg: Config) -> str:
    """How well the pretrained model writes held-out next states, and how that stands to the
    bar, from a pretraining report (the start line and the summary say it alike)."""
    if "pretrain_dynamics_exact_after" not in rep:
        return ""
    phrase = f", held-out next states written exactly {rep['pretrain_dynamics_exact_after']:.2f}"
    if "pretrain_reached_bar" in rep:
        phrase += f" ({'reached' if rep['pretrain_reached_bar'] else 'below'} the bar {pretrain_config(cfg).until_exact:.2f})"
    return phrase


def pretrain_line(run: Run) -> str:
    """The summary's line on the start model's pretraining (from this session's report, or the
    run's ``pretrain`` metrics record after a resume); empty without pretraining."""
    rep = run.start_report
    path = run.dir / "metrics.jsonl"
    if not rep and path.exists():
        with open(path, encoding="utf-8") as fh:
            rep = next((r for r in map(json.loads, fh) if r.get("kind") == "pretrain"), {})
    if not rep:
        return ""
    return (f"the start: pretrained {steps_phrase(rep)} on the task's transitions{success_phrase(rep)}"
            f"{' (cached)' if rep.get('cached') else ''}{exact_phrase(rep, run.cfg)}")


def finish(run: Run) -> dict[str, Any]:
    """Last checkpoint, final evaluation, the selected policy's evaluation, summary, curves."""
    cfg, c = run.cfg, run.state.counters
    if cfg.select == "best" and cfg.eval_every and c.best_iteration != c.iteration \
            and (c.iteration % cfg.eval_every or c.best_iteration < 0):
        validate_policy(run)  # the last iteration is a candidate too (a time budget ends anywhere)
    newest = list_checkpoints(run.dir / "checkpoints")
    if not newest or newest[-1].name != f"iter_{c.iteration:06d}":
        write_checkpoint(run)
    evaluate_phase(run, "final", cfg.final_eval_episodes, cfg.eval_both)
    selected = None
    if cfg.select == "best" and 0 <= c.best_iteration < c.iteration:
        from agents.weights import load_weights_into

        selected = best_folder(run.dir, c.best_iteration)
        run.state.release_optimizer()  # after the last checkpoint nothing trains on: free Adam's state first
        run.ref = None
        load_weights_into(run.policy, selected / "model")  # in place: no second copy of the model
        evaluate_phase(run, "selected", cfg.final_eval_episodes, cfg.eval_both, {"policy_iteration": c.best_iteration})
    summary = summarize(run.evals, dataclasses.asdict(c), time.monotonic() - run.wall_start)
    summary["agent"] = str((selected or list_checkpoints(run.dir / "checkpoints")[-1]) / "model")
    summary["selected_iteration"] = c.best_iteration if selected is not None else c.iteration
    start = pretrain_line(run)
    if start:
        summary["text"] += "\n" + start
    summary["text"] += (f"\nthe agent: {summary['agent']} (iteration {summary['selected_iteration']}"
                        + (f", the best validation success {c.best_success:.2f} of the periodic evaluations; "
                           "'final' rows: the last iteration" if selected is not None else ", the last") + ")")
    (run.dir / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    (run.dir / "summary.txt").write_text(summary["text"] + "\n", encoding="utf-8")
    plot_curves(run.dir / "metrics.jsonl", run.dir / "curves.png", title=summary["verdict"])
    print(summary["text"])
    return summary


def train(cfg: Config) -> dict[str, Any]:
    """The whole job: setup -> start of RL -> loop -> finish; returns the summary."""
    run = setup(cfg)
    try:
        if run.resumed_from is None:
            start_of_rl(run)
        else:
            print(f"resumed from {run.resumed_from} at iteration {run.state.counters.iteration}")
        loop(run)
        return finish(run)
    except FloatingPointError as exc:  # weights or outputs that are no longer finite
        raise NonFiniteError(f"{exc}; at iteration {run.state.counters.iteration} the updates had made the policy "
                             f"not finite: lower --lr. The checkpoints in {run.dir / 'checkpoints'} are intact") from exc
    finally:
        run.close()


# -- evaluation --------------------------------------------------------------------------------
BEST_DIR = "best"


def best_folder(run_dir: Path, iteration: int) -> Path:
    return run_dir / BEST_DIR / checkpoint_name(iteration)


def validate_policy(run: Run) -> dict[str, Any]:
    """A periodic evaluation on the validation tasks; with ``--select best``, keep the policy if
    it is the best so far (ties: the later one) in ``best/iter_N/model``, written atomically."""
    cfg, c = run.cfg, run.state.counters
    ev = run_eval(run, cfg.eval_episodes, f"iter_{c.iteration}", seed=VALID_SEED_BASE)[0]
    run.metrics.log({"kind": "eval", "iteration": c.iteration, "episodes": c.episodes, "split": "validation", **ev})
    if cfg.select == "best" and ev["success"] >= c.best_success:
        save_checkpoint(run.dir / BEST_DIR, c.iteration, lambda tmp: run.policy.save_pretrained(tmp / "model"),
                        keep=1 << 30)
        c.best_iteration, c.best_success = c.iteration, float(ev["success"])
    return ev


def prune_best(run_dir: Path, best_iteration: int, upto: int) -> None:
    """Delete kept policies that the run state no longer points to: older than its best, and
    (after a resume) newer than ``upto``, the iteration it resumed from (they are re-made as the
    run replays, or not, if the run takes another course)."""
    for folder in list_checkpoints(run_dir / BEST_DIR):
        it = int(folder.name.split("_")[-1])
        if it != best_iteration and (it < best_iteration or it > upto):
            shutil.rmtree(folder, ignore_errors=True)


def restore_best(run_dir: Path, counters) -> None:
    """On resume: keep the best policy the restored state points to, drop later ones; if it is
    gone (deleted by hand), say so and pick the best again from the validations still to come."""
    clean_stale_temporaries(run_dir / BEST_DIR)
    prune_best(run_dir, counters.best_iteration, counters.iteration)
    if counters.best_iteration >= 0 and not best_folder(run_dir, counters.best_iteration).is_dir():
        logger.warning("the best policy of iteration %d is missing from %s: the run picks its best again from the "
                       "next validations on", counters.best_iteration, run_dir / BEST_DIR)
        counters.best_iteration, counters.best_success = -1, -1.0


def run_eval(run: Run, episodes: int, tag: str, greedy: bool | None = None,
             seed: int = EVAL_SEED_BASE) -> tuple[dict[str, Any], list]:
    """Evaluate on held-out tasks (seeds from ``seed``: the test tasks' EVAL_SEED_BASE unless
    given the validation tasks' VALID_SEED_BASE; neither ever trained on); return a flat
    dict (success with its 95% Wilson CI, return, invalid rate, turns, the task's probes and the
    policy diagnostics) and the records."""
    from agents.evaluate import evaluate
    from learner.diagnostics import policy_diagnostics

    cfg = run.cfg
    greedy = cfg.eval_greedy if greedy is None else greedy
    result = evaluate(run.policy, cfg.env_id, episodes=episodes, seed=seed, greedy=greedy,
                      runner=run.evaluator)
    out: dict[str, Any] = {
        "phase": tag, "decoding": "greedy" if greedy else "sampled", "episodes_eval": result.episodes, "first_task_seed": seed,
        "success": result.success_rate, "success_ci_low": result.success_ci[0], "success_ci_high": result.success_ci[1],
        "return_mean": result.mean_return, "return_ci_low": result.return_ci[0], "return_ci_high": result.return_ci[1],
        "invalid_rate": result.invalid_reply_rate, "turns_mean": result.mean_turns,
        "failed_eval": int(result.stats.get("failed", 0)),
    }
    out.update(task_turn_diagnostics(cfg.env_id, result.records, cfg.env_kwargs))
    if cfg.diagnostics and not greedy:
        out.update(policy_diagnostics(run.policy, cfg.env_id, cfg.env_kwargs, temperature=cfg.temperature,
                                      reasoning=cfg.reasoning))
    return out, result.records


def evaluate_phase(run: Run, tag: str, episodes: int, both: bool, extra: dict[str, Any] | None = None) -> None:
    """Run the evaluation of a phase (and, if ``both``, the other decoding mode too), log (with
    ``extra``) and save it."""
    from agents.evaluate import save_gifs
    from agents.record import save_records

    cfg, c = run.cfg, run.state.counters
    modes = [cfg.eval_greedy] + ([not cfg.eval_greedy] if both else [])
    for k, greedy in enumerate(modes):
        key = tag if k == 0 else f"{tag}_{'greedy' if greedy else 'sampled'}"
        run.evals[key], records = run_eval(run, episodes, key, greedy)
        run.evals[key].update(extra or {})
        run.metrics.log({"kind": "eval", "iteration": c.iteration, "episodes": c.episodes, **run.evals[key]})
        folder = run.dir / "eval" / key
        save_records(records, folder)
        if run.policy.is_vision and cfg.gifs > 0:
            save_gifs(records, folder, limit=cfg.gifs)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("matplotlib", "PIL", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        cfg = parse_config(argv)
    except (ValueError, CheckpointError, OSError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # process-wide: restored on return
    sharded = distributed.is_distributed()
    try:
        if sharded:  # torchrun: rank 0 runs the job, the other ranks serve its updates
            cfg.device = str(distributed.init(cfg.device))
            if distributed.rank() != 0:
                return serve_rank(cfg)
            if cfg.model is not None and (cfg.pretrain_steps or cfg.pretrain_follow_steps):
                raise ValueError("pretraining a --model runs in one process: pretrain it in a run without torchrun, "
                                 "then train its checkpoint's model folder under torchrun")
        train(cfg)
    except (NonFiniteError, CheckpointError, FileExistsError, ValueError, FloatingPointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.use_deterministic_algorithms(previous)
        if sharded:
            distributed.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
