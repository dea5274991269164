"""The Worker base class: what a user subclasses to run code in a group.

Before a subclass's ``__init__`` runs, the process already has RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT and NODE_RANK in its environment (so
``torch.distributed.init_process_group("gloo")`` works from the environment), and the
instance has ``rank``, ``world_size``, ``worker_info`` and ``worker_address``.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from phalanx._base.address import WorkerAddress
from phalanx._base.timing import TimerRecorder, timer
from phalanx.comm.mixin import CommMixin
from phalanx.weights.receiver import WeightsReceiverMixin

if TYPE_CHECKING:
    from phalanx.group.group import WorkerGroup


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
    """What a group tells each of its workers at creation."""

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

    def rank_env(self) -> dict[str, str]:
        """The distributed environment variables of this rank (they always win)."""
        env = {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "NODE_RANK": str(self.node_rank),
            "PHALANX_GROUP": self.group_name,
        }
        if self.isolate_gpu and self.gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpu_ids)
        return env


RANK_ENV_KEYS = frozenset(WorkerContext(group_name="g", rank=0, world_size=1).rank_env())


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
    def create_group(cls, *args: Any, **kwargs: Any) -> WorkerGroup:
        """An unlaunched group of this class; ``*args, **kwargs`` go to every worker's ``__init__``."""
        from phalanx.group.group import WorkerGroup
        from phalanx.worker.builder import RayWorkerBuilder

        return WorkerGroup(remote_worker_builder=RayWorkerBuilder(cls, *args, **kwargs))


# Names of the base class that are not worker methods exposed on a group.
BASE_ATTRIBUTES = frozenset(n for n in dir(Worker) if not n.startswith("__"))
