"""A message without tensors costs neither side an import of torch (a worker process that
never touches a tensor stays light)."""

from __future__ import annotations

import sys

import pytest

import phalanx as px

pytestmark = pytest.mark.timeout(120)


class Plain(px.Worker):
    def send_to(self, obj, group, rank):
        self.send(obj, group, rank)

    def recv_one(self, group, rank):
        return self.recv(group, rank, timeout=60)

    def has_torch(self):
        return "torch" in sys.modules


def test_a_message_without_tensors_imports_no_torch(cluster):
    s = Plain.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="nt_s")
    r = Plain.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="nt_r")
    try:
        got = r.recv_one(s.name, 0)
        s.send_to({"plain": [1, 2.5, "x"], "bytes": b"\x00" * 70_000}, r.name, 0).wait(timeout=60)
        assert got.wait(timeout=60) == [{"plain": [1, 2.5, "x"], "bytes": b"\x00" * 70_000}]
        assert s.has_torch().wait(timeout=60) == [False]
        assert r.has_torch().wait(timeout=60) == [False]
    finally:
        s.shutdown()
        r.shutdown()
