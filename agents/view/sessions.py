"""Live play sessions for the viewer: one task, one seed and one model, stepped a turn at a time
by the model or by a reply typed by hand, saved as a trajectory record and a GIF.

The model is an :class:`agents.interactive.ModelPlayer` (prompt = instructions + current
observation), so a human can take any turn and hand back to the model without its context
going out of sync. The saved record has one sample per turn (``window:0``): model turns carry
the sampled ids and behaviour log-probs; a typed turn carries the tokenised reply with loss
mask 0 (not sampled) and is listed in ``info["typed_turns"]``.

Play is bounded: task options (:func:`check_play_options`), typed replies
(:data:`MAX_REPLY_CHARS`), the size of the board a task draws and of its observation text, and
the turns of one session (:data:`MAX_TURNS`). Every session has its own lock, and sessions on the
same model share that model's lock for one model call at a time, so one session played to the
end never holds up another.
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
from agents.runfolder import model_folder_problem
from agents.view.runs import ViewError
from envs.play import wrap_reply

logger = logging.getLogger(__name__)

TINY = "tiny"  # the model choice that means the embedded tiny model of the task's modality
#: The longest reply a user may type.
MAX_REPLY_CHARS = 2000
#: Task options: at most this many, each number within +-MAX_OPTION_NUMBER, a size-like option
#: (``size``, ``*_size``, ``width``, ``height``, ...) at most MAX_OPTION_SIZE, strings and lists short.
MAX_OPTIONS = 16
MAX_OPTION_NUMBER = 1000
MAX_OPTION_SIZE = 32
_SIZE_KEYS = ("size", "width", "height", "dim", "rows", "cols", "num_boxes", "boxes")
#: The largest board picture (pixels) and observation text (characters) a session accepts.
MAX_FRAME_PIXELS = 4 << 20
MAX_OBSERVATION_CHARS = 100_000
#: The most turns one session plays.
MAX_TURNS = 1000


def check_play_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` if they are small enough to play in the viewer, else a ValueError saying which
    is too large: a board of FrozenLake ``size=400`` costs ~360 MB a turn."""
    if len(kwargs) > MAX_OPTIONS:
        raise ValueError(f"at most {MAX_OPTIONS} options")

    def check(key: str, value: Any, depth: int = 0) -> None:
        if depth > 2:
            raise ValueError(f"{key} nests too deeply")
        if isinstance(value, bool) or value is None:
            return
        if isinstance(value, (int, float)):
            sized = any(part in key.lower() for part in _SIZE_KEYS)
            bound = MAX_OPTION_SIZE if sized else MAX_OPTION_NUMBER
            if not abs(value) <= bound:
                raise ValueError(f"{key}={value} is outside what the viewer plays (at most {bound} in size)")
            return
        if isinstance(value, str):
            if len(value) > 200:
                raise ValueError(f"{key} is longer than 200 characters")
            return
        if isinstance(value, (list, tuple, dict)):
            items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
            if len(items) > MAX_OPTION_SIZE:
                raise ValueError(f"{key} has more than {MAX_OPTION_SIZE} entries")
            for k, v in items:
                check(f"{key}[{k}]" if not isinstance(value, dict) else f"{key}.{k}", v, depth + 1)
            return
        raise ValueError(f"{key} has a value of type {type(value).__name__}")

    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"{str(key)[:40]!r} is not an option name")
        check(key, value)
    return kwargs


