"""Where one real-model rollout spends its CPU time: SmolLM2-135M-Instruct sampling 64 Arithmetic
prompts x up to 16 tokens (the recipe's batch), bf16 weights, one batched ``Policy.generate``.

    .venv/bin/python -m experiments.real_model.profile_rollout [--model FOLDER] [--threads 1]

Prints the top operators by self CPU time of one generation after a warm-up one.
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=16)
    a = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from agents.policies.policy import Policy
    from benchmarks.real_rollout_bench import prompts

    torch.set_num_threads(a.threads)
    policy = Policy.from_pretrained(a.model, dtype="bfloat16")
    batch = prompts(policy, 64)
    policy.generate(batch, max_new_tokens=a.new_tokens)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        gens = policy.generate(batch, max_new_tokens=a.new_tokens)
    print(f"64 prompts, {sum(len(g.token_ids) for g in gens)} sampled tokens, {a.threads} thread(s)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
