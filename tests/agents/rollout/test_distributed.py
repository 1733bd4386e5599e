"""Shards of whole task groups and the weight format of rollout workers (no Ray needed):
one shard is the plain runner exactly; shards cover every task once with their own seeds and
group ids; weights round-trip through numpy (bf16 included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agents.policies.spec import PolicySpec
from agents.rollout.collector import build_collector
from agents.rollout.shards import ShardedCollector, plan_shards
from agents.rollout.transfer import load_numpy_state, read_folder, state_to_numpy, write_folder
from agents.policies.policy import Policy
from agents.rollout.runner import RolloutSettings, Runner
from agents.rollout.seeds import shard_rng_seed
from agents.policies.tiny import build_tiny_model

LAKE = RolloutSettings("freshper/FrozenLake-v0", {"feedback": False}, "window:0", group_size=2, max_new_tokens=4,
                     max_context_tokens=1024)


@pytest.fixture(scope="module")
def policy() -> Policy:
    torch.set_num_threads(1)
    return Policy.from_pretrained(build_tiny_model("text"))


def _blobs(records) -> list[bytes]:
    return [r.to_bytes() for r in records]


def test_shards_split_whole_tasks_with_their_own_seeds_and_group_ids() -> None:
    shards = plan_shards([10, 11, 12, 13, 14], 2, rng_seed=7, group_base=40)
    assert [s.seeds for s in shards] == [(10, 11), (12, 13, 14)] or [s.seeds for s in shards] == [(10, 11, 12), (13, 14)]
    assert [t for s in shards for t in s.seeds] == [10, 11, 12, 13, 14]
    first = len(shards[0].seeds)
    assert [s.group_base for s in shards] == [40, 40 + first]
    assert shards[0].rng_seed == 7 and shards[1].rng_seed == shard_rng_seed(7, first) != 7
    assert len(plan_shards([1, 2], 5, rng_seed=0, group_base=0)) == 2  # never an empty shard
    assert plan_shards([1, 2, 3], 1, rng_seed=5, group_base=3)[0].rng_seed == 5
    with pytest.raises(ValueError):
        plan_shards([1], 0, rng_seed=0, group_base=0)


def test_one_shard_is_the_plain_runner_exactly(policy) -> None:
    assert isinstance(build_collector(policy, "unused", LAKE, spec=PolicySpec(), seed=3), Runner)  # the default path is untouched
    runner = LAKE.runner(policy, seed=3)
    sharded = ShardedCollector(LAKE.runner(policy, seed=3), 1)
    a, _ = runner.collect([4, 5], policy_version=2, rng_seed=9, group_base=6)
    b, stats = sharded.collect([4, 5], policy_version=2, rng_seed=9, group_base=6)
    assert _blobs(a) == _blobs(b)
    assert stats["episodes"] == 4 and stats["wall_s"] > 0


def test_shards_are_independent_of_what_else_is_collected(policy) -> None:
    """A shard's records are a function of its own seeds: collecting it alone gives the same bytes."""
    sharded = ShardedCollector(LAKE.runner(policy, seed=0), 2)
    records, _ = sharded.collect([20, 21, 22, 23], policy_version=0, rng_seed=5, group_base=0)
    assert sorted({r.group_id for r in records}) == [0, 1, 2, 3]
    second = plan_shards([20, 21, 22, 23], 2, rng_seed=5, group_base=0)[1]
    alone, _ = LAKE.runner(policy, seed=99).collect(second.seeds, policy_version=0, rng_seed=second.rng_seed,
                                                   group_base=second.group_base)
    assert _blobs(records[4:]) == _blobs(alone)
    # ... while one batch of all four tasks is another sample (one sampling stream, other batch rows):
    # the shard, not the task, is what makes records reproducible
    together, _ = LAKE.runner(policy, seed=0).collect([20, 21, 22, 23], policy_version=0, rng_seed=5, group_base=0)
    assert _blobs(together) != _blobs(records)


def test_weights_round_trip_through_numpy_including_bf16(policy, tmp_path) -> None:
    import copy

    other = copy.deepcopy(policy.model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    state = state_to_numpy(other)
    assert all(isinstance(v, np.ndarray) for v in state.values())
    target = copy.deepcopy(policy.model)
    load_numpy_state(target, state)
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), other.state_dict().values()))
    half = copy.deepcopy(other).to(torch.bfloat16)
    bf = state_to_numpy(half)
    assert all(k.startswith("bf16:") for k in bf)
    back = copy.deepcopy(policy.model).to(torch.bfloat16)
    load_numpy_state(back, bf)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), half.state_dict().values()))
    with pytest.raises(ValueError, match="lack"):
        load_numpy_state(target, {k: v for k, v in state.items() if "layers.0." not in k})
    files = read_folder(build_tiny_model("text"))
    assert "config.json" in files and write_folder(files, tmp_path / "m").joinpath("config.json").exists()
