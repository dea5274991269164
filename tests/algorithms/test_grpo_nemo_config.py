"""NeMo-RL's nested GRPO config files as ``phalanx train grpo --config``: the shipped
example maps onto ``GRPOConfig`` field by field, ``defaults`` parents, ``_override_`` and
OmegaConf's interpolations resolve as NeMo-RL resolves them, every key phalanx cannot
honour is named by its dotted path (all of them in one error), the flat form still works,
and ``docs/compat.md`` holds the mapping table. No Ray is started."""

from __future__ import annotations

import textwrap
from importlib.util import find_spec
from pathlib import Path

import pytest

from phalanx.algorithms import _harness as harness
from phalanx.algorithms.grpo_config import GRPOConfig
from phalanx.algorithms.grpo_nemo_config import (
    RULES,
    is_nemo_rl_config,
    load_nemo_rl_yaml,
    mapping_table,
    nemo_rl_fields,
    resolve_interpolations,
)
from phalanx.cli.main import main
from phalanx.llm.policy_config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "nemo_rl_grpo_smollm2.yaml"
POLICY_1B = ROOT / "tests" / "llm" / "data" / "nemo_rl_grpo_math_1B_policy.yaml"

pytestmark = pytest.mark.timeout(60)


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _problems(cfg: dict) -> list[str]:
    """The dotted keys a NeMo-RL config is refused for, in order."""
    with pytest.raises(ConfigError) as info:
        nemo_rl_fields(cfg, "test")
    lines = str(info.value).splitlines()[1:]
    return [line.strip().split("=")[0] for line in lines]


@pytest.mark.smoke
def test_the_example_maps_onto_grpo_config_field_by_field():
    fields = harness.read_config_file(str(EXAMPLE), GRPOConfig)
    assert fields == {
        "prompts_per_step": 8, "samples_per_prompt": 8, "steps": 100, "eval_every": 5,
        "eval_at_start": True, "eval_size": 100, "seed": 0, "async_grpo": False,
        "max_trajectory_age_steps": 1, "kl_beta": 0.0, "clip_eps_low": 0.2,
        "clip_eps_high": 0.2, "run_dir": "runs/nemo-rl-grpo-smollm2", "checkpoint_every": 10,
        "model": "smollm2-135m-instruct", "train_global_batch_size": 64,
        "train_micro_batch_size": 8, "logprob_micro_batch_size": 8,
        "max_total_sequence_length": 112, "precision": "float32", "logprob_chunk_size": None,
        "dynamic_batching": True, "max_grad_norm": 1.0, "lr": 2e-5, "weight_decay": 0.0,
        "adam_betas": (0.9, 0.999), "adam_eps": 1e-8, "generation_backend": "vllm",
        "max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0, "vllm_async_engine": False,
        "generation_precision": "float32", "placement": "shared", "task": "addition",
        "wandb": False, "num_policy_workers": 1, "num_generation_workers": 1,
        "vllm_cfg": {"gpu_memory_utilization": 0.9, "enforce_eager": False}, "vllm_kwargs": {},
    }  # fmt: skip
    cfg = GRPOConfig(**fields)
    # what the README's GRPO run uses, spelled NeMo-RL's way
    base = GRPOConfig()
    for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "lr", "kl_beta",
                 "eval_size", "eval_every", "checkpoint_every", "task", "model"):  # fmt: skip
        assert getattr(cfg, name) == getattr(base, name), name


def test_the_file_format_is_told_by_its_sections(tmp_path):
    assert is_nemo_rl_config({"grpo": {}}) and is_nemo_rl_config({"defaults": "a.yaml"})
    assert not is_nemo_rl_config({"steps": 3, "async_grpo": {"enabled": True}})
    flat = _write(tmp_path, "flat.yaml", "steps: 3\nasync_grpo: {enabled: true}\n")
    assert harness.read_config_file(flat, GRPOConfig) == {
        "steps": 3, "async_grpo": {"enabled": True}
    }  # fmt: skip


