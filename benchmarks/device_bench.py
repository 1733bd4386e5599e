"""The default recipe's time per step on each torch device, side by side in one process.

    .venv/bin/python benchmarks/device_bench.py                          # cpu, and cuda where torch sees one
    .venv/bin/python benchmarks/device_bench.py --devices cpu cuda --iterations 12 --json out.json

Two measurements per device, the same work on each:

1. **Pretraining**: ``--pretrain-steps`` steps of the default pretraining (64 examples of the
   task's own transitions per step) on a fresh copy of the tiny model; steps per second.
2. **RL iterations**: ``train.py``'s default recipe (8 tasks x 8 rollouts, the on-policy update
   and two FreshPER replay updates on 16 trajectories) for ``--iterations`` iterations from the
   model the first device pretrained, so every device plays the same kind of episodes; the
   median seconds of the rollout, the on-policy update, the replay updates and the whole
   iteration over the iterations after the first (the warm-up), from the run's
   ``metrics.jsonl``.

The last column is each device's time over the first device's (the baseline, ``--devices``'
first). Rollouts are the tiny model's token-by-token decoding plus the environments' steps on
the CPU; updates are one forward and backward over the iteration's sequences.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

PHASES = ("time_rollout_s", "time_update_s", "time_replay_s", "time_total_s")


def default_devices() -> list[str]:
    import torch

    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def time_pretraining(model: Path, device: str, steps: int, seed: int, env_id: str) -> tuple[float, Path | None, dict]:
    """Seconds per pretraining step on ``device`` (a fresh copy of ``model``), and the result."""
    import torch

    from agents.policies.policy import Policy
    from agents.rollout.runner import default_env_kwargs
    from learner.pretrain import PretrainSettings, pretrain

    policy = Policy.from_pretrained(model, device=device)
    torch.manual_seed(seed)
    report = pretrain(policy, env_id, default_env_kwargs(env_id, "window:0"), PretrainSettings(steps=steps), seed=seed)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    out = Path(tempfile.mkdtemp(prefix=f"device_bench_{device.replace(':', '_')}_"))
    policy.save_pretrained(out)
    return report["pretrain_seconds"] / max(steps, 1), out, report


def time_iterations(model: Path, device: str, iterations: int, seed: int, env_id: str, root: Path,
                    name: str) -> dict[str, float]:
    """Median seconds of each phase of an RL iteration on ``device`` (iterations after the first)."""
    import learner.run
    from learner.config import make_config
    from learner.report import read_metrics

    cfg = make_config(env_id=env_id, model=str(model), pretrain_steps=0, iterations=iterations, device=device,
                      seed=seed, eval_every=0, final_eval_episodes=8, checkpoint_every=0, progress=False,
                      tensorboard=False, runs_root=str(root), run_name=name)
    learner.run.train(cfg)
    rows = [r for r in read_metrics(root / cfg.run.run_name / "metrics.jsonl") if r["kind"] == "train"]
    out = {k: float(np.median([r[k] for r in rows[1:] if k in r])) for k in PHASES if k != "time_total_s"}
    # time_total_s is the run's RL seconds so far: an iteration's is the step between two rows
    out["time_total_s"] = float(np.median(np.diff([r["time_total_s"] for r in rows])))
    out["tokens_per_s"] = float(np.median([r["tokens_per_s"] for r in rows[1:]]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", nargs="+", default=None, help="first one is the baseline (default: cpu [cuda])")
    parser.add_argument("--env-id", default="freshper/FrozenLake-v0")
    parser.add_argument("--pretrain-steps", type=int, default=100)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the measurements here")
    args = parser.parse_args(argv)

    import torch

    import envs
    from agents.policies.tiny import build_tiny_model

    devices = args.devices or default_devices()
    base = build_tiny_model(envs.task_spec(args.env_id).modality, seed=args.seed)
    results: dict[str, dict[str, float]] = {d: {} for d in devices}
    model_for_rl: Path | None = None
    made: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="device_bench_runs_") as tmp:
        for d in devices:
            per_step, folder, report = time_pretraining(base, d, args.pretrain_steps, args.seed, args.env_id)
            results[d]["pretrain_s_per_step"] = per_step
            results[d]["pretrain_loss_last"] = report["pretrain_loss_last"]
            made.append(folder)
            model_for_rl = model_for_rl or folder
            print(f"{d}: pretraining {per_step:.3f} s/step (loss {report['pretrain_loss_last']:.3f})", flush=True)
        for i, d in enumerate(devices):
            t0 = time.perf_counter()
            results[d].update(time_iterations(model_for_rl, d, args.iterations, args.seed, args.env_id, Path(tmp),
                                              f"bench_{i}_{d.replace(':', '_')}"))
            print(f"{d}: {args.iterations} iterations in {time.perf_counter() - t0:.0f} s", flush=True)
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)

    first = devices[0]
    names = {"pretrain_s_per_step": "pretraining step", "time_rollout_s": "rollout (64 episodes)",
             "time_update_s": "on-policy update", "time_replay_s": "replay updates (2 x 16)",
             "time_total_s": "whole iteration"}
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(f"\n{args.env_id}, torch {torch.__version__}, {os.cpu_count()} CPUs, GPU: {gpu}")
    cols = ["seconds", *devices, *(f"{d} / {first}" for d in devices[1:])]
    print("| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|")
    for key, label in names.items():
        vals = [results[d].get(key, float("nan")) for d in devices]
        cells = [label, *(f"{v:.3f}" for v in vals), *(f"{v / vals[0]:.2f}" for v in vals[1:])]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"env_id": args.env_id, "torch": torch.__version__, "gpu": gpu,
                                               "cpus": os.cpu_count(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
