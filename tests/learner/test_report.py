"""The run summary's verdicts: improvement over the start of RL, and board reading vs habit."""

from __future__ import annotations

from learner.report import board_reading_verdict, counterfactual_verdict, picture_verdict, summarize, wilson_interval


def _eval(success: float, n: int = 200, probe: float | None = None, probe_n: int = 0, decoding: str = "sampled") -> dict:
    lo, hi = wilson_interval(round(success * n), n)
    row = {"success": success, "success_ci_low": lo, "success_ci_high": hi, "episodes_eval": n, "return_mean": success,
           "invalid_rate": 0.0, "decoding": decoding}
    if probe is not None:
        row.update(probe_safe_rate=probe, probe_down_right=probe_n)
    return row


def test_board_blind_improvement_is_not_called_board_reading() -> None:
    reads, text = board_reading_verdict(_eval(0.27, probe=0.47, probe_n=190))
    assert reads is False and "board-blind" in text


def test_safe_move_probe_above_chance_or_success_above_fixed_path_is_board_reading() -> None:
    assert board_reading_verdict(_eval(0.40, probe=0.86, probe_n=200))[0] is True
    assert board_reading_verdict(_eval(0.70, probe=0.55, probe_n=40))[0] is True  # CI low > 0.46
    assert board_reading_verdict(_eval(0.40, probe=0.56, probe_n=40))[0] is False  # probe CI includes 0.5


def test_no_probe_no_board_verdict() -> None:
    assert board_reading_verdict(_eval(0.5)) == (None, "")


def test_without_a_safe_move_probe_the_counterfactual_interval_decides() -> None:
    """Tasks without FrozenLake's probe (Sokoban): reads the board iff the counterfactual
    shift's 95% interval is above 0; the safe-move probe keeps precedence where it ran."""
    reading = {**_eval(0.1), "counterfactual_shift": 0.12, "counterfactual_ci_low": 0.05, "counterfactual_ci_high": 0.19,
               "counterfactual_pairs": 32}
    reads, text = board_reading_verdict(reading)
    assert reads is True and "counterfactual shift +0.120 [+0.050, +0.190] over 32" in text
    blind = {**reading, "counterfactual_shift": 0.01, "counterfactual_ci_low": -0.02}
    assert board_reading_verdict(blind)[0] is False and "no evidence" in counterfactual_verdict(blind)[1]
    with_probe = {**_eval(0.27, probe=0.47, probe_n=190), **{k: v for k, v in reading.items() if k.startswith("counterfactual")}}
    assert board_reading_verdict(with_probe)[0] is False  # the safe-move probe decides where it ran


def test_a_figure_policy_reads_its_picture_when_another_picture_scores_clearly_lower() -> None:
    def row(success: float, other: float) -> dict:
        lo, hi = wilson_interval(round(other * 200), 200)
        return {**_eval(success), "other_picture_success": other, "other_picture_ci_low": lo, "other_picture_ci_high": hi}

    reads, text = picture_verdict(row(0.99, 0.185))
    assert reads is True and text.endswith("reads the picture") and "0.18 [0.14, 0.24] with another problem's" in text
    assert picture_verdict(row(0.51, 0.435))[0] is False  # intervals overlap: a blind policy's success
    assert picture_verdict(row(0.20, 0.45))[0] is False
    assert picture_verdict(_eval(0.5)) == (None, "")
    state = {"iteration": 10, "episodes": 640, "nonfinite_total": 0}
    out = summarize({"baseline": row(0.25, 0.18), "final": row(0.99, 0.185)}, state, 300.0)
    assert out["learned"] is True and out["reads_board"] is True
    assert "other picture 0.18" in out["text"] and "other picture: success on the same tasks" in out["text"]
    assert "other picture:" not in summarize({"baseline": _eval(0.1), "final": _eval(0.2)}, state, 1.0)["text"]


def test_summary_separates_improvement_from_board_reading() -> None:
    state = {"iteration": 10, "episodes": 640, "nonfinite_total": 0}
    out = summarize({"baseline": _eval(0.035, probe=0.46, probe_n=174), "final": _eval(0.27, probe=0.47, probe_n=190)},
                    state, 300.0)
    assert out["learned"] is True and out["reads_board"] is False
    assert "do not overlap - improved" in out["text"] and "no evidence beyond the board-blind" in out["text"]
    assert "safe 0.47 (n=190)" in out["text"]
    flat = summarize({"baseline": _eval(0.30), "final": _eval(0.32)}, state, 300.0)
    assert flat["learned"] is False and "no clear improvement" in flat["text"]
    soko = summarize({"baseline": {**_eval(0.03), "noop_rate": 0.41}, "final": {**_eval(0.1), "noop_rate": 0.125}}, state, 300.0)
    assert "no-op 0.41" in soko["text"] and "no-op 0.12" in soko["text"]  # Sokoban's probe: wasted moves


