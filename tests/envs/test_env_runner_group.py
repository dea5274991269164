"""EnvRunnerGroup on a real local Ray: every method of RLlib's API, weight sync, restarts."""

from __future__ import annotations

import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest
import ray
import torch

from phalanx.envs import EnvRunner, EnvRunnerGroup, EnvRunnerGroupConfig
from phalanx.envs.policy import ActorCritic

pytestmark = pytest.mark.timeout(120)

CFG = dict(env="CartPole-v1", num_envs_per_env_runner=2, seed=0, normalize_observations=True)
X = torch.linspace(-1, 1, 12).reshape(3, 4)


def _out(runner: EnvRunner, pid: str = "default_policy") -> list[float]:
    with torch.no_grad():
        return runner.get_policy(pid).value(X).tolist()


@pytest.fixture(scope="module")
def group(cluster):
    g = EnvRunnerGroup(
        config=EnvRunnerGroupConfig(**CFG), num_env_runners=2, cluster=cluster, name="erg_test"
    )
    yield g
    g.stop()


@pytest.mark.smoke
def test_counts_health_and_spaces(group):
    assert group.num_remote_workers() == group.num_remote_env_runners() == 2
    assert group.healthy_worker_ids() == [1, 2]
    assert group.num_healthy_remote_workers() == 2 and group.num_healthy_workers() == 3
    assert group.num_remote_worker_restarts() == 0
    assert group.local_env_runner is not None and group.local_env_runner.worker_index == 0
    spaces = group.get_spaces()
    assert spaces["__env__"][1] == gym.spaces.Discrete(2)
    assert spaces["default_policy"][0].shape == (4,)
    assert group.probe_unhealthy_workers(timeout_seconds=5) == []


@pytest.mark.smoke
def test_foreach_worker_variants(group):
    assert group.foreach_worker(lambda w: w.worker_index) == [0, 1, 2]
    assert group.foreach_worker(lambda w: w.worker_index, local_env_runner=False) == [1, 2]
    assert group.foreach_worker(
        lambda w: w.worker_index, remote_worker_ids=[2], local_env_runner=False
    ) == [2]
    assert group.foreach_worker("policy_ids") == [["default_policy"]] * 3
    assert group.foreach_worker_with_id(lambda i, w: (i, w.worker_index)) == [
        (0, 0),
        (1, 1),
        (2, 2),
    ]
    refs = group.foreach_worker(
        lambda w: w.worker_index, return_obj_refs=True, local_env_runner=False
    )
    assert sorted(ray.get(refs)) == [1, 2]
    with pytest.raises(ValueError, match="return_obj_refs: the local runner"):
        group.foreach_worker(lambda w: w.worker_index, return_obj_refs=True)
    with pytest.raises(ValueError, match="remote_worker_ids"):
        group.foreach_worker(lambda w: 1, remote_worker_ids=[0])


def test_async_requests(group):
    assert group.foreach_worker_async(lambda w: (time.sleep(0.3), w.worker_index)[1], tag="t") == 2
    # one request per runner in flight at most (max_requests_in_flight_per_env_runner=1)
    assert group.foreach_worker_async(lambda w: 0, tag="t") == 0
    assert group.num_in_flight_async_reqs() == 2
    got: list = []
    deadline = time.monotonic() + 30
    while len(got) < 2 and time.monotonic() < deadline:
        got += group.fetch_ready_async_reqs(tags="t", timeout_seconds=1.0)
    assert sorted(got) == [(1, 1), (2, 2)]
    assert group.num_in_flight_async_reqs() == 0


def test_foreach_env_and_context(group):
    assert group.foreach_env(lambda e: e.spec.id) == [["CartPole-v1"] * 2] * 3
    ctx = group.foreach_env_with_context(lambda e, c: (c.worker_index, c.vector_index, c.remote))
    assert ctx == [
        [(0, 0, False), (0, 1, False)],
        [(1, 0, True), (1, 1, True)],
        [(2, 0, True), (2, 1, True)],
    ]


