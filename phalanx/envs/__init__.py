"""Layer 7: env runners on gymnasium and their fault-tolerant group (RLlib's names)."""

from __future__ import annotations

from phalanx.envs.config import DEFAULT_POLICY_ID, EnvContext, EnvRunnerGroupConfig

__all__ = [
    "DEFAULT_POLICY_ID",
    "ActorCritic",
    "EnvContext",
    "EnvRunner",
    "EnvRunnerGroup",
    "EnvRunnerGroupConfig",
    "RunningMeanStd",
]


def __getattr__(name: str):
    # torch-heavy modules load on first use
    if name == "EnvRunner":
        from phalanx.envs.env_runner import EnvRunner

        return EnvRunner
    if name == "EnvRunnerGroup":
        from phalanx.envs.env_runner_group import EnvRunnerGroup

        return EnvRunnerGroup
    if name == "ActorCritic":
        from phalanx.envs.policy import ActorCritic

        return ActorCritic
    if name == "RunningMeanStd":
        from phalanx.envs.normalize import RunningMeanStd

        return RunningMeanStd
    raise AttributeError(f"module 'phalanx.envs' has no attribute {name!r}")
