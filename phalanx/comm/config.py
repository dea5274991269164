"""Settings of the communication layer, read from the environment once per process.

``PHALANX_COMM_PEER_CHECK_S`` (default 1.0): how often a waiting operation checks that
its peer is still alive. ``PHALANX_COMM_PEER_TIMEOUT_S`` (default 20): a peer whose
liveness probe does not answer for this long counts as dead. A peer process that exits
is noticed at once (its socket closes); one whose actor Ray reports dead or restarted,
within one check interval. ``PHALANX_COMM_CONNECT_TIMEOUT_S`` (default 30): how long a
send waits for a live peer to announce its endpoint (workers announce theirs when they
start, so this only covers start-up); a dead peer fails the send at once.
``PHALANX_COMM_RENDEZVOUS_TIMEOUT_S`` (default 600): how long members of a collective
group wait for each other to join (they may reach ``get_group`` minutes apart).
``PHALANX_COMM_SHM`` (default 1): use shared memory between processes
of one node. ``PHALANX_COMM_SHM_MIN_BYTES`` / ``PHALANX_COMM_INLINE_MAX_BYTES``: size
thresholds of the transport decision (see ``wire.select_transport``).
``PHALANX_COMM_POOL_SLOTS`` (default 4) / ``PHALANX_COMM_POOL_BYTES`` (default
1 GiB): how many reusable buffers, of how many bytes in all, this process keeps per peer:
shared-memory segments for what it sends (``shm.SegmentPool``), receive buffers for what
arrives through gloo (``buffers.BufferPool``).
``PHALANX_COMM_MAX_FRAME_BYTES`` (default 256 MiB): the largest frame (pickled metadata
plus inline bytes) a connection may announce; tensors and large buffers travel outside
the frame (shared memory, gloo), so normal frames are kilobytes. A larger header breaks
the connection. ``PHALANX_COMM_MAX_HANDSHAKES`` (default 64): connections that may be in
their authentication handshake at once; more are closed at once.
``PHALANX_COMM_BIND_ADDRESS`` (default: unset): the address phalanx's listeners (and the
TCP stores and gloo groups they start) bind to; unset, the node address Ray uses.
``px.Cluster(_node_ip_address="127.0.0.1")`` sets it for the Ray it starts (Ray itself
replaces a loopback node address by the machine's network address), so a single-machine
run stays on loopback. It is read when an endpoint starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


@dataclass
class CommConfig:
    """Tunables of the communication layer (see the module docstring)."""

    peer_check_interval_s: float = 1.0
    peer_timeout_s: float = 20.0
    connect_timeout_s: float = 30.0
    rendezvous_timeout_s: float = 600.0
    use_shm: bool = True
    shm_min_bytes: int = 256 * 1024
    inline_max_bytes: int = 1024 * 1024
    pool_slots: int = 4
    pool_bytes: int = 1 << 30
    max_frame_bytes: int = 256 << 20
    max_handshakes: int = 64


def _from_env() -> CommConfig:
    return CommConfig(
        peer_check_interval_s=_env_float("PHALANX_COMM_PEER_CHECK_S", 1.0),
        peer_timeout_s=_env_float("PHALANX_COMM_PEER_TIMEOUT_S", 20.0),
        connect_timeout_s=_env_float("PHALANX_COMM_CONNECT_TIMEOUT_S", 30.0),
        rendezvous_timeout_s=_env_float("PHALANX_COMM_RENDEZVOUS_TIMEOUT_S", 600.0),
        use_shm=os.environ.get("PHALANX_COMM_SHM", "1") not in ("0", "false", "False"),
        shm_min_bytes=int(_env_float("PHALANX_COMM_SHM_MIN_BYTES", 256 * 1024)),
        inline_max_bytes=int(_env_float("PHALANX_COMM_INLINE_MAX_BYTES", 1024 * 1024)),
        pool_slots=int(_env_float("PHALANX_COMM_POOL_SLOTS", 4)),
        pool_bytes=int(_env_float("PHALANX_COMM_POOL_BYTES", 1 << 30)),
        max_frame_bytes=int(_env_float("PHALANX_COMM_MAX_FRAME_BYTES", 256 << 20)),
        max_handshakes=int(_env_float("PHALANX_COMM_MAX_HANDSHAKES", 64)),
    )


CONFIG = _from_env()
BIND_ADDRESS_ENV = "PHALANX_COMM_BIND_ADDRESS"


def bind_address() -> str:
    """``PHALANX_COMM_BIND_ADDRESS`` now ("" when unset: use Ray's node address)."""
    return os.environ.get(BIND_ADDRESS_ENV, "").strip()


def configure(**changes: float | int | bool) -> CommConfig:
    """Change settings of this process's communication layer; returns the new settings."""
    for key, value in changes.items():
        if not hasattr(CONFIG, key):
            raise ValueError(f"configure: unknown setting {key!r} (known: {sorted(vars(CONFIG))})")
        setattr(CONFIG, key, type(getattr(CONFIG, key))(value))
    return CONFIG
