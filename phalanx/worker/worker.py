"""The Worker base class: what a user subclasses to run code in a group.

Before a subclass's ``__init__`` runs, the process already has RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT and NODE_RANK in its environment (so
``torch.distributed.init_process_group("gloo")`` works from the environment), and the
instance has ``rank``, ``world_size``, ``worker_info`` and ``worker_address`` (also under
RLinf's spellings ``_rank``, ``_world_size``, ``_group_name``, ``_worker_address``,
``_cluster_node_rank``, ``_local_accelerator_rank``, ``_node_local_rank``).

``Worker.create_group`` builds a group through a factory that the group layer registers
when it is imported (``register_group_factory``, kept in ``group_factory``): the worker
layer never imports the group layer, which sits above it.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from phalanx._base.address import WorkerAddress
from phalanx._base.timing import timer
from phalanx.comm.mixin import CommMixin
from phalanx.worker.builder import RayWorkerBuilder
from phalanx.worker.context import RANK_ENV_KEYS, ContextBound, WorkerContext
from phalanx.worker.group_factory import register_group_factory, registered_group_factory
from phalanx.worker.weights_state import WeightsReceiverMixin

__all__ = [
    "BASE_ATTRIBUTES",
    "RANK_ENV_KEYS",
    "Worker",
    "WorkerContext",
    "WorkerInfo",
    "register_group_factory",
]


@dataclass
class WorkerInfo:
    """Runtime facts about one worker (RLinf's ``WorkerInfo``).

    Attributes:
        address: its ``WorkerAddress``.
        rank: its rank.
        node_id: its node's rank.
        gpu_id: its first GPU, or None.
        node_ip: its node's IP address.
        available_gpus: the GPUs it sees.
        local_rank: its rank on its node.
        world_size: its group's size.
        ray_node_id: its Ray node id.
    """

    address: WorkerAddress
    rank: int
    node_id: int
    gpu_id: int | None
    node_ip: str
    available_gpus: list[int] = field(default_factory=list)
    local_rank: int = 0
    world_size: int = 1
    ray_node_id: str = ""


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


class _TorchDeviceType(_TorchPlatform):
    """RLinf's ``Worker.torch_device_type``: ``"cuda"`` where ``torch_platform`` is
    ``torch.cuda`` (an NVIDIA GPU), else ``None``."""

    def __get__(self, obj: Any, owner: type) -> str | None:
        return None if super().__get__(obj, owner) is None else "cuda"


class Worker(CommMixin, WeightsReceiverMixin, ContextBound):
    """Base class of phalanx workers.

    Subclass it, then ``MyWorker.create_group(*init_args).launch(cluster, placement, name)``.
    Constructed outside a group (e.g. in a unit test), it behaves as rank 0 of 1.

    Args:
        *args, **kwargs: a subclass's own arguments.

    Example:
        >>> import phalanx as px
        >>> worker = px.Worker()
        >>> (worker.rank, worker.world_size, worker.get_name())
        (0, 1, 'local_Worker:0')
    """

    timer = staticmethod(timer)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if self._px_ctx is None:
            self._px_bind(
                WorkerContext(group_name=f"local_{type(self).__name__}", rank=0, world_size=1)
            )

    # -- identity ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's rank in its group."""
        return self._px_ctx.rank

    @property
    def world_size(self) -> int:
        """The number of workers in this worker's group."""
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
        """The name of this worker's group."""
        return self._px_ctx.group_name

    @property
    def worker_address(self) -> WorkerAddress:
        """This worker's ``WorkerAddress``."""
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
    torch_device_type = _TorchDeviceType()

    @property
    def worker_info(self) -> WorkerInfo:
        """This worker's ``WorkerInfo``: address, rank, node, GPUs and node IP."""
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
        """This worker's name, ``"group:rank"``.

        Returns:
            The name.
        """
        return self.worker_address.get_name()

    def get_parent_rank(self) -> int:
        """The rank of this worker's parent address.

        Returns:
            The rank.
        """
        return self.worker_address.get_parent_rank()

    # -- timers -----------------------------------------------------------------------
    def worker_timer(self, tag: str) -> AbstractContextManager[None]:
        """``with self.worker_timer("step"): ...`` adds the block's duration to ``step``.

        Args:
            tag: the timer's name.

        Returns:
            A context manager that times its block.
        """
        return self._px_timers.span(tag)

    # -- groups -----------------------------------------------------------------------
    @classmethod
    def create_group(cls, *args: Any, **kwargs: Any) -> Any:
        """An unlaunched group of this class; ``*args, **kwargs`` go to every worker's ``__init__``.

        Returns a ``phalanx.WorkerGroup`` (built by the factory ``phalanx.group`` registers).

        Args:
            *args, **kwargs: what every worker's ``__init__`` gets.

        Returns:
            An unlaunched ``WorkerGroup``; call ``launch()`` on it.

        Raises:
            RuntimeError: no group factory is registered (``phalanx`` was not imported).
        """
        factory = registered_group_factory()
        if factory is None:
            raise RuntimeError(
                f"{cls.__name__}.create_group: no group factory is registered; import "
                "phalanx (or phalanx.group) before creating groups"
            )
        return factory(remote_worker_builder=RayWorkerBuilder(cls, *args, **kwargs))


# Names of the base class that are not worker methods exposed on a group.
BASE_ATTRIBUTES = frozenset(n for n in dir(Worker) if not n.startswith("__"))
Worker.px_base_attributes = BASE_ATTRIBUTES
