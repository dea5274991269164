"""WorkerGroup: a set of worker actors called as one, with three faces over one call path.

RLinf face: ``MyWorker.create_group(...).launch(cluster, placement, name)``; the worker
class's public methods appear on the group and return a ``GroupHandle``;
``execute_on(*ranks)`` narrows the next call.

NeMo-RL face: ``RayWorkerGroup(virtual_cluster, builder, ...)`` with
``run_single_worker_single_data``, ``run_all_workers_single_data``,
``run_all_workers_multiple_data`` and ``run_all_workers_sharded_data``.

RLlib face (any group): ``foreach_worker``, ``foreach_worker_with_id``,
``foreach_worker_async`` / ``fetch_ready_async_reqs``, ``foreach_actor`` (results with
``.ok``/``.get()``), and health: ``healthy_worker_ids``, ``probe_unhealthy_workers``,
``num_remote_worker_restarts``.

The class is a facade. The work is done by small modules: ``launch`` (start workers, the
roster of live actors), ``dispatch`` (each call style as a pure function from arguments to
per-rank calls), ``collect`` (the one result path), ``fault`` (health and restarts, behind
the ``Members`` interface), ``requests`` (async request bookkeeping) and ``hang`` (reports).
Every face ends in ``WorkerGroup._call(method, [(rank, args, kwargs), ...])``, which puts
arguments shared by several ranks into the object store once and returns a handle.

Failure rule of a plain group: an exception raised by a worker's code is that call's
``WorkerError`` and the worker stays healthy; only a dead process makes a worker unhealthy
(restarted or left out per the ``RestartPolicy``). ``RestartPolicy(restart_on_error=True)``
switches to RLlib's rule (an exception is a worker failure).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import ray

from phalanx._base import trace as _trace
from phalanx.group import dispatch
from phalanx.group import hang as _hang
from phalanx.group.collect import Collector, check_timeout
from phalanx.group.fault import FaultState, HealthEvent, RestartPolicy, WorkerHealth
from phalanx.group.futures import GroupHandle, MultiWorkerFuture
from phalanx.group.launch import (
    Roster,
    WorkerRank,
    bundle_indices_for,
    check_bundle_indices,
    check_resources,
    check_sharding,
    pin_to_nodes,
    placement_slots,
    resolve_name,
    wait_names_free,
)
from phalanx.group.requests import AsyncRequests, AsyncSubmission, check_tags
from phalanx.group.results import RemoteCallResults
from phalanx.group.sharding import NamedSharding
from phalanx.resources.cluster import Cluster
from phalanx.resources.placement import Placement, WorkerSlot, default_placement
from phalanx.resources.virtual_cluster import RayVirtualCluster
from phalanx.worker.builder import RayWorkerBuilder, _check_env

logger = logging.getLogger(__name__)

_NEW, _RUNNING, _SHUT_DOWN = "new", "running", "shut down"


class UnknownMethodError(AttributeError, ValueError):
    """The worker class has no public method of that name."""


class _GroupMethod:
    """``group.method`` (or ``group.execute_on(...).method``): calling it dispatches."""

    __slots__ = ("_group", "_name", "_ranks")

    def __init__(self, group: WorkerGroup, name: str, ranks: list[int] | None):
        self._group, self._name, self._ranks = group, name, ranks

    def __call__(self, *args: Any, **kwargs: Any) -> GroupHandle:
        g = self._group
        if self._ranks is None:
            calls = [(r, args, kwargs) for r in g._all_ranks]
            return g._call(self._name, calls, health=g._broadcast_health())
        return g._call(self._name, [(r, args, kwargs) for r in self._ranks])

    def __repr__(self) -> str:
        return f"<group method {self._group.name}.{self._name}>"


class _RankView:
    """The group restricted to some ranks, for the next call."""

    __slots__ = ("_group", "_ranks")

    def __init__(self, group: WorkerGroup, ranks: list[int]):
        self._group, self._ranks = group, ranks

    def __getattr__(self, name: str) -> _GroupMethod:
        self._group._check_method(name)
        return _GroupMethod(self._group, name, self._ranks)


class _ActorProxy:
    """A worker's handle as NeMo-RL users hold it: ``proxy.method.remote(*args)``."""

    __slots__ = ("actor", "_group", "_rank")

    def __init__(self, group: WorkerGroup, rank: int, actor: ray.actor.ActorHandle):
        self.actor, self._group, self._rank = actor, group, rank

    def __getattr__(self, name: str) -> Any:
        group, rank = self._group, self._rank
        group._check_method(name)

        class _Remote:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                return group._bare_refs(group._call(name, [(rank, args, kwargs)]))[0]

        return _Remote()

    def __repr__(self) -> str:
        return f"<worker {self._group.name}:{self._rank}>"


