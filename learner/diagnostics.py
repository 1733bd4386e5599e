"""What the policy looks at: action distributions across states, and counterfactual probes.

A policy can earn a fair score while ignoring its observation (on FrozenLake 4x4 a fixed
Down/Right habit reaches 0.39-0.46), so success alone does not say whether a policy reads the
state. Two measurements do, from the policy's own action probabilities (each candidate reply
scored in full and renormalised over the task's actions; no sampling):

- ``action_spread``: the mean total-variation distance between the action distributions of
  pairs of different states from random play. 0 means the same distribution on every state.
- ``illegal_mass``: the mean probability of actions that the state does not allow or that
  change nothing in it (FrozenLake: moves off the board; Sokoban: steps into a wall, blocked
  pushes; :meth:`~envs.base.MultiTurnEnv.effective_actions`), over the same states; reported
  where some state allows fewer actions than the task has. The pretraining's format replies are
  random *effective* moves, so a policy that reads the state puts little mass there. ``blind_illegal_mass`` is the reference: the mass
  that a board-blind model fitted to those replies puts there (one distribution for every state,
  the mean of the states' uniform-over-legal distributions).
- ``counterfactual_shift``: over the task's counterfactual probes
  (:class:`envs.capabilities.CounterfactualProbes`: pairs of states that differ in one
  detail, e.g. FrozenLake's hole below vs to the right of the player), the mean increase of
  the probability of the action that detail favours. 0 for a policy blind to it; up to 1.
  ``counterfactual_ci_low`` / ``_high``: its 95% interval over the pairs (normal approximation),
  the board-reading verdict of tasks without a task-specific probe (Sokoban: a wall vs floor
  next to the player).

Prompts are built as a ``window:0`` runner builds them (instructions and the current
observation), the setting these diagnostics are meant for. With ``reasoning="lookahead"``
(``"state"``) every candidate reply starts with the state's true lookahead (its text) in a think tag
(:func:`envs.capabilities.think_reply`), the same for all actions of a state, so the distribution is
that of the answer given correct lookahead.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from agents.record import Sample
from agents.rollout.seeds import DIAGNOSTIC_SEED_BASE
from envs.capabilities import counterfactual_probes, reasoning_text, think_reply
from learner.batch import batch_logprobs, supervised_batches



def _prompt(obs: dict, instructions: str, first: bool, with_images: bool) -> tuple[str, list[np.ndarray]]:
    text = obs["text"] if first else f"{instructions}\n\n{obs['text']}"
    return text, ([np.asarray(obs["image"], dtype=np.uint8)] if with_images and "image" in obs else [])


@torch.no_grad()
def action_probabilities(policy, states: list[tuple[str, list[np.ndarray]]], replies: list[str],
                         temperature: float = 1.0, micro_batch: int = 256,
                         prefixes: list[str] | None = None) -> np.ndarray:
    """``[len(states), len(replies)]``: each reply's probability (EOS included) in each state,
    renormalised over ``replies``; ``prefixes[i]`` (optional) maps a reply to state ``i``'s
    full reply (e.g. its lookahead before the answer), scored as a whole."""
    samples, images = [], []
    for i, (text, ims) in enumerate(states):
        prompt = policy.chat.first_message(text, ims)
        shown = replies if prefixes is None else [think_reply(prefixes[i], r) for r in replies]
        for reply in (policy.encode_reply(r) for r in shown):
            samples.append(Sample(prompt + reply, [0] * len(prompt) + [1] * len(reply), [0.0] * (len(prompt) + len(reply)),
                                  list(range(len(ims)))))
            images.append(list(ims))
    totals: list[float] = []
    for batch in supervised_batches(samples, images, micro_batch):
        totals.extend(batch_logprobs(policy, batch, temperature).sum(1).tolist())
    logp = np.asarray(totals, dtype=np.float64).reshape(len(states), len(replies))
    logp -= logp.max(axis=1, keepdims=True)
    p = np.exp(logp)
    return p / p.sum(axis=1, keepdims=True)


def _random_states(env, n: int, rng: np.random.Generator, with_images: bool,
                   reasoning: str = "none") -> tuple[list, set[str], list[str], list[set[str]]]:
    """``n`` observed states from short random walks, the legal actions seen in them, each
    state's think text for ``reasoning`` (empty strings where the task has none) and each
    state's effective actions."""
    task = env.unwrapped
    states, actions, lookahead, legal = [], set(), [], []
    for i in range(n * 3):
        if len(states) >= n:
            break
        obs, info = env.reset(seed=DIAGNOSTIC_SEED_BASE + i)
        instructions, first = info.get("instructions", ""), True
        for _ in range(int(rng.integers(0, 4))):
            obs, _, term, trunc, _ = env.step(task.sample_reply(rng))
            first = False
            if term or trunc:
                break
        else:
            states.append(_prompt(obs, instructions, first, with_images))
            actions.update(task.legal_actions())
            legal.append(set(task.effective_actions()))
            lookahead.append(_think(task, reasoning))
    return states, actions, lookahead, legal


