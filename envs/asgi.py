"""One small lifecycle for the project's HTTP services: an ASGI app on uvicorn, hardened.

Used by the task server (:mod:`envs.serve`) and the retrieval server (:mod:`envs.search.server`).
:class:`HTTPServer` binds its socket when it is made (port 0: a free one, known at once as
:attr:`HTTPServer.url`), serves on uvicorn (httptools' parser, uvloop where installed) in the
thread that calls :meth:`HTTPServer.serve_forever` or in its own (:meth:`HTTPServer.start`, which
returns once requests are answered), and stops with :meth:`HTTPServer.shutdown` and
:meth:`HTTPServer.server_close`. :func:`serve_until_signal` is the commands' main loop: serve
until SIGTERM or SIGINT, then stop cleanly.

What uvicorn leaves open is bounded at the connection (:class:`Limits`):

- a request must arrive, from its first byte to its last (request line, headers and body,
  however it is paced), within ``request_timeout`` seconds: past it the client gets a 408 and
  the connection is closed; a connection may stay idle, before its first request or between
  requests, as long;
- the request line and headers together may hold ``max_head_bytes`` (a 431 past them);
- at most ``max_connections`` connections are open: for a new one past the limit the
  longest-idle connection is closed, or, when every one is mid-request, the new one is
  answered 503 (``Retry-After: 1``) and closed.

Every refusal is a JSON object ``{"error": "..."}``. What a request may hold once it has
arrived is the app's to check; :func:`read_body` reads a body with its size capped (411 without
a Content-Length, 413 past the cap) and :func:`send_json` answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What a connection may do before the app sees its request."""

    #: Seconds a request may take to arrive, first byte to last, and a connection may stay idle.
    request_timeout: float = 30.0
    #: Open connections at most.
    max_connections: int = 256
    #: Bytes of request line and headers at most.
    max_head_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.max_head_bytes < 1024:
            raise ValueError(f"max_head_bytes must be >= 1024, got {self.max_head_bytes}")


def raw_response(status: int, reason: str, message: str, *, retry_after: bool = False) -> bytes:
    """A complete HTTP/1.1 answer ``{"error": message}`` that closes the connection."""
    data = json.dumps({"error": message}).encode()
    extra = b"Retry-After: 1\r\n" if retry_after else b""
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (status, reason.encode(), extra, len(data), data))


