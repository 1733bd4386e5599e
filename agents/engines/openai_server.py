"""A freshper checkpoint behind an OpenAI-compatible chat-completions endpoint.

    python -m agents.engines.openai_server --model runs/<run>/checkpoints/iter_000100/model [--port 8001]
    python -m agents.engines.openai_server --tiny text      # the embedded tiny model of a modality

For evaluating a checkpoint with tools that speak the OpenAI API (``python -m agents.evaluate
--base-url http://127.0.0.1:8001/v1 --model NAME``, any OpenAI client), on the CPU or wherever
the policy loads. Prompts are rendered exactly as the runner renders them (the model's chat
template through :class:`agents.policies.chat.ChatRenderer`; earlier assistant turns re-encoded and
closed with EOS), images come as PNG/JPEG data URLs, and replies are sampled by
:meth:`agents.policies.policy.Policy.generate`, one request at a time.

Endpoints: ``GET /v1/models``; ``POST /v1/chat/completions`` with ``messages``, ``max_tokens``
(or ``max_completion_tokens``), ``temperature`` (0: greedy), ``seed``, ``logprobs``, and vLLM's
``return_tokens_as_token_ids``. Answers carry ``finish_reason`` (``stop`` or ``length``), the
reply's token log-probs when asked (the closing EOS left out, as OpenAI's are) and ``usage``.
Requests beyond ``--max-body-bytes``, ``n`` > 1, tools and other roles than user/assistant
(a system message is refused: the runner sends none) get a 4xx with ``{"error": {"message"}}``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import logging
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


class RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _image(url: str) -> np.ndarray:
    from PIL import Image

    if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
        raise RequestError(400, "images must be data URLs (data:image/png;base64,...); remote URLs are not fetched")
    try:
        data = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
        with Image.open(io.BytesIO(data)) as im:
            return np.asarray(im.convert("RGB"), dtype=np.uint8)
    except Exception as exc:
        raise RequestError(400, f"an image could not be decoded: {exc}") from None


def _content(message: dict[str, Any]) -> tuple[str, list[np.ndarray]]:
    """A message's text (``<image>`` where each image stands) and its images."""
    from envs.base import IMAGE_PLACEHOLDER

    content = message.get("content")
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise RequestError(400, "message content must be a string or a list of parts")
    text, images = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text.append(str(part.get("text", "")))
        elif kind == "image_url":
            url = part.get("image_url", {})
            images.append(_image(url.get("url") if isinstance(url, dict) else url))
            text.append(IMAGE_PLACEHOLDER)
        else:
            raise RequestError(400, f"unsupported content part {kind!r} (text and image_url are)")
    return "".join(text), images


class ChatModel:
    """The policy and how a request becomes a generation."""

    def __init__(self, policy: Any, name: str) -> None:
        self.policy = policy
        self.name = name
        self.lock = threading.Lock()

    def prompt(self, messages: Any) -> tuple[list[int], list[np.ndarray]]:
        """Prompt ids as the runner builds them: the first user message, then each assistant
        reply (re-encoded, closed with EOS) and the next user message."""
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list")
        roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
        expected = ["user" if k % 2 == 0 else "assistant" for k in range(len(messages))]
        if roles != expected:
            raise RequestError(400, f"messages must alternate user/assistant starting and ending with user; got {roles}")
        chat = self.policy.chat
        text, imgs = _content(messages[0])
        self._check_images(imgs)
        ids, images = list(chat.first_message(text, imgs)), list(imgs)
        for k in range(1, len(messages), 2):
            reply, _ = _content(messages[k])
            text, imgs = _content(messages[k + 1])
            self._check_images(imgs)
            ids += self.policy.encode_reply(reply) + list(chat.next_message(text, imgs))
            images += imgs
        return ids, images

    def _check_images(self, images: list[np.ndarray]) -> None:
        if images and not self.policy.is_vision:
            raise RequestError(400, f"{self.name} is a text model; it takes no images")

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        import torch

        if body.get("n", 1) != 1:
            raise RequestError(400, "n must be 1")
        if body.get("tools"):
            raise RequestError(400, "tools are not supported")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
        temperature = body.get("temperature", 1.0)
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= 4096:
            raise RequestError(400, f"max_tokens must be an integer from 1 to 4096, got {max_tokens!r}")
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise RequestError(400, f"temperature must be >= 0, got {temperature!r}")
        ids, images = self.prompt(body.get("messages"))
        seed = body.get("seed")
        with self.lock, torch.random.fork_rng(devices=[]):
            if isinstance(seed, int):
                torch.manual_seed(seed)
            gen = self.policy.generate([ids], [images], max_new_tokens=max_tokens,
                                       temperature=float(temperature) if temperature > 0 else 1.0,
                                       greedy=temperature == 0)[0]
        tok_ids, lps = list(gen.token_ids), list(gen.logprobs)
        if gen.finished and tok_ids and tok_ids[-1] == self.policy.eos_token_id:
            tok_ids, lps = tok_ids[:-1], lps[:-1]
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": self.policy.decode(tok_ids)},
                                  "finish_reason": "stop" if gen.finished else "length"}
        if body.get("logprobs"):
            as_ids = bool(body.get("return_tokens_as_token_ids"))
            content = []
            for tid, lp in zip(tok_ids, lps):
                text = self.policy.decode([tid])
                content.append({"token": f"token_id:{tid}" if as_ids else text, "logprob": float(lp),
                                "bytes": list(text.encode("utf-8")), "top_logprobs": []})
            choice["logprobs"] = {"content": content}
        return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
                "model": self.name, "choices": [choice],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(gen.token_ids),
                          "total_tokens": len(ids) + len(gen.token_ids)}}


