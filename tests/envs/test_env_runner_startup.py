"""Env runners killed while the group starts, and weight sync through same-node views.

Start-up: a remote runner whose process is killed inside ``__init__`` is
started again by the restart policy; each such restart counts in
``num_remote_env_runner_restarts()`` as soon as the group exists, the launch waits for
the restarted runner beyond its first deadline, and a runner that keeps dying fails the
launch with an error naming the group, the rank and the restarts used. The kills come
from inside the runner's env creator on a fixed schedule (one marker file per
incarnation), so the counts are exact.

Weights: ``sync_weights`` uses the ``auto`` transport, so runners on this
node (``read_only_weights``) get views of the sender's shared buffer; a runner restarted
after a kill gets the current weights back.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
import torch

import phalanx as px
from phalanx.envs import EnvRunner, EnvRunnerGroup, EnvRunnerGroupConfig
from phalanx.envs.policy import ActorCritic
from phalanx.group.fault import STARTUP_RESTART, WorkerHealth
from tests.envs.faulty_env import make_cartpole_dying_in_init
from tests.helpers import until

pytestmark = pytest.mark.timeout(300)

X = torch.linspace(-1, 1, 12).reshape(3, 4)


def _config(tmp_path, deaths, gates=None, **extra) -> EnvRunnerGroupConfig:
    env_config = {"driver_pid": os.getpid(), "deaths": deaths, "marks": str(tmp_path)}
    if gates is not None:
        env_config["gates"] = gates
    return EnvRunnerGroupConfig(
        env_config=env_config,
        num_envs_per_env_runner=1,
        seed=0,
        env_runner_health_probe_timeout_s=120.0,
        **extra,
    )


def _inits(tmp_path, wi: int) -> int:
    return len(list(tmp_path.glob(f"init_{wi}_*")))


def _names(prefix: str) -> list[str]:
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"{prefix}:")
    )


def test_runners_killed_in_init_are_restarted_and_counted(cluster, tmp_path):
    g = EnvRunnerGroup(
        env_creator=make_cartpole_dying_in_init,
        config=_config(tmp_path, {1: 2, 2: 1}),
        num_env_runners=2,
        local_env_runner=False,
        cluster=cluster,
        name="startup_kills",
    )
    try:
        assert (_inits(tmp_path, 1), _inits(tmp_path, 2)) == (3, 2)
        # 2 + 1 restarts in start-up, counted as soon as the group exists
        assert g.num_remote_env_runner_restarts() == 3
        assert g.num_remote_worker_restarts() == 3
        assert g.remote_group.num_remote_worker_restarts() == 3
        events = [(e.rank, e.new) for e in g.remote_group.health_events()]
        assert sorted(events) == [(0, WorkerHealth.HEALTHY)] * 2 + [(1, WorkerHealth.HEALTHY)]
        assert {e.reason for e in g.remote_group.health_events()} == {STARTUP_RESTART}
        assert g.healthy_env_runner_ids() == [1, 2]
        # no probe brings them back a second time: the count stays
        assert g.probe_unhealthy_env_runners() == []
        assert sorted(b["worker_index"] for b in g.sample(num_timesteps=5)) == [1, 2]
        assert g.num_remote_env_runner_restarts() == 3
    finally:
        g.stop()


def test_runner_dying_in_every_init_fails_the_launch_naming_it(cluster, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(px.WorkerDiedError) as info:
        EnvRunnerGroup(
            env_creator=make_cartpole_dying_in_init,
            config=_config(tmp_path, {2: 99}, max_num_env_runner_restarts=2),
            num_env_runners=2,
            local_env_runner=False,
            cluster=cluster,
            name="startup_doomed",
        )
    assert info.value.group == "startup_doomed" and info.value.rank == 1
    assert info.value.method == "__init__"
    assert "after 2 start-up restart(s), no restart left" in str(info.value)
    assert _inits(tmp_path, 2) == 3  # the first start and its 2 restarts
    assert time.monotonic() - t0 < 240
    assert until(lambda: _names("startup_doomed") == [], 20)


def test_start_up_restart_extends_the_launch_wait(cluster, tmp_path):
    """Launch timeout T: runner 2's first incarnation waits in ``__init__`` until 0.75 T
    and dies; its second waits until 1.25 T. Past the first deadline, the launch waits on
    because the restart gave the rank a new one."""
    T = 20.0
    gates = [str(tmp_path / "gate_1"), str(tmp_path / "gate_2")]
    cfg = _config(tmp_path, {2: 1}, gates={2: gates})
    t0 = time.monotonic()
    timers = [
        threading.Timer(0.75 * T, lambda: open(gates[0], "w").close()),
        threading.Timer(1.25 * T, lambda: open(gates[1], "w").close()),
    ]
    for t in timers:
        t.start()
    remote = EnvRunner.create_group(cfg, make_cartpole_dying_in_init).launch(
        cluster,
        px.NodePlacement(num_workers=2),
        "startup_slow",
        timeout_s=T,
        restart_policy=px.RestartPolicy(max_restarts_per_worker=3),
    )
    waited = time.monotonic() - t0
    g = EnvRunnerGroup(
        env_creator=make_cartpole_dying_in_init,
        config=cfg,
        num_env_runners=2,
        local_env_runner=False,
        _setup=False,
    )
    try:
        assert waited > 1.25 * T - 1.0  # it waited for the second incarnation
        assert _inits(tmp_path, 2) == 2
        g.reset(remote)  # adopting a launched group counts its start-up restarts too
        assert g.num_remote_env_runner_restarts() == 1
        assert sorted(b["worker_index"] for b in g.sample(num_timesteps=5)) == [1, 2]
    finally:
        for t in timers:
            t.cancel()
        g.stop()


def _out(runner: EnvRunner) -> list[float]:
    with torch.no_grad():
        return runner.get_policy().value(X).tolist()


def test_sync_weights_gives_local_runners_views_and_restores_after_a_kill(cluster):
    cfg = EnvRunnerGroupConfig(env="CartPole-v1", num_envs_per_env_runner=1, seed=0)
    g = EnvRunnerGroup(
        config=cfg, num_env_runners=2, local_env_runner=False, cluster=cluster, name="views"
    )
    try:
        learner = ActorCritic(*g.get_spaces()["__env__"])
        with torch.no_grad():
            expect = learner.value(X).tolist()
        res = g.sync_weights(from_worker_or_learner_group=learner, timeout_seconds=None)
        assert res.applied == [0, 1] and res.failed == {}
        assert res.routes == {0: "shm_view", 1: "shm_view"}
        for got in g.foreach_env_runner(_out):
            assert got == pytest.approx(expect, rel=1e-6)
        assert g.foreach_env_runner(lambda w: w.weights_version) == [g.weights_version] * 2

        # runner 1 is killed; while it is out the learner moves on and syncs runner 2
        pid = g.foreach_env_runner(lambda w: os.getpid(), remote_worker_ids=[1])[0]
        os.kill(pid, signal.SIGKILL)
        assert until(lambda: g.remote_group.health()[0] != WorkerHealth.HEALTHY)
        with torch.no_grad():
            for p in learner.parameters():
                p.mul_(0.5).add_(0.25)
            expect = learner.value(X).tolist()
        res = g.sync_weights(from_worker_or_learner_group=learner, timeout_seconds=None)
        assert res.applied == [1] and res.routes == {1: "shm_view"}
        back: list[int] = []
        assert until(lambda: back.extend(g.probe_unhealthy_env_runners()) or 1 in back, 120)
        assert g.healthy_env_runner_ids() == [1, 2]
        assert g.foreach_env_runner(lambda w: os.getpid(), remote_worker_ids=[1])[0] != pid
        # the restarted runner has the current weights and version
        for got in g.foreach_env_runner(_out):
            assert got == pytest.approx(expect, rel=1e-6)
        assert g.foreach_env_runner(lambda w: w.weights_version) == [g.weights_version] * 2
        # and takes the view route again on the next sync
        res = g.sync_weights(from_worker_or_learner_group=learner, timeout_seconds=None)
        assert res.routes == {0: "shm_view", 1: "shm_view"}
    finally:
        g.stop()
