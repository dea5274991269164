"""Placement strategies: turn "how many workers, on which devices" into worker slots.

This file holds phalanx's own strategies and the ``WorkerSlot`` every strategy produces;
RLinf's strategies (``PackedPlacementStrategy`` ...) live in ``strategies.py``.

A slot says where one rank runs: its node, its local rank on that node, the GPUs it sees
and the CPU/GPU resources it reserves. Rank order is deterministic:

* ``PackedPlacement`` walks a global device range. Global device ``g`` lives on node
  ``g // gpus_per_node`` as local device ``g % gpus_per_node`` (node ranks as in
  ``Cluster.nodes``). Ranks follow the device order.
* ``FlexiblePlacement`` takes an explicit global device list per rank, in rank order.
* ``NodePlacement`` places CPU-only workers node by node: ranks ``0..k-1`` on the first
  listed node, the next ranks on the next node, spreading ``num_workers`` as evenly as
  possible (earlier nodes take the remainder).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phalanx._base.checks import check_int, check_number
from phalanx.resources.cluster import Cluster


@dataclass
class WorkerSlot:
    """Where one rank of a group runs and what it reserves.

    Attributes:
        rank: the rank.
        node_rank: its node's rank.
        local_rank: its rank on its node.
        node_id: its node's Ray id.
        node_ip: its node's IP address.
        gpu_ids: the GPUs it sees.
        num_cpus: CPUs it reserves.
        num_gpus: GPUs it reserves in Ray.
        scheduling_strategy: a Ray scheduling strategy (derived from the node if None).
        placement_group: the Ray placement group it runs in.
        bundle_index: its bundle in that group.
        bundle_indices: ``(node, bundles)`` of a worker over several bundles.
        isolate_gpu: it sees only its own GPUs.
        local_world_size: the ranks on its node.
        placement_node_rank: its node's rank among the placement's nodes.
        isolate_accelerator: RLinf's name of ``isolate_gpu``.
        accelerator_type: the accelerator's type.
        port_range: the ports it may hand out.
    """

    rank: int
    node_rank: int
    local_rank: int
    node_id: str = ""
    node_ip: str = ""
    gpu_ids: list[int] = field(default_factory=list)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # Ray scheduling details, filled by whoever turns slots into actors.
    scheduling_strategy: Any = None
    placement_group: Any = None
    bundle_index: int | None = None
    bundle_indices: tuple[int, list[int]] | None = None
    isolate_gpu: bool = True
    # Filled by the strategies: this group's ranks on the slot's node, and the node's
    # index among the nodes the placement uses (None: not known, not exported).
    local_world_size: int | None = None
    placement_node_rank: int | None = None
    # RLinf strategies only: RLinf's isolate_accelerator flag (see WorkerContext.rank_env).
    isolate_accelerator: bool | None = None
    accelerator_type: str | None = None
    # Ports the group may pick on the slot's node, [low, high) (None: any free port).
    port_range: tuple[int, int] | None = None


class Placement:
    """Base class: ``slots(cluster)`` returns one ``WorkerSlot`` per rank."""

    def slots(self, cluster: Cluster) -> list[WorkerSlot]:
        """One ``WorkerSlot`` per rank on ``cluster``.

        Args:
            cluster: the cluster to place on.

        Returns:
            The slots, in rank order.

        Raises:
            ValueError: the cluster cannot hold the placement.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement slots(cluster)")


def _finish(cluster: Cluster, slots: list[WorkerSlot]) -> list[WorkerSlot]:
    """Fill node ids/ips, local ranks (index of the rank among this group's ranks on its
    node), each node's rank count and the node's index among the placement's nodes."""
    per_node: dict[int, int] = {}
    for s in slots:
        node = cluster.node(s.node_rank)
        s.node_id, s.node_ip = node.node_id, node.ip
        s.accelerator_type = node.accelerator_type
        s.local_rank = per_node.get(s.node_rank, 0)
        per_node[s.node_rank] = s.local_rank + 1
    order = {n: i for i, n in enumerate(sorted(per_node))}
    for s in slots:
        s.local_world_size = per_node[s.node_rank]
        s.placement_node_rank = order[s.node_rank]
    return slots


