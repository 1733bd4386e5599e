"""The replay buffer's default settings, which are ``train.py``'s (``learner.state.ReplaySettings``
takes its defaults from here), so a buffer built with the defaults samples as a training run's does."""

#: priority exponent: ``P(i) ∝ (p_i * exp(-age_i / tau)) ** alpha``
ALPHA = 1.0
#: freshness decay in optimizer steps (the sampling half-life is ``tau * ln 2 / alpha``)
TAU = 10.0
#: floor of a base priority (``|R| + eps``, ``|A| + eps``)
EPS = 1e-2
#: importance-sampling exponent at the start, annealed linearly to ``BETA_FINAL``
BETA = 0.4
BETA_FINAL = 1.0
#: optimizer steps over which beta anneals
BETA_ANNEAL_STEPS = 1000
