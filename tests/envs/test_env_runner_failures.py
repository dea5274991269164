"""EnvRunnerGroup failure semantics on fixed schedules (RLlib's rules).

Two remote runners sample 10 steps per round; runner 2's env faults at its 15th step,
so inside round 2, once (a marker file stops a restarted runner from faulting again).
Faults: the env raises, the runner's process exits, ``step`` hangs. Each fault runs
with ``restart_failed_env_runners`` on, with ``ignore_env_runner_failures`` on (no
restarts), and with both off. After every round the test checks the batches returned,
the runner ids in service and RLlib's restart count; between rounds 2 and 3 it probes as
RLlib's algorithms do (``restore_env_runners``).
"""

from __future__ import annotations

import os
import time

import pytest
import ray

import phalanx as px
from phalanx.envs import EnvRunnerGroup, EnvRunnerGroupConfig
from phalanx.group.fault import WorkerHealth
from tests.envs.faulty_env import make_faulty_cartpole

pytestmark = pytest.mark.timeout(300)

# A hanging runner's round waits this long: what is checked is what happens after it.
HANG_TIMEOUT_S = 3.0

MODES = {
    "restart": dict(restart_failed_env_runners=True, ignore_env_runner_failures=False),
    "ignore": dict(restart_failed_env_runners=False, ignore_env_runner_failures=True),
    "off": dict(restart_failed_env_runners=False, ignore_env_runner_failures=False),
}


def _group(cluster, tmp_path, name: str, mode: str, fault: str, **extra) -> EnvRunnerGroup:
    cfg = EnvRunnerGroupConfig(
        env_config={"bad": [2], "at_step": 15, "mode": fault, "once_dir": str(tmp_path)},
        num_envs_per_env_runner=1,
        seed=0,
        sample_timeout_s=extra.pop("sample_timeout_s", 60.0),
        env_runner_health_probe_timeout_s=120.0,  # a restart takes ~1 s idle, 50 s+ on a loaded box
        **MODES[mode],
        **extra,
    )
    return EnvRunnerGroup(
        env_creator=make_faulty_cartpole,
        config=cfg,
        num_env_runners=2,
        local_env_runner=False,
        cluster=cluster,
        name=name,
    )


def _pids(g: EnvRunnerGroup, ids: list[int]) -> list[int]:
    return g.foreach_env_runner(lambda w: os.getpid(), remote_worker_ids=ids)


def _round(g: EnvRunnerGroup) -> list[int]:
    """One sample round: the worker index of each batch returned."""
    return sorted(b["worker_index"] for b in g.sample(num_timesteps=10))


# (fault, mode) -> (round 2 result, probe result, restarts after probe, round 3, new pid)
EXPECTED = {
    ("raise", "restart"): ([1], [2], 1, [1, 2], True),
    ("raise", "ignore"): ([1], [2], 1, [1, 2], False),
    ("raise", "off"): (px.WorkerError, [2], 1, [1, 2], False),
    ("exit", "restart"): ([1], [2], 1, [1, 2], True),
    ("exit", "ignore"): ([1], [], 0, [1], None),
    ("exit", "off"): (px.WorkerDiedError, [], 0, [1], None),
    ("hang", "restart"): ([1], [2], 1, [1, 2], True),
    ("hang", "ignore"): ([1], [], 0, [1], None),
    ("hang", "off"): ([1], [], 0, [1], None),
}


@pytest.mark.parametrize(("fault", "mode"), sorted(EXPECTED))
def test_fault_schedule(cluster, tmp_path, fault, mode):
    round2, probed, restarts, round3, new_pid = EXPECTED[(fault, mode)]
    extra = {"sample_timeout_s": HANG_TIMEOUT_S} if fault == "hang" else {}
    g = _group(cluster, tmp_path, f"fail_{fault}_{mode}", mode, fault, **extra)
    try:
        pid2 = _pids(g, [2])[0]
        assert _round(g) == [1, 2]  # steps 1..10: no fault yet
        assert g.healthy_env_runner_ids() == [1, 2]
        if isinstance(round2, type):
            with pytest.raises(round2) as err:
                _round(g)
            assert err.value.rank == 1 and err.value.method == "sample"
            assert isinstance(err.value, ray.exceptions.RayError)  # what RLlib code catches
            if fault == "raise":
                assert "simulated env failure on worker 2 at step 15" in str(err.value)
                assert "remote traceback" in str(err.value)
        else:
            assert _round(g) == round2
        assert (tmp_path / "faulted_2").exists()
        # out of service until a probe, whatever happened to its process meanwhile
        assert g.healthy_env_runner_ids() == [1]
        assert g.num_healthy_remote_env_runners() == 1 == g.num_healthy_env_runners()
        assert g.num_remote_env_runner_restarts() == 0
        assert g.probe_unhealthy_env_runners() == probed
        assert g.num_remote_env_runner_restarts() == restarts
        assert g.healthy_env_runner_ids() == sorted({1, *probed})
        assert _round(g) == round3
        assert g.num_remote_env_runner_restarts() == restarts
        if new_pid is not None:
            assert (_pids(g, [2])[0] != pid2) is new_pid
        health = g.remote_group.health()[1]
        if (fault, mode) in {("exit", "ignore"), ("exit", "off")}:
            assert health == WorkerHealth.DEAD
        else:
            assert health == WorkerHealth.HEALTHY
    finally:
        g.stop()


