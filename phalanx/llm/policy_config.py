"""The policy config (NeMo-RL's ``PolicyConfig`` keys): which keys phalanx reads, which it
accepts because another component reads them, and which it refuses.

Every key of NeMo-RL's ``PolicyConfig`` is decided here; a key that is neither NeMo-RL's nor
phalanx's raises ``ConfigError`` naming it, so that nothing is silently ignored.
``ConfigError`` is both a ``ValueError`` and an ``AssertionError``: NeMo-RL raises
``AssertionError`` for most config mistakes, phalanx's own checks raise ``ValueError``;
code catching either keeps working. ``check_policy_config`` runs in ``Policy(...)`` before
any worker starts and again in each worker.

Keys phalanx reads::

    model_name                    path of a save_pretrained model (required)
    train_global_batch_size       rows per optimizer step, over all ranks
    train_micro_batch_size        rows per forward/backward on one rank
    logprob_batch_size            rows per forward in get_logprobs
    logprob_chunk_size            positions per chunk when computing log-probs
    logprob_kernel                "auto" | "compiled" | "eager" (phalanx's; ``logprobs.py``)
    max_total_sequence_length     longest input accepted
    precision                     "float32" | "bfloat16" | "float16" (FSDP2 mixed precision)
    max_grad_norm                 gradient clipping (None: no clipping)
    optimizer, scheduler          see ``optimizer.py``
    dtensor_cfg                   parallel sizes, sequence_parallel, activation_checkpointing,
                                  cpu_offload, custom_parallel_plan, defer_fsdp_grad_sync,
                                  clear_cache_every_n_steps, env_vars, _v2, automodel_kwargs,
                                  lora_cfg (checked by ``lora.check_lora_config``);
                                  phalanx's gather_weights_once_per_step ("auto" | bool;
                                  ``fsdp_state.gathers_once``) and compile (bool;
                                  ``parallelize.compile_layers``)
    dynamic_batching              {"enabled", "train_mb_tokens", "logprob_mb_tokens",
                                   "sequence_length_round"}
    sequence_packing              {"enabled", "train_mb_tokens", "logprob_mb_tokens",
                                   "algorithm", "microbatch_order", "sequence_length_round"}
    make_sequence_length_divisible_by  sequence packing's pad multiple (as NeMo-RL)
    generation                    its "temperature" divides the logits (as in NeMo-RL)
    hf_config_overrides           passed to the model config
    offload_optimizer_for_logprob prepare_for_lp_inference moves optimizer state to CPU
    refit_buffer_size_gb / _mb    refit bucket size
    seed                          torch seed (same on every rank)
    profile_dir                   where stop_gpu_profiling writes its trace
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import torch

from phalanx._base.checks import check_int, check_number
from phalanx.data.batched_data_dict import MICROBATCH_ORDERS
from phalanx.data.bin_packing import PACKING_ALGORITHMS


class ConfigError(ValueError, AssertionError):
    """A policy config value phalanx cannot use; the message names the key."""


# How log-probs are computed (``logprobs.py``): "auto" is "compiled" on a GPU with Triton.
LOGPROB_KERNELS = ("auto", "compiled", "eager")

PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Top-level keys. "used": read by the policy worker or Policy. "caller": part of NeMo-RL's
# PolicyConfig but read by the code around the policy (tokenizer loading, generation,
# data preparation), not by the policy itself; accepted unchanged.
_USED = {
    "model_name",
    "train_global_batch_size",
    "train_micro_batch_size",
    "logprob_batch_size",
    "logprob_chunk_size",
    "generation",  # its temperature scales the logits, as NeMo-RL's worker does
    "precision",
    "dtensor_cfg",
    "megatron_cfg",
    "reward_model_cfg",
    "draft",
    "hf_config_overrides",
    "dynamic_batching",
    "sequence_packing",
    "make_sequence_length_divisible_by",
    "max_total_sequence_length",
    "max_grad_norm",
    "refit_buffer_size_gb",
    "optimizer",
    "scheduler",
    "offload_optimizer_for_logprob",
    # phalanx's own
    "seed",
    "profile_dir",
    "refit_buffer_size_mb",
    "logprob_kernel",
}
_CALLER = {"tokenizer", "generation_batch_size"}
# Read by nothing in NeMo-RL either (its own test configs still carry it).
_LEGACY = {"learning_rate": "set optimizer.kwargs.lr instead"}

_DTENSOR_KEYS = {
    "enabled",
    "env_vars",
    "_v2",
    "tensor_parallel_size",
    "context_parallel_size",
    "expert_parallel_size",
    "dp_replicate_size",
    "sequence_parallel",
    "activation_checkpointing",
    "cpu_offload",
    "custom_parallel_plan",
    "defer_fsdp_grad_sync",
    "moe_parallelizer",
    "lora_cfg",
    "lora",
    "automodel_kwargs",
    "clear_cache_every_n_steps",
    "gather_weights_once_per_step",  # phalanx's (``fsdp_state.gathered_for_step``)
    "compile",  # phalanx's (``parallelize.compile_layers``)
}
_DYNAMIC_KEYS = {"enabled", "train_mb_tokens", "logprob_mb_tokens", "sequence_length_round"}
_PACKING_KEYS = _DYNAMIC_KEYS | {"algorithm", "microbatch_order"}


def positive_int(value: Any, key: str) -> int:
    """``value`` as an int >= 1, else a ``ConfigError`` naming ``key``."""
    try:
        return check_int(value, key, minimum=1)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be a positive int, got {value!r}") from None


def _dict(section: Any, key: str) -> dict[str, Any]:
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"{key} must be a dict, got {type(section).__name__}")
    return section


def _unknown(section: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(section) - allowed)
    if extra:
        raise ConfigError(
            f"{where}: unknown key(s) {extra}; phalanx reads {sorted(allowed)} here "
            "(a misspelt key would otherwise be silently ignored)"
        )


def _enabled(section: Any, key: str) -> bool:
    return bool(_dict(section, key).get("enabled", False))


def check_policy_config(config: dict[str, Any]) -> None:
    """Raise ``ConfigError`` naming the first key phalanx cannot honour."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    unknown = sorted(set(config) - _USED - _CALLER - set(_LEGACY))
    if unknown:
        raise ConfigError(
            f"policy config: unknown key(s) {unknown}; accepted keys are "
            f"{sorted(_USED | _CALLER | set(_LEGACY))}"
        )
    for key, hint in _LEGACY.items():
        if key in config:
            warnings.warn(
                f"policy config {key!r} is not read (NeMo-RL ignores it too); {hint}", stacklevel=2
            )
    precision = config.get("precision", "float32")
    if precision not in PRECISIONS:
        raise ConfigError(f"config['precision'] {precision!r} is not one of {sorted(PRECISIONS)}")
    for key in (
        "train_global_batch_size",
        "train_micro_batch_size",
        "logprob_batch_size",
        "logprob_chunk_size",
        "max_total_sequence_length",
        "make_sequence_length_divisible_by",
    ):
        if config.get(key) is not None:
            positive_int(config[key], key)
    if config.get("seed") is not None:
        _int(config["seed"], "seed", 0)
    if config.get("logprob_kernel", "auto") not in LOGPROB_KERNELS:
        raise ConfigError(
            f"logprob_kernel must be one of {LOGPROB_KERNELS}, got {config['logprob_kernel']!r}"
        )
    for key in ("max_grad_norm", "refit_buffer_size_gb", "refit_buffer_size_mb"):
        if config.get(key) is not None:
            _number(config[key], key)
    _check_dtensor(config)
    for key, why in (
        ("megatron_cfg", "phalanx has no Megatron backend"),
        ("reward_model_cfg", "reward models are not supported"),
        ("draft", "draft-model training needs NeMo-RL's Megatron backend (as in NeMo-RL)"),
    ):
        if _enabled(config.get(key), key):
            raise ConfigError(f"{key}.enabled=True: {why}")
    overrides = config.get("hf_config_overrides")
    if overrides is not None and not isinstance(overrides, dict):
        raise ConfigError(f"hf_config_overrides must be a dict, got {overrides!r}")
    _check_generation(_dict(config.get("generation"), "generation"))
    _check_batching(config)
    scheduler = config.get("scheduler")
    if scheduler is not None and not isinstance(scheduler, (dict, list)):
        raise ConfigError("scheduler must be a dict {name, kwargs} or a list of them")
    optimizer = _dict(config.get("optimizer"), "optimizer")
    if optimizer and not isinstance(optimizer.get("name"), str):
        raise ConfigError(f"optimizer.name must be a dotted class path, got {optimizer!r}")


