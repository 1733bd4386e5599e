"""The fused LM head against the ordinary one: log-probs of chosen tokens from last hidden states,
forward and backward, at real models' head sizes.

    .venv/bin/python -m benchmarks.head_bench [--rows 640,2560] [--repeats 5] [--threads 2]

The ordinary path is what the learner ran before :mod:`agents.policies.head`: the head's
``Linear`` under bf16 autocast over fp32 weights, then
:meth:`agents.policies.policy.Policy.logprobs_of` on the logits (an fp32 copy, ``logsumexp``,
``gather``; above 64M elements in checkpointed row chunks). The fused path is
:func:`agents.policies.head.head_logprobs`. Both take a weighted sum of the log-probs and its
backward pass into the hidden states and the head's weight; the two arms alternate, the median of
``--repeats`` is printed with the ratio and the largest difference of the weight's gradient.
Heads: SmolLM2-135M (49,152 x 576) and Qwen2.5-3B / Qwen2.5-VL-3B (151,936 x 2,048), random weights.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

HEADS = {"smollm2-135m (49,152 x 576)": (49_152, 576), "qwen2.5-3b (151,936 x 2,048)": (151_936, 2_048)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="640,2560", help="comma-separated scored positions per pass")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    from agents.policies.head import head_logprobs

    plain = plain_policy()

    torch.set_num_threads(a.threads)
    print(f"load average before: {os.getloadavg()}; {a.threads} threads, bf16 autocast over fp32 weights")
    print("| head | rows | ordinary s | fused s | fused / ordinary | max weight-grad difference |\n|---|---:|---:|---:|---:|---:|")
    for name, (vocab, width) in HEADS.items():
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(vocab, width) * 0.02)
        for rows in (int(r) for r in a.rows.split(",")):
            hidden = torch.randn(rows, width, requires_grad=True)
            targets, coef = torch.randint(0, vocab, (rows,)), torch.rand(rows)

            def ordinary():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = torch.nn.functional.linear(hidden, weight)
                return plain.logprobs_of(logits, targets, 1.0)

            def fused():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return head_logprobs(hidden, weight, targets)

            times: dict[str, list[float]] = {"ordinary": [], "fused": []}
            grads = {}
            for _ in range(a.repeats + 1):  # the first round warms up
                for arm, fn in (("ordinary", ordinary), ("fused", fused)):
                    weight.grad = hidden.grad = None
                    t = time.perf_counter()
                    (fn() * coef).sum().backward()
                    times[arm].append(time.perf_counter() - t)
                    grads[arm] = weight.grad
            med = {arm: statistics.median(ts[1:]) for arm, ts in times.items()}
            diff = float((grads["fused"] - grads["ordinary"]).abs().max())
            print(f"| {name} | {rows} | {med['ordinary']:.3f} | {med['fused']:.3f} | "
                  f"{med['fused'] / med['ordinary']:.2f}x | {diff:.1e} |", flush=True)
    print(f"load average after: {os.getloadavg()}")
    return 0


def plain_policy():
    """What :meth:`Policy.logprobs_of` reads of a text policy (no suppressed token), unbound."""
    from types import SimpleNamespace

    from agents.policies.policy import Policy

    plain = SimpleNamespace(suppressed_ids=[])
    plain.scaled_logits = lambda logits, temperature: Policy.scaled_logits(plain, logits, temperature)
    plain._logprobs_of = lambda logits, targets, temperature: Policy._logprobs_of(plain, logits, targets, temperature)
    plain.logprobs_of = lambda logits, targets, temperature: Policy.logprobs_of(plain, logits, targets, temperature)
    return plain


if __name__ == "__main__":
    raise SystemExit(main())
