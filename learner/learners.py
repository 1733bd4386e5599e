"""The learner a run trains with, behind one interface (:class:`Learner`), in two implementations:
:class:`LocalLearner` (one process) and :class:`learner.distributed.ShardedLearner` (FSDP2 over
torchrun ranks, driven by rank 0). ``learner/build.py`` chooses one when the run is built; the
loop, the checkpoints and the evaluations see only the interface.

Both carry out an update with the same :class:`UpdateStep`, the one place
:func:`learner.update.policy_update` is called: the loss settings, the update threads and the
KL reference (loaded on first use, after the start of RL wrote it) live there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from learner.machine import torch_threads
from learner.state import TrainerState


class Learner(Protocol):
    """What the run asks of its learner."""

    #: The policy that samples and is evaluated: the trained one, or a sharded learner's rank-0
    #: copy (which :meth:`publish` keeps current).
    policy: Any
    #: The run state: optimizer, schedule, buffer, counters.
    state: TrainerState

    def update(self, trajs: Sequence, weights, ages, *, on_policy: bool, observe=None) -> dict[str, Any]:
        """One optimizer step on ``trajs`` with their PER weights and ages; its statistics."""

    def publish(self) -> None:
        """Make :attr:`policy` hold the trained weights (a sharded learner gathers them)."""

    def reference(self) -> Any:
        """The KL reference the updates score against (None without a KL term)."""

    def save(self, folder: Path) -> None:
        """Write the model and the run state into a checkpoint folder."""

    def load(self, folder: Path) -> None:
        """Restore the run state (and a sharded learner's shards) from a checkpoint folder."""

    def release(self) -> None:
        """Free what only training needs (Adam's moments, the KL reference): the end of a run."""

    def close(self) -> None:
        """Release the learner's processes (a sharded learner's other ranks)."""


@dataclass
class UpdateStep:
    """One rank's optimizer step: ``step(trajs, weights, ages, on_policy, shard=None, observe=None)``.

    ``policy`` is the trained policy (a rank's shard of it under torchrun), ``reference_loader``
    gives its KL reference once asked (``learner.build.reference_policy``)."""

    policy: Any
    state: TrainerState
    cfg: Any  # learner.config.Config: its loss, rl and rollout sections
    threads: int
    skip_span: tuple[int, int] | None
    reference_loader: Callable[[], Any]
    _reference: list = field(default_factory=list)

    def reference(self) -> Any:
        if self.cfg.loss.kl_coef == 0.0:
            return None
        if not self._reference:
            self._reference.append(self.reference_loader())
        return self._reference[0]

    def release_reference(self) -> None:
        self._reference.clear()

    def __call__(self, trajs: Sequence, weights, ages, on_policy: bool, shard=None, observe=None) -> dict[str, Any]:
        from learner.update import policy_update

        cfg, state = self.cfg, self.state
        with torch_threads(self.threads):
            return policy_update(self.policy, self.reference(), state.optimizer, state.scheduler, trajs, weights, ages,
                                 loss_cfg=cfg.loss, temperature=cfg.rollout.temperature, micro_batch=cfg.rl.micro(),
                                 max_grad_norm=cfg.rl.max_grad_norm, on_policy=on_policy, skip_span=self.skip_span,
                                 scaler=state.scaler, shard=shard, observe=observe, keep_reference_logprobs=True)


class LocalLearner:
    """The learner of a one-process run: the policy trains in place and samples itself."""

    def __init__(self, policy: Any, state: TrainerState, step: UpdateStep) -> None:
        self.policy, self.state, self.step = policy, state, step

    def update(self, trajs: Sequence, weights, ages, *, on_policy: bool, observe=None) -> dict[str, Any]:
        return self.step(trajs, weights, ages, on_policy, observe=observe)

    def publish(self) -> None:
        """Nothing to do: the sampler is the trained policy."""

    def reference(self) -> Any:
        return self.step.reference()

    def save(self, folder: Path) -> None:
        self.policy.save_pretrained(folder / "model")
        self.state.save(folder)

    def load(self, folder: Path) -> None:
        self.state.load(folder)

    def release(self) -> None:
        self.state.release_optimizer()
        self.step.release_reference()

    def close(self) -> None:
        """Nothing to release."""
