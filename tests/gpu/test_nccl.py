"""NCCL process groups: world size 1 in this process (torch allows one NCCL rank), and the
two-rank broadcast of a weights stream, which needs a GPU per rank."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import procs
from tests.gpu.skips import skip_unless

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]


@pytest.mark.parametrize("bucket_bytes", [256, 1 << 20])
@skip_unless(1)
def test_nccl_group_of_one_broadcasts_reduces_and_streams(bucket_bytes):
    from phalanx.comm.process_group import broadcast, host_store, make_process_group
    from phalanx.weights import broadcast_stream, gather, pack_to_cuda, receive_stream, views

    store = host_store("127.0.0.1", 60.0, procs.free_port())
    pg = make_process_group("nccl", store, 0, 1, prefix="kit_one", timeout_s=60.0)
    t = torch.arange(10, dtype=torch.float32, device="cuda")
    broadcast(pg, t).wait()
    assert torch.equal(t.cpu(), torch.arange(10, dtype=torch.float32))
    pg.allreduce([t]).wait()  # a sum over one rank
    assert torch.equal(t.cpu(), torch.arange(10, dtype=torch.float32))

    expected = procs.version_tensors(1)
    layout, sources = gather({k: v.cuda() for k, v in expected.items()})
    broadcast_stream(pg, layout, sources, bucket_bytes, torch.device("cuda", 0))
    # on one rank the root receives from itself: its packed buffer comes back unchanged
    flat = pack_to_cuda(layout, sources, torch.device("cuda", 0))
    got = views(receive_stream(pg, layout, bucket_bytes, "cuda", out=flat), layout)
    torch.cuda.synchronize()
    for k, v in expected.items():
        assert torch.equal(got[k].cpu(), v), k


@pytest.mark.parametrize("bucket_bytes", [256, 1 << 20])
@skip_unless(2)
def test_two_rank_nccl_stream_delivers_every_tensor(bucket_bytes):
    (q,) = procs.queues(1)
    port = procs.free_port()
    ranks = [
        procs.start(
            procs.nccl_stream_rank,
            q,
            r,
            2,
            port,
            bucket_bytes,
            env={"CUDA_VISIBLE_DEVICES": str(r)},
        )
        for r in range(2)
    ]
    try:
        got = dict(procs.get_by_value(q, 150) for _ in ranks)
    finally:
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got[0] is None
    for k, v in procs.version_tensors(1).items():
        assert torch.equal(got[1][k], v), k
