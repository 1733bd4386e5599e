"""Rollouts: the runner that plays batches of episodes (``runner``), the seed scheme (``seeds``),
shards of whole task groups (``shards``), weights as plain data (``transfer``), the sampling
engine's settings and the vLLM sampler factory (``engine``), Ray rollout workers (``workers``),
the choice among them (``collector``) and episodes against an OpenAI-compatible endpoint
(``openai_eval``). They produce :mod:`agents.record`'s trajectories."""
