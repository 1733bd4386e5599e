"""The viewer against hostile run folders (issue 47, items 5-7): the real CLI on loopback
(``python -m agents.view``) serving a real tiny run beside folders built to hurt it.

- files it serves or parses are regular files inside its root (images too): links out, ``/dev/zero``,
  FIFOs and PNG decompression bombs are refused, and the outside files never reach a page;
- one malformed run folder (deep JSON or YAML, a YAML alias bomb, a manifest size of ``1e400``)
  is shown as a bad run while every page of the others works;
- POSTs need the viewer's own Origin, the Host check holds on 127.0.0.2 too, play is bounded, play
  sessions do not wait on each other, and a hub id in a run's config is never looked up.

Fuzz-style tests throw the same categories at the run-folder readers and the config loader.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import struct
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents.view.runs import find_runs, load_run
from conftest import ViewServer, make_tiny_run

TEXT = "freshper/FrozenLake-v0"
SECRET = "SECRET-7f3a-outside-the-root"
#: A 1 KB YAML alias bomb: nine levels of nine aliases, 387 million strings once expanded.
ALIAS_BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))
MINIMAL_CONFIG = f"env_id: {TEXT}\nseed: 0\n"


def _png_header(width: int, height: int) -> bytes:
    """A PNG claiming ``width`` x ``height`` pixels in a few hundred bytes (a decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = zlib.compress(b"\x00" * (width * 3 + 1) * 4)  # the first rows only: the rest is "truncated"
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", rows) + chunk(b"IEND", b""))


def _deep_json(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def _records_with_images(src: Path, dst: Path, image_files: list[str]) -> Path:
    """``dst/records.jsonl``: the first record of a real run, its images replaced by ``image_files``."""
    dst.mkdir(parents=True, exist_ok=True)
    meta = json.loads((src / "records.jsonl").read_text().splitlines()[0])
    meta["image_files"] = image_files
    meta["num_images"] = len(image_files)
    for k, turn in enumerate(meta["turns"]):
        turn["image_index"] = 0 if image_files and k == 0 else None
    (dst / "records.jsonl").write_text(json.dumps(meta) + "\n")
    return dst


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real tiny run, files outside the root holding a secret, and hostile folders beside the run."""
    base = tmp_path_factory.mktemp("hostile")
    root, outside = base / "runs", base / "outside"
    root.mkdir()
    outside.mkdir()
    good = make_tiny_run(root, "text")
    records = good / "eval" / "final"
    secret_png = outside / "secret.png"
    from PIL import Image

    Image.new("RGB", (3, 3), (7, 7, 7)).save(secret_png)
    secret_png.write_bytes(secret_png.read_bytes() + SECRET.encode())  # trailing bytes PIL ignores
    for name in ("secret.yaml", "secret.jsonl", "secret.json"):
        (outside / name).write_text({"secret.yaml": f"env_id: {SECRET}\n",
                                     "secret.jsonl": json.dumps({"kind": "train", "iteration": 1, SECRET: 1}) + "\n",
                                     "secret.json": json.dumps({"verdict": SECRET, "text": SECRET})}[name])

    # item 5: records naming images anywhere, and a run folder of links to outside files
    img = root / "images"
    img.mkdir()
    (img / "config.yaml").write_text(MINIMAL_CONFIG)
    phases = img / "eval"
    _records_with_images(records, phases / "absolute", [str(secret_png)])
    _records_with_images(records, phases / "dotdot", ["../../../../outside/secret.png"])
    _records_with_images(records, phases / "devzero", ["/dev/zero"])
    fifo = _records_with_images(records, phases / "fifo", ["images/pipe.png"])
    (fifo / "images").mkdir()
    os.mkfifo(fifo / "images" / "pipe.png")
    link = _records_with_images(records, phases / "link", ["images/0_0.png"])
    (link / "images").mkdir()
    (link / "images" / "0_0.png").symlink_to(secret_png)
    valid = _records_with_images(records, phases / "valid", ["images/0_0.png"])
    (valid / "images").mkdir()
    Image.new("RGB", (3, 3), (1, 2, 3)).save(valid / "images" / "0_0.png")
    for phase, (w, h) in {"bomb": (20000, 20000), "bomb25mp": (5000, 5000)}.items():
        folder = _records_with_images(records, phases / phase, ["images/0_0.png"])
        (folder / "images").mkdir()
        (folder / "images" / "0_0.png").write_bytes(_png_header(w, h))

    links = root / "links"
    links.mkdir()
    for name, target in [("config.yaml", "secret.yaml"), ("metrics.jsonl", "secret.jsonl"),
                         ("summary.json", "secret.json"), ("curves.png", "secret.png")]:
        (links / name).symlink_to(outside / target)
    (outside / "run").mkdir()
    (outside / "run" / "config.yaml").write_text(f"env_id: {SECRET}\n")
    (root / "outlink").symlink_to(outside / "run")

    # item 6: one malformed file per run folder
    bad = {
        "deep_metrics": {"metrics.jsonl": '{"kind": "train", "iteration": 1}\n' + "[" * 100_000 + "]" * 100_000 + "\n"},
        "deep_summary": {"summary.json": _deep_json(50_000)},
        "deep_yaml": {"config.yaml": "a: " + "[" * 20_000 + "]" * 20_000 + "\n"},
        "alias_bomb": {"config.yaml": ALIAS_BOMB + "env_id: *i\nmodel: *i\n"},  # shown on every page
        "recursive_alias": {"config.yaml": "a: &a [*a]\n"},
        "huge_int": {"metrics.jsonl": '{"kind": "train", "iteration": ' + "9" * 5000 + "}\n"},
        "wrong_types": {"summary.json": json.dumps({"verdict": ["x"], "iterations": {"a": [1]}, "learned": "yes",
                                                     "evals": {"final": {"success": "high", "success_ci_low": {}}}})},
        "binary": {"config.yaml": "\x00\x01\xff garbage: [\n", "metrics.jsonl": "\x00" * 100 + "\n"},
        "scalar_yaml": {"config.yaml": "5\n"},
    }
    for run, files in bad.items():
        folder = root / run
        folder.mkdir()
        if "config.yaml" not in files:
            (folder / "config.yaml").write_text(MINIMAL_CONFIG)
        for name, text in files.items():
            (folder / name).write_text(text, encoding="utf-8", errors="surrogateescape")
    for run, manifest in {"deep_manifest": _deep_json(50_000),
                          "inf_manifest": '{"iteration": 1, "files": {"model/x": {"size": 1e400, "sha256": "' + "0" * 64 + '"}}}',
                          "empty_manifest": '{"iteration": 1, "files": {}}'}.items():
        ck = root / run / "checkpoints" / "iter_000001"
        (ck / "model").mkdir(parents=True)
        (ck / "model" / "x").write_text("x")
        (ck / "manifest.json").write_text(manifest)
        (root / run / "config.yaml").write_text(MINIMAL_CONFIG)
    # item 7: a run whose config names a hub model (the viewer must not look it up)
    hub = root / "hub"
    hub.mkdir()
    (hub / "config.yaml").write_text(f"env_id: {TEXT}\nmodel: someorg/some-model\n")
    shutil.copytree(records, hub / "eval" / "final")
    return {"root": root, "outside": outside, "good": good,
            "bad": [*bad, "deep_manifest", "inf_manifest", "empty_manifest"]}


@pytest.fixture(scope="module")
def server(hostile: dict[str, Any]):
    with ViewServer(hostile["root"]) as srv:
        yield srv


def _get(server: ViewServer, path: str, timeout: float = 60) -> httpx.Response:
    r = httpx.get(server.url + path, timeout=timeout)
    assert "Traceback" not in r.text
    return r


def _bad_runs(hostile: dict[str, Any]) -> list[str]:
    return hostile["bad"]


# -- item 5: only regular files inside the root ---------------------------------------------------
@pytest.mark.parametrize("phase", ["absolute", "dotdot", "devzero", "fifo", "link", "bomb", "bomb25mp"])
def test_records_naming_images_outside_or_not_regular_files_are_refused(server: ViewServer, phase: str) -> None:
    """``image_files`` in records.jsonl used to be read from any path: an outside PNG was served,
    /dev/zero read until memory ran out, a FIFO hung the request, a PNG bomb decoded at 2.9 GB."""
    start = time.monotonic()
    for path in (f"/episode/runs/images/eval/{phase}?n=0", f"/image/runs/images/eval/{phase}?n=0&k=0"):
        r = _get(server, path, timeout=30)
        assert r.status_code == 400 and "cannot be read" in r.text, (path, r.status_code, r.text[:300])
        assert SECRET.encode() not in r.content and r.headers["content-type"].startswith("text/html")
    assert time.monotonic() - start < 20


def test_a_fifo_in_a_records_folder_never_wedges_the_viewer(server: ViewServer) -> None:
    """A FIFO used to tie up a worker thread per request; after ~45 every page hung."""
    for _ in range(60):
        assert _get(server, "/image/runs/images/eval/fifo?n=0&k=0", timeout=10).status_code == 400
    assert _get(server, "/", timeout=30).status_code == 200


def test_links_to_outside_files_in_a_run_folder_are_not_followed(server: ViewServer, hostile: dict[str, Any]) -> None:
    page = _get(server, "/run/links")
    assert page.status_code == 200 and SECRET not in page.text
    assert "config.yaml cannot be read" in page.text and "is a symbolic link" in page.text
    curves = _get(server, "/curves/links")
    assert curves.status_code == 404 and SECRET.encode() not in curves.content
    index = _get(server, "/")
    assert SECRET not in index.text and 'data-run="links"' in index.text
    assert 'data-run="outlink"' not in index.text and _get(server, "/run/outlink").status_code == 404
    assert SECRET not in _get(server, "/api/metrics?run=links").text
    assert [p.name for p in find_runs(hostile["root"]) if p.name == "outlink"] == []


def test_image_scale_is_bounded(server: ViewServer) -> None:
    ok = httpx.get(server.url + "/image/runs/images/eval/valid?n=0&k=0&scale=16", timeout=30)
    assert ok.status_code == 200 and ok.headers["content-type"] == "image/png"
    from PIL import Image
    import io

    assert Image.open(io.BytesIO(ok.content)).size == (48, 48)
    for scale in ("17", "5000", "0", "-3", "9" * 5000):
        r = _get(server, f"/image/runs/images/eval/valid?n=0&k=0&scale={scale}")
        assert r.status_code == 400 and "scale" in r.text, (scale, r.status_code)


def test_compare_reads_a_repeated_run_once(server: ViewServer) -> None:
    r = _get(server, "/compare?" + "&".join(["run=text"] * 50))
    assert r.status_code == 200 and r.text.count('<tr><td><a href="/run/text">') == 1
    data = _get(server, "/api/metrics?" + "&".join(["run=text"] * 50)).json()
    assert [run["name"] for run in data["runs"]] == ["text"]
    assert _get(server, "/compare?" + "&".join(f"run=r{i}" for i in range(100))).status_code == 400


def test_a_nul_byte_in_a_path_is_a_clean_404(server: ViewServer) -> None:
    for path in ("/run/x%00y", "/curves/x%00y", "/episodes/runs/x%00y", "/saved/x%00y"):
        r = _get(server, path)
        assert r.status_code == 404, (path, r.status_code)


# -- item 6: one bad run folder is a bad run, the rest unaffected ---------------------------------
def test_malformed_run_folders_are_shown_as_bad_runs_and_the_others_work(server: ViewServer,
                                                                         hostile: dict[str, Any]) -> None:
    """Deep JSON or YAML, a manifest size of 1e400 and a 1 KB alias bomb used to make / and /play
    500s (or hang) for every run."""
    good_verdict = json.loads((hostile["good"] / "summary.json").read_text())["verdict"].split("\n")[0]
    start = time.monotonic()
    index = _get(server, "/")
    assert index.status_code == 200 and good_verdict in index.text
    for run in _bad_runs(hostile):
        assert f'data-run="{run}"' in index.text, run
        row = index.text.split(f'data-run="{run}"', 1)[1].split("</tr>", 1)[0]
        assert "problem" in row, run
        page = _get(server, f"/run/{run}")
        assert page.status_code == 200 and "Problems in this run folder" in page.text, (run, page.text[:300])
    assert "lists no files" in _get(server, "/run/empty_manifest").text
    assert "not a whole number of bytes" in _get(server, "/run/inf_manifest").text
    assert "expands to more than" in _get(server, "/run/alias_bomb").text
    assert _get(server, "/play").status_code == 200
    every = "&".join(f"run={r}" for r in ["text", *_bad_runs(hostile)])
    assert _get(server, f"/compare?{every}").status_code == 200
    assert _get(server, f"/api/metrics?{every}").status_code == 200
    assert _get(server, "/run/text").status_code == 200
    assert time.monotonic() - start < 60


# -- item 7: cross-site, hosts, bounded play --------------------------------------------------------
def test_posts_without_the_viewers_own_origin_are_refused(server: ViewServer) -> None:
    form = {"env_id": TEXT, "seed": "x"}
    for headers in ({"Origin": "null"}, {}, {"Origin": "http://evil.example"}, {"Origin": f"{server.url}.evil.example"},
                    {"Origin": "file://"}):
        r = httpx.post(server.url + "/play", data=form, headers=headers, timeout=30)
        assert r.status_code == 403 and "refused" in r.text, headers
    own = httpx.post(server.url + "/play", data=form, headers={"Origin": server.url}, timeout=30)
    assert own.status_code == 400 and "the seed must be a whole number" in own.text


def test_play_options_replies_and_bodies_are_bounded(server: ViewServer) -> None:
    """FrozenLake size=400 cost ~360 MB a turn; a 10 MB typed reply was accepted."""
    with httpx.Client(base_url=server.url, timeout=120, headers={"Origin": server.url}) as client:
        start = time.monotonic()
        for kwargs, message in [("size=400", "outside what the viewer plays"), ("size=33", "at most 32 in size"),
                                ("max_turns=1000000000", "outside what the viewer plays"),
                                ("x=" + "1" * 3000, "at most 1,000 characters"),
                                (" ".join(f"k{i}=1" for i in range(20)), "at most 16 options")]:
            r = client.post("/play", data={"env_id": TEXT, "seed": "0", "kwargs": kwargs})
            assert r.status_code == 400 and message in r.text, (kwargs, r.text[:300])
        assert time.monotonic() - start < 30
        r = client.post("/play", data={"env_id": TEXT, "seed": "0", "model": "tiny"}, follow_redirects=True)
        sid = str(r.url).rstrip("/").split("/")[-1]
        r = client.post(f"/play/{sid}/step", data={"action": "typed", "reply": "R" * 3000})
        assert r.status_code == 413 and "limited to 2,000 characters" in r.text
        r = client.post(f"/play/{sid}/step", content=b"action=typed&reply=" + b"R" * (10 << 20),
                        headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 413
        r = client.post(f"/play/{sid}/step", data={"action": "typed", "reply": "Right"}, follow_redirects=True)
        assert r.status_code == 200 and r.text.count('data-testid="turn"') == 1


class _Listener:
    """A TCP listener on loopback that counts connections (a stand-in model hub)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        self.sock.close()


def test_any_loopback_bind_keeps_the_host_check(hostile: dict[str, Any]) -> None:
    """--host 127.0.0.2 used to switch the Host and Origin checks off."""
    with ViewServer(hostile["root"], host="127.0.0.2") as srv:
        assert httpx.get(srv.url + "/", headers={"Host": "evil.example"}, timeout=30).status_code == 400
        assert httpx.get(srv.url + "/", timeout=60).status_code == 200
        r = httpx.post(srv.url + "/play", data={"env_id": TEXT}, headers={"Origin": "http://evil.example"}, timeout=30)
        assert r.status_code == 403
        own = httpx.post(srv.url + "/play", data={"env_id": TEXT, "seed": "x"}, headers={"Origin": srv.url}, timeout=30)
        assert own.status_code == 400 and "the seed must be a whole number" in own.text


def test_a_hub_id_in_a_runs_config_is_never_looked_up(hostile: dict[str, Any]) -> None:
    """A run whose config names a hub id made the viewer contact the hub for its tokenizer (the
    docs say no data leaves the machine). The hub here is a listener on loopback that counts."""
    hub = _Listener()
    try:
        env = {"HF_ENDPOINT": f"http://127.0.0.1:{hub.port}", "HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None}
        with ViewServer(hostile["root"], env=env) as srv:
            page = httpx.get(srv.url + "/episode/runs/hub/eval/final?n=0", timeout=120)
            assert page.status_code == 200 and 'data-testid="turn"' in page.text
    finally:
        hub.close()
    assert hub.connections == 0


def test_one_session_played_to_the_end_does_not_block_another(hostile: dict[str, Any]) -> None:
    """One lock for every play session let one "play to the end" hold up another user for 96 s.
    The real app on loopback (in this process, so the test can hold session A's lock as a long
    play would): session B still steps."""
    import uvicorn

    from agents.view.app import create_app

    app = create_app(hostile["root"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.1)
        with httpx.Client(base_url=url, timeout=120, headers={"Origin": url}, follow_redirects=True) as client:
            sids = []
            for seed in ("0", "1"):
                r = client.post("/play", data={"env_id": TEXT, "seed": seed, "model": "tiny"})
                sids.append(str(r.url).rstrip("/").split("/")[-1])
            a = app.state.viewer.sessions.get(sids[0])
            with a.lock:  # session A is being played to the end
                r = client.post(f"/play/{sids[1]}/step", data={"action": "model"}, timeout=30)
                assert r.status_code == 200 and r.text.count('data-testid="turn"') == 1
    finally:
        server.should_exit = True
        thread.join(timeout=30)


# -- fuzz: the categories above, thrown at the readers ----------------------------------------------
def _hostile_texts(seed: int = 0) -> list[str]:
    """Malformed and hostile file contents: deep nesting of every kind, alias bombs and cycles,
    numbers JSON and YAML cannot hold, tags, binary, and random mixes of their pieces."""
    rng = random.Random(seed)
    fixed = [
        "", "5", "null", "[1, 2]", "- a\n- b\n", '"just a string"', "\x00" * 64, "\xff\xfe\x00garbage", "\ufeff{}",
        "{" * 10_000, "[" * 50_000 + "]" * 50_000, _deep_json(5000), "a:\n" + "".join(" " * i + "- \n" for i in range(1, 500)),
        "a: " + "{b: " * 3000 + "1" + "}" * 3000, ALIAS_BOMB, "a: &a [*a]\n", "a: &a {b: *a}\n",
        "a: &x [1, 2]\nb: &y [*x, *x, *x, *x, *x, *x, *x, *x]\nc: [*y, *y, *y, *y, *y, *y, *y, *y]\n"
        "d: &z [*y, *y]\ne: {<<: {k: *z}}\n",
        "a: !!python/object/apply:os.system ['echo hacked']\n", "a: !!binary AAAA\n", "a: 2001-13-45 25:99:99\n",
        '{"files": {"m": {"size": 1e400, "sha256": "' + "a" * 64 + '"}}, "iteration": 1}',
        '{"files": {"/etc/passwd": {"size": 1, "sha256": "' + "a" * 64 + '"}}, "iteration": 1}',
        '{"files": {"../../x": {"size": 1, "sha256": "' + "a" * 64 + '"}}, "iteration": 1}',
        '{"files": {"m": {"size": -1, "sha256": "x"}}}', '{"files": []}', '{"files": {}}', '{"files": {"m": 5}}',
        '{"kind": "train", "iteration": ' + "9" * 5000 + "}", '{"iteration": 1e400, "success": -1e400}',
        '{"a": NaN, "b": Infinity}', '{"a": "\\ud800"}', "x" * 300_000, "{1: 2, [3]: 4}\n", "? [a, b]\n: c\n",
    ]
    pieces = ["[", "]", "{", "}", "&a ", "*a", ": ", "- ", "\n", '"', "1e400", "!!python/name:os.system", "\x00", ",",
              "<<: ", "#", "'", "\t", "9" * 50]
    random_texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 400))) for _ in range(60)]
    return fixed + random_texts


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl", "summary.json", "checkpoints/iter_000001/manifest.json"])
def test_fuzzed_run_folder_files_become_problems_never_errors(tmp_path: Path, name: str) -> None:
    from agents.view.app import Viewer

    viewer = Viewer(tmp_path)
    for k, text in enumerate(_hostile_texts()):
        run = tmp_path / f"r{k}"
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        if name != "config.yaml":
            (run / "config.yaml").write_text(MINIMAL_CONFIG)
        (run / name).write_text(text, encoding="utf-8", errors="surrogateescape")
        start = time.monotonic()
        info = load_run(tmp_path, run)
        html = viewer.render("run.html", run=info).body.decode()
        viewer.render("runs.html", runs=[info], root="r", plays=[], play_dir="p")
        viewer.render("compare.html", runs=[info, info])
        assert time.monotonic() - start < 5, (name, text[:80])
        assert "Traceback" not in html and len(html) < 5_000_000


