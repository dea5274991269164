"""How each key of a NeMo-RL GRPO config is read (:data:`RULES`): the ``GRPOConfig`` field it
sets, the values accepted because they are what phalanx does, or why it is refused. Each
rule carries the line ``docs/compat.md``'s table shows for it. :mod:`grpo_nemo_config`
walks a config through them."""

from __future__ import annotations

import os
from importlib.util import find_spec
from typing import Any

from phalanx.algorithms.grpo_nemo_base import (
    Reader,
    Rule,
    custom,
    into,
    only,
    refused,
    same_as,
    to,
    unused,
    unused_unless,
)

PHALANX_SECTION = "phalanx"
WANDB_PROJECT = "phalanx"  # the W&B project phalanx's metrics logger writes to
DYNAMIC_BATCHING_ROUND = 16  # phalanx's dynamic batches round sequence lengths to this


def _builtin_tasks() -> tuple[str, ...]:
    from phalanx.algorithms.grpo_tasks import BUILTIN_TASKS

    return tuple(BUILTIN_TASKS)


def _task_is_jsonl(r: Reader) -> bool:
    """Whether the run's task is a JSONL file (``data.dataset_name: ResponseDataset``, or
    without a dataset the phalanx section's ``task``)."""
    if _dataset_name(r) is not None:
        return _dataset_name(r) == "ResponseDataset"
    return str(r.get(f"{PHALANX_SECTION}.task", "")).endswith(".jsonl")


@custom(
    "accepted for a built-in task (its problems are generated: no epoch ever ends); refused "
    "for a JSONL task (sampled with replacement: no epochs)"
)
def _max_num_epochs(r: Reader, key: str, value: Any) -> None:
    if _task_is_jsonl(r):
        r.refuse(key, value, "a JSONL task is sampled with replacement, it has no epochs")


@custom("must be true while `grpo.val_period` > 0, false at 0 (phalanx evaluates at the end then)")
def _val_at_end(r: Reader, key: str, value: Any) -> None:
    period = r.get("grpo.val_period", r.get(f"{PHALANX_SECTION}.eval_every", 5))
    if value is not (isinstance(period, int) and period > 0):
        r.refuse(key, value, "phalanx evaluates at the end exactly when grpo.val_period > 0")


@custom("at least `grpo.max_val_samples`: phalanx decodes the held-out split in one call")
def _val_batch_size(r: Reader, key: str, value: Any) -> None:
    size = r.get("grpo.max_val_samples", r.get(f"{PHALANX_SECTION}.eval_size", 100))
    if not isinstance(value, int) or not isinstance(size, int) or value < size:
        r.refuse(key, value, f"phalanx decodes the {size} held-out problems in one call")


@custom(
    "true only without a KL penalty, false only with one (phalanx runs the reference pass exactly "
    "when `loss_fn.reference_policy_kl_penalty` > 0)"
)
def _skip_reference(r: Reader, key: str, value: Any) -> None:
    kl = r.get("loss_fn.reference_policy_kl_penalty", 0.0)
    if value is not (not kl):
        r.refuse(key, value, "phalanx runs the reference pass exactly when the KL penalty is > 0")


@custom(
    "false only, synchronous GRPO (its update is on-policy); asynchronous GRPO corrects "
    "stale rows with the generator's log-probs inside the ratio instead: leave the key out"
)
def _importance_sampling(r: Reader, key: str, value: Any) -> None:
    if value is not False or r.get("grpo.async_grpo.enabled", False):
        why = (
            "phalanx's sync update is on-policy; async puts the generator's log-probs in the ratio"
        )
        r.refuse(key, value, f"{why}, not NeMo-RL's separate weight: leave the key out")


@custom(
    "accepted with `generation.backend: vllm` (NeMo-RL reads it only for HF generation); refused "
    "with hf"
)
def _generation_batch_size(r: Reader, key: str, value: Any) -> None:
    if r.get("policy.generation.backend", "hf") != "vllm":
        r.refuse(key, value, "phalanx's HF generation decodes a worker's rows in one batch")


