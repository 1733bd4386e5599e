"""What every command line of the project shares: a parser whose errors are one short message
(an unknown flag names the nearest one), and ``--import``, which loads a module or a loose
``.py`` file so that the tasks it registers run by id."""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Iterable, NoReturn

IMPORT_HELP = ("a module (mypkg.tasks) or a .py file (my_task.py) to import first, so the tasks it registers "
               "run by id; repeatable")


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are short: the error, the nearest known flag for
    an unknown one (``--iteratons`` -> ``--iterations``), and where the flags are listed (``--help``),
    instead of the whole usage block."""

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            message = self.unknown_flags(message[len(prefix):].split()) or message
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog} --help lists every flag\n")

    def unknown_flags(self, args: Iterable[str]) -> str:
        known = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        hints = []
        for arg in args:
            if not arg.startswith("-"):
                continue  # a value of the unknown flag
            name = arg.split("=", 1)[0]
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
        if not hints:
            return ""
        return f"unknown flag{'s' if len(hints) > 1 else ''} {', '.join(hints)}"


def add_import_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE_OR_FILE",
                        help=IMPORT_HELP)


def import_tasks(targets: Iterable[str]) -> None:
    """Import each module name or ``.py`` file path in ``targets`` (``--import``), so the tasks it
    registers are known by id. A file is imported under its file name (without ``.py``) and
    its folder is put on ``sys.path`` first, so a module beside it imports too; a file that
    is not there, or a module that does not import, is a ``ValueError`` saying so."""
    for target in targets:
        path = Path(target)
        if target.endswith(".py") or path.is_file() or "/" in target or "\\" in target:
            if not path.is_file():
                raise ValueError(f"--import {target}: no such file")
            path = path.resolve()
            name = path.stem
            if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
                continue  # already imported: its tasks are registered
            folder = str(path.parent)
            if folder not in sys.path:
                sys.path.insert(0, folder)
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ValueError(f"--import {target}: not a Python file")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        else:
            try:
                importlib.import_module(target)
            except ModuleNotFoundError as exc:
                if exc.name and target.startswith(exc.name):
                    raise ValueError(f"--import {target}: no module named {exc.name!r} (a file path ends in .py)") \
                        from None
                raise
