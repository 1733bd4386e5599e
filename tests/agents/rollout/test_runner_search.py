"""Runner on the search task: a retriever that is down fails episodes cleanly; queries are batched."""

from __future__ import annotations

import socket

import pytest
import torch

pytest.importorskip("transformers")

from agents.policies.policy import Policy  # noqa: E402
from agents.rollout.runner import Runner  # noqa: E402
from agents.policies.tiny import build_tiny_model  # noqa: E402
from learner.advantages import assign_group_advantages  # noqa: E402

SEARCH = "freshper/SearchQA-v0"


pytestmark = pytest.mark.usefixtures("search_cache")  # generated files stay out of the tree


@pytest.fixture(scope="module")
def text_policy(search_cache):
    torch.set_num_threads(1)
    return Policy.from_pretrained(build_tiny_model("text", cache_dir=search_cache))


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _search_reply(obs, info, env) -> str:
    return "Let me look it up. <search>capital city</search>"


def test_unreachable_retriever_fails_episodes_with_zero_advantage(text_policy):
    url = f"http://127.0.0.1:{_closed_port()}"
    runner = Runner(text_policy, SEARCH, group_size=2, max_new_tokens=8,
                    env_kwargs={"retrieval_url": url, "retrieval_timeout": 0.5, "retrieval_retries": 0})
    try:
        records, stats = runner.collect([0, 1], policy_version=3, reply_fn=_search_reply)
    finally:
        runner.close()
    assign_group_advantages(records)  # what the learner does with every batch
    assert len(records) == 4 and stats["failed"] == 4
    for rec in records:
        assert rec.failed and rec.advantage == 0.0
        assert rec.num_turns == 1 and rec.info["end_reason"] == "failed"
        assert rec.policy_version == 3


class _CountingRetriever:
    """Wraps a retriever and records the query batches it is asked for."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[list[str]] = []

    def search(self, queries, topk):
        self.calls.append(list(queries))
        return self.inner.search(queries, topk)


def test_each_turn_sends_all_episodes_queries_in_one_retriever_call(text_policy):
    from envs.search import SearchQAEnv

    counting = _CountingRetriever(SearchQAEnv().retriever)
    runner = Runner(text_policy, SEARCH, group_size=3, max_new_tokens=8,
                    env_kwargs={"retriever": counting, "max_searches": 2, "max_turns": 3})
    try:
        records, stats = runner.collect([0, 1], policy_version=0, reply_fn=_search_reply)
    finally:
        runner.close()
    assert stats["failed"] == 0
    assert all(r.num_turns == 3 for r in records)
    # Two searching turns (the third is over the search limit): one call each, with every
    # episode's query (deduplicated: all six episodes ask the same thing).
    assert counting.calls == [["capital city"], ["capital city"]]


def test_copy_probe_tells_verbatim_searches_and_grounded_answers_from_garbled_ones(text_policy, tmp_path):
    """experiments/searchqa/search_copy_probe.py on records of the random agent (its searches are parts of
    the question, its answers spans of the passages) and of a policy that garbles both."""
    import numpy as np

    from agents.record import save_records
    from experiments.searchqa import search_copy_probe as probe
    rng = np.random.default_rng(0)
    garbled = iter(["<search>Zqxv Wrrt</search>", "<answer>Qqzz</answer>"] * 20)
    runner = Runner(text_policy, SEARCH, group_size=2, max_new_tokens=8)
    try:
        random_agent, _ = runner.collect([0, 1, 2], policy_version=0,
                                         reply_fn=lambda obs, info, env: env.unwrapped.sample_reply(rng))
        garbling, _ = runner.collect([0, 1, 2], policy_version=0, reply_fn=lambda obs, info, env: next(garbled))
    finally:
        runner.close()
    save_records(random_agent, tmp_path / "random")
    save_records(garbling, tmp_path / "garbled")
    good, bad = probe.probe(tmp_path / "random"), probe.probe(tmp_path / "garbled")
    assert good["searches"] > 0 and good["query_in_question"] == 1.0
    assert good["answers"] > 0 and good["answer_in_passages"] == 1.0
    assert bad["searches"] > 0 and bad["answers"] > 0
    assert bad["query_in_question"] == 0.0 and bad["answer_in_passages"] == 0.0 and bad["exact_match"] == 0.0
    # An archived folder (records.jsonl gzipped, as docs/data keeps them) reads the same.
    import gzip
    import shutil

    plain = tmp_path / "random" / "records.jsonl"
    with plain.open("rb") as src, gzip.open(plain.with_name("records.jsonl.gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    plain.unlink()
    assert probe.probe(tmp_path / "random") == good


def test_answer_probe_finds_the_passages_candidates_and_a_blind_model_at_the_uniform_share(text_policy):
    """experiments/searchqa/search_answer_probe.py: the candidates it scores are in the observation and not
    in the question, and a fresh (blind) model puts about the uniform share of its mass on them."""
    from experiments.searchqa import search_answer_probe as probe

    cases = probe.states(12)
    assert len(cases) == 12
    for text, own, _ in cases:
        question = text.rsplit("Question: ", 1)[1].split("\n")[0]
        assert len(own) >= 2 and all(c in text and c not in question for c in own)
    r = probe.probe(text_policy, cases)
    assert r["questions"] == 12 and 0.0 < r["uniform_share"] < 1.0
    assert abs(r["own_mass"] - r["uniform_share"]) < 0.15
