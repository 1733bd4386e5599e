"""Registrations of the tasks that ship with freshper (entry points load lazily)."""

from envs.reasoning import INSTALL_HINT as _REASONING_HINT
from envs.reasoning import PRESETS as _REASONING_PRESETS
from envs import registry
from envs.registry import register

_BEFORE = set(registry._TASKS)

#: What to install for the GEM tasks (envs/gem_compat.py).
GEM_INSTALL_HINT = "pip install -e '.[gem]' (or pip install gem-llm; Python 3.10-3.11)"
#: What to install for verifiers environments (envs/adapters/verifiers.py).
VERIFIERS_INSTALL_HINT = "pip install -e '.[verifiers]' (verifiers>=0.3.1,<0.4)"
#: What to install for OpenEnv environments (envs/adapters/openenv.py).
OPENENV_INSTALL_HINT = "pip install -e '.[openenv]' (openenv-core>=0.2.1,<0.4)"
#: freshper ids of GEM's offline games -> GEM's ids (envs/gem_compat.py wraps them).
GEM_GAMES: dict[str, str] = {
    "gem/GuessTheNumberEasy-v0": "game:GuessTheNumber-v0-easy",
    "gem/GuessTheNumberHard-v0": "game:GuessTheNumber-v0-hard",
    "gem/MastermindEasy-v0": "game:Mastermind-v0-easy",
    "gem/MastermindHard-v0": "game:Mastermind-v0-hard",
    "gem/MinesweeperEasy-v0": "game:Minesweeper-v0-easy",
    "gem/MinesweeperHard-v0": "game:Minesweeper-v0-hard",
    "gem/Game2048Easy-v0": "game:Game2048-v0-easy",
    "gem/SokobanEasy-v0": "game:Sokoban-v0-easy",
    "gem/FifteenPuzzleEasy-v0": "game:FifteenPuzzle-v0-easy",
}

register(
    "freshper/Sokoban-v0",
    "envs.sokoban:SokobanEnv",
    modality="text",
    description="Push every box onto a goal; generated rooms always solvable in time (preset simple|hard|large), or XSB levels.",
    kwargs={},
)
register(
    "freshper/SokobanVision-v0",
    "envs.sokoban:SokobanVisionEnv",
    modality="vision",
    description="Sokoban observed as a rendered image.",
    kwargs={},
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
register(
    "freshper/ReasoningGym-v0",
    "envs.reasoning:ReasoningGymEnv",
    modality="text",
    description="Any reasoning-gym generator (task=<name>, its settings as kwargs); reward = its verifier's score.",
    kwargs={"task": "basic_arithmetic"},
    requires=("reasoning_gym",),
    install_hint=_REASONING_HINT,
)
register(
    "freshper/Arithmetic-v0",
    "envs.reasoning:ReasoningGymEnv",
    modality="text",
    description="a + b, a - b, a * b with one-digit numbers (reasoning-gym basic_arithmetic); one answer.",
    kwargs=_REASONING_PRESETS["arithmetic"],
    requires=("reasoning_gym",),
    install_hint=_REASONING_HINT,
)
register(
    "freshper/Countdown-v0",
    "envs.reasoning:ReasoningGymEnv",
    modality="text",
    description="Reach a target (10-30) with three one-digit numbers and + - * (reasoning-gym countdown); 3 attempts.",
    kwargs=_REASONING_PRESETS["countdown"],
    requires=("reasoning_gym",),
    install_hint=_REASONING_HINT,
)
for _id, _gem_id in GEM_GAMES.items():
    register(
        _id,
        "envs.gem_compat:GemGameEnv",
        modality="text",
        description=f"GEM's {_gem_id} game (replies in \\boxed{{}} or <answer>); GEM's rewards.",
        kwargs={"gem_id": _gem_id},
        requires=("gem",),
        install_hint=GEM_INSTALL_HINT,
    )
register(
    "gem/Game-v0",
    "envs.gem_compat:GemGameEnv",
    modality="text",
    description="Any GEM env by its id (gem_id='game:...'), e.g. gem_id='game:Mastermind-v0-random'.",
    kwargs={"gem_id": "game:GuessTheNumber-v0-random"},
    requires=("gem",),
    install_hint=GEM_INSTALL_HINT,
)
register(
    "freshper/Remote-v0",
    "envs.remote:RemoteEnv",
    modality="text",
    description="A text task served by `python -m envs.serve ID` at url= (other kwargs go to the served task).",
    kwargs={},
    needs=("url",),
)
register(
    "freshper/RemoteVision-v0",
    "envs.remote:RemoteVisionEnv",
    modality="vision",
    description="A vision task served by `python -m envs.serve ID` at url= (images sent as lossless PNG).",
    kwargs={},
    needs=("url",),
)
register(
    "freshper/Verifiers-v0",
    "envs.adapters.verifiers:VerifiersEnv",
    modality="text",
    description="A verifiers environment (env=object, 'module:function' or installed id; env_args=...): multi-turn through its env_response, reward from its rubric.",
    kwargs={},
    requires=("verifiers",),
    install_hint=VERIFIERS_INSTALL_HINT,
    needs=("env",),
)
register(
    "freshper/OpenEnv-v0",
    "envs.adapters.openenv:OpenEnvEnv",
    modality="text",
    description="An OpenEnv environment server at url=, played over its WebSocket session (action_field= carries the reply).",
    kwargs={},
    requires=("openenv",),
    install_hint=OPENENV_INSTALL_HINT,
    needs=("url",),
)

#: The ids registered here: the tasks that ship with freshper, whatever else is installed
#: (the embedded tiny model's shared tokenizer learns from these alone, agents/policies/tiny.py).
BUILTIN_IDS: frozenset[str] = frozenset(set(registry._TASKS) - _BEFORE)
del _BEFORE

# The figure tasks ship with freshper too, registered after BUILTIN_IDS so the shared tokenizer
# (and every cached default model and pretraining) stays as it was: like a plugin's task, each
# gets an embedded tiny model whose tokenizer also learned from its own episodes.
register(
    "freshper/GeometryVision-v0",
    "envs.geometry:GeometryVisionEnv",
    modality="vision",
    description="Plane geometry with a drawn diagram whose values are on the picture alone (preset easy|medium|hard|mixed); numeric answer, 3 attempts.",
    kwargs={},
)
register(
    "freshper/Geometry-v0",
    "envs.geometry:GeometryEnv",
    modality="text",
    description="GeometryVision's problems with the figure described in words (the text twin).",
    kwargs={},
)
register(
    "freshper/ChartQA-v0",
    "envs.chartqa:ChartQAEnv",
    modality="vision",
    description="Questions about a bar, line or pie chart of generated data, the chart the only place the data is (preset easy|medium|hard); 2 attempts.",
    kwargs={},
)
