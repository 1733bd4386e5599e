"""The learner's two shared-prefix scoring paths on a real model, side by side: the KV-cached
passes (``learner.prefix._text_logprobs``) and the packed passes (``learner.packed``), on the
batches the real recipes train on.

    .venv/bin/python -m experiments.real_model.scoring_path_ab --model FOLDER [--repeats 2]

SmolLM2-135M-Instruct (``--model``: the recipes' start of RL or the converted model) in fp32 on
two threads. Batches: Arithmetic (8 problems x 8 samples, 16-token replies) once with first
turns only and once with a second turn among them (seeds tried until an episode takes one),
Countdown (8 x 8, 24-token replies, up to 4 turns) and FrozenLake 4x4 (4 maps x 8, feedback off),
each cut into the learner's micro-batches (at most 4,096 padded tokens). For each: the tokens
the cached passes run (every distinct prompt padded to the longest, every reply to the longest)
and a pack runs (each distinct token once), and the seconds of a forward and backward pass of
the summed log-probs and of a forward pass without gradients, the two paths alternating
``--repeats`` times after a warm-up; medians. ``learner packs`` counts the micro-batches the
learner's rule (``learner.prefix.packing_pays``) packs.
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
    ap.add_argument("--model", required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from agents.policies.policy import Policy
    from agents.rollout.runner import Runner
    from learner import packed
    from learner.advantages import assign_group_advantages
    from learner.batch import MicroBatch, make_batches
    from learner.prefix import _text_logprobs, packing_pays, scored_tokens
    from learner.prompts import prompt_lengths

    torch.set_num_threads(a.threads)
    print(f"load average before: {os.getloadavg()}", flush=True)
    pol = Policy.from_pretrained(a.model, dtype="float32", compute_dtype="float32")

    def batches(env_id: str, seeds: list[int], tokens: int, **kwargs) -> list[list]:
        runner = Runner(pol, env_id, group_size=8, max_new_tokens=tokens, seed=1, env_kwargs=kwargs or None)
        records, _ = runner.collect(seeds, policy_version=0)
        assign_group_advantages(records)
        cut = make_batches(records, np.ones(len(records)), np.zeros(len(records)), MicroBatch(256, 4096), None)
        return [b.samples for b in cut]

    sets: dict[str, list[list]] = {"Arithmetic, first turns": batches("freshper/Arithmetic-v0", list(range(1000, 1008)), 16)}
    for base in range(1016, 1200, 8):
        cut = batches("freshper/Arithmetic-v0", list(range(base, base + 8)), 16)
        plen = prompt_lengths([s for b in cut for s in b])
        if max(plen) > min(plen) + 20:
            sets[f"Arithmetic, a second turn (seeds {base}-{base + 7})"] = cut
            break
    sets["Countdown"] = batches("freshper/Countdown-v0", list(range(7, 15)), 24)
    sets["FrozenLake 4x4"] = batches("freshper/FrozenLake-v0", list(range(3, 7)), 16, feedback=False)

    def run(path: str, cut: list[list], grad: bool) -> float:
        pol.model.train(grad)
        t = time.perf_counter()
        for samples in cut:
            with torch.set_grad_enabled(grad), pol.autocast():
                lp = packed.packed_logprobs(pol, samples, 1.0) if path == "packed" else _text_logprobs(pol, samples, 1.0)
            if grad:
                lp.sum().backward()
        pol.model.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    print("| batch | samples | passes | tokens | cached passes run | a pack runs | ratio | learner packs | pass | "
          "cached s | packed s | packed / cached |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|")
    for name, cut in sets.items():
        flat = [s for b in cut for s in b]
        cached_tokens, pack_tokens = (sum(c) for c in zip(*(scored_tokens(b) for b in cut)))
        chosen = sum(packing_pays(pol, b) for b in cut)
        for grad in (True, False):
            for path in ("cached", "packed"):
                run(path, cut, grad)  # warm-up
            times: dict[str, list[float]] = {"cached": [], "packed": []}
            for _ in range(a.repeats):
                for path in times:
                    times[path].append(run(path, cut, grad))
            m = {k: statistics.median(v) for k, v in times.items()}
            print(f"| {name} | {len(flat)} | {len(cut)} | {sum(len(s.token_ids) for s in flat)} | {cached_tokens} | "
                  f"{pack_tokens} | {pack_tokens / cached_tokens:.2f} | {chosen} of {len(cut)} | "
                  f"{'forward + backward' if grad else 'forward, no gradient'} | {m['cached']:.2f} | {m['packed']:.2f} | "
                  f"{m['packed'] / m['cached']:.2f}x |", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
