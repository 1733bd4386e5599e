"""Answers are data: no text a policy writes is ever run as Python while a task scores it.

Task verifiers (reasoning-gym's among them) turn answers into values with sympy's ``parse_expr``
or Python's ``eval``, both of which compile the text and run it. :func:`guarded` is the context
every scorer runs in. Inside it, an audit hook (:pep:`578`) sees each piece of code before it is
compiled and lets it through only when its syntax tree is an arithmetic expression over numbers,
strings, plain names and a fixed set of math functions (:func:`check_expression`): no attribute,
subscript, lambda, comprehension or call of anything outside :data:`CALLABLE`, and no name with
underscores at its ends or naming a builtin. Whatever else would compile raises
:class:`UnsafeAnswer` before it runs, and the scorer's caller counts the answer as wrong. Inside
the context the hook also refuses processes, sockets, native libraries, writing files and
building code objects by hand (:data:`REFUSED_EVENTS`), in case anything slips past the first
check.

The hook is process-wide once installed (audit hooks cannot be removed) but does nothing
outside the context, which is per thread. Modules imported from files while scoring compile as
usual, and sympy's (and mpmath's) lazy imports of their own modules load their cached bytecode
(:data:`LAZY_IMPORTERS`); any other ``marshal.loads`` is refused.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib.machinery
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

#: Functions and constructors an answer's expression may call: sympy's number and symbol
#: constructors (what ``parse_expr`` writes for literals and unknown names) and math functions.
CALLABLE = frozenset({
    "Symbol", "Integer", "Float", "Rational", "Function", "Number",
    "Add", "Mul", "Pow", "Eq", "Abs", "abs", "sqrt", "cbrt", "root", "exp", "log", "ln",
    "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "atan2", "acot",
    "sinh", "cosh", "tanh", "coth", "asinh", "acosh", "atanh",
    "factorial", "factorial2", "binomial", "floor", "ceiling", "Min", "Max", "min", "max",
    "gamma", "re", "im", "sign", "gcd", "lcm", "Mod", "conjugate", "round", "Integral", "Derivative",
})
#: Names of constants an expression may read besides plain symbol names.
CONSTANTS = frozenset({"pi", "E", "I", "oo", "zoo", "nan", "True", "False", "None"})
#: The only keyword argument allowed (sympy's ``evaluate=False`` parse writes it).
KEYWORDS = frozenset({"evaluate"})
#: Audit events refused while scoring, whatever their arguments.
REFUSED_EVENTS = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg",
    "subprocess.Popen", "pty.spawn", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.__new__",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "ctypes.addressof",
    "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
    "os.truncate", "os.putenv", "os.unsetenv", "shutil.rmtree", "shutil.move", "shutil.copyfile",
    "code.__new__", "function.__new__", "marshal.loads", "marshal.load", "pickle.find_class",
    "sys.addaudithook", "sys.settrace", "sys.setprofile", "webbrowser.open", "urllib.Request",
})
#: Packages whose lazy imports of their own modules (cached bytecode, ``marshal.loads``) go
#: through while scoring.
LAZY_IMPORTERS = frozenset({"sympy", "mpmath"})
#: The one statement ``parse_expr`` compiles besides the answer: its namespace set-up.
_SYMPY_SETUP = "from sympy import *"
_WRITE_MODE = frozenset("wax+")
_BUILTIN_NAMES = frozenset(dir(builtins))
_MAX_SOURCE_CHARS = 100_000


class UnsafeAnswer(ValueError):
    """An answer's text would have run as code; it is refused (and scores 0)."""


_state = threading.local()
_installed = False
_install_lock = threading.Lock()


def _allowed_name(name: str) -> bool:
    if name in CALLABLE or name in CONSTANTS:
        return True
    return not (name.startswith("_") or name.endswith("_")) and name not in _BUILTIN_NAMES and name.isidentifier()


def _check_node(node: ast.AST) -> None:
    """Raise :class:`UnsafeAnswer` unless ``node`` is a plain arithmetic expression tree."""
    if isinstance(node, ast.Expression):
        _check_node(node.body)
    elif isinstance(node, ast.Module) and len(node.body) == 1 and isinstance(node.body[0], ast.Expr):
        _check_node(node.body[0].value)
    elif isinstance(node, ast.Constant):
        if not isinstance(node.value, (int, float, complex, str, bool, type(None))):
            raise UnsafeAnswer(f"constant of type {type(node.value).__name__}")
    elif isinstance(node, ast.Name):
        if not isinstance(node.ctx, ast.Load) or not _allowed_name(node.id):
            raise UnsafeAnswer(f"name {node.id!r}")
    elif isinstance(node, ast.BinOp):
        if not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
                                    ast.BitXor, ast.BitAnd, ast.BitOr, ast.LShift, ast.RShift)):
            raise UnsafeAnswer(f"operator {type(node.op).__name__}")
        _check_node(node.left)
        _check_node(node.right)
    elif isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.UAdd, ast.USub, ast.Not, ast.Invert)):
            raise UnsafeAnswer(f"operator {type(node.op).__name__}")
        _check_node(node.operand)
    elif isinstance(node, ast.Compare):
        for part in (node.left, *node.comparators):
            _check_node(part)
    elif isinstance(node, (ast.Tuple, ast.List)):
        if not isinstance(node.ctx, ast.Load):
            raise UnsafeAnswer("assignment")
        for element in node.elts:
            _check_node(element)
    elif isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Call):  # Function('f')(x): sympy's undefined function applied
            if not (isinstance(func.func, ast.Name) and func.func.id == "Function"):
                raise UnsafeAnswer("call of a call")
            _check_node(func)
        elif not (isinstance(func, ast.Name) and func.id in CALLABLE):
            raise UnsafeAnswer(f"call of {ast.dump(func)[:60]}")
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                raise UnsafeAnswer("starred argument")
            _check_node(arg)
        for keyword in node.keywords:
            if keyword.arg not in KEYWORDS or not isinstance(keyword.value, ast.Constant):
                raise UnsafeAnswer(f"keyword {keyword.arg!r}")
    else:
        raise UnsafeAnswer(f"{type(node).__name__} is not part of an expression")


