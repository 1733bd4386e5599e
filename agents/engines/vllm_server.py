"""A small generation server around :class:`agents.engines.vllm_engine.VLLMEngine`, and its wire format.

    <vllm-env>/bin/python -m agents.engines.vllm_server --fd 5 --model FOLDER [--max-model-len 2048] ...

vLLM pins its own torch, so it runs in its own environment and process;
:class:`agents.engines.vllm_client.VLLMSampler` starts this module with that environment's python and
talks to it over a socket pair it hands down as file descriptor ``--fd``. Messages are JSON
objects, each framed by an 8-byte big-endian length; every request gets one reply,
``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``. Requests (``op``):

- ``generate``: ``prompts`` (lists of ids), ``max_new_tokens``, ``temperature``, ``greedy``,
  ``eos_token_id``, ``seeds``, optionally ``suppressed_ids`` and, for images, ``images`` (each
  ``{"shape": [h, w, 3], "data": base64 of its uint8 bytes}``, sent once per request) and
  ``image_refs`` (per prompt, indices into ``images``) -> ``generations``: ``[ids, logprobs,
  finished]`` per prompt (and with ``echo_prompts``, ``prompt_ids``: the prompts vLLM ran);
- ``join_weight_group``: ``host``, ``port``, ``world_size``, ``rank``, ``backend`` -> the
  engine joins the trainer's weight group (the trainer joins it at the same time);
- ``receive_weights``: ``buckets`` (per bucket, ``[name, dtype, shape]`` of its tensors) -> the
  engine takes the buckets the trainer broadcasts meanwhile, loads them in place and resets its
  prefix cache; ``receive_weights_ipc``: the same from the trainer's CUDA buckets, ``handles``
  (colocated mode); ``receive_adapter``: the same for LoRA adapter tensors, with ``peft_config``;
- ``load_weights``: ``path`` (a ``save_pretrained`` folder) -> reloaded from files in place;
- ``sleep`` / ``wake_up`` (``tags``): vLLM's sleep mode (colocated mode, GPUs only);
- ``info`` -> the vLLM version, pid, dtype and reload/sync counts; ``close`` -> the server exits.

The first message is sent unasked once the engine is up: ``{"ok": true, "ready": true, ...}``.
The server exits when its socket closes (its trainer is gone). Only the standard library is
imported at module level, so the client side imports this module for the wire format.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import struct
import sys
import traceback
from typing import Any

logger = logging.getLogger(__name__)

_HEADER = struct.Struct(">Q")


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send one JSON message, length-framed."""
    data = json.dumps(message).encode("utf-8")
    sock.sendall(_HEADER.pack(len(data)) + data)


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket) -> dict[str, Any] | None:
    """Receive one message; None when the other side has closed the socket."""
    header = _read_exactly(sock, _HEADER.size)
    if header is None:
        return None
    data = _read_exactly(sock, _HEADER.unpack(header)[0])
    if data is None:
        return None
    return json.loads(data.decode("utf-8"))


def decode_images(images: list[dict[str, Any]]) -> list[Any]:
    """The ``images`` of a generate request as uint8 arrays."""
    import base64

    import numpy as np

    return [np.frombuffer(base64.b64decode(im["data"]), dtype=np.uint8).reshape(im["shape"]) for im in images]


