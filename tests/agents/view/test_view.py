"""The viewer without a browser: reading damaged run folders, play sessions recorded turn by turn,
and every page served by the real CLI on loopback (``python -m agents.view``) for a real tiny run.

The same pages in headless Chromium are tests/agents/view/test_view_browser.py (``make test-view``).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from agents.record import load_records
from agents.view.episodes import EpisodeFilter, filter_episodes, reply_spans, turn_views
from agents.runfolder import check_checkpoint, read_metrics_lines
from agents.view.runs import ViewError, find_runs, load_run, safe_join
from conftest import REPO, ViewServer, damage_run, make_tiny_run

TEXT = "freshper/FrozenLake-v0"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real finished tiny run, a damaged copy of it, and a sweep-style nested run folder."""
    root = tmp_path_factory.mktemp("view-runs")
    text = make_tiny_run(root, "text")
    damage_run(text, root / "damaged")
    (root / "sweep").mkdir()
    import shutil

    shutil.copytree(text, root / "sweep" / "text__s1")
    return root


@pytest.fixture(scope="module")
def server(runs: Path):
    with ViewServer(runs) as srv:
        yield srv


# -- reading run folders ------------------------------------------------------------------------
def test_metrics_reader_names_corrupt_and_torn_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "iteration": 1}\n{"kind": oops}\n[1, 2]\n{"kind": "eval", "success": NaN}\n'
                    '{"kind": "tr', encoding="utf-8")
    rows, problems = read_metrics_lines(path)
    assert [r["kind"] for r in rows] == ["train", "eval"] and math.isnan(rows[1]["success"])
    assert len(problems) == 3
    assert problems[0].startswith("metrics.jsonl line 2 is not valid JSON") and '{"kind": oops}' in problems[0]
    assert "line 3 is a JSON list, not an object" in problems[1]
    assert "line 5 is incomplete (a run still writing, or killed mid-line)" in problems[2]


def test_a_damaged_run_folder_is_read_with_every_problem_named(runs: Path) -> None:
    run = load_run(runs, runs / "damaged")
    good = load_run(runs, runs / "text")
    assert not good.problems and good.finished and good.has_curves and good.phases
    assert len(run.metrics) == len(good.metrics)  # the corrupt and torn lines are skipped, the rest kept
    text = "\n".join(run.problems)
    assert "metrics.jsonl line 2 is not valid JSON" in text
    assert f"metrics.jsonl line {len(good.metrics) + 2} is incomplete" in text
    newest = run.checkpoints[-2]  # the temporary folder sorts last
    assert newest.problem.startswith("incomplete or damaged checkpoint") and "model/model.safetensors is" in newest.problem
    assert run.checkpoints[-1].name.startswith(".tmp-") and "half-written" in run.checkpoints[-1].problem
    assert run.checkpoints[0].ok and run.verdict == good.verdict


def test_checkpoint_check_finds_missing_manifests_and_changed_bytes(runs: Path, tmp_path: Path) -> None:
    import shutil

    ck = sorted((runs / "text" / "checkpoints").glob("iter_*"))[-1]
    assert check_checkpoint(ck, hashes=True) == ""
    copy = shutil.copytree(ck, tmp_path / ck.name)
    weights = copy / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes: only the hash sees it
    weights.write_bytes(bytes(data))
    assert check_checkpoint(copy) == ""
    assert "does not match its checksum" in check_checkpoint(copy, hashes=True)
    (copy / "manifest.json").unlink()
    assert "has no manifest.json" in check_checkpoint(copy)


def test_runs_are_found_nested_and_paths_stay_inside_the_root(runs: Path) -> None:
    names = [p.relative_to(runs).as_posix() for p in find_runs(runs)]
    assert names == ["damaged", "sweep/text__s1", "text"]
    with pytest.raises(ViewError, match="outside the folder"):
        safe_join(runs, "../../etc")
    assert safe_join(runs, "text/eval") == (runs / "text" / "eval").resolve()


