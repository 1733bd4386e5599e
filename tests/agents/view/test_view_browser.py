"""The viewer end to end in a real headless browser: Chromium driven by Playwright against
``python -m agents.view`` on loopback, over real tiny run folders.

Run with ``make test-view`` (``pytest tests/agents/view/test_view_browser.py --browser``); it needs the
``.[browser]`` extra and a Chromium (Debian: ``apt-get install chromium``; another one through
``FRESHPER_CHROMIUM=/path/to/chrome``). ``--screenshots docs/img`` writes the screenshots
docs/view.md shows.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from agents.record import load_records
import numpy as np

from conftest import ViewServer, damage_run, make_tiny_run

pytestmark = pytest.mark.browser

CHROMIUM_ARGS = ["--no-sandbox", "--disable-background-networking", "--disable-gpu", "--no-first-run",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


def chromium_path() -> str:
    """The Chromium to drive: ``$FRESHPER_CHROMIUM``, else one on the PATH."""
    path = os.environ.get("FRESHPER_CHROMIUM") or next(
        (p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if not path:
        pytest.fail("no Chromium found: apt-get install chromium (or set FRESHPER_CHROMIUM)")
    return path


#: The text run's replay: --replay fresh with --tau auto, 4 items per replay update from a buffer of
#: 12, so over 5 iterations of 4 episodes items age, are drawn repeatedly and are evicted; a short
#: pretraining makes replies well-formed, so returns differ within groups and the advantages,
#: priorities, IS weights, ESS and gradients the page shows are not constants.
REPLAY = dict(replay="fresh", replay_batch=4, buffer_capacity=12, tau="auto", pretrain_steps=40, pretrain_batch=16)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A text run of five iterations with --replay fresh, a FrozenLakeVision run (its records
    hold images) and a damaged copy of the text run."""
    root = tmp_path_factory.mktemp("view-browser")
    make_tiny_run(root, "frozenlake", iterations=5, **REPLAY)
    make_tiny_run(root, "frozenlake-vision", env_id="freshper/FrozenLakeVision-v0")
    damage_run(root / "frozenlake", root / "damaged")
    return root


@pytest.fixture(scope="module")
def server(runs: Path):
    with ViewServer(runs) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    # A page may answer 4xx with its message (a bad form); what it loads (images, scripts, data) may not.
    pg.on("console", lambda msg: errors.append(msg.text)
          if msg.type == "error" and not msg.text.startswith("Failed to load resource") else None)
    pg.on("response", lambda r: errors.append(f"{r.status} {r.url}")
          if r.status >= 400 and r.request.resource_type != "document" else None)
    requests: list[str] = []
    pg.on("request", lambda req: requests.append(req.url))
    yield pg
    context.close()
    assert not errors, f"errors in the page: {errors}"
    outside = [u for u in requests if not u.startswith(server.url)]
    assert not outside, f"the page loaded something from elsewhere: {outside}"


@pytest.fixture
def shot(request, tmp_path: Path):
    """Save a full-page screenshot under --screenshots DIR (else the test's tmp folder)."""
    folder = Path(request.config.getoption("--screenshots") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)

    def take(pg, name: str) -> Path:
        path = folder / f"view-{name}.png"
        height = min(2200, pg.evaluate("document.documentElement.scrollHeight"))
        pg.screenshot(path=str(path), full_page=True, clip={"x": 0, "y": 0, "width": 1280, "height": height})
        assert path.stat().st_size > 10_000
        return path

    return take


def image_loaded(pg, selector: str) -> list[int]:
    """naturalWidth of every image matching ``selector`` once loaded (0: broken)."""
    pg.wait_for_function(f"[...document.querySelectorAll('{selector}')].every(i => i.complete)")
    return pg.eval_on_selector_all(selector, "els => els.map(e => e.naturalWidth)")


