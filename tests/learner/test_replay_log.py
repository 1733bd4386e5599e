"""The replay log (learner/replay_log.py) over real tiny runs: every replay update's drawn items
with their ages, priorities, freshness, probabilities, IS weights, advantages and token ratios,
agreeing with what the buffer and the learner computed (metrics.jsonl) and changing nothing of
it; resumable, readable after a torn write, bounded by its cap. Also the viewer's reader of it
(agents/view/replay.py) and the sample details the buffer now returns."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import make_tiny_run
from learner.replay_log import (AGE_EDGES, SEGMENTS, ReplayLog, bucket_of, read_members, read_replay_log)
from replay import ReplayBuffer

REPLAY = dict(replay="fresh", replay_batch=4, buffer_capacity=12)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-iteration run with --replay fresh (the buffer evicts in its last iteration) and the
    same run without its replay log."""
    root = tmp_path_factory.mktemp("replay-log")
    make_tiny_run(root, "fresh", iterations=4, **REPLAY)
    make_tiny_run(root, "nolog", iterations=4, replay_log_mb=0, **REPLAY)
    return root


def _metrics(run: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_sample_says_how_each_item_was_drawn_without_drawing_more() -> None:
    buf = ReplayBuffer(8, tau=3.0, alpha=0.7, seed=1)
    buf.add(list("abcdef"), [1, 2, 3, 4, 5, 6], step=0)
    buf.add(list("gh"), [0.5, 1], step=4)
    state = buf.rng.bit_generator.state
    s = buf.sample(5, 6)
    twin = np.random.default_rng(1)
    twin.bit_generator.state = state
    twin.random(5)
    assert buf.rng.bit_generator.state == twin.bit_generator.state  # one draw of uniforms, as before
    items, ids, weights, ages = s  # still unpacks as four
    all_ids, probs = buf.probabilities(6)
    assert np.allclose(s.probabilities, probs[np.searchsorted(all_ids, ids)], rtol=1e-12)
    assert np.allclose(s.freshness, np.exp(-ages / 3.0))
    base = {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6, "g": 0.5, "h": 1}
    assert s.base_priorities.tolist() == [base[i] for i in items]
    p = (s.base_priorities * s.freshness) ** 0.7  # P(i) is proportional to (p_i * freshness_i)^alpha
    assert np.allclose(p / s.probabilities, p[0] / s.probabilities[0])
    per = ReplayBuffer(8, mode="per", seed=0)
    per.add(list("ab"), [1, 3], step=0)
    assert per.sample(4, 10).freshness.tolist() == [1.0] * 4


def test_every_replay_update_is_logged_as_the_learner_saw_it(runs: Path) -> None:
    rows = read_replay_log(runs / "fresh")
    header = rows[0]
    assert header["type"] == "header" and header["age_edges"] == list(AGE_EDGES)
    episodes = {r["id"]: r for r in rows if r["type"] == "episode"}
    draws = [r for r in rows if r["type"] == "draw"]
    iterations = [r for r in rows if r["type"] == "iteration"]
    assert sorted(episodes) == list(range(16)) and len(draws) == 8 and [r["iteration"] for r in iterations] == [1, 2, 3, 4]
    train = {r["iteration"]: r for r in _metrics(runs / "fresh") if r["kind"] == "train"}
    for d in draws:
        assert d["step"] >= 1 and len(d["ids"]) == 4
        for pos, i in enumerate(d["ids"]):
            ep = episodes[i]
            assert ep["iteration"] <= d["iteration"]  # drawn only once collected
            assert d["ages"][pos] == d["step"] - ep["step"]
            assert d["fresh"][pos] == pytest.approx(math.exp(-d["ages"][pos] / d["tau"]), rel=1e-6)
            assert d["base"][pos] == pytest.approx(abs(ep["return"]) + 1e-2)  # --priority return, eps 0.01
            assert len(d["adv"][pos]) == len(ep["samples"])
            # one replay-time log ratio per sampled token of every sample
            assert [len(r) for r in d["log_ratio"][pos]] == [sum(len(run) for run in s["ids"]) for s in ep["samples"]]
        assert max(d["weight"]) == 1.0 and 0 < sum(d["prob"]) <= 1 + 1e-9
        ratios = [math.exp(x) for item in d["log_ratio"] for s in item for x in s]
        assert max(ratios) == pytest.approx(d["stats"]["ratio_max"], rel=1e-4)  # the learner's own ratios
        assert min(ratios) == pytest.approx(d["stats"]["ratio_min"], rel=1e-4)
    for r in iterations:  # the buffer's histogram and each bucket's IS ESS as metrics.jsonl has them
        m = train[r["iteration"]]
        assert r["buffer"]["hist"] == m["buffer_age_hist"] and r["tau"] == m["tau"]
        its = [d for d in draws if d["iteration"] == r["iteration"]]
        for key in [k for k in m if k.startswith("ess/age_") and any(k in d["stats"] for d in its)]:
            assert np.mean([d["stats"][key] for d in its if key in d["stats"]]) == pytest.approx(m[key], abs=2e-6)
        assert np.mean([d["stats"]["grad_norm"] for d in its]) == pytest.approx(m["replay_grad_norm"], abs=2e-6)
        assert max(d["stats"]["ratio_max"] for d in its) >= m["replay_ratio_max"] - 1e-6
        assert r["on_policy"]["tokens"] == m["tokens"]


def test_the_log_changes_nothing_the_run_computes(runs: Path) -> None:
    assert not (runs / "nolog" / "replay_log").exists()
    timing = ("time_", "tokens_per_s")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(timing) and k != "pretrain_seconds"}
                          for r in rows]
    assert strip(_metrics(runs / "fresh")) == strip(_metrics(runs / "nolog"))


