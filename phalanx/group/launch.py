"""Starting a group's workers and keeping track of them: the :class:`Roster`.

A roster holds what launching produced (one actor per placement slot, each worker's
metadata, the worker class's public methods) and does what changes it: start every
worker, recreate one rank on its slot (restarts), and kill them all. It satisfies
``fault.Members``, the interface the restart machinery uses.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from phalanx._base.errors import WorkerDiedError, WorkerError
from phalanx.group.results import unwrap_error
from phalanx.resources.cluster import NAMESPACE, Cluster, find_free_port
from phalanx.resources.placement import Placement, WorkerSlot
from phalanx.resources.strategies import PlacementStrategy
from phalanx.worker.builder import RayWorkerBuilder, allowlisted_env, pool_environ
from phalanx.worker.worker import WorkerContext

_group_counter = itertools.count()


@dataclass
class Spawned:
    """A recreated worker, started but not yet part of the group."""

    actor: ray.actor.ActorHandle
    meta: dict[str, Any]


@dataclass
class WorkerRank:
    """RLinf's ``WorkerGroup.WorkerRank``: a worker's actor handle and its rank."""

    worker: ray.actor.ActorHandle
    rank: int


# ----------------------------------------------------------------------------- pure checks


def bundle_indices_for(
    bundle_counts: list[int], workers_per_node: int | list[int] | None
) -> list[tuple[int, list[int]]]:
    """One single-bundle tuple per worker: ``workers_per_node`` workers on each placement group."""
    if workers_per_node is None:
        wanted = bundle_counts
    elif isinstance(workers_per_node, bool):
        raise TypeError("workers_per_node must be None, an int or a list of ints")
    elif isinstance(workers_per_node, int):
        wanted = [workers_per_node] * len(bundle_counts)
    elif isinstance(workers_per_node, list):
        if len(workers_per_node) != len(bundle_counts):
            raise ValueError(
                f"workers_per_node has {len(workers_per_node)} entries; the cluster has "
                f"{len(bundle_counts)} placement group(s)"
            )
        wanted = workers_per_node
    else:
        raise TypeError("workers_per_node must be None, an int or a list of ints")
    for i, (w, c) in enumerate(zip(wanted, bundle_counts)):
        if not isinstance(w, int) or w < 0 or w > c:
            raise ValueError(
                f"workers_per_node: placement group {i} has {c} bundles, asked for {w} workers"
            )
    return [(i, [b]) for i, w in enumerate(wanted) for b in range(w)]


def check_bundle_indices(bundle_indices_list: Any) -> None:
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


def check_resources(cluster: Cluster, slots: list[WorkerSlot]) -> None:
    """Fail before any remote work when a node lacks the CPUs or GPUs the slots need."""
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


def placement_slots(
    placement: Placement, cluster: Cluster, isolate_gpu: bool | None
) -> list[WorkerSlot]:
    """The placement's slots, with RLinf's ``launch(isolate_gpu=...)`` applied.

    For an RLinf ``PlacementStrategy`` ``isolate_gpu`` becomes the strategy's
    ``isolate_accelerator`` (``None`` keeps RLinf's default, True). phalanx's own
    placements fix isolation when built (``PackedPlacement(..., isolate_gpu=...)``); a
    launch value that disagrees with theirs is an error rather than silently dropped.
    """
    if isolate_gpu is not None and not isinstance(isolate_gpu, bool):
        raise TypeError(f"isolate_gpu must be a bool or None, got {isolate_gpu!r}")
    if isinstance(placement, PlacementStrategy):
        if isolate_gpu is None:
            return placement.slots(cluster)
        return placement.slots(cluster, isolate_accelerator=isolate_gpu)
    own = getattr(placement, "isolate_gpu", None)
    if isolate_gpu is not None and own != isolate_gpu:
        where = (
            f"set it on the placement ({type(placement).__name__}(..., isolate_gpu=...))"
            if own is not None
            else f"{type(placement).__name__} places CPU workers and isolates no GPUs"
        )
        raise ValueError(
            f"isolate_gpu={isolate_gpu} applies to RLinf placement strategies; {where}"
        )
    return placement.slots(cluster)


def check_sharding(sharding: Any, world_size: int) -> None:
    """A group's ``NamedSharding`` must hold exactly the ranks ``0..world_size-1``."""
    if sharding is None:
        return
    ranks = sorted(int(r) for r in sharding.layout.ravel())
    if ranks != list(range(world_size)):
        missing = sorted(set(range(world_size)) - set(ranks))
        extra = sorted(set(ranks) - set(range(world_size)))
        raise ValueError(
            f"sharding_annotations must cover exactly ranks 0..{world_size - 1} of the "
            f"group's {world_size} workers; its layout holds {len(ranks)} rank(s)"
            + (f", missing {missing}" if missing else "")
            + (f", outside the group {extra}" if extra else "")
        )


def pin_to_nodes(slots: list[WorkerSlot]) -> None:
    for s in slots:
        s.scheduling_strategy = NodeAffinitySchedulingStrategy(s.node_id, soft=False)


def check_bundles(slots: list[WorkerSlot]) -> None:
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
        short = {k: (a, avail.get(k, 0.0)) for k, a in need.items() if avail.get(k, 0.0) + 1e-9 < a}
        if not short or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for key, (amount, have) in short.items():
        res, _, bundle, _ = key.split("_", 3)
        raise ValueError(
            f"bundle {bundle}: needs {amount:g} {res}, {have:g} free; another group holds "
            "it (co-locate groups with RayVirtualCluster(max_colocated_worker_groups=N))"
        )


def resolve_name(prefix: str, class_name: str) -> str:
    """The group's name: ``prefix`` or a fresh one; a live group of that name is an error."""
    name = prefix or f"{class_name}_group_{next(_group_counter)}"
    if ":" in name:
        raise ValueError(f"name may not contain ':', got {name!r}")
    try:
        ray.get_actor(f"{name}:0", namespace=NAMESPACE)
    except ValueError:
        return name
    raise ValueError(f"name {name!r}: a live group of that name already exists")


# ----------------------------------------------------------------------------- the roster


class Roster:
    """The live workers of one group, by rank."""

    def __init__(self, builder: RayWorkerBuilder, launch_timeout_s: float):
        self.builder = builder
        self.launch_timeout_s = launch_timeout_s
        self.name = ""
        self.cluster: Any = None
        self.slots: list[WorkerSlot] = []
        self.actors: list[ray.actor.ActorHandle] = []
        self.metadata: list[dict[str, Any]] = []
        self.methods: dict[str, str] = {}
        self.master_address = ""
        self.master_port = 0
        self.max_concurrency: int | None = None
        self.env_layers: list[dict[str, str]] = []
        self._initializer: ray.actor.ActorHandle | None = None
        self._lock = threading.Lock()
        self._initializer_lock = threading.Lock()
        self._pending: set[ray.actor.ActorHandle] = set()  # recreated, not yet installed
        self._closed = False

    # -- fault.Members ----------------------------------------------------------------------
    def actor(self, rank: int) -> ray.actor.ActorHandle:
        return self.actors[rank]

    def has_method(self, name: str) -> bool:
        return name in self.methods

    @property
    def world_size(self) -> int:
        return len(self.actors)

    # -- start ------------------------------------------------------------------------------
    def start(
        self,
        slots: list[WorkerSlot],
        name: str,
        env_vars: dict[str, str],
        startup_restarts_left: Callable[[int, int], bool],
    ) -> dict[int, int]:
        """Create one worker per slot and wait until all are ready.

        A worker whose process dies during ``__init__`` is created again while
        ``startup_restarts_left(rank, done)`` allows; returns the restarts done per rank.
        An exception raised by ``__init__`` fails the launch with that rank's error.
        """
        if not slots:
            raise ValueError("placement produced no workers")
        check_bundles(slots)
        self.name = name
        self.slots = slots
        self._closed = False
        first = slots[0]
        self.master_address = first.node_ip
        self.master_port = find_free_port(first.node_ip, first.node_id, first.port_range)
        self.env_layers = [allowlisted_env(), {}, dict(env_vars)]
        t0 = time.perf_counter()
        if self.builder.isolated:
            self._initializer = self.builder.shared_initializer()
        else:  # one probe per node, in parallel, before the first worker needs it
            pool_environ(s.node_id for s in slots)
        pending = [self._spawn(s) for s in slots]
        try:
            self.actors = list(ray.get(pending, timeout=self.launch_timeout_s))
        except GetTimeoutError:
            if self._initializer is not None:
                # Stuck: it may still create workers that no handle here names.
                _kill(self._initializer)
            self.kill_all()
            raise RuntimeError(
                f"group {self.name}: creating workers timed out after {self.launch_timeout_s}s"
            ) from None
        try:
            return self._await_ready(t0, startup_restarts_left)
        except BaseException:
            self.kill_all()
            raise

    def _spawn(self, s: WorkerSlot) -> ray.ObjectRef:
        """Start creating the worker of slot ``s``; returns a ref to its actor handle."""
        ctx = WorkerContext.from_slot(
            s, self.name, len(self.slots), self.master_address, self.master_port
        )
        options: dict[str, Any] = {
            "name": f"{self.name}:{s.rank}",
            "namespace": NAMESPACE,
            "num_cpus": s.num_cpus,
            "px_context": ctx,
            "px_env_layers": self.env_layers,
            "num_gpus_per_node": getattr(self.cluster, "num_gpus_per_node", None),
            "px_node_id": s.node_id or None,
            # Fate-share with the driver (or the initializer it owns) even when the class
            # asks for ``lifetime="detached"``: a killed driver must take its group along.
            "lifetime": None,
        }
        if self.max_concurrency is not None:
            options["max_concurrency"] = self.max_concurrency
        if s.placement_group is None:
            options["scheduling_strategy"] = s.scheduling_strategy
        ref, _ = self.builder.create_worker_async(
            s.placement_group,
            s.bundle_index,
            s.num_gpus,
            s.bundle_indices,
            initializer=self._initializer,
            **options,
        )
        return ref

    def _await_ready(
        self, t0: float, startup_restarts_left: Callable[[int, int], bool]
    ) -> dict[int, int]:
        """Wait for every worker's ``__init__``; each answer is handled once, as it arrives.

        Each rank has ``launch_timeout_s`` from its latest (re)creation: a start-up restart
        extends the wait for that rank, and restarts are bounded by the policy, so the
        wait is too.
        """
        world = len(self.actors)
        deadlines = dict.fromkeys(range(world), t0 + self.launch_timeout_s)
        pending: dict[Future, tuple[int, ray.ObjectRef]] = {}

        def ask(rank: int) -> None:
            ref = self.actors[rank]._px_describe.remote()
            pending[ref.future()] = (rank, ref)

        for r in range(world):
            ask(r)
        metas: dict[int, dict[str, Any]] = {}
        restarts: dict[int, int] = {}
        while pending:
            now = time.perf_counter()
            left = min(deadlines[rank] for rank, _ in pending.values()) - now
            if left <= 0:
                idx = sorted(rank for rank, _ in pending.values() if deadlines[rank] <= now)
                raise RuntimeError(
                    f"group {self.name}: ranks {idx} not ready after {self.launch_timeout_s}s "
                    f"(start-up restarts so far: {restarts or 'none'}; resources held "
                    f"elsewhere? available: {ray.available_resources()})"
                )
            # as_completed over the futures pending now: O(1) per answer. A recreated
            # rank starts a new round, which waits on its new future too.
            try:
                for fut in as_completed(list(pending), timeout=min(left, 5.0)):
                    rank, ref = pending.pop(fut)
                    try:
                        metas[rank] = ray.get(ref)
                    except (RayTaskError, RayActorError) as e:
                        done = restarts.get(rank, 0)
                        if not _died_in_init(e):
                            raise _init_error(self.name, rank, e) from None
                        if not startup_restarts_left(rank, done):
                            raise _startup_exhausted(self.name, rank, done, e) from None
                        restarts[rank] = done + 1
                        self.actors[rank] = self._recreate(rank, self.launch_timeout_s)
                        deadlines[rank] = time.perf_counter() + self.launch_timeout_s
                        ask(rank)
                        break
            except FuturesTimeout:
                print(
                    f"[phalanx] {self.name}: waiting for {world - len(metas)}/{world} workers "
                    f"to start ({time.perf_counter() - t0:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
        self.methods = metas[0]["methods"]
        self.metadata = []
        for s in self.slots:
            m = metas[s.rank]
            self.metadata.append(
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
        shard = -1
        tied = any(s.bundle_indices is not None for s in self.slots)
        for md in self.metadata:
            if md["bundle_indices"] is not None or not tied:
                shard += 1
            md["dp_shard_idx"] = max(shard, 0)
        return restarts

    # -- restart ----------------------------------------------------------------------------
    def _recreate(self, rank: int, timeout: float) -> ray.actor.ActorHandle:
        """Kill the actor of ``rank`` (freeing its name) and create it again on its slot."""
        _kill(self.actors[rank])
        with self._initializer_lock:  # ranks restart in threads of their own
            if self._initializer is not None:
                # a dead one (killed, OOM) is replaced; its workers died with it
                old = self._initializer
                self._initializer = self.builder.shared_initializer()
                self.builder.release_initializer(old)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return ray.get(self._spawn(self.slots[rank]), timeout=timeout)
            except Exception as e:  # noqa: BLE001
                if "already taken" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def respawn(self, rank: int, timeout: float) -> Spawned:
        """Recreate ``rank`` and wait until its ``__init__`` finished (not yet installed)."""
        if self._closed:
            raise RuntimeError(f"group {self.name} is shut down")
        deadline = time.monotonic() + timeout
        actor = self._recreate(rank, timeout)
        with self._lock:
            if self._closed:
                _kill(actor)
                raise RuntimeError(f"group {self.name} is shut down")
            self._pending.add(actor)
        try:
            m = ray.get(actor._px_describe.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.discard(Spawned(actor, {}))
            raise
        meta = {
            "pid": m["pid"],
            "ray_node_id": m["node_id"],
            "cuda_visible_devices": m["cuda_visible_devices"],
        }
        if m["ray_gpu_ids"]:
            meta["gpu_ids"] = m["ray_gpu_ids"]
        return Spawned(actor, meta)

    def install(self, rank: int, spawned: Spawned) -> ray.actor.ActorHandle:
        """Make a recreated worker the rank's worker."""
        with self._lock:
            self._pending.discard(spawned.actor)
            self.actors[rank] = spawned.actor
            self.metadata[rank].update(spawned.meta)
        return spawned.actor

    def discard(self, spawned: Spawned) -> None:
        with self._lock:
            self._pending.discard(spawned.actor)
        _kill(spawned.actor)

    # -- stop -------------------------------------------------------------------------------
    def kill_all(self) -> list[str]:
        """Kill every worker, those being recreated included, and the initializer.

        Returns the actor names that were in use.
        """
        with self._lock:
            self._closed = True
            victims = [*self.actors, *self._pending]
            self._pending.clear()
        for a in victims:
            _kill(a)
        with self._initializer_lock:
            if self._initializer is not None:
                self.builder.release_initializer(self._initializer)
                self._initializer = None
        names = [f"{self.name}:{r}" for r in range(len(self.actors))]
        self.actors = []
        return names

    def worker_ranks(self) -> list[WorkerRank]:
        return [WorkerRank(a, r) for r, a in enumerate(self.actors)]


# A name lookup unanswered this long: Ray's node no longer answers (its raylet is gone).
LOOKUP_STALL_S = 3.0


def wait_names_free(names: list[str], timeout: float) -> list[str]:
    """Block until no actor holds these names (or ``timeout``); returns those not seen free.

    Each round asks about names only up to the first one still held: the cost is one
    lookup per freed name plus one per round, not one per name per round. The lookups
    run on a daemon thread: with this node's raylet gone (a SIGTERM sent to the whole
    job, as Slurm and ``timeout`` send it) a lookup blocks for good, so a lookup left
    unanswered for ``LOOKUP_STALL_S`` ends the wait early.
    """
    held = deque(names)
    lock = threading.Lock()
    stop = threading.Event()
    answered = [time.monotonic()]

    def poll() -> None:
        while not stop.is_set():
            with lock:
                first = held[0] if held else None
            if first is None:
                return
            still_held = _name_held(first)
            answered[0] = time.monotonic()
            if still_held:
                stop.wait(0.02)
            else:
                with lock:
                    held.popleft()

    poller = threading.Thread(target=poll, name="phalanx-names-free", daemon=True)
    poller.start()
    deadline = time.monotonic() + timeout
    while poller.is_alive() and time.monotonic() < deadline:
        poller.join(min(0.05, max(0.0, deadline - time.monotonic())))
        if time.monotonic() - answered[0] > LOOKUP_STALL_S:
            break
    stop.set()
    with lock:
        return list(held)


def _name_held(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def _died_in_init(e: BaseException) -> bool:
    """The process died while ``__init__`` ran (killed, crashed), not ``__init__`` raising."""
    err = getattr(e, "cause", None) if isinstance(e, RayTaskError) else e
    return isinstance(err, RayActorError) and not getattr(err, "actor_init_failed", False)


def _startup_exhausted(group: str, rank: int, done: int, e: BaseException) -> BaseException:
    """A rank died in ``__init__`` with no start-up restart left: its death, saying so."""
    err = _init_error(group, rank, e)
    if done == 0 or not isinstance(err, WorkerError):
        return err  # restarts off: the plain death
    return WorkerDiedError(
        group,
        rank,
        "__init__",
        err.remote_traceback,
        err.cause_type,
        f"died during start-up again after {done} start-up restart(s), no restart left "
        f"(max_restarts_per_worker): {err.message}",
    )


def _init_error(group: str, rank: int, e: BaseException) -> BaseException:
    err = unwrap_error(group, "__init__", rank, e)
    cause = getattr(getattr(e, "cause", None), "error_msg", None) or str(e)
    if isinstance(err, WorkerError) and not err.remote_traceback:
        err = WorkerError(group, rank, "__init__", cause, err.cause_type, err.message)
    return err


__all__ = ["Roster", "Spawned", "WorkerRank", "bundle_indices_for", "check_resources"]
