"""Pretraining on a task's own transitions: the start the embedded default model needs.

A randomly initialised tiny model knows neither the reply format nor how to read a state.
RL alone teaches it the format and a state-blind habit, not to look at the cells it steps on
(docs/results/history.md). Pretraining on the environment's own dynamics builds that perception
without telling the model which action is good:

- a **dynamics** example shows a state and a random well-formed action and asks for what it
  leads to: user = the task prompt of the state + ``"\\nMove: <action>"``, assistant =
  ``<answer>`` + :func:`envs.capabilities.outcome_text` + ``</answer>`` (the next
  state in the task's text notation, or how the episode ended: ``hole``/``goal`` on FrozenLake).
  Where the task's random replies leave out legal moves that do nothing
  (:meth:`~envs.base.MultiTurnEnv.effective_actions`, e.g. Sokoban's steps into a wall), the
  action is any legal move, so the dynamics also show what blocks a move;
- a **format** example is the task prompt of a state and a random well-formed reply
  (:meth:`~envs.base.MultiTurnEnv.sample_reply`, a uniform *effective* action), so the model
  learns to answer in format, with no preference between the actions that do something: to
  imitate it, the model must read which those are. With ``reasoning="lookahead"`` the reply starts with
  what each legal action leads to (:class:`envs.capabilities.Lookahead`) in a think
  tag, ``<think> Left - Down F Right H Up -</think><answer>Down</answer>``, so the policy
  learns to write what lies next to it before it answers (the answer is still random). With
  ``reasoning="state"`` the think tag holds the state itself in the task's text notation
  (:meth:`~envs.base.MultiTurnEnv.render_text`): a vision policy transcribes the image before
  it answers, so its answer reads text, as a text policy's does.

- a **success** example (``success_fraction`` of the format examples; off by default) is a
  turn of a random-play episode that succeeded: imitation of random play's successes. It is the
  one part that uses the task's reward (a success filter on random play, as in rejection-sampling
  fine-tuning with a random policy), for a task whose random play sometimes succeeds but whose
  start of RL too rarely does (SearchQA: random answers drawn from the passages are right ~5% of
  the time, the pretrained model's ~0.5%).

States come from random play: ``batch`` streams each play their own episodes of the task with
random well-formed replies, one transition per stream per step (new tasks from a seed block
disjoint from training and evaluation seeds). Everything goes through the env contract, so any
task that can draw a random reply (``legal_actions`` or ``sample_reply``) gets it: text and
vision (the model sees the image, predicts the next state as text). The loss is the mean
negative log-likelihood of the reply tokens.

:func:`pretrained_default` builds the embedded tiny model, pretrains it on a task and caches
the result under the model cache, keyed by everything that shapes it (the recipe, the seed and
a digest of a stretch of the task's random play), so ``train.py`` pays for it once per task,
seed and recipe.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from agents.record import Sample
from agents.rollout.seeds import pretrain_seed
from agents.policies.tiny import DEFAULT_WIDTH
from envs.capabilities import (REASONING_NEEDS, REASONINGS, SubgoalMoves, outcome_text, reasoning_text, require,
                               supports_reasoning, think_reply)
from learner.update import nll_per_sample, supervised_step

logger = logging.getLogger(__name__)

#: Bump when the examples or the training change, so cached pretrained models are rebuilt.
PRETRAIN_VERSION = 2
MARKER = "freshper_pretrain.json"


#: Pretraining steps of the embedded default (``steps=None``).
DEFAULT_PRETRAIN_STEPS = 400
#: The embedded default's pretraining goes on past its steps until the model writes this share
#: of held-out next boards exactly (``until_exact=None`` with ``steps=None``): most seeds pass
#: 0.80 at 400 steps, a few stall near 0.1 there
#: (docs/results/frozenlake.md#pretraining-until-the-model-writes-the-next-board).
DEFAULT_PRETRAIN_EXACT = 0.5

#: Field metadata: ``locked``, the setting cannot change when a run resumes; ``flag``, its
#: command-line name where that is not ``pretrain_`` + the field's; ``setting: False``, not a
#: setting of its own (``learner.config`` fills it from another section, or it keeps its default).
_LOCKED = {"locked": True}


@dataclass
class PretrainSettings:
    """The pretraining recipe: ``train.py``'s ``pretrain`` settings (``learner.config``; flags
    ``--pretrain-*``). ``None`` in ``steps`` or ``until_exact`` is train.py's default, which
    :meth:`recipe` resolves."""

    steps: int | None = dataclasses.field(default=DEFAULT_PRETRAIN_STEPS, metadata=_LOCKED)
    """pretraining optimizer steps; None (train.py's default): 400 for the embedded model (built once and cached), 0 with --model"""
    batch: int = dataclasses.field(default=64, metadata=_LOCKED)
    """examples per pretraining step (also the number of random-play streams)"""
    lr: float = dataclasses.field(default=1e-3, metadata=_LOCKED)
    """Adam learning rate of pretraining"""
    dynamics_fraction: float = dataclasses.field(default=0.5, metadata={"locked": True, "flag": "pretrain_dynamics"})
    """share of dynamics examples (state + move -> what it leads to); the rest are random well-formed replies; 0: a format-only warm-up"""
    observe_fraction: float = dataclasses.field(default=0.0, metadata={"locked": True, "flag": "pretrain_observe"})
    """share of observation examples (the state as shown -> the state as text), taken from the dynamics share: perception alone, for image tasks"""
    reasoning: str = dataclasses.field(default="none", metadata={"locked": True, "flag": "reasoning"})
    """what a reply writes before its answer, in a think tag taught by the pretraining's format replies: 'none'; 'lookahead': what each legal action leads to (the task's lookahead_text); 'state': the state in the task's text notation (render_text; an image task's policy transcribes the image, then answers); 'aim': where the agent's target lies (the task's aim_text, e.g. Sokoban's 'box Up Left goal Down'), then the lookahead; 'subgoal': the next place to reach and what to do there (the task's subgoal_text, e.g. Sokoban's 'stand Up Left push Right'), then the lookahead. Needs --max-new-tokens room for it"""
    max_grad_norm: float = dataclasses.field(default=1.0, metadata={"setting": False})
    """gradient clipping by global norm (a run's --max-grad-norm)"""
    seconds: float | None = dataclasses.field(default=None, metadata=_LOCKED)
    """stop pretraining after this many seconds (a capped pretraining is not cached)"""
    until_exact: float | None = dataclasses.field(default=0.0, metadata=_LOCKED)
    """after --pretrain-steps, keep pretraining in rounds of 100 steps until the model writes this share of held-out next states exactly (greedy; on two held-out random-play transitions per --pretrain-batch stream, at most 128), up to --pretrain-max-steps; 0: off. None (train.py's default): 0.5 when --pretrain-steps is not given (the embedded default's recipe), else 0"""
    max_steps: int | None = dataclasses.field(default=None, metadata=_LOCKED)
    """with --pretrain-until-exact: stop there even below the bar (default, None or 0: 4x --pretrain-steps)"""
    check_every: int = dataclasses.field(default=100, metadata={"setting": False})
    """with ``until_exact``: steps between two measurements of the held-out exact rate"""
    follow_steps: int = dataclasses.field(default=0, metadata=_LOCKED)
    """a second pretraining stage of this many steps, with --reasoning subgoal: --pretrain-follow of its format replies play a move that does what the think tag's subgoal words say (the task's subgoal_moves), so the model learns what its words mean as a move; the first stage is cached on its own. 0: none"""
    success_fraction: float = dataclasses.field(default=0.0, metadata={"locked": True, "flag": "pretrain_success"})
    """share of the pretraining's format examples that are turns of random-play episodes that succeeded (imitation of random play's successes, the only part of the pretraining that uses the task's reward; the episodes random play takes to find them count in the pretraining's episodes); for tasks whose random play sometimes succeeds and whose RL start too rarely does (SearchQA). 0: off"""
    replies: str = dataclasses.field(default="random", metadata=_LOCKED)
    """the format examples' replies: 'random' (random well-formed replies, the embedded model's warm-up) or 'own' (a real chat model's own answers: each prompt asked directly, the answer taken out of the model's greedy reply and put in the task's reply format, learner/warmup.py; needs --pretrain-dynamics 0)"""
    follow_fraction: float = dataclasses.field(default=1.0, metadata={"locked": True, "flag": "pretrain_follow"})
    """with --pretrain-follow-steps: the share of the second stage's format replies whose move follows the words (the rest stay random; a uniform draw among the moves that do); docs/results/sokoban.md#following-the-words compares shares"""

    def __post_init__(self) -> None:
        steps = DEFAULT_PRETRAIN_STEPS if self.steps is None else self.steps
        if steps < 0:
            raise ValueError("--pretrain-steps must be >= 0")
        if self.batch < 1 or not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError("--pretrain-batch must be >= 1 and --pretrain-lr a positive number")
        if not 0.0 <= self.dynamics_fraction <= 1.0:
            raise ValueError(f"--pretrain-dynamics must be in [0, 1], got {self.dynamics_fraction}")
        if not 0.0 <= self.observe_fraction <= self.dynamics_fraction:
            raise ValueError(f"--pretrain-observe must be in [0, --pretrain-dynamics], got {self.observe_fraction}")
        if self.until_exact is not None and not 0.0 <= self.until_exact <= 1.0:
            raise ValueError(f"--pretrain-until-exact must be in [0, 1], got {self.until_exact}")
        if self.max_steps is not None and (self.max_steps < 0 or 0 < self.max_steps < steps):
            raise ValueError(f"--pretrain-max-steps must be >= --pretrain-steps ({steps}; 400 by default), "
                             f"got {self.max_steps}")
        if self.check_every < 1:
            raise ValueError("check_every must be >= 1")
        if self.reasoning not in REASONINGS:
            raise ValueError(f"--reasoning must be one of {'|'.join(REASONINGS)}, got {self.reasoning!r}")
        if not 0.0 <= self.success_fraction <= 1.0:
            raise ValueError(f"--pretrain-success (success_fraction) must be in [0, 1], got {self.success_fraction}")
        if self.follow_steps < 0 or not 0.0 <= self.follow_fraction <= 1.0:
            raise ValueError("--pretrain-follow-steps must be >= 0 and --pretrain-follow in [0, 1]")
        if self.follow_steps and self.reasoning != "subgoal":
            raise ValueError(f"--pretrain-follow-steps needs --reasoning subgoal (the words a move follows), "
                             f"got --reasoning {self.reasoning}")
        if self.replies not in ("random", "own"):
            raise ValueError(f"--pretrain-replies must be 'random' or 'own', got {self.replies!r}")
        if self.replies == "own" and (self.dynamics_fraction or self.success_fraction or self.follow_steps
                                      or self.until_exact or self.reasoning != "none"):
            raise ValueError("--pretrain-replies own is a format warm-up on the model's own answers: it needs "
                             "--pretrain-dynamics 0, no --pretrain-success, --pretrain-follow-steps, "
                             "--pretrain-until-exact or --reasoning")
        if self.follow_steps and self.seconds is not None:
            raise ValueError("--pretrain-follow-steps builds on a cached first stage: drop --pretrain-seconds")

    def recipe(self) -> "PretrainSettings":
        """This recipe with train.py's defaults resolved: ``steps`` None is 400, ``until_exact``
        None is 0.5 when ``steps`` is None (the embedded default's bar) else 0, ``max_steps``
        None is 0 (four times ``steps``)."""
        until = self.until_exact
        if until is None:
            until = DEFAULT_PRETRAIN_EXACT if self.steps is None else 0.0
        return dataclasses.replace(self, steps=DEFAULT_PRETRAIN_STEPS if self.steps is None else self.steps,
                                   until_exact=until, max_steps=self.max_steps or 0)


@dataclass
class Example:
    """One supervised example: a user message (text with ``<image>`` slots and its images)
    and the assistant reply to learn; ``kind`` is ``"dynamics"`` or ``"format"``."""

    text: str
    images: list[np.ndarray]
    reply: str
    kind: str


def has_random_replies(env) -> bool:
    """Whether the task can draw random well-formed replies (so it can be pretrained): it
    implements ``sample_reply`` or ``legal_actions`` of the env contract."""
    from envs.base import MultiTurnEnv

    cls = type(env.unwrapped)
    return cls.sample_reply is not MultiTurnEnv.sample_reply or cls.legal_actions is not MultiTurnEnv.legal_actions


class TransitionStreams:
    """``n`` environments, each playing its own episodes with random well-formed replies.

    :meth:`examples` takes one transition from every stream and turns it into an example:
    a dynamics example with probability ``dynamics_fraction``, else a format example (with
    probability ``success_fraction`` a turn of a successful random episode instead,
    :meth:`success_example`).
    """

    #: Random episodes :meth:`success_example` plays to find one success before it gives up.
    MAX_SCOUT_EPISODES = 20_000

    def __init__(self, env_id: str, env_kwargs: dict[str, Any] | None, n: int, seed: int,
                 dynamics_fraction: float, with_images: bool, observe_fraction: float = 0.0,
                 reasoning: str = "none", follow_fraction: float = 0.0, first_episode: int = 0,
                 success_fraction: float = 0.0) -> None:
        from envs.registry import make

        self.env_id, self.env_kwargs = env_id, dict(env_kwargs or {})
        self.envs = []
        try:
            for _ in range(n):
                self.envs.append(make(env_id, **self.env_kwargs))
        except Exception as exc:
            for env in self.envs:
                env.close()
            if getattr(exc, "status", None) == 503:  # a served task's server at its session limit
                raise RuntimeError(f"pretraining plays {n} random-play streams at once (--pretrain-batch), one "
                                   f"session each, and the server refused session {len(self.envs) + 1}: {exc}. "
                                   "Lower --pretrain-batch or raise the server's --max-sessions") from exc
            raise
        self.rng = np.random.default_rng(pretrain_seed(seed, 0))
        self.seed = seed
        self.dynamics_fraction = dynamics_fraction
        self.observe_fraction = observe_fraction
        self.reasoning = reasoning
        self.follow_fraction = follow_fraction
        self.success_fraction = success_fraction
        self.with_images = with_images
        self._scout = None  # the environment success_example plays its random episodes in
        self._successes: list[Example] = []  # turns of the last successful episode not yet used
        self.successes_found = 0
        self._episodes = first_episode
        self._state: list[tuple[dict, str, bool] | None] = [None] * n  # (obs, instructions, first turn)

    def close(self) -> None:
        for env in self.envs + ([self._scout] if self._scout is not None else []):
            env.close()

    def success_example(self) -> Example:
        """The next turn of a random-play episode that succeeded: random episodes (well-formed
        random replies, as the streams play them, on new tasks of the same seed block) are
        played to the end until one succeeds; its turns (the prompt a ``window:0`` runner shows
        and the reply played, with the think tag of ``reasoning``) are handed out in order.
        Raises a clear error when ``MAX_SCOUT_EPISODES`` episodes in a row do not succeed."""
        if not self._successes:
            from envs.registry import make

            if self._scout is None:
                self._scout = make(self.env_id, **self.env_kwargs)
            for _ in range(self.MAX_SCOUT_EPISODES):
                self._episodes += 1
                obs, info = self._scout.reset(seed=pretrain_seed(self.seed, self._episodes))
                instructions, first, turns = info.get("instructions", ""), True, []
                while True:
                    task = self._scout.unwrapped
                    text, images = self._prompt(obs, instructions, first)
                    reply = task.sample_reply(self.rng)
                    if self.reasoning != "none":
                        reply = think_reply(think_text(task, self.reasoning), reply)
                    turns.append(Example(text, images, reply, "success"))
                    obs, _, terminated, truncated, info = self._scout.step(reply)
                    first = False
                    if terminated or truncated or info.get("failed"):
                        break
                if info.get("success") and not info.get("failed"):
                    self._successes, self.successes_found = turns, self.successes_found + 1
                    break
            else:
                raise RuntimeError(f"{self.MAX_SCOUT_EPISODES} random episodes of {self.env_id} without a success: "
                                   "imitating random play's successes needs a task that random play sometimes "
                                   "solves; set the success fraction to 0")
        return self._successes.pop(0)

    def _reset(self, k: int) -> None:
        self._episodes += 1
        obs, info = self.envs[k].reset(seed=pretrain_seed(self.seed, self._episodes))
        self._state[k] = (obs, info.get("instructions", ""), True)

    def _prompt(self, obs: dict, instructions: str, first: bool) -> tuple[str, list[np.ndarray]]:
        """The user message a ``window:0`` runner shows for this observation."""
        text = obs["text"] if first else f"{instructions}\n\n{obs['text']}"
        images = [np.asarray(obs["image"], dtype=np.uint8)] if self.with_images and "image" in obs else []
        return text, images

    def examples(self) -> list[Example]:
        out = []
        for k, env in enumerate(self.envs):
            if self._state[k] is None:
                self._reset(k)
            obs, instructions, first = self._state[k]
            task = env.unwrapped
            text, images = self._prompt(obs, instructions, first)
            reply = task.sample_reply(self.rng)
            draw = self.rng.random()
            kind = ("observe" if draw < self.observe_fraction else
                    "dynamics" if draw < self.dynamics_fraction else "format")
            if kind == "format" and self.success_fraction > 0 and self.rng.random() < self.success_fraction:
                out.append(self.success_example())  # this stream's own episode waits for the next call
                continue
            if kind == "dynamics":
                reply = _dynamics_reply(task, reply, self.rng)
            if kind == "observe":  # the state as shown -> the state in text (perception alone)
                out.append(Example(f"{text}\nState:", images, f"<answer>{outcome_text(task, False, False)}</answer>",
                                   "observe"))
            if kind == "format" and self.follow_fraction > 0 and self.rng.random() < self.follow_fraction:
                named = follow_moves(task)  # the move the think tag's words name, where one does
                if named:
                    reply = task.format_reply(named[int(self.rng.integers(len(named)))])
            action = task.describe_action(reply)
            if kind == "format" and self.reasoning != "none":
                reply = think_reply(think_text(task, self.reasoning), reply)
            nxt, _, terminated, truncated, info = env.step(reply)
            if kind == "dynamics":
                outcome = outcome_text(task, bool(terminated), bool(info.get("success", False)))
                out.append(Example(f"{text}\nMove: {action}", images, f"<answer>{outcome}</answer>", "dynamics"))
            elif kind == "format":
                out.append(Example(text, images, reply, "format"))
            if terminated or truncated or info.get("failed"):
                self._state[k] = None
            else:
                self._state[k] = (nxt, instructions, False)
        return out


def think_text(task, mode: str) -> str | None:
    """The think tag of a ``--reasoning mode`` reply in ``task``'s state
    (:func:`envs.capabilities.reasoning_text`); where the task lacks what the mode needs, a
    ``NotImplementedError`` that also names the modes it can train with."""
    try:
        return reasoning_text(task, mode)
    except NotImplementedError as exc:  # a remote task's comes from its server, naming no protocol
        missing = getattr(exc, "capability", None)
        modes = [m for m in REASONINGS if m != mode and supports_reasoning(task, m)
                 and (missing not in REASONING_NEEDS[m] if missing else not REASONING_NEEDS[m])]
        raise NotImplementedError(f"{exc}; train it with --reasoning {'|'.join(modes)}") from None


def follow_moves(task) -> list[str]:
    """The moves that do what the task's subgoal words say (``--pretrain-follow-steps``:
    :class:`envs.capabilities.SubgoalMoves`); a ``NotImplementedError`` naming the flag where
    the task has none."""
    try:
        return require(task, SubgoalMoves).subgoal_moves()
    except NotImplementedError as exc:
        raise NotImplementedError(f"{exc}; train it without --pretrain-follow-steps") from None


def _dynamics_reply(task, reply: str, rng: np.random.Generator) -> str:
    """The move of a dynamics example: where the task's random replies leave out legal moves
    that do nothing (:meth:`~envs.base.MultiTurnEnv.effective_actions` narrowed, e.g. Sokoban's
    steps into a wall), a uniformly drawn legal move, so the dynamics examples also teach what
    blocks a move; elsewhere the random reply itself (no extra draw: the stream is unchanged)."""
    if not task.skips_noop_moves():
        return reply
    legal = list(task.legal_actions())
    return task.format_reply(legal[int(rng.integers(len(legal)))]) if legal else reply


def own_examples(policy, env_id: str, env_kwargs: dict[str, Any] | None, examples: list[Example], *,
                 progress: bool = False) -> tuple[list[Example], dict[str, Any]]:
    """``examples`` with their replies replaced by the model's own answers in the task's format
    (:func:`learner.warmup.own_replies`), those without a usable answer dropped; and a report."""
    from envs.registry import make
    from learner.warmup import own_replies

    env = make(env_id, **dict(env_kwargs or {}))
    try:
        task = env.unwrapped
        replies, _ = own_replies(policy, examples, task, progress=progress)
    finally:
        env.close()
    kept = [dataclasses.replace(ex, reply=r, kind="format") for ex, r in zip(examples, replies) if r is not None]
    usable = len(kept) / max(1, len(examples))
    logger.info("own-answer warm-up: %d of %d direct replies give a well-formed answer", len(kept), len(examples))
    return kept, {"pretrain_own_prompts": len(examples), "pretrain_own_usable": usable}


def encode(policy, examples: list[Example]) -> tuple[list[Sample], list[list[np.ndarray]]]:
    """Token samples of examples: the user message as the chat template renders a first
    message, then the reply closed by EOS; the loss mask covers the reply."""
    samples, images = [], []
    for ex in examples:
        prompt = policy.chat.first_message(ex.text, ex.images)
        reply = policy.encode_reply(ex.reply)
        samples.append(Sample(prompt + reply, [0] * len(prompt) + [1] * len(reply), [0.0] * (len(prompt) + len(reply)),
                              list(range(len(ex.images)))))
        images.append(list(ex.images))
    return samples, images


def held_out_dynamics(env_id: str, env_kwargs: dict[str, Any] | None, seed: int, with_images: bool,
                      streams: int = 64, rounds: int = 2) -> list[Example]:
    """Dynamics examples from random play on a seed block of their own (``seed + 104_729``),
    for :func:`exact_rate`: ``streams * rounds`` of them, the same for every recipe."""
    held = TransitionStreams(env_id, env_kwargs, streams, seed + 104_729, 1.0, with_images)
    try:
        return [ex for _ in range(rounds) for ex in held.examples()]
    finally:
        held.close()


def greedy_replies(policy, examples: list[Example]) -> list[str]:
    """What the policy writes for each example's prompt, greedy decoding, up to two tokens past
    the longest target reply (stripped)."""
    longest = max(len(policy.encode_reply(ex.reply)) for ex in examples) + 2
    gens = policy.generate([policy.chat.first_message(ex.text, ex.images) for ex in examples],
                           [ex.images for ex in examples], max_new_tokens=longest, greedy=True)
    return [policy.reply_text(g.token_ids).strip() for g in gens]


def exact_rate(policy, examples: list[Example]) -> float:
    """The share of ``examples`` whose reply the policy writes exactly, greedy decoding (for
    dynamics examples: the next state, or how the episode ended, to the character)."""
    if not examples:
        return float("nan")
    return float(np.mean([text == ex.reply for text, ex in zip(greedy_replies(policy, examples), examples)]))


def pretrain(policy, env_id: str, env_kwargs: dict[str, Any] | None, cfg: PretrainSettings, *, seed: int = 0,
             micro_batch: int = 256, progress: bool = False,
             on_step: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, Any]:
    """Both stages of ``cfg`` on ``policy`` in place (:func:`pretrain_stage`, then with
    ``cfg.follow_steps`` :func:`follow_stage`); their report."""
    cfg = cfg.recipe()
    report = pretrain_stage(policy, env_id, env_kwargs, cfg, seed=seed, micro_batch=micro_batch, progress=progress,
                            on_step=on_step)
    if cfg.follow_steps:
        report = follow_stage(policy, env_id, env_kwargs, cfg, report, seed=seed, micro_batch=micro_batch,
                              progress=progress)
    return report


def follow_stage(policy, env_id: str, env_kwargs: dict[str, Any] | None, cfg: PretrainSettings,
                 first: dict[str, Any], *, seed: int = 0, micro_batch: int = 256,
                 progress: bool = False) -> dict[str, Any]:
    """The second stage: ``cfg.follow_steps`` more steps whose format replies' moves follow the
    subgoal words with share ``cfg.follow_fraction``, on episodes after the first stage's
    (``first``: its report). Returns the two stages' report: steps, seconds and episodes
    summed, the losses and exact rate after the second, ``pretrain_follow_*`` for it alone."""
    stage = dataclasses.replace(cfg, steps=cfg.follow_steps, until_exact=0.0, max_steps=0, follow_steps=0)
    second = pretrain_stage(policy, env_id, env_kwargs, stage, seed=seed, micro_batch=micro_batch, progress=progress,
                            follow=cfg.follow_fraction, first_episode=int(first["pretrain_episodes"]))
    return {**first, **{k: v for k, v in second.items() if k.endswith("_after")},
            "pretrain_steps": first["pretrain_steps"] + second["pretrain_steps"],
            "pretrain_seconds": first["pretrain_seconds"] + second["pretrain_seconds"],
            "pretrain_episodes": first["pretrain_episodes"] + second["pretrain_episodes"], "pretrain_loss_last": second["pretrain_loss_last"],
            # a follow stage alone (``--model`` with no first-stage steps) starts the loss curve itself
            "pretrain_loss_first": first["pretrain_loss_first"] if first["pretrain_steps"] else second["pretrain_loss_first"],
            "pretrain_follow_steps": second["pretrain_steps"], "pretrain_follow_seconds": second["pretrain_seconds"],
            "pretrain_follow_format_nll_before": second.get("pretrain_format_nll_before", float("nan"))}


def pretrain_stage(policy, env_id: str, env_kwargs: dict[str, Any] | None, cfg: PretrainSettings, *, seed: int = 0,
                   micro_batch: int = 256, progress: bool = False,
                   on_step: Callable[[int, dict[str, float]], None] | None = None, follow: float = 0.0,
                   first_episode: int = 0) -> dict[str, Any]:
    """Pretrain ``policy`` in place on ``env_id``'s transitions; return a report (steps, losses
    per kind at the start and end on held-out examples, the held-out dynamics exact rate,
    seconds). With ``cfg.until_exact`` the training goes on past ``cfg.steps`` in rounds of
    ``cfg.check_every`` steps until that rate reaches the bar or ``cfg.max_steps`` is spent; the
    rates measured on the way are reported (``pretrain_exact_checks``: ``[step, rate]`` pairs)."""
    from tqdm.auto import tqdm

    cfg = cfg.recipe()
    # the held-out examples first, their envs closed before the training streams open: at most
    # cfg.batch envs at once (a served task's sessions: its server's --max-sessions is 64 by default)
    held = TransitionStreams(env_id, env_kwargs, cfg.batch, seed + 7_919, cfg.dynamics_fraction, policy.is_vision,
                             cfg.observe_fraction, cfg.reasoning, follow, success_fraction=cfg.success_fraction)
    try:
        held_examples = held.examples() + held.examples()
    finally:
        held.close()
    own = cfg.replies == "own"
    if own:  # the model's own answers, asked before any training
        held_examples, _ = own_examples(policy, env_id, env_kwargs, held_examples, progress=progress)
    held_samples, held_images = encode(policy, held_examples)
    kinds = np.array([ex.kind for ex in held_examples])
    # the held-out next-state rate: where next states are trained (or a bar is set on it); the own-answer
    # warm-up and a mix whose dynamics share is all observation examples train none
    next_states = not own and (cfg.dynamics_fraction > cfg.observe_fraction or cfg.until_exact > 0)
    exact_examples = held_out_dynamics(env_id, env_kwargs, seed, policy.is_vision,
                                       streams=min(64, cfg.batch)) if next_states else []
    streams = TransitionStreams(env_id, env_kwargs, cfg.batch, seed, cfg.dynamics_fraction, policy.is_vision,
                                cfg.observe_fraction, cfg.reasoning, follow, first_episode, cfg.success_fraction)
    pool: list[Example] = []
    own_report: dict[str, Any] = {}
    if own:  # every step's examples, answered by the start model before training begins
        try:
            drawn = [ex for _ in range(cfg.steps) for ex in streams.examples()]
        finally:
            streams.close()
        pool, own_report = own_examples(policy, env_id, env_kwargs, drawn, progress=progress)
        if not pool:
            raise RuntimeError(f"no usable answer in the model's {len(drawn)} direct replies to {env_id}'s prompts: "
                               "the own-answer warm-up needs a task the model can answer in a few words; "
                               "use --pretrain-replies random")

    def next_examples(step: int) -> list[Example]:
        if not own:
            return streams.examples()
        return [pool[(step * cfg.batch + k) % len(pool)] for k in range(cfg.batch)]

    def held_losses() -> dict[str, float]:
        nll = nll_per_sample(policy, held_samples, held_images, micro_batch)
        return {f"{k}_nll": float(nll[kinds == k].mean()) for k in ("dynamics", "observe", "format", "success")
                if (kinds == k).any()}

    before = held_losses()
    from learner.state import fused_adam

    params = list(policy.model.parameters())
    optimizer = torch.optim.Adam(params, lr=cfg.lr, fused=fused_adam(params) or None)  # fused: real models only
    cap = (cfg.max_steps or 4 * cfg.steps) if cfg.until_exact > 0 else cfg.steps
    start = time.monotonic()
    losses: list[float] = []
    checks: list[list[float]] = []
    bar = tqdm(total=cfg.steps, desc="pretrain (follow)" if follow else "pretrain", unit="step", disable=not progress, dynamic_ncols=True, leave=False)
    try:
        step = 0
        while step < cap:
            if cfg.until_exact > 0 and step >= cfg.steps and (step - cfg.steps) % cfg.check_every == 0:
                checks.append([step, exact_rate(policy, exact_examples)])
                logger.info("pretraining step %d: held-out dynamics exact %.2f (bar %.2f)", step, checks[-1][1],
                            cfg.until_exact)
                if checks[-1][1] >= cfg.until_exact:
                    break
                bar.total = min(cap, step + cfg.check_every)
                bar.set_description(f"pretrain (exact {checks[-1][1]:.2f} < {cfg.until_exact:.2f})")
                bar.refresh()
            if cfg.seconds is not None and time.monotonic() - start >= cfg.seconds:
                break
            samples, images = encode(policy, next_examples(step))
            st = supervised_step(policy, optimizer, samples, images, micro_batch=micro_batch,
                                 max_grad_norm=cfg.max_grad_norm)
            if not math.isfinite(st["loss"]):
                raise FloatingPointError(f"pretraining loss is not finite at step {step}; lower the pretraining lr")
            losses.append(st["loss"])
            if on_step is not None:
                on_step(step, st)
            bar.update(1)
            bar.set_postfix(loss=f"{st['loss']:.3f}")
            step += 1
    finally:
        bar.close()
        if not own:  # the own-answer warm-up closed its streams once it had drawn its examples
            streams.close()
    seconds = time.monotonic() - start
    after = held_losses()
    if next_states and (not checks or checks[-1][0] != len(losses)):  # the model as it ends, unless the last check saw it
        checks.append([len(losses), exact_rate(policy, exact_examples)])
    exact = checks[-1][1] if checks else float("nan")
    return {
        "pretrain_steps": len(losses), "pretrain_seconds": seconds,
        "pretrain_loss_first": losses[0] if losses else float("nan"),
        "pretrain_loss_last": float(np.mean(losses[-10:])) if losses else float("nan"),
        **{f"pretrain_{k}_before": v for k, v in before.items()},
        **{f"pretrain_{k}_after": v for k, v in after.items()},
        **({"pretrain_dynamics_exact_after": exact} if next_states else {}),
        **({"pretrain_exact_checks": checks, "pretrain_reached_bar": bool(exact >= cfg.until_exact)}
           if cfg.until_exact > 0 else {}),
        "pretrain_episodes": streams._episodes - first_episode,
        **({"pretrain_successes_imitated": streams.successes_found} if cfg.success_fraction > 0 else {}),
        **own_report,
    }


def cache_key(base_model: Path, env_id: str, env_kwargs: dict[str, Any] | None, cfg: PretrainSettings,
              seed: int) -> str:
    recipe = dataclasses.asdict(cfg.recipe())
    if not recipe["observe_fraction"]:  # the recipe before observation examples existed: same models, same keys
        del recipe["observe_fraction"]
    if recipe["reasoning"] == "none":  # likewise before the lookahead existed
        del recipe["reasoning"]
    if not recipe["until_exact"]:  # likewise before the exact-rate bar existed
        for name in ("until_exact", "max_steps", "check_every"):
            del recipe[name]
    if not recipe["success_fraction"]:  # likewise before the imitation of random play's successes existed
        del recipe["success_fraction"]
    if recipe["replies"] == "random":  # likewise before the own-answer warm-up existed
        del recipe["replies"]
    if not recipe["follow_steps"]:  # likewise before the follow stage existed
        del recipe["follow_steps"], recipe["follow_fraction"]
    parts: list[Any] = [PRETRAIN_VERSION, base_model.name, env_id, env_kwargs or {}, recipe, seed,
                        random_play_digest(env_id, env_kwargs)]
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def random_play_digest(env_id: str, env_kwargs: dict[str, Any] | None, turns: int = 12) -> str:
    """A digest of a short stretch of the task's random play (seed 0: its observations, images
    included, and the random replies it draws), so the pretrained model's cache key changes
    when what the pretraining would see does: a task drawn or worded differently, or random
    replies drawn another way, is another task to the model and is pretrained again."""
    import envs

    digest = hashlib.sha256()
    env = envs.make(env_id, **dict(env_kwargs or {}))
    try:
        rng = np.random.default_rng(0)
        obs, _ = env.reset(seed=0)
        for _ in range(turns):
            digest.update(str(obs.get("text", "")).encode())
            if obs.get("image") is not None:
                digest.update(np.ascontiguousarray(obs["image"]).tobytes())
            reply = env.unwrapped.sample_reply(rng)
            digest.update(reply.encode())
            obs, _, terminated, truncated, _ = env.step(reply)
            if terminated or truncated:
                obs, _ = env.reset(seed=1)
    finally:
        env.close()
    return digest.hexdigest()[:16]


def pretrained_default(env_id: str, env_kwargs: dict[str, Any] | None, cfg: PretrainSettings, *, seed: int = 0,
                       cache_dir: str | os.PathLike | None = None, micro_batch: int = 256,
                       progress: bool = False, device: str = "cpu", width: int = DEFAULT_WIDTH) -> tuple[Path, dict[str, Any]]:
    """The embedded tiny model of the task (:func:`agents.policies.tiny.task_model`: its modality's, with
    a tokenizer that also learned the task's own text where it has some), pretrained on
    ``env_id``'s transitions.

    Built once and cached (written to a temporary folder and renamed, like the tiny model);
    returns the model folder and its pretraining report (``cached`` says whether it was reused).
    A time cap (``cfg.seconds``) makes the result depend on the machine, so capped runs are
    not cached. ``device``: where the pretraining runs (the cached folder does not depend on it).
    ``width``: the tiny model's hidden size (:data:`agents.policies.tiny.DEFAULT_WIDTH`); a wider model
    is another base folder, so another cache key.
    With ``cfg.follow_steps`` the first stage is built (or found) as a model of its own and the
    second stage starts from it, so recipes that differ in the second stage share the first.
    """
    from agents.policies.tiny import cache_lock, default_cache_dir, task_model

    cfg = cfg.recipe()
    first: dict[str, Any] | None = None
    if cfg.follow_steps:
        if cfg.seconds is not None:  # refused before the first stage is built, not after
            raise ValueError("a time-capped first stage is not cached: give follow_steps without seconds")
        base, first = pretrained_default(env_id, env_kwargs, dataclasses.replace(cfg, follow_steps=0), seed=seed,
                                         cache_dir=cache_dir, micro_batch=micro_batch, progress=progress, device=device,
                                         width=width)
    else:
        base = task_model(env_id, env_kwargs, cache_dir=cache_dir, seed=seed, width=width)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    task = env_id.split("/")[-1]
    target = root / f"pretrained-{task}-s{seed}-{cache_key(base, env_id, env_kwargs, cfg, seed)}"
    root.mkdir(parents=True, exist_ok=True)
    with cache_lock(root / f".{target.name}.lock"):  # runs started together build it once
        if (target / MARKER).exists():
            report = json.loads((target / MARKER).read_text(encoding="utf-8"))
            return target, {**report, "cached": True}
        return _build(base, target, root, task, env_id, env_kwargs, cfg, seed, micro_batch, progress, device, first)


def _build(base: Path, target: Path, root: Path, task: str, env_id: str, env_kwargs: dict[str, Any] | None,
           cfg: PretrainSettings, seed: int, micro_batch: int, progress: bool,
           device: str = "cpu", first: dict[str, Any] | None = None) -> tuple[Path, dict[str, Any]]:
    from agents.policies.policy import Policy
    from agents.policies.tiny import staged_folder

    policy = Policy.from_pretrained(base, device=device)
    torch.manual_seed(seed)
    if first is not None:  # base is the first stage's model: only the second stage runs here
        first = {k: v for k, v in first.items() if k not in ("cached", "env_id", "env_kwargs", "base_model", "recipe")}
        report = follow_stage(policy, env_id, env_kwargs, cfg, first, seed=seed, micro_batch=micro_batch,
                              progress=progress)
    else:
        report = pretrain(policy, env_id, env_kwargs, cfg, seed=seed, micro_batch=micro_batch, progress=progress)
    if cfg.seconds is not None:  # machine-dependent: keep it in a folder that is not reused
        target = root / f".uncached-{task}-s{seed}-{os.getpid()}"
    with staged_folder(root, f".pretrain-{task}-", target) as tmp:
        policy.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({**report, "env_id": env_id, "env_kwargs": env_kwargs or {},
                                              "base_model": base.name, "recipe": dataclasses.asdict(cfg)}),
                                  encoding="utf-8")
    logger.info("pretrained %s on %s in %.0f s (%d steps) at %s", base.name, env_id, report["pretrain_seconds"],
                report["pretrain_steps"], target)
    return target, {**report, "cached": False}


