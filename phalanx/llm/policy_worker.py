"""The DTensor policy worker: a Hugging Face causal LM sharded with FSDP2, one per rank.

Each rank of a group joins one ``torch.distributed`` process group (gloo on CPU, NCCL on
GPU) from the rank environment phalanx sets, loads the model with ``from_pretrained``,
builds a ("dp", "cp", "tp") device mesh, applies tensor (and sequence) parallelism over
"tp" when ``tensor_parallel_size > 1`` and then ``fully_shard`` to every decoder layer and
the root over "dp" (and "cp") (``parallelize.py``), and trains with token-level losses
normalised by the number of valid tokens of the whole global batch, so the result does
not depend on the sharding. Context parallelism needs CUDA (``check_parallel_config``
refuses it on CPU); on GPU the forward and backward run inside ``train_context``.

The config is a dict of NeMo-RL's ``PolicyConfig`` keys (``policy_config.py`` lists and
checks them). Besides the model, optimizer and reference weights, the worker holds three
objects that its NeMo-RL methods call: a ``RefitSource`` (``refit_source.py``: the
weights for generation workers and the buffers kept between refits), an ``Offload``
(``offload.py``: where the model and optimizer state live, phase by phase) and a
``DeviceInfo`` (``device_info.py``: device facts, peak memory, the profiler). Global and
micro-batches are cut by ``microbatches.py``. The model is built by ``build_model`` and
the optimizer by ``build_optimizer`` over the trainable parameters.

With ``dynamic_batching`` or ``sequence_packing`` the data must come from
``BatchedDataDict.shard_by_batch_size`` with the matching arguments (``Policy`` does that):
micro-batches follow the shard's plan. Packed micro-batches run as one row with position ids
restarting per sequence and a block-diagonal causal mask.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from phalanx._base.heap import reuse_freed_memory
from phalanx.data import BatchedDataDict
from phalanx.llm.checkpoint import load_policy, save_policy
from phalanx.llm.device_info import DeviceInfo
from phalanx.llm.fsdp_state import (
    full_state_dict,
    gathered_for_step,
    gathers_once,
    get_cpu_state_dict,
    local,
    reshard,
    unshard_fsdp2_model,
)
from phalanx.llm.kept_state import KeptState
from phalanx.llm.logprobs import chosen_token_logprobs, logprob_settings
from phalanx.llm.lora import disabled_adapters
from phalanx.llm.loss import (
    LossFunction,
    LossType,
    drop_leading_positions,
    first_loss_position,
)
from phalanx.llm.microbatches import global_batches, logprob_micro_batches, micro_batches
from phalanx.llm.model_setup import build_model
from phalanx.llm.offload import (
    Offload,
    free_device_cache,
    move_buffer_to_device,
    move_optimizer_to_device,
    move_to_cpu,
    move_to_cuda,
    move_to_device,
)
from phalanx.llm.optimizer import build_optimizer
from phalanx.llm.packed_rows import pack_rows, unpack_to_rows, unpack_token_logprobs
from phalanx.llm.parallelize import (
    check_parallel_config,
    clip_grad_norm,
    create_context_parallel_ctx,
    train_context,
    use_cp_attention,
)
from phalanx.llm.policy_config import (
    PRECISIONS,
    ConfigError,
    check_policy_config,
    dynamic_batching_enabled,
    logits_temperature,
    sequence_packing_enabled,
    train_batch_sizes,
)
from phalanx.llm.refit_source import PG_TIMEOUT_S, RefitSource
from phalanx.worker.worker import Worker

__all__ = [
    "DTensorPolicyWorker",
    "check_parallel_config",
    "get_cpu_state_dict",
    "unshard_fsdp2_model",
]

_PG_TIMEOUT = timedelta(seconds=PG_TIMEOUT_S)


class DTensorPolicyWorker(Worker):
    """One rank of an FSDP2-sharded policy (NeMo-RL's ``DTensorPolicyWorker``).

    Args:
        config: NeMo-RL's policy config (``model_name``, batch sizes, ``dtensor_cfg``, ...).
        tokenizer: the model's tokenizer.
        weights_path: a checkpoint to load the weights from.
        optimizer_path: a checkpoint to load the optimizer's state from.
        init_optimizer: build the optimizer (False for inference only).
        init_reference_model: keep the initial weights as the reference policy.
        **kwargs: NeMo-RL's other keywords, accepted and unused.

    Raises:
        ConfigError: the config asks for what this worker does not support.
    """

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
        else:  # every micro-batch reallocates its logits and activations
            reuse_freed_memory()
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
        self.dtype = PRECISIONS[self.cfg.get("precision", "float32")]
        self.temperature = logits_temperature(self.cfg)
        self.logprob_chunk_size = self.cfg.get("logprob_chunk_size")
        self.logprob_kernel = self.cfg.get("logprob_kernel") or "auto"
        # dtensor_cfg._v2: NeMo-RL's Automodel worker; phalanx runs this worker with its
        # observable differences (per-micro-batch metrics).
        self.automodel_metrics = bool(dcfg.get("_v2", False))
        self.mode = (
            "dynamic"
            if dynamic_batching_enabled(self.cfg)
            else "packed"
            if sequence_packing_enabled(self.cfg)
            else "plain"
        )
        self.model, self.peft_model = build_model(
            self.cfg, self.device, self.dtype, self.tp_mesh, self._fsdp_mesh, self.sequence_parallel
        )
        # Gather the compute-dtype weights once per optimizer step, not twice per micro-batch.
        self.gather_once = gathers_once(
            dcfg.get("gather_weights_once_per_step"),
            self._fsdp_mesh.size(),
            bool(dcfg.get("cpu_offload")),
        )
        if self.cp_size > 1:
            use_cp_attention(self.model)
        self.max_seq_len = int(
            self.cfg.get("max_total_sequence_length")
            or getattr(self.model.config, "max_position_embeddings", 1 << 30)
        )
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        if init_optimizer:
            self._init_optimizer()
        self.reference_model_state_dict: dict[str, torch.Tensor] | None = None
        # With LoRA the reference policy is the base model: the adapters disabled, no copy.
        if init_reference_model and self.peft_model is None:
            self.reference_model_state_dict = get_cpu_state_dict(
                self.model.state_dict().items(), pin_memory=True
            )
        if weights_path:
            self.load_checkpoint(weights_path, optimizer_path if init_optimizer else None)
        self._device_info = DeviceInfo(
            self.model,
            self.device,
            self.rank,
            self.world_size,
            profile_dir=self.cfg.get("profile_dir"),
            trace_name=f"{self.group_name}_rank{self.rank}",
        )
        self._refit = RefitSource(
            self.model,
            self.peft_model,
            self.cfg,
            self.dtype,
            self.device,
            self.rank,
            device_id=self._device_info.report_device_id,
        )
        self._offload = Offload(
            self.model,
            self.optimizer,
            model_device=torch.device("cpu") if dcfg.get("cpu_offload") else self.device,
            offload_optimizer_for_logprob=self.cfg.get("offload_optimizer_for_logprob", True),
            release_refit_buffers=self._refit.release_refit_buffers,
        )
        self._microbatch_hooks: list[Callable[[], None]] = []
        self._kept = KeptState(self.rank)

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

    def _init_optimizer(self) -> None:
        """The optimizer over the trainable parameters, and its scheduler."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(params, self.cfg)

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

    def _loss_start(self, mb: BatchedDataDict, loss_fn: LossFunction) -> int:
        """How many leading positions need no logits: those before the first trained token
        of every row, when the loss reads masked positions only (the prompt's logits are
        then never computed; the sequence is whole on this rank)."""
        whole = self.cp_size == 1 and not self.sequence_parallel
        if not (whole and getattr(loss_fn, "masked_positions_only", False)):
            return 0
        return first_loss_position(mb)

    def _forward_logits(
        self,
        input_ids: torch.Tensor,
        stack: contextlib.ExitStack,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """Logits [B, T, V] of right-padded ``input_ids`` (divided by the generation
        temperature when the config has one, as NeMo-RL does).

        Contexts the backward pass must also run under (context parallelism) are entered
        into ``stack``, which the caller closes after its backward. ``position_ids`` and a
        4-D boolean ``attention_mask`` are given for packed rows. With ``start`` > 0 only
        positions ``start:`` get logits ([B, T - start, V]; the model still reads all).
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
            if start:
                kwargs["logits_to_keep"] = T - start
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

    def add_microbatch_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` before every training micro-batch (e.g. to follow a thread
        share that changes while a ``train`` call runs).

        Args:
            hook: called with no arguments.
        """
        self._microbatch_hooks.append(hook)

    def _clear_cache_step(self, i: int) -> None:
        n = (self.cfg.get("dtensor_cfg") or {}).get("clear_cache_every_n_steps")
        if n and i % n == 0:
            free_device_cache()

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

        Args:
            data: this rank's shard, with ``input_ids`` and ``input_lengths``.
            loss_fn: the loss function.
            eval_mode: compute the loss without stepping the optimizer.
            gbs: the global batch size (the config's if None).
            mbs: the micro-batch size (the config's if None).

        Returns:
            The metrics, as above.

        Raises:
            ValueError: the batch sizes do not divide, or ranks hold different numbers of
                global batches.
            ConfigError: a token-level loss gets no ``token_mask``.
            RuntimeError: training with no optimizer (``init_optimizer=False``).
        """
        plain = self.mode == "plain"
        gbs, mbs, local_gbs = train_batch_sizes(self.cfg, gbs, mbs, self.dp_size, plain)
        self._check_batch(data, "train")
        if getattr(loss_fn, "loss_type", None) == LossType.TOKEN_LEVEL and "token_mask" not in data:
            raise ConfigError(
                f"train: {type(loss_fn).__name__} is a token-level loss and needs "
                "data['token_mask'] (only sequence-level losses may omit it)"
            )
        if not eval_mode and self.optimizer is None:
            raise RuntimeError("train: the worker was built with init_optimizer=False")
        batches = global_batches(data, local_gbs, self.mode)
        n_gb = len(batches)
        if self._max_over_ranks(n_gb) != n_gb:
            raise ValueError(
                f"train: rank {self.rank} holds {n_gb} global batches but another policy rank "
                "holds more; every data-parallel rank needs the same number"
            )
        self.model.train(not eval_mode)
        losses, grad_norms, mb_metrics = [], [], {}
        with logprob_settings(self.logprob_chunk_size, self.logprob_kernel):
            for gb in batches:
                loss, grad_norm = self._train_global_batch(gb, loss_fn, mbs, eval_mode, mb_metrics)
                losses.append(loss)
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
            "gpu_name": torch.cuda.get_device_name(self.device)
            if self.device.type == "cuda"
            else "cpu",
            "model_dtype": self.dtype,
            "all_mb_metrics": mb_metrics,
        }

    def _train_global_batch(
        self,
        gb: BatchedDataDict,
        loss_fn: LossFunction,
        mbs: int,
        eval_mode: bool,
        mb_metrics: dict[str, list[Any]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One global batch of ``train``: forward and backward per micro-batch, then one
        optimizer step (none in ``eval_mode``). Appends each micro-batch's metrics to
        ``mb_metrics``; returns the batch's loss (summed over dp ranks) and gradient norm."""
        defer_sync = (self.cfg.get("dtensor_cfg") or {}).get("defer_fsdp_grad_sync", True)
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
        micro = [mb for mb in micro_batches(gb, mbs, self.mode, "train") if mb.size]
        n_mb = self._max_over_ranks(len(micro))
        gb_loss = torch.zeros((), device=self.device)
        with gathered_for_step(self.model, self.gather_once and not eval_mode) as before_mb:
            for i in range(n_mb):
                before_mb(i == n_mb - 1)
                self._clear_cache_step(i)
                for hook in self._microbatch_hooks:
                    hook()
                if hasattr(self.model, "set_requires_gradient_sync"):
                    self.model.set_requires_gradient_sync(i == n_mb - 1 or not defer_sync)
                mb = micro[i] if i < len(micro) else None
                loss, metrics = self._train_micro_batch(
                    mb, loss_fn, eval_mode, global_seqs, global_toks
                )
                if metrics is None:
                    continue
                gb_loss += loss.detach()
                if self.automodel_metrics:  # NeMo-RL's v2 worker adds these
                    metrics = {
                        **metrics,
                        "lr": self.optimizer.param_groups[0]["lr"] if self.optimizer else None,
                        "global_valid_seqs": float(global_seqs),
                        "global_valid_toks": float(global_toks),
                    }
                for k, v in metrics.items():
                    mb_metrics.setdefault(k, []).append(v)
        grad_norm = torch.zeros(())
        if not eval_mode:
            params = list(self.model.parameters())
            grad_norm = clip_grad_norm(params, self.cfg.get("max_grad_norm"))
            self.optimizer.step()
        return self._all_reduce(gb_loss, group=self._dp_group).cpu(), grad_norm

    def _train_micro_batch(
        self,
        mb: BatchedDataDict | None,
        loss_fn: LossFunction,
        eval_mode: bool,
        global_seqs: torch.Tensor,
        global_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Any] | None]:
        """Forward and backward (none in ``eval_mode``) of one micro-batch of ``train``: its
        loss and metrics. ``mb`` None: this rank has fewer micro-batches than another, a
        no-op step (metrics None)."""
        with torch.set_grad_enabled(not eval_mode), contextlib.ExitStack() as stack:
            metrics = None
            if mb is None:
                loss = self._dummy_logits(stack).sum() * 0.0
            else:
                mb = mb.to(self.device)
                if self.mode == "packed":
                    packed_logits, packed = self._packed_logits(mb, stack)
                    logits = unpack_to_rows(packed_logits, packed, mb["input_ids"].shape[1])
                else:
                    start = self._loss_start(mb, loss_fn)
                    logits = self._forward_logits(mb["input_ids"], stack, start=start)
                    mb = drop_leading_positions(mb, start)
                loss, metrics = loss_fn(logits, mb, global_seqs, global_toks)
            if not eval_mode:
                # FSDP averages gradients over dp ranks; the loss is already a share of
                # the global mean, so undo that average.
                (loss * self.dp_size).backward()
        return loss, metrics

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def get_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """Per-token log-probs [B, T] of ``input_ids``; position 0 and padding are 0.

        Only the chosen tokens' log-probs are kept, computed in chunks of positions
        (``logprob_chunk_size``): no full-vocabulary float32 copy of a micro-batch's logits.

        Args:
            data: the batch, with ``input_ids`` and ``input_lengths``.
            micro_batch_size: rows per forward pass (the config's if None).

        Returns:
            A ``BatchedDataDict`` with ``logprobs``.

        Raises:
            ValueError: ``data`` lacks a key it needs or its sizes disagree.
        """
        self._check_batch(data, "get_logprobs")
        ids = data["input_ids"]
        B, T = ids.shape
        lengths = data.get("input_lengths")
        if lengths is None:
            lengths = torch.full((B,), T, dtype=torch.long)
        self.model.eval()
        mbs = micro_batch_size or self.cfg.get("logprob_batch_size")
        micro = [(s, mb) for s, mb in logprob_micro_batches(data, mbs, self.mode) if mb.size]
        # FSDP forwards are collective: every rank runs as many as the busiest one.
        n_max = self._max_over_ranks(len(micro))
        out = torch.zeros((B, T), dtype=torch.float32)
        with logprob_settings(self.logprob_chunk_size, self.logprob_kernel):
            for i in range(n_max):
                with contextlib.ExitStack() as stack:
                    if i >= len(micro):
                        self._dummy_logits(stack)
                        continue
                    start, mb = micro[i]
                    chunk = mb["input_ids"]
                    if self.mode == "packed":
                        logits, packed = self._packed_logits(mb, stack)
                        lp = chosen_token_logprobs(logits, packed.input_ids[:, 1:])
                        tok = unpack_token_logprobs(lp, packed, chunk.shape[1])
                    else:
                        logits = self._forward_logits(chunk, stack)
                        lp = chosen_token_logprobs(logits, chunk[:, 1:])
                        tok = torch.cat([lp.new_zeros((lp.shape[0], 1)), lp], dim=1)
                    del logits
                n, width = tok.shape
                out[start : start + n, :width] = tok.cpu()
        pos = torch.arange(T).unsqueeze(0)
        out = out * (pos < lengths.cpu().unsqueeze(1)).float()
        return BatchedDataDict(logprobs=out)

    @contextlib.contextmanager
    def use_reference_model(self) -> Generator[None, None, None]:
        """Swap the reference weights into the model in place; swap back afterwards.
        With LoRA: disable the adapters inside the block.

        Yields:
            Nothing; the block runs with the reference weights.

        Raises:
            RuntimeError: the worker was built with ``init_reference_model=False``.
        """
        if self.peft_model is not None:
            with disabled_adapters(self.peft_model):
                yield
            return
        if self.reference_model_state_dict is None:
            raise RuntimeError("use_reference_model: built with init_reference_model=False")
        reshard(self.model)
        state = self.model.state_dict()
        current = get_cpu_state_dict(state.items(), pin_memory=True)
        with torch.no_grad():
            for k, v in state.items():
                local(v).copy_(self.reference_model_state_dict[k])
        try:
            yield
        finally:
            reshard(self.model)
            with torch.no_grad():
                for k, v in state.items():
                    local(v).copy_(current[k])

    def update_reference_model(self) -> None:
        """Take the current weights as the new reference (e.g. after an SFT warm-up)."""
        if self.peft_model is not None:
            raise RuntimeError(
                "update_reference_model: with LoRA the reference policy is the base model "
                "(adapters disabled); it cannot take the adapted weights"
            )
        reshard(self.model)
        self.reference_model_state_dict = get_cpu_state_dict(
            self.model.state_dict().items(), pin_memory=True
        )

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """``get_logprobs`` under the reference weights, as ``reference_logprobs``.

        Args:
            data: as for ``get_logprobs``.
            micro_batch_size: as for ``get_logprobs``.

        Returns:
            A ``BatchedDataDict`` with ``reference_logprobs``.

        Raises:
            RuntimeError: the worker was built with ``init_reference_model=False``.
        """
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
        reshard(self.model)
        for p in self.model.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * std
            if isinstance(p, DTensor):
                noise = distribute_tensor(noise, p.device_mesh, p.placements, src_data_rank=None)
            part = local(p)
            part.add_(local(noise).to(part.device, part.dtype))

    def return_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's model state dict as NeMo-RL returns it: sharded parameters stay
        DTensors (``.shape`` is the full shape, ``.to_local()`` this rank's shard).

        Not a collective: it may be called on one worker. ``return_full_state_dict`` (every
        rank calls it) gathers full tensors.

        Returns:
            A dict from parameter name to its tensor or DTensor.
        """
        reshard(self.model)
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def return_full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (gathered) model state dict on CPU; a collective: every rank calls it.

        Returns:
            A dict from parameter name to its full tensor.
        """
        return {k: v.cpu() for k, v in full_state_dict(self.model).items()}

    def return_model_config(self) -> Any:
        """The model's Hugging Face config object (NeMo-RL's ``return_model_config``).

        Returns:
            The config.
        """
        return self.model.config

    # ------------------------------------------------------------------ device facts
    def reset_peak_memory_stats(self) -> None:
        """Start the peak memory figures again from now (``get_gpu_info``'s peaks)."""
        self._device_info.reset_peak_memory_stats()

    def get_gpu_info(self) -> dict[str, Any]:
        """Device and memory facts of this rank, with NeMo-RL's keys.

        On CPU the memory figures are the process's resident memory (``memory_*_mb``) and
        ``cuda`` is False; ``parameter_sample`` names one parameter with its device, shape
        (this rank's shard) and dtype.

        Returns:
            A dict of the facts.
        """
        return self._device_info.get_gpu_info()

    def report_device_id(self) -> str:
        """The GPU's UUID, or ``cpu:<hostname>`` on CPU (same-node processes share it).

        Returns:
            The id.
        """
        return self._device_info.report_device_id()

    def start_gpu_profiling(self) -> None:
        """Start the torch profiler (CPU activity, plus CUDA when present)."""
        self._device_info.start_gpu_profiling()

    def stop_gpu_profiling(self) -> str:
        """Stop the profiler and write a Chrome trace; returns its path.

        Returns:
            The trace's path.

        Raises:
            RuntimeError: the profiler was not started.
        """
        return self._device_info.stop_gpu_profiling()

    # ------------------------------------------------------------------ refit
    @property
    def model_update_group(self) -> Any:
        """The collective refit's process group (None before ``init_collective``)."""
        return self._refit.model_update_group

    def prepare_refit_info(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """``{name: (full shape, refit dtype)}`` of the weights a refit sends (NeMo-RL's
        ``prepare_refit_info``; the dtype is the policy's precision).

        Returns:
            A dict from parameter name to ``(shape, dtype)``.
        """
        return self._refit.prepare_refit_info()

    def prepare_weights_for_ipc(self) -> tuple[list[tuple[str, int]], float]:
        """Gather the full weights and hold them for ``get_weights_ipc_handles``.

        Every rank must call it. Returns ``[(name, nbytes)]`` (at the refit dtype, the
        policy's precision) and the bytes of device memory free for refit buffers.

        Returns:
            ``([(name, nbytes), ...], free bytes)``.
        """
        return self._refit.prepare_weights_for_ipc()

    def get_weights_ipc_handles(self, keys: Iterable[str]) -> dict[str, Any]:
        """Same-node handles to the held weights ``keys``: ``{device_id: handle}``.

        On GPU the weights are packed into one CUDA buffer and its CUDA IPC handle is
        returned; on CPU they are packed into a shared-memory segment (kept and reused
        across refits) and its name is returned. The handle carries the stream layout.

        Args:
            keys: the parameter names.

        Returns:
            A dict from device id to its handle.

        Raises:
            RuntimeError: ``prepare_weights_for_ipc`` was not called.
            KeyError: a name is not held.
        """
        return self._refit.get_weights_ipc_handles(keys)

    def pack_weights_for_ipc(self) -> dict[str, Any] | None:
        """``prepare_weights_for_ipc`` + ``get_weights_ipc_handles`` in one call, cheaper.

        Every rank must call it; rank 0 returns the handles, once the weights are in place.
        On CPU, when all policy ranks
        share a node, each rank copies its own rows of every parameter into one
        shared-memory segment (kept across refits; no gather, no collective after the
        first call), so the cost is one parallel copy of the weights. Otherwise the full
        weights are gathered and packed by rank 0, as NeMo-RL's two methods do.

        Returns:
            On rank 0, a dict from device id to its handle; None on the others.
        """
        return self._refit.pack_weights_for_ipc()

    def shm_refit_layout(self) -> Any:
        """The stream layout for ``write_weights_to_shm``, or None where the ranks cannot
        write one same-node buffer (weights on GPU, or ranks on several nodes).

        Every rank must call it (the first call asks the ranks for their hosts).

        Returns:
            The ``Layout``, or None.
        """
        return self._refit.shm_refit_layout()

    def write_weights_to_shm(self, path: str, live: Iterable[str] = ()) -> Any:
        """Every rank copies its own rows of every parameter into the shared buffer ``path``
        (a same-node segment another process made, e.g. a ``WeightSender``'s
        ``reserve_shared_buffer``): no gather, no collective beyond a final barrier.

        Mappings are kept for the next call; those of buffers neither ``path`` nor in
        ``live`` (retired by their owner) are dropped. Every rank must call it; rank 0
        returns the stream layout once every rank has written, the others None.

        Args:
            path: the shared buffer.
            live: other buffers whose mappings to keep.

        Returns:
            On rank 0, the stream ``Layout``; None on the others.

        Raises:
            ValueError: the buffer is smaller than the weights.
        """
        return self._refit.write_weights_to_shm(path, live)

    def prepare_info_for_collective(self) -> dict[str, Any]:
        """The stream layout and bucket size a collective refit uses (every rank calls).

        Returns:
            ``{"layout": ..., "bucket_bytes": ...}``.
        """
        return self._refit.prepare_info_for_collective()

    def init_collective(self, ip: str, port: int, world_size: int) -> None:
        """Create the refit process group as its rank 0 (on policy rank 0; receivers join
        as ranks 1..world_size-1). Gloo on CPU, NCCL on GPU.

        Args:
            ip: the address of the process group's store.
            port: its port.
            world_size: the process group's size (this rank and the receivers).
        """
        self._refit.init_collective(ip, port, world_size)

    def broadcast_weights_for_collective(self) -> None:
        """Gather the full weights (all policy ranks) and broadcast them from rank 0."""
        self._refit.broadcast_weights_for_collective()

    def release_refit_buffers(self) -> None:
        """Drop the weights held for IPC handles (receivers have copied them)."""
        self._refit.release_refit_buffers()

    # ------------------------------------------------------------------ memory moves
    def move_optimizer_to_device(self, device: str | torch.device) -> None:
        """Move every optimizer state tensor to ``device`` (no-op without an optimizer).

        Args:
            device: the target device.
        """
        move_optimizer_to_device(self.optimizer, device)

    def move_to_device(self, model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
        """Move parameters and buffers of ``model`` to ``device``.

        Args:
            model: the model.
            device: the target device.

        Returns:
            The model.
        """
        return move_to_device(model, device)

    def move_buffer_to_device(
        self, model: torch.nn.Module, device: str | torch.device
    ) -> torch.nn.Module:
        """Move only the buffers (FSDP2 shards parameters, not buffers).

        Args:
            model: the model.
            device: the target device.

        Returns:
            The model.
        """
        return move_buffer_to_device(model, device)

    def move_to_cuda(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move ``model`` to the GPU.

        Args:
            model: the model.

        Returns:
            The model.

        Raises:
            RuntimeError: CUDA is not available.
        """
        return move_to_cuda(model)

    def move_to_cpu(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move ``model`` to the CPU and free the device's cache.

        Args:
            model: the model.

        Returns:
            The model.
        """
        return move_to_cpu(model)

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        """Model on its device in eval mode; optimizer state off the device unless
        ``keep_train_buffers`` (or ``offload_optimizer_for_logprob`` is False).

        Args:
            keep_train_buffers: keep the optimizer state on the device.
        """
        self._offload.prepare_for_lp_inference(keep_train_buffers)

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        """Model and optimizer state on the device, model in train mode.

        Args:
            *args, **kwargs: accepted for NeMo-RL's signature.
        """
        self._offload.prepare_for_training()

    def offload_before_refit(self) -> None:
        """Move optimizer state to CPU to make room for refit buffers."""
        self._offload.offload_before_refit()

    def offload_after_refit(self) -> None:
        """Free the held refit buffers and move the model to CPU (until training resumes)."""
        self._offload.offload_after_refit()

    def finish_inference(self) -> None:
        """NeMo-RL's end of an inference phase (PPO): the model goes to host memory."""
        self._offload.finish_inference()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
        checkpointing_cfg: dict[str, Any] | None = None,
    ) -> None:
        """Sharded save with torch.distributed.checkpoint (every rank calls it).

        ``checkpointing_cfg`` (NeMo-RL v2's) may only ask for this format: its
        ``model_save_format`` must be None or "torch_save".

        Args:
            weights_path: the directory for the model's weights.
            optimizer_path: the directory for the optimizer's state (not saved if None).
            tokenizer_path: the directory for the tokenizer (not saved if None).
            checkpointing_cfg: NeMo-RL's checkpointing config.

        Raises:
            ConfigError: ``checkpointing_cfg`` asks for another format.
            OSError: a write failed (a full disk: ``ENOSPC``) on any rank; every rank
                raises it, naming the file or folder.
        """
        fmt = (checkpointing_cfg or {}).get("model_save_format")
        if fmt not in (None, "torch_save"):
            raise ConfigError(
                f"checkpointing_cfg.model_save_format={fmt!r}: phalanx saves sharded "
                "torch.distributed.checkpoint directories only (use None or 'torch_save')"
            )
        save_policy(self, weights_path, optimizer_path, tokenizer_path)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Load a ``save_checkpoint`` directory into this (already sharded) model; with
        LoRA, ``weights_path`` holds the adapters in peft's format.

        Args:
            weights_path: the directory of the model's weights.
            optimizer_path: the directory of the optimizer's state (not loaded if None).
        """
        load_policy(self, weights_path, optimizer_path)

    def keep_state(self, root: str, slot: int) -> int:
        """Copy this rank's trainable weights, optimizer and scheduler state into ``slot``
        (0 or 1) of the files under ``root``, for a relaunched rank to restore
        (in-place recovery). Cheaper than ``save_checkpoint``: the files stay mapped and a
        keep is one copy of the bytes.

        Args:
            root: the folder of the files (``/dev/shm`` or a run folder's).
            slot: 0 or 1; the caller alternates them so the last good one is never written.

        Returns:
            The bytes kept by this rank.

        Raises:
            ValueError: ``slot`` is not 0 or 1.
            OSError: the files could not be written.
        """
        return self._kept.keep(root, slot, self.model, self.optimizer, self.scheduler)

    def restore_kept_state(self, root: str, slot: int) -> None:
        """Load what the rank of this number kept with ``keep_state(root, slot)``.

        Args:
            root: the folder ``keep_state`` wrote to.
            slot: the slot to restore.

        Raises:
            FileNotFoundError: nothing was kept there.
            StateLayoutError: the kept state does not fit this model and optimizer.
        """
        self._kept.restore(root, slot, self.model, self.optimizer, self.scheduler)

    # ------------------------------------------------------------ the rest of NeMo-RL's API
    create_context_parallel_ctx = staticmethod(create_context_parallel_ctx)
    train_context = staticmethod(train_context)

    def is_alive(self) -> bool:
        """True: the worker answers.

        Returns:
            True.
        """
        return True

    def shutdown(self) -> bool:
        """Release the profiler, refit buffers and process groups.

        Returns:
            True.
        """
        self._device_info.close()
        self._refit.close()
        self._kept.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        return True


def _check_config(config: Any) -> dict[str, Any]:
    """``check_policy_config`` plus the model path and parallel sizes; a copy of ``config``."""
    check_policy_config(config)
    path = config.get("model_name")
    if not path:
        raise ConfigError("config['model_name'] is required (a save_pretrained directory)")
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        raise ConfigError(f"config['model_name']: model path {path!r} does not exist")
    check_parallel_config(config)
    return dict(config)
