"""Call styles as pure functions (phalanx.group.dispatch): no Ray, exact per-rank calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import phalanx as px
from phalanx.group import dispatch
from phalanx.group.sharding import NamedSharding

pytestmark = pytest.mark.timeout(60)

DP_TP = NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])


def _data(calls):
    return [(r, a, k) for r, a, k in calls]


@pytest.mark.smoke
def test_broadcast_and_execute_on():
    assert dispatch.broadcast([0, 2], (1,), {"k": 2}) == [(0, (1,), {"k": 2}), (2, (1,), {"k": 2})]
    assert dispatch.execute_on((0, 3), 4, "g") == [0, 3]
    assert dispatch.execute_on(([2, 1],), 4, "g") == [2, 1]
    with pytest.raises(TypeError, match="must be an int rank.*'a'"):
        dispatch.execute_on(("a",), 4, "g")
    with pytest.raises(TypeError, match="int rank"):
        dispatch.execute_on((True,), 4, "g")
    with pytest.raises(ValueError, match=r"ranks \[7\] out of range for group g of 4"):
        dispatch.execute_on((0, 7), 4, "g")
    with pytest.raises(ValueError, match="at least one rank"):
        dispatch.execute_on((), 4, "g")
    with pytest.raises(ValueError, match=r"worker_idx: ranks \[-1\]"):
        dispatch.check_ranks([-1], 4, "worker_idx")
    with pytest.raises(TypeError, match="calls: ranks must be int"):
        dispatch.check_ranks(["0"], 4, "calls")


def test_rank0_only_axes():
    assert dispatch.rank0_only(DP_TP, [0, 1, 2, 3], None) == [0, 1, 2, 3]
    assert dispatch.rank0_only(DP_TP, [0, 1, 2, 3], ["tp"]) == [0, 2]
    assert dispatch.rank0_only(DP_TP, [0, 1, 2, 3], ["dp", "tp"]) == [0]
    with pytest.raises(ValueError, match="run_rank_0_only_axes: unknown axis 'pp'"):
        dispatch.rank0_only(DP_TP, [0, 1, 2, 3], ["pp"])


def test_multiple_data():
    calls = dispatch.multiple_data([0, 2], ([10, 11],), {"x": ["a", "b"]}, {"c": 5})
    assert calls == [(0, (10,), {"x": "a", "c": 5}), (2, (11,), {"x": "b", "c": 5})]
    with pytest.raises(ValueError, match="3 entries for 2"):
        dispatch.multiple_data([0, 1], (), {"x": [1, 2, 3]}, None)
    with pytest.raises(TypeError, match="args\\[0\\] must be a list"):
        dispatch.multiple_data([0, 1], (5,), {}, None)
    with pytest.raises(ValueError, match="repeats per-worker kwargs \\['x'\\]"):
        dispatch.multiple_data([0, 1], (), {"x": [1, 2]}, {"x": 0})
    with pytest.raises(ValueError, match="needs per-worker data"):
        dispatch.multiple_data([0, 1], (), {}, None)


def test_sharded_replicated_and_free_axes():
    plan = dispatch.sharded(
        DP_TP,
        [0, 1, 2, 3],
        (),
        {"data": ["s0", "s1"]},
        in_sharded_axes=["dp"],
        replicate_on_axes=["tp"],
        output_is_replicated=["tp"],
        common_kwargs={"lr": 0.1},
    )
    assert plan.called == [0, 1, 2, 3] and plan.returning == [0, 2]
    assert [k for _, _, k in plan.calls] == [
        {"data": "s0", "lr": 0.1},
        {"data": "s0", "lr": 0.1},
        {"data": "s1", "lr": 0.1},
        {"data": "s1", "lr": 0.1},
    ]
    free = dispatch.sharded(DP_TP, [0, 1, 2, 3], (), {"data": ["a", "b"]}, in_sharded_axes=["dp"])
    assert free.called == [0, 2] and free.returning == [0, 2]
    two = dispatch.sharded(
        DP_TP, [0, 1, 2, 3], (), {"data": [["a", "b"], ["c", "d"]]}, in_sharded_axes=["dp", "tp"]
    )
    assert [k["data"] for _, _, k in two.calls] == ["a", "b", "c", "d"]


def test_sharded_bad_input():
    with pytest.raises(ValueError, match="in_sharded_axes: unknown axes \\['pp'\\]"):
        dispatch.sharded(DP_TP, [0, 1, 2, 3], (), {"d": [1, 2]}, in_sharded_axes=["pp"])
    with pytest.raises(ValueError, match="overlap on \\['dp'\\]"):
        dispatch.sharded(
            DP_TP, [0], (), {"d": [1, 2]}, in_sharded_axes=["dp"], replicate_on_axes=["dp"]
        )
    with pytest.raises(ValueError, match="axis 'dp' has size 2, got 3 shards"):
        dispatch.sharded(DP_TP, [0], (), {"d": [1, 2, 3]}, in_sharded_axes=["dp"])
    with pytest.raises(TypeError, match="d: expected a list of 2 shards along axis 'dp'"):
        dispatch.sharded(DP_TP, [0], (), {"d": "oops"}, in_sharded_axes=["dp"])
    with pytest.raises(ValueError, match="repeats an axis"):
        dispatch.sharded(DP_TP, [0], (), {}, in_sharded_axes=["dp", "dp"])
    with pytest.raises(ValueError, match="common_kwargs repeats sharded kwargs"):
        dispatch.sharded(
            DP_TP, [0], (), {"d": [1, 2]}, in_sharded_axes=["dp"], common_kwargs={"d": 0}
        )


def test_dummy_calls_to_free_axes_get_none():
    plan = dispatch.sharded(
        DP_TP,
        [0, 1, 2, 3],
        (),
        {"data": ["a", "b"]},
        in_sharded_axes=["dp"],
        make_dummy_calls_to_free_axes=True,
    )
    assert plan.called == [0, 1, 2, 3] and plan.returning == [0, 2]
    assert [k["data"] for _, _, k in plan.calls] == ["a", None, "b", None]


class Halves:
    """Any value with ``shard_by_batch_size`` shards itself (the ShardsItself protocol)."""

    def __init__(self, items):
        self.items = items

    def shard_by_batch_size(self, shards, *args, **kwargs):
        n = len(self.items) // shards
        return [self.items[i * n : (i + 1) * n] for i in range(shards)]


def test_values_that_shard_themselves():
    assert isinstance(Halves([]), dispatch.ShardsItself)
    plan = dispatch.sharded(
        DP_TP,
        [0, 1, 2, 3],
        (),
        {"data": Halves([1, 2, 3, 4])},
        in_sharded_axes=["dp"],
        replicate_on_axes=["tp"],
    )
    assert [k["data"] for _, _, k in plan.calls] == [[1, 2], [1, 2], [3, 4], [3, 4]]
    batch = px.BatchedDataDict({"x": torch.arange(8)})
    plan = dispatch.sharded(DP_TP, [0, 1, 2, 3], (batch,), {}, in_sharded_axes=["dp"])
    assert [a[0]["x"].tolist() for _, a, _ in plan.calls] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # for two sharded axes a whole value is not split: it must be nested lists
    with pytest.raises(TypeError, match="expected a list of 2 shards"):
        dispatch.sharded(DP_TP, [0], (Halves([1, 2]),), {}, in_sharded_axes=["dp", "tp"])


def test_foreach_select_drops_unhealthy_workers_functions():
    f0, f1, f2 = (lambda w: 0), (lambda w: 1), (lambda w: 2)
    ranks, funcs = dispatch.foreach_select(
        [0, 1, 2], 3, [f0, f1, f2], healthy_only=True, not_healthy={1}, remote_worker_ids=None
    )
    assert ranks == [0, 2] and funcs == [f0, f2]
    ranks, funcs = dispatch.foreach_select(
        [0, 1, 2], 3, [f0, f1, f2], healthy_only=False, not_healthy={1}, remote_worker_ids=None
    )
    assert ranks == [0, 1, 2] and funcs == [f0, f1, f2]
    ranks, funcs = dispatch.foreach_select(
        [0, 1, 2], 3, [f2, f0], healthy_only=True, not_healthy={2}, remote_worker_ids=[2, 0]
    )
    assert ranks == [0] and funcs == [f0]
    with pytest.raises(ValueError, match="a list of 2 functions for 3 workers"):
        dispatch.foreach_select(
            [0, 1, 2], 3, [f0, f1], healthy_only=True, not_healthy=set(), remote_worker_ids=None
        )
    with pytest.raises(TypeError, match="remote_worker_ids must be a list"):
        dispatch.foreach_select(
            [0, 1], 2, f0, healthy_only=True, not_healthy=set(), remote_worker_ids=1
        )


def test_foreach_plans_and_labels():
    known = {"noop"}

    def check(name):
        if name not in known:
            raise ValueError(f"unknown {name}")

    def sample(w):
        return w

    plan = dispatch.foreach("noop", [0, 1], {"k": 1}, with_id=False, check_method=check)
    assert (plan.method, plan.fn, plan.label) == ("noop", None, "noop")
    assert plan.calls == [(0, (), {"k": 1}), (1, (), {"k": 1})]
    plan = dispatch.foreach(sample, [1], None, with_id=False, check_method=check)
    assert (plan.method, plan.fn, plan.label) == (None, sample, "sample")
    plan = dispatch.foreach(lambda w: w, [1], None, with_id=False, check_method=check)
    assert plan.label == "foreach_worker"
    plan = dispatch.foreach(sample, [0, 3], None, with_id=True, check_method=check)
    assert plan.fn is dispatch.call_with_id and plan.label == "sample"
    assert [c[1] for c in plan.calls] == [(sample, 0), (sample, 3)]
    plan = dispatch.foreach(["noop", sample], [0, 1], None, with_id=False, check_method=check)
    assert plan.fn is dispatch.call_each and plan.label == "foreach_worker"
    with pytest.raises(ValueError, match="unknown nope"):
        dispatch.foreach("nope", [0], None, with_id=False, check_method=check)
    with pytest.raises(TypeError, match="func must be a callable or a method name, got int"):
        dispatch.foreach(3, [0], None, with_id=False, check_method=check)


def test_shared_payload_put_once():
    payload = np.zeros(1 << 20, dtype=np.uint8)
    calls = [(r, (payload,), {"small": 1, "also": payload}) for r in range(4)]
    shared = dispatch.shared_values(calls, lambda v: False)
    assert list(shared) == [id(payload)]  # one object-store copy; small values stay inline
    assert shared[id(payload)] is payload
    one = dispatch.shared_values([(0, (payload,), {})], lambda v: False)
    assert one == {}  # passed to one rank only: nothing to share
    assert dispatch.approx_nbytes({"a": b"x" * 10}) == 11
    assert dispatch.approx_nbytes(torch.zeros(4, dtype=torch.float64)) == 32


def test_approx_nbytes_deep_and_cyclic_values():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert dispatch.approx_nbytes(deep) == dispatch.INLINE_LIMIT  # gave up: assumed big
    cyclic: dict = {"a": b"x" * 10}
    cyclic["self"] = cyclic
    assert dispatch.approx_nbytes(cyclic) == 1 + 10 + 4  # each container looked at once
    looped: list = [b"y" * 5]
    looped.append(looped)
    assert dispatch.approx_nbytes(looped) == 5
    assert dispatch.approx_nbytes([b"z"] * 10_000) == dispatch.INLINE_LIMIT  # item cap
    calls = [(r, (cyclic,), {}) for r in range(2)]
    assert dispatch.shared_values(calls, lambda v: False) == {}  # small: stays inline


def test_count_mismatches_are_assertion_and_value_errors():
    with pytest.raises(AssertionError) as info:
        dispatch.multiple_data([0, 1], (), {"x": [1]}, None)
    assert (
        isinstance(info.value, ValueError)
        and str(info.value) == "x has 1 entries for 2 called workers"
    )
    with pytest.raises(AssertionError, match="a list of 1 functions for 2 workers"):
        dispatch.foreach_select(
            [0, 1], 2, [len], healthy_only=True, not_healthy=set(), remote_worker_ids=None
        )
    assert dispatch.check_ranks([np.int64(1)], 2, "ranks") == [1]
