"""Point-to-point messages between workers named by group and rank (or ``WorkerAddress``).

``send``/``recv`` move any picklable object; tensors inside it (at any depth) travel as
raw bytes, never pickled. ``send_tensor``/``recv_tensor`` move one tensor into a buffer
the receiver already holds; a dtype or element-count mismatch raises ``ValueError`` on
the receiver (the bytes are drained, the stream stays in step). Every call may be
posted before its counterpart; messages between a pair arrive in send order.
With ``async_op=True`` the call returns a ``Work`` (``wait``, ``done``, ``async_wait``);
for an async send, do not modify the tensors until the work is done.

RLinf's signatures: ``options`` is a ``CollectiveGroupOptions`` (``options.py``) or None;
a sender's options shape the NCCL group of its pair when that group is first built (the
CPU paths, socket, shared memory and gloo, have nothing to tune); a receiver's are checked
only. ``send(..., piggyback_payload=p)`` delivers ``(object, p)`` to the receiver's
``recv``, as RLinf does.
"""

from __future__ import annotations

import threading
from typing import Any

from phalanx._base.address import WorkerAddress
from phalanx._base.checks import check_int, check_timeout
from phalanx.comm import shm
from phalanx.comm.config import CONFIG
from phalanx.comm.endpoint import get_endpoint
from phalanx.comm.options import check_options
from phalanx.comm.wire import Outgoing, blob_bytes, encode, encode_raw, same_node_shm
from phalanx.comm.work import Work


def peer_name(group: str | WorkerAddress, rank: int | None, arg: str = "group_name") -> str:
    """The endpoint name (``group:rank``) of a worker, validating the arguments."""
    if isinstance(group, WorkerAddress):
        if rank is not None:
            raise ValueError(f"{arg}: give a WorkerAddress or a group name with a rank, not both")
        return group.get_name()
    if not isinstance(group, str) or not group:
        raise TypeError(f"{arg} must be a non-empty str or a WorkerAddress, got {group!r}")
    if rank is None:
        raise ValueError(f"a rank is needed with {arg}={group!r}")
    return f"{group}:{check_int(rank, 'rank', minimum=0)}"


def _tensor(t: Any, arg: str) -> Any:
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    return t


def send(
    obj: Any,
    dst_group_name: str | WorkerAddress,
    dst_rank: int | None = None,
    async_op: bool = False,
    options: Any = None,
    piggyback_payload: Any = None,
) -> Work | None:
    """Send ``obj`` to worker ``dst_rank`` of ``dst_group_name``."""
    peer = peer_name(dst_group_name, dst_rank, "dst_group_name")
    check_options(options)
    if piggyback_payload is not None:
        obj = (obj, piggyback_payload)
    ep = get_endpoint()
    ep.check_peer_exists(peer)
    msg = encode(obj)
    msg.options = options
    work = ep.send(peer, msg, async_op=async_op)
    return work if async_op else None


def recv(
    src_group_name: str | WorkerAddress,
    src_rank: int | None = None,
    async_op: bool = False,
    options: Any = None,
    timeout: float | None = None,
) -> Any:
    """The next message from worker ``src_rank`` of ``src_group_name`` (a ``Work`` if async)."""
    peer = peer_name(src_group_name, src_rank, "src_group_name")
    check_timeout(timeout)
    check_options(options)
    ep = get_endpoint()
    ep.check_peer_exists(peer)
    if async_op:
        return ep.recv(peer)
    return ep.recv_now(peer, timeout)


def send_tensor(
    tensor: Any,
    dst_group_name: str | WorkerAddress,
    dst_rank: int | None = None,
    async_op: bool = False,
    options: Any = None,
) -> Work | None:
    """Send one tensor for the peer's ``recv_tensor`` (no pickled metadata)."""
    _tensor(tensor, "tensor")
    peer = peer_name(dst_group_name, dst_rank, "dst_group_name")
    check_options(options)
    ep = get_endpoint()
    ep.check_peer_exists(peer)
    msg = encode_raw(tensor)
    msg.options = options
    work = ep.send(peer, msg, async_op=async_op)
    return work if async_op else None


def recv_tensor(
    tensor: Any,
    src_group_name: str | WorkerAddress,
    src_rank: int | None = None,
    async_op: bool = False,
    options: Any = None,
    timeout: float | None = None,
) -> Any:
    """Receive the next message from the peer into ``tensor`` in place; returns ``tensor``."""
    _tensor(tensor, "tensor")
    if not tensor.is_contiguous():
        raise ValueError("tensor: recv_tensor needs a contiguous buffer")
    peer = peer_name(src_group_name, src_rank, "src_group_name")
    check_timeout(timeout)
    check_options(options)
    ep = get_endpoint()
    ep.check_peer_exists(peer)
    if async_op:
        return ep.recv(peer, kind="tensor", buffer=tensor)
    return ep.recv_now(peer, timeout, kind="tensor", buffer=tensor)


