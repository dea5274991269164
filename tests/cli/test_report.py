"""``phalanx report``: the summary table and the three plots, from a run saved by the test."""

from __future__ import annotations

import io
import json
import shutil
import time
from pathlib import Path

import pytest
from rich.console import Console

import phalanx as px
from phalanx.cli import report
from phalanx.cli.main import main
from phalanx.observe import plots, trace
from phalanx.observe.metrics import MetricsLogger, read_metrics

# The metrics.jsonl of a PPO run of ``benchmarks/chaos_training.py --algo ppo`` (CartPole,
# --num-learners 1) in which the learner was killed twice and an env runner once.
PPO_CHAOS_METRICS = Path(__file__).parent / "data" / "ppo_chaos_metrics.jsonl"


class Learner(px.Worker):
    def rollout(self, n: int):
        with self.worker_timer("env_step"):
            time.sleep(0.002 * n)
        return [float(self.rank + i) for i in range(n)]

    def train(self):
        with self.worker_timer("update"):
            time.sleep(0.01)
        return 0.5


def _saved_run(cluster, run_dir) -> None:
    """A tiny traced training loop that logs the standard keys."""
    trace.reset()
    trace.enable(run_dir / "trace.json")
    group = Learner.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=2), name="report_run"
    )
    try:
        with MetricsLogger(run_dir, config={"algo": "test", "workers": 2}) as log:
            timesteps = 0
            for step in range(1, 6):
                t0 = time.perf_counter()
                with trace.span("rollout"):
                    returns = [r for rs in group.rollout(4).wait(timeout=60) for r in rs]
                t1 = time.perf_counter()
                with trace.span("train"):
                    loss = group.train().wait(timeout=60)[0]
                t2 = time.perf_counter()
                timesteps += 8
                log.log(
                    step,
                    {
                        "timesteps": timesteps,
                        "return_mean": sum(returns) / len(returns) + step,
                        "return_std": 0.5,
                        "loss": {"total": loss},
                        "time": {"rollout": t1 - t0, "train": t2 - t1, "step": t2 - t0},
                        "throughput/steps_per_s": 8 / (t2 - t0),
                        "restarts": 0,
                        "weights_version": step,
                    },
                )
        trace.dump()
    finally:
        group.shutdown()
        trace.disable()
        trace.reset()


@pytest.mark.timeout(120)
def test_report_writes_table_and_plots_from_a_saved_run(cluster, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "tiny"
    _saved_run(cluster, run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["loss/total"] == 0.5 and rows[-1]["timesteps"] == 40

    out_dir = tmp_path / "plots"
    assert main(["report", str(run_dir), "--out", str(out_dir)]) == 0
    text = capsys.readouterr().out
    assert "tiny" in text and "return_mean last" in text and "time/rollout mean s" in text
    assert "busy report_run rank 0" in text and "busy driver (waiting)" in text
    for name in ("learning_curve", "phase_times", "utilisation"):
        png = out_dir / f"{name}.png"
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert png.stat().st_size > 5_000

    summary = report.summarize(run_dir)
    assert summary["steps"] == 5 and summary["timesteps"] == 40
    assert summary["return_mean last"] == pytest.approx(rows[-1]["return_mean"])
    util = report.utilisation(trace.load(run_dir / "trace.json"))
    assert {"report_run rank 0", "report_run rank 1", "driver (waiting)"} <= set(util)
    for u in util.values():
        assert 0 < u["fraction"] <= 1 and u["busy_s"] > 0


def test_report_without_trace_or_curve_and_missing_run(tmp_path, capsys):
    run_dir = tmp_path / "bare"
    with MetricsLogger(run_dir) as log:
        for step in range(3):
            log.log(step, {"time/generate": 0.1 * step, "time/train": 0.2})
    written = report.write_report(run_dir)
    assert set(written) == {"phase_times"}
    text = capsys.readouterr().out
    assert "skipped utilisation" in text and "skipped learning_curve" in text
    assert main(["report", str(tmp_path / "nope")]) == 1


def test_metrics_logger_rows_and_bad_input(tmp_path):
    import numpy as np
    import torch

    with MetricsLogger(tmp_path / "m", use_tensorboard=None) as log:
        assert log.backends[0] == "jsonl"
        row = log.log(3, {"a": torch.tensor(1.5), "b": np.float32(2.0), "c": float("nan")})
        assert row["a"] == 1.5 and row["b"] == 2.0 and row["c"] is None
        with pytest.raises(TypeError, match="step"):
            log.log("3", {})
        with pytest.raises(ValueError, match="step"):
            log.log(1, {"step": 2})
        with pytest.raises(TypeError, match="metric value"):
            log.log(1, {"x": object()})
    lines = (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["step"] == 3
    with pytest.raises(TypeError, match="run_dir"):
        MetricsLogger(None)


@pytest.mark.timeout(60)
def test_report_marks_each_ppo_recovery_at_the_timesteps_of_its_iteration(tmp_path, monkeypatch):
    run_dir = tmp_path / "ppo"
    run_dir.mkdir()
    shutil.copy(PPO_CHAOS_METRICS, run_dir / "metrics.jsonl")
    rows = read_metrics(run_dir)
    recoveries = [r for r in rows if "recovery/step" in r]
    assert [(r["recovery/group"], r["recovery/iteration"]) for r in recoveries] == [
        ("learner", 24),
        ("env_runner", 46),
        ("learner", 55),
    ]
    timesteps = {r["iteration"]: r["timesteps"] for r in rows if "iteration" in r}
    assert [timesteps[i] for i in (24, 46, 55)] == [12288, 17920, 22528]
    assert plots.recovery_marks(rows, "timesteps") == [12288, 17920, 22528]
    # An iteration that wrote no row (the run stopped first): the recovery's own row's step.
    without_55 = [r for r in rows if r.get("iteration") != 55]
    assert plots.recovery_marks(without_55, "timesteps") == [12288, 17920, 22528]
    with pytest.raises(ValueError, match="x_axis must be 'step' or 'timesteps', got 'wall'"):
        plots.recovery_marks(rows, "wall")

    figures = []  # the figures the report draws, kept to read their artists
    make_figure = plots._figure
    monkeypatch.setattr(
        plots, "_figure", lambda w, h: figures.append(make_figure(w, h)) or figures[-1]
    )
    written = report.write_report(run_dir, console=Console(file=io.StringIO()))
    assert written["learning_curve"] == str(run_dir / "learning_curve.png")
    (ax,) = figures[0].axes  # the learning curve: return_mean_recent against timesteps
    assert ax.get_xlabel() == "timesteps"
    marks = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert [list(line.get_xdata()) for line in marks] == [
        [12288, 12288],
        [17920, 17920],
        [22528, 22528],
    ]
    assert marks[0].get_label() == "recovery (3: the learner or an env runner restarted)"
    assert report.summarize(run_dir)["recoveries"] == (
        "step 12288 (learner, 3.6 s), step 17920 (env_runner, 2.5 s), step 22528 (learner, 3.4 s)"
    )
