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
- :class:`KeepAlive` is one persistent connection whose requests each end within a deadline,
  answers parsed as HTTP/1.x by :class:`_Answer` (``Content-Length``, ``chunked`` or
  close-delimited bodies) and read through :class:`CappedBody`.
- :func:`deadline_client` is an ``httpx.Client`` whose requests run under
  :func:`deadline`: every connect, write and read waits at most what is left of one deadline
  for the whole request, so a server trickling a byte a second cannot hold a request past it
  (an httpx timeout is per read).
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
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
    """``value`` (lists and dicts as JSON decodes them) if they nest at most ``max_depth``
    deep, checked a level at a time without recursion; else :class:`AnswerError`."""
    level = [value] if type(value) is dict or type(value) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            raise AnswerError(f"{what} nests deeper than {max_depth} levels")
        deeper = []
        for item in level:
            for child in (item.values() if type(item) is dict else item):
                if type(child) is dict or type(child) is list:
                    deeper.append(child)
        level = deeper
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


# -- one keep-alive connection under a deadline -------------------------------------------------
class Unreachable(ConnectionError):
    """The server could not be connected to (refused, no route, the name unknown, connect timeout)."""


class TooLate(TimeoutError):
    """The request, its whole answer included, did not end within its deadline."""


class Broken(ConnectionError):
    """The connection failed mid-request (dropped, reset, or a garbled answer)."""


#: Bytes an answer's status line and headers may hold.
MAX_HEAD_BYTES = 64 << 10
#: Bytes of one chunk-size line (with its extensions) or trailer line.
_MAX_LINE = 8 << 10


class _Answer:
    """One HTTP/1.x answer read off a socket: the status line and headers, then the body as
    raw chunks (``Content-Length``, ``chunked`` or, without either, up to the connection's end),
    every read waiting at most what is left until ``end`` (monotonic seconds). The head is at
    most :data:`MAX_HEAD_BYTES`; anything that is not HTTP/1.x is :class:`Broken`."""

    __slots__ = ("_sock", "end", "_buf", "status", "headers", "will_close", "_mode", "_left")

    def __init__(self, sock: socket.socket, end: float, method: str) -> None:
        self._sock, self.end, self._buf = sock, end, b""
        while True:  # informational answers (100 Continue, 103 Early Hints) come before the real one
            self._read_head()
            if not 100 <= self.status < 200 or self.status == 101:
                break
        headers = self.headers
        version_close = self.will_close
        connection = headers.get("connection", "").lower()
        self.will_close = "close" in connection or (version_close and "keep-alive" not in connection)
        coding = headers.get("transfer-encoding")
        length = headers.get("content-length")
        if method == "HEAD" or self.status in (101, 204, 304):
            self._mode, self._left = "none", 0
        elif coding is not None:
            if coding.lower().rsplit(",", 1)[-1].strip() != "chunked":
                raise Broken(f"the answer's Transfer-Encoding {clip(coding, 40)!r} is not chunked")
            self._mode, self._left = "chunked", 0
        elif length is not None:
            values = {v.strip() for v in length.split(",")}
            value = values.pop() if len(values) == 1 else ""
            if not value.isdigit() or not value.isascii():
                raise Broken(f"the answer's Content-Length {clip(length, 40)!r} is not a number")
            self._mode, self._left = "length", int(value)
        else:
            self._mode, self._left = "eof", 0
            self.will_close = True

    def _fill(self) -> bytes:
        """The next bytes from the socket (``b""`` once the server has closed it)."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise TooLate("the request's deadline passed")
        self._sock.settimeout(left)
        try:
            return self._sock.recv(1 << 16)
        except (socket.timeout, TimeoutError):
            raise TooLate("the request's deadline passed") from None

    def _read_head(self) -> None:
        buf = self._buf
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                head, self._buf = buf[:end], buf[end + 4:]
                break
            end = buf.find(b"\n\n")  # bare line feeds, as lenient parsers accept
            if end >= 0:
                head, self._buf = buf[:end], buf[end + 2:]
                break
            if len(buf) > MAX_HEAD_BYTES:
                raise Broken(f"the answer's status line and headers exceed {MAX_HEAD_BYTES} bytes")
            more = self._fill()
            if not more:
                raise Broken("the server closed the connection before answering" if not buf
                             else "the server closed the connection mid-answer")
            buf += more
        if len(head) > MAX_HEAD_BYTES:
            raise Broken(f"the answer's status line and headers exceed {MAX_HEAD_BYTES} bytes")
        lines = head.split(b"\n")
        parts = lines[0].rstrip(b"\r").split(None, 2)
        if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0") or len(parts[1]) != 3 \
                or not parts[1].isdigit():
            raise Broken(f"not an HTTP/1.x status line: {clip(lines[0][:100].decode('latin-1'))!r}")
        self.status = int(parts[1])
        self.will_close = parts[0] == b"HTTP/1.0"
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise Broken(f"a malformed header line: {clip(line[:100].decode('latin-1'))!r}")
            key = name.decode("latin-1").lower()
            text = value.strip().decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        self.headers = headers

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(b"\n")
            if end >= 0:
                line, self._buf = self._buf[:end], self._buf[end + 1:]
                return line.rstrip(b"\r")
            if len(self._buf) > _MAX_LINE:
                raise Broken("a chunk-size line of the answer is too long")
            more = self._fill()
            if not more:
                raise Broken("the server closed the connection mid-answer")
            self._buf += more

    def _take(self, n: int) -> Iterator[bytes]:
        """``n`` bytes of the body, as they arrive."""
        while n > 0:
            if not self._buf:
                self._buf = self._fill()
                if not self._buf:
                    raise Broken("the server closed the connection mid-answer")
            piece, self._buf = self._buf[:n], self._buf[n:]
            n -= len(piece)
            yield piece

    def chunks(self) -> Iterator[bytes]:
        """The body's raw bytes (still content-encoded), as they arrive."""
        mode = self._mode
        if mode == "length":
            yield from self._take(self._left)
        elif mode == "chunked":
            while True:
                line = self._line()
                size = line.split(b";", 1)[0].strip()
                try:
                    n = int(size, 16)
                    if n < 0 or size[:1] in (b"+", b"-") or b"_" in size:
                        raise ValueError
                except ValueError:
                    raise Broken(f"a malformed chunk size {clip(line[:40].decode('latin-1'))!r}") from None
                if n == 0:
                    while self._line():  # trailers, up to the blank line
                        pass
                    return
                yield from self._take(n)
                if self._line():
                    raise Broken("a chunk of the answer is longer than its size")
        elif mode == "eof":
            if self._buf:
                piece, self._buf = self._buf, b""
                yield piece
            while True:
                piece = self._fill()
                if not piece:
                    return
                yield piece
        if self._buf and not self.will_close:  # bytes nobody asked for: the connection cannot be reused
            self.will_close = True


