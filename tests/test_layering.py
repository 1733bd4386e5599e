"""The layers import one way: envs < replay < agents < learner < train.py, with no circles.

``envs`` imports neither torch nor ``agents`` (``envs/capabilities.py``, what the learner checks a
task for, numpy and the standard library alone); ``replay`` imports numpy and the standard library
only; no package imports a higher layer; the modules of ``agents`` import each other without a
circle (type-checking-only imports included in the scan, so a protocol is not a loophole);
importing train.py or any module of the packages runs nothing: no thread, no read of
``/proc/stat``, no environment variable set (train.py's ``main()`` does what a run needs first);
the readers of a run folder are defined once, in ``agents/runfolder.py``, for learner and viewer.
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
            "import envs.play, envs.search, envs.capabilities; "
            "print(sorted(m for m in ('torch', 'agents', 'learner', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_optional_capabilities_module_uses_numpy_and_the_standard_library_only() -> None:
    """``envs/capabilities.py`` is what learner/ and agents/ check a task for: it imports no torch,
    nothing of agents/ or learner/, not even the rest of envs/ (a task need not import it)."""
    allowed = set(sys.stdlib_module_names) | {"numpy"}
    imports = _imports(REPO / "envs" / "capabilities.py")
    assert not sorted(i for i in imports if i.split(".")[0] not in allowed), imports


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


#: agents/ by role, lowest first: a module imports (from agents) only its own part and those before it.
AGENT_PARTS = [("agents.safeio", "agents.record", "agents.runfolder"), ("agents.policies", "agents.pretrained"), ("agents.engines",), ("agents.rollout",)]
#: The commands and the UI, above every part.
AGENT_TOP = ("agents.evaluate", "agents.play", "agents.interactive", "agents.merge_lora", "agents.view")


def _part(name: str) -> int | None:
    for level, prefixes in enumerate(AGENT_PARTS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return level
    return None


def test_agents_parts_import_only_those_below_them() -> None:
    """record < policies < engines < rollout < the commands and the viewer: a sampler never reaches
    the runner, an engine never the runner, nothing but the commands reaches the UI."""
    offenders = []
    for module, imports in _modules("agents").items():
        level = _part(module)
        if level is None:
            assert module == "agents" or module.startswith(AGENT_TOP), f"{module} belongs to no part of agents/"
            continue
        for imp in imports:
            if not imp.startswith("agents"):
                continue
            to = _part(imp)
            if imp.startswith(AGENT_TOP) or (to is not None and to > level):
                offenders.append(f"{module} imports {imp}")
    assert not offenders, offenders


#: The readers of a run folder's files (and the manifest's writer), each defined once: in
#: agents/runfolder.py, low enough for both the learner and the viewer to read with it.
RUN_FOLDER_READERS = {"list_checkpoints", "survey_checkpoints", "check_checkpoint", "verify_checkpoint",
                      "manifest_entries", "unlisted_files", "write_manifest", "model_folder_problem", "load_metrics",
                      "parse_metrics", "read_metrics", "read_metrics_lines", "segment_paths", "read_segment",
                      "read_members", "member_rows", "read_replay_log", "is_run_folder"}
#: Names a second copy of one of them would take.
RUN_FOLDER_PREFIXES = ("read_metrics", "check_metrics", "list_checkpoint", "check_checkpoint", "verify_checkpoint",
                       "read_segment", "read_replay", "read_members")
#: What reading a run file by hand looks like: the checkpoint and segment name patterns, gzip members.
RUN_FOLDER_CODE = ("iter_(", "seg-(", "decompressobj", "GzipFile")


def test_the_run_folder_readers_exist_once() -> None:
    """The learner and the viewer each re-implemented the readers of a run folder (the viewer may
    not import the learner): every reader is defined in agents/runfolder.py alone, nothing else
    in agents/ or learner/ parses a checkpoint or segment name or decompresses a log or metrics,
    and both sides import the module."""
    runfolder = REPO / "agents" / "runfolder.py"
    defined: dict[str, list[str]] = {}
    by_hand = []
    for path in [*sorted((REPO / "agents").rglob("*.py")), *sorted((REPO / "learner").rglob("*.py")), REPO / "train.py"]:
        text = path.read_text(encoding="utf-8")
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and (
                    node.name in RUN_FOLDER_READERS or node.name.startswith(RUN_FOLDER_PREFIXES)):
                defined.setdefault(node.name, []).append(rel)
        if path != runfolder:
            by_hand += [f"{rel}: {code}" for code in RUN_FOLDER_CODE if code in text]
    assert defined == {name: ["agents/runfolder.py"] for name in RUN_FOLDER_READERS}, defined
    assert not by_hand, by_hand
    users = ["agents.view.runs", "agents.view.replay", "learner.checkpoint", "learner.report", "learner.replay_log",
             "learner.tools.archive"]
    modules = _modules("agents") | _modules("learner")
    assert all("agents.runfolder" in modules[m] for m in users), {m: sorted(modules[m]) for m in users}


def test_every_agents_module_imports_from_outside_the_checkout(tmp_path: Path) -> None:
    """openai-agents (which verifiers installs) is also a top-level ``agents``: outside the checkout
    its package is found first, and ours is reached by the editable install for the names it
    lacks. A part of ours named as one of theirs (``agents.pretrained``) would be theirs: every
    module of ours must import, from another folder, as itself."""
    names = [m for m in _modules("agents") if m != "agents" and not m.endswith("__main__")]
    code = ("import importlib, sys\n"
            "bad = []\n"
            "for n in sys.argv[1:]:\n"
            "    try:\n"
            "        m = importlib.import_module(n)\n"
            f"        bad += [] if (m.__file__ or '').startswith({str(REPO)!r}) else [n + ' is ' + str(m.__file__)]\n"
            "    except ImportError as exc:\n"
            "        bad.append(n + ': ' + str(exc))\n"
            "print(bad)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code, *names], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.strip() == "[]", out.stdout[-3000:] + out.stderr[-3000:]


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


#: What importing every module checks (a JSON line): threads started, /proc/stat reads,
#: environment variables changed, and the modules an optional extra that is not installed keeps out.
_IMPORT_PROBE = r"""
import builtins, importlib, io, json, os, sys, threading
opened = []
real_open = io.open
def spy(file, *args, **kwargs):
    opened.append(str(file))
    return real_open(file, *args, **kwargs)
