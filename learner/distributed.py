"""The sharded learner: FSDP2 (``torch.distributed.fsdp.fully_shard``) over ``torchrun`` ranks.

    torchrun --nproc_per_node 8 train.py --model /models/Qwen2.5-7B-Instruct --dtype bf16 ...

Every rank holds one shard of the trained weights, of their gradients and of Adam's state
(fp32), and computes in ``--dtype`` through FSDP2's mixed-precision policy (bf16 parameters
gathered layer by layer, gradients reduced in fp32). Rank 0 is the run's driver: it owns the run
folder, the rollouts (in process, Ray workers or vLLM, from an unsharded sampler copy of the
policy in the compute dtype), the evaluations and the replay buffer. The other ranks serve its
commands (:func:`serve`):

- ``update``: rank 0 broadcasts one update's records with their PER weights and ages; every
  rank takes every ``world``-th training sequence of it (:class:`Shard`), with the *whole*
  batch's token count as the token-mean denominator, so the per-rank losses sum to the one-
  process loss, and FSDP2 sums (not averages) the gradients across ranks. Statistics are
  reduced exactly (sums, maxima; the loss statistics merged as a whole). The replay buffer has
  one owner, so sampling, priorities and ages are those of a one-process run.
- ``gather``: the trained weights gathered (full, to rank 0's CPU, layer by layer), loaded into
  rank 0's sampler; with LoRA only the adapters travel.
- ``save``: ``torch.distributed.checkpoint`` writes every rank's shards of the weights and the
  optimizer into the checkpoint (``sharded/``), beside rank 0's files; a resume reads them back
  on any number of ranks. Nothing in them is unpickled beyond plain data: the ``.metadata`` file
  (a pickle) is read by a restricted unpickler that admits only the checkpoint metadata's own
  types (:func:`read_sharded_metadata`), the optimizer's non-tensor values with ``torch.load``'s
  ``weights_only``; anything else refuses the resume with an error naming the file.

Every rank runs the same number of forward and backward passes per update (a rank with fewer
sequences runs empty micro-batches), scoring each sequence in one full forward
(:func:`learner.prefix.full_logprobs`): the shared-prefix passes make a data-dependent number
of model calls, which collective communication cannot follow. NCCL on GPUs, gloo on CPUs.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import os
import pickle
import re
import sys
from pathlib import Path
from typing import Any, Iterator, NoReturn, Sequence

import numpy as np
import torch

#: Seconds a rank waits in a collective (rank 0's evaluations and rollouts happen in between).
DEFAULT_TIMEOUT_S = 4 * 3600
SHARDED_DIR = "sharded"


def world_size() -> int:
    """Processes of this run (``torchrun`` sets ``WORLD_SIZE``); 1 without torchrun."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def is_distributed() -> bool:
    return world_size() > 1


