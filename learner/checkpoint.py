"""Atomic, verified training checkpoints, and the lock on a run folder.

A checkpoint is a folder ``checkpoints/iter_<NNNNNN>/`` written by the caller into a temporary
sibling folder, each file fsynced, a ``manifest.json`` (SHA-256 and size of every file) written
last, and the folder renamed into place with ``os.replace``. A run killed at any moment leaves
either the previous checkpoints or the new one complete, never a half-written one under the
final name. The run folder's layout, the manifest and the readers (listing, verifying a
checkpoint against its manifest, the metrics) are :mod:`agents.runfolder`'s, which the viewer
reads with too; :func:`verify_checkpoint` there fails a damaged checkpoint with a clear message
instead of a confusing unpickling error deep in torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from agents.runfolder import (CHECKPOINT_NAME, CHECKPOINTS, MANIFEST, METRICS, RUN_FILES, TEMPORARY, CheckpointError,
                              checkpoint_name, fsync_path, list_checkpoints, load_metrics, verify_checkpoint,
                              write_manifest)
from agents.safeio import UnsafeFileError, open_nofollow

logger = logging.getLogger(__name__)


#: What a full disk (or quota) says: errno, or the text libraries that wrap it keep (safetensors'
#: "I/O error: No space left on device (os error 28)", torch's stream writer).
_DISK_FULL_ERRNOS = (28, 122)  # ENOSPC, EDQUOT
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")


def disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from or during) is a full disk."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
            return True
        if any(t in str(exc) for t in _DISK_FULL_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _nearly_full(path: Path) -> bool:
    """Whether the file system of ``path`` has (almost) no room left: under 1 MiB available."""
    try:
        return shutil.disk_usage(path).free < (1 << 20)
    except OSError:
        return False


class DiskFullError(RuntimeError):
    """The disk filled while a run wrote; the message says what is intact and how to go on."""


def disk_full_error(run_dir: Path, exc: BaseException) -> DiskFullError:
    """The clear error for a run whose disk filled: what failed, and that its complete
    checkpoints are intact (written whole or not at all), so it resumes once there is space."""
    done = list_checkpoints(run_dir / CHECKPOINTS)
    what = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    then = (f"its last complete checkpoint, {done[-1].name}, is intact: free space, then resume with "
            f"python train.py --resume {run_dir}" if done else
            f"it has no checkpoint yet: free space, then start it again (another --run-name, or remove {run_dir})")
    return DiskFullError(f"the disk is full ({what}) while writing the run {run_dir}; {then}")


class RunFolderError(ValueError):
    """A run folder that cannot be used safely (a planted symbolic link where train.py writes)."""


def save_checkpoint(root: str | os.PathLike, iteration: int, write: Callable[[Path], None], keep: int = 2) -> Path:
    """Write a checkpoint atomically and keep only the newest ``keep`` ones.

    Args:
        root: the checkpoints folder (created if needed).
        iteration: the iteration counter that names the checkpoint.
        write: fills the given (empty, temporary) folder with the checkpoint's files.
        keep: how many checkpoints to keep; older ones are deleted after the new one is in place.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(iteration)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write(tmp)
        write_manifest(tmp, iteration)
        if final.exists():  # re-saving an iteration (e.g. after a resume): move the old one aside
            old = root / f".old-{final.name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_path(root)
    except BaseException as exc:
        full = isinstance(exc, Exception) and not disk_full(exc) and _nearly_full(root)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:  # torch's stream writer says "iostream error", not what filled
            raise OSError(errno.ENOSPC, f"No space left on device while writing checkpoint {final.name}: {exc}") from exc
        raise
    for old in list_checkpoints(root)[: -keep if keep > 0 else None]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def verify_resume(path: str | os.PathLike) -> dict[str, Any]:
    """What ``--resume`` checks before anything is written: the checkpoint against its manifest
    (:func:`agents.runfolder.verify_checkpoint`) and the run's ``metrics.jsonl``, which a resume
    rewrites from its lines: every line must be a JSON object (a torn last line, from a kill
    mid-write, excepted), else a :class:`CheckpointError` names the file and the line."""
    manifest = verify_checkpoint(path)
    metrics = Path(path).parent.parent / METRICS
    if not os.path.lexists(metrics):
        return manifest
    try:
        damaged = load_metrics(metrics, name=str(metrics)).damaged
    except (UnsafeFileError, OSError) as exc:
        raise CheckpointError(f"{metrics} cannot be read to resume: {exc}") from None
    if damaged:
        raise CheckpointError(f"{damaged}: a resume rewrites metrics.jsonl from its lines, so it stops here; "
                              "fix or delete that line and resume again")
    return manifest




def resolve_resume(path: str | os.PathLike) -> Path:
    """``--resume`` accepts a checkpoint folder, a ``checkpoints/`` folder or a run folder;
    return the checkpoint to load (the newest one in the last two cases)."""
    path = Path(path)
    if (path / MANIFEST).exists() or CHECKPOINT_NAME.match(path.name):
        return path
    for root in (path / CHECKPOINTS, path):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise CheckpointError(f"no checkpoint found in {path} (expected iter_NNNNNN folders or a checkpoints/ folder)")


