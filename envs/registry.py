"""Task registration: ids, modality and defaults, on top of gymnasium's registry.

``register`` validates the id, records the task's modality and defaults for
``python -m envs list``, and registers it with gymnasium so ``gymnasium.make(id, **kwargs)``
works. Third-party packages add tasks through the entry-point group ``freshper.envs``: each
entry point is a function that calls :func:`register`.

The modality has one source, the task class (``MultiTurnEnv.modality``): a class entry point
gives it at registration; a lazy ``"module:Class"`` entry point is registered with the modality
it promises (so listings need not import the module) and the class is checked against it each
time the task is built, with an error naming both. A task may name the optional packages it
needs (``requires``): it is still listed, marked as not installed with the install hint, and
building it says what to install.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import importlib.util
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import gymnasium as gym
from gymnasium.envs.registration import load_env_creator

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "freshper.envs"
_ID_RE = re.compile(r"^(?P<ns>[a-z][a-z0-9_\-]*)/(?P<name>[A-Z][A-Za-z0-9]*)-v(?P<version>\d+)$")


class RegistrationError(ValueError):
    """A task id or registration is malformed or clashes with an existing one."""


class UnknownTaskError(KeyError):
    """No task is registered under the requested id (the message suggests close ids)."""

    def __str__(self) -> str:  # KeyError would show the message quoted and escaped
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class TaskSpec:
    """What the hub knows about a registered task."""

    id: str
    entry_point: str | Callable[..., gym.Env]
    modality: str
    description: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    source: str = "freshper"
    #: Importable top-level modules the task needs beyond freshper's own dependencies.
    requires: tuple[str, ...] = ()
    #: What to install when a required module is missing, e.g. ``pip install -e '.[reasoning]'``.
    install_hint: str = ""
    #: Keyword arguments the task cannot be built without (a served task's ``url``, an adapter's
    #: environment): listed with the task; checks that build every task by its defaults skip it.
    needs: tuple[str, ...] = ()

    def missing(self) -> list[str]:
        """The required modules that cannot be imported here (cheap: nothing is imported)."""
        return [m for m in self.requires if not _importable(m)]

    @property
    def available(self) -> bool:
        """Whether every required module is installed."""
        return not self.missing()

    def missing_message(self) -> str:
        """Why the task cannot be built here and what to install ('' when it can)."""
        missing = self.missing()
        if not missing:
            return ""
        hint = f": {self.install_hint}" if self.install_hint else ""
        return f"task {self.id!r} needs the Python package(s) {', '.join(missing)}, which are not installed{hint}"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class _Creator:
    """The gymnasium entry point of a registered task: loads the class (with a clear error for
    a missing package or module), checks that its modality is the registered one, builds it.

    A module-level class with plain attributes, so gymnasium's vector envs can pickle it.
    """

    def __init__(self, env_id: str, entry_point: str | Callable[..., gym.Env]) -> None:
        self.env_id = env_id
        self.entry_point = entry_point

    def _load(self) -> Callable[..., gym.Env]:
        spec = _TASKS.get(self.env_id)
        if spec is not None and spec.missing():
            raise ImportError(spec.missing_message())
        if not isinstance(self.entry_point, str):
            return self.entry_point
        try:
            return load_env_creator(self.entry_point)
        except (ImportError, AttributeError) as exc:
            source = spec.source if spec is not None else "?"
            raise ImportError(
                f"task {self.env_id!r} is registered (source {source}) but its entry point "
                f"{self.entry_point!r} could not be loaded: {exc}. Is the package that provides it "
                "installed and up to date?"
            ) from exc

    @property
    def metadata(self) -> dict[str, Any]:
        """The class's metadata (gymnasium reads its render modes before building)."""
        return dict(getattr(self._load(), "metadata", {}))

    def __call__(self, **kwargs: Any) -> gym.Env:
        creator = self._load()
        env = creator(**kwargs)
        spec = _TASKS.get(self.env_id)
        actual = getattr(getattr(env, "unwrapped", env), "modality", None)
        if spec is not None and actual is not None and actual != spec.modality:
            raise RegistrationError(
                f"task {self.env_id!r} was registered with modality={spec.modality!r} but its class "
                f"{type(env.unwrapped).__name__} declares modality={actual!r}; fix the register() call "
                "(or omit modality= when registering a class, so it is taken from the class)"
            )
        return env

    def __repr__(self) -> str:
        return f"_Creator({self.env_id!r}, {self.entry_point!r})"


_TASKS: dict[str, TaskSpec] = {}
_LOADED_PLUGINS: set[tuple[str, str]] = set()
#: The distribution whose entry point is running, so its tasks are listed under its name.
_plugin_source: str | None = None


def validate_id(env_id: str) -> None:
    """Raise a :class:`RegistrationError` that says how to fix a malformed id."""
    if not isinstance(env_id, str) or not _ID_RE.match(env_id):
        raise RegistrationError(
            f"invalid task id {env_id!r}: ids look like 'namespace/Name-vN', with a lowercase "
            "namespace, a CamelCase name and an integer version, e.g. 'freshper/Sokoban-v0' "
            "or 'mypackage/Maze-v1'"
        )


