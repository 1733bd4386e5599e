"""How fast does the tiny model learn to *read* a FrozenLake board, per prompt format?

A supervised probe of the observation format, independent of RL: the embedded tiny text model
(fresh weights, the project's tokenizer) is trained to predict a shortest safe move from the
``window:0`` prompt (chat template + ``<answer>``), on random 4x4 maps and random reachable
player positions, with the same batches and seeds for every format. Every ``--eval-every``
steps it reports, on 1,500 held-out states:

- ``optimal``: the argmax move is one of the shortest safe moves;
- ``probe``: on states where exactly one of Down/Right leads into a hole, how often the
  model prefers the safe one (0.5 = board-blind; the same probe as ``learner.report``).

Formats (``--formats``):

- ``indented``: the task's observation, ``envs.frozenlake`` (every cell after a space);
- ``plain``: the same rows without the leading space (``"P F H F"``), where a cell in the
  first column is another token than the same cell elsewhere;
- ``board-only``: the indented board without the instructions.

    python experiments/board_reading/board_format_bench.py                    # ~8 min on 2 CPU cores
    python experiments/board_reading/board_format_bench.py --steps 150 --formats indented plain

Results and the command are recorded in docs/results/history.md#why-the-observation-format-matters.
"""

from __future__ import annotations

import argparse
import collections
import random
import time

import numpy as np
import torch

from agents.policies.tiny import build_tiny_model
from envs.frozenlake import FrozenLakeEnv, random_map

MOVES = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}


def distances(desc: list[str]) -> dict[tuple[int, int], int]:
    """Shortest safe path length to the goal from every cell that can reach it."""
    n, m = len(desc), len(desc[0])
    goal = next((r, c) for r in range(n) for c in range(m) if desc[r][c] == "G")
    dist, queue = {goal: 0}, collections.deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in MOVES.values():
            a, b = r + dr, c + dc
            if 0 <= a < n and 0 <= b < m and desc[a][b] != "H" and (a, b) not in dist:
                dist[(a, b)] = dist[(r, c)] + 1
                queue.append((a, b))
    return dist


def example(rng: random.Random, env: FrozenLakeEnv, fmt: str):
    """(prompt text, shortest safe move indices, index of the safe one of Down/Right or None)."""
    while True:
        desc = random_map(np.random.default_rng(rng.randrange(1 << 30)), 4, 0.8)
        dist = distances(desc)
        cells = [p for p in dist if desc[p[0]][p[1]] != "G"]
        if cells:
            break
    env.desc, env.pos = desc, rng.choice(cells)
    board = env.board_text()
    if fmt == "plain":
        board = "\n".join(line.lstrip(" ") for line in board.splitlines())
    text = board if fmt == "board-only" else f"{env.instructions()}\n\n{board}"
    r, c = env.pos
    best = [i for i, (dr, dc) in enumerate(MOVES.values()) if dist.get((r + dr, c + dc), 99) == dist[(r, c)] - 1]
    probe = None
    if r + 1 < 4 and c + 1 < 4:
        down_hole, right_hole = desc[r + 1][c] == "H", desc[r][c + 1] == "H"
        if down_hole != right_hole:
            probe = 2 if down_hole else 1  # the safe move: Right (2) or Down (1)
    return text, best, probe


def run(fmt: str, steps: int, eval_every: int, lr: float, batch: int, seed: int) -> list[tuple[int, float, float, float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model("text")
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path)
    act_ids = [tok.convert_tokens_to_ids(a) for a in MOVES]
    env = FrozenLakeEnv()

    def encode(items):
        texts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
                 + "<answer>" for t, _, _ in items]
        ids = [tok(t)["input_ids"] for t in texts]
        width = max(map(len, ids))
        x = torch.full((len(ids), width), tok.pad_token_id or 0)
        att = torch.zeros((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):  # left padding: the last position predicts the move
            x[i, width - len(row):], att[i, width - len(row):] = torch.tensor(row), 1
        return model(input_ids=x, attention_mask=att).logits[:, -1, act_ids]

    held_out = [example(random.Random(10_000 + i), env, fmt) for i in range(1500)]
    train_rng = random.Random(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    rows = []
    start = time.monotonic()
    for step in range(steps + 1):
        if step % eval_every == 0:
            model.eval()
            ok = safe = n_probe = 0
            with torch.no_grad():
                for i in range(0, len(held_out), 250):
                    part = held_out[i:i + 250]
                    for (_, best, probe), logits in zip(part, encode(part)):
                        ok += int(logits.argmax()) in best
                        if probe is not None:
                            n_probe += 1
                            safe += (2 if logits[2] > logits[1] else 1) == probe
            rows.append((step, ok / len(held_out), safe / max(1, n_probe), time.monotonic() - start))
            print(f"{fmt:>10} step {step:4d}  optimal {rows[-1][1]:.3f}  probe {rows[-1][2]:.3f}  ({rows[-1][3]:.0f} s)",
                  flush=True)
            model.train()
        if step == steps:
            break
        items = [example(train_rng, env, fmt) for _ in range(batch)]
        logits = encode(items)
        target = torch.zeros_like(logits)
        for i, (_, best, _) in enumerate(items):
            target[i, best] = 1.0 / len(best)
        loss = -(target * torch.log_softmax(logits, -1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=["indented", "plain", "board-only"],
                        choices=["indented", "plain", "board-only"])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {fmt: run(fmt, args.steps, args.eval_every, args.lr, args.batch, args.seed) for fmt in args.formats}
    print("\nsafe-move probe (0.5 = board-blind) by training step, same batches for every format:")
    print("step  " + "  ".join(f"{fmt:>10}" for fmt in args.formats))
    for k, step in enumerate(r[0] for r in results[args.formats[0]]):
        print(f"{step:4d}  " + "  ".join(f"{results[fmt][k][2]:10.3f}" for fmt in args.formats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