@contextlib.contextmanager
def loading(path: str | os.PathLike, what: str = "the model") -> Iterator[None]:
    """Turn a failure to load weights or state (corrupt safetensors, a pickle that is not one, a
    malformed ``config.json``, a missing file) into a :class:`CheckpointError` that names
    ``path`` and the problem in one line, instead of a traceback from deep in a loader."""
    import pickle

    try:
        yield
    except CheckpointError:
        raise
    except (OSError, ValueError, RuntimeError, EOFError, KeyError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"{what} at {path} cannot be loaded: {type(exc).__name__}: {_first_line(exc)}") from exc
    except Exception as exc:
        if type(exc).__name__ != "SafetensorError":  # safetensors' own error class, not importable by a stable name
            raise
        raise CheckpointError(f"{what} at {path} cannot be loaded: corrupt safetensors ({_first_line(exc)})") from exc


def _first_line(exc: BaseException, n: int = 300) -> str:
    text = str(exc).strip().split("\n")[0]
    return text if len(text) <= n else text[:n] + "..."


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states in a form ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])


class RunLock:
    """An exclusive lock on a run folder for the life of one ``train.py`` process.

    A second process that opens the same run folder (two ``--run-name dup`` started together,
    or a resume while the run still trains) is refused with :class:`FileExistsError`. The lock
    is the kernel's (``flock``), so a killed process never leaves a stale one. Taking it also
    removes temporary checkpoint folders that a killed writer left behind.

    The lock file is opened without following a symbolic link (``O_NOFOLLOW``), and a link at
    any name in :data:`RUN_FILES` refuses the start (:class:`RunFolderError`), so a planted
    ``.lock`` or ``config.yaml`` link never truncates its target. A start that fails leaves no
    trace: releasing the lock of a folder that holds nothing else removes the lock file and the
    folders the lock created.
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        run_dir = Path(run_dir)
        self.run_dir = run_dir
        self._created = _missing_parents(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._fh = self._take(run_dir)
        except BaseException:
            self._remove_created()
            raise
        removed = clean_stale_temporaries(run_dir / CHECKPOINTS)
        if removed:
            logger.info("removed %d temporary checkpoint folder(s) left by an interrupted run", removed)

    @staticmethod
    def _take(run_dir: Path):
        linked = [name for name in RUN_FILES if (run_dir / name).is_symlink()]
        if linked:
            raise RunFolderError(f"{run_dir} holds symbolic links where train.py writes ({', '.join(linked)}): "
                                 "refusing to write through them to their targets; remove them or pick another "
                                 "--run-name")
        path = run_dir / ".lock"
        for _ in range(100):
            try:
                fh = open_nofollow(path, "a+")
            except OSError as exc:
                raise RunFolderError(f"cannot use {path} as the run's lock: {exc.strerror or exc}") from None
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                fh.seek(0)
                holder = fh.read(200).strip() or "another process"
                fh.close()
                raise FileExistsError(f"{run_dir} is in use by {holder}: wait for it to finish or pick another "
                                      "--run-name") from None
            try:  # a failed start removes its lock file: make sure ours is still the one at the path
                same = os.path.samestat(os.fstat(fh.fileno()), os.lstat(path))
            except FileNotFoundError:
                same = False
            if same:
                fh.seek(0)
                fh.truncate()
                fh.write(f"train.py pid {os.getpid()}")
                fh.flush()
                return fh
            fh.close()
            run_dir.mkdir(parents=True, exist_ok=True)
        raise FileExistsError(f"{run_dir}/.lock keeps being replaced: another process is starting and failing there")

    def _remove_created(self) -> None:
        for folder in reversed(self._created):  # deepest first; only empty ones go
            try:
                folder.rmdir()
            except OSError:
                break

    def release(self) -> None:
        if self._fh.closed:
            return
        try:
            if [p.name for p in self.run_dir.iterdir()] == [".lock"]:  # a start that wrote nothing: leave no trace
                (self.run_dir / ".lock").unlink()
                self.run_dir.rmdir()
                self._created = [p for p in self._created if p != self.run_dir]
                self._remove_created()
        except OSError as exc:
            logger.debug("leaving %s in place: %s", self.run_dir, exc)
        fcntl.flock(self._fh, fcntl.LOCK_UN)
        self._fh.close()


def _missing_parents(folder: Path) -> list[Path]:
    """The folders that ``mkdir(parents=True)`` would create for ``folder``, outermost first."""
    missing = []
    for p in [folder, *folder.parents]:
        if os.path.lexists(p):
            break
        missing.append(p)
    return missing[::-1]


def clean_stale_temporaries(root: str | os.PathLike) -> int:
    """Delete ``.tmp-*`` / ``.old-*`` folders under a checkpoints folder (call with the run lock
    held: then no writer is using them); return how many went."""
    root = Path(root)
    if not root.is_dir():
        return 0
    stale = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(TEMPORARY)]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return len(stale)