def test_sample_counts(group):
    batches = group.sample(num_timesteps=10)
    assert [b["timesteps"] for b in batches] == [10, 10]
    assert sorted(b["worker_index"] for b in batches) == [1, 2]
    eps = group.sample(num_episodes=3)
    assert [len(b["episode_returns"]) for b in eps] == [3, 3]
    assert all(b["timesteps"] == b["episode_lengths"].sum() for b in eps)


@pytest.mark.smoke
def test_sync_weights_reaches_every_runner(group):
    local = group.local_env_runner
    with torch.no_grad():
        for p in local.get_policy().parameters():
            p.add_(0.5)
    before = group.foreach_worker(lambda w: _out(w), local_env_runner=False)
    assert all(b != _out(local) for b in before)
    res = group.sync_weights(timeout_seconds=None)
    assert sorted(res.applied) == [0, 1]
    after = group.foreach_worker(lambda w: _out(w))
    for a in after:
        np.testing.assert_allclose(a, _out(local), rtol=1e-6)
    versions = group.foreach_worker(lambda w: w.weights_version)
    assert versions == [group.weights_version] * 3
    # from a module, to one runner only
    net = ActorCritic(local.observation_space, local.action_space)
    group.sync_weights(
        from_worker_or_learner_group=net, to_worker_indices=[2], timeout_seconds=None
    )
    outs = group.foreach_worker(lambda w: _out(w))
    expect = net.value(X).tolist()
    np.testing.assert_allclose(outs[2], expect, rtol=1e-6)
    np.testing.assert_allclose(outs[0], expect, rtol=1e-6)  # the local runner follows the source
    assert not np.allclose(outs[1], expect)
    # fire-and-forget (RLlib's default timeout 0) completes on the next sync
    assert group.sync_weights(global_vars={"timestep": 7}) is None
    group.sync_weights(timeout_seconds=None)
    assert (
        group.foreach_worker(lambda w: w.global_vars, local_env_runner=False)
        == [{"timestep": 7}] * 2
    )
    with pytest.raises(ValueError, match="to_worker_indices"):
        group.sync_weights(to_worker_indices=[3])


def test_sync_env_runner_states_merges(group):
    group.sample(num_timesteps=20)
    deltas = group.foreach_worker(lambda w: w.get_connector_state()["obs_norm_delta"]["count"])
    before = group.get_connector_state()
    base = before["obs_norm"]["count"] if before else 1e-4
    merged = group.sync_env_runner_states()
    assert merged["obs_norm"]["count"] == pytest.approx(base + sum(deltas))
    means = group.foreach_worker(lambda w: w.get_connector_state()["obs_norm"]["mean"].tolist())
    for m in means:
        np.testing.assert_allclose(m, merged["obs_norm"]["mean"])
    assert group.foreach_worker(lambda w: w.get_connector_state()["obs_norm_delta"]["count"]) == [
        0,
        0,
        0,
    ]


def test_policies(group):
    group.add_policy("p2", ActorCritic, config={"hidden": (16,)}, policies_to_train=["p2"])
    assert group.foreach_worker("policy_ids") == [["default_policy", "p2"]] * 3
    assert group.foreach_policy(lambda p, pid: pid) == ["default_policy", "p2"] * 3
    assert group.foreach_policy_to_train(lambda p, pid: pid) == ["p2"] * 3
    assert group.is_policy_to_train("p2") and not group.is_policy_to_train("default_policy")
    # every runner starts p2 from the local runner's weights
    outs = group.foreach_worker(lambda w: _out(w, "p2"))
    for o in outs:
        np.testing.assert_allclose(o, outs[0], rtol=1e-6)
    assert "p2" in group.get_spaces()


