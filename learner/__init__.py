"""The learner: a run's settings (``config``), the run itself (``run``: setup -> start of RL ->
loop -> iteration -> finish, built by ``build``), the IS-corrected GRPO loss and updates,
pretraining, the run state, atomic checkpoints, evaluations and reporting (metrics, trackers,
curves, summary). ``train.py`` is the command line over :func:`learner.run.train`.
"""
