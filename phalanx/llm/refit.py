"""Refit: move the policy's current weights into the generation workers.

Every refit is a version of one ``WeightSender`` on the generation group, so the
generators receive through the weight-sync layer's own transports, under their names
(``phalanx.weights.transports``): versioned, validated, applied whole between calls.
What differs is who places the bytes:

- ``"shm"`` / ``"cuda_ipc"`` (alias ``"ipc"``: the one of the two that fits the policy's
  device): the policy's own ranks write the weights. On CPU, with the policy on the
  driver's node, every policy rank copies its own rows (no gather) into the next buffer
  of the sender's versioned ring (``WeightSender.reserve_shared_buffer``,
  ``DTensorPolicyWorker.write_weights_to_shm``); ``read_only_weights`` generators
  (``HFGenerationWorker`` on CPU) then take that buffer as their parameters, switched
  under their weights lock between calls (route ``"shm_view"``: no copy on their side),
  and other generators copy from it (route ``"shm"``). A generator inside a call keeps
  the version it started with; a buffer some generator still views, or that a
  generator which did not answer may read later, is never rewritten (the ring retires
  it). Elsewhere (policy on another node or spread over several) every rank writes
  into one segment of the policy's own (``pack_weights_for_ipc``), which generators
  copy from; on GPU rank 0 packs the gathered weights into a CUDA buffer. Either way
  the sender has the generators apply it (``WeightSender.send_prepared``), and
  ``refit()`` returns its ``SyncResult``, whose ``routes`` say which path each generator
  got. Same node only.
- ``"collective"``: policy rank 0 and the generation workers form one weights process
  group (gloo on CPU, NCCL on GPU; the generators join through the weight layer's
  receiver) and rank 0 broadcasts the weights in buckets while the generators receive
  them through the sender's collective transport. Every operation of that group times
  out after ``peer_timeout_s`` (30 s), so a peer that died or does not take part frees
  the others within that bound (a dead peer's closed connection usually does it at
  once); a busy generator takes part only once its call ends. A failed broadcast is
  reported naming the workers that died, and the group is rebuilt at the next refit; it
  is also rebuilt when a member was restarted since it was made.
- ``"object_store"`` / ``"auto"``: the driver gathers the policy's state dict and the
  sender moves it (``"auto"``: shared memory on one node, where ``read_only_weights``
  generators take the sender's buffers as their parameters without a copy).

A generation worker that dies is restarted by its group's fault-tolerance policy
(``launch(..., restart_policy=px.RestartPolicy())``), which refits it before any call
reaches it through the group's restart hooks: the sender re-sends its last version
(``"shm"``/``"cuda_ipc"``: the ring keeps the newest version's buffer, the policy its
own segment, until the next refit), and for
``"collective"``, whose broadcast is not kept, the weights are copied from a healthy peer
generation worker and the group is rebuilt at the next refit. The policy is not called,
so a restart never interleaves with the policy's own collectives.
"""

from __future__ import annotations

import datetime
from typing import Any

import ray

from phalanx.group.group import WorkerGroup
from phalanx.llm.policy import Policy
from phalanx.resources.cluster import find_free_port
from phalanx.weights import receiver as _recv
from phalanx.weights.layout import Layout
from phalanx.weights.sender import SyncResult, WeightSender, ping

TRANSPORTS = ("ipc", "collective", "object_store", "shm", "auto")  # usable on CPU
ALL_TRANSPORTS = (*TRANSPORTS, "cuda_ipc")  # "ipc" is an alias: "shm" on CPU, "cuda_ipc" on GPU
_KEY = "refit"  # the weights process group's key (DTensorPolicyWorker.init_collective)


