"""Tracing: a Chrome trace with the driver and every rank, nested spans, exact counts."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import phalanx as px
from phalanx.observe import trace


class TracedWorker(px.Worker):
    """A worker with nested timers, an async method and a generator."""

    def step(self, data):
        with self.worker_timer("outer"):
            with self.worker_timer("inner"):
                time.sleep(0.01)
            time.sleep(0.005)
        return np.zeros(1000, dtype=np.float32)

    def ping(self):
        return self.rank

    async def aping(self):
        with self.worker_timer("async_inner"):
            return self.rank

    def emit(self, channel_name):
        with trace.span("publish", cat="user", nbytes=4):
            self.connect_channel(channel_name).put(self.rank, key="k")
        return True


@pytest.fixture
def tracing(tmp_path):
    path = tmp_path / "trace.json"
    trace.reset()
    trace.enable(path)
    yield path
    trace.disable()
    trace.reset()


def _load(path):
    with open(path) as f:
        doc = json.load(f)  # strict JSON: the file must parse as a whole
    assert isinstance(doc["traceEvents"], list)
    return doc["traceEvents"]


def _tracks(events):
    names = {}
    for e in events:
        if e["ph"] == "M" and e["name"] == "process_name":
            names[e["pid"]] = e["args"]["name"]
    return names


@pytest.mark.timeout(120)
def test_trace_has_driver_and_every_rank_with_exact_counts(cluster, tracing):
    group = TracedWorker.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=2), name="traced_a"
    )
    try:
        payload = np.ones(5000, dtype=np.float32)
        for _ in range(3):
            group.step(payload).wait(timeout=60)
        for _ in range(2):
            group.execute_on(1).ping().wait(timeout=60)
        group.aping().wait(timeout=60)
        channel = px.create_channel("trace_chan")
        assert group.execute_on(0).emit("trace_chan").wait(timeout=60) == [True]
        assert channel.get(key="k", timeout=30) == 0
        path = trace.dump()
    finally:
        group.shutdown()
        channel.close()
    events = _load(path)
    pids = {name: pid for pid, name in _tracks(events).items()}
    assert "driver" in pids and "group traced_a" in pids
    gpid = pids["group traced_a"]

    calls = [e for e in events if e.get("cat") == "call" and e["pid"] == gpid]
    by = {}
    for e in calls:
        by.setdefault((e["name"], e["tid"] // 100), []).append(e)
    assert len(by[("step", 0)]) == 3 and len(by[("step", 1)]) == 3
    assert len(by[("ping", 1)]) == 2 and ("ping", 0) not in by
    assert len(by[("aping", 0)]) == 1 and len(by[("aping", 1)]) == 1
    assert len(by[("emit", 0)]) == 1
    # bytes of arguments and results are known for arrays
    step = by[("step", 0)][0]
    assert step["args"]["arg_bytes"] == payload.nbytes
    assert step["args"]["result_bytes"] == 4000

    # the driver: one async slice per group call, a wait slice per wait
    begins = [e for e in events if e["pid"] == pids["driver"] and e["ph"] == "b"]
    ends = [e for e in events if e["pid"] == pids["driver"] and e["ph"] == "e"]
    names = sorted(e["name"] for e in begins)
    assert names == sorted(
        ["traced_a.step"] * 3 + ["traced_a.ping"] * 2 + ["traced_a.aping", "traced_a.emit"]
    )
    assert sorted(e["id"] for e in begins) == sorted(e["id"] for e in ends)
    waits = [e for e in events if e.get("cat") == "wait"]
    assert len(waits) == 7 and all(e["pid"] == pids["driver"] for e in waits)
    # the driver's call slice covers the worker's execution (aligned clocks)
    b = min((e for e in begins if e["name"] == "traced_a.step"), key=lambda e: e["ts"])
    e_end = next(e for e in ends if e["id"] == b["id"])
    first = min(by[("step", 0)], key=lambda e: e["ts"])
    slack = 2000  # µs of clock/scheduling slack
    assert b["ts"] - slack <= first["ts"] and first["ts"] + first["dur"] <= e_end["ts"] + slack

    # spans reported through trace.span and channel put/get land on the right tracks
    user = [e for e in events if e.get("cat") == "user" and e["name"] == "publish"]
    assert len(user) == 1 and user[0]["pid"] == gpid and user[0]["args"] == {"nbytes": 4}
    comm = {(e["name"], e["pid"]): e for e in events if e.get("cat") == "comm"}
    assert set(comm) == {("channel.put", gpid), ("channel.get", pids["driver"])}
    put = comm[("channel.put", gpid)]
    assert put["args"] == {"channel": "trace_chan"} and put["tid"] == 0
    assert user[0]["ts"] <= put["ts"] and put["ts"] + put["dur"] <= user[0]["ts"] + user[0]["dur"]


@pytest.mark.timeout(120)
def test_timer_spans_nest_inside_their_parents(cluster, tracing):
    group = TracedWorker.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=2), name="traced_b"
    )
    try:
        group.step(None).wait(timeout=60)
        group.aping().wait(timeout=60)
        path = trace.dump()
    finally:
        group.shutdown()
    events = [e for e in _load(path) if e["ph"] == "X"]

    def inside(child, parent):
        return (
            child["pid"] == parent["pid"]
            and child["tid"] == parent["tid"]
            and parent["ts"] <= child["ts"]
            and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"] + 0.01
        )

    for rank in (0, 1):
        mine = [e for e in events if e["tid"] == rank * 100 and e["cat"] in ("call", "timer")]
        step = next(e for e in mine if e["name"] == "step")
        outer = next(e for e in mine if e["name"] == "outer")
        inner = next(e for e in mine if e["name"] == "inner")
        assert inside(inner, outer) and inside(outer, step)
        assert inner["dur"] >= 10_000 and outer["dur"] >= inner["dur"] + 5_000
        # a timer inside an async method sits in that call's span too
        aping = next(e for e in mine if e["name"] == "aping")
        assert inside(next(e for e in mine if e["name"] == "async_inner"), aping)


@pytest.mark.timeout(120)
def test_workers_started_after_enable_trace_and_off_records_nothing(cluster, tmp_path):
    trace.reset()
    group = TracedWorker.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=1), name="traced_c"
    )
    try:
        group.ping().wait(timeout=60)  # tracing off: nothing recorded
        path = trace.enable(tmp_path / "t.json")  # the running group starts tracing too
        group.ping().wait(timeout=60)
        late = TracedWorker.create_group().launch(
            cluster, placement=px.NodePlacement(num_workers=1), name="traced_d"
        )
        late.ping().wait(timeout=60)
        late.shutdown()  # its events are collected before its workers go
        trace.disable()
        group.ping().wait(timeout=60)  # off again
        trace.dump(path)
    finally:
        trace.disable()
        group.shutdown()
    events = _load(path)
    tracks = _tracks(events)
    calls = [(tracks[e["pid"]], e["name"]) for e in events if e.get("cat") == "call"]
    assert sorted(calls) == [("group traced_c", "ping"), ("group traced_d", "ping")]
    trace.reset()


@pytest.mark.smoke
def test_span_and_record_event_are_noops_when_off_and_bad_input_raises(tmp_path):
    trace.reset()
    assert not trace.enabled()
    with trace.span("x"):
        pass
    trace.record_event("y", 0.0, 1.0)
    assert [e for e in trace.chrome_trace()["traceEvents"] if e["ph"] != "M"] == []
    with pytest.raises(TypeError, match="path"):
        trace.enable(123)
    assert not trace.enabled()
