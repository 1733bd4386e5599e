"""What attention per task would save in a packed pass: one layer's attention over the recipe's
on-policy pack (SmolLM2-135M's 9 heads of 64, fp32, 2 threads), forward and backward, computed
whole under its tree-shaped mask as the packed passes run it, against computed per block (the
header's causal attention, then each task's prompt remainder and replies against the header and
themselves under the same tree mask), which gives the same output.

    .venv/bin/python experiments/real_model/attention_blocks.py [--header 54] [--tasks 8] [--prompt 11] \
        [--replies 8] [--reply 8] [--repeats 5]

The default pack is the one ``update_floor.py`` prints: a 54-token header, 8 prompt remainders
of 11 tokens and 64 replies of about 7.5 tokens (8 here), 616 tokens in all.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def tree_mask(header: int, tasks: int, prompt: int, replies: int, reply: int) -> tuple[torch.Tensor, list]:
    """The pack's boolean attention mask (True: may attend) and each token's segment: the
    header, then per task its prompt remainder followed by its replies, each reply seeing the
    header, its task's remainder and itself (causally)."""
    owners = [("h", -1)] * header
    for t in range(tasks):
        owners += [("p", t)] * prompt
        for r in range(replies):
            owners += [("r", t * replies + r)] * reply
    n = len(owners)
    mask = torch.zeros(n, n, dtype=torch.bool)
    task_of = [o[1] if o[0] == "p" else (o[1] // replies if o[0] == "r" else -1) for o in owners]
    for i, (kind, who) in enumerate(owners):
        for j in range(i + 1):
            k2, w2 = owners[j]
            if k2 == "h" or (k2 == "p" and w2 == task_of[i]) or (kind == "r" and k2 == "r" and w2 == who):
                mask[i, j] = True
    return mask, task_of


def whole(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def blocks(q, k, v, mask, header: int, spans: list[tuple[int, int]]):
    """The same attention, each task's span against the header and itself only."""
    outs = [F.scaled_dot_product_attention(q[:, :, :header], k[:, :, :header], v[:, :, :header], is_causal=True)]
    for a, b in spans:
        keys = torch.cat([k[:, :, :header], k[:, :, a:b]], dim=2)
        values = torch.cat([v[:, :, :header], v[:, :, a:b]], dim=2)
        sub = torch.cat([mask[a:b, :header], mask[a:b, a:b]], dim=1)
        outs.append(F.scaled_dot_product_attention(q[:, :, a:b], keys, values, attn_mask=sub))
    return torch.cat(outs, dim=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--header", type=int, default=54)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=11)
    ap.add_argument("--replies", type=int, default=8)
    ap.add_argument("--reply", type=int, default=8)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    mask, task_of = tree_mask(a.header, a.tasks, a.prompt, a.replies, a.reply)
    n = mask.shape[0]
    spans = []
    for t in range(a.tasks):
        idx = [i for i, owner in enumerate(task_of) if owner == t]
        spans.append((idx[0], idx[-1] + 1))
    shape = (1, a.heads, n, a.head_dim)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape)
    ref = whole(q, k, v, mask)
    out = blocks(q, k, v, mask, a.header, spans)
    gap = (ref - out).abs().max().item()
    pairs = a.header ** 2 + sum((b - s) * (a.header + b - s) for s, b in spans)
    print(f"pack: {n} tokens ({a.header} header, {a.tasks} tasks of {spans[0][1] - spans[0][0]}); query-key pairs "
          f"computed per block {pairs} against {n * n} whole ({pairs / n / n:.2f}); largest output difference {gap:.1e}")

    def timed(fn) -> tuple[float, float]:
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(a.layers):
                fn()
        forward = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(a.layers):
            q.grad = k.grad = v.grad = None
            fn().backward(grad)
        return forward, time.perf_counter() - t0

    arms = {"whole, tree mask": lambda: whole(q, k, v, mask),
            "per task": lambda: blocks(q, k, v, mask, a.header, spans)}
    for fn in arms.values():
        timed(fn)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    for _ in range(a.repeats):
        for name, fn in arms.items():
            times[name].append(timed(fn))
    base_f = statistics.median(t[0] for t in times["whole, tree mask"])
    base_b = statistics.median(t[1] for t in times["whole, tree mask"])
    print(f"{a.layers} layers, {a.threads} threads, medians of {a.repeats} alternating repeats")
    print("| attention | forward s | forward and backward s | forward vs whole | forward and backward vs whole |\n"
          "|---|---:|---:|---:|---:|")
    for name, ts in times.items():
        f, b = statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)
        print(f"| {name} | {f:.3f} | {b:.3f} | {f / base_f:.2f}x | {b / base_b:.2f}x |")


if __name__ == "__main__":
    main()
