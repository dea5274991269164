"""Layer 4: communication between workers (p2p messages, collective groups, channels).

Imports nothing heavy at package import; torch is loaded where tensors are handled.
"""

from __future__ import annotations

from phalanx._base.lazy import lazy_exports
from phalanx.comm.config import CommConfig, configure
from phalanx.comm.errors import (
    AuthenticationError,
    ChannelClosedError,
    ChannelEmpty,
    ChannelFull,
    CommError,
    PeerDiedError,
    PeerNotFoundError,
)
from phalanx.comm.mixin import CommMixin
from phalanx.comm.work import Work

_LAZY = {
    "send": ".p2p",
    "recv": ".p2p",
    "send_tensor": ".p2p",
    "recv_tensor": ".p2p",
    "broadcast": ".p2p",
    "Channel": ".channel",
    "create_channel": ".channel",
    "connect_channel": ".channel",
    "CollectiveGroup": ".collective",
    "get_group": ".collective",
    "ShmHandle": ".shm",
    "share_tensors": ".shm",
    "select_transport": ".wire",
}


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "AuthenticationError",
    "Channel",
    "ChannelClosedError",
    "ChannelEmpty",
    "ChannelFull",
    "CollectiveGroup",
    "CommConfig",
    "CommError",
    "CommMixin",
    "PeerDiedError",
    "PeerNotFoundError",
    "ShmHandle",
    "Work",
    "broadcast",
    "configure",
    "connect_channel",
    "create_channel",
    "get_group",
    "recv",
    "recv_tensor",
    "select_transport",
    "send",
    "send_tensor",
    "share_tensors",
]
