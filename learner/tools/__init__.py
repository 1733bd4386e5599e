"""Tools that run ``train.py`` over settings and seeds and read run folders back:
``python -m learner.tools TOOL [ARGS]`` (``python -m learner.tools`` lists them).

Each tool is a module with a ``main(argv)``: ``sweep`` and ``paper_table`` start runs, the others
read finished run folders (``metrics.jsonl`` or the archived ``.gz``, ``summary.json``,
``config.yaml``, checkpoints) and print or plot what they find.
"""
