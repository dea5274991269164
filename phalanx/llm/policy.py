"""The driver-side ``Policy``: a group of ``DTensorPolicyWorker`` called as one model.

NeMo-RL's ``Policy(cluster, config, tokenizer)`` on a ``RayVirtualCluster`` starts one
worker per bundle; on a ``px.Cluster`` it starts ``num_workers`` workers. Ranks sit on a
(pipeline=1, data, context, tensor)-parallel grid, as NeMo-RL's sharding annotations.
Batches are split by ``BatchedDataDict.shard_by_batch_size`` (global batch by global batch,
so every rank sees its part of each global batch; with ``dynamic_batching`` sorted by length
and cut by token budget, with ``sequence_packing`` bin-packed) and dispatched with
``run_all_workers_sharded_data`` along the ``data_parallel`` axis; log-probs come back in
the caller's order.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import torch

from phalanx._base.checks import check_int
from phalanx.data import BatchedDataDict
from phalanx.group.group import RayWorkerGroup
from phalanx.group.sharding import NamedSharding
from phalanx.llm.flops import FLOPTracker
from phalanx.llm.lora import check_lora_config
from phalanx.llm.loss import LossFunction
from phalanx.llm.parallelize import check_parallel_config, load_parallel_plan
from phalanx.llm.policy_config import (
    ConfigError,
    check_policy_config,
    dynamic_batching_enabled,
    sequence_packing_enabled,
    train_batch_sizes,
)
from phalanx.resources.cluster import Cluster
from phalanx.resources.placement import NodePlacement
from phalanx.resources.virtual_cluster import RayVirtualCluster
from phalanx.worker.builder import RayWorkerBuilder

PP_AXIS = "pipeline_parallel"
DP_AXIS = "data_parallel"
CP_AXIS = "context_parallel"
TP_AXIS = "tensor_parallel"
_REPLICATED = [CP_AXIS, TP_AXIS, PP_AXIS]


def _sharding(world_size: int, tp: int, cp: int) -> NamedSharding:
    """Ranks on a (pipeline, data, context, tensor)-parallel grid, as NeMo-RL lays them out
    (pipeline size 1: phalanx has no pipeline parallelism)."""
    if world_size < tp * cp or world_size % (tp * cp):
        raise ConfigError(
            f"dtensor_cfg.tensor_parallel_size={tp} x context_parallel_size={cp} does not "
            f"divide the {world_size} policy ranks (data-parallel size must be a whole number)"
        )
    grid = np.arange(world_size).reshape(1, world_size // (tp * cp), cp, tp)
    return NamedSharding(grid, [PP_AXIS, DP_AXIS, CP_AXIS, TP_AXIS])


class Policy:
    """An FSDP2 policy: NeMo-RL's ``lm_policy.Policy``.

    ``cluster`` is a ``RayVirtualCluster`` (one worker per bundle, NeMo-RL style) or a
    ``px.Cluster`` (``num_workers`` workers placed with ``NodePlacement``). The data-parallel
    size is the number of workers / (tensor_parallel_size x context_parallel_size).

    Args:
        cluster: a ``RayVirtualCluster`` or a ``Cluster``.
        config: NeMo-RL's policy config.
        tokenizer: the model's tokenizer.
        name_prefix: the workers' group name.
        workers_per_node: workers per node on a ``RayVirtualCluster``.
        init_optimizer: build the optimizer.
        weights_path: a checkpoint to load the weights from.
        optimizer_path: a checkpoint to load the optimizer's state from.
        init_reference_model: keep the initial weights as the reference policy.
        processor: a multimodal processor (not supported).
        num_workers: workers on a ``Cluster`` (1 if None).
        num_cpus_per_worker: CPUs each worker reserves.
        timeout_s: seconds a call may take.

    Raises:
        ConfigError: the config is invalid, the model path does not exist, or a
            ``processor`` is given.
        ValueError: an option is out of range.
        TypeError: ``cluster`` has the wrong type.

    Example:
        Two FSDP2 ranks learn to repeat one sequence (the tiny test decoder, random
        weights): the masked tokens' loss falls and each token gets its log-prob.

        >>> import tempfile, torch
        >>> import phalanx as px
        >>> from transformers import AutoTokenizer
        >>> from phalanx.algorithms.grpo_tiny_task import build_tiny_model
        >>> path = str(build_tiny_model(tempfile.mkdtemp() + "/model"))
        >>> tokenizer = AutoTokenizer.from_pretrained(path)
        >>> cfg = {"model_name": path, "train_global_batch_size": 4,
        ...        "train_micro_batch_size": 2,
        ...        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}}}
        >>> policy = px.Policy(px.Cluster(), cfg, tokenizer, num_workers=2,
        ...                    name_prefix="example_policy")
        >>> ids = torch.tensor(tokenizer("12+34=46")["input_ids"]).repeat(4, 1)
        >>> data = px.BatchedDataDict(
        ...     input_ids=ids, input_lengths=torch.full((4,), ids.shape[1]),
        ...     token_mask=torch.ones(ids.shape), sample_mask=torch.ones(4))
        >>> losses = [float(policy.train(data, px.NLLLoss())["loss"].mean()) for _ in range(5)]
        >>> losses[-1] < losses[0]
        True
        >>> policy.get_logprobs(data)["logprobs"].shape == ids.shape
        True
        >>> policy.shutdown()
        True
    """

    def __init__(
        self,
        cluster: Cluster | RayVirtualCluster,
        config: dict[str, Any],
        tokenizer: Any,
        name_prefix: str = "lm_policy",
        workers_per_node: int | list[int] | None = None,
        init_optimizer: bool = True,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_reference_model: bool = True,
        processor: Any = None,
        *,
        num_workers: int | None = None,
        num_cpus_per_worker: float = 1.0,
        timeout_s: float = 300.0,
    ) -> None:
        check_policy_config(config)
        path = config.get("model_name")
        if not path or not os.path.exists(os.path.join(str(path), "config.json")):
            raise ConfigError(f"config['model_name']: model path {path!r} does not exist")
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError(
                "tokenizer has no pad token (pad_token_id is None); set tokenizer.pad_token first"
            )
        if processor is not None:
            raise ConfigError("processor: multimodal (VLM) policies are not supported")
        if isinstance(cluster, RayVirtualCluster):
            world = cluster.world_size()
            if num_workers is not None and num_workers != world:
                raise ValueError(
                    f"num_workers={num_workers} disagrees with the virtual cluster's "
                    f"{world} bundles (a RayVirtualCluster starts one worker per bundle)"
                )
        elif isinstance(cluster, Cluster):
            world = 1 if num_workers is None else check_int(num_workers, "num_workers", 1)
        else:
            raise TypeError(
                f"cluster must be a RayVirtualCluster or a px.Cluster, got {type(cluster).__name__}"
            )
        tp, cp = check_parallel_config(config)
        plan = (config.get("dtensor_cfg") or {}).get("custom_parallel_plan")
        if plan is not None:
            load_parallel_plan(plan)  # a bad plan fails here, before any worker starts
        check_lora_config(config)  # so does a LoRA pattern that matches no layer
        self.sharding_annotations = _sharding(world, tp, cp)
        dp = self.sharding_annotations.get_axis_size(DP_AXIS)
        gbs = config.get("train_global_batch_size")
        if isinstance(gbs, int) and gbs % dp:
            raise ConfigError(
                f"train_global_batch_size {gbs} is not divisible by the data-parallel size {dp} "
                f"({world} ranks / (tensor_parallel_size {tp} x context_parallel_size {cp}))"
            )
        self.cfg = config
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.use_dynamic_batches = dynamic_batching_enabled(config)
        self.use_sequence_packing = sequence_packing_enabled(config)
        dcfg = config.get("dtensor_cfg") or {}
        env_vars = dict(dcfg.get("env_vars") or {})
        builder = RayWorkerBuilder(
            "phalanx.llm.policy_worker.DTensorPolicyWorker",
            config,
            tokenizer,
            weights_path=os.path.abspath(weights_path) if weights_path else None,
            optimizer_path=os.path.abspath(optimizer_path) if optimizer_path else None,
            init_optimizer=init_optimizer,
            init_reference_model=init_reference_model,
        )
        if isinstance(cluster, RayVirtualCluster):
            self.worker_group = RayWorkerGroup(
                cluster,
                builder,
                workers_per_node=workers_per_node,
                name_prefix=name_prefix,
                sharding_annotations=self.sharding_annotations,
                env_vars=env_vars,
            )
        else:
            if workers_per_node is not None:
                raise ValueError("workers_per_node applies to a RayVirtualCluster only")
            self.worker_group = RayWorkerGroup(remote_worker_builder=builder).launch(
                cluster,
                NodePlacement(num_workers=world, num_cpus=num_cpus_per_worker),
                name=name_prefix,
                sharding=self.sharding_annotations,
                env_vars=env_vars,
                timeout_s=timeout_s,
            )
        self.dp_size = dp
        self.max_seq_len = int(config.get("max_total_sequence_length") or 1 << 30)
        # NeMo-RL pads packed sequences to make_sequence_length_divisible_by.
        self._sequence_pad_multiple = int(
            config.get("make_sequence_length_divisible_by") or (cp * 2 * tp if cp > 1 else tp)
        )
        self.flops_tracker = _flops_tracker(str(path))

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
        if (self.use_dynamic_batches or self.use_sequence_packing) and "input_lengths" not in data:
            option = "dynamic_batching" if self.use_dynamic_batches else "sequence_packing"
            raise ValueError(f"{what}: {option} needs data['input_lengths']")

    def _shard(
        self, data: BatchedDataDict, batch_size: int | None, tokens_key: str
    ) -> tuple[list[BatchedDataDict], list[int] | None]:
        """Shards for the data-parallel ranks and, when reordered, the permutation to undo."""
        common = {"batch_size": batch_size, "allow_uneven_shards": batch_size is None}
        if not (self.use_dynamic_batches or self.use_sequence_packing):
            return data.shard_by_batch_size(self.dp_size, **common), None
        option = "dynamic_batching" if self.use_dynamic_batches else "sequence_packing"
        section = self.cfg[option]
        if tokens_key not in section:
            raise ConfigError(f"{option}.{tokens_key} is required for this call")
        args = {
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "max_tokens_per_microbatch": int(section[tokens_key]),
        }
        if self.use_dynamic_batches:
            args["sequence_length_round"] = section["sequence_length_round"]
            return data.shard_by_batch_size(self.dp_size, dynamic_batching_args=args, **common)
        args["algorithm"] = section.get("algorithm", "modified_first_fit_decreasing")
        args["sequence_length_pad_multiple"] = self._sequence_pad_multiple
        args["microbatch_order"] = section.get("microbatch_order", "packer")
        return data.shard_by_batch_size(self.dp_size, sequence_packing_args=args, **common)

    def _submit(self, method: str, shards: list[BatchedDataDict], **common: Any) -> Any:
        # The pp, cp and tp ranks of one data-parallel rank take the same shard; one returns.
        return self.worker_group.run_all_workers_sharded_data(
            method,
            data=shards,
            in_sharded_axes=[DP_AXIS],
            replicate_on_axes=_REPLICATED,
            output_is_replicated=_REPLICATED,
            common_kwargs=common,
        )

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
        timer: Any = None,
    ) -> dict[str, Any]:
        """Train on ``data`` (a whole number of global batches); returns loss and metrics.

        ``token_mask`` is needed only by token-level losses; without it every token counts.
        ``timer`` (NeMo-RL's ``Timer``, or any object whose ``time(label)`` is a context
        manager) records "policy_training/sharding_data" and
        "policy_training/submit_training_futures". With a ``flops_tracker`` the result
        has ``total_flops`` (model FLOPs of this call) and ``num_ranks``.

        Args:
            data: the batch.
            loss_fn: the loss function.
            eval_mode: compute the loss without stepping the optimizer.
            gbs: the global batch size (the config's if None).
            mbs: the micro-batch size (the config's if None).
            timer: records the phases, as above.

        Returns:
            ``loss``, ``grad_norm``, ``lr`` and ``all_mb_metrics``.

        Raises:
            ValueError: the batch sizes do not divide.
        """
        _check_timer(timer)
        self._check(data, "train")
        plain = not (self.use_dynamic_batches or self.use_sequence_packing)
        gbs, mbs, _ = train_batch_sizes(self.cfg, gbs, mbs, self.dp_size, plain)
        if data.size % gbs:
            raise ValueError(f"train: batch of {data.size} rows is not a multiple of gbs {gbs}")
        with _timed(timer, "policy_training/sharding_data"):
            shards, _ = self._shard(data, gbs, "train_mb_tokens")
        if self.flops_tracker is not None:
            self.flops_tracker.reset()
            for shard in shards:
                self.flops_tracker.track_batch(_sequence_lengths(shard))
        with _timed(timer, "policy_training/submit_training_futures"):
            fut = self._submit(
                "train", shards, loss_fn=loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs
            )
        results = fut.get_results(self.worker_group, timeout=self.timeout_s)
        mb_metrics: dict[str, list[Any]] = {}
        for r in results:
            for k, v in r["all_mb_metrics"].items():
                mb_metrics.setdefault(k, []).extend(v)
        out = {
            "loss": results[0]["global_loss"],
            "grad_norm": results[0]["grad_norm"],
            "lr": results[0]["lr"],
            "all_mb_metrics": mb_metrics,
        }
        if self.flops_tracker is not None:
            out["total_flops"] = self.flops_tracker.total_flops
            out["num_ranks"] = self.worker_group.world_size
        return out

    def _logprobs(
        self, method: str, key: str, data: BatchedDataDict, mbs: int | None, timer: Any, label: str
    ) -> BatchedDataDict:
        _check_timer(timer)
        self._check(data, method)
        with _timed(timer, f"{method}/shard_data"):
            shards, perm = self._shard(data, None, "logprob_mb_tokens")
        with _timed(timer, f"{method}/{label}"):
            fut = self._submit(method, shards, micro_batch_size=mbs)
        results = fut.get_results(self.worker_group, timeout=self.timeout_s)
        out = BatchedDataDict.from_batches([{key: r[key]} for r in results])
        if perm is not None:
            out.reorder_data(perm)
        if key not in out:  # no rows at all
            out[key] = torch.zeros(tuple(data["input_ids"].shape), dtype=torch.float32)
        return out

    def get_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None, timer: Any = None
    ) -> BatchedDataDict:
        """``logprobs`` [B, T] of ``data['input_ids']`` (position 0 and padding are 0),
        in the order of ``data``. ``timer`` records "get_logprobs/shard_data" and
        "get_logprobs/submit_logprob_futures" (NeMo-RL's labels).

        Args:
            data: the batch, with ``input_ids`` and ``input_lengths``.
            micro_batch_size: rows per forward pass (the config's if None).
            timer: records the phases, as above.

        Returns:
            A ``BatchedDataDict`` with ``logprobs``.
        """
        return self._logprobs(
            "get_logprobs", "logprobs", data, micro_batch_size, timer, "submit_logprob_futures"
        )

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None, timer: Any = None
    ) -> BatchedDataDict:
        """``reference_logprobs`` [B, T] under the initial (reference) weights. ``timer``
        records "get_reference_policy_logprobs/shard_data" and
        "get_reference_policy_logprobs/submit_reference_policy_logprob_futures".

        Args:
            data: as for ``get_logprobs``.
            micro_batch_size: as for ``get_logprobs``.
            timer: records the phases, as above.

        Returns:
            A ``BatchedDataDict`` with ``reference_logprobs``.
        """
        return self._logprobs(
            "get_reference_policy_logprobs",
            "reference_logprobs",
            data,
            micro_batch_size,
            timer,
            "submit_reference_policy_logprob_futures",
        )

    # ------------------------------------------------------------------ phases and weights
    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        """Every worker in train mode, model and optimizer state on the device.

        Args:
            *args, **kwargs: accepted for NeMo-RL's signature.
        """
        self._all("prepare_for_training")

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        """Every worker in eval mode; optimizer state moves to CPU (per
        ``offload_optimizer_for_logprob``) unless ``keep_train_buffers``.

        Args:
            keep_train_buffers: keep the optimizer state on the device.
        """
        self._all("prepare_for_lp_inference", keep_train_buffers=keep_train_buffers)

    def finish_inference(self) -> None:
        """Move the model to host memory after an inference phase (NeMo-RL's, for PPO)."""
        self._all("finish_inference")

    def prepare_refit_info(self) -> dict[str, Any]:
        """``{name: (shape, dtype)}`` of the weights a refit sends.

        Returns:
            A dict from parameter name to ``(shape, dtype)``.
        """
        return self._all("prepare_refit_info")[0]

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        """End of a training phase. Nothing to release: each ``train`` call already frees
        its gradients, and the model stays where ``prepare_for_training`` put it until
        ``prepare_for_lp_inference``/``offload_after_refit`` move it (NeMo-RL's is a no-op
        too).

        Args:
            *args, **kwargs: accepted for NeMo-RL's signature.
        """

    def offload_before_refit(self) -> None:
        self._all("offload_before_refit")

    def offload_after_refit(self) -> None:
        self._all("offload_after_refit")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full model weights on CPU (gathered collectively, returned by rank 0).

        Returns:
            A dict from parameter name to its tensor.
        """
        return self._all("return_full_state_dict")[0]

    def keep_state(self, root: str, slot: int) -> int:
        """Every rank's training state into ``slot`` (0 or 1) of the files under ``root``
        (``DTensorPolicyWorker.keep_state``), the last good state of in-place recovery.

        Args:
            root, slot: as for ``DTensorPolicyWorker.keep_state``.

        Returns:
            The bytes kept, all ranks together.
        """
        return sum(self._all("keep_state", root, slot))

    def restore_kept_state(self, root: str, slot: int) -> None:
        """Every rank loads what its predecessor kept in ``slot`` under ``root``.

        Args:
            root, slot: as for ``DTensorPolicyWorker.restore_kept_state``.
        """
        self._all("restore_kept_state", root, slot)

    def save_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
        checkpointing_cfg: dict[str, Any] | None = None,
    ) -> None:
        """Sharded checkpoint of model (and optimizer). As NeMo-RL, ``checkpointing_cfg``
        reaches the workers with ``dtensor_cfg._v2`` only; without it a
        ``model_save_format`` is an error.

        Args:
            weights_path, optimizer_path, tokenizer_path, checkpointing_cfg: as for
                ``DTensorPolicyWorker.save_checkpoint``.

        Raises:
            ConfigError: ``checkpointing_cfg`` asks for a format this policy does not write.
        """
        if not (self.cfg.get("dtensor_cfg") or {}).get("_v2"):
            if (checkpointing_cfg or {}).get("model_save_format") is not None:
                raise ConfigError(
                    "model_save_format must be None or omitted if using DTensorPolicyWorker "
                    "(_v2=False)"
                )
            checkpointing_cfg = None
        self._all(
            "save_checkpoint",
            weights_path,
            optimizer_path,
            tokenizer_path,
            checkpointing_cfg=checkpointing_cfg,
        )

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Load a ``save_checkpoint`` directory on every worker.

        Args:
            weights_path: the directory of the model's weights.
            optimizer_path: the directory of the optimizer's state (not loaded if None).
        """
        self._all("load_checkpoint", weights_path, optimizer_path)

    def start_gpu_profiling(self) -> None:
        self._all("start_gpu_profiling")

    def stop_gpu_profiling(self) -> None:
        self._all("stop_gpu_profiling")

    def shutdown(self) -> bool:
        """Shut every worker down (their ``shutdown`` first).

        Returns:
            Whether the workers' ``shutdown`` succeeded.
        """
        return self.worker_group.shutdown(cleanup_method="shutdown", timeout=60)


def _flops_tracker(model_path: str) -> FLOPTracker | None:
    """NeMo-RL's FLOPs tracker for the model, or None where its architecture is not counted."""
    from transformers import AutoConfig

    try:
        return FLOPTracker.from_config(model_path, AutoConfig.from_pretrained(model_path))
    except ValueError:
        return None


def _sequence_lengths(shard: BatchedDataDict) -> list[int]:
    if "input_lengths" in shard:
        return [int(n) for n in shard["input_lengths"].tolist()]
    return [int(shard["input_ids"].shape[1])] * shard.size


def _check_timer(timer: Any) -> None:
    if timer is not None and not callable(getattr(timer, "time", None)):
        raise TypeError(
            f"timer must have a time(label) context manager (NeMo-RL's Timer), got "
            f"{type(timer).__name__}"
        )


@contextmanager
def _timed(timer: Any, label: str) -> Iterator[None]:
    with timer.time(label) if timer is not None else nullcontext():
        yield
