"""Worker base class: create_group through the registered factory, RLinf's attribute
names, and the rank environment each kind of placement produces (no Ray needed)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import phalanx as px
import phalanx.worker.group_factory as group_factory_module
import phalanx.worker.worker as worker_module
from phalanx.resources.placement import WorkerSlot
from phalanx.worker.worker import RANK_ENV_KEYS, WorkerContext, register_group_factory


class Plain(px.Worker):
    def __init__(self, tag: str = "t"):
        super().__init__()
        self.tag = tag


@pytest.mark.smoke
def test_create_group_goes_through_the_registered_factory(monkeypatch):
    group = Plain.create_group("a")
    assert isinstance(group, px.WorkerGroup)  # registered by phalanx.group at import

    monkeypatch.setattr(group_factory_module, "_group_factory", None)
    with pytest.raises(RuntimeError, match="no group factory is registered"):
        Plain.create_group()

    built = []

    def factory(remote_worker_builder):
        built.append(remote_worker_builder)
        return ("group", len(built))

    register_group_factory(factory)
    assert Plain.create_group("x", tag="y") == ("group", 1)
    builder = built[0]
    assert isinstance(builder, px.RayWorkerBuilder)
    assert builder.ray_actor_class_fqn is Plain
    assert builder.args == ("x",) and builder.kwargs == {"tag": "y"}
    with pytest.raises(TypeError, match="factory must be callable"):
        register_group_factory(42)


def test_worker_package_does_not_import_the_group_layer():
    root = pathlib.Path(worker_module.__file__).parent
    offenders = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            offenders += [(path.name, n) for n in names if n.startswith("phalanx.group")]
    assert offenders == []


def test_rlinf_attributes_outside_a_group():
    w = Plain()
    assert w._group_name == "local_Plain"
    assert w._worker_address.get_name() == "local_Plain:0"
    assert (w._rank, w._world_size) == (0, 1)
    assert w._cluster_node_rank == 0
    assert w._node_local_rank == 0
    assert w._local_accelerator_rank == -1
    assert w._node_local_world_size == -1
    assert (w._local_rank, w._local_world_size) == (0, -1)
    assert w.torch_platform is None
    assert "torch_platform" in worker_module.BASE_ATTRIBUTES  # never a group method


def _slot(**kw):
    base = dict(rank=1, node_rank=1, local_rank=1, node_ip="10.0.0.2")
    base.update(kw)
    return WorkerSlot(**base)


@pytest.mark.smoke
def test_rank_env_rlinf_isolated():
    slot = _slot(
        gpu_ids=[2, 3],
        num_gpus=0.0,
        local_world_size=2,
        placement_node_rank=0,
        isolate_accelerator=True,
        accelerator_type="NV_GPU",
    )
    ctx = WorkerContext.from_slot(slot, "actor", 4, "10.0.0.1", 1234)
    env = ctx.rank_env()
    assert env["LOCAL_RANK"] == "0" and env["LOCAL_WORLD_SIZE"] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["VISIBLE_DEVICES"] == "2,3"
    assert env["NODE_RANK"] == "0" and env["CLUSTER_NODE_RANK"] == "1"
    assert env["NODE_LOCAL_RANK"] == "1" and env["NODE_LOCAL_WORLD_SIZE"] == "2"
    assert env["LOCAL_ACCELERATOR_RANK"] == "2" and env["ISOLATE_ACCELERATOR"] == "1"
    assert env["ACCELERATOR_TYPE"] == "NV_GPU"
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]) == (
        "1",
        "4",
        "10.0.0.1",
        "1234",
    )
    assert env["WORKER_NAME"] == "actor:1" and env["GROUP_NAME"] == "actor"


def test_rank_env_rlinf_not_isolated():
    slot = _slot(
        gpu_ids=[0, 1, 2, 3],
        local_world_size=3,
        placement_node_rank=1,
        isolate_accelerator=False,
        accelerator_type="NV_GPU",
    )
    env = WorkerContext.from_slot(slot, "g", 4, "h", 1).rank_env()
    # RLinf: the actual device id and the node's worker count.
    assert env["LOCAL_RANK"] == "0" and env["LOCAL_WORLD_SIZE"] == "3"
    assert env["ISOLATE_ACCELERATOR"] == "0" and env["NODE_RANK"] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_rank_env_phalanx_placement_unchanged():
    slot = _slot(gpu_ids=[1], num_gpus=1.0, local_world_size=2, placement_node_rank=0)
    env = WorkerContext.from_slot(slot, "g", 2, "h", 1).rank_env()
    assert env["LOCAL_RANK"] == "1" and env["NODE_RANK"] == "1"
    assert env["LOCAL_WORLD_SIZE"] == "2" and "ISOLATE_ACCELERATOR" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    # Keys the configuration layers may not set include RLinf's rank variables.
    assert {"RANK", "LOCAL_RANK", "NODE_RANK", "CLUSTER_NODE_RANK", "ISOLATE_ACCELERATOR"} <= (
        RANK_ENV_KEYS
    )
    assert "CUDA_VISIBLE_DEVICES" not in RANK_ENV_KEYS
