"""experiments/minimal_loop/minimal_loop.py, the independent GRPO loop the trainer is bisected against, and
experiments/board_reading/credit_snr.py, the policy gradient's projection on reading the board."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments.board_reading import credit_snr as snr
from experiments.minimal_loop import minimal_loop as ml


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agents.policies.tiny import build_tiny_model

    return build_tiny_model("text", cache_dir=tmp_path_factory.mktemp("tiny-cache"))


def test_the_trainers_prompts_are_the_tokenizers_own_chat_template(tiny: Path) -> None:
    """The bisect's first cut: the runner's prompt ids (agents.policies.chat, no re-tokenization) equal
    the chat template rendered by the tokenizer, on the first turn and after a move."""
    from transformers import AutoTokenizer

    from agents.policies.policy import Policy

    tok, policy = AutoTokenizer.from_pretrained(tiny), Policy.from_pretrained(tiny)
    env = ml.make_env()
    obs, info = env.reset(seed=5)
    assert ml.prompt_ids(tok, ml.user_text(env, "task")) == policy.chat.first_message(obs["text"], [])
    obs, *_ = env.step("<answer>Down</answer>")
    later = policy.chat.first_message(f"{info['instructions']}\n\n{obs['text']}", [])
    assert ml.prompt_ids(tok, ml.user_text(env, "task")) == later
    assert len(ml.prompt_ids(tok, ml.user_text(env, "short"))) < len(later) - 20


def test_shared_header_logprobs_equal_a_full_forward_pass(tiny: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    seqs = []
    for seed, reply in zip(range(6), ["<answer>Down</answer>", "<answer>Up</answer>", "Down", "<answer>R</answer>",
                                      "x", "<answer>Left</answer>"]):
        env = ml.make_env()
        env.reset(seed=seed)
        seqs.append((ml.prompt_ids(tok, ml.user_text(env, "task")), tok.encode(reply, add_special_tokens=False) + [eos]))
    got = ml.sequence_logprobs(model, seqs)
    for i, (p, r) in enumerate(seqs):
        logp = torch.log_softmax(model(input_ids=torch.tensor(p + r)[None]).logits[0].float(), -1)
        want = torch.stack([logp[len(p) + k - 1, t] for k, t in enumerate(r)])
        assert torch.allclose(got[i, : len(r)], want, atol=1e-4)
        assert (got[i, len(r):] == 0).all()


def test_group_advantages_are_normalised_within_each_group() -> None:
    eps = [{"ret": r} for r in (1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5)]
    ml.group_advantages(eps, 4)
    first = np.array([e["adv"] for e in eps[:4]])
    assert first.mean() == pytest.approx(0.0, abs=1e-9) and first.std() == pytest.approx(1.0, abs=1e-4)
    assert [e["adv"] for e in eps[4:]] == [0.0] * 4  # all equal: no signal


@pytest.mark.parametrize("parts", [[], ["--use-runner"], ["--use-runner", "--use-update"]])
def test_a_short_run_logs_warmup_iterations_and_evaluations(tiny: Path, tmp_path: Path, parts: list[str], capsys) -> None:
    out = tmp_path / "run.jsonl"
    start = tmp_path / "start"
    args = ["--iterations", "2", "--maps", "2", "--group", "2", "--warmup-steps", "3", "--warmup-batch", "4",
            "--eval-every", "1", "--eval-episodes", "3", "--final-eval-episodes", "4", "--out", str(out),
            "--save-start", str(start), "--model", str(tiny), *parts]
    assert ml.main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["warmup", "eval", "train", "eval", "train", "eval"]
    assert rows[0]["steps"] == 3 and rows[0]["loss_last"] < rows[0]["loss_first"]
    assert all(0.0 <= r["success_sampled"] <= 1.0 for r in rows if r["kind"] == "eval")
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] >= 0 for r in rows if r["kind"] == "train")
    assert (start / "config.json").exists()
    ml.main(["--summary", str(out)])
    assert f"| {out} | 2 |" in capsys.readouterr().out


def _record(group: int, observations: list[str], rewards: list[float]):
    from agents.record import Sample, Trajectory, Turn

    turns = [Turn(o, "<answer>Down</answer>", r, True) for o, r in zip(observations, rewards)]
    samples = [Sample([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.5]) for _ in turns]
    return Trajectory("x/Y-v0", 0, group, turns, samples, sum(rewards), sum(rewards) > 0, 0)


def test_estimators_give_the_documented_advantages() -> None:
    def records():
        return [_record(0, ["s0", "s1"], [0.0, 1.0]), _record(0, ["s0", "s2"], [0.0, 0.0]),
                _record(0, ["s0", "s3", "s4"], [0.0, 0.0, 0.0]), _record(1, ["s0"], [1.0])]

    by = {}
    for name in ("episode", "nostd", "gigpo", "gigpo:3", "step"):
        recs = records()
        snr.set_advantages(recs, name)
        by[name] = [[r.advantage if s.advantage is None else s.advantage for s in r.samples] for r in recs]
    # nostd: R - mean of the group, on every turn
    assert by["nostd"][0] == pytest.approx([2 / 3, 2 / 3]) and by["nostd"][1] == pytest.approx([-1 / 3, -1 / 3])
    # episode: the same, divided by the group's std
    std = np.std([1.0, 0.0, 0.0])
    assert by["episode"][0] == pytest.approx([(2 / 3) / std] * 2, rel=1e-4)
    # step = gigpo - episode; gigpo:3 = episode + 3 step
    for r in range(4):
        step = np.array(by["step"][r])
        assert np.allclose(np.array(by["gigpo"][r]) - np.array(by["episode"][r]), step, atol=1e-6)
        assert np.allclose(np.array(by["gigpo:3"][r]) - np.array(by["episode"][r]), 3 * step, atol=1e-6)
    assert by["step"][0][0] > 0 > by["step"][1][0]  # s0 in group 0: the rollout that went on to the goal
    assert by["step"][3] == [0.0]  # a state seen once in its group
    with pytest.raises(ValueError, match="unknown estimator"):
        snr.set_advantages(records(), "bogus")


def test_the_reading_direction_raises_the_counterfactual_shift(tiny: Path) -> None:
    """A small step along the measured reading direction raises the counterfactual shift it is
    the gradient of, and a step against it lowers it (first order)."""
    from agents.policies.policy import Policy

    torch.manual_seed(0)
    policy = Policy.from_pretrained(tiny)
    dirs, shift, habit = snr.directions(policy, probes=8, states=8, seed=0)
    assert set(dirs) == {"reading", "habit"}
    assert all(float(v.norm()) == pytest.approx(1.0, abs=1e-4) for v in dirs.values())
    params = list(policy.model.parameters())
    flat = torch.nn.utils.parameters_to_vector(params).detach()

    def shifted(sign: float) -> float:
        torch.nn.utils.vector_to_parameters(flat + sign * 0.05 * dirs["reading"], params)
        return snr.directions(policy, probes=8, states=8, seed=0)[1]

    up, down = shifted(+1.0), shifted(-1.0)
    torch.nn.utils.vector_to_parameters(flat, params)
    assert down < shift < up
    assert 0.0 <= habit <= 1.0


def test_measure_reports_every_estimator_and_the_kl_term(tiny: Path, tmp_path: Path) -> None:
    res = snr.measure(str(tiny), ["episode", "step"], batches=2, tasks=2, group=2, probes=4, seed=0,
                      reference=str(tiny))
    assert set(res["estimators"]) == {"episode", "step", "kl"}
    for row in res["estimators"].values():
        assert all(np.isfinite(row[k]) for k in ("grad_norm", "reading_cos", "habit_cos"))
        assert -1.0 <= row["reading_cos"] <= 1.0
    # the policy is its own reference: the KL term and its gradient are zero
    assert res["estimators"]["kl"]["grad_norm"] == pytest.approx(0.0, abs=1e-6)
