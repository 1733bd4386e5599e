"""Registry: id grammar, duplicates, did-you-mean, gymnasium.make, plugins, ``python -m envs list``."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

import envs
from envs import registry
from envs.__main__ import list_tasks

REPO = Path(__file__).resolve().parents[2]
PLUGIN_SRC = Path(__file__).resolve().parents[1] / "fixtures" / "freshper_demo_plugin"
BUILTIN_IDS = ["freshper/FrozenLake-v0", "freshper/FrozenLakeVision-v0", "freshper/Sokoban-v0", "freshper/SokobanVision-v0"]


@pytest.fixture
def scratch_registry():
    """Undo every registration a test makes (ours and gymnasium's)."""
    tasks, gym_ids, plugins = dict(registry._TASKS), set(gym.registry), set(registry._LOADED_PLUGINS)
    yield
    registry._TASKS.clear()
    registry._TASKS.update(tasks)
    registry._LOADED_PLUGINS.clear()
    registry._LOADED_PLUGINS.update(plugins)
    for env_id in set(gym.registry) - gym_ids:
        del gym.registry[env_id]


def _run(args: list[str], pythonpath: list[str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*(pythonpath or []), str(REPO)])
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_builtin_tasks_are_registered_with_modality() -> None:
    specs = {s.id: s for s in envs.registered_tasks()}
    for env_id in BUILTIN_IDS:
        assert env_id in specs and env_id in gym.registry
    assert specs["freshper/FrozenLakeVision-v0"].modality == "vision"
    assert specs["freshper/FrozenLake-v0"].kwargs == {"size": 4}


@pytest.mark.parametrize(
    "bad_id",
    ["FrozenLake-v0", "freshper/frozenLake-v0", "freshper/FrozenLake", "freshper/FrozenLake-vX",
     "Freshper/FrozenLake-v0", "freshper/Frozen Lake-v0", "", None],
)
def test_malformed_ids_are_rejected_with_the_grammar(bad_id, scratch_registry) -> None:
    with pytest.raises(envs.RegistrationError, match="namespace/Name-vN"):
        envs.register(bad_id, "envs.frozenlake:FrozenLakeEnv", modality="text")


def test_modality_must_be_text_or_vision(scratch_registry) -> None:
    with pytest.raises(envs.RegistrationError, match="'text' or 'vision'"):
        envs.register("testns/Thing-v0", "envs.frozenlake:FrozenLakeEnv", modality="audio")


def test_duplicate_registration_errors_unless_override(scratch_registry) -> None:
    envs.register("testns/Lake-v0", "envs.frozenlake:FrozenLakeEnv", modality="text", kwargs={"size": 3})
    with pytest.raises(envs.RegistrationError, match="already registered.*bump the version"):
        envs.register("testns/Lake-v0", "envs.frozenlake:FrozenLakeEnv", modality="text")
    envs.register("testns/Lake-v0", "envs.frozenlake:FrozenLakeEnv", modality="text", kwargs={"size": 5}, override=True)
    assert gym.make("testns/Lake-v0").unwrapped.nrow == 5


def test_unknown_id_suggests_close_ids() -> None:
    with pytest.raises(KeyError, match="Did you mean 'freshper/FrozenLake-v0'") as err:
        envs.make("freshper/FrozenLak-v0")
    assert "python -m envs list" in str(err.value) and not str(err.value).startswith('"')


def test_gymnasium_make_passes_kwargs_over_defaults() -> None:
    env = gym.make("freshper/FrozenLake-v0", size=5, is_slippery=True, max_turns=3)
    lake = env.unwrapped
    assert (lake.nrow, lake.is_slippery, lake.max_turns) == (5, True, 3)
    assert envs.make("freshper/FrozenLake-v0").unwrapped.nrow == 4


def test_unloadable_entry_point_is_listed_and_explained(scratch_registry) -> None:
    envs.register("testns/Missing-v0", "no_such_module_xyz:Env", modality="text", description="not installed")
    out = io.StringIO()
    list_tasks(out)
    assert "testns/Missing-v0" in out.getvalue() and "not installed" in out.getvalue()
    with pytest.raises(ImportError, match="no_such_module_xyz:Env.*installed"):
        envs.make("testns/Missing-v0")


def _register_dummy() -> None:
    envs.register("testns/Dummy-v0", "envs.frozenlake:FrozenLakeEnv", modality="text")


def test_plugins_load_once_and_a_broken_one_is_not_fatal(monkeypatch, scratch_registry, caplog) -> None:
    group = envs.ENTRY_POINT_GROUP
    fake = [
        importlib.metadata.EntryPoint(name="broken", value="no_such_module_xyz:register", group=group),
        importlib.metadata.EntryPoint(name="good", value=f"{__name__}:_register_dummy", group=group),
    ]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: fake if group == envs.ENTRY_POINT_GROUP else [])
    assert envs.load_plugins() == ["good"]
    assert "broken" in caplog.text
    assert envs.task_spec("testns/Dummy-v0").source == __name__.split(".")[0]
    assert envs.load_plugins() == []  # already loaded: no duplicate-registration errors


