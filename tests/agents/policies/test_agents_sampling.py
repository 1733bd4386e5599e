"""The text sampler: shared prefixes, repeated prompts and finished rows change nothing but speed."""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("transformers")

from agents.policies.policy import Policy  # noqa: E402
from agents.record import Sample  # noqa: E402
from agents.policies.tiny import build_tiny_model  # noqa: E402
from conftest import with_logit_bias  # noqa: E402


@pytest.fixture(scope="module")
def text_policy(tmp_path_factory):
    torch.set_num_threads(1)
    return Policy.from_pretrained(build_tiny_model("text", cache_dir=tmp_path_factory.mktemp("tiny-cache")))


@pytest.fixture(scope="module")
def eos_prone_policy(text_policy):
    """The tiny model with an EOS logit bias, so rows finish at different steps."""
    return with_logit_bias(text_policy, {text_policy.eos_token_id: 5.5}, name="eos-prone")


def _prompts(policy: Policy) -> list[list[int]]:
    chat = policy.chat
    a = chat.first_message("Reply with one move.\n\nP F\nH G")
    b = chat.first_message("Reply with one move.\n\nP F F\nF H G\nF F G")
    c = policy.tokenizer.encode("no chat prefix at all", add_special_tokens=False)
    return [a, b, a, c, a, b[:5], b]  # repeats, a shared prefix for some, none for all


def _check_logprobs(policy: Policy, prompts, gens) -> None:
    samples = [Sample(list(p) + g.token_ids, [0] * len(p) + [1] * len(g.token_ids),
                      [0.0] * len(p) + g.logprobs, []) for p, g in zip(prompts, gens)]
    with torch.no_grad():
        lp = policy.token_logprobs(samples)
    for b, (p, g) in enumerate(zip(prompts, gens)):
        got = lp[b, len(p): len(p) + len(g.token_ids)]
        assert torch.allclose(got, torch.tensor(g.logprobs), atol=1e-4), (got - torch.tensor(g.logprobs)).abs().max()


@pytest.mark.parametrize("greedy", [False, True])
def test_sampled_logprobs_match_a_fresh_forward_with_uneven_rows(eos_prone_policy, greedy):
    policy = eos_prone_policy
    prompts = _prompts(policy)
    torch.manual_seed(0)
    gens = policy.generate(prompts * 3, max_new_tokens=10, greedy=greedy)
    lengths = {len(g.token_ids) for g in gens}
    assert len(lengths) > 1 or greedy  # rows finished at different steps
    for g in gens:
        assert g.finished == (g.token_ids[-1] == policy.eos_token_id)
        assert policy.eos_token_id not in g.token_ids[:-1]
    _check_logprobs(policy, prompts * 3, gens)


def test_greedy_is_argmax_and_batching_changes_nothing(text_policy):
    prompts = _prompts(text_policy)
    together = text_policy.generate(prompts, max_new_tokens=6, greedy=True)
    for p, g in zip(prompts, together):
        alone = text_policy.generate([p], max_new_tokens=6, greedy=True)[0]
        assert alone.token_ids == g.token_ids
        assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(g.logprobs), atol=1e-5)
        with torch.no_grad():
            ids = torch.tensor([list(p) + g.token_ids])
            logits = text_policy.model(input_ids=ids).logits[0, len(p) - 1: -1]
        assert logits.argmax(-1).tolist() == g.token_ids


def test_same_seed_same_samples(text_policy):
    prompts = _prompts(text_policy)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append([(g.token_ids, g.logprobs) for g in text_policy.generate(prompts, max_new_tokens=6)])
    assert runs[0] == runs[1]
    assert len({tuple(ids) for ids, _ in runs[0]}) > 1


