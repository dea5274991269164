"""``RestartWatch`` turns a group's own restarts of its workers into recovery rows."""

from __future__ import annotations

import os
import signal

import pytest

import phalanx as px
from phalanx.algorithms.worker_recoveries import RestartWatch, recovery_row
from tests.helpers import until
from tests.workers import Recorder


def _pid(worker: object) -> int:
    return os.getpid()


@pytest.mark.timeout(60)
def test_a_killed_worker_restarted_by_its_group_is_one_restart_with_its_times(cluster):
    group = Recorder.create_group().launch(
        cluster, px.NodePlacement(num_workers=2), name="watched", restart_policy=px.RestartPolicy()
    )
    try:
        watch = RestartWatch(lambda: group)
        assert watch.new() == []  # the start is no recovery
        pid = group.apply(_pid, [(1, (), {})]).wait(timeout=60)[0]
        os.kill(pid, signal.SIGKILL)
        restarts: list = []  # the group's watcher sees the death and restarts the worker
        assert until(lambda: restarts.extend(watch.new()) or restarts, timeout=60)

        (restart,) = restarts
        assert (restart.rank, restart.attempts) == (1, 1)
        assert restart.reason.startswith("actor died"), restart.reason
        assert restart.down_at <= restart.asked_at < restart.back_at
        assert 0 < restart.start_seconds <= restart.seconds
        assert watch.new() == []  # each restart once
        assert recovery_row(restart, "generation", 7) == {
            "recovery/seconds": restart.seconds,
            "recovery/start_seconds": restart.start_seconds,
            "recovery/group": "generation",
            "recovery/rank": 1,
            "recovery/step": 7,
            "recovery/reason": restart.reason,
            "recovery/attempts": 1,
        }
        assert group.execute_on(1).record(1).wait()[0]["rank"] == 1  # serving again
    finally:
        group.shutdown(timeout=10)
