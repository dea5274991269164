"""WorkerGroup: a set of worker actors called as one, with two faces over one call path.

RLinf face: ``MyWorker.create_group(...).launch(cluster, placement, name)``; the worker
class's public methods appear on the group and return a ``GroupHandle``;
``execute_on(*ranks)`` narrows the next call.

NeMo-RL face: ``RayWorkerGroup(virtual_cluster, builder, ...)`` with
``run_single_worker_single_data``, ``run_all_workers_single_data``,
``run_all_workers_multiple_data`` and ``run_all_workers_sharded_data``.

Every face ends in ``WorkerGroup._call(method, [(rank, args, kwargs), ...])``, which puts
arguments shared by several ranks into the object store once and returns a handle.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .builder import RayWorkerBuilder, _check_env, allowlisted_env
from .cluster import NAMESPACE, Cluster, find_free_port
from .errors import WorkerError
from .futures import GroupHandle, MultiWorkerFuture, _unwrap, get_results
from .placement import Placement, WorkerSlot, default_placement
from .sharding import NamedSharding
from .virtual_cluster import RayVirtualCluster
from .worker import WorkerContext

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
        ranks = g._all_ranks if self._ranks is None else self._ranks
        return g._call(self._name, [(r, args, kwargs) for r in ranks])

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
        num_gpus_per_node = getattr(self.cluster, "num_gpus_per_node", None)
        layers = [allowlisted_env(), {}, dict(self._env_vars)]
        if self._builder.isolated:
            self._initializer = self._builder.new_initializer()
        pending: list[Any] = []
        t0 = time.perf_counter()
        for s in slots:
            ctx = WorkerContext(
                group_name=self.name,
                rank=s.rank,
                world_size=world,
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
                "px_env_layers": layers,
                "num_gpus_per_node": num_gpus_per_node,
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
            pending.append(ref)
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
        self._launched = True

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
    ) -> GroupHandle:
        """The one dispatch: for each (rank, args, kwargs) start the call; return a handle."""
        if fn is None:
            self._check_method(method)
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
                refs.append(
                    actor._px_stream.options(num_returns="streaming").remote(
                        method, *args, **kwargs
                    )
                )
            else:
                refs.append(actor._px_call.remote(method, *args, **kwargs))
        return GroupHandle(self, method, [c[0] for c in calls], refs)

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
        return get_results(self.name, handle.method, handle.ranks, handle.refs, timeout)

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
        ranks = self._all_ranks if ranks is None else self._check_ranks(ranks, "ranks")
        return self._call(method, [(r, args, kwargs) for r in ranks])

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
        return self._call(method_name, [(r, args, kwargs) for r in ranks]).refs

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
        from .data import BatchedDataDict

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


def _index(value: Any, idx: list[int]) -> Any:
    for i in idx:
        value = value[i]
    return value


RayWorkerGroup = WorkerGroup
__all__ = ["WorkerGroup", "RayWorkerGroup", "UnknownMethodError"]
