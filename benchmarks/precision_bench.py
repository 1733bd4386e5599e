"""bf16 against fp32 matrix products on this CPU, at a real model's shapes: what ``--dtype auto``
decides on (agents/policies/precision.py).

    .venv/bin/python -m benchmarks.precision_bench [--threads 2] [--repeats 3]

The shapes are SmolLM2-135M's (hidden 576, MLP 1536, vocabulary 49,152) at the row counts of a
learner pass (64 replies, 576 scored tokens, 1,200 tokens of a batch) and a rollout step (64
rows). Each round times every shape in both dtypes, alternating; the table gives medians and
bf16's time over fp32's. A CPU with AVX512-BF16 or AMX multiplies bf16 in hardware; elsewhere
oneDNN converts each operand to fp32 first and bf16 is slower than fp32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = [  # (rows, in, out): q/k/v/o and MLP projections, the LM head
    (64, 576, 1536), (576, 576, 1536), (576, 1536, 576), (1200, 576, 1536), (1200, 1536, 576), (576, 576, 49152),
]


def _time(a: torch.Tensor, w: torch.Tensor, calls: int) -> float:
    a @ w.t()
    t0 = time.perf_counter()
    for _ in range(calls):
        a @ w.t()
    return (time.perf_counter() - t0) / calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    from agents.policies.precision import cpu_bf16_native, resolve_dtype

    torch.set_num_threads(a.threads)
    native = cpu_bf16_native()
    print(f"torch {torch.__version__}, {a.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"bf16 units (AVX512-BF16 or AMX): {'yes' if native else 'no'}; --dtype auto for a 135M model: "
          f"{str(resolve_dtype('auto', 'cpu', 135_000_000)).removeprefix('torch.')}")
    gen = torch.Generator().manual_seed(0)
    times: dict[tuple, dict[torch.dtype, list[float]]] = {s: {torch.float32: [], torch.bfloat16: []} for s in SHAPES}
    for _ in range(a.repeats):
        for shape in SHAPES:
            rows, k, n = shape
            calls = max(2, int(2e9 // (2 * rows * k * n)))
            base_a, base_w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
            for dtype in (torch.float32, torch.bfloat16):
                times[shape][dtype].append(_time(base_a.to(dtype), base_w.to(dtype), calls))
    print("| rows x in x out | fp32 ms | fp32 GFLOP/s | bf16 ms | bf16 GFLOP/s | bf16 / fp32 time |")
    print("|---|---:|---:|---:|---:|---:|")
    ratios = []
    for shape in SHAPES:
        rows, k, n = shape
        f32, b16 = (statistics.median(times[shape][d]) for d in (torch.float32, torch.bfloat16))
        flops = 2 * rows * k * n
        ratios.append(b16 / f32)
        print(f"| {rows} x {k} x {n} | {f32 * 1e3:.2f} | {flops / f32 / 1e9:.0f} | {b16 * 1e3:.2f} | "
              f"{flops / b16 / 1e9:.0f} | {b16 / f32:.2f}x |")
    print(f"bf16 / fp32 time over the shapes: {min(ratios):.2f}-{max(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
