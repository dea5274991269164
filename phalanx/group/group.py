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

The class is a facade: every method of every face is a method here, and the work is done
by small modules. The state the faces share is one ``CallPath`` (``call_path``: the roster
of live actors, their health, the one result path, the async requests and the dispatch
every call ends in, ``CallPath.call(method, [(rank, args, kwargs), ...])``). The group
holds it, and a ``NemoFace`` (``nemo_face``) and an ``RllibFace`` (``rllib_face``) that
work over it; ``rlinf_face`` has the group methods ``__getattr__`` and ``execute_on`` hand
out. Below them: ``launch`` (start workers), ``dispatch`` (each call style as a pure
function from arguments to per-rank calls), ``collect`` (the one result path), ``fault``
(health and restarts, behind the ``Members`` interface), ``requests`` (async request
bookkeeping) and ``hang`` (reports).

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

from phalanx._base.checks import check_int, check_number, check_timeout
from phalanx.group import dispatch
from phalanx.group import hang as _hang
from phalanx.group.call_path import RUNNING, SHUT_DOWN, CallPath, UnknownMethodError
from phalanx.group.collect import Collector
from phalanx.group.fault import FaultState, HealthEvent, RestartPolicy, WorkerHealth
from phalanx.group.futures import GroupHandle, MultiWorkerFuture, default_call_timeout
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
from phalanx.group.requests import AsyncSubmission, as_results
from phalanx.group.results import RemoteCallResults
from phalanx.group.rlinf_face import GroupMethod, RankView
from phalanx.group.rllib_face import ForeachOptions, Funcs, FuncsWithId, RllibFace
from phalanx.group.sharding import NamedSharding
from phalanx.observe import trace as _trace
from phalanx.resources.cluster import Cluster
from phalanx.resources.placement import Placement, WorkerSlot
from phalanx.resources.strategies import default_placement
from phalanx.resources.virtual_cluster import RayVirtualCluster
from phalanx.worker.builder import RayWorkerBuilder, _check_env

logger = logging.getLogger(__name__)


