"""The default policy of env runners: a small actor-critic MLP for Box observations.

Discrete action spaces get a categorical head, Box action spaces a diagonal Gaussian
with a state-independent log-std. Sampling is written out by hand (no
``torch.distributions`` objects) because the env runner calls ``act`` once per vector
step and object construction would cost more than the tiny MLP itself.

Any ``nn.Module`` can be a policy of an :class:`~phalanx.envs.EnvRunner` if it has the
same two methods: ``act(obs, explore) -> (actions, logp, values)`` and
``evaluate(obs, actions) -> (logp, entropy, values)``; ``values`` may be ``None``.
"""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

_LOG_2PI = math.log(2 * math.pi)


def _mlp(sizes: list[int], act: type[nn.Module], out_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        lin = nn.Linear(a, b)
        last = i == len(sizes) - 2
        nn.init.orthogonal_(lin.weight, out_gain if last else math.sqrt(2))
        nn.init.zeros_(lin.bias)
        layers.append(lin)
        if not last:
            layers.append(act())
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs (CleanRL's layout), orthogonal initialisation.

    ``ActorCritic(observation_space, action_space, hidden=(64, 64), activation="tanh",
    init_log_std=0.0)``.
    """

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        hidden: tuple[int, ...] | list[int] = (64, 64),
        activation: str = "tanh",
        init_log_std: float = 0.0,
    ):
        super().__init__()
        if not isinstance(observation_space, gym.spaces.Box):
            raise TypeError(
                f"observation_space: ActorCritic needs a Box space, got {observation_space}"
            )
        if activation not in ("tanh", "relu"):
            raise ValueError(f"activation must be 'tanh' or 'relu', got {activation!r}")
        self._args = (observation_space, action_space, tuple(hidden), activation, init_log_std)
        act = nn.Tanh if activation == "tanh" else nn.ReLU
        obs_dim = int(np.prod(observation_space.shape))
        hidden = [int(h) for h in hidden]
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        if self.discrete:
            out_dim = int(action_space.n)
        elif isinstance(action_space, gym.spaces.Box):
            out_dim = int(np.prod(action_space.shape))
            self.log_std = nn.Parameter(torch.full((out_dim,), float(init_log_std)))
        else:
            raise TypeError(
                f"action_space: ActorCritic supports Discrete and Box, got {action_space}"
            )
        self.action_shape = tuple(action_space.shape or ())
        self.actor = _mlp([obs_dim, *hidden, out_dim], act, 0.01)
        self.critic = _mlp([obs_dim, *hidden, 1], act, 1.0)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles as its arguments and weights: hooks that a runner's weight receiver put
        on it (they hold weak references) stay behind, so a runner can return it."""
        state = {k: v.detach().clone() for k, v in self.state_dict().items()}
        return (_rebuild, (self._args, state, self.training))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """State values, shape ``[B]``."""
        return self.critic(obs.flatten(1)).squeeze(-1)

    def act(
        self, obs: torch.Tensor, explore: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Actions, their log-probabilities and the state values for a batch ``obs``."""
        x = obs.flatten(1)
        out = self.actor(x)
        if self.discrete:
            logp_all = torch.log_softmax(out, -1)
            if explore:
                a = torch.multinomial(logp_all.exp(), 1)
            else:
                a = out.argmax(-1, keepdim=True)
            return a.squeeze(-1), logp_all.gather(1, a).squeeze(-1), self.value(x)
        std = self.log_std.exp()
        a = out + std * torch.randn_like(out) if explore else out
        return a.view(-1, *self.action_shape), self._gauss_logp(out, a), self.value(x)

    def evaluate(
        self, obs: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probabilities of ``actions``, entropies and values (the PPO loss's inputs)."""
        x = obs.flatten(1)
        out = self.actor(x)
        if self.discrete:
            logp_all = torch.log_softmax(out, -1)
            logp = logp_all.gather(1, actions.long().view(-1, 1)).squeeze(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            return logp, entropy, self.value(x)
        a = actions.reshape(out.shape)
        entropy = (0.5 + 0.5 * _LOG_2PI + self.log_std).sum().expand(out.shape[0])
        return self._gauss_logp(out, a), entropy, self.value(x)

    def _gauss_logp(self, mean: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        z = (a - mean) / self.log_std.exp()
        return (-0.5 * z.pow(2) - self.log_std - 0.5 * _LOG_2PI).sum(-1)

    def forward(self, obs: torch.Tensor) -> Any:
        """Greedy actions (what ``phalanx eval`` runs)."""
        return self.act(obs, explore=False)[0]


def _rebuild(args: tuple[Any, ...], state: dict[str, torch.Tensor], training: bool) -> ActorCritic:
    with torch.random.fork_rng(devices=[]):  # the initialisation must not move the RNG
        module = ActorCritic(*args)
    module.load_state_dict(state)
    return module.train(training)
