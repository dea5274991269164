"""The DTensor policy worker: a Hugging Face causal LM sharded with FSDP2, one per rank.

Each rank of a group joins one ``torch.distributed`` process group (gloo on CPU, NCCL on
GPU) from the rank environment phalanx sets, loads the model with ``from_pretrained``,
builds a ("dp", "cp", "tp") device mesh, applies tensor (and sequence) parallelism over
"tp" when ``tensor_parallel_size > 1`` and then ``fully_shard`` to every decoder layer and
the root over "dp" (and "cp") (``parallelize.py``), and trains with token-level losses
normalised by the number of valid tokens of the whole global batch, so the result does
not depend on the sharding. Context parallelism needs CUDA (``check_parallel_config``
refuses it on CPU); on GPU the forward and backward run inside ``train_context``.

Config (a dict, NeMo-RL's ``PolicyConfig`` keys; ``policy_config.py`` decides every key)::

    model_name                    path of a save_pretrained model (required)
    train_global_batch_size       rows per optimizer step, over all ranks
    train_micro_batch_size        rows per forward/backward on one rank
    logprob_batch_size            rows per forward in get_logprobs
    logprob_chunk_size            positions per chunk when computing log-probs
    max_total_sequence_length     longest input accepted
    precision                     "float32" | "bfloat16" | "float16" (FSDP2 mixed precision)
    max_grad_norm                 gradient clipping (None: no clipping)
    optimizer                     {"name": "torch.optim.AdamW", "kwargs": {...}}
    scheduler                     None | {"name", "kwargs"} | [{"name", "kwargs"}, ...,
                                  {"milestones": [...]}] (SequentialLR)
    dtensor_cfg                   {"activation_checkpointing", "cpu_offload",
                                   "tensor_parallel_size", "context_parallel_size",
                                   "sequence_parallel", "custom_parallel_plan",
                                   "defer_fsdp_grad_sync", "clear_cache_every_n_steps",
                                   "env_vars"}
    dynamic_batching              {"enabled", "train_mb_tokens", "logprob_mb_tokens",
                                   "sequence_length_round"}
    sequence_packing              {"enabled", "train_mb_tokens", "logprob_mb_tokens",
                                   "algorithm", "microbatch_order"}
    generation                    its "temperature" divides the logits (as in NeMo-RL)
    hf_config_overrides           passed to the model config
    offload_optimizer_for_logprob prepare_for_lp_inference moves optimizer state to CPU
                                  (default True)
    refit_buffer_size_gb / _mb    refit bucket size
    seed                          torch seed (same on every rank)
    profile_dir                   where stop_gpu_profiling writes its trace

With ``dynamic_batching`` or ``sequence_packing`` the data must come from
``BatchedDataDict.shard_by_batch_size`` with the matching arguments (``Policy`` does that):
micro-batches follow the shard's plan. Packed micro-batches run as one row with position ids
restarting per sequence and a block-diagonal causal mask.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import socket
import time
import warnings
from collections.abc import Generator, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from phalanx.data import BatchedDataDict
from phalanx.llm.logprobs import chosen_token_logprobs
from phalanx.llm.loss import LossFunction, LossType
from phalanx.llm.parallelize import (
    apply_custom_plan,
    apply_fsdp,
    apply_tp,
    check_tp_size,
    clip_grad_norm,
)
from phalanx.llm.policy_config import (
    ConfigError,
    check_policy_config,
    dynamic_batching_enabled,
    logits_temperature,
    sequence_packing_enabled,
)
from phalanx.llm.sequence_packing import pack_rows, unpack_to_rows, unpack_token_logprobs
from phalanx.worker.worker import Worker

_PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PG_TIMEOUT = timedelta(seconds=300)


# ----------------------------------------------------------------------------- module functions


@contextlib.contextmanager
def unshard_fsdp2_model(model: torch.nn.Module) -> Generator[None, None, None]:
    """Hold the full (unsharded) parameters of every FSDP2 module inside the block."""
    from torch.distributed.fsdp import FSDPModule

    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    try:
        for m in fsdp_modules:
            m.unshard()
        yield
    finally:
        for m in fsdp_modules:
            m.reshard()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def get_cpu_state_dict(
    state_generator: Iterable[tuple[str, torch.Tensor | DTensor]], pin_memory: bool = False
) -> dict[str, torch.Tensor]:
    """Copy each tensor's local part (a DTensor's shard on this rank) into new CPU memory.

    The copies share nothing with the model, so they survive later training steps.
    ``pin_memory`` pins them (only when CUDA is available) for fast copies back.
    """
    pin = pin_memory and torch.cuda.is_available()
    out: dict[str, torch.Tensor] = {}
    for key, value in state_generator:
        local = _local(value).detach()
        buf = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
        buf.copy_(local, non_blocking=pin)
        out[key] = buf
    if pin:
        torch.cuda.synchronize()
    return out


def _free_device_cache() -> None:
    """Return freed GPU memory to the device (a full gc only matters, and pays, on GPU)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def _import_object(path: str, what: str) -> Any:
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"{what}: expected 'module.Name', got {path!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what}: cannot import {path!r} ({e})") from None


# ----------------------------------------------------------------------------- the worker


