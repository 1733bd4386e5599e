"""``python -m agents.view [runs/]``: a local web app to look at runs, episodes and live play.

- :mod:`agents.view.runs` reads run folders (config, metrics, summary, curves, checkpoints,
  evaluation records) and says what is wrong with a damaged one instead of raising;
- :mod:`agents.view.episodes` turns trajectory records into what a page shows (turns, images,
  reply tokens with their behaviour log-probs);
- :mod:`agents.view.sessions` holds live play sessions: a task, a seed and a model, stepped by the
  model or by hand, saved as a record and a GIF;
- :mod:`agents.view.app` is the Starlette app (optional extra ``.[view]``), bound to loopback
  by default. docs/view.md describes the pages.

The viewer lives in ``agents`` and imports neither ``learner`` nor ``train``: it reads the
run folder formats (plain JSON lines, JSON, YAML, checkpoint manifests) itself.
"""
