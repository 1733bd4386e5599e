"""Other ecosystems' environments as freshper tasks.

- :mod:`envs.adapters.verifiers`: a verifiers environment (multi-turn through its
  ``env_response`` hook, reward from its rubric) as ``freshper/Verifiers-v0``
  (extra ``.[verifiers]``);
- :mod:`envs.adapters.openenv`: an OpenEnv environment server, played over its WebSocket
  session, as ``freshper/OpenEnv-v0`` (extra ``.[openenv]``).

Both are :class:`envs.adapters.external.ExternalEnv`: the task contract of an environment that
runs outside freshper and answers each reply. Each module imports its package when used, so ``import envs`` works without them; building
a task whose package is missing raises an ``ImportError`` that says what to install.
"""
