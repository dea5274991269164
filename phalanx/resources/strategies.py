"""RLinf's placement strategies under RLinf's names, parameters and results.

``get_placement(cluster, isolate_accelerator=True)`` returns one ``RankPlacement`` per rank
with RLinf's fields; ``slots(cluster)`` turns the same answer into the ``WorkerSlot`` list a
phalanx group launches from, so ``Cls.create_group().launch(cluster, strategy)`` works.

Hardware ranks are global accelerator (GPU) ranks: node after node in ``Cluster.nodes``
order, each node contributing as many ranks as it has GPUs. What RLinf does, and so do we:

* ``PackedPlacementStrategy(start, end, num_hardware_per_process=1, stride=1)`` walks the
  range; each process takes the first unused rank ``r`` and ``r, r+stride, ...``
  (``num_hardware_per_process`` ranks); a process may not span nodes.
* ``FlexiblePlacementStrategy(hardware_ranks_list)`` gives each process the listed ranks,
  sorted ascending within the process; processes are ordered by their first rank.
* ``NodePlacementStrategy(node_ranks)`` places one process per entry (entries sorted); it
  reserves no device and every process sees all GPUs of its node.

With ``isolate_accelerator=True`` a device strategy's process sees only its own devices;
with ``False`` it sees every GPU of its node and its ``local_accelerator_rank`` is 0.
Like RLinf, these strategies reserve no GPUs in Ray: two groups may share devices
(co-location), and each process's ``CUDA_VISIBLE_DEVICES`` is set from the placement.

RLinf raises ``AssertionError`` (``IndexError`` for an unknown node rank) on bad input;
phalanx raises ``PlacementError``, which is both a ``ValueError`` and an
``AssertionError`` (``PlacementIndexError`` is also an ``IndexError``), so code catching
either kind keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.resources.cluster import Cluster
from phalanx.resources.placement import Placement, WorkerSlot

__all__ = [
    "FlexiblePlacementStrategy",
    "NodePlacementStrategy",
    "PackedPlacementStrategy",
    "PlacementError",
    "PlacementIndexError",
    "PlacementStrategy",
    "RankPlacement",
]

# phalanx has no RLinf node groups; every placement is in this one.
DEFAULT_NODE_GROUP = "cluster"
# RLinf's reserved labels: "cluster" (every node) and "node" (every node, one process per
# node); both name all of phalanx's nodes.
RESERVED_NODE_GROUPS = ("cluster", "node")


class PlacementError(ValueError, AssertionError):
    """Bad placement input (RLinf raises AssertionError; phalanx code expects ValueError)."""


class PlacementIndexError(PlacementError, IndexError):
    """A node rank outside the cluster (RLinf raises IndexError)."""


@dataclass
class RankPlacement:
    """Where one rank goes: RLinf's ``Placement`` record (phalanx's ``Placement`` is the
    strategy base class, hence the different name).

    Attributes:
        rank: the process's rank.
        cluster_node_rank: its node's rank in the cluster.
        placement_node_rank: its node's rank among the nodes this placement uses.
        local_accelerator_rank: its first accelerator on its node (-1: none).
        accelerator_type: the accelerator's type.
        local_rank: its rank among the processes on its node.
        local_world_size: the processes on its node.
        visible_accelerators: the accelerators it sees.
        isolate_accelerator: whether it sees only its own accelerators.
        local_hardware_ranks: its accelerators on its node.
        node_group_label: RLinf's node group.
    """

    rank: int
    cluster_node_rank: int
    placement_node_rank: int
    local_accelerator_rank: int
    accelerator_type: str
    local_rank: int
    local_world_size: int
    visible_accelerators: list[str]
    isolate_accelerator: bool
    local_hardware_ranks: list[int] = field(default_factory=list)
    node_group_label: str = DEFAULT_NODE_GROUP


class PlacementStrategy(Placement):
    """Base of the RLinf-named strategies: subclasses implement ``get_placement``."""

    num_cpus: float = 1.0

    def get_placement(
        self, cluster: Cluster, isolate_accelerator: bool = True
    ) -> list[RankPlacement]:
        """Where each rank goes (RLinf's ``get_placement``).

        Args:
            cluster: the cluster to place on.
            isolate_accelerator: each rank sees only its own accelerators.

        Returns:
            One ``RankPlacement`` per rank.

        Raises:
            PlacementError: the cluster cannot hold the placement.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement get_placement")

    def slots(self, cluster: Cluster, isolate_accelerator: bool = True) -> list[WorkerSlot]:
        """The placements as phalanx worker slots (no GPU reserved in Ray, as in RLinf).

        Args:
            cluster: the cluster to place on.
            isolate_accelerator: each rank sees only its own accelerators.

        Returns:
            The slots, in rank order.

        Raises:
            PlacementError: the cluster cannot hold the placement.
        """
        out = []
        for p in self.get_placement(cluster, isolate_accelerator):
            node = cluster.node(p.cluster_node_rank)
            out.append(
                WorkerSlot(
                    rank=p.rank,
                    node_rank=p.cluster_node_rank,
                    local_rank=p.local_rank,
                    node_id=node.node_id,
                    node_ip=node.ip,
                    gpu_ids=[int(v) for v in p.visible_accelerators],
                    num_cpus=self.num_cpus,
                    num_gpus=0.0,
                    isolate_gpu=True,
                    local_world_size=p.local_world_size,
                    placement_node_rank=p.placement_node_rank,
                    isolate_accelerator=p.isolate_accelerator,
                    accelerator_type=p.accelerator_type,
                )
            )
        return out


def _no_node_groups(value: object, arg: str) -> None:
    if value is not None:
        raise PlacementError(
            f"{arg}={value!r}: phalanx has no RLinf node groups; hardware ranks are global "
            "GPU ranks over Cluster.nodes (NodePlacementStrategy also takes RLinf's reserved "
            "labels 'cluster' and 'node', both meaning all nodes)"
        )


def _hardware_map(cluster: Cluster, arg: str) -> list[tuple[int, int]]:
    """Global hardware rank -> (cluster node rank, local accelerator rank)."""
    table = [(n.node_rank, g) for n in cluster.nodes for g in range(n.num_gpus)]
    if not table:
        raise PlacementError(
            f"{arg}: the cluster has no accelerators; use NodePlacementStrategy for CPU "
            "workers (or declare GPUs to Ray with Cluster(num_gpus=...))"
        )
    return table


def _fill_node_ranks(placements: list[RankPlacement]) -> list[RankPlacement]:
    """Local rank, node worker count and placement node index, in placement order."""
    count: dict[int, int] = {}
    order: dict[int, int] = {}
    for p in placements:
        order.setdefault(p.cluster_node_rank, len(order))
        p.local_rank = count.get(p.cluster_node_rank, 0)
        count[p.cluster_node_rank] = p.local_rank + 1
    for p in placements:
        p.local_world_size = count[p.cluster_node_rank]
        p.placement_node_rank = order[p.cluster_node_rank]
    return placements


def _device_placement(
    cluster: Cluster,
    rank: int,
    node_rank: int,
    local_ranks: list[int],
    isolate_accelerator: bool,
) -> RankPlacement:
    node = cluster.node(node_rank)
    visible = local_ranks if isolate_accelerator else list(range(node.num_gpus))
    return RankPlacement(
        rank=rank,
        cluster_node_rank=node_rank,
        placement_node_rank=-1,
        local_accelerator_rank=visible[0] if visible else -1,
        accelerator_type=node.accelerator_type,
        local_rank=-1,
        local_world_size=0,
        visible_accelerators=[str(v) for v in visible],
        isolate_accelerator=isolate_accelerator,
        local_hardware_ranks=list(local_ranks),
    )


class PackedPlacementStrategy(PlacementStrategy):
    """Processes packed over global accelerator ranks ``start..end`` (inclusive).

    Args:
        start_hardware_rank: the first global accelerator.
        end_hardware_rank: the last global accelerator (inclusive).
        num_hardware_per_process: accelerators per process.
        stride: the stride, as for ``PackedPlacement``.
        node_group: RLinf's node group (only the default group is supported).
    """

    def __init__(
        self,
        start_hardware_rank: int,
        end_hardware_rank: int,
        num_hardware_per_process: int = 1,
        stride: int = 1,
        node_group: str | None = None,
    ):
        _no_node_groups(node_group, "node_group")
        for name, value, low in (
            ("start_hardware_rank", start_hardware_rank, 0),
            ("end_hardware_rank", end_hardware_rank, 0),
            ("num_hardware_per_process", num_hardware_per_process, 1),
            ("stride", stride, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise PlacementError(f"{name} must be an int >= {low}, got {value!r}")
        if end_hardware_rank < start_hardware_rank:
            raise PlacementError(
                f"end_hardware_rank {end_hardware_rank} is below start_hardware_rank "
                f"{start_hardware_rank}"
            )
        count = end_hardware_rank - start_hardware_rank + 1
        block = num_hardware_per_process * stride
        if count % block:
            raise PlacementError(
                f"the range {start_hardware_rank}..{end_hardware_rank} has {count} hardware "
                f"ranks, not a multiple of num_hardware_per_process * stride = {block}"
            )
        self._start_hw_rank = start_hardware_rank
        self._end_hw_rank = end_hardware_rank
        self._num_hardware_per_process = num_hardware_per_process
        self._stride = stride

    def get_placement(
        self, cluster: Cluster, isolate_accelerator: bool = True
    ) -> list[RankPlacement]:
        """Ranks packed over the hardware range, ``num_hardware_per_process`` each.

        Args:
            cluster, isolate_accelerator: as for ``PlacementStrategy.get_placement``.

        Returns:
            One ``RankPlacement`` per rank.

        Raises:
            PlacementError: the range exceeds the cluster's accelerators or a process's
                accelerators span nodes.
        """
        table = _hardware_map(cluster, "PackedPlacementStrategy")
        if self._end_hw_rank >= len(table):
            raise PlacementError(
                f"hardware ranks {self._start_hw_rank}..{self._end_hw_rank} exceed the "
                f"cluster's {len(table)} accelerators (ranks 0..{len(table) - 1})"
            )
        unused = list(range(self._start_hw_rank, self._end_hw_rank + 1))
        taken: set[int] = set()
        placements: list[RankPlacement] = []
        for first in unused:
            if first in taken:
                continue
            ranks = [first + k * self._stride for k in range(self._num_hardware_per_process)]
            nodes = {table[r][0] for r in ranks}
            if len(nodes) != 1:
                raise PlacementError(
                    f"rank {len(placements)} would take hardware ranks {ranks}, which span "
                    f"nodes {sorted(nodes)}; a process cannot run across nodes"
                )
            taken.update(ranks)
            placements.append(
                _device_placement(
                    cluster,
                    len(placements),
                    nodes.pop(),
                    [table[r][1] for r in ranks],
                    isolate_accelerator,
                )
            )
        return _fill_node_ranks(placements)

    def __repr__(self) -> str:
        return (
            f"PackedPlacementStrategy({self._start_hw_rank}, {self._end_hw_rank}, "
            f"num_hardware_per_process={self._num_hardware_per_process}, stride={self._stride})"
        )


class FlexiblePlacementStrategy(PlacementStrategy):
    """An explicit list of global hardware ranks per process.

    Ranks are sorted within each process and processes are ordered by their first rank
    (so rank 0 is the process holding the lowest device), as RLinf does.

    Args:
        hardware_ranks_list: the global hardware ranks of each process.
        node_group_label: RLinf's node group (only the default group is supported).
    """

    def __init__(
        self,
        hardware_ranks_list: list[list[int]],
        node_group_label: str | None = None,
    ):
        _no_node_groups(node_group_label, "node_group_label")
        if not isinstance(hardware_ranks_list, (list, tuple)) or not hardware_ranks_list:
            raise PlacementError("hardware_ranks_list must not be empty")
        for i, ranks in enumerate(hardware_ranks_list):
            if not isinstance(ranks, (list, tuple)) or not ranks:
                raise PlacementError(
                    f"hardware_ranks_list[{i}] must be a non-empty list of hardware ranks, "
                    f"got {ranks!r}"
                )
            bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
            if bad:
                raise PlacementError(
                    f"hardware_ranks_list[{i}]: hardware ranks must be non-negative ints, got {bad}"
                )
        self._hardware_ranks_list = [list(r) for r in hardware_ranks_list]

    def get_placement(
        self, cluster: Cluster, isolate_accelerator: bool = True
    ) -> list[RankPlacement]:
        """One rank per list of hardware ranks, ordered by its first one.

        Args:
            cluster, isolate_accelerator: as for ``PlacementStrategy.get_placement``.

        Returns:
            One ``RankPlacement`` per rank.

        Raises:
            PlacementError: a hardware rank is out of range, repeated, or a process's ranks
                span nodes.
        """
        table = _hardware_map(cluster, "FlexiblePlacementStrategy")
        per_process = []
        for ranks in self._hardware_ranks_list:
            outside = [r for r in ranks if r >= len(table)]
            if outside:
                raise PlacementError(
                    f"hardware ranks {outside} of {ranks} are out of range: the cluster has "
                    f"{len(table)} accelerators (ranks 0..{len(table) - 1})"
                )
            nodes = {table[r][0] for r in ranks}
            if len(nodes) != 1:
                raise PlacementError(
                    f"hardware ranks {ranks} of one process must be on the same node; they "
                    f"are on nodes {sorted(nodes)}"
                )
            if len(set(ranks)) != len(ranks):
                raise PlacementError(f"hardware ranks {ranks} of one process must be unique")
            per_process.append(sorted(ranks))
        per_process.sort(key=lambda ranks: ranks[0])
        placements = [
            _device_placement(
                cluster, i, table[ranks[0]][0], [table[r][1] for r in ranks], isolate_accelerator
            )
            for i, ranks in enumerate(per_process)
        ]
        return _fill_node_ranks(placements)

    def __repr__(self) -> str:
        return f"FlexiblePlacementStrategy({self._hardware_ranks_list})"


class NodePlacementStrategy(PlacementStrategy):
    """One process per entry of ``node_ranks`` (sorted), seeing all GPUs of its node.

    Args:
        node_ranks: one node rank per process.
        node_group_label: RLinf's node group (only the default group is supported).
    """

    def __init__(self, node_ranks: list[int], node_group_label: str | None = None):
        if node_group_label not in RESERVED_NODE_GROUPS:
            _no_node_groups(node_group_label, "node_group_label")
        self._node_group_label = node_group_label or DEFAULT_NODE_GROUP
        if not isinstance(node_ranks, (list, tuple)) or not node_ranks:
            raise PlacementError("node_ranks must not be empty")
        bad = [r for r in node_ranks if isinstance(r, bool) or not isinstance(r, int)]
        if bad:
            raise PlacementError(f"node_ranks must be ints, got {bad}")
        self._node_ranks = sorted(node_ranks)

    def get_placement(
        self, cluster: Cluster, isolate_accelerator: bool = True
    ) -> list[RankPlacement]:
        """One rank per entry of ``node_ranks``, seeing every accelerator of its node.

        Args:
            cluster, isolate_accelerator: as for ``PlacementStrategy.get_placement``.

        Returns:
            One ``RankPlacement`` per rank.

        Raises:
            PlacementIndexError: a node rank is out of range.
        """
        for r in self._node_ranks:
            if not 0 <= r < cluster.num_nodes:
                raise PlacementIndexError(
                    f"node rank {r} is out of range: the cluster has {cluster.num_nodes} "
                    f"node(s) (ranks 0..{cluster.num_nodes - 1})"
                )
        placements = []
        for rank, node_rank in enumerate(self._node_ranks):
            devices = list(range(cluster.node(node_rank).num_gpus))
            p = _device_placement(cluster, rank, node_rank, devices, isolate_accelerator)
            p.local_hardware_ranks = []  # a whole node: no hardware ranks of its own
            p.node_group_label = self._node_group_label
            placements.append(p)
        return _fill_node_ranks(placements)

    def __repr__(self) -> str:
        return f"NodePlacementStrategy({self._node_ranks})"


def default_placement(cluster: Cluster) -> Placement:
    """RLinf's default: one worker per GPU over all GPUs (``PackedPlacementStrategy(0, n-1)``)
    when the cluster has GPUs, else one CPU worker on node 0 (``NodePlacementStrategy([0])``)."""
    if cluster.num_accelerators > 0:
        return PackedPlacementStrategy(0, cluster.num_accelerators - 1)
    return NodePlacementStrategy([0])
