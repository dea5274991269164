"""Fault tolerance: kill -9, sys.exit, exceptions and hangs injected on a fixed schedule.

Each worker appends one byte to ``<dir>/rank<r>.inits`` in ``__init__``: the file outlives
the process, so tests assert exact restart counts.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import sys
import time

import pytest
import ray

import phalanx as px
from phalanx.group.fault import FaultState
from phalanx.group.fault import WorkerHealth as H
from tests.helpers import until

pytestmark = pytest.mark.timeout(120)


class Flaky(px.Worker):
    def __init__(self, counter_dir: str, with_model: bool = False):
        super().__init__()
        with open(os.path.join(counter_dir, f"rank{self.rank}.inits"), "a") as f:
            f.write("x")
        self.value = 0
        if with_model:  # only the weights test pays for importing torch in its workers
            import torch

            self.model = torch.nn.Linear(4, 2)

    def pid(self):
        return os.getpid()

    def add(self, k):
        self.value += k
        return self.value

    def env(self):
        return os.environ["RANK"], os.environ.get("PX_FAULT_ENV")

    def get_value(self):
        return self.value

    def get_state(self):
        return {"value": self.value}

    def set_state(self, state):
        if state.get("poison"):
            raise RuntimeError("cannot restore a poisoned state")
        self.value = state["value"]

    def noop(self):
        return self.rank

    def slow(self, s):
        time.sleep(s)
        return self.rank

    def slow_signal(self, s, signal_dir):
        """Sleep ``s`` seconds after telling the test (a file) that the call started."""
        with open(os.path.join(signal_dir, f"started{self.rank}"), "w"):
            pass
        time.sleep(s)
        return self.rank

    def stuck_in_sleep_forever(self):
        while True:
            time.sleep(0.05)

    def hang_on(self, rank):
        if self.rank == rank:
            self.stuck_in_sleep_forever()
        return self.rank

    def hold_the_gil(self, signal_dir):
        import re

        with open(os.path.join(signal_dir, f"started{self.rank}"), "w"):
            pass
        return bool(re.match(r"(a+)+$", "a" * 64 + "b"))  # exponential, never lets go of the GIL

    def exit_now(self, code=3):
        sys.exit(code)

    def fail(self):
        raise ValueError(f"bad input on rank {self.rank}")

    def shard(self, data):
        return (self.rank, data)

    def weights(self):
        return self.weights_version, float(sum(p.detach().sum() for p in self.model.parameters()))


def _read(path):
    with open(path) as f:
        return f.read()


def _inits(d, rank):
    path = os.path.join(d, f"rank{rank}.inits")
    return len(_read(path)) if os.path.exists(path) else 0


def _kill(group, rank):
    os.kill(group.worker_metadata[rank]["pid"], signal.SIGKILL)


def _started(d, *ranks):
    """Wait until each of ``ranks`` signalled that its call started (``slow_signal``)."""
    return until(lambda: all(os.path.exists(os.path.join(d, f"started{r}")) for r in ranks))


def _transitions(group, rank):
    return [(e.old.value, e.new.value) for e in group.health_events() if e.rank == rank]


RESTARTED = [("healthy", "unhealthy"), ("unhealthy", "restarting"), ("restarting", "healthy")]


@pytest.fixture
def make_group(cluster, tmp_path):
    made = []

    def make(n=2, policy=None, with_model=False, **kw):
        g = Flaky.create_group(str(tmp_path), with_model).launch(
            cluster,
            placement=px.NodePlacement(num_workers=n),
            restart_policy=policy,
            **kw,
        )
        made.append(g)
        return g

    yield make
    for g in made:
        g.shutdown()


def test_policy_validation(cluster):
    with pytest.raises(ValueError, match="max_restarts_per_worker"):
        px.RestartPolicy(max_restarts_per_worker=-1)
    with pytest.raises(TypeError, match="delay_s"):
        px.RestartPolicy(delay_s="1")
    with pytest.raises(ValueError, match="health_probe_timeout_s"):
        px.RestartPolicy(health_probe_timeout_s=0)
    with pytest.raises(TypeError, match="restart_policy"):
        Flaky.create_group("/tmp").launch(cluster, restart_policy={"max_restarts_per_worker": 1})
    assert not px.RestartPolicy.never().restarts_enabled
    assert px.RestartPolicy().restarts_enabled


def test_kill9_during_call_restarts_with_state(make_group, tmp_path):
    g = make_group(3, px.RestartPolicy(), env_vars={"PX_FAULT_ENV": "kept"})
    assert g.add(5).wait() == [5, 5, 5]
    assert g.get_state().wait() == [{"value": 5}] * 3  # the group remembers these
    old_pid = g.worker_metadata[1]["pid"]
    name = g.worker_metadata[1]["name"]
    h = g.slow_signal(3, str(tmp_path))
    assert _started(tmp_path, 0, 1, 2)
    _kill(g, 1)
    with pytest.raises(px.WorkerDiedError) as info:
        h.wait(timeout=60)
    assert info.value.rank == 1 and "rank 1" in str(info.value)
    assert g.wait_healthy(60)
    assert _inits(tmp_path, 1) == 2 and _inits(tmp_path, 0) == 1 and _inits(tmp_path, 2) == 1
    assert g.num_remote_worker_restarts() == 1
    assert _transitions(g, 1) == RESTARTED
    assert _transitions(g, 0) == [] and _transitions(g, 2) == []
    # Same slot, rank, name, environment; state restored before any call reached it.
    md = g.worker_metadata[1]
    assert md["pid"] != old_pid and md["name"] == name
    assert ray.get_actor(name, namespace="phalanx")._actor_id == g.actors[1]._actor_id
    assert g.get_value().wait() == [5, 5, 5]
    assert g.execute_on(1).env().wait() == [("1", "kept")]
    assert g.healthy_worker_ids() == [0, 1, 2] and g.num_healthy_workers() == 3


def test_sys_exit_in_method_restarts(make_group, tmp_path):
    g = make_group(2, px.RestartPolicy())
    g.register_state(1, {"value": 42})
    with pytest.raises(px.WorkerDiedError) as info:
        g.execute_on(1).exit_now(3).wait(timeout=60)
    assert info.value.rank == 1
    assert g.wait_healthy(60)
    assert _inits(tmp_path, 1) == 2
    assert g.num_remote_worker_restarts() == 1
    assert _transitions(g, 1) == RESTARTED
    assert g.get_value().wait() == [0, 42]  # the registered state was restored


def test_exception_in_method_leaves_worker_healthy(make_group, tmp_path):
    g = make_group(2, px.RestartPolicy())
    with pytest.raises(px.WorkerError) as info:
        g.fail().wait(timeout=60)
    assert not isinstance(info.value, px.WorkerDiedError)
    assert info.value.rank == 0 and "ValueError" in str(info.value)
    assert g.healthy_worker_ids() == [0, 1]
    assert g.health_events() == [] and g.num_remote_worker_restarts() == 0
    assert _inits(tmp_path, 0) == _inits(tmp_path, 1) == 1
    assert g.noop().wait() == [0, 1]


def test_hang_report_has_the_hanging_frame(make_group, tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_HANG_DIR", str(tmp_path / "hangs"))
    g = make_group(2, px.RestartPolicy())
    h = g.hang_on(1)
    with pytest.raises(TimeoutError) as info:
        h.wait(timeout=1.0)
    err = info.value
    assert isinstance(err, px.HangTimeoutError) and isinstance(err, px.GroupTimeoutError)
    assert err.pending_ranks == [1]
    assert err.results == {0: 0}  # what finished comes back
    assert err.report_path and err.report_path in str(err)
    assert "stuck_in_sleep_forever" in str(err)  # the message names where it is stuck
    text = _read(err.report_path)
    assert "rank 1" in text and "stuck_in_sleep_forever" in text and "hang_on" in text
    assert "test_fault.py" in text
    assert g.healthy_worker_ids() == [0, 1]  # a timeout is not a death


def test_hang_holding_the_gil_is_dumped_with_py_spy(make_group, tmp_path, monkeypatch):
    if not shutil.which("py-spy"):
        pytest.skip("py-spy is not installed")
    monkeypatch.setenv("PHALANX_HANG_DIR", str(tmp_path / "hangs"))
    g = make_group(1, px.RestartPolicy())
    h = g.hold_the_gil(str(tmp_path))
    assert _started(tmp_path, 0)
    with pytest.raises(px.HangTimeoutError) as info:
        h.wait(timeout=0.5)
    text = _read(info.value.report_path)
    if "(py-spy)" in text and "hold_the_gil" not in text:
        pytest.skip(f"py-spy cannot read processes here: {text[-300:]}")
    assert "(py-spy)" in text and "hold_the_gil" in text
    assert "hold_the_gil" in str(info.value)


def test_foreach_timeout_reports_and_ignore_mode_returns_finished(
    make_group, tmp_path, monkeypatch
):
    monkeypatch.setenv("PHALANX_HANG_DIR", str(tmp_path / "hangs"))
    g = make_group(2, px.RestartPolicy(ignore_failures=True))
    got = g.foreach_worker_with_id(lambda i, w: w.hang_on(1), timeout_seconds=1.0)
    assert got == [0]
    assert len(os.listdir(tmp_path / "hangs")) == 1


def test_watchdog_prints_report(make_group, tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_HANG_DIR", str(tmp_path / "hangs"))
    g = make_group(2, px.RestartPolicy())
    out = io.StringIO()
    g.set_watchdog(0.5, stream=out)
    g.noop().wait()
    g.hang_on(0)
    assert until(lambda: g.watchdog.reports)
    report = g.watchdog.reports[0]
    assert report.pending_ranks == [0] and report.method == "hang_on"
    assert "stuck_in_sleep_forever" in out.getvalue()
    # A second stuck call gets its own report; the first is not reported again meanwhile.
    g.execute_on(1).hang_on(1)
    assert until(lambda: len(g.watchdog.reports) >= 2)
    assert [(r.method, r.pending_ranks) for r in g.watchdog.reports] == [
        ("hang_on", [0]),
        ("hang_on", [1]),
    ]
    with pytest.raises(ValueError, match="after_s"):
        g.set_watchdog(-1)


def test_ignore_failures_finishes_with_fewer_workers(make_group, tmp_path):
    from ray.exceptions import RayError

    g = make_group(3, px.RestartPolicy.never(ignore_failures=True))
    _kill(g, 1)
    assert until(lambda: g.health()[1] == H.DEAD)
    assert _transitions(g, 1) == [("healthy", "unhealthy"), ("unhealthy", "dead")]
    h = g.noop()
    assert h.wait(timeout=60) == [0, 2] and h.skipped == [1]
    assert g.foreach_worker("noop") == [0, 2]
    # one function per worker: the dead worker's function is dropped, the others run
    assert g.foreach_worker([lambda w: "f0", lambda w: "f1", lambda w: "f2"]) == ["f0", "f2"]
    # RLlib's result objects: with healthy_only=False the dead worker's error is a result
    res = g.foreach_actor(lambda w: w.rank * 10, healthy_only=False)
    assert [(r.actor_id, r.ok) for r in res] == [(0, True), (1, False), (2, True)]
    err = [r.get() for r in res if not r.ok][0]
    assert isinstance(err, px.WorkerDiedError) and isinstance(err, RayError) and err.rank == 1
    assert [r.get() for r in res.ignore_errors()] == [0, 20]
    assert [r.actor_id for r in res.ignore_ray_errors()] == [0, 2]
    assert g.foreach_worker(lambda w: w.rank * 10) == [0, 20]
    assert g.foreach_worker_with_id(lambda i, w: (i, w.rank)) == [(0, 0), (2, 2)]
    assert g.num_healthy_workers() == 2 and g.healthy_worker_ids() == [0, 2]
    assert g.num_remote_worker_restarts() == 0 and _inits(tmp_path, 1) == 1
    # per-worker data never drops a shard, even when ignoring failures
    with pytest.raises(px.WorkerDiedError, match="rank 1"):
        g.run_all_workers_multiple_data("shard", [10, 11, 12])


def test_raise_mode_names_the_rank(make_group):
    g = make_group(2, px.RestartPolicy.never())
    _kill(g, 1)
    with pytest.raises(px.WorkerDiedError) as info:
        g.noop().wait(timeout=60)
    assert info.value.rank == 1 and "rank 1" in str(info.value)
    assert until(lambda: g.health()[1] == H.DEAD)
    with pytest.raises(px.WorkerDiedError, match="rank 1 is dead"):
        g.noop()
    assert g.execute_on(0).noop().wait() == [0]


def test_died_during_call_ignore_mode_keeps_the_rest(make_group, tmp_path):
    g = make_group(3, px.RestartPolicy.never(ignore_failures=True))
    h = g.slow_signal(3, str(tmp_path))
    assert _started(tmp_path, 0, 1, 2)
    _kill(g, 2)
    assert h.wait(timeout=60) == [0, 1]
    assert h.skipped == [2]
    assert until(lambda: g.health()[2] == H.DEAD)


def test_future_of_bare_refs_uses_the_group_collect_path(make_group, tmp_path):
    """``MultiWorkerFuture.get_results`` handles a death as ``GroupHandle.wait`` does:
    ignored per policy, the rank marked, the call named."""
    g = make_group(3, px.RestartPolicy.never(ignore_failures=True))
    refs = g.run_all_workers_single_data("slow_signal", 3, str(tmp_path))
    assert _started(tmp_path, 0, 1, 2)
    _kill(g, 2)
    assert px.MultiWorkerFuture(refs).get_results(g, timeout=60) == [0, 1]
    assert until(lambda: g.health()[2] == H.DEAD)
    refs = g.run_all_workers_single_data("fail")
    with pytest.raises(px.WorkerError) as info:  # an exception is raised even when ignoring
        px.MultiWorkerFuture(refs, called_workers=[0, 1]).get_results(g, timeout=60)
    assert (info.value.rank, info.value.method) == (0, "fail")


def test_sharded_dispatch_restarts_dead_member_first(make_group, tmp_path):
    g = make_group(2, px.RestartPolicy(), sharding=px.NamedSharding([[0, 1]], ["dp", "tp"]))
    g.register_state(None, {"value": 7})
    _kill(g, 1)
    assert until(lambda: g.health()[1] != H.HEALTHY or g.num_remote_worker_restarts() == 1)
    fut = g.run_all_workers_sharded_data("shard", data=["a", "b"], in_sharded_axes=["tp"])
    assert g.get_all_worker_results(fut) == [(0, "a"), (1, "b")]
    assert _inits(tmp_path, 1) == 2 and g.num_remote_worker_restarts() == 1
    assert g.get_value().wait() == [0, 7]


def test_sharded_dispatch_without_restart_raises(make_group):
    g = make_group(
        2,
        px.RestartPolicy.never(ignore_failures=True),
        sharding=px.NamedSharding([[0, 1]], ["dp", "tp"]),
    )
    _kill(g, 0)
    assert until(lambda: g.health()[0] == H.DEAD)
    with pytest.raises(px.WorkerDiedError, match="rank 0"):
        g.run_all_workers_sharded_data("shard", data=["a", "b"], in_sharded_axes=["tp"])


def test_restart_limit_makes_worker_dead(make_group, tmp_path):
    g = make_group(2, px.RestartPolicy(max_restarts_per_worker=1))
    _kill(g, 0)
    assert until(lambda: g.num_remote_worker_restarts() == 1)
    assert g.wait_healthy(60)
    _kill(g, 0)
    assert until(lambda: g.health()[0] == H.DEAD)
    assert _transitions(g, 0) == [*RESTARTED, ("healthy", "unhealthy"), ("unhealthy", "dead")]
    assert _inits(tmp_path, 0) == 2 and g.num_remote_worker_restarts() == 1
    assert g.probe_unhealthy_workers(timeout_seconds=5) == [0]  # the one earlier recovery
    assert g.probe_unhealthy_workers(timeout_seconds=5) == []
    with pytest.raises(px.WorkerDiedError, match="rank 0"):
        g.noop()


def test_failed_restore_marks_unhealthy_then_probe_recovers(make_group, tmp_path):
    g = make_group(2, px.RestartPolicy(max_restarts_per_worker=1))
    g.register_state(1, {"value": 3, "poison": True})
    _kill(g, 1)
    assert until(
        lambda: g.health()[1] == H.UNHEALTHY and "restore failed" in g.health_events()[-1].reason
    )
    assert g.healthy_worker_ids() == [0]
    assert g.foreach_worker("noop") == [0]  # healthy_only: the unrestored worker is not used
    with pytest.raises(px.WorkerDiedError, match="restore failed"):
        g.execute_on(1).noop()
    g.register_state(1, {"value": 3})
    assert g.probe_unhealthy_workers(timeout_seconds=10) == [1]
    assert g.get_value().wait() == [0, 3]
    assert _inits(tmp_path, 1) == 2 and g.num_remote_worker_restarts() == 0


def test_weights_restored_after_restart(make_group):
    import torch

    from phalanx.weights import WeightSender

    g = make_group(2, px.RestartPolicy(), with_model=True)
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    sender = WeightSender(g, model)
    sender.send()
    expected = float(sum(p.detach().sum() for p in model.parameters()))
    assert g.weights().wait() == [(sender.version, expected)] * 2
    _kill(g, 0)
    assert until(lambda: g.num_remote_worker_restarts() == 1)
    assert g.wait_healthy(60)
    assert g.weights().wait() == [(sender.version, expected)] * 2


def test_foreach_worker_faces(make_group):
    from ray.exceptions import RayError

    g = make_group(2, px.RestartPolicy())
    assert g.foreach_worker(lambda w: w.add(2)) == [2, 2]
    assert g.foreach_worker("add", kwargs={"k": 1}) == [3, 3]
    assert g.foreach_worker([lambda w: "a", lambda w: "b"]) == ["a", "b"]
    assert g.foreach_worker_with_id(lambda i, w: i * 100 + w.rank) == [0, 101]
    assert g.foreach_worker("noop", remote_worker_ids=[1]) == [1]
    refs = g.foreach_worker("noop", return_obj_refs=True)
    assert ray.get(refs) == [0, 1]
    with pytest.raises(px.WorkerError, match="bad input on rank 0"):
        g.foreach_worker("fail")
    with pytest.raises(RayError, match=r"\[rank 0\]\.fail\(\)"):  # RLlib code catches RayError
        g.foreach_worker("fail")
    res = g.foreach_actor("fail")
    assert [(r.actor_id, r.ok, type(r.get()).__name__) for r in res] == [
        (0, False, "WorkerError"),
        (1, False, "WorkerError"),
    ]
    assert g.healthy_worker_ids() == [0, 1]  # a plain group: an exception is not a death
    with pytest.raises(px.WorkerError) as info:  # errors name the call, not a helper
        g.foreach_worker_with_id(lambda i, w: w.fail())
    assert info.value.method == "foreach_worker_with_id"
    with pytest.raises(ValueError, match="remote_worker_ids"):
        g.foreach_worker("noop", remote_worker_ids=[5])
    with pytest.raises(TypeError, match="func"):
        g.foreach_worker(3)
    with pytest.raises(ValueError, match="timeout_seconds"):
        g.foreach_worker("noop", timeout_seconds=-1)
    assert g.foreach_worker(lambda w: w.slow(1.0), timeout_seconds=0) == []  # take what is ready


def test_async_requests_budget_and_fetch(make_group):
    g = make_group(2, px.RestartPolicy())
    first = g.foreach_worker_async(lambda w: w.slow(1.0), tag="a", max_in_flight_per_worker=1)
    assert first.sent == [0, 1] and first.skipped == [] and int(first) == 2
    over = g.foreach_worker_async("noop", tag="a", max_in_flight_per_worker=1)
    assert over.sent == [] and over.skipped == [0, 1]  # reported, never silently dropped
    other = g.foreach_worker_async("noop", tag="b", remote_worker_ids=[1])
    assert other.sent == [1]
    assert g.num_in_flight_async_reqs() == 3 and g.num_in_flight_async_reqs(tags="a") == 2
    got_b = g.fetch_ready_async_reqs(tags=["b"], timeout_seconds=30)
    assert got_b == [(1, 1)]
    got: list = []
    assert until(lambda: got.extend(g.fetch_ready_async_reqs(tags="a")) or len(got) == 2)
    assert sorted(got) == [(0, 0), (1, 1)]
    assert g.num_in_flight_async_reqs() == 0
    g.foreach_worker_async(lambda w: w.fail() if w.rank == 0 else w.rank, tag="c")
    with pytest.raises(px.WorkerError, match="bad input on rank 0"):
        g.fetch_ready_async_reqs(tags="c", timeout_seconds=None)  # waits for both
    # a result ready beside the error is kept for the next fetch
    assert g.fetch_ready_async_reqs(tags="c") == [(1, 1)]
    assert g.num_in_flight_async_reqs() == 0
    # timeout_seconds=None waits for every request in flight, not the first one
    g.foreach_worker_async(lambda w: w.slow(0.3 * w.rank), tag="d")
    assert sorted(g.fetch_ready_async_reqs(tags="d", timeout_seconds=None)) == [(0, 0), (1, 1)]
    # two failed requests in one fetch: the second is raised by the next fetch, not lost
    g.foreach_worker_async("fail", tag="e")
    errors = []
    for _ in range(2):
        with pytest.raises(px.WorkerError) as info:
            g.fetch_ready_async_reqs(tags="e", timeout_seconds=None)
        errors.append((info.value.rank, info.value.method))
    assert sorted(errors) == [(0, "fail"), (1, "fail")]
    assert g.fetch_ready_async_reqs(tags="e") == []
    # RLlib's result objects: errors included, never raised
    g.foreach_worker_async(lambda w: w.fail() if w.rank == 1 else w.rank, tag="f")
    res = g.fetch_ready_async_results(tags="f", timeout_seconds=None)
    assert sorted((r.actor_id, r.ok) for r in res) == [(0, True), (1, False)]
    assert [r.get() for r in res.ignore_errors()] == [0]
    with pytest.raises(ValueError, match="max_in_flight_per_worker"):
        g.foreach_worker_async("noop", max_in_flight_per_worker=0)


def test_nemo_face_isolated_builder_restarts(cluster, tmp_path, monkeypatch):
    """A worker built by name (through the isolated initializer) on a virtual cluster."""
    monkeypatch.setenv("PHALANX_HANG_DIR", str(tmp_path / "hangs"))
    vc = px.RayVirtualCluster([2], use_gpus=False, name="fault_vc")
    builder = px.RayWorkerBuilder("tests.group.test_fault.Flaky", str(tmp_path))
    g = px.RayWorkerGroup(vc, builder, name_prefix="fault_nemo", restart_policy=px.RestartPolicy())
    try:
        _kill(g, 0)
        assert until(lambda: g.num_remote_worker_restarts() == 1)
        assert g.wait_healthy(60)
        assert _inits(tmp_path, 0) == 2 and _inits(tmp_path, 1) == 1
        assert g.worker_metadata[0]["name"] == "fault_nemo:0"
        fut = g.run_all_workers_sharded_data("shard", data=["a", "b"], in_sharded_axes=["dp"])
        assert g.get_all_worker_results(fut) == [(0, "a"), (1, "b")]
        fut = g.run_all_workers_single_data("hang_on", 0)
        with pytest.raises(px.HangTimeoutError) as info:
            px.MultiWorkerFuture(fut, called_workers=[0, 1]).get_results(g, timeout=1.0)
        assert info.value.pending_ranks == [0] and info.value.results == {1: 1}
        assert info.value.method == "hang_on"  # a future of bare refs still names its call
        assert "stuck_in_sleep_forever" in _read(info.value.report_path)
    finally:
        g.shutdown()
        vc.shutdown()


class _NoMembers:
    name = "nobody"
    launch_timeout_s = 1.0


def test_rllib_rule_keeps_a_failed_rank_out_until_it_answers():
    """``RestartPolicy.rllib``: an exception takes a rank out of service (its process is up,
    so it stays healthy); only an answer brings it back, counted as RLlib counts."""
    policy = px.RestartPolicy.rllib(restart=False)
    assert policy.restart_on_error and policy.until_probed and not policy.restarts_enabled
    assert px.RestartPolicy.rllib().max_restarts_per_worker == 1000
    fs = FaultState(_NoMembers(), policy, lambda r: None)
    fs.reset(3)
    fs.fail(1, "sample() raised ValueError")
    fs.fail(2, "sample() stalled", running="a ref still running")
    assert fs.in_service() == [0]
    assert fs.health() == [H.HEALTHY] * 3 and fs.recoveries == 0
    fs.mark_healthy([0, 1])
    assert fs.in_service() == [0, 1] and fs.recoveries == 1
    fs.set_in_service(2, True, "set_actor_state")
    assert fs.in_service() == [0, 1, 2] and fs.recoveries == 2
    fs.set_in_service(0, False, "set_actor_state")
    assert fs.in_service() == [1, 2] and fs.health()[0] == H.UNHEALTHY
    with pytest.raises(TypeError, match="until_probed must be a bool"):
        px.RestartPolicy(until_probed=1)
