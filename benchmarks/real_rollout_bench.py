"""Rollout speed of a real pretrained chat model on the CPU: the project's sampler beside HF
``generate``, in fp32 and in bf16 weights, on the same prompts.

    .venv/bin/python benchmarks/real_rollout_bench.py [--model smollm2-135m-instruct] [--batch 64]
        [--new-tokens 32] [--repeats 3] [--dtypes float32,bfloat16] [--vllm | --no-vllm]

The project's sampler also takes its turn drawing with ``torch.multinomial`` (``multinomial
draw``), as it did over every vocabulary before the distribution-function draw
(:func:`agents.policies.sampling.draw`). The prompts are ``--batch`` Arithmetic problems rendered by the model's own chat template;
every row samples up to ``--new-tokens`` tokens per prompt at temperature 1 with the full
vocabulary (no top-k/top-p), ending at the model's EOS, with the behaviour log-probs a trainer
needs. Tokens/s is sampled tokens (up to and including EOS) over wall seconds, the median of
``--repeats`` alternating runs; ratios are against the project's sampler in fp32 of the same
run. With ``--vllm`` (the default where ``make vllm-venv`` has built ``.venv-vllm``), vLLM's
CPU build serves the same model in its own process (:class:`agents.engines.vllm_client.VLLMSampler`,
the engine ``train.py --engine vllm`` uses) and takes its turn in the same rounds on the same
prompt ids, with the same thread count; its start-up is not timed. The load average is printed
before and after: the cores may be shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from agents.policies.policy import Policy, configure_threads


def prompts(policy: Policy, n: int) -> list[list[int]]:
    import envs

    env = envs.make("freshper/Arithmetic-v0")
    try:
        out = []
        for k in range(n):
            obs, _ = env.reset(seed=1_900_000_000 + k)
            out.append(policy.chat.first_message(obs["text"]))
        return out
    finally:
        env.close()


def run_sampler(policy: Policy, ids: list[list[int]], new_tokens: int) -> int:
    gens = policy.generate(ids, max_new_tokens=new_tokens, temperature=1.0)
    return sum(len(g.token_ids) for g in gens)


def run_sampler_race(policy: Policy, ids: list[list[int]], new_tokens: int) -> int:
    """The project's sampler drawing every token with ``torch.multinomial`` (its draw over
    small vocabularies, and over every vocabulary before the distribution-function draw)."""
    from agents.policies import sampling

    saved, sampling.RACE_VOCAB = sampling.RACE_VOCAB, 1 << 62
    try:
        return run_sampler(policy, ids, new_tokens)
    finally:
        sampling.RACE_VOCAB = saved


def run_generate(policy: Policy, ids: list[list[int]], new_tokens: int) -> int:
    pad = policy.pad_token_id
    width = max(map(len, ids))
    batch = torch.tensor([[pad] * (width - len(x)) + list(x) for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    with torch.no_grad(), policy.autocast():
        out = policy.model.generate(input_ids=batch, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                    top_p=1.0, max_new_tokens=new_tokens, eos_token_id=policy.eos_token_id,
                                    pad_token_id=pad, output_scores=True, return_dict_in_generate=True)
        # the behaviour log-probs a trainer needs, as generate gives them
        torch.stack(out.scores, 1).float().log_softmax(-1)
    new = out.sequences[:, width:]
    ended = (new == policy.eos_token_id).int().cumsum(1)
    return int(((ended == 0) | ((ended == 1) & (new == policy.eos_token_id))).sum())  # up to the first EOS


def vllm_available() -> bool:
    from agents.engines.vllm_client import default_vllm_python

    return os.path.exists(default_vllm_python())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=None,
                        help="also time vLLM's CPU build (default: when its venv exists)")
    args = parser.parse_args()
    if args.vllm is None:
        args.vllm = vllm_available()
    threads = configure_threads(args.threads)
    print(f"load average before: {os.getloadavg()}; torch threads {threads}")
    rows: dict[tuple[str, str], list[float]] = {}
    for dtype in args.dtypes.split(","):
        policy = Policy.from_pretrained(args.model, dtype=dtype)
        ids = prompts(policy, args.batch)
        paths = [("freshper sampler", run_sampler), ("freshper sampler, multinomial draw", run_sampler_race),
                 ("HF generate", run_generate)]
        engine = None
        if args.vllm:
            from agents.engines.vllm_client import VLLMSampler
            from agents.pretrained import resolve_model

            engine = VLLMSampler(resolve_model(args.model), eos_token_id=policy.eos_token_id, dtype=dtype,
                                 max_model_len=1024, seed=0, threads=threads)
            paths.append(("vLLM (CPU build)", lambda _p, x, n: sum(len(g.token_ids) for g in engine.generate(
                x, max_new_tokens=n, temperature=1.0))))
        try:
            for _, fn in paths:
                fn(policy, ids[:4], 4)  # warm-up
            for _ in range(args.repeats):
                for name, fn in paths:
                    t0 = time.perf_counter()
                    tokens = fn(policy, ids, args.new_tokens)
                    rows.setdefault((name, dtype), []).append(tokens / (time.perf_counter() - t0))
        finally:
            if engine is not None:
                engine.close()
        del policy
    base = statistics.median(rows.get(("freshper sampler", "float32"), next(iter(rows.values()))))
    print(f"\n{args.model}: {args.batch} prompts x {args.new_tokens} sampled tokens, median of {args.repeats}")
    print(f"| path | weights | tokens/s | vs freshper sampler fp32 |\n|---|---|---:|---:|")
    for (name, dtype), vals in rows.items():
        med = statistics.median(vals)
        print(f"| {name} | {dtype} | {med:.0f} | {med / base:.2f}x |")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
