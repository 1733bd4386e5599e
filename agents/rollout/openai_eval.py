"""Evaluate a model behind an OpenAI-compatible chat-completions endpoint on any registered task.

    python -m agents.evaluate --env freshper/FrozenLake-v0 --base-url http://127.0.0.1:8000/v1 \\
        --model Qwen/Qwen2.5-7B-Instruct [--api-key-env OPENAI_API_KEY] [--episodes 100] [--concurrency 16] \\
        [--request-timeout 120] [--max-retries 6] [--token-ids] [--save DIR]

The tasks run here, in-process; the endpoint writes the replies
(:class:`EndpointRunner` plays them with the runner's ``collect`` contract). Episodes, seeds, task kwargs, context modes and the summary table
(success with a 95% Wilson interval, mean return with a normal 95% interval) are those of the
in-process path (:mod:`agents.evaluate`), and ``--save`` writes the project's records
(:class:`agents.record.Trajectory`, ``records.jsonl``), which ``python -m agents.view`` opens.

- Conversations follow the context mode as the runner builds prompts: ``window:k`` sends the
  instructions with the observation k turns back and the turns since, ``full`` the whole
  conversation. No system message is added (the model's chat template applies its default).
- Vision tasks send each observation's image as a PNG data URL (``image_url`` content parts,
  in place of the ``<image>`` placeholder).
- Every answer is read as hostile: a request, its whole answer included, ends within
  ``--request-timeout`` however the server paces it; the body is read as it arrives (chunked,
  gzip or deflate) and refused once it decodes past ``--max-response-bytes`` (16 MB); its
  JSON may nest at most 64 deep, and every field used is checked for its type (``logprob`` a
  finite number, ``usage`` counts non-negative integers, ...). Each is a malformed answer,
  retried as below, never a traceback.
- At most ``--concurrency`` episodes play at once. A request that times out, gets a 429 or a
  5xx, a malformed answer or a dropped connection is retried up to ``--max-retries`` times with
  exponential backoff (``Retry-After`` honoured); an episode that still cannot go on is recorded
  as failed (``Trajectory.failed``, the reason in ``info["error"]``) and left out of the rates,
  as an infrastructure fault is in-process. Any other 4xx stops the evaluation with the
  endpoint's message (a wrong model name or key would fail every episode alike); a 400 about
  the context length ends that episode as truncated.
- Log-probs: each reply's token log-probs are requested (``logprobs``); where the endpoint names
  token ids (vLLM with ``--token-ids``, which sends its ``return_tokens_as_token_ids``), each
  turn's reply becomes a :class:`~agents.record.Sample` (ids, loss mask 1, behaviour log-probs),
  as in-process records hold them; otherwise the tokens' text and log-probs are kept in
  ``info["reply_logprobs"]`` (one list of ``[token, logprob]`` per turn). Prompt ids are not
  known here (the endpoint renders the chat template).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import httpx
import numpy as np

from agents.record import Sample, Trajectory, Turn, episode_stats
from agents.rollout.seeds import request_seed
from envs.wire import ACCEPT_ENCODING, AnswerError, CappedBody, clip, loads_json

logger = logging.getLogger(__name__)

#: Statuses worth retrying: rate limits and server-side failures.
RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class EndpointError(RuntimeError):
    """The endpoint refused a request in a way retrying cannot fix (bad model, key, request)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RetriesExhausted(RuntimeError):
    """A request kept failing in retryable ways: the episode is recorded as failed."""


@dataclass
class Completion:
    """One reply of the endpoint."""

    text: str
    finished: bool  # ended by the model (False: cut by max_tokens)
    tokens: list[tuple[str, float]] | None = None  # (token text, log-prob), when returned
    token_ids: list[int] | None = None  # when the endpoint names ids ("token_id:N")
    usage: dict[str, int] = field(default_factory=dict)  # the counts of USAGE_KEYS the answer gave


