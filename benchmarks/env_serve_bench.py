"""Steps per second of a served task (``python -m envs.serve``) against the same task in-process.

    python benchmarks/env_serve_bench.py [--env freshper/FrozenLake-v0] [--sessions 1 8 64] [--seconds 3]
        [--server process|thread] [--pin] [--profile]

For each number of sessions N: N envs play random well-formed replies until ``--seconds`` have
passed, the episodes that ended in a turn reset after it. ``in-process``: N local envs stepped
in turn. ``batched steps``: N ``freshper/Remote-v0`` clients stepped in turn as the runner steps
them, one ``/batch`` request per turn of all N (``before_batch_step``), each reset its own
request. ``batched steps and resets``: the same with a turn's resets sent as one ``/batch``
request too (``before_batch_reset``). ``threads``: N clients each stepping from its own thread,
one request per step (N concurrent connections). The server is
``python -m envs.serve`` on loopback: by default its own process (``--server process``, as it is
deployed), or a thread of this process (``--server thread``: client and server share the GIL);
``--pin`` keeps the server's process on one CPU and this one on another.
Ratios are served / in-process.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np

import envs  # noqa: F401
from envs.remote import RemoteEnv
from envs.remote import remote_id as remote_id_of
from envs.serve import Limits, make_server

REPO = Path(__file__).resolve().parents[1]

MOVES = ("Left", "Down", "Right", "Up")  # FrozenLake's and Sokoban's replies


def _lockstep(envs_: list, seconds: float, batched: bool, batch_resets: bool = False,
              split: dict[str, float] | None = None) -> float:
    """Steps per second; ``split`` (if given) collects the seconds spent in the batch requests,
    in stepping (one request per step where not batched) and in the resets, the client thread's
    CPU seconds and the steps."""
    rng = np.random.default_rng(0)
    for k, env in enumerate(envs_):
        env.reset(seed=k)
    steps, t0, cpu0 = 0, time.perf_counter(), time.thread_time()
    seed = len(envs_)
    clock = time.perf_counter
    parts = {"batch requests": 0.0, "stepping": 0.0, "resets": 0.0}
    while clock() - t0 < seconds:
        replies = [f"<answer>{MOVES[int(rng.integers(4))]}</answer>" for _ in envs_]
        a = clock()
        if batched:
            RemoteEnv.before_batch_step([e.unwrapped for e in envs_], replies)
        b = clock()
        ended = []
        for env, reply in zip(envs_, replies):
            _, _, terminated, truncated, _ = env.unwrapped.step(reply)
            steps += 1
            if terminated or truncated:
                ended.append(env.unwrapped)
        c = clock()
        seeds = list(range(seed, seed + len(ended)))
        seed += len(ended)
        if batch_resets:
            RemoteEnv.before_batch_reset(ended, seeds)
        for env, s in zip(ended, seeds):
            env.reset(seed=s)
        parts["batch requests"] += b - a
        parts["stepping"] += c - b
        parts["resets"] += clock() - c
    wall = clock() - t0
    if split is not None:
        split.update(parts, wall=wall, client_cpu=time.thread_time() - cpu0, steps=steps)
    return steps / wall


def _threads(envs_: list, seconds: float) -> float:
    counts = [0] * len(envs_)
    stop = time.perf_counter() + seconds

    def work(k: int, env) -> None:
        rng = np.random.default_rng(k)
        env.reset(seed=k)
        seed = 10_000 * (k + 1)
        while time.perf_counter() < stop:
            _, _, terminated, truncated, _ = env.unwrapped.step(f"<answer>{MOVES[int(rng.integers(4))]}</answer>")
            counts[k] += 1
            if terminated or truncated:
                env.unwrapped.reset(seed=seed)
                seed += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(k, e)) for k, e in enumerate(envs_)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


_ECHO = r"""
import socket
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(1)
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := conn.recv(65536):
    conn.sendall(data)
