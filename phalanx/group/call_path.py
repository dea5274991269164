"""What every face of a group shares: its members, their health, results, and the one dispatch.

``WorkerGroup`` holds one :class:`CallPath`, and so do its NeMo-RL face (``nemo_face``)
and RLlib face (``rllib_face``); they reach the group's state only through its public
attributes and methods. Every call of every face ends in :meth:`CallPath.call`, which puts
arguments shared by several ranks into the object store once and returns a handle.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

import ray

from phalanx._base.checks import check_ranks
from phalanx.group import dispatch
from phalanx.group import hang as _hang
from phalanx.group.collect import Collector
from phalanx.group.fault import FaultState
from phalanx.group.futures import GroupHandle
from phalanx.group.launch import Roster
from phalanx.group.requests import AsyncRequests
from phalanx.observe import trace as _trace

NEW, RUNNING, SHUT_DOWN = "new", "running", "shut down"


class UnknownMethodError(AttributeError, ValueError):
    """The worker class has no public method of that name."""


class CallPath:
    """One group's shared state and its dispatch.

    Attributes:
        roster: the live actors by rank, their metadata and the worker class's methods.
        fault: health and restarts of the ranks.
        collector: the one result path (handles, futures and the faces collect through it).
        requests: the async requests in flight (RLlib's ``foreach_worker_async``).
        ranks: every rank, in order (empty until launched and after shutdown).
        state: ``NEW``, ``RUNNING`` or ``SHUT_DOWN``.
        watchdog: follows every call for hang reports, or None.

    Args:
        group: the ``WorkerGroup`` its handles and traces refer to; its ``name`` and
            ``name_prefix`` name it in errors.
        roster: the group's roster.
        fault: the group's fault state.
    """

    def __init__(self, group: Any, roster: Roster, fault: FaultState) -> None:
        self._group = group
        self.roster = roster
        self.fault = fault
        self.collector = Collector(group, fault)
        self.requests = AsyncRequests()
        self.ranks: list[int] = []
        self.state = NEW
        self.watchdog: _hang.Watchdog | None = None

    @property
    def name(self) -> str:
        """The group's name (empty until launched)."""
        return self._group.name

    @property
    def world_size(self) -> int:
        """The number of workers."""
        return len(self.roster.actors)

    def check_live(self) -> None:
        """Raise ``RuntimeError`` unless the group is launched and not shut down."""
        if self.state != RUNNING:
            g = self._group
            what = g.name or g.name_prefix or self.roster.builder.class_name
            if self.state == SHUT_DOWN:
                raise RuntimeError(f"group {what!r} is shut down; launch a new group")
            raise RuntimeError(f"group {what!r} is not launched yet")

    def check_method(self, method: str) -> None:
        """Raise ``UnknownMethodError`` unless ``method`` is a public method of the workers."""
        if method not in self.roster.methods:
            self.check_live()
            raise UnknownMethodError(
                f"method_name {method!r}: {self.roster.builder.class_name} has no public "
                f"method of that name (known: {sorted(self.roster.methods)})"
            )

    def check_ranks(self, ranks: Any, arg: str) -> list[int]:
        """``ranks`` checked against the live group (repeats allowed), naming ``arg``."""
        self.check_live()
        return check_ranks(ranks, self.world_size, arg, repeats="allow")

    def broadcast_health(self) -> str:
        """Same-arguments calls to every rank may go on without dead ranks when ignoring failures."""
        return "skip" if self.fault.policy.ignore_failures else "restart"

    def bare_refs(self, handle: GroupHandle) -> list[Any]:
        """A handle's refs for faces that return bare Ray refs; the label is kept for
        ``MultiWorkerFuture`` errors."""
        self.collector.note_label(handle.refs, handle.method)
        return handle.refs

    def call(
        self,
        method: str,
        calls: list[tuple[int, tuple, dict]],
        fn: Callable[..., Any] | None = None,
        *,
        health: str = "restart",
    ) -> GroupHandle:
        """The one dispatch: for each (rank, args, kwargs) start the call; return a handle.

        ``health`` says what to do with a called rank that is not healthy: ``"restart"``
        (wait for or start its restart; raise naming it if that cannot be),
        ``"skip"`` (leave it out; the handle lists it in ``skipped``) or ``"any"`` (call it).
        """
        if self.state != RUNNING:
            self.check_live()
        t0 = time.perf_counter() if _trace.ON else 0.0
        if fn is None:
            self.check_method(method)
        skipped = None
        if self.fault.not_healthy and health != "any":
            ready, skipped = self.fault.ensure_ready(
                [c[0] for c in calls], method, skip=health == "skip"
            )
            if skipped:
                keep = set(ready)
                calls = [c for c in calls if c[0] in keep]
        stream = fn is None and self.roster.methods[method] in ("gen", "asyncgen")
        try:
            shared = _share(calls) if len(calls) > 1 else None
        except (pickle.PicklingError, RecursionError) as e:  # a value passed to every rank
            rank, args, kwargs = calls[0]
            raise dispatch.unpicklable_argument(self.name, method, rank, args, kwargs, e) from None
        refs = []
        actors = self.roster.actors
        for rank, args, kwargs in calls:
            if shared:
                args = tuple(shared.get(id(a), a) for a in args)
                kwargs = {k: shared.get(id(v), v) for k, v in kwargs.items()}
            actor = actors[rank]
            try:
                if fn is not None:
                    refs.append(actor._px_apply.remote(fn, *args, **kwargs))
                elif stream:
                    # Each public method has its own actor method (see host_class_for).
                    remote = getattr(actor, method).options(num_returns="streaming")
                    refs.append(remote.remote(*args, **kwargs))
                else:
                    refs.append(getattr(actor, method).remote(*args, **kwargs))
            except (pickle.PicklingError, RecursionError) as e:
                raise dispatch.unpicklable_argument(
                    self.name, method, rank, args, kwargs, e
                ) from None
        handle = GroupHandle(self._group, method, [c[0] for c in calls], refs)
        if skipped:
            handle.skipped = skipped
        if self.watchdog is not None:
            self.watchdog.track(handle)
        if t0:
            _trace.driver_call(self._group, method, calls, handle, t0)
        return handle


def _share(calls: list[tuple[int, tuple, dict]]) -> dict[int, Any]:
    """Values passed to several ranks and too big to inline go to the object store once."""
    values = dispatch.shared_values(calls, lambda v: isinstance(v, ray.ObjectRef))
    return {key: ray.put(v) for key, v in values.items()}


__all__ = ["CallPath", "UnknownMethodError", "NEW", "RUNNING", "SHUT_DOWN"]
