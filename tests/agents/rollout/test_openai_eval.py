"""``python -m agents.evaluate --base-url``: a model behind an OpenAI-compatible endpoint plays any
task. The happy path runs against a real server on loopback (``agents.engines.openai_server`` serving
the embedded model: real prompts, sampling and log-probs); a scripted stub server stands in
only for faults a real one cannot be made to produce on demand (429, 5xx, timeouts, malformed
JSON, dropped connections). vLLM's own server: tests/agents/engines/test_vllm_openai.py (make test-vllm)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from agents import evaluate as ev
from agents.rollout.openai_eval import ChatEndpoint, EndpointRunner
from agents.record import load_records

LAKE = "freshper/FrozenLake-v0"


@pytest.fixture(scope="module")
def policy():
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model

    from conftest import with_logit_bias

    torch.set_num_threads(1)
    base = Policy.from_pretrained(build_tiny_model("text"))
    # lean the untrained model towards the answer's tokens, so returns spread (valid moves, holes, invalid replies)
    ids = {i for w in ("<answer>", "Down", "Right", "Left", "Up", "</answer>") for i in base.tokenizer.encode(w, add_special_tokens=False)}
    return with_logit_bias(base, {**{i: 6.0 for i in ids}, base.eos_token_id: 3.0}, name=str(build_tiny_model("text")))


@pytest.fixture(scope="module")
def served(policy):
    from agents.engines.openai_server import ChatModel, ChatServer

    server = ChatServer(("127.0.0.1", 0), ChatModel(policy, policy.name))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_greedy_endpoint_records_equal_the_in_process_ones(policy, served) -> None:
    """Same prompts, same model: greedy replies are the in-process ones token for token, with
    their log-probs, in both context modes."""
    for context in ("window:0", "full"):
        kwargs = {"feedback": False} if context == "window:0" else {}
        local = ev.evaluate(policy, LAKE, episodes=6, greedy=True, env_kwargs=kwargs, context=context, max_new_tokens=8)
        runner = EndpointRunner(ChatEndpoint(served.url, policy.name, token_ids=True), LAKE, env_kwargs=kwargs,
                                context=context, max_new_tokens=8, concurrency=3)
        remote = ev.evaluate(None, LAKE, episodes=6, greedy=True, runner=runner, batch_size=6)
        assert remote.success_rate == local.success_rate and remote.mean_return == local.mean_return
        for a, b in zip(local.records, remote.records):
            assert [(t.observation, t.reply, t.reward, t.action_is_valid) for t in a.turns] == \
                   [(t.observation, t.reply, t.reward, t.action_is_valid) for t in b.turns]
            assert len(b.samples) == len(b.turns) and b.seed == a.seed
            sampled = [s.token_ids[s.loss_mask == 1] for s in a.samples]
            lps = [s.behavior_logprobs[s.loss_mask == 1] for s in a.samples]
            if context == "full":  # one sample holding every reply
                sampled, lps = [sampled[0]], [lps[0]]
                got_ids = [np.concatenate([s.token_ids for s in b.samples])]
                got_lps = [np.concatenate([s.behavior_logprobs for s in b.samples])]
            else:
                got_ids, got_lps = [s.token_ids for s in b.samples], [s.behavior_logprobs for s in b.samples]
            eos = policy.eos_token_id
            for ids, lp, gi, gl in zip(sampled, lps, got_ids, got_lps):
                keep = ids != eos  # the endpoint's log-probs leave out the closing EOS, as OpenAI's do
                assert np.array_equal(ids[keep], gi)
                assert np.abs(lp[keep] - gl).max() < 1e-4


def test_the_cli_samples_within_the_in_process_interval_and_the_viewer_opens_it(policy, served, tmp_path, capsys) -> None:
    local = ev.evaluate(policy, LAKE, episodes=32, env_kwargs={"feedback": False}, max_new_tokens=8)
    code = ev.main(["--env", LAKE, "--base-url", served.url, "--model", policy.name, "--episodes", "32",
                    "--max-new-tokens", "8", "--concurrency", "6", "--save", str(tmp_path / "ep")])
    out = capsys.readouterr().out
    assert code == 0
    assert "success" in out and "mean return" in out and "failed episodes 0" in out
    records = load_records(tmp_path / "ep")
    wins = sum(r.success for r in records)
    lo, hi = local.success_ci
    assert len(records) == 32 and lo <= wins / 32 <= hi, (wins, local.success_ci)
    mean_return = float(np.mean([r.episode_return for r in records]))
    lo, hi = local.return_ci
    assert hi - lo > 0.01 and lo <= mean_return <= hi, (mean_return, local.return_ci)  # a spread, and within it
    assert all(r.info["model"] == policy.name and r.info.get("reply_logprobs") for r in records)
    summary = json.loads((tmp_path / "ep" / "endpoint.json").read_text())
    assert summary["episodes"] == 32 and summary["model"] == policy.name

    from starlette.testclient import TestClient

    from agents.view.app import create_app

    with TestClient(create_app(tmp_path), base_url="http://127.0.0.1") as client:
        page = client.get("/episodes/runs/ep")
        assert page.status_code == 200 and "32" in page.text
        one = client.get("/episode/runs/ep?n=0")
        assert one.status_code == 200
        assert records[0].turns[0].reply.strip()[:10].replace("<", "&lt;").replace(">", "&gt;") in one.text


def test_vision_tasks_send_their_images_as_png_data_urls(tmp_path) -> None:
    from agents.rollout.openai_eval import image_data_url, user_message

    from envs.serve import decode_image

    img = np.random.default_rng(0).integers(0, 256, (28, 56, 3), dtype=np.uint8)
    msg = user_message("Board:\n<image>\nYour move?", [img])
    kinds = [p["type"] for p in msg["content"]]
    assert kinds == ["text", "image_url", "text"]
    url = msg["content"][1]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,") and url == image_data_url(img)
    assert np.array_equal(decode_image({"png": url.split(",", 1)[1], "shape": [28, 56, 3]}), img)  # lossless


# -- faults, from a scripted stub ----------------------------------------------------------------
GOOD = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "<answer>Down</answer>"},
                     "finish_reason": "stop",
                     "logprobs": {"content": [{"token": "<answer>", "logprob": -0.5}, {"token": "Down", "logprob": -0.25},
                                              {"token": "</answer>", "logprob": -0.125}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3}}


class Stub(ThreadingHTTPServer):
    """Answers requests by a script of faults, then with :data:`GOOD`; counts requests."""

    daemon_threads = True

    def __init__(self, script: list[str]) -> None:
        self.script = list(script)
        self.requests = 0
        self.lock = threading.Lock()
        self.bodies: list[dict] = []
        super().__init__(("127.0.0.1", 0), _StubHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


class _StubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests += 1
            self.server.bodies.append(body)
            fault = self.server.script.pop(0) if self.server.script else "ok"
        if fault == "drop":  # the connection dies without an answer
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if fault == "slow":
            time.sleep(1.5)
            fault = "ok"
        status, payload, headers = 200, json.dumps(GOOD).encode(), {}
        if fault == "429":
            status, payload, headers = 429, b'{"error": {"message": "rate limited"}}', {"Retry-After": "0.1"}
        elif fault in ("500", "503"):
            status, payload = int(fault), b'{"error": {"message": "overloaded"}}'
        elif fault == "garbage":
            payload = b'{"choices": [{"message": '
        elif fault == "401":
            status, payload = 401, b'{"error": {"message": "bad key"}}'
        elif fault == "context":
            status, payload = 400, b'{"error": {"message": "This model\'s maximum context length is 8 tokens"}}'
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def _run(url: str, episodes: int = 1, **kw):
    endpoint = ChatEndpoint(url, "stub", timeout=kw.pop("timeout", 5.0), max_retries=kw.pop("max_retries", 4),
                            backoff=0.01)
    runner = EndpointRunner(endpoint, LAKE, env_kwargs={"feedback": False}, concurrency=kw.pop("concurrency", 1))
    return ev.evaluate(None, LAKE, episodes=episodes, runner=runner, batch_size=episodes), endpoint


def test_429_5xx_malformed_and_dropped_answers_are_retried() -> None:
    with Stub(["429", "503", "garbage", "drop", "500"]) as stub:
        result, endpoint = _run(stub.url, max_retries=6)
    rec = result.records[0]
    assert not rec.failed and result.episodes == 1 and endpoint.retries == 5
    assert stub.requests == 5 + rec.num_turns
    assert rec.turns[0].reply == "<answer>Down</answer>"
    assert rec.info["reply_logprobs"][0] == [["<answer>", -0.5], ["Down", -0.25], ["</answer>", -0.125]]
    body = stub.bodies[0]
    assert body["model"] == "stub" and body["logprobs"] is True and body["messages"][0]["role"] == "user"
    assert "FrozenLake" in body["messages"][0]["content"] or "hole" in body["messages"][0]["content"].lower()


def test_a_timeout_is_retried_and_an_endpoint_that_keeps_failing_fails_the_episode_only() -> None:
    with Stub(["slow"]) as stub:
        result, endpoint = _run(stub.url, timeout=0.5)
    assert not result.records[0].failed and endpoint.retries == 1
    with Stub(["garbage"] * 3) as stub:  # episode 0 gets garbage 3 times: fails; episode 1 plays on
        result, endpoint = _run(stub.url, episodes=2, max_retries=2)
    failed = [r for r in result.records if r.failed]
    assert len(failed) == 1 and "malformed answer" in failed[0].info["error"] and "after 2 retries" in failed[0].info["error"]
    assert result.episodes == 1 and result.stats["failed"] == 1  # left out of the rates


def test_a_context_overflow_truncates_and_a_bad_key_stops_with_the_message(capsys) -> None:
    with Stub(["context"]) as stub:
        result, _ = _run(stub.url)
    rec = result.records[0]
    assert rec.truncated and rec.info["end_reason"] == "context budget" and rec.num_turns == 0
    with Stub(["401"] * 50) as stub:
        code = ev.main(["--env", LAKE, "--base-url", stub.url, "--model", "stub", "--episodes", "3"])
    assert code == 2 and "401" in capsys.readouterr().err and stub.requests <= 3


def test_the_api_key_comes_from_the_named_variable(monkeypatch, capsys) -> None:
    monkeypatch.delenv("MY_KEY", raising=False)
    with pytest.raises(SystemExit):
        ev.main(["--env", LAKE, "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--api-key-env", "MY_KEY"])
    assert "MY_KEY: that environment variable is not set" in capsys.readouterr().err
    seen = {}

    class KeyStub(Stub):
        pass

    with KeyStub([]) as stub:
        orig = _StubHandler.do_POST

        def spy(self):
            seen["auth"] = self.headers.get("Authorization")
            orig(self)

        monkeypatch.setattr(_StubHandler, "do_POST", spy)
        monkeypatch.setenv("MY_KEY", "sk-test")
        assert ev.main(["--env", LAKE, "--base-url", stub.url, "--model", "m", "--api-key-env", "MY_KEY",
                        "--episodes", "1"]) == 0
    assert seen["auth"] == "Bearer sk-test"
