"""How SearchQA's pretraining teaches the tiny model to copy, measured as it goes.

    python -m experiments.searchqa.search_pretrain_curve --steps 800 --every 200 --batch 16 --episodes 100

Pretrains the embedded tiny text model on SearchQA's own transitions (``learner.pretrain``,
the recipe's flags) and, at step 0 and every ``--every`` steps, plays ``--episodes`` held-out
episodes with the policy as it is (sampled, as an evaluation at the start of RL would) and
prints: exact match with its 95% interval, invalid replies, the share of searches that are a
verbatim part of the question and of answers found verbatim in the passages seen
(``search_copy_probe``), and the held-out dynamics exact rate (the titles a search returns,
written exactly: a copy of the names in the query). ``--save`` keeps the last model for
``train.py --model DIR --pretrain-steps 0``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--every", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dynamics", type=float, default=0.5)
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--shared-tokenizer", action="store_true",
                        help="start from the tiny model every task shares (512 tokens) instead of SearchQA's own "
                             "(agents.policies.tiny.task_model: a tokenizer that learned the knowledge base's names)")
    parser.add_argument("--model", default=None, help="start from this model folder (e.g. an earlier --save)")
    parser.add_argument("--save", default=None, metavar="DIR")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from agents.evaluate import evaluate, wilson_interval
    from agents.policies.policy import Policy
    from agents.rollout.runner import default_env_kwargs
    from agents.policies.tiny import build_tiny_model, task_model
    from experiments.searchqa.search_copy_probe import probe_records
    from learner.pretrain import PretrainSettings, exact_rate, held_out_dynamics, pretrain

    env_id = "freshper/SearchQA-v0"
    kwargs = default_env_kwargs(env_id, "window:0")
    base = Path(args.model) if args.model else (
        build_tiny_model("text", seed=args.seed) if args.shared_tokenizer else task_model(env_id, kwargs, seed=args.seed))
    policy = Policy.from_pretrained(base)
    exact_set = held_out_dynamics(env_id, kwargs, args.seed, False, streams=32, rounds=2)
    rows: list[dict] = []
    start = time.monotonic()

    def measure(step: int) -> None:
        ev = evaluate(policy, env_id, episodes=args.episodes, env_kwargs=kwargs, max_new_tokens=args.max_new_tokens)
        cp = probe_records(ev.records)
        wins = round(ev.success_rate * ev.episodes)
        row = {"step": step, "seconds": round(time.monotonic() - start, 1), "em": ev.success_rate,
               "em_ci": wilson_interval(wins, ev.episodes), "invalid": ev.invalid_reply_rate,
               "query_in_question": cp["query_in_question"], "answer_in_passages": cp["answer_in_passages"],
               "searches": cp["searches"], "answers": cp["answers"], "titles_exact": exact_rate(policy, exact_set)}
        rows.append(row)
        print(f"{step:>6} {row['seconds']:>8} {row['em']:>6.3f} [{row['em_ci'][0]:.3f}, {row['em_ci'][1]:.3f}] "
              f"{row['invalid']:>7.2f} {row['query_in_question']:>9.2f} ({cp['searches']:>3}) "
              f"{row['answer_in_passages']:>9.2f} ({cp['answers']:>3}) {row['titles_exact']:>12.2f}", flush=True)

    print(f"{env_id}: {base.name} ({len(policy.tokenizer)} tokens), batch {args.batch}, lr {args.lr}, "
          f"dynamics share {args.dynamics}, {args.episodes} held-out episodes")
    print(f"{'step':>6} {'seconds':>8} {'EM':>6} {'95% CI':>14} {'invalid':>7} {'query in q':>15} "
          f"{'answer in p':>15} {'titles exact':>12}")
    measure(0)
    torch.manual_seed(args.seed)
    cfg = PretrainSettings(steps=args.steps, batch=args.batch, lr=args.lr, dynamics_fraction=args.dynamics)
    pretrain(policy, env_id, kwargs, cfg, seed=args.seed,
             on_step=lambda step, st: measure(step + 1) if (step + 1) % args.every == 0 else None)
    if args.save:
        policy.save_pretrained(args.save)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