def test_open_a_run_see_its_curves_verdict_and_interactive_metrics(page, server, runs, shot) -> None:
    page.goto(server.url + "/")
    rows = page.locator("[data-testid=run-row]")
    assert sorted(rows.evaluate_all("els => els.map(e => e.dataset.run)")) == ["damaged", "frozenlake", "frozenlake-vision"]
    shot(page, "runs")
    page.click("a[href='/run/frozenlake']")
    page.wait_for_url("**/run/frozenlake")
    summary = json.loads((runs / "frozenlake" / "summary.json").read_text())
    assert page.inner_text("[data-testid=verdict]").strip().splitlines()[0] == summary["verdict"].split("\n")[0]
    from PIL import Image

    with Image.open(runs / "frozenlake" / "curves.png") as im:
        assert image_loaded(page, "[data-testid=curves]") == [im.width]
    train_rows = [json.loads(line) for line in (runs / "frozenlake" / "metrics.jsonl").read_text().splitlines()]
    n_train = sum(r["kind"] == "train" for r in train_rows)
    series = page.locator("[data-testid=plot-series]")
    series.first.wait_for(state="attached")
    assert series.count() == 1 and series.first.get_attribute("data-points") == str(n_train)
    page.select_option("[data-testid=plot-metric]", "time_rollout_s")  # differs between iterations
    assert "time_rollout_s" in page.locator("[data-testid=plot-svg] text").all_text_contents()
    ys = {float(pt.split(",")[1]) for pt in page.locator("[data-testid=plot-series]").first.get_attribute("d")[1:].split("L")}
    assert len(ys) == len({r["time_rollout_s"] for r in train_rows if r["kind"] == "train"})
    page.select_option("[data-testid=plot-kind]", "eval")
    names = page.locator("[data-testid=plot-series]").evaluate_all("els => els.map(e => e.dataset.series)")
    assert names == ["frozenlake \u00b7 greedy", "frozenlake \u00b7 sampled"]
    page.select_option("[data-testid=plot-metric]", "success")
    page.hover("[data-testid=plot-hit]")
    tip = page.locator("[data-testid=plot-tooltip]")
    assert tip.is_visible() and "frozenlake \u00b7 sampled" in tip.inner_text()
    assert page.locator("[data-testid=checkpoints] .badge.ok").count() >= 2
    shot(page, "run")


def test_overlay_several_runs(page, server, shot) -> None:
    page.goto(server.url + "/")
    page.check("input[value=frozenlake]")
    page.check("input[value=damaged]")
    page.click("text=Compare ticked runs")
    page.wait_for_url("**/compare?**")
    page.locator("[data-testid=plot-series]").first.wait_for(state="attached")
    names = page.locator("[data-testid=plot-series]").evaluate_all("els => els.map(e => e.dataset.series)")
    assert sorted(names) == ["damaged", "frozenlake"]
    assert page.locator("[data-testid=compare-table] tbody tr").count() == 2
    assert "skipped" in page.inner_text(".plot .note")  # the damaged run's bad lines are said, not hidden
    shot(page, "compare")


def test_open_an_episode_of_a_vision_task_and_see_its_images(page, server, runs, shot) -> None:
    page.goto(server.url + "/run/frozenlake-vision")
    page.click("[data-testid=phases] >> text=final")
    records = load_records(runs / "frozenlake-vision" / "eval" / "final")
    assert page.locator("[data-testid=episode-row]").count() == len(records)
    page.select_option("select[name=success]", "yes")
    page.click("text=Filter")
    assert page.locator("[data-testid=episode-row]").count() == sum(r.success for r in records)
    page.fill("input[name=min_return]", "abc")
    page.click("text=Filter")
    assert "min return must be a number" in page.inner_text("[data-testid=error]")
    page.goto(server.url + "/episodes/runs/frozenlake-vision/eval/final")
    page.click("text=episode 0")
    rec = records[0]
    assert page.locator("[data-testid=turn]").count() == rec.num_turns
    widths = image_loaded(page, "[data-testid=obs-image]")
    assert len(widths) == rec.num_turns and all(w == rec.images[0].shape[1] * 4 for w in widths)
    assert image_loaded(page, "[data-testid=final-image]")[0] > 0
    first = page.locator("[data-testid=turn]").first
    tokens = first.locator("[data-testid=reply-tokens] .tok")
    assert tokens.count() == int(rec.samples[0].loss_mask.sum())
    assert "background" in (tokens.first.get_attribute("style") or "")
    shot(page, "episode")


