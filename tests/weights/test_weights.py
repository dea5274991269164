"""Weight sync: senders, receivers and every transport, on a real local Ray."""

from __future__ import annotations

import os
import threading
import time

import pytest
import ray
import torch

import phalanx as px


def make_model(width: int = 32, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 3)
    )
    return m.to(dtype)


class Receiver(px.Worker):
    """Holds a model; reports its weights and the identity of its parameter tensors."""

    def __init__(self, width: int = 32, dtype: str = "float32"):
        super().__init__()
        self.model = make_model(width, getattr(torch, dtype))
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()
        self._ptrs = self.ptrs()

    def ptrs(self) -> dict[str, int]:
        return {k: v.data_ptr() for k, v in self.model.state_dict(keep_vars=True).items()}

    def same_storage(self) -> bool:
        return self.ptrs() == self._ptrs

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def version(self) -> int:
        return self.weights_version

    def torn(self) -> int:
        return self.weights_torn

    def read_twice(self, pause_s: float, started: str) -> tuple[float, float, int, int]:
        """Reads the weights, sleeps, reads again: equal unless a version landed mid-call."""
        a = float(self.model[0].weight.sum())
        v0 = self.weights_version
        open(started, "w").close()
        time.sleep(pause_s)
        return a, float(self.model[0].weight.sum()), v0, self.weights_version

    def sleep(self, s: float, started: str | None = None) -> int:
        if started:
            open(started, "w").close()  # tells the test the call is running
        time.sleep(s)
        return self.rank


class Renamed(px.Worker):
    """An inference model whose names differ from the trainer's (``policy.`` prefix)."""

    def __init__(self):
        super().__init__()
        self.policy = make_model(32, torch.bfloat16)

    def weights_module(self) -> torch.nn.Module:
        return torch.nn.ModuleDict({"policy": self.policy})

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.policy.state_dict().items()}


def _bump(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise equality (NaN-safe) of two state dicts."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _wait_file(path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _busy(group, rank: int, seconds: float, tmp_path) -> object:
    """Start ``sleep`` on ``rank`` and return its handle once the call is running."""
    flag = str(tmp_path / f"busy_{rank}_{time.monotonic_ns()}")
    handle = group.execute_on(rank).sleep(seconds, flag)
    _wait_file(flag)
    return handle


@pytest.fixture(scope="module")
def receivers(cluster):
    g = Receiver.create_group().launch(cluster, px.NodePlacement(num_workers=3), name="w_recv")
    yield g
    g.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["auto", "object_store", "shm", "collective"])
@pytest.mark.parametrize("bucket_size_mb", [64, 0.001])  # 1 KiB buckets: tensors span buckets
def test_bitwise_equal_after_several_updates(receivers, transport, bucket_size_mb):
    model = make_model()
    sender = px.WeightSender(receivers, model, transport=transport, bucket_size_mb=bucket_size_mb)
    # One node, CPU weights: "auto" (the default) takes shared memory.
    route = {"auto": "shm"}.get(transport, transport)
    try:
        for step in range(3):
            _bump(model, step)
            result = sender.send()
            assert result.ok and result.applied == [0, 1, 2], result
            assert result.routes == dict.fromkeys([0, 1, 2], route)
            assert result.version == sender.version
            expected = _snapshot(model)
            for state in receivers.state().wait(timeout=60):
                assert _equal(state, expected)
        # In place: the receivers' parameter tensors were never re-allocated.
        assert receivers.same_storage().wait(timeout=60) == [True, True, True]
        assert receivers.version().wait(timeout=60) == [sender.version] * 3
        assert {"gather", "transfer", "apply", "total"} <= set(result.timings)
        assert sender.timers.peek()["weights/gather"] > 0
    finally:
        sender.close()


@pytest.mark.timeout(60)
def test_worker_ids_subsets(receivers):
    model = make_model()
    sender = px.WeightSender(receivers, model)
    before = receivers.state().wait(timeout=60)
    _bump(model, 10)
    assert sender.send(worker_ids=1).applied == [1]
    after = receivers.state().wait(timeout=60)
    assert _equal(after[1], _snapshot(model))
    assert _equal(after[0], before[0]) and _equal(after[2], before[2])
    _bump(model, 11)
    assert sender.send(worker_ids=[2, 0]).applied == [0, 2]
    after = receivers.state().wait(timeout=60)
    assert _equal(after[0], _snapshot(model)) and _equal(after[2], _snapshot(model))
    assert not _equal(after[1], _snapshot(model))
    with pytest.raises(ValueError, match="worker_ids"):
        sender.send(worker_ids=[5])
    with pytest.raises(TypeError, match="worker_ids"):
        sender.send(worker_ids="0")
    sender.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["auto", "object_store", "collective"])
