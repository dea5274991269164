"""Channels: named FIFO queues (one per key) that pipeline work between groups (RLinf's API).

A channel is a small Ray actor (``px-channel:<name>``) with its own communication
endpoint. Producers and consumers talk to it over the same point-to-point path as
``send``/``recv``, so tensor payloads travel as raw bytes (shared memory on one node),
never pickled. The server is event-driven: a ``get`` waiting on an empty key is a
parked request, so it never blocks ``put``s. ``maxsize`` bounds each key's queue; a
``put`` to a full key waits (back-pressure) until a consumer takes an item.

As in RLinf: ``put(item, weight=0, key=DEFAULT_KEY, async_op=False)``; ``get_nowait`` /
``put_nowait`` raise ``asyncio.QueueEmpty`` / ``asyncio.QueueFull`` (phalanx's
``ChannelEmpty`` / ``ChannelFull``, which are also ``queue.Empty`` / ``queue.Full``);
``get_batch(target_weight)`` takes the oldest items while the next one would not push
the total over ``target_weight``, and stops once the total reaches it (with weights
1, 2, 3 and a target of 2 it returns the first item only; an empty key is waited on);
``str(channel)`` shows the items queued under each key. A ``get`` that times out is
withdrawn, so no item is handed to a receive nobody waits for. After ``close`` every
operation raises ``ChannelClosedError``.

A channel actor that stops answering (stopped, overloaded) is not a closed channel: a
``get(timeout=t)`` raises ``TimeoutError`` after about ``t`` s (at most one second more,
spent asking the actor to withdraw it) saying the actor did not answer; an item the actor
hands out for it later goes back to its place in its key. Operations waiting when the
actor stays silent for ``peer_timeout_s`` fail with ``PeerTimeoutError`` (so do the gets:
what the actor hands them later goes back too); the handle keeps working once the actor
answers again. A ``put`` that returned reaches the queue, in order, also across such a
silence; one that cannot be sent raises. Only a closed channel or a dead actor raises
``ChannelClosedError``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import ray

from phalanx._base.checks import check_int, check_name, check_number, check_timeout
from phalanx.comm.endpoint import ACTOR_NAMESPACE, get_endpoint
from phalanx.comm.errors import (
    ChannelClosedError,
    ChannelEmpty,
    ChannelFull,
    CommError,
    PeerDiedError,
    PeerTimeoutError,
)
from phalanx.comm.wire import encode
from phalanx.comm.work import Work
from phalanx.observe import trace as _trace

DEFAULT_KEY = "default_queue"  # RLinf's name of the default queue
_PREFIX = "px-channel:"
_OWNED: dict[str, Any] = {}  # actor handles of channels created by this process (keep them alive)
_CLOSED = "__px_closed__"  # the server's notice to its clients that the channel was closed
CANCEL_GRACE_S = 1.0  # how long a timed-out get waits for the actor to withdraw it


@dataclass
class _Getter:
    """A parked ``get`` (``target is None``) or ``get_batch`` with what it has taken so far."""

    client: str
    req: int
    target: float | None = None
    batch: list[tuple[Any, float, int]] = field(default_factory=list)
    acc: float = 0.0


class _ChannelServer:
    """Runs inside the channel actor: per-key queues, parked gets and blocked puts."""

    def __init__(self, name: str, maxsize: int):
        self.name = name
        self.maxsize = maxsize
        self.closed = False
        self.lock = threading.Lock()
        # Per key: (item, weight, sequence number); the number puts an item handed out
        # and given back (its get was given up on) back in its place.
        self.items: dict[Any, deque[tuple[Any, float, int]]] = defaultdict(deque)
        self.seq = itertools.count()
        self.getters: dict[Any, deque[_Getter]] = defaultdict(deque)
        self.putters: dict[Any, deque[tuple[str, int, Any, float]]] = defaultdict(deque)
        self.clients: set[str] = set()
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

    def close(self) -> int:
        """Refuse further requests and tell every client; returns how many were told."""
        err = ChannelClosedError(self.ep.name, f"channel {self.name!r} was closed")
        replies: list[tuple[str, int, bool, Any]] = []
        with self.lock:
            self.closed = True
            for d in self.getters.values():
                replies.extend((g.client, g.req, False, err) for g in d)
                d.clear()
            for d in self.putters.values():
                replies.extend((p[0], p[1], False, err) for p in d)
                d.clear()
            clients = sorted(self.clients)
        replies.extend((c, -1, False, _CLOSED) for c in clients)
        self._reply(replies)
        return len(clients)

    # -- request handling (reader threads) ---------------------------------------------
    def _on_message(self, client: str, msg: Any) -> None:
        if isinstance(msg, BaseException):  # the client died: drop its parked requests
            with self.lock:
                self.clients.discard(client)
                for key, d in self.getters.items():
                    mine = [g for g in d if g.client == client]
                    kept = [g for g in d if g.client != client]
                    d.clear()
                    d.extend(kept)
                    for g in mine:  # a partial batch goes back, in order
                        self._requeue(key, g.batch)
                for d in self.putters.values():
                    kept = [e for e in d if e[0] != client]
                    d.clear()
                    d.extend(kept)
            return
        op, req, key, a, b = msg
        replies: list[tuple[str, int, bool, Any]] = []
        with self.lock:
            self.clients.add(client)
            if self.closed:
                err = ChannelClosedError(self.ep.name, f"channel {self.name!r} was closed")
                replies.append((client, req, False, err))
            else:
                self._handle(client, op, req, key, a, b, replies)
        self._reply(replies)

    def _handle(self, client: str, op: str, req: int, key: Any, a: Any, b: Any, replies: list):
        q = self.items[key]
        if op in ("put", "put_nowait"):
            if self.maxsize == 0 or (len(q) < self.maxsize and not self.putters[key]):
                q.append((a, b, next(self.seq)))
                if req >= 0:
                    replies.append((client, req, True, None))
            elif op == "put_nowait":
                full = ChannelFull(f"channel {self.name!r} key {key!r} is full")
                replies.append((client, req, False, full))
            else:
                self.putters[key].append((client, req, a, b, next(self.seq)))
            self._serve(key, replies)
        elif op == "requeue":  # items a client got too late, back in their places
            self._requeue(key, a)
            self._serve(key, replies)
        elif op in ("get", "get_batch"):
            self.getters[key].append(_Getter(client, req, b if op == "get_batch" else None))
            self._serve(key, replies)
        elif op == "get_nowait":
            if q and not self.getters[key]:
                replies.append((client, req, True, q.popleft()))
                self._refill(key, replies)
            else:
                empty = ChannelEmpty(f"channel {self.name!r} key {key!r} is empty")
                replies.append((client, req, False, empty))
        elif op == "cancel":  # withdraw the parked get ``a`` of this client, if still parked
            replies.append((client, req, True, self._cancel(client, key, a)))
            self._serve(key, replies)
        elif op == "qsize":
            replies.append((client, req, True, len(q)))
        elif op == "full":
            replies.append((client, req, True, self.maxsize > 0 and len(q) >= self.maxsize))
        elif op == "peek_all":
            queued = {k: [e[0] for e in v] for k, v in self.items.items() if v}
            replies.append((client, req, True, queued))
        else:
            replies.append((client, req, False, ValueError(f"unknown channel operation {op!r}")))

    def _reply(self, replies: list[tuple[str, int, bool, Any]]) -> None:
        for to, req_id, ok, value in replies:
            try:
                self.ep.send(to, encode((req_id, ok, value)), async_op=False)
            except CommError:
                pass  # that client is gone; its requests die with it

    def _requeue(self, key: Any, entries: list[tuple[Any, float, int]]) -> None:
        """Put entries handed out back into ``key``'s queue, each in its place by number."""
        q = self.items[key]
        merged = sorted([*entries, *q], key=lambda e: e[2])
        q.clear()
        q.extend(merged)

    def _cancel(self, client: str, key: Any, req: int) -> bool:
        d = self.getters[key]
        for g in d:
            if g.client == client and g.req == req:
                d.remove(g)
                self._requeue(key, g.batch)
                return True
        return False

    def _refill(self, key: Any, replies: list) -> None:
        q, putters = self.items[key], self.putters[key]
        while putters and (self.maxsize == 0 or len(q) < self.maxsize):
            client, req, item, weight, seq = putters.popleft()
            q.append((item, weight, seq))
            replies.append((client, req, True, None))

    def _serve(self, key: Any, replies: list) -> None:
        """Hand queued items to the parked getters of ``key``, oldest first."""
        q, getters = self.items[key], self.getters[key]
        while True:
            self._refill(key, replies)  # an item taken makes room for a blocked put
            if not getters:
                return
            g = getters[0]
            if g.target is None:
                if not q:
                    return
                getters.popleft()
                replies.append((g.client, g.req, True, q.popleft()))
                continue
            done = False
            while q and not done:
                w = q[0][1]
                if g.acc + w > g.target:
                    done = True
                    break
                g.batch.append(q.popleft())
                g.acc += w
                done = g.acc >= g.target
                self._refill(key, replies)
            if not done:
                return  # waits for more items, holding what it took (as RLinf's does)
            getters.popleft()
            replies.append((g.client, g.req, True, g.batch))


