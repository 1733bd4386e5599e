"""What a task may offer beyond the lean contract of :mod:`envs.base`: optional capabilities.

A task is whatever :class:`envs.base.MultiTurnEnv` asks for (``_reset_task``, ``instructions``,
``state_text``, ``parse_action``, ``apply_action``, random replies). Everything here is optional:
a task offers a capability by defining its method(s), nothing else (the classes below are
``typing.Protocol``s, checked structurally with ``isinstance``: no base class to inherit, no
registration). The code that uses a capability checks for it where it uses it, through the
accessors at the bottom of this module, which give today's default where there is one and
raise :class:`MissingCapability` (a ``NotImplementedError`` naming the method and the protocol)
where there is none.

- :class:`Lookahead` (``lookahead_text``): what each legal action leads to, in a few words
  (FrozenLake: ``" Left - Down F Right H Up -"``, the cell each move steps on). Without it the
  reasoning modes ``lookahead``, ``aim`` and ``subgoal`` are unavailable.
- :class:`Aim` (``aim_text``): where what the agent works towards lies relative to it (Sokoban:
  ``" box Up Left goal Down"``, in the words of :func:`direction_words`). Without it: no ``aim``.
- :class:`Subgoal` (``subgoal_text``): the next place to reach and what to do there (Sokoban:
  ``" stand Up Left push Right"``). Without it: no ``subgoal``.
- :class:`SubgoalMoves` (``subgoal_moves``): the legal actions that do what the subgoal says
  (Sokoban: the push on the push spot, else a step towards it). Without it: no follow stage
  (pretraining replies whose move does what the words say).
- :class:`Dynamics` (``outcome_text``): what a step led to, as text, the target of dynamics
  examples (predicting it makes a model read the state it acts on). Default: the new state
  (``render_text``), or ``success``/``failure`` when the episode ended.
- :class:`TaskVocabulary` (``tokenizer_text``): text the embedded tiny model's tokenizer should
  learn from (SearchQA: its knowledge base, whose made-up names would otherwise be spelled
  letter by letter). Default ``""``: the shared tokenizer.
- :class:`CounterfactualProbes` (``counterfactual_probes``): pairs of states that differ in one
  detail a competent policy must react to. Default ``[]``: no counterfactual probe.
- :class:`TurnDiagnostics` (``turn_diagnostics``, a class method): task-specific numbers over
  played ``(observation text, reply)`` turns (FrozenLake: its safe-move probe). Default ``{}``.

A think tag's content for each reasoning mode (:data:`REASONINGS`) is :func:`reasoning_text`;
:func:`supports_reasoning` says which modes a task (or its class) can write. docs/hub.md shows
which training stage and diagnostic uses each capability.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np


class MissingCapability(NotImplementedError):
    """A task lacks an optional capability its caller needs (the message names the method and
    the protocol of :mod:`envs.capabilities`; ``capability`` is the protocol)."""

    def __init__(self, message: str, capability: type | None = None) -> None:
        super().__init__(message)
        self.capability = capability


@runtime_checkable
class Lookahead(Protocol):
    def lookahead_text(self) -> str:
        """What each legal action leads to in the current state, in a few words (FrozenLake:
        ``" Left - Down F Right H Up -"``). It describes the state, never which action is good."""
        ...


@runtime_checkable
class Aim(Protocol):
    def aim_text(self) -> str:
        """Where what the agent works towards lies relative to it, in a few words (Sokoban:
        ``" box Up Left goal Down"``, the nearest box off its goal seen from the player and the
        nearest free goal seen from that box; FrozenLake: ``" goal Down Right"``)."""
        ...


@runtime_checkable
class Subgoal(Protocol):
    def subgoal_text(self) -> str:
        """The next place to reach and what to do there, in a few words (Sokoban: ``" stand Up
        Left push Right"``, the nearest cell from which a push moves the box towards its goal,
        seen from the player, and that push; ``" stand here push Right"`` on it)."""
        ...


@runtime_checkable
class SubgoalMoves(Protocol):
    def subgoal_moves(self) -> list[str]:
        """The legal actions that do what :meth:`Subgoal.subgoal_text` says (Sokoban: the push
        on the push spot, else a step towards it); empty where none does."""
        ...


@runtime_checkable
class Dynamics(Protocol):
    def outcome_text(self, terminated: bool, success: bool) -> str:
        """What the last step led to, as text: the new state in the task's text notation, or a
        word for how the episode ended (the default: :func:`outcome_text`)."""
        ...


@runtime_checkable
class TaskVocabulary(Protocol):
    def tokenizer_text(self) -> str:
        """Text the embedded tiny model of this task should learn its tokens from, beside the
        sampled episodes of every task: the task's own vocabulary where random play shows little
        of it. Empty: the shared tokenizer."""
        ...


@runtime_checkable
class CounterfactualProbes(Protocol):
    def counterfactual_probes(self, rng: np.random.Generator, n: int) -> list[tuple[dict, dict, str]]:
        """Up to ``n`` pairs of states that differ in one detail a competent policy must react to.

        Each item is ``(options_a, options_b, action)``: ``reset(seed=..., options=options_a)``
        puts the task in state a (likewise b), and a policy that reads the state prefers
        ``action`` more in state b than in state a; a policy blind to that detail shows no
        difference."""
        ...


@runtime_checkable
class OtherPicture(Protocol):
    @classmethod
    def other_picture_kwargs(cls) -> dict[str, Any]:
        """Keyword arguments that build the task with each episode's picture replaced by another
        problem's, the text and the answer staying the episode's own (the same seeds give the
        same problems): a policy that reads the picture falls there to what a picture-blind one
        scores, one that does not keeps its success. Empty where the task shows no picture. A
        class method."""
        ...


@runtime_checkable
class TurnDiagnostics(Protocol):
    @classmethod
    def turn_diagnostics(cls, turns: Sequence[tuple[str, str]]) -> dict[str, float]:
        """Task-specific numbers computed from played turns, each ``(observation text, reply)``
        (e.g. from evaluation records). A class method: it reads only the text, not a live env."""
        ...


def require(task: Any, capability: type) -> Any:
    """``task`` itself when it offers ``capability`` (one of this module's protocols), else a
    :class:`MissingCapability` naming the method it lacks."""
    if isinstance(task, capability):
        return task
    name = task.__name__ if isinstance(task, type) else type(task).__name__
    methods = ", ".join(f"{m}()" for m in _METHODS[capability])
    raise MissingCapability(f"{name} does not implement {methods} (envs.capabilities.{capability.__name__})",
                            capability)


#: What each reasoning mode writes in a reply's think tag before the answer: nothing, the task's
#: lookahead (:class:`Lookahead`), the state itself in the task's text notation (``render_text``:
#: a vision task's policy transcribes the image, then answers), where the agent's target lies, a
#: comma, then the lookahead (:class:`Aim`: ``" box Down goal Up, Up wall Down move Left wall Right
#: move"``), or the next place to reach and what to do there, a comma, then the lookahead
#: (:class:`Subgoal`: ``" stand Up Left push Right, Up wall ..."``).
REASONINGS = ("none", "lookahead", "state", "aim", "subgoal")

#: The capabilities each reasoning mode needs (``state`` needs ``render_text``, which every task has).
REASONING_NEEDS: dict[str, tuple[type, ...]] = {"none": (), "lookahead": (Lookahead,), "state": (),
                                                "aim": (Aim, Lookahead), "subgoal": (Subgoal, Lookahead)}


def supports_reasoning(task: Any, mode: str) -> bool:
    """Whether ``task`` (a task or its class) has what reasoning ``mode`` needs. A task served
    remotely answers every method and raises ``NotImplementedError`` on the call instead."""
    if mode not in REASONINGS:
        raise ValueError(f"reasoning must be one of {REASONINGS}, got {mode!r}")
    return all(isinstance(task, need) for need in REASONING_NEEDS[mode])


def reasoning_text(task: Any, mode: str) -> str | None:
    """The think-tag content of a ``mode`` reply in ``task``'s current state (``None`` for
    ``"none"``). Raises :class:`MissingCapability` where the task lacks what the mode needs."""
    if mode == "none":
        return None
    if mode == "lookahead":
        return require(task, Lookahead).lookahead_text()
    if mode == "state":
        return task.render_text()
    if mode == "aim":
        return require(task, Aim).aim_text() + "," + require(task, Lookahead).lookahead_text()
    if mode == "subgoal":
        return require(task, Subgoal).subgoal_text() + "," + require(task, Lookahead).lookahead_text()
    raise ValueError(f"reasoning must be one of {REASONINGS}, got {mode!r}")


def think_reply(lookahead: str, reply: str) -> str:
    """``reply`` with ``lookahead`` before it in a think tag: ``<think>...</think><answer>...``.
    Parsing reads the last complete answer tag, so the env executes the same action."""
    return f"<think>{lookahead}</think>{reply}"


def states_lookahead(think: str, lookahead: str) -> bool:
    """Whether a think tag's content is ``lookahead`` (stripped) or ends with it, as it does
    after the aim (reasoning mode ``aim``): the turn diagnostics' ``lookahead_exact``."""
    return think == lookahead or think.endswith(" " + lookahead)