def _mb_tokens(batch_key: str) -> Rule:
    @custom(
        f"must equal `{batch_key}` x `policy.max_total_sequence_length` (phalanx's token budget)"
    )
    def rule(r: Reader, key: str, value: Any) -> None:
        if not r.get("policy.dynamic_batching.enabled"):
            return
        rows, seq = r.get(batch_key), r.get("policy.max_total_sequence_length")
        if not isinstance(seq, int) or not isinstance(rows, int):
            r.refuse(key, value, f"phalanx's budget is {batch_key} x max_total_sequence_length")
        elif value != rows * seq:
            r.refuse(key, value, f"phalanx's budget is {batch_key} x {seq} = {rows * seq}")

    return rule


@custom(f"{DYNAMIC_BATCHING_ROUND} only (phalanx's rounding) while dynamic batching is on")
def _round(r: Reader, key: str, value: Any) -> None:
    if r.get("policy.dynamic_batching.enabled") and value != DYNAMIC_BATCHING_ROUND:
        r.refuse(key, value, f"phalanx rounds dynamic batches' lengths to {DYNAMIC_BATCHING_ROUND}")


@custom(
    "with `enabled: true`: `dim` -> `lora_rank`, `alpha` -> `lora_alpha`, `target_modules` -> "
    "`lora_target_modules`"
)
def _lora(r: Reader, key: str, value: Any) -> None:
    if not isinstance(value, dict):
        r.refuse(key, value, "must be a mapping")
        return
    if not value.get("enabled", False):
        return  # the adapters are off: their settings are unused
    known = {"enabled", "dim", "alpha", "target_modules", "match_all_linear", "use_triton",
             "dropout", "dropout_position", "exclude_modules", "lora_A_init"}  # fmt: skip
    for name in sorted(set(value) - known):
        r.refuse(f"{key}.{name}", value[name], "not a lora_cfg key phalanx knows")
    if "dim" in value:
        r.set("lora_rank", value["dim"], f"{key}.dim")
    else:
        r.refuse(f"{key}.dim", None, "enabled adapters need their rank")
    if "alpha" in value:
        r.set("lora_alpha", value["alpha"], f"{key}.alpha")
    targets = value.get("target_modules") or []
    r.set("lora_target_modules", list(targets), f"{key}.target_modules")
    if value.get("match_all_linear", not targets) is not (not targets):
        r.refuse(f"{key}.match_all_linear", value.get("match_all_linear"),
                 "adapts every linear layer exactly when target_modules is empty")  # fmt: skip
    for name, default in (("use_triton", False), ("dropout", 0.0), ("lora_A_init", "xavier")):
        if name in value and value[name] != default:
            r.refuse(f"{key}.{name}", value[name], f"phalanx train grpo uses {default!r}")
    if value.get("exclude_modules"):
        r.refuse(f"{key}.exclude_modules", value["exclude_modules"],
                 "phalanx names the adapted modules with target_modules only")  # fmt: skip


@custom("`hf` or `vllm` -> `generation_backend`")
def _backend(r: Reader, key: str, value: Any) -> None:
    if value not in ("hf", "vllm"):
        r.refuse(key, value, "phalanx generates with hf (its own loop) or vllm")
    else:
        r.set("generation_backend", value, key)


@custom("must equal `policy.max_total_sequence_length` (phalanx sizes its engines to it)")
def _max_model_len(r: Reader, key: str, value: Any) -> None:
    if value != r.get("policy.max_total_sequence_length"):
        r.refuse(key, value, "phalanx's engines take policy.max_total_sequence_length")


def _vllm(rule: Rule) -> Rule:
    """A ``vllm_cfg`` key: read with the vLLM backend, unused (as in NeMo-RL) with hf."""

    def wrapped(r: Reader, key: str, value: Any) -> None:
        if r.get("policy.generation.backend", "hf") == "vllm":
            rule(r, key, value)

    return Rule(wrapped, f"with `backend: vllm`: {rule.doc}")


@custom(
    "true -> `placement: shared`, false -> `placement: disaggregated` (generation on cores of its "
    "own)"
)
def _colocated(r: Reader, key: str, value: Any) -> None:
    if not isinstance(value, bool):
        r.refuse(key, value, "must be true or false")
    else:
        r.set("placement", "shared" if value else "disaggregated", key)


