"""Where a served step's time goes at 64 sessions, batched steps and resets: the client's CPU,
the server's CPU and, inside the server, its resets, its steps, decoding the requests and
encoding the answers, beside the same reset and step in-process.

    .venv/bin/python experiments/env_serve/server_split.py [--seconds 4] [--repeats 3]

The server is ``python -m envs.serve`` in its own process, started through this script
(``--serve``), which wraps :meth:`envs.serve.TaskService.run`, :func:`envs.serve._encode` and
:func:`envs.serve._parse_body` to add up their thread CPU time and reports the sums on SIGUSR1.
The client is ``benchmarks/env_serve_bench.py``'s loop (``_lockstep`` with ``batch_resets``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV = "freshper/FrozenLake-v0"


def serve() -> None:
    """The task server with CPU counters; SIGUSR1 prints them as one JSON line on stderr."""
    import envs.serve as S

    sums: dict[str, float] = {}

    def count(key: str, fn):
        def wrapped(*args, **kwargs):
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                sums[key] = sums.get(key, 0.0) + time.thread_time() - t
                sums[key + " calls"] = sums.get(key + " calls", 0) + 1
        return wrapped

    started: list[float] = []

    def collected(phase: str, info: dict) -> None:  # the cyclic garbage collector's passes
        if phase == "start":
            started[:] = [time.thread_time()]
        elif started:
            sums["gc"] = sums.get("gc", 0.0) + time.thread_time() - started.pop()
            sums["gc calls"] = sums.get("gc calls", 0) + 1

    gc.callbacks.append(collected)
    run = S.TaskService.run
    S.TaskService.run = lambda self, sid, op, body, **kw: count(op, run)(self, sid, op, body, **kw)
    S._encode = count("encode", S._encode)
    S._parse_body = count("decode", S._parse_body)

    def report(*_: object) -> None:
        user, system = os.times()[:2]
        sys.stderr.write(json.dumps({**sums, "process": user + system}) + "\n")
        sys.stderr.flush()

    signal.signal(signal.SIGUSR1, report)
    S.main([ENV, "--port", "0", "--max-sessions", "64", "--log-level", "WARNING"])


def in_process_costs(n: int = 3000) -> tuple[float, float]:
    """Microseconds of one reset and one step of the task as gym.make gives it (what the server holds)."""
    import gymnasium as gym

    env = gym.make(ENV)
    t = time.perf_counter()
    for i in range(n):
        env.reset(seed=i)
    reset = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for i in range(n):
        if i % 3 == 0:
            env.reset(seed=i)
        env.step("<answer>Left</answer>")
    step = (time.perf_counter() - t) / n - reset / 3
    return reset * 1e6, step * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve()
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gymnasium as gym

    import envs  # noqa: F401
    from env_serve_bench import _cpu_seconds, _lockstep
    from envs.remote import remote_id

    print(f"load average before: {os.getloadavg()}")
    proc = subprocess.Popen([sys.executable, __file__, "--serve"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = re.search(r"at (http://\S+):", proc.stdout.readline()).group(1)

        def counters() -> dict:
            os.kill(proc.pid, signal.SIGUSR1)
            return json.loads(proc.stderr.readline())

        remote = [gym.make(remote_id(url), url=url) for _ in range(64)]
        local = [gym.make(ENV) for _ in range(64)]
        _lockstep(remote, 1.0, batched=True, batch_resets=True)
        print("| run | in-process us/step | served us/step | ratio | client CPU | server CPU | server: resets "
              "| steps | decoding | encoding | the rest | of all these, the garbage collector | resets per step |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for k in range(a.repeats):
            base = _lockstep(local, a.seconds, batched=False)
            split: dict[str, float] = {}
            before, cpu0 = counters(), _cpu_seconds(proc.pid)
            _lockstep(remote, a.seconds, batched=True, batch_resets=True, split=split)
            after, cpu1 = counters(), _cpu_seconds(proc.pid)
            steps = split["steps"]
            per = {key: (after.get(key, 0) - before.get(key, 0)) / steps * 1e6
                   for key in ("reset", "step", "decode", "encode", "gc")}
            server = (cpu1 - cpu0) / steps * 1e6
            rest = server - sum(v for key, v in per.items() if key != "gc")  # gc falls inside the others
            resets = (after.get("reset calls", 0) - before.get("reset calls", 0)) / steps
            served = split["wall"] / steps * 1e6
            print(f"| {k + 1} | {1e6 / base:.1f} | {served:.1f} | {1e6 / base / served:.3f} | "
                  f"{split['client_cpu'] / steps * 1e6:.1f} | {server:.1f} | {per['reset']:.1f} | {per['step']:.1f} | "
                  f"{per['decode']:.1f} | {per['encode']:.1f} | {rest:.1f} | {per['gc']:.1f} | {resets:.3f} |")
        for e in remote:
            e.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    reset, step = in_process_costs()
    print(f"in-process, this process: a reset {reset:.1f} us, a step {step:.1f} us (gym.make's env, as the server holds it)")
    print("(per step of the served loop, microseconds; the server's resets, steps, decoding and encoding are its thread "
          "CPU time in them; the rest: HTTP, the batch loop, the event loop)")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
