"""Live play sessions for the viewer: one task, one seed and one model, stepped a turn at a time
by the model or by a reply typed by hand, saved as a trajectory record and a GIF.

The model is an :class:`agents.interactive.ModelPlayer` (prompt = instructions + current
observation), so a human can take any turn and hand back to the model without its context
going out of sync. The saved record has one sample per turn (``window:0``): model turns carry
the sampled ids and behaviour log-probs; a typed turn carries the tokenised reply with loss
mask 0 (not sampled) and is listed in ``info["typed_turns"]``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agents.record import Sample, Trajectory, Turn, save_records
from agents.view.runs import CHECKPOINT_NAME, ViewError, check_checkpoint
from envs.play import wrap_reply

logger = logging.getLogger(__name__)

TINY = "tiny"  # the model choice that means the embedded tiny model of the task's modality


class PolicyCache:
    """Loaded policies by model folder (a few, least recently used dropped), so sessions on
    the same checkpoint share one copy; loading checks a checkpoint against its manifest."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, model: str, env_id: str) -> tuple[Any, str]:
        """The policy for ``model`` (a folder, or :data:`TINY`) and a label for pages and records."""
        from agents.policy import Policy
        from envs.registry import task_spec

        if model == TINY:
            from agents.tiny import build_tiny_model

            modality = task_spec(env_id).modality
            path = str(build_tiny_model(modality))
            label = f"embedded tiny {modality} model"
        else:
            folder = Path(model).expanduser()
            if not folder.exists():
                raise ViewError(f"no model folder at {model}")
            if CHECKPOINT_NAME.match(folder.name):  # a checkpoint folder: play its model
                folder = folder / "model"
            if folder.name == "model" and CHECKPOINT_NAME.match(folder.parent.name):
                problem = check_checkpoint(folder.parent, hashes=True)
                if problem:
                    raise ViewError(f"cannot play {model}: {problem}")
            if not (folder / "config.json").is_file():
                raise ViewError(f"{model} is not a model folder (it has no config.json)")
            path, label = str(folder), str(folder)
        with self._lock:
            if path in self._items:
                self._items.move_to_end(path)
                return self._items[path], label
            try:
                policy = Policy.from_pretrained(path)
            except Exception as exc:  # a damaged or foreign folder: say so, keep serving
                logger.exception("loading %s failed", path)
                raise ViewError(f"the model at {path} cannot be loaded: {type(exc).__name__}: {exc}") from exc
            self._items[path] = policy
            while len(self._items) > self.size:
                self._items.popitem(last=False)
            return policy, label


@dataclass
class PlaySession:
    """One episode being played in the browser."""

    id: str
    env_id: str
    seed: int
    model_label: str
    env: Any
    player: Any
    env_kwargs: dict[str, Any]
    obs: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    images: list[np.ndarray] = field(default_factory=list)  # observed images (vision tasks), in order
    frames: list[np.ndarray] = field(default_factory=list)  # the board after every step, for the GIF
    typed_turns: list[int] = field(default_factory=list)
    episode_return: float = 0.0
    success: bool = False
    terminated: bool = False
    truncated: bool = False
    saved_to: Path | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while the session is stepped

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    def _observe(self) -> None:
        if "image" in self.obs:
            self.images.append(np.array(self.obs["image"], dtype=np.uint8, copy=True))
        frame = _frame(self.env)
        if frame is not None:
            self.frames.append(frame)

    @property
    def current_image_index(self) -> int | None:
        """The index in :attr:`images` of the current observation's image (None: no image)."""
        return len(self.images) - 1 if "image" in self.obs and self.images else None

    def step_model(self) -> str:
        """The model replies to the current observation and the reply is played."""
        self._check_open()
        proposal = self.player.propose(self.obs, self.env.unwrapped.state_text(), first=not self.turns)
        gen = proposal.generation
        prompt = proposal.prompt_ids
        self.samples.append(Sample(prompt + list(gen.token_ids), [0] * len(prompt) + [1] * len(gen.token_ids),
                                   [0.0] * len(prompt) + list(gen.logprobs), self._prompt_image_ids(proposal.images)))
        self._apply(proposal.reply)
        return proposal.reply

    def step_typed(self, text: str) -> str:
        """A reply typed by hand is played (a bare action is wrapped in ``<answer>``)."""
        self._check_open()
        if not text.strip():
            raise ViewError("type a reply first (e.g. Right, or <answer>Down</answer>)")
        reply = wrap_reply(text)
        prompt, images = self.player.prompt(self.obs, self.env.unwrapped.state_text(), first=not self.turns)
        ids = self.player.policy.encode_reply(reply)
        self.samples.append(Sample(prompt + ids, [0] * (len(prompt) + len(ids)), [0.0] * (len(prompt) + len(ids)),
                                   self._prompt_image_ids(images)))
        self.typed_turns.append(len(self.turns))
        self._apply(reply)
        return reply

    def _prompt_image_ids(self, images: list[np.ndarray]) -> list[int]:
        idx = self.current_image_index
        return [idx] if images and idx is not None else []

    def _check_open(self) -> None:
        if self.done:
            raise ViewError("this episode is over: save it or start a new one")

    def _apply(self, reply: str) -> None:
        obs, reward, terminated, truncated, info = self.env.step(reply)
        self.turns.append(Turn(self.obs["text"], reply, float(reward), bool(info.get("action_is_valid", True)),
                               self.current_image_index))
        self.episode_return += float(reward)
        self.success = bool(info.get("success", False))
        self.terminated, self.truncated = bool(terminated), bool(truncated)
        self.obs, self.info = obs, info
        self.saved_to = None
        self._observe()

    def trajectory(self) -> Trajectory:
        """The episode so far as a record (final observation image included for GIFs)."""
        images = list(self.images)
        extra: dict[str, Any] = {
            "source": "agents.view play", "model": self.model_label, "typed_turns": list(self.typed_turns),
            "env_kwargs": self.env_kwargs, "final_observation": self.obs.get("text", ""),
            "end_reason": "terminated" if self.terminated else "turn limit" if self.truncated else "stopped",
        }
        if images and "image" in self.obs:
            extra["final_image_index"] = len(images) - 1
        return Trajectory(env_id=self.env_id, seed=self.seed, group_id=0, turns=list(self.turns),
                          samples=list(self.samples), episode_return=self.episode_return, success=self.success,
                          policy_version=-1, context="window:0", images=images,
                          truncated=self.truncated and not self.terminated, info=extra)

    def save(self, folder: Path) -> tuple[Path, Path | None]:
        """Write the episode as ``records.jsonl`` (+ images) and ``episode.gif`` into ``folder``."""
        if not self.turns:
            raise ViewError("nothing to save yet: play at least one turn")
        save_records([self.trajectory()], folder)
        gif = None
        if self.frames:
            from PIL import Image

            gif = folder / "episode.gif"
            pics = [Image.fromarray(f) for f in self.frames]
            pics[0].save(gif, save_all=True, append_images=pics[1:], duration=600, loop=0)
        self.saved_to = folder
        logger.info("saved play session %s to %s", self.id, folder)
        return folder, gif


