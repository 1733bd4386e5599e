"""The keep-alive client's HTTP/1.x reader (:class:`envs.wire.KeepAlive`) against a real socket
server on loopback that answers with exact bytes: the framings servers use (``Content-Length``,
``chunked`` with extensions and trailers, close-delimited, HTTP/1.0), informational answers, and
answers that are not HTTP or end early. Every fault is one of the client's own errors, and a
connection is reused only where the answer leaves it clean."""

from __future__ import annotations

import gzip
import socket
import threading

import pytest

from envs.wire import MAX_HEAD_BYTES, AnswerError, Broken, KeepAlive, TooLate


class Canned:
    """Accepts connections; answers each request read off one with the next of ``answers``
    (bytes, then the connection is kept; ``(bytes, "close")``: closed after it)."""

    def __init__(self, answers: list) -> None:
        self.answers = list(answers)
        self.connections = 0
        self.requests: list[bytes] = []
        self.done = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while self.answers:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                data = b""
                while self.answers:
                    while b"\r\n\r\n" not in data:
                        more = conn.recv(65536)
                        if not more:
                            break
                        data += more
                    if b"\r\n\r\n" not in data:
                        break
                    head, data = data.split(b"\r\n\r\n", 1)
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    while len(data) < length:
                        data += conn.recv(65536)
                    self.requests.append(head)
                    data = data[length:]
                    answer = self.answers.pop(0)
                    close = isinstance(answer, tuple)
                    conn.sendall(answer[0] if close else answer)
                    if close:
                        break
                else:
                    self.done.wait(10)  # the last answer given: the connection stays open, silent

    def close(self) -> None:
        self.done.set()
        self.sock.close()


def _ask(client: KeepAlive, method: str = "POST", body: bytes | None = b"{}") -> tuple[int, bytes]:
    return client.request(method, "/x", body, timeout=5, cap=1 << 20)


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"a\": true}"


def test_framings_servers_use_are_read_and_the_connection_is_reused_where_it_can_be() -> None:
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"4;name=value\r\n{\"a\"\r\n7\r\n: true}\r\n0\r\nX-Trailer: 1\r\n\r\n")
    continued = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK
    bare = b"HTTP/1.1 200 OK\nContent-Length: 11\n\n{\"a\": true}"
    packed = gzip.compress(b"{\"a\": true}")
    zipped = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s" % (len(packed), packed)
    folded = b"HTTP/1.1 404 Not Found\r\ncontent-length: 11\r\nX-A: 1\r\nX-A: 2\r\n\r\n{\"a\": true}"
    server = Canned([OK, chunked, continued, bare, zipped, folded])
    client = KeepAlive(server.url)
    try:
        for want in (200, 200, 200, 200, 200, 404):
            assert _ask(client) == (want, b"{\"a\": true}")
        assert server.connections == 1  # every answer left the connection clean
        assert server.requests[0].startswith(b"POST /x HTTP/1.1\r\n")
    finally:
        client.close()
        server.close()


def test_answers_that_end_the_connection_are_read_to_its_end_and_it_is_reopened() -> None:
    server = Canned([(b"HTTP/1.1 200 OK\r\n\r\n{\"a\": true}", "close"),  # close-delimited body
                     (b"HTTP/1.0 200 OK\r\nContent-Length: 11\r\n\r\n{\"a\": true}", "close"),
                     (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 11\r\n\r\n{\"a\": true}", "close"),
                     b"HTTP/1.1 204 No Content\r\n\r\n", OK])
    client = KeepAlive(server.url)
    try:
        for _ in range(3):
            assert _ask(client) == (200, b"{\"a\": true}")
        assert _ask(client) == (204, b"")  # no body, the connection kept
        assert _ask(client) == (200, b"{\"a\": true}")
        assert server.connections == 4
    finally:
        client.close()
        server.close()


def test_a_head_answer_has_no_body_whatever_its_length_says() -> None:
    server = Canned([b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n", OK])
    client = KeepAlive(server.url)
    try:
        assert _ask(client, "HEAD", None) == (200, b"")
        assert _ask(client) == (200, b"{\"a\": true}")
        assert server.connections == 1
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("answer,error", [
    (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 2000 OK\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\n{}", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n{}", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n{}", "not chunked"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-2\r\n{}\r\n0\r\n\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{}\r\n0\r\n\r\n", "longer than its size"),
    (b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n", "exceed"),
])
def test_what_is_not_http_is_a_broken_answer_saying_why(answer: bytes, error: str) -> None:
    server = Canned([(answer, "close"), OK])
    client = KeepAlive(server.url)
    try:
        with pytest.raises(Broken, match=error):
            _ask(client)
        assert _ask(client) == (200, b"{\"a\": true}")  # a new connection serves again
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("answer", [
    b"",  # closed before answering
    b"HTTP/1.1 200 OK\r\nContent-Le",  # mid-head
    b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{\"a\"",  # mid-body
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n",  # between chunks
])
def test_an_answer_cut_short_by_the_server_is_broken(answer: bytes) -> None:
    server = Canned([(answer, "close")])
    client = KeepAlive(server.url)
    try:
        with pytest.raises(Broken, match="closed the connection"):
            _ask(client)
    finally:
        client.close()
        server.close()


def test_an_announced_body_past_the_cap_and_a_silent_server_are_refused_in_time() -> None:
    server = Canned([(b"HTTP/1.1 200 OK\r\nContent-Length: 999999999\r\n\r\n", "close"),
                     b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"])
    client = KeepAlive(server.url)
    try:
        with pytest.raises(AnswerError, match="above the limit"):
            client.request("GET", "/x", timeout=5, cap=1000)
        with pytest.raises(TooLate):
            client.request("GET", "/x", timeout=0.3, cap=1000)
    finally:
        client.close()
        server.close()