def test_dead_runner_batches_of_the_others_are_returned(cluster, tmp_path):
    """Ignoring failures, a runner dying mid-sample leaves the other
    runners' batches (three runners, two of them die in the same round)."""
    cfg = EnvRunnerGroupConfig(
        env_config={"bad": [1, 3], "at_step": 5, "mode": "exit", "once_dir": str(tmp_path)},
        num_envs_per_env_runner=1,
        restart_failed_env_runners=False,
        ignore_env_runner_failures=True,
    )
    g = EnvRunnerGroup(
        env_creator=make_faulty_cartpole,
        config=cfg,
        num_env_runners=3,
        local_env_runner=False,
        cluster=cluster,
        name="fail_two_die",
    )
    try:
        batches = g.sample(num_timesteps=10)
        assert [b["worker_index"] for b in batches] == [2]
        assert batches[0]["timesteps"] == 10
        assert g.healthy_env_runner_ids() == [2]
        assert g.probe_unhealthy_env_runners() == []
        assert [b["worker_index"] for b in g.sample(num_timesteps=10)] == [2]
    finally:
        g.stop()


def test_sample_brings_a_restarted_runner_back_without_a_probe(cluster, tmp_path):
    """Fast recovery: the round after the restart finished samples on it again (the
    probe at the start of ``sample`` counts it), no explicit probe needed."""
    g = _group(cluster, tmp_path, "fail_fast_back", "restart", "exit")
    try:
        assert _round(g) == [1, 2]
        assert _round(g) == [1]
        deadline = time.monotonic() + 240
        while g.remote_group.health()[1] != WorkerHealth.HEALTHY:
            assert time.monotonic() < deadline, "runner 2 was not restarted"
            time.sleep(0.05)
        assert g.healthy_env_runner_ids() == [1]  # restarted, not yet probed
        assert _round(g) == [1, 2]
        assert g.num_remote_env_runner_restarts() == 1
        assert g.probe_unhealthy_env_runners() == []
    finally:
        g.stop()


def test_no_runner_left_raises_naming_the_health(cluster, tmp_path):
    cfg = EnvRunnerGroupConfig(
        env_config={"bad": [1], "at_step": 3, "mode": "exit"},
        num_envs_per_env_runner=1,
        restart_failed_env_runners=False,
        ignore_env_runner_failures=True,
        env_runner_health_probe_timeout_s=2.0,
    )
    g = EnvRunnerGroup(
        env_creator=make_faulty_cartpole,
        config=cfg,
        num_env_runners=1,
        local_env_runner=False,
        cluster=cluster,
        name="fail_none_left",
    )
    try:
        assert g.sample(num_timesteps=5) == []
        with pytest.raises(px.WorkerDiedError, match="no remote env runner is in service"):
            g.sample(num_timesteps=5)
    finally:
        g.stop()


