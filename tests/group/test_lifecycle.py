"""Group lifecycle under faults: start-up deaths, restarts under way, shutdown, bad input,
RLlib's failure rules, and RLinf's ``worker_info_list``/``max_concurrency``/``_close``.

Workers signal through files: each ``__init__`` appends to ``rank<r>.inits`` and writes
``rank<r>.pid<n>`` for its n-th incarnation; while ``gate<r>.<n>`` exists that incarnation's
``__init__`` waits (the tests open and close gates instead of sleeping).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest
import ray

import phalanx as px
from phalanx.group.fault import FaultState
from phalanx.group.fault import WorkerHealth as H
from tests.helpers import until

pytestmark = pytest.mark.timeout(150)


class Gated(px.Worker):
    def __init__(self, d: str):
        super().__init__()
        path = os.path.join(d, f"rank{self.rank}.inits")
        with open(path, "a") as f:
            f.write("x")
        with open(path) as f:
            n = len(f.read())
        pid_file = os.path.join(d, f"rank{self.rank}.pid{n}")
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)  # readers never see it empty
        gate = os.path.join(d, f"gate{self.rank}.{n}")
        deadline = time.monotonic() + 120
        while os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.d = d

    def noop(self):
        return self.rank

    def fail(self):
        raise ValueError(f"failed on rank {self.rank}")

    def slow_signal(self, s):
        with open(os.path.join(self.d, f"started{self.rank}"), "w"):
            pass
        time.sleep(s)
        return self.rank

    def meet(self, n):
        """Return once ``n`` calls of ``meet`` run at the same time on this worker."""
        prefix = f"meet{self.rank}."
        with open(os.path.join(self.d, prefix + uuid.uuid4().hex), "w"):
            pass
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            count = sum(1 for f in os.listdir(self.d) if f.startswith(prefix))
            if count >= n:
                return count
            time.sleep(0.02)
        raise TimeoutError(f"only {count} concurrent calls")

    def _close(self):
        with open(os.path.join(self.d, f"closed{self.rank}"), "w"):
            pass


def _path(d, name):
    return os.path.join(str(d), name)


def _pid(d, rank, n):
    with open(_path(d, f"rank{rank}.pid{n}")) as f:
        return int(f.read())


def _inits(d, rank):
    with open(_path(d, f"rank{rank}.inits")) as f:
        return len(f.read())


def _gate(d, rank, n):
    with open(_path(d, f"gate{rank}.{n}"), "w"):
        pass


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _names(prefix):
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"{prefix}:")
    )


def _launch(cluster, d, n=2, policy=None, name=None, **kw):
    return Gated.create_group(str(d)).launch(
        cluster, px.NodePlacement(num_workers=n), name, restart_policy=policy, **kw
    )


def _kill_when_started(d, rank, n):
    """Kill incarnation ``n`` of ``rank`` as soon as its ``__init__`` started (a thread)."""

    def run():
        if until(lambda: os.path.exists(_path(d, f"rank{rank}.pid{n}")), 60):
            os.kill(_pid(d, rank, n), signal.SIGKILL)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_worker_killed_in_init_is_restarted_by_policy(cluster, tmp_path):
    _gate(tmp_path, 1, 1)  # the first __init__ of rank 1 waits: it is killed there
    killer = _kill_when_started(tmp_path, 1, 1)
    g = _launch(cluster, tmp_path, policy=px.RestartPolicy(), name="init_kill")
    try:
        killer.join(10)
        assert _inits(tmp_path, 0) == 1 and _inits(tmp_path, 1) == 2
        assert g.num_remote_worker_restarts() == 1
        assert [(e.rank, e.new.value) for e in g.health_events()] == [(1, "healthy")]
        assert "start-up" in g.health_events()[0].reason
        assert g.noop().wait(timeout=30) == [0, 1]
        assert g.worker_metadata[1]["pid"] == _pid(tmp_path, 1, 2)
    finally:
        g.shutdown()
    # Without restarts, the same death fails the launch naming the rank; nothing is left.
    d2 = tmp_path / "never"
    d2.mkdir()
    _gate(d2, 1, 1)
    killer = _kill_when_started(d2, 1, 1)
    with pytest.raises(px.WorkerError, match=r"init_never\[rank 1\]\.__init__\(\)"):
        _launch(cluster, d2, policy=px.RestartPolicy.never(), name="init_never")
    killer.join(10)
    assert until(lambda: _names("init_never") == [], 10)


def test_probe_waits_for_a_restart_under_way(cluster, tmp_path):
    g = _launch(cluster, tmp_path, policy=px.RestartPolicy(), name="probe_wait")
    try:
        _gate(tmp_path, 1, 2)  # the restarted rank 1 waits in __init__ until we open it
        os.kill(g.worker_metadata[1]["pid"], signal.SIGKILL)
        assert until(lambda: os.path.exists(_path(tmp_path, "rank1.pid2")))
        assert g.health()[1] == H.RESTARTING
        os.remove(_path(tmp_path, "gate1.2"))
        assert g.probe_unhealthy_workers(timeout_seconds=30) == [1]
        assert g.healthy_worker_ids() == [0, 1] and g.num_remote_worker_restarts() == 1
        assert g.probe_unhealthy_workers(timeout_seconds=5) == []
    finally:
        g.shutdown()


def test_shutdown_frees_a_restart_stuck_in_init(cluster, tmp_path):
    g = _launch(cluster, tmp_path, policy=px.RestartPolicy(), name="stuck_init")
    _gate(tmp_path, 1, 2)  # never opened: the restart stays in __init__
    os.kill(g.worker_metadata[1]["pid"], signal.SIGKILL)
    assert until(lambda: os.path.exists(_path(tmp_path, "rank1.pid2")))
    stuck = _pid(tmp_path, 1, 2)
    assert _names("stuck_init") == ["stuck_init:0", "stuck_init:1"]
    t0 = time.monotonic()
    assert g.shutdown(timeout=5) is True
    assert time.monotonic() - t0 < 7
    assert _names("stuck_init") == []
    assert until(lambda: not _alive(stuck), 20)  # the restarted process is gone too
    # Calls after shutdown raise instead of returning nothing.
    with pytest.raises(RuntimeError, match="'stuck_init' is shut down"):
        g.call("noop")
    with pytest.raises(RuntimeError, match="shut down"):
        g.foreach_worker("noop")
    with pytest.raises(RuntimeError, match="shut down"):
        g.noop()
    assert g.shutdown() is True  # a second shutdown is a no-op


def test_death_during_whole_group_call_is_reported_at_once(cluster, tmp_path):
    g = _launch(cluster, tmp_path, n=3, name="death_now")
    try:
        h = g.slow_signal(60)
        assert until(lambda: all(os.path.exists(_path(tmp_path, f"started{r}")) for r in range(3)))
        t0 = time.monotonic()
        os.kill(g.worker_metadata[1]["pid"], signal.SIGKILL)
        with pytest.raises(px.WorkerDiedError) as info:
            h.wait(timeout=120)
        assert info.value.rank == 1 and info.value.method == "slow_signal"
        assert time.monotonic() - t0 < 15  # not after the other ranks' 60 s
        assert until(lambda: g.health()[1] == H.DEAD, 10)
    finally:
        g.shutdown(timeout=10)


def test_bad_waits_and_ranks(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_HANG_DIR", str(tmp_path / "hangs"))
    g = _launch(cluster, tmp_path, n=2, name="bad_waits")
    try:
        h = g.execute_on(0).slow_signal(30)
        assert until(lambda: os.path.exists(_path(tmp_path, "started0")))
        with pytest.raises(ValueError, match="timeout must be >= 0 or None, got -1"):
            h.wait(timeout=-1)
        with pytest.raises(TypeError, match="timeout must be a number"):
            h.wait(timeout="1")
        with pytest.raises(px.GroupTimeoutError) as info:
            h.wait(timeout=0)  # a poll: names what still runs, writes no report
        assert info.value.pending_ranks == [0]
        assert not isinstance(info.value, px.HangTimeoutError)
        assert not os.path.exists(tmp_path / "hangs")
        assert g.execute_on(1).noop().wait(timeout=0.0 + 30) == [1]
        with pytest.raises(TypeError, match="each rank must be an int rank, got \\['a'\\]"):
            g.execute_on("a")
        with pytest.raises(ValueError, match=r"ranks \[2\] out of range"):
            g.execute_on(2)
    finally:
        g.shutdown(timeout=10)


def test_restart_on_error_is_rllibs_rule(cluster, tmp_path):
    policy = px.RestartPolicy(restart_on_error=True, ignore_failures=True)
    g = _launch(cluster, tmp_path, policy=policy, name="on_error")
    try:
        assert g.foreach_worker(lambda w: w.fail() if w.rank == 1 else w.rank) == [0]
        assert g.wait_healthy(60)
        assert _inits(tmp_path, 1) == 2 and _inits(tmp_path, 0) == 1
        assert g.num_remote_worker_restarts() == 1
        assert [(e.old.value, e.new.value) for e in g.health_events() if e.rank == 1] == [
            ("healthy", "unhealthy"),
            ("unhealthy", "restarting"),
            ("restarting", "healthy"),
        ]
        assert "raised ValueError" in g.health_events()[0].reason
    finally:
        g.shutdown()


def test_rlinf_worker_info_list_max_concurrency_and_close(cluster, tmp_path):
    with pytest.raises(ValueError, match="max_concurrency must be an int >= 1, got 0"):
        _launch(cluster, tmp_path, name="conc_bad", max_concurrency=0)
    g = _launch(cluster, tmp_path, name="conc", max_concurrency=2)
    infos = g.worker_info_list
    assert [i.rank for i in infos] == [0, 1]
    assert all(isinstance(i, px.WorkerGroup.WorkerRank) for i in infos)
    assert [i.worker._actor_id for i in infos] == [a._actor_id for a in g.actors]
    # two calls run at once on one worker: each waits for the other
    h1, h2 = g.execute_on(0).meet(2), g.execute_on(0).meet(2)
    assert h1.wait(timeout=60) == [2] and h2.wait(timeout=60) == [2]
    g._close()
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("closed")) == [
        "closed0",
        "closed1",
    ]
    assert _names("conc") == []


class _NoMembers:
    name = "nobody"
    launch_timeout_s = 1.0


def test_restart_window_counts_recent_restarts_only():
    with pytest.raises(ValueError, match="restart_window_s must be > 0"):
        px.RestartPolicy(restart_window_s=0)
    with pytest.raises(TypeError, match="restart_window_s must be a number"):
        px.RestartPolicy(restart_window_s="1")
    members = _NoMembers()
    windowed = FaultState(
        members, px.RestartPolicy(max_restarts_per_worker=1, restart_window_s=0.3), lambda r: None
    )
    lifetime = FaultState(members, px.RestartPolicy(max_restarts_per_worker=1), lambda r: None)
    for fs in (windowed, lifetime):
        fs.reset(1, {0: 1})  # one restart already used
        assert not fs.can_restart(0) and fs.restart_attempts(0) == 1
    assert until(lambda: windowed.can_restart(0), 10)
    assert windowed.restart_attempts(0) == 0
    assert not lifetime.can_restart(0) and lifetime.restart_attempts(0) == 1