def image_data_url(image: np.ndarray) -> str:
    """A uint8 (H, W, 3) image as a lossless PNG data URL."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(image, dtype=np.uint8), mode="RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def user_message(text: str, images: Sequence[np.ndarray] = ()) -> dict[str, Any]:
    """A user message: plain text, or text and ``image_url`` parts with each image where its
    ``<image>`` placeholder stands (images without a placeholder go first)."""
    from envs.base import IMAGE_PLACEHOLDER

    if not images:
        return {"role": "user", "content": text}
    pieces = text.split(IMAGE_PLACEHOLDER)
    urls = [image_data_url(im) for im in images]
    content: list[dict[str, Any]] = []
    extra = len(urls) - (len(pieces) - 1)
    for url in urls[:max(0, extra)]:
        content.append({"type": "image_url", "image_url": {"url": url}})
    urls = urls[max(0, extra):]
    for k, piece in enumerate(pieces):
        if piece:
            content.append({"type": "text", "text": piece})
        if k < len(pieces) - 1:
            if k < len(urls):
                content.append({"type": "image_url", "image_url": {"url": urls[k]}})
            else:
                content.append({"type": "text", "text": IMAGE_PLACEHOLDER})
    return {"role": "user", "content": content}


def _parse_token_id(token: str) -> int | None:
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[len("token_id:"):])
        except ValueError:
            return None
    return None


def _finite(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {clip(value, 60)}")
    return float(value)


#: The token counts read from an answer's ``usage`` (each a non-negative integer or absent).
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


def parse_completion(payload: Any) -> Completion:
    """The first choice of a chat-completions answer, every field it uses checked for its type;
    ``ValueError`` naming the field when one is malformed."""
    if not isinstance(payload, dict):
        raise ValueError(f"the answer is not a JSON object: {clip(payload)}")
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ValueError(f"no choices in the answer: {clip(payload)}")
    choice = choices[0]
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        raise ValueError(f"a choice without a message: {clip(choice)}")
    text = choice["message"].get("content")
    text = "" if text is None else text
    if not isinstance(text, str):
        raise ValueError(f"message content is not text: {clip(text)}")
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise ValueError(f"'finish_reason' must be a string or null, got {clip(finish, 60)}")
    tokens = ids = None
    lp = choice.get("logprobs")
    if lp is not None:
        if not isinstance(lp, dict):
            raise ValueError(f"'logprobs' must be an object or null, got {clip(lp, 60)}")
        content = lp.get("content")
        if content is not None:
            if not isinstance(content, list):
                raise ValueError(f"'logprobs.content' must be a list or null, got {clip(content, 60)}")
            tokens = []
            for k, item in enumerate(content):
                if not isinstance(item, dict):
                    raise ValueError(f"logprobs.content[{k}] must be an object, got {clip(item, 60)}")
                token = item.get("token")
                if not isinstance(token, str):
                    raise ValueError(f"logprobs.content[{k}].token must be a string, got {clip(token, 60)}")
                tokens.append((token, _finite(item.get("logprob"), f"logprobs.content[{k}].logprob")))
            parsed = [_parse_token_id(t) for t, _ in tokens]
            if tokens and all(p is not None for p in parsed):
                ids = [int(p) for p in parsed]  # type: ignore[arg-type]
    raw_usage = payload.get("usage")
    if raw_usage is not None and not isinstance(raw_usage, dict):
        raise ValueError(f"'usage' must be an object or null, got {clip(raw_usage, 60)}")
    usage: dict[str, int] = {}
    for key in USAGE_KEYS:
        value = (raw_usage or {}).get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**53:
            raise ValueError(f"usage.{key} must be a non-negative integer, got {clip(value, 60)}")
        usage[key] = value
    return Completion(text, finish != "length", tokens, ids, usage)


class ChatEndpoint:
    """An OpenAI-compatible ``/chat/completions`` endpoint with retries and timeouts."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, timeout: float = 120.0,
                 max_retries: int = 6, backoff: float = 0.5, max_backoff: float = 30.0, token_ids: bool = False,
                 logprobs: bool = True, max_connections: int = 64, max_response_bytes: int = 16 << 20) -> None:
        if not (timeout > 0 and math.isfinite(timeout)) or int(max_response_bytes) < 1024:
            raise ValueError("timeout must be a positive number of seconds and max_response_bytes >= 1024")
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.max_response_bytes = int(max_response_bytes)
        self.model = model
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.token_ids = bool(token_ids)
        self.logprobs = bool(logprobs)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout, connect=min(timeout, 30.0))
        self._limits = httpx.Limits(max_connections=max_connections)
        self._client: httpx.AsyncClient | None = None
        self.retries = 0  # retried requests, for the summary

    def open(self) -> None:
        """Start the connection pool (inside the event loop that will use it)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout, headers=self._headers, limits=self._limits)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        if retry_after:
            try:
                return min(self.max_backoff, max(0.0, float(retry_after)))
            except ValueError:
                pass
        return min(self.max_backoff, self.backoff * 2 ** attempt) * (0.5 + random.random() / 2)

    async def _post(self, url: str, body: dict[str, Any]) -> tuple[int, httpx.Headers, bytes]:
        """One request: the status, the headers and the decoded body, read as it arrives and
        refused (:class:`AnswerError`) once it passes ``max_response_bytes``."""
        assert self._client is not None
        async with self._client.stream("POST", url, json=body, headers={"Accept-Encoding": ACCEPT_ENCODING}) as resp:
            cap = self.max_response_bytes if resp.status_code == 200 else min(self.max_response_bytes, 1 << 20)
            length = resp.headers.get("content-length", "")
            if length.isdigit() and int(length) > cap:
                raise AnswerError(f"the answer announces {clip(length, 30)} bytes, more than {cap} "
                                  "(max_response_bytes)")
            reader = CappedBody(resp.headers.get("content-encoding"), cap)
            async for chunk in resp.aiter_raw():
                reader.feed(chunk)
            return resp.status_code, resp.headers, reader.finish()

    async def complete(self, messages: list[dict[str, Any]], *, max_tokens: int, temperature: float,
                       seed: int | None = None) -> Completion:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": int(max_tokens),
                                "temperature": float(temperature), "n": 1}
        if seed is not None:
            body["seed"] = int(seed)
        if self.logprobs:
            body["logprobs"] = True
        if self.token_ids:
            body["return_tokens_as_token_ids"] = True
        url = self.base_url + "/chat/completions"
        last = ""
        for attempt in range(self.max_retries + 1):
            retry_after = None
            self.open()
            try:  # the whole request, answer included, within the timeout however the server paces it
                status, headers, raw = await asyncio.wait_for(self._post(url, body), self.timeout)
            except asyncio.TimeoutError:
                last = f"no complete answer within {self.timeout:g} s (the request timeout)"
            except httpx.TimeoutException as exc:
                last = f"timed out ({type(exc).__name__})"
            except httpx.TransportError as exc:  # refused, reset, dropped mid-answer
                last = f"connection failed ({type(exc).__name__}: {clip(str(exc), 200)})"
            except AnswerError as exc:  # too large, or an encoding it cannot be
                last = f"malformed answer ({exc})"
            else:
                text = raw[:500].decode("utf-8", errors="replace")
                if status == 200:
                    try:
                        return parse_completion(loads_json(raw, what="the answer"))
                    except ValueError as exc:  # not JSON, nested too deeply, a field of the wrong type
                        last = f"malformed answer ({exc})"
                elif status in RETRY_STATUSES or status >= 500:
                    last = f"HTTP {status}: {text[:200]}"
                    retry_after = headers.get("retry-after")
                else:
                    raise EndpointError(f"{url} answered {status}: {text}", status)
            if attempt < self.max_retries:
                self.retries += 1
                logger.info("request failed (%s); retry %d of %d", last, attempt + 1, self.max_retries)
                await asyncio.sleep(self._delay(attempt, retry_after))
        raise RetriesExhausted(f"{url}: {last}, after {self.max_retries} retries")


@dataclass
class EndpointSettings:
    """How episodes are played against an endpoint (the runner's settings, plus the request's)."""

    env_id: str
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    context: str = "window:0"
    max_new_tokens: int = 16
    temperature: float = 1.0
    greedy: bool = False


def _messages(window: int | None, instructions: str, observations: list[str], replies: list[str],
              images: list[list[np.ndarray]]) -> list[dict[str, Any]]:
    """The conversation of turn ``t = len(replies)``, as the runner builds its prompt."""
    t = len(replies)
    start = 0 if window is None or t <= window else t - window
    first = observations[0] if start == 0 else f"{instructions}\n\n{observations[start]}"
    out = [user_message(first, images[start])]
    for j in range(start, t):
        out.append({"role": "assistant", "content": replies[j]})
        out.append(user_message(observations[j + 1], images[j + 1]))
    return out


async def play_episode(endpoint: ChatEndpoint, settings: EndpointSettings, seed: int, group_id: int,
                       rng_seed: int) -> Trajectory:
    """One episode on task seed ``seed``; faults make a failed record, never an exception
    (except :class:`EndpointError`, which no retry fixes)."""
    import envs
    from agents.rollout.runner import parse_context

    window = parse_context(settings.context)
    vision = envs.task_spec(settings.env_id).modality == "vision"
    env = await asyncio.to_thread(envs.make, settings.env_id, **settings.env_kwargs)
    turns: list[Turn] = []
    samples: list[Sample] = []
    reply_logprobs: list[list[list[Any]] | None] = []
    observations: list[str] = []
    obs_images: list[list[np.ndarray]] = []
    images: list[np.ndarray] = []
    episode_return, success, truncated, failed = 0.0, False, False, False
    end_reason, error, usage = "", "", {"prompt_tokens": 0, "completion_tokens": 0}
    try:
        obs, info = await asyncio.to_thread(env.reset, seed=int(seed))
        instructions = info.get("instructions", "")

        def observe(o: dict[str, Any]) -> None:
            observations.append(o["text"])
            imgs = [np.array(o["image"], dtype=np.uint8, copy=True)] if vision and o.get("image") is not None else []
            obs_images.append(imgs)
            images.extend(imgs)

        observe(obs)
        while True:
            messages = _messages(window, instructions, observations, [t.reply for t in turns], obs_images)
            try:
                done = await endpoint.complete(
                    messages, max_tokens=settings.max_new_tokens,
                    temperature=0.0 if settings.greedy else settings.temperature,
                    seed=request_seed(rng_seed, seed, len(turns)))
            except RetriesExhausted as exc:
                failed, end_reason, error = True, "failed", str(exc)
                break
            except EndpointError as exc:
                if exc.status == 400 and "context" in str(exc).lower():
                    truncated, end_reason = True, "context budget"
                    break
                raise
            for k in usage:
                usage[k] += done.usage.get(k, 0)
            if done.token_ids is not None:
                samples.append(Sample(done.token_ids, [1] * len(done.token_ids), [lp for _, lp in done.tokens or []]))
            reply_logprobs.append([[tok, lp] for tok, lp in done.tokens] if done.tokens is not None else None)
            image_index = len(images) - len(obs_images[-1]) if obs_images[-1] else None
            obs_text = observations[-1]
            obs, reward, terminated, trunc, info = await asyncio.to_thread(env.step, done.text)
            turns.append(Turn(obs_text, done.text, float(reward), bool(info.get("action_is_valid", True)), image_index))
            episode_return += float(reward)
            success = bool(info.get("success", False))
            if info.get("failed"):
                failed, end_reason, error = True, "failed", str(info.get("error", "the task reported a fault"))
                break
            if terminated or trunc:
                truncated = bool(trunc and not terminated)
                end_reason = "terminated" if terminated else "turn limit"
                break
            observe(obs)
        extra: dict[str, Any] = {"end_reason": end_reason, "final_observation": obs.get("text", ""),
                                 "model": endpoint.model, "base_url": endpoint.base_url, "usage": usage}
        if vision and obs.get("image") is not None and len(observations) == len(turns):  # the final frame, for GIFs
            images.append(np.array(obs["image"], dtype=np.uint8, copy=True))
            extra["final_image_index"] = len(images) - 1
    finally:
        await asyncio.to_thread(env.close)
    if samples and len(samples) != len(turns):
        samples = []  # some turns came without ids: keep the text view only
    if not samples and any(r is not None for r in reply_logprobs):
        extra["reply_logprobs"] = reply_logprobs
    if error:
        extra["error"] = error
    return Trajectory(env_id=settings.env_id, seed=int(seed), group_id=group_id, turns=turns, samples=samples,
                      episode_return=episode_return, success=success, policy_version=-1, context=settings.context,
                      images=images, truncated=truncated, failed=failed, info=extra)


class EndpointRunner:
    """Plays episodes against an endpoint with the runner's ``collect`` contract, so
    :func:`agents.evaluate.evaluate` (``runner=``) summarises them as it does in-process ones."""

    def __init__(self, endpoint: ChatEndpoint, env_id: str, *, env_kwargs: dict[str, Any] | None = None,
                 context: str = "window:0", max_new_tokens: int = 16, temperature: float = 1.0,
                 concurrency: int = 8) -> None:
        from agents.rollout.runner import parse_context

        parse_context(context)  # a bad context fails before any request
        self.endpoint = endpoint
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        self.context = context
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.concurrency = max(1, int(concurrency))
        self._next_group = 0

    def collect(self, seeds: Sequence[int], *, policy_version: int = -1, greedy: bool = False, progress: bool = False,
                rng_seed: int | None = None, **_: Any) -> tuple[list[Trajectory], dict[str, Any]]:
        settings = EndpointSettings(self.env_id, self.env_kwargs, self.context, self.max_new_tokens,
                                    self.temperature, greedy)
        t0 = time.perf_counter()
        records = asyncio.run(self._collect(settings, list(seeds), int(rng_seed or 0), progress))
        for rec in records:
            rec.policy_version = int(policy_version)
        stats: dict[str, Any] = {**episode_stats(records), "wall_s": time.perf_counter() - t0,
                                 "retries": self.endpoint.retries}
        return records, stats

    async def _collect(self, settings: EndpointSettings, seeds: list[int], rng_seed: int,
                       progress: bool) -> list[Trajectory]:
        slots = asyncio.Semaphore(self.concurrency)
        first, done = self._next_group, 0
        self._next_group += len(seeds)

        async def one(i: int, seed: int) -> Trajectory:
            nonlocal done
            async with slots:
                rec = await play_episode(self.endpoint, settings, seed, first + i, rng_seed)
            done += 1
            if progress and (done % 10 == 0 or done == len(seeds)):
                print(f"  {done}/{len(seeds)} episodes", file=sys.stderr, flush=True)
            return rec

        tasks = [asyncio.create_task(one(i, s)) for i, s in enumerate(seeds)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            await self.endpoint.aclose()

    def close(self) -> None:
        pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The endpoint's flags (``python -m agents.evaluate --base-url ...``)."""
    parser.add_argument("--base-url", required=True, help="the endpoint's base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key-env", default=None, metavar="VAR",
                        help="environment variable holding the API key (default: OPENAI_API_KEY if set, else none)")
    parser.add_argument("--concurrency", type=int, default=8, help="episodes in flight at once")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="seconds a request may take, its whole answer included")
    parser.add_argument("--max-response-bytes", type=int, default=16 << 20,
                        help="largest answer read (decoded); a larger one is refused while it is read")
    parser.add_argument("--max-retries", type=int, default=6, help="retries of a request (429, 5xx, timeouts, ...)")
    parser.add_argument("--token-ids", action="store_true",
                        help="ask for token ids with the log-probs (vLLM's return_tokens_as_token_ids)")
    parser.add_argument("--no-logprobs", action="store_true", help="do not ask for log-probs")


