"""What plays a trainer's B x G episodes, built from its settings by :func:`build_collector`: the
plain runner, in-process shards (:mod:`agents.rollout.shards`), a vLLM engine
(:mod:`agents.rollout.engine`) or Ray rollout workers (:mod:`agents.rollout.workers`)."""

from __future__ import annotations

import os
from typing import Any, Callable

from agents.policies.spec import PolicySpec
from agents.rollout.engine import EngineSettings, vllm_sampler
from agents.rollout.runner import RolloutSettings
from agents.rollout.shards import ShardedCollector
from agents.rollout.workers import RayCollector


def build_collector(policy: Any, model_path: str | os.PathLike, rollout: RolloutSettings, *, spec: PolicySpec,
                    seed: int = 0, workers: int = 0, shards: int | None = None, asynchronous: bool = False,
                    max_staleness: int | None = None, steps_per_iteration: int = 1,
                    plan: Callable[[int], dict[str, Any]] | None = None, start_iteration: int = 0,
                    engine: EngineSettings | None = None, max_restarts: int = 3,
                    log_path: str | os.PathLike | None = None, worker_gpus: float = 0.0) -> Any:
    """What plays a trainer's B x G episodes, from its settings (``train.py`` calls this once):

    - no workers, one shard, the policy's sampler: the plain :class:`~agents.rollout.runner.Runner`;
    - no workers otherwise: a :class:`ShardedCollector` (in process; with a vLLM engine in its
      own process for ``engine="vllm"``, weights pushed when their version changes);
    - ``workers`` >= 1: a :class:`RayCollector`, synchronous or ``asynchronous``.

    ``spec`` is the policy's compute dtype and LoRA adapters, handed on to the engine and the
    workers. ``max_staleness`` defaults to ``steps_per_iteration`` (records at most one iteration old);
    ``log_path`` is where an in-process vLLM engine writes its log; ``worker_gpus`` is what each
    Ray worker reserves (Ray then sets its ``CUDA_VISIBLE_DEVICES``, which its vLLM engine inherits).
    """
    engine = engine or EngineSettings()
    if engine.engine not in ("hf", "vllm"):
        raise ValueError(f"engine must be 'hf' or 'vllm', got {engine.engine!r}")
    staleness = steps_per_iteration if max_staleness is None else int(max_staleness)
    if workers:
        return RayCollector(policy, model_path, rollout, workers=workers, seed=seed, shards=shards,
                            asynchronous=asynchronous, max_staleness=staleness, steps_per_iteration=steps_per_iteration,
                            plan=plan, start_iteration=start_iteration, engine=engine, max_restarts=max_restarts,
                            worker_gpus=worker_gpus, spec=spec)
    if asynchronous:
        raise ValueError("asynchronous collection needs rollout workers (--rollout-workers N)")
    sampler = None
    if engine.engine == "vllm":
        sampler = vllm_sampler(policy, model_path, rollout, seed=seed, engine=engine, spec=spec, log_path=log_path)
    runner = rollout.runner(policy, seed=seed, sampler=sampler)
    if sampler is None and (shards or 1) == 1:
        return runner
    return ShardedCollector(runner, shards or 1, policy=policy)