def register(
    env_id: str,
    entry_point: str | Callable[..., gym.Env],
    *,
    modality: str | None = None,
    description: str = "",
    kwargs: dict[str, Any] | None = None,
    source: str | None = None,
    override: bool = False,
    requires: tuple[str, ...] | list[str] = (),
    install_hint: str = "",
    needs: tuple[str, ...] | list[str] = (),
) -> TaskSpec:
    """Register a task by id.

    Args:
        env_id: ``namespace/Name-vN``.
        entry_point: ``"module.path:ClassName"`` (loaded lazily, when the task is built) or a
            class or callable returning the env.
        modality: ``"text"`` or ``"vision"``. Taken from the class when ``entry_point`` is a
            class with a ``modality`` attribute (a different value given here is an error);
            required for lazy string entry points, and checked against the class when built.
        description: one line shown by ``python -m envs list``.
        kwargs: default keyword arguments (overridable in ``gymnasium.make``).
        source: the distribution that provides the task (shown in listings); defaults to
            the distribution of the running ``freshper.envs`` entry point, else "freshper".
        override: replace an existing registration instead of raising.
        requires: importable modules the task needs beyond freshper's dependencies; when one is
            missing the task is still listed (marked) and building it raises ``ImportError``
            with ``install_hint``.
        install_hint: what to install, e.g. ``"pip install -e '.[reasoning]'"``.
        needs: keyword arguments without which the task cannot be built (e.g. ``("url",)`` for a
            task played on a server); ``python -m envs list`` shows them.
    """
    validate_id(env_id)
    source = source or _plugin_source or "freshper"
    declared = getattr(entry_point, "modality", None) if isinstance(entry_point, type) else None
    if declared is not None:
        if modality is not None and modality != declared:
            raise RegistrationError(
                f"modality={modality!r} given for {env_id!r}, but its class {entry_point.__name__} "
                f"declares modality={declared!r}; omit modality= (it is taken from the class) or fix the class")
        modality = declared
    if modality is None:
        raise RegistrationError(
            f"modality of {env_id!r} is required for a lazy entry point {entry_point!r}: pass "
            "modality='text' or 'vision' (it is checked against the class when the task is built)")
    if modality not in ("text", "vision"):
        raise RegistrationError(f"modality of {env_id!r} must be 'text' or 'vision', got {modality!r}")
    if env_id in _TASKS and not override:
        raise RegistrationError(
            f"task {env_id!r} is already registered (by {_TASKS[env_id].source}); bump the "
            "version (e.g. -v1) or pass override=True"
        )
    spec = TaskSpec(env_id, entry_point, modality, description, dict(kwargs or {}), source,
                    tuple(requires), install_hint, tuple(needs))
    _TASKS[env_id] = spec
    if env_id in gym.registry:
        del gym.registry[env_id]
    # Turn limits are the task's own (max_turns), so no TimeLimit wrapper is added.
    gym.register(id=env_id, entry_point=_Creator(env_id, entry_point), kwargs=dict(spec.kwargs),
                 disable_env_checker=False)
    return spec


def unregister(env_id: str) -> TaskSpec:
    """Remove a registered task (from freshper's registry and gymnasium's); returns its spec."""
    spec = task_spec(env_id)
    del _TASKS[env_id]
    gym.registry.pop(env_id, None)
    return spec


def task_spec(env_id: str) -> TaskSpec:
    """Look up a registered task, suggesting close ids when it is unknown."""
    try:
        return _TASKS[env_id]
    except KeyError:
        close = difflib.get_close_matches(env_id, list(_TASKS), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownTaskError(
            f"no task registered as {env_id!r}.{hint} Run `python -m envs list` to see all tasks; a task "
            "registered by a file or module of your own runs with --import FILE.py (or MODULE)."
        ) from None


def task_class(env_id: str) -> type:
    """The class of a registered task, loaded without building an env: for the class methods
    of the contract and its capabilities, e.g.
    ``envs.capabilities.turn_diagnostics(task_class(env_id), turns)``."""
    spec = task_spec(env_id)
    creator = _Creator(env_id, spec.entry_point)._load()
    if not isinstance(creator, type):
        raise TypeError(f"task {env_id!r} is registered with a factory function, not a class; build it and use "
                        "type(env.unwrapped)")
    return creator


def registered_tasks() -> list[TaskSpec]:
    """All registered tasks, sorted by id."""
    return [_TASKS[k] for k in sorted(_TASKS)]


def make(env_id: str, **kwargs: Any) -> gym.Env:
    """``gymnasium.make`` with helpful errors for unknown ids, missing optional packages and
    unloadable entry points (``gymnasium.make`` gives the same errors for the last two)."""
    task_spec(env_id)
    return gym.make(env_id, **kwargs)


def load_plugins() -> list[str]:
    """Call every ``freshper.envs`` entry point once; a failing plugin is logged, not fatal.

    Returns the names of the entry points loaded by this call. Calling it again (e.g. after
    installing a package at run time) loads only entry points not seen before.
    """
    global _plugin_source
    loaded = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = (ep.name, ep.value)
        if key in _LOADED_PLUGINS:  # the same distribution can be visible twice on sys.path
            continue
        _LOADED_PLUGINS.add(key)
        dist = getattr(ep, "dist", None)
        _plugin_source = getattr(dist, "name", None) or ep.value.split(":")[0].split(".")[0]
        try:
            ep.load()()
            loaded.append(ep.name)
        except Exception:  # a broken third-party package must not break the hub
            logger.exception("could not load freshper.envs plugin %r (%s)", ep.name, ep.value)
        finally:
            _plugin_source = None
    return loaded
