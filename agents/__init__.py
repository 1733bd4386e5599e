"""The agent runner, by role (each layer imports only those before it; importing runs nothing):

- :mod:`agents.record`: the trajectory record every layer shares (and :mod:`agents.safeio`,
  reading files that may be hostile);
- :mod:`agents.policies`: policies (HF text and Qwen2-VL), chat rendering, the samplers, the
  embedded tiny models, LoRA, precision;
- :mod:`agents.engines`: generation outside the project's sampler (vLLM, an OpenAI-compatible
  server of a checkpoint);
- :mod:`agents.rollout`: the runner, the seed scheme, shards and Ray rollout workers, episodes
  against an endpoint;
- the commands and the UI: ``python -m agents.evaluate``, ``agents.play`` (with
  :mod:`agents.interactive`), ``agents.merge_lora`` and the browser viewer ``agents.view``.
"""
