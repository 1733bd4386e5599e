"""Shared test helpers."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--browser", action="store_true",
                     help="run the browser tests (marked 'browser'; headless Chromium): make test-view")
    parser.addoption("--distributed", action="store_true",
                     help="run the multi-process torch.distributed tests (marked 'distributed'): make test-dist")
    parser.addoption("--real", action="store_true",
                     help="run the tests on a real pretrained model (marked 'real'; SmolLM2-135M-Instruct "
                          "from its package): make test-real")
    parser.addoption("--screenshots", default=None, metavar="DIR",
                     help="with --browser: save the viewer's page screenshots to DIR (docs/img for the docs)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Browser tests run only when asked for (``--browser``), so ``make test`` needs no browser;
    the multi-process torch.distributed tests (``--distributed``) have their own target too,
    ``make test-dist``, as the Ray and vLLM suites do."""
    skips = {
        "browser": (config.getoption("--browser"),
                    pytest.mark.skip(reason="a browser test: run with make test-view (pytest --browser)")),
        "distributed": (config.getoption("--distributed"),
                        pytest.mark.skip(reason="a multi-process test: run with make test-dist (pytest --distributed)")),
        "real": (config.getoption("--real"),
                 pytest.mark.skip(reason="a real-model test: run with make test-real (pytest --real)")),
    }
    for item in items:
        for marker, (asked, skip) in skips.items():
            if not asked and marker in item.keywords:
                item.add_marker(skip)


def build_tiny_qwen25vl(folder: Path, **generation_config) -> Path:
    """Save a tiny randomly initialised model in the real Qwen2.5-VL checkpoint layout (model,
    tokenizer, Qwen2.5-VL processor) to ``folder``; ``generation_config`` items are set on the
    saved model's generation config (e.g. a distorting top_k)."""
    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessor)

    from agents.policies.tiny import CHAT_TEMPLATE, _train_tokenizer

    corpus = "<answer>Up</answer> <answer>Down</answer> FrozenLake move the player to the goal\n" * 20
    tok = _train_tokenizer(corpus, 300)
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
                         bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    for key, value in generation_config.items():
        setattr(model.generation_config, key, value)
    try:
        from transformers import Qwen2VLVideoProcessor

        video = Qwen2VLVideoProcessor()
    except ImportError:
        video = None
    Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64),
                        tokenizer=tok, video_processor=video, chat_template=CHAT_TEMPLATE).save_pretrained(folder)
    tok.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


def with_logit_bias(policy, biases: dict[int, float], name: str = "biased"):
    """A copy of ``policy`` whose LM head adds ``biases[token_id]`` to those tokens' logits
    (e.g. an EOS bias, so rows of a batch finish at different steps)."""
    import copy

    import torch

    from agents.policies.policy import Policy

    model = copy.deepcopy(policy.model)
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        for token, bias in biases.items():
            head.bias[token] = bias
    model.lm_head = head
    return Policy(model, policy.tokenizer, policy.processor, name=name)


@pytest.fixture(scope="module")
def search_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point ``FRESHPER_CACHE`` at a temporary folder, so generated corpora, indices and tiny
    models stay out of the working tree."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("freshper-cache")
    mp.setenv("FRESHPER_CACHE", str(root))
    yield root
    mp.undo()


# -- the viewer (tests/agents/view/test_view.py, tests/agents/view/test_view_browser.py) --------------------------------
REPO = Path(__file__).resolve().parents[1]

#: Tiny train.py settings for viewer fixtures (a real run folder in well under a minute).
VIEW_TINY = dict(tasks_per_iter=2, group_size=2, max_new_tokens=4, pretrain_steps=0, eval_every=0, eval_episodes=2,
                 final_eval_episodes=2, checkpoint_every=1, progress=False, tensorboard=False, threads=1, gifs=1)


def make_tiny_run(root: Path, name: str, **overrides) -> Path:
    """Train a real tiny run into ``root/name`` (config, metrics, summary, curves, eval records,
    checkpoints) and return its folder."""
    import learner.run
    from learner.config import make_config

    learner.run.train(make_config(runs_root=str(root), run_name=name, **{**VIEW_TINY, "iterations": 1, **overrides}))
    return root / name


def damage_run(src: Path, dst: Path) -> Path:
    """A copy of a run folder with the damage a killed or broken run leaves: a corrupt line in
    the middle of metrics.jsonl, a torn last line, a checkpoint whose model file is cut short
    (manifest present) and a temporary checkpoint folder."""
    import shutil

    shutil.copytree(src, dst)
    lines = (dst / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    lines.insert(1, '{"kind": "train", "iteration": 1, "success": 0.5,,}')
    (dst / "metrics.jsonl").write_text("\n".join(lines) + '\n{"kind": "train", "itera', encoding="utf-8")
    newest = sorted((dst / "checkpoints").glob("iter_*"))[-1]
    weights = newest / "model" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 3])
    (dst / "checkpoints" / ".tmp-iter_000099-4242" / "model").mkdir(parents=True)
    return dst


class ViewServer:
    """``python -m agents.view ROOT`` in a subprocess on a free loopback port, the real CLI."""

    def __init__(self, root: Path, *extra: str, host: str = "127.0.0.1", env: dict[str, str | None] | None = None) -> None:
        import socket

        with socket.socket() as s:
            s.bind((host, 0))
            self.port = s.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.args = [str(root), "--port", str(self.port), "--threads", "1", *(["--host", host] if host != "127.0.0.1" else []),
                     *extra]
        self.env = env  # changes to the environment the viewer runs in (None: unset that variable)
        self.proc = None
        self.log = root.parent / f"view-{self.port}.log"

    def __enter__(self) -> "ViewServer":
        import subprocess
        import sys
        import time

        import httpx

        import os

        env = dict(os.environ)
        for key, value in (self.env or {}).items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        self._fh = self.log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "agents.view", *self.args], cwd=REPO,
                                     stdout=self._fh, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the viewer exited with {self.proc.returncode}: {self.log.read_text()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.proc.kill()
        raise RuntimeError(f"the viewer did not start within 120 s: {self.log.read_text()}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except Exception:
                self.proc.kill()
        self._fh.close()

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


class Served:
    """A task server on a free loopback port, serving in a thread."""

    def __init__(self, env_id: str = "freshper/FrozenLake-v0", **kwargs) -> None:
        import threading

        from envs.serve import make_server

        self.server = make_server(env_id, "127.0.0.1", 0, **kwargs)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> "Served":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return self.server.url
