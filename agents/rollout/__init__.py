"""Rollouts: the runner that plays batches of episodes (``runner``), the seed scheme (``seeds``),
shards and Ray rollout workers (``distributed``) and episodes against an OpenAI-compatible
endpoint (``openai_eval``). They produce :mod:`agents.record`'s trajectories."""
