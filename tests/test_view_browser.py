"""The viewer end to end in a real headless browser: Chromium driven by Playwright against
``python -m agents.view`` on loopback, over real tiny run folders.

Run with ``make test-view`` (``pytest tests/test_view_browser.py --browser``); it needs the
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A text run of two iterations, a FrozenLakeVision run (its records hold images) and a
    damaged copy of the text run."""
    root = tmp_path_factory.mktemp("view-browser")
    make_tiny_run(root, "frozenlake", iterations=2)
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