def test_a_resumed_run_logs_as_if_it_had_never_stopped(runs: Path, tmp_path: Path) -> None:
    import learner.run
    from learner.config import parse_config

    run = tmp_path / "fresh"
    shutil.copytree(runs / "fresh", run)
    before = read_replay_log(run)
    learner.run.train(parse_config(["--resume", str(run / "checkpoints" / "iter_000003"), "--iterations", "4"]))
    after = read_replay_log(run)
    drop = lambda rows: [{k: v for k, v in r.items() if k != "log_seconds"} for r in rows if r["type"] != "header"]
    assert drop(after) == drop(before)


def test_a_torn_last_iteration_is_skipped_by_both_readers(runs: Path, tmp_path: Path) -> None:
    from agents.view.replay import figures, read_log

    run = tmp_path / "torn"
    shutil.copytree(runs / "fresh", run)
    (seg,) = sorted((run / "replay_log").glob("seg-*.jsonl.gz"))
    data = seg.read_bytes()
    members = list(read_members(data))
    whole = b"".join(raw for raw, _ in members[:-1])
    seg.write_bytes(whole + members[-1][0][: len(members[-1][0]) // 2])  # killed mid-write
    assert [r["iteration"] for r in read_replay_log(run) if r["type"] == "iteration"] == [1, 2, 3]
    log = read_log(run, tmp_path)
    assert figures(log)["iterations"] == [1, 2, 3]
    assert any("torn iteration" in p for p in log.problems)


def _record(n_turns: int = 3):
    from agents.record import Sample, Trajectory, Turn

    turns = [Turn("board " * 20, "<answer>Up</answer>", -0.1, True) for _ in range(n_turns)]
    samples = [Sample(np.arange(12), [0] * 8 + [1] * 4, np.linspace(-1, 0, 12)) for _ in range(n_turns)]
    return Trajectory("freshper/FrozenLake-v0", 0, 0, turns, samples, -0.3, False, 0)


def test_the_cap_keeps_the_newest_iterations(tmp_path: Path) -> None:
    cap = 24_000
    log = ReplayLog(tmp_path, max_bytes=cap)
    buf = ReplayBuffer(64, seed=0)
    counters = SimpleNamespace(global_step=0, episodes=0)
    rng = np.random.default_rng(0)
    sizes = []
    for it in range(60):
        recs = [_record(int(rng.integers(1, 6))) for _ in range(8)]
        log.added(it, counters.global_step, buf.add(recs, np.ones(8), step=counters.global_step), recs)
        sample = buf.sample(4, counters.global_step + 1)
        log.drawn(it, counters.global_step + 1, sample, {"grad_norm": 0.5, "tokens": 10.0}, buf.tau)
        counters.global_step += 2
        counters.episodes += 8
        log.end_iteration(it, counters, buf, {"grad_norm": 1.0, "tokens": 30.0})
        sizes.append(sum(p.stat().st_size for p in log.segments()))
    log.close()
    per_iteration = sizes[0]
    assert max(sizes) <= cap + SEGMENTS * per_iteration and len(log.segments()) <= SEGMENTS
    kept = [r["iteration"] for r in read_replay_log(tmp_path) if r["type"] == "iteration"]
    assert kept == list(range(kept[0], 61)) and kept[0] > 1  # the oldest went, the newest stayed, in order


def test_the_viewer_reads_a_logged_episode_and_its_replays(runs: Path) -> None:
    from agents.view.replay import episode, figures, read_log

    log = read_log(runs / "fresh", runs)
    fig = figures(log)
    top = fig["top"][0]
    rec, row, replays = episode(log, top["id"], runs)
    assert len(replays) == top["times"] and [r.age for r in replays] == top["ages"]
    draws = [d for d in read_replay_log(runs / "fresh") if d["type"] == "draw" and top["id"] in d["ids"]]
    expected = [(d["iteration"], d["weight"][p]) for d in draws for p, i in enumerate(d["ids"]) if i == top["id"]]
    assert [(r.iteration, r.weight) for r in replays] == expected
    assert rec.num_turns == len(row["turns"]) and [t.reply for t in rec.turns] == [t[1] for t in row["turns"]]
    for its, hist in zip(fig["iterations"], fig["drawn_hist"]):
        ages = [a for d in read_replay_log(runs / "fresh") if d["type"] == "draw" and d["iteration"] == its for a in d["ages"]]
        assert hist == np.bincount(bucket_of(ages), minlength=len(AGE_EDGES)).tolist()


def test_a_linked_replay_log_folder_refuses_the_start(tmp_path: Path) -> None:
    from learner.checkpoint import RunFolderError, RunLock

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "seg-000000.jsonl.gz").write_bytes(b"keep me")
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / "replay_log").symlink_to(elsewhere)
    with pytest.raises(RunFolderError, match="replay_log"):
        RunLock(run)
    with pytest.raises(OSError, match="symbolic link"):
        ReplayLog(run, max_bytes=1 << 20)
    assert (elsewhere / "seg-000000.jsonl.gz").read_bytes() == b"keep me"


