"""The README quick start as a script: both faces of a phalanx group."""

from __future__ import annotations

import asyncio

import ray
import torch

import phalanx as px


class Echo(px.Worker):
    def hello(self):
        return self.rank


class Trainer(px.Worker):
    def __init__(self, lr: float):
        super().__init__()
        self.lr = lr

    def train(self, data, step: int = 0):
        return {"rank": self.rank, "rows": int(data["x"].shape[0]), "step": step}


def main() -> None:
    cluster = px.Cluster()  # starts an embedded Ray, or joins RAY_ADDRESS / address="auto"

    # RLinf face
    g = Echo.create_group().launch(cluster, placement=px.NodePlacement(num_workers=4), name="echo")
    print(g.hello().wait())  # [0, 1, 2, 3]
    print(g.execute_on(0, 3).hello().wait())  # [0, 3]

    async def main_async():
        return await g.hello()

    print(asyncio.run(main_async()))
    g.shutdown()

    # NeMo-RL face
    vc = px.RayVirtualCluster([4], use_gpus=False)
    wg = px.RayWorkerGroup(
        vc,
        px.RayWorkerBuilder(Trainer, 1e-3),  # or "my_pkg.mod.Trainer": the driver never imports it
        sharding_annotations=px.NamedSharding([[0, 1], [2, 3]], ["dp", "tp"]),
    )
    shards = px.BatchedDataDict({"x": torch.randn(64, 8)}).shard_by_batch_size(2)
    fut = wg.run_all_workers_sharded_data(
        "train",
        data=shards,
        in_sharded_axes=["dp"],
        replicate_on_axes=["tp"],
        output_is_replicated=["tp"],
        common_kwargs={"step": 1},
    )
    print(fut.get_results(wg))  # results of ranks 0 and 2
    print(ray.get(wg.run_all_workers_single_data("train", data=shards[0])))
    wg.shutdown()
    vc.shutdown()


if __name__ == "__main__":
    main()
