"""How OpenMP's wait policy changes the learner's speed, on an idle machine and with one core busy.

    python benchmarks/omp_wait_bench.py                 # ~4 min on 2 cores
    python benchmarks/omp_wait_bench.py --steps 20 --no-busy

Times ``--steps`` pretraining steps (batch 64, the tiny text model on FrozenLake: forward,
backward and Adam on ~100-token examples, the shape of the learner's work) in a fresh process
per setting, because OpenMP reads ``OMP_WAIT_POLICY`` once when torch loads: 1 thread, then 2
threads sleeping (``PASSIVE``), spinning (``ACTIVE``) and libgomp's default (spin a while,
then sleep). With ``--busy`` (default) the 2-thread settings run again beside a busy loop on
another core. Prints seconds and the ratio to the 1-thread time measured in the same run; run it on an otherwise idle machine (it prints the load average at start).
``train.py`` chooses the policy from what this shows (``learner.machine.default_omp_wait_policy``, called by its ``main()``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
from agents.policies.policy import Policy
from agents.policies.tiny import build_tiny_model
from learner.pretrain import PretrainSettings, pretrain
policy = Policy.from_pretrained(build_tiny_model("text"))
torch.manual_seed(0)
t = time.monotonic()
pretrain(policy, "freshper/FrozenLake-v0", {"feedback": False}, PretrainSettings(steps=int(sys.argv[2]), batch=64), seed=0)
print(time.monotonic() - t)
"""

SETTINGS = [("1 thread", 1, {"OMP_WAIT_POLICY": "PASSIVE"}),
            ("2 threads, PASSIVE (sleep)", 2, {"OMP_WAIT_POLICY": "PASSIVE"}),
            ("2 threads, ACTIVE (spin)", 2, {"OMP_WAIT_POLICY": "ACTIVE"}),
            ("2 threads, libgomp default", 2, {})]


def timed(threads: int, env: dict[str, str], steps: int) -> float:
    child_env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    child_env.update(env)
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(steps), str(REPO)], env=child_env, cwd=REPO,
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--busy", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {args.steps} pretraining steps per setting")
    print(f"{'setting':<30} {'machine':<14} {'seconds':>8} {'vs 1 thread':>12}")
    base = None
    for busy in ([False, True] if args.busy else [False]):
        loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            time.sleep(1.0 if busy else 0.0)
            for name, threads, env in SETTINGS:
                if busy and threads == 1:
                    continue
                sec = timed(threads, env, args.steps)
                base = base if base is not None else sec
                print(f"{name:<30} {'+ a busy loop' if busy else 'as it is':<14} {sec:8.1f} {base / sec:11.2f}x", flush=True)
        finally:
            if loop is not None:
                loop.kill()
                loop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
