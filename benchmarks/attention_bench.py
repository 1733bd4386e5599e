"""Short-query attention (agents/policies/attention.py) against transformers' ``sdpa`` on the CPU,
forward and backward, on the shapes of the learner's and the sampler's passes.

    .venv/bin/python -m benchmarks.attention_bench [--repeats 7] [--threads 2]

Shapes are SmolLM2-135M's heads (9 query heads, 3 key/value heads, 64 dimensions) in bf16:
the shared prompt header (1 row of 60 tokens), each distinct prompt's remainder on the header's
cache (8 x 12 on 72), every sample's reply on its prompt's cache (64 x 16 on 96, and 16 x 16 on
96 for a replay batch), one decoding step (64 x 1 on 90), and a packed pass of the
gradient-checkpointed path (1 x 1,024 on 1,024, which ``short_attention`` hands to ``sdpa``).
Masks are the boolean ones transformers builds (causal, the first rows left-padded). The two arms
alternate; medians of ``--repeats`` (the first round is a warm-up) and the ratio are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from types import SimpleNamespace

import torch

SHAPES = {  # name: (rows, query tokens, key tokens)
    "header": (1, 60, 60),
    "prompt remainders": (8, 12, 72),
    "on-policy replies": (64, 16, 96),
    "replay replies": (16, 16, 96),
    "decoding step": (64, 1, 90),
    "packed pass": (1, 1024, 1024),
}
HEADS, KV_HEADS, DIM = 9, 3, 64


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from agents.policies.attention import short_attention

    torch.set_num_threads(a.threads)
    module = SimpleNamespace(is_causal=True, num_key_value_groups=HEADS // KV_HEADS)
    print(f"load average before: {os.getloadavg()}; {a.threads} threads, bf16")
    print("| pass | rows x query on keys | grad | sdpa ms | short ms | short / sdpa |\n|---|---|---|---:|---:|---:|")
    for name, (rows, q_len, k_len) in SHAPES.items():
        mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)[None, None].repeat(rows, 1, 1, 1)
        mask[: max(1, rows // 4), :, :, :3] = False  # left padding
        grad = q_len > 1
        q = torch.randn(rows, HEADS, q_len, DIM, dtype=torch.bfloat16, requires_grad=grad)
        k = torch.randn(rows, KV_HEADS, k_len, DIM, dtype=torch.bfloat16, requires_grad=grad)
        v = torch.randn(rows, KV_HEADS, k_len, DIM, dtype=torch.bfloat16, requires_grad=grad)
        weights = torch.rand(rows, q_len, HEADS, DIM, dtype=torch.bfloat16)
        times: dict[str, list[float]] = {"sdpa": [], "short": []}
        for _ in range(a.repeats + 1):
            for arm, fn in (("sdpa", sdpa_attention_forward), ("short", short_attention)):
                t = time.perf_counter()
                with torch.set_grad_enabled(grad):
                    out, _ = fn(module, q, k, v, mask, scaling=DIM ** -0.5)
                    if grad:
                        (out * weights).sum().backward()
                times[arm].append(time.perf_counter() - t)
                q.grad = k.grad = v.grad = None
        med = {arm: statistics.median(ts[1:]) * 1e3 for arm, ts in times.items()}
        print(f"| {name} | {rows} x {q_len} on {k_len} | {'forward + backward' if grad else 'forward'} | "
              f"{med['sdpa']:.2f} | {med['short']:.2f} | {med['short'] / med['sdpa']:.2f}x |", flush=True)
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
