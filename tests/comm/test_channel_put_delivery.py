"""A put that returned normally reaches the queue, in order, even when the channel's actor
was silent (stopped) for longer than the peer timeout while it was sent."""

from __future__ import annotations

import os
import signal

import pytest
import ray

import phalanx as px
from phalanx.comm.config import CONFIG
from tests.helpers import stop_process, until

pytestmark = pytest.mark.timeout(90)


def _channel_pid(name: str) -> int:
    actor = ray.get_actor(f"px-channel:{name}", namespace="phalanx")
    return ray.get(actor.describe.remote(), timeout=60)["pid"]


@pytest.fixture
def short_peer_timeout():
    old = CONFIG.peer_timeout_s
    CONFIG.peer_timeout_s = 3.0
    yield
    CONFIG.peer_timeout_s = old


def test_put_sent_to_a_stopped_actor_is_kept_through_the_peer_timeout(cluster, short_peer_timeout):
    ch = px.create_channel("put_kept")
    pid = _channel_pid("put_kept")
    ch.put("a")
    ch.put("b")
    stop_process(pid)
    try:
        with pytest.raises(TimeoutError, match="not answering"):
            ch.get(timeout=1)
        ch.put("c")  # returns: written to the connection of the silent actor
        late = ch.get(async_op=True)
        # The silence outlasts the peer timeout: waiting operations fail, the connection
        # is dropped and the next operation opens a new one.
        with pytest.raises(px.comm.PeerDiedError, match="alive but not answering"):
            late.wait(timeout=30)
    finally:
        os.kill(pid, signal.SIGCONT)
    ch.put("d")  # over the new connection; it must not overtake "c"
    # The withdrawn and the failed gets were still parked in the actor: what it handed
    # them goes back in its place.
    want = {"default_queue": ["a", "b", "c", "d"]}
    assert until(lambda: ch.peek_all() == want, timeout=30), ch.peek_all()
    assert [ch.get(timeout=10) for _ in range(4)] == ["a", "b", "c", "d"]
    assert ch.qsize() == 0
    ch.close()


def test_items_handed_back_keep_their_places_among_newer_puts(cluster):
    ch = px.create_channel("put_order")
    for item in range(5):
        ch.put(item, weight=1)
    first = ch.get_batch(2, async_op=True)
    assert first.wait(timeout=30) == [0, 1]
    pid = _channel_pid("put_order")
    stop_process(pid)
    try:
        with pytest.raises(TimeoutError, match="not answering"):
            ch.get_batch(2, timeout=1)  # abandoned: the actor hands it 2 and 3 later
        with pytest.raises(TimeoutError, match="not answering"):
            ch.get(timeout=1)  # abandoned too: it gets 4
        ch.put(5, weight=1)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert until(lambda: ch.peek_all() == {"default_queue": [2, 3, 4, 5]}, timeout=30)
    assert ch.get_batch(2, timeout=10) == [2, 3]  # weights kept
    ch.close()
