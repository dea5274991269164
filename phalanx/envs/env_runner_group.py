"""EnvRunnerGroup: RLlib's set of env runners, on a fault-tolerant phalanx WorkerGroup.

Zero or one *local* runner lives in the driver process; ``num_env_runners`` *remote*
runners are the workers of one phalanx ``WorkerGroup`` launched with a
``RestartPolicy`` built from the config. Weights go through
``phalanx.weights.WeightSender``; connector state (the observation normaliser) is merged
across runners and registered on the group so a restarted runner gets it back.

Failure semantics are RLlib's (see :mod:`phalanx.envs.runner_health`): any error from a
remote runner - its env raised, its process died - takes it out of service and drops its
result for that call; the call completes from the other runners when
``restart_failed_env_runners`` or ``ignore_env_runner_failures`` is set, and raises the
runner's error when both are off. With ``restart_failed_env_runners`` the runner's process
is replaced at once (in the background); it returns to service at the next probe, which
``sample`` runs at the start of every round. A runner still sampling after
``sample_timeout_s`` loses its batch for the round and is restarted (or, without
restarts, left out until it answers a probe); a stall never raises.

Worker ids follow RLlib: 0 is the local runner, remote runners are ``1..n`` (the phalanx
rank plus one, and the ``worker_index`` of their :class:`EnvContext`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from phalanx._base.errors import WorkerDiedError
from phalanx.envs import runner_calls
from phalanx.envs.config import DEFAULT_POLICY_ID, EnvContext, EnvRunnerGroupConfig
from phalanx.envs.env_runner import EnvCreator, EnvRunner, check_env_id, make_env
from phalanx.envs.normalize import RunningMeanStd
from phalanx.envs.runner_calls import RunnerCall
from phalanx.envs.runner_health import AsyncRequest, RunnerHealth
from phalanx.group.fault import STARTUP_RESTART, RestartPolicy, WorkerHealth
from phalanx.group.futures import GroupHandle
from phalanx.group.group import WorkerGroup
from phalanx.group.results import unwrap_error
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
        self._health = RunnerHealth()
        self._sample_actors: dict[ray.ObjectRef, Any] = {}
        self._remove_hook: Callable[[], None] | None = None
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
        self._adopt(group)
        if validate:
            self._validate_remote_spaces()
        if self._added_policies or self._obs_norm is not None:
            self._foreach_remote(_apply_state, kwargs={"state": self._restore_state()})
        self._register_restore_state()
        if self._local is not None:
            self.sync_weights(timeout_seconds=None)
        elif carried is not None:
            self.sync_weights(from_worker_or_learner_group=carried, timeout_seconds=None)

    def _adopt(self, group: WorkerGroup) -> None:
        """Make ``group`` this set's remote runners: all in service, restarts watched."""
        if self._remove_hook is not None:
            self._remove_hook()
        self._group = group
        self._health.reset()
        # Runners replaced while the group started are in service from its first call:
        # the launch waited for them as a probe would, so each counts now.
        with self._health.lock:
            self._health.num_restarts += sum(
                1 for e in group.health_events() if e.reason == STARTUP_RESTART
            )
        self._remove_hook = group.add_restart_hook(self._on_restarted)

    def _on_restarted(self, ranks: list[int]) -> None:
        """Restart hook: a runner whose process was replaced stays out until a probe."""
        with self._health.lock:
            for r in ranks:
                if r not in self._health.restoring:
                    self._health.take_out(r)

    def _validate_remote_spaces(self) -> None:
        spaces = self._foreach_remote(_env_spaces, timeout_seconds=self.config.sample_timeout_s)
        if not spaces:  # every runner died after starting: nothing to compare
            return
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

    def num_remote_env_runners(self) -> int:
        """The number of remote EnvRunners (healthy or not)."""
        return 0 if self._group is None else self._group.world_size

    def num_remote_workers(self) -> int:
        """RLlib's older name of ``num_remote_env_runners``."""
        return self.num_remote_env_runners()

    def _in_service(self) -> list[int]:
        """Ranks in service: not taken out, and their process up (a death takes one out)."""
        if self._group is None:
            return []
        health = self._group.health()
        with self._health.lock:
            for r, h in health.items():
                if h != WorkerHealth.HEALTHY:
                    self._health.take_out(r)
            return [r for r in range(len(health)) if r not in self._health.out]

    def healthy_env_runner_ids(self) -> list[int]:
        """Ids (1..n) of the remote runners in service."""
        return [r + 1 for r in self._in_service()]

    def healthy_worker_ids(self) -> list[int]:
        """RLlib's older name of ``healthy_env_runner_ids``."""
        return self.healthy_env_runner_ids()

    def num_healthy_remote_env_runners(self) -> int:
        """The number of remote runners in service."""
        return len(self._in_service())

    def num_healthy_remote_workers(self) -> int:
        return self.num_healthy_remote_env_runners()

    def num_healthy_env_runners(self) -> int:
        """Remote runners in service, plus the local runner if there is one."""
        return self.num_healthy_remote_env_runners() + (1 if self._local is not None else 0)

    def num_healthy_workers(self) -> int:
        return self.num_healthy_env_runners()

    def num_remote_env_runner_restarts(self) -> int:
        """How many times a remote runner came back into service (RLlib's count).

        A runner counts when a probe (or a ``mark_healthy`` call) brings it back after a
        failure, whether its process was replaced or it only answered again. A runner
        whose process died in ``__init__`` while the group started, and was started again
        by the restart policy, counts once per restart as soon as the group exists: it is
        in service from the first call on, so no later probe would see it come back
        (RLlib's "0 until a probe" holds for every failure after start-up).
        """
        return self._health.num_restarts

    def num_remote_worker_restarts(self) -> int:
        """RLlib's older name of ``num_remote_env_runner_restarts``."""
        return self.num_remote_env_runner_restarts()

    def num_in_flight_async_reqs(
        self, tag: str | None = None, *, tags: str | list[str] | None = None
    ) -> int:
        """Async requests sent and not yet fetched (of ``tag``/``tags``; default all)."""
        wanted = _tag_set(tags if tags is not None else tag)
        with self._health.lock:
            return sum(
                1 for q in self._health.in_flight.values() if wanted is None or q.tag in wanted
            )

    def probe_unhealthy_env_runners(self) -> list[int]:
        """Bring runners that are out of service back if they answer; ids of those back.

        Waits (up to ``env_runner_health_probe_timeout_s``) for process restarts under
        way, pings every out-of-service runner whose process is up, gives those that
        answer the current connector state, extra policies and weights, and puts them
        back in service (one restart each). Runners brought back since the last probe by
        a ``mark_healthy`` call are included.
        """
        return self._probe(self.config.env_runner_health_probe_timeout_s, wait=True)

    def probe_unhealthy_workers(self, timeout_seconds: float | None = None) -> list[int]:
        """RLlib's older probe, with its timeout argument (default: the config's)."""
        if timeout_seconds is None:
            timeout_seconds = self.config.env_runner_health_probe_timeout_s
        if (
            isinstance(timeout_seconds, bool)
            or not isinstance(timeout_seconds, (int, float))
            or timeout_seconds <= 0
        ):
            raise ValueError(f"timeout_seconds must be a positive number, got {timeout_seconds!r}")
        return self._probe(float(timeout_seconds), wait=True)

    def _probe(self, timeout: float, wait: bool) -> list[int]:
        """The probe; ``wait=False`` leaves restarts under way for a later probe."""
        if self._group is None:
            return []
        self._in_service()  # note deaths the group saw
        back = [r + 1 for r in self._health.pop_restored()]
        with self._health.lock:
            targets = sorted(self._health.out)
        if not targets:
            return back
        if wait:
            deadline = time.monotonic() + timeout
            if any(self._group.health()[r] == WorkerHealth.UNHEALTHY for r in targets):
                self._group.probe_unhealthy_workers(timeout)  # restart what can be
            health = self._group.health()
            under_way = [r for r in targets if health[r] in _COMING_BACK]
            if under_way:
                self._group.wait_healthy(max(deadline - time.monotonic(), 0.01), ranks=under_way)
        health = self._group.health()
        up = [
            r
            for r in targets
            if health[r] == WorkerHealth.HEALTHY and not self._health.still_busy(r)
        ]
        if not up:
            return back
        answered = self._call_remote("ping", up, None, timeout)
        restored = self._restore_runners([r for r, _ in answered.values], timeout)
        return sorted({*back, *(r + 1 for r in self._health.bring_back(restored))})

    def _restore_runners(self, ranks: list[int], timeout: float) -> list[int]:
        """Give runners coming back the current state and weights; the ranks that took them."""
        if not ranks:
            return []
        state = self._restore_state()
        with self._health.lock:
            self._health.restoring.update(ranks)
        try:
            rnd = self._call_remote(
                _restore_runner, ranks, {"state": state, "global_vars": self.global_vars}, timeout
            )
            ok = [r for r, _ in rnd.values]
            for r, err in rnd.errors:
                logger.warning("env runner %d: restoring its state failed: %s", r + 1, err)
            if ok and self._weights_version > 0:
                # The weight sender's hook re-sends the latest version to these ranks.
                self._group.run_restart_hooks(ok)
            return ok
        except Exception as e:  # noqa: BLE001 - they stay out; the next probe tries again
            logger.warning("env runners %s: restore failed: %s", [r + 1 for r in ranks], e)
            return []
        finally:
            with self._health.lock:
                self._health.restoring.difference_update(ranks)

    # ------------------------------------------------------------------ calls and failures
    def _select(
        self,
        func: Any,
        remote_worker_ids: list[int] | None,
        healthy_only: bool,
    ) -> tuple[list[int], list[Any] | None]:
        """Ranks to call (and their functions, for a list of functions), RLlib's filter:
        with ``healthy_only`` the runners out of service and their functions drop out."""
        ranks = (
            list(range(self.num_remote_env_runners()))
            if remote_worker_ids is None
            else self._ranks(remote_worker_ids)
        )
        funcs = None
        if isinstance(func, list):
            if len(func) != len(ranks):
                raise ValueError(
                    f"func: a list of {len(func)} functions for {len(ranks)} remote env runners"
                )
            funcs = list(func)
        for f in funcs if funcs is not None else [func]:
            if not (callable(f) or isinstance(f, str)):
                raise TypeError(f"func must be a callable or a method name, got {type(f).__name__}")
        if healthy_only:
            keep = set(self._in_service())
            if funcs is not None:
                funcs = [f for f, r in zip(funcs, ranks) if r in keep]
            ranks = [r for r in ranks if r in keep]
        return ranks, funcs

    def _call_remote(
        self,
        func: Any,
        ranks: list[int],
        kwargs: dict[str, Any] | None,
        timeout: float | None,
        funcs: list[Any] | None = None,
        *,
        return_obj_refs: bool = False,
    ) -> RunnerCall:
        """Call ``func`` on ``ranks`` and collect within ``timeout`` (see ``runner_calls``)."""
        return runner_calls.call(
            self._group, func, ranks, kwargs, timeout, funcs, return_obj_refs=return_obj_refs
        )

    def _runner_failed(self, rank: int, err: BaseException, actor: Any = None) -> None:
        """An error from runner ``rank``: out of service; replaced if the config restarts.

        A dead process is restarted by the group's restart policy; a runner whose call
        raised is killed here so the group replaces it (RLlib's runners exit for that).
        """
        dropped = self._health.take_out(rank)
        if dropped:
            logger.warning("env runner %d: %d async requests dropped with it", rank + 1, dropped)
        if (
            not isinstance(err, WorkerDiedError)
            and actor is not None
            and self.config.restart_failed_env_runners
        ):
            self._replace(rank, actor)
        elif actor is not None:
            self._await_noticed(rank, actor, dead=isinstance(err, WorkerDiedError))

    def _replace(self, rank: int, actor: Any) -> None:
        """Kill this incarnation of ``rank``; the group's restart policy starts a new one."""
        try:
            ray.kill(actor, no_restart=True)
        except Exception as e:  # noqa: BLE001 - already gone
            logger.debug("killing env runner %d: %s", rank + 1, e)
        self._await_noticed(rank, actor, dead=True)

    def _await_noticed(self, rank: int, actor: Any, dead: bool) -> None:
        """Wait (bounded) until the group saw the death of ``actor``, so the next probe
        finds the restart under way instead of a dead handle."""
        if not dead:
            return
        deadline = time.monotonic() + self.config.env_runner_health_probe_timeout_s
        while time.monotonic() < deadline:
            if self._group.actors[rank] is not actor:
                return
            if self._group.health()[rank] != WorkerHealth.HEALTHY:
                return
            time.sleep(0.005)

    def _settle(self, rnd: RunnerCall, *, mark_healthy: bool = False) -> None:
        """RLlib's error rule for a finished call: failed runners go out of service; their
        errors raise unless the config restarts or ignores failed runners."""
        for rank, err in rnd.errors:
            self._runner_failed(rank, err, rnd.actors.get(rank))
        for rank, _, _ in rnd.pending:
            # timeout 0 is RLlib's fire-and-forget: not collecting is what was asked for
            logger.log(
                logging.DEBUG if rnd.timeout == 0 else logging.WARNING,
                "env runner %d: %s() still running after %ss; its result is dropped",
                rank + 1,
                rnd.method,
                rnd.timeout,
            )
        if mark_healthy and rnd.values:
            back = self._health.bring_back([r for r, _ in rnd.values])
            with self._health.lock:
                self._health.restored.update(back)
        if rnd.errors:
            if not self._fault_tolerant:
                raise rnd.errors[0][1]
            for rank, err in rnd.errors:
                logger.warning(
                    "env runner %d failed and is out of service: %s",
                    rank + 1,
                    str(err).splitlines()[0],
                )

    def _foreach_remote(
        self,
        func: Any,
        *,
        kwargs: dict[str, Any] | None = None,
        ranks: list[int] | None = None,
        timeout_seconds: float | None = None,
    ) -> list[Any]:
        """Values of ``func`` on the runners in service (rank order), failures per config."""
        sel = self._in_service() if ranks is None else [r for r in ranks if r in self._in_service()]
        rnd = self._call_remote(func, sel, kwargs, timeout_seconds)
        self._settle(rnd)
        return [v for _, v in rnd.values]

    # ------------------------------------------------------------------ foreach
    def foreach_env_runner(
        self,
        func: Callable[[EnvRunner], Any] | str | list[Callable[[EnvRunner], Any] | str],
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

        The local runner's result first (if it exists and ``local_env_runner``), then the
        remote runners' in id order. ``func`` may be a list with one function per selected
        remote runner. ``healthy_only`` calls only the runners in service. A runner that
        fails is taken out of service and its result left out; its error raises unless
        the config restarts or ignores failed runners. Results not ready after
        ``timeout_seconds`` are dropped (logged; the runner stays in service);
        ``return_obj_refs`` returns the refs of the results ready by then.
        ``mark_healthy`` (with ``healthy_only=False``) brings runners out of service that
        answer back, each counted as a restart.
        """
        if local_worker is not None:
            local_env_runner = local_worker
        if return_obj_refs and local_env_runner and self._local is not None:
            raise ValueError(
                "return_obj_refs: the local runner has no object refs; pass local_env_runner=False"
            )
        _check_timeout(timeout_seconds)
        out: list[Any] = []
        if self._group is not None:
            ranks, funcs = self._select(func, remote_worker_ids, healthy_only)
            rnd = self._call_remote(
                func, ranks, kwargs, timeout_seconds, funcs, return_obj_refs=return_obj_refs
            )
            self._settle(rnd, mark_healthy=mark_healthy)
            out = [v for _, v in rnd.values]
        if local_env_runner and self._local is not None:
            local_func = func[0] if isinstance(func, list) else func
            out.insert(0, runner_calls.call_on_runner(self._local, local_func, kwargs))
        return out

    foreach_worker = foreach_env_runner

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
        return self.foreach_env_runner(
            _with_worker_id,
            kwargs={"func": func, "kwargs": kwargs or {}},
            local_env_runner=local_env_runner if local_worker is None else local_worker,
            healthy_only=healthy_only,
            remote_worker_ids=remote_worker_ids,
            timeout_seconds=timeout_seconds,
            return_obj_refs=return_obj_refs,
            mark_healthy=mark_healthy,
        )

    foreach_env_runner_with_id = foreach_worker_with_id

    # ------------------------------------------------------------------ async requests
    def foreach_env_runner_async(
        self,
        func: Callable[[EnvRunner], Any] | str | list[Callable[[EnvRunner], Any] | str],
        tag: str | None = None,
        *,
        kwargs: dict[str, Any] | None = None,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
    ) -> int:
        """Start ``func`` on the remote runners without waiting; returns how many requests
        were sent. A runner that already has ``max_requests_in_flight_per_env_runner``
        requests in flight (any tag) gets none. Collect with ``fetch_ready_async_reqs``."""
        if tag is not None and not isinstance(tag, str):
            raise TypeError(f"tag must be a str or None, got {type(tag).__name__}")
        if self._group is None:
            return 0
        ranks, funcs = self._select(func, remote_worker_ids, healthy_only)
        budget = self.config.max_requests_in_flight_per_env_runner
        with self._health.lock:
            busy: dict[int, int] = {}
            for q in self._health.in_flight.values():
                busy[q.rank] = busy.get(q.rank, 0) + 1
        send, send_funcs = [], []
        for i, r in enumerate(ranks):
            if busy.get(r, 0) < budget:
                busy[r] = busy.get(r, 0) + 1
                send.append(r)
                if funcs is not None:
                    send_funcs.append(funcs[i])
        over = [r + 1 for r in ranks if r not in send]
        if over:
            logger.debug("foreach_env_runner_async: runners %s are at their in-flight limit", over)
        if not send:
            return 0
        called, refs, actors, down = runner_calls.start(
            self._group, func, send, kwargs, send_funcs if funcs is not None else None
        )
        with self._health.lock:
            for rank, ref, actor in zip(called, refs, actors):
                self._health.in_flight[ref] = AsyncRequest(tag, rank, actor)
        for r in down:
            self._health.take_out(r)
        return len(refs)

    foreach_worker_async = foreach_env_runner_async

    def _fetch(
        self,
        tags: set[str | None] | None,
        timeout_seconds: float | None,
        return_obj_refs: bool,
        mark_healthy: bool,
    ) -> tuple[list[tuple[int, Any]], list[tuple[int, BaseException]]]:
        """Ready async requests of ``tags``: their values and errors (runners that failed
        are out of service already). Waits up to ``timeout_seconds`` for all of them."""
        h = self._health
        with h.lock:
            held = [(r, v) for t, r, v in h.held if tags is None or t in tags]
            h.held = [x for x in h.held if not (tags is None or x[0] in tags)]
            mine = [(ref, q) for ref, q in h.in_flight.items() if tags is None or q.tag in tags]
        values: list[tuple[int, Any]] = list(held)
        errors: list[tuple[int, BaseException]] = []
        if mine:
            refs = [ref for ref, _ in mine]
            ready, _ = ray.wait(
                refs, num_returns=len(refs), timeout=timeout_seconds, fetch_local=False
            )
            done = set(ready)
            for ref, q in mine:
                if ref not in done:
                    continue
                with h.lock:
                    if h.in_flight.pop(ref, None) is None:
                        continue  # its runner went out of service meanwhile
                if return_obj_refs:
                    values.append((q.rank, ref))
                    continue
                try:
                    values.append((q.rank, ray.get(ref)))
                except (RayTaskError, RayActorError) as e:
                    err = unwrap_error(self._group.name, "foreach_env_runner_async", q.rank, e)
                    errors.append((q.rank, err))
                    self._runner_failed(q.rank, err, q.actor)
        if mark_healthy and values:
            back = h.bring_back([r for r, _ in values])
            with h.lock:
                h.restored.update(back)
        return values, errors

    def _raise_or_log(
        self,
        values: list[tuple[int, Any]],
        errors: list[tuple[int, BaseException]],
        tags: set[str | None] | None,
    ) -> None:
        """RLlib's rule for async errors; values fetched with a raised error are kept for
        the next fetch, further errors are logged (nothing is dropped unseen)."""
        if not errors:
            return
        first = errors[0][1]
        for rank, err in errors[0 if self._fault_tolerant else 1 :]:
            logger.warning(
                "env runner %d failed an async request and is out of service: %s",
                rank + 1,
                str(err).splitlines()[0],
            )
        if not self._fault_tolerant:
            tag = next(iter(tags)) if tags is not None and len(tags) == 1 else None
            with self._health.lock:
                self._health.held[:0] = [(tag, r, v) for r, v in values]
            raise first

    def fetch_ready_async_reqs(
        self,
        *,
        tags: str | list[str] | tuple[str, ...] | None = None,
        timeout_seconds: float | None = 0.0,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
    ) -> list[tuple[int, Any]]:
        """``(worker_id, result)`` of the async requests (of ``tags``; None: all) that are
        done. Waits up to ``timeout_seconds`` for every request in flight (None: until all
        are done; 0: only those done now)."""
        _check_timeout(timeout_seconds)
        wanted = _tag_set(tags)
        if self._group is None:
            return []
        values, errors = self._fetch(wanted, timeout_seconds, return_obj_refs, mark_healthy)
        self._raise_or_log(values, errors, wanted)
        return [(r + 1, v) for r, v in values]

    def foreach_env_runner_async_fetch_ready(
        self,
        func: Callable[[EnvRunner], Any] | str | list[Callable[[EnvRunner], Any] | str],
        kwargs: dict[str, Any] | None = None,
        tag: str | None = None,
        timeout_seconds: float | None = 0.0,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
        return_actor_ids: bool = False,
    ) -> list[Any]:
        """Fetch the results of earlier requests of ``tag``, then send ``func`` again.

        First the ready results of requests made with the same ``tag`` are fetched (up
        to ``timeout_seconds``), then ``func`` goes to the selected runners (those at
        their in-flight limit are skipped), then errors are handled as in
        ``fetch_ready_async_reqs``. Returns the fetched values, or ``(worker_id, value)``
        pairs with ``return_actor_ids``.
        """
        _check_timeout(timeout_seconds)
        if self._group is None:
            return []
        wanted = {tag}
        values, errors = self._fetch(wanted, timeout_seconds, return_obj_refs, mark_healthy)
        self.foreach_env_runner_async(
            func,
            tag,
            kwargs=kwargs,
            healthy_only=healthy_only,
            remote_worker_ids=remote_worker_ids,
        )
        self._raise_or_log(values, errors, wanted)
        if return_actor_ids:
            return [(r + 1, v) for r, v in values]
        return [v for _, v in values]

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

    # ------------------------------------------------------------------ spaces
    def get_spaces(self) -> dict[str, tuple[gym.Space, gym.Space]]:
        """``{"__env__": (obs, act), policy_id: (obs, act), ...}`` from the local runner,
        else from the first healthy remote runner."""
        if self._local is not None:
            return self._local.get_spaces()
        ids = self.healthy_worker_ids()
        if not ids and self.config.restart_failed_env_runners:
            # every runner is out with restarts under way (e.g. killed while starting)
            ids = [r + 1 for r in self._wait_for_any(self._restart_wait_s())]
        if not ids:
            raise RuntimeError("get_spaces: no local runner and no healthy remote runner")
        return self._first_answer("get_spaces", ids)

    # ------------------------------------------------------------------ weights and state
    def _remote_weights(self) -> dict[str, dict[str, np.ndarray]]:
        ids = self.healthy_worker_ids()
        if not ids:
            raise RuntimeError("no healthy remote runner to read weights from")
        return self._first_answer("get_weights", ids)

    def _first_answer(self, method: str, ids: list[int]) -> Any:
        """``method()`` of the first of the runners ``ids`` that answers (RLlib asks one)."""
        for wid in ids:
            got = self._foreach_remote(
                method, ranks=[wid - 1], timeout_seconds=self.config.sample_timeout_s
            )
            if got:
                return got[0]
        raise RuntimeError(f"{method}: none of the remote runners {ids} answered")

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
                # "auto": runners on this node view the sender's shared buffer (they set
                # read_only_weights), runners on other nodes get the object store.
                self._sender = WeightSender(
                    self._group, transport="auto", timeout_s=self.config.sample_timeout_s
                )
            if self._sync_pending:
                self._sync_pending = False
                self._sender.wait_async()
            healthy = set(self._in_service())
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
            weights = self._first_answer("get_weights", [rank + 1])
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
                    self._foreach_remote(
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
            self._foreach_remote(
                "set_connector_state",
                kwargs={"state": merged},
                ranks=ranks,
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
        """Start ``sample(**kwargs)`` on every remote runner in service; collect the
        batches with ``collect_samples``. None when there is no remote runner.

        First brings back runners that were restarted since the last round (a probe that
        does not wait for restarts still under way). With no runner in service it waits
        for the first restart under way to finish (up to ``env_runner_health_probe_timeout_s``
        + 180 s); with none coming back it raises ``WorkerDiedError``.
        """
        if self._group is None:
            return None
        self._probe(self.config.env_runner_health_probe_timeout_s, wait=False)
        ranks = self._in_service()
        if not ranks:
            ranks = self._wait_for_any(self._restart_wait_s())
        if not ranks:
            health = self._group.health()
            raise WorkerDiedError(
                self._group.name,
                -1,
                "sample",
                "",
                "NoHealthyRunner",
                "no remote env runner is in service to sample with (runner health: "
                + ", ".join(f"{r + 1}: {h.value}" for r, h in health.items())
                + f"; {self.num_remote_env_runner_restarts()} restarts so far)",
            )
        called, refs, actors, down = runner_calls.start(self._group, "sample", ranks, kwargs)
        for r in down:
            self._health.take_out(r)
        with self._health.lock:
            for ref, actor in zip(refs, actors):
                self._sample_actors[ref] = actor
        return GroupHandle(self._group, "sample", called, refs)

    def _restart_wait_s(self) -> float:
        """How long to wait for a runner to come back when every one is out."""
        return self.config.env_runner_health_probe_timeout_s + RESTART_WAIT_S

    def _wait_for_any(self, timeout: float) -> list[int]:
        """Every runner is out: wait until one is back in service (probing as restarts
        finish) while a restart is under way, up to ``timeout``; the ranks in service."""
        deadline = time.monotonic() + timeout
        while True:
            self._probe(self.config.env_runner_health_probe_timeout_s, wait=False)
            ranks = self._in_service()
            left = deadline - time.monotonic()
            if ranks or left <= 0:
                return ranks
            health = self._group.health()
            restarting = [r for r, h in health.items() if h == WorkerHealth.RESTARTING]
            if not restarting:
                # None under way: a full probe restarts what the policy allows and waits.
                self._probe(self.config.env_runner_health_probe_timeout_s, wait=True)
                ranks = self._in_service()
                health = self._group.health()
                if ranks or not any(h == WorkerHealth.RESTARTING for h in health.values()):
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
        died is taken out of service and left out of the round (restarted per config);
        its error raises only when the config neither restarts nor ignores failed
        runners. A runner still sampling at the timeout is left out and taken out of
        service, and restarted when the config restarts runners (RLlib drops its batch
        too); a stall does not raise. With no remote runners the local runner samples.
        """
        if handle is None:
            if self._local is None:
                raise RuntimeError("no env runner to sample with")
            return [self._local.sample(**local_kwargs)]
        timeout = self.config.sample_timeout_s
        with self._health.lock:
            actors = [self._sample_actors.pop(ref, None) for ref in handle.refs]
        rnd = runner_calls.collect(
            self._group, "sample", handle.ranks, handle.refs, actors, timeout
        )
        for rank, ref, actor in rnd.pending:
            self._runner_stalled(rank, ref, actor, timeout)
        rnd.pending = []
        self._settle(rnd)
        return [v for _, v in rnd.values]

    def _runner_stalled(self, rank: int, ref: ray.ObjectRef, actor: Any, timeout: float) -> None:
        """``rank`` is still sampling after ``sample_timeout_s``: drop its batch, take it out
        of service, and restart it if the config restarts runners."""
        restart = self.config.restart_failed_env_runners and actor is not None
        logger.warning(
            "env runner %d still sampling after sample_timeout_s=%s: its batch is dropped "
            "and it is %s",
            rank + 1,
            timeout,
            "restarted" if restart else "out of service until it answers a probe",
        )
        dropped = self._health.take_out(rank)
        if dropped:
            logger.warning("env runner %d: %d async requests dropped with it", rank + 1, dropped)
        if restart:
            self._replace(rank, actor)
        else:
            with self._health.lock:
                self._health.busy[rank] = ref

    def sample(self, **kwargs: Any) -> list[dict[str, Any]]:
        """One batch per remote runner in service (or from the local runner if there are
        none); failed and stalled runners are left out as ``collect_samples`` says."""
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
        if not hasattr(new_remote_workers, "sample"):
            raise TypeError("new_remote_workers: the group's workers are not EnvRunners")
        self._close_sender()
        if self._group is not None and self._group is not new_remote_workers:
            self._group.shutdown(force=True)
        self._adopt(new_remote_workers)
        from dataclasses import replace

        self.config = replace(self.config, num_env_runners=new_remote_workers.world_size)
        self._register_restore_state()

    def stop(self) -> None:
        """Close every runner's envs and end the remote runners."""
        if self._local is not None:
            self._local.stop()
        self._close_sender()
        if self._group is not None:
            # Every runner whose process is up, in service or not (RLlib stops them all),
            # except those stuck in a call: they would not answer; shutdown ends them.
            ranks = [r for r in range(self._group.world_size) if not self._health.still_busy(r)]
            rnd = self._call_remote("stop", ranks, None, 10.0)
            for rank, err in rnd.errors:
                logger.info("stopping env runner %d: %s", rank + 1, str(err).splitlines()[0])
            if self._remove_hook is not None:
                self._remove_hook()
                self._remove_hook = None
            self._group.shutdown(force=True)
            self._group = None
            self._health.reset()
            self._sample_actors.clear()

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


_COMING_BACK = (WorkerHealth.UNHEALTHY, WorkerHealth.RESTARTING)
# With every runner out, how long ``sample`` waits for a restart under way to finish
# (beyond the probe timeout): a new runner process starts in ~1 s on an idle machine.
RESTART_WAIT_S = 180.0


def _check_timeout(timeout_seconds: float | None) -> None:
    if timeout_seconds is not None and (
        isinstance(timeout_seconds, bool)
        or not isinstance(timeout_seconds, (int, float))
        or timeout_seconds < 0
    ):
        raise ValueError(f"timeout_seconds must be >= 0 or None, got {timeout_seconds!r}")


def _tag_set(tags: str | list[str] | tuple[str, ...] | None) -> set[str | None] | None:
    if tags is None:
        return None
    if isinstance(tags, str):
        return {tags}
    if isinstance(tags, (list, tuple, set)) and all(isinstance(t, str) for t in tags):
        return set(tags) or None
    raise TypeError(f"tags must be a str, a list of str or None, got {tags!r}")


# Functions shipped to runners (module level so they pickle by reference).
def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in module.state_dict().items()}


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


def _restore_runner(runner: EnvRunner, state: dict[str, Any], global_vars: dict[str, Any]) -> None:
    runner.set_state(state)
    runner.global_vars = dict(global_vars)


def _set_global_vars(runner: EnvRunner, global_vars: dict[str, Any]) -> None:
    runner.global_vars = dict(global_vars)
