"""A run folder: its layout, and the one reader of each file in it.

``train.py`` writes a run folder; the learner (resume, reports, tools) and the viewer read it
through this module (docs/design.md#layout-and-layering), so a file has one reader, with one set
of checks:

- ``checkpoints/iter_NNNNNN/``: :func:`list_checkpoints` (the complete ones, oldest first),
  :func:`survey_checkpoints` (every folder, temporaries included, each with what is wrong with
  it), :func:`check_checkpoint` (what is wrong, as text) and :func:`verify_checkpoint` (the
  manifest, or :class:`CheckpointError`), both against the ``manifest.json`` that
  :func:`write_manifest` writes last: the SHA-256 and size of every file, an integer iteration.
  The manifest is a completeness check: it lists at least one file, every file it lists matches,
  and the folder holds no file it does not list;
- ``metrics.jsonl`` (or ``metrics.jsonl.gz``, an archived run): :func:`load_metrics` (rows, a
  message for every line skipped, and the first damaged line), :func:`read_metrics` (the rows)
  and :func:`read_metrics_lines` (rows and messages, never raising);
- ``replay_log/seg-NNNNNN.jsonl.gz`` (the format is ``learner/replay_log.py``'s):
  :func:`segment_paths`, :func:`read_segment`, :class:`Members` (the whole gzip members of a
  segment, decompressed with a cap checked while decompressing), :func:`member_rows`,
  :func:`read_members` and :func:`read_replay_log`.

A run folder may come from elsewhere, so every file is read as untrusted input
(:mod:`agents.safeio`): a regular file (no link in its own name, no FIFO or device), bounded in
size, inside a root where one is given, parsed with bounded depth; decompression stops at a cap.
Standard library and :mod:`agents.safeio` only.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import stat
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from agents.safeio import UnsafeFileError, inside, loads_json, open_nofollow, open_regular, read_regular, sha256_regular

# -- layout ---------------------------------------------------------------------------------------
CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CURVES = "curves.png"
CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
REPLAY_LOG = "replay_log"
#: The files whose presence makes a folder a run folder.
RUN_MARKERS = (CONFIG, METRICS, SUMMARY)
#: Files train.py writes directly in a run folder: a symbolic link at one of these names is
#: refused when the run starts, so nothing is written through it to the link's target.
RUN_FILES = (".lock", CONFIG, METRICS, "metrics.tmp", SUMMARY, "summary.txt", CURVES, "environment.json",
             "environment.json.tmp", REPLAY_LOG)
CHECKPOINT_NAME = re.compile(r"^iter_(\d{6,})$")
#: Name prefixes of a checkpoint folder being written (``.tmp-``) or replaced (``.old-``).
TEMPORARY = (".tmp-", ".old-")
SEGMENT = re.compile(r"^seg-(\d{6})\.jsonl\.gz$")

#: The most read of each kind of file (the viewer's bounds; a larger file is a problem shown).
MAX_BYTES = {CONFIG: 1 << 20, METRICS: 128 << 20, SUMMARY: 16 << 20, MANIFEST: 16 << 20, CURVES: 32 << 20}
#: The most metrics text the learner and the tools read (plain or decompressed).
MAX_METRICS_BYTES = 2 << 30
#: The largest segment file read (one is closed at 1/8 of ``--replay-log-mb``; this bounds a planted one).
MAX_SEGMENT_BYTES = 512 << 20
#: What one segment may decompress to at most, and at most :data:`MAX_RATIO` times its size on
#: disk, though never less than :data:`MIN_SEGMENT_TEXT` (JSON lines compress ~5-10x; a 1.3 MB
#: file of gzip bombs expanded to 1.3 GB).
MAX_SEGMENT_TEXT = 1 << 30
MAX_RATIO = 100
MIN_SEGMENT_TEXT = 64 << 20


def is_run_folder(path: Path) -> bool:
    """Whether ``path`` looks like a ``train.py`` run folder."""
    return path.is_dir() and any((path / m).is_file() for m in RUN_MARKERS)


def _clip(text: str, n: int = 80) -> str:
    text = text.strip()
    return text if len(text) <= n else text[:n] + "..."


# -- checkpoints ----------------------------------------------------------------------------------
class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:06d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The checkpoints under a checkpoints folder ``root`` (oldest first); temporary folders are
    left out (their contents are not checked here: :func:`verify_checkpoint` does that)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := CHECKPOINT_NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def manifest_entries(manifest: Any, what: str) -> list[tuple[str, int, str]]:
    """The ``(relative path, size, sha256)`` of every file a checkpoint manifest lists, or
    :class:`UnsafeFileError` saying what is malformed: relative paths inside the folder, whole
    non-negative sizes (``1e400`` is not a size), hex SHA-256s, an integer iteration, at least
    one file (an empty manifest would vouch for nothing)."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise UnsafeFileError(f"{what} is not a checkpoint manifest (no \"files\" object)")
    files = manifest["files"]
    if not files:
        raise UnsafeFileError(f"{what} lists no files: an empty manifest vouches for nothing")
    out = []
    for rel, meta in files.items():
        parts = Path(rel).parts
        if not rel or "\x00" in rel or Path(rel).is_absolute() or ".." in parts or "\\" in rel:
            raise UnsafeFileError(f"{what} lists {_clip(repr(rel))}, which is not a path inside the checkpoint")
        if not isinstance(meta, dict):
            raise UnsafeFileError(f"{what}: the entry of {_clip(rel)} is not an object")
        size, sha = meta.get("size"), meta.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise UnsafeFileError(f"{what}: the size of {_clip(rel)} is {_clip(repr(size))}, not a whole number of bytes")
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise UnsafeFileError(f"{what}: the sha256 of {_clip(rel)} is not 64 hex digits")
        out.append((Path(rel).as_posix(), size, sha))
    iteration = manifest.get("iteration")
    if not isinstance(iteration, int) or isinstance(iteration, bool):
        raise UnsafeFileError(f"{what} has no whole-number \"iteration\"")
    return out


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def unlisted_files(folder: str | os.PathLike, listed: set[str], skip: tuple[str, ...] = (MANIFEST,)) -> list[str]:
    """Files (and links) under ``folder`` that a manifest does not list: a manifest is a
    completeness check, so a file added after it was written (say a pickle beside the
    safetensors) is found."""
    folder = Path(folder)
    extra = []
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = Path(dirpath, name).relative_to(folder).as_posix()
            if rel not in listed and rel not in skip:
                extra.append(rel)
    return sorted(extra)


