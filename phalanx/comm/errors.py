"""Errors of the communication layer; each names the peer it is about."""

from __future__ import annotations


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