"""


def _round_trips(url: str, n: int = 1000) -> list[str]:
    """Microseconds per round trip: raw TCP to an echo process (the floor), then the served
    task's ``/health`` (answered on the event loop) and a trivial call (answered on the event
    loop where the task declares its calls quick, else in the pool)."""
    import json
    import socket

    from envs.wire import KeepAlive

    lines = []
    echo = subprocess.Popen([sys.executable, "-c", _ECHO], stdout=subprocess.PIPE, text=True)
    try:
        with socket.create_connection(("127.0.0.1", int(echo.stdout.readline()))) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.perf_counter()
            for _ in range(n):
                sock.sendall(b"x" * 200)
                sock.recv(65536)
            lines.append(f"raw TCP echo to another process: {(time.perf_counter() - t0) / n * 1e6:.0f} us")
    finally:
        echo.wait(timeout=10)
    conn = KeepAlive(url)
    sid = json.loads(conn.request("POST", "/sessions", b"{}", timeout=30, cap=1 << 20)[1])["session"]
    conn.request("POST", f"/sessions/{sid}/reset", b'{"seed": 0}', timeout=30, cap=1 << 20)
    for what, method, path, body in (("GET /health (on the event loop)", "GET", "/health", None),
                                     ("a render_text call", "POST", f"/sessions/{sid}/call",
                                      b'{"method": "render_text"}')):
        t0, cpu0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            conn.request(method, path, body, timeout=30, cap=1 << 20)
        lines.append(f"{what}: {(time.perf_counter() - t0) / n * 1e6:.0f} us, the client's CPU "
                     f"{(time.thread_time() - cpu0) / n * 1e6:.0f} us")
    conn.request("DELETE", f"/sessions/{sid}", timeout=30, cap=1 << 20)
    conn.close()
    return lines


def _cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds of process ``pid`` so far (Linux's /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="freshper/FrozenLake-v0")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--profile", action="store_true",
                        help="also print where a served step's time goes (batched steps, resets one by one)")
    parser.add_argument("--server", choices=("process", "thread"), default="process",
                        help="run the server as its own process (python -m envs.serve) or in a thread of this one")
    parser.add_argument("--pin", action="store_true",
                        help="pin this process (the clients and the in-process envs) to one CPU and the server's "
                             "process to another, as a server on its own cores is deployed (Linux; needs 2 CPUs)")
    parser.add_argument("--no-inline", dest="inline", action="store_false",
                        help="the server answers every call in its thread pool (envs.serve --no-inline)")
    args = parser.parse_args(argv)
    proc = server = None
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.pin and (args.server != "process" or len(cpus) < 2):
        parser.error("--pin needs --server process and at least 2 CPUs this process may run on")
    if args.pin:
        os.sched_setaffinity(0, {cpus[0]})
    if args.server == "process":
        proc = subprocess.Popen([sys.executable, "-m", "envs.serve", args.env, "--port", "0", "--max-sessions",
                                 str(max(args.sessions)), "--log-level", "WARNING",
                                 *([] if args.inline else ["--no-inline"])], cwd=REPO,
                                stdout=subprocess.PIPE, text=True,
                                preexec_fn=(lambda: os.sched_setaffinity(0, {cpus[1]})) if args.pin else None)
        line = proc.stdout.readline()
        found = re.search(r"at (http://\S+):", line)
        if not found:
            proc.kill()
            raise SystemExit(f"the server did not start: {line!r}")
        url = found.group(1)
    else:
        server = make_server(args.env, limits=Limits(max_sessions=max(args.sessions)), inline=args.inline).start()
        url = server.url
    profiles: list[str] = []
    try:
        remote_id = remote_id_of(url)
        where = "its own process" if proc is not None else "a thread of this process"
        if args.pin:
            where += f" pinned to CPU {cpus[1]}, the clients and in-process envs to CPU {cpus[0]}"
        print(f"{args.env}, {args.seconds:g} s per setting, the server on loopback in {where}"
              f"{'' if args.inline else ', every call in its pool (--no-inline)'}")
        print(f"{'sessions':>8}  {'in-process':>11}  {'batched steps':>13}  {'ratio':>6}  {'batched steps+resets':>20}  "
              f"{'ratio':>6}  {'threads':>9}  {'ratio':>6}")
        for n in args.sessions:
            local = [gym.make(args.env) for _ in range(n)]
            base = _lockstep(local, args.seconds, batched=False)
            for e in local:
                e.close()
            remote = [gym.make(remote_id, url=url) for _ in range(n)]
            split: dict[str, float] = {}
            cpu0 = _cpu_seconds(proc.pid) if proc is not None else None
            batched = _lockstep(remote, args.seconds, batched=True, split=split)
            cpu1 = _cpu_seconds(proc.pid) if proc is not None else None
            both = _lockstep(remote, args.seconds, batched=True, batch_resets=True)
            threaded = _threads(remote, args.seconds)
            for e in remote:
                e.close()
            print(f"{n:>8}  {base:>9.0f}/s  {batched:>11.0f}/s  {batched / base:>6.3f}  {both:>18.0f}/s  "
                  f"{both / base:>6.3f}  {threaded:>7.0f}/s  {threaded / base:>6.3f}")
            if args.profile:
                per = {k: split[k] / split["steps"] * 1e6 for k in ("batch requests", "stepping", "resets", "client_cpu")}
                profiles.append(f"{n:>8}  in-process {1e6 / base:5.0f} us/step; served (batched steps) "
                                f"{split['wall'] / split['steps'] * 1e6:5.0f} us/step = batch requests "
                                f"{per['batch requests']:4.0f} + stepping {per['stepping']:4.0f} + resets "
                                f"{per['resets']:4.0f}; the client's CPU {per['client_cpu']:4.0f}"
                                + (f", the server's {(cpu1 - cpu0) / split['steps'] * 1e6:4.0f}"
                                   if cpu0 is not None and cpu1 is not None else ""))
        if profiles:
            print("where a served step's time goes (per step, batched steps, each reset its own request):")
            print("\n".join(profiles))
            print("round trips:")
            print("\n".join(_round_trips(url)))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        else:
            server.shutdown()
            server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