def _int(value: Any, key: str, minimum: int) -> int:
    try:
        return check_int(value, key, minimum=minimum)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


def _number(value: Any, key: str) -> float:
    try:
        return check_number(value, key, minimum=0.0)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


def _check_dtensor(config: dict[str, Any]) -> None:
    dcfg = _dict(config.get("dtensor_cfg"), "dtensor_cfg")
    _unknown(dcfg, _DTENSOR_KEYS, "dtensor_cfg")
    if "enabled" in dcfg and not dcfg["enabled"]:
        raise ConfigError(
            "dtensor_cfg.enabled=False: phalanx's Policy is the DTensor (FSDP2) backend; "
            "set dtensor_cfg.enabled=True"
        )
    if dcfg.get("expert_parallel_size", 1) != 1:
        raise ConfigError("dtensor_cfg.expert_parallel_size > 1: no expert parallelism in phalanx")
    if positive_int(dcfg.get("dp_replicate_size", 1), "dtensor_cfg.dp_replicate_size") > 1:
        raise ConfigError(
            "dtensor_cfg.dp_replicate_size > 1 (HSDP): phalanx shards over every data-parallel "
            "rank (FSDP); set dp_replicate_size=1"
        )
    if dcfg.get("moe_parallelizer"):
        raise ConfigError("dtensor_cfg.moe_parallelizer: MoE models are not supported")
    automodel = _dict(dcfg.get("automodel_kwargs"), "dtensor_cfg.automodel_kwargs")
    # force_hf: phalanx always builds Hugging Face's own model class, which is what it asks.
    extra = sorted(k for k, v in automodel.items() if k != "force_hf" and v)
    if extra:
        raise ConfigError(
            f"dtensor_cfg.automodel_kwargs {extra}: Automodel's custom kernels and model "
            "classes are not available; phalanx builds the Hugging Face model (force_hf)"
        )
    if _enabled(dcfg.get("lora"), "dtensor_cfg.lora"):
        raise ConfigError(
            "dtensor_cfg.lora.enabled=True: NeMo-RL reads the LoRA settings from "
            "dtensor_cfg.lora_cfg (dtensor_cfg.lora is read by nothing); rename the key"
        )
    env = dcfg.get("env_vars")
    if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) for k in env)):
        raise ConfigError(f"dtensor_cfg.env_vars must be a dict of str, got {env!r}")
    n = dcfg.get("clear_cache_every_n_steps")
    if n is not None:
        positive_int(n, "dtensor_cfg.clear_cache_every_n_steps")
    gather = dcfg.get("gather_weights_once_per_step")
    if gather not in ("auto", None) and not isinstance(gather, bool):
        raise ConfigError(
            f"dtensor_cfg.gather_weights_once_per_step must be 'auto', True or False, got {gather!r}"
        )
    _check_compile(dcfg)
    plan = dcfg.get("custom_parallel_plan")
    if plan is not None and not isinstance(plan, (str, dict)):
        raise ConfigError(
            "dtensor_cfg.custom_parallel_plan must be a dict of module name -> ParallelStyle "
            f"or a dotted path to one (or to a function returning one), got {plan!r}"
        )


