"""Reading run folders for the viewer, tolerant of damage.

A run folder (written by ``train.py``) holds ``config.yaml``, ``metrics.jsonl`` (one JSON object
per line, ``kind`` = train / eval / warmup), ``summary.json`` / ``summary.txt`` when finished,
``curves.png``, ``eval/<phase>/records.jsonl`` and ``checkpoints/iter_NNNNNN/`` (a ``model``
folder and a ``manifest.json`` of every file's size and SHA-256, written last).

Nothing here raises on a damaged folder: every problem becomes a message in
:attr:`RunInfo.problems` (or a checkpoint's :attr:`CheckpointInfo.problem`) that a page shows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

RUN_MARKERS = ("config.yaml", "metrics.jsonl", "summary.json")
CHECKPOINT_NAME = re.compile(r"^iter_(\d{6,})$")
#: Folders of a run that are never runs themselves (not descended into when looking for runs).
_NOT_RUNS = {"checkpoints", "best", "eval", "reference", "tensorboard", "images", "gifs", "__pycache__"}


#: Settings shown at the top of a run page (the whole config.yaml is below them).
KEY_SETTINGS = ("env_id", "model", "seed", "context", "pretrain_steps", "tasks_per_iter", "group_size", "iterations",
                "time_budget", "advantage", "loss", "lr", "kl_coef", "replay", "replay_ratio", "priority", "alpha", "tau",
                "beta")


class ViewError(Exception):
    """Something the user asked for cannot be shown; the message says why and what to do."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def is_run_folder(path: Path) -> bool:
    """Whether ``path`` looks like a ``train.py`` run folder."""
    return path.is_dir() and any((path / m).is_file() for m in RUN_MARKERS)


def find_runs(root: Path, max_depth: int = 3) -> list[Path]:
    """Run folders under ``root`` (itself included), down to ``max_depth`` levels, sorted by path.

    Sweeps nest runs one level deeper (``runs/<sweep>/<setting>__s<seed>``), so a few levels are
    searched; hidden folders and the inner folders of a run are skipped.
    """
    found: list[Path] = []

    def walk(folder: Path, depth: int) -> None:
        if is_run_folder(folder):
            found.append(folder)
        if depth >= max_depth:
            return
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir())
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


def read_metrics_lines(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The metric rows of a ``metrics.jsonl`` and a message for every line that could not be read.

    A corrupt line is skipped and named (line number and what is wrong); a torn last line is
    reported as what it usually is, a run killed or still writing.
    """
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return [], [f"{path.name} cannot be read: {exc}"]
    lines = text.split("\n")
    last = len(lines) - (1 if lines and lines[-1] == "" else 0)
    for lineno, line in enumerate(lines[:last], 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == last and not text.endswith("\n"):
                problems.append(f"{path.name} line {lineno} is incomplete (a run still writing, or killed mid-line) "
                                f"and was skipped")
            else:
                problems.append(f"{path.name} line {lineno} is not valid JSON and was skipped ({exc.msg} at "
                                f"column {exc.colno}): {_clip(line)}")
            continue
        if not isinstance(row, dict):
            problems.append(f"{path.name} line {lineno} is not a JSON object and was skipped: {_clip(line)}")
            continue
        rows.append(row)
    return rows, problems


def _clip(text: str, n: int = 80) -> str:
    text = text.strip()
    return text if len(text) <= n else text[:n] + "..."


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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_checkpoint(path: Path, *, hashes: bool = False) -> str:
    """What is wrong with a checkpoint folder against its ``manifest.json`` ('' if nothing).

    Sizes are always compared; ``hashes`` also recomputes every file's SHA-256 (what loading a
    checkpoint to play does).
    """
    if not path.is_dir():
        return f"{path} does not exist or is not a folder"
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        return (f"incomplete checkpoint: {path.name} has no manifest.json, which is written last "
                "(a run killed while saving it?)")
    try:
        files = json.loads(manifest_path.read_text(encoding="utf-8"))["files"]
        entries = [(rel, int(meta["size"]), str(meta["sha256"])) for rel, meta in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"corrupt checkpoint: {path.name}/manifest.json cannot be read ({exc})"
    for rel, size, sha in entries:
        p = path / rel
        if not p.is_file():
            return f"incomplete checkpoint: {path.name} is missing {rel}"
        actual = p.stat().st_size
        if actual != size:
            return (f"incomplete or damaged checkpoint: {path.name}/{rel} is {actual:,} bytes, its manifest says "
                    f"{size:,} (half-written?)")
        if hashes and _sha256(p) != sha:
            return f"damaged checkpoint: {path.name}/{rel} does not match its checksum (corrupt or modified)"
    return ""


def list_checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    """Every checkpoint of a run (oldest first), each with what is wrong with it; a temporary
    folder a writer left behind is listed as half-written."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    out: list[CheckpointInfo] = []
    for p in sorted(root.iterdir()):
        if not p.is_dir():
            continue
        m = CHECKPOINT_NAME.match(p.name)
        if m:
            out.append(CheckpointInfo(p.name, p, int(m.group(1)), check_checkpoint(p)))
        elif p.name.startswith((".tmp-", ".old-")):
            out.append(CheckpointInfo(p.name, p, None, "half-written checkpoint: a temporary folder of a save that was "
                                                         "interrupted or is still running; it is never loaded"))
    return sorted(out, key=lambda c: (c.iteration is None, c.iteration or 0, c.name))


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
        return (self.path / "curves.png").is_file()

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
    """Read a run folder; every unreadable part becomes a message in ``problems``."""
    import yaml

    name = path.relative_to(root).as_posix() if path != root else path.name
    info = RunInfo(name=name, path=path)
    cfg_path = path / "config.yaml"
    if cfg_path.is_file():
        try:
            info.config_text = cfg_path.read_text(encoding="utf-8", errors="replace")
            loaded = yaml.safe_load(info.config_text)
            if isinstance(loaded, dict):
                info.config = loaded
            else:
                info.problems.append("config.yaml does not hold a mapping of settings")
        except (OSError, yaml.YAMLError) as exc:
            info.problems.append(f"config.yaml cannot be read: {exc}")
    else:
        info.problems.append("no config.yaml in this run folder")
    metrics_path = path / "metrics.jsonl"
    if metrics_path.is_file():
        info.metrics, info.metrics_problems = read_metrics_lines(metrics_path)
        info.problems += info.metrics_problems
    summary_path = path / "summary.json"
    if summary_path.is_file():
        try:
            loaded = json.loads(summary_path.read_text(encoding="utf-8"))
            if not isinstance(loaded, dict):
                raise ValueError("not a JSON object")
            info.summary = loaded
            info.summary_text = str(loaded.get("text", "")).strip("\n")
        except (OSError, ValueError) as exc:
            info.problems.append(f"summary.json cannot be read ({exc}); the verdict is not shown")
    info.checkpoints = list_checkpoints(path)
    for ck in info.checkpoints:
        if ck.problem:
            info.problems.append(f"checkpoint {ck.name}: {ck.problem}")
    eval_dir = path / "eval"
    if eval_dir.is_dir():
        info.phases = sorted(p.name for p in eval_dir.iterdir() if (p / "records.jsonl").is_file())
    return info


def safe_join(root: Path, rel: str) -> Path:
    """``root / rel`` resolved, refusing anything that leaves ``root`` (``..``, absolute paths, links out)."""
    rel = rel.strip("/")
    target = (root / rel).resolve() if rel else root.resolve()
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