builtins.open = io.open = spy
env = dict(os.environ)
threads = {t.ident for t in threading.enumerate()}
skipped = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        skipped[name] = str(exc)
print(json.dumps({"stat": [f for f in opened if f.startswith("/proc/stat")],
                  "threads": [t.name for t in threading.enumerate() if t.ident not in threads],
                  "env": sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)),
                  "skipped": skipped}))
"""


#: Variables a library the packages import sets when it is imported (gymnasium's toy-text tasks).
THIRD_PARTY_ENV = {"PYGAME_HIDE_SUPPORT_PROMPT"}


def test_importing_train_or_any_package_module_runs_nothing() -> None:
    import json

    names = ["train"] + [m for package in LAYERS for m in _modules(package) if not m.endswith("__main__")]
    env = {k: v for k, v in __import__("os").environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, *names], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    changed = [k for k in found["env"] if k not in THIRD_PARTY_ENV]
    assert found["stat"] == [] and found["threads"] == [] and changed == [], found
    essential = [m for m in found["skipped"] if m == "train" or m.startswith(("learner", "replay"))]
    assert not essential, {m: found["skipped"][m] for m in essential}


def test_tests_are_mirrored_by_package() -> None:
    """A package's tests live in its folder under tests/ (a research probe's under
    tests/experiments/); only the whole-repository checks and conftest.py sit at the top."""
    top = sorted(p.name for p in (REPO / "tests").glob("*.py"))
    assert top == ["conftest.py", "test_docs_links.py", "test_layering.py"], top
    folders = {p.parent.relative_to(REPO / "tests").parts[0] for p in (REPO / "tests").rglob("test_*.py")
               if p.parent != REPO / "tests" and "fixtures" not in p.parts}
    assert folders == {*LAYERS, "experiments"}, folders
