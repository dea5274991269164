"""The overhead benchmark's one-process loop (``benchmarks/ppo_single_process.py``) and an
env runner are the same sampler: given the same seeds and weights they produce the same
batches, truncation bootstraps and normaliser included. So ``bench_ppo
--vs-single-process`` compares runtimes, not two algorithms. No Ray: the runner is built in
this process, as a local runner is."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from phalanx.algorithms.ppo import PPOConfig, build_policy, flatten_batches, ppo_update
from phalanx.envs import EnvRunner
from phalanx.envs.normalize import RunningMeanStd
from tests.helpers import benchmark_module

pytestmark = pytest.mark.timeout(120)

KEYS = ("obs", "actions", "logp", "rewards", "terminateds", "truncateds", "values",
        "final_values", "last_values", "episode_returns")  # fmt: skip


def _single_process():
    return benchmark_module("ppo_single_process")


class CountInfoReads(gym.Wrapper):
    """Puts a key in every step's info, to see whether it reaches the vector env."""

    marker_key = "marker"

    def step(self, action):
        obs, r, term, trunc, info = self.env.step(action)
        return obs, r, term, trunc, {**info, "marker": 1.0}


def test_runner_batches_equal_the_one_process_loop_across_a_truncation_and_an_update():
    seed, n = 3, 4
    # Pendulum truncates at 200 steps: the second fragment of 128 holds every truncation
    cfg = PPOConfig.for_env("Pendulum-v1", seed=seed, num_env_runners=1,
                            num_envs_per_env_runner=n, rollout_fragment_length=128)  # fmt: skip
    runner = EnvRunner(cfg.env_runner_config(), worker_index=1)
    loop = _single_process()
    env = gym.vector.SyncVectorEnv(
        [lambda: gym.make(cfg.env, disable_env_checker=True)] * n,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    torch.manual_seed(seed)
    policy = build_policy(cfg, env.single_observation_space, env.single_action_space)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps)
    norm = RunningMeanStd(env.single_observation_space.shape)
    # the runner's env seeds are seed + 1000 * worker_index + i, its noise seed + worker_index
    obs, _ = env.reset(seed=[seed + 1000 + i for i in range(n)])
    rng = np.random.default_rng(seed + 1)
    ep = {"ret": np.zeros(n)}
    truncations = 0
    for _ in range(3):
        runner.set_weights(
            {"default_policy": {k: v.clone() for k, v in policy.state_dict().items()}}
        )
        with torch.inference_mode():
            ours, obs = loop.rollout(env, policy, obs, norm, cfg, ep, rng)
        theirs = runner.sample(num_timesteps=cfg.rollout_fragment_length * n)
        for k in KEYS:
            np.testing.assert_allclose(theirs[k], ours[k], rtol=0, atol=1e-5, err_msg=k)
        truncations += int(ours["truncateds"].sum())
        assert runner.get_connector_state()["obs_norm"]["count"] == norm.count
        ppo_update(policy, optimizer, flatten_batches([ours], cfg), cfg)
    assert truncations == n  # one truncation per env in 384 steps, bootstrapped alike
    assert np.abs(ours["final_values"]).sum() == 0  # the third fragment had none
    runner.stop()
    env.close()


def test_runner_drops_step_infos_but_foreach_env_sees_the_env_as_built():
    cfg = PPOConfig.for_env("Pendulum-v1", seed=0, num_envs_per_env_runner=2)
    runner = EnvRunner(
        cfg.env_runner_config(),
        env_creator=lambda ctx: CountInfoReads(gym.make("Pendulum-v1")),
        worker_index=1,
    )
    assert runner.foreach_env(type) == [CountInfoReads, CountInfoReads]
    assert runner.foreach_env_with_context(lambda e, c: (type(e), c.vector_index)) == [
        (CountInfoReads, 0),
        (CountInfoReads, 1),
    ]
    runner.sample(num_timesteps=8)
    _, _, _, _, info = runner.env.step(np.zeros((2, 1), np.float32))
    assert info == {}  # nothing for the vector env to gather: the runner reads no info
    # the env's own attributes are still reachable through the vector env's sub-envs
    assert runner.env.envs[0].marker_key == "marker"
    runner.stop()


@pytest.mark.timeout(150)
def test_phalanx_ppo_with_one_runner_trains_on_the_one_process_loops_batches(
    cluster, tmp_path, monkeypatch
):
    """The whole driver loop (normaliser sync, weight sync, lr annealing, update count), not
    only the sampler: with one runner, phalanx's learner gets the very batches the
    one-process loop makes when that loop draws the runner's noise."""
    import phalanx.algorithms.ppo as ppo

    loop = _single_process()
    seen: dict[str, list[dict[str, torch.Tensor]]] = {"phalanx": [], "loop": []}

    def recording(name: str, update):
        def wrapped(policy, optimizer, data, cfg):
            seen[name].append({k: v.clone() for k, v in data.items()})
            return update(policy, optimizer, data, cfg)

        return wrapped

    monkeypatch.setattr(ppo, "ppo_update", recording("phalanx", ppo.ppo_update))
    monkeypatch.setattr(loop, "ppo_update", recording("loop", loop.ppo_update))
    cfg = PPOConfig.for_env("Pendulum-v1", seed=5, name="t", runs_dir=str(tmp_path),
                            num_env_runners=1, num_envs_per_env_runner=4,
                            rollout_fragment_length=64, max_timesteps=4 * 4 * 64,
                            checkpoint_every=100)  # fmt: skip
    ppo.train(cfg, cluster=cluster, progress=False)
    loop.train(cfg, noise_seed=cfg.seed + 1)
    assert len(seen["phalanx"]) == len(seen["loop"]) == 4
    for it, (ours, theirs) in enumerate(zip(seen["loop"], seen["phalanx"])):
        for k in ours:
            torch.testing.assert_close(theirs[k], ours[k], rtol=1e-5, atol=1e-5, msg=f"{it} {k}")
