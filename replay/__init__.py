"""Freshness-aware prioritized experience replay (numpy only; items are opaque payloads).

See docs/design.md#freshness-aware-replay-without-a-refresh-pass-replay.
"""

from .buffer import MODES, ReplayBuffer, ReplaySample
from .persistence import DefaultCodec, ItemCodec, ReplayCheckpointError
from .priorities import abs_advantage_priority, abs_return_priority, function_priority
from .sum_tree import MinTree, SumTree

__all__ = [
    "MODES",
    "DefaultCodec",
    "ItemCodec",
    "MinTree",
    "ReplayBuffer",
    "ReplayCheckpointError",
    "ReplaySample",
    "SumTree",
    "abs_advantage_priority",
    "abs_return_priority",
    "function_priority",
]
