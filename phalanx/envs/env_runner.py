"""EnvRunner: a phalanx worker that steps a gymnasium vector env with torch policies.

One runner holds one ``SyncVectorEnv`` (``vector_env.SameStepVectorEnv``, the same with a
leaner step) of ``num_envs_per_env_runner`` sub-environments
(built by ``env_creator(EnvContext)`` or ``gymnasium.make(env_id)``), its policies (torch
modules keyed by policy id) and its connector state (an optional running observation
normaliser). ``sample`` returns numpy arrays, which travel through Ray without copies.

Truncation: the vector env resets a finished sub-env in the same step
(``AutoresetMode.SAME_STEP``), so the observation after a truncated step is the next
episode's first one. The runner evaluates the value of the *final* observation for those
steps and returns it as ``final_values``; a learner adds ``gamma * final_values`` to the
reward of truncated (not terminated) steps, which bootstraps the cut-off return.

Step infos: the runner reads none of a sub-env's per-step ``info`` (the vector env adds
``final_obs`` itself), so each sub-env is wrapped to return ``{}`` and the vector env has
no info to gather into arrays: on HalfCheetah that gathering is about a quarter of a vector
step. ``foreach_env`` still hands the env as built, not the wrapper.

Box actions: the batch keeps each action as the policy drew it (its ``logp`` is that
value's), and the env gets it clipped to the action space's bounds (CleanRL's
``ClipAction``); nothing is rescaled, so the policy's Gaussian works in the bounds' own
units (MuJoCo's are [-1, 1]).
"""

from __future__ import annotations

import importlib
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.envs.registration import load_env_creator

from phalanx._base.checks import check_int
from phalanx.envs.config import DEFAULT_POLICY_ID, EnvContext, EnvRunnerGroupConfig
from phalanx.envs.normalize import RunningMeanStd, batch_moments
from phalanx.envs.policy import ActorCritic, act_on_numpy
from phalanx.envs.vector_env import SameStepVectorEnv
from phalanx.worker.worker import Worker

EnvCreator = Callable[[EnvContext], gym.Env]


# Env id namespaces registered by a package that is not installed with gymnasium.
_NAMESPACE_EXTRAS = {"ALE": 'pip install "gymnasium[atari]" (ale-py)'}


def check_env_id(env_id: str) -> None:
    """``ValueError`` naming ``env`` if gymnasium cannot make ``env_id``.

    ``module:EnvId`` (gymnasium's form) imports ``module`` first, which registers the
    id. An id whose extra is not installed (MuJoCo, Box2D, Atari) names the extra.
    """
    module, _, name = env_id.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"env: cannot import {module!r} for {env_id!r} ({e})") from None
    try:
        spec = gym.spec(name)
    except gym.error.NamespaceNotFound as e:
        extra = _NAMESPACE_EXTRAS.get(name.split("/")[0])
        hint = f"; install it with {extra}" if extra else ""
        raise ValueError(f"env: unknown gymnasium env id {env_id!r} ({e}){hint}") from None
    except gym.error.Error as e:
        raise ValueError(f"env: unknown gymnasium env id {env_id!r} ({e})") from None
    if isinstance(spec.entry_point, str):
        try:
            load_env_creator(spec.entry_point)
        except gym.error.DependencyNotInstalled as e:
            raise ValueError(f"env: {env_id!r} needs an extra that is not installed: {e}") from None


def check_spaces(observation_space: gym.Space, action_space: gym.Space) -> None:
    """``ValueError`` (before any runner starts) if the default policy, an MLP on a Box
    observation with a Discrete or Box action, cannot handle the env's spaces."""
    if not isinstance(observation_space, gym.spaces.Box):
        raise ValueError(
            f"env: observation_space {observation_space} is a "
            f"{type(observation_space).__name__} space; the default policy (ActorCritic) "
            "needs a Box: wrap the env in gymnasium.wrappers.FlattenObservation (in an "
            "env_creator) or give a default_policy_class that handles it"
        )
    if not isinstance(action_space, (gym.spaces.Discrete, gym.spaces.Box)):
        raise ValueError(
            f"env: action_space {action_space} is a {type(action_space).__name__} space; "
            "the default policy (ActorCritic) needs a Discrete or Box action space "
            "(give a default_policy_class that handles it)"
        )


