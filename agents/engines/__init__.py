"""Generation engines outside the project's sampler: the vLLM engine (``vllm_client`` in the
trainer, ``vllm_server`` and ``vllm_engine`` in its own process) and an OpenAI-compatible server
of a checkpoint (``openai_server``)."""
