"""The multi-turn task contract shared by every freshper environment: what a task *is*.

A task is a ``gymnasium.Env`` whose action is the model's raw reply (``str``) and whose
observation is ``{"text": str}`` (text tasks) or ``{"text": str, "image": uint8 (H, W, 3)}``
(vision tasks, the text holding ``<image>`` where the picture goes). Subclasses implement
the task; this base class owns turn counting, lenient reply parsing, invalid replies, the
format penalty and the ``info`` keys every runner relies on.

The whole contract, in one place (docs/design.md and docs/hub.md explain it with examples):

=========================================  ==================================================
what a task declares or implements         what it is for / the default
=========================================  ==================================================
``modality`` (class attribute)             ``"text"`` or ``"vision"``; the one source of the
                                           modality: ``register`` derives it from a class
                                           entry point and checks a lazy one when built
``metadata["render_modes"]``               derived: ``"ansi"`` always, ``"rgb_array"`` when
                                           the class implements ``render_image``
``markov_state`` (class attribute)         the state text is all an agent needs (trainers
                                           then default to ``feedback=False``)
``_reset_task``, ``instructions``,         the task itself (required)
``state_text``, ``parse_action``,
``apply_action``
``render_image()``                         vision tasks (required there), optional otherwise
``render_text()``                          the state in the task's text notation;
                                           ``state_text()``
``task_info()``                            extra ``info`` entries; none
``legal_actions()`` or ``sample_reply()``  random well-formed replies: the random agent,
                                           pretraining replies (required: one of the two)
``effective_actions()``                    the legal actions that change the state (what
                                           ``sample_reply`` draws); all legal ones
``format_reply(action)``                   ``<answer>action</answer>``
``describe_action(reply)``                 the answer tag's content
``before_batch_step(envs, replies)``       class method; nothing
``before_batch_reset(envs, seeds)``        class method; nothing
``client_kwargs`` (class attribute)        the keyword arguments a client of the served task
                                           may set, each with its bounds (``ClientKwarg``);
                                           none
``server_kwargs`` (class attribute)        keyword arguments no client may set, even on a
                                           server that allows client kwargs; none
``quick_calls`` (class attribute)          the served operations short enough to answer on
                                           the server's event loop; none
=========================================  ==================================================

What a task may add for pretraining, the embedded model's tokenizer and diagnostics (a
lookahead, an aim, a subgoal, the outcome of a step as text, its own vocabulary, counterfactual
probes, per-turn diagnostics) are optional capabilities, each a protocol of
:mod:`envs.capabilities`: a task offers one by defining its method, and the code that uses it
checks for it there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Sequence

import gymnasium as gym
import numpy as np

from envs.spaces import AnyText

IMAGE_PLACEHOLDER = "<image>"
Modality = Literal["text", "vision"]

_ANSWER_OPEN = "<answer>"
_ANSWER_CLOSE = "</answer>"
# Lowercases ASCII only, so indices stay aligned with the original reply: str.lower() can
# change the length of non-ASCII text (e.g. "İ" -> "i̇"), which would shift every slice.
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def extract_tag(reply: str, tag: str = "answer") -> str | None:
    """Return the content of the last complete ``<tag>...</tag>`` in ``reply``, stripped.

    Tags are matched case-insensitively (ASCII). Runs in linear time on any input (a 1 MB
    reply of unclosed tags included), which a backtracking regex would not.
    """
    if not isinstance(reply, str):
        return None
    tag = tag.translate(_ASCII_LOWER)
    lower = reply.translate(_ASCII_LOWER)
    close = lower.rfind(f"</{tag}>")
    if close < 0:
        return None
    open_ = lower.rfind(f"<{tag}>", 0, close)
    if open_ < 0:
        return None
    return reply[open_ + len(tag) + 2 : close].strip()


@dataclass(frozen=True)
class ClientKwarg:
    """A task keyword argument that a client of the served task (``python -m envs.serve``) may
    set, and the bounds the server checks before it builds the env: a client controls no more
    work than these bounds allow (a board's size, the turns of an episode, a text's length).

    ``kind`` is ``bool``, ``int``, ``float`` or ``str``; numbers lie in ``[low, high]``, strings
    have at most ``max_chars`` characters, and with ``choices`` the value is one of them.
    """

    kind: type
    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] | None = None
    max_chars: int = 256

    def check(self, name: str, value: Any) -> Any:
        """``value`` as the task receives it, or ``ValueError`` saying what is allowed."""
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            value = float(value) if ok else value
        elif self.kind is str:
            ok = isinstance(value, str) and len(value) <= self.max_chars
        else:
            ok = False
        if not ok:
            what = f"a string of at most {self.max_chars} characters" if self.kind is str else \
                f"a finite {self.kind.__name__}" if self.kind is float else f"a {self.kind.__name__}"
            raise ValueError(f"{name} must be {what}, got {_short(value)}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{name} must be one of {list(self.choices)}, got {_short(value)}")
        if self.kind in (int, float) and ((self.low is not None and value < self.low)
                                          or (self.high is not None and value > self.high)):
            raise ValueError(f"{name} must lie in [{self.low:g}, {self.high:g}], got {_short(value)}")
        return value


def free_answer(reply: str, max_chars: int) -> tuple[str | None, str | None]:
    """``(content, None)`` for a reply whose last ``<answer>...</answer>`` holds a non-empty
    answer of at most ``max_chars`` characters (a free-form answer the task then checks), else
    ``(None, why)``: the shared well-formedness rule of the answer tasks."""
    content = extract_tag(reply)
    if content is None:
        return None, "no <answer>...</answer> found; end your reply with <answer>your answer</answer>."
    if not content:
        return None, "the answer is empty; write it between <answer> and </answer>."
    if len(content) > max_chars:
        return None, f"the answer is longer than {max_chars} characters."
    return content, None


def _short(value: Any, n: int = 60) -> str:
    if isinstance(value, int) and value.bit_length() > 100:  # repr of a huge int is slow, or refused
        return f"an integer of {value.bit_length()} bits"
    text = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= n else text[:n] + "..."


#: What a client may set on most tasks: the episode's length, the feedback lines, the penalty
#: of an invalid reply.
COMMON_CLIENT_KWARGS: Mapping[str, ClientKwarg] = {
    "max_turns": ClientKwarg(int, 1, 200),
    "feedback": ClientKwarg(bool),
    "format_penalty": ClientKwarg(float, -1.0, 0.0),
}


class MultiTurnEnv(gym.Env[dict, str]):
    """Base class for multi-turn tasks driven by free-text replies.

    Subclasses implement:

    - ``_reset_task(options)``: draw a new task from ``self.np_random``;
    - ``instructions()``: the full task description (rules, reply format);
    - ``state_text()``: the current state as text (the board, the question, ...);
    - ``parse_action(reply)``: ``(action, None)`` or ``(None, "what was wrong")``;
    - ``apply_action(action)``: ``(reward, feedback, terminated, success)``;
    - ``legal_actions()`` or ``sample_reply(rng)``: random well-formed replies;
    - vision tasks also ``render_image()`` returning uint8 (H, W, 3).

    Optional capabilities (a lookahead, probes, diagnostics, ...) are :mod:`envs.capabilities`.

    The base class guarantees: invalid replies never raise and leave the state unchanged,
    cost ``format_penalty`` and are explained in the next observation; ``max_turns`` ends the
    episode with ``truncated=True``; ``info`` carries ``action_is_valid``, ``success``,
    ``turn`` and, at reset, ``instructions``.

    Observations after a step are ``feedback`` (what the move did, or why the reply was
    invalid), the state, and the turns left. ``feedback=False`` makes them the state alone:
    for Markov tasks played in ``window:0`` context the extra lines only lengthen the prompt.
    """

    #: ``render_modes`` is derived per class (:meth:`__init_subclass__`): ``"ansi"`` always, and
    #: ``"rgb_array"`` when the class implements :meth:`render_image`. A class that sets its own
    #: ``metadata`` is checked instead (it may not list a mode it does not implement).
    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 4}
    modality: ClassVar[Modality] = "text"
    #: True when the observed state (``state_text()``, and the image for vision tasks) is all an
    #: agent needs to act: no history and no feedback lines. Trainers then default to
    #: ``feedback=False`` in ``window:0`` context (a task kwarg, so a run may override it).
    markov_state: ClassVar[bool] = False
    #: Shape of the observed image for vision tasks; subclasses set it in ``__init__``.
    image_shape: tuple[int, int, int] | None = None
    #: The keyword arguments a client of the served task may set (``python -m envs.serve``),
    #: each with the bounds the server enforces (:class:`ClientKwarg`). Any other is refused
    #: unless the server was started with ``--allow-client-kwargs``. None: clients play the
    #: task with the server's kwargs.
    client_kwargs: ClassVar[Mapping[str, ClientKwarg]] = {}
    #: Keyword arguments only the server's operator may set, never a client (not even on a
    #: server that allows client kwargs): those that would move work into the server's own
    #: process or lift its limits.
    server_kwargs: ClassVar[frozenset[str]] = frozenset()
    #: Keyword arguments a server applies beneath its own when it serves the task (e.g. where
    #: answers are scored); none.
    served_kwargs: ClassVar[Mapping[str, Any]] = {}
    #: The served task's operations (``"reset"``, ``"step"``, ``"call"``) whose work is short and
    #: bounded whatever a client sends (well under a millisecond, no I/O, no waiting): the server
    #: answers them on its event loop instead of handing each to a thread. None: every call is
    #: answered in the server's pool.
    quick_calls: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Derive (or check) the render modes the class implements, and check its modality.

        gymnasium's ``check_env`` renders every mode listed in ``metadata["render_modes"]``, so a
        text task that listed ``"rgb_array"`` without drawing anything failed it.
        """
        super().__init_subclass__(**kwargs)
        draws = cls.render_image is not MultiTurnEnv.render_image
        if cls.modality not in ("text", "vision"):
            raise TypeError(f"{cls.__name__}.modality must be 'text' or 'vision', got {cls.modality!r}")
        if cls.modality == "vision" and not draws:
            raise TypeError(f"{cls.__name__} is a vision task but does not implement render_image()")
        if "metadata" in cls.__dict__:
            modes = list(cls.metadata.get("render_modes", []))
            if "rgb_array" in modes and not draws:
                raise TypeError(f"{cls.__name__}.metadata lists render mode 'rgb_array' but the class does not "
                                "implement render_image(); remove the mode or implement it")
            unknown = set(modes) - {"ansi", "rgb_array"}
            if unknown:
                raise TypeError(f"{cls.__name__}.metadata lists render modes {sorted(unknown)}; "
                                "MultiTurnEnv renders 'ansi' and 'rgb_array' only")
        else:
            cls.metadata = {**cls.metadata, "render_modes": ["ansi", "rgb_array"] if draws else ["ansi"]}

    def __init__(
        self,
        *,
        max_turns: int = 10,
        format_penalty: float = -0.1,
        render_mode: str | None = None,
        max_text_length: int = 1 << 20,
        feedback: bool = True,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(
                f"render_mode must be one of {self.metadata['render_modes']} or None, got {render_mode!r}"
            )
        self.max_turns = int(max_turns)
        self.format_penalty = float(format_penalty)
        self.render_mode = render_mode
        self.feedback = bool(feedback)
        self.action_space = AnyText(max_length=max_text_length)
        self.turn = 0
        self.episode_return = 0.0
        self._done = False
        self._success = False
        if self.modality == "text":  # nothing of the subclass shapes a text task's spaces
            self._build_spaces()

    def _build_spaces(self) -> None:
        """Set ``observation_space``: a vision task calls it at the end of its ``__init__``, once
        ``image_shape`` is set (a text task's are built by this class; calling it again is harmless)."""
        spaces: dict[str, gym.Space] = {"text": AnyText(max_length=1 << 22)}
        if self.modality == "vision":
            if self.image_shape is None:
                raise TypeError(f"{type(self).__name__} is a vision task but sets no image_shape")
            spaces["image"] = gym.spaces.Box(0, 255, self.image_shape, dtype=np.uint8)
        self.observation_space = gym.spaces.Dict(spaces)

    # -- to implement -------------------------------------------------------------------
    def _reset_task(self, options: dict[str, Any] | None) -> None:
        raise NotImplementedError

    def instructions(self) -> str:
        raise NotImplementedError

    def state_text(self) -> str:
        raise NotImplementedError

    def parse_action(self, reply: str) -> tuple[Any, str | None]:
        raise NotImplementedError

    def apply_action(self, action: Any) -> tuple[float, str, bool, bool]:
        raise NotImplementedError

    def render_image(self) -> np.ndarray:
        """The picture of the state, uint8 (H, W, 3): required for vision tasks, optional for text
        ones (``envs.play --save-gif``); implementing it adds the ``"rgb_array"`` render mode."""
        raise NotImplementedError(f"{type(self).__name__} has no image rendering")

    def render_text(self) -> str:
        """The state in the task's documented text notation (``render_mode="ansi"``)."""
        return self.state_text()

    def task_info(self) -> dict[str, Any]:
        """Extra per-step ``info`` entries (JSON-serialisable); override to add some."""
        return {}

    # -- what trainers and tools need from a task (docs/design.md#the-task-contract-envsbasepy) ---------
    # (the optional extras, a lookahead, probes, diagnostics, ..., are protocols of envs.capabilities)
    def legal_actions(self) -> list[str]:
        """The actions a well-formed reply may name in the current state (discrete tasks).

        Tasks with a fixed set of moves override this; :meth:`sample_reply` draws from it.
        """
        raise NotImplementedError(
            f"{type(self).__name__} defines neither legal_actions() nor sample_reply(); implement one "
            "so trainers can draw well-formed replies (pretraining, warm-up, random play)")

    def format_reply(self, action: Any) -> str:
        """The canonical reply naming ``action``, e.g. ``"<answer>Down</answer>"``."""
        return f"{_ANSWER_OPEN}{action}{_ANSWER_CLOSE}"

    def effective_actions(self) -> list[str]:
        """The legal actions that change the state (default: every legal action).

        A task where some legal moves are no-ops (Sokoban: a step into a wall, a push against
        a wall or a second box) narrows them here. :meth:`sample_reply` draws from these, so a
        model pretrained on random replies has to read the state to imitate them: with replies
        drawn the same way on every board, its move distribution ignores the board and RL starts
        with no state-dependent choice to reinforce (docs/results/sokoban.md#what-blocks-sokoban).
        """
        return list(self.legal_actions())

    @classmethod
    def skips_noop_moves(cls) -> bool:
        """Whether the task narrows :meth:`effective_actions` below its legal actions (so its
        random replies leave out some legal moves)."""
        return cls.effective_actions is not MultiTurnEnv.effective_actions

    def sample_reply(self, rng: np.random.Generator) -> str:
        """A random well-formed reply for the current state: a uniformly drawn effective action
        (:meth:`effective_actions`) in the task's reply format. The random agent of
        ``python -m envs.play --random``, and the replies of the embedded model's pretraining."""
        legal = list(self.effective_actions())
        if not legal:
            raise ValueError(f"{type(self).__name__}.effective_actions() is empty in this state")
        return self.format_reply(legal[int(rng.integers(len(legal)))])

    def describe_action(self, reply: str) -> str:
        """The action of a well-formed reply in a few words (the content of its answer tag)."""
        content = extract_tag(reply)
        return content if content is not None else reply.strip()

    @classmethod
    def before_batch_step(cls, envs: "Sequence[MultiTurnEnv]", replies: Sequence[str]) -> None:
        """Called by batched runners with every env of this class that is about to be stepped
        this turn, and its reply, before stepping them one by one: a task whose step does
        expensive I/O does it here for the whole batch (search: one retrieval request per turn).
        ``step`` must give the same result whether or not this ran. The default does nothing."""

    @classmethod
    def before_batch_reset(cls, envs: "Sequence[MultiTurnEnv]", seeds: Sequence[int | None]) -> None:
        """Called by batched runners with every env of this class about to be reset, and its
        seed, before resetting them one by one (``reset(seed=...)``, no options): a served task
        sends them as one request. ``reset`` must give the same result whether or not this
        ran. The default does nothing."""

    # -- the contract -------------------------------------------------------------------
    def _observation(self, text: str) -> dict[str, Any]:
        obs: dict[str, Any] = {"text": text}
        if self.modality == "vision":
            obs["image"] = self.render_image()
        return obs

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        self._reset_task(options)
        self.turn = 0
        self.episode_return = 0.0
        self._done = False
        self._success = False
        instructions = self.instructions()
        obs = self._observation(f"{instructions}\n\n{self.state_text()}")
        info = {"instructions": instructions, "action_is_valid": True, "success": False, "turn": 0}
        info.update(self.task_info())
        return obs, info

    def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self.turn += 1
        reply = action if isinstance(action, str) else ""
        parsed, error = self.parse_action(reply)
        if error is not None:
            reward, terminated, success, valid = self.format_penalty, False, False, False
            feedback = f"Invalid reply: {error}"
        else:
            reward, feedback, terminated, success = self.apply_action(parsed)
            valid = True
        truncated = not terminated and self.turn >= self.max_turns
        self._done = terminated or truncated
        self._success = bool(success)
        self.episode_return += float(reward)
        if not self.feedback:  # the state alone: what a window:0 agent of a Markov task needs
            text = self.state_text()
        else:
            text = f"{feedback}\n\n{self.state_text()}" if feedback else self.state_text()
            text += "\n\nThe episode is over." if self._done else f"\n\nTurns left: {self.max_turns - self.turn}."
        info = {"action_is_valid": valid, "success": self._success, "turn": self.turn}
        info.update(self.task_info())
        return self._observation(text), float(reward), bool(terminated), bool(truncated), info

    def render(self) -> str | np.ndarray | None:
        if self.render_mode == "ansi":
            return self.render_text()
        if self.render_mode == "rgb_array":
            return self.render_image()
        return None