class _Handler(BaseHTTPRequestHandler):
    server: "ChatServer"
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    timeout = 30

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        logger.debug("%s - %s", self.address_string(), format % args)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        if self.path.rstrip("/") in ("/v1/models", "/models"):
            self._send(200, {"object": "list", "data": [{"id": self.server.model.name, "object": "model",
                                                         "owned_by": "freshper"}]})
        elif self.path == "/health":
            self._send(200, {"status": "ok"})
        else:
            self._send(404, {"error": {"message": f"unknown path {self.path}"}})

    def do_POST(self) -> None:  # noqa: N802
        try:
            if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                raise RequestError(404, f"unknown path {self.path}; use POST /v1/chat/completions")
            length = int(self.headers.get("Content-Length") or -1)
            if length < 0:
                self.close_connection = True
                raise RequestError(411, "a Content-Length header is required")
            if length > self.server.max_body_bytes:
                self.close_connection = True
                raise RequestError(413, f"body of {length} bytes exceeds {self.server.max_body_bytes}")
            try:
                raw = self.rfile.read(length)
            except (socket.timeout, TimeoutError):
                self.close_connection = True
                raise RequestError(408, "the body did not arrive in time") from None
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                raise RequestError(400, "the body is not valid JSON") from None
            if not isinstance(body, dict):
                raise RequestError(400, "the body must be a JSON object")
            model = body.get("model")
            if model not in (None, self.server.model.name):
                raise RequestError(404, f"model {model!r} is not served here; this server serves {self.server.model.name!r}")
            answer = self.server.model.complete(body)
        except RequestError as err:
            self._send(err.status, {"error": {"message": str(err), "type": "invalid_request_error"}})
            return
        except Exception as err:
            logger.exception("completion failed")
            self._send(500, {"error": {"message": f"{type(err).__name__}: {err}", "type": "server_error"}})
            return
        self._send(200, answer)


class ChatServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], model: ChatModel, max_body_bytes: int = 32 << 20) -> None:
        self.model = model
        self.max_body_bytes = int(max_body_bytes)
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agents.engines.openai_server", description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--model", help="model folder (HF layout), e.g. a checkpoint's model/")
    group.add_argument("--tiny", choices=("text", "vision"), help="the embedded tiny model of a modality")
    parser.add_argument("--name", default=None, help="the model name clients send (default: the folder)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from agents.policies.policy import Policy, configure_threads

    configure_threads(args.threads)
    path = args.model
    if path is None:
        from agents.policies.tiny import build_tiny_model

        path = str(build_tiny_model(args.tiny))
    policy = Policy.from_pretrained(path)
    if args.threads is None:  # the default depends on the model's size (a real model samples on every core)
        configure_threads(parameters=policy.num_parameters)
    server = ChatServer((args.host, args.port), ChatModel(policy, args.name or str(path)))
    print(f"serving {server.model.name} at {server.url}/chat/completions", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
