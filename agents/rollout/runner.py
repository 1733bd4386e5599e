"""The batched rollout runner: B tasks x G rollouts, one batched generation per turn.

Each episode keeps its token view as pieces that are only ever appended to: the ids of each
user message rendered alone (:mod:`agents.policies.chat`) and the ids the model sampled. A prompt is a
concatenation of those pieces, so nothing is re-tokenized and the learner trains on exactly the
sampled ids. Context modes (docs/design.md#the-trajectory-record-agentsrecordpy, "Context modes"):

- ``full``: one growing sequence per episode, stored as one :class:`~agents.record.Sample`;
- ``window:k``: each turn's prompt is the instructions plus the last k turns (k = 0: the
  current observation only); one Sample per turn.

A reply cut by ``max_new_tokens`` has no ``<|im_end|>``; when it becomes history the runner
closes it with an unsampled EOS (loss mask 0). If the next prompt plus ``max_new_tokens``
would exceed ``max_context_tokens`` the episode ends with ``truncated=True`` before that turn.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch

from agents.policies.policy import Policy
from agents.record import Generation, Sample, Trajectory, Turn, episode_stats
from agents.policies.sampling import TurnKVCache
from agents.rollout.seeds import counter_seed

logger = logging.getLogger(__name__)

ReplyFn = Callable[[dict, dict, Any], str]


class Sampler(Protocol):
    """What generates the replies of a turn: :meth:`agents.policies.policy.Policy.generate`'s contract
    (prompt ids in; sampled ids, behaviour log-probs and whether EOS ended them out). The
    policy itself is the default; :class:`agents.engines.vllm_client.VLLMSampler` is another."""

    def generate(self, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[np.ndarray]] | None = None, *,
                 max_new_tokens: int = 32, temperature: float = 1.0, greedy: bool = False,
                 turn_cache: TurnKVCache | None = None) -> list[Generation]: ...


def parse_context(context: str) -> int | None:
    """``"full"`` -> None, ``"window:k"`` -> k; anything else raises a clear error."""
    if context == "full":
        return None
    if context.startswith("window:"):
        try:
            k = int(context.split(":", 1)[1])
        except ValueError:
            k = -1
        if k >= 0:
            return k
    raise ValueError(f"context must be 'full' or 'window:k' with k >= 0, got {context!r}")


def default_env_kwargs(env_id: str, context: str) -> dict[str, Any]:
    """The task keyword arguments to play ``env_id`` with in ``context`` when none are given.

    A ``window:0`` prompt is the instructions and the latest observation. For a task whose
    board is its whole state (``markov_state``: FrozenLake, Sokoban) the move feedback and the
    turns-left line add nothing the board does not show, and a shorter prompt is cheaper and
    faster to learn from, so such tasks are observed as the board alone (``feedback=False``).
    Training (``train.py``) and evaluation (``python -m agents.evaluate``) share this rule, so
    a checkpoint is evaluated on the prompts it was trained on.
    """
    import envs

    if context != "window:0":
        return {}
    env = envs.make(env_id)
    try:
        return {"feedback": False} if getattr(env.unwrapped, "markov_state", False) else {}
    finally:
        env.close()


@dataclass(frozen=True)
class RolloutSettings:
    """How episodes are played: one value shared by every phase of a run (pretraining
    prompts, collection, evaluation), so they all see the same prompts. ``train.py``'s
    ``rollout`` settings (``learner.config``); ``locked`` fields cannot change on resume."""

    env_id: str = field(metadata={"locked": True})
    """registered task id (python -m envs list)"""
    env_kwargs: dict[str, Any] | None = field(default=None, metadata={"locked": True})
    """keyword arguments of the task (JSON on the command line); default: {"feedback": false} for tasks whose board is their whole state (FrozenLake, Sokoban) in window:0 context, else {}"""
    context: str = field(default="window:0", metadata={"locked": True})
    """prompt context: 'full' (whole conversation) or 'window:k' (instructions + last k turns)"""
    group_size: int = field(default=8, metadata={"locked": True})
    """G: rollouts per task, the GRPO group"""
    max_new_tokens: int = 16
    """reply length limit per turn, in tokens"""
    temperature: float = 1.0
    """sampling temperature of rollouts (log-probs are taken at the same temperature)"""
    max_context_tokens: int = 2048
    """per-episode context budget; an episode that would overflow is truncated cleanly"""
    system_prompt: str | None = field(default=None, metadata={"locked": True})
    """a system message before each episode's first user message, saved with the model so evaluations and play use it too (default: the model's chat template's own, if it has one; a checkpoint's saved one on resume)"""

    def __post_init__(self) -> None:
        window = self.context.split(":", 1)
        if not (self.context == "full" or (window[0] == "window" and len(window) == 2 and window[1].isdigit())):
            raise ValueError(f"--context must be 'full' or 'window:k', got {self.context!r}")
        if self.group_size < 1:
            raise ValueError(f"--group-size must be >= 1, got {self.group_size}")
        if self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")
        if self.max_context_tokens <= self.max_new_tokens:
            raise ValueError("--max-context-tokens must exceed --max-new-tokens")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError("--temperature must be a positive number")

    def task_kwargs(self) -> dict[str, Any]:
        """The task's keyword arguments: ``env_kwargs``, or where it is None the task's default
        in this context (:func:`default_env_kwargs`)."""
        return dict(self.env_kwargs) if self.env_kwargs is not None else default_env_kwargs(self.env_id, self.context)

    def runner(self, policy: Policy, *, seed: int = 0, group_size: int | None = None,
               sampler: Sampler | None = None) -> "Runner":
        """A runner playing these settings (``group_size`` overrides G, e.g. 1 for evaluation;
        ``sampler`` generates instead of the policy, e.g. a vLLM engine)."""
        cfg = self if group_size is None else replace(self, group_size=group_size)
        return Runner(policy, cfg.env_id, env_kwargs=cfg.task_kwargs(), group_size=cfg.group_size, context=cfg.context,
                      max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                      max_context_tokens=cfg.max_context_tokens, seed=seed, sampler=sampler)


def _announce(hook: str, envs: Sequence[Any], values: Sequence[Any]) -> None:
    """Call each task class's ``hook`` once with its envs among ``envs`` and their values."""
    groups: dict[type, tuple[list[Any], list[Any]]] = {}
    for env, value in zip(envs, values):
        inner = env.unwrapped
        if getattr(type(inner), hook, None) is not None:
            pair = groups.setdefault(type(inner), ([], []))
            pair[0].append(inner)
            pair[1].append(value)
    for cls, (members, vals) in groups.items():
        getattr(cls, hook)(members, vals)


