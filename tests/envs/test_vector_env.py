"""SameStepVectorEnv steps exactly as gymnasium's SyncVectorEnv in SAME_STEP mode."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from phalanx.envs.vector_env import SameStepVectorEnv

pytestmark = pytest.mark.timeout(120)


def _pair(make, n):
    ours = SameStepVectorEnv([make] * n)
    theirs = SyncVectorEnv([make] * n, autoreset_mode=AutoresetMode.SAME_STEP)
    return ours, theirs


def _assert_infos_equal(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        if isinstance(value, dict):
            _assert_infos_equal(ours[key], value)
        elif value.dtype == object:
            mask = theirs["_" + key]
            for i in np.flatnonzero(mask):
                np.testing.assert_array_equal(ours[key][i], value[i], err_msg=key)
            assert all(o is None for o in ours[key][~mask])
        else:
            np.testing.assert_array_equal(ours[key], value, err_msg=key)


@pytest.mark.parametrize(
    ("env_id", "kwargs", "finishes"),
    [
        ("HalfCheetah-v5", {"max_episode_steps": 7}, "truncations"),  # Box, step infos
        ("CartPole-v1", {}, "terminations"),  # MultiDiscrete batch of actions
    ],
)
def test_steps_equal_the_librarys(env_id, kwargs, finishes):
    def make():
        return gym.make(env_id, disable_env_checker=True, **kwargs)

    ours, theirs = _pair(make, 3)
    o1, _ = ours.reset(seed=[5, 6, 7])
    o2, _ = theirs.reset(seed=[5, 6, 7])
    np.testing.assert_array_equal(o1, o2)
    theirs.action_space.seed(0)
    ended = 0
    for _ in range(40):
        a = theirs.action_space.sample()
        got, want = ours.step(a), theirs.step(a)
        for g, w in zip(got[:4], want[:4], strict=True):
            np.testing.assert_array_equal(g, w)
            assert g.dtype == w.dtype
        _assert_infos_equal(got[4], want[4])
        ended += int((got[3] if finishes == "truncations" else got[2]).sum())
    assert ended >= 3  # the autoreset path ran, for every sub-env at least once on average
    ours.close()
    theirs.close()


def _pendulum() -> gym.Env:
    return gym.make("Pendulum-v1", disable_env_checker=True)


def test_observations_come_in_the_reused_buffer():
    """``copy=False``, as the library's: the next step overwrites what a step returned."""
    env = SameStepVectorEnv([_pendulum] * 2)
    env.reset(seed=0)
    first = env.step(np.zeros((2, 1), np.float32))[0]
    kept = first.copy()
    second = env.step(np.ones((2, 1), np.float32))[0]
    assert second is first
    assert not np.array_equal(kept, second)
    env.close()


@pytest.mark.smoke
def test_a_wrong_number_of_actions_is_refused():
    env = SameStepVectorEnv([_pendulum] * 2)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="actions: 3 rows for 2 sub-envs"):
        env.step(np.zeros((3, 1), np.float32))
    env.close()
