"""The communication methods every ``px.Worker`` has (RLinf's Worker communication API)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx._base.address import WorkerAddress
    from phalanx.comm.channel import Channel
    from phalanx.comm.work import Work


class CommMixin:
    """``send``/``recv``, ``send_tensor``/``recv_tensor``, ``broadcast`` and channels.

    Peers are named by group name and rank (or a ``WorkerAddress``), in any group. Every
    method also works inside ``async def`` worker methods; with ``async_op=True`` it
    returns a ``Work`` that can be awaited.
    """

    def send(
        self,
        object: Any,
        dst_group_name: str | WorkerAddress,
        dst_rank: int | None = None,
        async_op: bool = False,
    ) -> Work | None:
        """Send any picklable object (tensors inside travel as raw bytes) to a worker."""
        from phalanx.comm import p2p

        return p2p.send(object, dst_group_name, dst_rank, async_op=async_op)

    def recv(
        self,
        src_group_name: str | WorkerAddress,
        src_rank: int | None = None,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """The next object sent by that worker to this one (a ``Work`` if ``async_op``)."""
        from phalanx.comm import p2p

        return p2p.recv(src_group_name, src_rank, async_op=async_op, timeout=timeout)

    def send_tensor(
        self,
        tensor: Any,
        dst_group_name: str | WorkerAddress,
        dst_rank: int | None = None,
        async_op: bool = False,
    ) -> Work | None:
        """Send one tensor for the receiver's ``recv_tensor`` into its own buffer."""
        from phalanx.comm import p2p

        return p2p.send_tensor(tensor, dst_group_name, dst_rank, async_op=async_op)

    def recv_tensor(
        self,
        tensor: Any,
        src_group_name: str | WorkerAddress,
        src_rank: int | None = None,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """Receive in place into ``tensor``; a dtype/size mismatch raises ``ValueError``."""
        from phalanx.comm import p2p

        return p2p.recv_tensor(tensor, src_group_name, src_rank, async_op=async_op, timeout=timeout)

    def broadcast(
        self,
        object: Any = None,
        groups: Any = None,
        src_group_name: str | WorkerAddress | None = None,
        src_rank: int | None = None,
        async_op: bool = False,
    ) -> Any:
        """From this worker to ``groups`` (``[(name, [ranks])]``), or receive from ``src``."""
        from phalanx.comm import p2p

        return p2p.broadcast(object, groups, src_group_name, src_rank, async_op=async_op)

    def create_channel(self, name: str, node_id: int = 0, maxsize: int = 0) -> Channel:
        """Create a named channel (a FIFO per key) on node rank ``node_id``."""
        from phalanx.comm.channel import Channel

        return Channel.create(name, node_id=node_id, maxsize=maxsize)

    def connect_channel(self, name: str) -> Channel:
        """Connect to an existing channel by name."""
        from phalanx.comm.channel import Channel

        return Channel.connect(name)
