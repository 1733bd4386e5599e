"""How likely a real model is to write a negative answer: for held-out Arithmetic problems whose
answer is below zero, the probability the policy gives the minus sign right after ``<answer>``
(teacher-forced on the task's well-formed reply), beside the probability of the whole right reply.

    .venv/bin/python -m experiments.real_model.negative_probe --model FOLDER [--model FOLDER2 ...]
        [--problems 128] [--direct] [--system-prompt TEXT]

Prints, per model, over the problems with a negative answer and those with a non-negative one:
the mean probability of the first answer character being ``-`` and the median log-probability of
the right reply. A policy that samples 8 replies a problem finds a right negative answer in a
group with probability ~ 1 - (1 - p)^8. With ``--direct`` it also asks each model the
negative-answer problems as the own-answer warm-up does (greedy, "reply with only the final
answer") and counts the replies holding a minus sign and the right answer: what the warm-up
would teach. ``--system-prompt`` replaces the chat template's default system prompt for every
model (``train.py --system-prompt``).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--problems", type=int, default=400)
    ap.add_argument("--first-seed", type=int, default=1_900_000_000, help="the held-out seeds' start")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--direct", action="store_true",
                    help="also ask each model the negative-answer problems directly (the own-answer warm-up's question, "
                         "greedy) and count the replies that hold a minus sign and the right answer")
    ap.add_argument("--system-prompt", default=None, help="a system prompt for every model (default: the template's)")
    a = ap.parse_args()
    from agents.policies.policy import Policy
    from agents.record import Sample
    from envs import make

    torch.set_num_threads(a.threads)
    env = make("freshper/Arithmetic-v0")
    problems = []
    for k in range(a.problems):
        obs, info = env.reset(seed=a.first_seed + k)
        problems.append((obs["text"] if isinstance(obs, dict) else obs, info["gold_answer"]))
    task = env.unwrapped
    for folder in a.model:
        policy = Policy.from_pretrained(folder, compute_dtype="float32")
        if a.system_prompt is not None:
            policy.set_system_prompt(a.system_prompt)
        minus_id = policy.encode_reply("-")[:-1]
        rows = {"negative": [], "non-negative": []}
        for text, gold in problems:
            prompt = policy.chat.first_message(text)
            reply = policy.encode_reply(task.format_reply(gold))
            head = policy.encode_reply(task.format_reply(gold).split(gold)[0])[:-1]  # without its EOS
            ids = np.asarray(prompt + reply)
            mask = np.zeros(len(ids), np.float32)
            mask[len(prompt):] = 1
            s = Sample(token_ids=ids, loss_mask=mask, behavior_logprobs=np.zeros(len(ids), np.float32))
            with torch.no_grad():
                lp = policy.token_logprobs([s])[0].numpy()
                at = len(prompt) + len(head)  # the first answer token's position
                logits = policy.model(input_ids=torch.as_tensor(ids[None, :at])).logits[0, -1]
                probs = torch.softmax(logits.float(), -1)
            p_minus = float(probs[minus_id[0]])
            kind = "negative" if gold.startswith("-") else "non-negative"
            rows[kind].append((p_minus, float(lp[len(prompt):].sum())))
        print(f"model {folder}", flush=True)
        for kind, vals in rows.items():
            if vals:
                pm = [v[0] for v in vals]
                lr = [v[1] for v in vals]
                print(f"  {kind:>12}: {len(vals):3d} problems, P(first answer char '-') mean {statistics.mean(pm):.4f} "
                      f"max {max(pm):.4f}; right reply log-prob median {statistics.median(lr):.2f} "
                      f"(p {np.exp(statistics.median(lr)):.4f})", flush=True)
        if a.direct:
            from learner.warmup import DIRECT_SUFFIX, DIRECT_TOKENS, answer_span

            negative = [(text, gold) for text, gold in problems if gold.startswith("-")]
            gens = policy.generate([policy.chat.first_message(text + DIRECT_SUFFIX) for text, _ in negative],
                                   max_new_tokens=DIRECT_TOKENS, greedy=True)
            replies = [policy.reply_text(g.token_ids) for g in gens]
            spans = [answer_span(r) for r in replies]
            print(f"  direct answers to the {len(negative)} negative problems: "
                  f"{sum('-' in (s or '') for s in spans)} hold a minus sign, "
                  f"{sum(s == gold for s, (_, gold) in zip(spans, negative))} right; e.g. "
                  + "; ".join(f"{text.rsplit(':', 1)[-1].strip()!r} -> {r!r}" for (text, _), r in list(zip(negative, replies))[:4]),
                  flush=True)


if __name__ == "__main__":
    main()
