"""Scale-out, side by side in one run: Ray rollout workers, asynchronous collection, vLLM.

    .venv/bin/python benchmarks/scale_bench.py                      # all tables (~12 min on 2 busy cores)
    .venv/bin/python benchmarks/scale_bench.py --skip-vllm          # without the vLLM table
    .venv/bin/python benchmarks/scale_bench.py --latency-ms 50,200 --tasks 8 --group-size 4

1. **Collection** on SearchQA against the real retrieval server (``python -m envs.search.server``
   in its own process on loopback) answering each request after ``--latency-ms``: episodes/s of
   one B x G collect in this process, on 1 Ray worker and on 2 Ray workers (synchronous,
   identical records). The policy is the tiny model after a few supervised steps towards
   searching for random words of the question, so (almost) every turn of every episode sends a
   new query (4 turns, so 4 requests per collect call and worker): a slow service's worst case.
2. **Training**, ``train.py`` iterations (on-policy update, no replay, no KL) with the same task
   and model at ``--train-latency-ms``: in process, 2 workers synchronous, 2 workers ``--async``,
   taking turns for ``--train-rounds`` rounds (medians). Episodes per second of RL time after
   the first iteration; "waiting for episodes" is the iteration's collect call as the learner
   sees it (with ``--async`` the episodes were collected during the previous update).
3. **vLLM** (``--vllm-python``, default ``.venv-vllm/bin/python``; ``make vllm-venv``) against the
   project's sampler on the tiny model: generated tokens/s for 64 FrozenLake prompts x 32 new
   tokens, and episodes/s of one 8 x 8 FrozenLake collect, through the runner.

Every ratio compares rows of this run; the load average is printed before and after, since the
machine's cores are shared.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train.py sets it, before torch loads OpenMP

import torch

from agents.policies.policy import Policy, configure_threads
from agents.rollout.runner import RolloutSettings
from agents.policies.tiny import build_tiny_model

SEARCH = "freshper/SearchQA-v0"
LAKE = "freshper/FrozenLake-v0"


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def start_server(latency_ms: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "envs.search.server", "--port", "0", "--latency-ms",
                             str(latency_ms), "--log-level", "WARNING"], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    line = proc.stdout.readline()
    return proc, line.split(" at ")[1].strip().removesuffix("/retrieve")


def searching_model(folder: Path, rollout: RolloutSettings) -> Path:
    """The tiny model after supervised steps towards searching on every turn for a few random
    words of the question (see the docstring): its sampled queries differ between episodes and
    turns, so the retrievers' query caches seldom answer for the server."""
    import random

    rng = random.Random(0)

    def search_words(obs, info, env) -> str:
        words = env.unwrapped.question.question.rstrip("?").split()
        return "<search>" + " ".join(rng.sample(words, min(3, len(words)))) + "</search>"

    policy = Policy.from_pretrained(build_tiny_model("text"))
    runner = rollout.runner(policy, seed=0, group_size=2)
    scripted, _ = runner.collect(range(8), policy_version=0, reply_fn=search_words)
    runner.close()
    samples = [s for r in scripted for s in r.samples]
    opt = torch.optim.Adam(policy.model.parameters(), lr=3e-3)
    policy.model.train()
    for _ in range(6):
        for s in samples:
            ids = torch.as_tensor(s.token_ids)[None]
            labels = torch.where(torch.as_tensor(s.loss_mask)[None] == 1, ids, torch.full_like(ids, -100))
            loss = policy.model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    policy.model.eval()
    return policy.save_pretrained(folder)


def table(rows: list[dict[str, str]]) -> None:
    header = list(rows[0])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row[h] for h in header) + " |")
    print(flush=True)


