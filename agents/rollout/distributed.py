"""Collection spread over processes: shards of whole GRPO groups, Ray rollout workers, and
asynchronous collection (docs/scaling.md).

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

Ray is imported only when a :class:`RayCollector` is built, so this module imports without it.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from agents.record import Trajectory, episode_stats
from agents.rollout.runner import RolloutConfig, Runner
from agents.rollout.seeds import shard_rng_seed

logger = logging.getLogger(__name__)

#: Timers summed over shards in a collect's stats.
_TIMERS = ("generation_s", "env_s", "tokenization_s")
#: The repository root (the folder holding ``agents/``): Ray workers import the project from it.
REPO_ROOT = Path(__file__).resolve().parents[2]


# -- shards ------------------------------------------------------------------------------------
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


# -- weights and model folders as plain data ---------------------------------------------------
def state_to_numpy(model: Any) -> dict[str, np.ndarray]:
    """A model's state dict as numpy arrays (views of the tensors; bf16 as its int16 bits,
    under a ``bf16:`` key prefix, since numpy has no bf16); a LoRA model's with its adapters
    merged, under the plain model's names."""
    import torch

    from agents.policies.lora import plain_state_dict

    out = {}
    for name, tensor in plain_state_dict(model).items():  # LoRA adapters merged in
        t = tensor.detach().cpu()
        if t.dtype == torch.bfloat16:
            out["bf16:" + name] = t.view(torch.int16).numpy()
        else:
            out[name] = t.numpy()
    return out


def load_numpy_state(model: Any, state: dict[str, np.ndarray]) -> None:
    """Copy arrays from :func:`state_to_numpy` into ``model``'s tensors in place."""
    import torch

    own = model.state_dict()
    names = {k.removeprefix("bf16:") for k in state}
    missing = sorted(set(own) - names)
    if missing:
        raise ValueError(f"pushed weights lack {len(missing)} tensors, e.g. {missing[:3]}")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # object-store arrays are read-only; copy_ only reads them
        for key, arr in state.items():
            if key.startswith("bf16:"):
                own[key[5:]].copy_(torch.from_numpy(arr).view(torch.bfloat16))
            else:
                own[key].copy_(torch.from_numpy(arr))