class _Client:
    """This process's connection to one channel: request ids and reply futures.

    Replies to gets carry ``(item, weight, sequence number)`` entries; a get given up on (its caller timed
    out and the actor did not withdraw it, or the connection failed while it waited) is
    ``abandoned``: what the actor hands out for it later is put back at the front of its key.
    """

    _clients: dict[str, _Client] = {}
    _lock = threading.Lock()

    def __init__(self, server: str, name: str):
        self.server = server
        self.name = name
        self.ep = get_endpoint()
        self.ids = itertools.count()
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.abandoned: dict[int, Any] = {}  # request id -> key
        self.get_keys: dict[int, Any] = {}  # request id -> key of the gets awaiting a reply
        self.plock = threading.Lock()
        self.closed: CommError | None = None
        self.ep.set_handler(server, self._on_reply)
        self.ep.inbox(server).has_pending = lambda: bool(self.pending)

    @classmethod
    def of(cls, server: str, name: str) -> _Client:
        with cls._lock:
            client = cls._clients.get(server)
            if client is None or client.ep is not get_endpoint():
                client = cls._clients[server] = cls(server, name)
            return client

    def _on_reply(self, peer: str, msg: Any) -> None:
        if isinstance(msg, BaseException):  # the connection broke or the actor went silent
            err = msg if isinstance(msg, CommError) else PeerDiedError(peer, str(msg))
            with self.plock:
                futs, self.pending = list(self.pending.values()), {}
                # The actor may still hold these gets (it was only silent): what it hands
                # out for them once it answers again goes back to the queue.
                self.abandoned.update(self.get_keys)
                self.get_keys = {}
            for f in futs:
                if not f.done():
                    f.set_exception(err)
            return
        req, ok, value = msg
        if req == -1 and value == _CLOSED:
            self.closed = ChannelClosedError(peer, f"channel {self.name!r} was closed")
            return
        with self.plock:
            fut = self.pending.pop(req, None)
            self.get_keys.pop(req, None)
            key = self.abandoned.pop(req, None)
        if key is not None and ok and value:
            self._send("requeue", -1, key, value if isinstance(value, list) else [value])
        if fut is None or fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def _send(
        self, op: str, req: int, key: Any, a: Any = None, b: Any = None, sync: bool = False
    ) -> Work:
        return self.ep.send(self.server, encode((op, req, key, a, b)), async_op=not sync)

    def request(
        self,
        what: str,
        op: str,
        key: Any,
        a: Any = None,
        b: Any = None,
        reply: bool = True,
        post: Any = None,
        sync: bool = True,
    ) -> tuple[int, Work]:
        """Send one request; its reply completes the returned work (``post`` maps it).

        ``sync=False`` sends from the connection's thread (a failed send fails the
        request), so a caller with a timeout is not held by a silent actor's connection.
        """
        if self.closed is not None:
            raise self.closed
        fut: concurrent.futures.Future = concurrent.futures.Future()
        req = next(self.ids) if reply else -1
        if reply:
            with self.plock:
                self.pending[req] = fut
                if op in ("get", "get_batch"):
                    self.get_keys[req] = key
        if sync or not reply:
            try:
                self._send(op, req, key, a, b, sync=True)
            except BaseException as e:
                with self.plock:
                    self.pending.pop(req, None)
                    self.get_keys.pop(req, None)
                if isinstance(e, PeerDiedError):
                    raise self._dead(e) from None
                raise
        else:
            self._send(op, req, key, a, b).add_done_callback(lambda f: self._sent(req, f))
        if not reply:
            fut.set_result(None)
        return req, Work(what, fut, post)

    def _dead(self, e: PeerDiedError) -> CommError:
        if isinstance(e, PeerTimeoutError):
            return e
        return ChannelClosedError(
            self.server, f"channel {self.name!r} is closed or its actor died ({e})"
        )

    def _sent(self, req: int, f: concurrent.futures.Future) -> None:
        err = f.exception()
        if err is None:
            return
        with self.plock:  # the request did not reach the actor
            fut = self.pending.pop(req, None)
            self.get_keys.pop(req, None)
        if fut is not None and not fut.done():
            fut.set_exception(self._dead(err) if isinstance(err, PeerDiedError) else err)

    def wait_or_withdraw(self, req: int, work: Work, key: Any, timeout: float | None) -> Any:
        """Wait for a parked get; on timeout withdraw it, unless the item is already on its way."""
        try:
            return work.wait(timeout)
        except TimeoutError:
            pass
        try:
            _, cancel = self.request("cancel", "cancel", key, req, sync=False)
            withdrawn = cancel.wait(CANCEL_GRACE_S)
        except (TimeoutError, CommError):
            with self.plock:
                abandoned = self.pending.pop(req, None) is not None
                self.get_keys.pop(req, None)
                if abandoned:
                    self.abandoned[req] = key
            if not abandoned:  # its reply came in the meantime
                return work.wait(0)
            raise TimeoutError(
                f"get from channel {self.name!r} did not complete within {timeout}s and the "
                f"channel's actor ({self.server}) did not answer within {CANCEL_GRACE_S}s "
                "more: it is not dead but not answering (stopped or overloaded); the channel "
                "stays usable"
            ) from None
        if withdrawn:
            with self.plock:
                self.pending.pop(req, None)
                self.get_keys.pop(req, None)
            raise TimeoutError(f"get from channel {self.name!r} got no item within {timeout}s")
        return work.wait(60)  # not parked any more: its reply came before the cancel's


