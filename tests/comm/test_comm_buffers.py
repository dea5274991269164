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