def bench_collect(model: Path, rollout: RolloutSettings, tasks: int, repeats: int) -> list[dict[str, str]]:
    """Episodes/s of one B x G collect per setting; the settings take turns in every repeat, so a
    change of the machine's load falls on all of them alike."""
    from agents.policies.spec import PolicySpec
    from agents.rollout.workers import RayCollector

    policy = Policy.from_pretrained(model)
    settings = [("in process", rollout.runner(policy, seed=0)),
                ("1 Ray worker", RayCollector(policy, model, rollout, workers=1, spec=PolicySpec(), seed=0)),
                ("2 Ray workers", RayCollector(policy, model, rollout, workers=2, spec=PolicySpec(), seed=0))]
    walls: dict[str, list[float]] = {name: [] for name, _ in settings}
    episodes = tasks * rollout.group_size
    try:
        for name, collector in settings:  # warm-up: weights pushed, envs and caches built
            collector.collect(list(range(tasks)), policy_version=0, rng_seed=0, group_base=0)
        for r in range(repeats):
            seeds = list(range(1000 * (r + 1), 1000 * (r + 1) + tasks))
            for name, collector in settings:
                t0 = time.perf_counter()
                records, _ = collector.collect(seeds, policy_version=0, rng_seed=r + 1, group_base=0)
                walls[name].append(time.perf_counter() - t0)
                assert len(records) == episodes
    finally:
        for _, collector in settings:
            collector.close()
    base = episodes / statistics.median(walls["in process"])
    return [{"setting": name, "episodes/s": f"{episodes / statistics.median(w):.1f}",
             "s / collect (median)": f"{statistics.median(w):.2f}",
             "vs in process": f"{episodes / statistics.median(w) / base:.2f}x"} for name, w in walls.items()]


def bench_train(model: Path, rollout: RolloutSettings, tasks: int, iterations: int, runs_root: Path,
                rounds: int) -> list[dict[str, str]]:
    """train.py runs per setting, the settings taking turns for ``rounds`` rounds; each row is the
    median over its rounds."""
    import learner.run
    from learner.config import make_config
    from learner.report import read_metrics

    common = dict(env_id=SEARCH, env_kwargs=dict(rollout.env_kwargs), model=str(model), pretrain_steps=0,
                  iterations=iterations, tasks_per_iter=tasks, group_size=rollout.group_size,
                  max_new_tokens=rollout.max_new_tokens, eval_every=0, final_eval_episodes=1, eval_both=False,
                  diagnostics=False, checkpoint_every=0, progress=False, tensorboard=False, runs_root=str(runs_root),
                  kl_coef=0.0)
    settings = [("in process", {}), ("2 workers, sync", {"rollout_workers": 2}),
                ("2 workers, --async", {"rollout_workers": 2, "async_collect": True})]
    measured: dict[str, list[tuple[float, ...]]] = {name: [] for name, _ in settings}
    for r in range(rounds):
        for name, extra in settings:
            run_name = f"{name.replace(' ', '_').replace(',', '').replace('-', '')}_{r}"
            with contextlib.redirect_stdout(io.StringIO()):  # train.py's config and summary printouts
                learner.run.train(make_config(run_name=run_name, seed=r, **common, **extra))
            rows = [x for x in read_metrics(runs_root / run_name / "metrics.jsonl") if x["kind"] == "train"]
            seconds = rows[-1]["time_total_s"] - rows[0]["time_total_s"]  # after the first iteration
            episodes = rows[-1]["episodes"] - rows[0]["episodes"]
            measured[name].append((episodes / seconds, seconds / (len(rows) - 1),
                                   statistics.median(x["time_rollout_s"] for x in rows[1:]),
                                   statistics.median(x["time_update_s"] for x in rows[1:]),
                                   max(x.get("staleness_max", 0.0) for x in rows)))
    med = {name: [statistics.median(v[i] for v in vals) for i in range(5)] for name, vals in measured.items()}
    base = med["in process"][0]
    return [{"setting": name, "episodes/s": f"{eps:.1f}", "s / iteration": f"{it:.2f}",
             "waiting for episodes s": f"{ro:.2f}", "update s": f"{up:.2f}", "max staleness": f"{st:.0f}",
             "vs in process": f"{eps / base:.2f}x"} for name, (eps, it, ro, up, st) in med.items()]


