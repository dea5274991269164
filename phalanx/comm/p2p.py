"""Point-to-point messages between workers named by group and rank (or ``WorkerAddress``).

``send``/``recv`` move any picklable object; tensors inside it (at any depth) travel as
raw bytes, never pickled. ``send_tensor``/``recv_tensor`` move one tensor into a buffer
the receiver already holds; a dtype or element-count mismatch raises ``ValueError`` on
the receiver (the bytes are drained, the stream stays in step). Every call may be
posted before its counterpart; messages between a pair arrive in send order.
With ``async_op=True`` the call returns a ``Work`` (``wait``, ``done``, ``async_wait``);
for an async send, do not modify the tensors until the work is done.
"""

from __future__ import annotations

import threading
from typing import Any

from phalanx._base.address import WorkerAddress
from phalanx.comm.endpoint import get_endpoint
from phalanx.comm.wire import encode, encode_raw
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
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    return f"{group}:{rank}"


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
        raise ValueError(f"timeout must be None or a non-negative number, got {timeout!r}")


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
) -> Work | None:
    """Send ``obj`` to worker ``dst_rank`` of ``dst_group_name``."""
    peer = peer_name(dst_group_name, dst_rank, "dst_group_name")
    ep = get_endpoint()
    ep.check_peer_exists(peer)
    work = ep.send(peer, encode(obj), async_op=async_op)
    return work if async_op else None


def recv(
    src_group_name: str | WorkerAddress,
    src_rank: int | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> Any:
    """The next message from worker ``src_rank`` of ``src_group_name`` (a ``Work`` if async)."""
    peer = peer_name(src_group_name, src_rank, "src_group_name")
    _check_timeout(timeout)
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
) -> Work | None:
    """Send one tensor for the peer's ``recv_tensor`` (no pickled metadata)."""
    _tensor(tensor, "tensor")
    peer = peer_name(dst_group_name, dst_rank, "dst_group_name")
    ep = get_endpoint()
    ep.check_peer_exists(peer)
    work = ep.send(peer, encode_raw(tensor), async_op=async_op)
    return work if async_op else None


def recv_tensor(
    tensor: Any,
    src_group_name: str | WorkerAddress,
    src_rank: int | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> Any:
    """Receive the next message from the peer into ``tensor`` in place; returns ``tensor``."""
    _tensor(tensor, "tensor")
    if not tensor.is_contiguous():
        raise ValueError("tensor: recv_tensor needs a contiguous buffer")
    peer = peer_name(src_group_name, src_rank, "src_group_name")
    _check_timeout(timeout)
    ep = get_endpoint()
    ep.check_peer_exists(peer)
    if async_op:
        return ep.recv(peer, kind="tensor", buffer=tensor)
    return ep.recv_now(peer, timeout, kind="tensor", buffer=tensor)


def _targets(groups: Any) -> list[str]:
    if isinstance(groups, (str, WorkerAddress)) or (
        isinstance(groups, tuple) and len(groups) == 2 and isinstance(groups[0], str)
    ):
        groups = [groups]
    if not isinstance(groups, (list, tuple)) or not groups:
        raise TypeError(
            "groups must be a non-empty list of (group_name, rank or ranks) or WorkerAddress"
        )
    names = []
    for g in groups:
        if isinstance(g, WorkerAddress):
            names.append(g.get_name())
            continue
        if not (isinstance(g, (tuple, list)) and len(g) == 2):
            raise TypeError(
                f"groups: each entry must be (group_name, ranks) or a WorkerAddress, got {g!r}"
            )
        name, ranks = g
        ranks = [ranks] if isinstance(ranks, int) else list(ranks)
        names.extend(peer_name(name, r, "groups") for r in ranks)
    return names


def broadcast(
    obj: Any = None,
    groups: Any = None,
    src_group_name: str | WorkerAddress | None = None,
    src_rank: int | None = None,
    async_op: bool = False,
) -> Any:
    """Send ``obj`` from one worker to every worker of ``groups``.

    The source calls it with ``obj`` and ``groups`` (``[(group_name, [ranks])]``); each
    destination calls it with ``src_group_name``/``src_rank`` and gets the object. The
    source encodes the object once and sends to all destinations concurrently.
    """
    ep = get_endpoint()
    src = (
        ep.name if src_group_name is None else peer_name(src_group_name, src_rank, "src_group_name")
    )
    if src != ep.name:
        ep.check_peer_exists(src)
        work = ep.recv(src)
        return work if async_op else work.wait()
    targets = [t for t in _targets(groups) if t != ep.name]
    for t in targets:
        ep.check_peer_exists(t)
    msg = encode(obj)
    works = [ep.send(t, msg, async_op=True) for t in targets]
    work = _AllWork(f"broadcast to {len(targets)} workers", works, obj)
    return work if async_op else work.wait()


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
            p._future.add_done_callback(_one)
        super().__init__(what, fut)
