"""Policies of an ``EnvRunnerGroup``: RLlib's ``add_policy``, ``foreach_policy*`` and the
set of policies to train, on every runner (local and remote).

Policies added to every runner are kept here and registered on the runners' group, so a
runner returning to service (a restarted process, or one back from a failure) gets them
with their weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import torch

from phalanx.envs.config import EnvRunnerGroupConfig
from phalanx.envs.env_runner import EnvRunner
from phalanx.group.group import WorkerGroup


class RunnerPolicies:
    """Mixin of ``EnvRunnerGroup``: the policies of every runner.

    The group provides the attributes annotated here and ``_ranks``, ``_foreach_remote``,
    ``foreach_worker`` and ``_register_restore_state``.
    """

    config: EnvRunnerGroupConfig
    _group: WorkerGroup | None
    _local: EnvRunner | None
    _added_policies: dict[str, dict[str, Any]]
    _policies_to_train: list[str] | None

    def foreach_policy(self, func: Callable[..., Any], **kwargs: Any) -> list[Any]:
        """``func(policy, policy_id, **kwargs)`` for every policy of every runner (flat list).

        Args:
            func: called as ``func(policy, policy_id, **kwargs)``.
            **kwargs: its keyword arguments.

        Returns:
            The results of every runner, flat.
        """
        results = self.foreach_worker(_foreach_policy, kwargs={"func": func, "kwargs": kwargs})
        return [x for per_runner in results for x in per_runner]

    def foreach_policy_to_train(self, func: Callable[..., Any], **kwargs: Any) -> list[Any]:
        """Like ``foreach_policy`` for the policies in ``policies_to_train`` only.

        Args:
            func: called as ``func(policy, policy_id, **kwargs)``.
            **kwargs: its keyword arguments.

        Returns:
            The results of every runner, flat.
        """
        results = self.foreach_worker(
            _foreach_policy, kwargs={"func": func, "kwargs": kwargs, "to_train": True}
        )
        return [x for per_runner in results for x in per_runner]

    def is_policy_to_train(self, policy_id: str, batch: Any = None) -> bool:
        """Whether ``policy_id`` is trained (all policies are unless ``policies_to_train`` says).

        Args:
            policy_id: the policy's id.
            batch: accepted for RLlib's signature.

        Returns:
            Whether it is trained.
        """
        return self._policies_to_train is None or policy_id in self._policies_to_train

    def add_policy(
        self,
        policy_id: str,
        policy_cls: type[torch.nn.Module] | None = None,
        policy: torch.nn.Module | None = None,
        *,
        observation_space: gym.Space | None = None,
        action_space: gym.Space | None = None,
        config: dict[str, Any] | None = None,
        policy_state: dict[str, Any] | None = None,
        policies_to_train: list[str] | None = None,
        workers: list[int] | None = None,
    ) -> torch.nn.Module | None:
        """Add a policy to every runner (or the remote runners ``workers``, ids 1..n).

        Give a ``policy`` instance (its weights go along) or a ``policy_cls`` built as
        ``policy_cls(observation_space, action_space, **config)``. ``policies_to_train``
        replaces the trained set. Returns the local runner's new policy (if any).

        Args:
            policy_id: the new policy's id.
            policy_cls: a module class, built as ``policy_cls(obs_space, act_space, **config)``.
            policy: a module instance (its weights go along).
            observation_space: the policy's observation space (the env's if None).
            action_space: the policy's action space (the env's if None).
            config: keyword arguments of ``policy_cls``.
            policy_state: a state dict loaded into the new policy.
            policies_to_train: the new set of trained policies.
            workers: the remote ids (1..n) that get it (every runner if None).

        Returns:
            The local runner's new policy, or None.

        Raises:
            ValueError: ``policy_id`` is empty or has a ``.``, or ``policy`` is given with
                neither ``observation_space`` nor ``config``.
            TypeError: ``policy`` or ``policy_cls`` is not a torch module.
        """
        if not isinstance(policy_id, str) or not policy_id or "." in policy_id:
            raise ValueError(f"policy_id must be a non-empty str without '.', got {policy_id!r}")
        if policy is not None and not isinstance(policy, torch.nn.Module):
            raise TypeError(f"policy must be a torch.nn.Module, got {type(policy).__name__}")
        if policy_cls is not None and not (
            isinstance(policy_cls, type) and issubclass(policy_cls, torch.nn.Module)
        ):
            raise TypeError("policy_cls must be a torch.nn.Module subclass")
        ranks = self._ranks(workers, "workers")
        if policy is not None:
            policy_cls = type(policy)
            policy_state = {k: v.detach().cpu().numpy() for k, v in policy.state_dict().items()}
            if config is None and observation_space is None:
                raise ValueError(
                    "policy: to rebuild it on remote runners, also give observation_space, "
                    "action_space and config (or give policy_cls instead)"
                )
        spec = {
            "policy_cls": policy_cls,
            "observation_space": observation_space,
            "action_space": action_space,
            "config": dict(config or self.config.policy_config),
            "policy_state": policy_state,
        }
        local_policy = None
        if self._local is not None and workers is None:
            local_policy = self._local.add_policy(policy_id, **spec)
            if policy_state is None:  # every runner starts from the local runner's weights
                spec["policy_state"] = self._local.get_weights([policy_id])[policy_id]
        if self._group is not None:
            self._foreach_remote(
                _add_policy, kwargs={"policy_id": policy_id, "spec": spec}, ranks=ranks
            )
        if policies_to_train is not None:
            self._policies_to_train = list(policies_to_train)
            self.foreach_worker(
                "set_policies_to_train", kwargs={"policies_to_train": policies_to_train}
            )
        if workers is None:
            self._added_policies[policy_id] = spec
        self._register_restore_state()
        return local_policy


# Functions shipped to runners (module level so they pickle by reference).
def _foreach_policy(
    runner: EnvRunner, func: Callable[..., Any], kwargs: dict[str, Any], to_train: bool = False
) -> list[Any]:
    if to_train:
        return runner.foreach_policy_to_train(func, **kwargs)
    return runner.foreach_policy(func, **kwargs)


def _add_policy(runner: EnvRunner, policy_id: str, spec: dict[str, Any]) -> None:
    runner.add_policy(policy_id, **spec)
