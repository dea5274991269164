"""EnvRunner on its own (no Ray): exact sample counts, truncation bootstrap, normaliser, state."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from phalanx.envs import EnvContext, EnvRunner, EnvRunnerGroupConfig, RunningMeanStd
from phalanx.envs.policy import ActorCritic

pytestmark = pytest.mark.timeout(60)


class CountEnv(gym.Env):
    """obs = [steps so far in the episode, episode id]; truncated after ``limit`` steps,
    terminated at step ``term_at`` (if given). Reward 1 per step."""

    def __init__(self, limit: int = 3, term_at: int | None = None):
        self.observation_space = gym.spaces.Box(-100, 100, (2,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.limit, self.term_at = limit, term_at
        self.t, self.episode = 0, -1

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.episode += 1
        return np.array([0, self.episode], np.float32), {}

    def step(self, action):
        self.t += 1
        obs = np.array([self.t, self.episode], np.float32)
        term = self.term_at is not None and self.t >= self.term_at
        trunc = not term and self.t >= self.limit
        return obs, 1.0, term, trunc, {}


def _runner(n=2, **kw) -> EnvRunner:
    cfg = EnvRunnerGroupConfig(env="CartPole-v1", num_envs_per_env_runner=n, seed=0, **kw)
    return EnvRunner(cfg, worker_index=0)


@pytest.mark.smoke
def test_sample_timesteps_exact_and_shapes():
    r = _runner(4)
    b = r.sample(num_timesteps=40)
    assert b["timesteps"] == 40
    assert b["obs"].shape == (10, 4, 4) and b["actions"].shape == (10, 4)
    for k in ("logp", "rewards", "terminateds", "truncateds", "values", "final_values"):
        assert b[k].shape == (10, 4), k
    assert b["last_values"].shape == (4,)
    # not a multiple of num_envs: rounded up to whole vector steps
    assert r.sample(num_timesteps=10)["timesteps"] == 12
    assert r.sample()["timesteps"] == 4 * r.config.rollout_fragment_length
    assert r.num_env_steps_sampled == 40 + 12 + 4 * r.config.rollout_fragment_length
    # logp is the policy's log-probability of the action taken
    pol = r.get_policy()
    with torch.no_grad():
        logp, _, v = pol.evaluate(torch.from_numpy(b["obs"][0]), torch.from_numpy(b["actions"][0]))
    np.testing.assert_allclose(logp.numpy(), b["logp"][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v.numpy(), b["values"][0], rtol=1e-5, atol=1e-6)


def test_sample_episodes_exact():
    r = _runner(3)
    b = r.sample(num_episodes=7)
    assert len(b["episode_returns"]) == 7 and len(b["episode_lengths"]) == 7
    assert b["timesteps"] == int(b["episode_lengths"].sum()) == len(b["obs"]) == len(b["rewards"])
    ends = np.cumsum(b["episode_lengths"]) - 1
    done = b["terminateds"] | b["truncateds"]
    assert np.flatnonzero(done).tolist() == ends.tolist()  # each episode ends exactly once, last
    starts = np.concatenate([[0], ends[:-1] + 1])
    np.testing.assert_allclose(
        [b["rewards"][s : e + 1].sum() for s, e in zip(starts, ends)], b["episode_returns"]
    )


def test_episode_stats_across_timestep_calls():
    cfg = EnvRunnerGroupConfig(num_envs_per_env_runner=2, seed=0)
    r = EnvRunner(cfg, env_creator=lambda ctx: CountEnv(limit=5), worker_index=0)
    b1 = r.sample(num_timesteps=6)  # 3 steps each: no episode done
    b2 = r.sample(num_timesteps=6)  # 6 steps each: one episode of 5 per env
    assert len(b1["episode_returns"]) == 0
    assert b2["episode_lengths"].tolist() == [5, 5] and b2["episode_returns"].tolist() == [5, 5]


@pytest.mark.smoke
def test_truncation_bootstraps_from_final_observation():
    cfg = EnvRunnerGroupConfig(num_envs_per_env_runner=1, seed=0)
    r = EnvRunner(cfg, env_creator=lambda ctx: CountEnv(limit=3), worker_index=0)
    b = r.sample(num_timesteps=4)
    obs = b["obs"][:, 0]
    # steps 0,1,2 of episode 0, then the reset observation of episode 1
    assert obs.tolist() == [[0, 0], [1, 0], [2, 0], [0, 1]]
    assert b["truncateds"][:, 0].tolist() == [False, False, True, False]
    pol = r.get_policy()
    with torch.no_grad():
        v_final = pol.value(torch.tensor([[3.0, 0.0]])).item()  # the cut episode's final obs
        v_reset = pol.value(torch.tensor([[0.0, 1.0]])).item()
    assert b["final_values"][2, 0] == pytest.approx(v_final, rel=1e-5)
    assert v_final != pytest.approx(v_reset)
    assert b["final_values"][[0, 1, 3], 0].tolist() == [0.0, 0.0, 0.0]


def test_termination_is_not_bootstrapped():
    cfg = EnvRunnerGroupConfig(num_envs_per_env_runner=1, seed=0)
    r = EnvRunner(cfg, env_creator=lambda ctx: CountEnv(limit=10, term_at=2), worker_index=0)
    b = r.sample(num_timesteps=4)
    assert b["terminateds"][:, 0].tolist() == [False, True, False, True]
    assert not b["truncateds"].any()
    assert (b["final_values"] == 0).all()


def test_continuous_actions_and_greedy():
    cfg = EnvRunnerGroupConfig(env="Pendulum-v1", num_envs_per_env_runner=2, seed=0)
    r = EnvRunner(cfg, worker_index=0)
    b = r.sample(num_timesteps=10)
    assert b["actions"].shape == (5, 2, 1) and b["actions"].dtype == np.float32
    pol = r.get_policy()
    g = r.sample(num_timesteps=2, explore=False)
    with torch.no_grad():
        greedy = pol.actor(torch.from_numpy(g["obs"][0]))
    np.testing.assert_allclose(g["actions"][0], greedy.numpy(), rtol=1e-5)


def test_running_mean_std_merge_equals_whole():
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, size=(1000, 3))
    whole = RunningMeanStd((3,), 0.0)
    whole.update(x)
    a, b = RunningMeanStd((3,), 0.0), RunningMeanStd((3,), 0.0)
    a.update(x[:300])
    b.update(x[300:])
    merged = RunningMeanStd((3,), 0.0)
    merged.merge(a)
    merged.merge(b.get_state())
    np.testing.assert_allclose(merged.mean, x.mean(0))
    np.testing.assert_allclose(merged.var, x.var(0))
    np.testing.assert_allclose(whole.var, x.var(0))
    assert merged.count == 1000


def test_normaliser_connector_state_delta():
    r = _runner(2, normalize_observations=True)
    r.sample(num_timesteps=20)
    st = r.get_connector_state()
    assert st["obs_norm_delta"]["count"] == 20
    b = r.sample(num_timesteps=2)
    assert np.abs(b["obs"]).max() <= 10.0
    r.set_connector_state({"obs_norm": {"mean": np.ones(4), "var": np.full(4, 4.0), "count": 99.0}})
    assert r.get_connector_state()["obs_norm_delta"]["count"] == 0
    frozen = r.get_connector_state()["obs_norm"]
    r.sample(num_timesteps=4, update_connectors=False)
    assert r.get_connector_state()["obs_norm"]["count"] == frozen["count"]


def test_normaliser_delta_holds_the_moments_of_every_observation_the_policy_saw():
    """One call of 300 steps (its observations reach the delta in more than one merge) and
    a second call: the delta is exactly the moments of the observations fed to the
    policy, and the global statistics are those folded into the initial ones."""
    seen: dict[int, list[np.ndarray]] = {}

    def creator(ctx: EnvContext) -> gym.Env:
        env = gym.make("Pendulum-v1", max_episode_steps=10_000)  # no episode ends here
        rows = seen.setdefault(ctx.vector_index, [])

        def record(o):
            rows.append(np.array(o))
            return o

        return gym.wrappers.TransformObservation(env, record, env.observation_space)

    cfg = EnvRunnerGroupConfig(num_envs_per_env_runner=2, seed=0, normalize_observations=True)
    r = EnvRunner(cfg, env_creator=creator, worker_index=0)
    r.sample(num_timesteps=600)
    r.sample(num_timesteps=20)
    # Fed to the policy: each env's reset observation and every later one but the last.
    fed = np.concatenate([np.stack(seen[i][:-1]) for i in (0, 1)]).astype(np.float64)
    assert len(fed) == 620
    st = r.get_connector_state()
    assert st["obs_norm_delta"]["count"] == 620
    np.testing.assert_allclose(st["obs_norm_delta"]["mean"], fed.mean(0), rtol=1e-12)
    np.testing.assert_allclose(st["obs_norm_delta"]["var"], fed.var(0), rtol=1e-10)
    expected = RunningMeanStd(fed.shape[1:])
    expected.update(fed)
    np.testing.assert_allclose(st["obs_norm"]["mean"], expected.mean, rtol=1e-10)
    np.testing.assert_allclose(st["obs_norm"]["var"], expected.var, rtol=1e-10)


def test_policies_state_and_contexts():
    r = _runner(2, normalize_observations=True)
    space = r.observation_space
    r.add_policy("other", ActorCritic, config={"hidden": (8,)})
    assert r.policy_ids() == ["default_policy", "other"]
    assert sorted(r.get_spaces()) == ["__env__", "default_policy", "other"]
    assert r.foreach_policy(lambda p, pid: pid) == ["default_policy", "other"]
    r.set_policies_to_train(["other"])
    assert r.foreach_policy_to_train(lambda p, pid: pid) == ["other"]
    ctxs = r.foreach_env_with_context(lambda e, c: (c.worker_index, c.vector_index, type(c)))
    assert ctxs == [(0, 0, EnvContext), (0, 1, EnvContext)]
    assert r.foreach_env(lambda e: e.spec.id) == ["CartPole-v1"] * 2
    r.sample(num_timesteps=8)
    state = r.get_state()
    fresh = _runner(2, normalize_observations=True)
    fresh.set_state(state)
    assert fresh.policy_ids() == ["default_policy", "other"]
    x = torch.zeros(3, *space.shape)
    torch.testing.assert_close(fresh.get_policy("other").value(x), r.get_policy("other").value(x))
    np.testing.assert_allclose(
        fresh.get_connector_state()["obs_norm"]["mean"], r.get_connector_state()["obs_norm"]["mean"]
    )
    assert fresh.is_policy_to_train("other") and not fresh.is_policy_to_train("default_policy")
    with pytest.raises(ValueError, match="policy_id"):
        r.add_policy("a.b")
    with pytest.raises(KeyError, match="nope"):
        r.sample(num_timesteps=2, policy_id="nope")


def test_env_context_pickles_and_reaches_creator():
    import pickle

    seen = []

    def creator(ctx):
        seen.append((dict(ctx), ctx.worker_index, ctx.vector_index, ctx.num_workers))
        return CountEnv(limit=ctx["limit"])

    cfg = EnvRunnerGroupConfig(
        num_envs_per_env_runner=2, env_config={"limit": 4}, num_env_runners=3
    )
    EnvRunner(cfg, env_creator=creator, worker_index=2)
    assert seen == [({"limit": 4}, 2, 0, 3), ({"limit": 4}, 2, 1, 3)]
    ctx = pickle.loads(pickle.dumps(EnvContext({"a": 1}, worker_index=3, vector_index=1)))
    assert dict(ctx) == {"a": 1} and ctx.worker_index == 3 and ctx.vector_index == 1


def test_bad_sample_arguments_and_config():
    r = _runner(2)
    with pytest.raises(ValueError, match="not both"):
        r.sample(num_timesteps=4, num_episodes=1)
    with pytest.raises(ValueError, match="num_timesteps"):
        r.sample(num_timesteps=0)
    with pytest.raises(ValueError, match="num_envs_per_env_runner"):
        EnvRunnerGroupConfig(num_envs_per_env_runner=0).validate()
    with pytest.raises(ValueError, match="sample_timeout_s"):
        EnvRunnerGroupConfig(sample_timeout_s=0).validate()
    with pytest.raises(TypeError, match="restart_failed_env_runners"):
        EnvRunnerGroupConfig(restart_failed_env_runners="yes").validate()
    with pytest.raises(ValueError, match="unknown env runner config keys"):
        EnvRunnerGroupConfig.from_dict({"num_workers": 2})


def test_episode_sampling_times_out():
    cfg = EnvRunnerGroupConfig(num_envs_per_env_runner=1, sample_timeout_s=0.3)
    r = EnvRunner(cfg, env_creator=lambda ctx: CountEnv(limit=10**9), worker_index=0)
    with pytest.raises(TimeoutError, match="sample_timeout_s"):
        r.sample(num_episodes=1)