def _frame(env: Any) -> np.ndarray | None:
    try:
        return np.asarray(env.unwrapped.render_image(), dtype=np.uint8)
    except NotImplementedError:
        return None


class Sessions:
    """Play sessions by id (the oldest dropped beyond ``limit``)."""

    def __init__(self, limit: int = 16) -> None:
        self.limit = limit
        self._items: OrderedDict[str, PlaySession] = OrderedDict()
        self._lock = threading.Lock()
        #: One model call at a time across sessions (they may share a policy; CPUs are few anyway).
        self.model_lock = threading.Lock()
        self.policies = PolicyCache()

    def start(self, env_id: str, seed: int, model: str, *, greedy: bool = True,
              env_kwargs: dict[str, Any] | None = None, max_new_tokens: int = 32) -> PlaySession:
        """A new episode of ``env_id`` reset with ``seed``, played by ``model`` (:data:`TINY` or a folder)."""
        import envs
        from agents.interactive import ModelPlayer
        from envs.registry import UnknownTaskError, task_spec

        try:
            task_spec(env_id)
        except UnknownTaskError as exc:
            raise ViewError(str(exc)) from None
        policy, label = self.policies.get(model, env_id)
        kwargs = dict(env_kwargs or {})
        try:
            env = envs.make(env_id, **kwargs)
            obs, info = env.reset(seed=int(seed))
        except (TypeError, ValueError, KeyError, ImportError) as exc:
            raise ViewError(f"cannot start {env_id} with {kwargs or 'its defaults'}: {exc}") from exc
        player = ModelPlayer(label, env_id, policy=policy, greedy=greedy, max_new_tokens=max_new_tokens, seed=int(seed))
        player.reset(obs, info)
        session = PlaySession(secrets.token_hex(8), env_id, int(seed), label, env, player, kwargs, obs, info,
                              lock=self.model_lock)
        session._observe()
        with self._lock:
            self._items[session.id] = session
            while len(self._items) > self.limit:
                _, old = self._items.popitem(last=False)
                old.env.close()
        return session

    def get(self, sid: str) -> PlaySession:
        with self._lock:
            session = self._items.get(sid)
        if session is None:
            raise ViewError("this play session is not open any more (the viewer was restarted, or it was one of "
                            "the oldest); start a new one", status=404)
        return session


def save_folder(play_dir: Path, session: PlaySession) -> Path:
    """A new folder name for a saved episode: ``<task>__s<seed>__<date-time>``."""
    name = session.env_id.split("/")[-1]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = play_dir / f"{name}__s{session.seed}__{stamp}"
    n = 1
    while folder.exists():
        n += 1
        folder = play_dir / f"{name}__s{session.seed}__{stamp}-{n}"
    return folder
