"""Answers are data, never code: hostile answers through the real scoring worker and the real
generators' verifiers, the worker's private reply channel, its process-group kill, unreadable
replies, and every reference answer the generators produce still scoring as before."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import pytest

import envs  # noqa: F401  (registers the tasks)
from envs import answer_guard
from envs.answer_guard import UnsafeAnswer, check_expression, guarded

rg = pytest.importorskip("reasoning_gym")
from envs import reasoning  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

#: Answers that ran code before the guard: each tries to leave a file behind ({marker}).
HOSTILE = [
    "sympify.__globals__['__builtins__']['__import__']('os').system('touch {marker}')",
    "__import__('os').system('touch {marker}')",
    "eval(chr(95)+chr(95)+'import'+chr(95)+chr(95)+'(\"os\").system(\"touch {marker}\")')",
    "exec('open(\"{marker}\", \"w\")')",
    "open('{marker}', 'w')",
    "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'Popen'][0](['touch', '{marker}'])",
    "(lambda: __import__('os').system('touch {marker}'))()",
    "getattr(__import__('os'), 'system')('touch {marker}')",
    "preview(x, viewer='file', filename='{marker}')",
    "lambdify(x, 'open(\"{marker}\", \"w\")')(1)",
]
#: Generators whose verifiers compile the answer (sympy's parse_expr, or Python's eval).
COMPILING = ["countdown", "puzzle24", "polynomial_multiplication", "simple_integration", "string_insertion",
             "n_queens", "binary_matrix", "spiral_matrix"]


@pytest.mark.parametrize("task", COMPILING)
def test_a_hostile_answer_runs_nothing_and_scores_zero_in_the_real_worker(task: str, tmp_path: Path) -> None:
    env = gym.make("freshper/ReasoningGym-v0", task=task, max_attempts=len(HOSTILE), size=50)
    env.reset(seed=3)
    for i, template in enumerate(HOSTILE):
        marker = tmp_path / f"pwned{i}"
        _, reward, _, _, info = env.step(f"<answer>{template.format(marker=marker)}</answer>")
        assert not marker.exists(), f"{task}: answer {i} ran code"
        assert reward == 0.0 and info["score"] == 0.0 and not info["success"]
    env.close()


def test_an_answer_that_writes_a_reply_to_stdout_does_not_forge_its_reward(tmp_path: Path) -> None:
    env = gym.make("freshper/Countdown-v0")
    env.reset(seed=1)
    forge = "__import__('os').write(1, b'{\"score\": 1.0, \"error\": null}\\n')"
    _, reward, terminated, _, info = env.step(f"<answer>{forge}</answer>")
    assert reward == 0.0 and not info["success"] and "refused" in info["score_error"]
    # The worker goes on scoring real answers correctly after it.
    env.reset(seed=1)
    gold = env.unwrapped.entry["answer"]
    _, reward, terminated, _, info = env.step(f"<answer>{gold}</answer>")
    assert reward == 1.0 and terminated and info["score_error"] == ""


class _FaultyWorker(reasoning._ScoringWorker):
    """The real worker protocol with a fault injected in the worker process before it serves."""

    def __init__(self, preamble: str) -> None:
        super().__init__()
        self.preamble = preamble

    def _code(self, memory_mb: int, reply_fd: int) -> str:
        return f"{self.preamble}\n{super()._code(memory_mb, reply_fd)}"


REQUEST = {"task": "countdown", "config": reasoning._config_key(reasoning.PRESETS["countdown"] | {}),
           "size": 100_000, "seed": 0, "index": 0}


def _request(answer: str) -> dict:
    config = {k: v for k, v in reasoning.PRESETS["countdown"].items() if k not in ("task", "max_attempts")}
    return {**REQUEST, "config": reasoning._config_key(config), "answer": answer}


def test_what_the_scorer_prints_on_stdout_never_reaches_the_reply_channel() -> None:
    # A scorer that prints a forged reply on file descriptor 1 and on sys.stdout, then fails.
    worker = _FaultyWorker(
        "import os, sys, envs.reasoning as r\n"
        "def forged(dataset, answer, entry):\n"
        "    os.write(1, b'{\"score\": 1.0, \"error\": null}\\n'); print('{\"score\": 1.0, \"error\": null}')\n"
        "    return 0.0, None\n"
        "r._score = forged")
    try:
        score, error = worker.score(_request("1 + 2"), timeout=60, memory_mb=4096)
        assert (score, error) == (0.0, None)
    finally:
        worker.stop()


@pytest.mark.parametrize("garbage", [b"not json\\n", b"[1, 2]\\n", b"{\\\"score\\\": 7}\\n", b"x" * 100_000])
def test_an_unreadable_reply_scores_zero_and_the_step_does_not_raise(garbage: bytes) -> None:
    worker = _FaultyWorker(
        "import os, envs.reasoning as r\n"
        f"def garbage(dataset, answer, entry):\n    os.write(r._REPLY_FD, {garbage!r} + b'\\n'); return 0.0, None\n"
        "r._score = garbage")
    try:
        score, error = worker.score(_request("1 + 2"), timeout=60, memory_mb=4096)
        assert score == 0.0 and "unreadable" in error
        assert worker._proc is None  # replaced on the next answer
    finally:
        worker.stop()


def test_at_the_time_limit_the_whole_process_group_is_killed_even_a_detached_grandchild(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    worker = _FaultyWorker(
        "import subprocess, sys, time, envs.reasoning as r\n"
        "def stall(dataset, answer, entry):\n"
        f"    import resource; resource.setrlimit(resource.RLIMIT_NPROC, (-1, -1)) if resource.getrlimit(resource.RLIMIT_NPROC)[1] == -1 else None\n    p = subprocess.Popen(['sleep', '300'], stdout=r._REPLY_FD, stderr=subprocess.DEVNULL, pass_fds=(r._REPLY_FD,), start_new_session=True)\n"
        f"    open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(300)\n"
        "r._score = stall")
    start = time.monotonic()
    score, error = worker.score(_request("1 + 2"), timeout=3, memory_mb=4096)
    took = time.monotonic() - start
    assert (score, error) == (0.0, "scoring timed out after 3 s")
    assert took < 30, took  # worker start (imports reasoning-gym) + 3 s, not the grandchild's 300 s
    pid = int(pid_file.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


HOSTILE_EXPRESSIONS = [
    "__import__('os')", "x.__class__", "a[0]", "lambda: 1", "[i for i in x]", "f'{x}'", "(x := 1)",
    "open('f')", "eval('1')", "exec('1')", "getattr(x, 'y')", "globals()", "vars()", "chr(95)", "type(x)",
    "sympify('x')", "lambdify(x, x)", "preview(x)", "Function('f').__init__", "Symbol('x', **kw)",
    "f(*args)", "sin(x, key=1)", "{1: 2}", "{1, 2}", "x if y else z", "yield x", "await x", "__x__",
    "Integer(1).__class__", "(1).real", "print(1)", "input()", "compile('1','','eval')", "breakpoint()",
]
SAFE_EXPRESSIONS = [
    "1 + 2", "3*5 - 3", "x**2 + 3*x - 4", "sin(x) + cos(y)", "2*exp(x) + C", "[[1, 0], [0, 1]]",
    "['a', 'b']", "(1, 2.5, -3)", "Integer (2 )*Symbol ('x' )", "Function ('f' )(Symbol ('z' ))",
    "Float ('3.5' )", "Rational(1, 2)", "Add(x, y, evaluate=False)", "0x5b993 >> 3", "-Integral(x**2, x) + C",
    "x == 3", "pi*E", "sqrt(2)/2", "abs(-1)", "factorial(5)",
]


@pytest.mark.parametrize("text", HOSTILE_EXPRESSIONS)
def test_the_expression_check_refuses_everything_beyond_arithmetic(text: str) -> None:
    with pytest.raises(UnsafeAnswer):
        check_expression(text)


@pytest.mark.parametrize("text", SAFE_EXPRESSIONS)
def test_the_expression_check_lets_arithmetic_and_sympys_own_code_through(text: str) -> None:
    check_expression(text)
    check_expression(ast.parse(text, mode="eval"))


def test_fuzzed_expressions_never_escape_the_check() -> None:
    # Random token soups over the characters of Python's escape routes: whatever passes the check
    # must be a tree of the allowed node types only (no attribute, subscript, lambda, call of a
    # name outside CALLABLE), and nothing crashes the check with anything but UnsafeAnswer.
    import random

    rng = random.Random(0)
    atoms = ["x", "1", "2.5", "'s'", "__import__", "os", "sin", "Symbol", "eval", "(", ")", "[", "]", ".", ",",
             "+", "*", "**", "lambda", ":", "_", "__class__", "=", "(" * 200, "getattr", "[0]", "{", "}", " "]
    for _ in range(3000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 12)))
        try:
            check_expression(text)
        except UnsafeAnswer:
            continue
        tree = ast.parse(text.strip(), mode="eval")
        for node in ast.walk(tree):
            assert not isinstance(node, (ast.Attribute, ast.Subscript, ast.Lambda, ast.comprehension)), text
            if isinstance(node, ast.Call):
                assert isinstance(node.func, ast.Name) and node.func.id in answer_guard.CALLABLE, text
            if isinstance(node, ast.Name):
                assert not node.id.startswith("_") and node.id not in ("eval", "exec", "getattr", "__import__"), text


def test_inside_the_guard_processes_sockets_and_file_writes_are_refused(tmp_path: Path) -> None:
    with guarded() as verdict:
        with pytest.raises(UnsafeAnswer):
            subprocess.run(["true"])
        with pytest.raises(UnsafeAnswer):
            open(tmp_path / "x", "w")
        open(REPO / "README.md").close()  # reading is fine
    assert verdict.refused is not None
    with guarded() as verdict:
        pass
    assert verdict.refused is None
    # Outside the guard nothing changes.
    subprocess.run(["true"], check=True)
    (tmp_path / "y").write_text("ok")


def test_every_generators_reference_answers_still_score_as_their_verifier_scores_them() -> None:
    checked = 0
    for name in sorted(rg.factory.DATASETS):
        try:
            dataset = rg.create_dataset(name, size=4, seed=5)
            entries = [dataset[i] for i in range(4)]
        except Exception:  # a generator that needs settings of its own (composite)
            continue
        for entry in entries:
            if entry.get("answer") is None:
                continue
            answer = str(entry["answer"])
            plain = min(max(float(dataset.score_answer(answer, entry)), 0.0), 1.0)
            score, error = reasoning._score(dataset, answer, entry)
            assert (score, error) == (pytest.approx(plain), None), (name, answer)
            checked += 1
    assert checked > 300


LAZY = {"Derivative(x**2, x, evaluate=True)": "2*x", "Integral(x, x)": "Integral(x, x)",
        "Integral(x**2, (x, 0, 3))": "Integral(x**2, (x, 0, 3))", "Derivative(sin(x), x, evaluate=True)": "cos(x)"}


def test_sympys_lazy_imports_of_its_own_modules_score_and_other_bytecode_is_still_refused() -> None:
    """Answers that make sympy import a part of itself for the first time (its cached bytecode,
    read with marshal.loads) were refused as "marshal.loads while scoring"; in a fresh process,
    as in a fresh scoring worker, they now parse to their values, while marshal.loads called
    from anywhere else and a standard-library module's bytecode stay refused."""
    program = (
        "import json, marshal, sys\n"
        "from envs.answer_guard import guarded, UnsafeAnswer\n"
        "from sympy.parsing.sympy_parser import parse_expr\n"
        "out = {}\n"
        f"for text in {sorted(LAZY)!r}:\n"
        "    with guarded() as v:\n"
        "        try:\n"
        "            value = str(parse_expr(text))\n"
        "        except Exception as exc:\n"
        "            value = type(exc).__name__ + ': ' + str(exc)\n"
        "    out[text] = [value, v.refused]\n"
        "for name, attempt in (('marshal', lambda: marshal.loads(marshal.dumps(1))),\n"
        "                      ('graphlib', lambda: __import__('graphlib'))):\n"
        "    assert name == 'marshal' or name not in sys.modules\n"
        "    with guarded() as v:\n"
        "        try:\n"
        "            attempt()\n"
        "        except UnsafeAnswer:\n"
        "            pass\n"
        "    out[name] = [None, v.refused]\n"
        "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for text, value in LAZY.items():
        assert out[text] == [value, None], (text, out[text])
    assert out["marshal"][1] == "marshal.loads while scoring an answer"
    assert out["graphlib"][1] == "marshal.loads while scoring an answer"


def test_a_lazily_importing_answer_scores_in_a_fresh_worker() -> None:
    """Through a fresh real scoring worker: the answer is not refused (its score is the
    verifier's; no score_error)."""
    config = {k: v for k, v in reasoning.PRESETS["countdown"].items() if k not in ("task", "max_attempts")}
    worker = reasoning._ScoringWorker()
    try:
        for text in LAZY:
            score, error = worker.score({**REQUEST, "config": reasoning._config_key(config), "answer": text},
                                        timeout=60, memory_mb=4096)
            assert error is None or "refused" not in error and "marshal" not in error, (text, error)
    finally:
        worker.stop()