def write_manifest(folder: Path, iteration: int) -> dict[str, Any]:
    """Write ``folder/manifest.json`` (the SHA-256 and size of every file in ``folder``, and
    ``iteration``) after every file is fsynced; the manifest and the folders are fsynced too.
    Called last, by the writer of a checkpoint, before it renames the folder into place."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    manifest = {"iteration": iteration, "files": {}}
    for p in files:
        sha, size = sha256_regular(p)
        manifest["files"][str(p.relative_to(folder))] = {"sha256": sha, "size": size}
    for p in files:
        fsync_path(p)
    with open_nofollow(folder / MANIFEST, "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    for d in sorted({p.parent for p in files} | {folder}):
        fsync_path(d)
    return manifest


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _inspect(path: Path, *, hashes: bool, root: Path | None, name: str) -> tuple[dict[str, Any] | None, str]:
    """A checkpoint folder's manifest and what is wrong with the folder ('' if nothing)."""
    if not path.is_dir():
        return None, f"checkpoint {name} does not exist or is not a folder"
    if root is not None and not inside(path, root):
        return None, f"{name} lies outside {root}: it is not read"
    manifest_path = path / MANIFEST
    if not os.path.lexists(manifest_path):
        return None, (f"incomplete checkpoint: {name} has no {MANIFEST}, which is written last "
                      "(a run killed while saving it?)")
    what = f"{name}/{MANIFEST}"
    try:
        manifest = loads_json(read_regular(manifest_path, max_bytes=MAX_BYTES[MANIFEST], root=path), what=what)
        entries = manifest_entries(manifest, what)
    except (OSError, UnsafeFileError) as exc:
        return None, f"corrupt checkpoint: {what} cannot be read ({exc})"
    extra = unlisted_files(path, {rel for rel, _, _ in entries})
    if extra:
        return manifest, (f"modified checkpoint: {name} holds files its manifest does not list "
                          f"({', '.join(_clip(e, 60) for e in extra[:5])}): it was changed after it was saved")
    for rel, size, sha in entries:
        p = path / rel
        try:
            st = os.lstat(p)
        except OSError:
            return manifest, f"incomplete checkpoint: {name} is missing {rel}"
        if not stat.S_ISREG(st.st_mode) or not inside(p.parent, path):
            return manifest, f"damaged checkpoint: {name}/{rel} is not a regular file inside the checkpoint (a link?)"
        if st.st_size != size:
            return manifest, (f"incomplete or damaged checkpoint: {name}/{rel} is {st.st_size:,} bytes, its manifest "
                              f"says {size:,} (half-written?)")
        if hashes:
            try:
                actual = sha256_regular(p, root=path)[0]
            except (OSError, UnsafeFileError) as exc:
                return manifest, f"damaged checkpoint: {name}/{rel} cannot be read ({exc})"
            if actual != sha:
                return manifest, f"damaged checkpoint: {name}/{rel} does not match its checksum (corrupt or modified)"
    return manifest, ""


