"""The run state: everything training changes besides the policy weights, kept in one place.

:class:`TrainerState` holds the optimizer, its learning-rate schedule, the replay buffer, the
counters and (when saved) the RNG states. It is built from the run's settings, saved into a
checkpoint folder and restored from one as a unit, and settings that may change on resume
(the learning rate) are applied to the restored objects, so the config a run reports and the
state it trains with cannot disagree.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from learner.checkpoint import CheckpointError, rng_state, set_rng_state
from replay import defaults as replay_defaults

TRAINER_FILE = "trainer.pt"
REPLAY_FILE = "replay.npz"


@dataclass
class Counters:
    """Where the run is: every schedule (task seeds, sampling seeds, beta, ages) reads these."""

    iteration: int = 0
    global_step: int = 0  # optimizer steps taken (replay ages count these)
    episodes: int = 0  # environment episodes collected for training
    rl_seconds: float = 0.0
    nonfinite_total: int = 0
    nonfinite_consecutive: int = 0
    best_iteration: int = -1  # the iteration with the highest validation success so far (-1: none yet)
    best_success: float = -1.0  # its validation success


class TrajectoryCodec:
    """Replay-buffer codec: a record's own lossless, pickle-free blob."""

    def encode(self, item: Any) -> bytes:
        return item.to_bytes()

    def decode(self, data: bytes) -> Any:
        from agents.record import Trajectory

        return Trajectory.from_bytes(data)


_LOCKED = {"locked": True}