def test_defaults_overrides_and_interpolations_resolve_as_in_nemo_rl(tmp_path):
    (tmp_path / "base").mkdir()
    _write(
        tmp_path / "base",
        "parent.yaml",
        """
        grpo:
          num_prompts_per_step: 4
          num_generations_per_prompt: 2
          max_num_steps: ${mul:${grpo.num_prompts_per_step}, 10}
        policy:
          model_name: tiny
          max_total_sequence_length: 32
          train_micro_batch_size: 2
          logprob_batch_size: 4
          dynamic_batching:
            enabled: true
            train_mb_tokens: ${mul:${policy.max_total_sequence_length}, ${policy.train_micro_batch_size}}
            logprob_mb_tokens: ${mul:${..max_total_sequence_length}, ${..logprob_batch_size}}
            sequence_length_round: 16
          optimizer:
            name: torch.optim.AdamW
            kwargs: {lr: 1.0e-3, eps: 1e-8, betas: [0.8, 0.9]}
          scheduler:
            - name: torch.optim.lr_scheduler.LinearLR
        """,
    )
    child = _write(
        tmp_path,
        "child.yaml",
        """
        defaults: base/parent.yaml
        grpo:
          num_prompts_per_step: 6
        policy:
          max_total_sequence_length: 48
          scheduler: null
          optimizer:
            _override_: true
            name: torch.optim.AdamW
            kwargs: {lr: 5.0e-6}
        checkpointing:
          checkpoint_dir: runs/x-${grpo.max_num_steps}
        phalanx:
          task: tiny-addition
        """,
    )
    fields = harness.read_config_file(child, GRPOConfig)
    assert fields == {
        "prompts_per_step": 6, "samples_per_prompt": 2, "steps": 60, "model": "tiny",
        "max_total_sequence_length": 48, "train_micro_batch_size": 2,
        "logprob_micro_batch_size": 4, "dynamic_batching": True, "lr": 5e-6,
        "run_dir": "runs/x-60", "task": "tiny-addition",
    }  # fmt: skip
    assert resolve_interpolations({"a": {"b": 2, "c": "${.b}-${max:${a.b}, 3}"}}) == {
        "a": {"b": 2, "c": "2-3"}
    }
    with pytest.raises(ConfigError, match=r"^a.c: Interpolation key 'a.d' not found"):
        resolve_interpolations({"a": {"c": "${a.d}"}})
    with pytest.raises(ConfigError, match=r"^a.c: Recursive interpolation detected"):
        resolve_interpolations({"a": {"c": "${a.c}"}})


def test_every_key_phalanx_cannot_honour_is_named_at_once():
    cfg = resolve_interpolations(load_nemo_rl_yaml(str(EXAMPLE)))
    cfg["grpo"]["use_leave_one_out_baseline"] = True
    cfg["loss_fn"]["ratio_clip_c"] = 3.0
    cfg["policy"]["generation"]["vllm_cfg"]["enforce_eager"] = True
    cfg["policy"]["generation"]["vllm_cfg"]["tensor_parallel_size"] = 2
    cfg["policy"]["generation"]["vllm_cfg"]["swap_space"] = 4
    cfg["policy"]["megatron_cfg"] = {"enabled": True, "tensor_model_parallel_size": 2}
    cfg["policy"]["dynamic_batching"]["train_mb_tokens"] = 4096
    cfg["env"] = {"math": {"num_workers": 8}}
    cfg["data"]["dataset_name"] = "OpenMathInstruct-2"
    cfg["logger"]["mlflow_enabled"] = True
    cfg["sft"] = {"max_num_steps": 1}
    assert _problems(cfg) == [
        "grpo.use_leave_one_out_baseline",
        "loss_fn.ratio_clip_c",
        "policy.megatron_cfg.enabled",
        "policy.dynamic_batching.train_mb_tokens",
        "policy.generation.vllm_cfg.tensor_parallel_size",
        "policy.generation.vllm_cfg.swap_space",
        "data.dataset_name",
        "logger.mlflow_enabled",
        "env.math.num_workers",
        "sft",
    ]
    with pytest.raises(ConfigError) as info:
        nemo_rl_fields(cfg, "--config run.yaml")
    text = str(info.value)
    assert text.startswith("--config run.yaml: 10 NeMo-RL key(s) phalanx cannot honour")
    assert (
        "policy.generation.vllm_cfg.tensor_parallel_size=2: only 1: phalanx train grpo starts "
        "single-rank engines" in text
    )
    assert (
        "policy.dynamic_batching.train_mb_tokens=4096: phalanx's budget is "
        "policy.train_micro_batch_size x 112 = 896" in text
    )