def check_checkpoint(path: Path, *, hashes: bool = False, root: Path | None = None) -> str:
    """What is wrong with a checkpoint folder against its ``manifest.json`` ('' if nothing),
    naming the folder by its name. The manifest must be well formed (:func:`manifest_entries`);
    every listed file must be a regular file (not a link) inside the checkpoint, of the listed
    size, and the folder may hold no file the manifest does not list. ``hashes`` also recomputes
    every file's SHA-256 (what loading a checkpoint does). With ``root``, the checkpoint must lie
    inside it."""
    path = Path(path)
    return _inspect(path, hashes=hashes, root=root, name=path.name)[1]


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's manifest once every file is checked against it, hashes included
    (:func:`check_checkpoint`); else :class:`CheckpointError` naming the folder, the problem and
    where the older checkpoints are."""
    path = Path(path)
    manifest, problem = _inspect(path, hashes=True, root=None, name=str(path))
    if problem:
        raise CheckpointError(f"{problem}; resume from an older checkpoint in {path.parent}")
    assert manifest is not None
    return manifest


def model_folder_problem(model: str | Path) -> tuple[Path, str]:
    """The model folder to load for ``model`` (a checkpoint folder ``iter_N`` means its
    ``model/``) and what is wrong with the checkpoint it belongs to ('' if nothing, or if it is
    no checkpoint's): checked against the manifest with every hash, as loading to play does."""
    folder = Path(model).expanduser()
    if CHECKPOINT_NAME.match(folder.name):
        folder = folder / "model"
    if folder.name == "model" and CHECKPOINT_NAME.match(folder.parent.name):
        return folder, check_checkpoint(folder.parent, hashes=True)
    return folder, ""


@dataclass
class CheckpointInfo:
    """One ``checkpoints/iter_N`` folder (or a temporary one a writer left behind)."""

    name: str
    path: Path
    iteration: int | None
    problem: str = ""  # empty: complete per its manifest (sizes; hashes are checked on load)

    @property
    def model_path(self) -> Path:
        return self.path / "model"

    @property
    def ok(self) -> bool:
        return not self.problem


def survey_checkpoints(root: Path, within: Path | None = None) -> list[CheckpointInfo]:
    """Every folder of a checkpoints folder ``root`` (oldest first), each with what is wrong with
    it (sizes checked, not hashes); a temporary folder a writer left behind is listed, last, as
    half-written. With ``within``, nothing outside that folder is read."""
    if not root.is_dir() or (within is not None and not inside(root, within)):
        return []
    out: list[CheckpointInfo] = []
    for p in sorted(root.iterdir()):
        if not p.is_dir():
            continue
        m = CHECKPOINT_NAME.match(p.name)
        if m:
            out.append(CheckpointInfo(p.name, p, int(m.group(1)), check_checkpoint(p, root=within)))
        elif p.name.startswith(TEMPORARY):
            out.append(CheckpointInfo(p.name, p, None, "half-written checkpoint: a temporary folder of a save that was "
                                                         "interrupted or is still running; it is never loaded"))
    return sorted(out, key=lambda c: (c.iteration is None, c.iteration or 0, c.name))


# -- metrics.jsonl --------------------------------------------------------------------------------
@dataclass
class Metrics:
    """What a ``metrics.jsonl`` holds: its rows (JSON objects, in order), a message for every
    non-blank line that was skipped, and the first of those that is not a torn last line ('' if
    none, else what is wrong with it): a last line not ending in a newline that is not JSON (or
    not UTF-8) is what a run killed or still writing leaves, every other skipped line is damage."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    damaged: str = ""
    torn: bool = False  # the last line was torn (and skipped)


def load_metrics(path: str | os.PathLike, *, root: str | os.PathLike | None = None, name: str | None = None,
                 max_bytes: int = MAX_METRICS_BYTES, follow_links: bool = False) -> Metrics:
    """Read a ``metrics.jsonl`` (from ``metrics.jsonl.gz`` where only that is there: an archived
    run; a path ending in ``.gz`` is read decompressed): a regular file (``follow_links``: also
    through a link to one), inside ``root`` if given, of at most ``max_bytes`` (decompressed, for
    an archive). Lines are named ``<name> line <n>`` (``name``: the name of the file read). A file
    that cannot be read raises (``FileNotFoundError``, :class:`UnsafeFileError` naming it)."""
    path = Path(path)
    archived = path.with_name(path.name + ".gz")
    source = archived if not os.path.lexists(path) and os.path.lexists(archived) else path
    if source.name.endswith(".gz"):
        data = _gunzip(source, max_bytes=max_bytes, root=root, follow_links=follow_links)
    else:
        data = read_regular(source, max_bytes=max_bytes, root=root, follow_links=follow_links)
    return parse_metrics(data, source.name if name is None else name)


def _gunzip(path: Path, *, max_bytes: int, root: str | os.PathLike | None, follow_links: bool) -> bytes:
    if follow_links and "\x00" not in str(path):
        path = Path(os.path.realpath(path))
    fd, _ = open_regular(path, root=root)
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as stream:
        try:
            data = stream.read(max_bytes + 1)
        except (OSError, EOFError, zlib.error) as exc:
            raise UnsafeFileError(f"{path} cannot be decompressed ({exc})") from None
    if len(data) > max_bytes:
        raise UnsafeFileError(f"{path} decompresses to more than the {max_bytes:,} bytes read here")
    return data


def parse_metrics(data: bytes, name: str = METRICS) -> Metrics:
    """The rows and skipped lines of ``metrics.jsonl`` bytes (:class:`Metrics`): every line must
    be UTF-8 holding a JSON object."""
    out = Metrics()
    lines = data.split(b"\n")
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        cut = False  # what a line cut short looks like: not UTF-8 (a character cut) or not JSON
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line, cut = raw.decode("utf-8", errors="replace"), True
            problem = f"{name} line {lineno} is not UTF-8 ({exc.reason} at byte {exc.start})"
        else:
            try:
                row = loads_json(line, what=f"{name} line {lineno}")
            except UnsafeFileError as exc:
                problem, cut = str(exc), " is not valid JSON (" in str(exc)
            else:
                if isinstance(row, dict):
                    out.rows.append(row)
                    continue
                problem = f"{name} line {lineno} is a JSON {type(row).__name__}, not an object"
        if cut and lineno == len(lines):  # no newline after it: torn
            out.torn = True
            out.problems.append(f"{name} line {lineno} is incomplete (a run still writing, or killed mid-line) "
                                f"and was skipped")
            continue
        out.problems.append(f"{problem} and was skipped: {_clip(line)}")
        out.damaged = out.damaged or problem
    return out


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (or its archived ``.gz``), read through a link as a file
    the user names; skipped lines (damaged or torn) are left out. Raises where the file cannot be
    read (missing, a FIFO, larger than :data:`MAX_METRICS_BYTES`)."""
    return load_metrics(path, follow_links=True).rows


def read_metrics_lines(path: Path, root: Path | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a ``metrics.jsonl`` and a message for every line that could not be read, never
    raising (the viewer's reading, bounded by :data:`MAX_BYTES`): a file that is a link, not a
    regular file, outside ``root`` or too large gives no rows and one message."""
    try:
        metrics = load_metrics(path, root=root, max_bytes=MAX_BYTES[METRICS])
    except (OSError, UnsafeFileError) as exc:
        return [], [f"{Path(path).name} cannot be read: {exc}"]
    return metrics.rows, metrics.problems


# -- the replay log -------------------------------------------------------------------------------
def segment_paths(run_dir: str | os.PathLike) -> list[Path]:
    """A run's replay log segment files, oldest first (none where the run has no log folder)."""
    folder = Path(run_dir) / REPLAY_LOG
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if SEGMENT.match(p.name))


def read_segment(path: str | os.PathLike, *, root: str | os.PathLike | None = None,
                 max_bytes: int = MAX_SEGMENT_BYTES) -> bytes:
    """The bytes of a segment file: a regular file (no link, FIFO or device), opened without
    blocking, of at most ``max_bytes``, inside ``root`` if given; else
    :class:`UnsafeFileError` naming it."""
    try:
        return read_regular(path, max_bytes=max_bytes, root=root)
    except UnsafeFileError as exc:
        raise UnsafeFileError(f"replay log segment refused: {exc}") from None


@dataclass
class Member:
    """One whole gzip member of a segment: where it lies in the file and its text."""

    offset: int
    length: int
    text: bytes


class Members:
    """The whole gzip members of a segment's bytes, one at a time, decompressed with a cap
    checked while decompressing: ``max_text`` in all (at most :data:`MAX_RATIO` times the data,
    at least :data:`MIN_SEGMENT_TEXT`) and, with ``max_member``, that much per member.

    Iteration stops at the first member that is torn (a run still writing, or killed), corrupt
    or past a cap; then :attr:`problem` says which (one phrase, to follow the segment's name),
    :attr:`bomb` whether a cap stopped it, and :attr:`end` is where the whole members end."""

    def __init__(self, data: bytes, *, max_text: int = MAX_SEGMENT_TEXT, max_member: int | None = None) -> None:
        self.data = data
        self.cap = min(max_text, max(MIN_SEGMENT_TEXT, MAX_RATIO * len(data)))
        self.max_member = max_member
        self.problem = ""
        self.bomb = False
        self.end = 0
        self.count = 0
        self.text_bytes = 0

    def __iter__(self) -> Iterator[Member]:
        view = memoryview(self.data)
        size = len(self.data)
        while self.end < size:
            d = zlib.decompressobj(31)
            room = self.cap - self.text_bytes
            per_member = self.max_member is not None and self.max_member <= room
            room = min(room, self.max_member) if self.max_member is not None else room
            try:
                text = d.decompress(view[self.end:], room)
            except zlib.error as exc:
                self.problem = f"is corrupt after {self.count} iterations ({exc}); the rest is skipped"
                return
            if d.unconsumed_tail:
                limit = f"{room:,} bytes for one member" if per_member else f"{self.cap:,} bytes for the segment"
                self.problem = f"decompresses past {limit} (a compression bomb?); the rest is skipped"
                self.bomb = True
                return
            if not d.eof:
                self.problem = "ends in a torn iteration (a run still writing, or killed mid-write); it is skipped"
                return
            length = size - self.end - len(d.unused_data)
            member = Member(self.end, length, text)
            self.text_bytes += len(text)
            self.count += 1
            self.end += length
            yield member
            del member, text  # one member's text held at a time


_LINE = re.compile(rb"[^\n]+")


def member_rows(text: bytes, what: str, *, strict: bool = False, offset: int = 0) -> list[dict[str, Any]]:
    """The rows (JSON objects) of a member's text, lines parsed with bounded depth. A line that is
    not one is skipped, or with ``strict`` an :class:`UnsafeFileError` naming ``what`` and the
    member's ``offset``."""
    rows = []
    for match in _LINE.finditer(text):  # non-empty lines, without a list of every line
        line = match.group(0)
        if not line.strip():
            continue
        try:
            row = loads_json(line.decode("utf-8", errors="strict" if strict else "replace"), what=what)
            if not isinstance(row, dict):
                raise UnsafeFileError(f"{what} holds a line that is not a JSON object")
        except (UnsafeFileError, UnicodeDecodeError) as exc:
            if strict:
                raise UnsafeFileError(f"{what}: the member at byte {offset:,} is not JSON lines "
                                      f"({type(exc).__name__}: {str(exc)[:120]})") from None
            continue
        rows.append(row)
    return rows


def read_members(data: bytes, *, what: str = "a replay log segment",
                 max_text: int = MAX_SEGMENT_TEXT) -> Iterator[tuple[bytes, list[dict[str, Any]] | None]]:
    """``(raw bytes, rows)`` of each gzip member of a segment (what the learner rewrites on a
    resume); a torn or corrupt last member gives ``None`` rows and ends the file. A member past
    the cap (:class:`Members`) or holding a line that is not a JSON object is an
    :class:`UnsafeFileError` naming ``what``."""
    members = Members(data, max_text=max_text)
    for m in members:
        yield data[m.offset: m.offset + m.length], member_rows(m.text, what, strict=True, offset=m.offset)
    if members.bomb:
        raise UnsafeFileError(f"{what} {members.problem.split(';')[0]}: refused")
    if members.problem:
        yield data[members.end:], None


def read_replay_log(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every row of a run's replay log, oldest first (a torn last member skipped; any other damage
    an :class:`UnsafeFileError` naming the segment)."""
    rows: list[dict[str, Any]] = []
    for path in segment_paths(run_dir):
        for _, lines in read_members(read_segment(path), what=str(path)):
            rows.extend(lines or [])
    return rows
