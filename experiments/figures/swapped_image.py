"""Is the picture needed? The figure tasks with each episode's image replaced by another problem's.

Importing this file registers ``figures/ChartQASwapped-v0`` and ``figures/GeometryVisionSwapped-v0``:
the same problems, text and answers as ``freshper/ChartQA-v0`` and ``freshper/GeometryVision-v0``
for the same seed, but the picture is that of a second problem of the same preset, drawn after the
first from the same seeded RNG (the tasks' ``picture="another"``, which a run's own evaluations
also play: ``envs.capabilities.OtherPicture``). A policy that reads the values off the picture falls towards
what a picture-blind one scores; one that ignores the picture scores the same on both.

    python -m agents.evaluate --import experiments/figures/swapped_image.py --env figures/ChartQASwapped-v0 \\
        --model runs/<run>/checkpoints/iter_NNNNNN/model --episodes 200 --kw preset=easy
    python -m agents.evaluate --env freshper/ChartQA-v0 --model ... --episodes 200 --kw preset=easy   # the same seeds
"""

from __future__ import annotations

from envs import register
from envs.chartqa import ChartQAEnv
from envs.geometry import GeometryVisionEnv
from envs.registry import registered_tasks

_ids = {s.id for s in registered_tasks()}
if "figures/ChartQASwapped-v0" not in _ids:
    register("figures/ChartQASwapped-v0", ChartQAEnv, kwargs=ChartQAEnv.other_picture_kwargs(),
             description="ChartQA with each episode's chart replaced by another problem's (is the picture needed?).")
if "figures/GeometryVisionSwapped-v0" not in _ids:
    register("figures/GeometryVisionSwapped-v0", GeometryVisionEnv, kwargs=GeometryVisionEnv.other_picture_kwargs(),
             description="GeometryVision with each episode's diagram replaced by another problem's.")
