"""``StepPhases``: each phase is timed, traced, shown on the progress line and, when
asked, measured for peak memory."""

from __future__ import annotations

import pytest

from phalanx.observe import trace
from phalanx.observe.breakdown import WallBreakdown
from phalanx.observe.phases import StepPhases
from phalanx.observe.progress import Progress

pytestmark = pytest.mark.timeout(60)


class _Memory:
    """A peak-memory source whose peak is the number of resets so far."""

    def __init__(self) -> None:
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1

    def peak(self) -> float:
        return float(self.resets)


def test_phases_time_trace_and_measure(tmp_path):
    bar = Progress(total=1, enabled=False)
    memory = _Memory()
    phases = StepPhases(bar, memory)
    trace.enable(tmp_path / "t.json")
    try:
        with phases("generation"):
            assert bar.waiting_for == "generation"
        with phases("training", "train step", peak=True):
            assert bar.waiting_for == "train step"
        with pytest.raises(RuntimeError), phases("refit"):
            raise RuntimeError("boom")
        trace.dump()
    finally:
        trace.disable()
        trace.reset()
    assert bar.waiting_for is None
    assert set(phases.times) == {"generation", "training"}  # a failed phase has no time
    assert all(t >= 0 for t in phases.times.values())
    assert phases.memory_gb == {"training": 1.0} and memory.resets == 1
    spans = [e for e in trace.load(tmp_path / "t.json") if e.get("cat") == "phase"]
    assert [e["name"] for e in spans] == ["generation", "training", "refit"]
    phases.new_step()
    assert phases.times == {} and phases.memory_gb == {}
    breakdown = WallBreakdown()
    timed = StepPhases(bar, breakdown=breakdown)
    for _ in range(2):
        with timed("weight_sync", breakdown="weight sync"):
            pass
    with timed("train"):
        pass
    parts = breakdown.as_dict()
    assert set(parts) >= {"weight sync", "train"} and "weight_sync" not in parts
    no_memory = StepPhases(bar)
    with pytest.raises(ValueError, match="phase 'x': peak=True needs StepPhases"):
        no_memory("x", peak=True).__enter__()
