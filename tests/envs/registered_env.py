"""Registers ``PhalanxCountdown-v0`` when imported: the target of ``--env module:EnvId``."""

from __future__ import annotations

import gymnasium as gym

gym.register("PhalanxCountdown-v0", entry_point="gymnasium.envs.classic_control:CartPoleEnv")
