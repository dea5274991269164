"""Building the policy's model: a Hugging Face causal LM loaded with ``from_pretrained``,
then tensor-parallel (when ``tensor_parallel_size > 1``) and FSDP2-sharded."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from phalanx.llm.lora import apply_lora, check_lora_config
from phalanx.llm.parallelize import apply_custom_plan, apply_fsdp, apply_tp, compile_layers


def build_model(
    cfg: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    tp_mesh: DeviceMesh,
    fsdp_mesh: DeviceMesh,
    sequence_parallel: bool,
) -> tuple[torch.nn.Module, Any]:
    """The sharded model of ``cfg['model_name']``; parameters in ``dtype`` for compute
    (FSDP2 mixed precision), float32 for the optimizer. With ``dtensor_cfg.lora_cfg``
    enabled, LoRA adapters are injected before sharding and the ``peft.PeftModel`` over
    the model comes second (else None)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    from transformers import AutoConfig, AutoModelForCausalLM

    dcfg = cfg.get("dtensor_cfg") or {}
    overrides = dict(cfg.get("hf_config_overrides") or {})
    overrides.setdefault("attn_implementation", "sdpa")
    config = AutoConfig.from_pretrained(cfg["model_name"], **overrides)
    model = AutoModelForCausalLM.from_pretrained(
        cfg["model_name"], config=config, dtype=torch.float32
    )
    model.config.use_cache = False
    if dcfg.get("activation_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = check_lora_config(cfg, with_model=False)
    peft_model = apply_lora(model, lora) if lora is not None else None
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    # Pinned host memory needs an accelerator; NeMo-RL does not pin either.
    offload = CPUOffloadPolicy(pin_memory=False) if dcfg.get("cpu_offload") else None
    if offload is not None and device.type == "cpu":
        warnings.warn(
            "dtensor_cfg.cpu_offload=True on a CPU-only worker: parameters already live "
            "in host memory, so offloading changes nothing",
            stacklevel=2,
        )
    if offload is None and device.type == "cuda":
        model = model.to(device)
    plan = dcfg.get("custom_parallel_plan")
    if plan is not None and tp_mesh.size() == 1:
        warnings.warn(
            "dtensor_cfg.custom_parallel_plan is only applied with tensor_parallel_size > 1 "
            "(as in NeMo-RL); it has no effect at tensor_parallel_size=1",
            stacklevel=2,
        )
    if dcfg.get("compile"):
        compile_layers(model)
    if tp_mesh.size() > 1:
        if plan is not None:
            apply_custom_plan(model, tp_mesh, plan)
        else:
            apply_tp(model, tp_mesh, sequence_parallel)
    apply_fsdp(model, fsdp_mesh, mp, offload)
    return model, peft_model
