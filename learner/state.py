"""The run state: everything training changes besides the policy weights, kept in one place.

:class:`TrainerState` holds the optimizer, its learning-rate schedule, the replay buffer, the
counters and (when saved) the RNG states. It is built from the run's settings, saved into a
checkpoint folder and restored from one as a unit, and settings that may change on resume
(the learning rate) are applied to the restored objects, so the config a run reports and the
state it trains with cannot disagree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from learner.checkpoint import CheckpointError, rng_state, set_rng_state

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


@dataclass
class ReplaySettings:
    """The replay buffer's settings (``mode="none"``: no buffer)."""

    mode: str = "none"
    capacity: int = 640
    alpha: float = 1.0
    tau: float = 10.0
    beta: float = 0.4
    beta_final: float = 1.0
    beta_anneal_steps: int = 1000
    eps: float = 1e-2
    seed: int = 0
    auto_tau: bool = False  # set tau online (learner.autotau); ``tau`` is then the starting value
    target_ess: float = 0.9
    tau_signal: str = "ess"  # what auto tau keeps at its target: "ess" or "clip" (learner.autotau)
    target_clip: float = 0.05
    is_weights: str = "base"  # "base" or "classical" ((N P)^-beta over the buffer)

    def build(self):
        if self.mode == "none":
            return None
        from replay.buffer import ReplayBuffer

        return ReplayBuffer(self.capacity, mode=self.mode, alpha=self.alpha, tau=self.tau, beta=self.beta,
                            beta_final=self.beta_final, beta_anneal_steps=self.beta_anneal_steps, eps=self.eps,
                            is_target="uniform" if self.is_weights == "classical" else "base",
                            is_normalize="buffer" if self.is_weights == "classical" else "batch", seed=self.seed)


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

            self.tau_controller = TauController(alpha=replay.alpha, target_ess=replay.target_ess, tau=replay.tau,
                                                signal=replay.tau_signal, target_clip=replay.target_clip)

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
            differ = {k: (getattr(self.buffer, k), getattr(self.replay, k)) for k in keys
                      if getattr(self.buffer, k) != getattr(self.replay, k)}
            if differ:
                raise CheckpointError(f"the replay buffer in {folder} was built with other settings "
                                      f"(saved, configured): {differ}")
        self.set_lr(self.lr)
        for group in self.optimizer.param_groups:
            group["betas"] = self.betas
