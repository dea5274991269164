"""The continuous-control task (HalfCheetah-v5, ``pip install "gymnasium[mujoco]"``): its
spaces reach the runners, Box actions are clipped as documented, PPO runs on it, async
sampling keeps its policy lag bound, and the sampling benchmark counts the same steps on
both of its paths."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from phalanx.envs import EnvRunner, EnvRunnerGroup, EnvRunnerGroupConfig
from tests.helpers import benchmark_module

pytest.importorskip("mujoco", reason='needs the mujoco extra: pip install "gymnasium[mujoco]"')
pytestmark = pytest.mark.timeout(180)

ENV = "HalfCheetah-v5"


class RecordActions(gym.ActionWrapper):
    """Keeps every action the env itself receives."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.seen: list[np.ndarray] = []

    def action(self, action: np.ndarray) -> np.ndarray:
        self.seen.append(np.array(action))
        return action


def _recording_cheetah(ctx) -> gym.Env:
    return RecordActions(gym.make(ENV, disable_env_checker=True))


def test_box_spaces_reach_the_runners(cluster):
    g = EnvRunnerGroup(
        config=EnvRunnerGroupConfig(env=ENV, num_envs_per_env_runner=2, seed=0),
        num_env_runners=1,
        local_env_runner=False,
        cluster=cluster,
        name="erg_cheetah",
    )
    try:
        obs, act = g.get_spaces()["__env__"]
        assert obs == gym.spaces.Box(-np.inf, np.inf, (17,), np.float64)
        assert act == gym.spaces.Box(-1.0, 1.0, (6,), np.float32)
        (batch,) = g.sample(num_timesteps=20)
        assert batch["obs"].shape == (10, 2, 17) and batch["obs"].dtype == np.float32
        assert batch["actions"].shape == (10, 2, 6) and batch["actions"].dtype == np.float32
        assert batch["timesteps"] == 20
    finally:
        g.stop()


def test_box_actions_are_clipped_for_the_env_and_kept_raw_in_the_batch():
    # std e^1.5 ~ 4.5: most sampled actions lie outside [-1, 1]
    cfg = EnvRunnerGroupConfig(
        num_envs_per_env_runner=1, seed=0, policy_config={"init_log_std": 1.5}
    )
    runner = EnvRunner(cfg, env_creator=_recording_cheetah, worker_index=0)
    batch = runner.sample(num_timesteps=50)
    raw = batch["actions"].reshape(50, 6)
    seen = np.stack(runner.env.envs[0].seen)
    assert np.abs(raw).max() > 1.0
    np.testing.assert_array_equal(seen, np.clip(raw, -1.0, 1.0))
    # the log-probabilities are those of the raw (unclipped) actions
    import torch

    logp, _, _ = runner.module.evaluate(
        torch.from_numpy(batch["obs"].reshape(50, 17)), torch.from_numpy(raw)
    )
    np.testing.assert_allclose(logp.detach().numpy(), batch["logp"].reshape(50), rtol=1e-5)
    runner.stop()


def _bench_sampling():
    return benchmark_module("bench_sampling")


def test_sampling_benchmark_paths_take_the_same_steps(cluster):
    bench = _bench_sampling()
    single, _ = bench.single_process("sync", ENV, 4, 16)
    ours, _ = bench.phalanx_group(ENV, 2, 4, 16, cluster)
    assert single == ours == 64


def _ppo_cfg(tmp_path, **kw):
    from phalanx.algorithms.ppo import PPOConfig

    base = dict(
        name="t",
        runs_dir=str(tmp_path),
        num_env_runners=1,
        num_envs_per_env_runner=2,
        rollout_fragment_length=64,
        minibatch_size=64,
        update_epochs=2,
        normalize_observations=True,
        max_timesteps=384,
        checkpoint_every=100,
    )
    return PPOConfig.for_env(ENV, **{**base, **kw})


def test_ppo_iterations_write_metrics(cluster, tmp_path):
    from phalanx.algorithms.ppo import train
    from phalanx.observe.metrics import read_metrics

    out = train(_ppo_cfg(tmp_path), cluster=cluster, progress=False)
    rows = read_metrics(tmp_path / "t")
    assert out["timesteps"] == 384 and out["iterations"] == 3
    assert [r["timesteps"] for r in rows] == [128, 256, 384]
    assert all(np.isfinite(r["loss/policy"]) and np.isfinite(r["loss/value"]) for r in rows)
    assert (tmp_path / "t" / "checkpoints" / "step_3" / "learner.pt").exists()


def test_async_sampling_lag_stays_within_one_version(cluster, tmp_path):
    """``--async``: a round samples while the learner trains on the previous one, so its
    batch was sampled with weights at most one version behind the learner's."""
    from phalanx.algorithms.ppo import train
    from phalanx.observe.metrics import read_metrics

    cfg = _ppo_cfg(tmp_path, num_env_runners=2, max_timesteps=1024, async_sampling=True)
    train(cfg, cluster=cluster, progress=False)
    rows = read_metrics(tmp_path / "t")
    lags = [r["policy_lag"] for r in rows]
    assert len(rows) == 4 and lags[0] == 0
    assert all(0 <= lag <= 1 for lag in lags), lags
    versions = [r["weights_version"] for r in rows]
    assert versions == sorted(versions)


def test_tuned_defaults_and_standby_option():
    from phalanx.algorithms.ppo import TUNED, PPOConfig

    cfg = PPOConfig.for_env(ENV, num_standby_env_runners=1)
    cfg.validate()
    assert cfg.batch_size == 2048 and cfg.minibatch_size == 64 and cfg.update_epochs == 10
    assert (cfg.stop_return, cfg.max_timesteps) == (TUNED[ENV]["stop_return"], 1_000_000)
    assert cfg.normalize_observations
    assert cfg.env_runner_config().num_standby_env_runners == 1
    with pytest.raises(ValueError, match="num_standby_env_runners must be >= 0, got -1"):
        PPOConfig.for_env(ENV, num_standby_env_runners=-1).validate()