def init(device: str) -> torch.device:
    """Join the process group (NCCL for CUDA devices, gloo for the CPU) and return this rank's
    device (``cuda:LOCAL_RANK`` for ``--device cuda``/``auto`` with GPUs)."""
    import torch.distributed as dist

    from agents.policies.policy import resolve_device

    local = int(os.environ.get("LOCAL_RANK", "0"))
    chosen = resolve_device(device)
    if chosen.type == "cuda":
        chosen = torch.device("cuda", local if chosen.index is None else chosen.index)
        torch.cuda.set_device(chosen)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=float(os.environ.get("FRESHPER_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
        dist.init_process_group("nccl" if chosen.type == "cuda" else "gloo", timeout=timeout)
    return chosen


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def broadcast(value: Any = None) -> Any:
    """Rank 0's ``value`` on every rank (any picklable object); rank 0's commands advance
    :data:`_phase`."""
    import torch.distributed as dist

    global _phase
    box = [value]
    dist.broadcast_object_list(box, src=0)
    if rank() == 0 and isinstance(value, tuple) and value and value[0] in ("start", "stop", "abort"):
        _phase = {"start": "started", "stop": "stopped", "abort": "stopped"}[value[0]]
    return box[0]


# -- the model ---------------------------------------------------------------------------------
def decoder_blocks(model) -> list[torch.nn.Module]:
    """The model's repeated blocks (decoder layers, vision blocks): the HF classes named in its
    ``_no_split_modules``, each one FSDP unit."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no repeated blocks (_no_split_modules) to shard")
    return blocks


def shard_policy(policy, compute_dtype: torch.dtype) -> None:
    """Shard ``policy.model`` in place with FSDP2: each block, then the root; parameters kept
    in their (fp32) dtype and gathered in ``compute_dtype`` for each forward; gradients
    reduced as sums in fp32. The policy then computes without autocast (FSDP2 casts)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) \
        if compute_dtype != torch.float32 else MixedPrecisionPolicy()
    for block in decoder_blocks(policy.model):
        fully_shard(block, mp_policy=mp)
    fully_shard(policy.model, mp_policy=mp)
    from torch.distributed.fsdp import FSDPModule

    for module in policy.model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # per-rank losses already sum to the batch's
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no pre-multiplied sum
    policy.compute_dtype = next(policy.model.parameters()).dtype  # no autocast: FSDP2 casts the parameters
    policy.sharded = True


def full_state(policy, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The sharded model's full weights on rank 0's CPU (empty elsewhere); a collective.
    ``trainable_only``: the trainable parameters alone (LoRA adapters)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(policy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                       ignore_frozen_params=trainable_only))


def save_sharded(policy, optimizer, folder: Path) -> None:
    """Every rank's shards of the weights and of the optimizer state into ``folder/sharded``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(policy.model), "optim": get_optimizer_state_dict(policy.model, optimizer)}
    dcp.save(state, checkpoint_id=str(Path(folder) / SHARDED_DIR))


#: The largest sharded checkpoint ``.metadata`` read (a 70B model's with its optimizer is ~10 MB).
MAX_METADATA_BYTES = 256 << 20
#: The globals a ``torch.distributed.checkpoint`` ``.metadata`` pickle names: the metadata's own
#: dataclasses, ``torch.Size``, a path, and torch's dtypes, layouts and memory formats (checked
#: by type in :class:`_MetadataUnpickler`). Each is plain data: building one runs no code an
#: attacker chooses.
METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
})


class _Refused(pickle.UnpicklingError):
    """A global that a sharded checkpoint's metadata never names."""


class _MetadataUnpickler(pickle._Unpickler):
    """An unpickler whose ``find_class`` admits :data:`METADATA_GLOBALS` and torch's dtypes,
    layouts and memory formats, and refuses every other global (``os.system``, ``builtins.eval``,
    ...) before it is looked up. The pure-Python unpickler, so that ``BUILD`` can refuse to set
    attributes on a class (which would change that class for the whole process)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))

    def _load_build(self) -> None:
        if isinstance(self.stack[-2] if len(self.stack) > 1 else None, type):
            raise _Refused("state set on a class")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and name.isidentifier() and not name.startswith("_"):
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise _Refused(f"{module}.{name}"[:120])

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id")


def read_sharded_metadata(path: str | os.PathLike) -> Any:
    """A sharded checkpoint's ``.metadata`` (a ``torch.distributed.checkpoint`` ``Metadata``),
    unpickled without running code: the file must be a regular file (no link, FIFO or device) of
    at most :data:`MAX_METADATA_BYTES`, every global it names one of the metadata's own types,
    and every shard it lists a plain file name inside its folder. Anything else raises
    :class:`learner.checkpoint.CheckpointError` naming the file; nothing it holds is run."""
    from torch.distributed.checkpoint.metadata import Metadata

    from agents.safeio import UnsafeFileError, read_regular
    from learner.checkpoint import CheckpointError

    path = Path(path)
    try:
        data = read_regular(path, max_bytes=MAX_METADATA_BYTES)
    except UnsafeFileError as exc:
        raise CheckpointError(f"sharded checkpoint metadata refused: {exc}") from None
    try:
        metadata = _MetadataUnpickler(data).load()
    except _Refused as exc:
        raise CheckpointError(f"{path} is refused: it names {exc}, which a sharded checkpoint's metadata never "
                              "holds (the file was tampered with or not written by torch.distributed.checkpoint); "
                              "nothing in it was run") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
            RecursionError, MemoryError, OverflowError) as exc:
        raise CheckpointError(f"{path} cannot be read as a sharded checkpoint's metadata "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not a sharded checkpoint's metadata")
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"{path} lists no shard files (storage_data is {type(storage).__name__})")
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(rel, str) or not rel or "/" in rel or "\\" in rel or rel in (".", "..") or "\x00" in rel:
            raise CheckpointError(f"{path} lists a shard file {str(rel)[:80]!r} that is not a file in its folder")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
            raise CheckpointError(f"{path} lists a shard of {rel!r} at offset {offset!r}, length {length!r}")
    return metadata


def _safe_reader(path: Path):
    """A ``FileSystemReader`` of ``path`` that reads its metadata with :func:`read_sharded_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_sharded_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(path))


def _weights_only_planner():
    """torch's default load planner, with the checkpoint's non-tensor values (the optimizer's
    hyperparameters) read by ``torch.load(weights_only=True)`` instead of a full unpickle."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    from learner.checkpoint import CheckpointError

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
                named = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
                why = f"it names {named.group(1)[:120]}, which is not plain data" if named else \
                    f"{type(exc).__name__}: {str(exc)[:160]}"
                raise CheckpointError(f"the sharded checkpoint's value {read_item.dest_index.fqn!r} is refused ({why}); "
                                      "nothing in it was run") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Planner()


def load_sharded(policy, optimizer, folder: Path) -> None:
    """Read what :func:`save_sharded` wrote (on any number of ranks) into the model and optimizer;
    its metadata is checked first (:func:`read_sharded_metadata`), so a tampered one is a clear
    error on every rank before any collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    path = Path(folder) / SHARDED_DIR
    if not (path / ".metadata").exists() and not (path / ".metadata").is_symlink():
        raise FileNotFoundError(f"{folder} holds no sharded learner state ({SHARDED_DIR}/.metadata): it was not "
                                "written by a torchrun run; resume it without torchrun")
    read_sharded_metadata(path / ".metadata")
    state = {"model": get_model_state_dict(policy.model), "optim": get_optimizer_state_dict(policy.model, optimizer)}
    try:
        dcp.load(state, storage_reader=_safe_reader(path), planner=_weights_only_planner())
    except CheckpointException as exc:  # torch wraps what a rank raised: show ours as itself
        from learner.checkpoint import CheckpointError

        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(inner, CheckpointError):
                raise CheckpointError(str(inner)) from None
        raise
    set_model_state_dict(policy.model, state["model"])
    set_optimizer_state_dict(policy.model, optimizer, state["optim"])


# -- one update across ranks --------------------------------------------------------------------
@dataclasses.dataclass
class Shard:
    """This rank's part of an update and the reductions across ranks (``policy_update``'s
    ``shard``)."""

    rank: int
    world: int

    @property
    def part(self) -> tuple[int, int]:
        return self.rank, self.world

    def select(self, batches: list, template) -> list:
        """Pad this rank's micro-batches to the most any rank has, with empty ones (a sequence
        with nothing to score), so every rank runs as many forward and backward passes.
        ``template()`` gives a micro-batch of the update to copy a sequence from where this
        rank has none."""
        import torch.distributed as dist

        count = torch.tensor([len(batches)], dtype=torch.long)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        if len(batches) >= int(count):
            return batches
        filler = _empty_batch(batches[0] if batches else template())
        return batches + [filler] * (int(count) - len(batches))

    def all_finite(self, finite: bool) -> bool:
        import torch.distributed as dist

        flag = torch.tensor([1 if finite else 0], dtype=torch.long)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def reduce_scalars(self, loss: float, gap: float, seq_tokens: int) -> tuple[float, float, int]:
        import torch.distributed as dist

        sums = torch.tensor([loss, float(seq_tokens)], dtype=torch.float64)
        dist.all_reduce(sums)
        top = torch.tensor([gap], dtype=torch.float64)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return float(sums[0]), float(top[0]), int(sums[1])

    def reduce_stats(self, stats):
        import torch.distributed as dist

        from learner.loss import LossStats

        parts: list = [None] * self.world
        dist.all_gather_object(parts, stats)
        merged = LossStats()
        for part in parts:
            merged.merge(part)
        return merged


def _empty_batch(source):
    """A micro-batch that scores nothing: one sequence of ``source`` with its loss mask zeroed."""
    from learner.batch import Batch

    sample = source.samples[0]
    empty = dataclasses.replace(sample, loss_mask=np.zeros_like(sample.loss_mask))
    zeros = torch.zeros_like(source.mask[:1])
    return Batch(samples=[empty], images=[source.images[0]], mask=zeros,
                 behavior_logprobs=torch.zeros_like(source.behavior_logprobs[:1]),
                 advantages=torch.zeros(1), weights=torch.zeros(1), ages=torch.zeros(1),
                 num_tokens=source.num_tokens)


def encode_update(trajs: Sequence, weights, ages, on_policy: bool, base_lr: float) -> dict[str, Any]:
    """One update's records and settings as plain data for :func:`broadcast`."""
    return {"records": [t.to_bytes() for t in trajs], "weights": np.asarray(weights, dtype=np.float64),
            "ages": np.asarray(ages, dtype=np.float64), "on_policy": bool(on_policy), "base_lr": float(base_lr)}


def decode_update(message: dict[str, Any]) -> tuple[list, np.ndarray, np.ndarray, bool, float]:
    from agents.record import Trajectory

    return ([Trajectory.from_bytes(b) for b in message["records"]], message["weights"], message["ages"],
            message["on_policy"], message["base_lr"])


class ShardedLearner:
    """The sharded learner behind :class:`learner.learners.Learner`, as rank 0 drives it: each
    call that needs the other ranks is a command every rank carries out (:func:`serve`).

    ``trained`` is this rank's sharded policy; ``policy`` rank 0's unsharded copy that plays and
    evaluates (None on the other ranks); ``step`` (a :class:`learner.learners.UpdateStep`) runs
    one update on this rank.
    """

    def __init__(self, trained, policy, state, step) -> None:
        self.trained, self.policy, self.state, self.step = trained, policy, state, step
        self.world = world_size()

    def update(self, trajs: Sequence, weights, ages, *, on_policy: bool, observe=None) -> dict[str, Any]:
        """Every rank takes its part of the update. ``observe`` (per-record losses) is not taken:
        each rank scores only its own sequences."""
        message = encode_update(trajs, weights, ages, on_policy, self.state.scheduler.base_lrs[0])
        broadcast(("update", message))
        return run_update(self, message)

    def publish(self) -> None:
        """Gather the trained weights into rank 0's sampler."""
        broadcast(("gather", None))
        gather_into(self.trained, self.policy)

    def reference(self) -> Any:
        """Rank 0's KL reference (each rank loads its own unsharded copy on first use)."""
        return self.step.reference()

    def save(self, folder: Path) -> None:
        """Rank 0's sampler as the checkpoint's model, every rank's shards of the weights and of
        Adam's state, and the run state (its optimizer left to the shards)."""
        self.policy.save_pretrained(folder / "model")
        broadcast(("save", str(folder)))
        save_sharded(self.trained, self.state.optimizer, folder)
        self.state.save(folder, optimizer_state={})

    def load(self, folder: Path) -> None:
        """The run state and this rank's shards (the other ranks read theirs as they start)."""
        self.state.load(folder)
        load_sharded(self.trained, self.state.optimizer, folder)

    def release(self) -> None:
        self.state.release_optimizer()
        self.step.release_reference()

    def close(self) -> None:
        self.stop()

    def stop(self) -> None:
        if _phase == "started":
            broadcast(("stop", None))


def run_update(learner, message: dict[str, Any]) -> dict[str, Any]:
    trajs, weights, ages, on_policy, base_lr = decode_update(message)
    if learner.state.scheduler.base_lrs[0] != base_lr:
        learner.state.set_lr(base_lr)
    return learner.step(trajs, weights, ages, on_policy, Shard(rank(), world_size()))


def stream_state(policy, trainable_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The sharded model's weights one tensor at a time, each gathered whole on every rank (a
    collective per tensor: every rank must walk the same stream to its end), in the keys and
    order of :func:`full_state`. A rank holds one gathered tensor at a time, never the model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    shards = get_model_state_dict(policy.model, options=StateDictOptions(ignore_frozen_params=trainable_only))
    for key, value in shards.items():
        yield key, (value.full_tensor() if isinstance(value, DTensor) else value)


def gather_into(policy, sampler) -> None:
    """The collective weight gather, tensor by tensor; on rank 0 each lands in ``sampler``'s
    model (cast to its dtype) as it arrives."""
    from agents.policies.lora import has_lora

    lora = has_lora(policy.model)
    own = sampler.model.state_dict() if sampler is not None and rank() == 0 else None
    seen: set[str] = set()
    strange: list[str] = []
    with torch.no_grad():
        for key, value in stream_state(policy, trainable_only=lora):
            if own is None:
                continue  # the other ranks take part in each gather only
            if key in own:
                own[key].copy_(value)
                seen.add(key)
            else:
                strange.append(key)  # said after the stream: the other ranks walk it to its end
    if strange:
        raise KeyError(f"the sampler has no tensor {strange[0]!r} ({len(strange)} such)")
    if own is not None and not lora:
        missing = set(own) - seen
        tied = {k for k in missing if "lm_head" in k}
        if missing - tied:
            raise KeyError(f"the gathered weights lack {sorted(missing - tied)[:3]}")


def serve(learner) -> None:
    """A non-zero rank's loop: carry out rank 0's commands until it says stop."""
    while True:
        command, payload = broadcast()
        if command == "update":
            run_update(learner, payload)
        elif command == "gather":
            gather_into(learner.trained, None)
        elif command == "save":
            save_sharded(learner.trained, learner.state.optimizer, Path(payload))
        elif command in ("stop", "abort"):
            return
        else:  # pragma: no cover - rank 0 sends only the commands above
            raise RuntimeError(f"unknown command from rank 0: {command!r}")


#: Rank 0's progress in the command protocol: None, "started" (the other ranks build their
#: shards and serve), "stopped" (they have left).
_phase: str | None = None


def finish() -> None:
    """Rank 0: release the other ranks whatever happened (``abort`` before the start was
    broadcast, ``stop`` after); every rank: leave the process group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if rank() == 0 and _phase is None:
        broadcast(("abort", None))
    elif rank() == 0 and _phase == "started":
        broadcast(("stop", None))
    dist.destroy_process_group()


def exit_serving_rank(code: int) -> NoReturn:
    """End a non-zero rank after :func:`finish`: flush its output and leave without
    interpreter finalization, as a forked worker does (``os._exit``). The group's threads
    outlive ``destroy_process_group`` (torch's DTensor caches keep the group alive), and one
    taking the GIL of a finalizing interpreter aborts a finished job ("terminate called without
    an active exception"). The rank owns no files, trackers or child processes: what it writes
    (its checkpoint shards) is complete when ``save`` returns."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
