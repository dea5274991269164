"""A sender killed mid-send leaves no shared memory behind once phalanx starts again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import ray

import phalanx as px

_SENDER = """
import sys, torch, ray
import phalanx as px

class Receiver(px.Worker):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Linear(512, 512)

ray.init(address=sys.argv[1], namespace=sys.argv[2])
g = Receiver.create_group().launch(px.Cluster(), px.NodePlacement(num_workers=1), name="w_leak")
model = torch.nn.Linear(512, 512)
sender = px.WeightSender(g, model)
sender.send()  # its shared buffer exists from now on
print(" ".join(sender.shared_buffers), flush=True)
while True:  # killed in the middle of one of these
    with torch.no_grad():
        model.weight.add_(1.0)
    sender.send()
"""


class Probe(px.Worker):
    def pid(self) -> int:
        return os.getpid()


@pytest.mark.timeout(240)
def test_sender_killed_mid_send_leaves_no_segment(cluster):
    ctx = ray.get_runtime_context()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SENDER, ctx.gcs_address, ctx.namespace],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        paths = proc.stdout.readline().split()
        assert len(paths) == 1 and os.path.exists(paths[0]), paths
        assert all(os.path.basename(p).startswith(f"px_w_{proc.pid}-") for p in paths)
        os.kill(proc.pid, signal.SIGKILL)  # mid-send: it cannot clean up
        proc.wait(timeout=30)
        # Left behind by the dead sender until a phalanx process starting on the node
        # reaps it (any would: here a new worker).
        g = Probe.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="w_reap")
        try:
            assert g.pid().wait(timeout=60)[0] > 0
            assert not any(os.path.exists(p) for p in paths)
        finally:
            g.shutdown()
    finally:
        if proc.poll() is None:
            proc.kill()