def _check_compile(dcfg: dict[str, Any]) -> None:
    """``dtensor_cfg.compile``: a bool, and only where the compiled layers are tested (one
    tensor- and context-parallel rank; activation checkpointing and LoRA included)."""
    compiled = dcfg.get("compile", False)
    if not isinstance(compiled, bool):
        raise ConfigError(f"dtensor_cfg.compile must be True or False, got {compiled!r}")
    if not compiled:
        return
    for key in ("tensor_parallel_size", "context_parallel_size"):
        if positive_int(dcfg.get(key, 1), f"dtensor_cfg.{key}") > 1:
            raise ConfigError(
                f"dtensor_cfg.compile=True with dtensor_cfg.{key} > 1 is not supported: "
                "the compiled layers are tested with FSDP2 sharding only; set compile=False "
                f"or {key}=1"
            )


def _check_generation(gen: dict[str, Any]) -> None:
    t = gen.get("temperature", 1.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
        raise ConfigError(f"generation.temperature must be a positive number, got {t!r}")
    # NeMo-RL's worker also filters the training logits by top-k/top-p; phalanx does not.
    if gen.get("top_k") not in (None, -1, 0) or gen.get("top_p", 1.0) not in (None, 1.0):
        raise ConfigError(
            f"generation.top_k={gen.get('top_k')!r} / top_p={gen.get('top_p', 1.0)!r}: "
            "top-k/top-p filtering of the training log-probs is not supported; use "
            "top_k=None and top_p=1.0"
        )


def _check_batching(config: dict[str, Any]) -> None:
    dyn, packing = config.get("dynamic_batching"), config.get("sequence_packing")
    if _enabled(dyn, "dynamic_batching"):
        _unknown(dyn, _DYNAMIC_KEYS, "dynamic_batching")
        for key in ("train_mb_tokens", "sequence_length_round"):
            if key not in dyn:
                raise ConfigError(f"dynamic_batching.{key} is required when enabled")
            positive_int(dyn[key], f"dynamic_batching.{key}")
        if "logprob_mb_tokens" in dyn:
            positive_int(dyn["logprob_mb_tokens"], "dynamic_batching.logprob_mb_tokens")
    if not _enabled(packing, "sequence_packing"):
        return
    if _enabled(dyn, "dynamic_batching"):
        raise ConfigError("sequence_packing and dynamic_batching are exclusive; enable only one")
    _unknown(packing, _PACKING_KEYS, "sequence_packing")
    if "train_mb_tokens" not in packing:
        raise ConfigError("sequence_packing.train_mb_tokens is required when enabled")
    for key in ("train_mb_tokens", "logprob_mb_tokens", "sequence_length_round"):
        if key in packing:
            positive_int(packing[key], f"sequence_packing.{key}")
    algorithm = packing.get("algorithm", "modified_first_fit_decreasing")
    if algorithm not in PACKING_ALGORITHMS:
        raise ConfigError(
            f"sequence_packing.algorithm must be one of {PACKING_ALGORITHMS}, got {algorithm!r}"
        )
    order = packing.get("microbatch_order", "packer")
    if order not in MICROBATCH_ORDERS:
        raise ConfigError(
            f"sequence_packing.microbatch_order must be one of {MICROBATCH_ORDERS}, got {order!r}"
        )
    if int((config.get("dtensor_cfg") or {}).get("context_parallel_size", 1)) > 1:
        raise ConfigError(
            "sequence_packing with context_parallel_size > 1 is not supported (nor in "
            "NeMo-RL's DTensor worker)"
        )


def train_batch_sizes(
    config: dict[str, Any], gbs: int | None, mbs: int | None, dp_size: int, plain: bool
) -> tuple[int, int, int]:
    """The global and micro batch sizes of one ``train`` call and the per-rank global batch.

    Args:
        config: the policy config (``train_global_batch_size``, ``train_micro_batch_size``).
        gbs: the call's global batch size; None or 0 for the config's.
        mbs: the call's micro-batch size; None or 0 for the config's.
        dp_size: the data-parallel size the global batch is split over.
        plain: micro-batches of ``mbs`` rows (neither dynamic batching nor packing).

    Returns:
        ``(gbs, mbs, gbs // dp_size)``.

    Raises:
        ValueError: ``gbs`` not divisible by ``dp_size``, or in ``plain`` mode ``mbs`` not
            dividing the per-rank global batch.
    """
    gbs = int(gbs or config["train_global_batch_size"])
    mbs = int(mbs or config["train_micro_batch_size"])
    if gbs % dp_size:
        raise ValueError(
            f"gbs {gbs} is not divisible by the data-parallel size {dp_size} "
            "(train_global_batch_size)"
        )
    local = gbs // dp_size
    if plain and local % mbs:
        raise ValueError(
            f"mbs {mbs} does not divide the per-rank global batch {local} (gbs {gbs} / dp "
            f"{dp_size}; train_micro_batch_size)"
        )
    return gbs, mbs, local


def import_object(path: str, what: str) -> Any:
    """The object at dotted ``path`` ("module.Name"); ``what`` names the config key."""
    module, _, name = path.rpartition(".") if isinstance(path, str) else ("", "", "")
    if not module:
        raise ConfigError(f"{what}: expected 'module.Name', got {path!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{what}: cannot import {path!r} ({e})") from None


def dynamic_batching_enabled(config: dict[str, Any]) -> bool:
    return _enabled(config.get("dynamic_batching"), "dynamic_batching")


def sequence_packing_enabled(config: dict[str, Any]) -> bool:
    return _enabled(config.get("sequence_packing"), "sequence_packing")


def logits_temperature(config: dict[str, Any]) -> float:
    """The generation temperature the logits are divided by (1.0 without ``generation``)."""
    gen = config.get("generation") or {}
    return float(gen.get("temperature", 1.0))
