"""The trainer's side of the vLLM engine: a sampler with the runner's generate contract whose
engine runs in another process, started with the vLLM environment's python.

vLLM pins its own torch, which cannot share a process with the project's, so
:class:`VLLMSampler` starts ``python -m agents.engines.vllm_server`` with the vLLM environment's
interpreter and talks to it over a socket pair (:mod:`agents.engines.vllm_server` has the wire
format). Per-prompt sampling seeds are drawn from torch's RNG in this process, so a runner's
seeded collect is reproducible through vLLM too. Images (Qwen2-VL / Qwen2.5-VL) are sent sized
as the policy's processor sizes them (:meth:`agents.policies.policy.Policy.prepare_image`), each distinct
image once per request.

Weights (:meth:`VLLMSampler.push_weights`) go in memory by default (``weight_sync="memory"``):
at the first push the trainer and the engine's workers form a ``torch.distributed`` group of
their own (a TCPStore on a free loopback port, rank 0 here; gloo when the engine or the
learner runs on the CPU, NCCL when they run on two GPUs), and each push broadcasts the weights in buckets of
``bucket_mb`` in the engine's dtype, which the engine loads into its model in place
(:mod:`agents.engines.vllm_engine`): no file is written. A tied LM head is not sent (the engine's is
the embedding). A LoRA model sends its adapters alone when the engine serves adapters
(``lora=``, their settings), else its merged weights. ``weight_sync="files"`` keeps the round trip through
``save_pretrained`` under ``/dev/shm`` (the benchmark's baseline).

Which python: ``python=`` (``--vllm-python``), else ``$FRESHPER_VLLM_PYTHON``, else the
checkout's ``.venv-vllm/bin/python`` (``make vllm-venv``), else this interpreter (a machine
where vLLM is installed beside the project, as on GPU machines with ``.[vllm]``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from agents.record import Generation
from agents.engines.vllm_server import recv_message, send_message

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]


def default_vllm_python() -> str:
    """The interpreter to run the vLLM engine with (see the module docstring)."""
    env = os.environ.get("FRESHPER_VLLM_PYTHON")
    if env:
        return env
    venv = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _shm_root() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=f"freshper-vllm-{os.getpid()}-", dir=base))


def _stop(proc: subprocess.Popen, sock: socket.socket, folder: Path, temp_log: Path | None,
          groups: list | None = None) -> None:
    """Close the socket (the server exits on EOF), wait a little, kill if needed, clean up (a
    weight group still alive at interpreter exit aborts the process, so it is shut down)."""
    for group in groups or ():
        try:
            group.shutdown()
        except Exception:  # noqa: BLE001 - best effort: the peer may be gone
            pass
    if groups:
        groups.clear()
    try:
        sock.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    shutil.rmtree(folder, ignore_errors=True)
    if temp_log is not None and proc.returncode == 0:
        temp_log.unlink(missing_ok=True)


class VLLMSampler:
    """Generates with a vLLM engine in its own process; :meth:`generate` is the contract of
    :meth:`agents.policies.policy.Policy.generate` (``turn_cache`` is ignored, vLLM caches prefixes
    itself). ``prepare_image`` sizes an image as the policy's processor does (vision models)."""

    def __init__(self, model_path: str | os.PathLike, *, eos_token_id: int, suppressed_ids: Sequence[int] = (),
                 prepare_image: Any = None, python: str | None = None, dtype: str = "auto", max_model_len: int = 2048,
                 seed: int = 0, enforce_eager: bool | None = None, gpu_memory_utilization: float | None = None,
                 engine_args: dict[str, Any] | None = None, startup_timeout: float = 900.0,
                 log_path: str | os.PathLike | None = None, weight_sync: str = "memory", bucket_mb: int = 256,
                 lora: Any = None, colocate: bool = False, max_images: int = 16,
                 group_timeout: float = 600.0, threads: int | None = None) -> None:
        import json

        if weight_sync not in ("memory", "files"):
            raise ValueError(f"weight_sync must be 'memory' or 'files', got {weight_sync!r}")
        self.eos_token_id = int(eos_token_id)
        self.suppressed_ids = [int(t) for t in suppressed_ids]
        self.prepare_image = prepare_image
        self.python = python or default_vllm_python()
        self.weight_sync = weight_sync
        self.bucket_bytes = int(bucket_mb) << 20
        #: The LoRA adapters (``agents.policies.lora.LoraSettings``) the engine serves as adapters
        #: (None: weights are pushed merged); its rank sizes the engine's LoRA slot.
        self.lora = lora if lora is not None and lora.rank else None
        self.lora_rank = self.lora.rank if self.lora is not None else 0
        self.colocate = bool(colocate)
        self.group_timeout = float(group_timeout)
        self.folder = _shm_root()
        self.log_path = Path(log_path) if log_path else self.folder.parent / f"{self.folder.name}.log"
        self._temp_log = log_path is None
        self.version: int | None = None
        self._weights_dir: Path | None = None
        self._group: Any = None
        self._store: Any = None
        self._base_pushed = False
        #: Seconds of each push (the learner's log and the benchmark read them).
        self.sync_seconds: list[float] = []
        #: When True, each generate keeps the prompts vLLM ran (image pads as vLLM expanded
        #: them) in :attr:`last_prompt_ids` (the conformance test compares them with the renderer's).
        self.echo_prompts = False
        self.last_prompt_ids: list[list[int]] | None = None
        model_path = engine_model_folder(model_path)
        parent, child = socket.socketpair()
        cmd = [self.python, "-m", "agents.engines.vllm_server", "--fd", str(child.fileno()), "--model", str(model_path),
               "--dtype", dtype, "--max-model-len", str(int(max_model_len)), "--seed", str(int(seed)),
               "--max-images", str(int(max_images)), "--lora-rank", str(self.lora_rank),
               "--engine-args", json.dumps(engine_args or {})]
        if enforce_eager is not None:
            cmd.append("--enforce-eager" if enforce_eager else "--no-enforce-eager")
        if colocate:
            cmd.append("--sleep-mode")
        if gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU builds (else a share of RAM)
        env.pop("OMP_WAIT_POLICY", None)
        if threads is None:  # a CPU engine computes with this process's torch threads (1 on <= 2 cores)
            import torch

            threads = torch.get_num_threads()
        env.setdefault("OMP_NUM_THREADS", str(int(threads)))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, pass_fds=(child.fileno(),), cwd=str(REPO_ROOT), env=env,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        child.close()
        self.sock = parent
        self._groups: list[Any] = []  # the weight group, shut down with the engine
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.sock, self.folder,
                                           self.log_path if self._temp_log else None, self._groups)
        logger.info("starting the vLLM engine (pid %d, %s); its log: %s", self.proc.pid, self.python, self.log_path)
        t0 = time.monotonic()
        self.sock.settimeout(startup_timeout)
        try:
            ready = recv_message(self.sock)
        except (socket.timeout, OSError) as exc:
            self.close()
            raise RuntimeError(f"the vLLM engine did not start within {startup_timeout:.0f} s "
                               f"({exc}); see {self.log_path}:\n{self._log_tail()}") from exc
        self.sock.settimeout(None)
        if ready is None or not ready.get("ok"):
            error = (ready or {}).get("error", "it exited")
            self.close()
            raise RuntimeError(f"the vLLM engine failed to start: {error}\n{self.log_path}:\n{self._log_tail()}")
        self.vllm_version = ready.get("vllm")
        #: The engine's weights' dtype (pushed weights are sent in it) and where it runs.
        self.engine_dtype: str = ready.get("dtype", "float32")
        self.engine_on_cpu: bool = bool(ready.get("on_cpu", True))
        self.engine_gpu: str | None = ready.get("gpu_uuid")  # the engine's GPU (its UUID), if on one
        self._backend: str | None = None
        logger.info("vLLM %s engine up in %.0f s (%s)", self.vllm_version, time.monotonic() - t0, self.engine_dtype)

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _send(self, request: dict[str, Any]) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("the vLLM engine is closed")
        try:
            send_message(self.sock, request)
        except OSError as exc:
            raise RuntimeError(f"the vLLM engine (pid {self.proc.pid}) is gone: {exc}; its log "
                               f"{self.log_path}:\n{self._log_tail()}") from exc

    def _reply(self, op: str) -> dict[str, Any]:
        try:
            reply = recv_message(self.sock)
        except OSError as exc:
            reply = None
            error = str(exc)
        else:
            error = "the engine closed the connection"
        if reply is None:
            raise RuntimeError(f"the vLLM engine (pid {self.proc.pid}) is gone: {error}; its log "
                               f"{self.log_path}:\n{self._log_tail()}")
        if not reply.get("ok"):
            raise RuntimeError(f"vLLM engine error on {op}: {reply.get('error')}")
        return reply

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        self._send(request)
        return self._reply(str(request.get("op")))

    def generate(self, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[np.ndarray]] | None = None, *,
                 max_new_tokens: int = 32, temperature: float = 1.0, greedy: bool = False,
                 turn_cache: Any = None) -> list[Generation]:
        """One reply per prompt, sampled by the engine from ``log_softmax(logits / T)`` (the
        policy's vision special tokens excluded); ``images[b]`` are prompt b's images in order."""
        import torch

        if not prompts:
            return []
        if temperature <= 0:
            raise ValueError("temperature must be > 0 (use greedy=True for argmax decoding)")
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()  # from the runner's seeded RNG
        request = {"op": "generate", "prompts": [[int(t) for t in p] for p in prompts],
                   "max_new_tokens": int(max_new_tokens), "temperature": float(temperature),
                   "greedy": bool(greedy), "eos_token_id": self.eos_token_id, "seeds": seeds,
                   "suppressed_ids": self.suppressed_ids}
        if images is not None and any(len(im) for im in images):
            if len(images) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(images)} image lists")
            request["images"], request["image_refs"] = self._encode_images(images)
        if self.echo_prompts:
            request["echo_prompts"] = True
        reply = self._call(request)
        self.last_prompt_ids = reply.get("prompt_ids")
        return [Generation([int(t) for t in ids], [float(x) for x in lps], bool(done))
                for ids, lps, done in reply["generations"]]

    def _encode_images(self, images: Sequence[Sequence[np.ndarray]]) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """Each distinct image once (sized as the policy's processor sizes it), and per prompt
        the indices of its images."""
        import base64

        table: list[dict[str, Any]] = []
        index: dict[tuple, int] = {}
        refs = []
        for per in images:
            row = []
            for im in per:
                a = np.ascontiguousarray(im, dtype=np.uint8)
                key = (a.shape, a.tobytes())
                if key not in index:
                    sized = np.ascontiguousarray(self.prepare_image(a) if self.prepare_image is not None else a,
                                                 dtype=np.uint8)
                    index[key] = len(table)
                    table.append({"shape": list(sized.shape), "data": base64.b64encode(sized.tobytes()).decode()})
                row.append(index[key])
            refs.append(row)
        return table, refs

    # -- weights ---------------------------------------------------------------------------
    def push_weights(self, model: Any, version: int) -> None:
        """Make the engine sample from ``model``'s current weights (in memory or through files,
        ``weight_sync``; the prefix cache is reset); ``version`` is kept for the log."""
        from agents.policies.lora import has_lora

        t0 = time.perf_counter()
        if self.weight_sync == "files":
            self._push_files(model, version)
        elif has_lora(model) and self.lora_rank:
            self._push_adapter(model)
        else:
            self.push_state(named_weights(model))
        self.version = int(version)
        self.sync_seconds.append(time.perf_counter() - t0)
        logger.debug("pushed weights version %d to vLLM in %.2f s", version, self.sync_seconds[-1])

    def push_state(self, weights: Any) -> None:
        """Broadcast ``(name, tensor)`` pairs (the model's own names) into the engine's model
        (colocated on a GPU: the engine opens the buckets through CUDA IPC handles)."""
        if self.transport() == "ipc":
            self._push_ipc(weights)
            return
        self._ensure_group()
        buckets = self._buckets(weights)
        self._send({"op": "receive_weights", "buckets": [[e for e, _ in b] for b in buckets]})
        self._broadcast_buckets(buckets)
        self._reply("receive_weights")

    def _push_ipc(self, weights: Any) -> None:
        """Colocated mode: the buckets stay in this process's GPU memory and the engine, on the
        same GPU, reads them through CUDA IPC (NCCL cannot join two ranks on one device)."""
        import base64
        import pickle

        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        from agents.engines.vllm_engine import bucket_layout

        device = torch.device("cuda", torch.cuda.current_device())
        buckets = self._buckets(weights)
        flats, handles = [], []
        for bucket in buckets:  # held until the engine replies: one copy of the weights in its dtype
            offsets, size = bucket_layout([e for e, _ in bucket])
            flat = torch.empty(size, dtype=torch.uint8, device=device)
            for ((_, wire, shape), t), start in zip(bucket, offsets):
                dt = getattr(torch, wire)
                n = t.numel() * torch.empty((), dtype=dt).element_size()
                flat[start:start + n].view(dt).view(shape).copy_(t)
            flats.append(flat)
            handles.append(base64.b64encode(pickle.dumps(reduce_tensor(flat)[1])).decode())
        torch.cuda.synchronize(device)
        self._call({"op": "receive_weights_ipc", "buckets": [[e for e, _ in b] for b in buckets], "handles": handles})
        del flats  # the engine has copied them into its model

    def _push_adapter(self, model: Any) -> None:
        from agents.policies.lora import adapter_state_dict

        settings = self.lora
        config = settings.peft_config().to_dict()
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
        if self.transport() == "ipc":
            raise NotImplementedError("LoRA adapters served by an engine on the learner's GPU: use lora 'merged'")
        self._ensure_group()
        buckets = self._buckets(adapter_state_dict(model).items(), cast=False)
        self._send({"op": "receive_adapter", "buckets": [[e for e, _ in b] for b in buckets],
                    "peft_config": json.loads(json.dumps(config, default=str))})
        self._broadcast_buckets(buckets)
        self._reply("receive_adapter")

    def _buckets(self, weights: Any, cast: bool = True) -> list[list[tuple[list[Any], Any]]]:
        """``(name, tensor)`` pairs grouped into broadcast buckets, each entry ``([name, dtype,
        shape], tensor)``: a tensor of :data:`DIRECT_BYTES` or more is a bucket of its own (sent
        from its own memory, no copy), smaller ones are packed together up to ``bucket_bytes``.
        Tensors are sent in the engine's dtype unless ``cast`` is False (adapters keep fp32),
        converted one at a time as they are sent (never a second copy of the model)."""
        import torch

        dtype = getattr(torch, self.engine_dtype)
        buckets: list[list[tuple[list[Any], Any]]] = []
        small: list[tuple[list[Any], Any]] = []
        size = 0
        for name, tensor in weights:
            t = tensor.detach()
            wire = dtype if cast and t.is_floating_point() else t.dtype
            entry = ([name, str(wire).removeprefix("torch."), list(t.shape)], t)
            nbytes = t.numel() * torch.empty((), dtype=wire).element_size()
            if nbytes >= DIRECT_BYTES:
                buckets.append([entry])
                continue
            if small and size + nbytes > self.bucket_bytes:
                buckets.append(small)
                small, size = [], 0
            small.append(entry)
            size += nbytes
        if small:
            buckets.append(small)
        return buckets

    def _broadcast_buckets(self, buckets: list[list[tuple[list[Any], Any]]]) -> None:
        """Broadcast each bucket (the engine posts its receives in the same order); at most two
        in flight, so packing the next overlaps sending this one."""
        import torch

        from agents.engines.vllm_engine import broadcast, bucket_layout

        device = torch.device("cpu") if self._backend == "gloo" else self._device
        inflight: list[tuple[Any, Any]] = []
        for bucket in buckets:
            offsets, size = bucket_layout([e for e, _ in bucket])
            (_, wire0, _), t0 = bucket[0]
            if len(bucket) == 1:  # a large tensor: from its own memory when it already is what goes
                t0 = t0.to(device=device, dtype=getattr(torch, wire0)).contiguous()
                flat = t0.reshape(-1).view(torch.uint8)
            else:
                flat = torch.empty(size, dtype=torch.uint8, device=device)
                for ((_, wire, shape), t), start in zip(bucket, offsets):
                    dt = getattr(torch, wire)
                    n = t.numel() * torch.empty((), dtype=dt).element_size()
                    flat[start:start + n].view(dt).view(shape).copy_(t)
            inflight.append((flat, broadcast(self._group, flat, wait=False)))
            if len(inflight) > 2:
                inflight.pop(0)[1].wait()
        for _, work in inflight:
            work.wait()

    def transport(self) -> str:
        """How in-memory pushes travel: ``gloo`` (the engine or this process on the CPU),
        ``nccl`` (the engine on another GPU) or ``ipc`` (the engine on this process's GPU:
        NCCL cannot put two ranks on one device, so the engine opens the buckets through CUDA
        IPC handles)."""
        if self._backend is None:
            import torch

            if self.engine_on_cpu or not torch.cuda.is_available():
                self._backend = "gloo"
            else:
                mine = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
                self._backend = "ipc" if mine == self.engine_gpu else "nccl"
        return self._backend

    def _ensure_group(self) -> None:
        """At the first in-memory push: form the weight group with the engine (rank 0 here)."""
        if self._group is not None:
            return
        import torch

        from agents.engines.vllm_engine import new_group

        self.transport()
        self._device = torch.device("cpu") if self._backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        port = _free_port()
        self._send({"op": "join_weight_group", "host": "127.0.0.1", "port": port, "world_size": 2, "rank": 1,
                    "backend": self._backend, "timeout_s": self.group_timeout})
        self._store, self._group = new_group("127.0.0.1", port, 2, 0, self._backend, self.group_timeout, self._device)
        self._groups.append(self._group)
        self._reply("join_weight_group")
        logger.info("weight group with the vLLM engine formed (%s, port %d)", self._backend, port)

    def _push_files(self, model: Any, version: int) -> None:
        target = self.folder / f"v{int(version)}-{time.monotonic_ns()}"
        from agents.policies.lora import has_lora, plain_state_dict

        if has_lora(model):  # the engine holds the plain model: the adapters go in merged
            from safetensors.torch import save_file

            target.mkdir(parents=True)
            model.config.save_pretrained(target)
            save_file({k: v.detach().cpu().clone() for k, v in plain_state_dict(model).items()},
                      str(target / "model.safetensors"))
        else:
            model.save_pretrained(target)
        self._call({"op": "load_weights", "path": str(target)})
        if self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)  # the engine keeps only the newest folder's path
        self._weights_dir = target

    # -- colocated mode ----------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the engine's GPU memory (colocated mode) until :meth:`wake_up`."""
        self._call({"op": "sleep"})

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call({"op": "wake_up", "tags": tags})

    def info(self) -> dict[str, Any]:
        """The engine's vLLM version, pid, dtype, reload and in-memory sync counts."""
        return self._call({"op": "info"})

    def close(self) -> None:
        """Stop the engine process and remove any pushed weight files."""
        if self._finalizer.alive:
            try:
                self.sock.settimeout(30)
                send_message(self.sock, {"op": "close"})
                recv_message(self.sock)
            except OSError:
                pass
            self._finalizer()
        self._group = None
        self._store = None


#: Tensors of at least this many bytes are broadcast alone, from their own memory.
DIRECT_BYTES = 4 << 20


def named_weights(model: Any):
    """``model``'s weights to send an engine, under the model's own names: LoRA adapters merged
    in, and without a tied LM head (the engine's is its embedding)."""
    from agents.policies.lora import plain_state_dict

    state = plain_state_dict(model)
    tied = _tied(model)
    for name, tensor in state.items():
        if tied and name.endswith("lm_head.weight"):
            continue
        yield name, tensor


def _tied(model: Any) -> bool:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))


def engine_model_folder(path: str | os.PathLike) -> Path:
    """The folder the engine loads: ``path``, or the base model of a LoRA adapter folder (the
    adapters are pushed at the first sync)."""
    path = Path(path)
    if (path / "adapter_config.json").is_file():
        from agents.policies.lora import read_adapter_config

        return read_adapter_config(path)[2]
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