# -- issue 54 items 3 and 10: every segment is untrusted input -------------------------------------------
@pytest.mark.timeout(120)
def test_a_fifo_named_like_a_segment_stops_a_resume_with_a_named_error(runs: Path, tmp_path: Path, capsys) -> None:
    """The repro: a FIFO named like a segment in ``replay_log/`` hung ``train.py --resume`` (still
    waiting after 90 s): segments were read whole, with no regular-file check. Now the resume
    ends at once, exit 2, naming the file."""
    import os
    import time

    import train

    run = tmp_path / "fifo"
    shutil.copytree(runs / "fresh", run)
    fifo = run / "replay_log" / "seg-000099.jsonl.gz"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    code = train.main(["--resume", str(run / "checkpoints" / "iter_000003"), "--iterations", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "seg-000099.jsonl.gz is not a regular file" in err, err[-2000:]
    assert time.monotonic() - t0 < 60
    from agents.safeio import UnsafeFileError

    with pytest.raises(UnsafeFileError, match="seg-000099.jsonl.gz is not a regular file"):
        read_replay_log(run)
    fifo.unlink()
    fifo.symlink_to("/dev/zero")
    with pytest.raises(UnsafeFileError, match="seg-000099.jsonl.gz is a symbolic link"):
        read_replay_log(run)


def test_a_segment_that_is_a_compression_bomb_or_not_json_is_a_named_error(runs: Path, tmp_path: Path) -> None:
    import gzip
    import zlib

    from agents.safeio import UnsafeFileError
    from learner.replay_log import main as replay_log_main

    run = tmp_path / "bomb"
    shutil.copytree(runs / "fresh", run)
    (seg,) = sorted((run / "replay_log").glob("seg-*.jsonl.gz"))
    good = seg.read_bytes()
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    member = comp.compress(b"\n" * (32 << 20)) + comp.flush()
    seg.write_bytes(good + member * 3)  # ~100 KB on disk, 96 MB of text
    with pytest.raises(UnsafeFileError, match=r"seg-000000\.jsonl\.gz decompresses past 67,108,864 bytes for the segment"):
        read_replay_log(run)
    for junk in (b"not json\n", b'{"type": "draw"\n', b"[1, 2]\n", b"\xff\xfe\n"):
        seg.write_bytes(good + gzip.compress(junk))
        with pytest.raises(UnsafeFileError, match=rf"seg-000000\.jsonl\.gz: the member at byte {len(good):,}"):
            read_replay_log(run)
        with pytest.raises(UnsafeFileError, match="seg-000000.jsonl.gz"):
            ReplayLog(run, max_bytes=1 << 20, resume_iteration=3)  # what a resume does
    assert replay_log_main([str(run)]) == 2  # the CLI: one line, no traceback


def test_the_viewer_stops_decompressing_a_bomb_segment_while_reading_it(runs: Path, tmp_path: Path) -> None:
    """The repro of issue 54 item 4, scaled down: a segment of many gzip members of 16 MB each
    (about 400 KB on disk) was decompressed whole, its per-run cap checked only afterwards (40
    members of 32 MB took the viewer to 2.6 GB with no answer in 200 s). Now the segment's cap
    (100 times the file, at least 64 MB) is checked while decompressing, one member held at a
    time: the page answers at once, naming the problem, with the iterations before the bomb."""
    import time
    import tracemalloc
    import zlib

    from agents.view.replay import figures, read_log

    run = tmp_path / "bomb"
    shutil.copytree(runs / "fresh", run)
    (seg,) = sorted((run / "replay_log").glob("seg-*.jsonl.gz"))
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    member = comp.compress(b"\n" * (16 << 20)) + comp.flush()
    seg.write_bytes(seg.read_bytes() + member * 24)  # 384 MB of text
    t0 = time.monotonic()
    tracemalloc.start()
    try:
        log = read_log(run, tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 160 << 20, peak  # a member or two in memory, never the whole segment
    assert time.monotonic() - t0 < 20
    assert any("decompresses past 67,108,864 bytes for the segment" in p for p in log.problems), log.problems
    assert figures(log)["iterations"] == [1, 2, 3, 4]


@pytest.mark.parametrize("edges", ['"x"', "[]", '["a", 1]', "[3, 2, 1]", "[1e400]", '{"a": 1}', str(list(range(65)))])
def test_a_header_with_bad_age_edges_is_a_named_problem_on_the_replay_page(runs: Path, tmp_path: Path,
                                                                           edges: str) -> None:
    """A replay-log header with ``age_edges: "x"`` made /replay a 500: the page and its API
    answer, with the default edges and the problem named."""
    import gzip
    import json

    import httpx

    from conftest import ViewServer

    run = tmp_path / "runs" / "edges"
    shutil.copytree(runs / "fresh", run)
    first = sorted((run / "replay_log").glob("seg-*.jsonl.gz"))[0]
    lines = gzip.decompress(first.read_bytes()).decode().splitlines()
    assert json.loads(lines[0])["type"] == "header"
    lines[0] = lines[0].replace(json.dumps(list(AGE_EDGES)), edges)
    assert edges in lines[0]
    first.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    with ViewServer(tmp_path / "runs") as srv:
        page = httpx.get(f"{srv.url}/replay/edges", timeout=30)
        api = httpx.get(f"{srv.url}/api/replay", params={"run": "edges"}, timeout=30)
    assert page.status_code == 200, page.text[:500]
    assert api.status_code == 200, api.text[:500]
    problems = api.json()["problems"]
    assert any("age_edges" in p and "not 1 to 64 increasing numbers" in p for p in problems), problems
    assert "not 1 to 64 increasing numbers" in page.text
    assert api.json()["iterations"] == [1, 2, 3, 4] and api.json()["edges"] == [float(e) for e in AGE_EDGES]
