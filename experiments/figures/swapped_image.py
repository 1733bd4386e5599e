"""Is the picture needed? The figure tasks with each episode's image replaced by another problem's.

Importing this file registers ``figures/ChartQASwapped-v0`` and ``figures/GeometryVisionSwapped-v0``:
the same problems, text and answers as ``freshper/ChartQA-v0`` and ``freshper/GeometryVision-v0``
for the same seed, but the picture is that of a second problem of the same preset, drawn after the
first from the same seeded RNG. A policy that reads the values off the picture falls towards
what a picture-blind one scores; one that ignores the picture scores the same on both.

    python -m agents.evaluate --import experiments/figures/swapped_image.py --env figures/ChartQASwapped-v0 \\
        --model runs/<run>/checkpoints/iter_NNNNNN/model --episodes 200 --kw preset=easy
    python -m agents.evaluate --env freshper/ChartQA-v0 --model ... --episodes 200 --kw preset=easy   # the same seeds
"""

from __future__ import annotations

from typing import Any

from envs import register
from envs.chartqa import ChartQAEnv
from envs.figure_qa import Problem
from envs.geometry import GeometryVisionEnv
from envs.registry import registered_tasks


class _Swapped:
    """Mixin: the picture shows ``self.decoy``, another problem of the preset."""

    decoy: Problem

    def _reset_task(self, options: dict[str, Any] | None) -> None:
        super()._reset_task(options)  # type: ignore[misc]
        self.decoy = self.draw_problem(self.np_random, self.preset)  # type: ignore[attr-defined]

    def render_image(self):
        if self._image is None:  # type: ignore[has-type]
            self._image = self.draw_figure(getattr(self, "decoy", self.problem), self.image_size)  # type: ignore[attr-defined]
        return self._image.copy()


class ChartQASwappedEnv(_Swapped, ChartQAEnv):
    pass


class GeometryVisionSwappedEnv(_Swapped, GeometryVisionEnv):
    pass


_ids = {s.id for s in registered_tasks()}
if "figures/ChartQASwapped-v0" not in _ids:
    register("figures/ChartQASwapped-v0", ChartQASwappedEnv,
             description="ChartQA with each episode's chart replaced by another problem's (is the picture needed?).")
if "figures/GeometryVisionSwapped-v0" not in _ids:
    register("figures/GeometryVisionSwapped-v0", GeometryVisionSwappedEnv,
             description="GeometryVision with each episode's diagram replaced by another problem's.")
