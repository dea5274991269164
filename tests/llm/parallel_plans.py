"""Tensor-parallel plans that tests name by dotted path (``dtensor_cfg.custom_parallel_plan``);
workers import them by name."""

from __future__ import annotations

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


def llama_tp_plan() -> dict[str, ParallelStyle]:
    """Heads and MLP sharded as Megatron does; lm_head sharded over the vocabulary with its
    output gathered (the default plan replicates lm_head)."""
    layer = "model.layers.*."
    return {
        **{f"{layer}self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        f"{layer}self_attn.o_proj": RowwiseParallel(),
        f"{layer}mlp.gate_proj": ColwiseParallel(),
        f"{layer}mlp.up_proj": ColwiseParallel(),
        f"{layer}mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
