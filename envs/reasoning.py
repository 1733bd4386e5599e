"""Reasoning tasks from ``reasoning-gym``'s procedural generators, with their offline verifiers.

``freshper/ReasoningGym-v0`` turns any generator into a task: ``task=<generator name>`` picks it
and every other unknown keyword is the generator's own configuration, e.g.
``gym.make("freshper/ReasoningGym-v0", task="chain_sum", min_terms=2, max_terms=3)``. No data is
downloaded: problems are generated on the fly from ``(dataset_seed, index)``.

- ``reset(seed=s)`` draws the problem index from ``s`` (deterministic); ``options={"index": i}``
  picks problem ``i``. ``size`` is the number of distinct problems indices are drawn from.
- The reply holds the answer between ``<answer>`` and ``</answer>`` (the last complete pair,
  :func:`envs.base.extract_tag`); a reply without one, or with an empty one, is invalid.
- The reward is the generator's own score of the answer, in [0, 1] (``dataset.score_answer``;
  some generators give partial credit); ``success`` is a score of 1.
- ``max_attempts=k`` makes it multi-turn: a wrong answer with attempts left gets the feedback
  that it is not correct and reward 0, and the episode goes on; the episode ends at a correct
  answer (reward 1) or with the last attempt (reward its score). ``max_turns`` (default
  ``max_attempts + 1``: one spare turn, so an invalid reply is explained and can be repaired)
  bounds all replies, invalid ones included.

Scoring safety: some generators turn the answer into a value with sympy's ``parse_expr`` or
Python's ``eval``. Answers are data, never code: every score runs inside
:func:`envs.answer_guard.guarded`, which lets only arithmetic expressions over numbers, symbols
and math functions be compiled, so an answer that would reach Python (attributes, subscripts,
builtins, imports) is refused and scores 0 with ``info["score_error"]`` saying so. An expression
can still be costly (``9**9**9`` never finishes, ``[0]*10**10`` exhausts memory): answers made
only of digits, whitespace and ``+ - * / ( ) . , =`` without a power operator are scored in the
process (bounded work); any other answer is scored in a separate worker process with a time
limit (``score_timeout``) and, on Linux, a memory limit (``score_memory_mb``); at the limit its
whole process group is killed. The worker's replies travel on a pipe of their own, not its
stdout, and a reply that cannot be read scores 0: ``env.step`` never raises for an answer. A
score that times out or fails counts 0 and ``info["score_error"]`` says why.
``scoring="worker"`` scores every answer in the worker, plain ones too: a served task
(``python -m envs.serve``) does, so the server's own process computes nothing an answer
controls. ``scoring="inline"`` scores every answer in the process, still guarded, without the
time and memory limits (trusted replies only); a client of a served task cannot ask for it (nor
set the worker's limits): only the server's own ``--kw`` can.

Requires the optional extra ``.[reasoning]`` (``pip install -e '.[reasoning]'``); without it the
tasks are still listed by ``python -m envs list`` and building one says what to install.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import math
import os
import re
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from envs.answer_guard import UnsafeAnswer, guarded
from envs.base import COMMON_CLIENT_KWARGS, ClientKwarg, MultiTurnEnv, free_answer

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install -e '.[reasoning]' (or pip install reasoning-gym)"
#: Answers with only these characters and no power operator are scored in the process.
_PLAIN_ANSWER = re.compile(r"^[0-9\s+\-*/().,=]*$")
_INT = re.compile(r"^-?\d+$")
_DECIMAL = re.compile(r"^-?\d+\.\d+$")
_FRACTION = re.compile(r"^-?\d+/\d+$")
_WORD_STRIP = ".,;:!?()[]{}\"'"
#: Seconds the scoring worker may take to start (it imports reasoning-gym, a few seconds).
START_TIMEOUT = 120.0

#: Presets registered as their own ids (``envs/_builtin.py``): small numbers and short answers,
#: so the embedded ~1M-parameter model has something to learn.
PRESETS: dict[str, dict[str, Any]] = {
    "arithmetic": {"task": "basic_arithmetic", "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                   "operators": ["+", "-", "*"], "allow_parentheses": False, "allow_negation": False},
    "countdown": {"task": "countdown", "min_numbers": 3, "max_numbers": 3, "min_value": 1, "max_value": 9,
                  "min_target": 10, "max_target": 30, "operators": ["+", "-", "*"], "max_attempts": 3},
}


def _require() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError(f"reasoning tasks need the reasoning-gym package, which is not installed: {INSTALL_HINT}") \
            from exc
    return reasoning_gym


def generator_names() -> list[str]:
    """Every generator reasoning-gym offers (imports it)."""
    return sorted(_require().factory.DATASETS)


def _config_key(config: Mapping[str, Any]) -> str:
    return json.dumps(dict(config), sort_keys=True, default=repr)


@lru_cache(maxsize=64)
def _dataset(task: str, config_json: str, size: int, seed: int) -> Any:
    """The generator's dataset object (cached: building one per env would repeat its set-up)."""
    rg = _require()
    if task not in rg.factory.DATASETS:
        close = difflib.get_close_matches(task, list(rg.factory.DATASETS), n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"reasoning-gym has no generator {task!r}.{hint} envs.reasoning.generator_names() "
                         "lists them all")
    config = json.loads(config_json)
    _, config_cls = rg.factory.DATASETS[task]
    fields = set(getattr(config_cls, "__dataclass_fields__", {})) - {"seed", "size"}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(f"{task!r} has no setting(s) {unknown}; its settings are {sorted(fields)}")
    try:
        return rg.create_dataset(task, size=size, seed=seed, **config)
    except (AssertionError, TypeError, ValueError) as exc:
        raise ValueError(f"invalid settings for reasoning-gym generator {task!r} {config}: "
                         f"{exc or type(exc).__name__}") from None