class KeepAlive:
    """One persistent HTTP/1.1 connection to an ``http://host:port`` (or ``https://``) server, opened on first use
    and again whenever the server has closed it. :meth:`request` sends a request and reads its
    whole answer within ``timeout`` seconds however the server paces it (connect, write and every
    read wait at most what is left), decoding the body as it arrives and refusing it past ``cap``
    bytes. Faults are :class:`Unreachable`, :class:`TooLate`, :class:`Broken` or an
    :class:`AnswerError`; after any of them the connection is dropped. One request at a time
    (a lock); ``close()`` from any thread."""

    def __init__(self, url: str, *, connect_timeout: float = 10.0) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the url must be http://host:port or https://host:port, got {clip(url, 100)!r}")
        self.tls = parts.scheme == "https"
        default = 443 if self.tls else 80
        self.host, self.port = parts.hostname, parts.port or default
        self.prefix = parts.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._host_header = (host if self.port == default else f"{host}:{self.port}").encode("ascii", "replace")
        self.connect_timeout = float(connect_timeout)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _connect(self, end: float) -> socket.socket:
        left = end - time.monotonic()
        if left <= 0:
            raise TooLate("the request's deadline passed")
        try:
            sock = socket.create_connection((self.host, self.port), timeout=min(left, self.connect_timeout))
        except (socket.timeout, TimeoutError) as exc:
            raise Unreachable(f"connecting timed out ({exc})") from None
        except OSError as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls:
            import ssl

            try:
                sock.settimeout(max(0.001, end - time.monotonic()))
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
            except (OSError, ssl.SSLError) as exc:
                sock.close()
                raise Unreachable(f"the TLS handshake failed ({type(exc).__name__}: {clip(str(exc))})") from None
        return sock

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        self._drop()

    def request(self, method: str, path: str, body: bytes | None = None, *, timeout: float, cap: int,
                content_type: str = "application/json") -> tuple[int, bytes]:
        """``(status, decoded body)`` of one request (``path`` below the url's)."""
        import select

        end = time.monotonic() + float(timeout)
        head = [b"%s %s HTTP/1.1\r\nHost: %s\r\nAccept-Encoding: %s\r\n"
                % (method.encode("ascii"), (self.prefix + path).encode("utf-8"), self._host_header,
                   ACCEPT_ENCODING.encode("ascii"))]
        if body is not None:
            head.append(b"Content-Type: %s\r\nContent-Length: %d\r\n" % (content_type.encode("ascii"), len(body)))
        head.append(b"\r\n")
        data = b"".join(head) + (body or b"")
        with self._lock:
            sock = self._sock
            if sock is not None and select.select([sock], [], [], 0)[0]:
                self._drop()  # closed by the server while idle (or it sent what was not asked for)
                sock = None
            if sock is None:
                sock = self._sock = self._connect(end)
            try:
                left = end - time.monotonic()
                if left <= 0:
                    raise TooLate("the request's deadline passed")
                sock.settimeout(left)
                try:
                    sock.sendall(data)
                except (socket.timeout, TimeoutError):
                    raise TooLate("the request's deadline passed") from None
                answer = _Answer(sock, end, method)
                if answer._mode == "length" and answer._left > cap:
                    raise AnswerError(f"the answer is {answer._left} bytes, above the limit of {cap} bytes")
                decoded = CappedBody(answer.headers.get("content-encoding"), cap, "the answer")
                for chunk in answer.chunks():
                    decoded.feed(chunk)
                raw = decoded.finish()
                if answer.will_close:
                    self._drop()
                return answer.status, raw
            except (AnswerError, TooLate, Broken):
                self._drop()
                raise
            except OSError as exc:
                self._drop()
                raise Broken(f"{type(exc).__name__}: {clip(str(exc))}") from None
            except BaseException:
                self._drop()
                raise
