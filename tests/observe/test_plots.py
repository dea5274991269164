"""The run plots: one learning curve for PPO and GRPO rows, phases from step 1."""

from __future__ import annotations

import pytest

from phalanx.cli.report import summarize
from phalanx.observe.metrics import MetricsLogger
from phalanx.observe.plots import phase_keys, plot_learning_curve, plot_phase_times, series

PNG = b"\x89PNG\r\n\x1a\n"


def _grpo_rows(tmp_path):
    with MetricsLogger(tmp_path, use_tensorboard=False) as log:
        log.log(-5, {"sft_loss": 2.0})  # a warm-up row: before step 1
        log.log(0, {"eval/accuracy": 0.1, "time/eval": 1.0})
        for step in (1, 2, 3):
            log.log(step, {"reward_mean": 0.2 * step, "reward_std": 0.1,
                           "time/generation": 2.0, "time/training": 3.0,
                           "time/step": 5.5 if step < 3 else 7.0,
                           **({"eval/accuracy": 0.5, "time/eval": 1.5} if step == 3 else {})})  # fmt: skip
    from phalanx.observe.metrics import read_metrics

    return read_metrics(tmp_path)


def test_grpo_curve_and_phases(tmp_path):
    rows = _grpo_rows(tmp_path)
    assert series(rows, "eval/accuracy") == ([0, 3], [0.1, 0.5])
    assert phase_keys(rows) == ["time/eval", "time/generation", "time/training"]
    assert plot_learning_curve(rows, tmp_path / "curve.png", "GRPO")
    assert (tmp_path / "curve.png").read_bytes()[:8] == PNG
    assert plot_phase_times(rows, tmp_path / "phases.png")
    assert (tmp_path / "phases.png").read_bytes()[:8] == PNG
    summary = summarize(tmp_path)
    assert summary["eval/accuracy first"] == 0.1 and summary["eval/accuracy last"] == 0.5
    assert summary["reward_mean last"] == 0.6000000000000001


def test_phase_chart_starts_at_step_1_and_stacks_within_the_step(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    rows = _grpo_rows(tmp_path)
    seen = {}
    real_savefig = Figure.savefig

    def savefig(fig, path, **kw):
        ax = fig.axes[0]
        seen["xlim"] = ax.get_xlim()
        seen["heights"] = [sum(p.get_height() for p in c) for c in zip(*ax.containers)]
        return real_savefig(fig, path, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    assert plot_phase_times(rows, tmp_path / "phases.png")
    lo, hi = seen["xlim"]
    assert 0 < lo < 1 and 3 < hi < 4  # steps 1..3; no warm-up step, no step 0
    assert seen["heights"] == [5.0, 5.0, 6.5]  # each at most its step's total


@pytest.mark.smoke
def test_ppo_curve_uses_timesteps(tmp_path):
    rows = [{"step": i, "timesteps": 512 * i, "return_mean_recent": 20.0 * i} for i in (1, 2)]
    assert series(rows, "return_mean_recent") == ([512, 1024], [20.0, 40.0])
    assert plot_learning_curve(rows, tmp_path / "c.png")
    assert not plot_learning_curve([{"step": 1, "loss": 1.0}], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
