"""Channels: per-key FIFO, weights, back-pressure, nowait variants, pipelines between groups."""

from __future__ import annotations

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

    def wait_get(self, name):
        ch = self.connect_channel(name)
        try:
            ch.get(key="never")
        except Exception as e:  # noqa: BLE001 - returned for the test
            return type(e).__name__, str(e)
        return None, ""


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


def test_fifo_order_over_1000_items(ch):
    for i in range(1000):
        ch.put(i, key="fifo")
    assert ch.qsize(key="fifo") == 1000
    assert [ch.get(key="fifo") for _ in range(1000)] == list(range(1000))
    assert ch.empty(key="fifo")


def test_get_batch_weight_semantics(ch):
    for item, w in [("a", 1), ("b", 2), ("c", 3), ("d", 1), ("e", 5)]:
        ch.put(item, key="w", weight=w)
    assert ch.get_batch(3, key="w") == ["a", "b"]  # 1 + 2 reaches 3
    assert ch.get_batch(2, key="w") == ["c"]  # 3 overshoots 2
    work = ch.get_batch(7, key="w", async_op=True)  # only 6 queued: waits
    time.sleep(0.3)
    assert not work.done()
    ch.put("f", key="w", weight=1)
    assert work.wait(timeout=30) == ["d", "e", "f"]
    with pytest.raises(ValueError, match="target_weight"):
        ch.get_batch(0, key="w")


def test_keys_are_isolated(ch):
    ch.put("x1", key="kx")
    ch.put("y1", key="ky")
    ch.put("x2", key="kx")
    assert ch.qsize(key="kx") == 2 and ch.qsize(key="ky") == 1
    assert ch.get(key="ky") == "y1"
    assert [ch.get(key="kx"), ch.get(key="kx")] == ["x1", "x2"]


def test_nowait_variants(ch):
    with pytest.raises(queue.Empty, match="nowait_key"):
        ch.get_nowait(key="nowait_key")
    ch.put_nowait(5, key="nowait_key")
    assert ch.get_nowait(key="nowait_key") == 5


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
        with pytest.raises(queue.Full, match="bounded_chan"):
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


def test_channel_death_fails_a_waiting_get(groups, cluster):
    _, c = groups
    doomed = px.create_channel("doomed_chan")
    h = c.execute_on(1).wait_get("doomed_chan")
    time.sleep(1.5)
    ray.kill(ray.get_actor("px-channel:doomed_chan", namespace="phalanx"), no_restart=True)
    err_type, message = h.wait(timeout=90)[0]
    assert err_type == "PeerDiedError" and "doomed_chan" in message
    doomed.close()
