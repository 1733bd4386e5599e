"""Reading run folders for the viewer, tolerant of damage.

A run folder (written by ``train.py``) holds ``config.yaml``, ``metrics.jsonl`` (one JSON object
per line, ``kind`` = train / eval / warmup), ``summary.json`` / ``summary.txt`` when finished,
``curves.png``, ``eval/<phase>/records.jsonl`` and ``checkpoints/iter_NNNNNN/`` (a ``model``
folder and a ``manifest.json`` of every file's size and SHA-256, written last).

Nothing here raises on a damaged or hostile folder: every problem becomes a message in
:attr:`RunInfo.problems` (or a checkpoint's :attr:`~agents.runfolder.CheckpointInfo.problem`)
that a page shows. Every file is read as untrusted input (:mod:`agents.safeio`): only regular
files inside the viewer's root, never through a symbolic link in the file's own name, each
bounded in size (``agents.runfolder.MAX_BYTES``) and parsed with a bound on depth (and, for YAML,
on what aliases expand to). The metrics, the checkpoints and the replay log are read by
:mod:`agents.runfolder`, the readers the learner uses too.
"""

from __future__ import annotations

import logging
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.runfolder import (CHECKPOINTS, CONFIG, CURVES, MAX_BYTES, METRICS, REPLAY_LOG, SUMMARY, CheckpointInfo,
                              is_run_folder, read_metrics_lines, survey_checkpoints)
from agents.safeio import UnsafeFileError, inside, load_yaml, loads_json, read_text

logger = logging.getLogger(__name__)

#: Folders of a run that are never runs themselves (not descended into when looking for runs).
_NOT_RUNS = {CHECKPOINTS, "best", "eval", "reference", "tensorboard", "images", "gifs", "__pycache__", REPLAY_LOG,
             "wandb"}


#: Settings shown at the top of a run page (the whole config.yaml is below them).
KEY_SETTINGS = ("env_id", "model", "seed", "context", "pretrain_steps", "tasks_per_iter", "group_size", "iterations",
                "time_budget", "advantage", "loss", "lr", "kl_coef", "replay", "replay_ratio", "priority", "alpha", "tau",
                "beta")


