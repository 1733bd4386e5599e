"""Run folders, checkpoints and config files as hostile input (issue 47, items 4 and 8), each
test written as the repro: a real symbolic link, a real tiny run with a damaged checkpoint or
metrics file, real model folders with corrupt weights or their own code, the real CLIs.

- the run lock never follows a symbolic link, and a link where train.py writes refuses the start;
- a start that fails leaves no run folder behind;
- malformed manifests, corrupt weights, a non-object metrics line on resume and YAML configs
  that are scalars, too deep or alias bombs are clear errors: exit 2, the file and the problem;
- an empty manifest vouches for nothing, and neither does one a file was added beside;
- loading never runs a model folder's code nor asks about it on stdin; ``agents.play`` refuses a
  tampered checkpoint as the viewer does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, VIEW_TINY, make_tiny_run
from learner.checkpoint import CheckpointError, RunFolderError, RunLock, list_checkpoints, verify_checkpoint

TEXT = "freshper/FrozenLake-v0"
ALIAS_BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)) + "lr: *h\n"
#: train.py flags of a tiny run (what the viewer's fixtures train), for starts that get far.
TINY_FLAGS = ["--iterations", "1", *[a for k, v in VIEW_TINY.items() if k not in ("progress", "tensorboard")
                                     for a in (f"--{k.replace('_', '-')}", str(v))], "--no-progress", "--no-tensorboard"]


def _train(*argv: str, capsys) -> tuple[int, str]:
    import train

    capsys.readouterr()
    code = train.main(list(argv))
    return code, capsys.readouterr().err


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_run(tmp_path_factory.mktemp("hardening"), "run")


def _copy_run(tiny_run: Path, dst: Path) -> tuple[Path, Path]:
    run = Path(shutil.copytree(tiny_run, dst, symlinks=True))
    return run, list_checkpoints(run / "checkpoints")[-1]


# -- item 4: the run lock and links where train.py writes --------------------------------------------
def test_a_symlinked_lock_is_refused_and_its_target_never_truncated(tmp_path: Path, capsys) -> None:
    """A `runs/X/.lock` link used to be opened "a+" and truncated: train.py overwrote its target."""
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / ".lock").symlink_to(precious)
    with pytest.raises(RunFolderError, match="symbolic link"):
        RunLock(run)
    code, err = _train("--runs-root", str(tmp_path / "runs"), "--run-name", "x", *TINY_FLAGS, capsys=capsys)
    assert code == 2 and ".lock" in err and "symbolic link" in err and "Traceback" not in err
    assert precious.read_text() == "keep me"
    dangling = tmp_path / "runs" / "y"
    dangling.mkdir()
    (dangling / ".lock").symlink_to(tmp_path / "created-through-the-link")
    with pytest.raises(RunFolderError):
        RunLock(dangling)
    assert not (tmp_path / "created-through-the-link").exists()


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl", "summary.json", "environment.json", "curves.png"])
def test_a_link_where_train_writes_refuses_the_start(tmp_path: Path, name: str) -> None:
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / name).symlink_to(precious)
    with pytest.raises(RunFolderError, match=name.replace(".", r"\.")):
        RunLock(run)
    assert precious.read_text() == "keep me" and not (run / ".lock").exists()


def test_the_metrics_file_is_never_written_through_a_link(tmp_path: Path) -> None:
    from learner.report import MetricsLogger

    precious = tmp_path / "precious"
    precious.write_text("keep me")
    for resume in (None, 0):  # a new run deletes the file, a resume rewrites it: the link goes, not its target
        (tmp_path / "metrics.jsonl").symlink_to(precious)
        logger = MetricsLogger(tmp_path, tensorboard=False, resume_iteration=resume)
        logger.log({"kind": "train", "iteration": 1})
        logger.close()
        assert precious.read_text() == "keep me" and not (tmp_path / "metrics.jsonl").is_symlink()
        (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.tmp").symlink_to(precious)  # the resume's temporary file
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "iteration": 1}\n')
    with pytest.raises(OSError, match="symbolic link"):
        MetricsLogger(tmp_path, tensorboard=False, resume_iteration=1)
    assert precious.read_text() == "keep me"


def test_a_released_lock_of_an_empty_start_leaves_nothing_and_can_be_taken_again(tmp_path: Path) -> None:
    run = tmp_path / "a" / "b" / "run"
    lock = RunLock(run)
    assert [p.name for p in run.iterdir()] == [".lock"]
    lock.release()
    assert not (tmp_path / "a").exists()  # the folders the lock made went with it
    again = RunLock(run)
    (run / "config.yaml").write_text("x: 1\n")
    again.release()
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.yaml"]  # a start that wrote stays


# -- item 8: clear errors for corrupt weights, and a failed start leaves no folder ----------------
@pytest.mark.parametrize("damage", ["safetensors", "pickle", "config.json"])
def test_corrupt_weights_are_a_clear_error_and_the_failed_start_leaves_no_run_folder(tmp_path: Path, damage: str,
                                                                                     capsys) -> None:
    from agents.policies.tiny import build_tiny_model

    model = Path(shutil.copytree(build_tiny_model("text"), tmp_path / "model"))
    if damage == "safetensors":
        data = bytearray((model / "model.safetensors").read_bytes())
        data[:8] = b"\xff" * 8  # a header length no file has
        (model / "model.safetensors").write_bytes(bytes(data))
    elif damage == "pickle":
        (model / "model.safetensors").unlink()
        (model / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    else:
        (model / "config.json").write_text('{"model_type": ')
    runs = tmp_path / "runs"
    code, err = _train("--model", str(model), "--runs-root", str(runs), "--run-name", "x", *TINY_FLAGS,
                       capsys=capsys)
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert str(model) in err and "cannot be loaded" in err and len(err) < 2000
    assert not runs.exists()  # not even a run folder holding only .lock


# -- item 8: malformed checkpoints and metrics on resume ---------------------------------------------
def _hex(c: str) -> str:
    return c * 64


MANIFESTS = {
    "not JSON": "{oops",
    "a list": "[]",
    "files a list": '{"iteration": 1, "files": []}',
    "files empty": '{"iteration": 1, "files": {}}',
    "size 1e400": None,  # the real manifest with one size replaced (below)
    "size a string": None,
    "no iteration": None,
    "a path outside": '{"iteration": 1, "files": {"../../config.yaml": {"size": 1, "sha256": "' + _hex("a") + '"}}}',
    "nested deeply": '{"a": ' * 50_000 + "1" + "}" * 50_000,
    "entry not an object": '{"iteration": 1, "files": {"config.yaml": 5}}',
}


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_a_malformed_manifest_on_resume_is_a_clear_error_before_anything_is_written(tiny_run: Path, tmp_path: Path,
                                                                                    case: str, capsys) -> None:
    run, ck = _copy_run(tiny_run, tmp_path / "run")
    real = json.loads((ck / "manifest.json").read_text())
    first = next(iter(real["files"]))
    if case == "size 1e400":
        text = json.dumps(real).replace(f'"size": {real["files"][first]["size"]}', '"size": 1e400', 1)
    elif case == "size a string":
        real["files"][first]["size"] = "12"
        text = json.dumps(real)
    elif case == "no iteration":
        del real["iteration"]
        text = json.dumps(real)
    else:
        text = MANIFESTS[case]
    (ck / "manifest.json").write_text(text)
    before = _snapshot(run)
    code, err = _train("--resume", str(ck), capsys=capsys)
    assert code == 2 and "Traceback" not in err and "manifest.json" in err and len(err) < 2000, err[-2000:]
    assert _snapshot(run) == before


def test_an_empty_manifest_or_an_unlisted_file_vouches_for_nothing(tiny_run: Path, tmp_path: Path, capsys) -> None:
    from agents.runfolder import check_checkpoint

    run, ck = _copy_run(tiny_run, tmp_path / "run")
    verify_checkpoint(ck)
    (ck / "model" / "pytorch_model.bin").write_bytes(b"a pickle transformers would load beside the safetensors")
    for check in (lambda: verify_checkpoint(ck), lambda: _raise(check_checkpoint(ck, hashes=True))):
        with pytest.raises((CheckpointError, AssertionError), match="does not list"):
            check()
    code, err = _train("--resume", str(ck), capsys=capsys)
    assert code == 2 and "pytorch_model.bin" in err
    (ck / "model" / "pytorch_model.bin").unlink()
    (ck / "manifest.json").write_text('{"iteration": 1, "files": {}}')
    with pytest.raises(CheckpointError, match="lists no files"):
        verify_checkpoint(ck)
    assert "lists no files" in check_checkpoint(ck)
    bare = tmp_path / "bare" / "iter_000001"
    bare.mkdir(parents=True)
    (bare / "manifest.json").write_text('{"iteration": 1, "files": {}}')
    with pytest.raises(CheckpointError, match="lists no files"):  # it used to verify vacuously
        verify_checkpoint(bare)


def _raise(problem: str) -> None:
    assert not problem, problem


@pytest.mark.parametrize("line", ["[1, 2]", '"text"', "3", "[" * 5000 + "]" * 5000, '{"kind": "train",,}'])
def test_an_unreadable_metrics_line_stops_a_resume_with_a_clear_error(tiny_run: Path, tmp_path: Path, line: str,
                                                                      capsys) -> None:
    """A non-object line in metrics.jsonl made a resume end in AttributeError (a resume rewrites
    the file from its lines, so a damaged one must not be dropped silently either)."""
    run, ck = _copy_run(tiny_run, tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines.insert(1, line)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    before = _snapshot(run)
    code, err = _train("--resume", str(ck), capsys=capsys)
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert "metrics.jsonl line 2" in err and len(err) < 2000
    assert _snapshot(run) == before


def test_a_torn_last_metrics_line_is_still_resumable(tiny_run: Path, tmp_path: Path) -> None:
    from learner.checkpoint import verify_resume

    run, ck = _copy_run(tiny_run, tmp_path / "run")
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"kind": "tra')
    assert verify_resume(ck)["iteration"] >= 1


# -- item 8: config files -----------------------------------------------------------------------------
@pytest.mark.parametrize("text, problem", [
    (ALIAS_BOMB, "expands to more than"), ("5\n", "holds a int, not a mapping"), ("- a\n- b\n", "holds a list"),
    ("a: " + "[" * 5000 + "]" * 5000, "nests deeper than"), ("a: &a [*a]\n", "refers to itself"),
    ("{1: 2}\n", "not setting names"), ("lr: 0.1\n\x00", "not valid YAML"),
])
def test_bad_config_files_are_a_short_clear_error_from_the_real_cli(tmp_path: Path, text: str, problem: str) -> None:
    """A 324-byte alias config made train.py print a 312 MB error; a scalar or deep config a traceback."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    out = subprocess.run([sys.executable, "train.py", "--config", str(path)], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert str(path) in out.stderr and problem in out.stderr and len(out.stderr) < 1000