@custom(
    "not colocated: -> `num_generation_workers` (the policy gets the rest of "
    "`cluster.gpus_per_node`)"
)
def _generation_workers(r: Reader, key: str, value: Any) -> None:
    if r.get("policy.generation.colocated.enabled", True) or value is None:
        return
    r.set("num_generation_workers", value, key)


@custom(
    "-> `num_policy_workers` (and `num_generation_workers` when colocated): one worker per device"
)
def _gpus_per_node(r: Reader, key: str, value: Any) -> None:
    if r.get("policy.generation.colocated.enabled", True):
        r.set("num_policy_workers", value, key)
        r.set("num_generation_workers", value, key)
        return
    gen = r.get("policy.generation.colocated.resources.gpus_per_node")
    if not isinstance(gen, int) or not isinstance(value, int) or value <= gen:
        r.refuse(key, value, f"must exceed the generation's {gen!r} (the policy gets the rest)")
    else:
        r.set("num_policy_workers", value - gen, key)


def _dataset_name(r: Reader) -> Any:
    """``data.dataset_name`` (NeMo-RL's earlier layout) or ``data.train.dataset_name``."""
    return r.get("data.train.dataset_name", r.get("data.dataset_name"))


def _data_path_key(key: str) -> str:
    """The JSONL path's key beside the dataset name ``key`` in either layout."""
    return "data.train_data_path" if key == "data.dataset_name" else "data.train.data_path"


@custom(
    "a built-in task name, or `ResponseDataset` with `train_data_path` (`data.train.data_path`) "
    "-> `task`"
)
def _dataset(r: Reader, key: str, value: Any) -> None:
    if value in _builtin_tasks():
        r.set("task", value, key)
    elif value == "ResponseDataset":
        path_key = _data_path_key(key)
        path = r.get(path_key)
        if not isinstance(path, str) or not path.endswith(".jsonl"):
            r.refuse(path_key, path, "ResponseDataset needs a local JSONL file here")
        else:
            r.set("task", path, key)
    else:
        r.refuse(
            key,
            value,
            f"phalanx trains on its built-in tasks ({', '.join(_builtin_tasks())}) or a JSONL "
            "file (dataset_name: ResponseDataset and its path); it downloads no datasets",
        )


@custom("read by `dataset_name: ResponseDataset`")
def _with_response_dataset(r: Reader, key: str, value: Any) -> None:
    if _dataset_name(r) != "ResponseDataset":
        r.refuse(key, value, "read only with dataset_name: ResponseDataset")


@custom(
    "false; true only when a step trains once on its whole batch (phalanx then takes the "
    "training forward's own log-probs as the old ones: ratio 1)"
)
def _force_on_policy(r: Reader, key: str, value: Any) -> None:
    batch = r.get("grpo.num_prompts_per_step", 8) * r.get("grpo.num_generations_per_prompt", 8)
    if value is True and r.get("policy.train_global_batch_size", batch) == batch:
        return
    if value is not False:
        r.refuse(key, value, "phalanx's ratio is 1 only when a step trains once on its batch")


def _response_key(expected: str) -> Rule:
    @custom(f"{expected!r} only (the field of phalanx's JSONL tasks)")
    def rule(r: Reader, key: str, value: Any) -> None:
        if value != expected:
            r.refuse(
                key, value, f"phalanx's JSONL tasks hold {{'prompt', 'answer'}}: use {expected!r}"
            )

    return rule


@custom(
    "at least `policy.max_total_sequence_length` (no prompt is cut: phalanx requires every prompt "
    "+ max_new_tokens to fit)"
)
def _max_input(r: Reader, key: str, value: Any) -> None:
    seq = r.get("policy.max_total_sequence_length")
    if value is not None and (not isinstance(seq, int) or value < seq):
        r.refuse(
            key, value, "phalanx never cuts a prompt; set it to policy.max_total_sequence_length"
        )


@custom("the file's text -> `system_prompt`")
def _system_prompt_file(r: Reader, key: str, value: Any) -> None:
    if value is None:
        return
    try:
        with open(value, encoding="utf-8") as f:
            r.set("system_prompt", f.read().strip(), key)
    except OSError as e:
        r.refuse(key, value, f"cannot read it: {e}")


