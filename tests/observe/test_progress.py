"""The progress display: live on a terminal, throttled lines elsewhere, never silent."""

from __future__ import annotations

import io
import time

import pytest
import ray
from rich.console import Console

from phalanx.observe.progress import Progress, format_stats, wait_refs


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=terminal, width=200), buf


def test_line_mode_says_what_it_waits_for_and_shows_stats():
    console, buf = _console(terminal=False)
    bar = Progress(total=4, title="PPO", unit="steps", console=console, log_interval_s=0.3)
    with bar.waiting("rollouts from 2 runners"):
        time.sleep(1.0)  # silent work: the ticker must speak up
    bar.update(2, {"return_mean": 21.5, "restarts": 1, "throughput/steps_per_s": 1500.0})
    bar.update(advance=2)
    assert bar.completed == 4
    bar.update(5)  # closed at total: ignored
    lines = buf.getvalue().splitlines()
    waits = [ln for ln in lines if "waiting for rollouts from 2 runners" in ln]
    assert len(waits) >= 2, lines
    assert lines[-1].startswith("[PPO] 4/4 steps")
    assert (
        "return 21.50" in lines[-1] and "restarts 1" in lines[-1] and "steps/s 1,500" in lines[-1]
    )


def test_terminal_mode_renders_live_bar():
    console, buf = _console(terminal=True)
    with Progress(total=3, title="GRPO", console=console) as bar:
        with bar.waiting("generation"):
            time.sleep(0.6)
        bar.update(3, {"reward_mean": 0.25})
    out = buf.getvalue()
    assert "GRPO" in out and "waiting for generation" in out and "reward 0.250" in out
    assert "3/3" in out


def test_disabled_prints_nothing_and_bad_input(monkeypatch):
    console, buf = _console(terminal=False)
    monkeypatch.setenv("PHALANX_PROGRESS", "0")
    bar = Progress(total=2, console=console)
    bar.update(2, {"return_mean": 1.0})
    bar.close()
    assert buf.getvalue() == ""
    with pytest.raises(TypeError, match="total"):
        Progress(total="10", enabled=False)
    with pytest.raises(ValueError, match="total"):
        Progress(total=-1, enabled=False)
    with pytest.raises(ValueError, match="completed or advance"):
        Progress(total=2, enabled=False).update(1, advance=1)
    with pytest.raises(ValueError, match="what"), Progress(enabled=False).waiting(""):
        pass
    assert format_stats({"return_mean": 1.0, "restarts": 2}) == "return 1.00 · restarts 2"


@pytest.mark.timeout(60)
def test_wait_refs_counts_ready_and_times_out(cluster):
    @ray.remote(num_cpus=0)
    def nap(s):
        time.sleep(s)
        return s

    refs = [nap.remote(0.1 * i) for i in range(3)]
    assert ray.get(wait_refs(refs, "naps", timeout_s=30, enabled=False)) == [0.0, 0.1, 0.2]
    slow = [nap.remote(30)]
    with pytest.raises(TimeoutError, match="1/1 still pending"):
        wait_refs(slow, "slow nap", timeout_s=0.5, enabled=False)
    ray.cancel(slow[0], force=True)
