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
plus one, and the ``worker_index`` of their :class:`EnvContext`). Weight sync and
connector state are in :mod:`phalanx.envs.runner_weights`, policies in
:mod:`phalanx.envs.runner_policies`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import gymnasium as gym
import ray
import torch

from phalanx._base.checks import check_int, check_ranks, check_timeout
from phalanx._base.errors import WorkerDiedError, WorkerError
from phalanx.envs.config import EnvContext, EnvRunnerGroupConfig
from phalanx.envs.env_runner import EnvCreator, EnvRunner, check_env_id, check_spaces, make_env
from phalanx.envs.normalize import RunningMeanStd
from phalanx.envs.runner_foreach import RunnerForeach
from phalanx.envs.runner_policies import RunnerPolicies
from phalanx.envs.runner_standby import RunnerStandby
from phalanx.envs.runner_weights import RunnerWeights
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


class EnvRunnerGroup(RunnerStandby, RunnerForeach, RunnerWeights, RunnerPolicies):
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
        self._group: WorkerGroup | None = None
        self._failures: dict[int, int] = {}  # runner id -> sample rounds failed in a row
        self._active: list[int] = []
        self._spares: list[int] = []
        self._handed_over: list[int] = []  # ids a standby took over since the last probe
        self._round_ids: dict[int, int] = {}  # rank -> runner id of the round in flight
        self._stalled: dict[int, Any] = {}  # rank -> its last sample call past the timeout
        self.num_standby_takeovers = 0
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
            self._close_sender()
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
        if self._added_policies or self._obs_norm is not None:
            self._foreach_remote(_apply_state, kwargs={"state": self._restore_state()})
        if self._local is not None:
            self.sync_weights(timeout_seconds=None)
        elif carried is not None:
            self.sync_weights(from_worker_or_learner_group=carried, timeout_seconds=None)

    def _adopt(self, group: WorkerGroup, num_standby: int = 0) -> None:
        """Make ``group`` this set's remote runners (its last ``num_standby`` ranks stand by)."""
        self._group = group
        self._assign_ranks(group.world_size, num_standby)
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
        for rank, sp in zip(self._all_ranks(), spaces):
            if sp != ref:
                self.stop()
                raise ValueError(
                    f"env_creator: spaces mismatch between env runners: {self._label(rank)} has "
                    f"observation_space={sp[0]}, action_space={sp[1]}; expected {ref}"
                )

    # ------------------------------------------------------------------ ids
    def _ranks(
        self, worker_ids: list[int] | None, arg: str = "remote_worker_ids"
    ) -> list[int] | None:
        """RLlib's remote ids (1..n) as the ranks of the group that serve them."""
        if worker_ids is None:
            return None
        if isinstance(worker_ids, int):
            worker_ids = [worker_ids]
        ids = check_ranks(worker_ids, self.num_remote_workers(), arg, repeats="allow", first=1)
        return [self._active[i - 1] for i in ids]

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
        return 0 if self._group is None else len(self._active)

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
        return [self._id_of(r) for r in self._in_service()]

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
        return len(self._in_service())

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
        self._in_service()  # standby runners take over the ids still out
        ids = sorted({self._id_of(r) for r in back} - {None} | set(self._handed_over))
        self._handed_over.clear()
        return ids

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
            ids = [self._id_of(r) for r in self._wait_for_any(self._restart_wait_s())]
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
        ranks = self._in_service() or self._wait_for_any(self._restart_wait_s())
        if not ranks:
            health = self._group.health()
            raise WorkerDiedError(
                self._group.name,
                -1,
                "sample",
                "",
                "NoHealthyRunner",
                "no remote env runner is in service to sample with (runner health: "
                + ", ".join(f"{self._label(r)}: {h.value}" for r, h in health.items())
                + f"; {self.num_remote_env_runner_restarts()} restarts so far)",
            )
        self._round_ids = {r: self._id_of(r) for r in ranks}
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
            ranks = self._in_service()
            left = deadline - time.monotonic()
            if ranks or left <= 0:
                return ranks
            restarting = [r for r, h in self._group.health().items() if h == _RESTARTING]
            if not restarting:
                # None under way: a full probe restarts what the policy allows and waits.
                self._probe(self.config.env_runner_health_probe_timeout_s)
                ranks = self._in_service()
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
                logger.warning("%s: %s: its batch is dropped", self._label(rank), stalled[rank])
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
        self._close_sender()
        if self._group is not None and self._group is not new_remote_workers:
            self._group.shutdown(force=True)
        self.config = replace(self.config, num_env_runners=new_remote_workers.world_size)
        self._adopt(new_remote_workers)

    def stop(self) -> None:
        """Close every runner's envs and end the remote runners."""
        if self._local is not None:
            self._local.stop()
        self._close_sender()
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
                    "stopping %s: %s", self._label(r.actor_id), str(r.get()).splitlines()[0]
                )
            self._group.shutdown(force=True)
            self._group = None

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
