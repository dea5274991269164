"""A channel whose actor stops answering (SIGSTOP) is not a closed channel."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

import phalanx as px
from phalanx.comm.config import CONFIG
from tests.helpers import stop_process, thread_states, until

pytestmark = pytest.mark.timeout(240)


def _channel_pid(name: str) -> int:
    actor = ray.get_actor(f"px-channel:{name}", namespace="phalanx")
    return ray.get(actor.describe.remote(), timeout=60)["pid"]


@pytest.fixture
def stopped_channel(cluster, request):
    name = f"stop_{request.node.name[-10:]}"
    ch = px.create_channel(name)
    ch.put("warm-up")
    assert ch.get(timeout=30) == "warm-up"  # connected both ways
    pid = _channel_pid(name)
    stop_process(pid)
    try:
        yield ch, pid
    finally:
        os.kill(pid, signal.SIGCONT)
        ch.close()


def test_get_timeout_is_honoured_and_says_the_actor_did_not_answer(stopped_channel):
    ch, pid = stopped_channel
    t0 = time.monotonic()
    with pytest.raises(
        TimeoutError, match="did not complete within 5s.*not dead but not answering"
    ):
        ch.get(timeout=5)
    took = time.monotonic() - t0
    assert 5 <= took < 7.5, took
    os.kill(pid, signal.SIGCONT)
    # The handle recovers; the withdrawn get took nothing away.
    ch.put("after")
    assert ch.get(timeout=30) == "after"
    assert ch.qsize() == 0


def test_item_handed_to_an_abandoned_get_goes_back(stopped_channel):
    ch, pid = stopped_channel
    ch.put("early", 2.0, async_op=True)  # queued behind the stop: served to the get below
    with pytest.raises(TimeoutError, match="not answering"):
        got = ch.get(timeout=2)
        pytest.fail(f"the stopped actor answered {got!r}; its threads: {thread_states(pid)}")
    assert set(thread_states(pid).values()) == {"T"}, "something resumed the actor"
    os.kill(pid, signal.SIGCONT)
    assert ch.get_batch(2.0, timeout=30) == ["early"]  # back at the front, weight kept


def test_silence_longer_than_the_peer_timeout_then_recovery(stopped_channel):
    ch, pid = stopped_channel
    old = CONFIG.peer_timeout_s
    CONFIG.peer_timeout_s = 2.0
    try:
        work = ch.get(async_op=True)
        with pytest.raises(px.comm.PeerDiedError, match="alive but not answering") as info:
            work.wait(timeout=60)
        assert type(info.value).__name__ == "PeerTimeoutError"
    finally:
        CONFIG.peer_timeout_s = old
        os.kill(pid, signal.SIGCONT)
    ch.put("back")
    assert ch.get(timeout=30) == "back"


def test_a_dead_channel_actor_is_reported_as_closed(cluster):
    ch = px.create_channel("stop_dead_chan")
    ch.put(1)
    assert ch.get(timeout=30) == 1
    ray.kill(ray.get_actor("px-channel:stop_dead_chan", namespace="phalanx"), no_restart=True)
    errors = []

    def put_fails() -> bool:
        try:
            ch.put(2)  # an unbounded put waits for no reply: it fails once the actor is gone
        except px.comm.ChannelClosedError as e:
            errors.append(str(e))
            return True
        return False

    assert until(put_fails, timeout=60)
    assert "stop_dead_chan" in errors[0] and "closed or its actor died" in errors[0]
    ch.close()
