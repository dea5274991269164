"""WorkerGroup: a set of worker actors called as one, with two faces over one call path.

RLinf face: ``MyWorker.create_group(...).launch(cluster, placement, name)``; the worker
class's public methods appear on the group and return a ``GroupHandle``;
``execute_on(*ranks)`` narrows the next call.

NeMo-RL face: ``RayWorkerGroup(virtual_cluster, builder, ...)`` with
``run_single_worker_single_data``, ``run_all_workers_single_data``,
``run_all_workers_multiple_data`` and ``run_all_workers_sharded_data``.

RLlib face (any group): ``foreach_worker``, ``foreach_worker_with_id``,
``foreach_worker_async`` / ``fetch_ready_async_reqs``, and health: ``healthy_worker_ids``,
``probe_unhealthy_workers``, ``num_remote_worker_restarts``. What happens when a worker
dies is the group's ``RestartPolicy`` (``phalanx.group.fault``); calls given a timeout that
expires raise with a hang report of the stuck ranks' stacks (``phalanx.group.hang``).

Every face ends in ``WorkerGroup._call(method, [(rank, args, kwargs), ...])``, which puts
arguments shared by several ranks into the object store once and returns a handle.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from phalanx._base import trace as _trace
from phalanx._base.errors import GroupTimeoutError, WorkerDiedError, WorkerError
from phalanx.group import hang as _hang
from phalanx.group.fault import (
    AsyncSubmission,
    FaultState,
    HealthEvent,
    RestartPolicy,
    WorkerHealth,
    call_each,
    call_with_id,
)
from phalanx.group.futures import GroupHandle, MultiWorkerFuture, _unwrap, get_results
from phalanx.group.sharding import NamedSharding
from phalanx.resources.cluster import NAMESPACE, Cluster, find_free_port
from phalanx.resources.placement import Placement, WorkerSlot, default_placement
from phalanx.resources.virtual_cluster import RayVirtualCluster
from phalanx.worker.builder import RayWorkerBuilder, _check_env, allowlisted_env
from phalanx.worker.worker import WorkerContext

logger = logging.getLogger(__name__)

_INLINE_LIMIT = 100 * 1024  # Ray inlines arguments below this size; above, share one copy.
_group_counter = itertools.count()


class UnknownMethodError(AttributeError, ValueError):
    """The worker class has no public method of that name."""


def _approx_nbytes(value: Any, budget: int = _INLINE_LIMIT) -> int:
    """A cheap lower bound of a value's serialized size, stopping once past ``budget``."""
    if value is None or isinstance(value, (bool, int, float, complex)):
        return 8
    if isinstance(value, (str, bytes, bytearray, memoryview)):
        return len(value)
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    numel = getattr(value, "numel", None)
    if callable(numel) and hasattr(value, "element_size"):
        return int(numel()) * int(value.element_size())
    if isinstance(value, dict):
        items: Iterable[Any] = itertools.chain.from_iterable(value.items())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    else:
        return budget  # unknown objects: assume big enough to share
    total = 0
    for i, item in enumerate(items):
        total += _approx_nbytes(item, budget - total)
        if total >= budget or i > 4096:
            return max(total, budget)
    return total


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
                return group._call(name, [(rank, args, kwargs)]).refs[0]

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
        self.master_address = ""
        self.master_port = 0
        self._actors: list[ray.actor.ActorHandle] = []
        self._slots: list[WorkerSlot] = []
        self._worker_metadata: list[dict[str, Any]] = []
        self._methods: dict[str, str] = {}
        self._all_ranks: list[int] = []
        self._initializer: ray.actor.ActorHandle | None = None
        self._env_vars = _check_env(env_vars, "env_vars")
        self._launch_timeout_s = launch_timeout_s
        self._launched = False
        self._fault = FaultState(self, _check_policy(restart_policy))
        # Run in order after a rank restarts and its state is restored (add_restart_hook).
        self._restart_hooks: list[Callable[[list[int]], None]] = []
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
        *,
        placement_strategy: Placement | None = None,
        sharding: NamedSharding | None = None,
        env_vars: dict[str, str] | None = None,
        timeout_s: float | None = None,
        restart_policy: RestartPolicy | None = None,
    ) -> WorkerGroup:
        """Start the workers; returns the group.

        With no placement: one worker per GPU if the cluster has GPUs, else one CPU worker
        per node (``NodePlacement()``). ``placement_strategy`` is RLinf's name for ``placement``.
        """
        if self._launched:
            raise RuntimeError(f"group {self.name!r} is already launched")
        if placement is not None and placement_strategy is not None:
            raise ValueError("give placement or placement_strategy, not both")
        placement = placement if placement is not None else placement_strategy
        if placement is not None and not isinstance(placement, Placement):
            raise TypeError(
                f"placement must be a phalanx Placement, got {type(placement).__name__}"
            )
        if sharding is not None:
            self.sharding_annotations = sharding
        if env_vars:
            self._env_vars.update(_check_env(env_vars, "env_vars"))
        if timeout_s is not None:
            self._launch_timeout_s = timeout_s
        if restart_policy is not None:
            self._fault.policy = _check_policy(restart_policy)
        if name is not None:
            self.name_prefix = name
        if isinstance(cluster, RayVirtualCluster):
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
        slots = placement.slots(cluster)
        self._check_resources(cluster, slots)
        for s in slots:
            s.scheduling_strategy = NodeAffinitySchedulingStrategy(s.node_id, soft=False)
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
            pgs = vc.get_placement_groups()
            counts = [pg.bundle_count for pg in pgs]
            if workers_per_node is None:
                wanted = counts
            elif isinstance(workers_per_node, int):
                wanted = [workers_per_node] * len(pgs)
            elif isinstance(workers_per_node, list):
                if len(workers_per_node) != len(pgs):
                    raise ValueError(
                        f"workers_per_node has {len(workers_per_node)} entries; the cluster has "
                        f"{len(pgs)} placement group(s)"
                    )
                wanted = workers_per_node
            else:
                raise TypeError("workers_per_node must be None, an int or a list of ints")
            for i, (w, c) in enumerate(zip(wanted, counts)):
                if not isinstance(w, int) or w < 0 or w > c:
                    raise ValueError(
                        f"workers_per_node: placement group {i} has {c} bundles, asked for {w} workers"
                    )
            bundle_indices_list = [(i, [b]) for i, w in enumerate(wanted) for b in range(w)]
        else:
            if not isinstance(bundle_indices_list, list) or not all(
                isinstance(t, (tuple, list)) and len(t) == 2 and isinstance(t[1], list)
                for t in bundle_indices_list
            ):
                raise ValueError(
                    "bundle_indices_list must be a list of (node_idx, [bundle indices]) tuples"
                )
            seen = [(t[0], b) for t in bundle_indices_list for b in t[1]]
            if len(seen) != len(set(seen)):
                raise ValueError(f"bundle_indices_list uses a bundle twice: {bundle_indices_list}")
        self._create_workers_from_bundle_indices(self._builder, bundle_indices_list)

    def _create_workers_from_bundle_indices(
        self,
        remote_worker_builder: RayWorkerBuilder,
        bundle_indices_list: list[tuple[int, list[int]]],
    ) -> None:
        """Create one worker per listed bundle; the first bundle of each tuple leads a tied group."""
        if not isinstance(self.cluster, RayVirtualCluster):
            raise RuntimeError("workers from bundle indices need a RayVirtualCluster")
        self._builder = remote_worker_builder
        self._start(self.cluster.slots(bundle_indices_list))

    def _resolve_name(self) -> str:
        name = self.name_prefix or f"{self._builder.class_name}_group_{next(_group_counter)}"
        if ":" in name:
            raise ValueError(f"name may not contain ':', got {name!r}")
        try:
            ray.get_actor(f"{name}:0", namespace=NAMESPACE)
        except ValueError:
            return name
        raise ValueError(f"name {name!r}: a live group of that name already exists")

    @staticmethod
    def _check_resources(cluster: Cluster, slots: list[WorkerSlot]) -> None:
        need: dict[int, dict[str, float]] = {}
        for s in slots:
            n = need.setdefault(s.node_rank, {"CPU": 0.0, "GPU": 0.0})
            n["CPU"] += s.num_cpus
            n["GPU"] += s.num_gpus
        for node_rank, res in need.items():
            node = cluster.node(node_rank)
            for key, have in (("CPU", node.num_cpus), ("GPU", node.num_gpus)):
                if res[key] > have + 1e-9:
                    raise ValueError(
                        f"placement: node {node_rank} ({node.ip}) has {have:g} {key}, the group needs {res[key]:g}"
                    )

    @staticmethod
    def _check_bundles(slots: list[WorkerSlot]) -> None:
        """Fail fast when a placement-group bundle is already taken by another group.

        Ray's view of available resources lags a little behind, so a shortfall is re-read
        for a few seconds before it counts.
        """
        need: dict[str, float] = {}
        for s in slots:
            if s.placement_group is None:
                continue
            pg_hex = s.placement_group.id.hex()
            for res, amount in (("CPU", s.num_cpus), ("GPU", s.num_gpus)):
                if amount > 0:
                    key = f"{res}_group_{s.bundle_index}_{pg_hex}"
                    need[key] = need.get(key, 0.0) + amount
        deadline = time.monotonic() + 5.0
        short: dict[str, tuple[float, float]] = {}
        while need:
            avail = ray.available_resources()
            short = {
                k: (a, avail.get(k, 0.0)) for k, a in need.items() if avail.get(k, 0.0) + 1e-9 < a
            }
            if not short or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for key, (amount, have) in short.items():
            res, _, bundle, _ = key.split("_", 3)
            raise ValueError(
                f"bundle {bundle}: needs {amount:g} {res}, {have:g} free; another group holds "
                "it (co-locate groups with RayVirtualCluster(max_colocated_worker_groups=N))"
            )

    def _start(self, slots: list[WorkerSlot]) -> None:
        if not slots:
            raise ValueError("placement produced no workers")
        self._check_bundles(slots)
        ray_ns = self.sharding_annotations
        if ray_ns is not None and ray_ns.size != len(slots):
            raise ValueError(
                f"sharding_annotations covers {ray_ns.size} ranks, the group has {len(slots)} workers"
            )
        self.name = self._resolve_name()
        self._slots = slots
        world = len(slots)
        first = slots[0]
        self.master_address = first.node_ip
        self.master_port = find_free_port(first.node_ip, first.node_id)
        self._env_layers = [allowlisted_env(), {}, dict(self._env_vars)]
        if self._builder.isolated:
            self._initializer = self._builder.new_initializer()
        t0 = time.perf_counter()
        pending = [self._spawn(s) for s in slots]
        try:
            actors = ray.get(pending, timeout=self._launch_timeout_s)
        except GetTimeoutError:
            self._kill_created()
            raise RuntimeError(
                f"group {self.name}: creating workers timed out after {self._launch_timeout_s}s"
            ) from None
        self._actors = list(actors)
        self._all_ranks = list(range(world))
        describe = [a._px_describe.remote() for a in self._actors]
        self._await_ready(describe, t0)
        if self.sharding_annotations is None:
            self.sharding_annotations = NamedSharding.default(world)
        leaders = [s.rank for s in slots if s.bundle_indices is not None]
        self.dp_leader_worker_indices = leaders if leaders else list(range(world))
        self._fault.reset(world)
        self._fault.start_watching()
        watchdog_s = os.environ.get("PHALANX_WATCHDOG_S")
        if watchdog_s:
            self.set_watchdog(float(watchdog_s))
        self._launched = True
        _trace.register_group(self)

    def _spawn(self, s: WorkerSlot) -> ray.ObjectRef:
        """Start creating the worker of slot ``s``; returns a ref to its actor handle."""
        ctx = WorkerContext(
            group_name=self.name,
            rank=s.rank,
            world_size=len(self._slots),
            local_rank=s.local_rank,
            node_rank=s.node_rank,
            node_ip=s.node_ip,
            master_addr=self.master_address,
            master_port=self.master_port,
            gpu_ids=list(s.gpu_ids),
            isolate_gpu=s.isolate_gpu,
        )
        options: dict[str, Any] = {
            "name": f"{self.name}:{s.rank}",
            "namespace": NAMESPACE,
            "num_cpus": s.num_cpus,
            "px_context": ctx,
            "px_env_layers": self._env_layers,
            "num_gpus_per_node": getattr(self.cluster, "num_gpus_per_node", None),
        }
        if s.placement_group is None:
            options["scheduling_strategy"] = s.scheduling_strategy
        ref, _ = self._builder.create_worker_async(
            s.placement_group,
            s.bundle_index,
            s.num_gpus,
            s.bundle_indices,
            initializer=self._initializer,
            **options,
        )
        return ref

    def _await_ready(self, refs: list[ray.ObjectRef], t0: float) -> None:
        deadline = t0 + self._launch_timeout_s
        remaining = list(refs)
        last_note = time.monotonic()
        while remaining:
            left = deadline - time.perf_counter()
            if left <= 0:
                idx = [refs.index(r) for r in remaining]
                self._kill_created()
                raise RuntimeError(
                    f"group {self.name}: ranks {idx} not ready after {self._launch_timeout_s}s "
                    f"(resources held elsewhere? available: {ray.available_resources()})"
                )
            _, remaining = ray.wait(remaining, num_returns=len(remaining), timeout=min(left, 5.0))
            if remaining and time.monotonic() - last_note > 4.5:
                last_note = time.monotonic()
                print(
                    f"[phalanx] {self.name}: waiting for {len(remaining)}/{len(refs)} workers to start "
                    f"({time.perf_counter() - t0:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
        metas = []
        for rank, ref in enumerate(refs):
            try:
                metas.append(ray.get(ref))
            except (RayTaskError, RayActorError) as e:
                self._kill_created()
                err = _unwrap(self.name, "__init__", rank, e)
                cause = getattr(getattr(e, "cause", None), "error_msg", None) or str(e)
                if isinstance(err, WorkerError) and not err.remote_traceback:
                    err = WorkerError(
                        self.name, rank, "__init__", cause, err.cause_type, err.message
                    )
                raise err from None
        self._methods = metas[0]["methods"]
        self._worker_metadata = []
        for s, m in zip(self._slots, metas):
            self._worker_metadata.append(
                {
                    "rank": s.rank,
                    "global_rank": s.rank,
                    "node_idx": s.node_rank,
                    "node_ip": s.node_ip,
                    "local_rank": s.local_rank,
                    "name": f"{self.name}:{s.rank}",
                    "bundle_indices": s.bundle_indices,
                    "gpu_ids": m["ray_gpu_ids"] or s.gpu_ids,
                    "cuda_visible_devices": m["cuda_visible_devices"],
                    "pid": m["pid"],
                    "ray_node_id": m["node_id"],
                }
            )
        self._assign_dp_shards()

    def _assign_dp_shards(self) -> None:
        shard = -1
        for md in self._worker_metadata:
            if md["bundle_indices"] is not None or all(
                s.bundle_indices is None for s in self._slots
            ):
                shard += 1
            md["dp_shard_idx"] = max(shard, 0)

    def _kill_created(self) -> None:
        for a in self._actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if self._initializer is not None:
            try:
                ray.kill(self._initializer, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self._actors = []

    # ------------------------------------------------------------------ the call path
    def _check_method(self, method: str) -> None:
        if method not in self._methods:
            if not self._launched:
                raise RuntimeError(
                    f"group {self.name_prefix or self._builder.class_name!r} is not launched yet"
                )
            raise UnknownMethodError(
                f"method_name {method!r}: {self._builder.class_name} has no public method of that name "
                f"(known: {sorted(self._methods)})"
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
        stream = fn is None and self._methods[method] in ("gen", "asyncgen")
        shared = self._share(calls) if len(calls) > 1 else None
        refs = []
        actors = self._actors
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
        seen: dict[int, int] = {}
        values: dict[int, Any] = {}
        for _, args, kwargs in calls:
            for v in itertools.chain(args, kwargs.values()):
                if isinstance(v, ray.ObjectRef):
                    continue
                key = id(v)
                seen[key] = seen.get(key, 0) + 1
                values[key] = v
        return {
            key: ray.put(values[key])
            for key, count in seen.items()
            if count > 1 and _approx_nbytes(values[key]) >= _INLINE_LIMIT
        }

    def _collect(self, handle: GroupHandle, timeout: float | None) -> list[Any]:
        try:
            results = get_results(self.name, handle.method, handle.ranks, handle.refs, timeout)
        except GroupTimeoutError as e:
            raise self._timeout_error(handle, e.pending_ranks, e.timeout) from None
        except WorkerDiedError as e:
            if not all(isinstance(r, ray.ObjectRef) for r in handle.refs):
                self._fault.suspect(e.rank)
                raise
            return self._collect_after_death(handle, timeout)
        if handle.method == "get_state":
            self._fault.see_states(handle.ranks, results)
        return results

    def _pop_durations(self, ranks: list[int]) -> list[dict[str, float]]:
        return ray.get([self._actors[r]._px_pop_durations.remote() for r in ranks], timeout=60)

    # ------------------------------------------------------------------ RLinf face
    def __getattr__(self, name: str) -> _GroupMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        methods = self.__dict__.get("_methods")
        if not methods or name not in methods:
            if not self.__dict__.get("_launched"):
                raise AttributeError(f"{name!r}: the group is not launched yet")
            raise UnknownMethodError(
                f"{name!r}: {self._builder.class_name} has no public method of that name (known: {sorted(methods)})"
            )
        return _GroupMethod(self, name, None)

    def execute_on(self, *ranks: int) -> _RankView:
        """The group restricted to ``ranks`` for the next call: ``g.execute_on(0, 3).hello()``."""
        if len(ranks) == 1 and isinstance(ranks[0], (list, tuple)):
            ranks = tuple(ranks[0])
        if not ranks:
            raise ValueError("execute_on needs at least one rank")
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.world_size]
        if bad:
            raise ValueError(
                f"ranks {bad} out of range for group {self.name} of {self.world_size} workers"
            )
        return _RankView(self, list(ranks))

    def call(
        self, method: str, *args: Any, ranks: list[int] | None = None, **kwargs: Any
    ) -> GroupHandle:
        """Call ``method`` on ``ranks`` (default all) with the same arguments."""
        if ranks is None:
            calls = [(r, args, kwargs) for r in self._all_ranks]
            return self._call(method, calls, health=self._broadcast_health())
        ranks = self._check_ranks(ranks, "ranks")
        return self._call(method, [(r, args, kwargs) for r in ranks])

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

    # ------------------------------------------------------------------ NeMo-RL face
    @property
    def workers(self) -> list[_ActorProxy]:
        return [_ActorProxy(self, r, a) for r, a in enumerate(self._actors)]

    @property
    def actors(self) -> list[ray.actor.ActorHandle]:
        """The underlying Ray actor handles (hosts of the worker objects)."""
        return list(self._actors)

    @property
    def worker_metadata(self) -> list[dict[str, Any]]:
        return list(self._worker_metadata)

    @property
    def world_size(self) -> int:
        return len(self._actors)

    @property
    def dp_size(self) -> int:
        return len(self.dp_leader_worker_indices)

    def get_dp_leader_worker_idx(self, dp_shard_idx: int) -> int:
        if not isinstance(dp_shard_idx, int) or not 0 <= dp_shard_idx < self.dp_size:
            raise IndexError(f"dp_shard_idx {dp_shard_idx} out of range 0..{self.dp_size - 1}")
        return self.dp_leader_worker_indices[dp_shard_idx]

    def _check_ranks(self, ranks: Iterable[int], arg: str) -> list[int]:
        ranks = list(ranks)
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"{arg}: ranks {bad} out of range for {self.world_size} workers")
        return ranks

    def _rank0_only(self, run_rank_0_only_axes: list[str] | None) -> list[int]:
        axes = list(run_rank_0_only_axes or [])
        sh = self.sharding_annotations
        for ax in axes:
            if ax not in sh.names:
                raise ValueError(f"run_rank_0_only_axes: unknown axis {ax!r} (axes: {sh.names})")
        if not axes:
            return list(self._all_ranks)
        return [r for r in self._all_ranks if all(sh.get_worker_coords(r)[ax] == 0 for ax in axes)]

    def run_single_worker_single_data(
        self, method_name: str, worker_idx: int, *args: Any, **kwargs: Any
    ) -> ray.ObjectRef:
        """Run ``method_name`` on one worker; returns its Ray future."""
        self._check_method(method_name)
        self._check_ranks([worker_idx], "worker_idx")
        return self._call(method_name, [(worker_idx, args, kwargs)]).refs[0]

    def run_all_workers_single_data(
        self,
        method_name: str,
        *args: Any,
        run_rank_0_only_axes: list[str] | None = None,
        **kwargs: Any,
    ) -> list[ray.ObjectRef]:
        """Same arguments to every worker (or only rank 0 of ``run_rank_0_only_axes``)."""
        self._check_method(method_name)
        ranks = self._rank0_only(run_rank_0_only_axes)
        calls = [(r, args, kwargs) for r in ranks]
        return self._call(method_name, calls, health=self._broadcast_health()).refs

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
        if not args and not kwargs:
            raise ValueError(
                "run_all_workers_multiple_data needs per-worker data; use run_all_workers_single_data"
            )
        ranks = self._rank0_only(run_rank_0_only_axes)
        common = dict(common_kwargs or {})
        for name, value in [*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]:
            if not isinstance(value, (list, tuple)):
                raise TypeError(
                    f"{name} must be a list with one entry per worker, got {type(value).__name__}"
                )
            if len(value) != len(ranks):
                raise ValueError(f"{name} has {len(value)} entries for {len(ranks)} called workers")
        clash = set(common) & set(kwargs)
        if clash:
            raise ValueError(f"common_kwargs repeats per-worker kwargs {sorted(clash)}")
        calls = [
            (r, tuple(a[i] for a in args), {**{k: v[i] for k, v in kwargs.items()}, **common})
            for i, r in enumerate(ranks)
        ]
        return self._call(method_name, calls).refs

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
        """Send each worker the shard for its coordinates.

        ``in_sharded_axes``: data is nested lists indexed by these axes, in this order.
        ``replicate_on_axes``: every worker along these axes gets the same shard.
        Free axes (neither): only index 0 is called (others get ``None`` data with
        ``make_dummy_calls_to_free_axes``). Results come from index 0 of free axes and of
        ``output_is_replicated`` axes.
        """
        self._check_method(method_name)
        sh = self.sharding_annotations
        in_sharded = list(in_sharded_axes or [])
        replicated = list(replicate_on_axes or [])
        out_rep = list(output_is_replicated or [])
        for arg, axes in (
            ("in_sharded_axes", in_sharded),
            ("replicate_on_axes", replicated),
            ("output_is_replicated", out_rep),
        ):
            unknown = [a for a in axes if a not in sh.names]
            if unknown:
                raise ValueError(f"{arg}: unknown axes {unknown} (axes: {sh.names})")
            if len(set(axes)) != len(axes):
                raise ValueError(f"{arg} repeats an axis: {axes}")
        overlap = set(in_sharded) & set(replicated)
        if overlap:
            raise ValueError(f"in_sharded_axes and replicate_on_axes overlap on {sorted(overlap)}")
        common = dict(common_kwargs or {})
        clash = set(common) & set(kwargs)
        if clash:
            raise ValueError(f"common_kwargs repeats sharded kwargs {sorted(clash)}")
        args = tuple(self._auto_shard(f"args[{i}]", a, in_sharded) for i, a in enumerate(args))
        kwargs = {k: self._auto_shard(k, v, in_sharded) for k, v in kwargs.items()}
        for name, value in [*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]:
            self._check_nested(name, value, in_sharded)

        free = [a for a in sh.names if a not in in_sharded and a not in replicated]
        calls, called, returning = [], [], []
        for rank in self._all_ranks:
            coords = sh.get_worker_coords(rank)
            on_free_zero = all(coords[a] == 0 for a in free)
            if on_free_zero and all(coords[a] == 0 for a in out_rep):
                returning.append(rank)
            if on_free_zero:
                idx = [coords[a] for a in in_sharded]
                wargs = tuple(_index(a, idx) for a in args)
                wkwargs = {k: _index(v, idx) for k, v in kwargs.items()}
            elif make_dummy_calls_to_free_axes:
                wargs = tuple(None for _ in args)
                wkwargs = {k: None for k in kwargs}
            else:
                continue
            calls.append((rank, wargs, {**wkwargs, **common}))
            called.append(rank)
        handle = self._call(method_name, calls)
        return MultiWorkerFuture(
            futures=handle.refs, return_from_workers=returning, called_workers=called
        )

    def _auto_shard(self, name: str, value: Any, axes: list[str]) -> Any:
        """A BatchedDataDict given whole for one sharded axis is split for the caller."""
        from phalanx.data import BatchedDataDict

        if isinstance(value, BatchedDataDict) and len(axes) == 1:
            return value.shard_by_batch_size(self.sharding_annotations.get_axis_size(axes[0]))
        return value

    def _check_nested(self, name: str, value: Any, axes: list[str]) -> None:
        level = [value]
        for ax in axes:
            size = self.sharding_annotations.get_axis_size(ax)
            nxt = []
            for v in level:
                if not isinstance(v, (list, tuple)):
                    raise TypeError(
                        f"{name}: expected a list of {size} shards along axis {ax!r}, got {type(v).__name__}"
                    )
                if len(v) != size:
                    raise ValueError(f"{name}: axis {ax!r} has size {size}, got {len(v)} shards")
                nxt.extend(v)
            level = nxt

    def get_all_worker_results(
        self, future_bundle: MultiWorkerFuture, return_generators_as_proxies: bool = False
    ) -> list[Any]:
        return future_bundle.get_results(
            self, return_generators_as_proxies=return_generators_as_proxies
        )

    # ------------------------------------------------------------------ fault tolerance
    @property
    def restart_policy(self) -> RestartPolicy:
        """The group's :class:`RestartPolicy` (``RestartPolicy.never()`` unless given)."""
        return self._fault.policy

    def _broadcast_health(self) -> str:
        """Same-arguments calls to every rank may go on without dead ranks when ignoring failures."""
        return "skip" if self._fault.policy.ignore_failures else "restart"

    def _respawn(self, rank: int, timeout: float) -> tuple[ray.actor.ActorHandle, dict[str, Any]]:
        """Recreate the actor of ``rank`` on its slot, with its name and environment."""
        try:
            ray.kill(self._actors[rank], no_restart=True)  # frees the actor name at once
        except Exception:  # noqa: BLE001 - already gone
            pass
        if self._initializer is not None:
            try:
                ray.get(self._initializer.__ray_ready__.remote(), timeout=timeout)
            except RayActorError:  # it died (and with it the workers it owned): a new one
                self._initializer = self._builder.new_initializer()
            except GetTimeoutError:
                pass  # slow, not dead: dropping it would kill the workers it owns
        deadline = time.monotonic() + timeout
        while True:
            try:
                actor = ray.get(self._spawn(self._slots[rank]), timeout=timeout)
                break
            except Exception as e:  # noqa: BLE001
                if "already taken" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        m = ray.get(actor._px_describe.remote(), timeout=max(1.0, deadline - time.monotonic()))
        meta = {
            "pid": m["pid"],
            "ray_node_id": m["node_id"],
            "cuda_visible_devices": m["cuda_visible_devices"],
        }
        if m["ray_gpu_ids"]:
            meta["gpu_ids"] = m["ray_gpu_ids"]
        return actor, meta

    def _collect_after_death(self, handle: GroupHandle, timeout: float | None) -> list[Any]:
        """Some called rank died: note it, then raise or (ignoring failures) keep the rest."""
        errors: dict[int, BaseException] = {}
        results: list[Any] = []
        kept: list[int] = []
        for rank, ref in zip(handle.ranks, handle.refs):
            try:
                results.append(ray.get(ref, timeout=timeout))
                kept.append(rank)
            except (RayTaskError, RayActorError) as e:
                errors[rank] = _unwrap(self.name, handle.method, rank, e)
        died = [r for r, e in errors.items() if isinstance(e, WorkerDiedError)]
        for rank in died:
            self._fault.suspect(rank)
        user = [e for r, e in errors.items() if r not in died]
        if user or not self._fault.policy.ignore_failures:
            raise next(iter(errors.values()))
        logger.warning(
            "group %s: %s() lost ranks %s (worker died); ignoring failures, %d results",
            self.name,
            handle.method,
            died,
            len(results),
        )
        handle.skipped = sorted({*handle.skipped, *died})
        return results

    def _timeout_error(self, handle: GroupHandle, pending: list[int], timeout: float) -> Exception:
        return self._hang_error(handle.method, handle.ranks, handle.refs, pending, timeout)

    def _hang_error(
        self, method: str, ranks: list[int], refs: list[Any], pending: list[int], timeout: float
    ) -> Exception:
        """The ``HangTimeoutError`` of a call that timed out: stacks of ``pending``, results of the rest."""
        finished: dict[int, Any] = {}
        for rank, ref in zip(ranks, refs):
            if rank in pending or not isinstance(ref, ray.ObjectRef):
                continue
            try:
                finished[rank] = ray.get(ref, timeout=0)
            except Exception as e:  # noqa: BLE001 - that rank's error is its result
                finished[rank] = _unwrap(self.name, method, rank, e)
        return _hang.timeout_error(self, method, pending, timeout, finished)

    def health(self) -> dict[int, WorkerHealth]:
        """Health of every rank: healthy, unhealthy, restarting or dead (for good)."""
        return dict(enumerate(self._fault.health))

    def health_events(self) -> list[HealthEvent]:
        """Every health transition so far, oldest first."""
        with self._fault.cond:
            return list(self._fault.events)

    def healthy_worker_ids(self) -> list[int]:
        """Ranks whose worker is healthy (RLlib's worker ids; phalanx ids are 0-based ranks)."""
        return [r for r, h in enumerate(self._fault.health) if h == WorkerHealth.HEALTHY]

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

        Ranks restarted in the background since the last probe are included, so a caller
        that re-syncs what came back (as RLlib's algorithms do) misses none.
        """
        timeout = (
            self._fault.policy.health_probe_timeout_s
            if timeout_seconds is None
            else timeout_seconds
        )
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout_seconds must be a positive number, got {timeout_seconds!r}")
        return self._fault.probe(float(timeout))

    def register_state(self, rank: int | None, state: Any) -> None:
        """The state ``set_state`` gets after ``rank`` restarts (``None``: every rank).

        The group also remembers each rank's last ``get_state()`` result it returned.
        """
        ranks = self._all_ranks if rank is None else self._check_ranks([rank], "rank")
        if "set_state" not in self._methods:
            raise ValueError(
                f"register_state: {self._builder.class_name} has no set_state(state) method"
            )
        with self._fault.cond:
            for r in ranks:
                self._fault.states[r] = state

    def set_watchdog(self, after_seconds: float | None, stream: Any = None) -> None:
        """Print a hang report for any call of this group running longer than ``after_seconds``
        (``None`` turns it off)."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if after_seconds is not None:
            self._watchdog = _hang.Watchdog(self, after_seconds, stream)

    def _foreach_ranks(self, healthy_only: bool, remote_worker_ids: list[int] | None) -> list[int]:
        if remote_worker_ids is None:
            ranks = list(self._all_ranks)
        else:
            if not isinstance(remote_worker_ids, (list, tuple)):
                raise TypeError("remote_worker_ids must be a list of ranks")
            ranks = self._check_ranks(remote_worker_ids, "remote_worker_ids")
        if healthy_only and self._fault.not_healthy:
            bad = self._fault.not_healthy
            ranks = [r for r in ranks if r not in bad]
        return ranks

    def _foreach_handle(
        self,
        func: Any,
        ranks: list[int],
        kwargs: dict[str, Any] | None,
        with_id: bool,
        health: str,
    ) -> GroupHandle:
        kwargs = dict(kwargs or {})
        funcs = func if isinstance(func, list) else None
        if funcs is not None and len(funcs) != len(ranks):
            raise ValueError(f"func: a list of {len(funcs)} functions for {len(ranks)} workers")
        for f in funcs or [func]:
            if not (callable(f) or isinstance(f, str)):
                raise TypeError(f"func must be a callable or a method name, got {type(f).__name__}")
            if isinstance(f, str):
                self._check_method(f)
        if funcs is None and isinstance(func, str) and not with_id:
            return self._call(func, [(r, (), kwargs) for r in ranks], health=health)
        if with_id:
            calls = [(r, (funcs[i] if funcs else func, r), kwargs) for i, r in enumerate(ranks)]
            return self._call("foreach_worker_with_id", calls, fn=call_with_id, health=health)
        if funcs is not None:
            calls = [(r, (funcs[i],), kwargs) for i, r in enumerate(ranks)]
            return self._call("foreach_worker", calls, fn=call_each, health=health)
        name = getattr(func, "__name__", "foreach_worker")
        return self._call(name, [(r, (), kwargs) for r in ranks], fn=func, health=health)

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

        ``healthy_only`` skips workers not healthy; ``remote_worker_ids`` selects ranks.
        Results come back in rank order. A rank whose method raised raises here, unless
        the policy ignores failures (its result is then left out and logged). With
        ``timeout_seconds`` a call still running then produces a hang report and a
        :class:`~phalanx.group.hang.HangTimeoutError` (with ``ignore_failures``: the finished
        results, and a warning naming the report); ``timeout_seconds=0`` returns what is
        ready at once, without a report. ``mark_healthy``: unhealthy workers that answer
        are healthy again.
        """
        return [
            v
            for _, v in self._foreach(
                func,
                kwargs,
                healthy_only,
                remote_worker_ids,
                timeout_seconds,
                return_obj_refs,
                mark_healthy,
                with_id=False,
            )
        ]

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
        return [
            v
            for _, v in self._foreach(
                func,
                kwargs,
                healthy_only,
                remote_worker_ids,
                timeout_seconds,
                return_obj_refs,
                mark_healthy,
                with_id=True,
            )
        ]

    def _foreach(
        self,
        func: Any,
        kwargs: dict[str, Any] | None,
        healthy_only: bool,
        remote_worker_ids: list[int] | None,
        timeout_seconds: float | None,
        return_obj_refs: bool,
        mark_healthy: bool,
        with_id: bool,
    ) -> list[tuple[int, Any]]:
        if timeout_seconds is not None and (
            isinstance(timeout_seconds, bool)
            or not isinstance(timeout_seconds, (int, float))
            or timeout_seconds < 0
        ):
            raise ValueError(f"timeout_seconds must be >= 0 or None, got {timeout_seconds!r}")
        ranks = self._foreach_ranks(healthy_only, remote_worker_ids)
        if not ranks:
            return []
        health = "any" if not healthy_only else self._broadcast_health()
        handle = self._foreach_handle(func, ranks, kwargs, with_id, health)
        if return_obj_refs:
            return list(zip(handle.ranks, handle.refs))
        ready_refs, _ = ray.wait(
            handle.refs, num_returns=len(handle.refs), timeout=timeout_seconds, fetch_local=False
        )
        done = set(ready_refs)
        pending = [rk for rk, r in zip(handle.ranks, handle.refs) if r not in done]
        out: list[tuple[int, Any]] = []
        errors: list[BaseException] = []
        for rank, ref in zip(handle.ranks, handle.refs):
            if ref not in done:
                continue
            try:
                out.append((rank, ray.get(ref)))
            except (RayTaskError, RayActorError) as e:
                err = _unwrap(self.name, handle.method, rank, e)
                if isinstance(err, WorkerDiedError):
                    self._fault.suspect(rank)
                errors.append(err)
        policy = self._fault.policy
        if errors and not policy.ignore_failures:
            raise errors[0]
        for err in errors:
            logger.warning("group %s: ignoring failure: %s", self.name, str(err).splitlines()[0])
        if func == "get_state":
            self._fault.see_states([r for r, _ in out], [v for _, v in out])
        if pending and timeout_seconds != 0:  # 0 is RLlib's "take what is ready": no report
            timeout_err = self._timeout_error(handle, pending, float(timeout_seconds or 0))
            if not policy.ignore_failures:
                raise timeout_err
            logger.warning("%s", str(timeout_err))
        if mark_healthy:
            self._fault.mark_healthy([r for r, _ in out])
        return out

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
        the returned :class:`~phalanx.group.fault.AsyncSubmission` lists it as skipped (and a
        warning is logged). ``int(submission)`` is the number of requests sent.
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
        ranks = self._foreach_ranks(healthy_only, remote_worker_ids)
        fault = self._fault
        with fault.cond:
            counts: dict[int, int] = {}
            for t, r in fault.in_flight.values():
                if t == tag:
                    counts[r] = counts.get(r, 0) + 1
        send = [r for r in ranks if counts.get(r, 0) < budget]
        over = [r for r in ranks if counts.get(r, 0) >= budget]
        if isinstance(func, list):
            if len(func) != len(ranks):
                raise ValueError(f"func: a list of {len(func)} functions for {len(ranks)} workers")
            func = [f for f, r in zip(func, ranks) if r in set(send)]
        sub = AsyncSubmission(tag=tag, skipped=over)
        if send:
            handle = self._foreach_handle(func, send, kwargs, False, self._broadcast_health())
            sub.skipped = sorted([*over, *handle.skipped])
            sub.sent = list(handle.ranks)
            with fault.cond:
                for rank, ref in zip(handle.ranks, handle.refs):
                    fault.in_flight[ref] = (tag, rank)
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

    def num_in_flight_async_reqs(self, tags: str | list[str] | None = None) -> int:
        """Async requests sent and not yet fetched (of ``tags``, default all)."""
        wanted = _tags(tags)
        with self._fault.cond:
            return sum(
                1 for t, _ in self._fault.in_flight.values() if wanted is None or t in wanted
            )

    def fetch_ready_async_reqs(
        self,
        *,
        tags: str | list[str] | None = None,
        timeout_seconds: float | None = 0.0,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
    ) -> list[tuple[int, Any]]:
        """``(worker_id, result)`` of the async requests (of ``tags``) that are done.

        Waits up to ``timeout_seconds`` for at least one (0: only what is ready now).
        A request whose worker raised (or died) raises its error, unless the policy
        ignores failures; results ready alongside an error are kept for the next fetch.
        """
        wanted = _tags(tags)
        fault = self._fault
        with fault.cond:
            held = [(t, r, v) for t, r, v in fault.held if wanted is None or t in wanted]
            fault.held = [h for h in fault.held if not (wanted is None or h[0] in wanted)]
            refs = [ref for ref, (t, _) in fault.in_flight.items() if wanted is None or t in wanted]
        ready: list[ray.ObjectRef] = []
        if refs:
            wait_s = 0 if held else timeout_seconds
            ready, _ = ray.wait(refs, num_returns=1, timeout=wait_s, fetch_local=False)
            if ready:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        got: list[tuple[str | None, int, Any]] = list(held)
        first_error: BaseException | None = None
        for ref in ready:
            with fault.cond:
                tag, rank = fault.in_flight.pop(ref, (None, -1))
            if rank < 0:
                continue
            if return_obj_refs:
                got.append((tag, rank, ref))
                continue
            try:
                got.append((tag, rank, ray.get(ref)))
            except (RayTaskError, RayActorError) as e:
                err = _unwrap(self.name, "foreach_worker_async", rank, e)
                if isinstance(err, WorkerDiedError):
                    fault.suspect(rank)
                if fault.policy.ignore_failures:
                    logger.warning(
                        "group %s: ignoring async failure: %s",
                        self.name,
                        str(err).splitlines()[0],
                    )
                elif first_error is None:
                    first_error = err
        if first_error is not None:
            with fault.cond:
                fault.held[:0] = got
            raise first_error
        out = [(r, v) for _, r, v in got]
        if mark_healthy:
            fault.mark_healthy([r for r, _ in out])
        return out

    # ------------------------------------------------------------------ shutdown
    def shutdown(
        self, cleanup_method: str | None = None, timeout: float | None = 30.0, force: bool = False
    ) -> bool:
        """Run ``cleanup_method`` on every worker (unless ``force``), then free every actor.

        Returns whether the cleanup succeeded. Actors, their names and the initializer are
        always released; the group's names are free again when this returns.
        """
        if not self._actors:
            return True
        success = True
        if cleanup_method is not None and not force:
            try:
                self._check_method(cleanup_method)
                self.call(cleanup_method).wait(timeout=timeout)
            except Exception as e:  # noqa: BLE001 - reported through the return value
                logger.warning("group %s: cleanup %s failed: %s", self.name, cleanup_method, e)
                success = False
        names = [f"{self.name}:{r}" for r in self._all_ranks]
        if _trace.ON:
            _trace.collect_group(self)  # the workers' trace events die with them otherwise
        self.set_watchdog(None)
        self._fault.close()
        self._kill_created()
        deadline = time.monotonic() + 30
        for n in names:
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(n, namespace=NAMESPACE)
                except ValueError:
                    break
                time.sleep(0.02)
        self._all_ranks = []
        self._launched = False
        return success

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, world_size={self.world_size})"


def _check_policy(policy: RestartPolicy | None) -> RestartPolicy:
    if policy is None:
        return RestartPolicy.never()
    if not isinstance(policy, RestartPolicy):
        raise TypeError(f"restart_policy must be a px.RestartPolicy, got {type(policy).__name__}")
    return policy


def _tags(tags: str | list[str] | None) -> set[str | None] | None:
    if tags is None:
        return None
    if isinstance(tags, str):
        return {tags}
    if not isinstance(tags, (list, tuple, set)):
        raise TypeError(f"tags must be a str, a list of str or None, got {type(tags).__name__}")
    return set(tags)


def _index(value: Any, idx: list[int]) -> Any:
    for i in idx:
        value = value[i]
    return value


RayWorkerGroup = WorkerGroup
__all__ = ["WorkerGroup", "RayWorkerGroup", "UnknownMethodError"]
