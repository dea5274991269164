"""Errors of the communication layer; each names the peer it is about."""

from __future__ import annotations

import asyncio
import queue


class CommError(RuntimeError):
    """A communication operation with ``peer`` failed."""

    def __init__(self, peer: str, message: str):
        self.peer = peer
        self.message = message
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.peer, self.message))


class PeerDiedError(CommError):
    """The peer process died (or stopped answering) while an operation waited on it."""


class PeerNotFoundError(CommError, ValueError):
    """No live worker (or channel) has that name."""


class AuthenticationError(CommError):
    """A connection did not prove it holds this Ray cluster's phalanx secret (``comm/auth.py``)."""


class ChannelClosedError(CommError):
    """The channel was closed (or its actor died): nothing can be put into it or taken from it."""


class ChannelEmpty(asyncio.QueueEmpty, queue.Empty):
    """``get_nowait`` on an empty key (RLinf raises ``asyncio.QueueEmpty``; also ``queue.Empty``)."""


class ChannelFull(asyncio.QueueFull, queue.Full):
    """``put_nowait`` on a full key (RLinf raises ``asyncio.QueueFull``; also ``queue.Full``)."""
