"""The layers import one way: envs < replay < agents < learner < train.py, with no circles.

``envs`` imports neither torch nor ``agents``; ``replay`` imports numpy and the standard library
only; no package imports a higher layer; the modules of ``agents`` import each other without a
circle (type-checking-only imports included in the scan, so a protocol is not a loophole).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ["envs", "replay", "agents", "learner"]


def _imports(path: Path) -> set[str]:
    """Every module a file imports (absolute names), at any depth of the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _modules(package: str) -> dict[str, set[str]]:
    found = {}
    for path in sorted((REPO / package).rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        found[name] = _imports(path)
    return found


@pytest.mark.parametrize("package", LAYERS)
def test_no_package_imports_a_higher_layer(package: str) -> None:
    higher = LAYERS[LAYERS.index(package) + 1:] + ["train"]
    if package == "agents":
        higher = ["learner", "train"]  # agents may use envs (tasks) but not the learner
    if package == "replay":
        higher = ["envs", "agents", "learner", "train"]
    bad = {m: sorted(i for i in imps if i.split(".")[0] in higher) for m, imps in _modules(package).items()}
    assert not {m: i for m, i in bad.items() if i}, f"{package} imports a higher layer: {bad}"


def test_replay_uses_numpy_and_the_standard_library_only() -> None:
    allowed = set(sys.stdlib_module_names) | {"numpy", "replay"}
    extra = {m: sorted(i for i in imps if i.split(".")[0] not in allowed) for m, imps in _modules("replay").items()}
    assert not {m: i for m, i in extra.items() if i}, extra


def test_importing_envs_loads_neither_torch_nor_agents() -> None:
    code = ("import sys, envs, gymnasium as gym; gym.make('freshper/FrozenLake-v0').reset(seed=0); "
            "import envs.play, envs.search; "
            "print(sorted(m for m in ('torch', 'agents', 'learner', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_agents_modules_import_each_other_without_a_circle() -> None:
    graph = {m: {i for i in imps if i.startswith("agents.") and i != m} for m, imps in _modules("agents").items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(path + [node, nxt]))
            if nxt in graph and state.get(nxt) is None:
                visit(nxt, path + [node])
        state[node] = 2

    for module in sorted(graph):
        if state.get(module) is None:
            visit(module, [])


def test_no_docstring_or_doc_cites_a_design_file_outside_the_repository() -> None:
    offenders = []
    for path in [*REPO.rglob("*.py"), *REPO.rglob("*.md")]:
        if {".venv", ".venv-vllm", "runs", ".cache", "fixtures", "node_modules"} & set(path.parts) \
                or path.name == "test_layering.py":
            continue
        text = path.read_text(encoding="utf-8")
        if "DESIGN.md" in text:
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, f"cite docs/design.md instead: {offenders}"
