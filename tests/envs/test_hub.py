"""Every registered task: gymnasium's checker and a reply fuzzer (the base contract holds).

Tasks are written concurrently; a task whose module or class does not exist yet is skipped
with the reason. Any other failure is a real failure.
"""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs
from envs.base import IMAGE_PLACEHOLDER, extract_tag

TASKS = envs.registered_tasks()
ONE_MB = 1 << 20


def make_or_skip(spec: envs.TaskSpec, **kwargs):
    if spec.needs:  # a served task or an adapter: checked by its own tests (test_env_serve.py, test_adapters.py)
        pytest.skip(f"{spec.id} cannot be built without {', '.join(spec.needs)}")
    try:
        return envs.make(spec.id, **kwargs)
    except ImportError as exc:
        pytest.skip(f"{spec.id}: task module not available yet ({exc})")


def _fuzz_replies() -> list:
    rng = np.random.default_rng(0)
    printable = "".join(chr(c) for c in range(32, 127))
    random_text = "".join(rng.choice(list(printable), 300))
    garbage = bytes(rng.integers(0, 256, 4096, dtype=np.uint8)).decode("latin-1")
    return [
        "",
        "   \n\t ",
        random_text,
        "x" * ONE_MB,  # huge
        "<answer>" * (ONE_MB // 8),  # a megabyte of unclosed tags
        "</answer><answer>" * (ONE_MB // 17),
        "<answer>" + "y" * ONE_MB + "</answer>",
        "İstanbul 東京 🙂 مرحبا <answer>上</answer>",  # non-ASCII
        "İ" * 1000 + "<answer>ⅮOWN</answer>",  # case-mapping traps
        "<answer>\x00\x01\x02</answer>",
        garbage,  # binary-ish
        "\x00" * 10_000,
        "\ud800\udfff lone surrogates",
        None,  # not a string at all
        b"<answer>Down</answer>",
        12345,
    ]


def _state(env) -> tuple:
    inner = env.unwrapped
    image = inner.render_image().tobytes() if inner.modality == "vision" else b""
    return inner.render_text(), image, inner.turn


@pytest.mark.parametrize("spec", TASKS, ids=[s.id for s in TASKS])
def test_gymnasium_check_env_passes(spec: envs.TaskSpec) -> None:
    mode = "rgb_array" if spec.modality == "vision" else "ansi"
    env = make_or_skip(spec, render_mode=mode)
    check_env(env.unwrapped)
    inner = env.unwrapped
    assert inner.modality == spec.modality, "registered modality disagrees with the class"
    obs, info = env.reset(seed=0)
    assert isinstance(info["instructions"], str) and info["instructions"] in obs["text"]
    if spec.modality == "vision":
        assert obs["text"].count(IMAGE_PLACEHOLDER) >= 1
        assert obs["image"].dtype == np.uint8 and obs["image"].ndim == 3 and obs["image"].shape[2] == 3
        assert np.array_equal(env.render(), obs["image"])
    else:
        assert set(obs) == {"text"} and isinstance(env.render(), str)


@pytest.mark.parametrize("spec", TASKS, ids=[s.id for s in TASKS])
def test_fuzzed_replies_never_raise_and_invalid_ones_keep_state(spec: envs.TaskSpec) -> None:
    env = make_or_skip(spec)
    inner = env.unwrapped
    env.reset(seed=1)
    invalid = 0
    for i, reply in enumerate(_fuzz_replies()):
        if inner._done:
            env.reset(seed=100 + i)
        before = _state(env)
        obs, reward, terminated, truncated, info = env.step(reply)
        assert env.observation_space.contains(obs), f"reply #{i}: observation outside the space"
        if not info["action_is_valid"]:
            invalid += 1
            after = _state(env)
            assert after[:2] == before[:2], f"reply #{i} was invalid but changed the state"
            assert after[2] == before[2] + 1
            assert reward == pytest.approx(inner.format_penalty) and not terminated
            assert "invalid" in obs["text"].lower()
    assert invalid >= 10, "most garbage replies should be rejected"


def test_extract_tag_keeps_offsets_on_non_ascii_and_is_linear() -> None:
    assert extract_tag("İİİ<ANSWER> Down </answer>") == "Down"
    assert extract_tag("<answer>a</answer> <answer>b") == "a"
    assert extract_tag("<answer>" * ONE_MB) is None
    assert extract_tag(None) is None  # type: ignore[arg-type]