class ViewError(Exception):
    """Something the user asked for cannot be shown; the message says why and what to do."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def find_runs(root: Path, max_depth: int = 3) -> list[Path]:
    """Run folders under ``root`` (itself included), down to ``max_depth`` levels, sorted by path.

    Sweeps nest runs one level deeper (``runs/<sweep>/<setting>__s<seed>``), so a few levels are
    searched; hidden folders, the inner folders of a run and links to folders outside ``root``
    are skipped.
    """
    found: list[Path] = []

    def walk(folder: Path, depth: int) -> None:
        if is_run_folder(folder):
            found.append(folder)
        if depth >= max_depth:
            return
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and (not p.is_symlink() or inside(p, root)))
        except OSError as exc:
            logger.warning("cannot list %s: %s", folder, exc)
            return
        for child in children:
            if child.name.startswith(".") or child.name in _NOT_RUNS:
                continue
            walk(child, depth + 1)

    walk(root, 0)
    return found


def finite(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None, recursively (JSON for a browser)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _clip(text: str, n: int = 80) -> str:
    text = text.strip()
    return text if len(text) <= n else text[:n] + "..."


@dataclass
class RunInfo:
    """What a page shows about one run folder."""

    name: str  # the path relative to the viewer's root, with '/'
    path: Path
    config: dict[str, Any] = field(default_factory=dict)
    config_text: str = ""
    summary: dict[str, Any] | None = None
    summary_text: str = ""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    metrics_problems: list[str] = field(default_factory=list)  # the lines of metrics.jsonl that were skipped
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)  # eval/<phase> folders holding records.jsonl

    @property
    def env_id(self) -> str:
        return str(self.config.get("env_id") or "")

    @property
    def key_settings(self) -> list[tuple[str, Any]]:
        """The settings that tell runs apart, in a fixed order (those the config has)."""
        return [(k, self.config[k]) for k in KEY_SETTINGS if k in self.config]

    @property
    def has_curves(self) -> bool:
        """Whether the run has a ``curves.png`` the viewer serves (a regular file, not a link)."""
        try:
            return stat.S_ISREG(os.lstat(self.path / CURVES).st_mode)
        except OSError:
            return False

    @property
    def has_replay_log(self) -> bool:
        """Whether the run has a replay log (``replay_log/``, written by runs with replay)."""
        folder = self.path / REPLAY_LOG
        return folder.is_dir() and not folder.is_symlink()

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def verdict(self) -> str:
        return str((self.summary or {}).get("verdict", ""))

    @property
    def final(self) -> dict[str, Any]:
        """The delivered policy's final evaluation: ``selected`` where ``--select best`` kept
        another iteration than the last, else ``final`` (from the summary; for a run still going,
        the last eval line of the metrics)."""
        evals = (self.summary or {}).get("evals") or {}
        for key in ("selected", "final"):
            if isinstance(evals, dict) and isinstance(evals.get(key), dict):
                return evals[key]
        rows = [r for r in self.metrics if r.get("kind") == "eval"]
        return rows[-1] if rows else {}

    def _latest(self, summary_key: str, metric_key: str) -> int | None:
        """The summary's value, or the last metrics row's for a run still going."""
        if self.summary and summary_key in self.summary:
            return self.summary[summary_key]
        rows = [r for r in self.metrics if metric_key in r]
        return rows[-1][metric_key] if rows else None

    @property
    def iterations(self) -> int | None:
        return self._latest("iterations", "iteration")

    @property
    def episodes(self) -> int | None:
        return self._latest("episodes", "episodes")


def load_run(root: Path, path: Path) -> RunInfo:
    """Read a run folder; every unreadable part becomes a message in ``problems`` (never an
    exception: one bad run folder is shown as a bad run, the others are unaffected)."""
    try:
        name = path.relative_to(root).as_posix() if path != root else path.name
    except ValueError:
        name = path.name
    info = RunInfo(name=name, path=path)
    for part in (_read_config, _read_metrics, _read_summary, _read_checkpoints, _read_phases):
        try:
            part(root, info)
        except Exception as exc:  # a part that fails in an unforeseen way: shown, the rest still read
            logger.warning("reading %s: %s", path, exc, exc_info=True)
            info.problems.append(f"part of this run folder cannot be read ({type(exc).__name__}: {_clip(str(exc))})")
    return info


def _read_config(root: Path, info: RunInfo) -> None:
    cfg_path = info.path / CONFIG
    if not os.path.lexists(cfg_path):
        info.problems.append("no config.yaml in this run folder")
        return
    try:
        info.config_text = read_text(cfg_path, max_bytes=MAX_BYTES[CONFIG], root=root)
        loaded = load_yaml(info.config_text, what="config.yaml")
    except (OSError, UnsafeFileError) as exc:
        info.config_text = ""
        info.problems.append(f"config.yaml cannot be read: {exc}")
        return
    if isinstance(loaded, dict):
        info.config = {str(k): v for k, v in loaded.items()}
    else:
        info.problems.append("config.yaml does not hold a mapping of settings")


def _read_metrics(root: Path, info: RunInfo) -> None:
    metrics_path = info.path / METRICS
    if os.path.lexists(metrics_path):
        info.metrics, info.metrics_problems = read_metrics_lines(metrics_path, root)
        info.problems += info.metrics_problems


def _read_summary(root: Path, info: RunInfo) -> None:
    summary_path = info.path / SUMMARY
    if not os.path.lexists(summary_path):
        return
    try:
        loaded = loads_json(read_text(summary_path, max_bytes=MAX_BYTES[SUMMARY], root=root),
                            what="summary.json")
        if not isinstance(loaded, dict):
            raise UnsafeFileError("summary.json is not a JSON object")
    except (OSError, UnsafeFileError) as exc:
        info.problems.append(f"summary.json cannot be read ({exc}); the verdict is not shown")
        return
    info.summary = loaded
    info.summary_text = str(loaded.get("text", "")).strip("\n")
    kinds = {"verdict": str, "text": str, "evals": dict, "iterations": int, "episodes": int}
    odd = [k for k, kind in kinds.items() if k in loaded and not isinstance(loaded[k], kind)]
    if odd:
        info.problems.append(f"summary.json has values of unexpected types ({', '.join(odd)}); they are shown as found")


def _read_checkpoints(root: Path, info: RunInfo) -> None:
    info.checkpoints = survey_checkpoints(info.path / CHECKPOINTS, root)
    for ck in info.checkpoints:
        if ck.problem:
            info.problems.append(f"checkpoint {ck.name}: {ck.problem}")


def _read_phases(root: Path, info: RunInfo) -> None:
    eval_dir = info.path / "eval"
    if eval_dir.is_dir() and inside(eval_dir, root):
        info.phases = sorted(p.name for p in eval_dir.iterdir() if (p / "records.jsonl").is_file())


def safe_join(root: Path, rel: str) -> Path:
    """``root / rel`` resolved, refusing anything that leaves ``root`` (``..``, absolute paths,
    links out) or that is no path at all (a NUL byte)."""
    rel = rel.strip("/")
    if "\x00" in rel or len(rel) > 4096:
        raise ViewError(f"{_clip(rel)!r} is not a path", status=404)
    try:
        target = (root / rel).resolve() if rel else root.resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # a link loop, a name too long
        raise ViewError(f"{_clip(rel)!r} cannot be opened ({exc})", status=404) from None
    base = root.resolve()
    if target != base and base not in target.parents:
        raise ViewError(f"{rel!r} is outside the folder this viewer serves", status=404)
    return target


def newest_model_folder(run: RunInfo) -> Path | None:
    """A folder with this run's tokenizer: its newest complete checkpoint's model, else ``reference``."""
    for ck in reversed(run.checkpoints):
        if ck.ok and ck.model_path.is_dir():
            return ck.model_path
    ref = run.path / "reference"
    return ref if (ref / "config.json").is_file() else None

