"""Layer 4: communication between workers (p2p messages, collective groups, channels).

Names are imported on first use; torch is loaded where tensors are handled.
"""

from __future__ import annotations

from phalanx._base.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "AuthenticationError": ".errors",
        "ChannelClosedError": ".errors",
        "ChannelEmpty": ".errors",
        "ChannelFull": ".errors",
        "CommError": ".errors",
        "PeerDiedError": ".errors",
        "PeerNotFoundError": ".errors",
        "CommConfig": ".config",
        "configure": ".config",
        "CommMixin": ".mixin",
        "Work": ".work",
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
        "CollectiveGroupOptions": ".options",
        "ShmHandle": ".shm",
        "share_tensors": ".shm",
        "select_transport": ".wire",
    },
)
