"""Where one real-model update spends its time on the CPU: SmolLM2-135M-Instruct, 8 Arithmetic
problems x 8 samples of up to 16 tokens (the recipe's iteration), one on-policy GRPO update.

    .venv/bin/python experiments/real_model/profile_update.py [--model FOLDER] [--repeats 2] [--profile]

Times the update, alternating, in four settings: bf16 compute over fp32 weights or fp32, each
with the KL reference's forward (kl 0.04, the reference in the compute dtype) and without it
(kl 0). Adam is the run's own (fused above 50M parameters). With ``--profile`` it also prints
the top operators of the bf16 update with the reference, by self CPU time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--attention", action="store_true",
                    help="instead: the bf16 update with the reference under PyTorch's SDPA kernels, eager attention "
                         "and the policy's default (short queries as matrix products)")
    a = ap.parse_args()
    from agents.policies.policy import Policy
    from agents.rollout.runner import Runner
    from learner.advantages import assign_group_advantages
    from learner.loss import LossSettings
    from learner.state import fused_adam
    from learner.update import policy_update

    torch.set_num_threads(a.threads)
    print(f"load average before: {os.getloadavg()}")
    policies = {d: Policy.from_pretrained(a.model, dtype="float32", compute_dtype=d) for d in ("bfloat16", "float32")}
    refs = {d: Policy.from_pretrained(a.model, dtype=d, compute_dtype=d) for d in ("bfloat16", "float32")}
    for ref in refs.values():
        ref.model.requires_grad_(False)
    runner = Runner(policies["float32"], "freshper/Arithmetic-v0", group_size=8, max_new_tokens=16, seed=1)
    records, _ = runner.collect(list(range(1000, 1008)), policy_version=0)
    assign_group_advantages(records)
    for r in records:  # every sample carries a gradient, as in a group with mixed rewards
        r.advantage = 1.0 if r.advantage == 0 else r.advantage
    samples = [s for r in records for s in r.samples]
    print(f"{len(samples)} samples, {sum(len(s.token_ids) for s in samples)} tokens, "
          f"{sum(int(s.loss_mask.sum()) for s in samples)} sampled")
    opts = {}
    for d, pol in policies.items():
        params = [p for p in pol.model.parameters() if p.requires_grad]
        opts[d] = torch.optim.Adam(params, lr=0.0, fused=fused_adam(params) or None)

    def update(d: str, kl: float) -> float:
        t = time.perf_counter()
        policy_update(policies[d], refs[d] if kl else None, opts[d], None, records, np.ones(len(records)),
                      np.zeros(len(records)), loss_cfg=LossSettings(kl_coef=kl), on_policy=True)
        return time.perf_counter() - t

    if a.attention:
        return attention_ab(a, update, policies["bfloat16"], refs["bfloat16"])
    settings = [(d, kl) for d in ("bfloat16", "float32") for kl in (0.04, 0.0)]
    for s in settings:
        update(*s)  # warm-up
    times = {s: [] for s in settings}
    for _ in range(a.repeats):
        for s in settings:
            times[s].append(update(*s))
    base = statistics.median(times[("bfloat16", 0.04)])
    print("| compute | KL reference | update s (median) | vs bf16 with reference |\n|---|---|---:|---:|")
    for (d, kl), ts in times.items():
        print(f"| {d} | {'yes' if kl else 'no'} | {statistics.median(ts):.2f} | {statistics.median(ts) / base:.2f}x |")
    print(f"load average after: {os.getloadavg()}")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            update("bfloat16", 0.04)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def attention_ab(a, update, policy, ref) -> None:
    """The bf16 update with the reference, alternating the attention implementation of both
    models between PyTorch's SDPA, the eager matmul-softmax-matmul and the policy's default
    (agents.policies.attention: the matrix products for short queries on the CPU, SDPA else)."""
    from agents.policies.attention import NAME

    def use(impl: str) -> None:
        for m in (policy.model, ref.model):
            m.set_attn_implementation(impl)

    times: dict[str, list[float]] = {"sdpa": [], "eager": [], NAME: []}
    for impl in times:
        use(impl)
        update("bfloat16", 0.04)  # warm-up
    for _ in range(a.repeats):
        for impl in times:
            use(impl)
            times[impl].append(update("bfloat16", 0.04))
    base = statistics.median(times["sdpa"])
    print("| attention | update s (median) | runs | vs SDPA |\n|---|---:|---|---:|")
    for impl, ts in times.items():
        print(f"| {impl} | {statistics.median(ts):.2f} | {', '.join(f'{t:.2f}' for t in ts)} | {statistics.median(ts) / base:.2f}x |")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
