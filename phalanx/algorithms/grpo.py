"""GRPO on a language model, readable top to bottom.

One step: sample ``prompts_per_step`` problems from the task -> ``samples_per_prompt``
responses each from the generation workers (prompts through the tokenizer's chat template)
-> reward each response -> advantages normalised within each prompt's group -> log-probs
of the reference policy (when ``kl_beta > 0``) -> clipped policy-gradient loss with a k3
KL penalty -> one optimizer step on the FSDP2 policy -> refit the generation workers.

With one optimizer step per GRPO step (``train_global_batch_size`` unset) the policy that
trains is exactly the one that generated, so the "old" log-probs of the ratio are the
training forward's own (detached), as TRL does: no separate log-prob pass. Every
``eval_every`` steps the generation workers decode the task's held-out split greedily
and ``eval/accuracy`` goes to ``metrics.jsonl`` and the progress line.

The model is a Hugging Face folder, a ``.gguf`` file (converted once), a model fetched
with ``phalanx models fetch``, or ``tiny``: a 0.2M-parameter model built from scratch and
trained on single-digit addition after a supervised warm-up (``GRPOConfig.tiny()``),
the machinery demo. For a pretrained model the reference policy is the model itself.

    phalanx models fetch smollm2-135m-instruct
    phalanx train grpo --model smollm2-135m-instruct --task addition --steps 60
    phalanx train grpo --model tiny --steps 40
"""

from __future__ import annotations

import functools
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import numpy as np
import torch

from phalanx.algorithms.flags import name_the_flag

TINY = "tiny"


