"""The communication methods every ``px.Worker`` has (RLinf's Worker communication API)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx._base.address import WorkerAddress
    from phalanx.comm.channel import Channel
    from phalanx.comm.work import Work


logger = logging.getLogger(__name__)


class CommMixin:
    """``send``/``recv``, ``send_tensor``/``recv_tensor``, ``broadcast`` and channels.

    Peers are named by group name and rank (or a ``WorkerAddress``), in any group. Every
    method also works inside ``async def`` worker methods; with ``async_op=True`` it
    returns a ``Work`` that can be awaited.

    A worker announces its communication endpoint as it is created inside its Ray actor,
    so peers can reach it (and tell its incarnation) before it ever calls ``recv``.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> CommMixin:
        obj = super().__new__(cls)
        _announce_endpoint()
        return obj

    def send(
        self,
        object: Any,
        dst_group_name: str | WorkerAddress,
        dst_rank: int | None = None,
        async_op: bool = False,
        options: Any = None,
        piggyback_payload: Any = None,
    ) -> Work | None:
        """Send any picklable object (tensors inside travel as raw bytes) to a worker.

        ``options``: a ``CollectiveGroupOptions`` (see ``phalanx.comm.options``);
        ``piggyback_payload=p`` makes the receiver's ``recv`` return ``(object, p)``, as in RLinf.

        Args:
            object: any picklable object.
            dst_group_name: the receiver's group name, or its ``WorkerAddress``.
            dst_rank: the receiver's rank in that group.
            async_op: return a ``Work`` at once.
            options: a ``CollectiveGroupOptions``.
            piggyback_payload: an object the receiver gets beside ``object``.

        Returns:
            A ``Work`` if ``async_op``, else None.

        Raises:
            PeerDiedError: the receiver died.
        """
        from phalanx.comm import p2p

        return p2p.send(
            object,
            dst_group_name,
            dst_rank,
            async_op=async_op,
            options=options,
            piggyback_payload=piggyback_payload,
        )

    def recv(
        self,
        src_group_name: str | WorkerAddress,
        src_rank: int | None = None,
        async_op: bool = False,
        options: Any = None,
        timeout: float | None = None,
    ) -> Any:
        """The next object sent by that worker to this one (a ``Work`` if ``async_op``).

        Args:
            src_group_name: the sender's group name, or its ``WorkerAddress``.
            src_rank: the sender's rank in that group.
            async_op: return a ``Work`` at once.
            options: a ``CollectiveGroupOptions``.
            timeout: seconds to wait (no bound if None).

        Returns:
            The object, ``(object, piggyback)`` if the sender gave one, or a ``Work``.

        Raises:
            TimeoutError: nothing came within ``timeout``.
            PeerDiedError: the sender died.
        """
        from phalanx.comm import p2p

        return p2p.recv(
            src_group_name, src_rank, async_op=async_op, options=options, timeout=timeout
        )

    def send_tensor(
        self,
        tensor: Any,
        dst_group_name: str | WorkerAddress,
        dst_rank: int | None = None,
        async_op: bool = False,
        options: Any = None,
    ) -> Work | None:
        """Send one tensor for the receiver's ``recv_tensor`` into its own buffer.

        Args:
            tensor: the tensor to send.
            dst_group_name: the receiver's group name, or its ``WorkerAddress``.
            dst_rank: the receiver's rank in that group.
            async_op: return a ``Work`` at once.
            options: a ``CollectiveGroupOptions``.

        Returns:
            A ``Work`` if ``async_op``, else None.

        Raises:
            PeerDiedError: the receiver died.
        """
        from phalanx.comm import p2p

        return p2p.send_tensor(tensor, dst_group_name, dst_rank, async_op=async_op, options=options)

    def recv_tensor(
        self,
        tensor: Any,
        src_group_name: str | WorkerAddress,
        src_rank: int | None = None,
        async_op: bool = False,
        options: Any = None,
        timeout: float | None = None,
    ) -> Any:
        """Receive in place into ``tensor``; a dtype/size mismatch raises ``ValueError``.

        Args:
            tensor: the buffer to receive into.
            src_group_name, src_rank, async_op, options, timeout: as for ``recv``.

        Returns:
            None, or a ``Work`` if ``async_op``.

        Raises:
            ValueError: the tensor sent differs in dtype or size.
            TimeoutError: nothing came within ``timeout``.
            PeerDiedError: the sender died.
        """
        from phalanx.comm import p2p

        return p2p.recv_tensor(
            tensor, src_group_name, src_rank, async_op=async_op, options=options, timeout=timeout
        )

    def broadcast(
        self,
        object: Any = None,
        groups: list[tuple[str, Any]] | None = None,
        src: tuple[str, Any] | None = None,
        async_op: bool = False,
        options: Any = None,
    ) -> Any:
        """RLinf's broadcast: every member calls it alike; all return the source's object.

        ``groups=[(group_name, ranks), ...]``, ``src=(group_name, rank)`` (default: the
        first member). See ``phalanx.comm.p2p.broadcast``.

        Args:
            object: the object to send (read on the source only).
            groups: the members, as ``(group_name, ranks)`` pairs.
            src: the source as ``(group_name, rank)``.
            async_op: return a ``Work`` at once.
            options: a ``CollectiveGroupOptions``.

        Returns:
            The source's object, or a ``Work`` whose ``wait()`` returns it.
        """
        from phalanx.comm import p2p

        return p2p.broadcast(object, groups, src, async_op=async_op, options=options)

    def create_channel(
        self,
        channel_name: str | None = None,
        node_rank: int = 0,
        maxsize: int = 0,
        *,
        distributed: bool = False,
        local: bool = False,
        name: str | None = None,
        node_id: int | None = None,
    ) -> Channel:
        """Create a named channel (a FIFO per key) on node rank ``node_rank`` (RLinf's keywords).

        Args:
            channel_name, node_rank, maxsize: as for ``phalanx.create_channel``.
            distributed, local, name, node_id: the same.

        Returns:
            A handle to the new channel.

        Raises:
            ValueError: a channel of that name exists.
            NotImplementedError: ``distributed`` or ``local`` is True.
        """
        from phalanx.comm.channel import create_channel

        return create_channel(
            channel_name,
            node_rank,
            maxsize,
            distributed=distributed,
            local=local,
            name=name,
            node_id=node_id,
        )

    def connect_channel(
        self, channel_name: str | None = None, *, name: str | None = None
    ) -> Channel:
        """Connect to an existing channel by name.

        Args:
            channel_name: the channel's name.
            name: the same, by keyword.

        Returns:
            A handle to the channel.

        Raises:
            ValueError: no channel has that name.
        """
        from phalanx.comm.channel import connect_channel

        return connect_channel(channel_name, name=name)


def _announce_endpoint() -> None:
    """Open this actor's endpoint now (outside a named Ray actor: nothing to do)."""
    try:
        import ray

        if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
            return
        if not ray.get_runtime_context().get_actor_name():
            return
        from phalanx.comm.endpoint import get_endpoint

        get_endpoint()
    except Exception:  # noqa: BLE001 - it opens again on first use; say why it could not now
        logger.warning("could not open this worker's communication endpoint", exc_info=True)
