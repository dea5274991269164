"""Channels: per-key FIFO, weights, back-pressure, nowait variants, pipelines between groups."""

from __future__ import annotations

import asyncio
import os
import queue
import time

import pytest
import ray
import torch

import phalanx as px

pytestmark = pytest.mark.timeout(240)


class Producer(px.Worker):
    def produce(self, channel, n, key="data"):
        for i in range(n):
            channel.put({"i": i, "obs": torch.full((64,), float(i))}, key=key)
        return n


class Consumer(px.Worker):
    def consume(self, name, n, key="data"):
        ch = self.connect_channel(name)
        out = []
        for _ in range(n):
            item = ch.get(key=key)
            assert torch.equal(item["obs"], torch.full((64,), float(item["i"])))
            out.append(item["i"])
        return out

    async def consume_async(self, name, n, key="data"):
        ch = self.connect_channel(name)
        return [(await ch.get(key=key, async_op=True))["i"] for _ in range(n)]

    def make_channel(self, name):
        ch = self.create_channel(name, maxsize=3)
        ch.put("from a worker")
        return ch.qsize()

    def wait_get(self, name, marker):
        ch = self.connect_channel(name)
        work = ch.get(key="never", async_op=True)
        with open(marker, "w") as f:
            f.write("posted")
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - returned for the test
            return type(e).__name__, str(e)
        return None, ""

    def rlinf_create(self, channel_name):
        ch = self.create_channel(channel_name=channel_name, node_rank=0, maxsize=2)
        ch.put("affinity_item", 1)
        return ch.maxsize, ch.qsize()

    def put_into(self, channel, item):
        try:
            channel.put(item)
        except Exception as e:  # noqa: BLE001 - returned for the test
            return type(e).__name__, str(e)
        return None, ""


def _wait_for_file(path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} was not written within {timeout}s"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def groups(cluster):
    p = Producer.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="chan_prod")
    c = Consumer.create_group().launch(cluster, px.NodePlacement(num_workers=2), name="chan_cons")
    yield p, c
    p.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def ch(cluster):
    channel = px.create_channel("test_chan")
    yield channel
    channel.close()


@pytest.mark.smoke
def test_fifo_order_over_1000_items(ch):
    for i in range(1000):
        ch.put(i, key="fifo")
    assert ch.qsize(key="fifo") == 1000
    assert [ch.get(key="fifo") for _ in range(1000)] == list(range(1000))
    assert ch.empty(key="fifo")


def test_get_batch_stops_before_exceeding_the_target(ch):
    """RLinf: take items while the next does not push the total over the target."""
    for item, w in [("a", 1), ("b", 2), ("c", 3)]:
        ch.put(item, w, key="w12")
    assert ch.get_batch(2, key="w12") == ["a"]  # 1 + 2 would exceed 2
    assert ch.get_batch(5, key="w12") == ["b", "c"]  # 2 + 3 reaches 5
    for item, w in [("a", 1), ("b", 2), ("c", 3)]:
        ch.put(item, w, key="w3")
    assert ch.get_batch(target_weight=3, key="w3") == ["a", "b"]  # RLinf's own test
    assert ch.get(key="w3") == "c"
    ch.put("heavy", 4, key="w4")
    assert ch.get_batch(3, key="w4") == []  # the first item alone exceeds the target
    assert ch.qsize(key="w4") == 1
    # An empty key is waited on; items taken so far are held until the target is reached.
    work = ch.get_batch(4, key="wait", async_op=True)
    ch.put("d", 1, key="wait")
    time.sleep(0.3)
    assert not work.done()
    ch.put("e", 3, key="wait")
    assert work.wait(timeout=30) == ["d", "e"]
    with pytest.raises(ValueError, match="target_weight"):
        ch.get_batch(-1, key="w")


def test_put_with_weight_positionally_goes_to_the_default_key(ch):
    """RLinf's order is put(item, weight, key): put(x, 3) then get() returns x."""
    ch.put("x", 3)
    assert ch.get(timeout=30) == "x"
    ch.put_nowait("y", 2)
    assert ch.get_batch(2) == ["y"]


@pytest.mark.smoke
def test_keys_are_isolated(ch):
    ch.put("x1", key="kx")
    ch.put("y1", key="ky")
    ch.put("x2", key="kx")
    assert ch.qsize(key="kx") == 2 and ch.qsize(key="ky") == 1
    assert ch.get(key="ky") == "y1"
    assert [ch.get(key="kx"), ch.get(key="kx")] == ["x1", "x2"]


def test_nowait_variants(ch):
    with pytest.raises(asyncio.QueueEmpty, match="nowait_key"):
        ch.get_nowait(key="nowait_key")
    with pytest.raises(queue.Empty):  # also the standard library's queue exception
        ch.get_nowait(key="nowait_key")
    ch.put_nowait(5, key="nowait_key")
    assert ch.get_nowait(key="nowait_key") == 5


