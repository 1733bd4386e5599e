"""Reading answers from a server that may be hostile: bodies capped while they are decoded,
JSON bounded in depth, a wall-clock deadline over a whole request.

Used by the task server's client (:mod:`envs.remote`) and the endpoint evaluator
(``agents.rollout.openai_eval``). Every way an answer can be unusable is an
:class:`AnswerError` whose message says why; nothing else escapes these helpers.

- :class:`CappedBody` decodes ``identity``, ``gzip`` and ``deflate`` bodies itself, chunk by
  chunk as they arrive, with the output of every decompression step bounded: a body whose
  decoded size passes the cap is refused there, whether it was announced, chunked or a
  compression bomb, so no more than the cap is ever held.
- :func:`loads_json` refuses JSON nested deeper than ``max_depth``, non-standard constants
  (``NaN``, ``Infinity``), numbers that overflow a float (``1e400``) and integers of thousands
  of digits.
- :func:`deadline_client` is an ``httpx.Client`` whose requests run under
  :func:`deadline`: every connect, write and read waits at most what is left of one deadline
  for the whole request, so a server trickling a byte a second cannot hold a request past it
  (an httpx timeout is per read).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
import zlib
from typing import Any, Iterator

#: Depth of nested lists and objects an answer may have.
MAX_DEPTH = 64
#: What clients accept as the body's encoding (what :class:`CappedBody` can decode).
ACCEPT_ENCODING = "gzip, deflate"


class AnswerError(ValueError):
    """An answer that cannot be used (too large, too late, not JSON, the wrong shape)."""


def clip(value: Any, n: int = 200) -> str:
    """``value`` as text of at most ``n`` characters (a server's text is quoted, never echoed whole)."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= n else text[:n] + "..."


class CappedBody:
    """A response body decoded as its raw chunks arrive (:meth:`feed`), refused with an
    :class:`AnswerError` as soon as its decoded size passes ``cap`` bytes."""

    def __init__(self, content_encoding: str | None, cap: int, what: str = "the answer") -> None:
        self.cap, self.what = int(cap), what
        encoding = (content_encoding or "identity").strip().lower()
        if encoding not in ("identity", "gzip", "x-gzip", "deflate", ""):
            raise AnswerError(f"{what} is encoded as {clip(encoding, 40)!r}, which is not one asked for "
                              f"({ACCEPT_ENCODING})")
        self._encoding = encoding
        self._decoder: Any = None
        if encoding in ("gzip", "x-gzip"):
            self._decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self._decoder = zlib.decompressobj()
        self._first = True
        self._parts: list[bytes] = []
        self.size = 0
        self.raw_size = 0

    def _keep(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.cap:
            self._parts.clear()
            raise AnswerError(f"{self.what} is larger than {self.cap} bytes (decoded); refused while reading it")
        if data:
            self._parts.append(data)

    def feed(self, raw: bytes) -> None:
        self.raw_size += len(raw)
        if self.raw_size > self.cap:
            self._parts.clear()
            raise AnswerError(f"{self.what} is larger than {self.cap} bytes; refused while reading it")
        if self._decoder is None:
            self._keep(raw)
            return
        if self._decoder.eof:  # bytes after the end of the compressed stream are ignored
            return
        data = raw
        while data:
            try:
                out = self._decoder.decompress(data, self.cap - self.size + 1)
            except zlib.error as exc:
                if self._first and self._encoding == "deflate":  # a raw deflate stream (no zlib header)
                    self._decoder, self._first = zlib.decompressobj(-zlib.MAX_WBITS), False
                    continue
                raise AnswerError(f"{self.what} is not valid {self._encoding} data ({exc})") from None
            self._first = False
            self._keep(out)
            data = self._decoder.unconsumed_tail
            if self._decoder.eof:
                break

    def finish(self) -> bytes:
        if self._decoder is not None and not self._decoder.eof and self.size:
            with contextlib.suppress(zlib.error):
                self._keep(self._decoder.flush(self.cap - self.size + 1))
        return b"".join(self._parts)


def read_capped(chunks: Iterator[bytes], content_encoding: str | None, cap: int, what: str = "the answer") -> bytes:
    """The decoded body of an iterator of raw chunks (``httpx.Response.iter_raw()``), capped."""
    body = CappedBody(content_encoding, cap, what)
    for chunk in chunks:
        body.feed(chunk)
    return body.finish()


def _refuse_constant(name: str) -> Any:
    raise AnswerError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise AnswerError(f"the number {clip(text, 40)} does not fit a float")
    return value


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


def check_depth(value: Any, max_depth: int = MAX_DEPTH, what: str = "the answer") -> Any:
    """``value`` if its lists and objects nest at most ``max_depth`` deep (checked without
    recursion), else :class:`AnswerError`."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            raise AnswerError(f"{what} nests deeper than {max_depth} levels")
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return value


def loads_json(raw: bytes | str, *, what: str = "the answer", max_depth: int = MAX_DEPTH) -> Any:
    """``raw`` parsed as strict JSON bounded in depth; any failure an :class:`AnswerError`."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        value = _DECODER.decode(text)
    except AnswerError as exc:
        raise AnswerError(f"{what} cannot be read: {exc}") from None
    except UnicodeDecodeError:
        raise AnswerError(f"{what} is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise AnswerError(f"{what} is not JSON ({exc.msg} at character {exc.pos}): {clip(exc.doc[:200])}") from None
    except RecursionError:
        raise AnswerError(f"{what} nests deeper than {max_depth} levels") from None
    except (ValueError, TypeError, OverflowError, MemoryError) as exc:  # e.g. an integer of 5,000 digits
        raise AnswerError(f"{what} cannot be read as JSON ({clip(str(exc), 120)})") from None
    if isinstance(value, (dict, list)) and text.count("[") + text.count("{") > max_depth:
        check_depth(value, max_depth, what)  # only text with that many brackets can nest that deep
    return value


# -- a deadline over a whole request (sync httpx) ------------------------------------------------
_local = threading.local()


class deadline:  # noqa: N801 (used as a function: ``with deadline(5):``)
    """Requests of a :func:`deadline_client` made in this block (this thread) end within
    ``seconds`` from now, however the server paces its answer."""

    __slots__ = ("_end", "_previous")

    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + float(seconds)

    def __enter__(self) -> None:
        self._previous = getattr(_local, "deadline", None)
        _local.deadline = self._end

    def __exit__(self, *exc: Any) -> None:
        _local.deadline = self._previous


def _left(timeout: float | None, error: type[Exception]) -> float | None:
    end = getattr(_local, "deadline", None)
    if end is None:
        return timeout
    left = end - time.monotonic()
    if left <= 0:
        raise error("the request's deadline passed")
    return left if timeout is None else min(timeout, left)


def _backend() -> Any:
    import httpcore

    class Stream(httpcore.NetworkStream):
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            return self._inner.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

        def write(self, buffer: bytes, timeout: float | None = None) -> None:
            self._inner.write(buffer, _left(timeout, httpcore.WriteTimeout))

        def close(self) -> None:
            self._inner.close()

        def start_tls(self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None) -> Any:
            return Stream(self._inner.start_tls(ssl_context, server_hostname, _left(timeout, httpcore.ConnectTimeout)))

        def get_extra_info(self, info: str) -> Any:
            return self._inner.get_extra_info(info)

    class Backend(httpcore.NetworkBackend):
        def __init__(self) -> None:
            self._inner = httpcore.SyncBackend()

        def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                        socket_options: Any = None) -> Any:
            return Stream(self._inner.connect_tcp(host, port, _left(timeout, httpcore.ConnectTimeout), local_address,
                                                  socket_options))

        def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> Any:
            return Stream(self._inner.connect_unix_socket(path, _left(timeout, httpcore.ConnectTimeout),
                                                          socket_options))

        def sleep(self, seconds: float) -> None:
            self._inner.sleep(seconds)

    return Backend()


def deadline_client(**kwargs: Any) -> Any:
    """An ``httpx.Client`` (``kwargs`` are its own) whose every socket operation waits at most
    what is left of the :func:`deadline` in force, so a request under one ends by it."""
    import httpx

    transport = httpx.HTTPTransport()
    pool = getattr(transport, "_pool", None)
    if pool is None or not hasattr(pool, "_network_backend"):  # an httpx/httpcore without the seam
        raise RuntimeError("this httpx cannot take a deadline over a whole request; "
                           "install httpx>=0.25 with httpcore>=1.0")
    pool._network_backend = _backend()
    return httpx.Client(transport=transport, **kwargs)