def test_rllib_health_methods_and_async_fetch_ready(cluster, tmp_path):
    """RLlib's names, signatures and return values."""
    g = _group(cluster, tmp_path, "fail_async", "ignore", "raise")
    try:
        assert g.healthy_env_runner_ids() == [1, 2]
        assert g.num_healthy_remote_env_runners() == 2
        assert g.num_healthy_env_runners() == 2  # no local runner
        assert g.num_remote_env_runner_restarts() == 0
        assert g.probe_unhealthy_env_runners() == []
        # first call: nothing fetched yet, two requests sent
        wid = g.foreach_env_runner_async_fetch_ready(lambda w: w.worker_index, tag="wid")
        assert wid == [] and g.num_in_flight_async_reqs("wid") == 2
        # the next call returns the previous results (waiting for all of them) and sends again
        got = g.foreach_env_runner_async_fetch_ready(
            lambda w: w.worker_index, tag="wid", timeout_seconds=None, return_actor_ids=True
        )
        assert got == [(1, 1), (2, 2)]
        assert g.num_in_flight_async_reqs("wid") == 2
        assert sorted(g.fetch_ready_async_reqs(tags="wid", timeout_seconds=None)) == [
            (1, 1),
            (2, 2),
        ]
        assert g.num_in_flight_async_reqs() == 0
        # an async request that raises takes its runner out of service (RLlib's RayError)
        assert g.foreach_env_runner_async("sample", "s", kwargs={"num_timesteps": 20}) == 2
        got = g.fetch_ready_async_reqs(tags=["s"], timeout_seconds=None)
        assert [wid for wid, _ in got] == [1]
        assert g.healthy_env_runner_ids() == [1]
        # healthy_only=False with mark_healthy: an answering runner comes back (counted)
        assert g.foreach_env_runner(
            lambda w: w.worker_index, healthy_only=False, mark_healthy=True
        ) == [1, 2]
        assert g.healthy_env_runner_ids() == [1, 2]
        assert g.num_remote_env_runner_restarts() == 1
        assert g.probe_unhealthy_env_runners() == [2]  # reported once, as RLlib does
        assert g.probe_unhealthy_env_runners() == []
        # a list of functions, one per runner in service
        assert g.foreach_env_runner([lambda w: "a", lambda w: "b"]) == ["a", "b"]
        with pytest.raises(ValueError, match="a list of 1 functions for 2 remote env runners"):
            g.foreach_env_runner([lambda w: 1])
        refs = g.foreach_env_runner(lambda w: w.worker_index, return_obj_refs=True)
        assert all(isinstance(r, ray.ObjectRef) for r in refs) and ray.get(refs) == [1, 2]
    finally:
        g.stop()


def test_async_error_raises_with_both_off_and_keeps_the_other_results(cluster, tmp_path):
    g = _group(cluster, tmp_path, "fail_async_off", "off", "raise")
    try:
        assert g.foreach_env_runner_async("sample", kwargs={"num_timesteps": 20}) == 2
        with pytest.raises(px.WorkerError, match="simulated env failure on worker 2"):
            g.fetch_ready_async_reqs(timeout_seconds=None)
        assert g.healthy_env_runner_ids() == [1]
        got = g.fetch_ready_async_reqs()  # the good result is not lost
        assert [(wid, b["timesteps"]) for wid, b in got] == [(1, 20)]
        assert g.num_in_flight_async_reqs() == 0
    finally:
        g.stop()


def test_stop_frees_every_actor(cluster, tmp_path):
    g = _group(cluster, tmp_path, "fail_stop", "ignore", "hang", sample_timeout_s=HANG_TIMEOUT_S)
    assert _round(g) == [1, 2]
    assert _round(g) == [1]  # runner 2 is stuck in step()
    t0 = time.monotonic()
    g.stop()
    # no stop call is left waiting (10 s) behind the stuck runner's sample
    assert time.monotonic() - t0 < 10.0
    alive = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("fail_stop")
    ]
    assert alive == []


def test_probe_gives_a_returning_runner_the_weights_it_missed(cluster, tmp_path):
    """RLlib's restore_env_runners: a runner back from a failure (here its env raised,
    no restarts) gets the state and the latest weights it missed while out of service."""
    import torch

    from phalanx.envs.policy import ActorCritic

    g = _group(cluster, tmp_path, "fail_resync", "ignore", "raise")
    try:
        assert _round(g) == [1, 2]
        assert _round(g) == [1]
        spaces = g.get_spaces()["__env__"]
        net = ActorCritic(*spaces)
        g.sync_weights(from_worker_or_learner_group=net, timeout_seconds=None)
        x = torch.linspace(-1, 1, 8).reshape(2, 4)

        def out(w):
            with torch.no_grad():
                return w.get_policy().value(x).tolist()

        with torch.no_grad():
            expect = net.value(x).tolist()
        stale = g.foreach_env_runner(out, remote_worker_ids=[2], healthy_only=False)[0]
        assert stale != pytest.approx(expect)  # runner 2 was out when the weights went
        assert g.probe_unhealthy_env_runners() == [2]
        for got in g.foreach_env_runner(out):
            assert got == pytest.approx(expect, rel=1e-6)
        versions = g.foreach_env_runner(lambda w: w.weights_version)
        assert versions == [g.weights_version] * 2
    finally:
        g.stop()
