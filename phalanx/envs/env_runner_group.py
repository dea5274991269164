"""EnvRunnerGroup: RLlib's set of env runners, on a fault-tolerant phalanx WorkerGroup.

Zero or one *local* runner lives in the driver process; ``num_env_runners`` *remote*
runners are the workers of one phalanx ``WorkerGroup`` launched with a
``RestartPolicy`` built from the config. Health, restarts, ``foreach_worker*`` and async
requests delegate to that group's fault-tolerance API; weights go through
``phalanx.weights.WeightSender``, which also re-sends the latest version to a runner
after it was restarted; connector state (the observation normaliser) is merged across
runners and registered on the group so a restarted runner gets it back.

Worker ids follow RLlib: 0 is the local runner, remote runners are ``1..n`` (the phalanx
rank plus one, and the ``worker_index`` of their :class:`EnvContext`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import ray
import torch

from phalanx._base.errors import GroupTimeoutError, WorkerDiedError
from phalanx.envs.config import DEFAULT_POLICY_ID, EnvContext, EnvRunnerGroupConfig
from phalanx.envs.env_runner import EnvCreator, EnvRunner, check_env_id, make_env
from phalanx.envs.normalize import RunningMeanStd
from phalanx.group.fault import RestartPolicy
from phalanx.group.futures import GroupHandle
from phalanx.group.group import WorkerGroup
from phalanx.resources.cluster import Cluster
from phalanx.resources.placement import NodePlacement

logger = logging.getLogger(__name__)


class EnvRunnerGroup:
    """Set of EnvRunners: ``n`` remote runners (a phalanx group) and zero or one local one.

    ``EnvRunnerGroup(*, env_creator=None, validate_env=None, default_policy_class=None,
    config=None, num_env_runners=None, local_env_runner=True, logdir=None, ...)``.
    ``config`` is an :class:`EnvRunnerGroupConfig` (or a dict of its fields);
    ``num_env_runners=None`` takes the config's. ``cluster`` and ``name`` choose where the
    remote runners start and the group's name. Bad options raise before any worker starts.
    """

    def __init__(
        self,
        *,
        env_creator: EnvCreator | None = None,
        validate_env: Callable[[gym.Env], None] | None = None,
        default_policy_class: type[torch.nn.Module] | None = None,
        config: EnvRunnerGroupConfig | dict[str, Any] | None = None,
        num_env_runners: int | None = None,
        local_env_runner: bool = True,
        logdir: str | None = None,
        _setup: bool = True,
        tune_trial_id: str | None = None,
        num_workers: int = -1,
        local_worker: int | bool = -1,
        cluster: Cluster | None = None,
        name: str | None = None,
    ):
        # RLlib's deprecated spellings.
        if num_workers != -1:
            num_env_runners = num_workers
        if local_worker != -1:
            local_env_runner = bool(local_worker)
        if config is None:
            config = EnvRunnerGroupConfig()
        elif isinstance(config, dict):
            config = EnvRunnerGroupConfig.from_dict(config)
        elif not isinstance(config, EnvRunnerGroupConfig):
            raise TypeError(
                f"config must be an EnvRunnerGroupConfig or a dict, got {type(config).__name__}"
            )
        if num_env_runners is not None:
            from dataclasses import replace

            config = replace(config, num_env_runners=num_env_runners)
        config.validate()
        if not isinstance(local_env_runner, bool):
            raise TypeError(f"local_env_runner must be a bool, got {local_env_runner!r}")
        if config.num_env_runners == 0 and not local_env_runner:
            raise ValueError(
                "num_env_runners=0 with local_env_runner=False leaves no env runner to sample "
                "with: set num_env_runners >= 1 or local_env_runner=True"
            )
        if env_creator is None:
            if config.env is None:
                raise ValueError("env: give config.env (a gymnasium env id) or an env_creator")
            check_env_id(config.env)
        elif not callable(env_creator):
            raise TypeError(f"env_creator must be callable, got {type(env_creator).__name__}")
        if validate_env is not None and not callable(validate_env):
            raise TypeError(f"validate_env must be callable, got {type(validate_env).__name__}")
        if default_policy_class is not None and not (
            isinstance(default_policy_class, type)
            and issubclass(default_policy_class, torch.nn.Module)
        ):
            raise TypeError("default_policy_class must be a torch.nn.Module subclass")
        if cluster is not None and not isinstance(cluster, Cluster):
            raise TypeError(f"cluster must be a phalanx Cluster, got {type(cluster).__name__}")
        self.config = config
        self.logdir = logdir
        self.tune_trial_id = tune_trial_id
        self._env_creator = env_creator
        self._validate_env = validate_env
        self._default_policy_class = default_policy_class
        self._cluster = cluster
        self._name = name
        self._group: WorkerGroup | None = None
        self._sender: Any = None
        self._sync_pending = False
        self._local: EnvRunner | None = None
        self._obs_norm: RunningMeanStd | None = None
        self._added_policies: dict[str, dict[str, Any]] = {}
        self._policies_to_train = (
            None if config.policies_to_train is None else list(config.policies_to_train)
        )
        self.num_env_steps_sampled = 0
        self._weights_version = 0
        self.global_vars: dict[str, Any] = {}
        if not _setup:
            return
        self._check_spaces_before_start(config.num_env_runners, local_env_runner)
        if local_env_runner:
            self._local = EnvRunner(
                config, env_creator, validate_env, default_policy_class, worker_index=0
            )
        if config.num_env_runners > 0:
            self.add_workers(config.num_env_runners, validate=True)

    # ------------------------------------------------------------------ setup
    def _check_spaces_before_start(self, num_remote: int, local: bool) -> None:
        """Build each future runner's first sub-env here and compare spaces (no worker yet)."""
        indices = ([0] if local else []) + list(range(1, num_remote + 1))
        if self._env_creator is None:
            indices = indices[:1]  # an env id makes the same env everywhere
        first: tuple[int, gym.Space, gym.Space] | None = None
        for wi in indices:
            ctx = EnvContext(
                self.config.env_config,
                worker_index=wi,
                num_workers=self.config.num_env_runners,
                remote=wi > 0,
            )
            env = make_env(self.config, self._env_creator, ctx)
            try:
                if self._validate_env is not None:
                    self._validate_env(env)
                obs, act = env.observation_space, env.action_space
            finally:
                env.close()
            if first is None:
                first = (wi, obs, act)
            elif (obs, act) != first[1:]:
                raise ValueError(
                    f"env_creator: spaces mismatch between env runners: worker_index {first[0]} "
                    f"has observation_space={first[1]}, action_space={first[2]}; worker_index "
                    f"{wi} has observation_space={obs}, action_space={act}"
                )

    def _restart_policy(self) -> RestartPolicy:
        c = self.config
        if not c.restart_failed_env_runners:
            return RestartPolicy.never(ignore_failures=c.ignore_env_runner_failures)
        return RestartPolicy(
            max_restarts_per_worker=c.max_num_env_runner_restarts,
            delay_s=float(c.delay_between_env_runner_restarts_s),
            health_probe_timeout_s=float(c.env_runner_health_probe_timeout_s),
            ignore_failures=c.ignore_env_runner_failures,
        )

    @property
    def _fault_tolerant(self) -> bool:
        return self.config.restart_failed_env_runners or self.config.ignore_env_runner_failures

    def add_workers(self, num_workers: int, validate: bool = False) -> None:
        """Create and add ``num_workers`` remote runners.

        A phalanx group has a fixed size, so adding to an existing group starts a new,
        larger group and hands it the current weights and connector state (the old
        runners' unfinished episodes are dropped).
        """
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        old = self._group
        total = num_workers + (old.world_size if old is not None else 0)
        carried = None
        if old is not None:
            if self._local is not None:
                carried = None  # the local runner is the weight source below
            else:
                carried = self._remote_weights()
            self._close_sender()
            old.shutdown(force=True)
            self._group = None
        from dataclasses import replace

        self.config = replace(self.config, num_env_runners=total)
        group = EnvRunner.create_group(
            self.config, self._env_creator, self._validate_env, self._default_policy_class
        )
        group.launch(
            self._cluster,
            placement=NodePlacement(
                num_workers=total, num_cpus=self.config.num_cpus_per_env_runner
            ),
            name=self._name,
            restart_policy=self._restart_policy(),
        )
        group.max_requests_in_flight_per_worker = self.config.max_requests_in_flight_per_env_runner
        self._group = group
        if validate:
            self._validate_remote_spaces()
        if self._added_policies or self._obs_norm is not None:
            group.foreach_worker(_apply_state, kwargs={"state": self._restore_state()})
        self._register_restore_state()
        if self._local is not None:
            self.sync_weights(timeout_seconds=None)
        elif carried is not None:
            self.sync_weights(from_worker_or_learner_group=carried, timeout_seconds=None)

    def _validate_remote_spaces(self) -> None:
        spaces = self._group.foreach_worker(
            _env_spaces, timeout_seconds=self.config.sample_timeout_s
        )
        ref = (
            spaces[0]
            if self._local is None
            else (
                self._local.observation_space,
                self._local.action_space,
            )
        )
        for wid, sp in enumerate(spaces, start=1):
            if sp != ref:
                self.stop()
                raise ValueError(
                    f"env_creator: spaces mismatch between env runners: worker {wid} has "
                    f"observation_space={sp[0]}, action_space={sp[1]}; expected {ref}"
                )

    # ------------------------------------------------------------------ ids
    def _ranks(
        self, worker_ids: list[int] | None, arg: str = "remote_worker_ids"
    ) -> list[int] | None:
        if worker_ids is None:
            return None
        if isinstance(worker_ids, int):
            worker_ids = [worker_ids]
        n = self.num_remote_workers()
        bad = [
            i
            for i in worker_ids
            if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= n
        ]
        if bad:
            raise ValueError(
                f"{arg}: ids {bad} are not remote env runners (ids are 1..{n}; 0 is the local runner)"
            )
        return [i - 1 for i in worker_ids]

    # ------------------------------------------------------------------ counts and health
    @property
    def local_env_runner(self) -> EnvRunner | None:
        """The runner in this process (None if created without one)."""
        return self._local

    def local_worker(self) -> EnvRunner | None:
        """RLlib's older name of ``local_env_runner``."""
        return self._local

    @property
    def weights_version(self) -> int:
        """Version of the weights last sent by ``sync_weights`` (0: none yet)."""
        return self._weights_version

    @property
    def remote_group(self) -> WorkerGroup | None:
        """The phalanx ``WorkerGroup`` of the remote runners."""
        return self._group

    def num_remote_workers(self) -> int:
        """The number of remote EnvRunners."""
        return 0 if self._group is None else self._group.world_size

    def num_remote_env_runners(self) -> int:
        """The number of remote EnvRunners."""
        return self.num_remote_workers()

    def healthy_worker_ids(self) -> list[int]:
        """Ids (1..n) of the remote runners that are healthy."""
        return [] if self._group is None else [r + 1 for r in self._group.healthy_worker_ids()]

    def num_healthy_remote_workers(self) -> int:
        return len(self.healthy_worker_ids())

    def num_healthy_workers(self) -> int:
        """Healthy remote runners, plus the local one."""
        return self.num_healthy_remote_workers() + (1 if self._local is not None else 0)

    def num_remote_worker_restarts(self) -> int:
        """How many times remote runners were restarted (and came back)."""
        return 0 if self._group is None else self._group.num_remote_worker_restarts()

    def num_in_flight_async_reqs(self, tags: str | list[str] | None = None) -> int:
        return 0 if self._group is None else self._group.num_in_flight_async_reqs(tags)

    def probe_unhealthy_workers(self, timeout_seconds: float | None = None) -> list[int]:
        """Ping unhealthy runners, restore or restart them; ids of those that came back.

        A runner that comes back gets the registered connector state and extra policies
        (``set_state``) and the latest weights before it takes calls again.
        """
        if self._group is None:
            return []
        if timeout_seconds is None:
            timeout_seconds = self.config.env_runner_health_probe_timeout_s
        return [r + 1 for r in self._group.probe_unhealthy_workers(timeout_seconds)]

    # ------------------------------------------------------------------ foreach
    def foreach_worker(
        self,
        func: Callable[[EnvRunner], Any] | str,
        *,
        kwargs: dict[str, Any] | None = None,
        local_env_runner: bool = True,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
        timeout_seconds: float | None = None,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
        local_worker: bool | None = None,
    ) -> list[Any]:
        """``func(runner)`` (or the runner method named ``func``) on each runner.

        Local runner's result first (if it exists and ``local_env_runner``), then the
        remote runners' in id order.
        """
        if local_worker is not None:
            local_env_runner = local_worker
        out: list[Any] = []
        if local_env_runner and self._local is not None and not return_obj_refs:
            out.append(_call_local(self._local, func, kwargs))
        if self._group is not None:
            out.extend(
                self._group.foreach_worker(
                    func,
                    kwargs=kwargs,
                    healthy_only=healthy_only,
                    remote_worker_ids=self._ranks(remote_worker_ids),
                    timeout_seconds=timeout_seconds,
                    return_obj_refs=return_obj_refs,
                    mark_healthy=mark_healthy,
                )
            )
        return out

    foreach_env_runner = foreach_worker

    def foreach_worker_with_id(
        self,
        func: Callable[[int, EnvRunner], Any] | str,
        *,
        kwargs: dict[str, Any] | None = None,
        local_env_runner: bool = True,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
        timeout_seconds: float | None = None,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
        local_worker: bool | None = None,
    ) -> list[Any]:
        """``func(worker_id, runner)`` on each runner (the local runner's id is 0)."""
        return self.foreach_worker(
            _with_worker_id,
            kwargs={"func": func, "kwargs": kwargs or {}},
            local_env_runner=local_env_runner if local_worker is None else local_worker,
            healthy_only=healthy_only,
            remote_worker_ids=remote_worker_ids,
            timeout_seconds=timeout_seconds,
            return_obj_refs=return_obj_refs,
            mark_healthy=mark_healthy,
        )

    def foreach_worker_async(
        self,
        func: Callable[[EnvRunner], Any] | str,
        *,
        tag: str | None = None,
        kwargs: dict[str, Any] | None = None,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
    ) -> int:
        """Start ``func`` on the remote runners without waiting; returns how many requests
        were sent (runners already at ``max_requests_in_flight_per_env_runner`` are skipped).
        Collect with ``fetch_ready_async_reqs``."""
        if self._group is None:
            return 0
        sub = self._group.foreach_worker_async(
            func,
            tag=tag,
            kwargs=kwargs,
            healthy_only=healthy_only,
            remote_worker_ids=self._ranks(remote_worker_ids),
            max_in_flight_per_worker=self.config.max_requests_in_flight_per_env_runner,
        )
        return int(sub)

    foreach_env_runner_async = foreach_worker_async

    def fetch_ready_async_reqs(
        self,
        *,
        tags: str | list[str] | None = None,
        timeout_seconds: float | None = 0.0,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
    ) -> list[tuple[int, Any]]:
        """``(worker_id, result)`` of finished async requests (waits up to ``timeout_seconds``)."""
        if self._group is None:
            return []
        got = self._group.fetch_ready_async_reqs(
            tags=tags,
            timeout_seconds=timeout_seconds,
            return_obj_refs=return_obj_refs,
            mark_healthy=mark_healthy,
        )
        return [(r + 1, v) for r, v in got]

    def foreach_env(self, func: Callable[[gym.Env], Any]) -> list[list[Any]]:
        """``func(sub_env)`` for every sub-environment; one list per runner (local first)."""
        return self.foreach_worker(_foreach_env, kwargs={"func": func})

    def foreach_env_with_context(
        self, func: Callable[[gym.Env, EnvContext], Any]
    ) -> list[list[Any]]:
        """``func(sub_env, env_context)`` for every sub-environment; one list per runner."""
        return self.foreach_worker(_foreach_env_ctx, kwargs={"func": func})

    # ------------------------------------------------------------------ policies
    def foreach_policy(self, func: Callable[..., Any], **kwargs: Any) -> list[Any]:
        """``func(policy, policy_id, **kwargs)`` for every policy of every runner (flat list)."""
        results = self.foreach_worker(_foreach_policy, kwargs={"func": func, "kwargs": kwargs})
        return [x for per_runner in results for x in per_runner]

    def foreach_policy_to_train(self, func: Callable[..., Any], **kwargs: Any) -> list[Any]:
        """Like ``foreach_policy`` for the policies in ``policies_to_train`` only."""
        results = self.foreach_worker(
            _foreach_policy, kwargs={"func": func, "kwargs": kwargs, "to_train": True}
        )
        return [x for per_runner in results for x in per_runner]

    def is_policy_to_train(self, policy_id: str, batch: Any = None) -> bool:
        """Whether ``policy_id`` is trained (all policies are unless ``policies_to_train`` says)."""
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
            self._group.foreach_worker(
                _add_policy, kwargs={"policy_id": policy_id, "spec": spec}, remote_worker_ids=ranks
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

    # ------------------------------------------------------------------ spaces
    def get_spaces(self) -> dict[str, tuple[gym.Space, gym.Space]]:
        """``{"__env__": (obs, act), policy_id: (obs, act), ...}`` from the local runner,
        else from the first healthy remote runner."""
        if self._local is not None:
            return self._local.get_spaces()
        ids = self.healthy_worker_ids()
        if not ids:
            raise RuntimeError("get_spaces: no local runner and no healthy remote runner")
        return self._group.foreach_worker(
            "get_spaces",
            remote_worker_ids=[ids[0] - 1],
            timeout_seconds=self.config.sample_timeout_s,
        )[0]

    # ------------------------------------------------------------------ weights and state
    def _remote_weights(self) -> dict[str, dict[str, np.ndarray]]:
        ids = self.healthy_worker_ids()
        if not ids:
            raise RuntimeError("no healthy remote runner to read weights from")
        return self._group.foreach_worker(
            "get_weights",
            remote_worker_ids=[ids[0] - 1],
            timeout_seconds=self.config.sample_timeout_s,
        )[0]

    def sync_weights(
        self,
        policies: list[str] | None = None,
        from_worker_or_learner_group: Any = None,
        to_worker_indices: list[int] | None = None,
        global_vars: dict[str, Any] | None = None,
        timeout_seconds: float | None = 0.0,
        inference_only: bool = False,
    ) -> Any:
        """Send policy weights to the remote runners (and the local one) with a new version.

        Source (``from_worker_or_learner_group``): None (the local runner), an
        ``EnvRunner``, a remote worker id (int), an ``nn.Module`` (the default policy), or
        ``{policy_id: nn.Module | state dict}``. ``policies`` limits which policies go.
        ``to_worker_indices``: remote ids (1..n) to update (default: all healthy).
        ``timeout_seconds``: 0 starts the transfer and returns (RLlib's fire-and-forget;
        the next sync completes it), None or > 0 blocks until applied. Returns the
        weight layer's ``SyncResult`` (None while a fire-and-forget send is in flight).
        ``global_vars`` are set on every runner (``runner.global_vars``).
        """
        from phalanx.weights import WeightSender

        weights = self._weights_from(from_worker_or_learner_group, policies)
        ranks = self._ranks(to_worker_indices, "to_worker_indices")
        if timeout_seconds is not None and (
            isinstance(timeout_seconds, bool)
            or not isinstance(timeout_seconds, (int, float))
            or timeout_seconds < 0
        ):
            raise ValueError(f"timeout_seconds must be >= 0 or None, got {timeout_seconds!r}")
        result = None
        if self._group is not None:
            if self._sender is None:
                self._sender = WeightSender(
                    self._group, transport="object_store", timeout_s=self.config.sample_timeout_s
                )
            if self._sync_pending:
                self._sync_pending = False
                self._sender.wait_async()
            healthy = set(self._group.healthy_worker_ids())
            targets = [
                r
                for r in (ranks if ranks is not None else range(self.num_remote_workers()))
                if r in healthy
            ]
            flat = {f"{pid}.{k}": v for pid, sd in weights.items() for k, v in sd.items()}
            if targets:
                if timeout_seconds == 0:
                    self._sender.send_async(flat, worker_ids=targets)
                    self._sync_pending = True
                else:
                    if timeout_seconds is not None:
                        self._sender.timeout_s = float(timeout_seconds)
                    result = self._sender.send(flat, worker_ids=targets)
                    if result.failed:
                        logger.warning("sync_weights: runners failed to apply: %s", result.failed)
        self._weights_version = (
            self._sender.version if self._sender is not None else self._weights_version + 1
        )
        if self._local is not None:
            if from_worker_or_learner_group is None or from_worker_or_learner_group is self._local:
                self._local._px_weights_version = self._weights_version
            else:
                self._local.set_weights(weights, weights_version=self._weights_version)
        if global_vars is not None:
            self.global_vars = dict(global_vars)
            self.foreach_worker(_set_global_vars, kwargs={"global_vars": self.global_vars})
        return result

    def _weights_from(self, source: Any, policies: list[str] | None) -> dict[str, dict[str, Any]]:
        if source is None:
            if self._local is None:
                raise ValueError(
                    "from_worker_or_learner_group: there is no local runner to take weights "
                    "from; pass a module, a {policy_id: module} dict or a worker id"
                )
            weights = {pid: _state(p) for pid, p in self._local.policies.items()}
        elif isinstance(source, EnvRunner):
            weights = {pid: _state(p) for pid, p in source.policies.items()}
        elif isinstance(source, int) and not isinstance(source, bool):
            rank = self._ranks([source], "from_worker_or_learner_group")[0]
            weights = self._group.foreach_worker(
                "get_weights",
                remote_worker_ids=[rank],
                timeout_seconds=self.config.sample_timeout_s,
            )[0]
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

    def sync_env_runner_states(
        self,
        *,
        config: Any = None,
        from_worker: EnvRunner | None = None,
        env_steps_sampled: int | None = None,
        connector_states: list[dict[str, Any]] | None = None,
        env_runner_indices_to_update: list[int] | None = None,
        **_ignored: Any,
    ) -> dict[str, Any]:
        """Merge the runners' connector states and give every runner the merged state.

        The observation normaliser's per-runner deltas since the last sync are folded into
        one global mean/std (from ``connector_states`` if given, else fetched from the
        healthy runners and ``from_worker``/the local runner); the result goes to the
        local runner and the remote runners ``env_runner_indices_to_update`` (default all
        healthy) and is registered so restarted runners get it too. Returns it.
        """
        if env_steps_sampled is not None:
            self.num_env_steps_sampled = int(env_steps_sampled)
        if not self.config.normalize_observations:
            return {}
        if connector_states is None:
            connector_states = []
            if self._group is not None:
                connector_states.extend(
                    self._group.foreach_worker(
                        "get_connector_state", timeout_seconds=self.config.sample_timeout_s
                    )
                )
            src = from_worker if from_worker is not None else self._local
            if src is not None:
                connector_states.append(src.get_connector_state())
        if self._obs_norm is None:
            shape = self.get_spaces()["__env__"][0].shape or ()
            self._obs_norm = RunningMeanStd(shape)
        for st in connector_states:
            if st and st.get("obs_norm_delta") is not None:
                self._obs_norm.merge(st["obs_norm_delta"])
        merged = {"obs_norm": self._obs_norm.get_state()}
        if self._local is not None:
            self._local.set_connector_state(merged)
        if self._group is not None:
            ranks = self._ranks(env_runner_indices_to_update, "env_runner_indices_to_update")
            self._group.foreach_worker(
                "set_connector_state",
                kwargs={"state": merged},
                remote_worker_ids=ranks,
                timeout_seconds=self.config.sample_timeout_s,
            )
            self._register_restore_state()
        return merged

    def get_connector_state(self) -> dict[str, Any]:
        """The merged connector state (what a checkpoint keeps)."""
        return {} if self._obs_norm is None else {"obs_norm": self._obs_norm.get_state()}

    def set_connector_state(self, state: dict[str, Any]) -> None:
        """Set the merged connector state on every runner (e.g. from a checkpoint)."""
        if not state or state.get("obs_norm") is None or not self.config.normalize_observations:
            return
        shape = np.asarray(state["obs_norm"]["mean"]).shape
        self._obs_norm = RunningMeanStd(shape)
        self._obs_norm.set_state(state["obs_norm"])
        self.sync_env_runner_states(connector_states=[])

    def _restore_state(self) -> dict[str, Any]:
        return {
            "connector": {
                "obs_norm": None if self._obs_norm is None else self._obs_norm.get_state()
            },
            "policies": dict(self._added_policies),
            "policies_to_train": self._policies_to_train,
        }

    def _register_restore_state(self) -> None:
        if self._group is not None:
            self._group.register_state(None, self._restore_state())

    # ------------------------------------------------------------------ sampling
    def sample_async(self, **kwargs: Any) -> GroupHandle | None:
        """Start ``sample(**kwargs)`` on every healthy remote runner; collect with
        ``collect_samples``. None when there is no remote runner."""
        if self._group is None:
            return None
        ranks = self._group.healthy_worker_ids()
        if not ranks:
            if not self._group.wait_healthy(self._wait_healthy_s()):
                raise WorkerDiedError(
                    self._group.name,
                    -1,
                    "sample",
                    "",
                    "NoHealthyRunner",
                    "no healthy env runner is left to sample with",
                )
            ranks = self._group.healthy_worker_ids()
        return self._group.call("sample", ranks=ranks, **kwargs)

    def _wait_healthy_s(self) -> float:
        return self.config.env_runner_health_probe_timeout_s + 60.0

    def collect_samples(
        self, handle: GroupHandle | None, **local_kwargs: Any
    ) -> list[dict[str, Any]]:
        """The batches of a ``sample_async`` round, within ``sample_timeout_s``.

        A runner that died during the round is left out (it is being restarted) when the
        config tolerates failures; with no remote runners the local runner samples.
        """
        if handle is None:
            if self._local is None:
                raise RuntimeError("no env runner to sample with")
            return [self._local.sample(**local_kwargs)]
        timeout = self.config.sample_timeout_s
        ready, _ = ray.wait(handle.refs, num_returns=len(handle.refs), timeout=timeout)
        done = set(ready)
        pending = [r for r, ref in zip(handle.ranks, handle.refs) if ref not in done]
        if pending:
            raise GroupTimeoutError(
                self._group.name,
                "sample",
                pending,
                timeout,
                f"env runner ids {[r + 1 for r in pending]} still sampling after "
                f"sample_timeout_s={timeout}",
            )
        out = []
        for rank, ref in zip(handle.ranks, handle.refs):
            try:
                out.append(GroupHandle(self._group, "sample", [rank], [ref]).wait(timeout)[0])
            except WorkerDiedError:
                if not self._fault_tolerant:
                    raise
                logger.warning("env runner %d died while sampling; it is left out", rank + 1)
        return out

    def sample(self, **kwargs: Any) -> list[dict[str, Any]]:
        """One batch per healthy remote runner (or from the local runner if there are none)."""
        return self.collect_samples(self.sample_async(**kwargs), **kwargs)

    # ------------------------------------------------------------------ lifecycle
    def reset(self, new_remote_workers: WorkerGroup) -> None:
        """Replace the remote runners with those of ``new_remote_workers`` (a launched
        phalanx group of EnvRunners); the old group is shut down.

        RLlib takes raw actor handles here; phalanx runners are a group with health and
        restart state, so a group is what can be adopted.
        """
        if not isinstance(new_remote_workers, WorkerGroup):
            raise TypeError(
                "new_remote_workers must be a launched phalanx WorkerGroup of EnvRunners "
                "(EnvRunner.create_group(config).launch(...)); raw Ray actor handles cannot "
                "be adopted because a group owns its workers' health and restarts"
            )
        if "sample" not in new_remote_workers._methods:
            raise TypeError("new_remote_workers: the group's workers are not EnvRunners")
        self._close_sender()
        if self._group is not None and self._group is not new_remote_workers:
            self._group.shutdown(force=True)
        self._group = new_remote_workers
        from dataclasses import replace

        self.config = replace(self.config, num_env_runners=new_remote_workers.world_size)
        self._register_restore_state()

    def stop(self) -> None:
        """Close every runner's envs and end the remote runners."""
        if self._local is not None:
            self._local.stop()
        self._close_sender()
        if self._group is not None:
            try:
                self._group.foreach_worker("stop", timeout_seconds=10)
            except Exception as e:  # noqa: BLE001 - stopping anyway
                logger.warning("stopping env runners: %s", e)
            self._group.shutdown(force=True)
            self._group = None

    def _close_sender(self) -> None:
        if self._sender is not None:
            try:
                self._sender.close()
            except Exception as e:  # noqa: BLE001
                logger.warning("closing the weight sender: %s", e)
            self._sender = None
            self._sync_pending = False

    def __repr__(self) -> str:
        return (
            f"EnvRunnerGroup(local={self._local is not None}, "
            f"remote={self.num_remote_workers()}, healthy={self.num_healthy_remote_workers()})"
        )


# Functions shipped to runners (module level so they pickle by reference).
def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in module.state_dict().items()}