class Refused(Exception):
    """A request an app refuses: the HTTP status, a message for the client, and whether the
    connection is closed after the answer (the rest of the request left unread)."""

    def __init__(self, status: int, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.close = status, close


async def read_body(scope: dict[str, Any], receive: Any, limit: int, *, drain: int, what: str = "message",
                    optional: bool = False) -> bytes | None:
    """The body of an HTTP request, at most ``limit`` bytes, or ``None`` if the client left
    (or its request did not arrive in time: the connection answered the 408). It must come with
    a Content-Length (a :class:`Refused` 411 otherwise, unless ``optional`` and the request has
    no body at all); a larger one is a 413, read away first when at most ``drain`` bytes, so
    the client sees the answer."""
    length_header = chunked = None
    for name, value in scope["headers"]:
        if name == b"content-length":
            length_header = value
        elif name == b"transfer-encoding":
            chunked = value
    if length_header is None:
        if optional and chunked is None:
            return b""
        raise Refused(411, "a Content-Length header is required (chunked bodies are not accepted)", close=True)
    try:
        length = int(length_header)
        if length < 0:
            raise ValueError
    except ValueError:
        shown = length_header[:40].decode("latin-1")
        raise Refused(400, f"invalid Content-Length {shown!r}", close=True) from None
    if length > limit:
        if length <= drain:
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return None
                if not message.get("more_body"):
                    break
        raise Refused(413, f"{what} of {length} bytes exceeds the server's limit of {limit} bytes", close=True)
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


def parse_json(raw: bytes) -> Any:
    """A request body's JSON value; ``ValueError`` with what the client is told (a 400) when the
    body is not UTF-8 JSON, nests too deeply or holds what JSON cannot read (an integer of
    thousands of digits)."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"the body is not valid UTF-8 JSON: {err}") from None
    except RecursionError:
        raise ValueError("the body's JSON is nested too deeply") from None
    except ValueError as err:
        raise ValueError(f"the body's JSON cannot be read: {err}") from None


async def send_json(send: Any, status: int, data: bytes, *, close: bool = False) -> None:
    """An answer of JSON ``data`` (a 503 says ``Retry-After: 1``; ``close`` ends the connection)."""
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class _Gate:
    """The connections of one server: how many are open and which wait idle, longest first."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.open = 0
        self.idle: dict[Any, None] = {}
        self.refused = self.evicted = 0


def _protocol_class(gate: _Gate) -> type:
    """uvicorn's httptools protocol with the request deadline, the head cap and the connection
    limit of ``gate`` (one class per server: the gate is its class attribute)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    limits = gate.limits

    class GuardedProtocol(HttpToolsProtocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            self._deadline: Any = None
            self._counted = self._reading_head = False
            self._head_bytes = 0
            super().connection_made(transport)
            if gate.open >= limits.max_connections:
                if not gate.idle:
                    gate.refused += 1
                    transport.write(raw_response(
                        503, "Service Unavailable", f"the server holds its limit of {limits.max_connections} "
                        "connections, all busy; retry shortly", retry_after=True))
                    transport.close()
                    return
                victim = next(iter(gate.idle))  # the longest idle one makes room
                gate.evicted += 1
                victim._uncount()
                victim.transport.close()
            gate.open += 1
            self._counted = True
            self._set_idle(True)
            self.timeout_keep_alive_task = self.loop.call_later(limits.request_timeout, self.timeout_keep_alive_handler)

        def _uncount(self) -> None:
            gate.idle.pop(self, None)
            if self._counted:
                self._counted = False
                gate.open -= 1

        def _set_idle(self, idle: bool) -> None:
            if idle:
                gate.idle[self] = None
            else:
                gate.idle.pop(self, None)

        def connection_lost(self, exc: Exception | None) -> None:
            self._uncount()
            self._stop_deadline()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self._counted or self.transport.is_closing():
                return
            self._set_idle(False)
            super().data_received(data)
            if self._reading_head:
                self._head_bytes += len(data)
                if self._head_bytes > limits.max_head_bytes and not self.transport.is_closing():
                    self._refuse(431, "Request Header Fields Too Large",
                                 f"the request line and headers exceed {limits.max_head_bytes} bytes")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._reading_head, self._head_bytes = True, 0
            self._stop_deadline()
            self._deadline = self.loop.call_later(limits.request_timeout, self._expired)

        def on_headers_complete(self) -> None:
            self._reading_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._stop_deadline()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self.pipeline:
                self._set_idle(True)

        def _stop_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            self._refuse(408, "Request Timeout", f"the request did not arrive within {float(limits.request_timeout)} s")

        def _refuse(self, status: int, reason: str, message: str) -> None:
            """Answer ``status`` unless an answer was begun, and close the connection."""
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:  # the app waits for the rest of the body
                started = cycle.response_started
                cycle.disconnected = True  # its receive() ends, its answer is not written
                cycle.message_event.set()
                if started:
                    self.transport.close()
                    return
            self.transport.write(raw_response(status, reason, message))
            self.transport.close()

    return GuardedProtocol


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class HTTPServer:
    """``app`` (ASGI) served by uvicorn at ``host:port`` (bound now; 0 picks a free port).

    ``serve_forever()`` serves in the calling thread until ``shutdown()``; ``start()`` serves in
    a thread of its own and returns once the server answers; ``server_close()`` releases the
    socket and runs ``on_close``. ``graceful`` bounds, in seconds, how long a shutdown waits for
    requests being answered."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, limits: Limits | None = None,
                 backlog: int = 1024, graceful: float = 5.0, on_close: Callable[[], None] | None = None) -> None:
        import uvicorn

        self.connection_limits = limits or Limits()
        self._gate = _Gate(self.connection_limits)
        self._socket = _bind(host, port, backlog)
        self.server_address = self._socket.getsockname()[:2]
        config = uvicorn.Config(app, http=_protocol_class(self._gate), ws="none", lifespan="off", log_config=None,
                                access_log=False, server_header=False, date_header=False, backlog=backlog,
                                timeout_keep_alive=self.connection_limits.request_timeout,  # type: ignore[arg-type]
                                timeout_graceful_shutdown=graceful)  # type: ignore[arg-type]
        self._uvicorn = uvicorn.Server(config)
        self._on_close = on_close
        self._served = False
        self._done = threading.Event()
        self._done.set()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def connections(self) -> int:
        """Connections open now."""
        return self._gate.open

    @property
    def refused(self) -> int:
        """Connections answered 503 because every other one was busy."""
        return self._gate.refused

    @property
    def evicted(self) -> int:
        """Idle connections closed to make room for new ones."""
        return self._gate.evicted

    @property
    def stopping(self) -> bool:
        return self._uvicorn.should_exit

    @property
    def serving(self) -> bool:
        """Whether requests are being answered now."""
        return self._uvicorn.started and not self._done.is_set()

    def serve_forever(self, poll_interval: float | None = None) -> None:
        """Serve in this thread until :meth:`shutdown` (``poll_interval``: accepted, unused;
        uvicorn checks for a shutdown every 0.1 s)."""
        if self._served:
            raise RuntimeError("this server has served already; make a new one")
        self._served = True
        if self._uvicorn.should_exit:
            return
        self._done.clear()
        loop = _new_loop()
        try:
            loop.run_until_complete(self._uvicorn.serve(sockets=[self._socket]))
        finally:
            loop.close()
            self._done.set()

    def start(self, timeout: float = 30.0) -> "HTTPServer":
        """Serve in a daemon thread; return once requests are answered (``RuntimeError`` if the
        server does not start within ``timeout`` seconds)."""
        self._thread = threading.Thread(target=self.serve_forever, name=f"http-{self.server_address[1]}",
                                        daemon=True)
        self._thread.start()
        end = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.005)
        return self

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop serving: no new connections, idle ones closed, requests being answered given
        ``graceful`` seconds; returns once the server has stopped (or after ``timeout``)."""
        self._uvicorn.should_exit = True
        if self._served:
            self._done.wait(timeout)

    def server_close(self) -> None:
        """Release the socket (after :meth:`shutdown`, or instead of serving) and run ``on_close``."""
        if self._closed:
            return
        self._closed = True
        self._uvicorn.should_exit = True
        self._socket.close()
        if self._on_close is not None:
            self._on_close()

    def __enter__(self) -> "HTTPServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
        self.server_close()


def serve_until_signal(server: HTTPServer, ready_message: str | None = None) -> None:
    """Serve ``server`` until SIGTERM or SIGINT, then shut it down and close it (the commands'
    main loop; call from the main thread). ``ready_message`` is printed once it answers."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        logger.info("signal %d: shutting down", signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        if ready_message:
            print(ready_message, flush=True)
        while not stop.wait(0.2) and server.serving:
            pass
    finally:
        server.shutdown(timeout=30.0)
        server.server_close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        logger.info("server stopped")