def test_an_archived_run_is_read_from_its_gzipped_metrics(tmp_path) -> None:
    import gzip
    import json

    from learner.report import read_metrics

    rows = [{"kind": "train", "iteration": 1, "episodes": 64}, {"kind": "eval", "iteration": 1, "success": 0.5}]
    with gzip.open(tmp_path / "metrics.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write("\n".join(json.dumps(r) for r in rows) + "\n{\"torn")
    assert read_metrics(tmp_path / "metrics.jsonl") == rows
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n", encoding="utf-8")  # the plain file wins
    assert read_metrics(tmp_path / "metrics.jsonl") == rows[:1]


def test_paired_summaries_pairs_by_seed_and_refuses_mismatched_seeds(tmp_path, capsys) -> None:
    import json

    import pytest

    from learner.tools import paired_summaries

    def summary(name: str, seed: int, success: float):
        run = tmp_path / name
        run.mkdir()
        (run / "config.yaml").write_text(f"seed: {seed}\n")
        (run / "summary.json").write_text(json.dumps({"evals": {"final": {"success": success}}}))
        return str(run / "summary.json")

    a = [summary(f"a{s}", s, v) for s, v in enumerate((0.5, 0.7, 0.6))]
    b = [summary(f"b{s}", s, v) for s, v in enumerate((0.4, 0.5, 0.6))]
    assert paired_summaries.main([*a, "--", *b]) == 0
    assert "over 3 seeds: +0.100 [-0.148, +0.348]" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not the same seed"):
        paired_summaries.main([a[0], "--", b[1]])
    # The delivered policy against the last iteration of the same runs, with the bar counted.
    (tmp_path / "a0" / "summary.json").write_text(json.dumps({"evals": {
        "final": {"success": 0.5, "probe_safe_rate": 0.7}, "selected": {"success": 0.8, "probe_safe_rate": 0.9}}}))
    assert paired_summaries.main(["--phase-a", "selected", "--bar", "0.6,0.75", a[0], "--", a[0]]) == 0
    out = capsys.readouterr().out
    assert "seed 0: 0.800 - 0.500 = +0.300" in out and "meet the bar: A 1 of 1, B 0 of 1" in out


def test_spread_curves_compares_runs_at_one_iteration_on_their_periodic_evaluations(tmp_path, capsys) -> None:
    import json

    from learner.tools import spread_curves

    def run(name: str, periodic: list[tuple[int, float]], final: tuple[int, float]):
        folder = tmp_path / name
        folder.mkdir()
        rows = [{"kind": "eval", "iteration": i, "phase": f"iter_{i}", "decoding": "sampled", "success": s,
                 "action_spread": 0.1} for i, s in periodic]
        rows.append({"kind": "eval", "iteration": final[0], "phase": "final", "decoding": "sampled",
                     "success": final[1], "action_spread": 0.3})
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(folder)

    short = run("short", [(10, 0.1), (20, 0.2)], (20, 0.9))  # its final evaluation is not a periodic one
    long = run("long", [(i, i / 100) for i in range(10, 80, 10)], (70, 0.95))
    assert spread_curves.main([short, long, "--at", "20"]) == 0
    out = capsys.readouterr().out.split("at or before iteration 20:")[1]
    rows = {line.split()[0].split("/")[-1]: line.split()[1:] for line in out.strip().splitlines()[1:]}
    assert rows["short"] == ["20", "0.200", "0.10", "0.150"]
    assert rows["long"] == ["20", "0.200", "0.10", "0.150"]
    assert spread_curves.main([long, "--at", "70"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].split()[1:] == ["70", "0.700", "0.10", "0.500"]


def test_spread_curves_compares_runs_at_equal_seconds_of_rl(tmp_path, capsys) -> None:
    """``--at-seconds``: each run's periodic evaluations up to the iteration it had reached at
    that many seconds of RL, so settings with dearer iterations are compared at equal time."""
    import json

    from learner.tools import spread_curves

    def run(name: str, seconds_per_iteration: float):
        folder = tmp_path / name
        folder.mkdir()
        rows = []
        for i in range(1, 41):
            rows.append({"kind": "train", "iteration": i, "time_total_s": i * seconds_per_iteration})
            if i % 10 == 0:
                rows.append({"kind": "eval", "iteration": i, "phase": f"iter_{i}", "decoding": "sampled",
                             "success": i / 100, "action_spread": 0.1})
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(folder)

    cheap, dear = run("cheap", 1.0), run("dear", 2.0)  # at 40 s: iteration 40 against 20
    assert spread_curves.main([cheap, dear, "--at-seconds", "40"]) == 0
    out = capsys.readouterr().out.split("at or before 40 seconds of RL:")[1]
    rows = {line.split()[0].split("/")[-1]: line.split()[1:3] for line in out.strip().splitlines()[1:]}
    assert rows == {"cheap": ["40", "0.400"], "dear": ["20", "0.200"]}


def test_spread_curves_reports_when_a_run_first_reaches_the_target(tmp_path, capsys) -> None:
    """The first periodic evaluation at or above ``--target``; a final evaluation above it does
    not count (it is not a point along training), and a run that never gets there says None."""
    import json

    from learner.tools import spread_curves

    def run(name: str, periodic: list[float], final: float):
        folder = tmp_path / name
        folder.mkdir()
        rows = [{"kind": "eval", "iteration": 10 * (k + 1), "phase": f"iter_{10 * (k + 1)}", "decoding": "sampled",
                 "success": s, "action_spread": 0.3} for k, s in enumerate(periodic)]
        rows.append({"kind": "eval", "iteration": 10 * len(periodic), "phase": "final", "decoding": "sampled",
                     "success": final, "action_spread": 0.3})
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(folder)

    early = run("early", [0.2, 0.65, 0.5, 0.7], 0.7)
    never = run("never", [0.2, 0.3, 0.59], 0.9)
    assert spread_curves.main([early, never, "--target", "0.6"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "success >= 0.6 first at" in lines[0]
    reached = {line.split()[0].split("/")[-1]: line.split()[3] for line in lines[1:]}
    assert reached == {"early": "20", "never": "None"}