def before_batch_step(envs: Sequence[Any], replies: Sequence[str]) -> None:
    """Give each task class the envs of a turn about to be stepped, with their replies, in one
    call (``MultiTurnEnv.before_batch_step``: e.g. search sends one retrieval request)."""
    _announce("before_batch_step", envs, replies)


def before_batch_reset(envs: Sequence[Any], seeds: Sequence[int]) -> None:
    """Give each task class the envs about to be reset, with their seeds, in one call
    (``MultiTurnEnv.before_batch_reset``: a served task sends the resets as one request)."""
    _announce("before_batch_reset", envs, seeds)


@dataclass
class _Episode:
    """Mutable state of one running episode."""

    seed: int
    group_id: int
    env: Any
    obs: dict
    info: dict
    instructions: str
    images: list[np.ndarray] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    user_ids: list[list[int]] = field(default_factory=list)  # per turn; turn 0 as a first message
    user_imgs: list[list[int]] = field(default_factory=list)  # per turn: indices into images
    reply_ids: list[list[int]] = field(default_factory=list)
    reply_lps: list[list[float]] = field(default_factory=list)
    reply_closed: list[bool] = field(default_factory=list)  # ended with a sampled EOS
    samples: list[Sample] = field(default_factory=list)
    episode_return: float = 0.0
    success: bool = False
    truncated: bool = False
    failed: bool = False
    end_reason: str = ""


