"""How well can the tiny model read an answer out of its passages when it is told the answer?

    python experiments/searchqa/search_copy_ceiling.py --steps 1500 --every 250                  # the embedded size
    python experiments/searchqa/search_copy_ceiling.py --steps 1500 --every 250 --hidden 256 --layers 6

A ceiling, not a recipe: the model is trained with the gold answer as its target (a label the
project's pretraining never uses) on the prompt RL sees after a search for the whole question
(``window:0``: the instructions, then the three passages and the question), on the training
split's questions whose answer is in those passages, and greedy exact match is measured on the
test split's questions of the same kind (their facts are other facts: a held-out EM is a copy,
not a memory). Training-split EM on as many questions is printed beside it.

If the tiny model gets high held-out EM here, it can copy a name from its passages and what
SearchQA's RL lacks is the signal to find that copy; if it does not within many more steps than
the pretraining takes, no reward teaches it at that size. ``--hidden``/``--layers`` build a
larger decoder on the same tokenizer (the task's own, ``agents.policies.tiny.task_model``; ``--hidden``
is ``train.py --tiny-width``) to say
whether size is what is missing. Step 0 is a randomly initialised model (``--model`` starts
from a folder instead, e.g. the config's pretrained start).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np


ENV_ID = "freshper/SearchQA-v0"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def cases(split: str, limit: int) -> tuple[list[tuple[str, tuple[str, ...]]], int]:
    """Up to ``limit`` (prompt, gold answers) of ``split``'s questions, in file order, whose
    answer is in the passages a search for the whole question returns; and how many questions
    were looked at to find them."""
    import envs
    from envs.search.metrics import normalize_answer

    env = envs.make(ENV_ID, split=split)
    out, seen = [], 0
    try:
        task = env.unwrapped
        for i in range(len(task.questions)):
            if len(out) >= limit:
                break
            _, info = env.reset(seed=i, options={"index": i})
            seen += 1
            q = task.question
            obs, *_ = env.step(f"<search>{q.question.rstrip('?')}</search>")
            text = normalize_answer(obs["text"])
            if any(normalize_answer(g) in text for g in q.golden_answers):
                out.append((f"{info.get('instructions', '')}\n\n{obs['text']}", tuple(q.golden_answers)))
    finally:
        env.close()
    return out, seen


def sized_model(base: Path, hidden: int, layers: int, seed: int, into: Path) -> Path:
    """A randomly initialised Qwen2 of ``hidden`` x ``layers`` (the tiny model's decoder at that
    width, ``train.py --tiny-width``, with ``layers`` layers) with ``base``'s tokenizer and chat
    template, written to ``into``."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from agents.policies.tiny import _decoder_dims, check_width

    tok = AutoTokenizer.from_pretrained(base)
    dims = {**_decoder_dims(tok, check_width(hidden)), "num_hidden_layers": layers}
    torch.manual_seed(seed)
    Qwen2ForCausalLM(Qwen2Config(**dims, tie_word_embeddings=True)).save_pretrained(into)
    for f in base.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, into / f.name)
    return into


def greedy_em(policy, items: list[tuple[str, tuple[str, ...]]], batch: int = 64) -> tuple[float, float]:
    """Greedy exact match on ``items`` and the share of replies with an ``<answer>`` tag."""
    from envs.search.metrics import exact_match

    em, tagged = [], []
    for i in range(0, len(items), batch):
        chunk = items[i:i + batch]
        gens = policy.generate([policy.chat.first_message(p, []) for p, _ in chunk], [[] for _ in chunk],
                               max_new_tokens=24, greedy=True)
        for g, (_, golds) in zip(gens, chunk):
            m = _ANSWER.search(policy.reply_text(g.token_ids))
            tagged.append(m is not None)
            em.append(exact_match(m.group(1).strip(), golds) if m else 0.0)
    return float(np.mean(em)), float(np.mean(tagged))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model", default=None, help="start from this model folder instead of a fresh one")
    parser.add_argument("--eval", type=int, default=200, help="held-out (and training) questions measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from agents.policies.policy import Policy
    from agents.rollout.runner import default_env_kwargs
    from agents.policies.tiny import task_model
    from learner.pretrain import Example, encode
    from learner.update import supervised_step

    train, train_seen = cases("train", 10_000)
    test, test_seen = cases("test", args.eval)
    print(f"answer in the passages of a search for the whole question: train {len(train)} of {train_seen}, "
          f"held-out {len(test)} of {test_seen} looked at")
    tmp = Path(tempfile.mkdtemp(prefix="copy-ceiling-"))
    try:
        if args.model:
            folder = Path(args.model)
        else:
            base = task_model(ENV_ID, default_env_kwargs(ENV_ID, "window:0"), seed=args.seed)
            folder = sized_model(base, args.hidden, args.layers, args.seed, tmp)
        policy = Policy.from_pretrained(folder)
        params = sum(p.numel() for p in policy.model.parameters())
        print(f"model: {folder if args.model else f'hidden {args.hidden} x {args.layers} layers'} ({params / 1e6:.2f}M "
              f"parameters), batch {args.batch}, lr {args.lr}")
        rng = np.random.default_rng(args.seed)
        train_probe = [train[i] for i in rng.choice(len(train), size=min(args.eval, len(train)), replace=False)]
        optimizer = torch.optim.Adam(policy.model.parameters(), lr=args.lr)
        rows, losses, start = [], [], time.monotonic()
        print(f"{'step':>6} {'seconds':>8} {'loss':>7} {'held-out EM':>12} {'train EM':>9} {'tagged':>7}", flush=True)

        def measure(step: int) -> None:
            held, tagged = greedy_em(policy, test)
            seen_em, _ = greedy_em(policy, train_probe)
            loss = float(np.mean(losses[-50:])) if losses else float("nan")
            rows.append({"step": step, "seconds": round(time.monotonic() - start, 1), "loss": loss,
                         "held_out_em": held, "train_em": seen_em, "tagged": tagged})
            print(f"{step:>6} {rows[-1]['seconds']:>8} {loss:>7.3f} {held:>12.3f} {seen_em:>9.3f} {tagged:>7.2f}",
                  flush=True)

        measure(0)
        for step in range(1, args.steps + 1):
            batch = [train[i] for i in rng.integers(len(train), size=args.batch)]
            samples, images = encode(policy, [Example(p, [], f"<answer>{g[0]}</answer>", "format") for p, g in batch])
            losses.append(supervised_step(policy, optimizer, samples, images, micro_batch=args.batch)["loss"])
            if step % args.every == 0 or step == args.steps:
                measure(step)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "params": params, "rows": rows}, indent=1),
                                       encoding="utf-8")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
