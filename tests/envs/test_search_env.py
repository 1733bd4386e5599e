"""SearchQAEnv with in-process BM25: rewards, limits, parsing, data files, batching, checker."""

from __future__ import annotations

import json
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401  (registers freshper/SearchQA-v0)
from envs.search import (
    BM25Retriever,
    Passage,
    Question,
    RetrievalError,
    SearchQAEnv,
    batch_search,
    kb,
    load_corpus,
    load_questions,
)


pytestmark = pytest.mark.usefixtures("search_cache")  # generated files stay out of the tree


@pytest.fixture()
def env() -> SearchQAEnv:
    return SearchQAEnv(max_turns=6, max_searches=2)


def _gold(env: SearchQAEnv) -> str:
    return env.question.golden_answers[0]


def test_make_with_no_arguments_serves_the_default_corpus() -> None:
    e = gym.make("freshper/SearchQA-v0")
    obs, info = e.reset(seed=0)
    assert "<search>" in info["instructions"] and "<answer>" in info["instructions"]
    assert f"Question: {info['question']}" in obs["text"]
    e.close()


def test_correct_answer_after_one_search_scores_one(env: SearchQAEnv) -> None:
    env.reset(seed=1)
    obs, reward, terminated, truncated, info = env.step(f"Let me look. <search>{env.question.question}</search>")
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert obs["text"].startswith("<information>\nDoc 1 (Title: ")
    assert info["searches"] == 1
    obs, reward, terminated, truncated, info = env.step(f"<answer>{_gold(env).upper()}</answer>")
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["em"] == 1.0 and info["f1"] == 1.0 and info["success"] is True


@pytest.mark.parametrize("answer", [".", "", "the", "wrong answer", "SUBSTRING"])
def test_empty_wrong_and_substring_answers_score_zero(env: SearchQAEnv, answer: str) -> None:
    env.reset(seed=2)
    if answer == "SUBSTRING":
        answer = _gold(env)[:-2]
    _, reward, terminated, _, info = env.step(f"<answer>{answer}</answer>")
    assert reward == 0.0 and terminated and info["em"] == 0.0 and info["success"] is False


def test_searching_past_the_limit_ends_the_episode_with_zero(env: SearchQAEnv) -> None:
    env.reset(seed=3)
    for n in range(2):
        _, _, terminated, _, info = env.step(f"<search>query {n}</search>")
        assert not terminated and info["searches"] == n + 1
    _, reward, terminated, truncated, info = env.step("<search>one more</search>")
    assert (reward, terminated, truncated) == (0.0, True, False)
    assert info["search_limit"] is True and info["searches"] == 2


def test_turn_limit_truncates(env: SearchQAEnv) -> None:
    env.reset(seed=4)
    for _ in range(5):
        assert env.step("no tag")[3] is False
    _, _, terminated, truncated, _ = env.step("still no tag")
    assert truncated and not terminated


def test_reply_without_tags_is_invalid_and_changes_nothing(env: SearchQAEnv) -> None:
    env.reset(seed=5)
    for reply in ["I don't know", "<search>   </search>", "<answer>unclosed"]:
        obs, reward, terminated, _, info = env.step(reply)
        assert info["action_is_valid"] is False and reward == env.format_penalty and not terminated
        assert obs["text"].startswith("Invalid reply:") and info["searches"] == 0


def test_search_before_answer_in_one_reply_searches(env: SearchQAEnv) -> None:
    env.reset(seed=6)
    _, _, terminated, _, info = env.step(f"<search>x y</search><answer>{_gold(env)}</answer>")
    assert not terminated and info["searches"] == 1


def test_megabyte_reply_is_fast_and_long_queries_are_cut(env: SearchQAEnv) -> None:
    env.reset(seed=7)
    start = time.perf_counter()
    env.step("<search>" * 100_000 + "x" * 200_000)
    env.step("<search>" + "word " * 200_000 + "</search>")
    assert time.perf_counter() - start < 2.0
    assert len(env.pending_query("<search>" + "a" * 10_000 + "</search>")) == env.max_query_chars


def test_reset_is_deterministic_in_the_seed_and_index_option() -> None:
    a, b = SearchQAEnv(), SearchQAEnv()
    assert a.reset(seed=11)[0] == b.reset(seed=11)[0]
    a.reset(options={"index": 5})
    assert a.question == a.questions[5]


def test_passages_are_numbered_and_truncated() -> None:
    e = SearchQAEnv(passage_chars=10)
    text = e.format_passages([Passage("1", "T", "x" * 50), Passage("2", "U", "short")])
    assert text == "<information>\nDoc 1 (Title: T) xxxxxxxxxx...\nDoc 2 (Title: U) short\n</information>"


