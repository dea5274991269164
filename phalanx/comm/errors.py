"""Errors of the communication layer; each names the peer it is about."""

from __future__ import annotations

import asyncio
import errno
import queue


class CommError(RuntimeError):
    """A communication operation with ``peer`` failed.

    Args:
        peer: the peer's worker name.
        message: what failed.
    """

    def __init__(self, peer: str, message: str):
        self.peer = peer
        self.message = message
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.peer, self.message))


class PeerDiedError(CommError):
    """The peer process died (or stopped answering) while an operation waited on it.

    Args:
        peer: the peer's worker name.
        message: what failed.
    """


class PeerTimeoutError(PeerDiedError):
    """The peer's actor is alive but did not answer for ``peer_timeout_s`` (stopped, overloaded).

    A ``PeerDiedError`` for callers that treat both alike; the operations waiting on the
    peer fail, later ones try again (they work once the peer answers).
    """


class PeerNotFoundError(CommError, ValueError):
    """No live worker (or channel) has that name."""


class AuthenticationError(CommError):
    """A connection did not prove it holds this Ray cluster's phalanx secret (``comm/auth.py``)."""


class ChannelClosedError(CommError):
    """The channel was closed (or its actor died): nothing can be put into it or taken from it."""


class ShmFullError(OSError):
    """A shared-memory segment could not be created: ``/dev/shm`` lacks the space.

    An ``OSError`` (errno ``ENOSPC``) naming ``/dev/shm``, the bytes needed and the bytes
    free, so callers can catch it and fall back to another transport.
    """

    def __init__(self, path: str, needed: int, free: int | None):
        self.path, self.needed, self.free = path, needed, free
        free_text = "unknown" if free is None else f"{free:,} bytes ({free / 2**20:.1f} MiB)"
        super().__init__(
            errno.ENOSPC,
            f"/dev/shm is full: a shared-memory segment of {needed:,} bytes "
            f"({needed / 2**20:.1f} MiB) does not fit, free: {free_text}",
            path,
        )

    def __reduce__(self):
        return (type(self), (self.path, self.needed, self.free))


class ChannelEmpty(asyncio.QueueEmpty, queue.Empty):
    """``get_nowait`` on an empty key (RLinf raises ``asyncio.QueueEmpty``; also ``queue.Empty``)."""


class ChannelFull(asyncio.QueueFull, queue.Full):
    """``put_nowait`` on a full key (RLinf raises ``asyncio.QueueFull``; also ``queue.Full``)."""
