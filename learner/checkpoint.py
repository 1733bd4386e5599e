"""Atomic, verified training checkpoints.

A checkpoint is a folder ``checkpoints/iter_<NNNNNN>/`` written by the caller into a temporary
sibling folder, each file fsynced, a ``manifest.json`` (SHA-256 and size of every file) written
last, and the folder renamed into place with ``os.replace``. A run killed at any moment leaves
either the previous checkpoints or the new one complete, never a half-written one under the
final name. :func:`verify_checkpoint` rechecks the manifest so a damaged checkpoint fails with
a clear message instead of a confusing unpickling error deep in torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_NAME_RE = re.compile(r"^iter_(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:06d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root`` (oldest first); temporary folders are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME_RE.match(p.name))]
    return [p for _, p in sorted(found)]


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
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {
            "iteration": iteration,
            "files": {str(p.relative_to(tmp)): {"sha256": _sha256(p), "size": p.stat().st_size} for p in files},
        }
        for p in files:
            _fsync_path(p)
        with (tmp / MANIFEST).open("w", encoding="utf-8") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        for d in sorted({p.parent for p in files} | {tmp}):
            _fsync_path(d)
        if final.exists():  # re-saving an iteration (e.g. after a resume): move the old one aside
            old = root / f".old-{final.name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(root)[: -keep if keep > 0 else None]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check a checkpoint against its manifest; return the manifest or raise :class:`CheckpointError`."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a folder")
    mpath = path / MANIFEST
    if not mpath.exists():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it is incomplete (a run killed while writing?)")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt ({exc})") from exc
    for rel, meta in files.items():
        p = path / rel
        if not p.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {rel}")
        if p.stat().st_size != meta["size"] or _sha256(p) != meta["sha256"]:
            raise CheckpointError(
                f"checkpoint {path}: {rel} does not match its checksum (corrupt or modified); "
                f"resume from an older checkpoint in {path.parent}"
            )
    return manifest


def resolve_resume(path: str | os.PathLike) -> Path:
    """``--resume`` accepts a checkpoint folder, a ``checkpoints/`` folder or a run folder;
    return the checkpoint to load (the newest one in the last two cases)."""
    path = Path(path)
    if (path / MANIFEST).exists() or _NAME_RE.match(path.name):
        return path
    for root in (path / "checkpoints", path):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise CheckpointError(f"no checkpoint found in {path} (expected iter_NNNNNN folders or a checkpoints/ folder)")


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
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._fh = (run_dir / ".lock").open("a+", encoding="utf-8")
        try:
            fcntl.flock(self._fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._fh.seek(0)
            holder = self._fh.read().strip() or "another process"
            self._fh.close()
            raise FileExistsError(f"{run_dir} is in use by {holder}: wait for it to finish or pick another --run-name") from None
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.write(f"train.py pid {os.getpid()}")
        self._fh.flush()
        removed = clean_stale_temporaries(run_dir / "checkpoints")
        if removed:
            logger.info("removed %d temporary checkpoint folder(s) left by an interrupted run", removed)

    def release(self) -> None:
        if not self._fh.closed:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()


def clean_stale_temporaries(root: str | os.PathLike) -> int:
    """Delete ``.tmp-*`` / ``.old-*`` folders under a checkpoints folder (call with the run lock
    held: then no writer is using them); return how many went."""
    root = Path(root)
    if not root.is_dir():
        return 0
    stale = [p for p in root.iterdir() if p.is_dir() and p.name.startswith((".tmp-", ".old-"))]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return len(stale)
