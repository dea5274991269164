"""Who a peer is and how to reach it: the announcement in Ray's KV store, liveness pings.

Every endpoint announces a ``PeerInfo`` (as JSON) under ``ep/<name>`` in the KV namespace
``phalanx_comm``. A worker's name is its Ray actor name ``group:rank`` (namespace
``phalanx``); a driver's is ``px-driver-<random>``. A peer's process is identified by
(actor id, pid): a restarted actor keeps its name and id but gets a new pid.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import ray

from phalanx.comm.errors import PeerDiedError, PeerTimeoutError

KV_NAMESPACE = "phalanx_comm"
ACTOR_NAMESPACE = "phalanx"
DRIVER_PREFIX = "px-driver-"

# A process of a peer: (Ray actor id, pid). A pid of None means "any process of that actor".
Ident = tuple[str, "int | None"]


@dataclass
class PeerInfo:
    """How to reach an endpoint, announced in Ray's KV store (as JSON)."""

    name: str
    incarnation: str
    ip: str
    port: int
    node_id: str
    pid: int
    is_actor: bool
    gpu_uuids: list[str] = field(default_factory=list)
    actor_id: str = ""

    @property
    def ident(self) -> Ident:
        return (self.actor_id, self.pid)

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> PeerInfo:
        fields = json.loads(raw)
        if not isinstance(fields, dict):
            raise ValueError("a peer description must be a JSON object")
        return cls(**fields)


def same_process(a: Ident, b: Ident) -> bool:
    """Whether two identities can be the same process (an unknown pid matches any)."""
    return a[0] == b[0] and (a[1] is None or b[1] is None or a[1] == b[1])


def kv_key(name: str) -> bytes:
    return f"ep/{name}".encode()


def announced(name: str) -> PeerInfo | None:
    """The endpoint ``name`` announces in Ray's KV store now (None if none)."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(kv_key(name), namespace=KV_NAMESPACE)
    return PeerInfo.from_json(raw) if raw else None


def announce(info: PeerInfo) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(
        kv_key(info.name), info.to_json(), overwrite=True, namespace=KV_NAMESPACE
    )


def withdraw(info: PeerInfo) -> None:
    """Remove ``info``'s announcement if it is still the current one (Ray may be gone)."""
    from ray.experimental import internal_kv

    try:
        if ray.is_initialized():
            cur = announced(info.name)
            if cur is not None and cur.incarnation == info.incarnation:
                internal_kv._internal_kv_del(kv_key(info.name), namespace=KV_NAMESPACE)
    except Exception:  # noqa: BLE001 - Ray may be shutting down
        pass


def gpu_uuids() -> list[str]:
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return [
                str(torch.cuda.get_device_properties(i).uuid)
                for i in range(torch.cuda.device_count())
            ]
    except Exception:  # noqa: BLE001 - no usable CUDA
        pass
    return []


def is_pingable(peer: str, own_name: str) -> bool:
    """Whether ``peer`` is a Ray actor that answers ``_px_ping`` (not a driver, not us)."""
    return not peer.startswith(DRIVER_PREFIX) and peer != own_name


def actor_now(peer: str) -> Any:
    """The actor registered as ``peer`` now; ``PeerDiedError`` when there is none."""
    try:
        return ray.get_actor(peer, namespace=ACTOR_NAMESPACE)
    except ValueError:
        raise PeerDiedError(peer, f"peer {peer} is dead (no live actor of that name)") from None


def ping(peer: str) -> tuple[str, Any]:
    """Ping the actor registered as ``peer``: (its actor id, the ref of its pid)."""
    actor = actor_now(peer)
    return actor._actor_id.hex(), actor._px_ping.remote()


def ping_result(peer: str, ref: Any, timeout: float | None = None) -> int:
    """The pid a ping returned; ``PeerDiedError`` if the actor died, ``PeerTimeoutError``
    if it did not answer within ``timeout``."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise no_answer(peer, timeout) from None
    except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
        raise PeerDiedError(peer, f"peer {peer} died: {str(e).splitlines()[0]}") from None


def no_answer(peer: str, timeout: float) -> PeerTimeoutError:
    return PeerTimeoutError(
        peer,
        f"peer {peer} did not answer a liveness probe in {timeout}s (its actor is alive "
        "but not answering: stopped or overloaded; PHALANX_COMM_PEER_TIMEOUT_S)",
    )


def not_found_text(peer: str) -> str:
    group, _, rank = peer.rpartition(":")
    if group and rank.isdigit():
        try:
            ray.get_actor(f"{group}:0", namespace=ACTOR_NAMESPACE)
        except ValueError:
            return f"no worker group named {group!r} (looking for worker {peer})"
        return f"worker group {group!r} has no rank {rank}"
    return f"no worker or channel named {peer!r}"
