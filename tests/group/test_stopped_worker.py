"""A stopped (SIGSTOP) worker during a call without an explicit timeout: the wait fails
once the rank leaves its health probe unanswered for ``PHALANX_CALL_SILENCE_S`` (60 s by
default, 3 s here), naming it; the rank is marked unhealthy until it answers; the hang
report says exactly why it has no stacks."""

from __future__ import annotations

import os
import signal
import time

import pytest

import phalanx as px
from phalanx.group.fault import WorkerHealth
from phalanx.group.hang import HangTimeoutError
from tests.helpers import stop_process

pytestmark = pytest.mark.timeout(120)


class Waits(px.Worker):
    def pid(self) -> int:
        return os.getpid()

    def block(self, path: str) -> int:
        """Return once ``path`` exists (polled, at most 60 s)."""
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.rank


def test_a_stopped_worker_fails_a_default_wait_naming_it(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_CALL_SILENCE_S", "3")
    g = Waits.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=2), name="stopped_worker"
    )
    go = tmp_path / "go"
    try:
        pids = g.pid().wait()
        handle = g.block(str(go))
        stop_process(pids[1])
        try:
            t0 = time.monotonic()
            with pytest.raises(HangTimeoutError) as info:
                handle.wait()
            took = time.monotonic() - t0
        finally:
            os.kill(pids[1], signal.SIGCONT)
            go.touch()
        e = info.value
        assert 3 <= took < 30, took
        assert (e.pending_ranks, e.silent_ranks, e.silence_s) == ([0, 1], [1], 3.0)
        assert (
            "ranks [1] did not answer a health probe for 3s (a stopped or wedged process; "
            "PHALANX_CALL_SILENCE_S)" in str(e)
        )
        assert (
            f"(stacks unavailable: process {pids[1]} is stopped (state T: SIGSTOP or a "
            "debugger); a stopped process runs no code, so it cannot report its stacks)"
        ) in e.report
        assert "block" in e.where[0]  # rank 0 answered: its stack is in the report
        assert g.health() == {0: WorkerHealth.HEALTHY, 1: WorkerHealth.UNHEALTHY}
        event = g.health_events()[-1]
        assert (event.rank, event.new, event.reason) == (
            1,
            WorkerHealth.UNHEALTHY,
            "did not answer a health probe for 3s during block()",
        )
        assert handle.wait(timeout=60) == [0, 1]  # it was only stopped
        assert g.health() == {0: WorkerHealth.HEALTHY, 1: WorkerHealth.HEALTHY}
        assert g.pid().wait() == pids  # answered: back in service, not restarted
    finally:
        g.shutdown()
