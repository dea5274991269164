"""``launch`` options checked before any remote work: RLinf's ``isolate_gpu`` and the
``NamedSharding`` layout a group is launched with."""

from __future__ import annotations

import pytest
import ray

import phalanx as px
from tests.workers import Recorder

pytestmark = pytest.mark.timeout(180)


def _names(prefix: str) -> list[str]:
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"{prefix}:")
    )


def test_sharding_must_cover_exactly_the_group_ranks(cluster):
    two = px.NodePlacement(num_workers=2)
    # Right size, wrong ranks: the layout names rank 2, the group has ranks 0 and 1.
    with pytest.raises(
        ValueError,
        match=r"sharding_annotations must cover exactly ranks 0\.\.1 of the group's 2 workers; "
        r"its layout holds 2 rank\(s\), missing \[0\], outside the group \[2\]",
    ):
        Recorder.create_group().launch(
            cluster, two, "shard_bad", sharding=px.NamedSharding([[1, 2]], ["dp", "tp"])
        )
    # Too few ranks.
    with pytest.raises(
        ValueError, match=r"sharding_annotations .* holds 1 rank\(s\), missing \[1\]$"
    ):
        Recorder.create_group().launch(
            cluster, two, "shard_bad", sharding=px.NamedSharding([0], ["dp"])
        )
    assert _names("shard_bad") == []  # nothing was started
    # The NeMo-RL constructor path runs the same check.
    vc = px.RayVirtualCluster([2], use_gpus=False, name="shard_vc")
    try:
        with pytest.raises(ValueError, match=r"sharding_annotations .*outside the group \[3\]"):
            px.RayWorkerGroup(
                vc,
                px.RayWorkerBuilder(Recorder),
                name_prefix="shard_vc",
                sharding_annotations=px.NamedSharding([[0], [3]], ["dp", "tp"]),
            )
        assert _names("shard_vc") == []
    finally:
        vc.shutdown()
    # Any order of exactly 0..n-1 is fine.
    sh = px.NamedSharding([[1], [0]], ["dp", "tp"])
    g = Recorder.create_group().launch(cluster, two, "shard_ok", sharding=sh)
    try:
        assert g.sharding_annotations is sh
        assert _names("shard_ok") == ["shard_ok:0", "shard_ok:1"]
    finally:
        g.shutdown()


def test_isolate_gpu_bad_input_is_refused_before_launch(cluster):
    with pytest.raises(TypeError, match="isolate_gpu must be a bool or None, got 'yes'"):
        Recorder.create_group().launch(cluster, px.NodePlacement(1), "iso_bad", isolate_gpu="yes")
    with pytest.raises(
        ValueError,
        match=r"isolate_gpu=False applies to RLinf placement strategies; NodePlacement places "
        r"CPU workers",
    ):
        Recorder.create_group().launch(cluster, px.NodePlacement(1), "iso_bad", None, False)
    vc = px.RayVirtualCluster([1], use_gpus=False, name="iso_vc")
    try:
        with pytest.raises(ValueError, match="isolate_gpu: a RayVirtualCluster already fixes"):
            Recorder.create_group().launch(vc, name="iso_vc", isolate_gpu=True)
    finally:
        vc.shutdown()
    assert _names("iso_bad") == [] and _names("iso_vc") == []


_ENV = ("CUDA_VISIBLE_DEVICES", "ISOLATE_ACCELERATOR", "LOCAL_RANK", "LOCAL_ACCELERATOR_RANK")


@pytest.mark.timeout(240)
def test_isolate_gpu_reaches_rlinf_strategies(fresh_ray):
    """Two declared GPUs (no CUDA needed: strategies reserve no GPU in Ray)."""
    cluster = px.Cluster(num_cpus=8, num_gpus=2)
    strategy = px.PackedPlacementStrategy(0, 1)
    g = Recorder.create_group().launch(cluster, strategy, "iso_default")
    try:  # RLinf's default: each worker sees its own GPU only
        envs = g.env(*_ENV).wait(timeout=60)
        assert [(e["CUDA_VISIBLE_DEVICES"], e["ISOLATE_ACCELERATOR"]) for e in envs] == [
            ("0", "1"),
            ("1", "1"),
        ]
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "0"]
        assert [e["LOCAL_ACCELERATOR_RANK"] for e in envs] == ["0", "1"]
    finally:
        g.shutdown()
    g = Recorder.create_group().launch(cluster, strategy, "iso_off", None, False)
    try:  # RLinf's positional order: (cluster, placement_strategy, name, max_concurrency, isolate_gpu)
        envs = g.env(*_ENV).wait(timeout=60)
        assert [(e["CUDA_VISIBLE_DEVICES"], e["ISOLATE_ACCELERATOR"]) for e in envs] == [
            ("0,1", "0"),
            ("0,1", "0"),
        ]
        # the rank variables follow the strategy's own answer for isolate_accelerator=False
        want = strategy.get_placement(cluster, isolate_accelerator=False)
        assert [p.visible_accelerators for p in want] == [["0", "1"], ["0", "1"]]
        assert [e["LOCAL_ACCELERATOR_RANK"] for e in envs] == [
            str(p.local_accelerator_rank) for p in want
        ]
    finally:
        g.shutdown()
    # phalanx's own placement fixes isolation when built; a disagreeing launch value is refused.
    with pytest.raises(
        ValueError, match=r"set it on the placement \(PackedPlacement\(\.\.\., isolate_gpu"
    ):
        Recorder.create_group().launch(
            cluster, px.PackedPlacement(0, 1), "iso_own", isolate_gpu=False
        )
    assert _names("iso_own") == []
