"""The viewer's web app: a small Starlette (ASGI) app with server-rendered pages.

Pages (docs/view.md shows each):

- ``/`` every run under the root with its task, progress, final success and verdict, and the
  saved play episodes; tick runs to compare them;
- ``/run/<name>`` one run: problems found in its folder, the summary verdict and table,
  ``curves.png``, the metrics as an interactive plot, its config, evaluation phases and
  checkpoints; ``/compare?run=A&run=B`` overlays several runs (``learner.report`` in the browser);
- ``/episodes/<base>/<folder>`` the episodes of a ``records.jsonl`` folder, filterable by success
  and return; ``/episode/<base>/<folder>?n=N`` one episode turn by turn (``base`` is ``runs`` for
  the root or ``plays`` for saved play episodes);
- ``/play`` picks a task, a seed and a model; ``/play/<id>`` steps the model or a typed reply,
  and saves the episode as a record and a GIF;
- ``/replay/<name>`` a run's replay (``<run>/replay_log``): the buffer's and the drawn batches'
  ages over time, ESS by age bucket, the share of the update from replay, tau and the drift,
  gradient norm and clip fraction of replay and on-policy updates (``/api/replay?run=`` feeds
  its plots, polled while the run goes on), the most replayed episodes;
  ``/replayed/<name>?id=N`` one logged training episode with every replay of it.

Every expected failure (a damaged run folder, unreadable records, an unknown task, a
half-written checkpoint) is a :class:`~agents.view.runs.ViewError` shown as a message on the
page; anything else is logged with its traceback and shown as a one-line error, never a trace.
Everything is served from this machine: no page loads anything from elsewhere, and the viewer
itself never contacts the model hub (a run's config naming a hub id shows token ids instead).

Run folders are untrusted input (docs/reliability.md#the-viewer-python--m-agentsview): only regular files inside
the roots are read or served, every file is bounded in size and parsed with bounded depth, and
one bad run folder is shown as a bad run without affecting the others. POSTs must carry the
viewer's own ``Origin``; the Host check holds for every loopback bind; play options, replies and
request bodies are bounded, and each play session has its own lock.
"""

from __future__ import annotations

import html
import logging
import math
import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

import jinja2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from agents.runfolder import CURVES, MAX_BYTES, is_run_folder
from agents.safeio import UnsafeFileError, inside, read_regular
from agents.view import episodes as ep
from agents.view import replay as rp
from agents.view.sessions import MAX_REPLY_CHARS, TINY, Sessions, check_play_options, save_folder
from agents.view.runs import RunInfo, ViewError, finite, find_runs, load_run, newest_model_folder, safe_join

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
#: The most runs one ``/compare`` or ``/api/metrics`` request reads (repeats count once).
MAX_COMPARED = 32
#: The largest POST body the viewer reads (its forms are a few hundred bytes).
MAX_FORM_BYTES = 64 << 10
#: The largest saved play GIF served.
MAX_GIF_BYTES = 64 << 20


def _fmt(value: Any, digits: int = 3) -> str:
    """A number for a table cell ('' for missing, 'n/a' for NaN)."""
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return "n/a"
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    return str(value)