def test_render_ansi_shows_the_transcript() -> None:
    e = SearchQAEnv(render_mode="ansi")
    e.reset(seed=8)
    e.step("<search>anything</search>")
    e.step(f"<answer>{_gold(e)}</answer>")
    text = e.render()
    assert text.startswith("Question: ") and "search: anything" in text and "-> correct" in text


def test_check_env_passes() -> None:
    check_env(gym.make("freshper/SearchQA-v0", render_mode="ansi").unwrapped)
    check_env(gym.make("freshper/SearchQA-v0").unwrapped)  # no render mode: the default


def test_default_kb_is_deterministic_cached_and_answers_are_in_the_corpus(search_cache: Path) -> None:
    start = time.perf_counter()
    corpus, splits = kb.generate(seed=5)
    assert time.perf_counter() - start < 2.0
    assert (corpus, splits) == kb.generate(seed=5)
    assert 300 <= len(corpus) <= 2000 and len(splits["test"]) > 100
    assert not {q["question"] for q in splits["train"]} & {q["question"] for q in splits["test"]}
    text = " ".join(p["contents"] for p in corpus)
    assert all(q["golden_answers"][0] in text for q in splits["train"] + splits["test"])
    assert {q["hops"] for q in splits["train"]} == {1, 2}
    paths = kb.default_paths()
    assert str(paths["corpus"]).startswith(str(search_cache)) and paths["corpus"].exists()


def test_a_two_hop_question_is_answerable_by_two_searches() -> None:
    e = SearchQAEnv()
    q = next(i for i, q in enumerate(e.questions) if q.question.startswith("In which country is the company founded by"))
    e.reset(options={"index": q})
    person = e.question.question.split("founded by ")[1].removesuffix(" headquartered?")
    obs = e.step(f"<search>{person} founded company</search>")[0]["text"]
    company = obs.split("founded the company ")[1].split(",")[0]
    obs = e.step(f"<search>{company} headquartered</search>")[0]["text"]
    assert _gold(e) in obs


def test_question_files_load_from_jsonl_and_parquet(tmp_path: Path) -> None:
    rows = [{"id": "q1", "question": "Who?", "golden_answers": ["A", "B"]},
            {"question": "Where?", "golden_answers": "C"}]
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    parquet = tmp_path / "q.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "q1", "question": "Who?", "golden_answers": ["A", "B"]},
                                         {"id": "1", "question": "Where?", "golden_answers": ["C"]}]), parquet)
    expected = [Question("Who?", ("A", "B"), "q1"), Question("Where?", ("C",), "1")]
    assert load_questions(jsonl) == expected == load_questions(parquet)
    e = SearchQAEnv(questions=str(parquet))
    e.reset(options={"index": 1})
    assert e.step("<answer>c</answer>")[1] == 1.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "x"}\n')
    with pytest.raises(ValueError, match="golden_answers"):
        load_questions(bad)


def test_user_corpus_file_is_indexed_and_cached(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "contents": "\\"Zed\\"\\nZed is a river."}\n{"id": "b", "title": "Ox", "text": "An ox."}\n')
    assert load_corpus(corpus) == [("a", "Zed", "Zed is a river."), ("b", "Ox", "An ox.")]
    first = BM25Retriever(corpus, cache_dir=tmp_path / "idx")
    assert len(list((tmp_path / "idx").iterdir())) == 1
    again = BM25Retriever(corpus, cache_dir=tmp_path / "idx")
    assert again.search(["river"], 3) == first.search(["river"], 3)
    assert [p.id for p in first.search(["river"], 3)[0]] == ["a"] and first.search(["the"], 3) == [[]]


class _CountingRetriever:
    def __init__(self, inner: BM25Retriever | None = None, fail: bool = False) -> None:
        self.inner, self.fail, self.calls = inner, fail, []

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        self.calls.append(list(queries))
        if self.fail:
            raise RetrievalError("service down")
        return self.inner.search(queries, topk)


def test_batch_search_sends_one_call_per_turn_and_matches_solo_steps() -> None:
    base = SearchQAEnv()
    counting = _CountingRetriever(base.retriever)
    batch = [gym.wrappers.PassiveEnvChecker(SearchQAEnv(retriever=counting)) for _ in range(4)]
    solo = [SearchQAEnv(retriever=base.retriever) for _ in range(4)]
    for n, (b, s) in enumerate(zip(batch, solo)):
        b.reset(seed=n), s.reset(seed=n)
    replies = ["<search>Vete</search>", "<search>Vete</search>", "<answer>x</answer>", "no tag"]
    assert batch_search(batch, replies) == 1
    assert counting.calls == [["Vete"]]
    for b, s, reply in zip(batch, solo, replies):
        assert b.step(reply) == s.step(reply)
    assert counting.calls == [["Vete"]]  # the steps used the prefetched results


