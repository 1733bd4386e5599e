"""Rollout workers on Ray (docs/scaling.md): :class:`RolloutWorker`, a runner in its own process,
and :class:`RayCollector`, which plays a collect's shards (:mod:`agents.rollout.shards`) on them.

**Ray workers** (:class:`RayCollector`). Each worker is a Ray actor holding a runner with its
env pool and a copy of the policy (or a vLLM engine, :mod:`agents.engines.vllm_client`); the model
folder is shipped once through the object store, so nodes need no shared filesystem, and
weights go as numpy arrays (zero-copy reads from the object store; torch tensors were ~30x
slower to put). A worker with a vLLM engine hands those arrays straight to its engine's model
in memory (:meth:`agents.engines.vllm_client.VLLMSampler.push_state`), without loading them into its
own policy first. Records come back as :meth:`Trajectory.to_bytes
<agents.record.Trajectory.to_bytes>` blobs, the project's lossless record format.

**Synchronous mode**: every collect first publishes the learner's weights of that version,
then plays its shards on the workers; the records equal the in-process ones. **Asynchronous
mode**: after handing out an iteration's records the collector starts the next iterations'
shards at once with the last published weights, so workers collect while the learner
updates. Each record carries the version it was sampled with (the worker stamps its own), so
the learner's IS ratios and the buffer's ages are exact; a record older than
``max_staleness`` optimizer steps when it is handed out is dropped and its shard re-collected
with the current weights, counted in the log row and logged.

**Faults.** A worker that dies (``kill -9``, a lost node) makes its pending calls fail with
``RayActorError``; the collector logs it, starts a new worker in its slot with the weights it
should have, and submits the lost shards again, so no record is lost (in synchronous mode the
re-collected records are identical to the lost ones). After ``max_restarts`` deaths in one
collect it gives up with a clear error.

A worker gets the run's :class:`~agents.policies.spec.PolicySpec` as an argument: its engine
computes in the spec's dtype. Its own policy holds the plain model (weights arrive merged,
:func:`agents.rollout.transfer.state_to_numpy`), so its engine serves no adapters.

Ray is imported only when a :class:`RayCollector` is built, so this module imports without it.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from agents.policies.spec import PolicySpec
from agents.record import Trajectory
from agents.rollout.engine import EngineSettings, vllm_sampler
from agents.rollout.runner import RolloutSettings
from agents.rollout.shards import Shard, merge_stats, plan_shards
from agents.rollout.transfer import load_numpy_state, numpy_weights, read_folder, state_to_numpy, write_folder

logger = logging.getLogger(__name__)

#: The repository root (the folder holding ``agents/``): Ray workers import the project from it.
REPO_ROOT = Path(__file__).resolve().parents[2]


def _tied_head(model: Any) -> bool:
    from agents.engines.vllm_client import _tied

    return _tied(model)


class RolloutWorker:
    """A runner in its own process (a Ray actor): its env pool, a copy of the policy, and
    optionally a vLLM engine. Weights arrive by :meth:`set_weights`; records leave as blobs."""

    def __init__(self, model_files: dict[str, bytes], rollout: RolloutSettings, *, spec: PolicySpec, seed: int = 0,
                 threads: int | None = None, engine: EngineSettings | None = None) -> None:
        from agents.policies.policy import Policy, configure_threads

        configure_threads(threads)
        self.folder = Path(tempfile.mkdtemp(prefix="freshper-worker-"))
        write_folder(model_files, self.folder / "model")
        self.policy = Policy.from_pretrained(self.folder / "model")
        self.engine = engine or EngineSettings()
        self.sampler = None
        if self.engine.engine == "vllm":  # the worker's weights arrive merged: its engine serves no adapters
            self.sampler = vllm_sampler(self.policy, self.folder / "model", rollout, seed=seed, engine=self.engine,
                                        spec=spec.merged())
        self.runner = rollout.runner(self.policy, seed=seed, sampler=self.sampler)
        self.version: int | None = None

    def info(self) -> dict[str, Any]:
        """Where this worker runs (its pid is what a fault test kills)."""
        return {"pid": os.getpid(), "host": socket.gethostname(), "engine": self.engine.engine}

    def set_weights(self, version: int, state: dict[str, np.ndarray]) -> int:
        """Take the learner's weights of ``version``: into the worker's policy, or, with a vLLM
        engine, straight from the object store into the engine's model in memory (the worker's
        policy then only renders prompts, and keeps no copy of the weights)."""
        if self.sampler is not None and getattr(self.sampler, "weight_sync", "files") == "memory":
            self.sampler.push_state(numpy_weights(state, skip_tied_head=_tied_head(self.policy.model)))
            self.sampler.version = int(version)
        else:
            load_numpy_state(self.policy.model, state)
            if self.sampler is not None:
                self.sampler.push_weights(self.policy.model, int(version))
        self.version = int(version)
        return self.version

    def collect(self, shard: Shard) -> tuple[list[bytes], dict[str, float], int]:
        """Play one shard with the current weights; records are stamped with their version."""
        if self.version is None:
            raise RuntimeError("collect before any set_weights: the worker has no weights of a known version")
        records, stats = self.runner.collect(shard.seeds, policy_version=self.version, rng_seed=shard.rng_seed,
                                             group_base=shard.group_base)
        return [r.to_bytes() for r in records], stats, self.version

    def close(self) -> None:
        import shutil

        self.runner.close()
        if self.sampler is not None:
            self.sampler.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def ray_init(num_cpus: int | None = None, **kwargs: Any) -> bool:
    """Connect to ``$RAY_ADDRESS`` if set, else start a local cluster of ``num_cpus``; return
    True when this call started or connected (and so should shut it down). A running Ray
    session (e.g. a test's) is reused as it is."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS") or None
    common = dict(runtime_env=worker_runtime_env(), logging_level=logging.WARNING, **kwargs)
    if address:
        logger.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address, **common)
    else:
        logger.info("starting a local Ray cluster (%s CPUs)", num_cpus)
        ray.init(num_cpus=num_cpus, include_dashboard=False, **common)
    return True