def direction_words(src: tuple[int, int], dst: tuple[int, int]) -> str:
    """Where grid cell ``dst`` (row, column) lies seen from ``src``: ``" Up Left"``, ``" Down"``,
    ... (the vertical word first; empty for the same cell): the words of the tasks' ``aim_text``."""
    (r0, c0), (r1, c1) = src, dst
    return ("" if r1 == r0 else " Up" if r1 < r0 else " Down") + ("" if c1 == c0 else " Left" if c1 < c0 else " Right")


# -- the accessors with defaults ----------------------------------------------------------------
def outcome_text(task: Any, terminated: bool, success: bool) -> str:
    """What the last step led to (:class:`Dynamics`); by default the new state in the task's text
    notation (``render_text``), or ``success``/``failure`` when the episode ended."""
    if isinstance(task, Dynamics):
        return task.outcome_text(terminated, success)
    if terminated:
        return "success" if success else "failure"
    return task.render_text()


def tokenizer_text(task: Any) -> str:
    """The task's own vocabulary (:class:`TaskVocabulary`); ``""`` by default."""
    return task.tokenizer_text() if isinstance(task, TaskVocabulary) else ""


def counterfactual_probes(task: Any, rng: np.random.Generator, n: int) -> list[tuple[dict, dict, str]]:
    """The task's counterfactual pairs (:class:`CounterfactualProbes`); ``[]`` by default."""
    return task.counterfactual_probes(rng, n) if isinstance(task, CounterfactualProbes) else []


