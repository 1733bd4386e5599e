"""Settings become a command line: one flag per dataclass field, its help the docstring under
the field (as CleanRL does with tyro), values checked against the field's type with errors that
name the flag, and ``--config FILE.yaml`` experiment files read safely (``learner.config`` puts
these together for train.py)."""

from __future__ import annotations

import argparse
import ast
import inspect
import os
from typing import Any

from agents.safeio import UnsafeFileError, load_yaml, loads_json, read_text


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass, by field name."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[union-attr]
    return docs


def parse_value(kind: str, text: str) -> Any:
    """A flag's text as the field's type (``int``, ``float``, ``str``, ``dict`` as JSON, ``X | None``)."""
    if text.lower() in ("none", "null") and "None" in kind:
        return None
    if kind.startswith("dict"):
        return loads_json(text, what="the value")
    base = kind.replace(" | None", "")
    casts = {"int": int, "float": float, "str": str}
    if " | " in base:  # a union such as ``float | str``: the first type that takes the text
        for name in base.split(" | "):
            try:
                return casts[name](text)
            except ValueError:
                continue
        raise ValueError(f"{text!r} is not a {base}")
    return casts[base](text)


def add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, kind: str, default: Any,
             doc: str) -> None:
    """``--name`` (underscores as dashes) for a setting of type ``kind`` (``bool``: a
    ``--name/--no-name`` pair), its help ``doc`` and its default; unset, it is absent from the
    parsed result (``dest`` is ``name``)."""
    flag = "--" + name.replace("_", "-")
    help_text = f"{doc} (default: {default})"
    if kind == "bool":
        parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                            help=help_text)
    else:
        parser.add_argument(flag, dest=name, type=lambda s, k=kind: flag_value(k, s), default=argparse.SUPPRESS,
                            metavar=kind.replace(" | None", "").split("[")[0].upper(), help=help_text)


def flag_value(kind: str, text: str) -> Any:
    """:func:`parse_value` for argparse: a value that does not parse is an error saying why
    (for JSON, where), not argparse's "invalid <lambda> value"."""
    try:
        return parse_value(kind, text)
    except ValueError as exc:
        if not kind.startswith("dict"):
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an' if kind[0] in 'aeiou' else 'a'} "
                                             f"{kind.replace(' | None', '')}") from None
        raise argparse.ArgumentTypeError(f"{json_error(text, exc)}") from None


def json_error(text: str, exc: Exception) -> str:
    """What is wrong with ``text`` as JSON, and where: the text with a caret under the place."""
    import json

    try:
        json.loads(text)
    except json.JSONDecodeError as err:
        at = text[err.pos:err.pos + 1]
        quotes = at == "'" or at.isalpha() or at == "_"  # a single-quoted or bare key or string
        hint = """ (JSON's keys and strings take double quotes: '{"size": 4}')""" if quotes else ""
        return f"not valid JSON: {err.msg} at character {err.pos + 1}{hint}\n  {text}\n  {' ' * err.pos}^"
    except Exception:
        pass
    return str(exc)


def check_type(name: str, kind: str, value: Any) -> Any:
    """``value`` if it fits the field's declared type (``int``, ``float``, ``str``, ``bool``,
    ``dict``, unions and ``| None``), else a ValueError naming the flag; ints are accepted
    as floats. Values from YAML files are checked here, so ``"false"`` is not a bool."""
    flag = "--" + name.replace("_", "-")
    kinds = [k.strip() for k in kind.split("|")]
    if value is None and "None" in kinds:
        return value
    for k in kinds:
        if k == "bool" and isinstance(value, bool):
            return value
        if k == "int" and isinstance(value, int) and not isinstance(value, bool):
            return value
        if k == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if k == "str" and isinstance(value, str):
            return value
        if k.startswith("dict") and isinstance(value, dict):
            return value
    shown = repr(value) if len(repr(value)) <= 200 else repr(value)[:200] + "..."
    raise ValueError(f"{flag} must be {' or '.join(kinds)}, got {shown} ({type(value).__name__})")


#: A config file larger than this is refused (the repository's are ~1 KB).
MAX_CONFIG_BYTES = 1 << 20
#: Values a config file may expand to with its YAML aliases.
MAX_CONFIG_VALUES = 10_000


def load_config_file(path: str | os.PathLike, *, follow_links: bool = True) -> dict[str, Any]:
    """A YAML config file as a mapping of settings (an empty file is ``{}``), or a ValueError
    naming the file and the problem: not a regular file (a FIFO, a device), over 1 MB, not YAML,
    nested too deeply, aliases expanding past 10,000 values, not a mapping, keys that are not
    names. ``follow_links=False`` (a run folder's own ``config.yaml``) refuses a symbolic link."""
    try:
        text = read_text(path, max_bytes=MAX_CONFIG_BYTES, follow_links=follow_links)
        loaded = load_yaml(text, what=str(path), max_values=MAX_CONFIG_VALUES)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such config file") from None
    except UnsafeFileError as exc:
        raise ValueError(f"config {exc}") from None
    except OSError as exc:
        raise ValueError(f"{path} cannot be read: {exc.strerror or exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"config {path} holds a {type(loaded).__name__}, not a mapping of settings (key: value lines)")
    bad = [k for k in loaded if not isinstance(k, str)]
    if bad:
        raise ValueError(f"config {path} has keys that are not setting names: {', '.join(map(repr, bad[:5]))[:200]}")
    return loaded
