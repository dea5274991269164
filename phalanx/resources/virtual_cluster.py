"""NeMo-RL's virtual cluster: placement groups of bundles, per node or unified.

Each entry of ``bundle_ct_per_node_list`` is one node's worth of bundles (one bundle per
worker slot, 1 CPU and, with ``use_gpus``, 1 GPU each). By default every node entry gets
its own ``STRICT_PACK`` placement group; ``use_unified_pg=True`` makes one placement group
of all bundles. Workers of ``max_colocated_worker_groups`` groups share a bundle's GPU
(each takes ``1/max_colocated_worker_groups`` of it).

Resources the cluster cannot provide are reported within seconds, naming what is missing.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from phalanx.resources.cluster import Cluster, check_port_range, find_free_port
from phalanx.resources.placement import WorkerSlot

logger = logging.getLogger(__name__)


class RayVirtualCluster:
    """Bundles on Ray placement groups, one group per node entry or one unified group.

    Args:
        bundle_ct_per_node_list: bundles per node.
        use_gpus: each bundle holds a GPU.
        max_colocated_worker_groups: groups that share one bundle (a GPU's fraction each).
        num_gpus_per_node: GPUs per node.
        name: the placement groups' name prefix.
        placement_group_strategy: Ray's strategy (``"SPREAD"``, ``"PACK"``, ...).
        port_range_low: the lowest port handed out.
        port_range_high: one past the highest port handed out.
        use_unified_pg: one placement group over all nodes.
        num_cpus_per_bundle: CPUs per bundle.
        ready_timeout_s: seconds the placement groups may take to be ready.
        cluster: the ``Cluster`` (if None, ``Cluster()``: the running Ray, or a local one it
            starts).

    Raises:
        ValueError: ``bundle_ct_per_node_list`` is empty or an option is out of range.
    """

    def __init__(
        self,
        bundle_ct_per_node_list: list[int],
        use_gpus: bool = True,
        max_colocated_worker_groups: int = 1,
        num_gpus_per_node: int = 8,
        name: str = "",
        placement_group_strategy: str | None = None,
        port_range_low: int | None = None,
        port_range_high: int | None = None,
        use_unified_pg: bool = False,
        num_cpus_per_bundle: float = 1.0,
        ready_timeout_s: float = 30.0,
        cluster: Cluster | None = None,
    ):
        if not isinstance(bundle_ct_per_node_list, (list, tuple)) or not bundle_ct_per_node_list:
            raise ValueError("bundle_ct_per_node_list must be a non-empty list of bundle counts")
        if any(not isinstance(c, int) or c < 1 for c in bundle_ct_per_node_list):
            raise ValueError(
                f"bundle_ct_per_node_list entries must be positive ints, got {bundle_ct_per_node_list}"
            )
        if not isinstance(max_colocated_worker_groups, int) or max_colocated_worker_groups < 1:
            raise ValueError(
                f"max_colocated_worker_groups must be a positive int, got {max_colocated_worker_groups!r}"
            )
        if use_gpus and any(c > num_gpus_per_node for c in bundle_ct_per_node_list):
            raise ValueError(
                f"bundle_ct_per_node_list {bundle_ct_per_node_list}: a node entry has more GPU bundles "
                f"than num_gpus_per_node={num_gpus_per_node}"
            )
        strategies = {"PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"}
        if placement_group_strategy is not None and placement_group_strategy not in strategies:
            raise ValueError(
                f"placement_group_strategy must be one of {sorted(strategies)}, got {placement_group_strategy!r}"
            )
        if (port_range_low is None) != (port_range_high is None):
            raise ValueError(
                "port_range_low and port_range_high go together: pass both or neither, got "
                f"{port_range_low!r} and {port_range_high!r}"
            )
        self._port_range = (
            None if port_range_low is None else check_port_range(port_range_low, port_range_high)
        )
        self.port_range_low = port_range_low
        self.port_range_high = port_range_high
        self.cluster = cluster if cluster is not None else Cluster()
        self._bundle_ct_per_node_list = list(bundle_ct_per_node_list)
        self.use_gpus = use_gpus
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self.num_gpus_per_node = num_gpus_per_node
        self.name = name
        self.use_unified_pg = use_unified_pg
        self.placement_group_strategy = placement_group_strategy or (
            "PACK" if use_unified_pg else "STRICT_PACK"
        )
        self.num_cpus_per_bundle = num_cpus_per_bundle
        self._bundle = {"CPU": num_cpus_per_bundle, **({"GPU": 1} if use_gpus else {})}
        self._check_feasible()
        self._placement_groups: list[PlacementGroup] = []
        self._bundle_nodes: dict[tuple[int, int], str] = {}
        self._create(ready_timeout_s)

    # -- creation -----------------------------------------------------------------
    def _check_feasible(self) -> None:
        total = ray.cluster_resources()
        need = {k: v * self.world_size() for k, v in self._bundle.items()}
        missing = {
            k: (v, total.get(k, 0.0)) for k, v in need.items() if total.get(k, 0.0) + 1e-9 < v
        }
        if missing:
            what = ", ".join(
                f"{k}: needs {v:g}, cluster has {h:g}" for k, (v, h) in missing.items()
            )
            raise ValueError(
                f"RayVirtualCluster{self._bundle_ct_per_node_list}: not enough resources ({what})"
            )
        if not self.use_unified_pg and self.placement_group_strategy == "STRICT_PACK":
            biggest = max(self._bundle_ct_per_node_list)
            for key, per in self._bundle.items():
                cap = max(
                    (n["Resources"].get(key, 0.0) for n in ray.nodes() if n.get("Alive")), default=0
                )
                if cap + 1e-9 < per * biggest:
                    raise ValueError(
                        f"bundle_ct_per_node_list: a node entry of {biggest} bundles needs "
                        f"{per * biggest:g} {key} on one node; the largest node has {cap:g}"
                    )

    def _create(self, timeout_s: float) -> None:
        if self.use_unified_pg:
            specs = [[dict(self._bundle) for _ in range(self.world_size())]]
        else:
            specs = [[dict(self._bundle) for _ in range(c)] for c in self._bundle_ct_per_node_list]
        prefix = self.name or "phalanx-vc"
        for i, bundles in enumerate(specs):
            self._placement_groups.append(
                placement_group(
                    bundles, strategy=self.placement_group_strategy, name=f"{prefix}-pg{i}"
                )
            )
        ready = [pg.ready() for pg in self._placement_groups]
        start = time.monotonic()
        pending = ready
        while pending and time.monotonic() - start < timeout_s:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(5.0, timeout_s))
            if pending:  # said out loud: a silent wait of up to timeout_s looks like a hang
                print(
                    f"[phalanx] {prefix}: waiting for {len(pending)}/{len(ready)} placement "
                    f"group(s) to be ready ({time.monotonic() - start:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
        if pending:
            avail = ray.available_resources()
            need = {k: v * self.world_size() for k, v in self._bundle.items()}
            self.shutdown()
            what = ", ".join(
                f"{k}: needs {v:g}, available {avail.get(k, 0.0):g}" for k, v in need.items()
            )
            raise RuntimeError(
                f"RayVirtualCluster{self._bundle_ct_per_node_list}: placement groups not ready after "
                f"{timeout_s}s ({what}); other groups may hold the resources"
            )
        for pg_idx, pg in enumerate(self._placement_groups):
            table = ray.util.placement_group_table(pg)
            for b, node_id in table["bundles_to_node_id"].items():
                self._bundle_nodes[(pg_idx, int(b))] = node_id

    # -- NeMo-RL API --------------------------------------------------------------------
    def get_placement_groups(self) -> list[PlacementGroup]:
        """The Ray placement groups, one per node (or one in all when unified).

        Returns:
            The placement groups.
        """
        return list(self._placement_groups)

    def world_size(self) -> int:
        """The number of bundles in all.

        Returns:
            The number of bundles.
        """
        return sum(self._bundle_ct_per_node_list)

    def node_count(self) -> int:
        """The nodes that hold at least one bundle.

        Returns:
            The number of nodes.
        """
        return sum(1 for c in self._bundle_ct_per_node_list if c > 0)

    @property
    def bundle_ct_per_node_list(self) -> list[int]:
        """Bundles per node, as given."""
        return list(self._bundle_ct_per_node_list)

    def bundle_node_id(self, pg_idx: int, bundle_idx: int) -> str:
        """The Ray node id that holds a bundle.

        Args:
            pg_idx: the placement group.
            bundle_idx: the bundle in it.

        Returns:
            The node id.

        Raises:
            ValueError: there is no such bundle.
        """
        try:
            return self._bundle_nodes[(pg_idx, bundle_idx)]
        except KeyError:
            raise ValueError(f"no bundle {bundle_idx} in placement group {pg_idx}") from None

    def get_available_address_and_port(
        self, pg_idx: int = 0, bundle_idx: int = 0
    ) -> tuple[str, int]:
        """IP of the node holding the bundle and a free port on it (within
        ``[port_range_low, port_range_high)`` when those are set).

        Args:
            pg_idx: the placement group.
            bundle_idx: the bundle in it.

        Returns:
            ``(ip, port)``.

        Raises:
            ValueError: there is no such bundle.
        """
        node_id = self.bundle_node_id(pg_idx, bundle_idx)
        ip = self.cluster.node(self.cluster.node_rank_of(node_id)).ip
        return ip, find_free_port(ip, node_id, self._port_range)

    def get_master_address_and_port(self) -> tuple[str, int]:
        """The address and a free port of bundle 0 of placement group 0.

        Returns:
            ``(ip, port)``.
        """
        return self.get_available_address_and_port(0, 0)

    def slots(
        self, bundle_indices_list: list[tuple[int, list[int]]], num_gpus: float | None = None
    ) -> list[WorkerSlot]:
        """One slot per bundle of ``bundle_indices_list`` (``(pg_or_node_idx, [local bundles])``).

        Args:
            bundle_indices_list: ``(placement group, [bundles])`` per worker.
            num_gpus: the GPUs each worker reserves (by ``use_gpus`` if None).

        Returns:
            The worker slots.

        Raises:
            RuntimeError: the cluster was shut down.
            ValueError: a placement group or bundle does not exist.
        """
        if not self._placement_groups:
            raise RuntimeError("this RayVirtualCluster was shut down")
        per_worker_gpu = (1.0 / self.max_colocated_worker_groups) if self.use_gpus else 0.0
        if num_gpus is not None:
            per_worker_gpu = num_gpus
        slots: list[WorkerSlot] = []
        for pg_idx, local in bundle_indices_list:
            pg_pos = 0 if self.use_unified_pg else pg_idx
            if not 0 <= pg_pos < len(self._placement_groups):
                raise ValueError(f"bundle_indices_list: placement group {pg_idx} does not exist")
            pg = self._placement_groups[pg_pos]
            for j, b in enumerate(local):
                if not 0 <= b < pg.bundle_count:
                    raise ValueError(
                        f"bundle_indices_list: bundle {b} out of range for placement group {pg_pos} "
                        f"({pg.bundle_count} bundles)"
                    )
                node_id = self._bundle_nodes[(pg_pos, b)]
                node_rank = self.cluster.node_rank_of(node_id)
                node = self.cluster.node(node_rank)
                slots.append(
                    WorkerSlot(
                        rank=len(slots),
                        node_rank=node_rank,
                        local_rank=b,
                        node_id=node_id,
                        node_ip=node.ip,
                        accelerator_type=node.accelerator_type,
                        num_cpus=self.num_cpus_per_bundle / self.max_colocated_worker_groups,
                        num_gpus=per_worker_gpu,
                        placement_group=pg,
                        bundle_index=b,
                        bundle_indices=(pg_idx, list(local)) if j == 0 else None,
                        isolate_gpu=False,
                        port_range=self._port_range,
                    )
                )
        return slots

    def shutdown(self) -> bool:
        """Remove the placement groups (idempotent).

        Returns:
            True.
        """
        for pg in self._placement_groups:
            try:
                remove_placement_group(pg)
            except Exception as e:  # noqa: BLE001 - already removed or Ray gone
                logger.debug("remove_placement_group: %s", e)
        self._placement_groups = []
        self._bundle_nodes = {}
        return True

    def __repr__(self) -> str:
        return f"RayVirtualCluster({self._bundle_ct_per_node_list}, use_gpus={self.use_gpus})"

    def _info(self) -> dict[str, Any]:
        return {"bundles": self._bundle_ct_per_node_list, "strategy": self.placement_group_strategy}
