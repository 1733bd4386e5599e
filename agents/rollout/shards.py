"""Collection in shards of whole GRPO groups (docs/scaling.md): the unit a collect is split into,
in process (:class:`ShardedCollector`) or over Ray rollout workers (:mod:`agents.rollout.workers`).

**Shards.** An iteration's B tasks are split into contiguous shards of whole tasks (a GRPO
group never spans two shards). Each shard is one batched :meth:`Runner.collect
<agents.rollout.runner.Runner.collect>` call with its own sampling seed, derived from the request's
seed and the shard's first task, and its own group numbering (``group_base`` + first task). A
runner's collect is a function of its seeds, sampling seed, group base and weights, so the
records of a shard do not depend on which process plays it: N workers reproduce the
in-process :class:`ShardedCollector` with the same number of shards exactly. (Rows of one
batch are not bitwise independent of the other rows: padding and shared prefixes change fp32
rounding at ~1e-7, so the shard, not the task, is the unit that makes records reproducible.)
One shard uses the request's own seed, so one shard is exactly the plain runner. Bitwise
equality also needs the same kernels to run: the same hardware, torch thread count (workers
take this process's) and weight memory layout (fp32 CPU kernels round by the weights'
alignment; workers load the model folder the way the trainer does and copy weights in place).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from agents.record import Trajectory, episode_stats
from agents.rollout.runner import Runner
from agents.rollout.seeds import shard_rng_seed

#: Timers summed over shards in a collect's stats.
_TIMERS = ("generation_s", "env_s", "tokenization_s")


@dataclass(frozen=True)
class Shard:
    """One batched collect of whole tasks: its task seeds, sampling seed and first group id."""

    index: int
    seeds: tuple[int, ...]
    rng_seed: int
    group_base: int


def plan_shards(seeds: Sequence[int], shards: int, *, rng_seed: int, group_base: int) -> list[Shard]:
    """Split ``seeds`` into at most ``shards`` contiguous, near-equal shards of whole tasks."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    seeds = [int(s) for s in seeds]
    n = min(shards, max(1, len(seeds)))
    bounds = np.linspace(0, len(seeds), n + 1).round().astype(int)
    return [Shard(j, tuple(seeds[a:b]), shard_rng_seed(rng_seed, a), int(group_base) + int(a))
            for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b > a]


def merge_stats(records: Sequence[Trajectory], parts: Sequence[dict[str, float]], wall: float) -> dict[str, float]:
    """One collect's stats from its shards' (:meth:`Runner.collect`'s keys): episode stats of
    all records, timers summed over shards (work done, not wall time), and rates per wall second."""
    tokens = sum(r.num_sampled_tokens for r in records)
    return {
        **episode_stats(records),
        **{k: float(sum(p.get(k, 0.0) for p in parts)) for k in _TIMERS},
        "wall_s": wall,
        "episodes_per_s": len(records) / max(wall, 1e-9),
        "tokens_per_s": tokens / max(wall, 1e-9),
    }


class ShardedCollector:
    """In-process collection in shards, played one after the other by one runner: the
    reference a :class:`RayCollector` with the same number of shards reproduces. With a
    sampler that takes pushed weights (vLLM), the learner's weights are pushed before a
    collect of a newer version (:meth:`publish`)."""

    def __init__(self, runner: Runner, shards: int = 1, *, policy: Any = None) -> None:
        self.runner = runner
        self.shards = int(shards)
        self.policy = policy if policy is not None else runner.policy
        self.version: int | None = None
        self._asleep = False

    def publish(self, version: int) -> None:
        """Hand the learner's weights of ``version`` to the sampler (no-op for the policy itself).
        A colocated engine (asleep since the last collect) wakes its weights' memory first, takes
        the weights, then wakes its KV cache."""
        sampler = self.runner.sampler
        push = getattr(sampler, "push_weights", None)
        colocated = bool(getattr(sampler, "colocate", False))
        if push is not None and self.version != version:
            if colocated and self._asleep:
                sampler.wake_up(["weights"])
            push(self.policy.model, int(version))
        if colocated and self._asleep:
            sampler.wake_up(["kv_cache"])
            self._asleep = False
        self.version = int(version)

    def collect(self, seeds: Sequence[int], *, policy_version: int, rng_seed: int, group_base: int,
                **kwargs: Any) -> tuple[list[Trajectory], dict[str, Any]]:
        """:meth:`Runner.collect`'s contract, played shard by shard (a colocated engine goes to
        sleep after it, so the learner has the GPU while it updates)."""
        self.publish(policy_version)
        wall0 = time.perf_counter()
        records: list[Trajectory] = []
        parts = []
        for shard in plan_shards(seeds, self.shards, rng_seed=rng_seed, group_base=group_base):
            recs, stats = self.runner.collect(shard.seeds, policy_version=policy_version, rng_seed=shard.rng_seed,
                                              group_base=shard.group_base, **kwargs)
            records += recs
            parts.append(stats)
        if getattr(self.runner.sampler, "colocate", False):
            self.runner.sampler.sleep()
            self._asleep = True
        out: dict[str, Any] = merge_stats(records, parts, time.perf_counter() - wall0)
        synced = getattr(self.runner.sampler, "sync_seconds", None)
        if synced:  # the last weight push into the engine, for the learner's log row
            out["log"] = {"vllm_sync_s": float(synced[-1])}
        return records, out

    def close(self) -> None:
        self.runner.close()
        close = getattr(self.runner.sampler, "close", None)
        if close is not None and self.runner.sampler is not self.runner.policy:
            close()