def numpy_weights(state: dict[str, np.ndarray], *, skip_tied_head: bool = False):
    """``(name, tensor)`` pairs of a :func:`state_to_numpy` state (views of the arrays; a tied
    LM head left out: an engine's is its embedding)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # object-store arrays are read-only; they are only read
        for key, arr in state.items():
            name = key.removeprefix("bf16:")
            if skip_tied_head and name.endswith("lm_head.weight"):
                continue
            t = torch.from_numpy(arr)
            yield name, (t.view(torch.bfloat16) if key.startswith("bf16:") else t)


def _tied_head(model: Any) -> bool:
    from agents.engines.vllm_client import _tied

    return _tied(model)


def read_folder(path: str | os.PathLike) -> dict[str, bytes]:
    """Every file under ``path`` by relative name (a model folder shipped to another node)."""
    root = Path(path)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def write_folder(files: dict[str, bytes], path: str | os.PathLike) -> Path:
    root = Path(path)
    for name, data in files.items():
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return root


# -- the worker --------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineOptions:
    """How a worker samples: ``"hf"`` (the policy's own sampler) or ``"vllm"`` (a vLLM engine
    in its own process, :class:`agents.engines.vllm_client.VLLMSampler`, with these settings)."""

    engine: str = "hf"
    """sampling engine of training rollouts: 'hf' (the policy's own sampler) or 'vllm' (a vLLM engine in its own process, weights pushed in memory after each update; text tasks and Qwen2-VL/Qwen2.5-VL image tasks)"""
    vllm_python: str | None = None
    """python of the environment vLLM is installed in; default $FRESHPER_VLLM_PYTHON, else .venv-vllm/bin/python, else this one"""
    vllm_args: dict[str, Any] | None = field(default_factory=dict)
    """vLLM engine settings (JSON): dtype (default: the learner's compute dtype), max_model_len (default --max-context-tokens), gpu_memory_utilization, enforce_eager (default: on CPUs only), weight_sync (memory|files), lora (adapter|merged), colocate, max_images, engine_args (further vllm.LLM arguments); docs/scaling.md"""

    def __post_init__(self) -> None:
        if self.engine not in ("hf", "vllm"):
            raise ValueError(f"--engine must be hf|vllm, got {self.engine!r}")
        if self.vllm_args is None:  # a saved run config's "none": no settings
            object.__setattr__(self, "vllm_args", {})


class RolloutWorker:
    """A runner in its own process (a Ray actor): its env pool, a copy of the policy, and
    optionally a vLLM engine. Weights arrive by :meth:`set_weights`; records leave as blobs."""

    def __init__(self, model_files: dict[str, bytes], rollout: RolloutConfig, *, seed: int = 0,
                 threads: int | None = None, engine: EngineOptions | None = None) -> None:
        from agents.policies.policy import Policy, configure_threads

        configure_threads(threads)
        self.folder = Path(tempfile.mkdtemp(prefix="freshper-worker-"))
        write_folder(model_files, self.folder / "model")
        self.policy = Policy.from_pretrained(self.folder / "model")
        self.engine = engine or EngineOptions()
        self.sampler = None
        if self.engine.engine == "vllm":
            self.sampler = vllm_sampler(self.policy, self.folder / "model", rollout, seed=seed, engine=self.engine)
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


# -- Ray ---------------------------------------------------------------------------------------
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

    def __init__(self, policy: Any, model_path: str | os.PathLike, rollout: RolloutConfig, *, workers: int,
                 seed: int = 0, shards: int | None = None, asynchronous: bool = False, max_staleness: int = 1,
                 steps_per_iteration: int = 1, plan: Callable[[int], dict[str, Any]] | None = None,
                 start_iteration: int = 0, engine: EngineOptions | None = None, threads: int | None = None,
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
        self.model_files = ray.put(read_folder(model_path))
        # workers generate with this process's torch threads: fp32 sums of another thread count round differently
        self.rollout, self.seed = rollout, int(seed)
        self.threads = threads if threads is not None else _torch_threads()
        self.engine = engine or EngineOptions()
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

    # -- workers ---------------------------------------------------------------------------
    def _new_worker(self, slot: int) -> Any:
        return self._actor_cls.options(runtime_env=worker_runtime_env()).remote(
            self.model_files, self.rollout, seed=self.seed, threads=self.threads, engine=self.engine)

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

    def worker_pids(self) -> list[int]:
        """The process id of each worker slot (for fault tests and for the log)."""
        return [int(i["pid"]) for i in self.ray.get([w.info.remote() for w in self._slots])]

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


def vllm_sampler(policy: Any, model_path: str | os.PathLike, rollout: RolloutConfig, *, seed: int,
                 engine: EngineOptions, log_path: str | os.PathLike | None = None) -> Any:
    """A :class:`agents.engines.vllm_client.VLLMSampler` for ``policy`` with ``engine.vllm_args``:
    the policy's EOS, its never-sampled vision tokens and its image sizing; a LoRA policy's
    adapters are served as adapters with ``"lora": "adapter"``, else pushed merged; with
    ``"colocate": true`` the engine's GPU share is what the learner's measured peak leaves
    (:func:`colocated_memory_share`) unless ``gpu_memory_utilization`` is given."""
    from agents.policies.lora import has_lora
    from agents.engines.vllm_client import VLLMSampler

    args = {"max_model_len": rollout.max_context_tokens, "seed": seed, "log_path": log_path, **engine.vllm_args}
    lora = args.pop("lora", "merged")
    if lora not in ("adapter", "merged"):
        raise ValueError(f"vllm_args lora must be 'adapter' or 'merged', got {lora!r}")
    if lora == "adapter" and has_lora(policy.model):
        args.setdefault("lora_rank", policy.model.freshper_lora.rank)
    if args.get("colocate") and args.get("gpu_memory_utilization") is None:
        args["gpu_memory_utilization"] = colocated_memory_share(policy, rollout.max_context_tokens)
    prepare = None
    if policy.is_vision:
        def prepare(image: np.ndarray) -> np.ndarray:
            return np.asarray(policy.prepare_image(image), dtype=np.uint8)

    return VLLMSampler(model_path, eos_token_id=policy.eos_token_id, suppressed_ids=policy.suppressed_ids,
                       prepare_image=prepare, python=engine.vllm_python, **args)


def colocated_memory_share(policy: Any, max_tokens: int, *, margin_gb: float = 1.0) -> float:
    """The GPU share a colocated engine may take (vLLM's ``gpu_memory_utilization``): what the
    learner's measured peak leaves. The peak is measured here, on the learner's device: one
    forward and backward of a ``max_tokens`` sequence through :meth:`Policy.token_logprobs`
    (weights, gradients, activations), plus Adam's two fp32 moments of every trainable weight
    (allocated at the first step), plus ``margin_gb``. The engine sleeps while the learner
    updates, so the two peaks never meet; while the engine runs, the learner holds less."""
    import torch

    from agents.record import Sample

    device = policy.device
    if device.type != "cuda":
        raise ValueError("colocated mode (vllm_args colocate) needs the learner and the engine on one CUDA GPU: it "
                         "relies on vLLM's sleep mode, which the CPU build does not have (its workers ignore "
                         "sleep/wake_up); on CPUs run the engine beside the learner (docs/scaling.md)")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    n = max(2, int(max_tokens))
    probe = Sample([policy.pad_token_id] * n, [0] + [1] * (n - 1), [0.0] * n)
    policy.model.zero_grad(set_to_none=True)
    policy.token_logprobs([probe]).sum().backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    policy.model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    adam = 8 * sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    total = torch.cuda.get_device_properties(device).total_memory
    share = (total - peak - adam - margin_gb * 2**30) / total
    logger.info("colocated vLLM engine: the learner's measured peak %.1f GiB + Adam %.1f GiB of %.1f GiB leaves "
                "the engine %.0f%%", peak / 2**30, adam / 2**30, total / 2**30, 100 * share)
    if share < 0.05:
        raise ValueError(f"the learner's measured peak ({peak / 2**30:.1f} GiB + Adam {adam / 2**30:.1f} GiB) leaves "
                         f"no room for a colocated engine on this {total / 2**30:.0f} GiB GPU: use LoRA, gradient "
                         "checkpointing or a smaller --max-context-tokens, or run the engine on its own GPU")
    return round(share, 3)


def build_collector(policy: Any, model_path: str | os.PathLike, rollout: RolloutConfig, *, seed: int = 0,
                    workers: int = 0, shards: int | None = None, asynchronous: bool = False,
                    max_staleness: int | None = None, steps_per_iteration: int = 1,
                    plan: Callable[[int], dict[str, Any]] | None = None, start_iteration: int = 0,
                    engine: EngineOptions | None = None, max_restarts: int = 3,
                    log_path: str | os.PathLike | None = None, worker_gpus: float = 0.0) -> Any:
    """What plays a trainer's B x G episodes, from its settings (``train.py`` calls this once):

    - no workers, one shard, the policy's sampler: the plain :class:`~agents.rollout.runner.Runner`;
    - no workers otherwise: a :class:`ShardedCollector` (in process; with a vLLM engine in its
      own process for ``engine="vllm"``, weights pushed when their version changes);
    - ``workers`` >= 1: a :class:`RayCollector`, synchronous or ``asynchronous``.

    ``max_staleness`` defaults to ``steps_per_iteration`` (records at most one iteration old);
    ``log_path`` is where an in-process vLLM engine writes its log; ``worker_gpus`` is what each
    Ray worker reserves (Ray then sets its ``CUDA_VISIBLE_DEVICES``, which its vLLM engine inherits).
    """
    engine = engine or EngineOptions()
    if engine.engine not in ("hf", "vllm"):
        raise ValueError(f"engine must be 'hf' or 'vllm', got {engine.engine!r}")
    staleness = steps_per_iteration if max_staleness is None else int(max_staleness)
    if workers:
        return RayCollector(policy, model_path, rollout, workers=workers, seed=seed, shards=shards,
                            asynchronous=asynchronous, max_staleness=staleness, steps_per_iteration=steps_per_iteration,
                            plan=plan, start_iteration=start_iteration, engine=engine, max_restarts=max_restarts,
                            worker_gpus=worker_gpus)
    if asynchronous:
        raise ValueError("asynchronous collection needs rollout workers (--rollout-workers N)")
    sampler = None
    if engine.engine == "vllm":
        sampler = vllm_sampler(policy, model_path, rollout, seed=seed, engine=engine, log_path=log_path)
    runner = rollout.runner(policy, seed=seed, sampler=sampler)
    if sampler is None and (shards or 1) == 1:
        return runner
    return ShardedCollector(runner, shards or 1, policy=policy)