def _score(dataset: Any, answer: str, entry: dict[str, Any]) -> tuple[float, str | None]:
    """The generator's score of ``answer``, clipped to [0, 1], and an error or None.

    The generator scores inside :func:`envs.answer_guard.guarded`: an answer its scorer would run
    as code (``parse_expr``, ``eval``) is refused and scores 0 whatever the scorer returned.
    """
    try:
        with guarded() as verdict:
            value = float(dataset.score_answer(answer, entry))
    except MemoryError:
        return 0.0, "scoring ran out of memory"
    except Exception as exc:  # the generator's scorer failed on this answer
        if isinstance(exc, UnsafeAnswer) or verdict.refused:
            return 0.0, f"answer refused: it would run as code ({verdict.refused or exc})"[:300]
        return 0.0, f"scoring failed: {type(exc).__name__}: {exc}"[:300]
    if verdict.refused:
        return 0.0, f"answer refused: it would run as code ({verdict.refused})"[:300]
    return (min(max(value, 0.0), 1.0) if math.isfinite(value) else 0.0), None


# -- the scoring worker ------------------------------------------------------------------------
#: Longest reply line read from the worker; a longer one is unreadable (the answer scores 0).
MAX_REPLY_BYTES = 65_536
#: The worker's reply pipe (set in the worker process).
_REPLY_FD: int | None = None