def _think(task, reasoning: str) -> str:
    try:
        return reasoning_text(task, reasoning) or ""
    except NotImplementedError:
        return ""


def policy_diagnostics(policy, env_id: str, env_kwargs: dict[str, Any] | None, *, states: int = 32,
                       probes: int = 32, temperature: float = 1.0, seed: int = 0,
                       reasoning: str = "none") -> dict[str, float]:
    """``action_spread`` and ``counterfactual_shift`` (see the module docstring) of ``policy``
    on ``env_id``; tasks without discrete actions or probes report only what they support.
    ``reasoning="lookahead"`` / ``"state"``: replies are scored after the state's lookahead / text."""
    from envs.registry import make

    env = make(env_id, **dict(env_kwargs or {}))
    try:
        task = env.unwrapped
        try:
            task.legal_actions()
        except NotImplementedError:
            return {}
        except Exception:  # noqa: BLE001 - needs a reset first
            pass
        rng = np.random.default_rng(seed)
        with_images = policy.is_vision
        observed, actions, lookahead, legal = _random_states(env, states, rng, with_images, reasoning)
        prefixes = lookahead if reasoning != "none" else None
        if not actions:
            return {}
        names = sorted(actions)
        replies = [task.format_reply(a) for a in names]
        out: dict[str, float] = {}
        if len(observed) >= 2:
            p = action_probabilities(policy, observed, replies, temperature, prefixes=prefixes)
            tv = 0.5 * np.abs(p[:, None, :] - p[None, :, :]).sum(-1)
            k = len(p)
            out["action_spread"] = float(tv.sum() / (k * (k - 1)))
            allowed = np.array([[name in allow for name in names] for allow in legal])
            if not allowed.all():
                out["illegal_mass"] = float((p * ~allowed).sum(1).mean())
                blind = (allowed / allowed.sum(1, keepdims=True)).mean(0)
                out["blind_illegal_mass"] = float((blind * ~allowed).sum(1).mean())
        pairs = counterfactual_probes(task, np.random.default_rng(seed + 1), probes)
        if pairs:
            shown, ahead = [], []
            for options_a, options_b, _ in pairs:
                for options in (options_a, options_b):
                    obs, info = env.reset(seed=DIAGNOSTIC_SEED_BASE, options=options)
                    shown.append(_prompt(obs, info.get("instructions", ""), True, with_images))
                    ahead.append(_think(task, reasoning))
            p = action_probabilities(policy, shown, replies, temperature,
                                     prefixes=ahead if reasoning != "none" else None)
            col = np.array([names.index(action) for _, _, action in pairs])
            rows = np.arange(len(pairs))
            shift = p[2 * rows + 1, col] - p[2 * rows, col]
            out["counterfactual_shift"] = float(np.mean(shift))
            out["counterfactual_pairs"] = float(len(shift))
            if len(shift) >= 2:  # a 95% interval of the mean shift over the pairs (normal approximation)
                half = 1.96 * float(np.std(shift, ddof=1)) / math.sqrt(len(shift))
                out["counterfactual_ci_low"] = out["counterfactual_shift"] - half
                out["counterfactual_ci_high"] = out["counterfactual_shift"] + half
        return out
    finally:
        env.close()