def test_killed_runner_is_restarted_and_resynced(group):
    group.sync_weights(timeout_seconds=None)
    group.sample(num_timesteps=8)
    norm = group.sync_env_runner_states()
    pid = group.foreach_worker(
        lambda w: os.getpid(), remote_worker_ids=[1], local_env_runner=False
    )[0]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    back: list[int] = []
    while time.monotonic() < deadline and 1 not in back:
        back += group.probe_unhealthy_workers(timeout_seconds=10)
        time.sleep(0.2)
    assert 1 in back
    assert group.num_remote_worker_restarts() >= 1
    assert group.healthy_worker_ids() == [1, 2]
    new_pid = group.foreach_worker(
        lambda w: os.getpid(), remote_worker_ids=[1], local_env_runner=False
    )[0]
    assert new_pid != pid
    # latest weights, extra policies and the merged normaliser came back with it
    np.testing.assert_allclose(
        group.foreach_worker(lambda w: _out(w), remote_worker_ids=[1], local_env_runner=False)[0],
        _out(group.local_env_runner),
        rtol=1e-6,
    )
    st = group.foreach_worker(
        lambda w: w.get_connector_state()["obs_norm"], remote_worker_ids=[1], local_env_runner=False
    )[0]
    np.testing.assert_allclose(st["mean"], norm["obs_norm"]["mean"])
    assert group.foreach_worker("policy_ids", remote_worker_ids=[1], local_env_runner=False)[0] == [
        "default_policy",
        "p2",
    ]
    assert [b["timesteps"] for b in group.sample(num_timesteps=4)] == [4, 4]


def test_add_workers_reset_and_stop(cluster):
    g = EnvRunnerGroup(
        config=EnvRunnerGroupConfig(**{**CFG, "num_envs_per_env_runner": 1}),
        num_env_runners=1,
        local_env_runner=False,
        cluster=cluster,
    )
    try:
        assert g.local_env_runner is None and g.num_remote_workers() == 1
        g.add_workers(1)
        assert g.num_remote_workers() == 2 and g.healthy_worker_ids() == [1, 2]
        w = g.foreach_worker(lambda r: _out(r))
        np.testing.assert_allclose(w[0], w[1], rtol=1e-6)  # the new group got the old weights
        other = EnvRunner.create_group(
            EnvRunnerGroupConfig(**{**CFG, "num_envs_per_env_runner": 3})
        ).launch(cluster, placement=__import__("phalanx").NodePlacement(num_workers=1))
        g.reset(other)
        assert g.num_remote_workers() == 1
        assert g.foreach_worker(lambda r: r.env.num_envs) == [3]
        with pytest.raises(TypeError, match="phalanx WorkerGroup"):
            g.reset([object()])
    finally:
        g.stop()
    assert g.num_remote_workers() == 0


def test_bad_input_fails_before_workers_start(cluster):
    before = len(ray.util.list_named_actors(all_namespaces=True))
    with pytest.raises(ValueError, match="env: unknown gymnasium env id"):
        EnvRunnerGroup(config={"env": "NoSuchEnv-v9"}, num_env_runners=2, cluster=cluster)
    with pytest.raises(ValueError, match="num_env_runners=0 with local_env_runner=False"):
        EnvRunnerGroup(
            config=EnvRunnerGroupConfig(env="CartPole-v1"), local_env_runner=False, cluster=cluster
        )

    def creator(ctx):  # runner 2 builds a different env
        return gym.make("CartPole-v1" if ctx.worker_index < 2 else "Acrobot-v1")

    with pytest.raises(ValueError, match="spaces mismatch between env runners: worker_index 0"):
        EnvRunnerGroup(env_creator=creator, num_env_runners=2, cluster=cluster)
    checked = []

    def validate_env(env):
        checked.append(env.spec.id)
        raise ValueError("validate_env rejects this env")

    with pytest.raises(ValueError, match="validate_env rejects"):
        EnvRunnerGroup(
            config={"env": "CartPole-v1"},
            validate_env=validate_env,
            num_env_runners=1,
            cluster=cluster,
        )
    assert checked == ["CartPole-v1"]
    with pytest.raises(ValueError, match="max_num_env_runner_restarts"):
        EnvRunnerGroup(
            config={"env": "CartPole-v1", "max_num_env_runner_restarts": -1}, cluster=cluster
        )
    assert len(ray.util.list_named_actors(all_namespaces=True)) == before