class Refitter:
    """Refits ``generation`` from ``policy`` through one transport; ``refit()`` per step.

    ``timeout_s`` bounds each driver-side wait; ``peer_timeout_s`` bounds each operation of
    the collective refit group, i.e. how long its members wait for a peer that is gone.

    Args:
        policy: the ``Policy`` whose weights are sent.
        generation: the group of generation workers.
        transport: ``"ipc"`` (``"shm"`` on CPU, ``"cuda_ipc"`` on GPU), ``"shm"``,
            ``"cuda_ipc"``, ``"collective"``, ``"object_store"`` or ``"auto"``.
        timeout_s: as above.
        peer_timeout_s: as above.

    Raises:
        ValueError: ``transport`` is not one of those.
    """

    def __init__(
        self,
        policy: Policy,
        generation: WorkerGroup,
        transport: str = "ipc",
        timeout_s: float = 300.0,
        peer_timeout_s: float = 30.0,
    ) -> None:
        if transport not in ALL_TRANSPORTS:
            raise ValueError(f"transport must be one of {ALL_TRANSPORTS}, got {transport!r}")
        if not isinstance(peer_timeout_s, (int, float)) or peer_timeout_s <= 0:
            raise ValueError(f"peer_timeout_s must be a positive number, got {peer_timeout_s!r}")
        if not isinstance(generation, WorkerGroup):
            raise TypeError(f"generation must be a WorkerGroup, got {type(generation).__name__}")
        self.policy, self.generation, self.transport = policy, generation, transport
        self.timeout_s, self.peer_timeout_s = timeout_s, float(peer_timeout_s)
        self._info: dict[str, Any] | None = None
        self._members: dict[tuple[str, int], Any] = {}  # (group, rank) -> actor, collective
        sender_transport = transport if transport in ("object_store", "shm", "auto") else "auto"
        self.sender = WeightSender(generation, transport=sender_transport, timeout_s=timeout_s)
        self.refits = 0
        self.last_result: SyncResult | None = None
        self._ring_layout: Layout | None | bool = False  # False: not asked yet
        self._remove_hook = None
        if transport == "collective":  # the sender restores the others itself
            self._remove_hook = generation.add_restart_hook(self._restore)

    def close(self) -> None:
        """Release the sender and the restart hooks."""
        self.sender.close()
        if self._remove_hook is not None:
            self._remove_hook()

    def replace_policy(self, policy: Policy) -> None:
        """Refit from ``policy`` from now on (a policy group relaunched after a death):
        the sender and its versions stay, what was asked of the old group is asked again.

        Args:
            policy: the relaunched policy.
        """
        self.policy = policy
        self._ring_layout = False
        self._info = None

    # ------------------------------------------------------------------ collective
    def _collective_members(self) -> dict[tuple[str, int], Any]:
        """The actors a collective refit group spans: policy rank 0 and every generator."""
        pg, gen = self.policy.worker_group, self.generation
        return {(pg.name, 0): pg.actors[0], **{(gen.name, r): a for r, a in enumerate(gen.actors)}}

    def _setup_collective(self) -> None:
        pg, gen, t = self.policy.worker_group, self.generation, self.timeout_s
        if gen.num_healthy_workers() < gen.world_size:
            gen.call("is_alive").wait(timeout=t)  # waits for restarts (and their refit)
        members = self._collective_members()
        ids = {k: a._actor_id for k, a in members.items()}
        if self._info is not None and ids == {k: a._actor_id for k, a in self._members.items()}:
            return  # built, and no member was restarted since
        meta = pg.worker_metadata[0]
        ip = meta["node_ip"]
        port = find_free_port(ip, meta["ray_node_id"])
        world = 1 + gen.world_size
        a = pg.call("init_collective", ip, port, world)
        # The generators join as the weight layer's receivers (ranks 1..), each operation
        # of their group bounded by peer_timeout_s.
        joins = [(r, (ip, port, world, 1 + r, self.peer_timeout_s), {}) for r in range(world - 1)]
        b = gen.apply(_join_refit_group, joins, label="join_refit_group")
        a.wait(timeout=t)
        b.wait(timeout=t)
        bound = [(0, (self.peer_timeout_s,), {})]
        pg.apply(_bound_refit_group, bound, label="bound_refit_group").wait(timeout=t)
        self._info = pg.call("prepare_info_for_collective").wait(timeout=t)[0]
        self._members = members

    def _refit_collective(self) -> None:
        pg, t = self.policy.worker_group, self.timeout_s
        self._setup_collective()
        info = self._info
        payload = {"key": _KEY, "bucket_bytes": info["bucket_bytes"]}
        try:
            self.sender.send_prepared(
                "collective", info["layout"], payload, wait=False, beside_calls=False
            )
            pg.call("broadcast_weights_for_collective").wait(timeout=t)
        except Exception as e:
            if self.sender.pending:  # the generators' halves fail on their own
                self.sender.abandon_prepared()
            self._info = None  # rebuilt at the next refit
            raise self._broadcast_error(e) from e
        result = self.sender.wait_async()
        if not result.ok:
            self._info = None
            raise self._broadcast_error(RuntimeError(f"generators failed: {result.failed}"))

    def _broadcast_error(self, cause: Exception) -> RuntimeError:
        """The error of a failed collective refit, naming the members that died."""
        members = list(self._members.items())
        _, dead = ping({i: actor for i, (_, actor) in enumerate(members)})
        who = "; ".join(
            f"{members[i][0][0]}[rank {members[i][0][1]}]: {why}" for i, why in dead.items()
        )
        return RuntimeError(
            f"collective refit failed: {who or 'no member died'}; the refit group is rebuilt "
            f"at the next refit (cause: {type(cause).__name__}: {str(cause)[:300]})"
        )

    # ------------------------------------------------------------------ refit
    def refit(self) -> SyncResult | None:
        """Bring every generation worker to the policy's current weights.

        Returns the sender's ``SyncResult`` (``routes``: the path each generator got), or
        None for ``"collective"``, which the policy broadcasts itself.

        Returns:
            The ``SyncResult``, or None.

        Raises:
            RuntimeError: some generation worker did not apply the weights.
        """
        if self.transport in ("ipc", "shm", "cuda_ipc"):
            result = self._refit_shared()
        elif self.transport == "collective":
            self._refit_collective()
            result = None
        else:
            result = self.sender.send(self.policy.state_dict())
        if result is not None and not result.ok:
            raise RuntimeError(f"refit through {self.transport} failed: {result}")
        self.refits += 1
        self.last_result = result
        return result

    def _shared_ring_layout(self) -> Layout | None:
        """The policy's stream layout when its ranks can write the sender's ring (CPU,
        one node, the driver's node), else None; asked once."""
        if self._ring_layout is False:
            pg = self.policy.worker_group
            layout = pg.call("shm_refit_layout").wait(timeout=self.timeout_s)[0]
            here = ray.get_runtime_context().get_node_id()
            same_node = pg.worker_metadata[0].get("ray_node_id") == here
            self._ring_layout = layout if same_node else None
        return self._ring_layout  # type: ignore[return-value]

    def _refit_shared(self) -> SyncResult:
        """Refit through memory the policy's ranks write (shared memory, or CUDA IPC)."""
        pg, t = self.policy.worker_group, self.timeout_s
        layout = self._shared_ring_layout()
        if layout is not None:
            if self.transport == "cuda_ipc":
                raise ValueError(
                    "refit transport 'cuda_ipc': the policy packs for 'shm' (its device); "
                    "use 'ipc' to take whichever fits"
                )
            path = self.sender.reserve_shared_buffer(layout.total_bytes)
            live = self.sender.shared_buffers
            written = pg.call("write_weights_to_shm", path, live).wait(timeout=t)[0]
            return self.sender.send_prepared("shm", written, {"path": path})
        handles = pg.call("pack_weights_for_ipc").wait(timeout=t)[0]
        (handle,) = handles.values()  # one device id: the policy's node or GPU
        kind = handle["kind"]
        if self.transport != "ipc" and kind != self.transport:
            raise ValueError(
                f"refit transport {self.transport!r}: the policy packs for {kind!r} "
                "(its device); use 'ipc' to take whichever fits"
            )
        payload = {"path": handle["name"]} if kind == "shm" else handle
        return self.sender.send_prepared(kind, handle["layout"], payload)

    def _restore(self, ranks: list[int]) -> None:
        """Refit restarted generation ranks after a collective refit (run by the fault
        layer before they are called): copy the weights from a healthy peer."""
        gen, t = self.generation, self.timeout_s
        if self.refits == 0:
            return  # they loaded the same from_pretrained weights the policy started from
        self._info = None  # the broadcast group lost a member: rebuilt at the next refit
        peers = [r for r in gen.healthy_worker_ids() if r not in ranks]
        if not peers:
            raise RuntimeError(
                f"refit restore of generation ranks {ranks}: no healthy generation worker "
                "holds the current weights to copy from (collective transport)"
            )
        state = gen.execute_on(peers[0]).get_state_dict().wait(timeout=t)[0]
        gen.execute_on(*ranks).update_weights(state).wait(timeout=t)


def _join_refit_group(
    worker: Any, ip: str, port: int, world: int, rank: int, timeout_s: float
) -> bool:
    """Join the refit group as a weights receiver (NCCL when the worker's model is on CUDA)."""
    device = getattr(worker, "device", None)
    backend = "nccl" if getattr(device, "type", "cpu") == "cuda" else "gloo"
    return _recv.collective_join_op(worker, _KEY, ip, port, world, rank, backend, timeout_s)


def _bound_refit_group(worker: Any, timeout_s: float) -> None:
    """Make every later operation of the worker's refit group time out after ``timeout_s``."""
    worker.model_update_group.set_timeout(datetime.timedelta(seconds=timeout_s))