def test_fuzzed_records_are_a_clear_error(tmp_path: Path) -> None:
    from agents.record import load_records
    from agents.view.episodes import records_in
    from agents.view.runs import ViewError

    for k, text in enumerate(_hostile_texts(1)):
        folder = tmp_path / f"r{k}"
        folder.mkdir()
        (folder / "records.jsonl").write_text(text + "\n", encoding="utf-8", errors="surrogateescape")
        start = time.monotonic()
        try:
            load_records(folder)
        except ValueError:
            pass
        try:
            records_in(folder)
        except ViewError:
            pass
        assert time.monotonic() - start < 5, text[:80]


def test_fuzzed_config_files_are_a_mapping_or_a_short_clear_error(tmp_path: Path, capsys) -> None:
    """The config loader (train.py --config and a resumed run's config.yaml) on the same
    categories: a mapping, or a ValueError naming the file in a few hundred characters; train.py
    exits 2 with it (a 324-byte alias config printed a 312 MB error)."""
    import train
    from learner.cli import load_config_file

    refused = []
    for k, text in enumerate(_hostile_texts(2)):
        path = tmp_path / f"c{k}.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        start = time.monotonic()
        try:
            loaded = load_config_file(path)
            assert isinstance(loaded, dict) and all(isinstance(key, str) for key in loaded)
        except ValueError as exc:
            assert str(path) in str(exc) and len(str(exc)) < 1000, str(exc)[:300]
            refused.append(path)
        assert time.monotonic() - start < 5, text[:80]
    for special in ("/dev/zero", "/dev/null/x", str(tmp_path / "missing.yaml")):
        with pytest.raises(ValueError, match="config|cannot be read"):
            load_config_file(special)
    for path in [*refused[:12], Path("/dev/zero")]:
        capsys.readouterr()
        assert train.main(["--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and str(path) in err and len(err) < 1000 and "Traceback" not in err