def iter_examples(env_id: str, env_kwargs: dict[str, Any] | None, n: int, seed: int = 0,
                  dynamics_fraction: float = 0.5, with_images: bool = False,
                  reasoning: str = "none") -> Iterator[Example]:
    """``n`` examples of a task, for inspection (``python -m learner.pretrain --show``)."""
    streams = TransitionStreams(env_id, env_kwargs, 1, seed, dynamics_fraction, with_images, reasoning=reasoning)
    try:
        for _ in range(n):
            yield from streams.examples()
    finally:
        streams.close()


def main(argv: list[str] | None = None) -> int:
    import argparse

    import envs  # noqa: F401
    from agents.rollout.runner import default_env_kwargs

    parser = argparse.ArgumentParser(prog="python -m learner.pretrain",
                                     description="Pretrain (and cache) the embedded model on a task's transitions.")
    parser.add_argument("--env-id", default="freshper/FrozenLake-v0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=0, metavar="N", help="print N examples and exit")
    for f in dataclasses.fields(PretrainSettings):
        kind = {"float": float, "float | None": float, "str": str}.get(f.type, int)
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default,
                            **({"choices": REASONINGS} if f.name == "reasoning" else {}))
    args = parser.parse_args(argv)
    kwargs = default_env_kwargs(args.env_id, "window:0")
    if args.show:
        for ex in iter_examples(args.env_id, kwargs, args.show, args.seed, args.dynamics_fraction,
                                reasoning=args.reasoning):
            print(f"--- {ex.kind}\n[user]\n{ex.text}\n[assistant]\n{ex.reply}")
        return 0
    cfg = PretrainSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PretrainSettings)})
    path, report = pretrained_default(args.env_id, kwargs, cfg, seed=args.seed, progress=True)
    print(json.dumps({"model": str(path), **report}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