class PolicyCache:
    """Loaded policies by model folder (a few, least recently used dropped), so sessions on
    the same checkpoint share one copy; loading checks a checkpoint against its manifest.
    Models load on ``device`` in ``dtype`` (a ``--dtype`` name; :mod:`agents.policies.precision`).
    ``threads``: torch's threads as given (``--threads``); None: after each load, the default for
    the largest model loaded (:func:`agents.policies.policy.configure_threads`: one thread for a
    small model on a 2-CPU machine, every CPU for a real one)."""

    def __init__(self, size: int = 2, device: str = "cpu", dtype: str = "auto", threads: int | None = None) -> None:
        self.size = size
        self.device, self.dtype, self.threads = device, dtype, threads
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, model: str, env_id: str) -> tuple[Any, str, threading.Lock]:
        """The policy for ``model`` (a folder, or :data:`TINY`), a label for pages and records, and
        the lock its model calls take (one per loaded model)."""
        from agents.policies.policy import Policy
        from envs.registry import task_spec

        if model == TINY:
            from agents.policies.tiny import build_tiny_model

            modality = task_spec(env_id).modality
            path = str(build_tiny_model(modality))
            label = f"embedded tiny {modality} model"
        else:
            from agents.pretrained import KNOWN_MODELS, converted_folder

            if model in KNOWN_MODELS:  # a short name plays once converted (converting takes a while)
                folder = converted_folder(model)
                if folder is None:
                    raise ViewError(f"{model} is not converted yet: python -m agents.pretrained pull {model}")
                model = str(folder)
            if not Path(model).expanduser().exists():
                raise ViewError(f"no model folder at {model}")
            folder, problem = model_folder_problem(model)  # a checkpoint folder: play its model, if intact
            if problem:
                raise ViewError(f"cannot play {model}: {problem}")
            if not (folder / "config.json").is_file():
                raise ViewError(f"{model} is not a model folder (it has no config.json)")
            path, label = str(folder), str(folder)
        with self._lock:
            if path in self._items:
                self._items.move_to_end(path)
                policy, lock = self._items[path]
                return policy, label, lock
            try:
                policy = Policy.from_pretrained(path, device=self.device, dtype=self.dtype)
            except Exception as exc:  # a damaged or foreign folder: say so, keep serving
                logger.exception("loading %s failed", path)
                raise ViewError(f"the model at {path} cannot be loaded: {type(exc).__name__}: {exc}") from exc
            self._items[path] = (policy, threading.Lock())
            while len(self._items) > self.size:
                self._items.popitem(last=False)
            if self.threads is None:
                from agents.policies.policy import configure_threads

                configure_threads(parameters=max(p.num_parameters for p, _ in self._items.values()))
            return policy, label, self._items[path][1]


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
    lock: threading.Lock = field(default_factory=threading.Lock)  # this session's own, held while it is stepped
    model_lock: threading.Lock = field(default_factory=threading.Lock)  # its model's: one model call at a time

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    def _observe(self) -> None:
        text = self.obs.get("text", "")
        if len(text) > MAX_OBSERVATION_CHARS:
            raise ViewError(f"{self.env_id} wrote an observation of {len(text):,} characters, more than the viewer "
                            f"shows ({MAX_OBSERVATION_CHARS:,}): pick smaller task options")
        if "image" in self.obs:
            self.images.append(_bounded(np.array(self.obs["image"], dtype=np.uint8, copy=True), self.env_id))
        frame = _frame(self.env)
        if frame is not None:
            self.frames.append(_bounded(frame, self.env_id))

    @property
    def current_image_index(self) -> int | None:
        """The index in :attr:`images` of the current observation's image (None: no image)."""
        return len(self.images) - 1 if "image" in self.obs and self.images else None

    def step_model(self) -> str:
        """The model replies to the current observation and the reply is played."""
        self._check_open()
        with self.model_lock:
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
        if len(text) > MAX_REPLY_CHARS:
            raise ViewError(f"a typed reply is limited to {MAX_REPLY_CHARS:,} characters (this one has {len(text):,})",
                            status=413)
        reply = wrap_reply(text)
        with self.model_lock:  # the tokenizer is the model's: shared with other sessions on it
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
        if len(self.turns) >= MAX_TURNS:
            raise ViewError(f"this episode reached the viewer's limit of {MAX_TURNS} turns: save it or start a new one")

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


def _bounded(image: np.ndarray, env_id: str) -> np.ndarray:
    if image.ndim < 2 or image.shape[0] * image.shape[1] > MAX_FRAME_PIXELS:
        raise ViewError(f"{env_id} draws a picture of {'x'.join(map(str, image.shape[:2]))} pixels, more than the "
                        f"viewer plays ({MAX_FRAME_PIXELS:,}): pick smaller task options")
    return image


def _frame(env: Any) -> np.ndarray | None:
    try:
        return np.asarray(env.unwrapped.render_image(), dtype=np.uint8)
    except NotImplementedError:
        return None


class Sessions:
    """Play sessions by id (the oldest dropped beyond ``limit``)."""

    def __init__(self, limit: int = 16, device: str = "cpu", dtype: str = "auto", max_new_tokens: int = 32,
                 threads: int | None = None) -> None:
        self.limit = limit
        self._items: OrderedDict[str, PlaySession] = OrderedDict()
        self._lock = threading.Lock()
        self.policies = PolicyCache(device=device, dtype=dtype, threads=threads)
        self.max_new_tokens = int(max_new_tokens)  # the model's reply cap (``--max-new-tokens``)

    def start(self, env_id: str, seed: int, model: str, *, greedy: bool = True,
              env_kwargs: dict[str, Any] | None = None, max_new_tokens: int | None = None) -> PlaySession:
        """A new episode of ``env_id`` reset with ``seed``, played by ``model`` (:data:`TINY` or a folder)."""
        import envs
        from agents.interactive import ModelPlayer
        from envs.registry import UnknownTaskError, task_spec

        try:
            task_spec(env_id)
        except UnknownTaskError as exc:
            raise ViewError(str(exc)) from None
        kwargs = dict(env_kwargs or {})
        try:
            check_play_options(kwargs)
        except ValueError as exc:
            raise ViewError(f"task options: {exc}") from None
        policy, label, model_lock = self.policies.get(model, env_id)
        try:
            env = envs.make(env_id, **kwargs)
            obs, info = env.reset(seed=int(seed))
        except (TypeError, ValueError, KeyError, ImportError) as exc:
            raise ViewError(f"cannot start {env_id} with {kwargs or 'its defaults'}: {exc}") from exc
        player = ModelPlayer(label, env_id, policy=policy, greedy=greedy,
                             max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens,
                             seed=int(seed))
        player.reset(obs, info)
        session = PlaySession(secrets.token_hex(8), env_id, int(seed), label, env, player, kwargs, obs, info,
                              model_lock=model_lock)
        try:
            session._observe()
        except ViewError:
            env.close()
            raise
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