def _call_local(runner: EnvRunner, func: Any, kwargs: dict[str, Any] | None) -> Any:
    if isinstance(func, str):
        return getattr(runner, func)(**(kwargs or {}))
    return func(runner, **(kwargs or {}))


def _with_worker_id(runner: EnvRunner, func: Any, kwargs: dict[str, Any]) -> Any:
    wid = runner.worker_index
    if isinstance(func, str):
        return getattr(runner, func)(wid, **kwargs)
    return func(wid, runner, **kwargs)


def _env_spaces(runner: EnvRunner) -> tuple[gym.Space, gym.Space]:
    return runner.observation_space, runner.action_space


def _foreach_env(runner: EnvRunner, func: Callable[..., Any]) -> list[Any]:
    return runner.foreach_env(func)


def _foreach_env_ctx(runner: EnvRunner, func: Callable[..., Any]) -> list[Any]:
    return runner.foreach_env_with_context(func)


def _foreach_policy(
    runner: EnvRunner, func: Callable[..., Any], kwargs: dict[str, Any], to_train: bool = False
) -> list[Any]:
    if to_train:
        return runner.foreach_policy_to_train(func, **kwargs)
    return runner.foreach_policy(func, **kwargs)


def _add_policy(runner: EnvRunner, policy_id: str, spec: dict[str, Any]) -> None:
    runner.add_policy(policy_id, **spec)


def _apply_state(runner: EnvRunner, state: dict[str, Any]) -> None:
    runner.set_state(state)


def _set_global_vars(runner: EnvRunner, global_vars: dict[str, Any]) -> None:
    runner.global_vars = dict(global_vars)
