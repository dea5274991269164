"""Process groups between any workers, created lazily, with rendezvous through Ray.

``get_group(members)`` is called by every member (a collective call) with the same list
of worker names or ``WorkerAddress``es; the member's rank is its index in that list.
Rank 0 hosts a ``TCPStore`` on its node's own address and announces it in Ray's KV
store; the others find it there. Backend: ``"gloo"`` for CPU tensors, ``"nccl"`` for
CUDA tensors (``"auto"`` picks NCCL when CUDA is available). Groups are cached per
process by (members, backend, tag); pass a new ``tag`` to build a fresh group (e.g.
after a member restarted).
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phalanx._base.address import WorkerAddress
from phalanx._base.checks import check_name, check_timeout
from phalanx.comm.config import CONFIG
from phalanx.comm.endpoint import KV_NAMESPACE, get_endpoint
from phalanx.comm.errors import CommError
from phalanx.comm.options import CollectiveGroupOptions, check_options
from phalanx.comm.process_group import host_store, join_store, make_process_group

_groups: dict[tuple, CollectiveGroup] = {}
_lock = threading.Lock()


@dataclass
class CollectiveGroup:
    """A torch process group over named workers; ``pg`` is usable with ``torch.distributed``.

    Attributes:
        members: the members' worker names, in collective-rank order.
        rank: this process's collective rank.
        backend: ``"gloo"`` or ``"nccl"``.
        pg: the torch process group.
    """

    members: tuple[str, ...]
    rank: int
    backend: str
    pg: Any

    @property
    def world_size(self) -> int:
        """The number of members."""
        return len(self.members)

    def broadcast(self, tensor: Any, src: int = 0) -> Any:
        """In-place broadcast of ``tensor`` from member ``src``; returns ``tensor``.

        Args:
            tensor: the tensor, overwritten on the other members.
            src: the member that sends.

        Returns:
            ``tensor``.
        """
        self.pg.broadcast([tensor], src).wait()
        return tensor

    def all_reduce(self, tensor: Any) -> Any:
        """In-place sum over the members; returns ``tensor``.

        Args:
            tensor: the tensor, summed in place.

        Returns:
            ``tensor``.
        """
        self.pg.allreduce([tensor]).wait()
        return tensor

    def barrier(self) -> None:
        self.pg.barrier().wait()


def _names(members: Sequence[str | WorkerAddress]) -> tuple[str, ...]:
    if (
        isinstance(members, (str, WorkerAddress))
        or not isinstance(members, Sequence)
        or len(members) < 2
    ):
        raise ValueError("members must be a list of at least two worker names or WorkerAddresses")
    names = []
    for m in members:
        if isinstance(m, WorkerAddress):
            names.append(m.get_name())
        elif isinstance(m, str) and m:
            names.append(m)
        else:
            raise TypeError(f"members: expected a worker name or WorkerAddress, got {m!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"members: duplicate workers in {names}")
    return tuple(names)


def get_group(
    members: Sequence[str | WorkerAddress],
    backend: str = "gloo",
    tag: str = "",
    timeout_s: float | None = None,
    options: CollectiveGroupOptions | None = None,
) -> CollectiveGroup:
    """This worker's ``CollectiveGroup`` over ``members`` (created on first call, then cached).

    ``timeout_s``: how long members wait for each other to join (default
    ``rendezvous_timeout_s``); ``options``: a ``CollectiveGroupOptions`` (its ``timeout_s``
    bounds each operation of the group, its NCCL settings shape an NCCL group).
    """
    names = _names(members)
    check_options(options)
    check_name(backend, "backend")
    timeout_s = check_timeout(timeout_s, "timeout_s")
    if backend == "auto":
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or 'auto', got {backend!r}")
    ep = get_endpoint()
    if ep.name not in names:
        raise ValueError(f"members: this worker ({ep.name}) is not one of {list(names)}")
    for n in names:
        ep.check_peer_exists(n)
    cache_key = (names, backend, tag, repr(options))
    with _lock:
        group = _groups.get(cache_key)
        if group is not None:
            return group
        group = _create(ep, names, backend, tag, timeout_s or CONFIG.rendezvous_timeout_s, options)
        _groups[cache_key] = group
        return group


def _create(
    ep: Any, names: tuple[str, ...], backend: str, tag: str, timeout_s: float, options: Any
) -> CollectiveGroup:
    from ray.experimental import internal_kv

    rank = names.index(ep.name)
    digest = hashlib.sha1(repr((names, backend, tag)).encode()).hexdigest()[:20]
    kv_key = f"pg/{digest}".encode()
    if rank == 0:
        store = host_store(ep.info.ip, timeout_s)
        nonce = f"{ep.info.incarnation}/{time.time_ns()}"
        internal_kv._internal_kv_put(
            kv_key,
            pickle.dumps((ep.info.ip, store.port, ep.info.incarnation, nonce)),
            overwrite=True,
            namespace=KV_NAMESPACE,
        )
    else:
        deadline = time.monotonic() + timeout_s
        next_check = 0.0
        while True:
            raw = internal_kv._internal_kv_get(kv_key, namespace=KV_NAMESPACE)
            if raw is not None:
                ip, port, incarnation, nonce = pickle.loads(raw)
                if ep.is_current(names[0], incarnation):
                    break
            now = time.monotonic()
            if now > next_check:
                ep.check_alive(names[0])
                next_check = now + CONFIG.peer_check_interval_s
            if now > deadline:
                raise CommError(
                    names[0],
                    f"group {list(names)}: rank 0 ({names[0]}) did not host within {timeout_s}s",
                )
            time.sleep(0.05)
        store = join_store(ip, port, timeout_s)
    pg = make_process_group(
        backend,
        store,
        rank,
        len(names),
        prefix=f"{digest}/{tag}",
        ip=ep.info.ip,
        timeout_s=max(CONFIG.connect_timeout_s, 1800),
        options=options,
    )
    group = CollectiveGroup(names, rank, backend, pg)
    group._store = store  # keep the store alive as long as the group
    return group