class WorkerGroup:
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
        self._env_vars = _check_env(env_vars, "env_vars")
        # Run in order after a rank restarts and its state is restored (add_restart_hook).
        self._restart_hooks: list[Callable[[list[int]], None]] = []
        self._fault = FaultState(
            self._roster, _check_policy(restart_policy), _weak_restart_hooks(self)
        )
        # What every face shares: the roster, health, results, async requests and dispatch.
        self._path = CallPath(self, self._roster, self._fault)
        self._nemo = NemoFace(self._path)
        self._rllib = RllibFace(self._path)
        self._state_hook: Callable[[], None] | None = None
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
        if self._path.state == RUNNING:
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
        self._path.ranks = list(range(world))
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
            self._state_hook = self._path.collector.add_result_hook(
                policy.capture_state_from, self._fault.remember_states
            )
        watchdog_s = os.environ.get("PHALANX_WATCHDOG_S")
        if watchdog_s:
            self.set_watchdog(float(watchdog_s))
        self._path.state = RUNNING
        _trace.register_group(self)

    # ------------------------------------------------------------------ the call path
    @property
    def collector(self) -> Collector:
        """The group's one result path (used by handles and futures)."""
        return self._path.collector

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

    # ------------------------------------------------------------------ RLinf face
    def __getattr__(self, name: str) -> GroupMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        path = self.__dict__.get("_path")
        methods = path.roster.methods if path is not None else {}
        if name not in methods:
            state = path.state if path is not None else None
            if state == SHUT_DOWN:
                raise AttributeError(f"{name!r}: the group is shut down")
            if state != RUNNING:
                raise AttributeError(f"{name!r}: the group is not launched yet")
            raise UnknownMethodError(
                f"{name!r}: {self._builder.class_name} has no public method of that name (known: {sorted(methods)})"
            )
        return GroupMethod(self._path, name, None)

    def execute_on(self, *ranks: int) -> RankView:
        """The group restricted to ``ranks`` for the next call: ``g.execute_on(0, 3).hello()``.

        Args:
            *ranks: the ranks the next call runs on.

        Returns:
            A view of the group whose method calls run on ``ranks`` only.

        Raises:
            ValueError: no rank is given or a rank is out of range.
            TypeError: a rank is not an int.
        """
        self._path.check_live()
        return RankView(self._path, dispatch.execute_on(ranks, self.world_size, self.name))

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
        path = self._path
        if ranks is None:
            calls = dispatch.broadcast(path.ranks, args, kwargs)
            return path.call(method, calls, health=path.broadcast_health())
        ranks = path.check_ranks(ranks, "ranks")
        return path.call(method, dispatch.broadcast(ranks, args, kwargs))

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
        self._path.check_ranks([c[0] for c in calls], "calls")
        return self._path.call(method, calls, health="skip" if skip_unhealthy else "restart")

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
        self._path.check_ranks([c[0] for c in calls], "calls")
        name = label or getattr(fn, "__name__", "apply")
        return self._path.call(name, calls, fn=fn, health="skip" if skip_unhealthy else "restart")

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
        return self._path.collector.add_result_hook(method, hook)

    @property
    def worker_info_list(self) -> list[WorkerRank]:
        """RLinf's list of ``WorkerRank(worker=actor handle, rank=rank)``, in rank order."""
        return self._roster.worker_ranks()

    def _close(self) -> None:
        """RLinf's ``_close``: run each worker's ``_close()`` if it has one, then free every
        actor (as ``shutdown``)."""
        if self._path.state == RUNNING:
            try:
                self.apply(
                    _call_private_close,
                    dispatch.broadcast(self._path.ranks, (), {}),
                    label="_close",
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

    # ------------------------------------------------------------------ health
    @property
    def restart_policy(self) -> RestartPolicy:
        """The group's :class:`RestartPolicy` (``RestartPolicy.never()`` unless given)."""
        return self._fault.policy

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

    def add_death_listener(self, listener: Callable[[int, str], None]) -> Callable[[], None]:
        """Call ``listener(rank, reason)`` as soon as a rank's actor is seen dead, whether
        or not a call is running on the group (a trainer can start replacing an idle group).

        It runs on the thread that saw the death (usually the health monitor's), so it must
        return at once and hand longer work to a thread of its own; an exception it raises
        is logged and dropped.

        Args:
            listener: called with the rank and the reason of its death.

        Returns:
            A function that removes the listener.

        Raises:
            TypeError: ``listener`` is not callable.
        """
        return self._fault.add_death_listener(listener)

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
        path = self._path
        ranks = path.ranks if ranks is None else path.check_ranks(ranks, "ranks")
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
        path = self._path
        ranks = path.ranks if rank is None else path.check_ranks([rank], "rank")
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
        path = self._path
        if path.watchdog is not None:
            path.watchdog.stop()
            path.watchdog = None
        if after_seconds is not None:
            path.watchdog = _hang.Watchdog(self, after_seconds, stream)

    @property
    def watchdog(self) -> _hang.Watchdog | None:
        """The group's watchdog (``set_watchdog``), with the ``reports`` it printed."""
        return self._path.watchdog

    # ------------------------------------------------------------------ NeMo-RL face
    @property
    def workers(self) -> list[Any]:
        """One proxy per rank: ``group.workers[r].method.remote(...)`` returns a Ray ref."""
        return self._nemo.workers()

    @property
    def worker_metadata(self) -> list[dict[str, Any]]:
        """Per rank: node index, local and global rank, actor name, bundle indices, pid."""
        return list(self._roster.metadata)

    @property
    def master_address(self) -> str:
        """The IP address of rank 0, for ``torch.distributed`` rendezvous."""
        return self._roster.master_address

    @property
    def master_port(self) -> int:
        """A free port on rank 0's node, for ``torch.distributed`` rendezvous."""
        return self._roster.master_port

    @property
    def dp_size(self) -> int:
        """Number of data-parallel shards (one leader each)."""
        return len(self.dp_leader_worker_indices)

    def get_dp_leader_worker_idx(self, dp_shard_idx: int) -> int:
        """The rank that leads data-parallel shard ``dp_shard_idx``.

        Args:
            dp_shard_idx: the data-parallel shard.

        Returns:
            The rank of its leader.

        Raises:
            IndexError: ``dp_shard_idx`` is out of range.
        """
        check_int(dp_shard_idx, "dp_shard_idx")
        if not 0 <= dp_shard_idx < self.dp_size:
            raise IndexError(f"dp_shard_idx {dp_shard_idx} out of range 0..{self.dp_size - 1}")
        return self.dp_leader_worker_indices[dp_shard_idx]

    def run_single_worker_single_data(
        self, method_name: str, worker_idx: int, *args: Any, **kwargs: Any
    ) -> ray.ObjectRef:
        """Run ``method_name`` on one worker; returns its Ray future.

        Args:
            method_name: the worker method's name.
            worker_idx: the worker's rank.
            *args, **kwargs: its arguments.

        Returns:
            The Ray future of its result.

        Raises:
            UnknownMethodError: the worker class has no such public method.
            ValueError: ``worker_idx`` is out of range.
        """
        return self._nemo.run_single(method_name, worker_idx, args, kwargs)

    def run_all_workers_single_data(
        self,
        method_name: str,
        *args: Any,
        run_rank_0_only_axes: list[str] | None = None,
        **kwargs: Any,
    ) -> list[ray.ObjectRef]:
        """Same arguments to every worker (or only rank 0 of ``run_rank_0_only_axes``).

        Args:
            method_name: the worker method's name.
            *args, **kwargs: the arguments every called worker gets.
            run_rank_0_only_axes: call only index 0 along these named axes.

        Returns:
            One Ray future per called worker.

        Raises:
            UnknownMethodError: the worker class has no such public method.
        """
        return self._nemo.run_single_data(
            self.sharding_annotations, method_name, args, kwargs, run_rank_0_only_axes
        )

    def run_all_workers_multiple_data(
        self,
        method_name: str,
        *args: Any,
        run_rank_0_only_axes: list[str] | None = None,
        common_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[ray.ObjectRef]:
        """One item of each list argument per called worker, plus ``common_kwargs`` for all.

        Data that do not match the workers called raise ``dispatch.DispatchError`` (a
        ``ValueError`` and, as in NeMo-RL, an ``AssertionError``).

        Args:
            method_name: the worker method's name.
            *args, **kwargs: lists with one item per called worker.
            run_rank_0_only_axes: call only index 0 along these named axes.
            common_kwargs: keyword arguments every called worker gets.

        Returns:
            One Ray future per called worker.

        Raises:
            DispatchError: the lists do not match the workers called.
            UnknownMethodError: the worker class has no such public method.
        """
        return self._nemo.run_multiple_data(
            self.sharding_annotations,
            method_name,
            args,
            kwargs,
            run_rank_0_only_axes,
            common_kwargs,
        )

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

        Args:
            method_name: the worker method's name.
            *args, **kwargs: the data, nested lists indexed by ``in_sharded_axes``.
            in_sharded_axes: the axes the data is sharded over.
            replicate_on_axes: the axes along which every worker gets the same shard.
            output_is_replicated: the axes whose results come from index 0 only.
            make_dummy_calls_to_free_axes: call the free axes' other workers with ``None`` data.
            common_kwargs: keyword arguments every called worker gets.

        Returns:
            A ``MultiWorkerFuture`` whose results are those of the workers that return.

        Raises:
            DispatchError: the data do not match the axes.
            UnknownMethodError: the worker class has no such public method.
        """
        return self._nemo.run_sharded_data(
            self.sharding_annotations,
            method_name,
            args,
            kwargs,
            in_sharded_axes=in_sharded_axes,
            replicate_on_axes=replicate_on_axes,
            output_is_replicated=output_is_replicated,
            make_dummy_calls_to_free_axes=make_dummy_calls_to_free_axes,
            common_kwargs=common_kwargs,
        )

    def get_all_worker_results(
        self, future_bundle: MultiWorkerFuture, return_generators_as_proxies: bool = False
    ) -> list[Any]:
        """``future_bundle.get_results(self, ...)``: the selected workers' results.

        Args:
            future_bundle: the ``MultiWorkerFuture`` of a call on this group.
            return_generators_as_proxies: return generator methods' generators as they are.

        Returns:
            The selected workers' results, in worker order.

        Raises:
            WorkerError: a worker's method raised.
        """
        return future_bundle.get_results(
            self, return_generators_as_proxies=return_generators_as_proxies
        )

    # ------------------------------------------------------------------ RLlib face
    def foreach_worker(
        self,
        func: Funcs,
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

        Args:
            func: a function of the worker, a method name, or a list of them, one per worker.
            kwargs: keyword arguments of ``func``.
            healthy_only: skip workers not healthy.
            remote_worker_ids: the ranks to call (every rank if None).
            timeout_seconds: seconds to wait (no bound if None; 0 returns what is ready).
            return_obj_refs: return the finished calls' Ray refs.
            mark_healthy: unhealthy workers that answer are healthy again.

        Returns:
            The results in rank order.

        Raises:
            WorkerError: a call raised (unless the policy ignores failures).
            HangTimeoutError: a call was still running after ``timeout_seconds``.
        """
        opts = ForeachOptions(
            kwargs, healthy_only, remote_worker_ids, timeout_seconds, return_obj_refs, mark_healthy
        )
        return self._rllib.foreach_values(func, opts)

    def foreach_worker_with_id(
        self,
        func: FuncsWithId,
        *,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
        timeout_seconds: float | None = None,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Like ``foreach_worker`` with ``func(worker_id, worker)``; the id is the rank.

        Args:
            func: a function of ``(worker_id, worker)``, or a list of them.
            healthy_only, remote_worker_ids, timeout_seconds: as for ``foreach_worker``.
            return_obj_refs, mark_healthy, kwargs: the same.

        Returns:
            The results in rank order.

        Raises:
            WorkerError: a call raised (unless the policy ignores failures).
        """
        opts = ForeachOptions(
            kwargs, healthy_only, remote_worker_ids, timeout_seconds, return_obj_refs, mark_healthy
        )
        opts.with_id = True
        return self._rllib.foreach_values(func, opts)

    def foreach_actor(
        self,
        func: Funcs,
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

        Args:
            func: a function of the worker, a method name, or a list of them, one per worker.
            healthy_only: skip workers not healthy.
            remote_actor_ids: the ranks to call (every rank if None).
            timeout_seconds: seconds to wait (no bound if None).
            return_obj_refs: return the results' Ray refs instead of their values.
            mark_healthy: workers out of service that answered are healthy again.
            kwargs: keyword arguments of ``func``.

        Returns:
            The ``RemoteCallResults`` of the finished calls.
        """
        opts = ForeachOptions(
            kwargs, healthy_only, remote_actor_ids, timeout_seconds, return_obj_refs, mark_healthy
        )
        return self._rllib.foreach(func, opts)[0]

    def foreach_worker_async(
        self,
        func: Funcs,
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

        Args:
            func: a function of the worker, a method name, or a list of them.
            tag: the requests' tag, for ``fetch_ready_async_reqs``.
            kwargs: keyword arguments of ``func``.
            healthy_only: skip workers not healthy.
            remote_worker_ids: the ranks to call (every rank if None).
            max_in_flight_per_worker: the most requests of ``tag`` one worker has in flight.

        Returns:
            The ``AsyncSubmission``: the ranks sent a request and those skipped.

        Raises:
            TypeError: ``tag`` is not a str or None.
        """
        budget = (
            self.max_requests_in_flight_per_worker
            if max_in_flight_per_worker is None
            else max_in_flight_per_worker
        )
        opts = ForeachOptions(kwargs, healthy_only, remote_worker_ids)
        return self._rllib.foreach_async(func, tag, opts, budget)

    def foreach_actor_async(
        self,
        func: Funcs,
        tag: str | None = None,
        *,
        healthy_only: bool = True,
        remote_actor_ids: list[int] | None = None,
    ) -> int:
        """RLlib's ``FaultTolerantActorManager.foreach_actor_async``: the number of requests sent.

        Args:
            func: a function of the worker, a method name, or a list of them.
            tag: the requests' tag, for ``fetch_ready_async_reqs``.
            healthy_only: skip workers not healthy.
            remote_actor_ids: the ranks to call (every rank if None).

        Returns:
            The number of requests sent.
        """
        return int(
            self.foreach_worker_async(
                func, tag=tag, healthy_only=healthy_only, remote_worker_ids=remote_actor_ids
            )
        )

    def num_in_flight_async_reqs(self, tags: str | list[str] | None = None) -> int:
        """Async requests sent and not yet fetched (of ``tags``, default all).

        Args:
            tags: the tags to count (every tag if None).

        Returns:
            The number of requests.
        """
        return self._path.requests.num_in_flight(tags)

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

        Args:
            tags: the tags whose requests to fetch (every tag if None).
            timeout_seconds: seconds to wait for requests in flight.
            return_obj_refs: return the results' Ray refs instead of their values.
            mark_healthy: workers out of service that answered are healthy again.

        Returns:
            A list of ``(worker_id, result)``.

        Raises:
            WorkerError: a request's worker raised or died (unless the policy ignores failures).
        """
        return self._rllib.fetch_values(tags, timeout_seconds, return_obj_refs, mark_healthy)

    def fetch_ready_async_results(
        self,
        *,
        tags: str | list[str] | None = None,
        timeout_seconds: float | None = 0.0,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
    ) -> RemoteCallResults:
        """RLlib's ``FaultTolerantActorManager.fetch_ready_async_reqs`` form: the outcomes
        of the done requests (``.actor_id``, ``.ok``, ``.get()``), errors included.

        Args:
            tags, timeout_seconds, return_obj_refs, mark_healthy: as for
                ``fetch_ready_async_reqs``.

        Returns:
            The ``RemoteCallResults`` of the done requests.
        """
        return as_results(self._rllib.fetch(tags, timeout_seconds, return_obj_refs, mark_healthy))

    def healthy_worker_ids(self) -> list[int]:
        """Ranks whose worker is healthy (RLlib's worker ids; phalanx ids are 0-based ranks).

        Returns:
            The healthy ranks, in order.
        """
        return self._fault.in_service()

    def num_healthy_workers(self) -> int:
        """The number of healthy workers.

        Returns:
            The number.
        """
        return len(self.healthy_worker_ids())

    def num_healthy_remote_workers(self) -> int:
        """Same as ``num_healthy_workers``: every phalanx worker is remote.

        Returns:
            The number of healthy workers.
        """
        return self.num_healthy_workers()

    def num_remote_workers(self) -> int:
        """The number of workers (all are remote).

        Returns:
            The number.
        """
        return self.world_size

    def num_remote_worker_restarts(self) -> int:
        """How many times a worker was restarted and came back healthy.

        Returns:
            The number of restarts.
        """
        return self._fault.recoveries

    def probe_unhealthy_workers(self, timeout_seconds: float | None = None) -> list[int]:
        """Ping unhealthy workers, restore or restart them; return the ranks that came back.

        A restart already under way is waited for (up to ``timeout_seconds``). Ranks
        restarted in the background since the last probe are included, so a caller that
        re-syncs what came back (as RLlib's algorithms do) misses none.

        Args:
            timeout_seconds: seconds to wait for the pings and restarts.

        Returns:
            The ranks that came back.
        """
        return self._rllib.probe_unhealthy_workers(timeout_seconds)

    def is_actor_healthy(self, actor_id: int) -> bool:
        """RLlib's ``FaultTolerantActorManager.is_actor_healthy``: whether rank ``actor_id``
        is in service.

        Args:
            actor_id: the rank.

        Returns:
            Whether it is healthy.

        Raises:
            ValueError: ``actor_id`` is out of range.
        """
        return self._rllib.is_actor_healthy(actor_id)

    def set_actor_state(self, actor_id: int, healthy: bool) -> None:
        """RLlib's ``FaultTolerantActorManager.set_actor_state``: put rank ``actor_id`` in or
        out of service. Out of service, its async requests in flight are dropped (as in
        RLlib) and it is not restarted; a rank being restarted is left to its restart.

        Args:
            actor_id: the rank.
            healthy: True puts it in service, False out.

        Raises:
            ValueError: ``actor_id`` is out of range.
            TypeError: ``healthy`` is not a bool.
        """
        self._rllib.set_actor_state(actor_id, healthy)

    def take_out_of_service(self, rank: int, reason: str, running: Any = None) -> None:
        """A failure only the caller saw (its call on ``rank`` stalled): out of service and
        restarted per policy, as if it raised; ``running`` (the stalled call's ref) must
        end before a probe pings the rank (``RestartPolicy.until_probed``).

        Args:
            rank: the rank that stalled.
            reason: why, for the health events.
            running: the stalled call's Ray ref.

        Raises:
            ValueError: ``rank`` is out of range.
        """
        self._rllib.take_out_of_service(rank, reason, running)

    def probe_unhealthy_actors(
        self, timeout_seconds: float | None = None, mark_healthy: bool = False
    ) -> list[int]:
        """RLlib's ``FaultTolerantActorManager.probe_unhealthy_actors``: ping every rank out
        of service (not one being restarted) and return those that answered.

        They stay out of service unless ``mark_healthy`` (RLlib's rule: the caller restores
        their state first, then calls ``set_actor_state``). ``timeout_seconds=None`` waits
        up to the policy's ``health_probe_timeout_s`` (RLlib: no bound).

        Args:
            timeout_seconds: seconds to wait for the pings.
            mark_healthy: put the ranks that answered back in service.

        Returns:
            The ranks that answered.
        """
        return self._rllib.probe_unhealthy_actors(timeout_seconds, mark_healthy)

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
        path = self._path
        if path.state != RUNNING:
            return True
        deadline = time.monotonic() + (30.0 if timeout is None else float(timeout))
        success = True
        if cleanup_method is not None and not force:
            try:
                path.check_method(cleanup_method)
                self.call(cleanup_method).wait(timeout=timeout)
            except Exception as e:  # noqa: BLE001 - reported through the return value
                logger.warning("group %s: cleanup %s failed: %s", self.name, cleanup_method, e)
                success = False
        if _trace.ON:
            _trace.collect_group(self)  # the workers' trace events die with them otherwise
        self.set_watchdog(None)
        self._fault.close()
        path.requests.clear()
        names = self._roster.kill_all()
        held = wait_names_free(names, max(0.5, deadline - time.monotonic()))
        if held:
            logger.warning(
                "group %s: actor names %s still registered after shutdown", self.name, held
            )
        path.ranks = []
        path.state = SHUT_DOWN
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