def test_async_send_overlaps_sender_computation(receivers, transport, tmp_path):
    model = make_model()
    sender = px.WeightSender(receivers, model, transport=transport)
    with pytest.raises(RuntimeError, match="no send_async"):
        sender.wait_async()
    _bump(model, 20)
    sent = _snapshot(model)
    busy = _busy(receivers, 0, 1.5, tmp_path)  # rank 0 applies only after this call
    t0 = time.perf_counter()
    sender.send_async()
    returned_after = time.perf_counter() - t0
    assert returned_after < 1.0
    with pytest.raises(RuntimeError, match="pending"):
        sender.send_async()
    with pytest.raises(RuntimeError, match="pending"):
        sender.send()
    # The sender keeps training while the send is in flight: the snapshot is what arrives.
    x = torch.randn(64, 32)
    for step in range(5):
        model(x).sum().backward()
        _bump(model, 21 + step)
    assert not busy.done()
    result = sender.wait_async()
    assert result.applied == [0, 1, 2]
    assert busy.wait(timeout=30) == [0]
    for state in receivers.state().wait(timeout=60):
        assert _equal(state, sent)
    sender.close()


@pytest.mark.timeout(60)
def test_applied_between_calls_no_torn_reads(receivers, tmp_path):
    model = make_model()
    sender = px.WeightSender(receivers, model)
    _bump(model, 30)
    reading = receivers.execute_on(2).read_twice(1.0, str(tmp_path / "reading"))
    _wait_file(tmp_path / "reading")
    result = sender.send()
    a, b, v0, v1 = reading.wait(timeout=30)[0]
    assert a == b and v0 == v1  # nothing changed during the call
    assert result.applied == [0, 1, 2]
    assert receivers.execute_on(2).version().wait(timeout=30) == [result.version]
    sender.close()


@pytest.mark.timeout(60)
def test_out_of_order_and_repeated_versions_ignored(receivers):
    model = make_model()
    # Three senders start at the same version: their sends race like delayed messages.
    ahead, same, behind = (px.WeightSender(receivers, model) for _ in range(3))
    _bump(model, 40)
    ahead.send()
    new = ahead.send()
    assert new.applied == [0, 1, 2]
    current = _snapshot(model)
    _bump(model, 41)
    same.send()
    again = same.send()  # the same version again
    assert again.version == new.version and again.ignored == [0, 1, 2] and not again.applied
    old = behind.send()  # an older version arriving late
    assert old.version < new.version and old.ignored == [0, 1, 2] and not old.applied
    for state in receivers.state().wait(timeout=60):
        assert _equal(state, current)
    assert receivers.version().wait(timeout=60) == [new.version] * 3
    # A new sender continues above the versions the workers hold.
    assert px.WeightSender(receivers, model).version == new.version
    for s in (ahead, same, behind):
        s.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["auto", "object_store", "collective"])
def test_mismatch_errors_leave_receiver_unchanged(receivers, transport):
    model = make_model()
    sender = px.WeightSender(receivers, model, transport=transport)
    before = receivers.state().wait(timeout=60)
    bad = _snapshot(model)
    bad["2.weight"] = torch.ones(4, 32)  # receiver has [3, 32]
    with pytest.raises(px.WeightMismatchError, match=r"'2.weight'.*\[3, 32\].*\[4, 32\]") as e:
        sender.send(bad)
    assert e.value.result.failed.keys() == {0, 1, 2}
    unknown = {**_snapshot(model), "head.bias": torch.ones(3)}
    with pytest.raises(px.WeightMismatchError, match="unknown parameter 'head.bias'"):
        sender.send(unknown)
    wrong_dtype = {**_snapshot(model), "0.bias": torch.ones(32, dtype=torch.float64)}
    with pytest.raises(px.WeightMismatchError, match="'0.bias': dtype mismatch"):
        sender.send(wrong_dtype)
    after = receivers.state().wait(timeout=60)
    assert all(_equal(a, b) for a, b in zip(after, before))
    with pytest.raises(TypeError, match="weights"):
        sender.send([1, 2])
    sender.close()


