"""Where the task server's CPU goes while 64 batched sessions play FrozenLake: ``perf record``
on the ``python -m envs.serve`` process during the benchmark's batched-steps-and-resets loop,
then the report by shared object and by symbol (C-level: the interpreter, JSON, the kernel).

    .venv/bin/python experiments/env_serve/perf_server.py [--seconds 4]

Needs Linux ``perf`` allowed to attach to a child process.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gymnasium as gym

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

import envs  # noqa: E402,F401
from env_serve_bench import _lockstep  # noqa: E402
from envs.remote import remote_id  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args()
    proc = subprocess.Popen([sys.executable, "-m", "envs.serve", "freshper/FrozenLake-v0", "--port", "0",
                             "--max-sessions", "64", "--log-level", "WARNING"], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    data = Path(tempfile.mkdtemp()) / "perf.data"
    try:
        url = re.search(r"at (http://\S+):", proc.stdout.readline()).group(1)
        remote = [gym.make(remote_id(url), url=url) for _ in range(64)]
        _lockstep(remote, 1.0, batched=True, batch_resets=True)  # warm
        perf = subprocess.Popen(["perf", "record", "-F", "2000", "-o", str(data), "-p", str(proc.pid)],
                                stderr=subprocess.DEVNULL)
        time.sleep(0.3)
        rate = _lockstep(remote, a.seconds, batched=True, batch_resets=True)
        perf.send_signal(2)
        perf.wait()
        print(f"64 sessions, batched steps and resets: {rate:.0f} steps/s while recorded")
        for sort, rows in (("dso", 8), ("sym", 25)):
            report = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", sort, "--stdio"],
                                    capture_output=True, text=True).stdout
            lines = [ln for ln in report.splitlines() if ln.strip() and not ln.startswith("#")]
            print(f"\nserver CPU by {sort}:")
            print("\n".join(lines[:rows]))
    finally:
        proc.terminate()


if __name__ == "__main__":
    main()
