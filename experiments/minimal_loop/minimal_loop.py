"""A minimal GRPO loop on FrozenLake 4x4 text, written apart from ``train.py``: the reference
the trainer's path is bisected against (docs/results/history.md#the-trainer-against-an-independent-minimal-loop).

Shared with the project: the embedded tiny model and its tokenizer (``agents.policies.tiny``), the task
(``envs``: maps, dynamics, board text) and the held-out seed block. Written here from scratch,
in a few lines each, with plain Hugging Face calls: the prompt (the tokenizer's own chat
template), batched sampling with a KV cache, the log-probs, the group advantage, the clipped
loss with the k3 KL, the format warm-up and the evaluation. So a defect in the trainer's
runner, sampler, batching, loss or schedule does not carry over, and each of those parts can
be swapped for the trainer's (``--use-runner``, ``--use-update``) to find which one matters.

The recipe, by default: a format warm-up on random on-board moves (no dynamics examples),
then GRPO with 8 maps x 8 rollouts per iteration, one Adam step per iteration (lr 3e-4, grad
clip 1), clip 0.2, KL 0.04 to the policy RL starts from, temperature 1, ``window:0`` prompts
(the instructions and the current board), episode advantage ``(R - mean) / (std + eps)`` on
every turn, token-mean loss. ``--start DIR`` starts from a saved model instead of the warm-up
(e.g. the trainer's pretrained default), ``--save-start DIR`` saves the warm-up's model so
``train.py --model DIR --pretrain-steps 0`` can start from it.

    python experiments/minimal_loop/minimal_loop.py --seed 0 --iterations 450 --out runs/minimal/s0.jsonl
    python experiments/minimal_loop/minimal_loop.py --seed 0 --prompt short --out runs/minimal/short_s0.jsonl
    python experiments/minimal_loop/minimal_loop.py --seed 0 --use-runner --use-update --out runs/minimal/both_s0.jsonl

Each line of ``--out`` is a JSON record: ``kind: warmup`` once, ``kind: train`` per iteration,
``kind: eval`` every ``--eval-every`` iterations (held-out success, sampled and greedy, and the
safe-move probe: where exactly one of Down/Right steps into a hole, how often the policy took
the other; 0.5 = blind). ``experiments/minimal_loop/minimal_loop.py --summary FILE...`` tables them.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch


ENV_ID = "freshper/FrozenLake-v0"
ACTIONS = ("Left", "Down", "Right", "Up")
#: A short instruction (the prompt is ~50 tokens instead of ~80): ``--prompt short``.
SHORT_INSTRUCTIONS = "Go to G. Avoid H. <answer>Left|Down|Right|Up</answer>"


# -- prompts -----------------------------------------------------------------------------
def make_env(**kwargs):
    import envs

    return envs.make(ENV_ID, feedback=False, **kwargs)


def user_text(env, style: str) -> str:
    """The user message of the current state: the task's instructions and the board."""
    task = env.unwrapped
    head = task.instructions() if style == "task" else SHORT_INSTRUCTIONS
    return f"{head}\n\n{task.board_text()}"


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The tokenizer's own chat template: one user message, then the assistant's turn."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def legal_moves(env) -> list[str]:
    return env.unwrapped.legal_actions()