class Runner:
    """Plays groups of episodes of one task with a policy and emits trajectory records."""

    def __init__(
        self,
        policy: Policy,
        env_id: str,
        *,
        env_kwargs: dict[str, Any] | None = None,
        group_size: int = 8,
        context: str = "window:0",
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        max_context_tokens: int = 2048,
        seed: int = 0,
        sampler: Sampler | None = None,
    ) -> None:
        import envs  # noqa: F401  (registers the tasks)

        self.policy = policy
        #: What generates replies: the policy, or an engine with its contract (e.g. vLLM); the
        #: policy still renders prompts and decodes replies.
        self.sampler: Sampler = policy if sampler is None else sampler
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        self.group_size = int(group_size)
        self.context = context
        self.window = parse_context(context)
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.max_context_tokens = int(max_context_tokens)
        self.seed = int(seed)
        self._envs: list[Any] = []
        self._calls = 0
        self._next_group = 0
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")

    def _env_pool(self, n: int) -> list[Any]:
        from envs.registry import make

        while len(self._envs) < n:
            self._envs.append(make(self.env_id, **self.env_kwargs))
        return self._envs[:n]

    def close(self) -> None:
        for env in self._envs:
            env.close()
        self._envs.clear()

    # -- prompts -------------------------------------------------------------------------
    def _history(self, ep: _Episode, start: int, t: int) -> tuple[list[int], list[int], list[int], list[float]]:
        """The replies of turns ``start..t-1``, each followed by the next user message (rendered
        as a continuation): ids, image indices, loss mask (1 on sampled ids) and log-probs."""
        ids: list[int] = []
        imgs: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        eos = self.policy.eos_token_id
        for j in range(start, t):
            between = ([] if ep.reply_closed[j] else [eos]) + ep.user_ids[j + 1]
            ids += ep.reply_ids[j] + between
            mask += [1] * len(ep.reply_ids[j]) + [0] * len(between)
            lps += ep.reply_lps[j] + [0.0] * len(between)
            imgs += ep.user_imgs[j + 1]
        return ids, imgs, mask, lps

    def _prompt(self, ep: _Episode) -> tuple[list[int], list[int]]:
        """Prompt ids and the image indices they reference, for the current turn."""
        t = len(ep.turns)
        if self.window is None or t <= self.window:
            ids, imgs, _, _ = self._history(ep, 0, t)
            return ep.user_ids[0] + ids, ep.user_imgs[0] + imgs
        start = t - self.window
        observation = ep.obs["text"] if start == t else ep.turns[start].observation
        first_imgs = ep.user_imgs[start]
        head = self.policy.chat.first_message(
            f"{ep.instructions}\n\n{observation}", [ep.images[i] for i in first_imgs]
        )
        ids, imgs, _, _ = self._history(ep, start, t)
        return head + ids, first_imgs + imgs

    # -- the loop ------------------------------------------------------------------------
    def collect(
        self,
        seeds: Sequence[int],
        *,
        policy_version: int,
        reply_fn: ReplyFn | None = None,
        greedy: bool = False,
        progress: bool = False,
        rng_seed: int | None = None,
        group_base: int | None = None,
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """Play ``len(seeds) x group_size`` episodes; return records (advantage 0: the learner
        assigns advantages, :mod:`learner.advantages`) and stats (:func:`~agents.record.episode_stats` plus timings). ``reply_fn(obs, info,
        env)`` replaces the model (scripted replies: loss mask 1, behaviour log-probs 0).

        ``rng_seed`` seeds the sampling of this call (default: the runner's seed and a call
        counter); ``group_base`` numbers its groups (default: counting on from the last call).
        A trainer passes both as functions of its iteration, so a resumed run plays the same.
        """
        from tqdm.auto import tqdm

        wall0 = time.perf_counter()
        timers = {"generation_s": 0.0, "env_s": 0.0, "tokenization_s": 0.0}
        n = len(seeds) * self.group_size
        pool = self._env_pool(n)
        episodes: list[_Episode] = []
        t0 = time.perf_counter()
        first_group = self._next_group if group_base is None else int(group_base)
        before_batch_reset(pool[:n], [int(seed) for seed in seeds for _ in range(self.group_size)])
        for i, seed in enumerate(seeds):
            for g in range(self.group_size):
                env = pool[i * self.group_size + g]
                obs, info = env.reset(seed=int(seed))
                episodes.append(_Episode(int(seed), first_group + i, env, obs, info, info.get("instructions", "")))
        self._next_group = first_group + len(seeds)
        timers["env_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        for ep in episodes:
            self._observe(ep, first=True)
        timers["tokenization_s"] += time.perf_counter() - t0

        bar = tqdm(total=n, desc=f"collect {self.env_id}", unit="ep", disable=not progress, leave=False)
        active = list(episodes)
        # full context: each turn's prompt extends the last one plus its reply; reuse their KV.
        turn_cache = TurnKVCache() if self.window is None and reply_fn is None else None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(counter_seed(self.seed, self._calls) if rng_seed is None else int(rng_seed))
            self._calls += 1
            while active:
                t0 = time.perf_counter()
                batch, prompts, prompt_imgs = [], [], []
                for ep in active:
                    ids, imgs = self._prompt(ep)
                    if len(ids) + self.max_new_tokens > self.max_context_tokens:
                        ep.truncated, ep.end_reason = True, "context budget"
                        continue
                    batch.append(ep)
                    prompts.append(ids)
                    prompt_imgs.append(imgs)
                replies: list[tuple[list[int], list[float], bool]] = []
                if reply_fn is not None:
                    texts = [reply_fn(ep.obs, ep.info, ep.env) for ep in batch]
                    for text in texts:
                        ids = self.policy.encode_reply(text)
                        replies.append((ids, [0.0] * len(ids), True))
                    timers["tokenization_s"] += time.perf_counter() - t0
                else:
                    timers["tokenization_s"] += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    gens = self.sampler.generate(
                        prompts,
                        [[ep.images[k] for k in imgs] for ep, imgs in zip(batch, prompt_imgs)],
                        max_new_tokens=self.max_new_tokens,
                        temperature=self.temperature,
                        greedy=greedy,
                        turn_cache=turn_cache,
                    )
                    replies = [(g.token_ids, g.logprobs, g.finished) for g in gens]
                    timers["generation_s"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                texts = [self.policy.reply_text(ids) for ids, _, _ in replies]
                timers["tokenization_s"] += time.perf_counter() - t0
                if batch:
                    t0 = time.perf_counter()
                    before_batch_step([ep.env for ep in batch], texts)  # e.g. one retrieval call per turn
                    timers["env_s"] += time.perf_counter() - t0
                still = []
                for ep, prompt, imgs, text, (ids, lps, closed) in zip(batch, prompts, prompt_imgs, texts, replies):
                    if self._step(ep, prompt, imgs, text, ids, lps, closed, timers):
                        still.append(ep)
                bar.update(len(active) - len(still))
                active = still
        bar.close()
        records = [self._record(ep, policy_version) for ep in episodes]
        return records, self._stats(records, timers, time.perf_counter() - wall0)

    def _observe(self, ep: _Episode, first: bool = False) -> None:
        """Render the current observation as the next user message's ids."""
        img = ep.obs.get("image") if self.policy.is_vision else None
        imgs = [] if img is None else [np.array(img, dtype=np.uint8, copy=True)]
        ep.user_imgs.append(list(range(len(ep.images), len(ep.images) + len(imgs))))
        ep.images.extend(imgs)
        chat = self.policy.chat
        render = chat.first_message if first else chat.next_message
        ep.user_ids.append(render(ep.obs["text"], imgs))

    def _step(self, ep: _Episode, prompt: list[int], imgs: list[int], reply: str, ids: list[int],
              lps: list[float], closed: bool, timers: dict[str, float]) -> bool:
        """Apply one reply (its text and sampled ids); return True while the episode goes on."""
        t0 = time.perf_counter()
        t = len(ep.turns)
        ep.reply_ids.append(list(ids))
        ep.reply_lps.append(list(lps))
        ep.reply_closed.append(closed)
        if self.window is not None:
            ep.samples.append(Sample(
                prompt + list(ids), [0] * len(prompt) + [1] * len(ids), [0.0] * len(prompt) + list(lps), list(imgs)
            ))
        timers["tokenization_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        obs, reward, terminated, truncated, info = ep.env.step(reply)
        timers["env_s"] += time.perf_counter() - t0
        image_index = ep.user_imgs[t][0] if ep.user_imgs[t] else None
        ep.turns.append(Turn(ep.obs["text"], reply, float(reward), bool(info.get("action_is_valid", True)), image_index))
        ep.episode_return += float(reward)
        ep.success = bool(info.get("success", False))
        ep.obs, ep.info = obs, info
        if info.get("failed"):
            ep.failed, ep.end_reason = True, "failed"
            return False
        if terminated or truncated:
            ep.truncated = bool(truncated and not terminated)
            ep.end_reason = "terminated" if terminated else "turn limit"
            return False
        t0 = time.perf_counter()
        self._observe(ep)
        timers["tokenization_s"] += time.perf_counter() - t0
        return True

    def _record(self, ep: _Episode, policy_version: int) -> Trajectory:
        samples = ep.samples
        n = len(ep.turns)
        if self.window is None and n:  # full context: the whole conversation as one sample
            ids, img_ids, mask, lps = self._history(ep, 0, n - 1)
            first, last = ep.user_ids[0], ep.reply_ids[n - 1]
            samples = [Sample(first + ids + last, [0] * len(first) + mask + [1] * len(last),
                              [0.0] * len(first) + lps + ep.reply_lps[n - 1], ep.user_imgs[0] + img_ids)]
        images = list(ep.images)
        extra: dict[str, Any] = {"end_reason": ep.end_reason, "final_observation": ep.obs.get("text", "")}
        if len(ep.user_ids) == n and self.policy.is_vision and "image" in ep.obs:  # final frame, for GIFs
            images.append(np.array(ep.obs["image"], dtype=np.uint8, copy=True))
            extra["final_image_index"] = len(images) - 1
        return Trajectory(
            env_id=self.env_id, seed=ep.seed, group_id=ep.group_id, turns=ep.turns, samples=samples,
            episode_return=ep.episode_return, success=ep.success, policy_version=int(policy_version),
            context=self.context, images=images, truncated=ep.truncated, failed=ep.failed, info=extra,
        )

    def _stats(self, records: list[Trajectory], timers: dict[str, float], wall: float) -> dict[str, float]:
        tokens = sum(r.num_sampled_tokens for r in records)
        return {
            **episode_stats(records),
            **timers,
            "wall_s": wall,
            "episodes_per_s": len(records) / max(wall, 1e-9),
            "tokens_per_s": tokens / max(wall, 1e-9),
        }