@pytest.mark.timeout(60)
def test_weights_from_dict_tensordict_and_module(receivers):
    from tensordict import TensorDict

    model = make_model()
    sender = px.WeightSender(receivers)  # no model: weights must be given
    with pytest.raises(ValueError, match="model"):
        sender.send()
    _bump(model, 50)
    assert sender.send(model).ok
    _bump(model, 51)
    assert sender.update_weights(TensorDict.from_module(model)).applied == [0, 1, 2]
    for state in receivers.state().wait(timeout=60):
        assert _equal(state, _snapshot(model))
    _bump(model, 52)
    assert sender.send(dict(model.state_dict()), worker_ids=0).applied == [0]
    assert _equal(receivers.execute_on(0).state().wait(timeout=60)[0], _snapshot(model))


@pytest.mark.timeout(60)
def test_restore_resyncs_a_worker(receivers):
    model = make_model()
    sender = px.WeightSender(receivers, model)
    _bump(model, 60)
    sender.send(worker_ids=[0, 1])
    v = sender.version
    assert receivers.execute_on(2).version().wait(timeout=30)[0] < v
    receivers.run_restart_hooks([2])
    assert receivers.execute_on(2).version().wait(timeout=30) == [v]
    assert _equal(receivers.execute_on(2).state().wait(timeout=30)[0], _snapshot(model))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["object_store", "shm", "collective"])
def test_dtype_cast_and_name_map(cluster, transport):
    g = Renamed.create_group().launch(
        cluster, px.NodePlacement(num_workers=2), name=f"w_ren_{transport}"
    )
    try:
        model = make_model()  # fp32 trainer, bf16 receivers named policy.*
        sender = px.WeightSender(
            g,
            model,
            transport=transport,
            dtype=torch.bfloat16,
            name_map=lambda n: f"policy.{n}",
            bucket_size_mb=0.001,
        )
        for step in (70, 71):  # twice: packing buffers are reused between sends
            _bump(model, step)
            result = sender.send()
            assert result.applied == [0, 1], result
            expected = {
                k: v.to(torch.bfloat16) if v.is_floating_point() else v
                for k, v in model.state_dict().items()
            }
            for state in g.state().wait(timeout=60):
                assert _equal(state, expected)
        # Without the cast the dtypes do not match: an error naming the parameter.
        plain = px.WeightSender(g, model, transport=transport, name_map=lambda n: f"policy.{n}")
        with pytest.raises(px.WeightMismatchError, match="dtype mismatch"):
            plain.send()
        sender.close()
        plain.close()
    finally:
        g.shutdown()


@pytest.mark.timeout(60)
def test_ray_module_transform_sender(cluster):
    g = Receiver.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="w_rmt")
    try:
        model = make_model()
        _bump(model, 80)
        sender = px.RayModuleTransformSender(g, model)
        assert sender.update_weights(model).applied == [0]
        _bump(model, 81)
        sender.send_async()
        assert sender.wait_async().applied == [0]
        assert _equal(g.state().wait(timeout=30)[0], _snapshot(model))
    finally:
        g.shutdown()


def test_bad_arguments(receivers):
    with pytest.raises(ValueError, match="transport"):
        px.WeightSender(receivers, transport="pigeon")
    with pytest.raises(TypeError, match="group"):
        px.WeightSender(object())
    with pytest.raises(ValueError, match="bucket_size_mb"):
        px.WeightSender(receivers, bucket_size_mb=0)
    with pytest.raises(TypeError, match="dtype"):
        px.WeightSender(receivers, dtype="bf16")
    with pytest.raises(TypeError, match="name_map"):
        px.WeightSender(receivers, name_map=3)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["auto", "object_store", "collective"])
def test_receiver_killed_during_send(cluster, transport, tmp_path):
    g = Receiver.create_group().launch(
        cluster, px.NodePlacement(num_workers=3), name=f"w_kill_{transport}"
    )
    try:
        model = make_model()
        sender = px.WeightSender(g, model, transport=transport, timeout_s=60)
        assert sender.send().ok  # process groups exist before the kill
        _bump(model, 90)
        busy = _busy(g, 1, 30, tmp_path)  # rank 1 cannot apply until this call ends
        t0 = time.perf_counter()
        sender.send_async()
        threading.Timer(0.5, lambda: ray.kill(g.actors[1], no_restart=True)).start()
        result = sender.wait_async()
        assert time.perf_counter() - t0 < 50
        assert result.applied == [0, 2] and list(result.failed) == [1], result
        states = g.execute_on(0, 2).state().wait(timeout=30)
        assert all(_equal(s, _snapshot(model)) for s in states)
        with pytest.raises(px.WorkerDiedError):  # the worker is gone
            busy.wait(timeout=30)
        # Later sends still reach the survivors.
        _bump(model, 91)
        again = sender.send()
        assert again.applied == [0, 2] and list(again.failed) == [1]
    finally:
        g.shutdown(force=True)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bucket_bytes", [64, 1024, 1 << 20, 64 << 20])