def test_nemo_rl_policy_section_of_grpo_math_1B_is_read_key_by_key():
    """NeMo-RL's own ``policy`` section of grpo_math_1B.yaml: what maps, and the keys
    refused (its LR schedule, sequence packing, sampled validation, vLLM's metrics logger
    and progress bar); its engine options reach the run's ``vllm_cfg``."""
    policy = load_nemo_rl_yaml(str(POLICY_1B))["policy"]
    cfg = resolve_interpolations({"policy": policy})
    vllm = "policy.generation.vllm_cfg."
    assert _problems(cfg) == [
        "policy.sequence_packing.enabled",
        "policy.scheduler",
        "policy.generation.val_temperature",
        *(
            vllm + k
            for k in (
                "use_tqdm",
                "enable_vllm_metrics_logger",
            )
        ),  # fmt: skip
    ]
    policy["sequence_packing"]["enabled"] = False
    del policy["scheduler"]
    policy["generation"]["val_temperature"] = 0.0
    policy["generation"]["vllm_cfg"].update(use_tqdm=False, enable_vllm_metrics_logger=False)
    fields = nemo_rl_fields(resolve_interpolations({"policy": policy}), "test")
    assert fields["model"] == policy["model_name"]
    assert (fields["precision"], fields["generation_precision"]) == ("bfloat16", "bfloat16")
    assert (fields["train_global_batch_size"], fields["train_micro_batch_size"]) == (512, 4)
    assert (fields["max_new_tokens"], fields["max_total_sequence_length"]) == (512, 512)
    assert (fields["lr"], fields["weight_decay"], fields["adam_eps"]) == (5e-6, 0.01, 1e-8)
    assert fields["dynamic_batching"] is False and fields["generation_backend"] == "vllm"
    assert fields["vllm_cfg"] == {
        "kv_cache_dtype": "auto", "logprobs_mode": "processed_logprobs",
        "gpu_memory_utilization": 0.6, "enforce_eager": False,
    }  # fmt: skip


def test_colocation_and_cluster_size_set_the_workers_and_placement():
    def read(colocated, cluster_gpus, gen_gpus=None):
        gen = {"backend": "hf", "colocated": {"enabled": colocated,
                                              "resources": {"gpus_per_node": gen_gpus}}}  # fmt: skip
        cfg = {"policy": {"generation": gen}, "cluster": {"gpus_per_node": cluster_gpus}}
        f = nemo_rl_fields(cfg, "test")
        return f["placement"], f["num_policy_workers"], f["num_generation_workers"]

    assert read(True, 2) == ("shared", 2, 2)
    assert read(False, 3, 1) == ("disaggregated", 2, 1)
    assert _problems(
        {"policy": {"generation": {"colocated": {"enabled": False, "resources": {"gpus_per_node": 2}}}},
         "cluster": {"gpus_per_node": 2}}
    ) == ["cluster.gpus_per_node"]  # fmt: skip


def test_a_field_set_twice_and_tied_keys_are_refused(tmp_path):
    cfg = {"grpo": {"max_num_steps": 5, "async_grpo": {"enabled": False}},
           "phalanx": {"steps": 6, "eval_every": 0}}  # fmt: skip
    assert _problems(cfg) == ["phalanx.steps"]
    cfg["phalanx"] = {"async": True, "lr": 0.1}  # flag spellings: async_grpo, lr
    with pytest.raises(ConfigError) as info:
        nemo_rl_fields(cfg, "t", GRPOConfig)
    assert "phalanx.async_grpo=True: grpo.async_grpo.enabled sets async_grpo too" in str(info.value)
    cfg["phalanx"] = {"lr": 0.1}
    assert nemo_rl_fields(cfg, "t", GRPOConfig) == {"steps": 5, "async_grpo": False, "lr": 0.1}
    assert nemo_rl_fields({"grpo": {"val_period": 0, "val_at_end": False}}, "t") == {
        "eval_every": 0
    }
    assert _problems({"grpo": {"val_period": 0, "val_at_end": True}}) == ["grpo.val_at_end"]
    jsonl = {"dataset_name": "ResponseDataset", "train_data_path": "t.jsonl"}
    assert _problems({"grpo": {"max_num_epochs": 1}, "data": jsonl}) == ["grpo.max_num_epochs"]
    assert nemo_rl_fields(
        {"data": {**jsonl, "input_key": "prompt", "output_key": "answer"}}, "t"
    ) == {"task": "t.jsonl"}
    assert _problems({"data": {**jsonl, "input_key": "input"}}) == ["data.input_key"]
    assert _problems({"loss_fn": {"use_importance_sampling_correction": False},
                      "grpo": {"async_grpo": {"enabled": True}}}) == [
        "loss_fn.use_importance_sampling_correction"
    ]  # fmt: skip
    prompt = _write(tmp_path, "system.txt", "Answer with a number.\n")
    assert nemo_rl_fields({"data": {"system_prompt_file": prompt}}, "t") == {
        "system_prompt": "Answer with a number."
    }