def test_a_resumed_runs_own_config_is_read_as_safely(tiny_run: Path, tmp_path: Path, capsys) -> None:
    run, ck = _copy_run(tiny_run, tmp_path / "run")
    (ck / "config.yaml").write_text(ALIAS_BOMB)
    code, err = _train("--resume", str(ck), capsys=capsys)
    assert code == 2 and "expands to more than" in err and len(err) < 1000
    (ck / "config.yaml").unlink()
    (ck / "config.yaml").symlink_to(run / "config.yaml")
    code, err = _train("--resume", str(ck), capsys=capsys)
    assert code == 2 and "symbolic link" in err


# -- item 8: remote code, stdin, tampered checkpoints in agents.play -----------------------------------
def test_loading_never_runs_a_model_folders_code_nor_asks_on_stdin(tmp_path: Path) -> None:
    """transformers' [y/N] prompt read the stdin agents.play takes moves from: a first line of
    `1` ran the folder's Python."""
    from agents.policies.tiny import build_tiny_model

    model = Path(shutil.copytree(build_tiny_model("text"), tmp_path / "model"))
    marker = tmp_path / "the-folder's-code-ran"
    (model / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                   "from transformers import PretrainedConfig\n"
                                   "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n")
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig"})
    (model / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    out = subprocess.run([sys.executable, "-m", "agents.play", TEXT, "--model", str(model)], cwd=REPO, input="1\n" * 5,
                         capture_output=True, text=True, timeout=300, env=env)
    assert not marker.exists()
    assert out.returncode == 2 and "Traceback" not in out.stderr and "custom code" in out.stderr, out.stderr[-2000:]
    assert "Do you wish to run the custom code" not in out.stdout + out.stderr


def test_agents_play_refuses_a_tampered_checkpoint_as_the_viewer_does(tiny_run: Path, tmp_path: Path) -> None:
    from agents.runfolder import check_checkpoint

    run, ck = _copy_run(tiny_run, tmp_path / "run")
    weights = ck / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size: only the hash sees it
    weights.write_bytes(bytes(data))
    assert "does not match its checksum" in check_checkpoint(ck, hashes=True)
    for model in (ck, ck / "model"):
        out = subprocess.run([sys.executable, "-m", "agents.play", TEXT, "--model", str(model), "--auto"], cwd=REPO,
                             capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert out.returncode == 2 and "does not match its checksum" in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr


# -- item 8: a full disk -------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path: Path):
    """A real file system small enough to fill: a tmpfs with room for a tiny run's start (the KL
    reference and the first checkpoint, one model each) but not for its second checkpoint (the
    model, Adam's two moments and the buffer). Mounting needs root: skipped elsewhere."""
    from agents.policies.tiny import build_tiny_model

    model_bytes = (Path(build_tiny_model("text")) / "model.safetensors").stat().st_size
    mnt = tmp_path / "disk"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(3.5 * model_bytes)}", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"filling a small file system needs mount (root): {out.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_is_a_clear_error_and_the_run_resumes_exactly_once_there_is_room(small_disk: Path, tmp_path: Path,
                                                                                     capsys) -> None:
    """A full disk used to end train.py in a traceback (torch's checkpoint writer says only
    "iostream error"). Now: exit 2, what filled and what is intact; the half-written checkpoint
    is gone, the last complete one verifies, and the run resumes from it, once there is room, to
    the same numbers as a run that never stopped."""
    flags = [*TINY_FLAGS, "--iterations", "3"]
    run = small_disk / "runs" / "x"
    code, err = _train("--runs-root", str(small_disk / "runs"), "--run-name", "x", *flags, capsys=capsys)
    assert code == 2 and "Traceback" not in err and len(err) < 2000, err[-3000:]
    assert "the disk is full" in err and "No space left on device" in err, err
    assert "iter_000000, is intact" in err and f"--resume {run}" in err, err
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["iter_000000"]  # no half-written folder left
    verify_checkpoint(run / "checkpoints" / "iter_000000")

    subprocess.run(["mount", "-o", "remount,size=256m", str(small_disk)], check=True)
    code, err = _train("--resume", str(run), "--no-progress", capsys=capsys)
    assert code == 0, err[-3000:]
    code, err = _train("--runs-root", str(tmp_path / "runs"), "--run-name", "whole", *flags, capsys=capsys)
    assert code == 0, err[-3000:]

    def learning(folder: Path) -> list[dict]:
        from learner.report import read_metrics

        return [{k: v for k, v in row.items() if not (k.startswith("time_") or k.endswith("_per_s"))}
                for row in read_metrics(folder / "metrics.jsonl") if row.get("kind") == "train"]

    resumed, whole = learning(run), learning(tmp_path / "runs" / "whole")
    assert [r["iteration"] for r in resumed] == [1, 2, 3]
    assert resumed == whole


# -- issue 54 item 2: a tampered sharded checkpoint never runs code ----------------------------------
class _Marker:
    """A pickle that creates ``path`` when it is loaded (what an attacker's payload would do)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


class _TouchMarker:
    """The same through a dotted global (``pathlib.Path.touch``), which a check of the module alone
    would let through."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return Path.touch, (Path(self.path),)


def _dcp_checkpoint(folder: Path):
    """A small model and optimizer saved as ``save_sharded`` saves them (``torch.distributed
    .checkpoint``, one process, no process group) into ``folder/sharded``; the model to load into."""
    import warnings
    from types import SimpleNamespace

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=str(folder / "sharded"))
    fresh = torch.nn.Linear(3, 2)
    return model, SimpleNamespace(model=fresh), torch.optim.AdamW(fresh.parameters(), lr=1e-3)


def _load(policy, opt, folder: Path) -> None:
    import warnings

    from learner import distributed

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        distributed.load_sharded(policy, opt, folder)


def test_a_real_dcp_checkpoint_loads_and_a_tampered_metadata_never_runs_code(tmp_path: Path) -> None:
    """The repro: ``sharded/.metadata`` replaced by a pickle whose ``__reduce__`` runs a command.
    torch's reader unpickled it and the command ran; now the restricted unpickler refuses it,
    naming the file, and the marker is never created. The untampered checkpoint still loads."""
    import pickle

    import torch

    from learner.distributed import read_sharded_metadata

    model, policy, opt = _dcp_checkpoint(tmp_path)
    _load(policy, opt, tmp_path)
    assert torch.equal(policy.model.weight, model.weight) and opt.state_dict()["state"][0]["step"] == 1
    meta = tmp_path / "sharded" / ".metadata"
    good = meta.read_bytes()
    assert read_sharded_metadata(meta).state_dict_metadata
    marker = tmp_path / "marker"
    for payload in (_Marker(marker), _TouchMarker(marker), {"x": _Marker(marker)}):
        meta.write_bytes(pickle.dumps(payload))
        with pytest.raises(CheckpointError, match=r"\.metadata is refused: it names (posix\.system|pathlib\.Path\.touch)"):
            _load(policy, opt, tmp_path)
        assert not marker.exists()
    for data, problem in ((good[: len(good) // 2], "cannot be read"), (pickle.dumps([1, 2]), "not a sharded")):
        meta.write_bytes(data)
        with pytest.raises(CheckpointError, match=problem):
            _load(policy, opt, tmp_path)
    meta.unlink()
    os.mkfifo(meta)  # a FIFO is refused, not waited on
    with pytest.raises(CheckpointError, match="not a regular file"):
        _load(policy, opt, tmp_path)


def test_a_tampered_shard_value_or_file_name_never_runs_code_nor_reads_outside(tmp_path: Path) -> None:
    """The optimizer's non-tensor values are pickles inside the ``.distcp`` files, which torch
    loaded with ``weights_only=False``: one pointed at an appended payload ran it. Shard file
    names that leave the folder are refused too."""
    import dataclasses
    import io
    import pickle

    import torch

    from learner.distributed import read_sharded_metadata

    _, policy, opt = _dcp_checkpoint(tmp_path)
    meta_path = tmp_path / "sharded" / ".metadata"
    metadata = read_sharded_metadata(meta_path)
    marker = tmp_path / "marker"
    index, info = next((i, v) for i, v in metadata.storage_data.items() if i.fqn.endswith("param_groups.0.lr"))
    shard = tmp_path / "sharded" / info.relative_path
    buf = io.BytesIO()
    torch.save(_Marker(marker), buf)
    offset = shard.stat().st_size
    with open(shard, "ab") as fh:
        fh.write(buf.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buf.getvalue()))
    meta_path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="param_groups.0.lr' is refused"):
        _load(policy, opt, tmp_path)
    assert not marker.exists()
    metadata.storage_data[index] = dataclasses.replace(info, relative_path="../../outside.distcp")
    meta_path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="not a file in its folder"):
        _load(policy, opt, tmp_path)
