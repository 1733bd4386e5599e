"""What the real-model update experiments start from: the policy (fp32 weights, bf16 compute),
its KL reference (a bf16 copy), 8 Arithmetic problems x 8 samples of up to 16 tokens with their
group advantages, and an Adam that takes no step (learning rate 0), so repeated updates score
the same weights."""

from __future__ import annotations

import os

import torch


def arithmetic_update(model: str, threads: int) -> tuple:
    """``(policy, reference, records, optimizer)``; prints the load average first."""
    from agents.policies.policy import Policy
    from agents.rollout.runner import Runner
    from learner.advantages import assign_group_advantages
    from learner.state import fused_adam

    torch.set_num_threads(threads)
    print(f"load average before: {os.getloadavg()}")
    policy = Policy.from_pretrained(model, dtype="float32", compute_dtype="bfloat16")
    ref = Policy.from_pretrained(model, dtype="bfloat16", compute_dtype="bfloat16")
    ref.model.requires_grad_(False)
    records, _ = Runner(policy, "freshper/Arithmetic-v0", group_size=8, max_new_tokens=16, seed=1).collect(
        list(range(1000, 1008)), policy_version=0)
    assign_group_advantages(records)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    return policy, ref, records, torch.optim.AdamW(params, lr=0.0, fused=fused_adam(params) or None)