def test_failed_retrieval_marks_the_episode_failed_or_raises() -> None:
    e = SearchQAEnv(retriever=_CountingRetriever(fail=True))
    e.reset(seed=0)
    _, reward, terminated, truncated, info = e.step("<search>x</search>")
    assert (reward, terminated, truncated) == (0.0, False, True)
    assert info["failed"] is True and "service down" in info["error"]
    batched = SearchQAEnv(retriever=_CountingRetriever(fail=True))
    batched.reset(seed=0)
    batch_search([batched], ["<search>x</search>"])
    assert batched.step("<search>x</search>")[4]["failed"] is True
    strict = SearchQAEnv(retriever=_CountingRetriever(fail=True), on_retrieval_error="raise")
    strict.reset(seed=0)
    with pytest.raises(RetrievalError, match="service down"):
        strict.step("<search>x</search>")


def test_a_human_can_search_and_answer_through_the_play_cli() -> None:
    import io

    from envs.play import play

    probe = SearchQAEnv()
    probe.reset(seed=3)
    gold = probe.question.golden_answers[0]
    out = io.StringIO()
    summary = play("freshper/SearchQA-v0", seed=3, stdin=io.StringIO(f"<search>{probe.question.question}</search>\n{gold}\n"),
                   stdout=out)
    assert summary.success and summary.turns == 2 and summary.invalid_replies == 0
    assert "<information>" in out.getvalue()


def test_random_answers_are_names_places_or_years_from_the_passages_seen(env: SearchQAEnv) -> None:
    from envs.search.env import answer_candidates

    rng = np.random.default_rng(0)
    env.reset(seed=1)
    assert all(env.unwrapped.sample_reply(rng).startswith("<search>") for _ in range(20))  # nothing seen yet
    env.step(f"<search>{env.question.question}</search>")
    seen = answer_candidates(" ".join(env.unwrapped._seen_text))
    assert _gold(env) in seen and env.unwrapped.random_answers() == seen
    replies = [env.unwrapped.sample_reply(rng) for _ in range(400)]
    answers = {r[len("<answer>"):-len("</answer>")] for r in replies if r.startswith("<answer>")}
    assert 150 < sum(r.startswith("<answer>") for r in replies) < 250 and answers == set(seen)
    with pytest.raises(ValueError, match="random_answers must be one of"):
        SearchQAEnv(random_answers="gold")


def test_random_answers_from_the_best_passage_found_leave_out_the_question_names() -> None:
    from envs.search.env import answer_candidates

    text = ("Grebex Moumoutheind (born 1911) is a painter born in Megras, Tryshusk. The Shekrond clock "
            "was invented by Kremund Disath in 1979.")
    assert answer_candidates(text) == ["Grebex Moumoutheind", "Grebex", "Moumoutheind", "1911", "Megras", "Tryshusk",
                                       "Shekrond", "Kremund Disath", "Kremund", "Disath", "1979"]
    env = gym.make("freshper/SearchQA-v0", random_answers="best")
    rng = np.random.default_rng(0)
    env.reset(seed=1)  # a one-hop question: one search finds its answer
    task = env.unwrapped
    assert task.random_answers() == []
    assert all(task.sample_reply(rng).startswith("<search>") for _ in range(20))  # nothing seen yet
    question = task.question.question
    env.step(f"<search>{question}</search>")
    drawn = task.random_answers()
    assert task.question.golden_answers[0] in drawn  # the best passage of a search for the whole question holds the answer
    asked = set(question.rstrip("?").split())
    assert drawn and not any(set(c.split()) & asked for c in drawn)  # nothing the question already names
    top = task._seen_text[0]
    assert set(drawn) < set(answer_candidates(top)) < set(answer_candidates(" ".join(task._seen_text)))
    replies = [task.sample_reply(rng) for _ in range(400)]
    answers = {r[len("<answer>"):-len("</answer>")] for r in replies if r.startswith("<answer>")}
    assert 150 < sum(r.startswith("<answer>") for r in replies) < 250 and answers == set(drawn)
    env.step("<search>zzzz qqqq</search>")  # a search that finds nothing: every passage seen
    assert not task._last_titles
    everything = [c for c in answer_candidates(" ".join(task._seen_text)) if not set(c.split()) & asked]
    assert task.random_answers() == everything and set(drawn) < set(everything)