def bench_vllm(python: str, repeats: int) -> list[dict[str, str]]:
    """Tokens/s and episodes/s of the project's sampler and of vLLM, taking turns in each repeat."""
    import envs
    from agents.engines.vllm_client import VLLMSampler

    path = build_tiny_model("text")
    policy = Policy.from_pretrained(path)
    env = envs.make(LAKE)
    prompts = []
    for seed in range(64):
        obs, _ = env.reset(seed=seed)
        prompts.append(policy.chat.first_message(obs["text"], []))
    env.close()
    sampler = VLLMSampler(path, eos_token_id=policy.eos_token_id, python=python, max_model_len=1024)
    rollout = RolloutSettings(LAKE, {"feedback": False}, "window:0", group_size=8, max_new_tokens=6,
                            max_context_tokens=1024)
    names = {"project sampler (torch, this process)": policy, "vLLM (CPU build, its own process)": sampler}
    runners = {name: rollout.runner(policy, seed=0, sampler=None if gen is policy else gen) for name, gen in names.items()}
    tokens: dict[str, list[float]] = {name: [] for name in names}
    episodes: dict[str, list[float]] = {name: [] for name in names}
    try:
        for name, gen in names.items():  # warm-up
            gen.generate(prompts, max_new_tokens=32)
            runners[name].collect(range(8), policy_version=0)
        for r in range(repeats):
            for name, gen in names.items():
                torch.manual_seed(r)
                t0 = time.perf_counter()
                out = gen.generate(prompts, max_new_tokens=32)
                tokens[name].append(sum(len(g.token_ids) for g in out) / (time.perf_counter() - t0))
                stats = runners[name].collect(range(100 * (r + 1), 100 * (r + 1) + 8), policy_version=0)[1]
                episodes[name].append(stats["episodes_per_s"])
    finally:
        for runner in runners.values():
            runner.close()
        sampler.close()
    first = next(iter(names))
    base_tok, base_eps = statistics.median(tokens[first]), statistics.median(episodes[first])
    return [{"sampler": name, "generated tokens/s (64 x 32)": f"{statistics.median(tokens[name]):,.0f}",
             "vs project": f"{statistics.median(tokens[name]) / base_tok:.2f}x",
             "FrozenLake 8 x 8 episodes/s": f"{statistics.median(episodes[name]):.1f}",
             "episodes vs project": f"{statistics.median(episodes[name]) / base_eps:.2f}x"} for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency-ms", default="50", help="comma-separated retrieval latencies per request")
    parser.add_argument("--tasks", type=int, default=8, help="B")
    parser.add_argument("--group-size", type=int, default=4, help="G")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=6, help="train.py iterations per training row")
    parser.add_argument("--train-rounds", type=int, default=2, help="rounds of the three training runs")
    parser.add_argument("--train-latency-ms", type=float, default=50.0, help="the latency of the training table")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-python", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    threads = configure_threads(None)
    print(f"start: {load()}; torch {torch.__version__}, {threads} torch thread(s) per process")
    from agents.rollout.workers import ray_init

    ray_init(num_cpus=4)  # logical CPUs: three collectors' workers alive at once
    with tempfile.TemporaryDirectory() as tmp:
        for latency in [float(x) for x in args.latency_ms.split(",")]:
            proc, url = start_server(latency)
            try:
                env_kwargs = {"retrieval_url": url, "max_turns": 4, "max_searches": 4, "topk": 2, "passage_chars": 150}
                rollout = RolloutSettings(SEARCH, env_kwargs, "window:0",
                                        group_size=args.group_size, max_new_tokens=10, max_context_tokens=1024)
                model = searching_model(Path(tmp) / "searcher", rollout)
                print(f"## Collection: SearchQA, {args.tasks} x {args.group_size} episodes, 4 searching turns, "
                      f"retrieval latency {latency:.0f} ms per request ({load()})\n")
                table(bench_collect(model, rollout, args.tasks, args.repeats))
                if not args.skip_train and latency == args.train_latency_ms:
                    print(f"## Training: {args.iterations} iterations x {args.train_rounds} rounds, same task and "
                          f"model, retrieval latency {latency:.0f} ms ({load()})\n")
                    table(bench_train(model, rollout, args.tasks, args.iterations, Path(tmp) / f"runs{latency:.0f}",
                                      args.train_rounds))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    if not args.skip_vllm:
        from agents.engines.vllm_client import default_vllm_python

        print(f"## Sampler: vLLM vs the project's, tiny text model ({load()})\n")
        table(bench_vllm(args.vllm_python or default_vllm_python(), args.repeats))
    print(f"end: {load()}")


if __name__ == "__main__":
    main()