def test_collective_plan_covers_every_tensor_once(bucket_bytes):
    from phalanx.weights.layout import gather, to_named_tensors
    from phalanx.weights.transports.collective import plan

    named = {**to_named_tensors(make_model(64)), "big": torch.zeros(300_000), "e": torch.zeros(0)}
    layout, _ = gather(named)
    segs = plan(layout, bucket_bytes)
    covered = torch.zeros(layout.total_bytes, dtype=torch.int32)
    for start, end, i in segs:
        assert 0 < end - start <= bucket_bytes
        covered[start:end] += 1
        if i >= 0:  # a direct segment lies inside its one tensor
            spec = layout.specs[i]
            assert spec.offset <= start and end <= spec.offset + spec.nbytes
        else:  # a packed bucket holds whole tensors only
            for spec in layout.specs:
                lo, hi = max(start, spec.offset), min(end, spec.offset + spec.nbytes)
                assert lo >= hi or (lo, hi) == (spec.offset, spec.offset + spec.nbytes)
    for spec in layout.specs:
        assert bool((covered[spec.offset : spec.offset + spec.nbytes] == 1).all()), spec.name
    assert int(covered.max()) <= 1


@pytest.mark.timeout(90)
def test_collective_broken_midway_claims_no_version(cluster):
    """The sender stops after the first segment: receivers that were receiving in place
    time out, keep their old version and say they are torn; a whole version repairs them."""
    from phalanx.weights.layout import as_bytes, gather, to_named_tensors
    from phalanx.weights.transports.collective import CollectiveSender, broadcast, plan

    g = Receiver.create_group().launch(cluster, px.NodePlacement(num_workers=2), name="w_torn")
    try:
        model = make_model()
        sender = px.WeightSender(
            g, model, transport="collective", bucket_size_mb=0.001, timeout_s=3
        )
        assert sender.send().ok
        v_old = sender.version
        _bump(model, 100)
        key, pg = CollectiveSender(sender).process_group([0, 1], "gloo")
        layout, sources = gather(to_named_tensors(model))
        payload = {"key": key, "bucket_bytes": sender.bucket_bytes}
        refs = [sender._apply_remote(r, "collective", v_old + 1, layout, payload) for r in (0, 1)]
        start, end, i = plan(layout, sender.bucket_bytes)[0]
        assert i >= 0  # the first tensor is sent straight from its storage
        spec = layout.specs[i]
        broadcast(pg, as_bytes(sources[i])[start - spec.offset : end - spec.offset]).wait()
        for ref in refs:
            with pytest.raises(ray.exceptions.RayTaskError):
                ray.get(ref, timeout=60)
        assert g.version().wait(timeout=30) == [v_old, v_old]
        assert g.torn().wait(timeout=30) == [v_old + 1, v_old + 1]
        sender.close()
        # A new sender (new process group) sends a whole version: consistent again.
        again = px.WeightSender(g, model, transport="collective", bucket_size_mb=0.001)
        assert again.send().applied == [0, 1]
        assert g.torn().wait(timeout=30) == [0, 0]
        assert all(_equal(s, _snapshot(model)) for s in g.state().wait(timeout=30))
        again.close()
    finally:
        g.shutdown(force=True)


@pytest.mark.timeout(60)
def test_shm_straggler_reads_a_segment_that_is_not_rewritten(receivers, tmp_path):
    """A worker that misses the deadline applies later from the segment it was given: the
    sender moves to a new segment, so what the straggler reads is still a whole version."""
    model = make_model()
    sender = px.WeightSender(receivers, model, timeout_s=1.0, apply_timeout_s=30)
    try:
        busy = _busy(receivers, 1, 3.0, tmp_path)
        _bump(model, 110)
        sent = _snapshot(model)
        late = sender.send()
        assert late.applied == [0, 2] and list(late.failed) == [1] and late.routes[1] == "shm"
        assert sender.shared_buffers == []  # retired: the straggler may still read it
        _bump(model, 111)
        assert sender.send(worker_ids=[0, 2]).applied == [0, 2]
        busy.wait(timeout=30)
        deadline = time.time() + 20
        while receivers.execute_on(1).version().wait(timeout=30)[0] < late.version:
            assert time.time() < deadline, "the straggler never applied its version"
            time.sleep(0.1)
        assert _equal(receivers.execute_on(1).state().wait(timeout=30)[0], sent)
    finally:
        sender.close()
