"""A full /dev/shm: transport="auto" falls back to the object store and says so once;
transport="shm" raises an error naming /dev/shm and the size."""

from __future__ import annotations

import errno
import logging
import shutil

import pytest
import torch

import phalanx as px


class Receiver(px.Worker):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Linear(64, 64)

    def weight_sum(self) -> float:
        return float(self.model.weight.detach().sum())


def _bump(model: torch.nn.Module, value: float) -> float:
    with torch.no_grad():
        model.weight.fill_(value)
    return float(model.weight.detach().sum())


@pytest.fixture
def receivers(cluster):
    g = Receiver.create_group().launch(cluster, px.NodePlacement(num_workers=2), name="w_shmfull")
    yield g
    g.shutdown()


def test_auto_falls_back_to_the_object_store_and_logs_once(receivers, caplog):
    model = torch.nn.Linear(64, 64)
    # The sender may use at most 1 KiB of /dev/shm: the 16.6 KB buffer does not fit.
    sender = px.WeightSender(receivers, model, shm_max_mb=1 / 1024)
    try:
        with caplog.at_level(logging.WARNING, logger="phalanx.weights.sender"):
            first = sender.send()
            expected = _bump(model, 0.5)
            second = sender.send()
        assert first.applied == [0, 1] and second.applied == [0, 1]
        assert first.routes == {0: "object_store", 1: "object_store"}
        assert second.routes == {0: "object_store", 1: "object_store"}
        assert receivers.weight_sum().wait(timeout=60) == [expected, expected]
        assert sender.shared_buffers == []
        warnings = [r.getMessage() for r in caplog.records if "/dev/shm" in r.getMessage()]
        assert len(warnings) == 1
        assert "no room for a weights buffer of 16640 bytes" in warnings[0]
        assert "object store" in warnings[0]
    finally:
        sender.close()


def test_explicit_shm_raises_naming_dev_shm_and_the_size(receivers):
    model = torch.nn.Linear(64, 64)
    sender = px.WeightSender(receivers, model, transport="shm", shm_max_mb=1 / 1024)
    try:
        with pytest.raises(OSError, match=r"/dev/shm has no room .* 16640 bytes") as info:
            sender.send()
        assert info.value.errno == errno.ENOSPC
    finally:
        sender.close()


def test_a_real_enospc_names_dev_shm_and_the_size(receivers):
    # More than the whole of /dev/shm: the kernel refuses the allocation at once.
    too_big = shutil.disk_usage("/dev/shm").total + (1 << 30)
    sender = px.WeightSender(receivers, transport="shm")
    try:
        with pytest.raises(OSError, match=rf"/dev/shm has no room .* {too_big} bytes") as info:
            sender.reserve_shared_buffer(too_big)
        assert info.value.errno == errno.ENOSPC
        assert info.value.__cause__.errno == errno.ENOSPC  # the kernel's own error
        assert sender.shared_buffers == []
    finally:
        sender.close()


def test_shm_max_mb_is_checked(receivers):
    with pytest.raises(ValueError, match="shm_max_mb must be >= 0"):
        px.WeightSender(receivers, shm_max_mb=-1)
    with pytest.raises(TypeError, match="shm_max_mb must be a number"):
        px.WeightSender(receivers, shm_max_mb=True)