def _worker_loop(memory_mb: int, reply_fd: int) -> None:  # pragma: no cover (runs in the worker process)
    """Answer JSON-line score requests on stdin until it closes (``python -c`` entry point).

    Requests: ``{"id", "task", "config", "size", "seed", "index", "answer"}``; replies ``{"id",
    "score", "error"}`` go to ``reply_fd``, a pipe of their own: file descriptor 1 points at
    stderr, so nothing printed while scoring can pass for a reply.
    """
    global _REPLY_FD
    _REPLY_FD = reply_fd
    os.set_inheritable(reply_fd, False)
    out = os.fdopen(reply_fd, "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        import resource

        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        resource.setrlimit(resource.RLIMIT_NPROC, (0, hard))  # no child processes (root is exempt)
    except (ImportError, ValueError, OSError):
        pass
    try:
        _require()
        import sympy.parsing.sympy_parser  # noqa: F401  (imported before any answer is seen)
    except ImportError as exc:
        out.write(json.dumps({"ready": False, "error": str(exc)}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        request_id = None
        try:
            req = json.loads(line)
            request_id = req["id"]
            dataset = _dataset(req["task"], req["config"], req["size"], req["seed"])
            score, error = _score(dataset, req["answer"], dataset[req["index"]])
            reply = {"score": score, "error": error}
        except MemoryError:
            reply = {"score": 0.0, "error": "scoring ran out of memory"}
        except Exception as exc:  # a malformed request, or the generator failed outside its scorer
            reply = {"score": 0.0, "error": f"scoring failed: {type(exc).__name__}: {exc}"[:300]}
        out.write(json.dumps({"id": request_id, **reply}) + "\n")
        out.flush()


class _ScoringWorker:
    """One worker process per parent process, shared by every env; restarted after a timeout.

    A plain ``python -c`` subprocess in a session (process group) of its own, reading requests
    on stdin and writing replies to a private pipe: no fork of a process that may hold threads,
    no re-import of the parent's main module (a spawned multiprocessing child would import
    ``train.py`` and torch with it), and no reader thread. At a time limit the whole process
    group is killed; a reply that is not the answer to the request just sent (unreadable,
    oversized, another id) scores 0 and the worker is replaced.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._reply_fd: int | None = None
        self._buffer = b""
        self._count = 0

    def _start(self, memory_mb: int) -> str | None:
        """Start the worker and wait until it has imported reasoning-gym; an error or None."""
        root = str(Path(__file__).resolve().parents[1])  # where the envs package lives
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
        read_fd, write_fd = os.pipe()
        code = self._code(memory_mb, write_fd)
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                          stdout=subprocess.DEVNULL, env=env, pass_fds=(write_fd,),
                                          start_new_session=True)
        except OSError as exc:
            os.close(read_fd)
            return f"the scoring worker could not start: {exc}"
        finally:
            os.close(write_fd)
        self._reply_fd, self._buffer = read_fd, b""
        first = self._read_line(START_TIMEOUT)
        if first is None:
            self.stop()
            return f"the scoring worker did not start within {START_TIMEOUT:g} s"
        message = _json_object(first) or {"ready": False, "error": "it exited"}
        if not message.get("ready"):
            self.stop()
            return f"the scoring worker could not start: {message.get('error')}"
        return None

    def _code(self, memory_mb: int, reply_fd: int) -> str:
        """The worker's ``python -c`` program."""
        return f"import envs.reasoning as r; r._worker_loop({int(memory_mb)}, {int(reply_fd)})"

    def _read_line(self, timeout: float) -> bytes | None:
        """The next reply line within ``timeout`` seconds; b"" at end of stream, None at the limit."""
        deadline = time.monotonic() + timeout
        assert self._reply_fd is not None
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_REPLY_BYTES:
                return b"{}"  # oversized: unreadable
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._reply_fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._reply_fd, 65_536)
            if not chunk:
                return b""
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def stop(self) -> None:
        if self._proc is not None:
            # The worker, its process group, and any descendant that left the group (setsid).
            for pid in _descendants(self._proc.pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                self._proc.kill()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.warning("the reasoning scoring worker (pid %d) did not exit after SIGKILL", self._proc.pid)
            if self._proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self._proc.stdin.close()
        if self._reply_fd is not None:
            os.close(self._reply_fd)
        self._proc, self._reply_fd, self._buffer = None, None, b""

    def score(self, request: dict[str, Any], timeout: float, memory_mb: int) -> tuple[float, str | None]:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self.stop()
                error = self._start(memory_mb)
                if error:
                    return 0.0, error
            self._count += 1
            request_id = f"{os.getpid()}-{self._count}-{secrets.token_hex(8)}"
            try:
                assert self._proc is not None and self._proc.stdin is not None
                self._proc.stdin.write((json.dumps({"id": request_id, **request}) + "\n").encode("utf-8"))
                self._proc.stdin.flush()
            except OSError as exc:
                self.stop()
                return 0.0, f"the scoring worker died ({type(exc).__name__})"
            line = self._read_line(timeout)
            if line is None:
                self.stop()  # still computing: kill it; the next answer starts a fresh one
                return 0.0, f"scoring timed out after {timeout:g} s"
            if not line:
                self.stop()
                return 0.0, "the scoring worker died while scoring (out of memory?)"
            reply = _json_object(line)
            try:
                if reply is None or reply.get("id") != request_id:
                    raise ValueError("not the reply to this request")
                score, error = float(reply["score"]), reply["error"]
                if not (0.0 <= score <= 1.0) or not (error is None or isinstance(error, str)):
                    raise ValueError("a score outside [0, 1]")
            except (KeyError, TypeError, ValueError) as exc:
                self.stop()
                return 0.0, f"the scoring worker's reply was unreadable ({exc})"
            return score, error


def _descendants(root: int) -> list[int]:
    """Every live process below ``root`` (Linux's /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def _json_object(line: bytes) -> dict[str, Any] | None:
    """``line`` as a JSON object, or None when it is not one."""
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


#: Scoring workers per process at most (``FRESHPER_SCORING_WORKERS``): answers are scored
#: in parallel up to this many, so a few answers that run to the time limit do not hold up
#: the others. Workers start when first needed and stay for the next answers.
SCORING_WORKERS = max(1, int(os.environ.get("FRESHPER_SCORING_WORKERS", "4") or 4))


class _ScoringPool:
    """Up to ``size`` :class:`_ScoringWorker` processes; an answer takes an idle one, starts
    another while fewer than ``size`` exist, else waits for one at most its time limit."""

    def __init__(self, size: int = SCORING_WORKERS, worker: type = _ScoringWorker) -> None:
        self.size = int(size)
        self._worker = worker
        self._idle: list[_ScoringWorker] = []
        self._count = 0
        self._cond = threading.Condition()

    def score(self, request: dict[str, Any], timeout: float, memory_mb: int) -> tuple[float, str | None]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._idle and self._count >= self.size:
                left = deadline - time.monotonic()
                if left <= 0:
                    return 0.0, f"every scoring worker ({self.size}) stayed busy for {timeout:g} s"
                self._cond.wait(left)
            if self._idle:
                worker = self._idle.pop()
            else:
                worker = self._worker()
                self._count += 1
        try:
            return worker.score(request, timeout, memory_mb)
        finally:
            with self._cond:
                self._idle.append(worker)
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for worker in idle:
            worker.stop()


_WORKER = _ScoringPool()


# -- the task ----------------------------------------------------------------------------------
class ReasoningGymEnv(MultiTurnEnv):
    """One reasoning-gym generator as a task (see the module docstring for the rules).

    Args:
        task: the generator's name (``basic_arithmetic``, ``chain_sum``, ``countdown``,
            ``gsm_symbolic``, ``leg_counting``, ...; :func:`generator_names` lists them).
        max_attempts: answers allowed per problem (1: single-turn).
        size: number of distinct problems (indices ``0 .. size-1``).
        dataset_seed: the generator's seed; with ``size`` it fixes the set of problems.
        max_turns: bound on replies, invalid ones included (default ``max_attempts + 1``).
        max_answer_chars: longer answers are invalid replies.
        scoring: ``"safe"`` (plain arithmetic inline, any other answer in the worker),
            ``"worker"`` (every answer in the worker: what a served task does) or ``"inline"``.
        score_timeout: seconds the worker may take to score one answer.
        score_memory_mb: address-space limit of the worker (Linux).
        **generator_config: the generator's own settings (its config dataclass's fields).
    """

    modality: ClassVar[str] = "text"
    #: A served reasoning task's clients may choose the attempts, the problems and the answer
    #: length; the generator's settings and the scoring are the server's.
    client_kwargs: ClassVar = {**COMMON_CLIENT_KWARGS, "max_turns": ClientKwarg(int, 1, 20),
                               "max_attempts": ClientKwarg(int, 1, 10), "size": ClientKwarg(int, 1, 1_000_000),
                               "dataset_seed": ClientKwarg(int, 0, 2**31 - 1),
                               "max_answer_chars": ClientKwarg(int, 1, 2_000)}
    #: Where and how answers are scored is the server's decision alone.
    server_kwargs: ClassVar = frozenset({"scoring", "score_timeout", "score_memory_mb"})
    #: A served task scores every answer in the worker (``python -m envs.serve`` applies these
    #: before its own ``--kw``): the server's process computes nothing an answer controls.
    served_kwargs: ClassVar = {"scoring": "worker"}

    def __init__(
        self,
        task: str,
        *,
        max_attempts: int = 1,
        size: int = 100_000,
        dataset_seed: int = 0,
        max_turns: int | None = None,
        max_answer_chars: int = 2_000,
        scoring: str = "safe",
        score_timeout: float = 10.0,
        score_memory_mb: int = 4_096,
        format_penalty: float = -0.1,
        render_mode: str | None = None,
        feedback: bool = True,
        **generator_config: Any,
    ) -> None:
        if "seed" in generator_config:
            raise ValueError("pass dataset_seed= for the generator's seed; reset(seed=...) picks the problem")
        if not isinstance(task, str) or not task:
            raise ValueError(f"task must name a reasoning-gym generator, got {task!r}")
        if int(max_attempts) < 1 or int(size) < 1 or int(max_answer_chars) < 1:
            raise ValueError("max_attempts, size and max_answer_chars must be >= 1")
        if scoring not in ("safe", "worker", "inline"):
            raise ValueError(f"scoring must be 'safe', 'worker' or 'inline', got {scoring!r}")
        if not (score_timeout > 0 and math.isfinite(score_timeout)) or int(score_memory_mb) < 64:
            raise ValueError("score_timeout must be a positive number of seconds and score_memory_mb >= 64")
        self.max_attempts = int(max_attempts)
        super().__init__(max_turns=self.max_attempts + 1 if max_turns is None else max_turns,
                         format_penalty=format_penalty, render_mode=render_mode, feedback=feedback)
        self.task = task
        self.size, self.dataset_seed = int(size), int(dataset_seed)
        self.generator_config = dict(generator_config)
        self._config_json = _config_key(self.generator_config)
        self.dataset = _dataset(task, self._config_json, self.size, self.dataset_seed)
        self.max_answer_chars = int(max_answer_chars)
        self.scoring, self.score_timeout, self.score_memory_mb = scoring, float(score_timeout), int(score_memory_mb)
        self.index = 0
        self.entry: dict[str, Any] = self.dataset[0]
        self._clear_episode()
        self._build_spaces()

    def _clear_episode(self) -> None:
        self.attempts = 0
        self.score = 0.0
        self.score_error = ""
        self.history: list[tuple[str, float]] = []

    # -- MultiTurnEnv hooks --------------------------------------------------------------------
    def _reset_task(self, options: dict[str, Any] | None) -> None:
        index = (options or {}).get("index")
        if index is None:
            index = int(self.np_random.integers(self.size))
        self.index = int(index) % self.size
        self.entry = self.dataset[self.index]
        self._clear_episode()

    def instructions(self) -> str:
        tries = f" You have {self.max_attempts} attempts." if self.max_attempts > 1 else ""
        return ("Solve the problem. You may reason first; then write only the final answer between "
                f"<answer> and </answer>.{tries}")

    def state_text(self) -> str:
        text = f"Problem: {self.entry['question'].strip()}"
        if self.max_attempts > 1:
            text += f"\nAttempts left: {self.max_attempts - self.attempts}."
        return text

    def parse_action(self, reply: str) -> tuple[Any, str | None]:
        return free_answer(reply, self.max_answer_chars)

    def apply_action(self, answer: str) -> tuple[float, str, bool, bool]:
        self.attempts += 1
        score, error = self._score_answer(answer)
        self.score, self.score_error = score, error or ""
        self.history.append((answer, score))
        correct = score >= 1.0
        shown = answer if len(answer) <= 60 else answer[:60] + "..."
        if correct:
            return 1.0, f"Your answer {shown!r} is correct.", True, True
        if self.attempts < self.max_attempts:
            left = self.max_attempts - self.attempts
            return 0.0, (f"Your answer {shown!r} is not correct; try again ({left} attempt"
                         f"{'s' if left > 1 else ''} left)."), False, False
        return score, f"Your answer {shown!r} is not correct.", True, False

    def _score_answer(self, answer: str) -> tuple[float, str | None]:
        if self.scoring == "inline" or (self.scoring == "safe" and _PLAIN_ANSWER.match(answer) and "**" not in answer):
            score, error = _score(self.dataset, answer, self.entry)
            if error:
                logger.debug("reasoning-gym %s: answer %r scored 0: %s", self.task, answer[:80], error)
            return score, error
        request = {"task": self.task, "config": self._config_json, "size": self.size, "seed": self.dataset_seed,
                   "index": self.index, "answer": answer}
        score, error = _WORKER.score(request, self.score_timeout, self.score_memory_mb)
        if error:  # an answer the guard refuses is the policy's, not a fault: info["score_error"] says it
            log = logger.debug if error.startswith("answer refused") else logger.warning
            log("reasoning-gym %s: answer %r scored 0: %s", self.task, answer[:80], error)
        return score, error

    # -- the rest of the task contract --------------------------------------------------------
    def sample_reply(self, rng: np.random.Generator) -> str:
        """A random well-formed answer of the gold answer's kind, never derived from its value:
        for Countdown-style tasks (the problem lists its numbers) a random expression over those
        numbers; for an integer, decimal or fraction answer a random one with as many digits;
        for any other answer as many consecutive words of the problem as the answer has."""
        gold = str(self.entry.get("answer", "")).strip()
        numbers = (self.entry.get("metadata") or {}).get("numbers")
        if isinstance(numbers, list) and numbers and all(isinstance(n, int) for n in numbers):
            return f"<answer>{self._random_expression(rng, numbers)}</answer>"
        sign = "-" if "-" in self.entry["question"] and rng.random() < 0.5 else ""
        if _INT.match(gold):
            return f"<answer>{sign}{_random_digits(rng, len(gold.lstrip('-')))}</answer>"
        if _DECIMAL.match(gold):
            whole, frac = gold.lstrip("-").split(".")
            return f"<answer>{sign}{_random_digits(rng, len(whole))}.{_random_digits(rng, len(frac), lead=False)}</answer>"
        if _FRACTION.match(gold):
            num, den = gold.lstrip("-").split("/")
            return f"<answer>{sign}{_random_digits(rng, len(num))}/{max(1, int(_random_digits(rng, len(den))))}</answer>"
        words = [w.strip(_WORD_STRIP) for w in self.entry["question"].split()]
        words = [w for w in words if w] or ["answer"]
        k = max(1, min(len(gold.split()), len(words)))
        start = int(rng.integers(len(words) - k + 1))
        return f"<answer>{' '.join(words[start:start + k])}</answer>"

    def _random_expression(self, rng: np.random.Generator, numbers: list[int]) -> str:
        ops = [o for o in getattr(self.dataset.config, "operators", ("+", "-", "*", "/")) if o in "+-*/"] or ["+"]
        order = [numbers[i] for i in rng.permutation(len(numbers))]
        parts = [str(order[0])]
        for n in order[1:]:
            parts.append(ops[int(rng.integers(len(ops)))])
            parts.append(str(n))
        return " ".join(parts)

    def outcome_text(self, terminated: bool, success: bool) -> str:
        """``correct`` or ``not correct``: what an answer leads to (the dynamics target)."""
        return "correct" if success else "not correct"

    def task_info(self) -> dict[str, Any]:
        return {"task": self.task, "index": self.index, "attempts": self.attempts, "score": self.score,
                "score_error": self.score_error, "gold_answer": str(self.entry.get("answer", ""))}

    def render_text(self) -> str:
        lines = [self.state_text()]
        lines += [f"answer: {a} -> score {s:.2f}" for a, s in self.history]
        if self.history and (self.history[-1][1] >= 1.0 or self.attempts >= self.max_attempts):
            lines.append(f"gold: {self.entry.get('answer', '')}")  # once the answers are over
        return "\n".join(lines)


def _random_digits(rng: np.random.Generator, n: int, lead: bool = True) -> str:
    """A random string of ``n`` >= 1 digits (no leading zero when ``lead`` and n > 1)."""
    n = max(1, n)
    digits = [str(int(d)) for d in rng.integers(0, 10, n)]
    if lead and n > 1 and digits[0] == "0":
        digits[0] = str(int(rng.integers(1, 10)))
    return "".join(digits)


def preset(name: str) -> dict[str, Any]:
    """The keyword arguments of a registered preset (a copy)."""
    return json.loads(json.dumps(PRESETS[name]))
