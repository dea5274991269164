"""Weight sync of an ``EnvRunnerGroup`` (RLlib's ``sync_weights``): the weights of a
source as per-policy state dicts, and one ``phalanx.weights.WeightSender`` per group of
remote runners (transport ``auto``: same-node runners view the sender's shared buffer)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from phalanx.envs.config import DEFAULT_POLICY_ID
from phalanx.envs.env_runner import EnvRunner
from phalanx.group.group import WorkerGroup

logger = logging.getLogger(__name__)


class WeightSync:
    """The sender to the current remote runners, a fire-and-forget send in flight, and the
    version of the weights last sent.

    Args:
        timeout_s: how long a blocking send waits for the runners to apply the weights.
    """

    def __init__(self, timeout_s: float) -> None:
        self.version = 0  # 0: none sent yet
        self._timeout_s = timeout_s
        self._sender: Any = None  # a WeightSender over the current group, made on first use
        self._pending = False  # a send_async not yet waited for

    def start(self, group: WorkerGroup) -> None:
        """Make the sender to ``group`` if there is none, and finish a send in flight."""
        from phalanx.weights import WeightSender

        if self._sender is None:
            self._sender = WeightSender(group, transport="auto", timeout_s=self._timeout_s)
        if self._pending:
            self._pending = False
            self._sender.wait_async()

    def send(
        self, weights: dict[str, dict[str, torch.Tensor]], ranks: list[int], timeout: float | None
    ) -> Any:
        """Send ``weights`` to ``ranks`` of the group given to ``start``.

        Args:
            weights: per-policy state dicts.
            ranks: the ranks to update (nothing is sent if empty).
            timeout: 0 starts the send and returns; None or > 0 waits until applied.

        Returns:
            The ``SyncResult`` of a blocking send, else None.
        """
        flat = {f"{pid}.{k}": v for pid, sd in weights.items() for k, v in sd.items()}
        if ranks and timeout == 0:
            self._sender.send_async(flat, worker_ids=ranks)
            self._pending = True
        elif ranks:
            if timeout is not None:
                self._sender.timeout_s = timeout
            result = self._sender.send(flat, worker_ids=ranks)
            if result.failed:
                logger.warning("sync_weights: runners failed to apply: %s", result.failed)
            return result
        return None

    def next_version(self) -> int:
        """Take the new version: the sender's, or one more without remote runners."""
        self.version = self._sender.version if self._sender is not None else self.version + 1
        return self.version

    def close(self) -> None:
        """Close the sender (its group is going away); a later send makes a new one."""
        if self._sender is not None:
            try:
                self._sender.close()
            except Exception as e:  # noqa: BLE001 - closing is best effort; the group goes
                logger.warning("closing the weight sender: %s", e)
            self._sender = None
            self._pending = False


def state_dicts(
    source: Any, policies: list[str] | None, local: EnvRunner | None
) -> dict[str, dict[str, torch.Tensor]]:
    """``{policy_id: state dict}`` of a ``sync_weights`` source, as tensors.

    Args:
        source: None (the local runner), an ``EnvRunner``, an ``nn.Module`` (the default
            policy), or ``{policy_id: nn.Module | state dict}``.
        policies: the policies to keep (all if None).
        local: the local runner.

    Returns:
        The state dicts.

    Raises:
        ValueError: ``source`` is None without a local runner, or a policy has no weights.
        TypeError: ``source`` or one of its values has the wrong type.
    """
    if source is None:
        if local is None:
            raise ValueError(
                "from_worker_or_learner_group: there is no local runner to take weights "
                "from; pass a module, a {policy_id: module} dict or a worker id"
            )
        weights = {pid: _state(p) for pid, p in local.policies.items()}
    elif isinstance(source, EnvRunner):
        weights = {pid: _state(p) for pid, p in source.policies.items()}
    elif isinstance(source, torch.nn.Module):
        weights = {DEFAULT_POLICY_ID: _state(source)}
    elif isinstance(source, dict):
        weights = {}
        for pid, w in source.items():
            if isinstance(w, torch.nn.Module):
                weights[pid] = _state(w)
            elif isinstance(w, dict):
                weights[pid] = w
            else:
                raise TypeError(
                    f"from_worker_or_learner_group[{pid!r}] must be an nn.Module or a state dict"
                )
    else:
        raise TypeError(
            "from_worker_or_learner_group must be None, an EnvRunner, a worker id, an "
            f"nn.Module or a dict, got {type(source).__name__}"
        )
    if policies is not None:
        missing = [p for p in policies if p not in weights]
        if missing:
            raise ValueError(f"policies: no weights for {missing} (have {sorted(weights)})")
        weights = {p: weights[p] for p in policies}
    return {
        pid: {
            k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))
            for k, v in sd.items()
        }
        for pid, sd in weights.items()
    }


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in module.state_dict().items()}
