"""Reading files that may be hostile, and writing run-folder files without following links.

Run folders, records and checkpoints can come from elsewhere (a copied run, a shared disk), so
what reads them treats them as untrusted input:

- :func:`read_regular` opens a file without following a symbolic link in its last component
  and without blocking (a FIFO), refuses anything that is not a regular file (``/dev/zero``, a
  FIFO, a folder) or lies outside an allowed folder, and reads at most ``max_bytes``;
- :func:`loads_json` and :func:`load_yaml` parse with a bound on nesting depth (deep nesting
  raised ``RecursionError``) and, for YAML, on the number of values after aliases are expanded
  (a 1 KB alias bomb expands to billions) and without cycles; only plain data (``safe_load``);
- :func:`open_nofollow` opens a file for writing without following a link (``O_NOFOLLOW``),
  so a planted ``runs/X/.lock -> ~/important`` is refused instead of truncating its target.

Every failure is an :class:`UnsafeFileError` (a ``ValueError``) whose message names the file
and the problem. Standard library and PyYAML only.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

#: Nesting deeper than this is refused (nothing freshper writes nests beyond ~6 levels).
MAX_DEPTH = 64
#: Values a YAML document may expand to (aliases counted as often as they are used).
MAX_YAML_VALUES = 100_000


class UnsafeFileError(ValueError):
    """A file that cannot be read safely: a link, not a regular file, outside its folder, too
    large, or malformed (too deep, an alias bomb, ...). The message names the file."""


def inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether the real location of ``path`` is ``root`` or below it (links resolved)."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def read_regular(path: str | os.PathLike, *, max_bytes: int, root: str | os.PathLike | None = None,
                 follow_links: bool = False) -> bytes:
    """The bytes of a regular file, read without following a link in its last component.

    Folders above the file may be links (a run folder on another disk) but, with ``root``, the
    file's real folder must lie inside ``root``. Refused with :class:`UnsafeFileError`: a
    symbolic link, a FIFO, a device, a folder, a file larger than ``max_bytes``, a name with a
    NUL byte; a missing file raises ``FileNotFoundError``. ``follow_links`` reads through a
    link to the regular file it names (a config file the user gives).
    """
    if follow_links and "\x00" not in str(path):
        path = os.path.realpath(path)
    fd, st = open_regular(path, root=root)
    try:
        if st.st_size > max_bytes:
            raise UnsafeFileError(f"{path} is {st.st_size:,} bytes, more than the {max_bytes:,} read here")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise UnsafeFileError(f"{path} grew past the {max_bytes:,} bytes read here")
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_regular(path: str | os.PathLike, *, root: str | os.PathLike | None = None) -> tuple[int, os.stat_result]:
    """A read-only descriptor of a regular file (opened as :func:`read_regular` opens it) and its
    ``fstat``; the caller closes it."""
    path = Path(path)
    if "\x00" in str(path):
        raise UnsafeFileError(f"{str(path)!r}: a file name with a NUL byte")
    parent = Path(os.path.realpath(path.parent))
    if root is not None and not inside(parent, root):
        raise UnsafeFileError(f"{path} lies outside {root}")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(parent / path.name, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component is a link
            raise UnsafeFileError(f"{path} is a symbolic link; only regular files are read") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{path} is not a regular file (a FIFO, device or folder); it is not read")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def sha256_regular(path: str | os.PathLike, *, root: str | os.PathLike | None = None) -> tuple[str, int]:
    """The SHA-256 (hex) and size of a regular file, streamed (refused as :func:`read_regular`
    refuses)."""
    import hashlib

    fd, _ = open_regular(path, root=root)
    h, size = hashlib.sha256(), 0
    try:
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return h.hexdigest(), size


def read_text(path: str | os.PathLike, *, max_bytes: int, root: str | os.PathLike | None = None,
              follow_links: bool = False) -> str:
    """:func:`read_regular` decoded as UTF-8 (undecodable bytes replaced)."""
    return read_regular(path, max_bytes=max_bytes, root=root, follow_links=follow_links).decode("utf-8",
                                                                                                errors="replace")


def check_depth(value: Any, max_depth: int = MAX_DEPTH, what: str = "the value") -> Any:
    """``value`` if its lists and dicts nest at most ``max_depth`` deep (checked without
    recursion), else :class:`UnsafeFileError`."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            if depth > max_depth:
                raise UnsafeFileError(f"{what} nests deeper than {max_depth} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list, tuple)))
    return value


def loads_json(text: str | bytes, *, what: str, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` that turns every failure (malformed, nested too deeply, an integer of
    thousands of digits) into :class:`UnsafeFileError` naming ``what``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UnsafeFileError(f"{what} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise UnsafeFileError(f"{what} nests deeper than {max_depth} levels") from None
    except (ValueError, TypeError) as exc:
        raise UnsafeFileError(f"{what} cannot be read as JSON ({exc})") from None
    return check_depth(value, max_depth, what)


def load_yaml(text: str, *, what: str, max_depth: int = MAX_DEPTH, max_values: int = MAX_YAML_VALUES) -> Any:
    """``yaml.safe_load`` bounded in depth and in the values its aliases expand to, refusing
    recursive aliases; every failure is an :class:`UnsafeFileError` naming ``what``."""
    import yaml

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            self.depth += 1
            try:
                if self.depth > max_depth:
                    raise UnsafeFileError(f"{what} nests deeper than {max_depth} levels")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    loader = None
    try:
        loader = Loader(text)  # the reader refuses control characters here already
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_graph(node, what, max_values)
        return loader.construct_document(node)
    except UnsafeFileError:
        raise
    except RecursionError:
        raise UnsafeFileError(f"{what} nests deeper than {max_depth} levels") from None
    except yaml.YAMLError as exc:
        raise UnsafeFileError(f"{what} is not valid YAML: {_clip(str(exc), 300)}") from None
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. a timestamp out of range
        raise UnsafeFileError(f"{what} cannot be read as YAML: {_clip(str(exc), 300)}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_yaml_graph(root: Any, what: str, max_values: int) -> None:
    """Refuse a composed YAML node graph with a cycle or more than ``max_values`` values once
    its aliases are expanded (computed once per shared node, without recursion)."""
    import yaml

    def children(node: Any) -> list:
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        if isinstance(node, yaml.MappingNode):
            return [n for pair in node.value for n in pair]
        return []

    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children(node))
            if size[key] > max_values:
                raise UnsafeFileError(f"{what} expands to more than {max_values:,} values (YAML aliases repeating "
                                      "large parts?); it is refused")
            continue
        if key in size:
            continue
        if key in on_path:
            raise UnsafeFileError(f"{what} has an alias that refers to itself (a recursive YAML value)")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children(node) if id(c) not in size)


def open_nofollow(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8"):
    """A file object for writing (``"w"``, ``"a"``, ``"a+"``, ``"wb"``, ``"ab"``) that refuses a
    symbolic link or a non-regular file at ``path`` (``OSError``) instead of writing through it."""
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    flags |= os.O_RDWR if "+" in mode else os.O_WRONLY
    if mode.startswith("a"):
        flags |= os.O_APPEND
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if os.path.islink(path):
            raise OSError(exc.errno, f"{path} is a symbolic link: refusing to write through it") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file: refusing to write to it")
        os.set_blocking(fd, True)
        if mode.startswith("w"):
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, mode.replace("w", "r+") if "+" in mode and mode.startswith("w") else mode,
                     encoding=None if "b" in mode else encoding)


def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n] + "..."
