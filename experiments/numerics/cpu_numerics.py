"""How the CPU's kernels move a run's floating-point results: the default pretraining under each
instruction set torch can use here.

    python experiments/numerics/cpu_numerics.py                     # held-out losses of the untrained model
    python experiments/numerics/cpu_numerics.py --steps 400         # and after the default 400 pretraining steps

torch picks its CPU kernels by the instruction sets the machine has (``ATEN_CPU_CAPABILITY``
can only lower the choice). Each capability runs in its own process, with the embedded tiny
model of ``--seed``, the default run's pretraining recipe (``train.py``'s) and ``--threads``
threads, and prints the held-out negative log-likelihoods of the pretraining's examples before
(and after ``--steps`` steps), with their difference to the first capability's. Same data, same
seed, same code: any difference is the kernels' rounding, and RL amplifies it (the same seed
on another machine is another draw; docs/results/frozenlake.md#same-seed-another-machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CAPABILITIES = ("avx512", "avx2", "default")


def child(seed: int, steps: int, threads: int) -> dict:
    import tempfile

    import torch

    from agents.policies.policy import Policy
    from agents.rollout.runner import default_env_kwargs
    from agents.policies.tiny import build_tiny_model
    from learner.config import Config
    from learner.pretrain import pretrain

    torch.set_num_threads(threads)
    cfg = Config()
    env_kwargs = default_env_kwargs(cfg.rollout.env_id, cfg.rollout.context)
    pcfg = dataclasses.replace(cfg.pretrain.recipe(), steps=steps)
    with tempfile.TemporaryDirectory() as tmp:  # a private copy of the tiny model: nothing cached is touched
        policy = Policy.from_pretrained(build_tiny_model("text", cache_dir=tmp, seed=seed))
        torch.manual_seed(seed)
        report = pretrain(policy, cfg.rollout.env_id, env_kwargs, pcfg, seed=seed, micro_batch=cfg.rl.micro_batch)
    report["capability"] = torch.backends.cpu.get_cpu_capability()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0, help="pretraining steps (the default run's: 400)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (make train's updates: 2 on 2 CPUs)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.seed, args.steps, args.threads)))
        return 0
    rows = []
    for cap in CAPABILITIES:
        env = {**os.environ, "ATEN_CPU_CAPABILITY": cap}
        out = subprocess.run([sys.executable, __file__, "--child", "--seed", str(args.seed), "--steps", str(args.steps),
                              "--threads", str(args.threads)], env=env, capture_output=True, text=True)
        if out.returncode != 0:  # asking for kernels the CPU lacks ends in SIGILL
            print(f"{cap}: not available here (exit {out.returncode})")
            continue
        report = json.loads(out.stdout.strip().splitlines()[-1])
        report["asked"] = cap
        rows.append(report)
    keys = ["pretrain_dynamics_nll_before", "pretrain_format_nll_before"]
    if args.steps:
        keys += ["pretrain_loss_last", "pretrain_dynamics_nll_after", "pretrain_format_nll_after"]
    print(f"seed {args.seed}, {args.steps} pretraining steps, {args.threads} threads")
    print(f"{'kernels':<10}" + "".join(f"{k.replace('pretrain_', ''):>26}" for k in keys))
    for r in rows:
        print(f"{r['capability']:<10}" + "".join(f"{r[k]:>26.16g}" for k in keys))
    for r in rows[1:]:
        print(f"{r['capability'] + ' - ' + rows[0]['capability']:<10}"
              + "".join(f"{r[k] - rows[0][k]:>+26.3e}" for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