@pytest.mark.smoke
def test_cli_exits_1_naming_the_dotted_key(tmp_path, capsys):
    run_dir = tmp_path / "run"
    text = EXAMPLE.read_text().replace(
        "      tensor_parallel_size: 1", "      tensor_parallel_size: 2"
    )
    text = text.replace('"runs/nemo-rl-grpo-smollm2"', f'"{run_dir}"')
    run = _write(tmp_path, "run.yaml", text)
    assert main(["train", "grpo", "--config", run]) == 1
    err = capsys.readouterr().err
    assert f"--config {run}: 1 NeMo-RL key(s) phalanx cannot honour" in err
    assert "policy.generation.vllm_cfg.tensor_parallel_size=2: only 1" in err
    assert not run_dir.exists()  # nothing started


def test_engine_options_need_the_vllm_backend():
    for name in ("vllm_cfg", "vllm_kwargs"):
        with pytest.raises(ConfigError, match=f"^{name} {{'x': 1}} needs generation_backend"):
            GRPOConfig(**{name: {"x": 1}}).validate()


def test_docs_compat_holds_the_mapping_table():
    doc = (ROOT / "docs" / "compat.md").read_text()
    assert mapping_table() in doc
    assert len(RULES) == mapping_table().count("\n| `")


# The sections besides `policy` of NeMo-RL's grpo_math_1B.yaml at the commit
# tests/llm/data/nemo_rl_grpo_math_1B_policy.yaml is pinned to, key for key.
MATH_1B_REST = {
    "grpo": {
        "num_prompts_per_step": 32, "num_generations_per_prompt": 16, "max_rollout_turns": 1,
        "max_num_epochs": 1, "max_num_steps": 1000000, "normalize_rewards": True,
        "use_leave_one_out_baseline": True, "val_period": 10, "val_start_at": -1,
        "val_at_start": False, "val_at_end": False, "overlong_filtering": False,
        "advantage_clip_low": None, "advantage_clip_high": None, "max_val_samples": 256,
        "val_num_generations_per_prompt": 1, "stop_at_validation_metric": None,
        "stop_at_validation_threshold": None, "val_batch_size": 256, "seed": 42,
        "use_dynamic_sampling": False, "dynamic_sampling_max_gen_batches": 10,
        "batch_multiplier": 1,
        "reward_shaping": {"enabled": False, "overlong_buffer_length": 128,
                           "overlong_buffer_penalty": 1,
                           "max_response_length": "${policy.max_total_sequence_length}",
                           "stop_properly_penalty_coef": None},
        "adv_estimator": {"name": "grpo", "normalize_rewards": "${grpo.normalize_rewards}",
                          "use_leave_one_out_baseline": "${grpo.use_leave_one_out_baseline}",
                          "minus_baseline": True},
        "reward_scaling": {"enabled": False, "source_min": 0.0, "source_max": 1.0,
                           "target_min": 0.0, "target_max": 1.0},
        "seq_logprob_error_threshold": None, "invalid_tool_call_advantage": None,
        "malformed_thinking_advantage": None,
        "async_grpo": {"enabled": False, "max_trajectory_age_steps": 1,
                       "max_generation_failures": 0, "in_flight_weight_updates": False,
                       "recompute_kv_cache_after_weight_updates": False},
    },
    "reward_penalties": {"penalize_duplicated_reasoning": False,
                         "penalize_empty_final_answer": False, "penalize_unwanted_tokens": False,
                         "penalize_malformed_think_tag": False, "token_ids": None},
    "loss_fn": {
        "reference_policy_kl_penalty": 0.01, "reference_policy_kl_type": "k3",
        "kl_input_clamp_value": 20.0, "kl_output_clamp_value": 10.0, "ratio_clip_min": 0.2,
        "ratio_clip_max": 0.2, "ratio_clip_c": None, "use_on_policy_kl_approximation": False,
        "use_importance_sampling_correction": False, "truncated_importance_sampling_type": None,
        "truncated_importance_sampling_ratio": None,
        "truncated_importance_sampling_ratio_min": None,
        "sequence_level_importance_ratios": False, "token_level_loss": True,
        "force_on_policy_ratio": False, "use_kl_in_reward": False, "use_cispo": False,
        "disable_ppo_ratio": False, "positive_example_nll_weight": 0.0,
    },
    "checkpointing": {
        "enabled": True, "checkpoint_dir": "results/grpo", "metric_name": "val:accuracy",
        "higher_is_better": True, "keep_top_k": 3, "save_period": 10,
        "checkpoint_must_save_by": None, "model_save_format": "safetensors",
        "save_consolidated": False, "save_optimizer": True,
    },
    "data": {
        "max_input_seq_length": "${policy.max_total_sequence_length}", "shuffle": True,
        "num_workers": 1, "use_multiple_dataloader": False,
        "train": {"dataset_name": "OpenMathInstruct-2", "split_validation_size": 0.05,
                  "seed": "${grpo.seed}"},
        "validation": None,
        "default": {"prompt_file": "examples/prompts/cot.txt", "system_prompt_file": None,
                    "processor": "math_hf_data_processor", "env_name": "math"},
    },
    "env": {"math": {"num_workers": 8, "math_verify_impl": "hf_math_verify"}},
    "logger": {
        "log_dir": "logs", "num_val_samples_to_print": 0, "wandb_enabled": False,
        "tensorboard_enabled": False, "mlflow_enabled": False, "swanlab_enabled": False,
        "monitor_gpus": True,
        "wandb": {"project": "grpo-dev", "name": "grpo-dev-logger",
                  "log_nemo_gym_full_result_tables": False},
        "swanlab": {"project": "grpo-dev", "name": "grpo-dev-logger"},
        "tensorboard": {},
        "mlflow": {"experiment_name": "grpo-dev", "run_name": "grpo-dev-logger",
                   "tracking_uri": "http://localhost:5000"},
        "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
    },
    "cluster": {"gpus_per_node": 1, "num_nodes": 1, "master_port_range_low": 1400,
                "master_port_range_high": 1999, "segment_size": None},
    "data_plane": {"enabled": False, "impl": "transfer_queue", "backend": "simple",
                   "storage_capacity": 1000000, "num_storage_units": 2,
                   "claim_meta_poll_interval_s": 0.5, "global_segment_size": 549755813888,
                   "local_buffer_size": 68719476736},
    "on_policy_distillation": None,
}  # fmt: skip


