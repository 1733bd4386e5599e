"""docs/hub.md's "From a file to a trained task" runs as the page shows it: gymnasium's checker on
the task in a loose file, then ``--import`` on envs.play, train.py, agents.evaluate and the viewer
(train.py with tiny settings appended: later flags win; the viewer on a free port)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
SECTION = "### From a file to a trained task"
TINY = ["--tasks-per-iter", "2", "--group-size", "2", "--pretrain-steps", "4", "--pretrain-batch", "4",
        "--eval-every", "0", "--eval-episodes", "2", "--final-eval-episodes", "2", "--no-progress",
        "--no-tensorboard", "--threads", "1"]


def _page_blocks() -> tuple[str, list[str]]:
    text = (REPO / "docs" / "hub.md").read_text(encoding="utf-8")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    python = re.findall(r"```python\n(.*?)```", section, re.S)
    bash = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(python) == 1 and len(bash) == 1
    return python[0], [line for line in bash[0].splitlines() if line.strip()]


def test_the_pages_commands_take_a_task_in_a_file_to_trained_and_viewed(tmp_path: Path) -> None:
    check, commands = _page_blocks()
    assert "check_env(envs.make(" in check and ".unwrapped)" in check
    (tmp_path / "docs" / "examples").mkdir(parents=True)
    shutil.copy(REPO / "docs" / "examples" / "minimal_task.py", tmp_path / "docs" / "examples")
    (tmp_path / "train.py").symlink_to(REPO / "train.py")
    (tmp_path / "check.py").write_text(check, encoding="utf-8")
    env = {**os.environ, "FRESHPER_CACHE": str(tmp_path / "cache"), "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": str(REPO)}

    def run(argv: list[str]) -> str:
        out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{shlex.join(argv)}\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        return out.stdout

    assert [c.split()[:3] for c in commands] == [
        ["python", "check.py"], ["python", "-m", "envs.play"], ["python", "train.py", "--import"],
        ["python", "-m", "agents.evaluate"], ["python", "-m", "agents.view"]]
    argvs = [[sys.executable, *shlex.split(c)[1:]] for c in commands]
    assert "check_env passed" in run(argvs[0])
    assert "The episode is over." in run(argvs[1])
    train = argvs[2]
    iterations = int(train[train.index("--iterations") + 1])
    summary = run([*train, *TINY, "--iterations", "2"])
    assert "iter_000002/model" in summary
    assert (tmp_path / "runs" / "copydigit" / "summary.json").exists()
    evaluate = [a.replace(f"iter_{iterations:06d}", "iter_000002") for a in argvs[3]]
    evaluated = run([*evaluate, "--episodes", "4"])
    assert "model runs/copydigit/checkpoints/iter_000002/model" in evaluated and "success" in evaluated
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    viewer = subprocess.Popen([*argvs[4], "--port", str(port)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = viewer.stdout.readline()
        assert "freshper viewer" in line, line + viewer.stderr.read()
        for _ in range(100):
            try:
                page = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert page.status_code == 200 and "copydigit" in page.text
    finally:
        viewer.terminate()
        viewer.wait(timeout=10)
