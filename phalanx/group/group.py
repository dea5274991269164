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
import pickle
import time
import weakref
from collections.abc import Callable
from typing import Any

import ray

from phalanx._base.checks import check_int, check_number, check_ranks, check_timeout
from phalanx.group import dispatch
from phalanx.group import hang as _hang
from phalanx.group.collect import Collector
from phalanx.group.fault import FaultState, HealthEvent, RestartPolicy, WorkerHealth
from phalanx.group.futures import GroupHandle, default_call_timeout
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
from phalanx.group.nemo_face import NemoFace
from phalanx.group.requests import AsyncRequests
from phalanx.group.rllib_face import RllibFace
from phalanx.group.sharding import NamedSharding
from phalanx.observe import trace as _trace
from phalanx.resources.cluster import Cluster
from phalanx.resources.placement import Placement, WorkerSlot
from phalanx.resources.strategies import default_placement
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


class WorkerGroup(NemoFace, RllibFace):
    """A group of workers of one class (also exported as ``RayWorkerGroup``).

    NeMo-RL form, launched at once::

        RayWorkerGroup(virtual_cluster, RayWorkerBuilder("pkg.mod.Cls", cfg),
                       workers_per_node=None, name_prefix="policy",
                       bundle_indices_list=None, sharding_annotations=NamedSharding(...))

    RLinf form, launched later: ``Cls.create_group(cfg).launch(cluster, placement, name)``.

    Args:
        cluster: a ``RayVirtualCluster`` to launch on at once (NeMo-RL form); None leaves
            the group unlaunched until ``launch()`` (RLinf form).
        remote_worker_builder: the ``RayWorkerBuilder`` of the worker class.
        workers_per_node: workers per node (an int for every node, or a list per node).
        name_prefix: the group's name, or its prefix.
        bundle_indices_list: ``(node, bundle indices)`` per worker, to place them by hand.
        sharding_annotations: the ``NamedSharding`` of the workers over named axes.
        env_vars: environment variables every worker gets.
        launch_timeout_s: seconds the workers may take to start.
        restart_policy: restart failed workers by this policy (None: no restarts).

    Raises:
        ValueError: ``remote_worker_builder`` is missing.
        TypeError: ``remote_worker_builder`` is not a ``RayWorkerBuilder`` or ``cluster``
            not a ``RayVirtualCluster``.

    Example:
        >>> import phalanx as px
        >>> cluster = px.Cluster()
        >>> group = px.Worker.create_group().launch(
        ...     cluster, px.NodePlacement(num_workers=2), name="example_group")
        >>> group.apply(lambda w, x: w.rank * x, [(0, (10,), {}), (1, (10,), {})]).wait()
        [0, 10]
        >>> group.shutdown()
        True
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
        self._call_timeout_s = default_call_timeout()
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

        Args:
            cluster: the ``Cluster`` or ``RayVirtualCluster`` to place on (if None, ``Cluster()``:
                the running Ray, or a local one it starts).
            placement: how the workers are placed (one per GPU, or one CPU worker per node, if None).
            name: the group's name (derived from the class if None).
            max_concurrency: calls each worker's actor runs at once.
            isolate_gpu: each worker sees only its own GPUs (RLinf placements).
            placement_strategy: RLinf's name for ``placement``.
            sharding: the ``NamedSharding`` of the workers.
            env_vars: environment variables every worker gets.
            timeout_s: seconds the workers may take to start.
            restart_policy: restart failed workers by this policy.

        Returns:
            The group, launched.

        Raises:
            RuntimeError: the group is already launched.
            ValueError: both ``placement`` and ``placement_strategy`` are given, or an argument
                is out of range.
            TypeError: ``placement`` or ``cluster`` has the wrong type.
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
        if max_concurrency is not None and check_int(max_concurrency, "max_concurrency") < 1:
            raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        self._roster.max_concurrency = max_concurrency
        if sharding is not None:
            self.sharding_annotations = sharding
        if env_vars:
            self._env_vars.update(_check_env(env_vars, "env_vars"))
        if timeout_s is not None:
            if not check_number(timeout_s, "timeout_s") > 0:
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
    def call_timeout_s(self) -> float | None:
        """How long ``handle.wait()`` and ``MultiWorkerFuture.get_results`` wait when given
        no timeout (``PHALANX_CALL_TIMEOUT_S``, default 600 s; ``None``: no bound)."""
        return self._call_timeout_s

    @call_timeout_s.setter
    def call_timeout_s(self, value: float | None) -> None:
        if check_timeout(value, "call_timeout_s") == 0:
            raise ValueError("call_timeout_s must be > 0 or None, got 0")
        self._call_timeout_s = check_timeout(value, "call_timeout_s")

    @property
    def methods(self) -> dict[str, str]:
        """Public methods of the worker class: name -> ``sync``/``async``/``gen``/``asyncgen``."""
        return dict(self._roster.methods)

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
        try:
            shared = self._share(calls) if len(calls) > 1 else None
        except (pickle.PicklingError, RecursionError) as e:  # a value passed to every rank
            rank, args, kwargs = calls[0]
            raise dispatch.unpicklable_argument(self.name, method, rank, args, kwargs, e) from None
        refs = []
        actors = self._roster.actors
        for rank, args, kwargs in calls:
            if shared:
                args = tuple(shared.get(id(a), a) for a in args)
                kwargs = {k: shared.get(id(v), v) for k, v in kwargs.items()}
            actor = actors[rank]
            try:
                if fn is not None:
                    refs.append(actor._px_apply.remote(fn, *args, **kwargs))
                elif stream:
                    # Each public method has its own actor method (see host_class_for).
                    remote = getattr(actor, method).options(num_returns="streaming")
                    refs.append(remote.remote(*args, **kwargs))
                else:
                    refs.append(getattr(actor, method).remote(*args, **kwargs))
            except (pickle.PicklingError, RecursionError) as e:
                raise dispatch.unpicklable_argument(
                    self.name, method, rank, args, kwargs, e
                ) from None
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
        """The group restricted to ``ranks`` for the next call: ``g.execute_on(0, 3).hello()``.

        Args:
            *ranks: the ranks the next call runs on.

        Returns:
            A view of the group whose method calls run on ``ranks`` only.

        Raises:
            ValueError: no rank is given or a rank is out of range.
            TypeError: a rank is not an int.
        """
        self._check_live()
        return _RankView(self, dispatch.execute_on(ranks, self.world_size, self.name))

    def call(
        self, method: str, *args: Any, ranks: list[int] | None = None, **kwargs: Any
    ) -> GroupHandle:
        """Call ``method`` on ``ranks`` (default all) with the same arguments.

        Args:
            method: the worker method's name.
            *args, **kwargs: its arguments, the same for every rank.
            ranks: the ranks to call (every rank if None).

        Returns:
            A ``GroupHandle``; its ``wait()`` returns the results in rank order.

        Raises:
            UnknownMethodError: the worker class has no such public method.
            ValueError: a rank is out of range.
        """
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

        Args:
            method: the worker method's name.
            calls: ``[(rank, args, kwargs), ...]``.
            skip_unhealthy: leave unhealthy ranks out instead of waiting for them.

        Returns:
            A ``GroupHandle`` over the called ranks.

        Raises:
            UnknownMethodError: the worker class has no such public method.
            ValueError: a rank is out of range.
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

        Args:
            fn: called as ``fn(worker, *args, **kwargs)`` on each rank.
            calls: ``[(rank, args, kwargs), ...]``.
            label: the call's name in errors and traces.
            skip_unhealthy: leave unhealthy ranks out instead of waiting for them.

        Returns:
            A ``GroupHandle`` over the called ranks.

        Raises:
            TypeError: ``fn`` is not callable.
            ValueError: a rank is out of range.
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

        Args:
            hook: called with the list of restarted ranks.

        Returns:
            A function that removes the hook.

        Raises:
            TypeError: ``hook`` is not callable.
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        self._restart_hooks.append(hook)

        def remove() -> None:
            if hook in self._restart_hooks:
                self._restart_hooks.remove(hook)

        return remove

    def run_restart_hooks(self, ranks: list[int]) -> None:
        """Run every restart hook for ``ranks`` (called by the restart machinery).

        Args:
            ranks: the restarted ranks.
        """
        for hook in list(self._restart_hooks):
            hook(ranks)

    def add_result_hook(
        self, method: str, hook: Callable[[list[int], list[Any]], None]
    ) -> Callable[[], None]:
        """Run ``hook(ranks, values)`` with the results of every call of ``method`` that
        the group collects (any call style). Returns a function that removes the hook.

        Args:
            method: the worker method whose results the hook gets.
            hook: called with the ranks and their results.

        Returns:
            A function that removes the hook.

        Raises:
            TypeError: ``method`` is not a str or ``hook`` is not callable.
        """
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

    # ------------------------------------------------------------------ members
    @property
    def actors(self) -> list[ray.actor.ActorHandle]:
        """The underlying Ray actor handles (hosts of the worker objects)."""
        return list(self._roster.actors)

    @property
    def world_size(self) -> int:
        """The number of workers in the group."""
        return len(self._roster.actors)

    def _check_ranks(self, ranks: Any, arg: str) -> list[int]:
        self._check_live()
        return check_ranks(ranks, self.world_size, arg, repeats="allow")

    # ------------------------------------------------------------------ health
    @property
    def restart_policy(self) -> RestartPolicy:
        """The group's :class:`RestartPolicy` (``RestartPolicy.never()`` unless given)."""
        return self._fault.policy

    def _broadcast_health(self) -> str:
        """Same-arguments calls to every rank may go on without dead ranks when ignoring failures."""
        return "skip" if self._fault.policy.ignore_failures else "restart"

    def health(self) -> dict[int, WorkerHealth]:
        """Health of every rank: healthy, unhealthy, restarting or dead (for good).

        Returns:
            A dict from rank to its ``WorkerHealth``.
        """
        return dict(enumerate(self._fault.health()))

    def health_events(self) -> list[HealthEvent]:
        """Every health transition so far, oldest first.

        Returns:
            The list of ``HealthEvent``.
        """
        return self._fault.events()

    def wait_healthy(self, timeout_seconds: float = 60.0, ranks: list[int] | None = None) -> bool:
        """Block until ``ranks`` (default all) are healthy; False if the time ran out or a
        rank is unhealthy or dead with no restart under way.

        Args:
            timeout_seconds: the longest wait.
            ranks: the ranks to wait for (every rank if None).

        Returns:
            True when every rank is healthy.

        Raises:
            ValueError: a rank is out of range.
        """
        ranks = self._all_ranks if ranks is None else self._check_ranks(ranks, "ranks")
        return self._fault.wait_healthy(ranks, timeout_seconds)

    def register_state(self, rank: int | None, state: Any) -> None:
        """The state ``set_state`` gets after ``rank`` restarts (``None``: every rank).

        The group also remembers each rank's last result of the policy's
        ``capture_state_from`` method (``get_state`` by default).

        Args:
            rank: the rank (every rank if None).
            state: what its ``set_state`` gets after a restart.

        Raises:
            ValueError: the worker class has no ``set_state`` method, or ``rank`` is out of range.
        """
        ranks = self._all_ranks if rank is None else self._check_ranks([rank], "rank")
        if "set_state" not in self._roster.methods:
            raise ValueError(
                f"register_state: {self._builder.class_name} has no set_state(state) method"
            )
        self._fault.remember_states(ranks, [state] * len(ranks))

    def set_watchdog(self, after_seconds: float | None, stream: Any = None) -> None:
        """Print a hang report for any call of this group running longer than ``after_seconds``
        (``None`` turns it off).

        Args:
            after_seconds: seconds a call may run before its hang report is printed.
            stream: where the report goes (stderr if None).
        """
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if after_seconds is not None:
            self._watchdog = _hang.Watchdog(self, after_seconds, stream)

    @property
    def watchdog(self) -> _hang.Watchdog | None:
        """The group's watchdog (``set_watchdog``), with the ``reports`` it printed."""
        return self._watchdog

    # ------------------------------------------------------------------ shutdown
    def shutdown(
        self, cleanup_method: str | None = None, timeout: float | None = 30.0, force: bool = False
    ) -> bool:
        """Run ``cleanup_method`` on every worker (unless ``force``), then free every actor.

        Returns whether the cleanup succeeded. Every actor (those being restarted
        included), its name and the initializer are released, and this returns within
        about ``timeout`` seconds (default 30). Calls on the group afterwards raise.

        Args:
            cleanup_method: a worker method to run on every worker first.
            timeout: seconds the cleanup may take.
            force: skip the cleanup.

        Returns:
            Whether the cleanup succeeded (True when there was none).
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
