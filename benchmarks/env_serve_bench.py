"""Steps per second of a served task (``python -m envs.serve``) against the same task in-process.

    python benchmarks/env_serve_bench.py [--env freshper/FrozenLake-v0] [--sessions 1 8 64] [--seconds 3]

For each number of sessions N: N envs play random well-formed replies until ``--seconds`` have
passed, resetting as episodes end. ``in-process``: N local envs stepped in turn. ``served,
batched``: N ``freshper/Remote-v0`` clients stepped in turn as the runner steps them, one
``/batch`` request per turn of all N (``before_batch_step``). ``served, threads``: N clients each
stepping from its own thread, one request per step (N concurrent connections). The server runs
in this process on loopback, in a thread, so client and server share the CPU and the GIL.
Ratios are served / in-process.
"""

from __future__ import annotations

import argparse
import threading
import time

import gymnasium as gym
import numpy as np

import envs  # noqa: F401
from envs.remote import RemoteEnv
from envs.serve import Limits, make_server

MOVES = ("Left", "Down", "Right", "Up")  # FrozenLake's and Sokoban's replies


def _lockstep(envs_: list, seconds: float, batched: bool) -> float:
    rng = np.random.default_rng(0)
    for k, env in enumerate(envs_):
        env.reset(seed=k)
    steps, t0 = 0, time.perf_counter()
    seed = len(envs_)
    while time.perf_counter() - t0 < seconds:
        replies = [f"<answer>{MOVES[int(rng.integers(4))]}</answer>" for _ in envs_]
        if batched:
            RemoteEnv.before_batch_step([e.unwrapped for e in envs_], replies)
        for env, reply in zip(envs_, replies):
            _, _, terminated, truncated, _ = env.unwrapped.step(reply)
            steps += 1
            if terminated or truncated:
                env.unwrapped.reset(seed=seed)
                seed += 1
    return steps / (time.perf_counter() - t0)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="freshper/FrozenLake-v0")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    server = make_server(args.env, limits=Limits(max_sessions=max(args.sessions)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    remote_id = "freshper/RemoteVision-v0" if server.service.spec.modality == "vision" else "freshper/Remote-v0"
    print(f"{args.env}, {args.seconds:g} s per setting, server on loopback in this process")
    print(f"{'sessions':>8}  {'in-process':>11}  {'served, batched':>15}  {'ratio':>6}  {'served, threads':>15}  {'ratio':>6}")
    try:
        for n in args.sessions:
            local = [gym.make(args.env) for _ in range(n)]
            base = _lockstep(local, args.seconds, batched=False)
            for e in local:
                e.close()
            remote = [gym.make(remote_id, url=server.url) for _ in range(n)]
            batched = _lockstep(remote, args.seconds, batched=True)
            threaded = _threads(remote, args.seconds)
            for e in remote:
                e.close()
            print(f"{n:>8}  {base:>9.0f}/s  {batched:>13.0f}/s  {batched / base:>6.3f}  {threaded:>13.0f}/s  "
                  f"{threaded / base:>6.3f}")
    finally:
        server.shutdown()
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