def make_env(
    config: EnvRunnerGroupConfig, env_creator: EnvCreator | None, ctx: EnvContext
) -> gym.Env:
    """One sub-environment for ``ctx`` (from the creator, else from the env id)."""
    if env_creator is not None:
        env = env_creator(ctx)
        if not isinstance(env, gym.Env):
            raise TypeError(f"env_creator must return a gymnasium.Env, got {type(env).__name__}")
        return env
    if config.env is None:
        raise ValueError("env: give a gymnasium env id or an env_creator")
    return gym.make(config.env, disable_env_checker=True, **config.env_config)


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A state dict of arrays or tensors as tensors, without copying.

    Arrays from Ray's object store are read-only; torch warns that a tensor over one could
    be written, but ``load_state_dict`` only reads them (it copies into the parameters).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {k: torch.as_tensor(v) for k, v in state.items()}


_NONE = np.zeros(0, np.int64)  # no sub-env finished in a step
_DELTA_ROWS = 256  # steps whose observations wait for one merge into the normaliser's delta


class NoStepInfo(gym.Wrapper):
    """A sub-env whose ``step`` returns an empty info (see the module's docstring). The
    env's own public attributes stay reachable through it (``runner.env.envs[i].x``)."""

    def __getattr__(self, name: str) -> Any:
        if name == "env" or name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.env, name)

    def step(self, action: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        obs, reward, terminated, truncated, _ = self.env.step(action)
        return obs, reward, terminated, truncated, {}


class EnvRunner(Worker):
    """Samples a gymnasium vector env with its policies (RLlib's ``SingleAgentEnvRunner``).

    ``EnvRunner(config, env_creator=None, validate_env=None, default_policy_class=None,
    worker_index=None)``. ``worker_index`` is RLlib's: 0 for the local runner, else
    ``rank + 1`` (the default inside a group).

    Args:
        config: the group's config.
        env_creator: builds one env from an ``EnvContext`` (``gymnasium.make(config.env)``
            if None).
        validate_env: called with each new env; raises to refuse it.
        default_policy_class: the default policy's module class.
        worker_index: the runner's id.
    """

    read_only_weights = True  # inference only: same-node sends give it views, not copies

    def __init__(
        self,
        config: EnvRunnerGroupConfig,
        env_creator: EnvCreator | None = None,
        validate_env: Callable[[gym.Env], None] | None = None,
        default_policy_class: type[torch.nn.Module] | None = None,
        worker_index: int | None = None,
    ):
        super().__init__()
        torch.set_num_threads(1)  # a runner's MLP is tiny; threads only fight the envs
        if isinstance(config, dict):
            config = EnvRunnerGroupConfig.from_dict(config)
        config.validate()
        self.config = config
        self.worker_index = self.rank + 1 if worker_index is None else worker_index
        self._env_creator = env_creator
        self._validate_env = validate_env
        n = config.num_envs_per_env_runner
        self._build_envs(recreated=False)
        self.observation_space = self.env.single_observation_space
        self.action_space = self.env.single_action_space
        self.default_policy_class = default_policy_class or ActorCritic
        self.policies: dict[str, torch.nn.Module] = {}
        self.policies_to_train: set[str] | None = (
            None if config.policies_to_train is None else set(config.policies_to_train)
        )
        self._policy_specs: dict[str, dict[str, Any]] = {}
        self.add_policy(DEFAULT_POLICY_ID, self.default_policy_class, config=config.policy_config)
        obs_shape = self.observation_space.shape or ()
        self._obs_rms = RunningMeanStd(obs_shape) if config.normalize_observations else None
        self._obs_delta = RunningMeanStd(obs_shape, 0.0) if config.normalize_observations else None
        self._delta_rows: list[np.ndarray] = []  # observations not yet in _obs_delta
        self._obs: np.ndarray | None = None
        self._ep_ret = np.zeros(n)
        self._ep_len = np.zeros(n, np.int64)
        self._needs_reset = True
        self._seeded = False
        self._update_norm = True
        self.num_env_steps_sampled = 0
        self.global_vars: dict[str, Any] = {}  # set by EnvRunnerGroup.sync_weights(global_vars=...)

    def _build_envs(self, recreated: bool) -> None:
        """The vector env of this runner's ``worker_index``; seeds torch for it."""
        self._contexts = [
            EnvContext(
                self.config.env_config,
                worker_index=self.worker_index,
                vector_index=i,
                num_workers=self.config.num_env_runners,
                remote=self.worker_index > 0,
                recreated_worker=recreated,
            )
            for i in range(self.config.num_envs_per_env_runner)
        ]
        fns = [self._env_fn(ctx) for ctx in self._contexts]
        # It reuses its observation buffer: the runner keeps only normalised copies.
        self.env = SameStepVectorEnv(fns)
        self._sub_envs = [e.env for e in self.env.envs]  # as built, without NoStepInfo
        seed = None if self.config.seed is None else self.config.seed + self.worker_index
        if seed is not None:
            torch.manual_seed(seed)
        self._rng = np.random.default_rng(seed)  # exploration noise of act_numpy policies

    def _env_fn(self, ctx: EnvContext) -> Callable[[], gym.Env]:
        def make() -> gym.Env:
            env = make_env(self.config, self._env_creator, ctx)
            if self._validate_env is not None:
                self._validate_env(env)
            return NoStepInfo(env)

        return make

    def take_over(self, worker_index: int, state: dict[str, Any]) -> int:
        """Become runner ``worker_index`` in place of a failed one (a standby runner's
        take-over): envs rebuilt for that index (``recreated_worker``), ``state`` set as
        after a restart; episodes start afresh. Returns the weights version it holds.

        Args:
            worker_index: the failed runner's id (1..n).
            state: the state to set.

        Returns:
            The weights version.

        Raises:
            ValueError: ``worker_index`` is below 1, or its envs' spaces differ from this
                runner's.
        """
        check_int(worker_index, "worker_index", minimum=1)
        self.env.close()
        self.worker_index = worker_index
        self._build_envs(recreated=True)
        spaces = (self.env.single_observation_space, self.env.single_action_space)
        if spaces != (self.observation_space, self.action_space):
            raise ValueError(
                f"take_over: env runner {worker_index}'s envs have spaces {spaces}, this "
                f"runner's policies were built for {(self.observation_space, self.action_space)}"
            )
        self.set_state(state)
        self._needs_reset = True
        self._seeded = False
        return self.weights_version

    # -- policies -----------------------------------------------------------------------
    def weights_module(self) -> torch.nn.Module:
        """All policies as one module (names ``<policy_id>.<param>``) for weight sync.

        Returns:
            A ``ModuleDict`` of the policies.
        """
        return torch.nn.ModuleDict(self.policies)

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
    ) -> torch.nn.Module:
        """Add (or replace) a policy: an instance, or ``policy_cls(obs_space, act_space, **config)``.

        Args:
            policy_id: the policy's id.
            policy_cls: a module class, built as ``policy_cls(obs_space, act_space, **config)``.
            policy: a module instance.
            observation_space: the policy's observation space (the env's if None).
            action_space: the policy's action space (the env's if None).
            config: keyword arguments of ``policy_cls``.
            policy_state: a state dict loaded into the policy.

        Returns:
            The policy.

        Raises:
            ValueError: ``policy_id`` is empty or has a ``.``.
            TypeError: ``policy`` is not a torch module.
        """
        if not isinstance(policy_id, str) or not policy_id or "." in policy_id:
            raise ValueError(f"policy_id must be a non-empty str without '.', got {policy_id!r}")
        if policy is None:
            cls = policy_cls or self.default_policy_class
            policy = cls(
                observation_space or self.observation_space,
                action_space or self.action_space,
                **(config or {}),
            )
        if not isinstance(policy, torch.nn.Module):
            raise TypeError(f"policy must be a torch.nn.Module, got {type(policy).__name__}")
        if policy_state is not None:
            policy.load_state_dict(_tensors(policy_state))
        self.policies[policy_id] = policy
        self._policy_specs[policy_id] = {
            "policy_cls": type(policy),
            "observation_space": observation_space or self.observation_space,
            "action_space": action_space or self.action_space,
            "config": dict(config or {}),
        }
        return policy

    @property
    def module(self) -> torch.nn.Module:
        """The default policy's module (RLlib's ``EnvRunner.module``)."""
        return self.policies[DEFAULT_POLICY_ID]

    def remove_policy(self, policy_id: str) -> None:
        """Remove the policy of id ``policy_id``.

        Args:
            policy_id: the policy's id.

        Raises:
            ValueError: it is the default policy.
            KeyError: there is no such policy.
        """
        if policy_id == DEFAULT_POLICY_ID:
            raise ValueError("policy_id: the default policy cannot be removed")
        self.policies.pop(policy_id)
        self._policy_specs.pop(policy_id, None)

    def get_policy(self, policy_id: str = DEFAULT_POLICY_ID) -> torch.nn.Module:
        """The policy of id ``policy_id``.

        Args:
            policy_id: the policy's id.

        Returns:
            The policy module.

        Raises:
            KeyError: there is no such policy.
        """
        try:
            return self.policies[policy_id]
        except KeyError:
            raise KeyError(
                f"policy_id {policy_id!r}: no such policy (have {sorted(self.policies)})"
            ) from None

    def policy_ids(self) -> list[str]:
        """The ids of this runner's policies.

        Returns:
            The ids.
        """
        return list(self.policies)

    def is_policy_to_train(self, policy_id: str, batch: Any = None) -> bool:
        """Whether ``policy_id`` is trained.

        Args:
            policy_id: the policy's id.
            batch: accepted for RLlib's signature.

        Returns:
            True unless ``policies_to_train`` leaves it out.
        """
        return self.policies_to_train is None or policy_id in self.policies_to_train

    def set_policies_to_train(self, policies_to_train: list[str] | None) -> None:
        """Set which policies are trained (None: all).

        Args:
            policies_to_train: the policy ids, or None.
        """
        self.policies_to_train = None if policies_to_train is None else set(policies_to_train)

    def foreach_policy(self, func: Callable[..., Any], **kwargs: Any) -> list[Any]:
        """``[func(policy, policy_id, **kwargs) for each policy]``.

        Args:
            func: called as ``func(policy, policy_id, **kwargs)``.
            **kwargs: its keyword arguments.

        Returns:
            The results, one per policy.
        """
        return [func(p, pid, **kwargs) for pid, p in self.policies.items()]

    def foreach_policy_to_train(self, func: Callable[..., Any], **kwargs: Any) -> list[Any]:
        """``[func(policy, policy_id, **kwargs) for each policy to train]``.

        Args:
            func: called as ``func(policy, policy_id, **kwargs)``.
            **kwargs: its keyword arguments.

        Returns:
            The results, one per policy to train.
        """
        return [
            func(p, pid, **kwargs)
            for pid, p in self.policies.items()
            if self.is_policy_to_train(pid)
        ]

    def get_weights(self, policies: list[str] | None = None) -> dict[str, dict[str, np.ndarray]]:
        """``{policy_id: state dict as numpy arrays}``.

        Args:
            policies: the policy ids (every policy if None).

        Returns:
            A dict from policy id to its state dict.

        Raises:
            KeyError: a policy id is unknown.
        """
        ids = list(self.policies) if policies is None else policies
        return {
            pid: {
                k: v.detach().cpu().numpy().copy()
                for k, v in self.get_policy(pid).state_dict().items()
            }
            for pid in ids
        }

    def set_weights(
        self, weights: dict[str, dict[str, Any]], weights_version: int | None = None
    ) -> None:
        """Load ``{policy_id: state dict}`` (the local runner's way of receiving weights).

        Args:
            weights: a dict from policy id to its state dict.
            weights_version: the version these weights are.

        Raises:
            KeyError: a policy id is unknown.
        """
        for pid, sd in weights.items():
            self.get_policy(pid).load_state_dict(_tensors(sd))
        if weights_version is not None:
            self._px_weights_version = int(weights_version)

    # -- envs ---------------------------------------------------------------------------
    def get_spaces(self) -> dict[str, tuple[gym.Space, gym.Space]]:
        """``{"__env__": (obs, act) of one sub-env, policy_id: (obs, act), ...}``.

        Returns:
            A dict from ``"__env__"`` and each policy id to ``(observation space, action space)``.
        """
        out = {"__env__": (self.observation_space, self.action_space)}
        for pid, spec in self._policy_specs.items():
            out[pid] = (spec["observation_space"], spec["action_space"])
        return out

    def foreach_env(self, func: Callable[[gym.Env], Any]) -> list[Any]:
        """``[func(sub_env) for each sub-environment]``.

        Args:
            func: called with each sub-environment.

        Returns:
            The results, one per sub-environment.
        """
        return [func(e) for e in self._sub_envs]

    def foreach_env_with_context(self, func: Callable[[gym.Env, EnvContext], Any]) -> list[Any]:
        """``[func(sub_env, env_context) for each sub-environment]``.

        Args:
            func: called with each sub-environment and its ``EnvContext``.

        Returns:
            The results, one per sub-environment.
        """
        return [func(e, ctx) for e, ctx in zip(self._sub_envs, self._contexts)]

    def _reset(self) -> None:
        seed = None
        if self.config.seed is not None and not self._seeded:
            # Seeded once; later resets go on with each sub-env's own seeded generator.
            seed = [
                self.config.seed + 1000 * self.worker_index + i for i in range(self.env.num_envs)
            ]
            self._seeded = True
        self._obs, _ = self.env.reset(seed=seed)
        self._ep_ret[:] = 0
        self._ep_len[:] = 0
        self._needs_reset = False

    # -- connector state ----------------------------------------------------------------
    def _check_finite(self, obs: np.ndarray) -> None:
        """Observations enter the batch here: a NaN or inf stops the runner, naming it."""
        if obs.dtype.kind == "f" and not np.isfinite(obs).all():
            bad = int(np.flatnonzero(~np.isfinite(obs).reshape(len(obs), -1).all(axis=1))[0])
            env_id = self.config.env or getattr(self._sub_envs[bad].spec, "id", "env_creator")
            raise ValueError(
                f"env {env_id}: non-finite observation from sub-env {bad} of env runner "
                f"{self.worker_index}: {obs[bad]!r}"
            )

    def _normalize(self, obs: np.ndarray, update: bool) -> np.ndarray:
        self._check_finite(obs)
        if self._obs_rms is None:
            return np.array(obs, np.float32)  # a copy: the vector env reuses its buffer
        if update and self._update_norm:
            self._obs_rms.merge_moments(*batch_moments(obs))
            self._delta_rows.append(obs.copy())
            if len(self._delta_rows) == _DELTA_ROWS:
                self._merge_delta()
        return self._obs_rms.normalize(obs)

    def _merge_delta(self) -> None:
        """Fold the observations kept since the last merge into the delta: at the end of a
        sample call (it is read only between calls) and every ``_DELTA_ROWS`` steps (so a
        long call keeps few); one merge of many rows costs what one of a step does."""
        if self._delta_rows:
            self._obs_delta.merge_moments(*batch_moments(np.concatenate(self._delta_rows)))
            self._delta_rows.clear()

    def get_connector_state(self) -> dict[str, Any]:
        """The normaliser's statistics seen since the last sync (``obs_norm_delta``) and in all.

        Returns:
            ``{"obs_norm": ..., "obs_norm_delta": ...}``, or ``{}`` without normalisation.
        """
        if self._obs_rms is None:
            return {}
        return {
            "obs_norm": self._obs_rms.get_state(),
            "obs_norm_delta": self._obs_delta.get_state(),
        }

    def set_connector_state(self, state: dict[str, Any]) -> None:
        """Adopt merged statistics (``{"obs_norm": ...}``); the delta starts again from zero.

        Args:
            state: the merged state.
        """
        if self._obs_rms is None or not state or state.get("obs_norm") is None:
            return
        self._obs_rms.set_state(state["obs_norm"])
        self._obs_delta = RunningMeanStd(self._obs_rms.mean.shape, 0.0)

    def get_state(self) -> dict[str, Any]:
        """What a restarted runner needs besides the weights: normaliser and extra policies.

        Returns:
            The state, for ``set_state``.
        """
        extra = {
            pid: {**spec, "policy_state": self.get_weights([pid])[pid]}
            for pid, spec in self._policy_specs.items()
            if pid != DEFAULT_POLICY_ID
        }
        conn = self.get_connector_state()
        return {
            "connector": {"obs_norm": conn.get("obs_norm")},
            "policies": extra,
            "policies_to_train": self.policies_to_train,
            "num_env_steps_sampled": self.num_env_steps_sampled,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore a state from ``get_state`` (after a restart or a take-over).

        Args:
            state: the state.
        """
        for pid, spec in (state.get("policies") or {}).items():
            self.add_policy(
                pid,
                spec["policy_cls"],
                observation_space=spec["observation_space"],
                action_space=spec["action_space"],
                config=spec["config"],
                policy_state=spec["policy_state"],
            )
        if "policies_to_train" in state:
            pt = state["policies_to_train"]
            self.policies_to_train = None if pt is None else set(pt)
        self.set_connector_state(state.get("connector") or {})
        if "num_env_steps_sampled" in state:
            self.num_env_steps_sampled = int(state["num_env_steps_sampled"])
        if "global_vars" in state:
            self.global_vars = dict(state["global_vars"])

    def ping(self) -> str:
        """``"pong"``: the health probe. It queues behind a running call, so a runner stuck
        in ``sample`` does not answer until that call ends.

        Returns:
            ``"pong"``.
        """
        return "pong"

    # -- sampling -----------------------------------------------------------------------
    def sample(
        self,
        num_timesteps: int | None = None,
        num_episodes: int | None = None,
        *,
        explore: bool | None = None,
        random_actions: bool = False,
        force_reset: bool = False,
        policy_id: str = DEFAULT_POLICY_ID,
        update_connectors: bool = True,
    ) -> dict[str, Any]:
        """Step the envs and return a batch of numpy arrays.

        ``num_timesteps``: ``T = ceil(num_timesteps / num_envs)`` steps of every sub-env,
        returned time-major (``obs [T, N, ...]``, ``actions``, ``logp``, ``rewards``,
        ``terminateds``, ``truncateds``, ``values``, ``final_values`` ``[T, N]``,
        ``last_values [N]``); episodes go on across calls.
        ``num_episodes``: reset, then exactly that many complete episodes, their steps
        concatenated (``[L, ...]``, ``L = sum(episode_lengths)``).
        Neither: ``rollout_fragment_length`` steps of every sub-env.
        Both modes add ``episode_returns``/``episode_lengths`` of the episodes that
        finished, ``timesteps``, ``weights_version`` and ``worker_index``.
        ``update_connectors=False`` keeps the observation normaliser fixed (evaluation).

        Args:
            num_timesteps: steps to take in all.
            num_episodes: complete episodes to run.
            explore: sample actions (True) or take the most likely (False; the config's if None).
            random_actions: take uniformly random actions.
            force_reset: reset the envs first.
            policy_id: the policy that acts.
            update_connectors: update the observation normaliser.

        Returns:
            The batch, a dict of numpy arrays.

        Raises:
            ValueError: both ``num_timesteps`` and ``num_episodes`` are given.
        """
        if num_timesteps is not None and num_episodes is not None:
            raise ValueError("give num_timesteps or num_episodes, not both")
        for name, v in (("num_timesteps", num_timesteps), ("num_episodes", num_episodes)):
            if v is not None:
                check_int(v, name, minimum=1)
        policy = self.get_policy(policy_id)
        explore = self.config.explore if explore is None else explore
        t0 = time.perf_counter()
        self._update_norm = update_connectors
        try:
            with torch.inference_mode():
                if num_episodes is not None:
                    batch = self._sample_episodes(policy, num_episodes, explore, random_actions)
                else:
                    n = self.env.num_envs
                    steps = (
                        math.ceil(num_timesteps / n)
                        if num_timesteps is not None
                        else self.config.rollout_fragment_length
                    )
                    if force_reset:
                        self._needs_reset = True
                    batch = self._sample_steps(policy, steps, explore, random_actions)
        except BaseException:
            # The envs may be mid-step: the next call starts from fresh episodes.
            self._needs_reset = True
            raise
        finally:
            self._merge_delta()
        batch["weights_version"] = self.weights_version
        batch["worker_index"] = self.worker_index
        batch["sample_time_s"] = time.perf_counter() - t0
        self.num_env_steps_sampled += batch["timesteps"]
        return batch

    def _act(
        self, policy: torch.nn.Module, nobs: np.ndarray, explore: bool, random_actions: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        if not random_actions:
            return act_on_numpy(policy, nobs, explore, self._rng)
        a = np.stack([self.action_space.sample() for _ in range(len(nobs))])
        logp, _, v = policy.evaluate(torch.from_numpy(nobs), torch.as_tensor(a))
        return a, logp.numpy(), None if v is None else v.numpy()

    def _env_action(self, a: np.ndarray) -> np.ndarray:
        if isinstance(self.action_space, gym.spaces.Box):
            # np.clip's Python dispatch costs more than the two ufuncs on a few rows.
            return np.minimum(np.maximum(a, self.action_space.low), self.action_space.high)
        return a

    def _value(self, policy: torch.nn.Module, nobs: np.ndarray) -> np.ndarray | None:
        fn = getattr(policy, "value", None)
        if fn is None:
            return None
        return fn(torch.from_numpy(nobs)).numpy()

    def _finished(
        self, done: np.ndarray, rewards: np.ndarray, returns: list[float], lengths: list[int]
    ) -> np.ndarray:
        self._ep_ret += rewards
        self._ep_len += 1
        if not done.any():
            return _NONE
        idx = np.flatnonzero(done)
        for i in idx:
            returns.append(float(self._ep_ret[i]))
            lengths.append(int(self._ep_len[i]))
        self._ep_ret[idx] = 0
        self._ep_len[idx] = 0
        return idx

    def _final_values(
        self, policy: torch.nn.Module, info: dict, term: np.ndarray, trunc: np.ndarray
    ) -> np.ndarray:
        """``V(final_obs)`` for sub-envs truncated (not terminated) in this step, else 0."""
        out = np.zeros(len(term), np.float32)
        cut = np.flatnonzero(trunc & ~term)
        if len(cut) and "final_obs" in info:
            final = np.stack([info["final_obs"][i] for i in cut])
            v = self._value(policy, self._normalize(final, update=False))
            if v is not None:
                out[cut] = v
        return out

    def _sample_steps(
        self, policy: torch.nn.Module, steps: int, explore: bool, random_actions: bool
    ) -> dict[str, Any]:
        if self._needs_reset or self._obs is None:
            self._reset()
        n = self.env.num_envs
        obs_shape = self.observation_space.shape or ()
        act_shape = self.action_space.shape or ()
        act_dtype = np.int64 if isinstance(self.action_space, gym.spaces.Discrete) else np.float32
        obs_buf = np.empty((steps, n, *obs_shape), np.float32)
        act_buf = np.empty((steps, n, *act_shape), act_dtype)
        logp_buf = np.empty((steps, n), np.float32)
        rew_buf = np.empty((steps, n), np.float32)
        term_buf = np.empty((steps, n), bool)
        trunc_buf = np.empty((steps, n), bool)
        val_buf = np.zeros((steps, n), np.float32)
        final_buf = np.zeros((steps, n), np.float32)
        returns: list[float] = []
        lengths: list[int] = []
        obs = self._obs
        for t in range(steps):
            nobs = self._normalize(obs, update=True)
            a, logp, v = self._act(policy, nobs, explore, random_actions)
            obs, r, term, trunc, info = self.env.step(self._env_action(a))
            obs_buf[t] = nobs
            act_buf[t] = a
            logp_buf[t] = logp
            rew_buf[t] = r
            term_buf[t] = term
            trunc_buf[t] = trunc
            if v is not None:
                val_buf[t] = v
            if self._finished(term | trunc, r, returns, lengths).size and trunc.any():
                final_buf[t] = self._final_values(policy, info, term, trunc)
        self._obs = obs
        last = self._value(policy, self._normalize(obs, update=False))
        return {
            "obs": obs_buf,
            "actions": act_buf,
            "logp": logp_buf,
            "rewards": rew_buf,
            "terminateds": term_buf,
            "truncateds": trunc_buf,
            "values": val_buf,
            "final_values": final_buf,
            "last_values": np.zeros(n, np.float32) if last is None else last,
            "episode_returns": np.asarray(returns, np.float64),
            "episode_lengths": np.asarray(lengths, np.int64),
            "timesteps": steps * n,
        }

    def _sample_episodes(
        self, policy: torch.nn.Module, count: int, explore: bool, random_actions: bool
    ) -> dict[str, Any]:
        self._reset()
        n = self.env.num_envs
        deadline = time.monotonic() + self.config.sample_timeout_s
        keys = (
            "obs",
            "actions",
            "logp",
            "rewards",
            "terminateds",
            "truncateds",
            "values",
            "final_values",
        )
        steps: dict[str, list[np.ndarray]] = {k: [] for k in keys}
        start = np.zeros(n, np.int64)
        episodes: list[dict[str, np.ndarray]] = []
        returns: list[float] = []
        lengths: list[int] = []
        obs = self._obs
        t = 0
        while len(episodes) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"sample(num_episodes={count}): only {len(episodes)} episodes finished "
                    f"within sample_timeout_s={self.config.sample_timeout_s}"
                )
            nobs = self._normalize(obs, update=True)
            a, logp, v = self._act(policy, nobs, explore, random_actions)
            obs, r, term, trunc, info = self.env.step(self._env_action(a))
            row = {
                "obs": nobs,
                "actions": a,
                "logp": logp,
                "rewards": np.asarray(r, np.float32),
                "terminateds": term,
                "truncateds": trunc,
                "values": np.zeros(n, np.float32) if v is None else v,
                "final_values": self._final_values(policy, info, term, trunc)
                if trunc.any()
                else np.zeros(n, np.float32),
            }
            for k in keys:
                steps[k].append(row[k])
            ep_returns: list[float] = []
            ep_lengths: list[int] = []
            for k, i in enumerate(self._finished(term | trunc, r, ep_returns, ep_lengths)):
                if len(episodes) < count:
                    episodes.append(
                        {
                            key: np.stack([s[i] for s in steps[key][start[i] : t + 1]])
                            for key in keys
                        }
                    )
                    returns.append(ep_returns[k])
                    lengths.append(ep_lengths[k])
                start[i] = t + 1
            t += 1
        self._obs = obs
        self._needs_reset = True  # unfinished episodes were dropped
        batch = {key: np.concatenate([e[key] for e in episodes]) for key in keys}
        batch["episode_returns"] = np.asarray(returns, np.float64)
        batch["episode_lengths"] = np.asarray(lengths, np.int64)
        batch["timesteps"] = int(sum(lengths))
        return batch

    def stop(self) -> None:
        """Close the environments."""
        self.env.close()
