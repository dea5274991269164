"""gymnasium's ``SyncVectorEnv``, stepped without its per-space machinery where it can be.

``SyncVectorEnv.step`` serves every space: it splits the actions with ``iterate``, joins
the observations with ``concatenate`` and copies its buffers, whatever the spaces are.
For a Box observation space and a Box or MultiDiscrete batch of actions that generic work
is a sizeable part of a runner's step on MuJoCo (``benchmarks/bench_sampling.py``).
:class:`SameStepVectorEnv` does the same steps directly on numpy rows, with the library's
own ``_add_info`` for what an env reports, and leaves every other space and autoreset mode
to the library's ``step``.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv


class SameStepVectorEnv(SyncVectorEnv):
    """``SyncVectorEnv(env_fns, copy=False, autoreset_mode=AutoresetMode.SAME_STEP)``
    with a direct ``step`` for Box observations: the same results (observations with the
    reset ones in place of finished episodes' last ones, ``final_obs``/``final_info`` and
    the sub-envs' infos under the library's keys), in the buffer that ``copy=False``
    reuses."""

    def __init__(self, env_fns: Any, **kwargs: Any):
        kwargs.setdefault("copy", False)
        kwargs.setdefault("autoreset_mode", AutoresetMode.SAME_STEP)
        super().__init__(env_fns, **kwargs)
        self._direct = (
            self.autoreset_mode == AutoresetMode.SAME_STEP
            and not self.copy
            and isinstance(self.single_observation_space, gym.spaces.Box)
            and isinstance(self.action_space, gym.spaces.Box | gym.spaces.MultiDiscrete)
        )

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict]:
        if not self._direct:
            return super().step(actions)
        actions = np.asarray(actions)
        if len(actions) != self.num_envs:
            raise ValueError(f"actions: {len(actions)} rows for {self.num_envs} sub-envs")
        obs = self._observations
        rewards, terms, truncs = [], [], []
        infos: dict[str, Any] = {}
        for i, env in enumerate(self.envs):
            o, r, term, trunc, info = env.step(actions[i])
            if term or trunc:
                infos = self._add_info(infos, {"final_obs": o, "final_info": info}, i)
                o, info = env.reset()
            if info:
                infos = self._add_info(infos, info, i)
            obs[i] = o
            rewards.append(r)
            terms.append(term)
            truncs.append(trunc)
        self._rewards = np.array(rewards, np.float64)
        self._terminations = np.array(terms, np.bool_)
        self._truncations = np.array(truncs, np.bool_)
        self._autoreset_envs = self._terminations | self._truncations
        return obs, self._rewards, self._terminations, self._truncations, infos