def worker_runtime_env() -> dict[str, Any]:
    """Workers import this checkout first (``PYTHONPATH``), find generated data where this
    process does (``FRESHPER_CACHE``: task corpora are built there once) and keep idle OpenMP
    threads asleep. Read when a worker starts, so a changed cache folder reaches new workers."""
    from agents.policies.tiny import default_cache_dir

    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"PYTHONPATH": path, "FRESHPER_CACHE": str(default_cache_dir().resolve()),
                         "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}}


@dataclass
class _Job:
    shard: Shard
    slot: int
    generation: int  # the slot's worker generation it was submitted to
    future: Any
    result: tuple[list[bytes], dict[str, float], int] | None = None


@dataclass
class _Batch:
    iteration: int
    request: dict[str, Any]
    jobs: list[_Job]


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def lookahead(max_staleness: int, steps_per_iteration: int) -> int:
    """Iterations an asynchronous collector may collect ahead so that its records are at most
    ``max_staleness`` optimizer steps old when handed out (at least 1)."""
    return max(1, int(max_staleness) // max(1, int(steps_per_iteration)))


class RayCollector:
    """B x G episodes in shards on Ray rollout workers, synchronous or asynchronous (see the
    module docstring). :meth:`collect` has :meth:`Runner.collect`'s contract; the learner calls
    :meth:`publish` after its updates.

    ``plan(i)`` gives the request (``seeds``, ``rng_seed``, ``group_base``) of iteration ``i``;
    an asynchronous collector uses it to start later iterations early and expects its
    collects in plan order from ``start_iteration`` on (another request is collected
    synchronously, and whatever was collected ahead is dropped, counted and logged).
    """

    def __init__(self, policy: Any, model_path: str | os.PathLike, rollout: RolloutSettings, *, workers: int,
                 spec: PolicySpec, seed: int = 0, shards: int | None = None, asynchronous: bool = False, max_staleness: int = 1,
                 steps_per_iteration: int = 1, plan: Callable[[int], dict[str, Any]] | None = None,
                 start_iteration: int = 0, engine: EngineSettings | None = None, threads: int | None = None,
                 max_restarts: int = 3, num_cpus: int | None = None, worker_gpus: float = 0.0) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if asynchronous and plan is None:
            raise ValueError("asynchronous collection needs the plan of requests (plan=)")
        import ray

        self.ray = ray
        self.policy = policy
        self.workers = int(workers)
        self.shards = int(shards or workers)
        self.asynchronous = bool(asynchronous)
        self.max_staleness = int(max_staleness)
        self.lookahead = lookahead(max_staleness, steps_per_iteration) if asynchronous else 0
        self.plan = plan
        self.next_iteration = int(start_iteration)
        self.max_restarts = int(max_restarts)
        self.owns_ray = ray_init(num_cpus=num_cpus or max(2, self.workers))
        files = read_folder(model_path)
        self._check_object_store(sum(len(b) for b in files.values()))
        self.model_files = ray.put(files)
        del files
        # workers generate with this process's torch threads: fp32 sums of another thread count round differently
        self.rollout, self.seed = rollout, int(seed)
        self.threads = threads if threads is not None else _torch_threads()
        self.engine = engine or EngineSettings()
        self.spec = spec
        # restarts are ours, not Ray's: a restarted worker must get the weights before it collects
        self._actor_cls = ray.remote(num_cpus=1, num_gpus=float(worker_gpus), max_restarts=0,
                                     max_task_retries=0)(RolloutWorker)
        self._slots: list[Any] = [None] * self.workers
        self._generation = [0] * self.workers
        self._weights: tuple[int, Any] | None = None  # (version, object ref) last published
        self._inflight: deque[_Batch] = deque()
        self.restarts_total = 0
        self.dropped_total = 0
        try:
            for slot in range(self.workers):
                self._slots[slot] = self._new_worker(slot)
            infos = [self._started(slot) for slot in range(self.workers)]
        except BaseException:
            self.close()
            raise
        logger.info("%d rollout workers up (%s, %s)", self.workers, self.engine.engine,
                    ", ".join(f"pid {i['pid']} on {i['host']}" for i in infos))

    def _check_object_store(self, folder_bytes: int) -> None:
        """The object store holds the model folder (for starting workers) and one published
        copy of the weights at once; smaller than that, Ray spills to disk, and on a nearly
        full disk that fails mid-run. Say so before the first episode."""
        weight_bytes = sum(p.numel() * p.element_size() for p in self.policy.model.parameters())
        need = folder_bytes + weight_bytes
        have = float(self.ray.cluster_resources().get("object_store_memory", 0.0))
        if have and have < need:
            logger.warning("the Ray object store (%.2f GiB) is smaller than the model folder plus one copy of its "
                           "weights (%.2f GiB): objects will spill to disk. Start Ray with a larger "
                           "--object-store-memory (`ray start`, then RAY_ADDRESS).", have / 2**30, need / 2**30)

    # -- workers ---------------------------------------------------------------------------
    def _new_worker(self, slot: int) -> Any:
        return self._actor_cls.options(runtime_env=worker_runtime_env()).remote(
            self.model_files, self.rollout, spec=self.spec, seed=self.seed, threads=self.threads, engine=self.engine)

    def _started(self, slot: int) -> dict[str, Any]:
        """Wait for the worker of ``slot`` to be up; one that dies starting (not by its own
        error) is started again, up to ``max_restarts`` times."""
        for attempt in range(self.max_restarts + 1):
            try:
                return self.ray.get(self._slots[slot].info.remote())
            except self.ray.exceptions.RayActorError as err:
                if getattr(err, "actor_init_failed", False) or attempt == self.max_restarts:
                    raise RuntimeError(f"rollout worker {slot} failed to start: {err}") from err
                logger.warning("rollout worker %d died while starting (%s); starting it again", slot,
                               type(err).__name__)
                self._slots[slot] = self._new_worker(slot)
        raise AssertionError("unreachable")

    def _restart(self, slot: int, error: BaseException, restarts: list[int]) -> None:
        restarts.append(slot)
        self.restarts_total += 1
        if len(restarts) > self.max_restarts:
            raise RuntimeError(f"rollout workers died {len(restarts)} times in one collect (last: {error}); "
                               f"giving up after --max-restarts {self.max_restarts}") from error
        logger.warning("rollout worker %d died (%s: %s); starting a new one and re-collecting its shards",
                       slot, type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        try:
            self.ray.kill(self._slots[slot])
        except Exception:  # already gone
            pass
        self._slots[slot] = self._new_worker(slot)
        self._generation[slot] += 1
        if self._weights is not None:
            self._slots[slot].set_weights.remote(self._weights[0], self._weights[1])

    def publish(self, version: int) -> None:
        """Send the learner's current weights, as ``version``, to every worker: calls queued
        before this use the old weights, later ones these."""
        if self._weights is not None and self._weights[0] == version:
            return
        ref = self.ray.put(state_to_numpy(self.policy.model))
        self._weights = (int(version), ref)
        for worker in self._slots:
            worker.set_weights.remote(int(version), ref)

    # -- collection ------------------------------------------------------------------------
    def _submit(self, request: dict[str, Any], iteration: int) -> _Batch:
        shards = plan_shards(request["seeds"], self.shards, rng_seed=request["rng_seed"],
                             group_base=request["group_base"])
        jobs = []
        for shard in shards:
            slot = shard.index % self.workers
            jobs.append(_Job(shard, slot, self._generation[slot], self._slots[slot].collect.remote(shard)))
        return _Batch(iteration, dict(request), jobs)

    def _wait(self, batch: _Batch, restarts: list[int]) -> None:
        """Wait for every job of ``batch``, restarting dead workers and resubmitting their shards."""
        ray = self.ray
        while True:
            pending = {j.future: j for j in batch.jobs if j.result is None}
            if not pending:
                return
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                job = pending[ref]
                if job.future is not ref:  # resubmitted meanwhile (its worker died)
                    continue
                try:
                    job.result = ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    if getattr(err, "actor_init_failed", False):  # its __init__ raised: a restart would too
                        raise RuntimeError(f"rollout worker {job.slot} failed to start: {err}") from err
                    if self._generation[job.slot] == job.generation:  # the slot's current worker died
                        self._restart(job.slot, err, restarts)
                    self._resubmit_lost(job.slot, [batch, *self._inflight])

    def _resubmit_lost(self, slot: int, batches: Sequence[_Batch]) -> None:
        """Every unfinished shard sent to a dead worker of ``slot`` goes to its replacement, in
        the order of ``batches`` (the batch being waited for, then those collected ahead)."""
        for batch in batches:
            for job in batch.jobs:
                if job.slot == slot and job.result is None and job.generation != self._generation[slot]:
                    job.generation = self._generation[slot]
                    job.future = self._slots[slot].collect.remote(job.shard)

    def collect(self, seeds: Sequence[int], *, policy_version: int, rng_seed: int, group_base: int,
                **kwargs: Any) -> tuple[list[Trajectory], dict[str, Any]]:
        """The records of this request (:meth:`Runner.collect`'s contract), with ``log``:
        counters for the learner's log row (worker restarts, dropped stale episodes, staleness)."""
        if kwargs:
            raise TypeError(f"RayCollector.collect does not take {sorted(kwargs)}")
        wall0 = time.perf_counter()
        request = {"seeds": [int(s) for s in seeds], "rng_seed": int(rng_seed), "group_base": int(group_base)}
        restarts: list[int] = []
        dropped = 0
        if self._weights is None or not self.asynchronous:
            self.publish(policy_version)
        head = None
        if self._inflight:
            if self._same(self._inflight[0].request, request):
                head = self._inflight.popleft()
            else:
                dropped += self._drop_inflight(restarts, "the learner asked for another request than planned")
        if head is None:
            head = self._submit(request, self.next_iteration)
        self._wait(head, restarts)
        # start the next iterations now: workers collect them while the learner updates
        while self.asynchronous and len(self._inflight) < self.lookahead:
            it = self.next_iteration + 1 + len(self._inflight)
            self._inflight.append(self._submit(self.plan(it), it))
        self.next_iteration += 1
        records: list[Trajectory] = []
        parts = []
        for job in head.jobs:
            blobs, stats, version = job.result
            if policy_version - version > self.max_staleness:
                dropped += len(blobs)
                logger.warning("dropping %d episodes of shard %d sampled with version %d: %d steps behind the "
                               "learner's %d (--max-staleness %d); re-collecting them with the current weights",
                               len(blobs), job.shard.index, version, policy_version - version, policy_version,
                               self.max_staleness)
                self.publish(policy_version)
                redo = _Job(job.shard, job.slot, self._generation[job.slot],
                            self._slots[job.slot].collect.remote(job.shard))
                self._wait(_Batch(head.iteration, request, [redo]), restarts)
                blobs, stats, version = redo.result
            records += [Trajectory.from_bytes(b) for b in blobs]
            parts.append(stats)
        self.dropped_total += dropped
        out: dict[str, Any] = merge_stats(records, parts, time.perf_counter() - wall0)
        ages = [policy_version - r.policy_version for r in records]
        out["log"] = {"worker_restarts": float(len(restarts)), "stale_dropped": float(dropped),
                      "staleness_mean": float(np.mean(ages)) if ages else 0.0,
                      "staleness_max": float(max(ages)) if ages else 0.0}
        return records, out

    @staticmethod
    def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return ([int(s) for s in a["seeds"]], int(a["rng_seed"]), int(a["group_base"])) == \
            ([int(s) for s in b["seeds"]], int(b["rng_seed"]), int(b["group_base"]))

    def _drop_inflight(self, restarts: list[int], why: str) -> int:
        """Wait for and discard every batch collected ahead; return the episodes dropped."""
        dropped = 0
        while self._inflight:
            batch = self._inflight.popleft()
            self._wait(batch, restarts)
            dropped += sum(len(j.result[0]) for j in batch.jobs)
        if dropped:
            logger.warning("dropping %d episodes collected ahead: %s", dropped, why)
        return dropped

    def close(self) -> None:
        """Stop the workers (and the Ray session this collector started)."""
        ray = self.ray
        live = [w for w in self._slots if w is not None]
        try:
            ray.get([w.close.remote() for w in live], timeout=60)
        except Exception as exc:  # a dead or stuck worker: kill it below
            logger.info("closing rollout workers: %s", exc)
        for worker in live:
            try:
                ray.kill(worker)
            except Exception:
                pass
        if self._inflight:  # collected ahead for iterations the run will not make
            logger.info("discarding %d shards collected ahead for iterations %s (the run ends)",
                        sum(len(b.jobs) for b in self._inflight), [b.iteration for b in self._inflight])
        self._inflight.clear()
        if self.owns_ray:
            ray.shutdown()