# -- sampling and log-probs ----------------------------------------------------------------
@torch.no_grad()
def sample(model, prompts: list[list[int]], eos: int, pad: int, max_new: int, greedy: bool,
           gen: torch.Generator) -> list[list[int]]:
    """Replies to left-padded prompts, decoded token by token on the KV cache."""
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((n, width), pad, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    replies: list[list[int]] = [[] for _ in range(n)]
    done = torch.zeros(n, dtype=torch.bool)
    last = pos[:, -1:]
    for _ in range(max_new):
        probs = torch.softmax(logits.float(), dim=-1)
        tok = probs.argmax(-1) if greedy else torch.multinomial(probs, 1, generator=gen)[:, 0]
        for i in range(n):
            if not done[i]:
                replies[i].append(int(tok[i]))
        done |= tok == eos
        if bool(done.all()):
            break
        attn = torch.cat([attn, torch.ones((n, 1), dtype=torch.long)], dim=1)
        last = last + 1
        out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=last, past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    return replies


def sequence_logprobs(model, seqs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """``[N, R]`` log-probs of each reply's tokens after its prompt (right-padded; 0 past the
    reply). The tokens every sequence starts with (the chat header and the instructions) run
    once, with gradient, and their KV cache is repeated over the rows; the rest runs in one
    right-padded pass on it (the same values as a full pass, up to float rounding)."""
    full = [p + r for p, r in seqs]
    head = 0
    shortest = min(len(p) for p, _ in seqs) - 1
    while head < shortest and all(f[head] == full[0][head] for f in full):
        head += 1
    cache = None
    if head:
        cache = model(input_ids=torch.tensor(full[0][:head])[None], use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(seqs))
    width = max(len(f) for f in full) - head
    rmax = max(len(r) for _, r in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    attn = torch.zeros((len(seqs), head + width), dtype=torch.long)
    attn[:, :head] = 1
    for i, f in enumerate(full):
        ids[i, : len(f) - head] = torch.tensor(f[head:])
        attn[i, head : len(f)] = 1
    pos = torch.arange(head, head + width)[None].expand(len(seqs), -1)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                   use_cache=cache is not None).logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    out = torch.zeros((len(seqs), rmax))
    rows, cols, targets, slots = [], [], [], []
    for i, (p, r) in enumerate(seqs):
        for k, tok in enumerate(r):
            rows.append(i)
            cols.append(len(p) + k - 1 - head)
            targets.append(tok)
            slots.append(k)
    picked = logp[torch.tensor(rows), torch.tensor(cols), torch.tensor(targets)]
    return out.index_put((torch.tensor(rows), torch.tensor(slots)), picked)


# -- episodes -----------------------------------------------------------------------------
def play(model, tokenizer, seeds: list[int], group: int, style: str, greedy: bool, gen: torch.Generator,
         max_new: int = 8) -> list[dict]:
    """Episodes of ``len(seeds) x group``: per episode its turns (prompt ids, reply ids, board,
    reply text), return and success."""
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id or 0
    episodes = []
    for s in seeds:
        for _ in range(group):
            env = make_env()
            env.reset(seed=int(s))
            episodes.append({"env": env, "turns": [], "ret": 0.0, "success": False, "seed": int(s), "done": False})
    while True:
        active = [e for e in episodes if not e["done"]]
        if not active:
            break
        texts = [user_text(e["env"], style) for e in active]
        prompts = [prompt_ids(tokenizer, t) for t in texts]
        replies = sample(model, prompts, eos, pad, max_new, greedy, gen)
        for e, text, p, r in zip(active, texts, prompts, replies):
            reply = tokenizer.decode([t for t in r if t != eos], skip_special_tokens=False)
            _, reward, terminated, truncated, info = e["env"].step(reply)
            e["turns"].append({"prompt": p, "reply": r, "text": text, "reply_text": reply})
            e["ret"] += float(reward)
            e["success"] = bool(info.get("success", False))
            if terminated or truncated:
                e["done"] = True
                e["env"].close()
    return episodes


def group_advantages(episodes: list[dict], group: int) -> None:
    for g in range(0, len(episodes), group):
        rets = np.array([e["ret"] for e in episodes[g : g + group]])
        adv = (rets - rets.mean()) / (rets.std() + 1e-6)
        for e, a in zip(episodes[g : g + group], adv):
            e["adv"] = float(a)


def probe(turns: list[tuple[str, str]]) -> float:
    from envs.frozenlake import FrozenLakeEnv

    return FrozenLakeEnv.turn_diagnostics(turns)["probe_safe_rate"]


def evaluate(model, tokenizer, n: int, style: str, greedy: bool, seed: int) -> dict:
    from agents.rollout.seeds import EVAL_SEED_BASE

    gen = torch.Generator().manual_seed(seed)
    model.eval()
    eps = play(model, tokenizer, [EVAL_SEED_BASE + k for k in range(n)], 1, style, greedy, gen)
    succ = float(np.mean([e["success"] for e in eps]))
    turns = [(t["text"], t["reply_text"]) for e in eps for t in e["turns"]]
    return {"success": succ, "probe": probe(turns)}


# -- the update ----------------------------------------------------------------------------
def grpo_step(model, ref, opt, episodes: list[dict], clip: float, kl_coef: float, max_grad_norm: float) -> dict:
    """One Adam step on the clipped surrogate (ratio 1: the batch was just sampled) plus the
    k3 KL to ``ref``, token mean over the batch. Identical (prompt, reply) rows are merged, their
    advantages summed (the same log-probs, so the same loss)."""
    rows: dict[tuple, list] = {}
    for e in episodes:
        for t in e["turns"]:
            key = (tuple(t["prompt"]), tuple(t["reply"]))
            rows.setdefault(key, [0.0, 0])
            rows[key][0] += e["adv"]
            rows[key][1] += 1
    seqs = [(list(p), list(r)) for p, r in rows]
    adv = torch.tensor([v[0] for v in rows.values()])
    count = torch.tensor([float(v[1]) for v in rows.values()])
    mask = torch.zeros((len(seqs), max(len(r) for _, r in seqs)))
    for i, (_, r) in enumerate(seqs):
        mask[i, : len(r)] = 1.0
    tokens = float((mask * count[:, None]).sum())
    model.train()
    logp = sequence_logprobs(model, seqs)
    old = logp.detach()
    ratio = torch.exp(logp - old)
    surrogate = torch.minimum(ratio * adv[:, None], torch.clamp(ratio, 1 - clip, 1 + clip) * adv[:, None])
    loss = -(surrogate * mask).sum() / tokens
    kl = torch.tensor(0.0)
    if kl_coef:
        with torch.no_grad():
            ref_lp = sequence_logprobs(ref, seqs)
        diff = (ref_lp - logp) * mask
        kl = ((torch.exp(diff) - diff - 1.0) * mask * count[:, None]).sum() / tokens
        loss = loss + kl_coef * kl
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    model.eval()
    return {"loss": float(loss), "kl": float(kl), "grad_norm": float(norm), "rows": len(seqs)}


def project_update(policy, ref_policy, opt, episodes_records, kl_coef: float) -> dict:
    """The trainer's own update (``learner.update.policy_update``) on the trainer's records."""
    from learner.loss import LossSettings
    from learner.update import policy_update

    n = len(episodes_records)
    st = policy_update(policy, ref_policy, opt, None, episodes_records, np.ones(n), np.zeros(n),
                       loss_cfg=LossSettings(kl_coef=kl_coef), on_policy=True)
    return {"loss": st.get("loss", 0.0), "kl": st.get("kl", 0.0), "grad_norm": st.get("grad_norm", 0.0)}


# -- the format warm-up ----------------------------------------------------------------------
def warmup(model, tokenizer, steps: int, batch: int, lr: float, style: str, seed: int) -> dict:
    """Supervised steps on random on-board moves, ``<answer>M</answer><|im_end|>`` after the
    prompt of a state from random play (maps from a seed block no other phase uses)."""
    rng = np.random.default_rng(seed + 12_345)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    streams = [None] * batch
    n_maps = 0
    t0 = time.monotonic()
    losses = []
    for _ in range(steps):
        seqs = []
        for k in range(batch):
            if streams[k] is None:
                env = make_env()
                n_maps += 1
                env.reset(seed=2_000_000_000 + seed * 100_000 + n_maps)
                streams[k] = env
            env = streams[k]
            move = str(rng.choice(legal_moves(env)))
            reply = f"<answer>{move}</answer>"
            seqs.append((prompt_ids(tokenizer, user_text(env, style)),
                         tokenizer.encode(reply, add_special_tokens=False) + [eos]))
            _, _, terminated, truncated, _ = env.step(reply)
            if terminated or truncated:
                env.close()
                streams[k] = None
        model.train()
        logp = sequence_logprobs(model, seqs)
        mask = torch.zeros_like(logp)
        for i, (_, r) in enumerate(seqs):
            mask[i, : len(r)] = 1.0
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return {"steps": steps, "seconds": time.monotonic() - t0, "loss_first": losses[0] if losses else None,
            "loss_last": float(np.mean(losses[-10:])) if losses else None}


# -- the loop ------------------------------------------------------------------------------
def run(args) -> None:
    from agents.policies.tiny import build_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.open("w", encoding="utf-8")

    def write(row: dict) -> None:
        log.write(json.dumps(row) + "\n")
        log.flush()

    base = Path(args.start or args.model or build_tiny_model("text", seed=args.seed))
    tokenizer = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.eval()
    if not args.start:
        write({"kind": "warmup", **warmup(model, tokenizer, args.warmup_steps, args.warmup_batch, args.warmup_lr,
                                          args.prompt, args.seed)})
    if args.save_start:
        model.save_pretrained(args.save_start)
        tokenizer.save_pretrained(args.save_start)
    ref = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32) if args.start else None
    if ref is None:
        import copy

        ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    ref.eval()

    policy = ref_policy = None
    if args.use_runner or args.use_update:  # the trainer's parts act on the same weights
        from agents.policies.policy import Policy
        from agents.rollout.runner import RolloutSettings

        policy = Policy(model, tokenizer)
        ref_policy = Policy(ref, tokenizer)
        runner = RolloutSettings(ENV_ID, {"feedback": False}, "window:0", args.group, 8, 1.0).runner(policy, seed=args.seed)
        if args.prompt != "task":
            raise SystemExit("--use-runner/--use-update play the task's own prompt: use --prompt task")
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    for phase_eval in ([0] if args.eval_every else []):
        write({"kind": "eval", "iteration": phase_eval,
               **{f"{k}_sampled": v for k, v in evaluate(model, tokenizer, args.eval_episodes, args.prompt, False, 1).items()},
               **{f"{k}_greedy": v for k, v in evaluate(model, tokenizer, args.eval_episodes, args.prompt, True, 1).items()}})
    t_start = time.monotonic()
    for it in range(1, args.iterations + 1):
        t0 = time.monotonic()
        seeds = [args.seed * 100_000_000 + (it - 1) * args.maps + b for b in range(args.maps)]
        if args.use_runner:
            records, _ = runner.collect(seeds, policy_version=it, rng_seed=args.seed * 1_000_003 + it)
            rets = [r.episode_return for r in records]
            succ = [r.success for r in records]
            episodes = None
        else:
            episodes = play(model, tokenizer, seeds, args.group, args.prompt, False, gen)
            group_advantages(episodes, args.group)
            rets = [e["ret"] for e in episodes]
            succ = [e["success"] for e in episodes]
        t1 = time.monotonic()
        if args.use_update:
            if episodes is not None:
                raise SystemExit("--use-update trains on the runner's records: add --use-runner")
            st = project_update(policy, ref_policy, opt, records, args.kl)
        elif episodes is None:  # the runner's records, this loop's update
            episodes = [{"turns": [{"prompt": list(s.token_ids[: int(np.argmax(s.loss_mask))]),
                                    "reply": list(s.token_ids[int(np.argmax(s.loss_mask)):])} for s in r.samples],
                         "adv": r.advantage} for r in records]
            st = grpo_step(model, ref, opt, episodes, args.clip, args.kl, 1.0)
        else:
            st = grpo_step(model, ref, opt, episodes, args.clip, args.kl, 1.0)
        t2 = time.monotonic()
        write({"kind": "train", "iteration": it, "return": float(np.mean(rets)), "success": float(np.mean(succ)),
               "time_rollout_s": t1 - t0, "time_update_s": t2 - t1, "elapsed_s": t2 - t_start, **st})
        if args.eval_every and it % args.eval_every == 0 or it == args.iterations:
            n = args.final_eval_episodes if it == args.iterations else args.eval_episodes
            write({"kind": "eval", "iteration": it, "elapsed_s": time.monotonic() - t_start,
                   **{f"{k}_sampled": v for k, v in evaluate(model, tokenizer, n, args.prompt, False, it).items()},
                   **{f"{k}_greedy": v for k, v in evaluate(model, tokenizer, n, args.prompt, True, it).items()}})
    log.close()


def summary(paths: list[str]) -> None:
    """The last evaluation of each run, and the iteration its greedy success first reached 0.6."""
    print("| run | iterations | final sampled | final greedy | probe (sampled) | first eval >= 0.60 |")
    print("|---|---|---|---|---|---|")
    import gzip

    for p in paths:
        with (gzip.open(p, "rt", encoding="utf-8") if p.endswith(".gz") else open(p, encoding="utf-8")) as fh:
            rows = [json.loads(line) for line in fh]
        evals = [r for r in rows if r["kind"] == "eval"]
        if not evals:
            continue
        last = evals[-1]
        first = next((r["iteration"] for r in evals if r["success_sampled"] >= 0.6), "-")
        pr = last["probe_sampled"]
        print(f"| {p} | {last['iteration']} | {last['success_sampled']:.3f} | {last['success_greedy']:.3f} | "
              f"{'nan' if pr != pr else f'{pr:.2f}'} | {first} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--summary", nargs="+", metavar="FILE", help="table the runs' logs and exit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/minimal/run.jsonl")
    ap.add_argument("--iterations", type=int, default=450)
    ap.add_argument("--maps", type=int, default=8, help="maps per iteration")
    ap.add_argument("--group", type=int, default=8, help="rollouts per map")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--kl", type=float, default=0.04)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--prompt", choices=("task", "short"), default="task")
    ap.add_argument("--warmup-steps", type=int, default=300)
    ap.add_argument("--warmup-batch", type=int, default=32)
    ap.add_argument("--warmup-lr", type=float, default=1e-3)
    ap.add_argument("--model", help="the untrained model folder to warm up (default: the embedded tiny model)")
    ap.add_argument("--start", help="start RL from this model folder (no warm-up), e.g. the trainer's pretrained default")
    ap.add_argument("--save-start", help="save the model RL starts from here")
    ap.add_argument("--use-runner", action="store_true", help="collect with the trainer's runner")
    ap.add_argument("--use-update", action="store_true", help="update with the trainer's policy_update")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-episodes", type=int, default=100)
    ap.add_argument("--final-eval-episodes", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.summary:
        summary(args.summary)
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
