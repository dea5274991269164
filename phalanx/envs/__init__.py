"""Layer 7: env runners on gymnasium and their fault-tolerant group (RLlib's names).

Names are imported on first use (the runners' modules import torch)."""

from __future__ import annotations

from phalanx._base.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "DEFAULT_POLICY_ID": ".config",
        "EnvContext": ".config",
        "EnvRunnerGroupConfig": ".config",
        "EnvRunner": ".env_runner",
        "EnvRunnerGroup": ".env_runner_group",
        "ActorCritic": ".policy",
        "RunningMeanStd": ".normalize",
    },
)
