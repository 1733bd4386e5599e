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
    """The description, with the keyword arguments it cannot be built without."""
    text = spec.description
    if spec.needs:
        text += f" [needs {', '.join(k + '=...' for k in spec.needs)}]"
    return text


def _status(spec: envs.TaskSpec) -> str:
    """What to install when a package the task needs is missing; ``""`` when it is there."""
    return "" if spec.available else f"[not installed: {spec.install_hint or ', '.join(spec.missing())}]"


def format_table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned plain-text columns (no dependency on a table library)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


#: The listing's width: one line per task (id, modality, source, a missing package), then its
#: description and its defaults, indented and wrapped at this width.
LIST_WIDTH = 100


def list_tasks(out: TextIO | None = None, as_json: bool = False) -> None:
    """Write the listing (or JSON lines) of registered tasks to ``out`` (default: ``sys.stdout`` now)."""
    import textwrap

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
    table = format_table([[s.id, s.modality, s.source] for s in specs], ["id", "modality", "source"]).split("\n")
    indent = " " * 4
    lines = [table[0] + "  (then: what it is; its defaults)", table[1]]
    for spec, head in zip(specs, table[2:]):
        status = _status(spec)
        lines.append(textwrap.fill(f"{head}  {status}" if status else head, LIST_WIDTH, subsequent_indent=indent * 2,
                                   break_on_hyphens=False))
        lines.append(textwrap.fill(_description(spec), LIST_WIDTH, initial_indent=indent, subsequent_indent=indent,
                                   break_on_hyphens=False))
        if spec.kwargs:
            lines.append(textwrap.fill(f"defaults: {_kwargs_text(spec.kwargs)}", LIST_WIDTH, initial_indent=indent,
                                       subsequent_indent=indent + " " * len("defaults: "), break_on_hyphens=False))
    out.write("\n".join(lines) + "\n")
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
        try:
            list_tasks(as_json=args.json)
        except BrokenPipeError:  # piped into `head` and closed
            return 141
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
