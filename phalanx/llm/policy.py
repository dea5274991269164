"""The driver-side ``Policy``: a group of ``DTensorPolicyWorker`` called as one model.

Batches are split by ``BatchedDataDict.shard_by_batch_size`` (global batch by global batch,
so every rank sees its part of each global batch) and dispatched with the group's
``run_all_workers_sharded_data`` along the ``data_parallel`` axis.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from phalanx.data import BatchedDataDict
from phalanx.group.group import RayWorkerGroup
from phalanx.group.sharding import NamedSharding
from phalanx.llm.loss import LossFunction
from phalanx.llm.policy_worker import check_parallel_config
from phalanx.resources.cluster import Cluster
from phalanx.resources.placement import NodePlacement
from phalanx.resources.virtual_cluster import RayVirtualCluster
from phalanx.worker.builder import RayWorkerBuilder

DP_AXIS = "data_parallel"
CP_AXIS = "context_parallel"
TP_AXIS = "tensor_parallel"


def _sharding(world_size: int, tp: int, cp: int) -> NamedSharding:
    """Ranks on a (data, context, tensor)-parallel grid, as the workers' device mesh."""
    if world_size % (tp * cp):
        raise ValueError(
            f"dtensor_cfg.tensor_parallel_size={tp} x context_parallel_size={cp} does not "
            f"divide {world_size} ranks"
        )
    grid = np.arange(world_size).reshape(world_size // (tp * cp), cp, tp)
    return NamedSharding(grid, [DP_AXIS, CP_AXIS, TP_AXIS])


class Policy:
    """An FSDP2 policy over ``num_workers`` ranks (``num_workers / tensor_parallel_size``
    data-parallel ranks, each a group of ``tensor_parallel_size`` neighbouring ranks).

    ``cluster`` is a ``px.Cluster`` (workers placed with ``NodePlacement``) or a
    ``RayVirtualCluster`` (one worker per bundle, NeMo-RL style).
    """

    def __init__(
        self,
        cluster: Cluster | RayVirtualCluster,
        config: dict[str, Any],
        tokenizer: Any,
        *,
        num_workers: int = 1,
        name_prefix: str = "policy",
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        num_cpus_per_worker: float = 1.0,
        timeout_s: float = 300.0,
    ) -> None:
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        path = config.get("model_name")
        if not path or not os.path.exists(os.path.join(str(path), "config.json")):
            raise ValueError(f"config['model_name']: model path {path!r} does not exist")
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError(
                "tokenizer has no pad token (pad_token_id is None); set tokenizer.pad_token first"
            )
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        tp, cp = check_parallel_config(config)
        if num_workers % (tp * cp):
            raise ValueError(
                f"dtensor_cfg.tensor_parallel_size={tp} x context_parallel_size={cp} does not "
                f"divide num_workers {num_workers}"
            )
        dp = num_workers // (tp * cp)
        gbs = config.get("train_global_batch_size")
        if isinstance(gbs, int) and gbs % dp:
            raise ValueError(
                f"train_global_batch_size {gbs} is not divisible by the data-parallel size {dp} "
                f"(num_workers {num_workers} / (tensor_parallel_size {tp} x "
                f"context_parallel_size {cp}))"
            )
        self.cfg = config
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        builder = RayWorkerBuilder(
            "phalanx.llm.policy_worker.DTensorPolicyWorker",
            config,
            tokenizer,
            weights_path=weights_path,
            optimizer_path=optimizer_path,
            init_optimizer=init_optimizer,
            init_reference_model=init_reference_model,
        )
        if isinstance(cluster, RayVirtualCluster):
            sharding = _sharding(cluster.world_size, tp, cp)
            self.worker_group = RayWorkerGroup(
                cluster, builder, name_prefix=name_prefix, sharding_annotations=sharding
            )
        else:
            sharding = _sharding(num_workers, tp, cp)
            self.worker_group = RayWorkerGroup(remote_worker_builder=builder).launch(
                cluster,
                NodePlacement(num_workers=num_workers, num_cpus=num_cpus_per_worker),
                name=name_prefix,
                sharding=sharding,
                timeout_s=timeout_s,
            )
        self.dp_size = self.worker_group.sharding_annotations.get_axis_size(DP_AXIS)
        self.max_seq_len = int(config.get("max_total_sequence_length") or 1 << 30)

    # ------------------------------------------------------------------ helpers
    def _check(self, data: BatchedDataDict, what: str) -> None:
        if not isinstance(data, BatchedDataDict):
            raise TypeError(f"{what}: data must be a BatchedDataDict, got {type(data).__name__}")
        if "input_ids" not in data:
            raise ValueError(f"{what}: data needs 'input_ids'")
        seq = data["input_ids"].shape[1]
        if seq > self.max_seq_len:
            raise ValueError(
                f"{what}: sequence length {seq} exceeds max_total_sequence_length {self.max_seq_len}"
            )

    def _sharded(self, method: str, shards: list[BatchedDataDict], **common: Any) -> list[Any]:
        # The cp and tp ranks of one data-parallel rank take the same shard; one returns.
        fut = self.worker_group.run_all_workers_sharded_data(
            method,
            data=shards,
            in_sharded_axes=[DP_AXIS],
            replicate_on_axes=[CP_AXIS, TP_AXIS],
            output_is_replicated=[CP_AXIS, TP_AXIS],
            common_kwargs=common,
        )
        return fut.get_results(self.worker_group, timeout=self.timeout_s)

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.worker_group.call(method, *args, **kwargs).wait(timeout=self.timeout_s)

    # ------------------------------------------------------------------ training and log-probs
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """Train on ``data`` (a whole number of global batches); returns loss and metrics."""
        self._check(data, "train")
        gbs = int(gbs or self.cfg["train_global_batch_size"])
        mbs = int(mbs or self.cfg["train_micro_batch_size"])
        if gbs % self.dp_size:
            raise ValueError(f"gbs {gbs} is not divisible by the data-parallel size {self.dp_size}")
        if (gbs // self.dp_size) % mbs:
            raise ValueError(
                f"mbs {mbs} does not divide the per-rank global batch {gbs // self.dp_size}"
            )
        if data.size % gbs:
            raise ValueError(f"train: batch of {data.size} rows is not a multiple of gbs {gbs}")
        shards = data.shard_by_batch_size(self.dp_size, batch_size=gbs)
        results = self._sharded(
            "train", shards, loss_fn=loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs
        )
        mb_metrics: dict[str, list[Any]] = {}
        for r in results:
            for k, v in r["all_mb_metrics"].items():
                mb_metrics.setdefault(k, []).extend(v)
        return {
            "loss": results[0]["global_loss"],
            "grad_norm": results[0]["grad_norm"],
            "lr": results[0]["lr"],
            "all_mb_metrics": mb_metrics,
        }

    def _logprobs(
        self, method: str, key: str, data: BatchedDataDict, mbs: int | None
    ) -> BatchedDataDict:
        self._check(data, method)
        shards = data.shard_by_batch_size(self.dp_size, allow_uneven_shards=True)
        results = self._sharded(method, shards, micro_batch_size=mbs)
        return BatchedDataDict({key: torch.cat([r[key] for r in results], dim=0)})

    def get_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """``logprobs`` [B, T] of ``data['input_ids']`` (position 0 and padding are 0)."""
        return self._logprobs("get_logprobs", "logprobs", data, micro_batch_size)

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """``reference_logprobs`` [B, T] under the initial (reference) weights."""
        return self._logprobs(
            "get_reference_policy_logprobs", "reference_logprobs", data, micro_batch_size
        )

    # ------------------------------------------------------------------ phases and weights
    def prepare_for_training(self) -> None:
        self._all("prepare_for_training")

    def prepare_for_lp_inference(self) -> None:
        self._all("prepare_for_lp_inference")

    def offload_before_refit(self) -> None:
        self._all("offload_before_refit")

    def offload_after_refit(self) -> None:
        self._all("offload_after_refit")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full model weights on CPU (gathered collectively, returned by rank 0)."""
        return self._all("return_state_dict")[0]

    def save_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
    ) -> None:
        self._all("save_checkpoint", weights_path, optimizer_path, tokenizer_path)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        self._all("load_checkpoint", weights_path, optimizer_path)

    def shutdown(self) -> bool:
        return self.worker_group.shutdown(cleanup_method="shutdown", timeout=60)
