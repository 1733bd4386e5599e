"""The shared tiny tokenizer against a task's own (``agents.policies.tiny.task_model``), side by side.

    python -m benchmarks.task_tokenizer_bench --env-id freshper/SearchQA-v0 --questions 200 --steps 10 --rounds 3 --threads 1

For the task's embedded model built both ways (the 512-token BPE every task shares, and the one
that also learned the task's ``tokenizer_text``), prints: tokens per gold answer of
``--questions`` held-out tasks (where the task has ``golden_answers``), tokens per prompt of 128
random-play transitions (what the pretraining and the policy read), and the median seconds per
pretraining step (``learner.pretrain``, ``--batch`` examples), the two models taking turns for
``--rounds`` rounds so they share the machine's load; the first step of each round warms up and
is left out. Ratios are task / shared.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-id", default="freshper/SearchQA-v0")
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per model and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.steps < 2 or args.rounds < 1:
        parser.error("--steps must be >= 2 and --rounds >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    import envs
    from agents.rollout.seeds import EVAL_SEED_BASE
    from agents.policies.policy import Policy
    from agents.rollout.runner import default_env_kwargs
    from agents.policies.tiny import build_tiny_model, task_model
    from benchmarks.pretrain_speed import interleaved_step_seconds
    from learner.pretrain import PretrainSettings, TransitionStreams

    kwargs = default_env_kwargs(args.env_id, "window:0")
    bases = {"shared": build_tiny_model(envs.task_spec(args.env_id).modality), "task": task_model(args.env_id, kwargs)}
    if bases["shared"] == bases["task"]:
        parser.error(f"{args.env_id} has no text of its own (tokenizer_text is empty): one tokenizer only")
    policies = {name: Policy.from_pretrained(path) for name, path in bases.items()}

    env = envs.make(args.env_id, **kwargs)
    answers = []
    for k in range(args.questions):
        env.reset(seed=EVAL_SEED_BASE + k)
        if hasattr(env.unwrapped, "question"):  # SearchQA's tasks: their gold answers
            answers += list(env.unwrapped.question.golden_answers)
    env.close()
    streams = TransitionStreams(args.env_id, kwargs, 64, 104_729, 0.5, False)
    prompts = [ex.text for _ in range(2) for ex in streams.examples()]
    streams.close()

    rows: dict[str, dict[str, float]] = {}
    for name, policy in policies.items():
        tok = policy.tokenizer
        rows[name] = {"vocab": len(tok),
                      "answer": float(np.mean([len(tok(f" {a}")["input_ids"]) for a in answers])) if answers else float("nan"),
                      "prompt": float(np.mean([len(policy.chat.first_message(p, [])) for p in prompts]))}

    jobs = {name: (policy, PretrainSettings(steps=args.steps, batch=args.batch)) for name, policy in policies.items()}
    per_step = interleaved_step_seconds(jobs, args.env_id, kwargs, args.rounds)
    for name in policies:
        rows[name]["step_s"] = float(np.median(per_step[name]))

    print(f"{args.env_id}: {len(answers)} gold answers of {args.questions} held-out tasks, {len(prompts)} random-play "
          f"prompts, pretraining batch {args.batch}, {args.rounds} rounds of {args.steps} steps each")
    print(f"{'tokenizer':<10} {'vocab':>6} {'tokens/answer':>14} {'tokens/prompt':>14} {'s/step':>8}")
    for name, r in rows.items():
        print(f"{name:<10} {r['vocab']:>6} {r['answer']:>14.2f} {r['prompt']:>14.1f} {r['step_s']:>8.3f}")
    s, t = rows["shared"], rows["task"]
    print(f"{'task/shared':<10} {'':>6} {t['answer'] / s['answer']:>14.2f} {t['prompt'] / s['prompt']:>14.2f} "
          f"{t['step_s'] / s['step_s']:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
