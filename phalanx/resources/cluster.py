"""Start or join Ray and describe its nodes.

``Cluster()`` with no address starts an embedded local Ray; with ``address="auto"`` or
``RAY_ADDRESS`` set it joins an existing cluster. If Ray is already initialised in this
process, the cluster simply wraps it. Nodes get deterministic ranks: the driver's node is
rank 0, then the others ordered by IP address and node id.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from dataclasses import dataclass

import ray

from phalanx._base.checks import check_int, check_number
from phalanx.resources.ray_start import DEFAULT_EMBEDDED_CPUS, NAMESPACE, init_ray

logger = logging.getLogger(__name__)

_port_lock = threading.Lock()
_issued_ports: set[tuple[str, int]] = set()


@dataclass(frozen=True)
class NodeInfo:
    """One Ray node as phalanx sees it.

    Attributes:
        node_rank: the node's rank (the driver's node is 0).
        node_id: its Ray node id.
        ip: its IP address.
        num_cpus: its logical CPUs.
        num_gpus: its GPUs.
        is_driver_node: whether the driver runs on it.
    """

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
        num_cpus, num_gpus: logical resources of an embedded Ray (ignored when joining).
        **ray_init_kwargs: more keyword arguments of ``ray.init``.
        timeout_s: how long to wait for ``num_nodes`` nodes.

    Ray's own start-up failures on a busy machine are retried for up to
    ``PHALANX_RAY_START_TIMEOUT_S`` seconds (``RayStartError`` after that).
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
        if num_nodes is not None:
            check_int(num_nodes, "num_nodes", minimum=1)
        check_number(timeout_s, "timeout_s", minimum=0)
        self._started_ray = False
        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS")
            kwargs = {"namespace": NAMESPACE, "log_to_driver": True, **ray_init_kwargs}
            if address:
                init_ray(address=address, **kwargs)
            else:
                kwargs.setdefault("include_dashboard", False)
                if kwargs.get("_node_ip_address"):  # Ray turns loopback into the network address;
                    # phalanx's listeners (here and in workers, which inherit it) keep it.
                    os.environ.setdefault("PHALANX_COMM_BIND_ADDRESS", kwargs["_node_ip_address"])
                # "local": a fresh instance even when `ray start` runs on this machine
                # (a bare ray.init() would join that cluster and refuse num_cpus).
                init_ray(
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
        """Re-read the alive nodes from Ray (node ranks stay deterministic).

        Returns:
            The nodes, in node-rank order (the driver's node first).
        """
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
        """The alive nodes, in node-rank order."""
        return list(self._nodes)

    @property
    def num_nodes(self) -> int:
        """The number of alive nodes."""
        return len(self._nodes)

    @property
    def num_gpus(self) -> int:
        """The GPUs of all nodes."""
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
        """The node of rank ``node_rank``.

        Args:
            node_rank: the node's rank.

        Returns:
            Its ``NodeInfo``.

        Raises:
            ValueError: ``node_rank`` is out of range.
        """
        if not 0 <= node_rank < len(self._nodes):
            raise ValueError(
                f"node_rank {node_rank} out of range: cluster has {len(self._nodes)} node(s)"
            )
        return self._nodes[node_rank]

    def get_node_info(self, node_rank: int) -> NodeInfo:
        """RLinf's name for ``node(node_rank)``.

        Args:
            node_rank: the node's rank.

        Returns:
            Its ``NodeInfo``.

        Raises:
            ValueError: ``node_rank`` is out of range.
        """
        return self.node(node_rank)

    def get_node_num_accelerators(self, node_rank: int) -> int:
        """Accelerators of one node (RLinf's name).

        Args:
            node_rank: the node's rank.

        Returns:
            Its number of GPUs.

        Raises:
            ValueError: ``node_rank`` is out of range.
        """
        return self.node(node_rank).num_gpus

    def get_node_ip(self, node_rank: int) -> str:
        """IP address of one node (RLinf's name).

        Args:
            node_rank: the node's rank.

        Returns:
            Its IP address.

        Raises:
            ValueError: ``node_rank`` is out of range.
        """
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
        """The rank of the node with Ray id ``node_id`` (re-reading the nodes once if unknown).

        Args:
            node_id: the Ray node id.

        Returns:
            The node's rank.

        Raises:
            ValueError: no alive node has that id.
        """
        for n in self._nodes:
            if n.node_id == node_id:
                return n.node_rank
        self.refresh()
        for n in self._nodes:
            if n.node_id == node_id:
                return n.node_rank
        raise ValueError(f"unknown Ray node id {node_id}")

    def available_resources(self) -> dict[str, float]:
        """Ray's resources free now, by name (``CPU``, ``GPU``, ...).

        Returns:
            A dict from resource name to amount.
        """
        return ray.available_resources()

    def total_resources(self) -> dict[str, float]:
        """Ray's resources of the whole cluster, by name.

        Returns:
            A dict from resource name to amount.
        """
        return ray.cluster_resources()

    def shutdown(self) -> None:
        """Stop Ray if this Cluster started it."""
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False

    def __repr__(self) -> str:
        return f"Cluster(nodes={self.num_nodes}, gpus={self.num_gpus})"


def find_free_port(
    node_ip: str | None = None,
    node_id: str | None = None,
    port_range: tuple[int, int] | None = None,
) -> int:
    """A free TCP port on the given node, never handed out twice by this process.

    ``port_range=(low, high)`` picks among ports ``low <= port < high`` (NeMo-RL's
    half-open ranges); ``None`` lets the operating system choose.
    """
    if port_range is not None:
        low, high = check_port_range(*port_range)
        port_range = (low, high)
    local = node_id is None or node_id == ray.get_runtime_context().get_node_id()
    for _ in range(100):
        if local:
            port = _local_free_port(port_range)
        else:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            port = ray.get(
                _remote_free_port.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                ).remote(port_range),
                timeout=60,
            )
        with _port_lock:
            key = (node_ip or "", port)
            if key not in _issued_ports:
                _issued_ports.add(key)
                return port
    where = "" if port_range is None else f" in [{port_range[0]}, {port_range[1]})"
    raise RuntimeError(f"could not find a free port{where} on node {node_ip}")


def check_port_range(low: object, high: object) -> tuple[int, int]:
    """``(low, high)`` checked as a half-open TCP port range ``1 <= low < high <= 65536``."""
    low = check_int(low, "port_range_low", minimum=1, maximum=65535)
    high = check_int(high, "port_range_high", minimum=2, maximum=65536)
    if high <= low:
        raise ValueError(f"port_range_high must be > port_range_low ({low}), got {high}")
    return low, high


def _local_free_port(port_range: tuple[int, int] | None = None) -> int:
    if port_range is None:
        candidates = [0]
    else:
        candidates = list(range(*port_range))
        random.shuffle(candidates)
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in [{port_range[0]}, {port_range[1]}) on this node")


@ray.remote(num_cpus=0)
def _remote_free_port(port_range: tuple[int, int] | None) -> int:
    return _local_free_port(port_range)
