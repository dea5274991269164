"""The default policy of env runners: a small actor-critic MLP for Box observations.

Discrete action spaces get a categorical head, Box action spaces a diagonal Gaussian
with a state-independent log-std. Sampling is written out by hand (no
``torch.distributions`` objects) because the env runner calls ``act`` once per vector
step and object construction would cost more than the tiny MLP itself. For the same
reason runners call :meth:`ActorCritic.act_numpy`: a vector step's batch is a few rows,
where torch's fixed cost per op is most of the forward and numpy's is a fraction of it.

Any ``nn.Module`` can be a policy of an :class:`~phalanx.envs.EnvRunner` if it has the
same two methods: ``act(obs, explore) -> (actions, logp, values)`` and
``evaluate(obs, actions) -> (logp, entropy, values)``; ``values`` may be ``None``.
It may add ``act_numpy(obs, explore, rng)``, the same as ``act`` on numpy arrays with
noise from the runner's ``numpy.random.Generator``; the runner calls it first and falls
back to ``act`` when it returns ``None``.
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
        self._np_activation = np.tanh if activation == "tanh" else _relu
        self._linears = [m for m in (*self.actor, *self.critic) if isinstance(m, nn.Linear)]
        self._np_views: tuple[tuple[int, ...], list[np.ndarray]] | None = None

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

    def act_numpy(
        self, obs: np.ndarray, explore: bool, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """:meth:`act` computed in numpy on the live parameters, with noise from ``rng``:
        same network, same distribution, numpy's random stream. ``None`` when the weights
        are not float32 on the CPU or a subclass overrides :meth:`act` (call :meth:`act`
        then)."""
        if type(self).act is not ActorCritic.act:
            return None
        # Each layer's own registry: nn.Module.__getattr__ would cost a quarter of the forward.
        params = [t for m in self._linears for t in m._parameters.values()]
        if not self.discrete:
            params.append(self._parameters["log_std"])
        arrays = self._numpy_views(params)
        if arrays is None:
            return None
        x = obs.reshape(len(obs), -1)
        n = len(self._linears) // 2  # Linear layers per net
        out = self._np_mlp(arrays[: 2 * n], x)
        value = self._np_mlp(arrays[2 * n : 4 * n], x)[:, 0]
        if self.discrete:
            z = out - out.max(-1, keepdims=True)
            logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
            if explore:  # Gumbel-max: an exact sample of the categorical
                gumbel = -np.log(-np.log(rng.random(out.shape, np.float32)))
                a = (logp_all + gumbel).argmax(-1)
            else:
                a = out.argmax(-1)
            return a, logp_all[np.arange(len(a)), a], value
        log_std = arrays[-1]
        const = np.float32(log_std.sum() + 0.5 * _LOG_2PI * out.shape[-1])
        if explore:
            eps = rng.standard_normal(out.shape, np.float32)
            a = out + np.exp(log_std) * eps
            logp = -0.5 * (eps * eps).sum(-1) - const  # (a - mean) / std is eps itself
        else:
            a = out
            logp = np.full(len(out), -const, np.float32)
        return a.reshape(-1, *self.action_shape), logp, value

    def _numpy_views(self, params: list[torch.Tensor]) -> list[np.ndarray] | None:
        """Numpy views of ``params``, rebuilt when a storage moves (a weight receiver may
        point a parameter at a new buffer); ``None`` unless all are float32 on the CPU."""
        ptrs = tuple(p.data_ptr() for p in params)
        if self._np_views is None or self._np_views[0] != ptrs:
            if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in params):
                return None
            self._np_views = (ptrs, [p.detach().numpy() for p in params])
        return self._np_views[1]

    def _np_mlp(self, arrays: list[np.ndarray], x: np.ndarray) -> np.ndarray:
        last = len(arrays) // 2 - 1
        for i in range(last + 1):
            x = x @ arrays[2 * i].T + arrays[2 * i + 1]
            if i < last:
                x = self._np_activation(x)
        return x

    def _gauss_logp(self, mean: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        z = (a - mean) / self.log_std.exp()
        return (-0.5 * z.pow(2) - self.log_std - 0.5 * _LOG_2PI).sum(-1)

    def forward(self, obs: torch.Tensor) -> Any:
        """Greedy actions (what ``phalanx eval`` runs)."""
        return self.act(obs, explore=False)[0]


def act_on_numpy(
    policy: nn.Module, obs: np.ndarray, explore: bool, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """What an env runner's forward is: ``policy.act_numpy`` where the policy has it and it
    answers, else ``policy.act`` on a tensor; numpy ``(actions, logp, values)`` either way."""
    fast = getattr(policy, "act_numpy", None)
    out = None if fast is None else fast(obs, explore, rng)
    if out is not None:
        return out
    a, logp, v = policy.act(torch.from_numpy(obs), explore)
    return a.numpy(), logp.numpy(), None if v is None else v.numpy()


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0)


def _rebuild(args: tuple[Any, ...], state: dict[str, torch.Tensor], training: bool) -> ActorCritic:
    with torch.random.fork_rng(devices=[]):  # the initialisation must not move the RNG
        module = ActorCritic(*args)
    module.load_state_dict(state)
    return module.train(training)