def test_play_three_model_turns_and_one_typed_then_save(page, server, runs, shot) -> None:
    page.goto(server.url + "/play")
    page.select_option("[data-testid=task]", "freshper/FrozenLake-v0")
    page.fill("[data-testid=seed]", "0")
    page.select_option("[data-testid=model]", "tiny")
    page.click("[data-testid=start]")
    page.wait_for_url("**/play/*")
    sources = [page.get_attribute("[data-testid=current-image]", "src")]
    assert image_loaded(page, "[data-testid=current-image]")[0] > 0
    for k in range(3):
        page.click("[data-testid=model-step]")
        page.wait_for_function(f"document.querySelectorAll('[data-testid=turn]').length === {k + 1}")
        sources.append(page.get_attribute("[data-testid=current-image]", "src"))
        assert image_loaded(page, "[data-testid=current-image]")[0] > 0
    page.fill("[data-testid=reply]", "Right")
    page.click("[data-testid=send]")
    page.wait_for_function("document.querySelectorAll('[data-testid=turn]').length === 4")
    sources.append(page.get_attribute("[data-testid=current-image]", "src"))
    assert len(set(sources)) == 5  # a new picture every turn
    assert page.locator("[data-testid=typed]").count() == 1
    assert "You moved Right" in page.inner_text("[data-testid=current-observation]")
    page.click("[data-testid=save]")
    saved = page.inner_text("[data-testid=saved]")
    folder = next(p for p in (runs / "play").iterdir() if p.name in saved)
    (rec,) = load_records(folder)
    assert rec.num_turns == 4 and rec.info["typed_turns"] == [3] and rec.turns[3].reply == "<answer>Right</answer>"
    assert (folder / "episode.gif").is_file()
    shot(page, "play")
    page.click("[data-testid=record-link]")
    assert page.locator("[data-testid=turn]").count() == 4 and page.locator("[data-testid=typed]").count() == 1


def test_a_damaged_run_shows_clear_messages_not_a_trace(page, server, runs, shot) -> None:
    page.goto(server.url + "/run/damaged")
    problems = page.inner_text("[data-testid=problems]")
    assert "metrics.jsonl line 2 is not valid JSON" in problems
    assert "incomplete (a run still writing, or killed mid-line)" in problems
    assert "incomplete or damaged checkpoint" in problems and "half-written checkpoint" in problems
    assert "Traceback" not in page.content()
    assert page.locator("[data-testid=curves]").count() == 1  # what could be read is still shown
    shot(page, "problems")
    broken = sorted((runs / "damaged" / "checkpoints").glob("iter_*"))[-1]
    page.goto(server.url + "/play")
    page.select_option("[data-testid=task]", "freshper/FrozenLake-v0")
    page.select_option("[data-testid=model]", str(broken))
    page.click("[data-testid=start]")
    error = page.inner_text("[data-testid=error]")
    assert "cannot play" in error and "model.safetensors" in error and "half-written" in error
    assert "Traceback" not in page.content()


# -- the replay -----------------------------------------------------------------------------------
def replay_rows(run: Path) -> list[dict]:
    from learner.replay_log import read_replay_log

    return read_replay_log(run)


