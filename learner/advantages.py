"""Advantage estimators: how a collected batch's returns become the advantages the loss weighs.

- GRPO (:func:`assign_group_advantages`): each episode's return normalised within its group,
  the G rollouts of one task, ``(R - mean_g) / (std_g + eps)``; set on ``Trajectory.advantage``.
- GiGPO-style turn-level credit (:func:`assign_step_advantages`, ``--advantage gigpo``): the
  episode advantage plus ``weight`` times a step advantage, the discounted return-to-go
  normalised among the turns of one group that saw the same state; set on ``Sample.advantage``.

The learner assigns them to every batch it collects (:func:`assign_advantages`), before the
update and before the batch enters the replay buffer; the runner only plays and records.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from agents.record import Sample, Trajectory


def assign_advantages(records: Sequence[Trajectory], rl: Any) -> None:
    """The advantages of a collected batch under the run's ``rl`` settings
    (:class:`learner.config.RLSettings`): group advantages, then, for ``advantage="gigpo"``,
    the turn-level ones. Records are changed in place."""
    assign_group_advantages(records)
    if rl.advantage == "gigpo":
        assign_step_advantages(records, gamma=rl.gigpo_gamma, weight=rl.step_weight)


def group_advantages(returns: Sequence[float], eps: float = 1e-6) -> np.ndarray:
    """GRPO advantage ``(R - mean_g) / (std_g + eps)`` over one group of rollouts.

    A group whose returns are all equal gets advantage 0 for every member (no signal).
    """
    r = np.asarray(returns, dtype=np.float64)
    if r.size == 0:
        return r
    std = r.std()
    if std < 1e-8:
        return np.zeros_like(r)
    return (r - r.mean()) / (std + eps)


def assign_group_advantages(records: Sequence[Trajectory], eps: float = 1e-6) -> None:
    """Set ``advantage`` on every record, grouping by ``group_id``; failed records are left out
    of the group statistics and get advantage 0."""
    groups: dict[int, list[Trajectory]] = {}
    for rec in records:
        if rec.failed:
            rec.advantage = 0.0
            continue
        groups.setdefault(rec.group_id, []).append(rec)
    for members in groups.values():
        adv = group_advantages([m.episode_return for m in members], eps)
        for m, a in zip(members, adv):
            m.advantage = float(a)


def _prompt_key(sample: Sample) -> bytes:
    """The ids before a sample's first sampled token: the prompt the policy answered."""
    sampled = np.flatnonzero(sample.loss_mask)
    return np.asarray(sample.token_ids[: sampled[0] if len(sampled) else len(sample.token_ids)], dtype=np.int64).tobytes()


def assign_step_advantages(records: Sequence[Trajectory], gamma: float = 0.95, weight: float = 1.0,
                           eps: float = 1e-6) -> None:
    """Turn-level credit (GiGPO-style): set ``Sample.advantage`` of every turn to the episode
    advantage plus ``weight`` times a step advantage.

    A turn's step return is its discounted return-to-go ``sum_k gamma^k r_{t+k}``. Turns of one
    group (the G rollouts of a task) that saw the identical state form an anchor group; the step
    advantage is the step return normalised within its anchor group, ``(R_t - mean) / (std +
    eps)``, and 0 for a state seen once or where all step returns agree. The state is the
    sample's prompt (its ids up to the first sampled one) and image in a ``window:0`` record,
    where the prompt is the instructions and the current observation on every turn, so the
    first turn joins later visits to its board (its observation text alone also holds the
    instructions); in a ``window:k`` record it is the observation text and image. Needs one
    sample per turn; failed records keep their advantage of 0. Records are changed in place.
    """
    anchors: dict[tuple, list[tuple[Sample, float]]] = {}
    for rec in records:
        if rec.failed:
            continue
        if len(rec.samples) != len(rec.turns):
            raise ValueError("turn-level advantages need one sample per turn (a window:k context)")
        rewards = [t.reward for t in rec.turns]
        to_go, acc = [0.0] * len(rewards), 0.0
        for j in range(len(rewards) - 1, -1, -1):
            acc = rewards[j] + gamma * acc
            to_go[j] = acc
        for turn, sample, ret in zip(rec.turns, rec.samples, to_go):
            image = rec.images[turn.image_index].tobytes() if turn.image_index is not None else b""
            key = (rec.group_id, _prompt_key(sample) if rec.context == "window:0" else turn.observation, image)
            anchors.setdefault(key, []).append((sample, ret))
    for rec in records:
        for sample in rec.samples:
            sample.advantage = float(rec.advantage)
    for members in anchors.values():
        step = group_advantages([ret for _, ret in members], eps)
        for (sample, _), a in zip(members, step):
            sample.advantage += weight * float(a)
