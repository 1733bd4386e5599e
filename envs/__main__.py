"""``python -m envs list``: print every registered task (built-in and plugins);
``python -m envs new mypkg/MyTask-v0 [DIR]``: write a task plugin package (:mod:`envs.scaffold`).

The listing reads only the registry (entry points are lazy ``module:Class`` strings), so it
works even when a task's module is missing or fails to import.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence, TextIO

import envs


def _kwargs_text(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "-"


def _description(spec: envs.TaskSpec) -> str:
    """The description, with what to install when a package the task needs is missing."""
    text = spec.description
    if spec.needs:
        text += f" [needs {', '.join(k + '=...' for k in spec.needs)}]"
    if spec.available:
        return text
    return f"{text} [not installed: {spec.install_hint or ', '.join(spec.missing())}]"


def format_table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned plain-text columns (no dependency on a table library)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def list_tasks(out: TextIO | None = None, as_json: bool = False) -> None:
    """Write the table (or JSON lines) of registered tasks to ``out`` (default: ``sys.stdout`` now)."""
    out = sys.stdout if out is None else out
    specs = envs.registered_tasks()
    if as_json:
        for s in specs:
            entry = s.entry_point if isinstance(s.entry_point, str) else repr(s.entry_point)
            out.write(json.dumps({"id": s.id, "modality": s.modality, "kwargs": s.kwargs,
                                  "description": s.description, "source": s.source, "entry_point": entry,
                                  "available": s.available, "install_hint": s.install_hint,
                                  "needs": list(s.needs)}) + "\n")
        return
    rows = [[s.id, s.modality, _kwargs_text(s.kwargs), _description(s), s.source] for s in specs]
    out.write(format_table(rows, ["id", "modality", "defaults", "description", "source"]) + "\n")
    out.write(f"\n{len(specs)} tasks. Play one: python -m envs.play <id>\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envs", description="freshper environment hub")
    sub = parser.add_subparsers(dest="command")
    p_list = sub.add_parser("list", help="print every registered task with its modality and defaults")
    p_list.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p_new = sub.add_parser("new", help="write a task plugin package (pyproject entry point, a task, its test)")
    p_new.add_argument("env_id", help="the new task's id, e.g. mypkg/MyTask-v0 (the namespace names the package)")
    p_new.add_argument("dir", nargs="?", default=None, help="where to write it (default: ./<namespace>)")
    args = parser.parse_args(argv)
    if args.command == "list":
        list_tasks(as_json=args.json)
        return 0
    if args.command == "new":
        from envs.scaffold import scaffold

        try:
            root = scaffold(args.env_id, args.dir)
        except (ValueError, OSError) as exc:  # a bad id or namespace, not a folder, not writable
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.env_id} to {root}/. Next: pip install -e '{root}[test]' && (cd {root} && pytest)")
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
