"""``python -m agents.evaluate --base-url`` against vLLM's own OpenAI-compatible server (``vllm serve``
from ``.venv-vllm`` on the CPU, serving the embedded model, and the real SmolLM2-135M-Instruct once
``make test-real`` has converted it): its success rate and mean return
fall within the 95% intervals of ``agents.evaluate`` on the same checkpoint in-process, and its
records carry the replies' token ids and log-probs. Runs with ``make test-vllm`` (which sets
``FRESHPER_VLLM_PYTHON``); skipped otherwise."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

VLLM_PYTHON = os.environ.get("FRESHPER_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(not VLLM_PYTHON, reason="the vLLM tests run with make test-vllm "
                                                      "(FRESHPER_VLLM_PYTHON names the vLLM environment's python)")
LAKE = "freshper/FrozenLake-v0"


#: The served model and the task it is evaluated on.
CASES = {"tiny": LAKE, "smollm2-real": "freshper/Arithmetic-v0"}


def _model(case: str) -> str:
    if case == "tiny":
        from agents.policies.tiny import build_tiny_model

        return str(build_tiny_model("text"))
    from agents.pretrained import converted_folder

    folder = converted_folder("smollm2-135m-instruct")
    if folder is None:
        pytest.skip("SmolLM2-135M-Instruct is not converted: make test-real (python -m agents.pretrained pull "
                    "smollm2-135m-instruct) first")
    return str(folder)


@pytest.fixture(scope="module", params=list(CASES))
def vllm_server(request, tmp_path_factory):
    model = _model(request.param)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    with log.open("w") as fh:
        proc = subprocess.Popen([VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                 "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024",
                                 "--dtype", "float32", "--seed", "0"], stdout=fh, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(url + "/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail(f"vllm serve did not come up in 600 s:\n{log.read_text()[-4000:]}")
        yield url, model, CASES[request.param]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_the_eval_cli_against_vllm_agrees_with_in_process_evaluation(vllm_server, tmp_path: Path, capsys) -> None:
    import torch

    from agents import evaluate as ev
    from agents.policies.policy import Policy
    from agents.record import load_records

    url, model, env_id = vllm_server
    torch.set_num_threads(1)
    episodes = 64
    kwargs = {"feedback": False} if env_id == LAKE else None
    local = ev.evaluate(Policy.from_pretrained(model), env_id, episodes=episodes, env_kwargs=kwargs,
                        max_new_tokens=16)
    code = ev.main(["--env", env_id, "--base-url", url, "--model", model, "--episodes", str(episodes),
                    "--max-new-tokens", "16", "--concurrency", "8", "--token-ids", "--save", str(tmp_path / "ep")])
    assert code == 0, capsys.readouterr().err
    records = load_records(tmp_path / "ep")
    assert len(records) == episodes and not any(r.failed for r in records)
    rate = sum(r.success for r in records) / episodes
    mean_return = float(np.mean([r.episode_return for r in records]))
    assert local.success_ci[0] <= rate <= local.success_ci[1], (rate, local.success_ci)
    assert local.return_ci[0] <= mean_return <= local.return_ci[1], (mean_return, local.return_ci)
    # vLLM names the sampled token ids (return_tokens_as_token_ids): one sample per turn, with log-probs
    for rec in records:
        assert len(rec.samples) == len(rec.turns)
        for sample in rec.samples:
            assert len(sample.token_ids) and (sample.behavior_logprobs <= 0).all() and sample.loss_mask.all()
