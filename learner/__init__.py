"""Pieces of the learner that ``train.py`` composes: the IS-corrected GRPO loss, atomic
checkpoints, and run reporting (metrics, TensorBoard, curves, summary, board-reading probe).

Pure helpers with no training loop of their own; the loop lives in ``train.py``.
"""
