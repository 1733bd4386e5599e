"""Replay buffer benchmark: freshness cost per step, insert throughput and sampling latency,
side by side with peers (cpprb, TorchRL) where they are installed.

Run with the peers in a throw-away venv (they are never project dependencies):

    bash benchmarks/replay_bench.sh            # creates .cache/bench_venv_replay on first use
    .venv/bin/python benchmarks/replay_bench.py # ours only, if the peers are missing

Timings are the best of 15 short rounds, interleaved across libraries in one process, so the
columns are comparable even on a shared, busy machine.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Callable

import numpy as np

from replay import ReplayBuffer
from replay.buffer import REBASE_LOG

ALPHA, BETA, TAU, INSERT_BATCH, FILL_CHUNK = 0.6, 0.4, 500.0, 64, 10_000


def best_per_call_us(fns: dict[str, Callable[[], object]], calls: int, rounds: int = 15) -> dict[str, float]:
    """Best round's mean wall time per call, in microseconds, for each function. Rounds are
    interleaved across the functions and the minimum is kept, so preemption by other processes
    on a shared machine hits every library alike instead of whichever ran during a busy spell."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    return best


class Ours:
    name = "freshper"

    def __init__(self, n: int, mode: str = "fresh") -> None:
        self.buf = ReplayBuffer(n, mode=mode, alpha=ALPHA, tau=TAU, beta=BETA, seed=0)
        self.rng = np.random.default_rng(0)
        self.step = 0
        for start in range(0, n, FILL_CHUNK):
            k = min(FILL_CHUNK, n - start)
            self.buf.add(range(start, start + k), self.rng.exponential(1.0, k), step=start // FILL_CHUNK)
        self.step = n // FILL_CHUNK + 1
        self.items = list(range(INSERT_BATCH))
        self.prio = self.rng.exponential(1.0, INSERT_BATCH)

    def insert(self) -> None:
        self.buf.add(self.items, self.prio, self.step)

    def sample(self) -> None:
        self.buf.sample(256, self.step)

    def insert_then_sample(self) -> None:  # the top-level cache is cold after every insert
        self.buf.add(self.items, self.prio, self.step)
        self.buf.sample(256, self.step)

    def next_step(self) -> None:
        self.step += 1
        self.buf.advance(self.step)


class Cpprb:
    name = "cpprb"

    def __init__(self, n: int) -> None:
        from cpprb import PrioritizedReplayBuffer

        self.rb = PrioritizedReplayBuffer(n, {"obs": {"shape": 1}}, alpha=ALPHA)
        rng = np.random.default_rng(0)
        for start in range(0, n, FILL_CHUNK):
            k = min(FILL_CHUNK, n - start)
            self.rb.add(obs=np.zeros((k, 1)), priorities=rng.exponential(1.0, k))
        self.obs, self.prio = np.zeros((INSERT_BATCH, 1)), rng.exponential(1.0, INSERT_BATCH)

    def insert(self) -> None:
        self.rb.add(obs=self.obs, priorities=self.prio)

    def sample(self) -> None:
        self.rb.sample(256, beta=BETA)


class TorchRL:
    name = "torchrl"

    def __init__(self, n: int) -> None:
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, PrioritizedReplayBuffer

        logging.getLogger("torchrl").setLevel(logging.WARNING)  # its storage logs each allocation

        self.rb = PrioritizedReplayBuffer(alpha=ALPHA, beta=BETA, storage=LazyTensorStorage(n), batch_size=256)
        gen = torch.Generator().manual_seed(0)
        for start in range(0, n, FILL_CHUNK):
            k = min(FILL_CHUNK, n - start)
            idx = self.rb.extend(TensorDict({"obs": torch.zeros(k, 1)}, batch_size=[k]))
            self.rb.update_priority(idx, torch.rand(k, generator=gen) + 1e-3)
        self.td = TensorDict({"obs": torch.zeros(INSERT_BATCH, 1)}, batch_size=[INSERT_BATCH])
        self.prio = torch.rand(INSERT_BATCH, generator=gen) + 1e-3

    def insert(self) -> None:
        idx = self.rb.extend(self.td)
        self.rb.update_priority(idx, self.prio)

    def sample(self) -> None:
        self.rb.sample()


def try_peer(cls: type, n: int) -> tuple[object | None, str]:
    try:
        return cls(n), ""
    except Exception as exc:  # a peer that fails to import or run is reported, not fatal
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:100]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated capacities N")
    ap.add_argument("--calls", type=int, default=100, help="calls per timing round")
    args = ap.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} cpu (load {load}); alpha={ALPHA} tau={TAU} "
          f"beta={BETA}; insert batches of {INSERT_BATCH}; sample 256 with IS weights; best of 15 interleaved rounds")
    rows, notes = [], {}
    for n in sizes:
        fresh, refresh = Ours(n, "fresh"), Ours(n, "refresh")
        steps = best_per_call_us({"fresh": fresh.next_step}, args.calls)
        steps.update(best_per_call_us({"refresh": refresh.next_step}, 2, rounds=5))
        del refresh
        t0 = time.perf_counter()
        fresh.buf._rebase(fresh.buf._t_ref)  # price one O(N) rebase (to the same reference)
        rebase_us = (time.perf_counter() - t0) * 1e6
        rebase_every = REBASE_LOG / (ALPHA / TAU)  # steps between rebases, at the latest
        libs: dict[str, object] = {"ours": fresh}
        for cls in (Cpprb, TorchRL):
            peer, err = try_peer(cls, n)
            if peer is None:
                notes[cls.name] = err
            else:
                libs[cls.name] = peer
        insert = best_per_call_us({k: lib.insert for k, lib in libs.items()}, args.calls)
        sample = best_per_call_us({k: lib.sample for k, lib in libs.items()}, args.calls)
        both = best_per_call_us({"ours": fresh.insert_then_sample}, args.calls)
        row = {
            "N": n,
            "fresh step us": steps["fresh"],
            "fresh rebase amortised us": rebase_us / rebase_every,
            "refresh step us": steps["refresh"],
        }
        for k in ("ours", Cpprb.name, TorchRL.name):
            row[f"ins/s {k}"] = INSERT_BATCH / insert[k] * 1e6 if k in insert else float("nan")
        for k in ("ours", Cpprb.name, TorchRL.name):
            row[f"sample us {k}"] = sample.get(k, float("nan"))
        row["ins+sample us ours"] = both["ours"]
        rows.append(row)
        del libs, fresh
        print(f"  N={n:,} done", file=sys.stderr, flush=True)
    for name, err in notes.items():
        print(f"{name}: not available ({err})")
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        cells = [f"{row['N']:,}"]
        for c in cols[1:]:
            v = row[c]
            cells.append("n/a" if v != v else (f"{v:,.0f}" if v >= 100 else f"{v:.2f}"))
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