def _item(entry: tuple[Any, float, int]) -> Any:
    return entry[0]


def _items(entries: list[tuple[Any, float, int]]) -> list[Any]:
    return [e[0] for e in entries]


class Channel:
    """A handle to a named channel; picklable, so it can be passed to workers.

    Create with ``Channel.create(name, node_rank=0, maxsize=0)`` (or a worker's
    ``self.create_channel``), connect with ``Channel.connect(name)``.

    Args:
        name: the channel's name.
        maxsize: the most items one key holds (0: unbounded).

    Example:
        >>> import phalanx as px
        >>> cluster = px.Cluster()
        >>> channel = px.create_channel("example_channel", maxsize=4)
        >>> channel.put({"step": 1})
        >>> px.connect_channel("example_channel").get()
        {'step': 1}
        >>> channel.close()
    """

    def __init__(self, name: str, maxsize: int):
        self.name = name
        self.maxsize = maxsize
        self._server = _PREFIX + name

    # -- creation ---------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        name: str,
        node_rank: int = 0,
        maxsize: int = 0,
        *,
        distributed: bool = False,
        local: bool = False,
        node_id: int | None = None,
    ) -> Channel:
        """Start the channel actor on node rank ``node_rank``; each key holds at most ``maxsize`` items (0: unbounded).

        ``node_id`` is the older name of ``node_rank`` in RLinf's API document. RLinf's
        ``distributed=True`` (one replica per node) and ``local=True`` (in-process only)
        are not supported: they raise ``NotImplementedError``.

        Args:
            name: the channel's name, unique in the cluster.
            node_rank: the node that hosts the channel actor.
            maxsize: the most items one key holds (0: unbounded).
            distributed: RLinf's one replica per node (not supported).
            local: RLinf's in-process channel (not supported).
            node_id: the older name of ``node_rank``.

        Returns:
            A handle to the new channel.

        Raises:
            ValueError: a channel of that name exists, or both ``node_rank`` and ``node_id``
                are given.
            NotImplementedError: ``distributed`` or ``local`` is True.
        """
        check_name(name, "name")
        if node_id is not None:
            if node_rank != 0:
                raise ValueError("give node_rank or node_id (its older name), not both")
            node_rank = node_id
        check_int(node_rank, "node_rank", minimum=0)
        check_int(maxsize, "maxsize", minimum=0)
        if distributed:
            raise NotImplementedError(
                "distributed=True: phalanx channels have one actor; per-node replicas are "
                "not supported"
            )
        if local:
            raise NotImplementedError(
                "local=True: phalanx has no in-process channel; use queue.Queue or asyncio.Queue"
            )
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from phalanx.resources.cluster import Cluster

        node = Cluster().node(node_rank)
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
    def connect(cls, name: str, current_worker: Any = None) -> Channel:
        """A handle to an existing channel; ``ValueError`` naming it if there is none.

        ``current_worker`` is accepted for RLinf's signature; phalanx does not need it.

        Args:
            name: the channel's name.
            current_worker: ignored (RLinf's signature).

        Returns:
            A handle to the channel.

        Raises:
            ValueError: no channel has that name.
        """
        check_name(name, "name")
        try:
            actor = ray.get_actor(_PREFIX + name, namespace=ACTOR_NAMESPACE)
        except ValueError:
            raise ValueError(
                f"name: no channel named {name!r} (create it with create_channel)"
            ) from None
        info = ray.get(actor.describe.remote(), timeout=120)
        return cls(name, info["maxsize"])

    def close(self) -> None:
        """Stop the channel actor: queued items are dropped, waiting operations and any later
        ``put``/``get`` on any handle raise ``ChannelClosedError``."""
        client = _Client._clients.get(self._server)
        actor = _OWNED.pop(self.name, None)
        if actor is None:
            try:
                actor = ray.get_actor(self._server, namespace=ACTOR_NAMESPACE)
            except ValueError:
                actor = None
        if actor is not None:
            try:
                ray.get(actor.close.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - already dead: nothing to tell
                pass
            ray.kill(actor, no_restart=True)
        if client is not None:
            client.closed = ChannelClosedError(self._server, f"channel {self.name!r} was closed")

    def __reduce__(self):
        return (Channel, (self.name, self.maxsize))

    def __repr__(self) -> str:
        return f"Channel({self.name!r}, maxsize={self.maxsize})"

    def __str__(self) -> str:
        """The items queued under each key (RLinf documents ``print(channel)`` for debugging)."""
        queued = self.peek_all()
        return f"Channel({self.name!r}, maxsize={self.maxsize}) {queued}"

    # -- operations -------------------------------------------------------------------
    def _client(self) -> _Client:
        return _Client.of(self._server, self.name)

    def put(
        self, item: Any, weight: float = 0, key: Any = DEFAULT_KEY, async_op: bool = False
    ) -> Work | None:
        """Append ``item`` (with ``weight``, for ``get_batch``) to ``key``'s queue; waits while it is full.

        Args:
            item: any picklable object.
            weight: the item's weight for ``get_batch``.
            key: the queue's key.
            async_op: return a ``Work`` at once instead of waiting.

        Returns:
            A ``Work`` if ``async_op``, else None.

        Raises:
            ValueError: ``weight`` is negative.
        """
        check_number(weight, "weight", minimum=0)
        bounded = self.maxsize > 0
        t0 = time.perf_counter() if _trace.ON else 0.0
        _, work = self._client().request(
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

    def put_nowait(self, item: Any, weight: float = 0, key: Any = DEFAULT_KEY) -> None:
        """Append ``item`` or raise ``ChannelFull`` (an ``asyncio.QueueFull``) at once.

        Args:
            item: any picklable object.
            weight: the item's weight for ``get_batch``.
            key: the queue's key.

        Raises:
            ChannelFull: ``key``'s queue is full.
        """
        check_number(weight, "weight", minimum=0)
        _, work = self._client().request(
            f"put_nowait to {self.name!r}", "put_nowait", key, item, weight
        )
        work.wait()

    def get(
        self, key: Any = DEFAULT_KEY, async_op: bool = False, timeout: float | None = None
    ) -> Any:
        """The oldest item of ``key`` (waits until there is one); a ``Work`` if ``async_op``.

        With ``timeout`` a synchronous get raises ``TimeoutError`` and is withdrawn.

        Args:
            key: the queue's key.
            async_op: return a ``Work`` at once instead of the item.
            timeout: seconds to wait (no bound if None).

        Returns:
            The item, or a ``Work`` whose ``wait()`` returns it.

        Raises:
            TimeoutError: no item came within ``timeout``.
        """
        check_timeout(timeout)
        t0 = time.perf_counter() if _trace.ON else 0.0
        client = self._client()
        what = f"get from channel {self.name!r}"
        req, work = client.request(what, "get", key, post=_item, sync=timeout is None)
        if async_op:
            return work
        item = client.wait_or_withdraw(req, work, key, timeout)
        if t0:
            _trace.record_event(
                "channel.get", t0, time.perf_counter(), cat="comm", channel=self.name
            )
        return item

    def get_nowait(self, key: Any = DEFAULT_KEY) -> Any:
        """The oldest item of ``key`` or ``ChannelEmpty`` (an ``asyncio.QueueEmpty``) at once.

        Args:
            key: the queue's key.

        Returns:
            The oldest item.

        Raises:
            ChannelEmpty: ``key`` holds no item.
        """
        what = f"get_nowait from {self.name!r}"
        _, work = self._client().request(what, "get_nowait", key, post=_item)
        return work.wait()

    def get_batch(
        self,
        target_weight: float = 0,
        key: Any = DEFAULT_KEY,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """The oldest items of ``key`` up to ``target_weight`` in total (a list; see the module doc).

        Args:
            target_weight: the total weight to take.
            key: the queue's key.
            async_op: return a ``Work`` at once instead of the list.
            timeout: seconds to wait (no bound if None).

        Returns:
            The list of items, or a ``Work`` whose ``wait()`` returns it.

        Raises:
            ValueError: ``target_weight`` is negative.
            TimeoutError: the items did not come within ``timeout``.
        """
        check_number(target_weight, "target_weight", minimum=0)
        check_timeout(timeout)
        client = self._client()
        what = f"get_batch from {self.name!r}"
        req, work = client.request(
            what, "get_batch", key, None, target_weight, post=_items, sync=timeout is None
        )
        return work if async_op else client.wait_or_withdraw(req, work, key, timeout)

    def qsize(self, key: Any = DEFAULT_KEY) -> int:
        """Items queued under ``key`` (puts blocked on a full queue not counted).

        Args:
            key: the queue's key.

        Returns:
            The number of items.
        """
        return self._client().request("qsize", "qsize", key)[1].wait()

    def empty(self, key: Any = DEFAULT_KEY) -> bool:
        """Whether ``key``'s queue is empty.

        Args:
            key: the queue's key.

        Returns:
            True when ``key`` holds no item.
        """
        return self.qsize(key) == 0

    def full(self, key: Any = DEFAULT_KEY) -> bool:
        """Whether ``key``'s queue is full.

        Args:
            key: the queue's key.

        Returns:
            True when ``key`` holds ``maxsize`` items.
        """
        return self._client().request("full", "full", key)[1].wait()

    def peek_all(self) -> dict[Any, list[Any]]:
        """Every queued item, per key, oldest first, without taking them.

        Returns:
            A dict from key to its items.
        """
        return self._client().request("peek_all", "peek_all", None)[1].wait()


def create_channel(
    channel_name: str | None = None,
    node_rank: int = 0,
    maxsize: int = 0,
    *,
    distributed: bool = False,
    local: bool = False,
    name: str | None = None,
    node_id: int | None = None,
) -> Channel:
    """Create a channel from the driver or any worker (see ``Channel.create``).

    RLinf's keywords (``channel_name``, ``node_rank``, ``maxsize``); the older
    ``name``/``node_id`` of RLinf's API document are accepted too.

    Args:
        channel_name: the channel's name.
        node_rank: the node that hosts the channel actor.
        maxsize: the most items one key holds (0: unbounded).
        distributed: not supported.
        local: not supported.
        name: the channel's name, by its older keyword.
        node_id: the older name of ``node_rank``.

    Returns:
        A handle to the new channel.

    Raises:
        ValueError: both ``channel_name`` and ``name`` are given, or a channel of that
            name exists.
        NotImplementedError: ``distributed`` or ``local`` is True.
    """
    return Channel.create(
        _channel_name(channel_name, name),
        node_rank,
        maxsize,
        distributed=distributed,
        local=local,
        node_id=node_id,
    )


def connect_channel(channel_name: str | None = None, *, name: str | None = None) -> Channel:
    """Connect to a channel by name (see ``Channel.connect``).

    Args:
        channel_name: the channel's name.
        name: the same, by its older keyword.

    Returns:
        A handle to the channel.

    Raises:
        ValueError: both names are given, or no channel has that name.
    """
    return Channel.connect(_channel_name(channel_name, name))


def _channel_name(channel_name: str | None, name: str | None) -> str:
    if channel_name is not None and name is not None:
        raise ValueError("give channel_name or name (its older spelling), not both")
    return channel_name if channel_name is not None else name