def test_the_run_list_shows_the_delivered_policy(runs: Path, tmp_path: Path) -> None:
    """A run that kept an earlier iteration (--select best) is listed with that policy's score;
    its best/ folder is not taken for a run."""
    import json
    import shutil

    run = tmp_path / "kept"
    shutil.copytree(runs / "text", run)
    summary = json.loads((run / "summary.json").read_text())
    assert load_run(tmp_path, run).final == summary["evals"]["final"]
    summary["evals"]["selected"] = {**summary["evals"]["final"], "success": 0.875}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "best" / "iter_000002").mkdir(parents=True)
    (run / "best" / "iter_000002" / "config.yaml").write_text("x: 1\n")  # within the depth runs are looked for
    assert load_run(tmp_path, run).final["success"] == 0.875
    assert [p.name for p in find_runs(tmp_path)] == ["kept"]


def test_episode_filters_and_reply_tokens(runs: Path) -> None:
    records = load_records(runs / "text" / "eval" / "final")
    assert filter_episodes(records, EpisodeFilter.parse({"success": "any"})) == list(enumerate(records))
    lost = filter_episodes(records, EpisodeFilter.parse({"success": "no"}))
    assert [n for n, _ in lost] == [n for n, r in enumerate(records) if not r.success]
    top = max(r.episode_return for r in records)
    assert all(r.episode_return >= top for _, r in filter_episodes(records, EpisodeFilter.parse({"min_return": str(top)})))
    with pytest.raises(ViewError, match="min return must be a number"):
        EpisodeFilter.parse({"min_return": "abc"})
    rec = records[0]
    views = turn_views(rec, None)
    assert len(views) == rec.num_turns
    for view, (sample, start, end) in zip(views, reply_spans(rec)):
        assert [t.id for t in view.tokens] == sample.token_ids[start:end].tolist()
        assert np.allclose([t.logprob for t in view.tokens], sample.behavior_logprobs[start:end])
        assert sample.loss_mask[start:end].all() and view.advantage == rec.advantage


# -- play sessions -------------------------------------------------------------------------------
def test_a_played_episode_is_recorded_with_model_and_typed_turns(tmp_path: Path) -> None:
    from agents.view.sessions import TINY, Sessions

    sessions = Sessions()
    session = sessions.start(TEXT, 0, TINY, env_kwargs={})
    replies = [session.step_model() for _ in range(3)]
    assert session.step_typed("Right") == "<answer>Right</answer>"
    rec = session.trajectory()
    assert [t.reply for t in rec.turns] == replies + ["<answer>Right</answer>"]
    assert rec.info["typed_turns"] == [3] and len(rec.samples) == 4
    policy = session.player.policy
    # The recorded prompts are what the model saw: rescoring reproduces the behaviour log-probs.
    with torch.no_grad():
        rescored = policy.token_logprobs(rec.samples[:3])
    for b, sample in enumerate(rec.samples[:3]):
        m = sample.loss_mask.astype(bool)
        assert m.sum() > 0 and policy.reply_text(sample.token_ids[m].tolist()) == replies[b]
        assert np.allclose(rescored[b, : len(m)].numpy()[m], sample.behavior_logprobs[m], atol=1e-4)
    assert rec.samples[3].loss_mask.sum() == 0  # typed, not sampled
    assert policy.reply_text(rec.samples[3].token_ids[-len(policy.encode_reply("<answer>Right</answer>")):].tolist()) \
        == "<answer>Right</answer>"
    folder, gif = session.save(tmp_path / "saved")
    (back,) = load_records(folder)
    assert back.turns == rec.turns and back.info["typed_turns"] == [3]
    from PIL import Image

    with Image.open(gif) as im:  # the board at reset and after each of the four turns, 600 ms each
        durations = []
        for k in range(im.n_frames):  # Pillow merges repeated frames (invalid replies) into longer ones
            im.seek(k)
            durations.append(im.info["duration"])
        last = np.asarray(im.convert("RGB"))
    assert sum(durations) == 5 * 600 and im.n_frames >= 2
    assert np.array_equal(last, session.frames[-1]) and len(session.frames) == 5
    assert [v.typed for v in turn_views(back, policy.tokenizer)] == [False, False, False, True]
    with pytest.raises(ViewError, match="type a reply first"):
        session.step_typed("  ")
    with pytest.raises(ViewError, match="no task registered"):
        sessions.start("freshper/FrozenLak-v0", 0, TINY)
    with pytest.raises(ViewError, match="not open any more"):
        sessions.get("nope")


