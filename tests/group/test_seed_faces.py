"""Upstream behaviour of a group's faces: NeMo-RL's and RLlib's validation errors (both
``AssertionError`` and ``ValueError``), RLlib's ``set_actor_state`` and
``probe_unhealthy_actors``, and a group call's default bound (``call_timeout_s``)."""

from __future__ import annotations

import os
import signal

import pytest
import ray

import phalanx as px
from phalanx.group.dispatch import DispatchError
from phalanx.group.futures import DEFAULT_CALL_TIMEOUT_S
from tests.helpers import stop_process, until
from tests.workers import Recorder


@pytest.fixture
def pair(cluster):
    g = Recorder.create_group("seed").launch(
        cluster, placement=px.NodePlacement(num_workers=2), name="seed_faces"
    )
    yield g
    g.shutdown()


def _recorded(g):
    return [len(c) for c in ray.get([w.get_calls.remote() for w in g.workers])]


@pytest.mark.smoke
def test_multiple_data_count_mismatch_is_assertion_and_value_error(pair):
    for data in ([1], [1, 2, 3]):
        with pytest.raises(AssertionError) as info:
            pair.run_all_workers_multiple_data("record", x=data)
        assert isinstance(info.value, ValueError) and type(info.value) is DispatchError
        assert str(info.value) == f"x has {len(data)} entries for 2 called workers"
    with pytest.raises(AssertionError, match="needs per-worker data"):
        pair.run_all_workers_multiple_data("record")
    assert _recorded(pair) == [0, 0]  # nothing reached a worker


def test_positional_data_is_forwarded_deliberately(pair):
    """NeMo-RL asserts on positional data; phalanx forwards it in order."""
    got = ray.get(pair.run_all_workers_multiple_data("record", [10, 11], common_kwargs={"c": 1}))
    assert [(r["rank"], r["args"], r["kwargs"]) for r in got] == [
        (0, (10,), {"c": 1}),
        (1, (11,), {"c": 1}),
    ]
    assert ray.get(pair.run_single_worker_single_data("record", 1, "a"))["args"] == ("a",)


def test_rllib_function_list_of_wrong_length_asserts(pair):
    f = lambda w: w.rank  # noqa: E731
    with pytest.raises(AssertionError) as info:
        pair.foreach_actor_async([f])
    assert isinstance(info.value, ValueError)
    assert str(info.value) == (
        "Funcs must have the same number of callables as actor indices. "
        "(func: a list of 1 functions for 2 workers)"
    )
    with pytest.raises(AssertionError, match="a list of 3 functions for 2 workers"):
        pair.foreach_worker([f, f, f])
    assert pair.num_in_flight_async_reqs() == 0


def test_set_actor_state_takes_a_worker_out_of_service_and_back(pair):
    assert pair.is_actor_healthy(1)
    pair.foreach_worker_async(lambda w: w.sleep(0.2), tag="t")
    pair.set_actor_state(1, healthy=False)
    assert pair.healthy_worker_ids() == [0] and not pair.is_actor_healthy(1)
    assert pair.num_in_flight_async_reqs() == 1  # rank 1's request was dropped, as in RLlib
    assert pair.foreach_worker(lambda w: w.rank) == [0]  # healthy_only skips it
    assert pair.health()[1] == px.WorkerHealth.UNHEALTHY  # no restart was scheduled
    pair.set_actor_state(1, True)
    assert pair.foreach_worker(lambda w: w.rank) == [0, 1]
    with pytest.raises(ValueError, match="actor_id must be < world size 2, got 2"):
        pair.set_actor_state(2, True)
    with pytest.raises(TypeError, match="healthy must be a bool"):
        pair.set_actor_state(0, 1)


def test_probe_unhealthy_actors_follows_rllib(pair):
    assert pair.probe_unhealthy_actors() == []
    pair.set_actor_state(0, False)
    pair.set_actor_state(1, False)
    # both answer the ping; without mark_healthy they stay out of service
    assert pair.probe_unhealthy_actors(timeout_seconds=30) == [0, 1]
    assert pair.healthy_worker_ids() == []
    assert pair.probe_unhealthy_actors(timeout_seconds=30, mark_healthy=True) == [0, 1]
    assert pair.healthy_worker_ids() == [0, 1]
    assert [h.value for h in pair.health().values()] == ["healthy", "healthy"]
    ray.kill(pair.actors[1], no_restart=True)
    assert until(lambda: pair.health()[1] != px.WorkerHealth.HEALTHY, 30)
    assert pair.probe_unhealthy_actors(timeout_seconds=5, mark_healthy=True) == []
    assert pair.healthy_worker_ids() == [0]


def test_call_timeout_bounds_a_wait_on_a_stopped_worker(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_HANG_DIR", str(tmp_path / "hangs"))
    assert pair.call_timeout_s == DEFAULT_CALL_TIMEOUT_S
    pair.call_timeout_s = 2.0
    pid = pair.worker_metadata[1]["pid"]
    stop_process(pid)
    try:
        handle = pair.noop()
        with pytest.raises(px.GroupTimeoutError) as info:
            handle.wait()  # no timeout given: the group's bound applies
        assert info.value.pending_ranks == [1] and info.value.timeout == 2.0
        assert "on ranks [1]" in str(info.value)
        fut = px.MultiWorkerFuture(pair.run_all_workers_single_data("noop"))
        with pytest.raises(px.GroupTimeoutError) as info:
            fut.get_results(pair)
        assert info.value.pending_ranks == [1]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert handle.wait(timeout=60) == [None, None]
    assert pair.healthy_worker_ids() == [0, 1]
    pair.call_timeout_s = None
    assert pair.noop().wait() == [None, None]
    with pytest.raises(ValueError, match="call_timeout_s must be > 0 or None, got 0"):
        pair.call_timeout_s = 0
    with pytest.raises(TypeError, match="call_timeout_s must be a number of seconds or None"):
        pair.call_timeout_s = "5"


def test_call_timeout_from_environment(monkeypatch):
    from phalanx.group.futures import default_call_timeout

    monkeypatch.setenv("PHALANX_CALL_TIMEOUT_S", "42.5")
    assert default_call_timeout() == 42.5
    monkeypatch.setenv("PHALANX_CALL_TIMEOUT_S", "none")
    assert default_call_timeout() is None
    monkeypatch.setenv("PHALANX_CALL_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="PHALANX_CALL_TIMEOUT_S must be seconds > 0"):
        default_call_timeout()
    monkeypatch.delenv("PHALANX_CALL_TIMEOUT_S")
    assert default_call_timeout() == DEFAULT_CALL_TIMEOUT_S


def test_cyclic_argument_reaches_the_workers(pair):
    shared = {"name": "loop", "pad": b"x" * 200_000}
    shared["self"] = shared
    looped: list = [1]
    looped.append(looped)
    got = pair.record(shared, looped).wait(timeout=60)
    for r in got:
        d, lst = r["args"]
        assert d["self"] is d and d["name"] == "loop" and len(d["pad"]) == 200_000
        assert lst[1] is lst and lst[0] == 1
