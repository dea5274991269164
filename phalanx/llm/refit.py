"""Refit: move the policy's current weights into the generation workers.

Four transports, all on the weight-sync layer (``phalanx.weights``):

- ``"ipc"``: on CPU every policy rank copies its own rows of the weights into one
  same-node shared-memory segment (``DTensorPolicyWorker.pack_weights_for_ipc``); on GPU
  rank 0 packs the gathered weights into a CUDA buffer. The generation workers map the
  handle and copy in. Same node only. The generators' call takes the policy's result
  as a Ray argument, so the driver waits once.
- ``"collective"``: policy rank 0 and the generation workers form one process group
  (gloo on CPU, NCCL on GPU); rank 0 broadcasts the weights in buckets. Every operation
  of that group times out after ``peer_timeout_s`` (30 s; the group is made with 300 s,
  then ``set_timeout`` on every member), so a peer that died or does not take part frees
  the others within that bound (a dead peer's closed connection usually does it at once).
  A gloo operation that timed out cannot be retried, so the refit fails instead. A broadcast
  that fails is reported naming the workers that died (pinged as the weight-sync layer
  does, ``phalanx.weights.sender.ping``), and the group is rebuilt at the next refit;
  it is also rebuilt when a member was restarted since it was made.
- ``"object_store"`` / ``"shm"``: the gathered state dict goes through a
  ``WeightSender`` on the generation group.

A generation worker that dies is restarted by its group's fault-tolerance policy
(``launch(..., restart_policy=px.RestartPolicy())``), which refits it before any call
reaches it (the group's weights-restore hook): ``"ipc"`` re-sends the last handle (the
policy keeps the segment until the next refit), ``"collective"`` copies the weights from
a healthy peer generation worker and rebuilds the broadcast group at the next refit,
and the ``WeightSender`` of the other two re-sends its last version. The policy is not
called, so a restart never interleaves with the policy's own collectives.
"""

from __future__ import annotations

import datetime
from typing import Any

from phalanx.group.group import WorkerGroup
from phalanx.llm.policy import Policy
from phalanx.resources.cluster import find_free_port
from phalanx.weights.sender import ping

TRANSPORTS = ("ipc", "collective", "object_store", "shm")


class Refitter:
    """Refits ``generation`` from ``policy`` through one transport; ``refit()`` per step.

    ``timeout_s`` bounds each driver-side wait; ``peer_timeout_s`` bounds each operation of
    the collective refit group, i.e. how long its members wait for a peer that is gone.
    """

    def __init__(
        self,
        policy: Policy,
        generation: WorkerGroup,
        transport: str = "ipc",
        timeout_s: float = 300.0,
        peer_timeout_s: float = 30.0,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if not isinstance(peer_timeout_s, (int, float)) or peer_timeout_s <= 0:
            raise ValueError(f"peer_timeout_s must be a positive number, got {peer_timeout_s!r}")
        if not isinstance(generation, WorkerGroup):
            raise TypeError(f"generation must be a WorkerGroup, got {type(generation).__name__}")
        self.policy, self.generation, self.transport = policy, generation, transport
        self.timeout_s, self.peer_timeout_s = timeout_s, float(peer_timeout_s)
        self._info: dict[str, Any] | None = None
        self._members: dict[tuple[str, int], Any] = {}  # (group, rank) -> actor, collective
        self._sender: Any = None
        self._handles: dict[str, Any] | None = None
        self.refits = 0
        if transport in ("ipc", "collective"):  # the WeightSender registers its own
            generation.add_restart_hook(self._restore)

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
        b = gen.call("init_collective", ip, port, world, 1)
        a.wait(timeout=t)
        b.wait(timeout=t)
        bound = [(r, (self.peer_timeout_s,), {}) for r in range(gen.world_size)]
        gen.apply(_bound_refit_group, bound, label="bound_refit_group").wait(timeout=t)
        pg.apply(_bound_refit_group, bound[:1], label="bound_refit_group").wait(timeout=t)
        self._info = pg.call("prepare_info_for_collective").wait(timeout=t)[0]
        self._members = members

    def _refit_collective(self) -> None:
        pg, gen, t = self.policy.worker_group, self.generation, self.timeout_s
        self._setup_collective()
        try:
            a = pg.call("broadcast_weights_for_collective")
            b = gen.call("update_weights_from_collective", self._info)
            a.wait(timeout=t)
            b.wait(timeout=t)
        except Exception as e:
            self._info = None  # rebuilt at the next refit
            raise self._broadcast_error(e) from e

    def _broadcast_error(self, cause: Exception) -> RuntimeError:
        """The error of a failed collective refit, naming the members that died."""
        members = list(self._members.items())
        _, dead = ping({i: actor for i, (_, actor) in enumerate(members)})
        who = "; ".join(
            f"{members[i][0][0]}[rank {members[i][0][1]}]: {why}" for i, why in dead.items()
        )
        return RuntimeError(
            f"collective refit failed: {who or 'no member died'}; the refit group is rebuilt at the next refit "
            f"(cause: {type(cause).__name__}: {str(cause)[:300]})"
        )

    def refit(self) -> None:
        """Copy the policy's current weights into every generation worker."""
        pg, gen, t = self.policy.worker_group, self.generation, self.timeout_s
        if self.transport == "ipc":
            packed = pg.call("pack_weights_for_ipc")
            # Rank 0's result goes straight to the generators as a Ray argument: they start
            # copying when it is ready, without a round trip through the driver.
            applied = gen.call("update_weights_from_ipc_handles", packed.refs[0])
            self._handles = packed.wait(timeout=t)[0]
            applied.wait(timeout=t)
        elif self.transport == "collective":
            self._refit_collective()
        else:
            from phalanx.weights import WeightSender

            if self._sender is None:
                self._sender = WeightSender(gen, transport=self.transport, timeout_s=t)
            result = self._sender.send(self.policy.state_dict())
            if not result.ok:
                raise RuntimeError(f"refit through {self.transport} failed: {result}")
        self.refits += 1

    def _restore(self, ranks: list[int]) -> None:
        """Refit restarted generation ranks (run by the fault layer before they are called)."""
        gen, t = self.generation, self.timeout_s
        if self.refits == 0:
            return  # they loaded the same from_pretrained weights the policy started from
        if self.transport == "ipc":
            gen.execute_on(*ranks).update_weights_from_ipc_handles(self._handles).wait(timeout=t)
            return
        self._info = None  # the broadcast group lost a member: rebuilt at the next refit
        peers = [r for r in gen.healthy_worker_ids() if r not in ranks]
        if not peers:
            raise RuntimeError(
                f"refit restore of generation ranks {ranks}: no healthy generation worker "
                "holds the current weights to copy from (collective transport)"
            )
        state = gen.execute_on(peers[0]).get_state_dict().wait(timeout=t)[0]
        gen.execute_on(*ranks).update_weights(state).wait(timeout=t)


def _bound_refit_group(worker: Any, timeout_s: float) -> None:
    """Make every later operation of the worker's refit group time out after ``timeout_s``."""
    worker.model_update_group.set_timeout(datetime.timedelta(seconds=timeout_s))