def test_a_played_vision_episode_records_the_image_of_every_turn(tmp_path: Path) -> None:
    from agents.view.sessions import TINY, Sessions

    session = Sessions().start("freshper/FrozenLakeVision-v0", 3, TINY)
    session.step_model()
    session.step_typed("Down")
    rec = session.trajectory()
    assert [t.image_index for t in rec.turns] == [0, 1] and len(rec.images) == 3
    assert rec.info["final_image_index"] == 2 and [s.image_ids for s in rec.samples] == [[0], [1]]
    assert np.array_equal(rec.images[-1], session.env.unwrapped.render_image())
    policy = session.player.policy
    with torch.no_grad():
        rescored = policy.token_logprobs(rec.samples[:1], [[rec.images[0]]])
    m = rec.samples[0].loss_mask.astype(bool)
    assert np.allclose(rescored[0].numpy()[m], rec.samples[0].behavior_logprobs[m], atol=1e-4)
    (back,) = load_records(session.save(tmp_path / "v")[0])
    assert all(np.array_equal(a, b) for a, b in zip(back.images, rec.images))


# -- the served pages ------------------------------------------------------------------------------
def _get(server: ViewServer, path: str, status: int = 200) -> str:
    r = httpx.get(server.url + path, timeout=120)
    assert r.status_code == status, (path, r.status_code, r.text[:500])
    assert "Traceback" not in r.text
    return r.text