def endpoint_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ChatEndpoint:
    """The endpoint the parsed flags name (the API key read from ``--api-key-env``)."""
    if args.episodes < 1 or args.concurrency < 1 or args.max_retries < 0 or not 0 < args.request_timeout < math.inf:
        parser.error("--episodes and --concurrency must be >= 1, --max-retries >= 0, --request-timeout > 0")
    if args.max_response_bytes < 1024:
        parser.error("--max-response-bytes must be >= 1024")
    if not args.model:
        parser.error("--base-url needs --model NAME: the model name the endpoint serves")
    key_var = args.api_key_env or ("OPENAI_API_KEY" if os.environ.get("OPENAI_API_KEY") else None)
    api_key = os.environ.get(key_var) if key_var else None
    if args.api_key_env and not api_key:
        parser.error(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return ChatEndpoint(args.base_url, args.model, api_key=api_key, timeout=args.request_timeout,
                        max_retries=args.max_retries, token_ids=args.token_ids, logprobs=not args.no_logprobs,
                        max_connections=args.concurrency, max_response_bytes=args.max_response_bytes)


def endpoint_summary(args: argparse.Namespace, env_kwargs: dict[str, Any], result: Any) -> dict[str, Any]:
    """What ``--save`` writes beside the records (``endpoint.json``)."""
    return {"base_url": args.base_url, "model": args.model, "env_id": args.env, "env_kwargs": env_kwargs,
            "context": args.context, "episodes": args.episodes, "seed": args.seed, "greedy": args.greedy,
            "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
            "success_rate": result.success_rate, "success_ci": list(result.success_ci),
            "mean_return": result.mean_return, "failed": result.stats.get("failed", 0)}
