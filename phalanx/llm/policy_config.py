"""The policy config (NeMo-RL's ``PolicyConfig`` keys): which keys phalanx reads, which it
accepts because another component reads them, and which it refuses.

Every key of NeMo-RL's ``PolicyConfig`` is decided here; a key that is neither NeMo-RL's nor
phalanx's raises ``ConfigError`` naming it, so that nothing is silently ignored.
``ConfigError`` is both a ``ValueError`` and an ``AssertionError``: NeMo-RL raises
``AssertionError`` for most config mistakes, phalanx's own checks raise ``ValueError``;
code catching either keeps working.
"""

from __future__ import annotations

import warnings
from typing import Any

from phalanx.data.batched_data_dict import MICROBATCH_ORDERS
from phalanx.data.packing import PACKING_ALGORITHMS


class ConfigError(ValueError, AssertionError):
    """A policy config value phalanx cannot use; the message names the key."""


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
    "hf_config_overrides",
    "dynamic_batching",
    "sequence_packing",
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
}
_CALLER = {"tokenizer", "generation_batch_size", "make_sequence_length_divisible_by"}
# Read by nothing in NeMo-RL either (its own test configs still carry it).
_LEGACY = {"learning_rate": "set optimizer.kwargs.lr instead"}

_DTENSOR_KEYS = {
    "enabled",
    "env_vars",
    "_v2",
    "tensor_parallel_size",
    "context_parallel_size",
    "expert_parallel_size",
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
}
_DYNAMIC_KEYS = {"enabled", "train_mb_tokens", "logprob_mb_tokens", "sequence_length_round"}
_PACKING_KEYS = {"enabled", "train_mb_tokens", "logprob_mb_tokens", "algorithm", "microbatch_order"}


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} must be a positive int, got {value!r}")
    return value


def _unknown(section: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(section) - allowed)
    if extra:
        raise ConfigError(
            f"{where}: unknown key(s) {extra}; phalanx reads {sorted(allowed)} here "
            "(a misspelt key would otherwise be silently ignored)"
        )


def _enabled(section: Any, key: str) -> bool:
    if section is None:
        return False
    if not isinstance(section, dict):
        raise ConfigError(f"{key} must be a dict, got {type(section).__name__}")
    return bool(section.get("enabled", False))