def test_pages_of_a_run_serve_its_verdict_curves_metrics_and_episodes(server: ViewServer, runs: Path) -> None:
    summary = json.loads((runs / "text" / "summary.json").read_text())
    index = _get(server, "/")
    for name in ("text", "damaged", "sweep/text__s1"):
        assert f'data-run="{name}"' in index
    assert summary["verdict"].split("\n")[0] in index
    page = _get(server, "/run/text")
    assert summary["verdict"].split("\n")[0] in page and 'src="/curves/text"' in page
    png = httpx.get(server.url + "/curves/text", timeout=30)
    assert png.headers["content-type"] == "image/png" and png.content == (runs / "text" / "curves.png").read_bytes()
    # Strict JSON for the browser: NaN in metrics.jsonl becomes null.
    data = json.loads(httpx.get(server.url + "/api/metrics?run=text&run=damaged", timeout=30).text,
                      parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert [len(r["rows"]) for r in data["runs"]] == [len(load_run(runs, runs / "text").metrics)] * 2
    assert data["runs"][1]["problems"]
    compare = _get(server, "/compare?run=text&run=sweep/text__s1")
    assert compare.count('href="/run/') >= 2
    episodes = _get(server, "/episodes/runs/text/eval/final?success=no")
    records = load_records(runs / "text" / "eval" / "final")
    assert episodes.count('data-testid="episode-row"') == sum(not r.success for r in records)
    episode = _get(server, "/episode/runs/text/eval/final?n=0")
    assert episode.count('data-testid="turn"') == records[0].num_turns
    shown = [float(x) for x in re.findall(r'data-logprob="([-0-9.]+)"', episode)]
    expected = [float(lp) for s, a, b in reply_spans(records[0]) for lp in s.behavior_logprobs[a:b]]
    assert np.allclose(shown, expected, atol=1e-4)


def test_bad_input_is_a_message_on_the_page(server: ViewServer) -> None:
    page = _get(server, "/run/damaged")
    assert "Problems in this run folder" in page and "metrics.jsonl line 2 is not valid JSON" in page
    assert "incomplete or damaged checkpoint" in page and "half-written checkpoint" in page
    assert "is incomplete (a run still writing, or killed mid-line)" in page
    assert "no run called" in _get(server, "/run/nope", 404)
    assert "outside the folder" in _get(server, "/run/..%2F..%2Fetc", 404)
    assert "min return must be a number" in _get(server, "/episodes/runs/text/eval/final?min_return=x")
    assert "there is no episode 99" in _get(server, "/episode/runs/text/eval/final?n=99", 404)
    assert "n must be a whole number" in _get(server, "/episode/runs/text/eval/final?n=one", 400)
    assert "no such page" in _get(server, "/nothing/here", 404)
    broken = str(sorted((server_root(server) / "damaged" / "checkpoints").glob("iter_*"))[-1])
    for form, message in [
        ({"env_id": TEXT, "seed": "0", "model": broken}, "cannot play"),
        ({"env_id": TEXT, "seed": "x"}, "the seed must be a whole number"),
        ({"env_id": "freshper/Nope-v0", "seed": "0"}, "no task registered"),
        ({"env_id": TEXT, "seed": "0", "model_path": "/no/such/model"}, "no model folder at /no/such/model"),
        ({"env_id": TEXT, "seed": "0", "kwargs": "size"}, "task options: --kw expects key=value"),
    ]:
        r = httpx.post(server.url + "/play", data=form, headers={"Origin": server.url}, timeout=120)  # as a browser
        assert r.status_code in (400, 404) and message in r.text and "Traceback" not in r.text, (form, r.text[:300])
    assert "not open any more" in _get(server, "/play/0000", 404)


def server_root(server: ViewServer) -> Path:
    return Path(server.args[0])


def test_play_over_http_steps_types_and_saves(server: ViewServer, runs: Path) -> None:
    with httpx.Client(base_url=server.url, timeout=120, follow_redirects=True, headers={"Origin": server.url}) as client:
        r = client.post("/play", data={"env_id": TEXT, "seed": "0", "model": "tiny"})
        assert r.status_code == 200 and "/play/" in str(r.url)
        sid = str(r.url).rstrip("/").split("/")[-1]
        for _ in range(3):
            r = client.post(f"/play/{sid}/step", data={"action": "model"})
        r = client.post(f"/play/{sid}/step", data={"action": "typed", "reply": "Right"})
        assert r.text.count('data-testid="turn"') == 4 and 'data-testid="typed"' in r.text
        frame = client.get(f"/play/{sid}/frame?k=4")
        assert frame.headers["content-type"] == "image/png"
        r = client.post(f"/play/{sid}/save")
        assert 'data-testid="saved"' in r.text
    (folder,) = sorted((runs / "play").iterdir())
    (rec,) = load_records(folder)
    assert rec.num_turns == 4 and rec.info["typed_turns"] == [3] and (folder / "episode.gif").is_file()
    assert f'href="/episode/plays/{folder.name}?n=0"' in _get(server, "/")
    assert _get(server, f"/episode/plays/{folder.name}?n=0").count('data-testid="typed"') == 1


def test_other_hosts_and_cross_site_forms_are_refused(server: ViewServer) -> None:
    """No data leaves the machine: a page elsewhere can neither read the viewer through another
    Host name (DNS rebinding) nor post forms to it."""
    assert httpx.get(server.url + "/", headers={"Host": "evil.example"}, timeout=30).status_code == 400
    r = httpx.post(server.url + "/play", data={"env_id": TEXT}, headers={"Origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 403 and "refused" in r.text
    own = httpx.post(server.url + "/play", data={"env_id": TEXT, "seed": "x"}, headers={"Origin": server.url}, timeout=30)
    assert own.status_code == 400 and "the seed must be a whole number" in own.text


def test_the_cli_binds_loopback_and_refuses_a_missing_folder(server: ViewServer, tmp_path: Path) -> None:
    assert f"http://127.0.0.1:{server.port}/" in server.output()
    out = subprocess.run([sys.executable, "-m", "agents.view", str(tmp_path / "missing")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "is not a folder" in out.stderr and "Traceback" not in out.stderr


def test_a_single_run_folder_is_served_alone(runs: Path) -> None:
    with ViewServer(runs / "text") as srv:
        assert 'data-run="text"' in _get(srv, "/") and 'data-run="damaged"' not in _get(srv, "/")
        assert "no run called &#39;damaged&#39;" in _get(srv, "/run/damaged", 404)
        assert _get(srv, "/episodes/runs/text/eval/final").count('data-testid="episode-row"') == 2
        assert "no records.jsonl" in _get(srv, "/episodes/runs/damaged/eval/final", 404)


def test_play_loads_models_on_the_device_and_dtype_asked(tmp_path: Path) -> None:
    from agents.view.sessions import TINY, Sessions

    session = Sessions(dtype="bf16").start(TEXT, 0, TINY)
    policy = session.player.policy
    assert policy.model.dtype == torch.bfloat16 and policy.device == torch.device("cpu")
    session.step_model()
    assert len(session.trajectory().turns) == 1
    assert Sessions().start(TEXT, 0, TINY).player.policy.model.dtype == torch.float32  # auto on the CPU: fp32
    capped = Sessions(max_new_tokens=2).start(TEXT, 0, TINY)
    capped.step_model()
    sample = capped.trajectory().samples[0]
    assert capped.player.max_new_tokens == 2 and 1 <= int(sample.loss_mask.sum()) <= 2
    out = subprocess.run([sys.executable, "-m", "agents.view", str(tmp_path), "--dtype", "fp64"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--dtype must be one of auto|bf16|fp16|fp32" in out.stderr
    out = subprocess.run([sys.executable, "-m", "agents.view", str(tmp_path), "--max-new-tokens", "0"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--max-new-tokens must be >= 1" in out.stderr
    if not torch.cuda.is_available():
        out = subprocess.run([sys.executable, "-m", "agents.view", str(tmp_path), "--device", "cuda"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "sees no CUDA device" in out.stderr


def test_the_replay_page_and_a_replayed_episode_over_http(server: ViewServer, runs: Path) -> None:
    from learner.replay_log import read_replay_log

    page = _get(server, "/run/text")
    assert 'href="/replay/text"' in page
    replay = _get(server, "/replay/text")
    assert 'id="replay" data-run="text"' in replay and "/static/replay.js" in replay
    data = httpx.get(server.url + "/api/replay?run=text", timeout=30).json()
    rows = read_replay_log(runs / "text")
    its = [r for r in rows if r["type"] == "iteration"]
    assert data["iterations"] == [r["iteration"] for r in its]
    assert data["buffer_hist"] == [r["buffer"]["hist"] for r in its]
    draws = [r for r in rows if r["type"] == "draw"]
    counts: dict[int, list[float]] = {}
    for d in draws:
        for i, a in zip(d["ids"], d["ages"]):
            counts.setdefault(i, []).append(a)
    top = data["top"][0]
    assert top["times"] == max(len(v) for v in counts.values()) and top["ages"] == counts[top["id"]]
    episode = _get(server, f"/replayed/text?id={top['id']}")
    ages = re.search(r'data-testid="replay-ages">([^<]*)<', episode).group(1)
    assert ages == ", ".join(f"{a:.0f}" for a in counts[top["id"]])
    assert episode.count('data-testid="replay-row"') == top["times"] and "data-ratios=" in episode
    missing = httpx.get(server.url + "/replayed/text?id=999999", timeout=30)
    assert missing.status_code == 404 and "no episode 999999" in missing.text
    (runs / "on-policy").mkdir()
    (runs / "on-policy" / "config.yaml").write_text("replay: none\n", encoding="utf-8")
    none = httpx.get(server.url + "/replay/on-policy", timeout=30)
    assert none.status_code == 404 and "has no replay log: it trains on-policy only" in none.text


def test_a_play_link_to_a_task_the_viewer_lacks_says_so(server: ViewServer) -> None:
    page = _get(server, "/play?env_id=mypkg/NotHere-v0", status=404)
    assert "unknown task" in page and "mypkg/NotHere-v0" in page and "--import" in page
    assert "unknown task" not in _get(server, f"/play?env_id={TEXT}")


def test_play_sets_threads_for_the_largest_model_loaded_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import agents.policies.policy as policy_module
    from agents.view.sessions import TINY, Sessions

    cpus = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(cpus + 3)
        Sessions().start(TEXT, 0, TINY)  # a tiny model: the small-model default
        assert torch.get_num_threads() == policy_module.configure_threads()
        monkeypatch.setattr(policy_module, "LARGE_MODEL_PARAMETERS", 1)  # as if the model were a real one
        Sessions().start(TEXT, 0, TINY)
        assert torch.get_num_threads() == policy_module.configure_threads(parameters=1)
        torch.set_num_threads(3)
        Sessions(threads=3).start(TEXT, 0, TINY)  # --threads given: left as it is
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
