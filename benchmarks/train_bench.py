"""Learner throughput and iteration-time split, and TRL's GRPOTrainer side by side.

    .venv/bin/python benchmarks/train_bench.py               # ours (text + image) and TRL
    .venv/bin/python benchmarks/train_bench.py --skip-trl    # ours only

Ours: a few iterations of ``train.py``'s loop (B x G = 8 x 8, FreshPER replay with one replay
update per iteration) on the tiny text model (FrozenLake 4x4, multi-turn) and the tiny VLM
(image FrozenLake, 4 x 4), after a short format warm-up; reported from ``metrics.jsonl``:
learner tokens/s (sequence tokens through forward + backward per second of update) and the
split of an iteration into rollout, on-policy update, buffer insert and replay update.

Side by side: a single-turn task (FrozenLake with ``max_turns=1``: the first board, one move,
reward 1 for a legal move and the env's reward otherwise) with equal sizes for both: 8 prompts
x 8 generations per step, at most 8 new tokens, the same prompts, the same tiny model folder,
lr 3e-4, KL 0.04, one optimizer step per batch. TRL runs in its own throw-away virtual
environment (``.cache/bench_venv_trl``; ``pip install trl torch==<ours> transformers==<ours>``)
in a subprocess, so the project's environment never depends on it. Timings are medians over
the measured steps, after one warm-up step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".cache" / "bench_venv_trl"

TRL_SCRIPT = r'''
import json, sys, time
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

args = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(args["threads"])
tok = AutoTokenizer.from_pretrained(args["model"])
if tok.pad_token is None:
    tok.pad_token = tok.eos_token
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in args["prompts"]])
MOVES = ("left", "down", "right", "up")

def reward(completions, **kw):
    out = []
    for c in completions:
        text = c[0]["content"] if isinstance(c, list) else c
        low = text.lower()
        ok = "<answer>" in low and "</answer>" in low and low.split("<answer>")[-1].split("</answer>")[0].strip() in MOVES
        out.append(1.0 if ok else -0.1)
    return out

times, tokens = [], []
class Clock(TrainerCallback):
    def on_step_begin(self, a, s, c, **kw):
        self.t = time.perf_counter()
    def on_step_end(self, a, s, c, **kw):
        times.append(time.perf_counter() - self.t)

n = args["batch"]
cfg = GRPOConfig(output_dir=args["out"], per_device_train_batch_size=n, num_generations=args["group"],
                 max_completion_length=args["max_new_tokens"], learning_rate=3e-4, beta=0.04, temperature=1.0,
                 max_steps=args["steps"], logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                 bf16=False, seed=0, disable_tqdm=True, dataloader_num_workers=0)
trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                      callbacks=[Clock()])
trainer.train()
logs = [h for h in trainer.state.log_history if "loss" in h]
print("RESULT " + json.dumps({"step_s": times, "logs": logs[-1:] if logs else []}))
'''


def _prompts(n: int) -> list[str]:
    """First observations of n FrozenLake maps: the single-turn task's prompts."""
    import envs  # noqa: F401
    from envs.registry import make

    env = make("freshper/FrozenLake-v0")
    return [env.reset(seed=10_000 + i)[0]["text"] for i in range(n)]


def bench_ours(modality: str, iterations: int, tasks: int, group: int, threads: int, root: Path,
               single_turn: bool = False) -> dict:
    """Run the training loop for a few iterations; return the medians of its timing metrics
    (the run folder, with the start-of-RL policy in ``reference/``, stays under ``root``)."""
    import learner.run
    from learner.config import make_config
    from learner.report import read_metrics

    env_id = "freshper/FrozenLake-v0" if modality == "text" else "freshper/FrozenLakeVision-v0"
    name = f"{modality}{'_single' if single_turn else ''}"
    cfg = make_config(
        runs_root=str(root), run_name=name, env_id=env_id, tasks_per_iter=tasks, group_size=group,
        iterations=iterations, pretrain_steps=40, pretrain_dynamics=0.0, diagnostics=False,
        final_eval_episodes=1, eval_every=0, checkpoint_every=0, replay="none" if single_turn else "fresh",
        replay_ratio=1, threads=threads, progress=False, tensorboard=False, gifs=0, eval_both=False,
        env_kwargs={"max_turns": 1} if single_turn else {},
    )
    learner.run.train(cfg)
    rows = [r for r in read_metrics(root / name / "metrics.jsonl") if r["kind"] == "train"][1:]
    keys = ("time_rollout_s", "time_update_s", "time_buffer_s", "time_replay_s", "tokens_per_s", "seq_tokens",
            "tokens", "turns_mean", "invalid_rate")
    out = {k: float(np.median([r[k] for r in rows if k in r])) for k in keys if any(k in r for r in rows)}
    out["iteration_s"] = float(np.median([r["time_rollout_s"] + r["time_update_s"] + r["time_buffer_s"] +
                                          r["time_replay_s"] for r in rows]))
    return out