class Viewer:
    """The app's state: the folder it serves, where played episodes are saved, the play sessions."""

    def __init__(self, root: Path, play_dir: Path | None = None, device: str = "cpu", dtype: str = "auto",
                 max_new_tokens: int = 32, threads: int | None = None) -> None:
        root = Path(root).expanduser().resolve()
        if not root.is_dir():
            raise ViewError(f"{root} is not a folder")
        # A run folder given directly: serve its parent, listing only this run.
        self.only: str | None = None
        if is_run_folder(root):
            self.only, root = root.name, root.parent
        self.root = root
        self.play_dir = Path(play_dir).expanduser().resolve() if play_dir else (root / "play")
        self.sessions = Sessions(device=device, dtype=dtype, max_new_tokens=max_new_tokens, threads=threads)
        self.env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(HERE / "templates")),
                                      autoescape=jinja2.select_autoescape(["html"]), undefined=jinja2.StrictUndefined)
        self.env.filters["fmt"] = _fmt
        self.env.filters["q"] = lambda s: quote(str(s))
        self.env.globals["urlencode"] = urlencode

    # -- helpers -----------------------------------------------------------------------------
    def render(self, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        """A template rendered as an HTML response."""
        return HTMLResponse(self.env.get_template(name).render(**context), status_code=status)

    def runs(self) -> list[Path]:
        """The run folders this viewer lists."""
        found = find_runs(self.root)
        if self.only is not None:
            found = [p for p in found if p.name == self.only and p.parent == self.root]
        return found

    def run(self, name: str) -> RunInfo:
        """The run called ``name`` (its path under the root), or a 404 :class:`ViewError`."""
        path = safe_join(self.root, name)
        if not is_run_folder(path) or (self.only is not None and path != (self.root / self.only).resolve()):
            raise ViewError(f"no run called {name!r} under {self.root} (a run folder holds config.yaml, "
                            "metrics.jsonl or summary.json)", status=404)
        return load_run(self.root, path)

    def base(self, base: str) -> Path:
        """The folder a records location names: ``runs`` (the root) or ``plays`` (saved play episodes)."""
        if base == "runs":
            return self.root
        if base == "plays":
            return self.play_dir
        raise ViewError(f"unknown records location {base!r} (runs or plays)", status=404)

    def records_folder(self, base: str, folder: str) -> Path:
        """A folder holding ``records.jsonl`` under a records location, or a 404 :class:`ViewError`."""
        path = safe_join(self.base(base), folder)
        only = (self.root / self.only).resolve() if base == "runs" and self.only is not None else None
        if not (path / "records.jsonl").is_file() or (only is not None and only not in (path, *path.parents)):
            raise ViewError(f"no records.jsonl in {folder!r}", status=404)
        return path

    def saved_plays(self) -> list[dict[str, Any]]:
        """The saved play episodes, newest first."""
        if not self.play_dir.is_dir():
            return []
        out = []
        for p in sorted(self.play_dir.iterdir(), reverse=True):
            if (p / "records.jsonl").is_file():
                out.append({"name": p.name, "gif": (p / "episode.gif").is_file()})
        return out

    def tokenizer_for(self, base: str, folder: Path, records: list) -> Any:
        """The tokenizer that sampled these records: the run's checkpoint (or reference) model,
        else the model a play record names, else the embedded model of the task."""
        model: str | Path | None = None
        if base == "runs":
            for parent in [folder, *folder.parents]:
                if parent == self.root.parent:
                    break
                if is_run_folder(parent):
                    run = load_run(self.root, parent)
                    model = newest_model_folder(run) or run.config.get("model")
                    break
        if model is not None and not Path(str(model)).is_dir():
            model = None  # a hub id in a run's config is never looked up: nothing leaves the machine
        if model is None and records:
            named = str(records[0].info.get("model", ""))
            if named and "\x00" not in named and Path(named).is_dir():
                model = named
        if model is None and records:
            try:
                from agents.policies.tiny import build_tiny_model
                from envs.registry import task_spec

                model = build_tiny_model(task_spec(records[0].env_id).modality)
            except Exception as exc:  # an unregistered task or no cache: show ids
                logger.warning("no tokenizer for %s: %s", folder, exc)
        return ep.load_tokenizer(model)

    # -- pages -------------------------------------------------------------------------------
    def index(self, request: Request) -> Response:
        """``/``: every run and the saved play episodes."""
        runs = [load_run(self.root, p) for p in self.runs()]
        return self.render("runs.html", runs=runs, root=str(self.root), plays=self.saved_plays(),
                           play_dir=str(self.play_dir))

    def run_page(self, request: Request) -> Response:
        """``/run/<name>``: one run."""
        run = self.run(request.path_params["name"])
        return self.render("run.html", run=run)

    def curves(self, request: Request) -> Response:
        """``/curves/<name>``: the run's ``curves.png``."""
        run = self.run(request.path_params["name"])
        if not run.has_curves:
            raise ViewError(f"{run.name} has no curves.png yet (train.py writes it when the run finishes)", status=404)
        return Response(_served(run.path / CURVES, MAX_BYTES[CURVES], self.root), media_type="image/png")

    def compare(self, request: Request) -> Response:
        """``/compare?run=A&run=B``: several runs side by side."""
        names = _distinct_runs(request.query_params.getlist("run"))
        if not names:
            raise ViewError("tick at least one run on the runs page to compare")
        runs = [self.run(n) for n in names]
        return self.render("compare.html", runs=runs)

    def metrics_api(self, request: Request) -> Response:
        """``/api/metrics?run=A``: the metric rows of runs as strict JSON (NaN -> null), for the plots."""
        names = _distinct_runs(request.query_params.getlist("run"))
        out = []
        for name in names:
            run = self.run(name)
            out.append({"name": run.name, "rows": finite(run.metrics), "problems": run.metrics_problems})
        return JSONResponse({"runs": out})

    def replay_log(self, run: RunInfo) -> rp.ReplayLog:
        """A run's replay log, or a 404 :class:`ViewError` saying why there is none."""
        log = rp.read_log(run.path, self.root)
        if log is None:
            why = ("it trains on-policy only (--replay none)" if run.config.get("replay") == "none"
                   else "it was trained without one (--replay-log-mb 0, or before replay logs existed)")
            raise ViewError(f"{run.name} has no replay log: {why}", status=404)
        return log

    def replay_page(self, request: Request) -> Response:
        """``/replay/<name>``: the run's replay."""
        run = self.run(request.path_params["name"])
        log = self.replay_log(run)
        return self.render("replay.html", run=run, log=log, fig=rp.figures(log))

    def replay_api(self, request: Request) -> Response:
        """``/api/replay?run=A``: the replay page's figures as strict JSON (NaN -> null)."""
        run = self.run(request.query_params.get("run", "").strip("/"))
        log = self.replay_log(run)
        return JSONResponse({"name": run.name, "finished": run.finished, "problems": log.problems,
                             **finite(rp.figures(log))})

    def replayed(self, request: Request) -> Response:
        """``/replayed/<name>?id=N``: a logged training episode and its replays."""
        run = self.run(request.path_params["name"])
        log = self.replay_log(run)
        item_id = _int_param(request, "id", -1)
        rec, row, replays = rp.episode(log, item_id, self.root)
        model = newest_model_folder(run)
        tokenizer = ep.load_tokenizer(model)
        turns = ep.turn_views(rec, tokenizer, [r.log_ratios for r in replays])
        clip = log.header.get("clip") or [0.2, 0.2]
        return self.render("replayed.html", run=run, rec=rec, row=row, turns=turns, replays=replays, item_id=item_id,
                           tokens_known=tokenizer is not None, clip=clip)

    def episodes(self, request: Request) -> Response:
        """``/episodes/<base>/<folder>``: the episodes of a records folder, filtered."""
        base, folder = request.path_params["base"], request.path_params["folder"]
        path = self.records_folder(base, folder)
        flt, filter_error = ep.EpisodeFilter(), ""
        try:
            flt = ep.EpisodeFilter.parse(dict(request.query_params))
        except ViewError as exc:
            filter_error = str(exc)
        records = ep.records_in(path)
        shown = ep.filter_episodes(records, flt)
        wins = sum(r.success for _, r in shown)
        return self.render("episodes.html", base=base, folder=folder, shown=shown, total=len(records), flt=flt,
                           filter_error=filter_error, wins=wins, crumbs=self.crumbs(base, folder),
                           mean_return=(sum(r.episode_return for _, r in shown) / len(shown)) if shown else None)

    def crumbs(self, base: str, folder: str) -> dict[str, str]:
        """The run a records folder belongs to (for links back), if any."""
        if base != "runs":
            return {}
        parts = folder.strip("/").split("/")
        if len(parts) >= 3 and parts[-2] == "eval":
            return {"run": "/".join(parts[:-2]), "phase": parts[-1]}
        return {}

    def episode(self, request: Request) -> Response:
        """``/episode/<base>/<folder>?n=N``: one episode turn by turn."""
        base, folder = request.path_params["base"], request.path_params["folder"]
        path = self.records_folder(base, folder)
        records = ep.records_in(path)
        n = _int_param(request, "n", 0)
        if not 0 <= n < len(records):
            raise ViewError(f"there is no episode {n} here ({len(records)} episodes, numbered from 0)", status=404)
        rec = records[n]
        tokenizer = self.tokenizer_for(base, path, records)
        turns = ep.turn_views(rec, tokenizer)
        image_url = f"/image/{base}/{quote(folder)}?n={n}&k="
        return self.render("episode.html", base=base, folder=folder, n=n, total=len(records), rec=rec, turns=turns,
                           image_url=image_url, tokens_known=tokenizer is not None, crumbs=self.crumbs(base, folder),
                           final_image=rec.info.get("final_image_index"))

    def image(self, request: Request) -> Response:
        """``/image/<base>/<folder>?n=N&k=K``: image K of episode N as PNG (enlarged ``scale`` times, default 4)."""
        base, folder = request.path_params["base"], request.path_params["folder"]
        records = ep.records_in(self.records_folder(base, folder))
        n, k = _int_param(request, "n", 0), _int_param(request, "k", 0)
        if not 0 <= n < len(records):
            raise ViewError(f"there is no episode {n} here", status=404)
        scale = _int_param(request, "scale", 4)
        return Response(ep.png_bytes(ep.record_image(records[n], k), scale=scale), media_type="image/png")

    def play_new(self, request: Request, error: str = "", form: dict[str, str] | None = None,
                 status: int = 200) -> Response:
        """``GET /play``: the form that starts an episode (with ``error`` and the submitted values after a bad one)."""
        import envs  # noqa: F401  (registers the tasks and plugins)
        from envs.registry import registered_tasks

        checkpoints = []
        for path in self.runs():
            run = load_run(self.root, path)
            for ck in run.checkpoints:
                if ck.iteration is not None:
                    checkpoints.append({"value": str(ck.path), "label": f"{run.name} / {ck.name}",
                                        "env_id": run.env_id, "problem": ck.problem})
        form = dict(form or {})
        for key in ("env_id", "seed", "model", "model_path", "kwargs", "decoding"):
            form.setdefault(key, request.query_params.get(key, ""))
        tasks = registered_tasks()
        asked = form.get("env_id", "").strip()
        if asked and not error and asked not in {t.id for t in tasks}:  # a link to a task this viewer lacks: say so
            error = (f"unknown task {asked[:200]!r}: not registered here (a plugin not installed, or a task in a "
                     "file: start the viewer with --import)")
            status = 404
        return self.render("play_new.html", status=status, tasks=tasks, checkpoints=checkpoints,
                           error=error, form=form, tiny=TINY)

    async def play_start(self, request: Request) -> Response:
        """``POST /play``: start a session and go to its page."""
        form = await _form(request)
        try:
            env_id = form.get("env_id", "").strip()
            if not env_id:
                raise ViewError("pick a task")
            seed_raw = form.get("seed", "").strip() or "0"
            try:
                seed = int(seed_raw)
            except ValueError:
                raise ViewError(f"the seed must be a whole number, not {seed_raw!r}") from None
            model = form.get("model_path", "").strip() or form.get("model", "").strip() or TINY
            if "\x00" in model or len(model) > 4096:
                raise ViewError("the model must be a folder path, tiny, or a checkpoint listed here")
            kwargs = _parse_kwargs(form.get("kwargs", ""))
            from starlette.concurrency import run_in_threadpool

            session = await run_in_threadpool(self.sessions.start, env_id, seed, model,
                                              greedy=form.get("decoding", "greedy") != "sampled", env_kwargs=kwargs)
        except ViewError as exc:
            return self.play_new(request, error=str(exc), form=form, status=exc.status)
        return RedirectResponse(f"/play/{session.id}", status_code=303)

    def play_page(self, request: Request, error: str = "", status: int = 200) -> Response:
        """``/play/<id>``: the session's current observation, controls and turns so far."""
        session = self.sessions.get(request.path_params["sid"])
        rec = session.trajectory()
        tokenizer = session.player.policy.tokenizer
        saved = None
        if session.saved_to is not None:
            saved = {"folder": str(session.saved_to), "name": session.saved_to.name,
                     "gif": (session.saved_to / "episode.gif").is_file()}
        return self.render("play.html", status=status, s=session, rec=rec, turns=ep.turn_views(rec, tokenizer),
                           image_url=f"/play/{session.id}/image?k=", error=error, saved=saved,
                           frame=len(session.frames) - 1,
                           frame_url=f"/play/{session.id}/frame?k=" if session.frames else None)

    async def play_step(self, request: Request) -> Response:
        """``POST /play/<id>/step``: a model step, a typed reply, or the model to the end."""
        from starlette.concurrency import run_in_threadpool

        session = self.sessions.get(request.path_params["sid"])
        form = await _form(request)
        action = form.get("action", "model")

        reply = form.get("reply", "")
        if action == "typed" and len(reply) > MAX_REPLY_CHARS:
            return self.play_page(request, error=f"a typed reply is limited to {MAX_REPLY_CHARS:,} characters "
                                                 f"(this one has {len(reply):,})", status=413)

        def work() -> None:
            with session.lock:  # this session's own: other sessions step meanwhile
                if action == "model":
                    session.step_model()
                elif action == "typed":
                    session.step_typed(reply)
                elif action == "auto":
                    while not session.done:
                        session.step_model()
                else:
                    raise ViewError(f"unknown action {str(action)[:40]!r}")

        try:
            await run_in_threadpool(work)
        except ViewError as exc:
            return self.play_page(request, error=str(exc), status=exc.status)
        return RedirectResponse(f"/play/{session.id}#now", status_code=303)

    async def play_save(self, request: Request) -> Response:
        """``POST /play/<id>/save``: write the episode as a record and a GIF."""
        session = self.sessions.get(request.path_params["sid"])
        from starlette.concurrency import run_in_threadpool

        def work() -> None:
            with session.lock:
                session.save(save_folder(self.play_dir, session))

        try:
            await run_in_threadpool(work)
        except ViewError as exc:
            return self.play_page(request, error=str(exc), status=exc.status)
        except OSError as exc:
            return self.play_page(request, error=f"cannot save to {self.play_dir}: {exc}", status=500)
        return RedirectResponse(f"/play/{session.id}#saved", status_code=303)

    def play_image(self, request: Request) -> Response:
        """``/play/<id>/image?k=K``: observed image K of a session (vision tasks)."""
        session = self.sessions.get(request.path_params["sid"])
        k = _int_param(request, "k", 0)
        if not 0 <= k < len(session.images):
            raise ViewError(f"this episode has no image {k}", status=404)
        return Response(ep.png_bytes(session.images[k], scale=4), media_type="image/png")

    def play_frame(self, request: Request) -> Response:
        """``/play/<id>/frame?k=K``: the task's picture after K turns (every task that renders one)."""
        session = self.sessions.get(request.path_params["sid"])
        k = _int_param(request, "k", len(session.frames) - 1)
        if not 0 <= k < len(session.frames):
            raise ViewError(f"{session.env_id} has no picture {k}", status=404)
        return Response(ep.png_bytes(session.frames[k], scale=4), media_type="image/png")

    def saved_file(self, request: Request) -> Response:
        """``/saved/<folder>``: the GIF of a saved play episode."""
        folder = safe_join(self.play_dir, request.path_params["folder"])
        gif = folder / "episode.gif"
        if not os.path.lexists(gif):
            raise ViewError("no GIF was saved for this episode", status=404)
        return Response(_served(gif, MAX_GIF_BYTES, self.play_dir), media_type="image/gif")


def _served(path: Path, max_bytes: int, root: Path) -> bytes:
    """The bytes of a file a page shows: a regular file inside ``root`` (not a link, FIFO or
    device) of at most ``max_bytes``, else a :class:`ViewError`."""
    try:
        return read_regular(path, max_bytes=max_bytes, root=root)
    except FileNotFoundError:
        raise ViewError(f"{path.name} is not there", status=404) from None
    except (UnsafeFileError, OSError) as exc:
        raise ViewError(f"{path.name} is not served: {exc}", status=403) from None


def _distinct_runs(names: list[str]) -> list[str]:
    """The runs a request names, each once (``run=A&run=A`` reads A once), at most :data:`MAX_COMPARED`."""
    out = list(dict.fromkeys(n.strip("/") for n in names))
    if len(out) > MAX_COMPARED:
        raise ViewError(f"compare at most {MAX_COMPARED} runs at a time ({len(out)} were ticked)")
    return out


def _int_param(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ViewError(f"{name} must be a whole number, not {raw!r}") from None


async def _form(request: Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body as a dict (first value of each field); a
    body over :data:`MAX_FORM_BYTES` is a 413 :class:`ViewError`, read no further."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_FORM_BYTES:
        raise ViewError(f"the form is {int(declared):,} bytes; the viewer reads at most {MAX_FORM_BYTES:,}", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_FORM_BYTES:
            raise ViewError(f"the form is over {MAX_FORM_BYTES:,} bytes, the most the viewer reads", status=413)
        chunks.append(chunk)
    body = b"".join(chunks).decode("utf-8", errors="replace")
    return {k: v[0] for k, v in parse_qs(body, keep_blank_values=True).items()}


def _parse_kwargs(text: str) -> dict[str, Any]:
    """``size=8 is_slippery=true`` (spaces or commas between) -> task keyword arguments, bounded
    (:func:`agents.view.sessions.check_play_options`)."""
    from envs.play import parse_kwargs

    if len(text) > 1000:
        raise ViewError(f"task options: at most 1,000 characters ({len(text):,} given)")
    pairs = [p for p in text.replace(",", " ").split() if p]
    try:
        return check_play_options(parse_kwargs(pairs))
    except (ValueError, SyntaxError, RecursionError, MemoryError) as exc:
        raise ViewError(f"task options: {exc}") from None


#: Host names a loopback-bound viewer answers to (any other Host header is refused, so a web
#: page elsewhere cannot read the runs through DNS rebinding).
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "::1", "[::1]"]


def is_loopback(host: str) -> bool:
    """Whether ``--host`` binds a loopback interface only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class SameOriginPosts:
    """ASGI middleware: a POST must carry an ``Origin`` naming this viewer's own address (the
    Host it was asked as): a form from another site, a sandboxed iframe (``Origin: null``) or a
    client that sends no Origin at all is refused with 403. Browsers send ``Origin`` with every
    POST, so the viewer's own forms pass."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            origin, host = headers.get("origin"), headers.get("host", "")
            scheme, sep, rest = (origin or "").partition("://")
            if not origin or not sep or scheme not in ("http", "https") or rest.rstrip("/") != host or not host:
                shown = "a page that sent no Origin" if not origin else f"a form from {origin[:100]}"
                response = HTMLResponse(f"refused: {html.escape(shown)} may not post to this viewer (open the "
                                        "viewer's own page and use its form)", status_code=403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(root: str | Path, play_dir: str | Path | None = None,
               allowed_hosts: list[str] | None = None, device: str = "cpu", dtype: str = "auto",
               max_new_tokens: int = 32, threads: int | None = None) -> Starlette:
    """The viewer app serving the run folders under ``root``; played episodes are saved to
    ``play_dir`` (default ``root/play``). ``allowed_hosts`` are the Host names it answers to
    (default: the loopback names; ``["*"]`` for any). Play loads models on ``device`` in
    ``dtype`` (``--device``/``--dtype``) with replies of at most ``max_new_tokens`` tokens, on
    ``threads`` torch threads (``--threads``; None: the default for the largest model loaded)."""
    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware

    viewer = Viewer(Path(root), Path(play_dir) if play_dir else None, device=device, dtype=dtype,
                    max_new_tokens=max_new_tokens, threads=threads)

    async def view_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ViewError)
        return viewer.render("error.html", status=exc.status, message=str(exc))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = "no such page" if exc.status_code == 404 else str(exc.detail)
        return viewer.render("error.html", status=exc.status_code, message=message)

    async def server_error(request: Request, exc: Exception) -> Response:
        logger.error("error serving %s", request.url.path, exc_info=exc)
        return viewer.render("error.html", status=500,
                             message=f"unexpected error: {type(exc).__name__}: {exc} (the details are in the viewer's log)")

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True, "root": str(viewer.root)})

    routes = [
        Route("/", viewer.index),
        Route("/healthz", healthz),
        Route("/run/{name:path}", viewer.run_page),
        Route("/curves/{name:path}", viewer.curves),
        Route("/compare", viewer.compare),
        Route("/api/metrics", viewer.metrics_api),
        Route("/replay/{name:path}", viewer.replay_page),
        Route("/api/replay", viewer.replay_api),
        Route("/replayed/{name:path}", viewer.replayed),
        Route("/episodes/{base}/{folder:path}", viewer.episodes),
        Route("/episode/{base}/{folder:path}", viewer.episode),
        Route("/image/{base}/{folder:path}", viewer.image),
        Route("/play", viewer.play_new, methods=["GET"]),
        Route("/play", viewer.play_start, methods=["POST"]),
        Route("/play/{sid}", viewer.play_page, methods=["GET"]),
        Route("/play/{sid}/step", viewer.play_step, methods=["POST"]),
        Route("/play/{sid}/save", viewer.play_save, methods=["POST"]),
        Route("/play/{sid}/image", viewer.play_image),
        Route("/play/{sid}/frame", viewer.play_frame),
        Route("/saved/{folder:path}", viewer.saved_file),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts or LOOPBACK_HOSTS),
                  Middleware(SameOriginPosts)]
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={ViewError: view_error, HTTPException: http_error, Exception: server_error})
    app.state.viewer = viewer
    return app