def test_get_timeout_withdraws_the_get(ch):
    with pytest.raises(TimeoutError):
        ch.get(key="late", timeout=0.2)
    ch.put("kept", key="late")
    assert ch.get(key="late", timeout=30) == "kept"  # not handed to the withdrawn get
    assert ch.empty(key="late")


def test_print_shows_items_per_key(cluster):
    c = px.create_channel(channel_name="print_chan")
    try:
        for item in ["item1", "item2", "item3"]:
            c.put(item)
        c.put("other", key="k2")
        text = str(c)
        assert "'default_queue': ['item1', 'item2', 'item3']" in text and "'k2': ['other']" in text
        assert c.qsize() == 3  # nothing taken
    finally:
        c.close()


def test_rlinf_creation_signatures(groups):
    _, c = groups
    assert c.execute_on(0).rlinf_create("rlinf_kw_chan").wait(timeout=120) == [(2, 1)]
    ch = px.connect_channel(channel_name="rlinf_kw_chan")
    assert ch.get() == "affinity_item"
    ch.close()
    positional = px.Channel.create("rlinf_pos_chan", 0, 5)  # (name, node_rank, maxsize)
    assert positional.maxsize == 5
    positional.close()
    with pytest.raises(NotImplementedError, match="distributed"):
        px.create_channel("dist_chan", distributed=True)
    with pytest.raises(ValueError, match="node_rank"):
        px.create_channel("bad_rank_chan", node_rank=-1)


def test_put_after_close_raises(groups):
    _, c = groups
    closed = px.create_channel("closed_chan")
    closed.put("before")
    closed.close()
    with pytest.raises(px.comm.ChannelClosedError, match="closed_chan"):
        closed.put("after")
    with pytest.raises(px.comm.ChannelClosedError, match="closed_chan"):
        closed.get()
    kind, message = c.execute_on(0).put_into(closed, "from a worker").wait(timeout=60)[0]
    assert kind == "ChannelClosedError" and "closed_chan" in message


def test_blocked_get_does_not_starve_puts(ch):
    waiting = ch.get(key="starve", async_op=True)
    for i in range(50):
        ch.put(i, key="other")
    assert ch.qsize(key="other") == 50
    assert [ch.get(key="other") for _ in range(50)] == list(range(50))
    assert not waiting.done()
    ch.put("finally", key="starve")
    assert waiting.wait(timeout=30) == "finally"


def test_maxsize_back_pressure(cluster):
    ch = px.create_channel("bounded_chan", maxsize=2)
    try:
        assert ch.empty() and not ch.full()
        ch.put(1)
        ch.put(2)
        assert ch.full() and ch.qsize() == 2
        with pytest.raises(asyncio.QueueFull, match="bounded_chan"):
            ch.put_nowait(3)
        blocked = ch.put(3, async_op=True)
        time.sleep(0.3)
        assert not blocked.done()
        assert ch.get() == 1
        blocked.wait(timeout=30)
        assert [ch.get(), ch.get()] == [2, 3]
        assert ch.empty()
    finally:
        ch.close()


def test_bad_input(ch):
    with pytest.raises(ValueError, match="no channel named 'missing_chan'"):
        px.connect_channel("missing_chan")
    with pytest.raises(ValueError, match="already exists"):
        px.create_channel("test_chan")
    with pytest.raises(ValueError, match="maxsize"):
        px.create_channel("x", maxsize=-1)
    with pytest.raises(ValueError, match="weight"):
        ch.put(1, weight=-2)


def test_producer_group_to_consumer_group_pipeline(groups, ch):
    p, c = groups
    hc = c.execute_on(0).consume("test_chan", 300, "pipe")
    hp = p.produce(ch, 300, "pipe")
    assert hc.wait(timeout=120) == [list(range(300))]
    assert hp.wait(timeout=60) == [300]


def test_async_worker_method_consumes(groups, ch):
    p, c = groups
    hc = c.execute_on(1).consume_async("test_chan", 20, "async")
    p.produce(ch, 20, "async").wait(timeout=60)
    assert hc.wait(timeout=60) == [list(range(20))]


def test_channel_created_in_a_worker(groups):
    _, c = groups
    assert c.execute_on(0).make_channel("worker_chan").wait(timeout=120) == [1]
    ch = px.connect_channel("worker_chan")
    assert ch.maxsize == 3 and ch.get() == "from a worker"


def test_channel_death_fails_a_waiting_get(groups, cluster, tmp_path):
    _, c = groups
    doomed = px.create_channel("doomed_chan")
    marker = tmp_path / "posted"
    h = c.execute_on(1).wait_get("doomed_chan", str(marker))
    _wait_for_file(marker)
    ray.kill(ray.get_actor("px-channel:doomed_chan", namespace="phalanx"), no_restart=True)
    err_type, message = h.wait(timeout=90)[0]
    assert err_type == "PeerDiedError" and "doomed_chan" in message
    doomed.close()