def check_expression(source: str | bytes | ast.AST) -> None:
    """Raise :class:`UnsafeAnswer` unless ``source`` is an expression :data:`CALLABLE` bounds.

    ``source`` is Python text (as ``eval`` or ``parse_expr`` would compile it) or a syntax tree.
    """
    if isinstance(source, ast.AST):
        tree = source
    else:
        text = source.decode("utf-8", "replace") if isinstance(source, (bytes, bytearray)) else str(source)
        if len(text) > _MAX_SOURCE_CHARS:
            raise UnsafeAnswer(f"expression of {len(text)} characters")
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError as exc:
            raise UnsafeAnswer(f"not an expression: {exc.msg}") from None
        except (RecursionError, MemoryError, ValueError):
            raise UnsafeAnswer("expression too deep") from None
    try:
        _check_node(tree)
    except RecursionError:
        raise UnsafeAnswer("expression too deep") from None


def _package_dir(name: str) -> str | None:
    module = sys.modules.get(name)
    files = getattr(module, "__path__", None)
    return os.path.realpath(list(files)[0]) if files else None


def _importing_own_module() -> bool:
    """Whether this ``marshal.loads`` is the import system reading the cached bytecode of a
    module of a package in :data:`LAZY_IMPORTERS` from that package's own folder (sympy imports
    parts of itself only when an expression first needs them: ``Derivative(..., evaluate=True)``).
    An answer cannot name a module or a file (the expression check allows no import, attribute
    or string-to-code step), so what is loaded here is the installed package's own code."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "get_code" and code.co_filename.startswith("<frozen importlib._bootstrap"):
            loader = frame.f_locals.get("self")
            name, path = getattr(loader, "name", None), getattr(loader, "path", None)
            if not isinstance(name, str) or not isinstance(path, str):
                return False
            top = name.split(".")[0]
            if top not in LAZY_IMPORTERS or not isinstance(loader, importlib.machinery.SourceFileLoader):
                return False
            root = _package_dir(top)
            real = os.path.realpath(path)
            return root is not None and real.startswith(root + os.sep) and real.endswith(".py")
        frame = frame.f_back
    return False


def _refuse(event: str, args: tuple[Any, ...]) -> None:
    if event == "compile":
        source, filename = args[0], args[1]
        if isinstance(filename, str) and not filename.startswith("<"):
            return  # a module compiled from its file (an import while scoring)
        if isinstance(source, (bytes, str)):
            text = source.decode("utf-8", "replace") if isinstance(source, bytes) else source
            if text.strip() == _SYMPY_SETUP:
                return
        check_expression(source)
    elif event in REFUSED_EVENTS:
        if event == "marshal.loads" and _importing_own_module():
            return
        raise UnsafeAnswer(f"{event} while scoring an answer")
    elif event == "open":
        mode, flags = args[1], args[2]
        import os

        if (isinstance(mode, str) and _WRITE_MODE & set(mode)) or \
                (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)):
            raise UnsafeAnswer(f"opening {args[0]!r} for writing while scoring an answer")


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if not getattr(_state, "active", False) or getattr(_state, "busy", False):
        return
    _state.busy = True  # check_expression's own ast.parse raises a compile event too
    try:
        _refuse(event, args)
    except UnsafeAnswer as exc:
        if _state.refused is None:
            _state.refused = str(exc)
        raise
    finally:
        _state.busy = False


def _install() -> None:
    global _installed
    with _install_lock:
        if not _installed:
            sys.addaudithook(_hook)
            _installed = True


class Verdict:
    """What :func:`guarded` saw: ``refused`` is why an answer was refused, or None."""

    refused: str | None = None


@contextlib.contextmanager
def guarded() -> Iterator[Verdict]:
    """Run a scorer with answers as data only (see the module docstring).

    Yields a :class:`Verdict` whose ``refused`` is set, once the block ends, when anything was
    refused inside it, even where the scorer caught the exception and went on.
    """
    _install()
    before = getattr(_state, "active", False), getattr(_state, "refused", None)
    _state.active, _state.refused = True, None
    verdict = Verdict()
    try:
        yield verdict
    finally:
        verdict.refused = _state.refused
        _state.active, _state.refused = before
