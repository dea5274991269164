"""The policies of an ``EnvRunnerGroup`` beyond the default one (RLlib's ``add_policy``)
and the set of policies to train.

Policies added to every runner are kept here so that a runner returning to service (a
restarted process, or one back from a failure) gets them with their weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import torch

from phalanx.envs.env_runner import EnvRunner


class RunnerPolicies:
    """The policies added to every runner (``{policy_id: spec}``) and those to train.

    Args:
        policies_to_train: the ids of the policies to train (None: all).
    """

    def __init__(self, policies_to_train: list[str] | None) -> None:
        self.added: dict[str, dict[str, Any]] = {}
        self.to_train = None if policies_to_train is None else list(policies_to_train)

    def is_to_train(self, policy_id: str) -> bool:
        """Whether ``policy_id`` is trained (all are unless ``policies_to_train`` says)."""
        return self.to_train is None or policy_id in self.to_train

    def restore(self) -> dict[str, Any]:
        """The policies part of what a runner returning to service gets."""
        return {"policies": dict(self.added), "policies_to_train": self.to_train}


def check_new_policy(
    policy_id: str, policy_cls: type[torch.nn.Module] | None, policy: torch.nn.Module | None
) -> None:
    """Refuse an ``add_policy`` id or module that cannot work.

    Args:
        policy_id: the new policy's id.
        policy_cls: a module class, or None.
        policy: a module instance, or None.

    Raises:
        ValueError: ``policy_id`` is empty or has a ``.``.
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


def policy_spec(
    policy_cls: type[torch.nn.Module] | None,
    policy: torch.nn.Module | None,
    observation_space: gym.Space | None,
    action_space: gym.Space | None,
    config: dict[str, Any] | None,
    policy_state: dict[str, Any] | None,
    default_config: dict[str, Any],
) -> dict[str, Any]:
    """``EnvRunner.add_policy``'s keywords for a new policy: a ``policy`` instance gives
    its class and weights, ``config`` defaults to ``default_config``.

    Args:
        policy_cls: a module class.
        policy: a module instance.
        observation_space: the policy's observation space.
        action_space: the policy's action space.
        config: keyword arguments of ``policy_cls``.
        policy_state: a state dict loaded into the new policy.
        default_config: the group's ``policy_config``.

    Returns:
        The keywords.

    Raises:
        ValueError: ``policy`` is given with neither ``observation_space`` nor ``config``.
    """
    if policy is not None:
        policy_cls = type(policy)
        policy_state = {k: v.detach().cpu().numpy() for k, v in policy.state_dict().items()}
        if config is None and observation_space is None:
            raise ValueError(
                "policy: to rebuild it on remote runners, also give observation_space, "
                "action_space and config (or give policy_cls instead)"
            )
    return {
        "policy_cls": policy_cls,
        "observation_space": observation_space,
        "action_space": action_space,
        "config": dict(config or default_config),
        "policy_state": policy_state,
    }


# Functions shipped to runners (module level so they pickle by reference).
def foreach_policy(
    runner: EnvRunner, func: Callable[..., Any], kwargs: dict[str, Any], to_train: bool = False
) -> list[Any]:
    """``func`` on every policy of ``runner`` (those to train only with ``to_train``)."""
    if to_train:
        return runner.foreach_policy_to_train(func, **kwargs)
    return runner.foreach_policy(func, **kwargs)


def add_policy(runner: EnvRunner, policy_id: str, spec: dict[str, Any]) -> None:
    """``runner.add_policy(policy_id, **spec)``."""
    runner.add_policy(policy_id, **spec)