@custom(
    "-> `run_dir` (the run folder: checkpoints go to its checkpoints/; NeMo-RL resumes from it by "
    "itself, phalanx with --resume)"
)
def _checkpoint_dir(r: Reader, key: str, value: Any) -> None:
    r.set("run_dir", value, key)


@custom(
    "-> `runs_dir` (each run a fresh folder under it); with `checkpointing.checkpoint_dir` set, "
    "must equal it"
)
def _log_dir(r: Reader, key: str, value: Any) -> None:
    ckpt = r.get("checkpointing.checkpoint_dir")
    if ckpt is None:
        r.set("runs_dir", value, key)
    elif value != ckpt:
        r.refuse(key, value, "phalanx logs into the run folder: checkpointing.checkpoint_dir")


@custom(f"{WANDB_PROJECT!r} only while W&B logging is on (phalanx's project)")
def _wandb_project(r: Reader, key: str, value: Any) -> None:
    if r.get("logger.wandb_enabled") and value != WANDB_PROJECT:
        r.refuse(key, value, f"phalanx logs to the W&B project {WANDB_PROJECT!r}")


@custom("-> `name` (the run folder's name is the W&B run's) while W&B logging is on")
def _wandb_name(r: Reader, key: str, value: Any) -> None:
    if not r.get("logger.wandb_enabled"):
        return
    ckpt = r.get("checkpointing.checkpoint_dir")
    if ckpt is None:
        r.set("name", value, key)
    elif value != os.path.basename(os.path.normpath(ckpt)):
        r.refuse(
            key, value, "the W&B run is named after the run folder, checkpointing.checkpoint_dir"
        )


@custom("true exactly when the tensorboard package is installed (phalanx writes TensorBoard then)")
def _tensorboard(r: Reader, key: str, value: Any) -> None:
    installed = find_spec("tensorboard") is not None
    if value is not installed:
        r.refuse(
            key, value, f"phalanx writes TensorBoard exactly when it is installed: {installed}"
        )


ASYNC_FIELDS = {
    "grpo.async_grpo.enabled": "async_grpo",
    "grpo.async_grpo.max_trajectory_age_steps": "max_trajectory_age_steps",
    "grpo.async_grpo.max_generation_failures": "max_generation_failures",
    "grpo.async_grpo.in_flight_weight_updates": "in_flight_weight_updates",
    "grpo.async_grpo.recompute_kv_cache_after_weight_updates": (
        "recompute_kv_cache_after_weight_updates"
    ),
}

_FSDP2 = "phalanx train grpo shards the policy with FSDP2 only"
_DTENSOR_ONLY: list[tuple[str, tuple[Any, ...], str]] = [
    ("enabled", (True,), "phalanx's policy is DTensor (FSDP2)"),
    ("_v2", (True, False), "picks NeMo-RL's worker version; phalanx has one"),
    ("cpu_offload", (False,), "phalanx train grpo keeps the policy in memory"),
    ("sequence_parallel", (False,), _FSDP2),
    ("activation_checkpointing", (False,), "phalanx train grpo has no activation checkpointing"),
    ("tensor_parallel_size", (1,), _FSDP2),
    ("context_parallel_size", (1,), _FSDP2),
    ("custom_parallel_plan", (None,), _FSDP2),
]
VLLM_CFG = "policy.generation.vllm_cfg"
_DEFAULTS = "phalanx train grpo starts single-rank engines with vLLM's default for it"
_OWN_REFIT = "phalanx refits through its own transports, not NeMo-RL's refit servers"
_VLLM_ONLY: list[tuple[str, tuple[Any, ...], str]] = [
    ("tensor_parallel_size", (1,), _DEFAULTS),
    ("pipeline_parallel_size", (1,), _DEFAULTS),
    ("expert_parallel_size", (1,), _DEFAULTS),
    ("use_deep_gemm", (False,), _DEFAULTS),
    ("num_last_layers_in_bf16", (0,), _DEFAULTS),
    ("num_first_layers_in_bf16", (0,), _DEFAULTS),
    ("use_tqdm", (False,), "phalanx shows its own progress"),
    ("http_refit_api_key_env_var", (None,), _OWN_REFIT),
    ("http_refit_server_port", (None,), _OWN_REFIT),
    ("zmq_refit_server_port", (None,), _OWN_REFIT),
    ("reset_encoder_cache_after_weight_update", (True, False), "a reload resets it either way"),
    ("enable_vllm_metrics_logger", (False,), "phalanx does not log vLLM's metrics"),
]

