"""What the host of a worker knows about it: its rank's context and environment, and the
base every phalanx ``Worker`` shares so the host can bind that context before the worker's
``__init__`` runs. The builder and the host depend on this module, never on ``worker.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from phalanx._base.timing import TimerRecorder

if TYPE_CHECKING:  # a worker process need not import the placement layer
    from phalanx.resources.placement import WorkerSlot


@dataclass
class WorkerContext:
    """What a group tells each of its workers at creation.

    ``isolate_accelerator`` is set only for RLinf placement strategies; it switches
    LOCAL_RANK / LOCAL_WORLD_SIZE / NODE_RANK to RLinf's meaning (see ``rank_env``).
    """

    group_name: str
    rank: int
    world_size: int
    local_rank: int = 0
    node_rank: int = 0
    node_ip: str = "127.0.0.1"
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    gpu_ids: list[int] = field(default_factory=list)
    isolate_gpu: bool = False
    bundle_indices: tuple[int, list[int]] | None = None
    env: dict[str, str] = field(default_factory=dict)
    local_world_size: int | None = None
    placement_node_rank: int | None = None
    isolate_accelerator: bool | None = None
    accelerator_type: str | None = None

    @classmethod
    def from_slot(
        cls,
        slot: WorkerSlot,
        group_name: str,
        world_size: int,
        master_addr: str,
        master_port: int,
    ) -> WorkerContext:
        """The context of the rank a placement slot describes."""
        return cls(
            group_name=group_name,
            rank=slot.rank,
            world_size=world_size,
            local_rank=slot.local_rank,
            node_rank=slot.node_rank,
            node_ip=slot.node_ip,
            master_addr=master_addr,
            master_port=master_port,
            gpu_ids=list(slot.gpu_ids),
            isolate_gpu=slot.isolate_gpu,
            local_world_size=slot.local_world_size,
            placement_node_rank=slot.placement_node_rank,
            isolate_accelerator=slot.isolate_accelerator,
            accelerator_type=slot.accelerator_type,
        )

    @property
    def local_accelerator_rank(self) -> int:
        """First accelerator this rank sees on its node (-1 without one), as RLinf counts."""
        return self.gpu_ids[0] if self.gpu_ids else -1

    @property
    def resolved_accelerator_type(self) -> str:
        """``NV_GPU`` when the rank's node has GPUs, else ``NO_ACCEL`` (RLinf's names)."""
        if self.accelerator_type is not None:
            return self.accelerator_type
        return "NV_GPU" if self.gpu_ids else "NO_ACCEL"

    def rank_env(self) -> dict[str, str]:
        """The distributed environment variables of this rank (they always win).

        phalanx placements: LOCAL_RANK is the rank's index among the group's ranks on its
        node and NODE_RANK the cluster node rank. RLinf placement strategies set
        ``isolate_accelerator`` and get RLinf's values: LOCAL_RANK 0 and LOCAL_WORLD_SIZE 1
        when isolated (the rank sees only its own devices), else the local accelerator rank
        and the node's worker count; NODE_RANK is the node's index within the placement.
        """
        env = {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "NODE_RANK": str(self.node_rank),
            "PHALANX_GROUP": self.group_name,
            "GROUP_NAME": self.group_name,
            "WORKER_NAME": f"{self.group_name}:{self.rank}",
            "CLUSTER_NODE_RANK": str(self.node_rank),
            "NODE_LOCAL_RANK": str(self.local_rank),
            "LOCAL_ACCELERATOR_RANK": str(self.local_accelerator_rank),
            "ACCELERATOR_TYPE": self.resolved_accelerator_type,
        }
        if self.local_world_size is not None:
            env["NODE_LOCAL_WORLD_SIZE"] = str(self.local_world_size)
            env["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        if self.isolate_accelerator is not None:
            isolated = self.isolate_accelerator
            env["ISOLATE_ACCELERATOR"] = "1" if isolated else "0"
            env["LOCAL_RANK"] = "0" if isolated else str(self.local_accelerator_rank)
            if isolated or self.local_world_size is not None:
                env["LOCAL_WORLD_SIZE"] = "1" if isolated else str(self.local_world_size)
            if self.placement_node_rank is not None:
                env["NODE_RANK"] = str(self.placement_node_rank)
            env["VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpu_ids)
        if self.isolate_gpu and self.gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpu_ids)
        return env


# Every variable phalanx may set per rank: configuration layers may not set these.
RANK_ENV_KEYS = frozenset(
    WorkerContext(
        group_name="g", rank=0, world_size=1, local_world_size=1, isolate_accelerator=True
    ).rank_env()
)


class ContextBound:
    """Base of objects a ``WorkerHost`` binds to their rank's context before ``__init__``.

    ``px_base_attributes`` names what the phalanx base class defines: those are never
    worker methods of a group (``Worker`` fills it in).
    """

    px_base_attributes: ClassVar[frozenset[str]] = frozenset()
    _px_ctx: WorkerContext | None = None
    _px_timers: TimerRecorder | None = None

    def _px_bind(self, ctx: WorkerContext, timers: TimerRecorder | None = None) -> None:
        self._px_ctx = ctx
        self._px_timers = timers if timers is not None else TimerRecorder()
