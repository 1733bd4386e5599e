"""A dataclass becomes a command line: one flag per field, its help the docstring under the
field (as CleanRL does with tyro), ``--config FILE.yaml`` for experiment files, and errors that
name the nearest valid key."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import os
from typing import Any, TypeVar

from agents.safeio import UnsafeFileError, load_yaml, loads_json, read_text

T = TypeVar("T")


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


def dataclass_parser(cls: type, description: str | None = None) -> argparse.ArgumentParser:
    """``--config`` plus ``--field-name`` per field; unset flags are absent from the result."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file of config values (flags given here override it)")
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = f"{docs.get(f.name, '')} (default: {default})"
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, type=lambda s, k=kind: parse_value(k, s), default=argparse.SUPPRESS,
                                metavar=kind.replace(" | None", "").upper(), help=help_text)
    return parser


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


def replace_checked(base: T, values: dict[str, Any]) -> T:
    """``dataclasses.replace`` that rejects unknown keys with a did-you-mean hint and values of
    the wrong type with the flag's name."""
    fields = {f.name: str(f.type) for f in dataclasses.fields(base)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(fields))
    if unknown:
        hints = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, fields, 1)) else k for k in unknown]
        raise ValueError(f"unknown config keys: {', '.join(hints)}")
    checked = {k: check_type(k, fields[k], v) for k, v in values.items()}
    return dataclasses.replace(base, **checked)  # type: ignore[type-var]


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
