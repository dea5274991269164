"""Reusable shared-memory segments and receive buffers: reuse only once a tensor is freed."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from phalanx.comm import shm
from phalanx.comm.buffers import BufferPool

pytestmark = pytest.mark.timeout(60)

MB = 1 << 20


def _msg(value: int, nbytes: int = MB) -> list[torch.Tensor]:
    return [torch.full((nbytes,), value, dtype=torch.uint8)]


def _send(pool: shm.SegmentPool, reader: shm.SegmentReader, value: int, nbytes: int = MB):
    ref, offsets = pool.write(_msg(value, nbytes))
    return ref, reader.open(ref)[offsets[0] : offsets[0] + nbytes]


@pytest.mark.smoke
def test_a_slot_is_reused_only_after_every_view_is_freed():
    pool, reader = shm.SegmentPool(max_slots=4), shm.SegmentReader()
    ref_a, a = _send(pool, reader, 1)
    assert ref_a.pooled and not os.path.exists(ref_a.path)  # the reader unlinked the name
    head = a[:10]  # a view keeps the message alive
    del a
    gc.collect()
    ref_b, b = _send(pool, reader, 2)
    assert ref_b.path != ref_a.path  # slot a is still in use
    assert torch.all(head == 1) and torch.all(b == 2)
    del head
    gc.collect()
    ref_c, c = _send(pool, reader, 3)
    assert ref_c.path == ref_a.path  # freed: reused, nothing new mapped
    assert torch.all(c == 3) and torch.all(b == 2)
    pool.close()


def test_a_full_pool_falls_back_to_one_shot_segments():
    pool, reader = shm.SegmentPool(max_slots=2), shm.SegmentReader()
    kept = [_send(pool, reader, i)[1] for i in range(5)]
    for i, t in enumerate(kept):
        assert torch.all(t == i), i  # nothing was overwritten while alive
    ref, _ = pool.write(_msg(9))
    assert not ref.pooled
    shm.unlink(ref.path)
    pool.close()


def test_a_slot_too_small_is_retired_and_the_reader_forgets_it():
    pool, reader = shm.SegmentPool(max_slots=1), shm.SegmentReader()
    ref_small, t = _send(pool, reader, 1, MB)
    del t
    gc.collect()
    ref_big, big = _send(pool, reader, 2, 4 * MB)
    assert ref_big.pooled and ref_big.retired == (ref_small.path,)
    assert ref_small.path not in reader._maps and torch.all(big == 2)
    pool.close()


def test_shared_memory_is_bounded_by_max_bytes():
    pool, reader = shm.SegmentPool(max_slots=8, max_bytes=5 * MB // 2), shm.SegmentReader()
    kept = [_send(pool, reader, i) for i in range(3)]
    assert [r.pooled for r, _ in kept] == [True, True, False]
    for i, (_, t) in enumerate(kept):
        assert torch.all(t == i)
    pool.close()


def test_receive_buffers_come_back_when_their_tensors_are_freed():
    pool = BufferPool(max_buffers=2, min_bytes=MB)
    a = pool.take(2 * MB)
    ptr = a.data_ptr()
    b = pool.take(2 * MB)
    assert b.data_ptr() != ptr
    c = pool.take(2 * MB)  # both busy, at the limit: plain new memory
    assert c.data_ptr() not in (ptr, b.data_ptr())
    view = a.view(torch.float32)[:4]
    del a
    gc.collect()
    assert pool.take(MB).data_ptr() != ptr  # the float view still holds it
    del view
    gc.collect()
    assert pool.take(MB).data_ptr() == ptr
    small = pool.take(1024)
    assert small.numel() == 1024 and not pool._items[0].busy


_OWNER_SCRIPT = """
import sys, torch
from phalanx.comm import shm
pool = shm.SegmentPool()
ref, _ = pool.write([torch.ones(1 << 20, dtype=torch.uint8)])
seg = shm.Segment.create(1 << 20, tag="w")
print(ref.path, seg.path, flush=True)
sys.stdin.read()  # killed while it holds both
"""


def test_segments_of_a_killed_owner_are_reaped_and_live_ones_kept():
    import signal
    import subprocess
    import sys

    mine = shm.Segment.create(4096, tag="w")
    proc = subprocess.Popen(
        [sys.executable, "-c", _OWNER_SCRIPT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        paths = proc.stdout.readline().split()
        assert len(paths) == 2, paths
        pool_path, seg_path = paths
        assert os.path.basename(pool_path).startswith(f"px_pool_{proc.pid}-")
        assert os.path.basename(seg_path).startswith(f"px_w_{proc.pid}-")
        assert shm.owner_alive(seg_path) and seg_path not in shm.reap_orphans()
        assert os.path.exists(pool_path) and os.path.exists(seg_path)
        os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up
        proc.wait(timeout=30)
        assert os.path.exists(pool_path) and os.path.exists(seg_path)  # left behind
        assert not shm.owner_alive(seg_path)
        reaped = shm.reap_orphans()
        assert {pool_path, seg_path} <= set(reaped)
        assert not os.path.exists(pool_path) and not os.path.exists(seg_path)
        assert os.path.exists(mine.path) and mine.path not in reaped  # its owner is alive
    finally:
        if proc.poll() is None:
            proc.kill()
        mine.unlink()


def test_owner_token_survives_pid_reuse():
    """A name whose pid is alive but whose start time differs belongs to a dead process."""
    token = shm.owner_token()
    pid, start = token.split("-")
    assert int(pid) == os.getpid()
    stale = os.path.join(shm.SHM_DIR, f"px_w_{pid}-{int(start) + 1}_0")
    assert not shm.owner_alive(stale)
    assert shm.owner_alive(os.path.join(shm.SHM_DIR, f"px_w_{token}_0"))
    assert shm.owner_alive("/dev/shm/not_phalanx")  # not ours to judge


def test_segment_attach_and_read_only_mapping():
    seg = shm.Segment.create(1000, tag="t")
    try:
        seg.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            reader = shm.Segment.attach(seg.name, populate=True, writable=False)
        assert reader.size == 1000 and reader.path == seg.path
        assert reader.tensor[:4].tolist() == [1, 2, 3, 4]
        seg.tensor[0] = 9  # the writer's change is seen through the reader's mapping
        assert int(reader.tensor[0]) == 9
        with pytest.raises(ValueError, match="not a shared-memory segment name"):
            shm.Segment.attach("/tmp/elsewhere")
    finally:
        seg.unlink()


def test_full_dev_shm_is_an_error_naming_it():
    """More than /dev/shm holds: an OSError subclass naming /dev/shm, the size and the space
    free (tmpfs refuses a reservation above its size at once, without filling anything)."""
    import errno

    from phalanx.comm.errors import ShmFullError

    st = os.statvfs("/dev/shm")
    too_big = st.f_blocks * st.f_frsize + (1 << 30)
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(ShmFullError) as info:
        shm.Segment.create(too_big, tag="fulltest")
    err = info.value
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert err.needed == too_big and err.free is not None and err.free < too_big
    assert "/dev/shm is full" in str(err) and f"{too_big:,} bytes" in str(err)
    assert not {n for n in os.listdir("/dev/shm") if "fulltest" in n} - before
