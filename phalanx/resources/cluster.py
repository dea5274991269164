"""Start or join Ray and describe its nodes.

``Cluster()`` with no address starts an embedded local Ray; with ``address="auto"`` or
``RAY_ADDRESS`` set it joins an existing cluster. If Ray is already initialised in this
process, the cluster simply wraps it. Nodes get deterministic ranks: the driver's node is
rank 0, then the others ordered by IP address and node id.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

import ray

logger = logging.getLogger(__name__)

NAMESPACE = "phalanx"
# Logical CPU slots of an embedded Ray. Workers are mostly waiting on each other, so the
# default lets a 2-core machine host the usual handful of workers; pass num_cpus to change.
DEFAULT_EMBEDDED_CPUS = 16
_port_lock = threading.Lock()
_issued_ports: set[tuple[str, int]] = set()


@dataclass(frozen=True)
class NodeInfo:
    """One Ray node as phalanx sees it."""

    node_rank: int
    node_id: str
    ip: str
    num_cpus: float
    num_gpus: int
    is_driver_node: bool

    @property
    def num_accelerators(self) -> int:
        """RLinf's name for ``num_gpus``."""
        return self.num_gpus

    @property
    def node_ip(self) -> str:
        """RLinf's name for ``ip``."""
        return self.ip

    @property
    def accelerator_type(self) -> str:
        """``NV_GPU`` when Ray reports GPUs on the node, else ``NO_ACCEL`` (RLinf's names)."""
        return "NV_GPU" if self.num_gpus > 0 else "NO_ACCEL"


class Cluster:
    """Ray, started or joined, with a stable list of nodes.

    Args:
        num_nodes: wait (up to ``timeout_s``) until at least this many nodes are alive.
        address: a Ray address to join; ``None`` uses ``RAY_ADDRESS`` or starts Ray locally.
        num_cpus / num_gpus: logical resources of an embedded Ray (ignored when joining).
        timeout_s: how long to wait for ``num_nodes`` nodes.
    """

    def __init__(
        self,
        num_nodes: int | None = None,
        address: str | None = None,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        timeout_s: float = 60.0,
        **ray_init_kwargs,
    ):
        if num_nodes is not None and (not isinstance(num_nodes, int) or num_nodes < 1):
            raise ValueError(f"num_nodes must be a positive int, got {num_nodes!r}")
        self._started_ray = False
        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS")
            kwargs = {"namespace": NAMESPACE, "log_to_driver": True, **ray_init_kwargs}
            if address:
                ray.init(address=address, **kwargs)
            else:
                kwargs.setdefault("include_dashboard", False)
                # "local": a fresh instance even when `ray start` runs on this machine
                # (a bare ray.init() would join that cluster and refuse num_cpus).
                ray.init(
                    address="local",
                    num_cpus=num_cpus
                    if num_cpus is not None
                    else max(DEFAULT_EMBEDDED_CPUS, os.cpu_count() or 1),
                    num_gpus=num_gpus if num_gpus is not None else 0,
                    **kwargs,
                )
                self._started_ray = True
        self._nodes: list[NodeInfo] = []
        deadline = time.monotonic() + timeout_s
        while True:
            self.refresh()
            if num_nodes is None or len(self._nodes) >= num_nodes:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Cluster(num_nodes={num_nodes}): only {len(self._nodes)} Ray node(s) alive "
                    f"after {timeout_s}s"
                )
            logger.info("waiting for %d nodes, %d alive", num_nodes, len(self._nodes))
            time.sleep(0.5)

    def refresh(self) -> list[NodeInfo]:
        """Re-read the alive nodes from Ray (node ranks stay deterministic)."""
        driver_node = ray.get_runtime_context().get_node_id()
        alive = [n for n in ray.nodes() if n.get("Alive")]
        alive.sort(key=lambda n: (n["NodeID"] != driver_node, n["NodeManagerAddress"], n["NodeID"]))
        self._nodes = [
            NodeInfo(
                node_rank=i,
                node_id=n["NodeID"],
                ip=n["NodeManagerAddress"],
                num_cpus=float(n["Resources"].get("CPU", 0)),
                num_gpus=int(n["Resources"].get("GPU", 0)),
                is_driver_node=n["NodeID"] == driver_node,
            )
            for i, n in enumerate(alive)
        ]
        return self._nodes

    @property
    def nodes(self) -> list[NodeInfo]:
        return list(self._nodes)

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    @property
    def num_gpus(self) -> int:
        return sum(n.num_gpus for n in self._nodes)

    @property
    def num_accelerators(self) -> int:
        """RLinf's name: accelerators (GPUs Ray reports) over all nodes."""
        return self.num_gpus

    @property
    def num_gpus_per_node(self) -> int:
        """GPUs of the largest node (global device ids are laid out with this stride)."""
        return max((n.num_gpus for n in self._nodes), default=0)

    def node(self, node_rank: int) -> NodeInfo:
        if not 0 <= node_rank < len(self._nodes):
            raise ValueError(
                f"node_rank {node_rank} out of range: cluster has {len(self._nodes)} node(s)"
            )
        return self._nodes[node_rank]

    def get_node_info(self, node_rank: int) -> NodeInfo:
        """RLinf's name for ``node(node_rank)``."""
        return self.node(node_rank)

    def get_node_num_accelerators(self, node_rank: int) -> int:
        """Accelerators of one node (RLinf's name)."""
        return self.node(node_rank).num_gpus

    def get_node_ip(self, node_rank: int) -> str:
        """IP address of one node (RLinf's name)."""
        return self.node(node_rank).ip

    @property
    def accelerator_ranks(self) -> list[list[int]]:
        """Global accelerator ranks of each node: node after node, in node-rank order."""
        out, start = [], 0
        for n in self._nodes:
            out.append(list(range(start, start + n.num_gpus)))
            start += n.num_gpus
        return out

    def node_rank_of(self, node_id: str) -> int:
        for n in self._nodes:
            if n.node_id == node_id:
                return n.node_rank
        self.refresh()
        for n in self._nodes:
            if n.node_id == node_id:
                return n.node_rank
        raise ValueError(f"unknown Ray node id {node_id}")

    def available_resources(self) -> dict[str, float]:
        return ray.available_resources()

    def total_resources(self) -> dict[str, float]:
        return ray.cluster_resources()

    def shutdown(self) -> None:
        """Stop Ray if this Cluster started it."""
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False

    def __repr__(self) -> str:
        return f"Cluster(nodes={self.num_nodes}, gpus={self.num_gpus})"


def ensure_cluster(cluster: Cluster | None = None) -> Cluster:
    """The given cluster, or one wrapping the current (or a new embedded) Ray."""
    return cluster if cluster is not None else Cluster()


def find_free_port(node_ip: str | None = None, node_id: str | None = None) -> int:
    """A free TCP port on the given node, never handed out twice by this process."""
    local = node_id is None or node_id == ray.get_runtime_context().get_node_id()
    for _ in range(100):
        if local:
            port = _local_free_port()
        else:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            port = ray.get(
                _remote_free_port.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                ).remote(),
                timeout=60,
            )
        with _port_lock:
            key = (node_ip or "", port)
            if key not in _issued_ports:
                _issued_ports.add(key)
                return port
    raise RuntimeError(f"could not find a free port on node {node_ip}")


def _local_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@ray.remote(num_cpus=0)
def _remote_free_port() -> int:
    return _local_free_port()
