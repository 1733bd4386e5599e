"""Can the tiny VLM copy a board out of an image? Multimodal rotary positions against flat ones.

The text model learns to write the next FrozenLake board exactly in ~200 pretraining steps; the
tiny Qwen2-VL never does (docs/results/vision.md#where-in-the-decoder). A candidate cause is
geometric. In the text model,
the cell written at answer position ``p0 + k`` copies the prompt's cell at ``q0 + k``: one fixed
relative offset for every cell, which a single rotary attention head can learn. Qwen2-VL gives
the visual token of board cell (row r, column c) the multimodal rotary position
``(t, h, w) = (s, s + r, s + c)`` while a text token at ``p`` has ``(p, p, p)``, so the offset
from the answer cell being written to the visual token it must copy changes with r and c, and
no fixed-offset head does it.

This trains the same fresh tiny VLM on the same transcription examples (the task's observation
image -> the board in the task's text notation, ``learner.pretrain``'s observation examples)
twice, with one change: ``--positions mrope`` keeps Qwen2-VL's own positions, ``flat`` gives
every token, visual ones included, its plain sequence index (``position_ids = arange(T)``, the
text model's 1-D rotary positions; the vision tower keeps its own 2-D ones). It prints the
held-out negative log-likelihood per target token and how often the whole board is right
(every target token the argmax given the ones before it, which is what greedy decoding writes).

    python experiments/vision/vision_rope_probe.py --positions mrope --steps 300 --out runs/rope/mrope.jsonl
    python experiments/vision/vision_rope_probe.py --positions flat --steps 300 --out runs/rope/flat.jsonl
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


ENV_ID = "freshper/FrozenLakeVision-v0"
#: Target tokens whose accuracy is reported apart: the board's cells, its line breaks, the tags.
KINDS = (" F", " H", " S", " G", " P", "\n", "<answer>", "</answer>")


def examples(streams, n_calls: int) -> list:
    out = []
    for _ in range(n_calls):
        out += streams.examples()
    return out


def forward(policy, samples, images, flat: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per target token: log-prob and whether it is the argmax, ``[B, T-1]`` each, and the mask."""
    lengths = [len(s.token_ids) for s in samples]
    t_max = max(lengths)
    ids = torch.full((len(samples), t_max), policy.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(samples), t_max), dtype=torch.long)
    mask = torch.zeros((len(samples), t_max), dtype=torch.float32)
    for b, s in enumerate(samples):
        ids[b, : lengths[b]] = torch.as_tensor(s.token_ids)
        attn[b, : lengths[b]] = 1
        mask[b, : lengths[b]] = torch.as_tensor(s.loss_mask, dtype=torch.float32)
    kwargs = {**policy.vision_inputs([im for per in images for im in per]), **policy._mm_types(ids)}
    if flat:
        kwargs["position_ids"] = torch.arange(t_max)[None].expand(len(samples), -1)
    logits = policy.model(input_ids=ids, attention_mask=attn, use_cache=False, **kwargs).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    target = ids[:, 1:]
    picked = logp.gather(-1, target[..., None])[..., 0]
    right = logits.argmax(-1) == target
    return picked, right, mask[:, 1:]


def main(argv: list[str] | None = None) -> int:
    from agents.policies.policy import Policy
    from agents.rollout.runner import default_env_kwargs
    from agents.policies.tiny import build_tiny_model
    from learner.pretrain import TransitionStreams, encode

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--positions", choices=("mrope", "flat"), default="mrope")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--held-out", type=int, default=32, help="held-out streams (4 states each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="JSON lines of the measurements")
    ap.add_argument("--save", help="save the trained model here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    flat = args.positions == "flat"
    policy = Policy.from_pretrained(build_tiny_model("vision", seed=args.seed))
    kwargs = default_env_kwargs(ENV_ID, "window:0")
    train = TransitionStreams(ENV_ID, kwargs, args.batch, args.seed, 1.0, True, observe_fraction=1.0)
    held = TransitionStreams(ENV_ID, kwargs, args.held_out, args.seed + 7_919, 1.0, True, observe_fraction=1.0)
    # held-out states along random walks (each call advances every stream by one move), so the
    # player stands on many cells, not only on the start
    held_samples, held_images = encode(policy, examples(held, 4))
    width = max(len(s.token_ids) for s in held_samples) - 1
    held_kinds = np.full((len(held_samples), width), "", dtype=object)
    for b, s in enumerate(held_samples):
        for t, tok in enumerate(s.token_ids[1:]):
            held_kinds[b, t] = policy.tokenizer.decode([int(tok)])
    torch.manual_seed(args.seed)
    opt = torch.optim.Adam(policy.model.parameters(), lr=args.lr)
    log = open(args.out, "w", encoding="utf-8") if args.out else None
    t0 = time.monotonic()

    def measure(step: int) -> None:
        policy.model.eval()
        with torch.no_grad():
            lp, right, mask = forward(policy, held_samples, held_images, flat)
        nll = float(-(lp * mask).sum() / mask.sum())
        exact = float(((right | (mask == 0)).all(dim=1)).float().mean())
        cells = float((right.float() * mask).sum() / mask.sum())
        by_kind = {}
        for kind in KINDS:  # accuracy per kind of target token (which cells go wrong)
            sel = torch.from_numpy(held_kinds == kind) & (mask > 0)
            if sel.any():
                by_kind[kind.strip() or repr(kind)] = round(float(right[sel].float().mean()), 4)
        row = {"positions": args.positions, "step": step, "nll": nll, "token_accuracy": cells, "exact": exact,
               "accuracy_by_target": by_kind, "seconds": time.monotonic() - t0}
        print(json.dumps(row), flush=True)
        if log:
            log.write(json.dumps(row) + "\n")
            log.flush()

    measure(0)
    for step in range(1, args.steps + 1):
        samples, images = encode(policy, train.examples())
        policy.model.train()
        lp, _, mask = forward(policy, samples, images, flat)
        loss = -(lp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        opt.step()
        if step % args.every == 0 or step == args.steps:
            measure(step)
    train.close()
    held.close()
    if args.save:
        policy.save_pretrained(args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
