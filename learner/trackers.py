"""Experiment trackers a run reports to (``--report-to``): TensorBoard, Weights & Biases, Trackio.

Each tracker takes the numbers :class:`learner.report.MetricsLogger` writes to ``metrics.jsonl``
(as ``<kind>/<name>``, against training episodes) and the replay figures of the replay log
(``replay/...`` scalars and the buffer's and drawn batches' age histograms). ``metrics.jsonl``
stays the run's own record either way.

- ``tensorboard``: event files in ``runs/<name>/tensorboard`` (the default);
- ``wandb``: a W&B run named after the run folder, its files in ``runs/<name>/wandb``; online
  with ``WANDB_API_KEY`` set or ``WANDB_MODE=online``, else offline (``wandb sync`` uploads it
  later). A resumed run continues the same W&B run (its id comes from the run folder);
- ``trackio``: Trackio's local store (``$TRACKIO_DIR``, default ``~/.cache/huggingface/trackio``),
  project ``$TRACKIO_PROJECT`` (default ``freshper``), run named after the run folder.

A tracker that cannot start (its package missing) is a clear error at the start of a run.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

logger = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb", "trackio")


def parse_report_to(value: str | Sequence[str] | None, tensorboard: bool = True) -> list[str]:
    """The trackers a ``--report-to`` value names (comma-separated; ``none`` for none), in
    :data:`TRACKERS` order. None means TensorBoard; ``--no-tensorboard`` takes TensorBoard out."""
    if value is None:
        names = ["tensorboard"]
    else:
        parts = value.split(",") if isinstance(value, str) else list(value)
        names = [p.strip().lower() for p in parts if p.strip()]
        if names == ["none"]:
            names = []
        bad = [n for n in names if n not in TRACKERS]
        if bad:
            raise ValueError(f"--report-to takes {'|'.join(TRACKERS)} (comma-separated) or none, got {', '.join(bad)}")
    if not tensorboard:
        names = [n for n in names if n != "tensorboard"]
    return [t for t in TRACKERS if t in names]


class TensorBoardTracker:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def histogram(self, key: str, values: np.ndarray, step: int) -> None:
        if len(values):
            self.writer.add_histogram(key, values, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path) -> None:
        import wandb

        self.wandb = wandb
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        run_id = "fp-" + hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "freshper"), name=run_dir.name, id=run_id,
                              dir=str(run_dir), mode=mode, resume="allow", reinit="create_new",
                              settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def histogram(self, key: str, values: np.ndarray, step: int) -> None:
        if len(values):
            self.run.log({key: self.wandb.Histogram(np.asarray(values))}, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    def __init__(self, run_dir: Path) -> None:
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "freshper"), name=run_dir.name,
                                resume="allow", embed=False, auto_log_gpu=False, auto_log_cpu=False)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def histogram(self, key: str, values: np.ndarray, step: int) -> None:
        if len(values):
            self.run.log({key: self.trackio.Histogram(np.asarray(values))}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_trackers(run_dir: str | os.PathLike, names: Sequence[str]) -> list[Any]:
    """The trackers ``names`` (:func:`parse_report_to`) for a run folder; ValueError naming the
    package to install for one that cannot be imported."""
    run_dir = Path(run_dir)
    classes = {"tensorboard": (TensorBoardTracker, "tensorboard"), "wandb": (WandbTracker, "wandb"),
               "trackio": (TrackioTracker, "trackio")}
    out = []
    for name in names:
        cls, package = classes[name]
        try:
            out.append(cls(run_dir))
        except ImportError as exc:
            if name == "tensorboard":  # the default: a dependency, but training goes on without it
                logger.warning("TensorBoard logging disabled: %s", exc)
                continue
            for t in out:
                t.close()
            raise ValueError(f"--report-to {name} needs the {package} package: pip install -e '.[trackers]' "
                             f"({exc})") from exc
    return out