def _device_slots(
    cluster: Cluster,
    devices_per_rank: list[list[int]],
    num_cpus: float,
    isolate_gpu: bool,
    arg: str,
) -> list[WorkerSlot]:
    per_node = cluster.num_gpus_per_node
    if per_node == 0:
        raise ValueError(
            f"{arg}: the cluster has no GPUs; use NodePlacement for CPU-only workers "
            "(or declare GPUs to Ray with Cluster(num_gpus=...))"
        )
    total = per_node * cluster.num_nodes
    slots = []
    for rank, devices in enumerate(devices_per_rank):
        if not devices:
            raise ValueError(f"{arg}: rank {rank} has an empty device list")
        bad = [d for d in devices if not 0 <= d < total]
        if bad:
            raise ValueError(f"{arg}: devices {bad} of rank {rank} are outside 0..{total - 1}")
        nodes = {d // per_node for d in devices}
        if len(nodes) != 1:
            raise ValueError(f"{arg}: rank {rank} spans several nodes with devices {devices}")
        node_rank = nodes.pop()
        local = [d % per_node for d in devices]
        if max(local) >= cluster.node(node_rank).num_gpus:
            raise ValueError(
                f"{arg}: node {node_rank} has {cluster.node(node_rank).num_gpus} GPU(s), rank {rank} asks for local devices {local}"
            )
        slots.append(
            WorkerSlot(
                rank=rank,
                node_rank=node_rank,
                local_rank=0,
                gpu_ids=local,
                num_cpus=num_cpus,
                num_gpus=float(len(local)),
                isolate_gpu=isolate_gpu,
            )
        )
    return _finish(cluster, slots)


class PackedPlacement(Placement):
    """Ranks packed over global devices ``start..end`` (inclusive).

    Each rank gets ``num_devices_per_process`` devices. With ``stride`` s, devices are taken
    in blocks of ``num_devices_per_process * s``; inside a block the j-th rank gets devices
    ``block + j, block + j + s, ...`` (s=1: contiguous devices).

    Args:
        start_device: the first global device.
        end_device: the last global device (inclusive).
        num_devices_per_process: devices per rank.
        stride: the stride, as above.
        num_cpus: CPUs each rank reserves.
        isolate_gpu: each rank sees only its own GPUs.

    Raises:
        ValueError: the range is empty or not a multiple of
            ``num_devices_per_process * stride``.
    """

    def __init__(
        self,
        start_device: int,
        end_device: int,
        num_devices_per_process: int = 1,
        stride: int = 1,
        num_cpus: float = 1.0,
        isolate_gpu: bool = True,
    ):
        check_int(start_device, "start_device", minimum=0)
        check_int(end_device, "end_device", minimum=0)
        check_int(num_devices_per_process, "num_devices_per_process", minimum=1)
        check_int(stride, "stride", minimum=1)
        check_number(num_cpus, "num_cpus", minimum=0)
        if end_device < start_device:
            raise ValueError(f"start_device/end_device: invalid range {start_device}..{end_device}")
        count = end_device - start_device + 1
        block = num_devices_per_process * stride
        if count % block:
            raise ValueError(
                f"end_device: the range {start_device}..{end_device} ({count} devices) is not a "
                f"multiple of num_devices_per_process*stride = {block}"
            )
        self.start_device, self.end_device = start_device, end_device
        self.num_devices_per_process, self.stride = num_devices_per_process, stride
        self.num_cpus, self.isolate_gpu = num_cpus, isolate_gpu

    def devices_per_rank(self) -> list[list[int]]:
        """The global devices of each rank, in rank order.

        Returns:
            A list of device lists.
        """
        out = []
        block = self.num_devices_per_process * self.stride
        for base in range(self.start_device, self.end_device + 1, block):
            for j in range(self.stride):
                out.append(
                    [base + j + k * self.stride for k in range(self.num_devices_per_process)]
                )
        return out

    def slots(self, cluster: Cluster) -> list[WorkerSlot]:
        """One slot per rank of ``devices_per_rank``.

        Args:
            cluster: as for ``Placement.slots``.

        Returns:
            The slots, in rank order.

        Raises:
            ValueError: a device is not on the cluster.
        """
        return _device_slots(
            cluster, self.devices_per_rank(), self.num_cpus, self.isolate_gpu, "PackedPlacement"
        )

    def __repr__(self) -> str:
        return (
            f"PackedPlacement({self.start_device}..{self.end_device}, "
            f"per_process={self.num_devices_per_process}, stride={self.stride})"
        )


class FlexiblePlacement(Placement):
    """An explicit list of global device ids per rank, in rank order.

    Args:
        devices_per_process: the global device ids of each rank.
        num_cpus: CPUs each rank reserves.
        isolate_gpu: each rank sees only its own GPUs.
    """

    def __init__(
        self, devices_per_process: list[list[int]], num_cpus: float = 1.0, isolate_gpu: bool = True
    ):
        if not devices_per_process or not all(
            isinstance(d, (list, tuple)) for d in devices_per_process
        ):
            raise ValueError("devices_per_process must be a non-empty list of device lists")
        flat = [d for ds in devices_per_process for d in ds]
        if isolate_gpu and len(flat) != len(set(flat)):
            raise ValueError(
                f"devices_per_process: a device appears twice in {devices_per_process}"
            )
        self.devices_per_process = [list(ds) for ds in devices_per_process]
        self.num_cpus, self.isolate_gpu = num_cpus, isolate_gpu

    def slots(self, cluster: Cluster) -> list[WorkerSlot]:
        """One slot per entry of ``devices_per_process``.

        Args:
            cluster: as for ``Placement.slots``.

        Returns:
            The slots, in rank order.

        Raises:
            ValueError: a device is not on the cluster.
        """
        return _device_slots(
            cluster, self.devices_per_process, self.num_cpus, self.isolate_gpu, "FlexiblePlacement"
        )


class NodePlacement(Placement):
    """CPU-only workers spread node by node.

    Args:
        num_workers: total workers; default one per listed node.
        node_ranks: nodes to use (default: all nodes, in node-rank order).
        num_cpus: logical CPUs each worker reserves.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        node_ranks: list[int] | None = None,
        num_cpus: float = 1.0,
    ):
        if num_workers is not None:
            check_int(num_workers, "num_workers", minimum=1)
        check_number(num_cpus, "num_cpus", minimum=0)
        self.num_workers, self.node_ranks, self.num_cpus = num_workers, node_ranks, num_cpus

    def slots(self, cluster: Cluster) -> list[WorkerSlot]:
        """``num_workers`` CPU workers spread over ``node_ranks`` (every node if None).

        Args:
            cluster: as for ``Placement.slots``.

        Returns:
            The slots, in rank order.

        Raises:
            ValueError: ``node_ranks`` is empty or names a node the cluster lacks.
        """
        node_ranks = (
            list(range(cluster.num_nodes)) if self.node_ranks is None else list(self.node_ranks)
        )
        if not node_ranks:
            raise ValueError("node_ranks must not be empty")
        for r in node_ranks:
            cluster.node(r)  # raises naming the rank
        n = self.num_workers or len(node_ranks)
        base, extra = divmod(n, len(node_ranks))
        slots, rank = [], 0
        for i, node_rank in enumerate(node_ranks):
            for _ in range(base + (1 if i < extra else 0)):
                slots.append(
                    WorkerSlot(rank=rank, node_rank=node_rank, local_rank=0, num_cpus=self.num_cpus)
                )
                rank += 1
        return _finish(cluster, slots)

    def __repr__(self) -> str:
        return f"NodePlacement(num_workers={self.num_workers}, node_ranks={self.node_ranks})"
