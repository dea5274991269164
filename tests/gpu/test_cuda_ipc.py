"""CUDA IPC weight transport between two processes on one GPU (``torch.multiprocessing``).

The sender packs a version of its weights into one CUDA buffer and shares its handle
(``phalanx.weights.pack_to_cuda`` / ``ipc_handle``); the receiver (this process) opens
it (``open_handle``), reads typed views (``views``) and copies them into its own tensors.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu import procs
from tests.gpu.skips import needs_gpu

pytestmark = [*needs_gpu(), pytest.mark.timeout(180)]


@pytest.fixture
def sender():
    out_q, cmd_q = procs.queues(2)
    proc = procs.start(procs.ipc_sender, out_q, cmd_q)
    yield proc, out_q, cmd_q
    if proc.is_alive():
        cmd_q.put("exit")
        proc.join(30)
    if proc.is_alive():
        proc.kill()


def _receive(out_q, cmd_q):
    cmd_q.put("next")
    return out_q.get(timeout=120)


def test_receiver_tensors_equal_the_senders_and_a_new_version_replaces_the_old(sender):
    from phalanx.weights import open_handle, views

    proc, out_q, cmd_q = sender
    own = {k: torch.zeros_like(v, device="cuda") for k, v in procs.version_tensors(1).items()}
    for version in (1, 2):
        msg = _receive(out_q, cmd_q)
        assert msg["version"] == version and msg["pid"] == proc.pid
        flat = open_handle(msg["handle"])
        assert flat.device.type == "cuda" and flat.dtype == torch.uint8
        got = views(flat, msg["layout"])
        assert set(got) == set(own)
        for k, v in got.items():
            own[k].copy_(v)
        torch.cuda.synchronize()
        expected = procs.version_tensors(version)
        for k, v in expected.items():
            assert own[k].dtype == v.dtype and own[k].shape == v.shape
            assert torch.equal(own[k].cpu(), v), k
    # the second version replaced the first everywhere (no tensor kept its old values)
    first = procs.version_tensors(1)
    assert all(not torch.equal(own[k].cpu(), first[k]) for k in own)


def test_the_transport_receive_function_gives_views_of_the_senders_buffer(sender):
    from phalanx.weights.transports import cuda_ipc

    _, out_q, cmd_q = sender
    msg = _receive(out_q, cmd_q)
    got, finish = cuda_ipc.receive(None, msg["layout"], msg["handle"], skip=False)
    finish()
    for k, v in procs.version_tensors(1).items():
        assert torch.equal(got[k].cpu(), v), k
    assert cuda_ipc.receive(None, msg["layout"], msg["handle"], skip=True)[0] == {}


def test_the_handle_of_a_dead_sender_fails_with_a_named_error(sender):
    from phalanx.comm.errors import PeerDiedError
    from phalanx.weights import open_handle

    proc, out_q, cmd_q = sender
    msg = _receive(out_q, cmd_q)
    cmd_q.put("exit")
    proc.join(60)
    assert proc.exitcode == 0
    with pytest.raises(PeerDiedError, match="cuda_ipc"):
        open_handle(msg["handle"])


def test_a_handle_for_another_gpu_names_the_gpu(sender):
    from phalanx.weights import open_handle

    _, out_q, cmd_q = sender
    msg = _receive(out_q, cmd_q)
    handle = {**msg["handle"], "uuid": "GPU-00000000-0000-0000-0000-000000000000"}
    with pytest.raises(
        RuntimeError, match="GPU-00000000-0000-0000-0000-000000000000 is not visible"
    ):
        open_handle(handle)