@dataclass
class ReplaySettings:
    """The replay buffer's settings and how the run replays it: ``train.py``'s ``replay``
    settings (``learner.config``; ``mode="none"``: no buffer). Field metadata: ``flag``, the
    command-line name where it is not the field's; ``locked``, it cannot change on resume;
    ``setting: False``, filled from another section (the run's seed)."""

    mode: str = field(default="none", metadata={"locked": True, "flag": "replay"})
    """'fresh' (FreshPER, the default), 'per' (no age decay), 'uniform', or 'none' (on-policy only)"""
    ratio: int = field(default=2, metadata={"flag": "replay_ratio"})
    """K: replay updates per iteration (0: none, the on-policy update only)"""
    batch: int | None = field(default=16, metadata={"flag": "replay_batch"})
    """trajectories per replay update (none: B x G, as many as one iteration collects)"""
    capacity: int = field(default=640, metadata={"locked": True, "flag": "buffer_capacity"})
    """trajectories kept in the buffer (FIFO)"""
    priority: str = field(default="return", metadata=_LOCKED)
    """base priority: 'return' (|R| + eps) or 'advantage' (|A| + eps)"""
    eps: float = field(default=replay_defaults.EPS, metadata={"locked": True, "flag": "priority_eps"})
    """floor of the base priority"""
    alpha: float = field(default=replay_defaults.ALPHA, metadata=_LOCKED)
    """priority exponent"""
    tau: float | str = field(default=replay_defaults.TAU, metadata=_LOCKED)
    """freshness decay in optimizer steps (sampling half-life tau ln2 / alpha); 'auto': set online from the measured policy drift so replayed tokens keep --tau-target-ess (starting at 10)"""
    target_ess: float = field(default=0.9, metadata={"locked": True, "flag": "tau_target_ess"})
    """with --tau auto --tau-signal ess: the IS effective sample size (per token, normalised) replayed data should keep"""
    signal: str = field(default="ess", metadata={"locked": True, "flag": "tau_signal"})
    """with --tau auto: what tau keeps at its target, 'ess' (--tau-target-ess) or 'clip': the share of replayed tokens outside the clip range (--tau-target-clip)"""
    target_clip: float = field(default=0.05, metadata={"locked": True, "flag": "tau_target_clip"})
    """with --tau auto --tau-signal clip: the share of replayed tokens whose ratio may lie outside the clip range"""
    beta: float = field(default=replay_defaults.BETA, metadata=_LOCKED)
    """initial IS-correction exponent, annealed linearly to beta_final"""
    beta_final: float = field(default=replay_defaults.BETA_FINAL, metadata=_LOCKED)
    """final IS-correction exponent"""
    is_target: str = field(default="base", metadata=_LOCKED)
    """what PER's importance weights correct towards: 'base' (the base priorities alone: the base-priority bias is corrected, the age decay kept) or 'uniform' ((N P(i))^-beta, as Schaul et al.); --is-weights classical sets it with --is-normalize buffer"""
    is_normalize: str = field(default="batch", metadata=_LOCKED)
    """IS weights are divided by the largest of the sampled 'batch' or of the whole 'buffer' (as Schaul et al.)"""
    beta_anneal_steps: int = field(default=replay_defaults.BETA_ANNEAL_STEPS, metadata=_LOCKED)
    """optimizer steps over which beta anneals (a fixed horizon, so a run extended on resume anneals as one run would)"""
    log_mb: float = field(default=64.0, metadata={"flag": "replay_log_mb"})
    """cap of runs/<name>/replay_log, the per-update record of which buffer items were replayed (ids, ages, priorities, probabilities, IS weights, advantages, token IS ratios) that the viewer's replay page reads, in MiB: past it the oldest iterations are deleted (learner/replay_log.py); 0: none"""
    seed: int = field(default=0, metadata={"setting": False})
    """seed of the buffer's sampling (the run's --seed)"""

    def __post_init__(self) -> None:
        checks = [
            (self.mode in ("none", "fresh", "per", "uniform"), f"--replay must be none|fresh|per|uniform, got {self.mode!r}"),
            (self.priority in ("return", "advantage"), f"--priority must be return|advantage, got {self.priority!r}"),
            (self.is_target in ("base", "uniform"), f"--is-target must be base|uniform, got {self.is_target!r}"),
            (self.is_normalize in ("batch", "buffer"), f"--is-normalize must be batch|buffer, got {self.is_normalize!r}"),
            (self.mode == "none" or self.batch is None or 1 <= self.batch <= self.capacity,
             f"--replay-batch must be between 1 and --buffer-capacity ({self.capacity})"),
            (self.ratio >= 0, "--replay-ratio must be >= 0"),
            (self.beta_anneal_steps >= 0, "--beta-anneal-steps must be >= 0"),
            (self.tau == "auto" or (isinstance(self.tau, (int, float)) and math.isfinite(self.tau) and self.tau > 0),
             f"--tau must be a positive number or 'auto', got {self.tau!r}"),
            (0.0 < self.target_ess < 1.0, "--tau-target-ess must be in (0, 1)"),
            (self.signal in ("ess", "clip"), f"--tau-signal must be ess|clip, got {self.signal!r}"),
            (0.0 < self.target_clip < 1.0, "--tau-target-clip must be in (0, 1)"),
            (self.tau != "auto" or self.mode == "fresh", "--tau auto needs --replay fresh"),
            (math.isfinite(self.log_mb) and self.log_mb >= 0, "--replay-log-mb must be >= 0 (0: no replay log)"),
            (self.mode == "none" or (self.capacity >= 1 and self.alpha >= 0),
             "--buffer-capacity must be >= 1 and --alpha >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def auto_tau(self) -> bool:
        """Whether tau is set online (learner.autotau) from :attr:`start_tau`."""
        return self.tau == "auto"

    @property
    def start_tau(self) -> float:
        """The buffer's tau at the start: ``tau``, or 10 where it is ``"auto"``."""
        return 10.0 if self.auto_tau else float(self.tau)

    def updates(self) -> int:
        """Replay updates per iteration (none without a buffer)."""
        return self.ratio if self.mode != "none" else 0

    def build(self):
        if self.mode == "none":
            return None
        from replay.buffer import ReplayBuffer

        return ReplayBuffer(self.capacity, mode=self.mode, alpha=self.alpha, tau=self.start_tau, beta=self.beta,
                            beta_final=self.beta_final, beta_anneal_steps=self.beta_anneal_steps, eps=self.eps,
                            is_target=self.is_target, is_normalize=self.is_normalize, seed=self.seed)


#: Above this many trained parameters Adam runs its fused kernel (one pass over every tensor; on
#: a 0.5B model's CPU update the per-tensor loop took as long as the matmuls). The embedded
#: models stay below it, so their runs keep their numbers bit for bit.
FUSED_ADAM_PARAMETERS = 50_000_000


def fused_adam(params) -> bool:
    """Whether Adam over ``params`` takes the fused kernel: many parameters, all plain (not
    sharded) floating-point tensors on one CPU or CUDA device."""
    params = list(params)
    if sum(p.numel() for p in params) < FUSED_ADAM_PARAMETERS:
        return False
    devices = {p.device for p in params}
    return (len(devices) == 1 and next(iter(devices)).type in ("cpu", "cuda")
            and all(p.is_floating_point() and not hasattr(p, "to_local") for p in params))


class TrainerState:
    """Optimizer, learning-rate schedule, replay buffer and counters of a run."""

    def __init__(self, params, lr: float, lr_warmup_steps: int, replay: ReplaySettings,
                 betas: tuple[float, float] = (0.9, 0.999), *, fp16: bool = False,
                 device: torch.device | str = "cpu") -> None:
        self.lr, self.betas = float(lr), (float(betas[0]), float(betas[1]))
        params = list(params)
        self.optimizer = torch.optim.Adam(params, lr=self.lr, betas=self.betas, fused=fused_adam(params) or None)
        #: fp16 compute: the dynamic loss scale (bf16 and fp32 need none).
        self.scaler = torch.amp.GradScaler(torch.device(device).type) if fp16 else None
        warm = max(1, int(lr_warmup_steps))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warm))
        self.replay = replay
        self.buffer = replay.build()
        self.counters = Counters()
        self.tau_controller = None
        if replay.auto_tau and self.buffer is not None:
            from learner.autotau import TauController

            self.tau_controller = TauController(alpha=replay.alpha, target_ess=replay.target_ess, tau=replay.start_tau,
                                                signal=replay.signal, target_clip=replay.target_clip)

    def set_lr(self, lr: float) -> None:
        """Make ``lr`` the learning rate from now on (optimizer and schedule agree)."""
        self.scheduler.base_lrs = [lr for _ in self.optimizer.param_groups]
        factor = self.scheduler.lr_lambdas[0](max(0, self.scheduler.last_epoch))
        for group in self.optimizer.param_groups:
            group["initial_lr"] = lr
            group["lr"] = lr * factor

    def release_optimizer(self) -> None:
        """Drop Adam's moments (the end of a run, after its last checkpoint)."""
        self.optimizer.state.clear()

    def save(self, folder: Path, optimizer_state: dict | None = None) -> None:
        """Write ``trainer.pt`` (optimizer, schedule, counters, RNG states) and ``replay.npz``.
        ``optimizer_state``: stored instead of the optimizer's own (None: the own one; a sharded
        learner passes ``{}`` and saves its shards with torch.distributed.checkpoint)."""
        torch.save({"optimizer": self.optimizer.state_dict() if optimizer_state is None else optimizer_state,
                    "scheduler": self.scheduler.state_dict(),
                    "state": dataclasses.asdict(self.counters), "rng": rng_state(),
                    "scaler": None if self.scaler is None else self.scaler.state_dict(),
                    "tau_controller": None if self.tau_controller is None else self.tau_controller.state_dict()},
                   folder / TRAINER_FILE)
        if self.buffer is not None:
            self.buffer.save(folder / REPLAY_FILE, TrajectoryCodec())

    def load(self, folder: Path) -> None:
        """Restore what :meth:`save` wrote (the RNG states too), then apply this state's learning
        rate and Adam betas, which the saved optimizer would otherwise bring back (the moments
        already kept stay)."""
        try:
            saved = torch.load(folder / TRAINER_FILE, weights_only=True, map_location="cpu")
            if saved["optimizer"]:  # empty where a sharded learner keeps it in its own shards
                self.optimizer.load_state_dict(saved["optimizer"])
            if self.scaler is not None and saved.get("scaler"):
                self.scaler.load_state_dict(saved["scaler"])
            self.scheduler.load_state_dict(saved["scheduler"])
            self.counters = Counters(**saved["state"])
            set_rng_state(saved["rng"])
            if self.tau_controller is not None and saved.get("tau_controller"):
                self.tau_controller.load_state_dict(saved["tau_controller"])
            if self.buffer is not None:
                from replay.buffer import ReplayBuffer

                self.buffer = ReplayBuffer.load(folder / REPLAY_FILE, TrajectoryCodec())
        except Exception as exc:  # noqa: BLE001 - any failure here means the checkpoint is unusable
            raise CheckpointError(f"cannot restore training state from {folder}: {exc}") from exc
        if self.buffer is not None:
            keys = ("mode", "capacity", "alpha", "beta", "beta_final", "beta_anneal_steps", "eps")
            keys += () if self.tau_controller is not None else ("tau",)
            configured = {**{k: getattr(self.replay, k) for k in keys}, "tau": self.replay.start_tau}
            differ = {k: (getattr(self.buffer, k), configured[k]) for k in keys
                      if getattr(self.buffer, k) != configured[k]}
            if differ:
                raise CheckpointError(f"the replay buffer in {folder} was built with other settings "
                                      f"(saved, configured): {differ}")
        self.set_lr(self.lr)
        for group in self.optimizer.param_groups:
            group["betas"] = self.betas