def test_nemo_rl_grpo_math_1B_is_refused_exactly_where_phalanx_differs():
    """The whole of NeMo-RL's grpo_math_1B.yaml (its policy section from tests/llm/data):
    each refusal is a real difference (its leave-one-out baseline, no evaluation at the
    end, KL clamps, top-3
    checkpoints in safetensors, a downloaded dataset with a CoT prompt file, the math
    environment, the GPU monitor), nothing else."""
    cfg = {**MATH_1B_REST, "policy": load_nemo_rl_yaml(str(POLICY_1B))["policy"]}
    problems = _problems(resolve_interpolations(cfg))
    assert [p for p in problems if not p.startswith("policy.")] == [
        "grpo.use_leave_one_out_baseline",
        "grpo.val_at_end",
        "grpo.adv_estimator.use_leave_one_out_baseline",
        "loss_fn.kl_input_clamp_value",
        "loss_fn.kl_output_clamp_value",
        "checkpointing.keep_top_k",
        "checkpointing.model_save_format",
        "data.train.dataset_name",
        "data.train.split_validation_size",
        "data.default.prompt_file",
        "data.default.processor",
        "data.default.env_name",
        "env.math.num_workers",
        "env.math.math_verify_impl",
        "logger.log_dir",
        *(["logger.tensorboard_enabled"] if find_spec("tensorboard") else []),
        "logger.monitor_gpus",
    ]