RULES: dict[str, Rule] = {
    # grpo
    "grpo.num_prompts_per_step": to("prompts_per_step"),
    "grpo.num_generations_per_prompt": to("samples_per_prompt"),
    "grpo.max_num_steps": to("steps"),
    "grpo.max_num_epochs": _max_num_epochs,
    "grpo.max_rollout_turns": only(1, why="phalanx's GRPO is single-turn"),
    "grpo.normalize_rewards": only(
        True, why="phalanx always divides by the group's sample std + 1e-6, as NeMo-RL does"
    ),
    "grpo.use_leave_one_out_baseline": only(
        False, why="phalanx's baseline is the mean of the whole group"
    ),
    "grpo.overlong_filtering": only(False, why="phalanx trains on truncated responses (reward 0)"),
    "grpo.val_period": to("eval_every"),
    "grpo.val_at_start": to("eval_at_start"),
    "grpo.val_at_end": _val_at_end,
    "grpo.max_val_samples": to("eval_size"),
    "grpo.val_batch_size": _val_batch_size,
    "grpo.seed": to("seed"),
    "grpo.skip_reference_policy_logprobs_calculation": _skip_reference,
    "grpo.val_start_at": only(-1, 0, 1, why="phalanx evaluates every val_period steps from step 1"),
    "grpo.advantage_clip_low": only(None, why="phalanx does not clip advantages"),
    "grpo.advantage_clip_high": only(None, why="phalanx does not clip advantages"),
    "grpo.val_num_generations_per_prompt": only(1, why="phalanx decodes each held-out one once"),
    "grpo.stop_at_validation_metric": only(None, why="phalanx stops on steps or time"),
    "grpo.stop_at_validation_threshold": only(None, why="phalanx stops on steps or time"),
    "grpo.use_dynamic_sampling": only(False, why="phalanx trains on every group it samples"),
    "grpo.dynamic_sampling_max_gen_batches": unused("read with dynamic sampling, which is off"),
    "grpo.batch_multiplier": only(1, why="phalanx generates exactly one step's prompts"),
    "grpo.reward_shaping": unused_unless(
        "grpo.reward_shaping.enabled", why="phalanx does not shape rewards by length"
    ),
    "grpo.reward_scaling": unused_unless(
        "grpo.reward_scaling.enabled", why="phalanx does not rescale rewards"
    ),
    "grpo.adv_estimator.name": only("grpo", why="phalanx's advantage is GRPO's"),
    "grpo.adv_estimator.normalize_rewards": only(True, why="as grpo.normalize_rewards"),
    "grpo.adv_estimator.use_leave_one_out_baseline": only(
        False, why="as grpo.use_leave_one_out_baseline"
    ),
    "grpo.adv_estimator.minus_baseline": only(True, why="phalanx subtracts the group mean"),
    "grpo.seq_logprob_error_threshold": only(
        None, why="phalanx logs train/gen_logprob_error and drops no sequence on it"
    ),
    "grpo.invalid_tool_call_advantage": only(None, why="phalanx's tasks call no tools"),
    "grpo.malformed_thinking_advantage": only(None, why="phalanx's tasks have no thinking format"),
    "reward_penalties": only(False, None, why="phalanx's rewards carry no penalties"),
    **{key: to(field) for key, field in ASYNC_FIELDS.items()},
    # loss_fn
    "loss_fn.reference_policy_kl_penalty": to("kl_beta"),
    "loss_fn.reference_policy_kl_type": only("k3", why="phalanx's KL penalty is k3 (Schulman's)"),
    "loss_fn.kl_input_clamp_value": only(None, why="phalanx does not clamp the KL"),
    "loss_fn.kl_output_clamp_value": only(None, why="phalanx does not clamp the KL"),
    "loss_fn.ratio_clip_min": to("clip_eps_low"),
    "loss_fn.ratio_clip_max": to("clip_eps_high"),
    "loss_fn.ratio_clip_c": only(None, why="phalanx has no dual clipping"),
    "loss_fn.use_on_policy_kl_approximation": only(
        False, why="phalanx's KL is the plain k3 estimate"
    ),
    "loss_fn.use_importance_sampling_correction": _importance_sampling,
    "loss_fn.truncated_importance_sampling_ratio": only(
        None, why="phalanx does not truncate importance weights"
    ),
    "loss_fn.sequence_level_importance_ratios": only(False, why="phalanx's ratios are per token"),
    "loss_fn.token_level_loss": only(True, why="phalanx's loss is a mean over the batch's tokens"),
    "loss_fn.truncated_importance_sampling_type": only(None, why="no truncated weights"),
    "loss_fn.truncated_importance_sampling_ratio_min": only(None, why="no truncated weights"),
    "loss_fn.force_on_policy_ratio": _force_on_policy,
    "loss_fn.use_kl_in_reward": only(False, why="phalanx adds the KL penalty to the loss"),
    "loss_fn.use_cispo": only(False, why="phalanx's loss is the clipped policy gradient"),
    "loss_fn.disable_ppo_ratio": only(False, why="phalanx's loss is the clipped policy gradient"),
    "loss_fn.positive_example_nll_weight": only(0, why="phalanx adds no NLL term"),
    # policy
    "policy.model_name": to("model"),
    "policy.tokenizer.name": same_as("policy.model_name", "phalanx uses the model's own tokenizer"),
    "policy.tokenizer.chat_template_kwargs": only(
        None, {}, why="phalanx applies the chat template without extra arguments"
    ),
    "policy.tokenizer.use_fastokens": only(
        True, False, why="a faster encoder of the same tokens; phalanx uses transformers' own"
    ),
    "policy.hf_config_overrides": only({}, why="phalanx loads the model's config as it is"),
    "policy.offload_optimizer_for_logprob": only(
        False, why="phalanx train grpo keeps the optimizer state in memory"
    ),
    "policy.draft": unused_unless(
        "policy.draft.enabled", why="phalanx trains no speculative-decoding draft model"
    ),
    "policy.tokenizer.chat_template": only(
        "default", why="phalanx applies the tokenizer's own chat template"
    ),
    "policy.train_global_batch_size": to("train_global_batch_size"),
    "policy.train_micro_batch_size": to("train_micro_batch_size"),
    "policy.generation_batch_size": _generation_batch_size,
    "policy.logprob_batch_size": to("logprob_micro_batch_size"),
    "policy.max_total_sequence_length": to("max_total_sequence_length"),
    "policy.precision": to("precision"),
    "policy.logprob_chunk_size": to("logprob_chunk_size"),
    "policy.max_grad_norm": to("max_grad_norm"),
    "policy.make_sequence_length_divisible_by": only(
        1, why="phalanx's policy is not tensor parallel"
    ),
    **{f"policy.dtensor_cfg.{key}": only(*values, why=why) for key, values, why in _DTENSOR_ONLY},
    "policy.dtensor_cfg.lora_cfg": _lora,
    "policy.megatron_cfg": unused_unless(
        "policy.megatron_cfg.enabled", why="phalanx's policy is DTensor (FSDP2), not Megatron"
    ),
    "policy.dynamic_batching.enabled": to("dynamic_batching"),
    "policy.dynamic_batching.train_mb_tokens": _mb_tokens("policy.train_micro_batch_size"),
    "policy.dynamic_batching.logprob_mb_tokens": _mb_tokens("policy.logprob_batch_size"),
    "policy.dynamic_batching.sequence_length_round": _round,
    "policy.sequence_packing": unused_unless(
        "policy.sequence_packing.enabled",
        why="phalanx batches by length (policy.dynamic_batching) and does not pack sequences",
    ),
    "policy.optimizer.name": only("torch.optim.AdamW", why="phalanx train grpo trains with AdamW"),
    "policy.optimizer.kwargs.lr": to("lr"),
    "policy.optimizer.kwargs.weight_decay": to("weight_decay"),
    "policy.optimizer.kwargs.betas": to("adam_betas", tuple),
    "policy.optimizer.kwargs.eps": to("adam_eps"),
    "policy.optimizer.kwargs.foreach": only(
        False, why="phalanx builds AdamW with torch's default implementation"
    ),
    "policy.optimizer.kwargs.fused": only(
        False, why="phalanx builds AdamW with torch's default implementation"
    ),
    "policy.scheduler": only(None, [], why="phalanx train grpo keeps the learning rate constant"),
    "policy.generation.backend": _backend,
    "policy.generation.model_name": same_as(
        "policy.model_name", "phalanx generates with the policy's model"
    ),
    "policy.generation.max_new_tokens": to("max_new_tokens"),
    "policy.generation.temperature": to("temperature"),
    "policy.generation.top_p": to("top_p"),
    "policy.generation.top_k": only(None, -1, why="phalanx samples without top-k"),
    "policy.generation.stop_token_ids": only(
        None, why="phalanx stops at the tokenizer's eos token"
    ),
    "policy.generation.stop_strings": only(None, why="phalanx stops at the tokenizer's eos token"),
    "policy.generation.val_temperature": only(
        None, 0.0, why="phalanx evaluates with greedy decoding"
    ),
    "policy.generation.val_top_p": unused("phalanx evaluates with greedy decoding"),
    "policy.generation.val_top_k": unused("phalanx evaluates with greedy decoding"),
    "policy.generation.port_range_low": unused(
        "ports of NeMo-RL's HTTP servers; phalanx opens none"
    ),
    "policy.generation.port_range_high": unused(
        "ports of NeMo-RL's HTTP servers; phalanx opens none"
    ),
    "policy.generation.refit_transport": only(
        None, why="phalanx refits through its own transports (phalanx.refit_transport)"
    ),
    "policy.generation.refit_cfg": unused(
        "settings of NeMo-RL's refit transports (refit_transport null)"
    ),
    "policy.generation.real_quant_export_cpu_offload": unused(
        "read only for quantized (fp8) generation, which phalanx refuses"
    ),
    "policy.generation.mcore_generation_config": unused(
        "settings of NeMo-RL's Megatron generation backend (backend must be hf or vllm)"
    ),
    "policy.generation.vllm_kwargs": _vllm(to("vllm_kwargs")),
    **{
        f"{VLLM_CFG}.{key}": _vllm(into("vllm_cfg", key))
        for key in ("gpu_memory_utilization", "enforce_eager", "kv_cache_dtype", "logprobs_mode")
    },
    "policy.generation.vllm_cfg.async_engine": _vllm(to("vllm_async_engine")),
    "policy.generation.vllm_cfg.precision": _vllm(to("generation_precision")),
    "policy.generation.vllm_cfg.max_model_len": _vllm(_max_model_len),
    **{f"{VLLM_CFG}.{key}": _vllm(only(*values, why=why)) for key, values, why in _VLLM_ONLY},
    f"{VLLM_CFG}.vllm_metrics_logger_interval": unused_unless(
        f"{VLLM_CFG}.enable_vllm_metrics_logger", why="phalanx does not log vLLM's metrics"
    ),
    "policy.generation.colocated.enabled": _colocated,
    "policy.generation.colocated.resources.gpus_per_node": _generation_workers,
    "policy.generation.colocated.resources.num_nodes": only(
        None, 1, why="phalanx train grpo runs on one node"
    ),
    # checkpointing
    "checkpointing.enabled": only(
        True, why="phalanx train grpo always checkpoints (every save_period steps and the last)"
    ),
    "checkpointing.checkpoint_dir": _checkpoint_dir,
    "checkpointing.save_period": to("checkpoint_every"),
    "checkpointing.keep_top_k": only(None, why="phalanx keeps every checkpoint"),
    "checkpointing.metric_name": unused("ranks checkpoints for keep_top_k, which must be null"),
    "checkpointing.higher_is_better": unused(
        "ranks checkpoints for keep_top_k, which must be null"
    ),
    "checkpointing.checkpoint_must_save_by": only(
        None,
        why=(
            "phalanx stops on time with phalanx.time_limit_s (after the step that passes it, not "
            "before)"
        ),
    ),
    "checkpointing.model_save_format": only(
        None, why="phalanx checkpoints are torch.distributed.checkpoint shards"
    ),
    "checkpointing.save_optimizer": only(True, why="phalanx's checkpoints keep the optimizer"),
    "checkpointing.save_consolidated": only(
        False, why="phalanx checkpoints are torch.distributed.checkpoint shards"
    ),
    # logger
    "logger.log_dir": _log_dir,
    "logger.num_val_samples_to_print": only(0, why="phalanx prints no validation samples"),
    "logger.wandb_enabled": to("wandb"),
    "logger.wandb.project": _wandb_project,
    "logger.wandb.name": _wandb_name,
    "logger.wandb.log_nemo_gym_full_result_tables": only(False, why="phalanx runs no NeMo-Gym"),
    "logger.tensorboard_enabled": _tensorboard,
    "logger.tensorboard": only({}, why="phalanx's TensorBoard writer takes no options"),
    "logger.mlflow_enabled": only(False, why="phalanx does not log to MLflow"),
    "logger.mlflow": unused_unless("logger.mlflow_enabled", why="phalanx does not log to MLflow"),
    "logger.swanlab_enabled": only(False, why="phalanx does not log to SwanLab"),
    "logger.swanlab": unused_unless(
        "logger.swanlab_enabled", why="phalanx does not log to SwanLab"
    ),
    "logger.monitor_gpus": only(
        False, why="phalanx records each phase's peak memory (memory/*), not a periodic GPU monitor"
    ),
    "logger.gpu_monitoring": unused_unless(
        "logger.monitor_gpus", why="phalanx has no periodic GPU monitor"
    ),
    # data
    "data.dataset_name": _dataset,
    "data.train.dataset_name": _dataset,
    "data.train.data_path": _with_response_dataset,
    "data.train.input_key": _response_key("prompt"),
    "data.train.output_key": _response_key("answer"),
    "data.train.split_validation_size": only(
        None, why="phalanx holds out grpo.max_val_samples problems of the task"
    ),
    "data.train.seed": same_as("grpo.seed", "phalanx seeds the task with the run's seed"),
    "data.validation": only(None, why="phalanx holds out grpo.max_val_samples problems"),
    "data.num_workers": unused("dataloader processes; phalanx draws problems in the driver"),
    "data.use_multiple_dataloader": only(False, why="phalanx trains on one task"),
    "data.default.prompt_file": only(None, why="phalanx's prompt is the problem, chat-templated"),
    "data.default.system_prompt_file": _system_prompt_file,
    "data.default.processor": only(None, why="phalanx formats problems with the chat template"),
    "data.default.env_name": only(None, why="phalanx scores with the task's own verifier"),
    "data.train_data_path": _with_response_dataset,
    "data.input_key": _response_key("prompt"),
    "data.output_key": _response_key("answer"),
    "data.val_data_path": only(
        None, why="phalanx holds out grpo.max_val_samples problems of the task"
    ),
    "data.max_input_seq_length": _max_input,
    "data.prompt_file": only(
        None, why="phalanx's prompt is the task's problem in the chat template"
    ),
    "data.system_prompt_file": _system_prompt_file,
    "data.shuffle": only(True, why="phalanx draws each step's problems at random"),
    # env
    "env": refused(
        "phalanx scores responses with the task's own verifier (or phalanx.reward) in the driver, "
        "not with NeMo-RL environments"
    ),
    # cluster
    "cluster.gpus_per_node": _gpus_per_node,
    "cluster.num_nodes": only(1, why="phalanx train grpo runs on one node"),
    "cluster.master_port_range_low": unused("phalanx's workers pick free ports themselves"),
    "cluster.master_port_range_high": unused("phalanx's workers pick free ports themselves"),
    "cluster.segment_size": only(None, why="phalanx train grpo runs on one node"),
    "data_plane": unused_unless("data_plane.enabled", why="phalanx moves batches through Ray"),
    "on_policy_distillation": only(None, why="phalanx train grpo does not distil"),
}


# Sections one rule reads leaf by leaf: those a flag of the file switches on or off.
SECTION_RULES = {
    "grpo.reward_shaping",
    "grpo.reward_scaling",
    "reward_penalties",
    "data_plane",
    "policy.draft",
    "policy.generation.refit_cfg",
    "policy.generation.mcore_generation_config",
    "policy.megatron_cfg",
    "policy.sequence_packing",
    "logger.mlflow",
    "logger.swanlab",
    "logger.gpu_monitoring",
    "env",
}


__all__ = ["RULES", "SECTION_RULES"]
