"""Read-only receivers: their parameters are views of the sender's shared buffers."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch

import phalanx as px
from tests.helpers import shm_files


def make_model(width: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 3))


class Viewer(px.Worker):
    """An inference-only receiver."""

    read_only_weights = True

    def __init__(self):
        super().__init__()
        self.model = make_model()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def version(self) -> int:
        return self.weights_version

    def shared_files(self) -> set[str]:
        """The files under /dev/shm that the model's tensors live in (empty: private)."""
        return shm_files(self.model.state_dict().values())[0]

    def forward_twice(self, pause_s: float, started: str) -> tuple[float, float]:
        x = torch.ones(1, 16)
        a = float(self.model(x).sum())
        open(started, "w").close()
        time.sleep(pause_s)
        return a, float(self.model(x).sum())

    def load(self, value: float) -> bool:
        """Writes into the parameters the ordinary way."""
        self.model.load_state_dict(
            {k: torch.full_like(v, value) for k, v in self.model.state_dict().items()}
        )
        return True


def _bump(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.add_(torch.randn(t.shape, generator=g))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _wait_file(path: str) -> None:
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


@pytest.fixture
def viewers(cluster, request):
    g = Viewer.create_group().launch(
        cluster, px.NodePlacement(num_workers=3), name=f"w_view_{request.node.name[-20:]}"
    )
    yield g
    g.shutdown(force=True)


@pytest.mark.timeout(120)
def test_views_not_copies_versions_whole_and_monotonic(viewers):
    model = make_model()
    sender = px.WeightSender(viewers, model)
    try:
        for step in range(4):  # more sends than buffers: buffers are reused
            sent = _bump(model, step)
            result = sender.send()
            assert result.applied == [0, 1, 2], result
            assert result.routes == dict.fromkeys([0, 1, 2], "shm_view")
            for state in viewers.state().wait(timeout=30):
                assert _equal(state, sent)
            files = viewers.shared_files().wait(timeout=30)
            assert all(len(f) == 1 for f in files) and files[0] == files[1] == files[2]
            assert files[0] <= set(sender.shared_buffers)
        assert viewers.version().wait(timeout=30) == [sender.version] * 3
        assert len(sender.shared_buffers) == 2  # double-buffered when all stay in step
    finally:
        sender.close()


@pytest.mark.timeout(120)
def test_a_buffer_a_receiver_views_is_never_rewritten(viewers):
    model = make_model()
    sender = px.WeightSender(viewers, model)
    try:
        first = _bump(model, 10)
        assert sender.send().applied == [0, 1, 2]
        for step in range(11, 15):  # rank 0 keeps viewing the first buffer meanwhile
            last = _bump(model, step)
            assert sender.send(worker_ids=[1, 2]).routes == {1: "shm_view", 2: "shm_view"}
        assert _equal(viewers.execute_on(0).state().wait(timeout=30)[0], first)
        for state in viewers.execute_on(1, 2).state().wait(timeout=30):
            assert _equal(state, last)
        assert len(sender.shared_buffers) == 3  # rank 0's, and two for ranks 1 and 2
    finally:
        sender.close()


@pytest.mark.timeout(120)
def test_switch_happens_between_calls(viewers, tmp_path):
    model = make_model()
    sender = px.WeightSender(viewers, model)
    try:
        sender.send()
        _bump(model, 20)
        flag = str(tmp_path / "fwd")
        reading = viewers.execute_on(1).forward_twice(1.0, flag)
        _wait_file(flag)
        result = sender.send()
        a, b = reading.wait(timeout=30)[0]
        assert a == b  # the version did not change under the running call
        assert result.applied == [0, 1, 2]
    finally:
        sender.close()


@pytest.mark.timeout(120)
def test_load_state_dict_on_a_viewer_does_not_touch_the_shared_buffer(viewers):
    model = make_model()
    sender = px.WeightSender(viewers, model)
    try:
        sent = _bump(model, 30)
        sender.send()
        assert viewers.execute_on(0).load(7.0).wait(timeout=30) == [True]
        mine = viewers.execute_on(0).state().wait(timeout=30)[0]
        assert all(torch.equal(v, torch.full_like(v, 7.0)) for v in mine.values())
        assert viewers.execute_on(0).shared_files().wait(timeout=30) == [set()]
        for state in viewers.execute_on(1, 2).state().wait(timeout=30):
            assert _equal(state, sent)  # the others still see what was sent
        again = _bump(model, 31)
        assert sender.send().routes[0] == "shm_view"  # and rank 0 views the next version
        assert _equal(viewers.execute_on(0).state().wait(timeout=30)[0], again)
    finally:
        sender.close()


@pytest.mark.timeout(120)
def test_killed_viewer_never_blocks_the_sender(viewers):
    model = make_model()
    sender = px.WeightSender(viewers, model, timeout_s=30)
    try:
        sender.send()
        ray.kill(viewers.actors[0], no_restart=True)
        for step in range(40, 46):  # the dead rank's buffer is retired, never waited on
            sent = _bump(model, step)
            t0 = time.perf_counter()
            result = sender.send(worker_ids=[1, 2])
            assert time.perf_counter() - t0 < 10
            assert result.applied == [1, 2]
            for state in viewers.execute_on(1, 2).state().wait(timeout=30):
                assert _equal(state, sent)
        assert len(sender.shared_buffers) <= 3
    finally:
        sender.close()


@pytest.mark.timeout(120)
def test_outside_writers_fill_reserved_ring_buffers(viewers):
    """``reserve_shared_buffer`` + ``send_prepared``: another mapping writes the version
    (as a trainer's ranks do) and read-only receivers view it, under the ring's rules."""
    from phalanx.comm.shm import Segment
    from phalanx.weights import gather, pack_range

    model = make_model()
    sender = px.WeightSender(viewers, model)
    maps: dict[str, Segment] = {}

    def write(path: str, state: dict[str, torch.Tensor]) -> px.weights.Layout:
        layout, sources = gather(state)
        seg = maps.setdefault(path, Segment.attach(path))
        pack_range(seg.tensor[: layout.total_bytes], layout, sources, 0, layout.total_bytes)
        return layout

    try:
        with pytest.raises(ValueError, match="nbytes"):
            sender.reserve_shared_buffer(0)
        first = _bump(model, 60)
        nbytes = gather(first)[0].total_bytes
        held = sender.reserve_shared_buffer(nbytes)
        result = sender.send_prepared("shm", write(held, first), {"path": held})
        assert result.applied == [0, 1, 2]
        assert result.routes == dict.fromkeys([0, 1, 2], "shm_view")
        assert viewers.shared_files().wait(timeout=30) == [{held}] * 3
        for state in viewers.state().wait(timeout=30):
            assert _equal(state, first)

        # Rank 0 keeps viewing the first buffer: it is never handed out again, nor is
        # the newest version's buffer (kept for restarts).
        newest, reserved = held, []
        for step in range(61, 66):
            last = _bump(model, step)
            path = sender.reserve_shared_buffer(nbytes)
            assert path not in (held, newest)
            assert sender.reserve_shared_buffer(nbytes) == path  # an unsent one is reused
            result = sender.send_prepared("shm", write(path, last), {"path": path}, [1, 2])
            assert result.routes == {1: "shm_view", 2: "shm_view"}
            newest = path
            reserved.append(path)
        assert len(set(reserved)) == 2 and len(sender.shared_buffers) == 3
        assert _equal(viewers.execute_on(0).state().wait(timeout=30)[0], first)
        for state in viewers.execute_on(1, 2).state().wait(timeout=30):
            assert _equal(state, last)
        assert viewers.version().wait(timeout=30) == [1, sender.version, sender.version]
    finally:
        sender.close()


@pytest.mark.timeout(120)
def test_a_copied_version_gives_a_viewer_private_storage_first(viewers):
    """A version that arrives by copy (object store, partial) never writes into the
    shared buffer a viewer held: the viewer gets its own storage, keeping what the
    version does not carry."""
    model = make_model()
    sender = px.WeightSender(viewers, model)
    copier = None
    try:
        shared = _bump(model, 70)
        sender.send()
        copier = px.WeightSender(viewers, transport="object_store", strict=False)
        (path,) = viewers.execute_on(0).shared_files().wait(timeout=30)[0]
        part = {"0.weight": torch.full((16, 16), 3.0)}
        result = copier.send(part, worker_ids=[0])
        assert result.routes == {0: "object_store"} and result.applied == [0]
        assert viewers.execute_on(0).shared_files().wait(timeout=30) == [set()]
        mine = viewers.execute_on(0).state().wait(timeout=30)[0]
        assert _equal(mine, {**shared, **part})
        for state in viewers.execute_on(1, 2).state().wait(timeout=30):
            assert _equal(state, shared)  # the buffer they view is untouched
        assert viewers.execute_on(1).shared_files().wait(timeout=30) == [{path}]
    finally:
        if copier is not None:
            copier.close()
        sender.close()
