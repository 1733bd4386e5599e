"""The trainer's side of the vLLM engine: a sampler with the runner's generate contract whose
engine runs in another process, started with the vLLM environment's python.

vLLM pins its own torch, which cannot share a process with the project's, so
:class:`VLLMSampler` starts ``python -m agents.vllm_server`` with the vLLM environment's
interpreter and talks to it over a socket pair (:mod:`agents.vllm_server` has the wire
format). Weights travel as files: :meth:`VLLMSampler.push_weights` writes the learner's model
with ``save_pretrained`` (safetensors) to a folder under ``/dev/shm`` and the engine reloads
them in place and resets its prefix cache. Per-prompt sampling seeds are drawn from torch's
RNG in this process, so a runner's seeded collect is reproducible through vLLM too.

Which python: ``python=`` (``--vllm-python``), else ``$FRESHPER_VLLM_PYTHON``, else the
checkout's ``.venv-vllm/bin/python`` (``make vllm-venv``), else this interpreter (a machine
where vLLM is installed beside the project, as on GPU machines with ``.[vllm]``).
"""

from __future__ import annotations

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
from agents.vllm_server import recv_message, send_message

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]


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


def _stop(proc: subprocess.Popen, sock: socket.socket, folder: Path, temp_log: Path | None) -> None:
    """Close the socket (the server exits on EOF), wait a little, kill if needed, clean up."""
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
    :meth:`agents.policy.Policy.generate` (text prompts; ``turn_cache`` is ignored, vLLM caches
    prefixes itself)."""

    def __init__(self, model_path: str | os.PathLike, *, eos_token_id: int, python: str | None = None,
                 dtype: str = "float32", max_model_len: int = 2048, seed: int = 0, enforce_eager: bool = True,
                 gpu_memory_utilization: float | None = None, engine_args: dict[str, Any] | None = None,
                 startup_timeout: float = 900.0, log_path: str | os.PathLike | None = None) -> None:
        import json

        self.eos_token_id = int(eos_token_id)
        self.python = python or default_vllm_python()
        self.folder = _shm_root()
        self.log_path = Path(log_path) if log_path else self.folder.parent / f"{self.folder.name}.log"
        self._temp_log = log_path is None
        self.version: int | None = None
        self._weights_dir: Path | None = None
        parent, child = socket.socketpair()
        cmd = [self.python, "-m", "agents.vllm_server", "--fd", str(child.fileno()), "--model", str(model_path),
               "--dtype", dtype, "--max-model-len", str(int(max_model_len)), "--seed", str(int(seed)),
               "--enforce-eager" if enforce_eager else "--no-enforce-eager",
               "--engine-args", json.dumps(engine_args or {})]
        if gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU builds (else a share of RAM)
        env.pop("OMP_WAIT_POLICY", None)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, pass_fds=(child.fileno(),), cwd=str(REPO_ROOT), env=env,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        child.close()
        self.sock = parent
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.sock, self.folder,
                                           self.log_path if self._temp_log else None)
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
        logger.info("vLLM %s engine up in %.0f s", self.vllm_version, time.monotonic() - t0)

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        if not self._finalizer.alive:
            raise RuntimeError("the vLLM engine is closed")
        try:
            send_message(self.sock, request)
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
            raise RuntimeError(f"vLLM engine error on {request.get('op')}: {reply.get('error')}")
        return reply

    def generate(self, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[np.ndarray]] | None = None, *,
                 max_new_tokens: int = 32, temperature: float = 1.0, greedy: bool = False,
                 turn_cache: Any = None) -> list[Generation]:
        """One reply per prompt, sampled by the engine from ``log_softmax(logits / T)``."""
        import torch

        if not prompts:
            return []
        if images is not None and any(len(im) for im in images):
            raise NotImplementedError("the vLLM engine takes text prompts only; vision tasks use --engine hf")
        if temperature <= 0:
            raise ValueError("temperature must be > 0 (use greedy=True for argmax decoding)")
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()  # from the runner's seeded RNG
        reply = self._call({"op": "generate", "prompts": [[int(t) for t in p] for p in prompts],
                            "max_new_tokens": int(max_new_tokens), "temperature": float(temperature),
                            "greedy": bool(greedy), "eos_token_id": self.eos_token_id, "seeds": seeds})
        return [Generation([int(t) for t in ids], [float(x) for x in lps], bool(done))
                for ids, lps, done in reply["generations"]]

    def push_weights(self, model: Any, version: int) -> None:
        """Make the engine sample from ``model``'s current weights (written as safetensors under
        /dev/shm, reloaded in place, prefix cache reset); ``version`` is kept for the log."""
        t0 = time.perf_counter()
        target = self.folder / f"v{int(version)}-{time.monotonic_ns()}"
        from agents.lora import has_lora, plain_state_dict

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
        self.version = int(version)
        logger.debug("pushed weights version %d to vLLM in %.2f s", version, time.perf_counter() - t0)

    def info(self) -> dict[str, Any]:
        """The engine's vLLM version, pid and reload count."""
        return self._call({"op": "info"})

    def close(self) -> None:
        """Stop the engine process and remove the pushed weights."""
        if self._finalizer.alive:
            try:
                self.sock.settimeout(30)
                send_message(self.sock, {"op": "close"})
                recv_message(self.sock)
            except OSError:
                pass
            self._finalizer()