class DTensorPolicyWorker(Worker):
    """One rank of an FSDP2-sharded policy (NeMo-RL's ``DTensorPolicyWorker``)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}[rank={self.rank}]"

    def __init__(
        self,
        config: dict[str, Any],
        tokenizer: Any,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.cfg = _check_config(config)
        if tokenizer is None or getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError(
                "tokenizer has no pad token (pad_token_id is None); set tokenizer.pad_token "
                "(e.g. to the eos token) before building the policy"
            )
        self.tokenizer = tokenizer
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._init_process_group()
        torch.manual_seed(int(self.cfg.get("seed", 42)))

        from torch.distributed.device_mesh import init_device_mesh

        dcfg = self.cfg.get("dtensor_cfg") or {}
        self.tp_size, self.cp_size = check_parallel_config(self.cfg)
        world = dist.get_world_size()
        if world % (self.tp_size * self.cp_size):
            raise ValueError(
                f"dtensor_cfg.tensor_parallel_size={self.tp_size} x context_parallel_size="
                f"{self.cp_size} does not divide the number of policy ranks {world}"
            )
        self.dp_size = world // (self.tp_size * self.cp_size)
        self.sequence_parallel = bool(dcfg.get("sequence_parallel")) and self.tp_size > 1
        # Rank r sits at (dp, cp, tp) in row-major order: tp ranks are neighbours.
        self.device_mesh = init_device_mesh(
            self.device.type,
            (self.dp_size, self.cp_size, self.tp_size),
            mesh_dim_names=("dp", "cp", "tp"),
        )
        self.dp_mesh, self.cp_mesh = self.device_mesh["dp"], self.device_mesh["cp"]
        self.tp_mesh = self.device_mesh["tp"]
        self._dp_group = self.dp_mesh.get_group()
        # FSDP shards over dp and cp together (cp ranks hold the same rows of the batch).
        self._fsdp_mesh = (
            self.device_mesh["dp", "cp"]._flatten("dp_cp") if self.cp_size > 1 else self.dp_mesh
        )
        self.dtype = _PRECISIONS[self.cfg.get("precision", "float32")]
        self.temperature = logits_temperature(self.cfg)
        self.logprob_chunk_size = self.cfg.get("logprob_chunk_size")
        self.mode = (
            "dynamic"
            if dynamic_batching_enabled(self.cfg)
            else "packed"
            if sequence_packing_enabled(self.cfg)
            else "plain"
        )
        self.model = self._load_model()
        self.max_seq_len = int(
            self.cfg.get("max_total_sequence_length")
            or getattr(self.model.config, "max_position_embeddings", 1 << 30)
        )
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        if init_optimizer:
            self._init_optimizer()
        self.reference_model_state_dict: dict[str, torch.Tensor] | None = None
        if init_reference_model:
            self.reference_model_state_dict = get_cpu_state_dict(
                self.model.state_dict().items(), pin_memory=True
            )
        if weights_path:
            self.load_checkpoint(weights_path, optimizer_path if init_optimizer else None)
        self._held_refit: dict[str, torch.Tensor] | None = None
        self._ipc_buffers: list[torch.Tensor] = []
        self._shm_segment: Any = None
        self._refit_segment: Any = None
        self._refit_layout: tuple[Any, Any] | None = None
        self._one_node: bool | None = None
        self._refit_maps: dict[str, Any] = {}  # name -> mapped buffer (write_weights_to_shm)
        self._profiler: Any = None
        self._peak_rss = 0
        self.model_update_group: Any = None

    # ------------------------------------------------------------------ setup
    def _init_process_group(self) -> None:
        if dist.is_initialized():
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            rank=int(os.environ.get("RANK", self.rank)),
            world_size=int(os.environ.get("WORLD_SIZE", self.world_size)),
            timeout=_PG_TIMEOUT,
        )

    def _load_model(self) -> torch.nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
        from transformers import AutoConfig, AutoModelForCausalLM

        dcfg = self.cfg.get("dtensor_cfg") or {}
        overrides = dict(self.cfg.get("hf_config_overrides") or {})
        overrides.setdefault("attn_implementation", "sdpa")
        config = AutoConfig.from_pretrained(self.cfg["model_name"], **overrides)
        model = AutoModelForCausalLM.from_pretrained(
            self.cfg["model_name"], config=config, dtype=torch.float32
        )
        model.config.use_cache = False
        if dcfg.get("activation_checkpointing"):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        # Pinned host memory needs an accelerator; NeMo-RL does not pin either.
        offload = CPUOffloadPolicy(pin_memory=False) if dcfg.get("cpu_offload") else None
        if offload is not None and self.device.type == "cpu":
            warnings.warn(
                "dtensor_cfg.cpu_offload=True on a CPU-only worker: parameters already live "
                "in host memory, so offloading changes nothing",
                stacklevel=2,
            )
        if offload is None and self.device.type == "cuda":
            model = model.to(self.device)
        plan = dcfg.get("custom_parallel_plan")
        if plan is not None and self.tp_size == 1:
            warnings.warn(
                "dtensor_cfg.custom_parallel_plan is only applied with tensor_parallel_size > 1 "
                "(as in NeMo-RL); it has no effect at tensor_parallel_size=1",
                stacklevel=2,
            )
        if self.tp_size > 1:
            if plan is not None:
                apply_custom_plan(model, self.tp_mesh, plan)
            else:
                apply_tp(model, self.tp_mesh, self.sequence_parallel)
        apply_fsdp(model, self._fsdp_mesh, mp, offload)
        return model

    def _reshard(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def _init_optimizer(self) -> None:
        ocfg = self.cfg.get("optimizer") or {
            "name": "torch.optim.AdamW",
            "kwargs": {"lr": 1e-3, "weight_decay": 0.0},
        }
        cls = _import_object(ocfg["name"], "optimizer.name")
        self.optimizer = cls(self.model.parameters(), **dict(ocfg.get("kwargs") or {}))
        scfg = self.cfg.get("scheduler")
        if isinstance(scfg, list):
            # NeMo-RL's form: schedulers chained by SequentialLR at the given milestones.
            parts, milestones = [], None
            for entry in scfg:
                if "name" in entry:
                    cls_ = _import_object(entry["name"], "scheduler[].name")
                    parts.append(cls_(self.optimizer, **dict(entry.get("kwargs") or {})))
                elif "milestones" in entry:
                    milestones = list(entry["milestones"])
                else:
                    raise ConfigError(f"scheduler entry {entry!r} has neither name nor milestones")
            if milestones is None:
                raise ConfigError("scheduler list needs a {'milestones': [...]} entry")
            self.scheduler = torch.optim.lr_scheduler.SequentialLR(
                self.optimizer, parts, milestones
            )
        elif scfg:
            sched_cls = _import_object(scfg["name"], "scheduler.name")
            self.scheduler = sched_cls(self.optimizer, **dict(scfg.get("kwargs") or {}))
        else:
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)

    # ------------------------------------------------------------------ helpers
    def _all_reduce(
        self, value: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None
    ) -> torch.Tensor:
        value = value.to(self.device)
        dist.all_reduce(value, op=op, group=group)
        return value

    def _check_batch(self, data: BatchedDataDict, what: str) -> None:
        if not isinstance(data, dict) or "input_ids" not in data:
            raise ValueError(f"{what}: data must be a BatchedDataDict with 'input_ids'")
        seq = data["input_ids"].shape[1]
        if seq > self.max_seq_len:
            raise ValueError(
                f"{what}: sequence length {seq} exceeds max_total_sequence_length "
                f"{self.max_seq_len}"
            )

    def _forward_logits(
        self,
        input_ids: torch.Tensor,
        stack: contextlib.ExitStack,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] of right-padded ``input_ids`` (divided by the generation
        temperature when the config has one, as NeMo-RL does).

        Contexts the backward pass must also run under (context parallelism) are entered
        into ``stack``, which the caller closes after its backward. ``position_ids`` and a
        4-D boolean ``attention_mask`` are given for packed rows.
        """
        if self.cp_size > 1:
            logits = self._forward_logits_cp(input_ids, stack)
        else:
            # Right padding needs no attention mask: valid tokens never attend to later pads.
            T = input_ids.shape[1]
            pad = -T % self.tp_size if self.sequence_parallel else 0
            if pad:  # sequence parallelism splits the sequence evenly over the tp ranks
                fill = input_ids.new_full((input_ids.shape[0], pad), self.tokenizer.pad_token_id)
                input_ids = torch.cat([input_ids, fill], dim=1)
            kwargs: dict[str, Any] = {}
            if position_ids is not None:
                kwargs["position_ids"] = position_ids.to(self.device)
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask.to(self.device)
            logits = self.model(input_ids=input_ids.to(self.device), use_cache=False, **kwargs)
            logits = logits.logits
            logits = logits[:, :T] if pad else logits
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return logits

    def _forward_logits_cp(
        self, input_ids: torch.Tensor, stack: contextlib.ExitStack
    ) -> torch.Tensor:
        """Context parallelism (CUDA only): each cp rank runs the model on its share of the
        sequence (torch's ring attention); the logits are all-gathered, with gradients,
        back into whole sequences, ordered by the positions each rank received."""
        from torch.distributed.nn.functional import all_gather

        B, T = input_ids.shape
        pad = -T % (2 * self.cp_size)  # torch's load balancer cuts 2 * cp chunks
        ids = torch.nn.functional.pad(input_ids, (0, pad), value=self.tokenizer.pad_token_id)
        ids = ids.to(self.device)
        pos = torch.arange(T + pad, device=self.device).expand(B, -1).contiguous()
        ctx = self.create_context_parallel_ctx(self.cp_mesh, [ids, pos], [1, 1], {ids, pos})
        stack.enter_context(self.train_context(ctx))
        local = self.model(input_ids=ids, position_ids=pos, use_cache=False).logits
        group = self.cp_mesh.get_group()
        positions = [torch.empty_like(pos[0]) for _ in range(self.cp_size)]
        dist.all_gather(positions, pos[0].contiguous(), group=group)
        order = torch.argsort(torch.cat(positions))
        full = torch.cat(all_gather(local.contiguous(), group=group), dim=1)
        return full[:, order[:T]]

    def _packed_logits(
        self, mb: BatchedDataDict, stack: contextlib.ExitStack
    ) -> tuple[torch.Tensor, Any]:
        """Logits [1, L, V] of ``mb``'s sequences packed into one row, and the packing."""
        if "input_lengths" not in mb:
            raise ValueError("sequence_packing needs data['input_lengths']")
        multiple = self.tp_size if self.sequence_parallel else 1
        packed = pack_rows(
            mb["input_ids"], mb["input_lengths"], self.tokenizer.pad_token_id, multiple
        )
        logits = self._forward_logits(
            packed.input_ids, stack, packed.position_ids, packed.attention_mask
        )
        return logits, packed

    def _dummy_logits(self, stack: contextlib.ExitStack) -> torch.Tensor:
        """A two-token forward that keeps this rank's collectives in step with busier ranks."""
        ids = torch.full((1, 2 * self.tp_size), self.tokenizer.pad_token_id, dtype=torch.long)
        return self._forward_logits(ids, stack)

    def _max_over_ranks(self, n: int) -> int:
        """The largest ``n`` over all policy ranks (forwards are collective)."""
        return int(self._all_reduce(torch.tensor(n), dist.ReduceOp.MAX).item())

    def _microbatches(self, batch: BatchedDataDict, mbs: int, what: str) -> list[BatchedDataDict]:
        """This rank's micro-batches of one global batch, per the batching mode."""
        if self.mode == "plain":
            if batch.size % mbs:
                raise ValueError(
                    f"{what}: mbs (train_micro_batch_size) {mbs} does not divide this rank's "
                    f"global batch of {batch.size} rows"
                )
            return list(batch.make_microbatch_iterator(mbs)) if batch.size else []
        if batch.micro_batch_indices is None:
            option = "dynamic_batching" if self.mode == "dynamic" else "sequence_packing"
            raise ValueError(
                f"{what}: {option} is enabled but the data carries no micro-batch plan; shard "
                "it with BatchedDataDict.shard_by_batch_size(..., "
                f"{'dynamic_batching_args' if self.mode == 'dynamic' else 'sequence_packing_args'}"
                "=...) (Policy does this)"
            )
        if self.mode == "dynamic":
            return list(batch.make_microbatch_iterator_with_dynamic_shapes())
        return list(batch.make_microbatch_iterator_for_packable_sequences())

    def _global_batches(self, data: BatchedDataDict, local_gbs: int) -> list[BatchedDataDict]:
        if data.elem_counts_per_gb is not None:  # sharded by shard_by_batch_size
            return [data.get_batch(g) for g in range(len(data.elem_counts_per_gb))]
        if self.mode != "plain":
            self._microbatches(data, 1, "train")  # raises: no plan
        if data.size % local_gbs:
            raise ValueError(
                f"train: this rank holds {data.size} rows, not a multiple of the per-rank "
                f"global batch {local_gbs}"
            )
        return [data.slice(s, s + local_gbs) for s in range(0, data.size, local_gbs)]

    def _clear_cache_step(self, i: int) -> None:
        n = (self.cfg.get("dtensor_cfg") or {}).get("clear_cache_every_n_steps")
        if n and i % n == 0:
            _free_device_cache()

    # ------------------------------------------------------------------ training
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """One optimizer step per global batch in ``data`` (this rank's shard of it).

        Returns ``global_loss`` (one value per global batch, summed over ranks),
        ``grad_norm``, ``lr`` and ``all_mb_metrics`` (lists, one entry per micro-batch).
        Without ``token_mask`` every token counts as valid (token-level losses need it).
        """
        gbs = int(gbs or self.cfg["train_global_batch_size"])
        mbs = int(mbs or self.cfg["train_micro_batch_size"])
        if gbs % self.dp_size:
            raise ValueError(
                f"gbs (train_global_batch_size) {gbs} is not divisible by the data-parallel "
                f"size {self.dp_size}"
            )
        local_gbs = gbs // self.dp_size
        if self.mode == "plain" and local_gbs % mbs:
            raise ValueError(
                f"mbs (train_micro_batch_size) {mbs} does not divide the per-rank global batch "
                f"{local_gbs} (gbs {gbs} / dp {self.dp_size})"
            )
        self._check_batch(data, "train")
        if getattr(loss_fn, "loss_type", None) == LossType.TOKEN_LEVEL and "token_mask" not in data:
            raise ConfigError(
                f"train: {type(loss_fn).__name__} is a token-level loss and needs "
                "data['token_mask'] (only sequence-level losses may omit it)"
            )
        if not eval_mode and self.optimizer is None:
            raise RuntimeError("train: the worker was built with init_optimizer=False")
        batches = self._global_batches(data, local_gbs)
        n_gb = len(batches)
        if self._max_over_ranks(n_gb) != n_gb:
            raise ValueError(
                f"train: rank {self.rank} holds {n_gb} global batches but another policy rank "
                "holds more; every data-parallel rank needs the same number"
            )
        defer_sync = (self.cfg.get("dtensor_cfg") or {}).get("defer_fsdp_grad_sync", True)
        self.model.train(not eval_mode)
        losses, grad_norms, mb_metrics = [], [], {}
        for gb in batches:
            sample_mask = gb.get("sample_mask", torch.ones(gb.size))
            local_seqs = sample_mask.float().sum()
            if "token_mask" in gb:
                local_toks = (gb["token_mask"][:, 1:].float() * sample_mask.float()[:, None]).sum()
            else:  # NeMo-RL: every token of every valid sequence
                local_toks = local_seqs * gb["input_ids"].shape[1]
            counts = self._all_reduce(
                torch.stack([local_toks.cpu(), local_seqs.cpu()]), group=self._dp_group
            )
            global_toks, global_seqs = counts[0], counts[1]
            if not eval_mode:
                self.optimizer.zero_grad(set_to_none=True)
            micro = [mb for mb in self._microbatches(gb, mbs, "train") if mb.size]
            n_mb = self._max_over_ranks(len(micro))
            gb_loss = torch.zeros((), device=self.device)
            for i in range(n_mb):
                self._clear_cache_step(i)
                if hasattr(self.model, "set_requires_gradient_sync"):
                    self.model.set_requires_gradient_sync(i == n_mb - 1 or not defer_sync)
                with torch.set_grad_enabled(not eval_mode), contextlib.ExitStack() as stack:
                    metrics = None
                    if i >= len(micro):  # this rank has fewer micro-batches: a no-op step
                        loss = self._dummy_logits(stack).sum() * 0.0
                    else:
                        mb = micro[i].to(self.device)
                        if self.mode == "packed":
                            packed_logits, packed = self._packed_logits(mb, stack)
                            T = mb["input_ids"].shape[1]
                            logits = unpack_to_rows(packed_logits, packed, T).float()
                        else:
                            logits = self._forward_logits(mb["input_ids"], stack).float()
                        loss, metrics = loss_fn(logits, mb, global_seqs, global_toks)
                    if not eval_mode:
                        # FSDP averages gradients over dp ranks; the loss is already a
                        # share of the global mean, so undo that average.
                        (loss * self.dp_size).backward()
                if metrics is not None:
                    gb_loss += loss.detach()
                    for k, v in metrics.items():
                        mb_metrics.setdefault(k, []).append(v)
            grad_norm = torch.zeros(())
            if not eval_mode:
                params = list(self.model.parameters())
                grad_norm = clip_grad_norm(params, self.cfg.get("max_grad_norm"))
                self.optimizer.step()
            losses.append(self._all_reduce(gb_loss, group=self._dp_group).cpu())
            grad_norms.append(grad_norm)
        lr = self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else None
        if not eval_mode:
            self.optimizer.zero_grad(set_to_none=True)  # free the gradients until next time
            if self.scheduler is not None:
                self.scheduler.step()
        return {
            "global_loss": torch.stack(losses) if losses else torch.zeros(0),
            "grad_norm": torch.stack(grad_norms) if grad_norms else torch.zeros(0),
            "lr": lr,
            "rank": self.rank,
            "all_mb_metrics": mb_metrics,
        }

    # ------------------------------------------------------------------ log-probs
    def _logprob_microbatches(
        self, data: BatchedDataDict, micro_batch_size: int | None
    ) -> Iterator[tuple[int, BatchedDataDict]]:
        """(first row, micro-batch) pairs covering ``data`` in order."""
        if self.mode == "plain":
            mbs = int(micro_batch_size or self.cfg.get("logprob_batch_size") or data.size or 1)
            for start in range(0, data.size, mbs):
                yield start, data.slice(start, min(start + mbs, data.size))
            return
        if data.micro_batch_indices is None:
            self._microbatches(data, 1, "get_logprobs")  # raises: no plan
        start = 0
        for mb in self._microbatches(data, 1, "get_logprobs"):
            yield start, mb
            start += mb.size

    @torch.no_grad()
    def get_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """Per-token log-probs [B, T] of ``input_ids``; position 0 and padding are 0.

        Only the chosen tokens' log-probs are kept, computed in chunks of positions
        (``logprob_chunk_size``): no full-vocabulary float32 copy of a micro-batch's logits.
        """
        self._check_batch(data, "get_logprobs")
        ids = data["input_ids"]
        B, T = ids.shape
        lengths = data.get("input_lengths")
        if lengths is None:
            lengths = torch.full((B,), T, dtype=torch.long)
        self.model.eval()
        micro = [(s, mb) for s, mb in self._logprob_microbatches(data, micro_batch_size) if mb.size]
        # FSDP forwards are collective: every rank runs as many as the busiest one.
        n_max = self._max_over_ranks(len(micro))
        out = torch.zeros((B, T), dtype=torch.float32)
        for i in range(n_max):
            with contextlib.ExitStack() as stack:
                if i >= len(micro):
                    self._dummy_logits(stack)
                    continue
                start, mb = micro[i]
                chunk = mb["input_ids"]
                if self.mode == "packed":
                    logits, packed = self._packed_logits(mb, stack)
                    lp = chosen_token_logprobs(
                        logits, packed.input_ids[:, 1:], self.logprob_chunk_size
                    )
                    tok = unpack_token_logprobs(lp, packed, chunk.shape[1])
                else:
                    logits = self._forward_logits(chunk, stack)
                    lp = chosen_token_logprobs(logits, chunk[:, 1:], self.logprob_chunk_size)
                    tok = torch.cat([lp.new_zeros((lp.shape[0], 1)), lp], dim=1)
                del logits
            n, width = tok.shape
            out[start : start + n, :width] = tok.cpu()
        pos = torch.arange(T).unsqueeze(0)
        out = out * (pos < lengths.cpu().unsqueeze(1)).float()
        return BatchedDataDict(logprobs=out)

    @contextlib.contextmanager
    def use_reference_model(self) -> Generator[None, None, None]:
        """Swap the reference weights into the model in place; swap back afterwards."""
        if self.reference_model_state_dict is None:
            raise RuntimeError("use_reference_model: built with init_reference_model=False")
        self._reshard()
        state = self.model.state_dict()
        current = get_cpu_state_dict(state.items(), pin_memory=True)
        with torch.no_grad():
            for k, v in state.items():
                _local(v).copy_(self.reference_model_state_dict[k])
        try:
            yield
        finally:
            self._reshard()
            with torch.no_grad():
                for k, v in state.items():
                    _local(v).copy_(current[k])

    def update_reference_model(self) -> None:
        """Take the current weights as the new reference (e.g. after an SFT warm-up)."""
        self._reshard()
        self.reference_model_state_dict = get_cpu_state_dict(
            self.model.state_dict().items(), pin_memory=True
        )

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """``get_logprobs`` under the reference weights, as ``reference_logprobs``."""
        with self.use_reference_model():
            lp = self.get_logprobs(data, micro_batch_size)
        return BatchedDataDict(reference_logprobs=lp["logprobs"])

    @torch.no_grad()
    def _add_noise_to_weights(self, std: float = 0.01, seed: int = 0) -> None:
        """Add Gaussian noise to every parameter (tests use it to tell weights apart).

        The noise of each full parameter is drawn from the same seed on every rank and each
        rank adds its own shard of it, so replicas (e.g. over tp) stay equal.
        """
        from torch.distributed.tensor import distribute_tensor

        gen = torch.Generator().manual_seed(seed)
        self._reshard()
        for p in self.model.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * std
            if isinstance(p, DTensor):
                noise = distribute_tensor(noise, p.device_mesh, p.placements, src_data_rank=None)
            local = _local(p)
            local.add_(_local(noise).to(local.device, local.dtype))

    def return_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's model state dict as NeMo-RL returns it: sharded parameters stay
        DTensors (``.shape`` is the full shape, ``.to_local()`` this rank's shard).

        Not a collective: it may be called on one worker. ``return_full_state_dict`` (every
        rank calls it) gathers full tensors.
        """
        self._reshard()
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def return_full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (gathered) model state dict on CPU; a collective: every rank calls it."""
        self._reshard()
        return {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in self.model.state_dict().items()
        }

    # ------------------------------------------------------------------ refit
    # Built on the weight-sync layer (phalanx.weights): its stream layout, shared-memory
    # segments, CUDA IPC handles and bucketed collective broadcast.
    def _full_state_for_refit(self) -> dict[str, torch.Tensor]:
        """Full (gathered) weights; a collective over the policy's ranks."""
        self._reshard()
        return {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
            for k, v in self.model.state_dict().items()
        }

    def _refit_bucket_bytes(self) -> int:
        from phalanx.weights.layout import check_sizes

        if "refit_buffer_size_gb" in self.cfg:  # NeMo-RL's key
            return check_sizes(float(self.cfg["refit_buffer_size_gb"]) * 1024)
        return check_sizes(self.cfg.get("refit_buffer_size_mb", 64))

    def prepare_weights_for_ipc(self) -> tuple[list[tuple[str, int]], float]:
        """Gather the full weights and hold them for ``get_weights_ipc_handles``.

        Every rank must call it. Returns ``[(name, nbytes)]`` (at the refit dtype, the
        policy's precision) and the bytes of device memory free for refit buffers.
        """
        self._held_refit = self._full_state_for_refit()
        item = torch.empty((), dtype=self.dtype).element_size()
        info = [(k, v.numel() * item) for k, v in self._held_refit.items()]
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            import psutil

            free = psutil.virtual_memory().available
        return info, float(free)

    def get_weights_ipc_handles(self, keys: Iterable[str]) -> dict[str, Any]:
        """Same-node handles to the held weights ``keys``: ``{device_id: handle}``.

        On GPU the weights are packed into one CUDA buffer and its CUDA IPC handle is
        returned; on CPU they are packed into a shared-memory segment (kept and reused
        across refits) and its name is returned. The handle carries the stream layout.
        """
        from phalanx.weights import gather

        if self._held_refit is None:
            raise RuntimeError("get_weights_ipc_handles: call prepare_weights_for_ipc first")
        keys = list(keys)
        missing = [k for k in keys if k not in self._held_refit]
        if missing:
            raise KeyError(f"get_weights_ipc_handles: unknown keys {missing[:5]}")
        layout, sources = gather({k: self._held_refit[k] for k in keys}, dtype=self.dtype)
        if self.device.type == "cuda":
            from phalanx.weights import ipc_handle, pack_to_cuda

            flat = pack_to_cuda(layout, sources, self.device)
            self._ipc_buffers = [flat]  # alive until the receivers copied (next refit)
            handle = {"kind": "cuda_ipc", "layout": layout, **ipc_handle(flat)}
        else:
            from phalanx.weights import pack_to_shm

            self._shm_segment = pack_to_shm(layout, sources, self._shm_segment)
            handle = {"kind": "shm", "layout": layout, "name": self._shm_segment.name}
        return {self.report_device_id(): handle}

    def pack_weights_for_ipc(self) -> dict[str, Any] | None:
        """``prepare_weights_for_ipc`` + ``get_weights_ipc_handles`` in one call, cheaper.

        Every rank must call it; rank 0 returns the handles, once the weights are in place.
        On CPU, when all policy ranks
        share a node, each rank copies its own rows of every parameter into one
        shared-memory segment (kept across refits; no gather, no collective after the
        first call), so the cost is one parallel copy of the weights. Otherwise the full
        weights are gathered and packed by rank 0, as the two seed methods do.
        """
        if self.device.type == "cuda" or not self._policy_on_one_node():
            info, _ = self.prepare_weights_for_ipc()
            return self.get_weights_ipc_handles([k for k, _ in info]) if self.rank == 0 else None
        from phalanx.llm.shard_pack import write_shards

        state, layout = self._stream_state()
        segment = self._shared_segment(layout.total_bytes)
        write_shards(segment.tensor, layout, state, self.rank == 0)
        dist.barrier()  # rank 0 returns once every rank has written: receivers may read
        if self.rank != 0:
            return None
        return {self.report_device_id(): {"kind": "shm", "layout": layout, "name": segment.name}}

    def _stream_state(self) -> tuple[dict[str, torch.Tensor], Any]:
        """The (resharded) state dict and its full-tensor stream layout, cached by shapes."""
        from phalanx.llm.shard_pack import stream_layout

        self._reshard()
        state = self.model.state_dict()
        key = tuple((k, tuple(v.shape), v.dtype) for k, v in state.items())
        if self._refit_layout is None or self._refit_layout[0] != key:
            self._refit_layout = (key, stream_layout(state, self.dtype))
        return state, self._refit_layout[1]

    def shm_refit_layout(self) -> Any:
        """The stream layout for ``write_weights_to_shm``, or None where the ranks cannot
        write one same-node buffer (weights on GPU, or ranks on several nodes).

        Every rank must call it (the first call asks the ranks for their hosts).
        """
        if self.device.type == "cuda" or not self._policy_on_one_node():
            return None
        return self._stream_state()[1]

    def write_weights_to_shm(self, path: str, live: Iterable[str] = ()) -> Any:
        """Every rank copies its own rows of every parameter into the shared buffer ``path``
        (a same-node segment another process made, e.g. a ``WeightSender``'s
        ``reserve_shared_buffer``): no gather, no collective beyond a final barrier.

        Mappings are kept for the next call; those of buffers neither ``path`` nor in
        ``live`` (retired by their owner) are dropped. Every rank must call it; rank 0
        returns the stream layout once every rank has written, the others None.
        """
        from phalanx.llm.shard_pack import write_shards
        from phalanx.weights import ShmSegment

        state, layout = self._stream_state()
        keep = {os.path.basename(p) for p in (path, *live)}
        maps = {k: v for k, v in self._refit_maps.items() if k in keep}
        name = os.path.basename(path)
        seg = maps.get(name)
        if seg is None:
            seg = maps[name] = ShmSegment(0, name=path, create=False)
        self._refit_maps = maps
        if seg.size < layout.total_bytes:
            raise ValueError(
                f"write_weights_to_shm: buffer {path!r} holds {seg.size} bytes, the weights "
                f"need {layout.total_bytes}"
            )
        write_shards(seg.tensor, layout, state, self.rank == 0)
        dist.barrier()  # rank 0 returns once every rank has written: receivers may read
        return layout if self.rank == 0 else None

    def _policy_on_one_node(self) -> bool:
        if self._one_node is None:
            hosts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(hosts, socket.gethostname())
            self._one_node = len(set(hosts)) == 1
        return self._one_node

    def _shared_segment(self, nbytes: int) -> Any:
        """The refit segment every policy rank maps (rank 0 creates it, once per size)."""
        from phalanx.weights import ShmSegment

        seg = self._refit_segment
        if seg is not None and seg.size >= nbytes:
            return seg  # every rank decides alike: all saw the same sizes
        name: list[Any] = [None]
        if self.rank == 0:
            if seg is not None:
                seg.unlink()
            seg = ShmSegment(nbytes)
            name = [seg.name]
        dist.broadcast_object_list(name, src=0)
        if self.rank != 0:
            seg = ShmSegment(nbytes, name=name[0], create=False)
        self._refit_segment = seg
        return seg

    def prepare_info_for_collective(self) -> dict[str, Any]:
        """The stream layout and bucket size a collective refit uses (every rank calls)."""
        from phalanx.weights import gather

        layout, _ = gather(self._full_state_for_refit(), dtype=self.dtype)
        return {"layout": layout, "bucket_bytes": self._refit_bucket_bytes()}

    def init_collective(self, ip: str, port: int, world_size: int) -> None:
        """Create the refit process group as its rank 0 (on policy rank 0; receivers join
        as ranks 1..world_size-1). Gloo on CPU, NCCL on GPU."""
        if self.rank != 0:
            return
        from phalanx.comm.process_group import host_store
        from phalanx.weights import new_process_group

        store = host_store(ip, _PG_TIMEOUT.total_seconds(), port)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._refit_store = store
        self.model_update_group = new_process_group(
            store, "refit", 0, world_size, backend, _PG_TIMEOUT.total_seconds()
        )

    def broadcast_weights_for_collective(self) -> None:
        """Gather the full weights (all policy ranks) and broadcast them from rank 0."""
        from phalanx.weights import broadcast_stream, gather

        full = self._full_state_for_refit()
        if self.rank != 0:
            return
        if self.model_update_group is None:
            raise RuntimeError("broadcast_weights_for_collective: call init_collective first")
        layout, sources = gather(full, dtype=self.dtype)
        broadcast_stream(
            self.model_update_group, layout, sources, self._refit_bucket_bytes(), self.device
        )

    # ------------------------------------------------------------------ memory movement
    def _move_optimizer(self, device: str | torch.device) -> None:
        if self.optimizer is None:
            return
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.device != torch.device(device):
                    state[k] = v.to(device)

    def move_to_device(self, model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
        """Move parameters and buffers of ``model`` to ``device``."""
        model = self.move_buffer_to_device(model, device)
        return model.to(device)

    def move_buffer_to_device(
        self, model: torch.nn.Module, device: str | torch.device
    ) -> torch.nn.Module:
        """Move only the buffers (FSDP2 shards parameters, not buffers)."""
        for module in model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.device != torch.device(device):
                    module._buffers[name] = buf.to(device)
        return model

    def move_to_cuda(self, model: torch.nn.Module) -> torch.nn.Module:
        if not torch.cuda.is_available():
            raise RuntimeError("move_to_cuda: CUDA is not available on this worker (CPU only)")
        model = self.move_to_device(model, "cuda")
        torch.cuda.synchronize()
        return model

    def move_to_cpu(self, model: torch.nn.Module) -> torch.nn.Module:
        model = self.move_to_device(model, "cpu")
        _free_device_cache()
        return model

    def _model_device(self) -> torch.device:
        dcfg = self.cfg.get("dtensor_cfg") or {}
        return torch.device("cpu") if dcfg.get("cpu_offload") else self.device

    def prepare_for_lp_inference(self) -> None:
        """Model on its device in eval mode; optimizer state off the device."""
        self.model = self.move_to_device(self.model, self._model_device())
        self.model.eval()
        if self.cfg.get("offload_optimizer_for_logprob", True):
            self.offload_before_refit()

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        """Model and optimizer state on the device, model in train mode."""
        self.model = self.move_to_device(self.model, self._model_device())
        self.model.train()
        self._move_optimizer(self._model_device())
        _free_device_cache()

    def offload_before_refit(self) -> None:
        """Move optimizer state to CPU to make room for refit buffers."""
        self._move_optimizer("cpu")
        _free_device_cache()

    def offload_after_refit(self) -> None:
        """Free the held refit buffers and move the model to CPU (until training resumes)."""
        self.model = self.move_to_cpu(self.model)
        self.model.eval()
        self._held_refit = None
        self._ipc_buffers = []
        self._move_optimizer("cpu")
        _free_device_cache()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
    ) -> None:
        """Sharded save with torch.distributed.checkpoint (every rank calls it)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        if not weights_path:
            raise ValueError("save_checkpoint: weights_path is required")
        dcp.save({"model": get_model_state_dict(self.model)}, checkpoint_id=weights_path)
        if optimizer_path:
            if self.optimizer is None:
                raise RuntimeError("save_checkpoint: no optimizer (init_optimizer=False)")
            state = {
                "optim": get_optimizer_state_dict(self.model, self.optimizer),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
            }
            dcp.save(state, checkpoint_id=optimizer_path)
        if tokenizer_path and self.rank == 0:
            self.tokenizer.save_pretrained(tokenizer_path)
        dist.barrier()

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Load a ``save_checkpoint`` directory into this (already sharded) model."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if not weights_path or not os.path.isdir(weights_path):
            raise ValueError(f"load_checkpoint: weights_path {weights_path!r} is not a directory")
        state = {"model": get_model_state_dict(self.model)}
        dcp.load(state, checkpoint_id=weights_path)
        set_model_state_dict(self.model, state["model"])
        if optimizer_path:
            if not os.path.isdir(optimizer_path):
                raise ValueError(
                    f"load_checkpoint: optimizer_path {optimizer_path!r} is not a directory"
                )
            if self.optimizer is None:
                raise RuntimeError("load_checkpoint: no optimizer (init_optimizer=False)")
            ostate = {
                "optim": get_optimizer_state_dict(self.model, self.optimizer),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
            }
            dcp.load(ostate, checkpoint_id=optimizer_path)
            set_optimizer_state_dict(self.model, self.optimizer, ostate["optim"])
            if self.scheduler is not None and ostate["scheduler"]:
                self.scheduler.load_state_dict(ostate["scheduler"])

    # ------------------------------------------------------------------ the rest of the seed
    @staticmethod
    def create_context_parallel_ctx(
        cp_mesh: Any,
        cp_buffers: list[torch.Tensor],
        cp_seq_dims: list[int],
        cp_no_restore_buffers: set[torch.Tensor],
        cp_rotate_method: str | None = None,
    ) -> Any:
        """torch's context-parallel context that shards ``cp_buffers`` along their seq dims."""
        from torch.distributed.tensor.experimental import context_parallel

        if cp_rotate_method is not None:
            from torch.distributed.tensor.experimental._attention import set_rotate_method

            set_rotate_method(cp_rotate_method)
        return context_parallel(
            cp_mesh,
            buffers=cp_buffers,
            buffer_seq_dims=cp_seq_dims,
            no_restore_buffers=cp_no_restore_buffers,
        )

    @staticmethod
    @contextlib.contextmanager
    def train_context(cp_context: Any | None = None) -> Generator[None, None, None]:
        """Enter ``cp_context`` (with the SDPA kernels context parallelism supports)."""
        with contextlib.ExitStack() as stack:
            if cp_context is not None:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                stack.enter_context(
                    sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
                )
                stack.enter_context(cp_context)
            yield

    def is_alive(self) -> bool:
        return True

    def reset_peak_memory_stats(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._peak_rss = self._rss()

    @staticmethod
    def _rss() -> int:
        import psutil

        return psutil.Process().memory_info().rss

    def get_gpu_info(self) -> dict[str, Any]:
        """Device and memory facts of this rank, with NeMo-RL's keys.

        On CPU the memory figures are the process's resident memory (``memory_*_mb``) and
        ``cuda`` is False; ``parameter_sample`` names one parameter with its device, shape
        (this rank's shard) and dtype.
        """
        rss = self._rss()
        self._peak_rss = max(self._peak_rss, rss)
        mb = 1024 * 1024
        sample: dict[str, Any] = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                local = _local(p)
                sample[name] = {
                    "device": str(local.device),
                    "shape": list(local.shape),
                    "dtype": str(local.dtype),
                }
                break
        cuda = torch.cuda.is_available()
        info: dict[str, Any] = {
            "rank": dist.get_rank() if dist.is_initialized() else self.rank,
            "world_size": dist.get_world_size() if dist.is_initialized() else self.world_size,
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "local_device_id": torch.cuda.current_device() if cuda else None,
            "global_device_id": os.environ.get("CUDA_VISIBLE_DEVICES") if cuda else None,
            "device_count": torch.cuda.device_count() if cuda else 0,
            "device_name": torch.cuda.get_device_name(self.device) if cuda else "cpu",
            "memory_allocated_mb": (torch.cuda.memory_allocated(self.device) if cuda else rss) / mb,
            "memory_reserved_mb": (torch.cuda.memory_reserved(self.device) if cuda else rss) / mb,
            "peak_memory_allocated_mb": (
                torch.cuda.max_memory_allocated(self.device) if cuda else self._peak_rss
            )
            / mb,
            "peak_memory_reserved_mb": (
                torch.cuda.max_memory_reserved(self.device) if cuda else self._peak_rss
            )
            / mb,
            "parameter_sample": sample,
            "env_vars": {
                k: v
                for k, v in os.environ.items()
                if k.startswith("CUDA") or k in ("LOCAL_RANK", "RANK", "WORLD_SIZE")
            },
            # phalanx's own
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "device": str(self.device),
            "cuda": cuda,
            "cpu_rss_bytes": rss,
            "cpu_peak_rss_bytes": self._peak_rss,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
        if cuda:
            props = torch.cuda.get_device_properties(self.device)
            info.update(total_memory=props.total_memory, device_uuid=self.report_device_id())
        return info

    def report_device_id(self) -> str:
        """The GPU's UUID, or ``cpu:<hostname>`` on CPU (same-node processes share it)."""
        if torch.cuda.is_available():
            return str(torch.cuda.get_device_properties(self.device).uuid)
        return f"cpu:{socket.gethostname()}"

    def start_gpu_profiling(self) -> None:
        """Start the torch profiler (CPU activity, plus CUDA when present)."""
        from torch.profiler import ProfilerActivity, profile

        if self._profiler is not None:
            raise RuntimeError("start_gpu_profiling: profiling is already running")
        acts = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=acts, record_shapes=False)
        self._profiler.start()

    def stop_gpu_profiling(self) -> str:
        """Stop the profiler and write a Chrome trace; returns its path."""
        if self._profiler is None:
            raise RuntimeError("stop_gpu_profiling: call start_gpu_profiling first")
        prof, self._profiler = self._profiler, None
        prof.stop()
        out_dir = self.cfg.get("profile_dir") or os.path.join(
            os.environ.get("TMPDIR", "/tmp"), "phalanx_profiles"
        )
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{self.group_name}_rank{self.rank}_{int(time.time())}.json")
        prof.export_chrome_trace(path)
        return path

    def shutdown(self) -> bool:
        """Release the profiler, refit buffers and process groups."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        self._held_refit = None
        for seg in (self._shm_segment, self._refit_segment):
            if seg is not None and self.rank == 0:
                seg.unlink()
        self._shm_segment = self._refit_segment = None
        self._refit_maps = {}
        if dist.is_initialized():
            dist.destroy_process_group()
        return True


def _check_config(config: Any) -> dict[str, Any]:
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    check_policy_config(config)
    path = config.get("model_name")
    if not path:
        raise ConfigError("config['model_name'] is required (a save_pretrained directory)")
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        raise ConfigError(f"config['model_name']: model path {path!r} does not exist")
    precision = config.get("precision", "float32")
    if precision not in _PRECISIONS:
        raise ConfigError(f"config['precision'] {precision!r} is not one of {sorted(_PRECISIONS)}")
    for key in ("train_global_batch_size", "train_micro_batch_size", "logprob_batch_size"):
        v = config.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"config[{key!r}] must be a positive int, got {v!r}")
    check_parallel_config(config)
    return dict(config)


def check_parallel_config(config: dict[str, Any]) -> tuple[int, int]:
    """Check ``dtensor_cfg``'s parallel sizes against the model; returns (tp, cp).

    Runs on the driver (``Policy``) before any worker starts, and again in each worker.
    """
    dcfg = config.get("dtensor_cfg") or {}
    sizes = []
    for key in ("tensor_parallel_size", "context_parallel_size"):
        v = dcfg.get(key, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"dtensor_cfg.{key} must be a positive int, got {v!r}")
        sizes.append(v)
    tp, cp = sizes
    if dcfg.get("sequence_parallel") and tp == 1:
        # NeMo-RL warns and goes on; sequence parallelism only exists over tp ranks.
        warnings.warn(
            "dtensor_cfg.sequence_parallel=True has no effect with tensor_parallel_size=1 "
            "(it shards the norms over the tensor-parallel ranks)",
            stacklevel=2,
        )
    if cp > 1 and not torch.cuda.is_available():
        raise NotImplementedError(
            f"dtensor_cfg.context_parallel_size={cp}: context parallelism needs CUDA (torch's "
            "context_parallel runs ring attention on the flash/efficient SDPA kernels, which "
            "exist only on GPU); use context_parallel_size=1 on CPU"
        )
    if tp > 1:
        from transformers import AutoConfig

        check_tp_size(AutoConfig.from_pretrained(config["model_name"]), tp)
    return tp, cp