def check_policy_config(config: dict[str, Any]) -> None:
    """Raise ``ConfigError`` naming the first key phalanx cannot honour."""
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

    dcfg = config.get("dtensor_cfg") or {}
    if not isinstance(dcfg, dict):
        raise ConfigError(f"dtensor_cfg must be a dict, got {type(dcfg).__name__}")
    _unknown(dcfg, _DTENSOR_KEYS, "dtensor_cfg")
    if "enabled" in dcfg and not dcfg["enabled"]:
        raise ConfigError(
            "dtensor_cfg.enabled=False: phalanx's Policy is the DTensor (FSDP2) backend; "
            "set dtensor_cfg.enabled=True"
        )
    if dcfg.get("_v2"):
        raise ConfigError(
            "dtensor_cfg._v2=True selects NeMo-RL's Automodel worker (DTensorPolicyWorkerV2), "
            "which phalanx does not have; drop _v2 to use the DTensor worker"
        )
    if dcfg.get("expert_parallel_size", 1) != 1:
        raise ConfigError("dtensor_cfg.expert_parallel_size > 1: no expert parallelism in phalanx")
    for key in ("moe_parallelizer", "automodel_kwargs"):
        if dcfg.get(key):
            raise ConfigError(f"dtensor_cfg.{key}: Automodel/MoE options are not supported")
    for key in ("lora_cfg", "lora"):
        if _enabled(dcfg.get(key), f"dtensor_cfg.{key}"):
            raise ConfigError(f"dtensor_cfg.{key}.enabled=True: LoRA is not supported")
    env = dcfg.get("env_vars")
    if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) for k in env)):
        raise ConfigError(f"dtensor_cfg.env_vars must be a dict of str, got {env!r}")
    n = dcfg.get("clear_cache_every_n_steps")
    if n is not None:
        _positive_int(n, "dtensor_cfg.clear_cache_every_n_steps")
    plan = dcfg.get("custom_parallel_plan")
    if plan is not None and not isinstance(plan, (str, dict)):
        raise ConfigError(
            "dtensor_cfg.custom_parallel_plan must be a dict of module name -> ParallelStyle "
            f"or a dotted path to one (or to a function returning one), got {plan!r}"
        )

    if _enabled(config.get("megatron_cfg"), "megatron_cfg"):
        raise ConfigError("megatron_cfg.enabled=True: phalanx has no Megatron backend")
    if _enabled(config.get("reward_model_cfg"), "reward_model_cfg"):
        raise ConfigError("reward_model_cfg.enabled=True: reward models are not supported")
    overrides = config.get("hf_config_overrides")
    if overrides is not None and not isinstance(overrides, dict):
        raise ConfigError(f"hf_config_overrides must be a dict, got {overrides!r}")
    chunk = config.get("logprob_chunk_size")
    if chunk is not None:
        _positive_int(chunk, "logprob_chunk_size")
    gen = config.get("generation")
    if gen is not None:
        if not isinstance(gen, dict):
            raise ConfigError(f"generation must be a dict, got {type(gen).__name__}")
        t = gen.get("temperature", 1.0)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ConfigError(f"generation.temperature must be a positive number, got {t!r}")

    dyn, packing = config.get("dynamic_batching"), config.get("sequence_packing")
    if _enabled(dyn, "dynamic_batching"):
        _unknown(dyn, _DYNAMIC_KEYS, "dynamic_batching")
        for key in ("train_mb_tokens", "sequence_length_round"):
            if key not in dyn:
                raise ConfigError(f"dynamic_batching.{key} is required when enabled")
            _positive_int(dyn[key], f"dynamic_batching.{key}")
        if "logprob_mb_tokens" in dyn:
            _positive_int(dyn["logprob_mb_tokens"], "dynamic_batching.logprob_mb_tokens")
    if _enabled(packing, "sequence_packing"):
        if _enabled(dyn, "dynamic_batching"):
            raise ConfigError(
                "sequence_packing and dynamic_batching are exclusive; enable only one"
            )
        _unknown(packing, _PACKING_KEYS, "sequence_packing")
        if "train_mb_tokens" not in packing:
            raise ConfigError("sequence_packing.train_mb_tokens is required when enabled")
        _positive_int(packing["train_mb_tokens"], "sequence_packing.train_mb_tokens")
        if "logprob_mb_tokens" in packing:
            _positive_int(packing["logprob_mb_tokens"], "sequence_packing.logprob_mb_tokens")
        algorithm = packing.get("algorithm", "modified_first_fit_decreasing")
        if algorithm not in PACKING_ALGORITHMS:
            raise ConfigError(
                f"sequence_packing.algorithm must be one of {PACKING_ALGORITHMS}, got {algorithm!r}"
            )
        order = packing.get("microbatch_order", "packer")
        if order not in MICROBATCH_ORDERS:
            raise ConfigError(
                f"sequence_packing.microbatch_order must be one of {MICROBATCH_ORDERS}, "
                f"got {order!r}"
            )
        if int(dcfg.get("context_parallel_size", 1)) > 1:
            raise ConfigError(
                "sequence_packing with context_parallel_size > 1 is not supported (nor in "
                "NeMo-RL's DTensor worker)"
            )
    if config.get("scheduler") is not None and not isinstance(config["scheduler"], (dict, list)):
        raise ConfigError("scheduler must be a dict {name, kwargs} or a list of them")


def dynamic_batching_enabled(config: dict[str, Any]) -> bool:
    return _enabled(config.get("dynamic_batching"), "dynamic_batching")


def sequence_packing_enabled(config: dict[str, Any]) -> bool:
    return _enabled(config.get("sequence_packing"), "sequence_packing")


def logits_temperature(config: dict[str, Any]) -> float:
    """The generation temperature the logits are divided by (1.0 without ``generation``)."""
    gen = config.get("generation") or {}
    return float(gen.get("temperature", 1.0))