def handle(engine: Any, request: dict[str, Any]) -> dict[str, Any]:
    """One request to one reply (see the module docstring)."""
    op = request.get("op")
    if op == "generate":
        images = None
        if request.get("images"):
            table = decode_images(request["images"])
            images = [[table[i] for i in refs] for refs in request["image_refs"]]
        gens = engine.generate(request["prompts"], max_new_tokens=request["max_new_tokens"],
                               temperature=request["temperature"], greedy=request["greedy"],
                               eos_token_id=request["eos_token_id"], seeds=request["seeds"], images=images,
                               suppressed_ids=request.get("suppressed_ids") or ())
        reply = {"ok": True, "generations": [[g.token_ids, g.logprobs, g.finished] for g in gens]}
        if request.get("echo_prompts"):
            reply["prompt_ids"] = engine.last_prompt_ids
        return reply
    if op == "join_weight_group":
        engine.join_weight_group(request["host"], request["port"], request["world_size"], request["rank"],
                                 request["backend"], request.get("timeout_s", 600.0))
        return {"ok": True}
    if op == "receive_weights":
        engine.receive_weights(request["buckets"])
        return {"ok": True, "syncs": engine.syncs}
    if op == "receive_weights_ipc":
        engine.receive_weights_ipc(request["buckets"], request["handles"])
        return {"ok": True, "syncs": engine.syncs}
    if op == "receive_adapter":
        return {"ok": True, "adapter_id": engine.receive_adapter(request["buckets"], request["peft_config"]),
                "syncs": engine.syncs}
    if op == "load_weights":
        engine.reload(request["path"])
        return {"ok": True, "reloads": engine.reloads}
    if op == "sleep":
        engine.sleep()
        return {"ok": True}
    if op == "wake_up":
        engine.wake_up(request.get("tags"))
        return {"ok": True}
    if op == "info":
        import vllm

        return {"ok": True, "vllm": vllm.__version__, "pid": os.getpid(), "reloads": engine.reloads,
                "syncs": engine.syncs, "dtype": engine.dtype, "enforce_eager": engine.enforce_eager,
                "adapter_id": engine.adapter_id}
    return {"ok": False, "error": f"unknown op {op!r}"}


def serve(sock: socket.socket, engine: Any) -> None:
    """Answer requests until ``close`` or until the socket closes. A client that vanished
    (killed) cannot remove its pushed weights, so on a closed socket the server removes the
    folders they were pushed in (``freshper-vllm-*`` under /dev/shm or the temp folder)."""
    pushed: set[str] = set()
    while True:
        request = recv_message(sock)
        if request is None or request.get("op") == "close":
            if request is not None:
                send_message(sock, {"ok": True})
            else:
                import shutil

                for folder in pushed:
                    shutil.rmtree(folder, ignore_errors=True)
            return
        if request.get("op") == "load_weights":
            parent = os.path.dirname(os.path.abspath(request["path"]))
            if os.path.basename(parent).startswith("freshper-vllm-"):
                pushed.add(parent)
        try:
            reply = handle(engine, request)
        except Exception as exc:  # the client raises it; the server stays up
            logger.exception("request %s failed", request.get("op"))
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        send_message(sock, reply)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agents.engines.vllm_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True, help="file descriptor of the connected socket")
    parser.add_argument("--model", required=True, help="model folder (HF layout)")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on GPUs, float32 on CPUs")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                        help="default: eager on CPUs, CUDA graphs on GPUs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--max-images", type=int, default=16, help="images per prompt (vision models)")
    parser.add_argument("--lora-rank", type=int, default=0, help="serve LoRA adapters up to this rank (0: none)")
    parser.add_argument("--sleep-mode", action="store_true", help="colocated mode: vLLM's sleep mode (GPUs)")
    parser.add_argument("--engine-args", default="{}", help="further vllm.LLM keyword arguments, as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = socket.socket(fileno=args.fd)
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():  # the engine core in this process: starts in ~half the time on CPU
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from agents.engines.vllm_engine import VLLMEngine

        engine = VLLMEngine(args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
                            enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization,
                            max_images=args.max_images, lora_rank=args.lora_rank, sleep_mode=args.sleep_mode,
                            **json.loads(args.engine_args))
    except Exception as exc:
        send_message(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})
        return 1
    import vllm

    gpu = None
    if not engine.on_cpu:
        import torch

        gpu = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    send_message(sock, {"ok": True, "ready": True, "pid": os.getpid(), "vllm": vllm.__version__,
                        "dtype": engine.dtype, "enforce_eager": engine.enforce_eager, "on_cpu": engine.on_cpu,
                        "gpu_uuid": gpu})
    try:
        serve(sock, engine)
    finally:
        sock.close()
        if engine.group_joined:  # a gloo group left alive aborts the interpreter at exit
            engine.llm.collective_rpc("freshper_leave_group")
    return 0


if __name__ == "__main__":  # vLLM's worker processes re-import the main module: start only here
    sys.exit(main())
