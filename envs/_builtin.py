"""Registrations of the tasks that ship with freshper (entry points load lazily)."""

from envs.registry import register

register(
    "freshper/Sokoban-v0",
    "envs.sokoban:SokobanEnv",
    modality="text",
    description="Push every box onto a goal; procedurally generated, always solvable rooms.",
    kwargs={"preset": "simple"},
)
register(
    "freshper/SokobanVision-v0",
    "envs.sokoban:SokobanVisionEnv",
    modality="vision",
    description="Sokoban observed as a rendered image.",
    kwargs={"preset": "simple"},
)
register(
    "freshper/FrozenLake-v0",
    "envs.frozenlake:FrozenLakeEnv",
    modality="text",
    description="Walk from the start to the goal without falling into a hole; random maps.",
    kwargs={"size": 4},
)
register(
    "freshper/FrozenLakeVision-v0",
    "envs.frozenlake:FrozenLakeVisionEnv",
    modality="vision",
    description="FrozenLake observed as a rendered image (one 28x28 tile per cell).",
    kwargs={"size": 4},
)
register(
    "freshper/SearchQA-v0",
    "envs.search:SearchQAEnv",
    modality="text",
    description="Answer questions by searching a corpus (<search>..</search>, <answer>..</answer>).",
    kwargs={},
)
