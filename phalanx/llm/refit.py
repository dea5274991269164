"""Refit: move the policy's current weights into the generation workers.

Four transports, all on the weight-sync layer (``phalanx.weights``):

- ``"ipc"``: policy ranks gather the full weights; rank 0 packs them into a same-node
  shared-memory segment (CPU) or a CUDA buffer (GPU) and hands out its handle; the
  generation workers map it and copy in. Same node only.
- ``"collective"``: policy rank 0 and the generation workers form one process group
  (gloo on CPU, NCCL on GPU); rank 0 broadcasts the weights in buckets.
- ``"object_store"`` / ``"shm"``: the gathered state dict goes through a
  ``WeightSender`` on the generation group (which also re-sends it to a restarted
  generation worker, through the group's fault-tolerance policy).
"""

from __future__ import annotations

from typing import Any

from ..cluster import find_free_port
from ..group import WorkerGroup
from .policy import Policy

TRANSPORTS = ("ipc", "collective", "object_store", "shm")


class Refitter:
    """Refits ``generation`` from ``policy`` through one transport; ``refit()`` per step."""

    def __init__(
        self,
        policy: Policy,
        generation: WorkerGroup,
        transport: str = "ipc",
        timeout_s: float = 300.0,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if not isinstance(generation, WorkerGroup):
            raise TypeError(f"generation must be a WorkerGroup, got {type(generation).__name__}")
        self.policy, self.generation, self.transport = policy, generation, transport
        self.timeout_s = timeout_s
        self._info: dict[str, Any] | None = None
        self._sender: Any = None
        self.refits = 0

    def _setup_collective(self) -> None:
        pg, gen = self.policy.worker_group, self.generation
        meta = pg.worker_metadata[0]
        ip = meta["node_ip"]
        port = find_free_port(ip, meta["ray_node_id"])
        world = 1 + gen.world_size
        a = pg.call("init_collective", ip, port, world)
        b = gen.call("init_collective", ip, port, world, 1)
        a.wait(timeout=self.timeout_s)
        b.wait(timeout=self.timeout_s)
        self._info = pg.call("prepare_info_for_collective").wait(timeout=self.timeout_s)[0]

    def refit(self) -> None:
        """Copy the policy's current weights into every generation worker."""
        pg, gen, t = self.policy.worker_group, self.generation, self.timeout_s
        if self.transport == "ipc":
            infos = pg.call("prepare_weights_for_ipc").wait(timeout=t)
            keys = [name for name, _ in infos[0][0]]
            handles = pg.execute_on(0).get_weights_ipc_handles(keys).wait(timeout=t)[0]
            gen.call("update_weights_from_ipc_handles", handles).wait(timeout=t)
            pg.call("offload_after_refit").wait(timeout=t)
        elif self.transport == "collective":
            if self._info is None:
                self._setup_collective()
            a = pg.call("broadcast_weights_for_collective")
            b = gen.call("update_weights_from_collective", self._info)
            a.wait(timeout=t)
            b.wait(timeout=t)
        else:
            from ..weights import WeightSender

            if self._sender is None:
                self._sender = WeightSender(gen, transport=self.transport, timeout_s=t)
            result = self._sender.send(self.policy.state_dict())
            if not result.ok:
                raise RuntimeError(f"refit through {self.transport} failed: {result}")
        self.refits += 1