def test_cli_list_shows_every_task() -> None:
    result = _run(["-m", "envs", "list"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["id", "modality", "source"]
    assert max(map(len, lines)) <= 100  # a terminal's width: descriptions and defaults wrap under their task
    for spec in envs.registered_tasks():
        line = next(l for l in lines if l.startswith(spec.id + " "))
        assert spec.modality in line and spec.source in line
    assert "    Walk from the start to the goal" in result.stdout and "    defaults: size=4" in result.stdout
    rows = [json.loads(l) for l in _run(["-m", "envs", "list", "--json"]).stdout.splitlines()]
    assert {r["id"] for r in rows} == {s.id for s in envs.registered_tasks()}


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory) -> Path:
    """pip-install the throw-away plugin package into a temporary --target dir (venv untouched)."""
    src = tmp_path_factory.mktemp("plugin_src") / "pkg"
    shutil.copytree(PLUGIN_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path_factory.mktemp("plugin_target")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "--quiet", "--target", str(target), str(src)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if result.returncode != 0:
        pytest.fail(f"could not pip-install the test plugin: {result.stderr[-2000:]}")
    return target


def test_installed_plugin_package_registers_its_task(installed_plugin: Path) -> None:
    listing = _run(["-m", "envs", "list"], pythonpath=[str(installed_plugin)])
    assert listing.returncode == 0, listing.stderr
    line, description, defaults = listing.stdout.split("demoplugin/GuessDigit-v0", 1)[1].splitlines()[:3]
    assert "freshper-demo-plugin" in line and "Guess a hidden digit" in description and "max_turns=4" in defaults
    script = (
        "import envs, gymnasium as gym\n"
        "env = gym.make('demoplugin/GuessDigit-v0')\n"
        "obs, info = env.reset(seed=0)\n"
        "secret = env.unwrapped.secret\n"
        "print(env.step(f'<answer>{secret}</answer>')[1:3], env.unwrapped.max_turns, envs.load_plugins())\n"
    )
    played = _run(["-c", script], pythonpath=[str(installed_plugin)])
    assert played.returncode == 0, played.stderr
    assert played.stdout.strip() == "(1.0, True) 4 []"
    checked = _run(["-c", "import envs, gymnasium as gym\n"
                          "from gymnasium.utils.env_checker import check_env\n"
                          "check_env(gym.make('demoplugin/GuessDigit-v0', render_mode='ansi').unwrapped)\n"
                          "print('checked')"], pythonpath=[str(installed_plugin)])
    assert checked.returncode == 0 and checked.stdout.strip() == "checked", checked.stderr
    assert "demoplugin" not in _run(["-m", "envs", "list"]).stdout  # nothing leaked into the venv


# -- one source for the modality; render modes a task implements -------------------------------
def _plugin_class():
    sys.path.insert(0, str(PLUGIN_SRC))
    try:
        from freshper_demo_plugin import GuessDigitEnv
    finally:
        sys.path.remove(str(PLUGIN_SRC))
    return GuessDigitEnv


def test_the_readme_plugin_passes_gymnasiums_checker_through_make(scratch_registry) -> None:
    from gymnasium.utils.env_checker import check_env

    cls = _plugin_class()
    assert cls.metadata["render_modes"] == ["ansi"]  # a text task that draws nothing
    envs.register("testns/GuessDigit-v0", cls, description="the README's plugin", kwargs={"max_turns": 4})
    assert envs.task_spec("testns/GuessDigit-v0").modality == "text"  # taken from the class
    env = envs.make("testns/GuessDigit-v0", render_mode="ansi")
    check_env(env.unwrapped)  # renders every listed mode through the spec: 'ansi' only
    with pytest.warns(UserWarning, match="not in the possible render_modes"), \
            pytest.raises(ValueError, match="render_mode must be one of \\['ansi'\\]"):
        envs.make("testns/GuessDigit-v0", render_mode="rgb_array")


def test_render_modes_are_the_ones_a_class_implements() -> None:
    from envs.frozenlake import FrozenLakeEnv, FrozenLakeVisionEnv
    from envs.search import SearchQAEnv
    from envs.sokoban import SokobanEnv

    assert FrozenLakeEnv.metadata["render_modes"] == ["ansi", "rgb_array"]  # it draws its board
    assert FrozenLakeVisionEnv.metadata["render_modes"] == ["ansi", "rgb_array"]
    assert SokobanEnv.metadata["render_modes"] == ["ansi", "rgb_array"]
    assert SearchQAEnv.metadata["render_modes"] == ["ansi"]
    base = _plugin_class().__mro__[1]
    with pytest.raises(TypeError, match="lists render mode 'rgb_array' but the class does not implement render_image"):
        type("Liar", (base,), {"metadata": {"render_modes": ["ansi", "rgb_array"]}})
    with pytest.raises(TypeError, match="vision task but does not implement render_image"):
        type("Blind", (base,), {"modality": "vision"})


def test_registered_modality_must_agree_with_the_class(scratch_registry) -> None:
    cls = _plugin_class()
    with pytest.raises(envs.RegistrationError, match="declares modality='text'"):
        envs.register("testns/Wrong-v0", cls, modality="vision")
    with pytest.raises(envs.RegistrationError, match="modality of 'testns/Lazy-v0' is required"):
        envs.register("testns/Lazy-v0", "envs.frozenlake:FrozenLakeEnv")
    # A lazy entry point promising the wrong modality is caught when built, by either make.
    envs.register("testns/Lazy-v0", "envs.frozenlake:FrozenLakeEnv", modality="vision")
    for make in (envs.make, gym.make):
        with pytest.raises(envs.RegistrationError, match="registered with modality='vision' but its class "
                                                         "FrozenLakeEnv declares modality='text'"):
            make("testns/Lazy-v0")


def test_a_task_whose_package_is_missing_is_listed_with_the_install_hint(scratch_registry) -> None:
    envs.register("testns/NeedsPkg-v0", "envs.frozenlake:FrozenLakeEnv", modality="text",
                  description="needs a package", requires=("no_such_package_xyz",),
                  install_hint="pip install no-such-package")
    spec = envs.task_spec("testns/NeedsPkg-v0")
    assert not spec.available and spec.missing() == ["no_such_package_xyz"]
    out = io.StringIO()
    list_tasks(out)
    line = next(l for l in out.getvalue().splitlines() if l.startswith("testns/NeedsPkg-v0"))
    assert "not installed: pip install no-such-package" in line
    for make in (envs.make, gym.make):
        with pytest.raises(ImportError, match="needs the Python package\\(s\\) no_such_package_xyz.*pip install no-such-package"):
            make("testns/NeedsPkg-v0")


def test_the_readmes_task_table_lists_every_registered_task() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("| id | modality | what |"):readme.index("Every task is a `gymnasium.Env`")]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    for spec in envs.registered_tasks():
        if spec.source != "freshper":
            continue
        row = next((r for r in rows if f"`{spec.id}`" in r), None)
        assert row is not None, f"{spec.id} is missing from the README's task table"
        assert spec.modality in row or (spec.modality == "vision" and "image" in row)


def test_envs_new_refuses_the_projects_own_package_names_and_targets_that_are_not_folders(tmp_path, capsys) -> None:
    """Issue 54 item 10: ``envs new`` into a file or ``/dev/null`` was a traceback, and
    ``envs/Foo-v0`` wrote a plugin package named ``envs``, shadowing the project's own."""
    from envs.__main__ import main

    afile = tmp_path / "afile"
    afile.write_text("keep")
    for argv, problem in ((["new", "mypkg/Foo-v0", str(afile)], "is not a folder"),
                          (["new", "mypkg/Foo-v0", "/dev/null"], "is not a folder"),
                          (["new", "envs/Foo-v0", str(tmp_path / "a")], "this project's own package"),
                          (["new", "learner/Foo-v0", str(tmp_path / "b")], "this project's own package"),
                          (["new", "train/Foo-v0", str(tmp_path / "c")], "this project's own package"),
                          (["new", "json/Foo-v0", str(tmp_path / "d")], "a standard-library module")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert problem in err and "Traceback" not in err, (argv, err)
    assert afile.read_text() == "keep" and not any((tmp_path / n).exists() for n in "abcd")
    assert main(["new", "mypkg/Foo-v0", str(tmp_path / "ok")]) == 0 and (tmp_path / "ok" / "mypkg" / "tasks.py").is_file()