def test_the_replay_page_shows_the_runs_own_age_histograms_and_ess(page, server, runs, shot) -> None:
    from learner.loss import AGE_BUCKETS, age_bucket_name
    from learner.replay_log import AGE_EDGES, bucket_of

    run = runs / "frozenlake"
    rows = replay_rows(run)
    metrics = {r["iteration"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if r["kind"] == "train"}
    page.goto(server.url + "/run/frozenlake")
    page.click("[data-testid=replay-link] a")
    page.wait_for_url("**/replay/frozenlake")
    page.locator("[data-testid=heat-cell]").first.wait_for(state="attached")
    its = [r for r in rows if r["type"] == "iteration"]
    assert page.get_attribute("[data-testid=replay-status]", "data-iterations") == str(len(its)) == "5"
    names = [f"{AGE_EDGES[b]}+" if b == len(AGE_EDGES) - 1 else
             (str(AGE_EDGES[b]) if AGE_EDGES[b + 1] - AGE_EDGES[b] == 1 else f"{AGE_EDGES[b]}-{AGE_EDGES[b + 1] - 1}")
             for b in range(len(AGE_EDGES))]

    def cells(kind: str) -> dict[tuple[int, str], int]:
        found = page.locator(f"[data-testid=heat-cell][data-kind={kind}]").evaluate_all(
            "els => els.map(e => [e.dataset.iteration, e.dataset.bucket, e.dataset.count])")
        return {(int(i), b): int(c) for i, b, c in found}

    buffer, drawn = cells("buffer"), cells("drawn")
    for r in its:
        it = r["iteration"]
        # the buffer's histogram: the log's, which is metrics.jsonl's buffer_age_hist
        assert r["buffer"]["hist"] == metrics[it]["buffer_age_hist"]
        assert {b: c for (i, b), c in buffer.items() if i == it} == \
            {names[b]: c for b, c in enumerate(r["buffer"]["hist"]) if names[b] in {k for (_, k) in buffer}}
        ages = [a for d in rows if d["type"] == "draw" and d["iteration"] == it for a in d["ages"]]
        expected = np.bincount(bucket_of(ages), minlength=len(AGE_EDGES))
        assert {b: c for (i, b), c in drawn.items() if i == it} == \
            {names[b]: int(c) for b, c in enumerate(expected) if names[b] in {k for (_, k) in drawn}}
        assert sum(c for (i, _), c in drawn.items() if i == it) == len(ages) == 2 * 4
    # one iteration's bars: pick iteration 3
    page.select_option("[data-testid=iteration-select]", "3")
    bars = page.locator("[data-testid=iter-bar][data-kind=buffer]").evaluate_all(
        "els => els.map(e => [e.dataset.bucket, +e.dataset.value])")
    assert {b: v for b, v in bars if v} == {names[b]: c for b, c in enumerate(metrics[3]["buffer_age_hist"]) if c}
    # ESS by age bucket: the mean over each iteration's replay updates, as metrics.jsonl has it
    for lo, hi in AGE_BUCKETS:
        name = age_bucket_name(lo, hi)
        shown = json.loads(page.get_attribute(f"[data-testid=line][data-chart=ess][data-series='age {name}']", "data-values"))
        draws = [[d["stats"].get(f"ess/age_{name}") for d in rows if d["type"] == "draw" and d["iteration"] == r["iteration"]]
                 for r in its]
        mine = [float(np.mean([v for v in vs if v is not None])) if any(v is not None for v in vs) else None for vs in draws]
        assert shown == pytest.approx(mine, abs=1e-9)
        for r, v in zip(its, shown):
            if v is not None:
                assert v == pytest.approx(metrics[r["iteration"]][f"ess/age_{name}"], abs=2e-6)
    share = json.loads(page.get_attribute("[data-testid=line][data-chart=share]", "data-values"))
    assert share == pytest.approx([1 - metrics[r["iteration"]]["tokens"] / (metrics[r["iteration"]]["tokens"] + sum(
        d["stats"]["tokens"] for d in rows if d["type"] == "draw" and d["iteration"] == r["iteration"])) for r in its])
    taus = json.loads(page.get_attribute("[data-testid=line][data-chart=tau]", "data-values"))
    assert taus == pytest.approx([metrics[r["iteration"]]["tau"] for r in its], abs=1e-6)  # the log keeps 6 decimals
    grad = json.loads(page.get_attribute("[data-testid=line][data-chart=grad_norm][data-series=on-policy]", "data-values"))
    assert grad == pytest.approx([metrics[r["iteration"]]["grad_norm"] for r in its], abs=1e-6)
    by_it = [[d for d in rows if d["type"] == "draw" and d["iteration"] == r["iteration"]] for r in its]
    for chart, key in (("grad_norm", "grad_norm"), ("clip_frac", "clip_frac")):
        replayed = json.loads(page.get_attribute(f"[data-testid=line][data-chart={chart}][data-series=replay]", "data-values"))
        assert replayed == pytest.approx([float(np.mean([d["stats"][key] for d in ds])) for ds in by_it], abs=1e-6)
    # --tau auto: the fitted drift it steers by and the drift measured on the replay updates
    fitted = json.loads(page.get_attribute("[data-testid=line][data-chart=drift][data-series^=fitted]", "data-values"))
    assert fitted == [r.get("drift") for r in its] and any(v is not None for v in fitted)
    measured = json.loads(page.get_attribute("[data-testid=line][data-chart=drift][data-series^=measured]", "data-values"))
    assert measured == pytest.approx([float(np.mean([d["stats"]["drift_per_step"] for d in ds
                                                      if d["stats"].get("drift_per_step") is not None]))
                                      if any(d["stats"].get("drift_per_step") is not None for d in ds) else None
                                      for ds in by_it], abs=1e-9)
    assert "tau (--tau auto" in page.content()  # the tau chart's title says it was steered
    # the run is not degenerate: what the page shows varies
    draws = [d for ds in by_it for d in ds]
    assert len({w for d in draws for w in d["weight"]}) > 1 and len({p for d in draws for p in d["prob"]}) > 1
    assert any(a for d in draws for item in d["adv"] for a in item)  # advantages used, per item and sample
    assert any(v < 1 for r in its for k, v in metrics[r["iteration"]].items() if k.startswith("ess/age_") and v is not None)
    assert all(g > 0 for g in grad) and len(set(taus)) > 1
    shot(page, "replay")


def test_a_replayed_episode_shows_its_replay_ages_weights_and_token_ratios(page, server, runs, shot) -> None:
    rows = replay_rows(runs / "frozenlake")
    draws = [d for d in rows if d["type"] == "draw"]
    page.goto(server.url + "/replay/frozenlake")
    first = page.locator("[data-testid=top-row]").first
    item = int(first.get_attribute("data-id"))
    first.locator("a").click()
    page.wait_for_url(f"**/replayed/frozenlake?id={item}")
    mine = [(d, p) for d in draws for p, i in enumerate(d["ids"]) if i == item]
    assert len(mine) >= 2  # the log says it was replayed, more than once
    assert page.inner_text("[data-testid=replay-ages]") == ", ".join(f"{d['ages'][p]:.0f}" for d, p in mine)
    shown = page.locator("[data-testid=replay-row]").evaluate_all(
        "els => els.map(e => [+e.dataset.age, +e.dataset.weight, +e.dataset.probability])")
    assert shown == [[d["ages"][p], d["weight"][p], d["prob"][p]] for d, p in mine]
    episode = next(r for r in rows if r["type"] == "episode" and r["id"] == item)
    assert page.locator("[data-testid=turn]").count() == len(episode["turns"])
    page.check("input[name=overlay][value=adv]")
    first_turn = page.locator("[data-testid=turn]").first.locator("[data-testid=reply-tokens] .tok")
    advs = first_turn.evaluate_all("els => els.map(e => +e.dataset.value)")
    assert advs == pytest.approx([episode["advantage"] if episode["samples"][0]["adv"] is None
                                  else episode["samples"][0]["adv"]] * len(advs))
    # the overlay: the IS ratio of the second replay, token by token, as the learner computed it
    page.check("input[name=overlay][value=ratio]")
    page.select_option("[data-testid=overlay-replay]", "1")
    d, p = mine[1]
    values = first_turn.evaluate_all("els => els.map(e => +e.dataset.value)")
    reply_run = episode["samples"][0]["ids"][-1]  # window:0: the turn's reply is its sample's last sampled run
    expected = [np.exp(x) for x in d["log_ratio"][p][0][-len(reply_run):]]
    assert values == pytest.approx(expected, rel=1e-9)
    shot(page, "replayed")


def test_the_replay_page_follows_a_run_still_writing_its_log(browser, runs, tmp_path) -> None:
    from learner.replay_log import read_members

    root = tmp_path / "live-root"
    live = root / "live"
    shutil.copytree(runs / "frozenlake", live)
    (live / "summary.json").unlink()  # not finished: the page polls
    (seg,) = sorted((live / "replay_log").glob("seg-*.jsonl.gz"))
    data = seg.read_bytes()
    members = [raw for raw, _ in read_members(data)]
    seg.write_bytes(b"".join(members[:3]))  # the header and the first two iterations so far
    with ViewServer(root) as srv:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        pg = context.new_page()
        pg.goto(srv.url + "/replay/live")
        pg.wait_for_function("document.querySelector('[data-testid=replay-status]').dataset.iterations === '2'")
        with seg.open("ab") as fh:  # the run writes its next iterations
            fh.write(b"".join(members[3:]))
        pg.wait_for_function("document.querySelector('[data-testid=replay-status]').dataset.iterations === '5'",
                             timeout=20_000)
        assert pg.locator("[data-testid=heat-cell][data-kind=drawn][data-iteration='5']").count() > 0
        context.close()