def ensure_trl_venv() -> tuple[bool, str]:
    """Create the throw-away TRL venv if needed; return (ok, why-not)."""
    py = VENV / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import trl"], capture_output=True).returncode == 0:
        return True, ""
    import torch
    import transformers

    torch_version = torch.__version__.split("+")[0]
    steps = [[sys.executable if not Path("/usr/bin/python3").exists() else "python3", "-m", "venv", str(VENV)],
             [str(VENV / "bin" / "pip"), "install", "--quiet", "trl", f"torch=={torch_version}",
              f"transformers=={transformers.__version__}"]]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return False, f"{' '.join(cmd)} failed: {(proc.stderr or proc.stdout)[-800:]}"
    return True, ""


def bench_trl(model: Path, steps: int, tasks: int, group: int, threads: int) -> dict:
    ok, why = ensure_trl_venv()
    if not ok:
        return {"error": why}
    with tempfile.TemporaryDirectory() as tmp:
        args = {"model": str(model), "prompts": _prompts(tasks * 4), "steps": steps, "batch": tasks * group,
                "group": group, "max_new_tokens": 8, "threads": threads, "out": tmp}
        proc = subprocess.run([str(VENV / "bin" / "python"), "-c", TRL_SCRIPT, json.dumps(args)], capture_output=True,
                              text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"error": f"TRL run failed (exit {proc.returncode}): {proc.stderr[-1500:]}"}
    res = json.loads(line[len("RESULT "):])
    measured = res["step_s"][1:] or res["step_s"]
    return {"step_s": float(np.median(measured)), "steps": len(measured), "last_log": res["logs"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=6, help="iterations of our loop per setting")
    parser.add_argument("--trl-steps", type=int, default=6, help="GRPOTrainer steps")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for both")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-vision", action="store_true")
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    results: dict[str, dict] = {}
    t0 = time.time()
    root = Path(tempfile.mkdtemp(prefix="train_bench_"))
    results["ours text multi-turn 8x8 fresh K=1"] = bench_ours("text", args.iterations, 8, 8, args.threads, root)
    if not args.skip_vision:
        results["ours image multi-turn 4x4 fresh K=1"] = bench_ours("vision", max(3, args.iterations // 2), 4, 4,
                                                                    args.threads, root)
    results["ours text single-turn 8x8 (no replay)"] = bench_ours("text", args.iterations, 8, 8, args.threads, root,
                                                                  single_turn=True)
    if not args.skip_trl:  # the same post-warm-up weights as our single-turn run
        results["TRL GRPOTrainer single-turn 8x8"] = bench_trl(root / "text_single" / "reference", args.trl_steps, 8, 8,
                                                               args.threads)
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    print(f"\n(total {time.time() - t0:.0f} s, threads={args.threads})")
    header = f"| setting | iteration s | rollout s | update s | buffer s | replay s | learner tokens/s |"
    print(header + "\n|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | error: {r['error'][:300]} |")
        elif "step_s" in r:
            print(f"| {name} | {r['step_s']:.2f} (generation + update, one step) | | | | | |")
        else:
            print(f"| {name} | {r['iteration_s']:.2f} | {r['time_rollout_s']:.2f} | {r['time_update_s']:.2f} | "
                  f"{r['time_buffer_s']:.3f} | {r.get('time_replay_s', 0):.2f} | {r['tokens_per_s']:.0f} |")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