def _members(groups: Any) -> list[str]:
    """The endpoint names of a broadcast's members, in RLinf's order (validating ``groups``)."""
    if groups is None:
        raise ValueError("groups must be given: a list of (group_name, ranks) tuples")
    if not isinstance(groups, list):
        raise TypeError(f"groups must be a list of (group_name, ranks) tuples, got {groups!r}")
    if not groups:
        raise ValueError("groups must contain at least one (group_name, ranks) entry")
    names: list[str] = []
    for entry in groups:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise TypeError(
                f"groups: each entry must be a (group_name, ranks) tuple, got {entry!r}"
            )
        group, ranks = entry
        if not isinstance(group, str) or not group:
            raise TypeError(f"groups: group_name must be a non-empty str, got {group!r}")
        if isinstance(ranks, list):
            if not ranks:
                raise ValueError(f"groups: the ranks of {group!r} must not be empty")
            paths = ranks
        else:
            paths = [ranks]
        for r in paths:
            names.append(_address(group, r, "groups"))
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"groups: {dupes} listed more than once")
    return names


def _address(group: str, rank: Any, arg: str) -> str:
    """``group:rank`` for an int rank, ``group:r0:r1`` for a rank path (a tuple of ints)."""
    path = rank if isinstance(rank, tuple) else (rank,)
    if not path or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in path):
        raise TypeError(
            f"{arg}: a rank must be a non-negative int or a tuple of them, got {rank!r}"
        )
    return WorkerAddress(group, list(path)).get_name()


def _source(src: Any, members: list[str]) -> str:
    if src is None:
        return members[0]
    if isinstance(src, WorkerAddress):
        name = src.get_name()
    elif isinstance(src, (tuple, list)) and len(src) == 2 and isinstance(src[0], str):
        name = _address(src[0], src[1], "src")
    else:
        raise TypeError(f"src must be a (group_name, rank) tuple or a WorkerAddress, got {src!r}")
    if name not in members:
        raise ValueError(f"src: {name} is not one of the broadcast's members {members}")
    return name


def broadcast(
    object: Any = None,
    groups: Any = None,
    src: Any = None,
    async_op: bool = False,
    options: Any = None,
) -> Any:
    """RLinf's broadcast: every member calls it with the same ``groups`` and ``src``.

    ``groups`` is ``[(group_name, ranks), ...]`` (``ranks``: an int, a rank-path tuple,
    or a list of them); ``src`` is ``(group_name, rank)``, by default the first member.
    The source's ``object`` is what every member returns (the others pass ``None``). The
    source encodes the object once and sends it to the other members concurrently; tensors
    for members on its node go through shared memory. ``options`` is accepted for RLinf's
    signature (see the module docstring). Members must call their
    broadcasts (and sends/recvs with each other) in the same order.
    """
    members = _members(groups)
    check_options(options)
    ep = get_endpoint()
    if ep.name not in members:
        raise ValueError(f"groups: this worker ({ep.name}) is not one of the members {members}")
    source = _source(src, members)
    if source != ep.name:
        ep.check_peer_exists(source)
        work = ep.recv(source)
        return work if async_op else work.wait()
    targets = [t for t in members if t != ep.name]
    for t in targets:
        ep.check_peer_exists(t)
    msg = encode(object)
    msg.options = options
    local = [t for t in targets if _on_my_node(ep, t)]
    names = _share_on_node(msg, local) if len(local) > 1 else {}
    works = []
    for t in targets:
        w = ep.send(t, msg, async_op=True)
        if t in names:  # a send that failed leaves its reader's name behind: remove it
            w.add_done_callback(
                lambda f, path=names[t]: shm.unlink(path) if f.exception() else None
            )
        works.append(w)
    work = _AllWork(f"broadcast to {len(targets)} workers", works, object)
    return work if async_op else work.wait()


def _on_my_node(ep: Any, peer: str) -> bool:
    info = ep.announced(peer)
    return info is not None and info.node_id == ep.info.node_id


def _share_on_node(msg: Outgoing, peers: list[str]) -> dict[str, str]:
    """Write the message's shared-memory blobs once for all ``peers`` (on this node).

    Each reader gets its own name (a hard link) of the one segment and unlinks it when it
    maps it, so the memory is freed once every reader lets go; a name whose reader never
    came is reaped with this process (``shm.reap_orphans``). Returns peer -> name.
    """
    index = [i for i, b in enumerate(msg.blobs) if same_node_shm(b, CONFIG)]
    if not index:
        return {}
    try:
        path, size, offsets = shm.write_segment([blob_bytes(msg.blobs[i]) for i in index], "bcast")
    except OSError:
        return {}  # /dev/shm full: each send falls back to its own transport
    try:
        names = dict(zip(peers, shm.link_segment(path, len(peers))))
    except OSError:
        return {}
    finally:
        shm.unlink(path)
    where = dict(zip(index, offsets))
    msg.shared = {peer: (shm.SegmentRef(name, size), where) for peer, name in names.items()}
    return names


class _AllWork(Work):
    """Done when every part is done; its result is ``value``."""

    __slots__ = ()

    def __init__(self, what: str, parts: list[Work], value: Any):
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()
        remaining = [len(parts)]

        lock = threading.Lock()

        def _one(f: concurrent.futures.Future) -> None:
            with lock:
                if fut.done():
                    return
                if f.exception() is not None:
                    fut.set_exception(f.exception())
                    return
                remaining[0] -= 1
                if remaining[0] == 0:
                    fut.set_result(value)

        if not parts:
            fut.set_result(value)
        for p in parts:
            p.add_done_callback(_one)
        super().__init__(what, fut)
