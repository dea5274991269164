"""Channels: named FIFO queues (one per key) that pipeline work between groups.

A channel is a small Ray actor (``px-channel:<name>``) with its own communication
endpoint. Producers and consumers talk to it over the same point-to-point path as
``send``/``recv``, so tensor payloads travel as raw bytes (shared memory on one node),
never pickled. The server is event-driven: a ``get`` waiting on an empty key is a
parked request, so it never blocks ``put``s. ``maxsize`` bounds each key's queue; a
``put`` to a full key waits (back-pressure) until a consumer takes an item.

``get_batch(target_weight)`` returns the oldest items whose weights add up to at least
``target_weight`` (the last item may overshoot), waiting until that much is queued.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections import defaultdict, deque
from typing import Any

import ray

from phalanx._base import trace as _trace
from phalanx.comm.endpoint import ACTOR_NAMESPACE, get_endpoint
from phalanx.comm.errors import CommError, PeerDiedError
from phalanx.comm.wire import encode
from phalanx.comm.work import Work

DEFAULT_KEY = "default"
_PREFIX = "px-channel:"
_OWNED: dict[str, Any] = {}  # actor handles of channels created by this process (keep them alive)


class _ChannelServer:
    """Runs inside the channel actor: per-key queues, parked gets and blocked puts."""

    def __init__(self, name: str, maxsize: int):
        self.name = name
        self.maxsize = maxsize
        self.lock = threading.Lock()
        self.items: dict[Any, deque[tuple[Any, float]]] = defaultdict(deque)
        self.getters: dict[Any, deque[tuple[str, int, float | None]]] = defaultdict(deque)
        self.putters: dict[Any, deque[tuple[str, int, Any, float]]] = defaultdict(deque)
        self.ep = get_endpoint()
        self.ep.default_handler = self._on_message

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "maxsize": self.maxsize,
            "endpoint": self.ep.name,
            "pid": os.getpid(),
        }

    def _px_ping(self) -> int:
        return os.getpid()

    # -- request handling (reader threads) ---------------------------------------------
    def _on_message(self, client: str, msg: Any) -> None:
        if isinstance(msg, BaseException):  # the client died: drop its parked requests
            with self.lock:
                for d in (*self.getters.values(), *self.putters.values()):
                    kept = [e for e in d if e[0] != client]
                    d.clear()
                    d.extend(kept)
            return
        op, req, key, a, b = msg
        replies: list[tuple[str, int, bool, Any]] = []
        with self.lock:
            q = self.items[key]
            if op == "put" or op == "put_nowait":
                if self.maxsize == 0 or (len(q) < self.maxsize and not self.putters[key]):
                    q.append((a, b))
                    if req >= 0:
                        replies.append((client, req, True, None))
                elif op == "put_nowait":
                    replies.append(
                        (
                            client,
                            req,
                            False,
                            queue.Full(f"channel {self.name!r} key {key!r} is full"),
                        )
                    )
                else:
                    self.putters[key].append((client, req, a, b))
                self._serve(key, replies)
            elif op == "get" or op == "get_batch":
                self.getters[key].append((client, req, b if op == "get_batch" else None))
                self._serve(key, replies)
            elif op == "get_nowait":
                if q and not self.getters[key]:
                    replies.append((client, req, True, q.popleft()[0]))
                    self._refill(key, replies)
                else:
                    replies.append(
                        (
                            client,
                            req,
                            False,
                            queue.Empty(f"channel {self.name!r} key {key!r} is empty"),
                        )
                    )
            elif op == "qsize":
                replies.append((client, req, True, len(q)))
            elif op == "full":
                replies.append((client, req, True, self.maxsize > 0 and len(q) >= self.maxsize))
            else:
                replies.append(
                    (client, req, False, ValueError(f"unknown channel operation {op!r}"))
                )
        for to, req_id, ok, value in replies:
            try:
                self.ep.send(to, encode((req_id, ok, value)), async_op=False)
            except CommError:
                pass  # that client is gone; its requests die with it

    def _refill(self, key: Any, replies: list) -> None:
        q, putters = self.items[key], self.putters[key]
        while putters and (self.maxsize == 0 or len(q) < self.maxsize):
            client, req, item, weight = putters.popleft()
            q.append((item, weight))
            replies.append((client, req, True, None))

    def _serve(self, key: Any, replies: list) -> None:
        q, getters = self.items[key], self.getters[key]
        while getters:
            client, req, target = getters[0]
            if target is None:
                if not q:
                    self._refill(key, replies)
                    if not q:
                        return
                getters.popleft()
                replies.append((client, req, True, q.popleft()[0]))
            else:
                total = sum(w for _, w in q) + sum(p[3] for p in self.putters[key])
                if total < target:
                    return
                getters.popleft()
                batch, acc = [], 0.0
                while acc < target:
                    if not q:
                        self._refill_one(key, replies)
                    item, w = q.popleft()
                    batch.append(item)
                    acc += w
                replies.append((client, req, True, batch))
            self._refill(key, replies)

    def _refill_one(self, key: Any, replies: list) -> None:
        client, req, item, weight = self.putters[key].popleft()
        self.items[key].append((item, weight))
        replies.append((client, req, True, None))


class _Client:
    """This process's connection to one channel: request ids and reply futures."""

    _clients: dict[str, _Client] = {}
    _lock = threading.Lock()

    def __init__(self, server: str):
        self.server = server
        self.ep = get_endpoint()
        self.ids = itertools.count()
        self.pending: dict[int, Any] = {}
        self.plock = threading.Lock()
        self.ep.set_handler(server, self._on_reply)
        self.ep.inbox(server).has_pending = lambda: bool(self.pending)

    @classmethod
    def of(cls, server: str) -> _Client:
        with cls._lock:
            client = cls._clients.get(server)
            if client is None or client.ep is not get_endpoint():
                client = cls._clients[server] = cls(server)
            return client

    def _on_reply(self, peer: str, msg: Any) -> None:
        if isinstance(msg, BaseException):
            with self.plock:
                futs, self.pending = list(self.pending.values()), {}
            err = msg if isinstance(msg, CommError) else PeerDiedError(peer, str(msg))
            for f in futs:
                if not f.done():
                    f.set_exception(err)
            return
        req, ok, value = msg
        with self.plock:
            fut = self.pending.pop(req, None)
        if fut is None:
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def request(
        self, what: str, op: str, key: Any, a: Any = None, b: Any = None, reply: bool = True
    ) -> Work:
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()
        req = next(self.ids) if reply else -1
        if reply:
            with self.plock:
                self.pending[req] = fut
        try:
            self.ep.send(self.server, encode((op, req, key, a, b)), async_op=False)
        except BaseException:
            with self.plock:
                self.pending.pop(req, None)
            raise
        if not reply:
            fut.set_result(None)
        return Work(what, fut)