@pytest.mark.parametrize("greedy", [True, False])
def test_turn_cache_reuses_earlier_turns_without_changing_samples(eos_prone_policy, greedy):
    """A full-context turn that extends the last prompt + reply reuses its KV; same samples."""
    from agents.policies.sampling import TurnKVCache

    policy = eos_prone_policy
    prompts = _prompts(policy) * 2
    turn_cache = TurnKVCache()
    torch.manual_seed(1)
    first = policy.generate(prompts, max_new_tokens=8, greedy=greedy, turn_cache=turn_cache)
    follow = policy.chat.next_message("P F\nF G")
    nexts = [list(p) + g.token_ids + ([] if g.finished else [policy.eos_token_id]) + follow
             for p, g in zip(prompts, first)]
    assert all(turn_cache.lookup(tuple(p))[0] == len(p0) + len(g.token_ids) - 1
               for p, p0, g in zip(nexts, prompts, first))
    torch.manual_seed(2)
    reused = policy.generate(nexts, max_new_tokens=8, greedy=greedy, turn_cache=turn_cache)
    torch.manual_seed(2)
    fresh = policy.generate(nexts, max_new_tokens=8, greedy=greedy)
    for a, b in zip(reused, fresh):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    _check_logprobs(policy, nexts, reused)


def test_long_replies_outgrow_the_cache_buffer_exactly(text_policy):
    """Replies longer than the KV buffer's spare room (64 tokens) move it without changing a value."""
    prompts = _prompts(text_policy)[:3]
    torch.manual_seed(3)
    gens = text_policy.generate(prompts, max_new_tokens=150)
    assert max(len(g.token_ids) for g in gens) > 130
    _check_logprobs(text_policy, prompts, gens)


# -- drawing a token -----------------------------------------------------------------------------
def test_a_small_vocabulary_draws_exactly_as_torch_multinomial():
    """The embedded models' vocabularies keep ``torch.multinomial``, so their seeded runs draw
    the tokens they always drew."""
    from agents.policies.sampling import RACE_VOCAB, draw

    logp = torch.log_softmax(torch.randn(16, RACE_VOCAB), -1)
    torch.manual_seed(3)
    want = torch.multinomial(logp.exp(), 1).squeeze(-1)
    torch.manual_seed(3)
    assert torch.equal(draw(logp), want)


def test_a_real_vocabulary_draws_by_the_distribution_function_from_the_same_distribution():
    """Over a vocabulary past the race's (the probability in 60 entries, 100 that cannot be
    drawn): 50,000 draws match the probabilities (a chi-square far below its 0.1% critical
    value), never a token of probability 0, and differ from multinomial's draws."""
    from agents.policies.sampling import RACE_VOCAB, draw

    vocab = RACE_VOCAB + 904
    gen = torch.Generator().manual_seed(0)
    logits = torch.full((vocab,), -60.0)
    live = torch.randperm(vocab, generator=gen)[:160]
    logits[live[:60]] = torch.randn(60, generator=gen) * 2
    logits[live[60:]] = float("-inf")
    logp = torch.log_softmax(logits, -1)
    torch.manual_seed(0)
    toks = torch.cat([draw(logp.expand(5_000, -1)) for _ in range(10)])
    assert not torch.isin(toks, live[60:]).any()
    counts = torch.bincount(toks, minlength=vocab).double()
    kept = live[:60]
    expected = logp.exp().double()[kept] * len(toks)
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 99.6, chi2  # the 0.999 quantile of chi-square with 59 degrees of freedom
    assert counts.sum() == counts[kept].sum()  # the rest of the mass is ~1e-23
    torch.manual_seed(0)
    assert not torch.equal(draw(logp.expand(64, -1)), torch.multinomial(logp.exp().expand(64, -1), 1).squeeze(-1))


def test_the_sampler_over_a_large_vocabulary_records_the_drawn_tokens_log_probs(eos_prone_policy, monkeypatch):
    """With the distribution-function draw (forced here for the tiny vocabulary), the behaviour
    log-probs still match a fresh forward and a seed still fixes the samples."""
    import agents.policies.sampling as sampling

    monkeypatch.setattr(sampling, "RACE_VOCAB", 0)
    prompts = _prompts(eos_prone_policy) * 2
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(eos_prone_policy.generate(prompts, max_new_tokens=8))
    assert [g.token_ids for g in runs[0]] == [g.token_ids for g in runs[1]]
    _check_logprobs(eos_prone_policy, prompts, runs[0])
