"""Does a SearchQA policy's answer depend on the passages in front of it?

    python experiments/searchqa/search_answer_probe.py MODEL_DIR [MODEL_DIR ...] --questions 100

For each held-out question (from the first evaluation seed on) the probe searches for the whole
question, takes the names, places and years of the best passage that share no word with the
question (``unasked_candidates``; questions with fewer than two are skipped), and as many from
*another* question's best passage, and scores ``<answer>X</answer>`` for every one of them in
the ``window:0`` prompt (``learner.diagnostics.action_probabilities``, renormalised over the
set). A policy that reads the passage puts its mass on the passage's own candidates (towards 1);
a blind one puts the uniform share there. Also: how often the gold answer is among the own
candidates, and how often the policy ranks it first among them (a type-blind pick: 1/n).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import envs
from agents.policies.policy import Policy
from envs.search.env import unasked_candidates
from learner.diagnostics import action_probabilities
from agents.rollout.seeds import EVAL_SEED_BASE


def best_passage_candidates(task) -> list[str]:
    return list(dict.fromkeys(unasked_candidates(task._top_text, task.question.question)))


def states(n: int) -> list[tuple[str, list[str], str]]:
    """``n`` (observation after a search for the whole question, own candidates, gold answer)."""
    env = envs.make("freshper/SearchQA-v0")
    out, k = [], 0
    try:
        while len(out) < n:
            env.reset(seed=EVAL_SEED_BASE + k)
            k += 1
            task = env.unwrapped
            obs, *_ = env.step(f"<search>{task.question.question.rstrip('?')}</search>")
            own = best_passage_candidates(task)
            if len(own) >= 2:
                out.append((obs["text"], own, task.question.golden_answers[0]))
    finally:
        env.close()
    return out


def probe(model, cases: list[tuple[str, list[str], str]]) -> dict[str, float]:
    """The probe's figures for ``model`` (a folder or a loaded ``Policy``) on ``cases``."""
    policy = model if isinstance(model, Policy) else Policy.from_pretrained(model)
    mass, share, ranks = [], [], []
    for i, (text, own, gold) in enumerate(cases):
        other = [x for x in cases[(i + 1) % len(cases)][1] if x not in own][:len(own)]
        p = action_probabilities(policy, [(text, [])], [f"<answer>{x}</answer>" for x in own + other])[0]
        mass.append(p[:len(own)].sum())
        share.append(len(own) / (len(own) + len(other)))
        if gold in own:
            ranks.append(own[int(np.argmax(p[:len(own)]))] == gold)
    return {"own_mass": float(np.mean(mass)), "uniform_share": float(np.mean(share)), "questions": len(cases),
            "gold_among_own": len(ranks), "gold_first": float(np.mean(ranks)) if ranks else float("nan"),
            "own_candidates": float(np.mean([len(c[1]) for c in cases]))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = states(args.questions)
    print(f"{'model':<60} {'own mass':>9} {'uniform':>8} {'gold among own':>15} {'gold first':>11} {'own cands':>10}")
    for model in args.models:
        r = probe(model, cases)
        print(f"{str(model)[-60:]:<60} {r['own_mass']:>9.3f} {r['uniform_share']:>8.3f} "
              f"{r['gold_among_own']:>15d} {r['gold_first']:>11.2f} {r['own_candidates']:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