class Channel:
    """A handle to a named channel; picklable, so it can be passed to workers.

    Create with ``Channel.create(name, node_id=0, maxsize=0)`` (or a worker's
    ``self.create_channel``), connect with ``Channel.connect(name)``.
    """

    def __init__(self, name: str, maxsize: int):
        self.name = name
        self.maxsize = maxsize
        self._server = _PREFIX + name

    # -- creation ---------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, node_id: int = 0, maxsize: int = 0) -> Channel:
        """Start the channel actor on node rank ``node_id``; each key holds at most ``maxsize`` items (0: unbounded)."""
        _check_name(name)
        if isinstance(node_id, bool) or not isinstance(node_id, int) or node_id < 0:
            raise ValueError(f"node_id must be a non-negative int (a node rank), got {node_id!r}")
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
            raise ValueError(f"maxsize must be a non-negative int, got {maxsize!r}")
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from phalanx.resources.cluster import Cluster

        node = Cluster().node(node_id)
        try:
            ray.get_actor(_PREFIX + name, namespace=ACTOR_NAMESPACE)
        except ValueError:
            pass
        else:
            raise ValueError(f"name: a channel named {name!r} already exists (use connect_channel)")
        actor = (
            ray.remote(_ChannelServer)
            .options(
                name=_PREFIX + name,
                namespace=ACTOR_NAMESPACE,
                num_cpus=0,
                max_concurrency=4,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
            )
            .remote(name, maxsize)
        )
        ray.get(actor.describe.remote(), timeout=300)
        _OWNED[name] = actor
        return cls(name, maxsize)

    @classmethod
    def connect(cls, name: str) -> Channel:
        """A handle to an existing channel; ``ValueError`` naming it if there is none."""
        _check_name(name)
        try:
            actor = ray.get_actor(_PREFIX + name, namespace=ACTOR_NAMESPACE)
        except ValueError:
            raise ValueError(
                f"name: no channel named {name!r} (create it with create_channel)"
            ) from None
        info = ray.get(actor.describe.remote(), timeout=120)
        return cls(name, info["maxsize"])

    def close(self) -> None:
        """Stop the channel actor (items still queued are lost)."""
        actor = _OWNED.pop(self.name, None)
        if actor is None:
            try:
                actor = ray.get_actor(self._server, namespace=ACTOR_NAMESPACE)
            except ValueError:
                return
        ray.kill(actor, no_restart=True)

    def __reduce__(self):
        return (Channel, (self.name, self.maxsize))

    def __repr__(self) -> str:
        return f"Channel({self.name!r}, maxsize={self.maxsize})"

    # -- operations -------------------------------------------------------------------
    def _client(self) -> _Client:
        return _Client.of(self._server)

    def put(
        self, item: Any, key: Any = DEFAULT_KEY, weight: float = 1, async_op: bool = False
    ) -> Work | None:
        """Append ``item`` to ``key``'s queue; waits while that queue is full."""
        _check_weight(weight)
        bounded = self.maxsize > 0
        t0 = time.perf_counter() if _trace.ON else 0.0
        work = self._client().request(
            f"put to channel {self.name!r}", "put", key, item, weight, reply=bounded
        )
        if async_op:
            return work
        work.wait()
        if t0:
            _trace.record_event(
                "channel.put", t0, time.perf_counter(), cat="comm", channel=self.name
            )
        return None

    def put_nowait(self, item: Any, key: Any = DEFAULT_KEY, weight: float = 1) -> None:
        """Append ``item`` or raise ``queue.Full`` at once."""
        _check_weight(weight)
        self._client().request(
            f"put_nowait to {self.name!r}", "put_nowait", key, item, weight
        ).wait()

    def get(
        self, key: Any = DEFAULT_KEY, async_op: bool = False, timeout: float | None = None
    ) -> Any:
        """The oldest item of ``key`` (waits until there is one); a ``Work`` if ``async_op``."""
        t0 = time.perf_counter() if _trace.ON else 0.0
        work = self._client().request(f"get from channel {self.name!r}", "get", key)
        if async_op:
            return work
        item = work.wait(timeout)
        if t0:
            _trace.record_event(
                "channel.get", t0, time.perf_counter(), cat="comm", channel=self.name
            )
        return item

    def get_nowait(self, key: Any = DEFAULT_KEY) -> Any:
        """The oldest item of ``key`` or ``queue.Empty`` at once."""
        return self._client().request(f"get_nowait from {self.name!r}", "get_nowait", key).wait()

    def get_batch(
        self,
        target_weight: float,
        key: Any = DEFAULT_KEY,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """The oldest items of ``key`` whose weights reach ``target_weight`` (a list)."""
        if (
            isinstance(target_weight, bool)
            or not isinstance(target_weight, (int, float))
            or target_weight <= 0
        ):
            raise ValueError(f"target_weight must be a positive number, got {target_weight!r}")
        work = self._client().request(
            f"get_batch from {self.name!r}", "get_batch", key, None, target_weight
        )
        return work if async_op else work.wait(timeout)

    def qsize(self, key: Any = DEFAULT_KEY) -> int:
        """Items queued under ``key`` (puts blocked on a full queue not counted)."""
        return self._client().request("qsize", "qsize", key).wait()

    def empty(self, key: Any = DEFAULT_KEY) -> bool:
        return self.qsize(key) == 0

    def full(self, key: Any = DEFAULT_KEY) -> bool:
        return self._client().request("full", "full", key).wait()


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")


def _check_weight(weight: Any) -> None:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
        raise ValueError(f"weight must be a non-negative number, got {weight!r}")


def create_channel(name: str, node_id: int = 0, maxsize: int = 0) -> Channel:
    """Create a channel from the driver or any worker (see ``Channel.create``)."""
    return Channel.create(name, node_id=node_id, maxsize=maxsize)


def connect_channel(name: str) -> Channel:
    """Connect to a channel by name (see ``Channel.connect``)."""
    return Channel.connect(name)
