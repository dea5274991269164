"""EnvRunnerGroup: RLlib's set of env runners, on a fault-tolerant phalanx WorkerGroup.

Zero or one *local* runner lives in the driver process; ``num_env_runners`` *remote*
runners are the workers of one phalanx ``WorkerGroup`` launched with
``RestartPolicy.rllib(...)`` built from the config: RLlib's failure rule lives in
:mod:`phalanx.group.fault`, not here. Any error from a remote runner - its env raised,
its process died, its ``sample`` stalled past ``sample_timeout_s`` - takes it out of
service and drops its result for that call; its process is replaced in the background
when ``restart_failed_env_runners`` is set; it is back in service at the next probe
(``sample`` probes at the start of every round), which gives it the current connector
state, extra policies and weights. The call completes from the other runners when
``restart_failed_env_runners`` or ``ignore_env_runner_failures`` is set, and raises the
runner's error when both are off. A runner that fails ``max_consecutive_env_runner_failures``
sample rounds in a row stops the run with an error naming it and the cause.

Calls go through the group's public RLlib face (``foreach_actor``,
``foreach_worker_async``, ``fetch_ready_async_reqs``, ``probe_unhealthy_workers``); worker
ids follow RLlib: 0 is the local runner, remote runners are ``1..n`` (the phalanx rank
plus one, and the ``worker_index`` of their :class:`EnvContext`), or a standby runner's
that took over (:mod:`phalanx.envs.runner_ids`). The group holds one object per concern:
runner ids and standby runners (``RunnerIds``), weight sync (``WeightSync``), the merged
connector state (``ConnectorState``) and the added policies (``RunnerPolicies``); its
calls on the runners are in :mod:`phalanx.envs.runner_foreach`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import gymnasium as gym
import numpy as np
import ray
import torch

from phalanx._base.checks import check_int, check_timeout
from phalanx._base.errors import WorkerDiedError, WorkerError
from phalanx.envs.config import EnvContext, EnvRunnerGroupConfig
from phalanx.envs.connector_state import ConnectorState, merge_and_broadcast
from phalanx.envs.env_runner import EnvCreator, EnvRunner, check_env_id, check_spaces, make_env
from phalanx.envs.runner_foreach import RunnerForeach
from phalanx.envs.runner_ids import RunnerIds
from phalanx.envs.runner_policies import (
    RunnerPolicies,
    add_policy,
    check_new_policy,
    foreach_policy,
    policy_spec,
)
from phalanx.envs.weight_sync import WeightSync, state_dicts
from phalanx.group.fault import RestartPolicy, WorkerHealth
from phalanx.group.futures import GroupHandle
from phalanx.group.group import WorkerGroup
from phalanx.group.results import RemoteCallResults
from phalanx.resources.cluster import Cluster
from phalanx.resources.placement import NodePlacement

logger = logging.getLogger(__name__)

# ``probe_unhealthy_workers`` needs a wait > 0: the probe before each round does not wait
# for restarts under way (they come back in a later round).
_PROBE_POLL_S = 1e-3
# With every runner out, how long ``sample`` waits for a restart under way to finish
# (beyond the probe timeout), with a wide margin for a loaded machine.
RESTART_WAIT_S = 180.0


class EnvRunnerGroup(RunnerForeach):
    """Set of EnvRunners: ``n`` remote runners (a phalanx group) and zero or one local one.

    ``EnvRunnerGroup(*, env_creator=None, validate_env=None, default_policy_class=None,
    config=None, num_env_runners=None, local_env_runner=True, logdir=None, ...)``.
    ``config`` is an :class:`EnvRunnerGroupConfig` (or a dict of its fields);
    ``num_env_runners=None`` takes the config's. ``cluster`` and ``name`` choose where the
    remote runners start and the group's name. Bad options raise before any worker starts.

    Args:
        env_creator: builds one env from an ``EnvContext``.
        validate_env: called with each new env; raises to refuse it.
        default_policy_class: the default policy's module class.
        config: the config.
        num_env_runners: remote runners (the config's if None).
        local_env_runner: build a local runner too.
        logdir: accepted for RLlib's signature.
        tune_trial_id: accepted for RLlib's signature.
        num_workers: RLlib's older name of ``num_env_runners`` (-1: not given).
        local_worker: RLlib's older name of ``local_env_runner`` (-1: not given).
        cluster: the cluster to start the runners on (if None, ``Cluster()``: the running Ray,
            or a local one it starts).
        name: the runners' group name.

    Raises:
        ValueError: an option is out of range or unknown.
        TypeError: an option has the wrong type.

    Example:
        >>> import phalanx as px
        >>> cluster = px.Cluster()
        >>> runners = px.EnvRunnerGroup(
        ...     config={"env": "CartPole-v1", "num_env_runners": 2, "rollout_fragment_length": 8},
        ...     local_env_runner=False, cluster=cluster, name="example_runners")
        >>> [batch["rewards"].shape for batch in runners.sample()]
        [(8, 1), (8, 1)]
        >>> runners.stop()
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
            config = replace(config, num_env_runners=num_env_runners)
        if not isinstance(local_env_runner, bool):
            raise TypeError(f"local_env_runner must be a bool, got {local_env_runner!r}")
        if config.num_env_runners == 0 and not local_env_runner:
            raise ValueError(
                "num_env_runners=0 with local_env_runner=False leaves no env runner to sample "
                "with: set num_env_runners >= 1 or local_env_runner=True"
            )
        if config.num_standby_env_runners and config.num_env_runners == 0:
            raise ValueError(
                f"num_standby_env_runners={config.num_standby_env_runners} needs "
                "num_env_runners >= 1 (a standby runner takes over a remote runner's place)"
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
        self._local: EnvRunner | None = None
        self._group: WorkerGroup | None = None  # the remote runners
        self._ids = RunnerIds()  # which rank serves which runner id; standby runners
        self._weights = WeightSync(timeout_s=config.sample_timeout_s)
        self._connector = ConnectorState()
        self._policies = RunnerPolicies(config.policies_to_train)
        self.global_vars: dict[str, Any] = {}
        self.num_env_steps_sampled = 0
        # Sampling rounds.
        self._failures: dict[int, int] = {}  # runner id -> sample rounds failed in a row
        self._round_ids: dict[int, int] = {}  # rank -> runner id of the round in flight
        self._stalled: dict[int, Any] = {}  # rank -> its last sample call past the timeout
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
        num_remote += self.config.num_standby_env_runners if num_remote else 0
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

        if self._default_policy_class is None:
            check_spaces(first[1], first[2])

    def _restart_policy(self) -> RestartPolicy:
        c = self.config
        return RestartPolicy.rllib(
            restart=c.restart_failed_env_runners,
            max_restarts=c.max_num_env_runner_restarts,
            delay_s=float(c.delay_between_env_runner_restarts_s),
            health_probe_timeout_s=float(c.env_runner_health_probe_timeout_s),
            ignore_failures=self._fault_tolerant,
        )

    @property
    def _fault_tolerant(self) -> bool:
        """RLlib's ``ignore_ray_errors_on_env_runners``: a failed runner does not raise."""
        return self.config.restart_failed_env_runners or self.config.ignore_env_runner_failures

    def add_workers(self, num_workers: int, validate: bool = False) -> None:
        """Create and add ``num_workers`` remote runners.

        A phalanx group has a fixed size, so adding to an existing group starts a new,
        larger group and hands it the current weights and connector state (the old
        runners' unfinished episodes are dropped).

        Args:
            num_workers: how many runners to add.
            validate: accepted for RLlib's signature; the new runners are checked as they start.
        """
        check_int(num_workers, "num_workers", minimum=1)
        old = self._group
        total = num_workers + self.num_remote_env_runners()
        spares = self.config.num_standby_env_runners
        # The local runner is the weight source below; without one, the old runners are.
        carried = self._remote_weights() if old is not None and self._local is None else None
        if old is not None:
            self._weights.close()
            old.shutdown(force=True)
            self._group = None
        self.config = replace(self.config, num_env_runners=total)
        group = EnvRunner.create_group(
            self.config, self._env_creator, self._validate_env, self._default_policy_class
        )
        group.launch(
            self._cluster,
            placement=NodePlacement(
                num_workers=total + spares, num_cpus=self.config.num_cpus_per_env_runner
            ),
            name=self._name,
            restart_policy=self._restart_policy(),
        )
        group.max_requests_in_flight_per_worker = self.config.max_requests_in_flight_per_env_runner
        self._adopt(group, spares)
        if validate:
            self._validate_remote_spaces()
        if self._policies.added or self._connector.obs_norm is not None:
            self._foreach_remote(_apply_state, kwargs={"state": self._restore_state()})
        if self._local is not None:
            self.sync_weights(timeout_seconds=None)
        elif carried is not None:
            self.sync_weights(from_worker_or_learner_group=carried, timeout_seconds=None)

    def _adopt(self, group: WorkerGroup, num_standby: int = 0) -> None:
        """Make ``group`` this set's remote runners (its last ``num_standby`` ranks stand by)."""
        self._group = group
        self._ids = RunnerIds(
            group,
            num_standby,
            probe_timeout_s=self.config.env_runner_health_probe_timeout_s,
            restore_state=self._restore_state,
            takeovers=self._ids.takeovers,
        )
        self._stalled = {}
        self._failures = {}
        self._register_restore_state()

    def _validate_remote_spaces(self) -> None:
        spaces = self._foreach_remote(_env_spaces, timeout_seconds=self.config.sample_timeout_s)
        if not spaces:  # every runner died after starting: nothing to compare
            return
        ref = spaces[0]
        if self._local is not None:
            ref = (self._local.observation_space, self._local.action_space)
        for rank, sp in zip(self._ids.all_ranks(), spaces):
            if sp != ref:
                label = self._ids.label(rank)
                self.stop()
                raise ValueError(
                    f"env_creator: spaces mismatch between env runners: {label} has "
                    f"observation_space={sp[0]}, action_space={sp[1]}; expected {ref}"
                )

    # ------------------------------------------------------------------ counts and health
    @property
    def local_env_runner(self) -> EnvRunner | None:
        """The runner in this process (None if created without one)."""
        return self._local

    def local_worker(self) -> EnvRunner | None:
        """RLlib's older name of ``local_env_runner``.

        Returns:
            The local ``EnvRunner``, or None.
        """
        return self._local

    @property
    def remote_group(self) -> WorkerGroup | None:
        """The phalanx ``WorkerGroup`` of the remote runners."""
        return self._group

    def num_remote_env_runners(self) -> int:
        """The number of remote EnvRunners (healthy or not).

        Returns:
            The number of runners.
        """
        return self._ids.num_serving()

    def num_remote_workers(self) -> int:
        """RLlib's older name of ``num_remote_env_runners``.

        Returns:
            The number of runners.
        """
        return self.num_remote_env_runners()

    def healthy_env_runner_ids(self) -> list[int]:
        """Ids (1..n) of the remote runners in service.

        Returns:
            The ids, in order.
        """
        return [self._ids.id_of(r) for r in self._ids.in_service()]

    def healthy_worker_ids(self) -> list[int]:
        """RLlib's older name of ``healthy_env_runner_ids``.

        Returns:
            The ids, in order.
        """
        return self.healthy_env_runner_ids()

    def num_healthy_remote_env_runners(self) -> int:
        """The number of remote runners in service.

        Returns:
            The number of runners.
        """
        return len(self._ids.in_service())

    def num_healthy_remote_workers(self) -> int:
        """RLlib's older name of ``num_healthy_remote_env_runners``.

        Returns:
            The number of runners.
        """
        return self.num_healthy_remote_env_runners()

    def num_healthy_env_runners(self) -> int:
        """Remote runners in service, plus the local runner if there is one.

        Returns:
            The number of runners.
        """
        return self.num_healthy_remote_env_runners() + (1 if self._local is not None else 0)

    def num_healthy_workers(self) -> int:
        """RLlib's older name of ``num_healthy_env_runners``.

        Returns:
            The number of runners.
        """
        return self.num_healthy_env_runners()

    def num_standby_env_runners(self) -> int:
        """Standby runners of the group (in service or being restarted).

        Returns:
            The number of runners.
        """
        return len(self._ids.spares)

    def num_healthy_standby_env_runners(self) -> int:
        """Standby runners in service, ready to take over a failed runner's id.

        Returns:
            The number of runners.
        """
        return self._ids.num_healthy_standby()

    @property
    def num_standby_takeovers(self) -> int:
        """How many times a standby runner took over a failed runner's id."""
        return self._ids.takeovers

    def num_remote_env_runner_restarts(self) -> int:
        """How many times a remote runner came back into service (RLlib's count).

        A runner counts when a probe (or a ``mark_healthy`` call) brings it back after a
        failure, whether its process was replaced or it only answered again. A runner
        whose process died in ``__init__`` while the group started, and was started again
        by the restart policy, counts once per restart as soon as the group exists.

        Returns:
            The number of restarts.
        """
        return 0 if self._group is None else self._group.num_remote_worker_restarts()

    def num_remote_worker_restarts(self) -> int:
        """RLlib's older name of ``num_remote_env_runner_restarts``.

        Returns:
            The number of restarts.
        """
        return self.num_remote_env_runner_restarts()

    def num_in_flight_async_reqs(
        self, tag: str | None = None, *, tags: str | list[str] | None = None
    ) -> int:
        """Async requests sent and not yet fetched (of ``tag``/``tags``; default all).

        Args:
            tag: one tag to count.
            tags: one tag or a list of tags to count (every tag if neither is given).

        Returns:
            The number of requests.
        """
        if self._group is None:
            return 0
        return self._group.num_in_flight_async_reqs(tags if tags is not None else tag)

    def probe_unhealthy_env_runners(self) -> list[int]:
        """Bring runners that are out of service back if they answer; ids of those back.

        Waits (up to ``env_runner_health_probe_timeout_s``) for process restarts under
        way, pings every out-of-service runner whose process is up (and whose stalled
        call ended), gives those that answer the current connector state, extra policies
        and weights, and puts them back in service (one restart each). Runners brought
        back since the last probe by a ``mark_healthy`` call are included.

        Returns:
            The ids of the runners back in service.
        """
        return self._probe(self.config.env_runner_health_probe_timeout_s)

    def probe_unhealthy_workers(self, timeout_seconds: float | None = None) -> list[int]:
        """RLlib's older probe, with its timeout argument (default: the config's).

        Args:
            timeout_seconds: seconds to wait for restarts under way (the config's if None).

        Returns:
            The ids of the runners back in service.

        Raises:
            ValueError: ``timeout_seconds`` is 0 or negative.
        """
        if timeout_seconds is None:
            timeout_seconds = self.config.env_runner_health_probe_timeout_s
        if check_timeout(timeout_seconds, "timeout_seconds") == 0:
            raise ValueError("timeout_seconds must be > 0 or None, got 0")
        return self._probe(float(timeout_seconds))

    def _probe(self, timeout: float) -> list[int]:
        if self._group is None:
            return []
        back = self._group.probe_unhealthy_workers(timeout)
        self._ids.in_service()  # standby runners take over the ids still out
        handed_over = self._ids.take_handed_over()
        return sorted({self._ids.id_of(r) for r in back} - {None} | set(handed_over))

    # ------------------------------------------------------------------ spaces
    def get_spaces(self) -> dict[str, tuple[gym.Space, gym.Space]]:
        """``{"__env__": (obs, act), policy_id: (obs, act), ...}`` from the local runner,
        else from the first remote runner in service.

        Returns:
            A dict from ``"__env__"`` and each policy id to ``(observation space, action space)``.

        Raises:
            RuntimeError: there is no local runner and no healthy remote runner.
        """
        if self._local is not None:
            return self._local.get_spaces()
        ids = self.healthy_worker_ids()
        if not ids and self.config.restart_failed_env_runners:
            # every runner is out with restarts under way (e.g. killed while starting)
            ids = [self._ids.id_of(r) for r in self._wait_for_any(self._restart_wait_s())]
        if not ids:
            raise RuntimeError("get_spaces: no local runner and no healthy remote runner")
        return self._first_answer("get_spaces", ids)

    # ------------------------------------------------------------------ sampling
    def sample_async(self, **kwargs: Any) -> GroupHandle | None:
        """Start ``sample(**kwargs)`` on every remote runner in service; collect the
        batches with ``collect_samples``. None when there is no remote runner.

        First brings back runners that were restarted since the last round (a probe that
        does not wait for restarts still under way). With no runner in service it waits
        for the first restart under way to finish (up to ``env_runner_health_probe_timeout_s``
        + 180 s); with none coming back it raises ``WorkerDiedError``.

        Args:
            **kwargs: each runner's ``sample`` arguments.

        Returns:
            The handle for ``collect_samples``, or None.

        Raises:
            WorkerDiedError: no remote runner is in service and none comes back.
        """
        if self._group is None:
            return None
        self._probe(_PROBE_POLL_S)
        ranks = self._ids.in_service() or self._wait_for_any(self._restart_wait_s())
        if not ranks:
            health = self._group.health()
            raise WorkerDiedError(
                self._group.name,
                -1,
                "sample",
                "",
                "NoHealthyRunner",
                "no remote env runner is in service to sample with (runner health: "
                + ", ".join(f"{self._ids.label(r)}: {h.value}" for r, h in health.items())
                + f"; {self.num_remote_env_runner_restarts()} restarts so far)",
            )
        self._round_ids = {r: self._ids.id_of(r) for r in ranks}
        return self._group.call_ranks(
            "sample", [(r, (), kwargs) for r in ranks], skip_unhealthy=True
        )

    def _restart_wait_s(self) -> float:
        """How long to wait for a runner to come back when every one is out."""
        return self.config.env_runner_health_probe_timeout_s + RESTART_WAIT_S

    def _wait_for_any(self, timeout: float) -> list[int]:
        """Every runner is out: wait until one is back in service (probing as restarts
        finish) while a restart is under way, up to ``timeout``; the ranks in service."""
        deadline = time.monotonic() + timeout
        while True:
            self._probe(_PROBE_POLL_S)
            ranks = self._ids.in_service()
            left = deadline - time.monotonic()
            if ranks or left <= 0:
                return ranks
            restarting = [r for r, h in self._group.health().items() if h == _RESTARTING]
            if not restarting:
                # None under way: a full probe restarts what the policy allows and waits.
                self._probe(self.config.env_runner_health_probe_timeout_s)
                ranks = self._ids.in_service()
                if ranks or _RESTARTING not in self._group.health().values():
                    return ranks
                continue
            for r in restarting:  # back here as soon as one of them is healthy again
                if self._group.wait_healthy(min(left, 0.25), ranks=[r]):
                    break

    def collect_samples(
        self, handle: GroupHandle | None, **local_kwargs: Any
    ) -> list[dict[str, Any]]:
        """The batches of a ``sample_async`` round, one per runner that delivered.

        Waits up to ``sample_timeout_s``. A runner whose ``sample`` raised or whose process
        died is out of service and left out of the round (restarted per config); its
        error raises only when the config neither restarts nor ignores failed runners.
        A runner still sampling at the timeout is left out and taken out of service
        (restarted when the config restarts runners; RLlib drops its batch too); a stall
        does not raise. A runner failing ``max_consecutive_env_runner_failures`` rounds
        in a row raises a ``WorkerError`` naming it and its last error. With no remote
        runners the local runner samples.

        Args:
            handle: the ``sample_async`` handle (None samples with the local runner).
            **local_kwargs: the local runner's ``sample`` arguments.

        Returns:
            The batches, one per runner that delivered.

        Raises:
            RuntimeError: ``handle`` is None and there is no local runner.
            WorkerError: a runner failed and the config neither restarts nor ignores failed
                runners, or a runner failed too many rounds in a row.
        """
        if handle is None:
            if self._local is None:
                raise RuntimeError("no env runner to sample with")
            return [self._local.sample(**local_kwargs)]
        timeout = self.config.sample_timeout_s
        results, pending = self._group.collector.ready("sample", handle.ranks, handle.refs, timeout)
        stalled = {}
        for rank, ref in zip(handle.ranks, handle.refs):
            if rank in pending:
                stalled[rank] = f"sample() still running after sample_timeout_s={timeout}"
                self._group.take_out_of_service(rank, stalled[rank], running=ref)
                self._stalled[rank] = ref
                logger.warning("%s: %s: its batch is dropped", self._ids.label(rank), stalled[rank])
        self._count_failures(results, stalled)
        return [v for _, v in self._settle(results, "sample")]

    def _count_failures(self, results: RemoteCallResults, stalled: dict[int, str]) -> None:
        """Raise when a runner failed ``max_consecutive_env_runner_failures`` rounds in a
        row (a crash loop, e.g. an env that returns NaN, must stop the run, naming why)."""
        limit = self.config.max_consecutive_env_runner_failures
        ids = self._round_ids  # counted per runner id: a standby taking over inherits it
        causes = {r.actor_id: r.get() for r in results.errors}
        causes.update(stalled)
        for r in results:
            if r.ok:
                self._failures.pop(ids[r.actor_id], None)
        for rank, cause in causes.items():
            n = self._failures[ids[rank]] = self._failures.get(ids[rank], 0) + 1
            if limit is not None and n >= limit:
                first = str(cause).strip().splitlines()[0] if str(cause).strip() else repr(cause)
                err = WorkerError(
                    self._group.name,
                    rank,
                    "sample",
                    "",
                    type(cause).__name__ if isinstance(cause, BaseException) else "Stalled",
                    f"env runner {ids[rank]} failed {n} sample rounds in a row "
                    f"(max_consecutive_env_runner_failures={limit}); last error: {first}",
                )
                raise err from cause if isinstance(cause, BaseException) else None

    def sample(self, **kwargs: Any) -> list[dict[str, Any]]:
        """One batch per remote runner in service (or from the local runner if there are
        none); failed and stalled runners are left out as ``collect_samples`` says.

        Args:
            **kwargs: each runner's ``sample`` arguments.

        Returns:
            The batches, one per runner that delivered.

        Raises:
            WorkerDiedError: no remote runner is in service and none comes back.
            WorkerError: as for ``collect_samples``.
        """
        return self.collect_samples(self.sample_async(**kwargs), **kwargs)

    # ------------------------------------------------------------------ weights
    @property
    def weights_version(self) -> int:
        """Version of the weights last sent by ``sync_weights`` (0: none yet)."""
        return self._weights.version

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
        ``to_worker_indices``: remote ids (1..n) to update (default: all in service).
        ``timeout_seconds``: 0 starts the transfer and returns (RLlib's fire-and-forget;
        the next sync completes it), None or > 0 blocks until applied. Returns the
        weight layer's ``SyncResult`` (None while a fire-and-forget send is in flight).
        ``global_vars`` are set on every runner (``runner.global_vars``).

        Args:
            policies: the policies to send (every policy if None).
            from_worker_or_learner_group: where the weights come from, as above.
            to_worker_indices: the remote ids (1..n) to update.
            global_vars: values set as every runner's ``global_vars``.
            timeout_seconds: 0 returns once the send started; None or > 0 waits.
            inference_only: accepted for RLlib's signature.

        Returns:
            The ``SyncResult``, or None while a fire-and-forget send is in flight.

        Raises:
            WeightMismatchError: a runner's policy does not match the weights.
        """
        if isinstance(from_worker_or_learner_group, int) and not isinstance(
            from_worker_or_learner_group, bool
        ):
            rank = self._ids.ranks([from_worker_or_learner_group], "from_worker_or_learner_group")
            source = self._first_answer("get_weights", [rank[0] + 1])
        else:
            source = from_worker_or_learner_group
        weights = state_dicts(source, policies, self._local)
        ranks = self._ids.ranks(to_worker_indices, "to_worker_indices")
        timeout = check_timeout(timeout_seconds, "timeout_seconds")
        result = None
        if self._group is not None:
            self._weights.start(self._group)
            healthy = set(self._ids.up_ranks())  # standby runners keep current weights too
            everyone = self._ids.all_ranks()
            targets = [r for r in (everyone if ranks is None else ranks) if r in healthy]
            result = self._weights.send(weights, targets, timeout)
        version = self._weights.next_version()
        if self._local is not None:
            if from_worker_or_learner_group is None or from_worker_or_learner_group is self._local:
                self._local._px_weights_version = version
            else:
                self._local.set_weights(weights, weights_version=version)
        if global_vars is not None:
            self.global_vars = dict(global_vars)
            self.foreach_worker(_set_global_vars, kwargs={"global_vars": self.global_vars})
            self._register_restore_state()
        return result

    def _remote_weights(self) -> dict[str, dict[str, np.ndarray]]:
        ids = self.healthy_worker_ids()
        if not ids:
            raise RuntimeError("no healthy remote runner to read weights from")
        return self._first_answer("get_weights", ids)

    # ------------------------------------------------------------------ connector state
    def sync_env_runner_states(
        self,
        *,
        config: Any = None,
        from_worker: EnvRunner | None = None,
        env_steps_sampled: int | None = None,
        connector_states: list[dict[str, Any]] | None = None,
        rl_module_state: dict[str, Any] | None = None,
        env_runner_indices_to_update: list[int] | None = None,
        env_to_module: Any = None,
        module_to_env: Any = None,
    ) -> dict[str, Any]:
        """Merge the runners' connector states and give every runner the merged state.

        The observation normaliser's per-runner deltas since the last sync are folded into
        one global mean/std (from ``connector_states`` if given, else fetched from the
        runners in service and ``from_worker``/the local runner); the result goes to the
        local runner and the remote runners ``env_runner_indices_to_update`` (default all
        in service) and is registered so runners returning to service get it too.

        RLlib's other keywords: ``config`` (an RLlib ``AlgorithmConfig`` or any object)
        is read for ``merge_env_runner_states`` (True, False or ``"training_only"`` with
        its ``in_evaluation``) and ``broadcast_env_runner_states``; None merges and
        broadcasts. ``env_steps_sampled`` becomes every runner's ``num_env_steps_sampled``.
        ``rl_module_state`` (``{"rl_module": {policy_id: state dict}}`` or
        ``{policy_id: state dict}``) is sent as weights to the same runners (a blocking
        ``sync_weights``). ``env_to_module``/``module_to_env`` (RLlib's connector pipeline
        objects) have no counterpart here and raise ``ValueError``.
        Returns the merged connector state (``{}`` without observation normalisation).

        Args:
            config: an object read for ``merge_env_runner_states`` and
                ``broadcast_env_runner_states``.
            from_worker: a runner whose state joins the merge.
            env_steps_sampled: every runner's new ``num_env_steps_sampled``.
            connector_states: the runners' states to merge (fetched if None).
            rl_module_state: weights sent to the same runners.
            env_runner_indices_to_update: the remote ids (1..n) to update.
            env_to_module: not supported.
            module_to_env: not supported.

        Returns:
            The merged connector state.

        Raises:
            ValueError: ``env_to_module`` or ``module_to_env`` is given.
            TypeError: ``rl_module_state`` is not a dict.
        """
        for name, value in (("env_to_module", env_to_module), ("module_to_env", module_to_env)):
            if value is not None:
                raise ValueError(
                    f"{name}: phalanx env runners have no connector pipeline objects; their "
                    "connector state is the observation normaliser (normalize_observations), "
                    "merged from the runners or from connector_states"
                )
        merge, broadcast = merge_and_broadcast(config)
        ranks = self._ids.ranks(env_runner_indices_to_update, "env_runner_indices_to_update")
        if env_steps_sampled is not None:
            self.num_env_steps_sampled = check_int(
                env_steps_sampled, "env_steps_sampled", minimum=0
            )
        if rl_module_state is not None:
            if not isinstance(rl_module_state, dict):
                raise TypeError(
                    f"rl_module_state must be a dict, got {type(rl_module_state).__name__}"
                )
            self.sync_weights(
                from_worker_or_learner_group=rl_module_state.get("rl_module", rl_module_state),
                to_worker_indices=env_runner_indices_to_update,
                timeout_seconds=None,
            )
        state: dict[str, Any] = {}
        if env_steps_sampled is not None:
            state["num_env_steps_sampled"] = self.num_env_steps_sampled
        if self.config.normalize_observations and merge:
            if connector_states is None:
                connector_states = self._connector_states(from_worker)
            state["connector"] = self._connector.merge(connector_states, self._obs_shape)
            if self._local is not None:
                self._local.set_connector_state(state["connector"])
        if self._local is not None and "num_env_steps_sampled" in state:
            self._local.num_env_steps_sampled = self.num_env_steps_sampled
        if self._group is not None and state and broadcast:
            self._foreach_remote(
                "set_state",
                kwargs={"state": state},
                ranks=ranks,
                timeout_seconds=self.config.sample_timeout_s,
            )
            self._register_restore_state()
        return state.get("connector", {})

    def _connector_states(self, from_worker: EnvRunner | None) -> list[dict[str, Any]]:
        """The connector states of the runners in service and of ``from_worker`` (or the
        local runner)."""
        states: list[dict[str, Any]] = []
        if self._group is not None:
            states.extend(
                self._foreach_remote(
                    "get_connector_state", timeout_seconds=self.config.sample_timeout_s
                )
            )
        src = from_worker if from_worker is not None else self._local
        if src is not None:
            states.append(src.get_connector_state())
        return states

    def _obs_shape(self) -> tuple[int, ...]:
        return self.get_spaces()["__env__"][0].shape or ()

    def get_connector_state(self) -> dict[str, Any]:
        """The merged connector state (what a checkpoint keeps).

        Returns:
            ``{"obs_norm": state}``, or ``{}`` without observation normalisation.
        """
        return self._connector.get()

    def set_connector_state(self, state: dict[str, Any]) -> None:
        """Set the merged connector state on every runner (e.g. from a checkpoint).

        Args:
            state: a state from ``get_connector_state``.
        """
        if not state or state.get("obs_norm") is None or not self.config.normalize_observations:
            return
        self._connector.load(state)
        self.sync_env_runner_states(connector_states=[])

    def _restore_state(self) -> dict[str, Any]:
        """What a runner returning to service gets (``EnvRunner.set_state``)."""
        return {
            "connector": self._connector.restore(),
            **self._policies.restore(),
            "global_vars": dict(self.global_vars),
        }

    def _register_restore_state(self) -> None:
        if self._group is not None:
            self._group.register_state(None, self._restore_state())

    # ------------------------------------------------------------------ policies
    def foreach_policy(self, func: Callable[..., Any], **kwargs: Any) -> list[Any]:
        """``func(policy, policy_id, **kwargs)`` for every policy of every runner (flat list).

        Args:
            func: called as ``func(policy, policy_id, **kwargs)``.
            **kwargs: its keyword arguments.

        Returns:
            The results of every runner, flat.
        """
        results = self.foreach_worker(foreach_policy, kwargs={"func": func, "kwargs": kwargs})
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
            foreach_policy, kwargs={"func": func, "kwargs": kwargs, "to_train": True}
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
        return self._policies.is_to_train(policy_id)

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
        check_new_policy(policy_id, policy_cls, policy)
        ranks = self._ids.ranks(workers, "workers")
        spec = policy_spec(
            policy_cls,
            policy,
            observation_space,
            action_space,
            config,
            policy_state,
            self.config.policy_config,
        )
        local_policy = None
        if self._local is not None and workers is None:
            local_policy = self._local.add_policy(policy_id, **spec)
            if spec["policy_state"] is None:  # every runner starts from the local runner's
                spec["policy_state"] = self._local.get_weights([policy_id])[policy_id]
        if self._group is not None:
            self._foreach_remote(
                add_policy, kwargs={"policy_id": policy_id, "spec": spec}, ranks=ranks
            )
        if policies_to_train is not None:
            self._policies.to_train = list(policies_to_train)
            self.foreach_worker(
                "set_policies_to_train", kwargs={"policies_to_train": policies_to_train}
            )
        if workers is None:
            self._policies.added[policy_id] = spec
        self._register_restore_state()
        return local_policy

    # ------------------------------------------------------------------ lifecycle
    def reset(self, new_remote_workers: WorkerGroup) -> None:
        """Replace the remote runners with those of ``new_remote_workers`` (a launched
        phalanx group of EnvRunners); the old group is shut down.

        RLlib takes raw actor handles here; phalanx runners are a group with health and
        restart state, so a group is what can be adopted.

        Args:
            new_remote_workers: the launched group of ``EnvRunner`` to adopt.

        Raises:
            TypeError: ``new_remote_workers`` is not a ``WorkerGroup`` of ``EnvRunner``.
        """
        if not isinstance(new_remote_workers, WorkerGroup):
            raise TypeError(
                "new_remote_workers must be a launched phalanx WorkerGroup of EnvRunners "
                "(EnvRunner.create_group(config).launch(...)); raw Ray actor handles cannot "
                "be adopted because a group owns its workers' health and restarts"
            )
        if "sample" not in new_remote_workers.methods:
            raise TypeError("new_remote_workers: the group's workers are not EnvRunners")
        self._weights.close()
        if self._group is not None and self._group is not new_remote_workers:
            self._group.shutdown(force=True)
        self.config = replace(self.config, num_env_runners=new_remote_workers.world_size)
        self._adopt(new_remote_workers)

    def stop(self) -> None:
        """Close every runner's envs and end the remote runners."""
        if self._local is not None:
            self._local.stop()
        self._weights.close()
        if self._group is not None:
            # Every runner, in service or not (RLlib stops them all), but one whose stalled
            # sample call still runs: its stop would queue behind it, and the shutdown ends it.
            stuck = {r for r, ref in self._stalled.items() if not _finished(ref)}
            ranks = [r for r in range(self._group.world_size) if r not in stuck] if stuck else None
            results = self._group.foreach_actor(
                "stop", healthy_only=False, remote_actor_ids=ranks, timeout_seconds=10.0
            )
            for r in results.errors:
                logger.info(
                    "stopping %s: %s", self._ids.label(r.actor_id), str(r.get()).splitlines()[0]
                )
            self._group.shutdown(force=True)
            self._group = None
            self._ids = RunnerIds(takeovers=self._ids.takeovers)

    def __repr__(self) -> str:
        return (
            f"EnvRunnerGroup(local={self._local is not None}, "
            f"remote={self.num_remote_workers()}, healthy={self.num_healthy_remote_workers()})"
        )


_RESTARTING = WorkerHealth.RESTARTING


def _finished(ref: Any) -> bool:
    """Whether a call's ref has its result (or its error) now."""
    return bool(ray.wait([ref], timeout=0, fetch_local=False)[0])


def _env_spaces(runner: EnvRunner) -> tuple[gym.Space, gym.Space]:
    return runner.observation_space, runner.action_space


def _apply_state(runner: EnvRunner, state: dict[str, Any]) -> None:
    runner.set_state(state)


def _set_global_vars(runner: EnvRunner, global_vars: dict[str, Any]) -> None:
    runner.global_vars = dict(global_vars)
