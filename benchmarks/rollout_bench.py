"""Rollout throughput of the runner on the tiny models: B x G = 8 x 8 FrozenLake episodes.

    .venv/bin/python benchmarks/rollout_bench.py [--repeats 3] [--threads 1] [--max-new-tokens 6]

Prints episodes/s, generated tokens/s and the wall-time split generation / env / tokenization
for the tiny text model (FrozenLake, window:0 and full) and the tiny VLM (FrozenLakeVision).
The untrained models reply at random, so every episode runs its full 8 turns and every reply
its full ``max_new_tokens``: a worst case for a trained policy's 4-token replies.
"""

from __future__ import annotations

import argparse
import statistics

from agents.policies.policy import Policy, configure_threads
from agents.rollout.runner import Runner
from agents.policies.tiny import build_tiny_model

CASES = [
    ("text", "freshper/FrozenLake-v0", "window:0"),
    ("text", "freshper/FrozenLake-v0", "full"),
    ("vision", "freshper/FrozenLakeVision-v0", "window:0"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tasks", type=int, default=8, help="B")
    parser.add_argument("--group-size", type=int, default=8, help="G")
    parser.add_argument("--max-new-tokens", type=int, default=6)
    args = parser.parse_args()
    threads = configure_threads(args.threads)
    print(f"torch threads: {threads}; B x G = {args.tasks} x {args.group_size}; max_new_tokens {args.max_new_tokens}")
    print("| model | task | context | episodes/s | gen tokens/s | s / collect | generation s | env s | tokenization s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for modality, env_id, context in CASES:
        policy = Policy.from_pretrained(build_tiny_model(modality))
        runner = Runner(policy, env_id, group_size=args.group_size, context=context,
                        max_new_tokens=args.max_new_tokens)
        runner.collect(range(args.tasks), policy_version=0)  # warm-up
        runs = [runner.collect(range(1000 * (r + 1), 1000 * (r + 1) + args.tasks), policy_version=0)[1]
                for r in range(args.repeats)]
        med = {k: statistics.median(s[k] for s in runs) for k in runs[0]}
        print(f"| tiny {modality} | {env_id.split('/')[1]} | {context} | {med['episodes_per_s']:.1f} | "
              f"{med['tokens_per_s']:.0f} | {med['wall_s']:.2f} | {med['generation_s']:.2f} | "
              f"{med['env_s']:.3f} | {med['tokenization_s']:.3f} |")
        runner.close()


if __name__ == "__main__":
    main()
