"""freshper's environment hub: multi-turn text and vision tasks behind a gymnasium API.

Importing ``envs`` registers the built-in tasks and any third-party tasks installed through
the ``freshper.envs`` entry-point group, so ``gymnasium.make("freshper/Sokoban-v0")`` works.
"""

from envs.base import IMAGE_PLACEHOLDER, MultiTurnEnv, extract_tag
from envs.registry import (
    ENTRY_POINT_GROUP,
    RegistrationError,
    TaskSpec,
    load_plugins,
    make,
    register,
    registered_tasks,
    task_class,
    task_spec,
    unregister,
)
from envs.spaces import AnyText
from envs import _builtin  # noqa: F401  (registers the freshper/* tasks)

__all__ = [
    "IMAGE_PLACEHOLDER",
    "MultiTurnEnv",
    "extract_tag",
    "ENTRY_POINT_GROUP",
    "RegistrationError",
    "TaskSpec",
    "load_plugins",
    "make",
    "register",
    "registered_tasks",
    "task_class",
    "task_spec",
    "unregister",
    "AnyText",
]

load_plugins()
