"""The runner on a served task (``python -m envs.serve``): a batch's resets go as one request and
the episodes equal those played on the task in process."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from agents.policies.policy import Policy  # noqa: E402
from agents.policies.tiny import build_tiny_model  # noqa: E402
from agents.rollout.runner import Runner  # noqa: E402
from conftest import Served  # noqa: E402

LAKE = "freshper/FrozenLake-v0"


def test_a_collect_sends_its_resets_as_one_request_and_plays_as_in_process(search_cache) -> None:
    torch.set_num_threads(1)
    policy = Policy.from_pretrained(build_tiny_model("text", cache_dir=search_cache))
    with Served(LAKE) as served:
        service = served.server.service
        resets: list[int] = []  # per /batch request, the resets it carried
        batch = service.batch
        service.batch = lambda body, **kw: resets.append(sum(c.get("op") == "reset" for c in body["calls"])) or batch(body, **kw)
        try:
            remote = Runner(policy, "freshper/Remote-v0", group_size=3, max_new_tokens=8, seed=5,
                            env_kwargs={"url": served.url})
            records, _ = remote.collect([11, 12], policy_version=0, rng_seed=7)
            remote.close()
        finally:
            service.batch = batch
    assert [k for k in resets if k] == [6]  # the six resets went as one request
    local = Runner(policy, LAKE, group_size=3, max_new_tokens=8, seed=5)
    expected, _ = local.collect([11, 12], policy_version=0, rng_seed=7)
    local.close()
    assert [r.seed for r in records] == [r.seed for r in expected]
    for got, want in zip(records, expected):
        assert [t.observation for t in got.turns] == [t.observation for t in want.turns]
        assert [s.token_ids.tolist() for s in got.samples] == [s.token_ids.tolist() for s in want.samples]
        assert got.episode_return == want.episode_return
