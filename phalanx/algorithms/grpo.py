"""GRPO on a small local language model, readable top to bottom.

One step: sample prompts -> ``samples_per_prompt`` responses each from the generation
workers -> reward each response -> advantages normalised within each prompt's group ->
log-probs of the current and the reference policy -> clipped policy-gradient loss with a
k3 KL penalty to the reference -> one optimizer step on the FSDP2 policy -> refit the
generation workers with the new weights.

A fresh run first builds the tiny model (if no ``--model-dir``) and runs a short
supervised warm-up, whose result becomes the reference policy. GRPO then starts from a
fresh optimizer: the warm-up's Adam moments (momentum along the supervised gradient,
second moments of much larger supervised gradients) would otherwise steer its first
updates. Every ``eval_every`` steps the run measures ``p_correct``, the probability of
the exact answer averaged over all the task's prompts (from log-probs, no sampling), a
noise-free view of the expected reward. Checkpoints (policy
weights, optimizer, scheduler, step and RNG state) are written every
``checkpoint_every`` steps under ``run_dir/checkpoints``; ``--resume`` continues from the
newest one. Metrics go to ``run_dir/metrics.jsonl`` and a reward curve to
``run_dir/reward.png``.

    phalanx train grpo --steps 40 --run-dir runs/grpo
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch


@dataclass
class GRPOConfig:
    run_dir: str = "runs/grpo"
    model_dir: str | None = None  # a save_pretrained model; None: build the tiny one
    steps: int = 40
    # 32 x 8 samples a step: fewer make the per-step gradient so noisy that Adam's
    # per-parameter steps move the policy at random (measured: update nearly orthogonal
    # to the reward gradient with 8 x 8 at lr 1e-3).
    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    max_new_tokens: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 3e-4
    warmup_lr: float = 1e-3
    kl_beta: float = 0.01
    clip_eps: float = 0.2
    train_micro_batch_size: int = 32
    warmup_steps: int = 200  # supervised steps before GRPO (fresh runs only)
    warmup_batch_size: int = 32
    num_policy_workers: int = 2
    num_generation_workers: int = 1
    refit_transport: str = "ipc"
    checkpoint_every: int = 10
    eval_every: int = 10  # steps between p_correct measurements (0: never)
    resume: bool = False
    seed: int = 0
    progress: bool = True

    def validate(self) -> None:
        for name in (
            "steps",
            "prompts_per_step",
            "samples_per_prompt",
            "max_new_tokens",
            "train_micro_batch_size",
            "num_policy_workers",
            "num_generation_workers",
            "warmup_batch_size",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ValueError(f"eval_every must be a non-negative int, got {self.eval_every!r}")
        if self.samples_per_prompt < 2:
            raise ValueError(
                f"samples_per_prompt must be >= 2 (advantages are relative within a group), got {self.samples_per_prompt}"
            )
        batch = self.prompts_per_step * self.samples_per_prompt
        if batch % self.num_policy_workers:
            raise ValueError(
                f"prompts_per_step * samples_per_prompt = {batch} is not divisible by "
                f"num_policy_workers {self.num_policy_workers}"
            )
        if (batch // self.num_policy_workers) % self.train_micro_batch_size:
            raise ValueError(
                f"train_micro_batch_size {self.train_micro_batch_size} does not divide the "
                f"per-rank batch {batch // self.num_policy_workers}"
            )
        if self.warmup_batch_size % self.num_policy_workers:
            raise ValueError(
                f"warmup_batch_size {self.warmup_batch_size} is not divisible by "
                f"num_policy_workers {self.num_policy_workers}"
            )
        if self.model_dir is not None and not os.path.exists(
            os.path.join(self.model_dir, "config.json")
        ):
            raise ValueError(f"model_dir {self.model_dir!r} does not exist")


# ----------------------------------------------------------------------------- helpers


def group_normalized_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + 1e-6); groups are consecutive rows."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    g = rewards.view(-1, group_size)
    adv = (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)
    return adv.view(-1)


def answer_probability(policy, tokenizer, pairs) -> float:
    """Mean over ``pairs`` of the policy's probability of the exact answer and end token.

    For temperature-1 sampling this is the expected 0/1 reward (up to answers spelled with
    extra spaces), computed from log-probs, so it carries no sampling noise.
    """
    from phalanx.llm.tiny_task import sft_batch

    data = sft_batch(tokenizer, pairs)
    logprobs = policy.get_logprobs(data)["logprobs"]
    return float(torch.exp((logprobs * data["token_mask"]).sum(1)).mean())


def _generate(gen_group, data, timeout: float = 300.0):
    """Split a prompt batch over the generation workers and put the outputs back in order."""
    from phalanx._base.errors import WorkerDiedError
    from phalanx.data import BatchedDataDict

    shards = data.shard_by_batch_size(gen_group.world_size, allow_uneven_shards=True)
    calls = [(r, (s,), {}) for r, s in enumerate(shards)]
    try:
        outs = gen_group.call_ranks("generate", calls).wait(timeout=timeout)
    except WorkerDiedError:
        # A worker died mid-call: its group restarts and refits it before this retry.
        outs = gen_group.call_ranks("generate", calls).wait(timeout=timeout)
    return BatchedDataDict.from_batches(outs, pad_value_dict={"output_ids": 0})


class _Metrics:
    """phalanx.observe.metrics.MetricsLogger when present; otherwise a minimal JSONL writer."""

    def __init__(self, run_dir: str):
        try:
            from phalanx.observe.metrics import MetricsLogger

            self._logger = MetricsLogger(run_dir)
            self._file = None
        except ImportError:
            self._logger = None
            self._file = open(os.path.join(run_dir, "metrics.jsonl"), "a")  # noqa: SIM115

    def log(self, step: int, values: dict[str, Any]) -> None:
        if self._logger is not None:
            self._logger.log(step, values)
        else:
            self._file.write(json.dumps({"step": step, **values}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._logger is not None and hasattr(self._logger, "close"):
            self._logger.close()
        if self._file is not None:
            self._file.close()


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


def plot_rewards(metrics_path: str, out_path: str) -> None:
    """Reward mean per step (with +-std band) from a metrics file, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if "reward_mean" in r]
    if not rows:
        return
    x = [r["step"] for r in rows]
    m = np.array([r["reward_mean"] for r in rows])
    s = np.array([r["reward_std"] for r in rows])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(x, m, label="reward mean")
    ax.fill_between(x, m - s, m + s, alpha=0.2)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax.set_title("GRPO task reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)


# ----------------------------------------------------------------------------- the algorithm


def train(cfg: GRPOConfig, cluster: Any = None) -> dict[str, Any]:
    """Run GRPO; returns the per-step metrics and the run directory."""
    from transformers import AutoTokenizer

    import phalanx as px
    from phalanx.llm.generation import HFGenerationWorker
    from phalanx.llm.loss import ClippedPGLossConfig, ClippedPGLossFn, NLLLoss
    from phalanx.llm.policy import Policy
    from phalanx.llm.refit import Refitter
    from phalanx.llm.tiny_task import AdditionTask, build_tiny_model, encode_prompts, sft_batch

    cfg.validate()
    os.makedirs(cfg.run_dir, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    cluster = cluster if cluster is not None else px.Cluster()
    ckpt = _latest_checkpoint(cfg.run_dir) if cfg.resume else None
    if cfg.resume and ckpt is None:
        raise ValueError(f"resume: no checkpoint under {cfg.run_dir}/checkpoints")

    # -- model, tokenizer, task ----------------------------------------------------------
    base_dir = cfg.model_dir or os.path.join(cfg.run_dir, "base_model")
    if cfg.model_dir is None and not os.path.exists(os.path.join(base_dir, "config.json")):
        build_tiny_model(base_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    sft_dir = os.path.join(cfg.run_dir, "sft_model")  # the reference policy
    task = AdditionTask(seed=cfg.seed)
    batch = cfg.prompts_per_step * cfg.samples_per_prompt
    policy_cfg = {
        "model_name": sft_dir if ckpt else base_dir,
        "train_global_batch_size": batch,
        "train_micro_batch_size": cfg.train_micro_batch_size,
        "logprob_batch_size": batch // cfg.num_policy_workers,
        "max_total_sequence_length": 32,
        "max_grad_norm": 1.0,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": cfg.lr, "weight_decay": 0.0}},
        "seed": cfg.seed,
    }
    policy = Policy(
        cluster,
        policy_cfg,
        tokenizer,
        num_workers=cfg.num_policy_workers,
        name_prefix=f"grpo_policy_{os.getpid()}",
        weights_path=os.path.join(ckpt, "weights") if ckpt else None,
        optimizer_path=os.path.join(ckpt, "optim") if ckpt else None,
    )
    gen_cfg = {
        "model_name": base_dir,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "seed": cfg.seed,
    }
    generation = HFGenerationWorker.create_group(gen_cfg, tokenizer).launch(
        cluster,
        px.NodePlacement(num_workers=cfg.num_generation_workers),
        name=f"grpo_generation_{os.getpid()}",
        # A dead generation worker is restarted, and refitted (Refitter) before it is called.
        restart_policy=px.RestartPolicy(),
    )
    refitter = Refitter(policy, generation, cfg.refit_transport)
    metrics = _Metrics(cfg.run_dir)
    history: list[dict[str, Any]] = []
    start_step = 0
    try:
        # -- supervised warm-up (fresh runs): its result is the reference policy ----------
        if ckpt is None:
            _set_lr(policy, cfg.warmup_lr)
            sft_cfg = {
                "gbs": cfg.warmup_batch_size,
                "mbs": cfg.warmup_batch_size // cfg.num_policy_workers,
            }
            for i in range(cfg.warmup_steps):
                out = policy.train(
                    sft_batch(tokenizer, task.sample_prompts(cfg.warmup_batch_size)),
                    NLLLoss(),
                    **sft_cfg,
                )
                if i == cfg.warmup_steps - 1 or i % 10 == 0:
                    metrics.log(-cfg.warmup_steps + i, {"sft_loss": float(out["loss"].mean())})
            policy.worker_group.call("update_reference_model").wait(timeout=300)
            _save_hf_model(policy, base_dir, sft_dir, tokenizer)
            _reset_optimizer(policy, cfg.lr)
        else:
            with open(os.path.join(ckpt, "state.json")) as f:
                state = json.load(f)
            start_step = state["step"]
            task.rng.setstate(_to_rng_state(state["task_rng"]))
            torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        refitter.refit()

        loss_fn = ClippedPGLossFn(ClippedPGLossConfig(cfg.clip_eps, cfg.clip_eps, cfg.kl_beta))
        eval_pairs = task.all_prompts()
        evals: list[tuple[int, float]] = []
        if cfg.eval_every:
            evals.append((start_step, answer_probability(policy, tokenizer, eval_pairs)))
            metrics.log(start_step, {"p_correct": evals[-1][1]})
        progress = _progress(cfg, start_step)
        for step in range(start_step + 1, cfg.steps + 1):
            times: dict[str, float] = {}
            t0 = time.perf_counter()

            # 1. prompts, each repeated samples_per_prompt times (a group per prompt)
            pairs = task.sample_prompts(cfg.prompts_per_step)
            prompt_ids, prompt_lens = encode_prompts(tokenizer, [p for p, _ in pairs])
            prompts = px.BatchedDataDict(input_ids=prompt_ids, input_lengths=prompt_lens)
            prompts = prompts.repeat_interleave(cfg.samples_per_prompt)
            answers = [a for _, a in pairs for _ in range(cfg.samples_per_prompt)]

            # 2. sample responses
            gen = _generate(generation, prompts)
            times["generation"] = time.perf_counter() - t0

            # 3. rewards
            rewards = torch.zeros(batch)
            for i in range(batch):
                n, g = int(prompts["input_lengths"][i]), int(gen["generation_lengths"][i])
                text = tokenizer.decode(gen["output_ids"][i, n : n + g], skip_special_tokens=True)
                ended = int(gen["output_ids"][i, n + g - 1]) == tokenizer.eos_token_id
                rewards[i] = task.reward(text, answers[i]) if ended else 0.0

            # 4. advantages normalised within each prompt's group
            advantages = group_normalized_advantages(rewards, cfg.samples_per_prompt)

            # 5. the training batch: loss on the generated tokens only
            T = int(gen["unpadded_sequence_lengths"].max())
            ids = gen["output_ids"][:, :T]
            pos = torch.arange(T)[None]
            token_mask = (
                (pos >= prompts["input_lengths"][:, None])
                & (pos < gen["unpadded_sequence_lengths"][:, None])
            ).float()
            data = px.BatchedDataDict(
                input_ids=ids,
                input_lengths=gen["unpadded_sequence_lengths"],
                token_mask=token_mask,
                sample_mask=torch.ones(batch),
                advantages=advantages,
            )

            # 6. log-probs under the current (pre-update) and the reference policy
            t1 = time.perf_counter()
            data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
            data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(data)[
                "reference_logprobs"
            ]
            times["logprobs"] = time.perf_counter() - t1

            # 7. one policy-gradient step
            t2 = time.perf_counter()
            out = policy.train(data, loss_fn)
            times["training"] = time.perf_counter() - t2

            # 8. refit the generators with the new weights
            t3 = time.perf_counter()
            refitter.refit()
            times["refit"] = time.perf_counter() - t3
            times["step"] = time.perf_counter() - t0

            mb = out["all_mb_metrics"]
            ntok = max(sum(mb["num_valid_tokens"]), 1)
            gen_tokens = int(gen["generation_lengths"].sum())
            row = {
                "reward_mean": float(rewards.mean()),
                "reward_std": float(rewards.std()),
                "loss": float(out["loss"].mean()),
                "grad_norm": float(out["grad_norm"].mean()),
                "kl": sum(mb["kl_sum"]) / ntok,
                "entropy": sum(mb["entropy_sum"]) / ntok,
                "clip_frac": sum(mb["clip_frac_sum"]) / ntok,
                "response_length": float(gen["generation_lengths"].float().mean()),
                "tokens_per_s": gen_tokens / max(times["generation"], 1e-9),
                "generation_restarts": generation.num_remote_worker_restarts(),
                **{f"time/{k}": v for k, v in times.items()},
            }
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                row["p_correct"] = answer_probability(policy, tokenizer, eval_pairs)
                evals.append((step, row["p_correct"]))
            metrics.log(step, row)
            history.append({"step": step, **row})
            progress(step, row)

            # 9. checkpoint
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                path = os.path.join(cfg.run_dir, "checkpoints", f"step_{step}")
                policy.save_checkpoint(
                    os.path.join(path, "weights"),
                    os.path.join(path, "optim"),
                    os.path.join(path, "tokenizer"),
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
    finally:
        metrics.close()
        generation.shutdown()
        policy.shutdown()
    metrics_path = os.path.join(cfg.run_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        plot_rewards(metrics_path, os.path.join(cfg.run_dir, "reward.png"))
    return {"history": history, "p_correct": evals, "run_dir": cfg.run_dir}


def _set_worker_lr(worker: Any, lr: float) -> None:
    for group in worker.optimizer.param_groups:
        group["lr"] = lr
        group["initial_lr"] = lr
    if worker.scheduler is not None:
        worker.scheduler.base_lrs = [lr for _ in worker.scheduler.base_lrs]


def _reset_worker_optimizer(worker: Any, lr: float) -> None:
    worker._init_optimizer()
    _set_worker_lr(worker, lr)


def _reset_optimizer(policy: Any, lr: float) -> None:
    """A fresh optimizer and scheduler at ``lr`` on every policy rank (for the RL phase)."""
    g = policy.worker_group
    calls = [(r, (lr,), {}) for r in range(g.world_size)]
    g.apply(_reset_worker_optimizer, calls, label="reset_optimizer").wait(timeout=120)


def _set_lr(policy: Any, lr: float) -> None:
    """Set the learning rate on every policy rank (warm-up and GRPO use different ones)."""
    g = policy.worker_group
    g.apply(_set_worker_lr, [(r, (lr,), {}) for r in range(g.world_size)], label="set_lr").wait(
        timeout=120
    )


def _to_rng_state(state: Any) -> tuple:
    """JSON turns random.Random's state tuple into lists; turn it back."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def _progress(cfg: GRPOConfig, start_step: int):
    """A per-step progress callback: phalanx.observe.progress when present, else one line a step."""
    if not cfg.progress:
        return lambda step, row: None
    try:
        from phalanx.observe.progress import Progress  # the observability layer's live display

        bar = Progress(total=cfg.steps, start=start_step, title="GRPO")
        return lambda step, row: bar.update(step, row)
    except (ImportError, TypeError, AttributeError):

        def line(step: int, row: dict[str, Any]) -> None:
            print(
                f"[grpo] step {step}/{cfg.steps} reward {row['reward_mean']:.3f}"
                f"±{row['reward_std']:.3f} kl {row['kl']:.4f} ent {row['entropy']:.3f} "
                f"len {row['response_length']:.2f} step {row['time/step']:.2f}s",
                flush=True,
            )

        return line


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``phalanx train grpo``: one per GRPOConfig field."""
    for f in fields(GRPOConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=f"(default {f.default})",
            )
            continue
        kind = {"int": int, "float": float}.get(str(f.type), str)
        parser.add_argument(flag, type=kind, default=f.default, help=f"(default {f.default})")


def run(args: argparse.Namespace) -> int:
    cfg = GRPOConfig(**{f.name: getattr(args, f.name) for f in fields(GRPOConfig)})
    result = train(cfg)
    hist = result["history"]
    if hist:
        first, last = hist[0]["reward_mean"], hist[-1]["reward_mean"]
        print(f"[grpo] reward {first:.3f} -> {last:.3f}; metrics in {cfg.run_dir}/metrics.jsonl")
    evals = result["p_correct"]
    if len(evals) > 1:
        print(
            f"[grpo] p_correct (exact answer, all prompts) {evals[0][1]:.3f} at step "
            f"{evals[0][0]} -> {evals[-1][1]:.3f} at step {evals[-1][0]}"
        )
    return 0
