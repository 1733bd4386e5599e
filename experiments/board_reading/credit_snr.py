"""How much of a policy-gradient step goes into reading the board, per advantage estimator.

On FrozenLake the trained policy first learns a board-blind Down/Right habit and reads the
board only 80-210 iterations later (docs/results/frozenlake_onpolicy.md). This measures the policy gradient
itself at a given checkpoint: for ``--batches`` independent batches of B x G episodes
(the trainer's runner, held-out maps), the on-policy GRPO gradient (the trainer's
batching and loss, KL left out) under each advantage estimator, all on the same episodes
(paired), projected on two directions of weight space:

- **reading**: the gradient of the counterfactual shift (``learner.diagnostics``: on boards
  that differ only in whether the hole is below or right of the player, how much more the
  policy picks Down when the hole is to the right), i.e. the direction that makes the policy
  look where it steps;
- **habit**: the gradient of the mean probability of Down or Right over random states.

Per estimator and direction it prints the mean cosine between a batch's gradient and the
direction, its spread over batches, and the per-batch signal-to-noise ratio of the projection
(mean / sd): Adam takes steps of roughly fixed size, so the cosine says how much of a step
goes into the direction, and the SNR how many batches it takes for that part to stand out of
the noise.

    python experiments/board_reading/credit_snr.py runs/snr/ckpt_s2/checkpoints/iter_000020/model --batches 24
    python experiments/board_reading/credit_snr.py MODEL [MODEL ...] --estimators episode nostd gigpo step

Estimators: ``episode`` (the default: ``(R - mean) / (std + eps)`` of the episode return on
every turn), ``nostd`` (``R - mean``), ``gigpo`` (``episode`` plus the step advantage,
``--advantage gigpo``; ``gigpo:W`` with ``--step-weight W``), ``step`` (the step advantage alone: each turn's discounted return-to-go
normalised among the group's turns that saw the same board).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch


ENV_ID = "freshper/FrozenLake-v0"
ESTIMATORS = ("episode", "nostd", "gigpo", "step")
#: Task seeds of the measured batches: the held-out block (``agents.rollout.seeds.EVAL_SEED_BASE``);
#: nothing is trained on them here, and they are maps no training run sees.
SEED_BASE = 1_900_000_000


def set_advantages(records, estimator: str) -> None:
    """Give every record (and its samples) the advantages of ``estimator``."""
    from learner.advantages import assign_group_advantages, assign_step_advantages

    assign_group_advantages(records)
    for r in records:
        for s in r.samples:
            s.advantage = None
    if estimator == "nostd":
        groups: dict[int, list] = {}
        for r in records:
            groups.setdefault(r.group_id, []).append(r)
        for members in groups.values():
            mean = float(np.mean([m.episode_return for m in members]))
            for m in members:
                m.advantage = m.episode_return - mean
    elif estimator == "step" or estimator.split(":")[0] == "gigpo":
        weight = float(estimator.split(":")[1]) if ":" in estimator else 1.0
        assign_step_advantages(records, gamma=0.95, weight=weight)
        if estimator == "step":
            for r in records:
                for s in r.samples:
                    s.advantage -= r.advantage
    elif estimator != "episode":
        raise ValueError(f"unknown estimator {estimator!r}; choose from {ESTIMATORS}")


def flat_grad(params) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def policy_gradient(policy, records, ref=None, kl_coef: float = 0.0) -> torch.Tensor:
    """The ascent direction of the on-policy GRPO objective (the trainer's loss). Without
    ``ref`` the KL term is left out; with it, the direction of the KL term alone
    (``kl_coef`` times the k3 KL to ``ref``, the advantages set to 0)."""
    from learner.batch import batch_logprobs, make_batches
    from learner.loss import LossSettings, grpo_loss

    params = list(policy.model.parameters())
    policy.model.zero_grad(set_to_none=True)
    for batch in make_batches(records):
        logp = batch_logprobs(policy, batch)
        ref_lp, adv = None, batch.advantages
        if ref is not None:
            with torch.no_grad():
                ref_lp = batch_logprobs(ref, batch)
            adv = torch.zeros_like(adv)
        loss, _ = grpo_loss(logp, logp.detach(), batch.mask, adv, batch.weights, LossSettings(kl_coef=kl_coef),
                            ref_logp=ref_lp, num_tokens=batch.num_tokens)
        loss.backward()
    g = -flat_grad(params)
    policy.model.zero_grad(set_to_none=True)
    return g


def _reply_probs(policy, prompts: list[str], replies: list[str]) -> torch.Tensor:
    """``[len(prompts), len(replies)]`` probabilities of each reply, renormalised over replies
    (differentiable)."""
    from agents.record import Sample
    from learner.batch import batch_logprobs, supervised_batches

    samples = []
    for text in prompts:
        prompt = policy.chat.first_message(text, [])
        for reply in (policy.encode_reply(r) for r in replies):
            samples.append(Sample(prompt + reply, [0] * len(prompt) + [1] * len(reply), [0.0] * (len(prompt) + len(reply))))
    logp = torch.cat([batch_logprobs(policy, b).sum(1) for b in supervised_batches(samples)])
    return torch.softmax(logp.reshape(len(prompts), len(replies)), dim=1)


def directions(policy, probes: int, states: int, seed: int) -> dict[str, torch.Tensor]:
    """Unit vectors of the reading and habit directions (see the module docstring)."""
    import envs
    from envs.frozenlake import ACTIONS

    env = envs.make(ENV_ID, feedback=False)
    task = env.unwrapped
    replies = [task.format_reply(a) for a in ACTIONS]
    params = list(policy.model.parameters())
    out = {}
    pairs = task.counterfactual_probes(np.random.default_rng(seed), probes)
    prompts = []
    for a, b, _ in pairs:
        for options in (a, b):
            obs, _ = env.reset(seed=0, options=options)
            prompts.append(obs["text"])
    policy.model.zero_grad(set_to_none=True)
    p = _reply_probs(policy, prompts, replies)
    down = ACTIONS.index("Down")
    shift = (p[1::2, down] - p[0::2, down]).mean()
    shift.backward()
    out["reading"] = flat_grad(params)
    rng = np.random.default_rng(seed + 1)
    prompts = []
    for i in range(states):
        obs, info = env.reset(seed=SEED_BASE - 1 - i)
        for _ in range(int(rng.integers(0, 3))):
            obs, _, term, trunc, _ = env.step(task.sample_reply(rng))
            if term or trunc:
                obs, info = env.reset(seed=SEED_BASE - 1 - i)
                break
        prompts.append(f"{info['instructions']}\n\n{task.board_text()}")
    policy.model.zero_grad(set_to_none=True)
    p = _reply_probs(policy, prompts, replies)
    habit = p[:, [ACTIONS.index("Down"), ACTIONS.index("Right")]].sum(1).mean()
    habit.backward()
    out["habit"] = flat_grad(params)
    policy.model.zero_grad(set_to_none=True)
    env.close()
    return {k: v / v.norm().clamp(min=1e-12) for k, v in out.items()}, float(shift.detach()), float(habit.detach())


def measure(model: str, estimators: list[str], batches: int, tasks: int, group: int, probes: int,
            seed: int, reference: str | None = None, kl_coef: float = 0.04) -> dict:
    from agents.policies.policy import Policy
    from agents.rollout.runner import RolloutSettings

    policy = Policy.from_pretrained(model)
    ref = None
    if reference:
        ref = Policy.from_pretrained(reference)
        ref.model.requires_grad_(False)
        estimators = [*estimators, "kl"]
    dirs, shift, habit = directions(policy, probes, 64, seed)
    runner = RolloutSettings(ENV_ID, {"feedback": False}, "window:0", group, 8, 1.0).runner(policy, seed=seed)
    proj = {e: {d: [] for d in dirs} for e in estimators}
    norms = {e: [] for e in estimators}
    success = []
    for k in range(batches):
        seeds = [SEED_BASE + seed * 100_000 + k * tasks + b for b in range(tasks)]
        records, stats = runner.collect(seeds, policy_version=0, rng_seed=seed * 7_919 + k)
        success.append(stats["success_rate"])
        for e in estimators:
            if e == "kl":
                g = policy_gradient(policy, records, ref, kl_coef)
            else:
                set_advantages(records, e)
                g = policy_gradient(policy, records)
            n = float(g.norm())
            norms[e].append(n)
            for d, v in dirs.items():
                proj[e][d].append(float(g @ v) / max(n, 1e-12))
    rows = {}
    for e in estimators:
        rows[e] = {"grad_norm": float(np.mean(norms[e]))}
        for d in dirs:
            c = np.asarray(proj[e][d])
            rows[e][f"{d}_cos"] = float(c.mean())
            rows[e][f"{d}_cos_sd"] = float(c.std(ddof=1)) if len(c) > 1 else float("nan")
            rows[e][f"{d}_snr"] = float(c.mean() / c.std(ddof=1)) if len(c) > 1 and c.std() > 0 else float("nan")
    return {"model": model, "batches": batches, "tasks": tasks, "group": group, "success": float(np.mean(success)),
            "counterfactual_shift": shift, "p_down_right": habit, "estimators": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="model folders (a checkpoint's model/)")
    ap.add_argument("--estimators", nargs="+", default=list(ESTIMATORS),
                    help=f"from {', '.join(ESTIMATORS)}; gigpo:W weighs the step advantage W (default 1)")
    ap.add_argument("--batches", type=int, default=24)
    ap.add_argument("--tasks", type=int, default=8, help="B: maps per batch")
    ap.add_argument("--group", type=int, default=8, help="G: rollouts per map")
    ap.add_argument("--probes", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", help="the run's KL reference (runs/<run>/reference): adds a row for the KL term alone")
    ap.add_argument("--kl-coef", type=float, default=0.04, help="the KL term's weight (train.py's --kl-coef)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="also write the results here (JSON lines)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| model | success | cf shift | P(D or R) | estimator | grad norm | reading cos (sd) | reading SNR | "
          "habit cos (sd) | habit SNR |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        res = measure(model, args.estimators, args.batches, args.tasks, args.group, args.probes, args.seed,
                      args.reference, args.kl_coef)
        for e, r in res["estimators"].items():
            print(f"| {model} | {res['success']:.2f} | {res['counterfactual_shift']:+.3f} | {res['p_down_right']:.2f} | "
                  f"{e} | {r['grad_norm']:.3f} | {r['reading_cos']:+.4f} ({r['reading_cos_sd']:.4f}) | "
                  f"{r['reading_snr']:+.2f} | {r['habit_cos']:+.4f} ({r['habit_cos_sd']:.4f}) | {r['habit_snr']:+.2f} |",
                  flush=True)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
