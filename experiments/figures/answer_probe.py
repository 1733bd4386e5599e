"""Can the tiny VLM learn a figure task's answers at all? Supervised probe on the right answers.

    python experiments/figures/answer_probe.py --model .cache/freshper/pretrained-ChartQA-v0-s0-<key> \\
        --steps 300 --every 50 --json out.json
    python experiments/figures/answer_probe.py --model ... --think   # the figure in words, then the answer

Trains a start model (``--model``: e.g. the cached pretrained start of ``configs/chartqa_grid.yaml``)
on first-turn replies that give the right answer (``<answer>3</answer>``, or with ``--think`` the
figure in words first, as ``--reasoning state`` writes it), and every ``--every`` steps measures
greedy first-turn accuracy on held-out problems by question kind, with the true picture and with
another problem's picture. It separates what RL must discover from what the model can represent:
if supervised answers do not rise above the picture-blind rate, no reward will teach them.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch


def problems(env_id: str, kwargs: dict, seeds: range, kinds: tuple[str, ...] = ()) -> list[dict]:
    """First-turn prompts of the seeds' episodes (those whose question is of ``kinds``, all
    where empty): text, picture, answer, kind, statement."""
    import envs

    env = envs.make(env_id, **kwargs)
    out = []
    try:
        for seed in seeds:
            obs, _ = env.reset(seed=seed)
            task = env.unwrapped
            q = task.problem.params["question"]["type"]
            if kinds and q not in kinds:
                continue
            out.append({"text": obs["text"], "image": np.asarray(obs["image"], dtype=np.uint8),
                        "answer": task.problem.answer.text(), "kind": q, "statement": task.problem.statement})
    finally:
        env.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-id", default="freshper/ChartQA-v0")
    parser.add_argument("--env-kwargs", type=json.loads, default={"preset": "grid", "image_size": [140, 140]})
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--held-out", type=int, default=256)
    parser.add_argument("--kinds", default="", help="only these question kinds, comma-separated (e.g. value)")
    parser.add_argument("--think", action="store_true", help="targets write the figure in words before the answer")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from agents.policies.policy import Policy
    from learner.pretrain import Example, encode
    from learner.update import supervised_step

    policy = Policy.from_pretrained(args.model)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    held = problems(args.env_id, args.env_kwargs, range(900_000, 900_000 + args.held_out), kinds)
    swapped = [dict(p, image=held[(i + 1) % len(held)]["image"]) for i, p in enumerate(held)]

    def target(p: dict) -> str:
        answer = f"<answer>{p['answer']}</answer>"
        return f"<think>{p['statement']}</think>{answer}" if args.think else answer

    def accuracy(items: list[dict]) -> dict[str, float]:
        longest = 40 if args.think else 8
        gens = policy.generate([policy.chat.first_message(p["text"], [p["image"]]) for p in items],
                               [[p["image"]] for p in items], max_new_tokens=longest, greedy=True)
        right: dict[str, list[bool]] = defaultdict(list)
        for g, p in zip(gens, items):
            found = re.findall(r"<answer>(.*?)</answer>", policy.reply_text(g.token_ids))
            ok = bool(found) and found[-1].strip() == p["answer"]
            right[p["kind"]].append(ok)
            right["all"].append(ok)
        return {k: float(np.mean(v)) for k, v in right.items()}

    rows = []
    start = time.monotonic()

    def measure(step: int) -> None:
        policy.model.eval()
        true, other = accuracy(held), accuracy(swapped)
        rows.append({"step": step, "seconds": round(time.monotonic() - start, 1), "true": true, "swapped": other})
        kinds = sorted(k for k in true if k != "all")
        print(f"{step:>5} {rows[-1]['seconds']:>7} all {true['all']:.3f} (swapped {other['all']:.3f}) "
              + " ".join(f"{k} {true[k]:.2f}/{other[k]:.2f}" for k in kinds), flush=True)

    print(f"{args.env_id} {args.env_kwargs}: batch {args.batch}, lr {args.lr}, think {args.think}; "
          "held-out first-turn greedy accuracy, true picture / another problem's picture")
    measure(0)
    optimizer = torch.optim.Adam(list(policy.model.parameters()), lr=args.lr)
    torch.manual_seed(0)
    seed = 0
    for step in range(args.steps):
        batch: list[dict] = []
        while len(batch) < args.batch:
            batch += problems(args.env_id, args.env_kwargs, range(seed, seed + args.batch - len(batch)), kinds)
            seed += args.batch
        samples, images = encode(policy, [Example(p["text"], [p["image"]], target(p), "format") for p in batch])
        supervised_step(policy, optimizer, samples, images)
        if (step + 1) % args.every == 0:
            measure(step + 1)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
