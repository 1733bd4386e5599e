"""learner/tools/paper_table.py end to end on a tiny budget: every method, one seed, one task."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--tasks-per-iter", "2", "--group-size", "2", "--max-new-tokens", "4", "--pretrain-steps", "0",
        "--final-eval-episodes", "4", "--eval-every", "1", "--eval-episodes", "2", "--no-eval-both",
        "--no-diagnostics", "--no-tensorboard", "--replay-batch", "4", "--threads", "1"]


@pytest.mark.slow
def test_the_table_script_runs_every_method_and_writes_the_table_and_plots(tmp_path: Path) -> None:
    out, doc = tmp_path / "paper", tmp_path / "docs" / "results.md"
    cmd = [sys.executable, "-m", "learner.tools", "paper-table", "--out", str(out), "--tasks", "frozenlake",
           "--seeds", "0", "--jobs", "2", "--iterations", "2", "--doc", str(doc), "--", *TINY]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True, timeout=900)
    text = doc.read_text()
    for method in ("none", "per", "fresh", "uniform"):
        assert (out / "frozenlake" / f"{method}_s0" / "summary.json").exists()
        assert f"| FrozenLake 4x4, text | {method} | 1 |" in text
    assert (doc.parent / "img" / "results_frozenlake.png").stat().st_size > 10_000
    assert "IS effective sample size per token" in text and "age 1-2" in text
    clip = text.split("Share of tokens outside the clip range")[1].split("\n\n")[1].splitlines()
    assert clip[0].startswith("| method | age 0 | age 1-2") and clip[2].startswith("| per | 0.000 | ")  # age 0: on-policy
    assert "Sampling mass by item age" in text and "- fresh:" in text
    assert "| method | on-policy update: gradient norm | replay update: gradient norm |" in text
    assert "| replay update: median gradient norm | replay updates above the clip |" in text
    assert "| none |" not in text.split("The updates of an iteration")[1].split("Sampling mass")[0]  # replay arms only
    assert "python -m learner.tools paper-table" in text
    assert "| final - best | curve mean |" in text
    assert "| fresh - per | 1 |" in text and "| per - none | 1 |" in text and "| none - fresh |" not in text
    # along the way: every replay arm against on-policy at each evaluation, from the same start
    along = text.split("Along the way")[1].split("\n\n")[1].splitlines()
    assert along[0] == "| episodes | none | per | per - none | fresh | fresh - none | uniform | uniform - none |"
    assert along[2].startswith("| 0 | ") and along[2].count("0.000, 0 of 1 ahead") == 3  # the start of RL is shared
    assert [row.split(" | ")[0] for row in along[3:]] == ["| 4", "| 8"]  # after each iteration of 2 x 2 episodes
    # a second call reruns nothing (finished runs are kept) and rewrites the same table
    again = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True, timeout=300)
    assert "0 runs to do" in again.stdout
    assert doc.read_text().split("## Commands")[0] == text.split("## Commands")[0]
    # the hand-written reading between the notes markers survives a rewrite of the report
    marker = "<!-- notes: kept when the report is rewritten -->"
    assert marker in text
    doc.write_text(text.replace(marker, marker + "\nPER trails on-policy here.\n"))
    subprocess.run(cmd[:-len(TINY) - 1] + ["--report-only"], cwd=REPO, check=True, capture_output=True, text=True,
                   timeout=300)
    assert "PER trails on-policy here." in doc.read_text()
    # a report-only call writes the budget its runs ran into the commands, whatever --iterations it gets
    other = cmd[:-len(TINY) - 1] + ["--report-only"]
    other[other.index("--iterations") + 1] = "7"
    subprocess.run(other, cwd=REPO, check=True, capture_output=True, text=True, timeout=300)
    assert "python train.py --config configs/frozenlake_default.yaml --iterations 2 --replay-batch none" in doc.read_text()
    # the ablation section pairs each FreshPER variant with FreshPER on the same seed and plots tau
    import json
    import shutil

    fresh_final = json.loads((out / "frozenlake" / "fresh_s0" / "summary.json").read_text())["evals"]["final"]["success"]
    for arm, delta in (("fresh_tau2", -0.25), ("fresh_tau40", 0.25), ("fresh_k2", 0.5)):
        shutil.copytree(out / "frozenlake" / "fresh_s0", out / "frozenlake" / f"{arm}_s0")
        summary_path = out / "frozenlake" / f"{arm}_s0" / "summary.json"
        summary = json.loads(summary_path.read_text())
        summary["evals"]["final"]["success"] = fresh_final + delta
        summary_path.write_text(json.dumps(summary))
    subprocess.run(cmd[:-len(TINY) - 1] + ["--report-only", "--ablations"], cwd=REPO, check=True,
                   capture_output=True, text=True, timeout=300)
    text = doc.read_text()
    assert f"| `fresh_tau2` | `--tau 2` | 1 | {fresh_final - 0.25:.3f} | -0.250 (n=1) |" in text
    assert f"| `fresh_tau40` | `--tau 40` | 1 | {fresh_final + 0.25:.3f} | 0.250 (n=1) |" in text
    assert f"| `fresh_k2` | `--replay-ratio 2` | 1 | {fresh_final + 0.5:.3f} | 0.500 (n=1) |" in text
    assert "fresh_classical" not in text.split("## Commands")[0]  # arms without runs are left out
    assert (doc.parent / "img" / "results_frozenlake_ablations.png").stat().st_size > 10_000
    # a table without the on-policy arm (replay arms only) leaves the columns against it empty
    shutil.rmtree(out / "frozenlake" / "none_s0")
    subprocess.run(cmd[:-len(TINY) - 1] + ["--report-only"], cwd=REPO, check=True, capture_output=True, text=True,
                   timeout=300)
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| FrozenLake 4x4, text |")]
    assert len(rows) == 3 and all(line.endswith("|  |  |") and "nan" not in line for line in rows)
    # --against pairs each arm with its runs in another folder (here the same one: differences 0)
    subprocess.run(cmd[:-len(TINY) - 1] + ["--report-only", "--against", str(out)], cwd=REPO, check=True,
                   capture_output=True, text=True, timeout=300)
    text = doc.read_text()
    assert f"Each arm against the same arm's runs in `{out}`" in text
    assert "| fresh - fresh there | 1 | 0.000 (0 of 1 ahead) |" in text


@pytest.mark.slow
def test_a_shared_start_is_built_once_every_run_starts_from_it_and_finished_runs_drop_their_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task with ``shared_start`` builds its start (the config's pretraining) once in
    ``<out>/<task>/start``; every run is started from its policy with no pretraining of its own,
    and with ``prune`` a finished run keeps its metrics and summary but not its weights."""
    import yaml

    from learner.tools import paper_table

    spec = paper_table.Task("FrozenLake 4x4, text", "configs/frozenlake_default.yaml", 1, shared_start=True,
                            prune=True)
    monkeypatch.setitem(paper_table.TASKS, "shared", spec)
    flags = [f if f != "0" or TINY[i - 1] != "--pretrain-steps" else "2" for i, f in enumerate(TINY)]  # a start to build
    out, doc = tmp_path / "paper", tmp_path / "docs" / "results.md"
    argv = ["--out", str(out), "--tasks", "shared", "--methods", "none", "fresh", "--seeds", "0", "--jobs", "2",
            "--doc", str(doc), "--", *flags]
    assert paper_table.main(argv) == 0
    start = out / "shared" / "start"
    assert (start / "summary.json").exists() and (start / "reference" / "config.json").exists()
    assert json.loads((start / "metrics.jsonl").read_text().splitlines()[0])["kind"] == "pretrain"
    built = (start / "summary.json").stat().st_mtime_ns
    for arm in ("none", "fresh"):
        run = out / "shared" / f"{arm}_s0"
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert config["model"] == str(start / "reference") and config["pretrain_steps"] == 0
        assert not any(json.loads(line)["kind"] == "pretrain" for line in (run / "metrics.jsonl").read_text().splitlines())
        assert (run / "summary.json").exists() and not (run / "checkpoints").exists() and not (run / "reference").exists()
    text = doc.read_text()
    assert "| FrozenLake 4x4, text | fresh | 1 |" in text
    assert "--run-name start --seed 0" in text and f"--model {start / 'reference'} --pretrain-steps 0" in text
    # a second call finds the start built and every run finished
    assert paper_table.main(argv) == 0
    assert (start / "summary.json").stat().st_mtime_ns == built