@dataclass
class GRPOConfig:
    """GRPO hyperparameters and run options (defaults: a small pretrained instruct model)."""

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
    eval_size: int = 200
    """problems in the held-out split (greedy accuracy on them is eval/accuracy)"""
    eval_every: int = 10
    """GRPO steps between held-out evaluations (0: never; also run at the start and end)"""
    # --- sampling
    steps: int = 100
    """GRPO steps to run (with --resume: the total, counting the steps already done)"""
    prompts_per_step: int = 16
    """problems per step"""
    samples_per_prompt: int = 8
    """responses per problem (the group whose rewards are normalised together)"""
    max_new_tokens: int = 192
    """generation limit; a response that reaches it is truncated and earns no reward"""
    temperature: float = 1.0
    """sampling temperature of the training rollouts"""
    top_p: float = 1.0
    """nucleus sampling of the training rollouts"""
    # --- optimisation
    lr: float = 3e-6
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas"""
    adam_eps: float = 1e-8
    """AdamW epsilon"""
    max_grad_norm: float | None = 1.0
    """gradient clipping (None: none)"""
    kl_beta: float = 0.01
    """weight of the k3 KL penalty to the reference policy (0: no reference pass at all)"""
    clip_eps_low: float = 0.2
    """ratio clipping below 1"""
    clip_eps_high: float = 0.2
    """ratio clipping above 1"""
    train_global_batch_size: int | None = None
    """rows per optimizer step (None: the whole step's batch, one on-policy update)"""
    train_micro_batch_size: int = 4
    """rows per forward/backward on one policy rank"""
    logprob_micro_batch_size: int = 8
    """rows per forward when computing reference log-probs"""
    logprob_chunk_size: int | None = None
    """positions per log-softmax chunk in the policy's log-prob pass (None: whole rows)"""
    max_total_sequence_length: int | None = None
    """longest prompt + response the policy accepts (None: longest prompt of the task +
    max_new_tokens, rounded up to a multiple of 16)"""
    precision: Literal["float32", "bfloat16"] = "float32"
    """compute dtype of the policy's forward/backward (FSDP2 mixed precision)"""
    generation_precision: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of the generation workers (auto: bfloat16 when the CPU/GPU supports it)"""
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
    refit_transport: str = "ipc"
    """how new weights reach the generation workers (ipc, collective, ...)"""
    policy_timeout_s: float = 1800.0
    """longest wait for one policy call (train, log-probs, checkpoint)"""
    generation_timeout_s: float = 1800.0
    """longest wait for one generation call"""
    # --- run
    run_dir: str = "runs/grpo"
    """metrics.jsonl, config.json, checkpoints and curve.png go here"""
    checkpoint_every: int = 10
    """steps between checkpoints (and the last step)"""
    time_limit_s: float | None = None
    """stop after the step during which this much wall time passed (evaluating and
    checkpointing there); None: run all steps"""
    resume: bool = False
    """continue from the newest checkpoint under run_dir/checkpoints"""
    seed: int = 0
    """seeds the task, sampling and torch"""
    progress: bool = True
    """live progress display (--no-progress: none)"""

    @classmethod
    def tiny(cls, **overrides: Any) -> GRPOConfig:
        """The tiny-model preset: random init, single-digit addition, a supervised warm-up.

        32 x 8 samples a step: fewer make the per-step gradient so noisy that Adam's
        per-parameter steps move the policy at random (measured: update nearly orthogonal to
        the reward gradient with 8 x 8 at lr 1e-3).
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
            num_policy_workers=2,
            generation_precision="float32",
            policy_timeout_s=300.0,
            generation_timeout_s=300.0,
        )
        base.update(overrides)
        return cls(**base)

    def validate(self) -> None:
        for name in (
            "steps",
            "prompts_per_step",
            "samples_per_prompt",
            "max_new_tokens",
            "train_micro_batch_size",
            "logprob_micro_batch_size",
            "num_policy_workers",
            "num_generation_workers",
            "warmup_batch_size",
            "checkpoint_every",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("eval_every", "eval_size", "warmup_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        for name in ("num_threads", "max_total_sequence_length", "logprob_chunk_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if self.samples_per_prompt < 2:
            raise ValueError(
                "samples_per_prompt must be >= 2 (advantages are relative within a group), "
                f"got {self.samples_per_prompt}"
            )
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be > 0 or None, got {self.time_limit_s!r}")
        for name in ("lr", "warmup_lr", "temperature", "policy_timeout_s", "generation_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("kl_beta", "clip_eps_low", "clip_eps_high", "format_reward", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.eval_every and not self.eval_size:
            raise ValueError("eval_every > 0 needs eval_size > 0 (the held-out split)")
        batch = self.prompts_per_step * self.samples_per_prompt
        gbs = self.train_global_batch_size or batch
        if batch % gbs:
            raise ValueError(
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


# ----------------------------------------------------------------------------- helpers


def derive_max_total_sequence_length(
    max_prompt_tokens: int, max_new_tokens: int, model_max_positions: int | None = None
) -> int:
    """Longest prompt + ``max_new_tokens``, rounded up to a multiple of 16 and capped by
    nothing: a model whose ``max_position_embeddings`` is shorter is an error."""
    if max_prompt_tokens < 1 or max_new_tokens < 1:
        raise ValueError(
            f"max_prompt_tokens ({max_prompt_tokens}) and max_new_tokens ({max_new_tokens}) "
            "must be positive"
        )
    need = max_prompt_tokens + max_new_tokens
    if model_max_positions is not None and need > model_max_positions:
        raise ValueError(
            f"longest prompt {max_prompt_tokens} + max_new_tokens {max_new_tokens} = {need} "
            f"tokens exceeds the model's max_position_embeddings {model_max_positions}"
        )
    rounded = -(-need // 16) * 16
    if model_max_positions is not None:
        rounded = min(rounded, model_max_positions)
    return rounded


def group_normalized_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + 1e-6); groups are consecutive rows."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    g = rewards.view(-1, group_size)
    adv = (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)
    return adv.view(-1)


def answer_probability(policy, tokenizer, pairs) -> float:
    """Mean over ``pairs`` of the policy's probability of the exact answer and end token
    (the tiny task's noise-free view of the expected 0/1 reward, from log-probs)."""
    from phalanx.llm.tiny_task import sft_batch

    data = sft_batch(tokenizer, pairs)
    logprobs = policy.get_logprobs(data)["logprobs"]
    return float(torch.exp((logprobs * data["token_mask"]).sum(1)).mean())


def _retry_once_after_death(call: Callable[[], Any], timeout: float) -> list[Any]:
    """``call().wait(timeout)``, started once more if a worker died under it: the group
    restarts (and refits) a dead worker before the second call reaches it."""
    from phalanx._base.errors import WorkerDiedError

    try:
        return call().wait(timeout=timeout)
    except WorkerDiedError:
        return call().wait(timeout=timeout)


def _generate(gen_group, data, timeout: float = 300.0, greedy: bool = False):
    """Split a prompt batch over the generation workers and put the outputs back in order."""
    from phalanx.data import BatchedDataDict

    shards = data.shard_by_batch_size(gen_group.world_size, allow_uneven_shards=True)
    calls = [(r, (s,), {"greedy": greedy}) for r, s in enumerate(shards)]
    outs = _retry_once_after_death(lambda: gen_group.call_ranks("generate", calls), timeout)
    return BatchedDataDict.from_batches(outs, pad_value_dict={"output_ids": 0})


def score(tokenizer, task, examples, prompts, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards [B] of generated responses, and which were truncated (no stop token)."""
    B = len(examples)
    rewards, truncated = torch.zeros(B), torch.zeros(B, dtype=torch.bool)
    for i in range(B):
        n, g = int(prompts["input_lengths"][i]), int(gen["generation_lengths"][i])
        tokens = gen["output_ids"][i, n : n + g]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        truncated[i] = g == 0 or int(tokens[-1]) != tokenizer.eos_token_id
        rewards[i] = task.reward(text, examples[i], bool(truncated[i]))
    return rewards, truncated


# -- per-phase peak memory: the kernel's high-water mark of each process, reset per phase


def _reset_peak_rss(worker: Any = None) -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _peak_rss_gb(worker: Any = None) -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    import psutil

    return psutil.Process().memory_info().rss / 2**30


class _PhaseMemory:
    """Peak resident memory of every worker of ``groups`` during each phase (GB, max over
    ranks): the kernel's per-process high-water mark, reset when a phase starts."""

    def __init__(self, groups: dict[str, Any]):
        self.groups = groups

    def _all(self, fn) -> list[float]:
        out = []
        for g in self.groups.values():
            calls = [(r, (), {}) for r in range(g.world_size)]
            label = fn.__name__.strip("_")
            out.extend(
                _retry_once_after_death(functools.partial(g.apply, fn, calls, label=label), 60)
            )
        return out

    def reset(self) -> None:
        self._all(_reset_peak_rss)

    def peak(self) -> float:
        return max(self._all(_peak_rss_gb))


def _set_threads(worker: Any, n: int) -> int:
    torch.set_num_threads(int(n))
    return torch.get_num_threads()


def _set_worker_lr(worker: Any, lr: float) -> None:
    for group in worker.optimizer.param_groups:
        group["lr"] = lr
        group["initial_lr"] = lr
    if worker.scheduler is not None:
        worker.scheduler.base_lrs = [lr for _ in worker.scheduler.base_lrs]


def _reset_worker_optimizer(worker: Any, lr: float) -> None:
    worker._init_optimizer()
    _set_worker_lr(worker, lr)


def _on_policy(policy: Any, fn: Any, lr: float, label: str) -> None:
    g = policy.worker_group
    g.apply(fn, [(r, (lr,), {}) for r in range(g.world_size)], label=label).wait(timeout=120)


def _latest_checkpoint(run_dir: str) -> str | None:
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    steps = sorted(
        (int(d.split("_")[1]), d)
        for d in os.listdir(root)
        if d.startswith("step_") and os.path.exists(os.path.join(root, d, "state.json"))
    )
    return os.path.join(root, steps[-1][1]) if steps else None


def _save_hf_model(policy, base_dir: str, out_dir: str, tokenizer) -> None:
    """Write the policy's current weights as a Hugging Face model (save_pretrained)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.load_state_dict(policy.state_dict())
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _to_rng_state(state: Any) -> tuple:
    """JSON turns random.Random's state tuple into lists; turn it back."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def plot_curve(metrics_path: str, out_path: str, title: str = "GRPO") -> str | None:
    """Training reward (mean +- std) and held-out greedy accuracy per step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    train_rows = [r for r in rows if "reward_mean" in r]
    eval_rows = [r for r in rows if "eval/accuracy" in r]
    if not train_rows and not eval_rows:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    if train_rows:
        x = [r["step"] for r in train_rows]
        m = np.array([r["reward_mean"] for r in train_rows])
        s = np.array([r["reward_std"] for r in train_rows])
        ax.plot(x, m, label="training reward (mean)", color="tab:blue")
        ax.fill_between(x, m - s, m + s, alpha=0.15, color="tab:blue")
    if eval_rows:
        ax.plot(
            [r["step"] for r in eval_rows],
            [r["eval/accuracy"] for r in eval_rows],
            "o-",
            color="tab:red",
            label="held-out greedy accuracy",
        )
    ax.set_xlabel("GRPO step")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


# ----------------------------------------------------------------------------- the algorithm


def _prepare_model(cfg: GRPOConfig) -> str:
    """The Hugging Face folder of ``cfg.model`` (building the tiny one, converting a GGUF)."""
    from phalanx.llm.models import resolve_model
    from phalanx.llm.tiny_task import build_tiny_model

    if cfg.model == TINY:
        base_dir = os.path.join(cfg.run_dir, "base_model")
        if not os.path.exists(os.path.join(base_dir, "config.json")):
            build_tiny_model(base_dir)
        return base_dir
    return resolve_model(cfg.model, quiet=not cfg.progress)


def _max_prompt_tokens(tokenizer, task, system_prompt: str | None, seed: int) -> int:
    """Longest chat-formatted prompt of the held-out split and of 512 training-distribution
    draws (from a separate RNG, so the training stream is untouched)."""
    from phalanx.llm.chat import build_prompt_ids
    from phalanx.llm.tasks import JsonlTask

    if isinstance(task, JsonlTask):
        probe = task.examples
    else:
        rng = random.Random(seed + 104729)
        probe = task.heldout + [task._draw(rng) for _ in range(512)]
    return max(len(build_prompt_ids(tokenizer, e.prompt, system_prompt)) for e in probe)


def _generation_dtype(cfg: GRPOConfig) -> str:
    if cfg.generation_precision != "auto":
        return cfg.generation_precision
    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    try:
        return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
    except (AttributeError, RuntimeError):
        return "float32"


def evaluate_accuracy(generation, tokenizer, task, system_prompt, timeout: float) -> dict:
    """Greedy accuracy (reward 1) on the held-out split, with truncation and length."""
    import phalanx as px
    from phalanx.llm.chat import encode_chat_prompts

    examples = task.heldout
    ids, lengths = encode_chat_prompts(tokenizer, [e.prompt for e in examples], system_prompt)
    prompts = px.BatchedDataDict(input_ids=ids, input_lengths=lengths)
    gen = _generate(generation, prompts, timeout=timeout, greedy=True)
    rewards, truncated = score(tokenizer, task, examples, prompts, gen)
    return {
        "eval/accuracy": float((rewards >= 1.0).float().mean()),
        "eval/reward": float(rewards.mean()),
        "eval/truncated": float(truncated.float().mean()),
        "eval/response_length": float(gen["generation_lengths"].float().mean()),
    }


def train(cfg: GRPOConfig, cluster: Any = None) -> dict[str, Any]:
    """Run GRPO; returns the per-step metrics, the evaluations and the run directory."""
    from transformers import AutoConfig, AutoTokenizer

    import phalanx as px
    from phalanx.llm.chat import encode_chat_prompts
    from phalanx.llm.generation import HFGenerationWorker
    from phalanx.llm.loss import ClippedPGLossConfig, NLLLoss
    from phalanx.llm.onpolicy_loss import OnPolicyPGLossFn
    from phalanx.llm.policy import Policy
    from phalanx.llm.refit import Refitter
    from phalanx.llm.tasks import make_task
    from phalanx.llm.tiny_task import sft_batch
    from phalanx.observe.metrics import MetricsLogger
    from phalanx.observe.progress import Progress

    t_start = time.perf_counter()
    cfg.validate()
    os.makedirs(cfg.run_dir, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    ckpt = _latest_checkpoint(cfg.run_dir) if cfg.resume else None
    if cfg.resume and ckpt is None:
        raise ValueError(f"resume: no checkpoint under {cfg.run_dir}/checkpoints")
    if not cfg.resume and _latest_checkpoint(cfg.run_dir) is not None:
        raise ValueError(
            f"run_dir {cfg.run_dir} already has checkpoints; pass --resume to continue it or "
            "choose another --run-dir"
        )

    # -- model, tokenizer, task ----------------------------------------------------------
    base_dir = _prepare_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    task = make_task(cfg.task, cfg.seed, cfg.eval_size, cfg.reward, cfg.format_reward)
    model_max = getattr(AutoConfig.from_pretrained(base_dir), "max_position_embeddings", None)
    max_prompt = _max_prompt_tokens(tokenizer, task, cfg.system_prompt, cfg.seed)
    need = derive_max_total_sequence_length(max_prompt, cfg.max_new_tokens, model_max)
    max_seq = cfg.max_total_sequence_length or need
    if max_seq < max_prompt + cfg.max_new_tokens:
        raise ValueError(
            f"max_total_sequence_length {max_seq} is shorter than the longest prompt "
            f"({max_prompt} tokens) + max_new_tokens {cfg.max_new_tokens}"
        )
    # The tiny model's reference is its warm-up result, kept as a folder for resuming.
    sft_dir = os.path.join(cfg.run_dir, "sft_model")
    warm = cfg.warmup_steps > 0
    batch = cfg.prompts_per_step * cfg.samples_per_prompt
    gbs = cfg.train_global_batch_size or batch
    on_policy = gbs == batch
    cores = os.cpu_count() or 1
    policy_threads = cfg.num_threads or max(1, cores // cfg.num_policy_workers)
    gen_threads = cfg.num_threads or max(1, cores // cfg.num_generation_workers)
    policy_cfg: dict[str, Any] = {
        "model_name": sft_dir if (ckpt and warm) else base_dir,
        "train_global_batch_size": gbs,
        "train_micro_batch_size": cfg.train_micro_batch_size,
        "logprob_batch_size": cfg.logprob_micro_batch_size,
        "max_total_sequence_length": max_seq,
        "precision": cfg.precision,
        "max_grad_norm": cfg.max_grad_norm,
        "optimizer": {
            "name": "torch.optim.AdamW",
            "kwargs": {
                "lr": cfg.lr,
                "weight_decay": cfg.weight_decay,
                "betas": tuple(cfg.adam_betas),
                "eps": cfg.adam_eps,
            },
        },
        "seed": cfg.seed,
    }
    if cfg.logprob_chunk_size:
        policy_cfg["logprob_chunk_size"] = cfg.logprob_chunk_size
    cluster = cluster if cluster is not None else px.Cluster()
    bar = Progress(
        total=cfg.steps,
        start=0,
        title=f"GRPO {cfg.task}",
        enabled=cfg.progress,
        keys=["reward_mean", "accuracy", "eval/accuracy", "response_length", "time/step"],
    )
    with bar.waiting(f"{cfg.num_policy_workers} policy worker(s) loading {cfg.model}"):
        policy = Policy(
            cluster,
            policy_cfg,
            tokenizer,
            num_workers=cfg.num_policy_workers,
            name_prefix=f"grpo_policy_{os.getpid()}",
            weights_path=os.path.join(ckpt, "weights") if ckpt else None,
            optimizer_path=os.path.join(ckpt, "optim") if ckpt else None,
            init_reference_model=cfg.kl_beta > 0 or warm,
            timeout_s=cfg.policy_timeout_s,
        )
    gen_cfg = {
        "model_name": base_dir,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "seed": cfg.seed,
        "precision": _generation_dtype(cfg),
        "num_threads": gen_threads,
    }
    generation = None
    metrics = MetricsLogger(cfg.run_dir, use_tensorboard=False)
    history: list[dict[str, Any]] = []
    evals: list[tuple[int, float]] = []
    p_correct: list[tuple[int, float]] = []
    start_step = 0
    try:
        with bar.waiting(f"{cfg.num_generation_workers} generation worker(s) loading"):
            generation = HFGenerationWorker.create_group(gen_cfg, tokenizer).launch(
                cluster,
                px.NodePlacement(num_workers=cfg.num_generation_workers),
                name=f"grpo_generation_{os.getpid()}",
                # A dead generation worker is restarted, and refitted before it is called.
                restart_policy=px.RestartPolicy(),
            )
        pg = policy.worker_group
        pg.apply(
            _set_threads,
            [(r, (policy_threads,), {}) for r in range(pg.world_size)],
            label="threads",
        ).wait(timeout=60)
        memory = _PhaseMemory({"policy": pg, "generation": generation})
        refitter = Refitter(policy, generation, cfg.refit_transport)
        metrics.log_config(
            {**asdict(cfg), "model_dir": base_dir, "max_total_sequence_length": max_seq}
        )

        # -- supervised warm-up (fresh tiny runs): its result is the reference policy ----
        if ckpt is None and warm:
            _on_policy(policy, _set_worker_lr, cfg.warmup_lr, "set_lr")
            sft = {
                "gbs": cfg.warmup_batch_size,
                "mbs": cfg.warmup_batch_size // cfg.num_policy_workers,
            }
            with bar.waiting(f"supervised warm-up, {cfg.warmup_steps} steps"):
                for i in range(cfg.warmup_steps):
                    pairs = [(e.prompt, e.answer) for e in task.sample(cfg.warmup_batch_size)]
                    out = policy.train(sft_batch(tokenizer, pairs), NLLLoss(), **sft)
                    if i == cfg.warmup_steps - 1 or i % 10 == 0:
                        metrics.log(-cfg.warmup_steps + i, {"sft_loss": float(out["loss"].mean())})
                pg.call("update_reference_model").wait(timeout=300)
                _save_hf_model(policy, base_dir, sft_dir, tokenizer)
                _on_policy(policy, _reset_worker_optimizer, cfg.lr, "reset_optimizer")
        elif ckpt is not None:
            with open(os.path.join(ckpt, "state.json")) as f:
                state = json.load(f)
            start_step = state["step"]
            task.rng.setstate(_to_rng_state(state["task_rng"]))
            torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        if start_step or warm:
            refitter.refit()  # the generators start from the base model's weights

        loss_fn = OnPolicyPGLossFn(
            ClippedPGLossConfig(cfg.clip_eps_low, cfg.clip_eps_high, cfg.kl_beta)
        )
        tiny_pairs = (
            [(e.prompt, e.answer) for e in task.heldout] if cfg.task == "tiny-addition" else None
        )

        def evaluate(step: int) -> dict[str, Any]:
            with bar.waiting(f"held-out evaluation ({len(task.heldout)} problems, greedy)"):
                t = time.perf_counter()
                row = evaluate_accuracy(
                    generation, tokenizer, task, cfg.system_prompt, cfg.generation_timeout_s
                )
                if tiny_pairs is not None:
                    row["p_correct"] = answer_probability(policy, tokenizer, tiny_pairs)
                    p_correct.append((step, row["p_correct"]))
                row["time/eval"] = time.perf_counter() - t
            evals.append((step, row["eval/accuracy"]))
            return row

        if cfg.eval_every:
            row0 = evaluate(start_step)
            metrics.log(start_step, row0)
            bar.log(f"[grpo] step {start_step}: held-out accuracy {row0['eval/accuracy']:.3f}")
        bar.update(start_step)
        for step in range(start_step + 1, cfg.steps + 1):
            times: dict[str, float] = {}
            mem: dict[str, float] = {}
            t0 = time.perf_counter()

            # 1. prompts, each repeated samples_per_prompt times (a group per prompt)
            problems = task.sample(cfg.prompts_per_step)
            ids, lengths = encode_chat_prompts(
                tokenizer, [e.prompt for e in problems], cfg.system_prompt
            )
            prompts = px.BatchedDataDict(input_ids=ids, input_lengths=lengths)
            prompts = prompts.repeat_interleave(cfg.samples_per_prompt)
            examples = [e for e in problems for _ in range(cfg.samples_per_prompt)]

            # 2. sample responses
            memory.reset()
            with bar.waiting(f"generating {batch} responses"):
                gen = _generate(generation, prompts, timeout=cfg.generation_timeout_s)
            times["generation"] = time.perf_counter() - t0
            mem["generation"] = memory.peak()

            # 3. rewards; 4. advantages normalised within each prompt's group
            rewards, truncated = score(tokenizer, task, examples, prompts, gen)
            advantages = group_normalized_advantages(rewards, cfg.samples_per_prompt)

            # 5. the training batch: loss on the generated tokens only
            T = int(gen["unpadded_sequence_lengths"].max())
            pos = torch.arange(T)[None]
            token_mask = (
                (pos >= prompts["input_lengths"][:, None])
                & (pos < gen["unpadded_sequence_lengths"][:, None])
            ).float()
            data = px.BatchedDataDict(
                input_ids=gen["output_ids"][:, :T],
                input_lengths=gen["unpadded_sequence_lengths"],
                token_mask=token_mask,
                sample_mask=torch.ones(batch),
                advantages=advantages,
            )

            # 6. log-probs: the old policy's only when several updates share a batch; the
            #    reference's only when the KL penalty is on
            t1 = time.perf_counter()
            memory.reset()
            with bar.waiting("log-probs"):
                if not on_policy:
                    data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
                if cfg.kl_beta > 0:
                    data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(data)[
                        "reference_logprobs"
                    ]
            times["logprobs"] = time.perf_counter() - t1
            if not on_policy or cfg.kl_beta > 0:
                mem["logprobs"] = memory.peak()

            # 7. policy-gradient step(s)
            t2 = time.perf_counter()
            memory.reset()
            with bar.waiting("training"):
                out = policy.train(data, loss_fn)
            times["training"] = time.perf_counter() - t2
            mem["training"] = memory.peak()

            # 8. refit the generators with the new weights
            t3 = time.perf_counter()
            with bar.waiting("refit"):
                refitter.refit()
            times["refit"] = time.perf_counter() - t3
            times["step"] = time.perf_counter() - t0

            mb = out["all_mb_metrics"]
            ntok = max(sum(mb["num_valid_tokens"]), 1)
            gen_tokens = int(gen["generation_lengths"].sum())
            groups = rewards.view(-1, cfg.samples_per_prompt)
            row = {
                "reward_mean": float(rewards.mean()),
                "reward_std": float(rewards.std()),
                "accuracy": float((rewards >= 1.0).float().mean()),
                "truncated": float(truncated.float().mean()),
                "groups_with_signal": float((groups.std(1) > 0).float().mean()),
                "loss": float(out["loss"].mean()),
                "grad_norm": float(out["grad_norm"].mean()),
                "kl": sum(mb["kl_sum"]) / ntok,
                "entropy": sum(mb["entropy_sum"]) / ntok,
                "clip_frac": sum(mb["clip_frac_sum"]) / ntok,
                "response_length": float(gen["generation_lengths"].float().mean()),
                "throughput/tokens_per_s": gen_tokens / max(times["generation"], 1e-9),
                "generation_restarts": generation.num_remote_worker_restarts(),
                "elapsed_s": time.perf_counter() - t_start,
                **{f"time/{k}": v for k, v in times.items()},
                **{f"memory/{k}_peak_gb": v for k, v in mem.items()},
            }
            out_of_time = (
                cfg.time_limit_s is not None and time.perf_counter() - t_start >= cfg.time_limit_s
            )
            last = step == cfg.steps or out_of_time
            if cfg.eval_every and (step % cfg.eval_every == 0 or last):
                row.update(evaluate(step))
            metrics.log(step, row)
            history.append({"step": step, **row})
            bar.update(
                step, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
            )
            if "eval/accuracy" in row:
                bar.log(f"[grpo] step {step}: held-out accuracy {row['eval/accuracy']:.3f}")

            # 9. checkpoint
            if step % cfg.checkpoint_every == 0 or last:
                with bar.waiting("checkpoint"):
                    _checkpoint(cfg, policy, task, step)
            if out_of_time:
                bar.log(f"[grpo] time limit {cfg.time_limit_s:.0f} s reached after step {step}")
                break
    finally:
        bar.close()
        metrics.close()
        if generation is not None:
            generation.shutdown()
        policy.shutdown()
    metrics_path = os.path.join(cfg.run_dir, "metrics.jsonl")
    curve = None
    if os.path.exists(metrics_path):
        curve = plot_curve(metrics_path, os.path.join(cfg.run_dir, "curve.png"), f"GRPO {cfg.task}")
    return {
        "history": history,
        "eval_accuracy": evals,
        "p_correct": p_correct,
        "run_dir": cfg.run_dir,
        "model_dir": base_dir,
        "curve": curve,
        "wall_s": time.perf_counter() - t_start,
    }


def _checkpoint(cfg: GRPOConfig, policy: Any, task: Any, step: int) -> None:
    path = os.path.join(cfg.run_dir, "checkpoints", f"step_{step}")
    policy.save_checkpoint(
        os.path.join(path, "weights"), os.path.join(path, "optim"), os.path.join(path, "tokenizer")
    )
    with open(os.path.join(path, "state.json"), "w") as f:
        json.dump(
            {
                "step": step,
                "task_rng": task.rng.getstate(),
                "torch_rng": torch.get_rng_state().tolist(),
                "config": asdict(cfg),
            },
            f,
        )


# ----------------------------------------------------------------------------- CLI


def _defaults(argv: list[str]) -> GRPOConfig:
    """What flags not given fall back to: the checkpoint's config (``--resume``), the tiny
    preset (``--model tiny``), or the pretrained defaults."""
    import argparse

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--model")
    pre.add_argument("--run-dir", "--run_dir", dest="run_dir")
    pre.add_argument("--resume", action="store_true")
    known, _ = pre.parse_known_args(argv)
    if known.resume:
        run_dir = known.run_dir or GRPOConfig.run_dir
        ckpt = _latest_checkpoint(run_dir)
        if ckpt is None:
            raise ValueError(f"--resume: no checkpoint under {run_dir}/checkpoints")
        with open(os.path.join(ckpt, "state.json")) as f:
            saved = json.load(f)["config"]
        names = {f.name for f in fields(GRPOConfig)}
        saved = {k: v for k, v in saved.items() if k in names}
        if isinstance(saved.get("adam_betas"), list):
            saved["adam_betas"] = tuple(saved["adam_betas"])
        return GRPOConfig(**{**saved, "resume": True})
    if known.model == TINY:
        return GRPOConfig.tiny()
    return GRPOConfig()


def cli(argv: list[str]) -> int:
    """``phalanx train grpo [flags]``: flags generated from GRPOConfig; returns exit status."""
    import tyro

    try:
        default = _defaults(argv)
    except (ValueError, OSError) as e:
        print(f"phalanx train grpo: error: {e}", file=sys.stderr)
        return 1
    try:
        cfg = tyro.cli(
            GRPOConfig,
            args=argv,
            default=default,
            prog="phalanx train grpo",
            description=(
                "GRPO on a language model. With --model tiny the tiny preset's values are "
                "the defaults; with --resume the checkpoint's config is."
            ),
        )
    except SystemExit as e:  # --help (0) or a bad flag (tyro printed why)
        return 0 if e.code in (0, None) else 1
    try:
        cfg.validate()
    except (ValueError, TypeError) as e:
        print(f"phalanx train grpo: error: {name_the_flag(str(e), GRPOConfig)}", file=sys.stderr)
        return 1
    try:
        result = train(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"phalanx train grpo: error: {e}", file=sys.stderr)
        return 1
    hist = result["history"]
    if hist:
        first, last = hist[0]["reward_mean"], hist[-1]["reward_mean"]
        print(f"[grpo] reward {first:.3f} -> {last:.3f}; metrics in {cfg.run_dir}/metrics.jsonl")
    ev = result["eval_accuracy"]
    if ev:
        print(
            f"[grpo] held-out greedy accuracy {ev[0][1]:.3f} at step {ev[0][0]} -> "
            f"{ev[-1][1]:.3f} at step {ev[-1][0]} ({len(result['history'])} steps, "
            f"{result['wall_s']:.0f} s)"
        )
    if result["curve"]:
        print(f"[grpo] curve: {result['curve']}")
    return 0


def add_arguments(parser: Any) -> None:
    """For a command line that builds argparse subparsers: pass every flag to ``cli``."""
    import argparse

    parser.add_argument("argv", nargs=argparse.REMAINDER, help="see phalanx train grpo --help")


def run(args: Any) -> int:
    return cli(list(args.argv))


__all__ = [
    "GRPOConfig",
    "cli",
    "derive_max_total_sequence_length",
    "evaluate_accuracy",
    "group_normalized_advantages",
    "plot_curve",
    "train",
]