class WorkerGroup:
    """A group of workers of one class (also exported as ``RayWorkerGroup``).

    NeMo-RL form, launched at once::

        RayWorkerGroup(virtual_cluster, RayWorkerBuilder("pkg.mod.Cls", cfg),
                       workers_per_node=None, name_prefix="policy",
                       bundle_indices_list=None, sharding_annotations=NamedSharding(...))

    RLinf form, launched later: ``Cls.create_group(cfg).launch(cluster, placement, name)``.
    """

    WorkerRank = WorkerRank  # RLinf's ``WorkerGroup.WorkerRank`` (see ``worker_info_list``)

    def __init__(
        self,
        cluster: RayVirtualCluster | None = None,
        remote_worker_builder: RayWorkerBuilder | None = None,
        workers_per_node: int | list[int] | None = None,
        name_prefix: str = "",
        bundle_indices_list: list[tuple[int, list[int]]] | None = None,
        sharding_annotations: NamedSharding | None = None,
        *,
        env_vars: dict[str, str] | None = None,
        launch_timeout_s: float = 120.0,
        restart_policy: RestartPolicy | None = None,
    ):
        if remote_worker_builder is None:
            raise ValueError("remote_worker_builder is required (a RayWorkerBuilder)")
        if not isinstance(remote_worker_builder, RayWorkerBuilder):
            raise TypeError(
                f"remote_worker_builder must be a RayWorkerBuilder, got {type(remote_worker_builder).__name__}"
            )
        self._builder = remote_worker_builder
        self.name: str = ""
        self.name_prefix = name_prefix
        self.cluster: Any = None
        self.sharding_annotations: NamedSharding | None = sharding_annotations
        self.dp_leader_worker_indices: list[int] = []
        self._roster = Roster(remote_worker_builder, launch_timeout_s)
        self._all_ranks: list[int] = []
        self._env_vars = _check_env(env_vars, "env_vars")
        self._state = _NEW
        # Run in order after a rank restarts and its state is restored (add_restart_hook).
        self._restart_hooks: list[Callable[[list[int]], None]] = []
        self._fault = FaultState(
            self._roster, _check_policy(restart_policy), _weak_restart_hooks(self)
        )
        self._collector = Collector(self, self._fault)
        self._requests = AsyncRequests()
        self._state_hook: Callable[[], None] | None = None
        self._watchdog: _hang.Watchdog | None = None
        self.max_requests_in_flight_per_worker = 2
        if cluster is not None:
            if not isinstance(cluster, RayVirtualCluster):
                raise TypeError(
                    f"cluster must be a RayVirtualCluster, got {type(cluster).__name__}; "
                    "for a px.Cluster use create_group().launch(cluster, ...)"
                )
            self._launch_on_virtual_cluster(cluster, workers_per_node, bundle_indices_list)

    # ------------------------------------------------------------------ launching
    def launch(
        self,
        cluster: Cluster | RayVirtualCluster | None = None,
        placement: Placement | None = None,
        name: str | None = None,
        max_concurrency: int | None = None,
        isolate_gpu: bool | None = None,
        *,
        placement_strategy: Placement | None = None,
        sharding: NamedSharding | None = None,
        env_vars: dict[str, str] | None = None,
        timeout_s: float | None = None,
        restart_policy: RestartPolicy | None = None,
    ) -> WorkerGroup:
        """Start the workers; returns the group.

        With no placement: one worker per GPU if the cluster has GPUs, else one CPU worker
        per node (``NodePlacement()``). ``placement_strategy`` is RLinf's name for
        ``placement``. ``max_concurrency`` (RLinf): how many calls each worker's actor runs
        at once (default 1: calls run one after another). ``isolate_gpu`` (RLinf): whether
        each worker of an RLinf ``PlacementStrategy`` sees only its own GPUs (``None``:
        RLinf's default, True); phalanx placements take it when built instead.
        """
        if self._state == _RUNNING:
            raise RuntimeError(f"group {self.name!r} is already launched")
        if placement is not None and placement_strategy is not None:
            raise ValueError("give placement or placement_strategy, not both")
        placement = placement if placement is not None else placement_strategy
        if placement is not None and not isinstance(placement, Placement):
            raise TypeError(
                f"placement must be a phalanx Placement, got {type(placement).__name__}"
            )
        if max_concurrency is not None and (
            isinstance(max_concurrency, bool)
            or not isinstance(max_concurrency, int)
            or max_concurrency < 1
        ):
            raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        self._roster.max_concurrency = max_concurrency
        if sharding is not None:
            self.sharding_annotations = sharding
        if env_vars:
            self._env_vars.update(_check_env(env_vars, "env_vars"))
        if timeout_s is not None:
            if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
                raise TypeError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
            if not timeout_s > 0:
                raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
            self._roster.launch_timeout_s = timeout_s
        if restart_policy is not None:
            self._fault.policy = _check_policy(restart_policy)
        if name is not None:
            self.name_prefix = name
        if isinstance(cluster, RayVirtualCluster):
            if isolate_gpu is not None:
                raise ValueError(
                    "isolate_gpu: a RayVirtualCluster already fixes each worker's devices"
                )
            if placement is not None:
                raise ValueError(
                    "placement: a RayVirtualCluster already fixes placement; pass one or the other"
                )
            self._launch_on_virtual_cluster(cluster, None, None)
            return self
        cluster = cluster if cluster is not None else Cluster()
        if not isinstance(cluster, Cluster):
            raise TypeError(
                f"cluster must be a phalanx Cluster or RayVirtualCluster, got {type(cluster).__name__}"
            )
        self.cluster = cluster
        placement = placement if placement is not None else default_placement(cluster)
        slots = placement_slots(placement, cluster, isolate_gpu)
        check_resources(cluster, slots)
        pin_to_nodes(slots)
        self._start(slots)
        return self

    def _launch_on_virtual_cluster(
        self,
        vc: RayVirtualCluster,
        workers_per_node: int | list[int] | None,
        bundle_indices_list: list[tuple[int, list[int]]] | None,
    ) -> None:
        self.cluster = vc
        if bundle_indices_list is None:
            counts = [pg.bundle_count for pg in vc.get_placement_groups()]
            bundle_indices_list = bundle_indices_for(counts, workers_per_node)
        else:
            check_bundle_indices(bundle_indices_list)
        self._start(vc.slots(bundle_indices_list))

    def _start(self, slots: list[WorkerSlot]) -> None:
        check_sharding(self.sharding_annotations, len(slots))
        roster = self._roster
        roster.cluster = self.cluster
        policy = self._fault.policy
        self.name = resolve_name(self.name_prefix, self._builder.class_name)

        def startup_restarts_left(rank: int, done: int) -> bool:
            return policy.restarts_enabled and done < policy.max_restarts_per_worker

        restarts = roster.start(slots, self.name, self._env_vars, startup_restarts_left)
        world = len(slots)
        self._all_ranks = list(range(world))
        if self.sharding_annotations is None:
            self.sharding_annotations = NamedSharding.default(world)
        leaders = [s.rank for s in slots if s.bundle_indices is not None]
        self.dp_leader_worker_indices = leaders if leaders else list(range(world))
        self._fault.reset(world, restarts)
        self._fault.start_watching()
        if self._state_hook is not None:
            self._state_hook()
            self._state_hook = None
        if policy.capture_state_from is not None:
            self._state_hook = self._collector.add_result_hook(
                policy.capture_state_from, self._fault.remember_states
            )
        watchdog_s = os.environ.get("PHALANX_WATCHDOG_S")
        if watchdog_s:
            self.set_watchdog(float(watchdog_s))
        self._state = _RUNNING
        _trace.register_group(self)

    # ------------------------------------------------------------------ the call path
    @property
    def collector(self) -> Collector:
        """The group's one result path (used by handles and futures)."""
        return self._collector

    @property
    def methods(self) -> dict[str, str]:
        """Public methods of the worker class: name -> ``sync``/``async``/``gen``/``asyncgen``."""
        return dict(self._roster.methods)

    @property
    def _methods(self) -> dict[str, str]:
        # Read by phalanx.envs.env_runner_group (to be replaced there by ``methods``).
        return self._roster.methods

    def _check_live(self) -> None:
        if self._state != _RUNNING:
            what = self.name or self.name_prefix or self._builder.class_name
            if self._state == _SHUT_DOWN:
                raise RuntimeError(f"group {what!r} is shut down; launch a new group")
            raise RuntimeError(f"group {what!r} is not launched yet")

    def _check_method(self, method: str) -> None:
        if method not in self._roster.methods:
            self._check_live()
            raise UnknownMethodError(
                f"method_name {method!r}: {self._builder.class_name} has no public method of that name "
                f"(known: {sorted(self._roster.methods)})"
            )

    def _call(
        self,
        method: str,
        calls: list[tuple[int, tuple, dict]],
        fn: Callable[..., Any] | None = None,
        *,
        health: str = "restart",
    ) -> GroupHandle:
        """The one dispatch: for each (rank, args, kwargs) start the call; return a handle.

        ``health`` says what to do with a called rank that is not healthy: ``"restart"``
        (wait for or start its restart; raise naming it if that cannot be),
        ``"skip"`` (leave it out; the handle lists it in ``skipped``) or ``"any"`` (call it).
        """
        if self._state != _RUNNING:
            self._check_live()
        t0 = time.perf_counter() if _trace.ON else 0.0
        if fn is None:
            self._check_method(method)
        skipped = None
        if self._fault.not_healthy and health != "any":
            ready, skipped = self._fault.ensure_ready(
                [c[0] for c in calls], method, skip=health == "skip"
            )
            if skipped:
                keep = set(ready)
                calls = [c for c in calls if c[0] in keep]
        stream = fn is None and self._roster.methods[method] in ("gen", "asyncgen")
        shared = self._share(calls) if len(calls) > 1 else None
        refs = []
        actors = self._roster.actors
        for rank, args, kwargs in calls:
            if shared:
                args = tuple(shared.get(id(a), a) for a in args)
                kwargs = {k: shared.get(id(v), v) for k, v in kwargs.items()}
            actor = actors[rank]
            if fn is not None:
                refs.append(actor._px_apply.remote(fn, *args, **kwargs))
            elif stream:
                # Each public method has its own actor method (see host_class_for).
                remote = getattr(actor, method).options(num_returns="streaming")
                refs.append(remote.remote(*args, **kwargs))
            else:
                refs.append(getattr(actor, method).remote(*args, **kwargs))
        handle = GroupHandle(self, method, [c[0] for c in calls], refs)
        if skipped:
            handle.skipped = skipped
        if self._watchdog is not None:
            self._watchdog.track(handle)
        if t0:
            _trace.driver_call(self, method, calls, handle, t0)
        return handle

    @staticmethod
    def _share(calls: list[tuple[int, tuple, dict]]) -> dict[int, Any]:
        """Values passed to several ranks and too big to inline go to the object store once."""
        values = dispatch.shared_values(calls, lambda v: isinstance(v, ray.ObjectRef))
        return {key: ray.put(v) for key, v in values.items()}

    def _bare_refs(self, handle: GroupHandle) -> list[Any]:
        """A handle's refs for faces that return bare Ray refs; the label is kept for
        ``MultiWorkerFuture`` errors."""
        self._collector.note_label(handle.refs, handle.method)
        return handle.refs

    # ------------------------------------------------------------------ RLinf face
    def __getattr__(self, name: str) -> _GroupMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        roster = self.__dict__.get("_roster")
        methods = roster.methods if roster is not None else {}
        if name not in methods:
            state = self.__dict__.get("_state")
            if state == _SHUT_DOWN:
                raise AttributeError(f"{name!r}: the group is shut down")
            if state != _RUNNING:
                raise AttributeError(f"{name!r}: the group is not launched yet")
            raise UnknownMethodError(
                f"{name!r}: {self._builder.class_name} has no public method of that name (known: {sorted(methods)})"
            )
        return _GroupMethod(self, name, None)

    def execute_on(self, *ranks: int) -> _RankView:
        """The group restricted to ``ranks`` for the next call: ``g.execute_on(0, 3).hello()``."""
        return _RankView(self, dispatch.execute_on(ranks, self.world_size, self.name))

    def call(
        self, method: str, *args: Any, ranks: list[int] | None = None, **kwargs: Any
    ) -> GroupHandle:
        """Call ``method`` on ``ranks`` (default all) with the same arguments."""
        if ranks is None:
            calls = dispatch.broadcast(self._all_ranks, args, kwargs)
            return self._call(method, calls, health=self._broadcast_health())
        ranks = self._check_ranks(ranks, "ranks")
        return self._call(method, dispatch.broadcast(ranks, args, kwargs))

    def call_ranks(
        self, method: str, calls: list[tuple[int, tuple, dict]], *, skip_unhealthy: bool = False
    ) -> GroupHandle:
        """Call ``method`` with per-rank arguments: ``calls`` is ``[(rank, args, kwargs), ...]``.

        A rank that is not healthy is waited for or restarted first; with
        ``skip_unhealthy`` it is left out and listed in the handle's ``skipped``.
        """
        self._check_ranks([c[0] for c in calls], "calls")
        return self._call(method, calls, health="skip" if skip_unhealthy else "restart")

    def apply(
        self,
        fn: Callable[..., Any],
        calls: list[tuple[int, tuple, dict]],
        *,
        label: str | None = None,
        skip_unhealthy: bool = False,
    ) -> GroupHandle:
        """Run ``fn(worker, *args, **kwargs)`` on chosen ranks, with per-rank arguments.

        ``calls`` is ``[(rank, args, kwargs), ...]``; ``fn`` is pickled to each worker and
        runs like a method call (same error wrapping, weights lock and health handling).
        ``label`` names the call in errors and traces (default: ``fn``'s name).
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self._check_ranks([c[0] for c in calls], "calls")
        name = label or getattr(fn, "__name__", "apply")
        return self._call(name, calls, fn=fn, health="skip" if skip_unhealthy else "restart")

    def add_restart_hook(self, hook: Callable[[list[int]], None]) -> Callable[[], None]:
        """Run ``hook(ranks)`` after restarted ranks got their state back, before they take calls.

        Every registered hook runs, in registration order (the weights layer re-sends the
        latest weights this way). Returns a function that removes the hook.
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        self._restart_hooks.append(hook)

        def remove() -> None:
            if hook in self._restart_hooks:
                self._restart_hooks.remove(hook)

        return remove

    def run_restart_hooks(self, ranks: list[int]) -> None:
        """Run every restart hook for ``ranks`` (called by the restart machinery)."""
        for hook in list(self._restart_hooks):
            hook(ranks)

    def add_result_hook(
        self, method: str, hook: Callable[[list[int], list[Any]], None]
    ) -> Callable[[], None]:
        """Run ``hook(ranks, values)`` with the results of every call of ``method`` that
        the group collects (any call style). Returns a function that removes the hook."""
        if not isinstance(method, str):
            raise TypeError(f"method must be a method name, got {type(method).__name__}")
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        return self._collector.add_result_hook(method, hook)

    @property
    def worker_info_list(self) -> list[WorkerRank]:
        """RLinf's list of ``WorkerRank(worker=actor handle, rank=rank)``, in rank order."""
        return self._roster.worker_ranks()

    def _close(self) -> None:
        """RLinf's ``_close``: run each worker's ``_close()`` if it has one, then free every
        actor (as ``shutdown``)."""
        if self._state == _RUNNING:
            try:
                self.apply(
                    _call_private_close, dispatch.broadcast(self._all_ranks, (), {}), label="_close"
                ).wait(timeout=30)
            except Exception as e:  # noqa: BLE001 - the actors are freed regardless
                logger.warning("group %s: _close failed: %s", self.name, e)
        self.shutdown()

    # ------------------------------------------------------------------ NeMo-RL face
    @property
    def workers(self) -> list[_ActorProxy]:
        return [_ActorProxy(self, r, a) for r, a in enumerate(self._roster.actors)]

    @property
    def actors(self) -> list[ray.actor.ActorHandle]:
        """The underlying Ray actor handles (hosts of the worker objects)."""
        return list(self._roster.actors)

    @property
    def worker_metadata(self) -> list[dict[str, Any]]:
        return list(self._roster.metadata)

    @property
    def world_size(self) -> int:
        return len(self._roster.actors)

    @property
    def master_address(self) -> str:
        return self._roster.master_address

    @property
    def master_port(self) -> int:
        return self._roster.master_port

    @property
    def dp_size(self) -> int:
        return len(self.dp_leader_worker_indices)

    def get_dp_leader_worker_idx(self, dp_shard_idx: int) -> int:
        if not isinstance(dp_shard_idx, int) or not 0 <= dp_shard_idx < self.dp_size:
            raise IndexError(f"dp_shard_idx {dp_shard_idx} out of range 0..{self.dp_size - 1}")
        return self.dp_leader_worker_indices[dp_shard_idx]

    def _check_ranks(self, ranks: Any, arg: str) -> list[int]:
        return dispatch.check_ranks(ranks, self.world_size, arg)

    def run_single_worker_single_data(
        self, method_name: str, worker_idx: int, *args: Any, **kwargs: Any
    ) -> ray.ObjectRef:
        """Run ``method_name`` on one worker; returns its Ray future."""
        self._check_method(method_name)
        self._check_ranks([worker_idx], "worker_idx")
        return self._bare_refs(self._call(method_name, [(worker_idx, args, kwargs)]))[0]

    def run_all_workers_single_data(
        self,
        method_name: str,
        *args: Any,
        run_rank_0_only_axes: list[str] | None = None,
        **kwargs: Any,
    ) -> list[ray.ObjectRef]:
        """Same arguments to every worker (or only rank 0 of ``run_rank_0_only_axes``)."""
        self._check_method(method_name)
        ranks = dispatch.rank0_only(
            self.sharding_annotations, self._all_ranks, run_rank_0_only_axes
        )
        calls = dispatch.broadcast(ranks, args, kwargs)
        return self._bare_refs(self._call(method_name, calls, health=self._broadcast_health()))

    def run_all_workers_multiple_data(
        self,
        method_name: str,
        *args: Any,
        run_rank_0_only_axes: list[str] | None = None,
        common_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[ray.ObjectRef]:
        """One item of each list argument per called worker, plus ``common_kwargs`` for all."""
        self._check_method(method_name)
        ranks = dispatch.rank0_only(
            self.sharding_annotations, self._all_ranks, run_rank_0_only_axes
        )
        calls = dispatch.multiple_data(ranks, args, kwargs, common_kwargs)
        return self._bare_refs(self._call(method_name, calls))

    def run_all_workers_sharded_data(
        self,
        method_name: str,
        *args: Any,
        in_sharded_axes: list[str] | None = None,
        replicate_on_axes: list[str] | None = None,
        output_is_replicated: list[str] | None = None,
        make_dummy_calls_to_free_axes: bool = False,
        common_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> MultiWorkerFuture:
        """Send each worker the shard for its coordinates (see ``dispatch.sharded``).

        ``in_sharded_axes``: data is nested lists indexed by these axes, in this order (a
        value that shards itself, such as a ``BatchedDataDict``, may be given whole for
        one axis). ``replicate_on_axes``: every worker along these axes gets the same
        shard. Free axes (neither): only index 0 is called (others get ``None`` data with
        ``make_dummy_calls_to_free_axes``). Results come from index 0 of free axes and of
        ``output_is_replicated`` axes.
        """
        self._check_method(method_name)
        plan = dispatch.sharded(
            self.sharding_annotations,
            self._all_ranks,
            args,
            kwargs,
            in_sharded_axes=in_sharded_axes,
            replicate_on_axes=replicate_on_axes,
            output_is_replicated=output_is_replicated,
            make_dummy_calls_to_free_axes=make_dummy_calls_to_free_axes,
            common_kwargs=common_kwargs,
        )
        handle = self._call(method_name, plan.calls)
        return MultiWorkerFuture(
            futures=handle.refs,
            return_from_workers=plan.returning,
            called_workers=plan.called,
            method=method_name,
        )

    def get_all_worker_results(
        self, future_bundle: MultiWorkerFuture, return_generators_as_proxies: bool = False
    ) -> list[Any]:
        return future_bundle.get_results(
            self, return_generators_as_proxies=return_generators_as_proxies
        )

    # ------------------------------------------------------------------ health
    @property
    def restart_policy(self) -> RestartPolicy:
        """The group's :class:`RestartPolicy` (``RestartPolicy.never()`` unless given)."""
        return self._fault.policy

    def _broadcast_health(self) -> str:
        """Same-arguments calls to every rank may go on without dead ranks when ignoring failures."""
        return "skip" if self._fault.policy.ignore_failures else "restart"

    def health(self) -> dict[int, WorkerHealth]:
        """Health of every rank: healthy, unhealthy, restarting or dead (for good)."""
        return dict(enumerate(self._fault.health()))

    def health_events(self) -> list[HealthEvent]:
        """Every health transition so far, oldest first."""
        return self._fault.events()

    def healthy_worker_ids(self) -> list[int]:
        """Ranks whose worker is healthy (RLlib's worker ids; phalanx ids are 0-based ranks)."""
        return [r for r, h in enumerate(self._fault.health()) if h == WorkerHealth.HEALTHY]

    def num_healthy_workers(self) -> int:
        return len(self.healthy_worker_ids())

    def num_healthy_remote_workers(self) -> int:
        """Same as ``num_healthy_workers``: every phalanx worker is remote."""
        return self.num_healthy_workers()

    def num_remote_workers(self) -> int:
        return self.world_size

    def num_remote_worker_restarts(self) -> int:
        """How many times a worker was restarted and came back healthy."""
        return self._fault.recoveries

    def wait_healthy(self, timeout_seconds: float = 60.0, ranks: list[int] | None = None) -> bool:
        """Block until ``ranks`` (default all) are healthy; False if the time ran out or a
        rank is unhealthy or dead with no restart under way."""
        ranks = self._all_ranks if ranks is None else self._check_ranks(ranks, "ranks")
        return self._fault.wait_healthy(ranks, timeout_seconds)

    def probe_unhealthy_workers(self, timeout_seconds: float | None = None) -> list[int]:
        """Ping unhealthy workers, restore or restart them; return the ranks that came back.

        A restart already under way is waited for (up to ``timeout_seconds``). Ranks
        restarted in the background since the last probe are included, so a caller that
        re-syncs what came back (as RLlib's algorithms do) misses none.
        """
        timeout = (
            self._fault.policy.health_probe_timeout_s
            if timeout_seconds is None
            else timeout_seconds
        )
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout_seconds must be a positive number, got {timeout_seconds!r}")
        self._check_live()
        return self._fault.probe(float(timeout))

    def register_state(self, rank: int | None, state: Any) -> None:
        """The state ``set_state`` gets after ``rank`` restarts (``None``: every rank).

        The group also remembers each rank's last result of the policy's
        ``capture_state_from`` method (``get_state`` by default).
        """
        ranks = self._all_ranks if rank is None else self._check_ranks([rank], "rank")
        if "set_state" not in self._roster.methods:
            raise ValueError(
                f"register_state: {self._builder.class_name} has no set_state(state) method"
            )
        self._fault.remember_states(ranks, [state] * len(ranks))

    def set_watchdog(self, after_seconds: float | None, stream: Any = None) -> None:
        """Print a hang report for any call of this group running longer than ``after_seconds``
        (``None`` turns it off)."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if after_seconds is not None:
            self._watchdog = _hang.Watchdog(self, after_seconds, stream)

    @property
    def watchdog(self) -> _hang.Watchdog | None:
        """The group's watchdog (``set_watchdog``), with the ``reports`` it printed."""
        return self._watchdog

    # ------------------------------------------------------------------ RLlib face
    def _foreach(
        self,
        func: Any,
        kwargs: dict[str, Any] | None,
        healthy_only: bool,
        remote_worker_ids: list[int] | None,
        timeout_seconds: float | None,
        return_obj_refs: bool,
        mark_healthy: bool,
        with_id: bool = False,
    ) -> tuple[RemoteCallResults, GroupHandle | None, list[int]]:
        """Start a ``foreach`` call and collect what finishes within the timeout:
        ``(outcomes, handle or None when no rank was selected, ranks still running)``."""
        timeout = check_timeout(timeout_seconds, "timeout_seconds")
        self._check_live()
        ranks, func = dispatch.foreach_select(
            self._all_ranks,
            self.world_size,
            func,
            healthy_only=healthy_only,
            not_healthy=self._fault.not_healthy,
            remote_worker_ids=remote_worker_ids,
        )
        plan = dispatch.foreach(
            func, ranks, kwargs, with_id=with_id, check_method=self._check_method
        )
        if not ranks:
            return RemoteCallResults(), None, []
        health = self._broadcast_health() if healthy_only else "any"
        handle = self._call(plan.method or plan.label, plan.calls, fn=plan.fn, health=health)
        results, pending = self._collector.ready(
            handle.method,
            handle.ranks,
            handle.refs,
            timeout,
            return_obj_refs=return_obj_refs,
            mark_healthy=mark_healthy,
        )
        return results, handle, pending

    def _foreach_values(
        self,
        func: Any,
        kwargs: dict[str, Any] | None,
        healthy_only: bool,
        remote_worker_ids: list[int] | None,
        timeout_seconds: float | None,
        return_obj_refs: bool,
        mark_healthy: bool,
        with_id: bool,
    ) -> list[Any]:
        """The plain-values form of ``_foreach`` (RLlib's ``foreach_worker``)."""
        results, handle, pending = self._foreach(
            func,
            kwargs,
            healthy_only,
            remote_worker_ids,
            timeout_seconds,
            return_obj_refs,
            mark_healthy,
            with_id,
        )
        if handle is None:
            return []
        if return_obj_refs:
            return [r.get() for r in results]
        out = [v for _, v in self._collector.values(handle.method, results)]
        if timeout_seconds is not None:
            self._collector.after_timeout(
                handle.method, handle.ranks, handle.refs, pending, float(timeout_seconds)
            )
        return out

    def foreach_worker(
        self,
        func: Callable[[Any], Any] | str | list[Callable[[Any], Any] | str],
        *,
        kwargs: dict[str, Any] | None = None,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
        timeout_seconds: float | None = None,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
    ) -> list[Any]:
        """Run ``func(worker)`` (or the method named ``func``) on each selected worker.

        ``healthy_only`` skips workers not healthy (with a list of functions, one per
        selected worker, the skipped workers' functions are dropped); ``remote_worker_ids``
        selects ranks. Results come back in rank order. A failed call raises its error,
        unless the policy ignores failures (it is then left out and logged). With
        ``timeout_seconds`` a call still running then produces a hang report and a
        :class:`~phalanx.group.hang.HangTimeoutError` (with ``ignore_failures``: the finished
        results, and a warning naming the report); ``timeout_seconds=0`` returns what is
        ready at once, without a report. ``return_obj_refs`` returns the finished calls'
        refs; ``mark_healthy``: unhealthy workers that answer are healthy again.
        """
        return self._foreach_values(
            func,
            kwargs,
            healthy_only,
            remote_worker_ids,
            timeout_seconds,
            return_obj_refs,
            mark_healthy,
            False,
        )

    def foreach_worker_with_id(
        self,
        func: Callable[[int, Any], Any] | str | list[Callable[[int, Any], Any] | str],
        *,
        kwargs: dict[str, Any] | None = None,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
        timeout_seconds: float | None = None,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
    ) -> list[Any]:
        """Like ``foreach_worker`` with ``func(worker_id, worker)``; the id is the rank."""
        return self._foreach_values(
            func,
            kwargs,
            healthy_only,
            remote_worker_ids,
            timeout_seconds,
            return_obj_refs,
            mark_healthy,
            True,
        )

    def foreach_actor(
        self,
        func: Callable[[Any], Any] | str | list[Callable[[Any], Any] | str],
        *,
        healthy_only: bool = True,
        remote_actor_ids: list[int] | None = None,
        timeout_seconds: float | None = None,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> RemoteCallResults:
        """RLlib's ``FaultTolerantActorManager.foreach_actor``: every finished call's outcome
        (``.actor_id``, ``.ok``, ``.get()``: the result or the error), errors included,
        never raised; calls still running after ``timeout_seconds`` are left out.

        Health follows the group's rule: a dead worker is marked unhealthy; an exception
        does so only with ``RestartPolicy(restart_on_error=True)`` (RLlib's rule).
        """
        results, _, _ = self._foreach(
            func,
            kwargs,
            healthy_only,
            remote_actor_ids,
            timeout_seconds,
            return_obj_refs,
            mark_healthy,
        )
        return results

    def foreach_worker_async(
        self,
        func: Callable[[Any], Any] | str | list[Callable[[Any], Any] | str],
        *,
        tag: str | None = None,
        kwargs: dict[str, Any] | None = None,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
        max_in_flight_per_worker: int | None = None,
    ) -> AsyncSubmission:
        """Start ``func`` on each selected worker without waiting; collect the results
        with ``fetch_ready_async_reqs``.

        A worker that already has ``max_in_flight_per_worker`` requests of this ``tag``
        in flight (default ``group.max_requests_in_flight_per_worker``) is not sent one;
        the returned :class:`~phalanx.group.requests.AsyncSubmission` lists it as skipped
        (and a warning is logged). ``int(submission)`` is the number of requests sent.
        """
        budget = (
            self.max_requests_in_flight_per_worker
            if max_in_flight_per_worker is None
            else max_in_flight_per_worker
        )
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"max_in_flight_per_worker must be an int >= 1, got {budget!r}")
        if tag is not None and not isinstance(tag, str):
            raise TypeError(f"tag must be a str or None, got {type(tag).__name__}")
        self._check_live()
        ranks, func = dispatch.foreach_select(
            self._all_ranks,
            self.world_size,
            func,
            healthy_only=healthy_only,
            not_healthy=self._fault.not_healthy,
            remote_worker_ids=remote_worker_ids,
        )
        counts = self._requests.counts(tag)
        send = [r for r in ranks if counts.get(r, 0) < budget]
        over = [r for r in ranks if counts.get(r, 0) >= budget]
        if isinstance(func, list):
            func = [f for f, r in zip(func, ranks) if r in set(send)]
        sub = AsyncSubmission(tag=tag, skipped=over)
        if send:
            plan = dispatch.foreach(
                func, send, kwargs, with_id=False, check_method=self._check_method
            )
            handle = self._call(
                plan.method or plan.label, plan.calls, fn=plan.fn, health=self._broadcast_health()
            )
            sub.skipped = sorted([*over, *handle.skipped])
            sub.sent = list(handle.ranks)
            self._requests.add(tag, handle.method, handle.ranks, handle.refs)
        if sub.skipped:
            logger.warning(
                "group %s: foreach_worker_async(tag=%r) skipped ranks %s (over the in-flight "
                "budget of %d or unavailable)",
                self.name,
                tag,
                sub.skipped,
                budget,
            )
        return sub

    def foreach_actor_async(
        self,
        func: Callable[[Any], Any] | str | list[Callable[[Any], Any] | str],
        tag: str | None = None,
        *,
        healthy_only: bool = True,
        remote_actor_ids: list[int] | None = None,
    ) -> int:
        """RLlib's ``FaultTolerantActorManager.foreach_actor_async``: the number of requests sent."""
        return int(
            self.foreach_worker_async(
                func, tag=tag, healthy_only=healthy_only, remote_worker_ids=remote_actor_ids
            )
        )

    def num_in_flight_async_reqs(self, tags: str | list[str] | None = None) -> int:
        """Async requests sent and not yet fetched (of ``tags``, default all)."""
        return self._requests.num_in_flight(tags)

    def fetch_ready_async_reqs(
        self,
        *,
        tags: str | list[str] | None = None,
        timeout_seconds: float | None = 0.0,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
    ) -> list[tuple[int, Any]]:
        """``(worker_id, result)`` of the async requests (of ``tags``) that are done.

        Waits up to ``timeout_seconds`` for the requests in flight (``None``: until every
        one has finished; 0: only what is ready now). A request whose worker raised (or
        died) raises its error, unless the policy ignores failures (then it is logged and
        left out). When a fetch raises, every other outcome of it (results and further
        errors) is held and handed out by the next fetch.
        """
        outcomes = self._fetch(tags, timeout_seconds, return_obj_refs, mark_healthy)
        if not self._fault.policy.ignore_failures:
            for i, (_, c) in enumerate(outcomes):
                if not c.ok:
                    self._requests.hold(outcomes[:i] + outcomes[i + 1 :])
                    raise c.get()
        return self._collector.values("async", RemoteCallResults([c for _, c in outcomes]))

    def fetch_ready_async_results(
        self,
        *,
        tags: str | list[str] | None = None,
        timeout_seconds: float | None = 0.0,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
    ) -> RemoteCallResults:
        """RLlib's ``FaultTolerantActorManager.fetch_ready_async_reqs`` form: the outcomes
        of the done requests (``.actor_id``, ``.ok``, ``.get()``), errors included."""
        outcomes = self._fetch(tags, timeout_seconds, return_obj_refs, mark_healthy)
        return RemoteCallResults([c for _, c in outcomes])

    def _fetch(
        self, tags: Any, timeout_seconds: Any, return_obj_refs: bool, mark_healthy: bool
    ) -> list:
        check_tags(tags)
        timeout = check_timeout(timeout_seconds, "timeout_seconds")
        return self._requests.fetch(
            self._collector,
            tags,
            timeout,
            return_obj_refs=return_obj_refs,
            mark_healthy=mark_healthy,
        )

    # ------------------------------------------------------------------ shutdown
    def shutdown(
        self, cleanup_method: str | None = None, timeout: float | None = 30.0, force: bool = False
    ) -> bool:
        """Run ``cleanup_method`` on every worker (unless ``force``), then free every actor.

        Returns whether the cleanup succeeded. Every actor (those being restarted
        included), its name and the initializer are released, and this returns within
        about ``timeout`` seconds (default 30). Calls on the group afterwards raise.
        """
        if self._state != _RUNNING:
            return True
        deadline = time.monotonic() + (30.0 if timeout is None else float(timeout))
        success = True
        if cleanup_method is not None and not force:
            try:
                self._check_method(cleanup_method)
                self.call(cleanup_method).wait(timeout=timeout)
            except Exception as e:  # noqa: BLE001 - reported through the return value
                logger.warning("group %s: cleanup %s failed: %s", self.name, cleanup_method, e)
                success = False
        if _trace.ON:
            _trace.collect_group(self)  # the workers' trace events die with them otherwise
        self.set_watchdog(None)
        self._fault.close()
        self._requests.clear()
        names = self._roster.kill_all()
        held = wait_names_free(names, max(0.5, deadline - time.monotonic()))
        if held:
            logger.warning(
                "group %s: actor names %s still registered after shutdown", self.name, held
            )
        self._all_ranks = []
        self._state = _SHUT_DOWN
        return success

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, world_size={self.world_size})"


def _weak_restart_hooks(group: WorkerGroup) -> Callable[[list[int]], None]:
    """``group.run_restart_hooks`` without keeping a dropped group alive (the health
    monitor holds the fault state for as long as workers are watched)."""
    ref = weakref.ref(group)

    def run(ranks: list[int]) -> None:
        g = ref()
        if g is not None:
            g.run_restart_hooks(ranks)

    return run


def _call_private_close(worker: Any) -> Any:
    close = getattr(worker, "_close", None)
    return close() if callable(close) else None


def _check_policy(policy: RestartPolicy | None) -> RestartPolicy:
    if policy is None:
        return RestartPolicy.never()
    if not isinstance(policy, RestartPolicy):
        raise TypeError(f"restart_policy must be a px.RestartPolicy, got {type(policy).__name__}")
    return policy


RayWorkerGroup = WorkerGroup
__all__ = ["WorkerGroup", "RayWorkerGroup", "UnknownMethodError"]
