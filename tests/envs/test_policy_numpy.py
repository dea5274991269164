"""ActorCritic.act_numpy (the runners' forward) against ActorCritic.act/evaluate (torch)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from phalanx.envs import EnvRunner, EnvRunnerGroupConfig
from phalanx.envs.normalize import batch_moments
from phalanx.envs.policy import ActorCritic

pytestmark = pytest.mark.timeout(60)

BOX = gym.spaces.Box(-1.0, 1.0, (5,), np.float32)
CONT = gym.spaces.Box(-2.0, 2.0, (3,), np.float32)
DISC = gym.spaces.Discrete(4)


def _policy(action_space, activation="tanh") -> ActorCritic:
    torch.manual_seed(0)
    p = ActorCritic(BOX, action_space, hidden=(16, 8), activation=activation, init_log_std=-0.5)
    with torch.no_grad():  # non-trivial outputs: the default init makes the actor ~0
        for m in p.actor:
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0, 1)
    return p


@pytest.mark.parametrize("space", [CONT, DISC], ids=["box", "discrete"])
@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_numpy_forward_equals_torch(space, activation):
    p = _policy(space, activation)
    obs = np.random.default_rng(1).normal(size=(64, 5)).astype(np.float32)
    rng = np.random.default_rng(2)
    with torch.inference_mode():
        greedy, logp_g, v = p.act_numpy(obs, False, rng)
        t_greedy, t_logp_g, t_v = p.act(torch.from_numpy(obs), explore=False)
        np.testing.assert_allclose(greedy, t_greedy.numpy(), atol=1e-5)
        np.testing.assert_allclose(logp_g, t_logp_g.numpy(), atol=1e-4)
        np.testing.assert_allclose(v, t_v.numpy(), atol=1e-5)
        a, logp, v2 = p.act_numpy(obs, True, rng)
        e_logp, _, e_v = p.evaluate(torch.from_numpy(obs), torch.from_numpy(np.asarray(a)))
    assert a.shape == (64, *space.shape) and logp.shape == v2.shape == (64,)
    assert logp.dtype == np.float32 and v2.dtype == np.float32
    np.testing.assert_allclose(logp, e_logp.numpy(), atol=1e-4)
    np.testing.assert_allclose(v2, e_v.numpy(), atol=1e-5)


def test_numpy_samples_follow_the_policys_distribution():
    obs = np.zeros((20000, 5), np.float32)
    rng = np.random.default_rng(3)
    p = _policy(CONT)
    a, _, _ = p.act_numpy(obs, True, rng)
    mean, _, _ = p.act_numpy(obs[:1], False, rng)
    z = (a - mean) / np.exp(p.log_std.detach().numpy())
    np.testing.assert_allclose(z.mean(0), 0, atol=0.03)
    np.testing.assert_allclose(z.std(0), 1, atol=0.03)
    d = _policy(DISC)
    with torch.no_grad():
        probs = torch.softmax(d.actor(torch.from_numpy(obs[:1])), -1).numpy()[0]
    a, _, _ = d.act_numpy(obs, True, rng)
    freq = np.bincount(a, minlength=4) / len(a)
    np.testing.assert_allclose(freq, probs, atol=0.015)


def test_numpy_forward_follows_weight_changes_in_place_and_by_rebinding():
    p = _policy(CONT)
    obs = np.ones((2, 5), np.float32)
    rng = np.random.default_rng(0)
    before = p.act_numpy(obs, False, rng)[0]
    with torch.no_grad():
        p.actor[0].bias.add_(1.0)  # in place: same storage
    in_place = p.act_numpy(obs, False, rng)[0]
    assert not np.allclose(in_place, before)
    np.testing.assert_allclose(in_place, p(torch.from_numpy(obs)).detach().numpy(), atol=1e-5)
    p.actor[4].weight.data = torch.zeros_like(p.actor[4].weight)  # a new storage
    p.actor[4].bias.data = torch.full_like(p.actor[4].bias, 0.25)
    np.testing.assert_allclose(p.act_numpy(obs, False, rng)[0], 0.25)
    p.double()
    assert p.act_numpy(obs, False, rng) is None  # not float32: the runner calls act


class ConstantPolicy(ActorCritic):
    """Overrides ``act``: the runner must call it, not the inherited numpy forward."""

    def act(self, obs, explore=True):
        n = obs.shape[0]
        return torch.full((n,), 1, dtype=torch.int64), torch.zeros(n), torch.zeros(n)


def test_runner_uses_the_numpy_forward_unless_act_is_overridden():
    cfg = EnvRunnerGroupConfig(env="CartPole-v1", num_envs_per_env_runner=2, seed=0)
    runner = EnvRunner(cfg, worker_index=1)
    b = runner.sample(num_timesteps=200)
    pol = runner.get_policy()
    with torch.no_grad():
        logp, _, v = pol.evaluate(
            torch.from_numpy(b["obs"].reshape(-1, 4)), torch.from_numpy(b["actions"].reshape(-1))
        )
    np.testing.assert_allclose(b["logp"].reshape(-1), logp.numpy(), atol=1e-5)
    np.testing.assert_allclose(b["values"].reshape(-1), v.numpy(), atol=1e-5)
    assert set(np.unique(b["actions"])) == {0, 1}
    runner.stop()
    custom = EnvRunner(cfg, worker_index=1, default_policy_class=ConstantPolicy)
    b = custom.sample(num_timesteps=20)
    assert (b["actions"] == 1).all() and (b["logp"] == 0).all()
    custom.stop()


def test_runners_with_one_seed_sample_the_same_actions():
    cfg = EnvRunnerGroupConfig(env="CartPole-v1", num_envs_per_env_runner=2, seed=7)
    a, b = EnvRunner(cfg, worker_index=1), EnvRunner(cfg, worker_index=1)
    np.testing.assert_array_equal(
        a.sample(num_timesteps=100)["actions"], b.sample(num_timesteps=100)["actions"]
    )


def test_batch_moments_equal_numpys():
    x = np.random.default_rng(0).normal(3.0, 2.0, size=(7, 4))
    mean, var, n = batch_moments(x)
    np.testing.assert_allclose(mean, x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(var, x.var(0), rtol=1e-12)
    assert n == 7.0
