"""The merged connector state of an ``EnvRunnerGroup``: the observation normaliser's
global statistics, folded from the runners' per-runner deltas (RLlib's
``sync_env_runner_states`` merge)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from phalanx.envs.normalize import RunningMeanStd


class ConnectorState:
    """The global observation statistics (None until the first merge or load)."""

    def __init__(self) -> None:
        self.obs_norm: RunningMeanStd | None = None

    def merge(
        self, connector_states: list[dict[str, Any]], shape: Callable[[], tuple[int, ...]]
    ) -> dict[str, Any]:
        """Fold the runners' normaliser deltas into the global statistics.

        Args:
            connector_states: the runners' ``get_connector_state()`` results.
            shape: gives the observation shape (asked only when nothing was merged yet).

        Returns:
            The merged state, ``{"obs_norm": state}``.
        """
        if self.obs_norm is None:
            self.obs_norm = RunningMeanStd(shape())
        for st in connector_states:
            if st and st.get("obs_norm_delta") is not None:
                self.obs_norm.merge(st["obs_norm_delta"])
        return {"obs_norm": self.obs_norm.get_state()}

    def get(self) -> dict[str, Any]:
        """``{"obs_norm": state}``, or ``{}`` before any merge or load."""
        return {} if self.obs_norm is None else {"obs_norm": self.obs_norm.get_state()}

    def restore(self) -> dict[str, Any]:
        """The connector part of what a runner returning to service gets."""
        return {"obs_norm": None if self.obs_norm is None else self.obs_norm.get_state()}

    def load(self, state: dict[str, Any]) -> None:
        """Replace the statistics with ``state["obs_norm"]`` (e.g. from a checkpoint)."""
        self.obs_norm = RunningMeanStd(np.asarray(state["obs_norm"]["mean"]).shape)
        self.obs_norm.set_state(state["obs_norm"])


def merge_and_broadcast(config: Any) -> tuple[bool, bool]:
    """RLlib's ``merge_env_runner_states``/``broadcast_env_runner_states`` of ``config``."""
    if config is None:
        return True, True
    merge = getattr(config, "merge_env_runner_states", True)
    if merge == "training_only":
        merge = not getattr(config, "in_evaluation", False)
    broadcast = getattr(config, "broadcast_env_runner_states", True)
    for name, v in (("merge_env_runner_states", merge), ("broadcast_env_runner_states", broadcast)):
        if not isinstance(v, bool):
            raise TypeError(
                f"config.{name} must be a bool (or 'training_only' for merging), got {v!r}"
            )
    return merge, broadcast
