"""Point-to-point communication between workers: payloads, ordering, failures, broadcast."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
import ray
import torch

import phalanx as px
from phalanx.comm import p2p
from tests.helpers import our_segments

pytestmark = pytest.mark.timeout(240)

SEND_GROUP_NAME = "send_worker_group"
RECV_GROUP_NAME = "recv_worker_group"


def _payloads() -> list:
    return [
        "hello",
        {"a": 1, "b": [1, 2, (3, None)]},
        torch.arange(10, dtype=torch.int64),
        [torch.ones(3), torch.zeros(2, 2)],
        {"x": torch.full((2, 3), 2.0), "y": torch.tensor(3.0)},
        {
            "nested": [{"t": torch.arange(6).reshape(2, 3).t()}, "s"],
            "bf": torch.ones(4, dtype=torch.bfloat16),
        },
        np.arange(12, dtype=np.float32).reshape(3, 4),
        torch.randn(512, 1024),  # 2 MB: the shared-memory path
    ]


def _wait_for_file(path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} was not written within {timeout}s"
        time.sleep(0.01)


def _split(name: str) -> tuple[str, int]:
    group, _, rank = name.rpartition(":")
    return group, int(rank)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class CommWorker(px.Worker):
    def options_round(self, group, rank):
        """A collective group and a gloo p2p pair built with ``CollectiveGroupOptions``."""
        from phalanx.comm import CollectiveGroupOptions, configure
        from phalanx.comm.collective import get_group

        opts = CollectiveGroupOptions(accel_max_ctas=2, timeout_s=60)
        members = sorted([self.worker_address.get_name(), f"{group}:{rank}"])
        g = get_group(members, options=opts, tag="opts")
        value = g.all_reduce(torch.tensor([1.0 + g.rank])).item()
        configure(use_shm=False, inline_max_bytes=1024)
        big = torch.full((4096,), 7.0)
        if g.rank == 0:
            self.send(big, group, rank, options=opts)
            got = self.recv(group, rank, options=opts, timeout=60)
        else:
            got = self.recv(group, rank, options=opts, timeout=60)
            self.send(big, group, rank, options=opts)
        configure(use_shm=True, inline_max_bytes=1 << 20)
        return value, g.pg.options._timeout.total_seconds(), sorted(set(got.tolist()))

    def send_all(self, objs, group, rank, mode="sync"):
        if mode == "sync":
            for o in objs:
                self.send(o, group, rank)
        elif mode == "async":
            works = [self.send(o, group, rank, async_op=True) for o in objs]
            for w in works:
                w.wait(timeout=60)
        else:

            async def go():
                for o in objs:
                    await self.send(o, group, rank, async_op=True).async_wait()

            asyncio.run(go())
        return len(objs)

    def recv_all(self, n, group, rank, mode="sync"):
        if mode == "sync":
            return [self.recv(group, rank) for _ in range(n)]
        if mode == "async":
            works = [self.recv(group, rank, async_op=True) for _ in range(n)]
            return [w.wait(timeout=60) for w in works]

        async def go():
            return [await self.recv(group, rank, async_op=True) for _ in range(n)]

        return asyncio.run(go())

    async def async_echo(self, group, rank):
        """An async worker method: receive, then send the object back."""
        obj = await self.recv(group, rank, async_op=True).async_wait()
        await self.send(obj, group, rank, async_op=True)
        return True

    def exchange(self, n, group, rank):
        """Post n async sends and n async receives to/from the peer at once."""
        sends = [self.send(i, group, rank, async_op=True) for i in range(n)]
        recvs = [self.recv(group, rank, async_op=True) for _ in range(n)]
        for w in sends:
            w.wait(timeout=60)
        return [w.wait(timeout=60) for w in recvs]

    def send_tensor_to(self, t, group, rank):
        self.send_tensor(t, group, rank)
        return True

    def recv_tensor_into(self, shape, dtype, group, rank):
        buf = torch.empty(shape, dtype=dtype)
        out = self.recv_tensor(buf, group, rank)
        return out is buf, buf

    def recv_with_timeout(self, group, rank, timeout):
        try:
            self.recv(group, rank, timeout=timeout)
        except TimeoutError as e:
            return f"timeout: {e}"
        return "received"

    def recv_error(self, group, rank, async_wait=False, marker=None):
        """Receive from the peer; returns the error it ends with (``marker``: written once posted)."""
        t0 = time.monotonic()
        try:
            work = self.recv(group, rank, async_op=True)
            if marker:
                with open(marker, "w") as f:
                    f.write("posted")
            if async_wait:
                asyncio.run(work.async_wait())
            else:
                work.wait()
        except Exception as e:  # noqa: BLE001 - returned for the test to inspect
            return type(e).__name__, str(e), time.monotonic() - t0
        return None, "", time.monotonic() - t0

    def bcast(self, obj, groups, src=None, async_op=False):
        """RLinf's convention: every member calls with the same groups and src."""
        out = self.broadcast(obj, groups=groups, src=src, async_op=async_op)
        return out.wait(timeout=60) if async_op else out

    def bcast_error(self, obj, groups, src=None):
        try:
            self.broadcast(obj, groups=groups, src=src)
        except Exception as e:  # noqa: BLE001 - returned for the test
            return type(e).__name__, str(e)
        return None, ""

    def all_pairs(self, members):
        """Send this worker's name to every other member and receive theirs."""
        me = self.worker_address.get_name()
        others = [m for m in members if m != me]
        recvs = {m: self.recv(*_split(m), async_op=True) for m in others}
        sends = [self.send(me, *_split(m), async_op=True) for m in others]
        for w in sends:
            w.wait(timeout=60)
        return {m: w.wait(timeout=60) for m, w in recvs.items()}

    def bcast_keep_maps(self, obj, groups, src=None):
        """Broadcast, keep the result, and list the broadcast segments this process maps."""
        import gc

        gc.collect()
        self._kept = self.broadcast(obj, groups=groups, src=src)
        inodes = set()
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and "px_bcast_" in parts[5]:
                    inodes.add(int(parts[4]))
        return sorted(inodes), float(self._kept["big"].sum())

    def send_pb(self, obj, payload, group, rank):
        self.send(obj, group, rank, piggyback_payload=payload, options=None)
        return True

    def recv_opts(self, group, rank):
        return self.recv(group, rank, False, None)

    def allreduce(self, members, value):
        from phalanx.comm.collective import get_group

        g = get_group(members, backend="gloo", tag="test")
        t = torch.tensor([float(value)])
        g.all_reduce(t)
        return g.rank, t.item()

    def pid(self):
        return os.getpid()

    def set_shm(self, on):
        from phalanx.comm import configure

        return configure(use_shm=on).use_shm

    def send_seq(self, n, nbytes, group, rank):
        for i in range(n):
            self.send(torch.full((nbytes // 4,), float(i)), group, rank)
        return n

    def recv_keep(self, n, group, rank):
        """Receive n tensors keeping every one alive; then check none was overwritten."""
        kept = [self.recv(group, rank) for _ in range(n)]
        return [float(t.min()) == float(t.max()) == i for i, t in enumerate(kept)]


class SendWorker(px.Worker):
    """RLinf's documented example sender, on CPU (gloo/shared memory, no CUDA)."""

    def hello_recv(self):
        msg = f"Hello from SendWorker Rank {self._rank}!"
        self.send(msg, dst_group_name=RECV_GROUP_NAME, dst_rank=self._rank)
        reply = self.recv(src_group_name=RECV_GROUP_NAME, src_rank=self._rank)
        dst_rank = (self._rank + 1) % self._world_size
        self.send(
            torch.ones(size=(1, 1), dtype=torch.float32),
            dst_group_name=RECV_GROUP_NAME,
            dst_rank=dst_rank,
        )
        tensor_list = [torch.tensor(1.0, dtype=torch.float32) for _ in range(4)]
        self.send(tensor_list, dst_group_name=RECV_GROUP_NAME, dst_rank=dst_rank)
        tensor_dict = {"tensor1": torch.tensor(2.0), "tensor2": torch.tensor(3.0)}
        self.send(tensor_dict, dst_group_name=RECV_GROUP_NAME, dst_rank=dst_rank)
        self.send_tensor(
            torch.ones(size=(2, 1), dtype=torch.float32),
            dst_group_name=RECV_GROUP_NAME,
            dst_rank=dst_rank,
        )
        return reply

    def hello_recv_async(self):
        dst_rank = (self._rank + 1) % self._world_size
        work = self.send(
            torch.ones(size=(3, 1)),
            dst_group_name=RECV_GROUP_NAME,
            dst_rank=dst_rank,
            async_op=True,
        )
        work.wait()

        async def send_tensor_async():
            w = self.send(
                torch.ones(size=(4, 1)),
                dst_group_name=RECV_GROUP_NAME,
                dst_rank=dst_rank,
                async_op=True,
            )
            await w.async_wait()

        asyncio.run(send_tensor_async())
        return True


class RecvWorker(px.Worker):
    """RLinf's documented example receiver, on CPU."""

    def hello_recv(self):
        msg = self.recv(src_group_name=SEND_GROUP_NAME, src_rank=self._rank)
        self.send(
            f"Hello from RecvWorker Rank {self._rank}!",
            dst_group_name=SEND_GROUP_NAME,
            dst_rank=self._rank,
        )
        src_rank = (self._rank - 1) % self._world_size
        tensor = self.recv(src_group_name=SEND_GROUP_NAME, src_rank=src_rank)
        tensor_list = self.recv(src_group_name=SEND_GROUP_NAME, src_rank=src_rank)
        tensor_dict = self.recv(src_group_name=SEND_GROUP_NAME, src_rank=src_rank)
        buf = torch.empty(size=(2, 1), dtype=torch.float32)
        self.recv_tensor(buf, src_group_name=SEND_GROUP_NAME, src_rank=src_rank)
        return msg, tensor, tensor_list, tensor_dict, buf

    def hello_recv_async(self):
        src_rank = (self._rank - 1) % self._world_size
        first = self.recv(src_group_name=SEND_GROUP_NAME, src_rank=src_rank, async_op=True).wait()

        async def recv_tensor_async():
            w = self.recv(src_group_name=SEND_GROUP_NAME, src_rank=src_rank, async_op=True)
            return await w.async_wait()

        second = asyncio.run(recv_tensor_async())
        return first, second


@pytest.fixture(scope="module")
def pair(cluster):
    a = CommWorker.create_group().launch(cluster, px.NodePlacement(num_workers=2), name="comm_a")
    b = CommWorker.create_group().launch(cluster, px.NodePlacement(num_workers=2), name="comm_b")
    yield a, b
    a.shutdown()
    b.shutdown()


@pytest.mark.parametrize("mode", ["sync", "async", "asyncio"])
def test_every_payload_round_trips(pair, mode):
    a, b = pair
    objs = _payloads()
    h_recv = b.execute_on(0).recv_all(len(objs), "comm_a", 0, mode)
    h_send = a.execute_on(0).send_all(objs, "comm_b", 0, mode)
    got = h_recv.wait(timeout=120)[0]
    assert h_send.wait(timeout=60) == [len(objs)]
    assert len(got) == len(objs)
    for sent, received in zip(objs, got):
        assert _same(sent, received), (sent, received)


def test_async_worker_method_echo(pair):
    a, b = pair
    h = b.execute_on(1).async_echo("comm_a", 1)
    a.execute_on(1).send_all([{"t": torch.arange(5)}], "comm_b", 1).wait(timeout=60)
    back = a.execute_on(1).recv_all(1, "comm_b", 1).wait(timeout=60)[0][0]
    assert h.wait(timeout=60) == [True]
    assert torch.equal(back["t"], torch.arange(5))


def test_recv_posted_before_send(pair):
    a, b = pair
    h = b.execute_on(0).recv_all(1, "comm_a", 1)
    time.sleep(1.0)
    assert not h.done()
    a.execute_on(1).send_all(["late"], "comm_b", 0).wait(timeout=60)
    assert h.wait(timeout=60) == [["late"]]


def test_back_to_back_async_both_directions_keep_order(pair):
    a, b = pair
    ha = a.execute_on(0).exchange(100, "comm_b", 1)
    hb = b.execute_on(1).exchange(100, "comm_a", 0)
    assert ha.wait(timeout=120) == [list(range(100))]
    assert hb.wait(timeout=120) == [list(range(100))]


def test_send_tensor_in_place_and_mismatch(pair):
    a, b = pair
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    h = b.execute_on(0).recv_tensor_into((3, 4), torch.float32, "comm_a", 0)
    a.execute_on(0).send_tensor_to(t, "comm_b", 0).wait(timeout=60)
    same, buf = h.wait(timeout=60)[0]
    assert same and torch.equal(buf, t)
    # dtype mismatch: an error on the receiver, and the stream stays in step afterwards
    h = b.execute_on(0).recv_tensor_into((3, 4), torch.float64, "comm_a", 0)
    a.execute_on(0).send_tensor_to(t, "comm_b", 0).wait(timeout=60)
    with pytest.raises(px.WorkerError, match="recv_tensor: buffer is"):
        h.wait(timeout=60)
    # size mismatch on a large (shared-memory) tensor
    big = torch.ones(300_000)
    h = b.execute_on(0).recv_tensor_into((200_000,), torch.float32, "comm_a", 0)
    a.execute_on(0).send_tensor_to(big, "comm_b", 0).wait(timeout=60)
    with pytest.raises(px.WorkerError, match="recv_tensor"):
        h.wait(timeout=60)
    h = b.execute_on(0).recv_all(1, "comm_a", 0)
    a.execute_on(0).send_all(["next"], "comm_b", 0).wait(timeout=60)
    assert h.wait(timeout=60) == [["next"]]


@pytest.mark.parametrize("use_shm", [True, False])
def test_received_tensors_stay_valid_while_buffers_are_reused(pair, use_shm):
    a, b = pair
    try:
        a.execute_on(0).set_shm(use_shm).wait()
        got = b.execute_on(0).recv_keep(12, "comm_a", 0)
        a.execute_on(0).send_seq(12, 2 << 20, "comm_b", 0).wait(timeout=60)
        assert got.wait(timeout=60)[0] == [True] * 12
        # freed ones are reused: the next round still arrives intact
        got = b.execute_on(0).recv_keep(12, "comm_a", 0)
        a.execute_on(0).send_seq(12, 2 << 20, "comm_b", 0).wait(timeout=60)
        assert got.wait(timeout=60)[0] == [True] * 12
    finally:
        a.execute_on(0).set_shm(True).wait()


def test_recv_timeout(pair):
    a, b = pair
    out = b.execute_on(1).recv_with_timeout("comm_a", 0, 0.5).wait(timeout=60)[0]
    assert out.startswith("timeout:") and "comm_a:0" in out


def test_unknown_group_or_rank_is_a_clear_error(pair):
    a, _ = pair
    with pytest.raises(px.WorkerError, match="has no rank 7"):
        a.execute_on(0).send_all([1], "comm_b", 7).wait(timeout=60)
    with pytest.raises(px.WorkerError, match="no worker group named 'no_such_group'"):
        a.execute_on(0).send_all([1], "no_such_group", 0).wait(timeout=60)
    with pytest.raises(ValueError, match="rank"):
        p2p.send(1, "comm_b", -1)
    with pytest.raises(TypeError, match="dst_group_name"):
        p2p.send(1, 3, 0)


def _rlinf_bcast(groups_of, groups, src, obj, async_op):
    """Every member calls broadcast with the same arguments; only the source passes obj."""
    first_group, first_ranks = groups_of[0]
    src_name = f"{src[0]}:{src[1]}" if src else f"{first_group.name}:{first_ranks[0]}"
    handles = []
    for g, ranks in groups_of:
        for r in ranks:
            mine = obj if f"{g.name}:{r}" == src_name else None
            handles.append(g.execute_on(r).bcast(mine, groups, src, async_op))
    return [h.wait(timeout=120)[0] for h in handles]


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("size", [3, 4])
def test_rlinf_broadcast_then_clean_pairs(pair, size, async_op):
    a, b = pair
    obj = {"w": torch.arange(8.0), "big": torch.randn(256, 1024), "step": size}
    if size == 3:
        groups = [("comm_a", [0, 1]), ("comm_b", 0)]
        groups_of = [(a, [0, 1]), (b, [0])]
        src = None  # RLinf: the first address of groups
    else:
        groups = [("comm_a", [0, 1]), ("comm_b", [0, 1])]
        groups_of = [(a, [0, 1]), (b, [0, 1])]
        src = ("comm_b", 1)
    got = _rlinf_bcast(groups_of, groups, src, obj, async_op)
    assert len(got) == size
    for out in got:
        assert _same(out, obj)
    # No stray message left queued: every pair exchanges exactly its names afterwards.
    members = [f"{g.name}:{r}" for g, ranks in groups_of for r in ranks]
    handles = [g.execute_on(r).all_pairs(members) for g, ranks in groups_of for r in ranks]
    for me, h in zip(members, handles):
        assert h.wait(timeout=120)[0] == {m: m for m in members if m != me}


def test_broadcast_on_one_node_shares_one_copy(pair):
    a, b = pair
    big = torch.ones(1024, 1024)  # 4 MB: the shared-memory path
    groups = [("comm_a", [0, 1]), ("comm_b", [0, 1])]
    readers = [(a, 1), (b, 0), (b, 1)]
    hs = [g.execute_on(r).bcast_keep_maps(None, groups) for g, r in readers]
    src = a.execute_on(0).bcast_keep_maps({"big": big}, groups).wait(timeout=120)[0]
    assert src == ([], float(big.sum()))  # the source keeps its own tensor, maps nothing
    maps = [h.wait(timeout=120)[0] for h in hs]
    assert [m[1] for m in maps] == [float(big.sum())] * 3
    inodes = [m[0] for m in maps]
    assert len(inodes[0]) == 1 and inodes == [inodes[0]] * 3  # three readers, one file
    leftovers = [n for n in our_segments(os.listdir("/dev/shm")) if n.startswith("px_bcast_")]
    assert leftovers == []  # every reader unlinked its name when it mapped it


def test_rlinf_broadcast_invalid_calls(pair):
    a, _ = pair
    err = a.execute_on(0).bcast_error(1, [("comm_b", [0, 1])]).wait(timeout=60)[0]
    assert err[0] == "ValueError" and "comm_a:0" in err[1] and "not one of the members" in err[1]
    err = a.execute_on(0).bcast_error(1, [("comm_a", [0, 1])], ("comm_b", 0)).wait(timeout=60)[0]
    assert err[0] == "ValueError" and "src" in err[1]
    # phalanx's old form (src_group_name as a str) cannot be mistaken for a valid call
    err = a.execute_on(0).bcast_error(1, [("comm_a", [0, 1])], "comm_a").wait(timeout=60)[0]
    assert err[0] == "TypeError" and "src" in err[1]
    err = a.execute_on(0).bcast_error(1, ("comm_a", [0, 1])).wait(timeout=60)[0]
    assert err[0] == "TypeError" and "list" in err[1]
    err = a.execute_on(0).bcast_error(1, None).wait(timeout=60)[0]
    assert err[0] == "ValueError" and "groups" in err[1]
    err = a.execute_on(0).bcast_error(1, [("comm_a", [0, 0])]).wait(timeout=60)[0]
    assert err[0] == "ValueError" and "more than once" in err[1]


def test_piggyback_payload_and_options(pair):
    a, b = pair
    h = b.execute_on(0).recv_opts("comm_a", 1)
    assert a.execute_on(1).send_pb({"x": 1}, ("key", 3), "comm_b", 0).wait(timeout=60) == [True]
    assert h.wait(timeout=60) == [({"x": 1}, ("key", 3))]


def test_collective_group_between_groups(pair):
    a, b = pair
    members = [px.WorkerAddress("comm_a", 0), px.WorkerAddress("comm_b", 1)]
    h1 = b.execute_on(1).allreduce(members, 5)
    h0 = a.execute_on(0).allreduce(members, 2)
    assert h0.wait(timeout=120) == [(0, 7.0)]
    assert h1.wait(timeout=120) == [(1, 7.0)]


@pytest.mark.parametrize("async_wait", [False, True])
def test_peer_killed_mid_recv_raises_naming_it(pair, cluster, async_wait, tmp_path):
    a, _ = pair
    name = f"comm_victim_{int(async_wait)}"
    victim = CommWorker.create_group().launch(cluster, px.NodePlacement(num_workers=1), name=name)
    marker = tmp_path / "posted"
    h = a.execute_on(1).recv_error(name, 0, async_wait, str(marker))
    _wait_for_file(marker)
    ray.kill(victim.actors[0], no_restart=True)
    err_type, message, waited = h.wait(timeout=90)[0]
    assert err_type == "PeerDiedError"
    assert f"{name}:0" in message
    assert waited < 60
    victim.shutdown()


def test_rlinf_seed_example(cluster):
    send_group = SendWorker.create_group().launch(
        cluster, px.NodePlacement(num_workers=2), name=SEND_GROUP_NAME
    )
    recv_group = RecvWorker.create_group().launch(
        cluster, px.NodePlacement(num_workers=2), name=RECV_GROUP_NAME
    )
    try:
        res = send_group.hello_recv()
        out = recv_group.hello_recv().wait(timeout=120)
        replies = res.wait(timeout=60)
        assert replies == [f"Hello from RecvWorker Rank {r}!" for r in range(2)]
        for rank, (msg, tensor, tensor_list, tensor_dict, buf) in enumerate(out):
            assert msg == f"Hello from SendWorker Rank {rank}!"
            assert torch.equal(tensor, torch.ones(1, 1))
            assert [t.item() for t in tensor_list] == [1.0] * 4
            assert {k: v.item() for k, v in tensor_dict.items()} == {"tensor1": 2.0, "tensor2": 3.0}
            assert torch.equal(buf, torch.ones(2, 1))
        res = send_group.hello_recv_async()
        out = recv_group.hello_recv_async().wait(timeout=120)
        assert res.wait(timeout=60) == [True, True]
        for first, second in out:
            assert torch.equal(first, torch.ones(3, 1)) and torch.equal(second, torch.ones(4, 1))
    finally:
        send_group.shutdown()
        recv_group.shutdown()


def test_work_object_api():
    from phalanx.comm.work import Work

    w = Work("op")
    assert not w.done()
    with pytest.raises(TimeoutError, match="op did not complete"):
        w.wait(timeout=0.05)
    w._future.set_result(5)
    assert w.done() and w.wait() == 5
    assert asyncio.run(w.async_wait()) == 5
    with pytest.raises(ValueError, match="timeout"):
        w.wait(timeout=-1)


@pytest.mark.smoke
def test_transport_decision():
    from phalanx.comm.config import CommConfig
    from phalanx.comm.wire import select_transport

    cfg = CommConfig()
    big, small = 64 << 20, 1024
    assert select_transport("cpu", big, same_node=True, same_gpu=False, config=cfg) == "shm"
    assert select_transport("cpu", small, same_node=True, same_gpu=False, config=cfg) == "inline"
    assert select_transport("cpu", big, same_node=False, same_gpu=False, config=cfg) == "gloo"
    assert select_transport("cuda", big, same_node=True, same_gpu=True, config=cfg) == "cuda_ipc"
    assert select_transport("cuda", big, same_node=True, same_gpu=False, config=cfg) == "nccl"
    assert (
        select_transport(
            "cpu", big, same_node=True, same_gpu=False, config=CommConfig(use_shm=False)
        )
        == "gloo"
    )


def test_collective_group_options_are_checked_and_honoured(pair):
    """RLinf's ``CollectiveGroupOptions``: fields checked at construction, accepted by every
    ``options=``, and its ``timeout_s`` bounds the operations of a collective group."""
    from phalanx.comm import CollectiveGroupOptions

    opts = CollectiveGroupOptions(accel_max_ctas=4, accel_min_ctas=2, timeout_s=120)
    assert not opts.is_empty_options() and CollectiveGroupOptions().is_empty_options()
    with pytest.raises(TypeError, match="accel_max_ctas must be an int"):
        CollectiveGroupOptions(accel_max_ctas="4")
    with pytest.raises(ValueError, match="accel_min_ctas .3. must be <= accel_max_ctas .2."):
        CollectiveGroupOptions(accel_max_ctas=2, accel_min_ctas=3)
    with pytest.raises(TypeError, match="is_high_priority_stream must be a bool"):
        CollectiveGroupOptions(is_high_priority_stream=1)
    with pytest.raises(TypeError, match="timeout_s must be a number of seconds"):
        CollectiveGroupOptions(timeout_s=True)
    with pytest.raises(TypeError, match="options must be a CollectiveGroupOptions"):
        p2p.send(1, "comm_b", 0, options={"accel_max_ctas": 2})
    a, b = pair
    h = b.execute_on(0).options_round("comm_a", 0)
    assert a.execute_on(0).options_round("comm_b", 0).wait(timeout=120) == [(3.0, 60.0, [7])]
    assert h.wait(timeout=120) == [(3.0, 60.0, [7])]
