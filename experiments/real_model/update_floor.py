"""How far one real-model update is from what the CPU can do: SmolLM2-135M-Instruct in fp32
(what ``--dtype auto`` picks on a CPU without bf16 units), 8 Arithmetic problems x 8 samples of
up to 16 tokens (the recipe's iteration), one on-policy GRPO update with the KL reference and
one replay update of 16 of those samples, as the learner runs them (its own scoring path).

    .venv/bin/python experiments/real_model/update_floor.py --model FOLDER [--threads 2] [--repeats 3]

For each update it prints the wall time, the time PyTorch's profiler puts in matrix products
(``aten::mm``/``addmm``/``bmm``) with their floating-point operations, the time in Adam's
fused step, in the fused attention kernels, and what is left of the wall time; then the matrix-product rate this CPU reaches
on the model's own shapes alone, and the update's floor: its matrix-product FLOPs at the better
of that rate and the update's own, plus Adam's step timed alone. ``wall / floor`` says how much
of an update is left to remove without removing work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ADAM_OPS = ("aten::_fused_adam_", "aten::_fused_adamw_")


def peak_gflops(hidden: int, inter: int, tokens: int, threads: int, seconds: float = 2.0) -> float:
    """GFLOP/s of fp32 matrix products of the model's own projections over ``tokens`` rows,
    forward shapes and the two backward ones, best of three rounds."""
    torch.set_num_threads(threads)
    shapes = [(tokens, hidden, inter), (tokens, inter, hidden), (tokens, hidden, hidden)]
    best = 0.0
    for _ in range(3):
        flops, t0 = 0.0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            for m, k, n in shapes:
                a, w, g = torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)
                torch.mm(a, w)  # forward
                torch.mm(g, w.t())  # the input's gradient
                torch.mm(a.t(), g)  # the weight's gradient
                flops += 3 * 2 * m * k * n
        best = max(best, flops / (time.perf_counter() - t0) / 1e9)
    return best


def adam_step_seconds(model: torch.nn.Module, repeats: int = 5) -> float:
    """Median seconds of one fused Adam step over every trained parameter (gradients of ones)."""
    from learner.state import fused_adam

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=0.0, fused=fused_adam(params) or None)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    for p in params:
        p.grad = None
    return statistics.median(times)


def split(prof) -> dict[str, float]:
    """Seconds of self CPU time in matrix products, in Adam's step and in the fused attention
    kernels (whose FLOPs the profiler does not count), and the products' FLOPs."""
    out = {"matmul": 0.0, "adam": 0.0, "attention": 0.0, "flops": 0.0}
    for e in prof.key_averages():
        s = e.self_cpu_time_total / 1e6
        if e.key in MATMUL_OPS:
            out["matmul"] += s
            out["flops"] += e.flops or 0
        elif e.key in ADAM_OPS:
            out["adam"] += s
        elif "scaled_dot_product" in e.key:  # the fused attention kernels, forward and backward
            out["attention"] += s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from agents.policies.policy import Policy
    from agents.rollout.runner import Runner
    from learner.advantages import assign_group_advantages
    from learner.loss import LossSettings
    from learner.prefix import common_prefix_length, group_prompts, prompt_lengths, scored_tokens, scoring_path
    from learner.state import fused_adam
    from learner.update import policy_update

    torch.set_num_threads(a.threads)
    print(f"load average before: {os.getloadavg()}")
    policy = Policy.from_pretrained(a.model, dtype="float32", compute_dtype="float32")
    ref = Policy.from_pretrained(a.model, dtype="float32", compute_dtype="float32")
    ref.model.requires_grad_(False)
    records, _ = Runner(policy, "freshper/Arithmetic-v0", group_size=8, max_new_tokens=16, seed=1).collect(
        list(range(1000, 1008)), policy_version=0)
    assign_group_advantages(records)
    for r in records:  # every sample carries a gradient, as in a group with mixed rewards
        r.advantage = 1.0 if r.advantage == 0 else r.advantage
    samples = [s for r in records for s in r.samples]
    replay = records[::4]
    print(f"{len(samples)} samples, {sum(len(s.token_ids) for s in samples)} tokens, "
          f"{sum(int(s.loss_mask.sum()) for s in samples)} sampled; scoring path: {scoring_path(policy, samples)}")
    ids = [np.asarray(s.token_ids) for s in samples]
    prompts, _ = group_prompts(ids, prompt_lengths(samples))
    print(f"the on-policy pack: {scored_tokens(samples)[1]} tokens, a shared header of "
          f"{common_prefix_length(prompts)} and {len(prompts)} distinct prompts of {sorted({len(p) for p in prompts})} "
          f"tokens (the cached passes would run {scored_tokens(samples)[0]})")
    params = [p for p in policy.model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=0.0, fused=fused_adam(params) or None)

    def on_policy() -> None:
        for s in samples:
            s.reference_logprobs = None  # the on-policy update runs the reference itself
        policy_update(policy, ref, opt, None, records, np.ones(len(records)), np.zeros(len(records)),
                      loss_cfg=LossSettings(kl_coef=0.04), on_policy=True, keep_reference_logprobs=True)

    def replayed() -> None:
        policy_update(policy, ref, opt, None, replay, np.ones(len(replay)), np.ones(len(replay)),
                      loss_cfg=LossSettings(kl_coef=0.04), on_policy=False, keep_reference_logprobs=True)

    rows = []
    for name, fn in (("on-policy, 64 samples, KL reference run", on_policy),
                     ("replay, 16 samples, reference log-probs kept", replayed)):
        fn()  # warm-up
        walls = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - t)
        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
            fn()
        rows.append((name, statistics.median(walls), split(prof)))
    cfg = policy.model.config
    peak = peak_gflops(cfg.hidden_size, cfg.intermediate_size, 1024, a.threads)
    adam = adam_step_seconds(policy.model)
    print(f"matrix products alone on the model's shapes: {peak:.0f} GFLOP/s; fused Adam's step alone: {adam:.3f} s "
          f"({sum(p.numel() for p in params) / 1e6:.1f}M parameters)")
    print("| update | wall s (median) | in matrix products s | their GFLOP | their GFLOP/s | Adam s "
          "| attention s | the rest s | floor s | wall / floor |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, wall, s in rows:
        gflops = s["flops"] / 1e9
        rate = gflops / max(s["matmul"], 1e-9)
        floor = gflops / max(peak, rate) + adam
        print(f"| {name} | {wall:.2f} | {s['matmul']:.2f} | {gflops:.0f} | {rate:.0f} | {s['adam']:.2f} | "
              f"{s['attention']:.2f} | {max(wall - s['matmul'] - s['adam'] - s['attention'], 0.0):.2f} | {floor:.2f} | "
              f"{wall / floor:.2f} |")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
