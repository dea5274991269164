"""Hot standby env runners (``num_standby_env_runners``) and RLlib's keywords of
``sync_env_runner_states``, on a real local Ray."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch

from phalanx.envs import EnvRunnerGroup, EnvRunnerGroupConfig
from phalanx.envs.policy import ActorCritic
from tests.helpers import until

pytestmark = pytest.mark.timeout(180)

CFG = dict(
    env="CartPole-v1",
    num_envs_per_env_runner=2,
    seed=0,
    normalize_observations=True,
    num_standby_env_runners=1,
    env_runner_health_probe_timeout_s=60.0,
)


@pytest.fixture(scope="module")
def group(cluster):
    g = EnvRunnerGroup(
        config=EnvRunnerGroupConfig(**CFG),
        num_env_runners=2,
        local_env_runner=False,
        cluster=cluster,
        name="erg_standby",
    )
    yield g
    g.stop()


def _module(seed: int) -> ActorCritic:
    torch.manual_seed(seed)
    env = gym.make("CartPole-v1")
    return ActorCritic(env.observation_space, env.action_space)


def test_standby_is_started_but_not_a_runner(group):
    assert group.num_remote_env_runners() == 2
    assert group.num_standby_env_runners() == 1
    assert group.remote_group.world_size == 3
    assert group.healthy_env_runner_ids() == [1, 2]
    assert group.foreach_env_runner(lambda w: w.worker_index) == [1, 2]
    assert sorted(b["worker_index"] for b in group.sample(num_timesteps=8)) == [1, 2]
    # the standby gets every weight sync
    group.sync_weights(from_worker_or_learner_group=_module(1), timeout_seconds=None)
    versions = group.remote_group.foreach_actor(lambda w: w.weights_version)
    assert sorted(r.get() for r in versions) == [group.weights_version] * 3


def test_killed_runner_is_served_by_the_standby(group):
    group.sync_weights(from_worker_or_learner_group=_module(2), timeout_seconds=None)
    version = group.weights_version
    group.sample(num_timesteps=8)
    norm = group.sync_env_runner_states()
    pid, standby_pid = (
        group.foreach_env_runner(lambda w: os.getpid(), remote_worker_ids=[1])[0],
        next(
            iter(group.remote_group.foreach_actor(lambda w: os.getpid(), remote_actor_ids=[2]))
        ).get(),
    )
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    assert until(lambda: 1 in group.probe_unhealthy_workers(timeout_seconds=1e-3), 30)
    took = time.monotonic() - t0
    assert group.num_standby_takeovers == 1
    assert group.healthy_env_runner_ids() == [1, 2]
    got = group.foreach_env_runner(
        lambda w: (os.getpid(), w.worker_index, w.weights_version, w.get_connector_state()),
        remote_worker_ids=[1],
    )[0]
    assert got[:3] == (standby_pid, 1, version)
    np.testing.assert_allclose(got[3]["obs_norm"]["mean"], norm["obs_norm"]["mean"])
    assert got[3]["obs_norm"]["count"] == norm["obs_norm"]["count"]
    # the killed runner's process is restarted and refills the standby pool
    assert until(
        lambda: (
            group.probe_unhealthy_workers(timeout_seconds=1.0) is not None
            and group.num_healthy_standby_env_runners() == 1
        ),
        120,
    )
    assert group.num_standby_env_runners() == 1
    assert sorted(b["worker_index"] for b in group.sample(num_timesteps=8)) == [1, 2]
    print(f"kill -> runner 1 back in service via the standby: {took:.3f} s")


def test_sync_env_runner_states_rllib_keywords(group):
    group.sample(num_timesteps=8)
    # rl_module_state: weights sent to the chosen runners; env_steps_sampled to every runner
    m = _module(3)
    state = {k: v.numpy() for k, v in m.state_dict().items()}
    group.sync_env_runner_states(
        rl_module_state={"rl_module": {"default_policy": state}},
        env_steps_sampled=1234,
        env_runner_indices_to_update=[2],
    )
    w = group.foreach_env_runner(
        lambda r: (r.num_env_steps_sampled, r.get_weights()["default_policy"]["critic.0.weight"])
    )
    assert w[0][0] != 1234 and w[1][0] == 1234
    np.testing.assert_array_equal(w[1][1], state["critic.0.weight"])
    assert not np.array_equal(w[0][1], state["critic.0.weight"])
    assert group.num_env_steps_sampled == 1234
    # an RLlib config that neither merges nor broadcasts leaves the runners alone
    before = group.foreach_env_runner(lambda r: r.get_connector_state()["obs_norm_delta"]["count"])
    off = SimpleNamespace(merge_env_runner_states=False, broadcast_env_runner_states=False)
    assert group.sync_env_runner_states(config=off) == {}
    after = group.foreach_env_runner(lambda r: r.get_connector_state()["obs_norm_delta"]["count"])
    assert after == before
    merged = group.sync_env_runner_states(
        config=SimpleNamespace(merge_env_runner_states="training_only", in_evaluation=False)
    )
    assert merged["obs_norm"]["count"] > 0


def test_sync_env_runner_states_bad_keywords(group):
    with pytest.raises(ValueError, match="env_to_module: phalanx env runners have no connector"):
        group.sync_env_runner_states(env_to_module=object())
    with pytest.raises(ValueError, match="module_to_env"):
        group.sync_env_runner_states(module_to_env=object())
    with pytest.raises(TypeError, match="config.merge_env_runner_states must be a bool"):
        group.sync_env_runner_states(config=SimpleNamespace(merge_env_runner_states="yes"))
    with pytest.raises(TypeError, match="rl_module_state must be a dict"):
        group.sync_env_runner_states(rl_module_state=[1])
    with pytest.raises(ValueError, match="env_runner_indices_to_update"):
        group.sync_env_runner_states(env_runner_indices_to_update=[3])
    with pytest.raises(TypeError, match="unexpected keyword argument 'from_worker_or_learner"):
        group.sync_env_runner_states(from_worker_or_learner_group=None)


def test_standby_config_checks():
    with pytest.raises(ValueError, match="num_standby_env_runners must be >= 0"):
        EnvRunnerGroupConfig(num_standby_env_runners=-1)
    with pytest.raises(TypeError, match="num_standby_env_runners must be an int"):
        EnvRunnerGroupConfig(num_standby_env_runners=True)
    with pytest.raises(ValueError, match="num_standby_env_runners=1 needs num_env_runners >= 1"):
        EnvRunnerGroup(config={"env": "CartPole-v1", "num_standby_env_runners": 1})
