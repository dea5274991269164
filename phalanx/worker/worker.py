"""The Worker base class: what a user subclasses to run code in a group.

Before a subclass's ``__init__`` runs, the process already has RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT and NODE_RANK in its environment (so
``torch.distributed.init_process_group("gloo")`` works from the environment), and the
instance has ``rank``, ``world_size``, ``worker_info`` and ``worker_address`` (also under
RLinf's spellings ``_rank``, ``_world_size``, ``_group_name``, ``_worker_address``,
``_cluster_node_rank``, ``_local_accelerator_rank``, ``_node_local_rank``).

``Worker.create_group`` builds a group through a factory that the group layer registers
when it is imported (``register_group_factory``): the worker layer never imports the
group layer, which sits above it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from phalanx._base.address import WorkerAddress
from phalanx._base.timing import TimerRecorder, timer
from phalanx.comm.mixin import CommMixin
from phalanx.worker.weights_state import WeightsReceiverMixin

if TYPE_CHECKING:  # a worker process need not import the placement layer
    from phalanx.resources.placement import WorkerSlot


@dataclass
class WorkerInfo:
    """Runtime facts about one worker (RLinf's ``WorkerInfo``)."""

    address: WorkerAddress
    rank: int
    node_id: int
    gpu_id: int | None
    node_ip: str
    available_gpus: list[int] = field(default_factory=list)
    local_rank: int = 0
    world_size: int = 1
    ray_node_id: str = ""


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


class _TorchPlatform:
    """RLinf's ``Worker.torch_platform``: ``torch.cuda`` on a GPU node, else ``None``.

    Works on an instance (from its context) and on the class, as RLinf code calls
    ``Worker.torch_platform``: in a worker process from its ACCELERATOR_TYPE, elsewhere
    (the driver) from whether torch sees a CUDA device.
    """

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is not None and obj._px_ctx is not None:
            kind = obj._px_ctx.resolved_accelerator_type
        else:
            kind = os.environ.get("ACCELERATOR_TYPE")
        if kind is not None and kind != "NV_GPU":
            return None
        import torch

        if kind is None and not torch.cuda.is_available():
            return None
        return torch.cuda


_group_factory: Callable[..., Any] | None = None


def register_group_factory(factory: Callable[..., Any]) -> None:
    """Set how ``Worker.create_group`` builds a group: ``factory(remote_worker_builder=...)``.

    The group layer calls this when it is imported, so the worker layer need not import it.
    """
    global _group_factory
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    _group_factory = factory


class Worker(CommMixin, WeightsReceiverMixin):
    """Base class of phalanx workers.

    Subclass it, then ``MyWorker.create_group(*init_args).launch(cluster, placement, name)``.
    Constructed outside a group (e.g. in a unit test), it behaves as rank 0 of 1.
    """

    _px_ctx: WorkerContext | None = None
    _px_timers: TimerRecorder | None = None
    timer = staticmethod(timer)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if self._px_ctx is None:
            self._px_bind(
                WorkerContext(group_name=f"local_{type(self).__name__}", rank=0, world_size=1)
            )

    def _px_bind(self, ctx: WorkerContext, timers: TimerRecorder | None = None) -> None:
        self._px_ctx = ctx
        self._px_timers = timers if timers is not None else TimerRecorder()

    # -- identity ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._px_ctx.rank

    @property
    def world_size(self) -> int:
        return self._px_ctx.world_size

    # RLinf spells these with a leading underscore in its examples.
    @property
    def _rank(self) -> int:
        return self._px_ctx.rank

    @property
    def _world_size(self) -> int:
        return self._px_ctx.world_size

    @property
    def group_name(self) -> str:
        return self._px_ctx.group_name

    @property
    def worker_address(self) -> WorkerAddress:
        return WorkerAddress(self._px_ctx.group_name, self._px_ctx.rank)

    # RLinf's private spellings of the same facts (its code and tests read them).
    @property
    def _group_name(self) -> str:
        return self._px_ctx.group_name

    @property
    def _worker_address(self) -> WorkerAddress:
        return self.worker_address

    @property
    def _cluster_node_rank(self) -> int:
        """Rank of this worker's node in the cluster (``Cluster.nodes`` order)."""
        return self._px_ctx.node_rank

    @property
    def _node_local_rank(self) -> int:
        """Index of this worker among its group's workers on the same node."""
        return self._px_ctx.local_rank

    @property
    def _node_local_world_size(self) -> int:
        """Number of this group's workers on this worker's node (-1 if not known)."""
        n = self._px_ctx.local_world_size
        return -1 if n is None else n

    @property
    def _local_rank(self) -> int:
        """This worker's LOCAL_RANK (RLinf: 0 when isolated to its own devices)."""
        return int(self._px_ctx.rank_env()["LOCAL_RANK"])

    @property
    def _local_world_size(self) -> int:
        """This worker's LOCAL_WORLD_SIZE (-1 if the placement does not say)."""
        return int(self._px_ctx.rank_env().get("LOCAL_WORLD_SIZE", -1))

    @property
    def _local_accelerator_rank(self) -> int:
        """First device this worker sees, as a node-local index (-1 without one)."""
        return self._px_ctx.local_accelerator_rank

    torch_platform = _TorchPlatform()

    @property
    def worker_info(self) -> WorkerInfo:
        ctx = self._px_ctx
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        available = [int(x) for x in visible.split(",") if x.strip().isdigit()]
        if not available:
            available = list(ctx.gpu_ids)
        ray_node_id = ""
        try:
            import ray

            if ray.is_initialized():
                ray_node_id = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - outside Ray
            pass
        return WorkerInfo(
            address=self.worker_address,
            rank=ctx.rank,
            node_id=ctx.node_rank,
            gpu_id=available[0] if available else None,
            node_ip=ctx.node_ip,
            available_gpus=available,
            local_rank=ctx.local_rank,
            world_size=ctx.world_size,
            ray_node_id=ray_node_id,
        )

    def get_name(self) -> str:
        return self.worker_address.get_name()

    def get_parent_rank(self) -> int:
        return self.worker_address.get_parent_rank()

    # -- timers -----------------------------------------------------------------------
    def worker_timer(self, tag: str) -> AbstractContextManager[None]:
        """``with self.worker_timer("step"): ...`` adds the block's duration to ``step``."""
        return self._px_timers.span(tag)

    # -- groups -----------------------------------------------------------------------
    @classmethod
    def create_group(cls, *args: Any, **kwargs: Any) -> Any:
        """An unlaunched group of this class; ``*args, **kwargs`` go to every worker's ``__init__``.

        Returns a ``phalanx.WorkerGroup`` (built by the factory ``phalanx.group`` registers).
        """
        if _group_factory is None:
            raise RuntimeError(
                f"{cls.__name__}.create_group: no group factory is registered; import "
                "phalanx (or phalanx.group) before creating groups"
            )
        from phalanx.worker.builder import RayWorkerBuilder

        return _group_factory(remote_worker_builder=RayWorkerBuilder(cls, *args, **kwargs))


# Names of the base class that are not worker methods exposed on a group.
BASE_ATTRIBUTES = frozenset(n for n in dir(Worker) if not n.startswith("__"))