def other_picture_kwargs(task: Any) -> dict[str, Any]:
    """The keyword arguments that give ``task`` (a task class or a task) another problem's
    picture in every episode (:class:`OtherPicture`); ``{}`` where it has none."""
    cls = task if isinstance(task, type) else type(task)
    return dict(cls.other_picture_kwargs()) if isinstance(cls, OtherPicture) else {}


def turn_diagnostics(task: Any, turns: Sequence[tuple[str, str]]) -> dict[str, float]:
    """The task's numbers over played turns (:class:`TurnDiagnostics`; ``task`` is a task class
    or a task); ``{}`` by default."""
    cls = task if isinstance(task, type) else type(task)
    return cls.turn_diagnostics(turns) if isinstance(cls, TurnDiagnostics) else {}


_METHODS: dict[type, tuple[str, ...]] = {
    Lookahead: ("lookahead_text",), Aim: ("aim_text",), Subgoal: ("subgoal_text",),
    SubgoalMoves: ("subgoal_moves",), Dynamics: ("outcome_text",), TaskVocabulary: ("tokenizer_text",),
    CounterfactualProbes: ("counterfactual_probes",), OtherPicture: ("other_picture_kwargs",),
    TurnDiagnostics: ("turn_diagnostics",),
}
#: Every optional capability, in the order of the table above.
CAPABILITIES: tuple[type, ...] = tuple(_METHODS)
