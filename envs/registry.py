"""Task registration: ids, modality and defaults, on top of gymnasium's registry.

``register`` validates the id, records the task's modality and defaults for
``python -m envs list``, and registers it with gymnasium so ``gymnasium.make(id, **kwargs)``
works. Third-party packages add tasks through the entry-point group ``freshper.envs``: each
entry point is a function that calls :func:`register`.
"""

from __future__ import annotations

import difflib
import importlib.metadata
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
    modality: str,
    description: str = "",
    kwargs: dict[str, Any] | None = None,
    source: str | None = None,
    override: bool = False,
) -> TaskSpec:
    """Register a task by id.

    Args:
        env_id: ``namespace/Name-vN``.
        entry_point: ``"module.path:ClassName"`` or a callable returning the env.
        modality: ``"text"`` or ``"vision"``.
        description: one line shown by ``python -m envs list``.
        kwargs: default keyword arguments (overridable in ``gymnasium.make``).
        source: the distribution that provides the task (shown in listings); defaults to
            the distribution of the running ``freshper.envs`` entry point, else "freshper".
        override: replace an existing registration instead of raising.
    """
    validate_id(env_id)
    source = source or _plugin_source or "freshper"
    if modality not in ("text", "vision"):
        raise RegistrationError(f"modality of {env_id!r} must be 'text' or 'vision', got {modality!r}")
    if env_id in _TASKS and not override:
        raise RegistrationError(
            f"task {env_id!r} is already registered (by {_TASKS[env_id].source}); bump the "
            "version (e.g. -v1) or pass override=True"
        )
    spec = TaskSpec(env_id, entry_point, modality, description, dict(kwargs or {}), source)
    _TASKS[env_id] = spec
    if env_id in gym.registry:
        del gym.registry[env_id]
    # Turn limits are the task's own (max_turns), so no TimeLimit wrapper is added.
    gym.register(id=env_id, entry_point=entry_point, kwargs=dict(spec.kwargs), disable_env_checker=False)
    return spec


def task_spec(env_id: str) -> TaskSpec:
    """Look up a registered task, suggesting close ids when it is unknown."""
    try:
        return _TASKS[env_id]
    except KeyError:
        close = difflib.get_close_matches(env_id, list(_TASKS), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownTaskError(
            f"no task registered as {env_id!r}.{hint} Run `python -m envs list` to see all tasks."
        ) from None


def registered_tasks() -> list[TaskSpec]:
    """All registered tasks, sorted by id."""
    return [_TASKS[k] for k in sorted(_TASKS)]


def make(env_id: str, **kwargs: Any) -> gym.Env:
    """``gymnasium.make`` with helpful errors for unknown ids and unloadable entry points."""
    spec = task_spec(env_id)
    if isinstance(spec.entry_point, str):
        try:
            load_env_creator(spec.entry_point)
        except (ImportError, AttributeError) as exc:
            raise ImportError(
                f"task {env_id!r} is registered (source {spec.source}) but its entry point "
                f"{spec.entry_point!r} could not be loaded: {exc}. Is the package that provides it "
                "installed and up to date?"
            ) from exc
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
