"""Which remote env runners are in service: RLlib's health flags, kept beside the group's.

RLlib's ``EnvRunnerGroup`` keeps one "healthy" flag per remote runner on top of Ray's
actor state. Any error from a runner (its env raised, its process died) takes it out of
service; only a probe (``probe_unhealthy_env_runners``) or a call made with
``mark_healthy=True`` that it answers brings it back, and each such return counts as one
restart. A phalanx ``WorkerGroup`` restarts a dead runner's process at once, in the
background; this ledger keeps such a runner out of service until the next probe, so
health and restart counts read as RLlib's do. It also holds the group's async requests
(RLlib drops the requests of a runner that goes out of service).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import ray


@dataclass
class AsyncRequest:
    """One request of ``foreach_env_runner_async``: its tag, rank and the actor it went to."""

    tag: str | None
    rank: int
    actor: Any


@dataclass
class RunnerHealth:
    """Service state of the remote runners of one ``EnvRunnerGroup`` (ranks are 0-based)."""

    out: set[int] = field(default_factory=set)
    # Out-of-service ranks stuck in a call that is still running (sample stalled, no restart).
    busy: dict[int, ray.ObjectRef] = field(default_factory=dict)
    # Ranks brought back by a ``mark_healthy`` call since the last probe.
    restored: set[int] = field(default_factory=set)
    # Ranks whose restart hooks the probe itself runs (the hook must not take them out).
    restoring: set[int] = field(default_factory=set)
    num_restarts: int = 0
    in_flight: dict[ray.ObjectRef, AsyncRequest] = field(default_factory=dict)
    # Results that were ready when a fetch raised an error: returned by the next fetch.
    held: list[tuple[str | None, int, Any]] = field(default_factory=list)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def reset(self) -> None:
        """Every runner in service, nothing in flight, no restart counted (a new group)."""
        with self.lock:
            self.out.clear()
            self.busy.clear()
            self.restored.clear()
            self.restoring.clear()
            self.in_flight.clear()
            self.held.clear()

    def take_out(self, rank: int) -> int:
        """Take ``rank`` out of service; its async requests are dropped (returns how many)."""
        with self.lock:
            self.out.add(rank)
            self.restored.discard(rank)
            dropped = [ref for ref, req in self.in_flight.items() if req.rank == rank]
            for ref in dropped:
                del self.in_flight[ref]
            return len(dropped)

    def bring_back(self, ranks: list[int]) -> list[int]:
        """Put ``ranks`` back in service; each one that was out counts as a restart."""
        back = []
        with self.lock:
            for r in ranks:
                if r in self.out:
                    self.out.discard(r)
                    self.busy.pop(r, None)
                    self.num_restarts += 1
                    back.append(r)
        return back

    def still_busy(self, rank: int) -> bool:
        """Whether ``rank`` is still inside the call it stalled in."""
        with self.lock:
            ref = self.busy.get(rank)
        if ref is None:
            return False
        ready, _ = ray.wait([ref], timeout=0, fetch_local=False)
        if ready:
            with self.lock:
                self.busy.pop(rank, None)
            return False
        return True

    def pop_restored(self) -> list[int]:
        with self.lock:
            back = sorted(self.restored)
            self.restored.clear()
            return back
