"""``RefitBuffer`` and ``mapped_views`` on the CPU: one shared-memory buffer per layout,
versions cast and copied into it in place, readers that map it once."""

from __future__ import annotations

import os

import pytest
import torch

from phalanx.weights import RefitBuffer, gather, mapped_buffer, mapped_views, pack_range

pytestmark = pytest.mark.timeout(60)


class Reader:
    """Any object can hold a reader's mapping (a worker in practice)."""


def _named(seed, rows=8):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(rows, 6, generator=g).t(),  # strided: copied without flattening first
        "b": torch.randn(6, generator=g),
        "steps": torch.randint(0, 100, (3,), generator=g),
    }


def test_versions_of_one_layout_share_the_buffer_and_the_handle():
    buf = RefitBuffer(torch.device("cpu"))
    reader = Reader()
    first = None
    try:
        for seed in (1, 2):
            named = _named(seed)
            layout, sources = gather(named, dtype=torch.bfloat16)
            handle = buf.pack(layout, sources)
            got = mapped_views(reader, handle)
            assert torch.equal(got["w"], named["w"].to(torch.bfloat16))
            assert torch.equal(got["b"], named["b"].to(torch.bfloat16))
            assert torch.equal(got["steps"], named["steps"])  # integers are not cast
            if first is None:
                first = (handle, buf.flat.data_ptr(), mapped_buffer(reader), got)
        assert handle is first[0] and handle["kind"] == "shm"
        assert buf.flat.data_ptr() == first[1] and buf.allocations == 1
        assert mapped_buffer(reader) is first[2] and got is first[3]
        # the bytes are those pack_range writes for the same layout
        expected = torch.zeros(layout.total_bytes, dtype=torch.uint8)
        pack_range(expected, layout, sources, 0, layout.total_bytes)
        assert torch.equal(buf.flat, expected)
    finally:
        buf.release()


def test_a_new_layout_gets_a_new_buffer_and_readers_drop_the_old():
    buf = RefitBuffer(torch.device("cpu"))
    reader = Reader()
    try:
        layout, sources = gather(_named(1))
        old = buf.pack(layout, sources)
        mapped_views(reader, old)
        layout, sources = gather(_named(2, rows=9))
        new = buf.pack(layout, sources)
        assert buf.allocations == 2 and new["buffer"] != old["buffer"]
        assert not os.path.exists(os.path.join("/dev/shm", old["name"]))
        got = mapped_views(reader, new)
        assert torch.equal(got["w"], _named(2, rows=9)["w"])
        assert mapped_buffer(reader).data_ptr() != 0
        with open("/proc/self/maps") as f:
            assert not any(old["name"] in line for line in f)
    finally:
        buf.release()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="device must be a CPU or CUDA"):
        RefitBuffer(torch.device("meta"))
    buf = RefitBuffer(torch.device("cpu"))
    layout, sources = gather(_named(1))
    with pytest.raises(ValueError, match="2 sources for 3 specs"):
        buf.pack(layout, sources[:2])
    with pytest.raises(ValueError, match="kind must be 'shm' or 'cuda_ipc'"):
        mapped_views(Reader(), {"kind": "pipe", "layout": layout})


def test_a_shared_memory_handle_packed_elsewhere_is_mapped_once_per_segment():
    from phalanx.weights import ShmSegment, pack_state_dict

    layout, _ = gather(_named(1))
    name = f"px_test_refit_{os.getpid()}"
    segments = [ShmSegment(layout.total_bytes, name=name)]
    reader = Reader()
    handle = {"kind": "shm", "name": name, "layout": layout}
    try:
        pack_state_dict(_named(1), out=segments[0].tensor)
        first = mapped_views(reader, handle)
        pack_state_dict(_named(2), out=segments[0].tensor)  # rewritten in place
        assert mapped_views(reader, handle) is first
        assert torch.equal(first["b"], _named(2)["b"])
        segments[0].unlink()  # made again under the same name: another buffer
        segments.append(ShmSegment(layout.total_bytes, name=name))
        pack_state_dict(_named(3), out=segments[1].tensor)
        again = mapped_views(reader, handle)
        assert again is not first and torch.equal(again["b"], _named(3)["b"])
    finally:
        segments[-1].unlink()
