"""Bad input and crash loops of env runners: each ends in a clear error.

``module:EnvId`` imports the module first; an env whose extra is not installed names the
extra; a Dict observation space fails before any runner starts; a NaN observation is
named where it enters the batch, and a runner that keeps failing stops the group after
``max_consecutive_env_runner_failures`` rounds; a ``foreach`` result that cannot be
returned is the caller's error and leaves the runner in service.
"""

from __future__ import annotations

import importlib.util
import threading

import gymnasium as gym
import numpy as np
import pytest
import ray
import torch

import phalanx as px
from phalanx.envs import EnvRunner, EnvRunnerGroup, EnvRunnerGroupConfig
from phalanx.envs.policy import ActorCritic
from tests.envs.faulty_env import make_faulty_cartpole

pytestmark = pytest.mark.timeout(240)


class DictObsEnv(gym.Env):
    observation_space = gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,), np.float32)})
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return {"pos": np.zeros(2, np.float32)}, {}

    def step(self, action):
        return {"pos": np.zeros(2, np.float32)}, 0.0, False, False, {}


def _named_actors() -> int:
    return len(ray.util.list_named_actors(all_namespaces=True))


def test_config_validates_itself_when_constructed():
    with pytest.raises(ValueError, match="num_envs_per_env_runner must be >= 1, got 0"):
        EnvRunnerGroupConfig(num_envs_per_env_runner=0)
    with pytest.raises(TypeError, match="num_env_runners must be an int, got bool"):
        EnvRunnerGroupConfig(num_env_runners=True)
    with pytest.raises(ValueError, match="max_consecutive_env_runner_failures must be >= 1"):
        EnvRunnerGroupConfig(max_consecutive_env_runner_failures=0)
    with pytest.raises(ValueError, match="sample_timeout_s must be > 0, got 0"):
        EnvRunnerGroupConfig(sample_timeout_s=0)
    assert EnvRunnerGroupConfig().max_consecutive_env_runner_failures == 3


def test_module_env_id_imports_the_module_first():
    env_id = "tests.envs.registered_env:PhalanxCountdown-v0"
    assert "PhalanxCountdown-v0" not in gym.registry
    g = EnvRunnerGroup(config={"env": env_id, "num_envs_per_env_runner": 1})
    try:
        assert g.foreach_env(lambda e: e.spec.id) == [["PhalanxCountdown-v0"]]
    finally:
        g.stop()
    with pytest.raises(ValueError, match="env: cannot import 'tests.envs.no_such_module'"):
        EnvRunnerGroup(config={"env": "tests.envs.no_such_module:X-v0"})


@pytest.mark.skipif(importlib.util.find_spec("mujoco") is not None, reason="mujoco installed")
def test_env_whose_extra_is_missing_names_the_extra():
    with pytest.raises(ValueError, match=r'Hopper-v5.*pip install "gymnasium\[mujoco\]"'):
        EnvRunnerGroup(config={"env": "Hopper-v5"})


@pytest.mark.skipif(importlib.util.find_spec("ale_py") is not None, reason="ale-py installed")
def test_atari_id_without_ale_py_names_the_extra():
    with pytest.raises(ValueError, match=r'ALE/Pong-v5.*pip install "gymnasium\[atari\]"'):
        EnvRunnerGroup(config={"env": "ALE/Pong-v5"})


def test_dict_observation_space_fails_before_any_runner_starts(cluster):
    before = _named_actors()
    with pytest.raises(ValueError, match="Dict space; the default policy .* needs a Box"):
        EnvRunnerGroup(env_creator=lambda ctx: DictObsEnv(), num_env_runners=2, cluster=cluster)
    assert _named_actors() == before


def test_nan_observation_is_named_where_it_enters_the_batch():
    cfg = EnvRunnerGroupConfig(
        env_config={"bad": [0], "at_step": 3, "mode": "nan"}, num_envs_per_env_runner=1
    )
    r = EnvRunner(cfg, env_creator=make_faulty_cartpole, worker_index=0)
    with pytest.raises(ValueError, match="non-finite observation from sub-env 0 of env runner 0"):
        r.sample(num_timesteps=10)


def test_runner_failing_every_round_stops_the_group_naming_the_cause(cluster):
    cfg = EnvRunnerGroupConfig(
        env="CartPole-v1",
        env_config={"bad": [1], "every": 2, "mode": "nan"},
        num_envs_per_env_runner=1,
        max_consecutive_env_runner_failures=2,
        env_runner_health_probe_timeout_s=120.0,
    )
    g = EnvRunnerGroup(
        env_creator=make_faulty_cartpole,
        config=cfg,
        num_env_runners=1,
        local_env_runner=False,
        cluster=cluster,
        name="nan_loop",
    )
    try:
        assert g.sample(num_timesteps=4) == []  # failed once: restarted, out until probed
        with pytest.raises(px.WorkerError) as info:
            g.sample(num_timesteps=4)
        msg = str(info.value)
        assert "env runner 1 failed 2 sample rounds in a row" in msg
        assert "max_consecutive_env_runner_failures=2" in msg
        assert "non-finite observation" in msg
        assert g.num_remote_env_runner_restarts() == 1
    finally:
        g.stop()


def test_foreach_returns_modules_and_an_unreturnable_result_is_the_callers_error(cluster):
    g = EnvRunnerGroup(
        config=EnvRunnerGroupConfig(env="CartPole-v1", num_envs_per_env_runner=1, seed=0),
        num_env_runners=1,
        cluster=cluster,
        name="module_access",
    )
    try:
        g.sync_weights(timeout_seconds=None)  # remote weights are views of a shared buffer
        modules = g.foreach_env_runner(lambda w: w.get_policy(), local_env_runner=False)
        assert [type(m) for m in modules] == [ActorCritic]
        x = torch.linspace(-1, 1, 8).reshape(2, 4)
        with torch.no_grad():
            expect = g.local_env_runner.module.value(x)
            torch.testing.assert_close(modules[0].value(x), expect)
        assert g.foreach_env_runner(lambda w: w.module is w.get_policy()) == [True, True]
        with pytest.raises(TypeError, match="result of env runner 1 cannot be returned") as info:
            g.foreach_env_runner(lambda w: threading.Lock(), local_env_runner=False)
        assert "cannot pickle" in str(info.value)
        assert g.healthy_env_runner_ids() == [1]
        assert g.num_remote_env_runner_restarts() == 0
        assert g.foreach_env_runner_async(lambda w: threading.Lock()) == 1
        with pytest.raises(TypeError, match="result of env runner 1 cannot be returned"):
            g.fetch_ready_async_reqs(timeout_seconds=None)
        assert g.healthy_env_runner_ids() == [1]
    finally:
        g.stop()
