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

import contextlib
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from phalanx.algorithms import _harness as harness
from phalanx.algorithms.grpo_async import AsyncRollouts
from phalanx.algorithms.grpo_config import TINY, GRPOConfig, expand_async_grpo, resolve_run_dir
from phalanx.algorithms.grpo_loss import OnPolicyPGLossFn, behaviour_logprobs
from phalanx.algorithms.grpo_rollout import (
    SyncRollouts,
    group_normalized_advantages,
    rollout,
    rollout_metrics,
    training_batch,
)
from phalanx.algorithms.grpo_workers import (
    PhaseMemory,
    answer_probability,
    evaluate_accuracy,
    generate,
    on_policy_workers,
    place_group,
    reset_worker_optimizer,
    set_worker_lr,
    thread_shares,
)
from phalanx.algorithms.phase_threads import PhaseThreads, follow_phase_threads

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


# ----------------------------------------------------------------------------- the algorithm


def _prepare_model(cfg: GRPOConfig) -> str:
    """The Hugging Face folder of ``cfg.model`` (building the tiny one, converting a GGUF)."""
    from phalanx.algorithms.grpo_tiny_task import build_tiny_model
    from phalanx.llm.models import resolve_model

    if cfg.model == TINY:
        base_dir = os.path.join(cfg.run_dir, "base_model")
        if not os.path.exists(os.path.join(base_dir, "config.json")):
            build_tiny_model(base_dir)
        return base_dir
    return resolve_model(cfg.model, quiet=not cfg.progress)


def _max_prompt_tokens(tokenizer, task, system_prompt: str | None, seed: int) -> int:
    """Longest chat-formatted prompt of the held-out split and of 512 training-distribution
    draws (from a separate RNG, so the training stream is untouched)."""
    from phalanx.algorithms.grpo_chat import build_prompt_ids
    from phalanx.algorithms.grpo_tasks import JsonlTask

    if isinstance(task, JsonlTask):
        probe = task.examples
    else:
        rng = random.Random(seed + 104729)
        probe = task.heldout + [task.draw(rng) for _ in range(512)]
    return max(len(build_prompt_ids(tokenizer, e.prompt, system_prompt)) for e in probe)


def train(
    cfg: GRPOConfig, cluster: Any = None, on_training: Callable[[int, Any], None] | None = None
) -> dict[str, Any]:
    """Run GRPO; returns the per-step metrics, the evaluations and the run directory.

    ``on_training(step, policy)``, if given, runs right after each step's training phase,
    before the refit (a benchmark measures the machine there, between the run's own steps;
    its time is not in ``time/step``).
    """
    from transformers import AutoConfig, AutoTokenizer

    import phalanx as px
    from phalanx.algorithms.grpo_tasks import make_task
    from phalanx.algorithms.grpo_tiny_task import sft_batch
    from phalanx.llm.generation import HFGenerationWorker
    from phalanx.llm.loss import ClippedPGLossConfig, NLLLoss
    from phalanx.llm.policy import Policy
    from phalanx.llm.refit import Refitter
    from phalanx.observe.metrics import MetricsLogger
    from phalanx.observe.progress import Progress

    t_start = time.perf_counter()
    cfg.validate()
    cfg = resolve_run_dir(cfg)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    ckpt = _latest_checkpoint(cfg.run_dir) if cfg.resume else None
    if cfg.resume and ckpt is None:
        raise ValueError(f"resume: no checkpoint under {cfg.run_dir}/checkpoints")
    if not cfg.resume and _latest_checkpoint(cfg.run_dir) is not None:
        raise ValueError(
            f"run_dir {cfg.run_dir} already has checkpoints; pass --resume to continue it or "
            "choose another --name"
        )

    # -- task (a bad task file is refused before anything is written), model, tokenizer --
    task = make_task(cfg.task, cfg.seed, cfg.eval_size, cfg.reward, cfg.format_reward)
    os.makedirs(cfg.run_dir, exist_ok=True)
    base_dir = _prepare_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
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
    policy_threads, gen_threads, policy_cpus, gen_cpus = thread_shares(cfg)
    policy_precision, generation_precision = cfg.precisions()
    policy_cfg: dict[str, Any] = {
        "model_name": sft_dir if (ckpt and warm) else base_dir,
        "train_global_batch_size": gbs,
        "train_micro_batch_size": cfg.train_micro_batch_size,
        "logprob_batch_size": cfg.logprob_micro_batch_size,
        "max_total_sequence_length": max_seq,
        "precision": policy_precision,
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
    if cfg.dynamic_batching:
        policy_cfg["dynamic_batching"] = {
            "enabled": True,
            "train_mb_tokens": cfg.train_micro_batch_size * max_seq,
            "logprob_mb_tokens": cfg.logprob_micro_batch_size * max_seq,
            "sequence_length_round": 16,
        }
    if cfg.logprob_chunk_size:
        policy_cfg["logprob_chunk_size"] = cfg.logprob_chunk_size
    if cfg.lora_rank:
        policy_cfg["dtensor_cfg"] = {"lora_cfg": cfg.lora_cfg()}
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
        "precision": generation_precision,
        "num_threads": gen_threads,
    }
    generation = None
    rollouts: Any = None
    phase: PhaseThreads | None = None
    refitter: Any = None
    metrics = MetricsLogger(cfg.run_dir, use_wandb=cfg.wandb)
    history: list[dict[str, Any]] = []
    evals: list[tuple[int, float]] = []
    p_correct: list[tuple[int, float]] = []
    start_step = 0
    failed = False
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
        place_group(pg, policy_threads, policy_cpus)
        place_group(generation, None, gen_cpus)  # its threads are in gen_cfg
        if cfg.async_grpo and cfg.placement != "disaggregated" and not cfg.num_threads:
            # every core for the policy while no generation batch runs (phase_threads)
            idle = max(1, len(os.sched_getaffinity(0)) // cfg.num_policy_workers)
            phase = PhaseThreads(busy=policy_threads, idle=idle)
            calls = [(r, (phase.path,), {}) for r in range(pg.world_size)]
            pg.apply(follow_phase_threads, calls, label="follow_threads").wait(timeout=60)
        # Overlapping phases: the generators' memory is not a phase's (not measured).
        memory = PhaseMemory(
            {"policy": pg} if cfg.async_grpo else {"policy": pg, "generation": generation}
        )
        refitter = Refitter(policy, generation, cfg.refit_transport)
        metrics.log_config(
            {**asdict(cfg), "model_dir": base_dir, "max_total_sequence_length": max_seq}
        )

        # -- supervised warm-up (fresh tiny runs): its result is the reference policy ----
        if ckpt is None and warm:
            on_policy_workers(policy, set_worker_lr, cfg.warmup_lr, "set_lr")
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
                on_policy_workers(policy, reset_worker_optimizer, cfg.lr, "reset_optimizer")
        elif ckpt is not None:
            with open(os.path.join(ckpt, "state.json")) as f:
                state = json.load(f)
            start_step = state["step"]
            metrics.drop_after(start_step)  # steps after the checkpoint are redone now
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
                if phase is not None:  # async, shared: nothing else runs, every core
                    every = len(os.sched_getaffinity(0)) // cfg.num_generation_workers
                    place_group(generation, max(1, every), None)
                try:
                    row, samples = evaluate_accuracy(
                        generation, tokenizer, task, cfg.system_prompt, cfg.generation_timeout_s
                    )
                finally:
                    if phase is not None:
                        place_group(generation, gen_threads, None)
                if tiny_pairs is not None:
                    row["p_correct"] = answer_probability(policy, tokenizer, tiny_pairs)
                    p_correct.append((step, row["p_correct"]))
                row["time/eval"] = time.perf_counter() - t
            evals.append((step, row["eval/accuracy"]))
            bar.log(f"[grpo] step {step}: held-out accuracy {row['eval/accuracy']:.3f}")
            for prompt, response, reward in samples:
                bar.log(f"  {prompt!r} -> {response!r} (reward {reward:g})")
            return row

        if cfg.eval_every and cfg.eval_at_start:
            metrics.log(start_step, evaluate(start_step))
        bar.update(start_step)

        def make_batch() -> px.BatchedDataDict:
            # Asynchronous: a failed batch is dropped, the collector counts the failure.
            return rollout(cfg, task, tokenizer, lambda prompts: generate(
                generation, prompts, cfg.generation_timeout_s, retry=not cfg.async_grpo
            ))  # fmt: skip

        if cfg.async_grpo:
            rollouts = AsyncRollouts(
                make_batch, refitter.refit, generation,
                max_trajectory_age_steps=cfg.max_trajectory_age_steps,
                max_generation_failures=cfg.max_generation_failures,
                start_version=start_step, timeout_s=cfg.generation_timeout_s,
                on_generating=phase.generating if phase is not None else None,
            )  # fmt: skip
        else:
            rollouts = SyncRollouts(make_batch, refitter.refit, memory)
        for step in range(start_step + 1, cfg.steps + 1):
            times: dict[str, float] = {}
            mem: dict[str, float] = {}
            t0 = time.perf_counter()

            # 1-4. a batch of trajectories: prompts, each repeated samples_per_prompt times
            #      (a group per prompt), responses, rewards, advantages within each group
            with bar.waiting(f"generating {batch} responses"):
                traj, info = rollouts.take(step)
            data = training_batch(traj)  # 5. the loss counts the generated tokens only
            if cfg.async_grpo:  # the ratio's "old" log-probs: the generating weights'
                data["generation_logprobs"] = traj["generation_logprobs"][
                    :, : data["input_ids"].shape[1]
                ]
                data["generation_is_current"] = (traj["version"] == step - 1).float()

            # 6. log-probs: the old policy's only when several updates share a batch; the
            #    reference's only when the KL penalty is on
            t1 = time.perf_counter()
            memory.reset()
            with bar.waiting("log-probs"):
                if not on_policy:
                    own = policy.get_logprobs(data)["logprobs"]
                    data["prev_logprobs"] = behaviour_logprobs(own, data)
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
            if on_training is not None:
                t_hook = time.perf_counter()
                on_training(step, policy)
                t0 += time.perf_counter() - t_hook

            # 8. refit the generators with the new weights (between generation batches);
            #    an evaluation follows under the same pause of the collector
            out_of_time = (
                cfg.time_limit_s is not None and time.perf_counter() - t_start >= cfg.time_limit_s
            )
            last = step == cfg.steps or out_of_time
            evaluating = bool(cfg.eval_every) and (step % cfg.eval_every == 0 or last)
            hold = contextlib.ExitStack()
            held_wait = hold.enter_context(rollouts.paused()) if evaluating else 0.0
            with hold:
                with bar.waiting("refit"):
                    info.update(rollouts.refit())
                if cfg.async_grpo:
                    info["time/refit_wait"] += held_wait
                    info["time/training_wait"] += info["time/refit_wait"]
                if evaluating:
                    info.update(evaluate(step))

            mb = out["all_mb_metrics"]
            ntok = max(sum(mb["num_valid_tokens"]), 1)
            row = {
                **rollout_metrics(traj, cfg.samples_per_prompt),
                "loss": float(out["loss"].mean()),
                "grad_norm": float(out["grad_norm"].mean()),
                "kl": sum(mb["kl_sum"]) / ntok,
                "entropy": sum(mb["entropy_sum"]) / ntok,
                "clip_frac": sum(mb["clip_frac_sum"]) / ntok,
                "ratio_mean": sum(mb["ratio_sum"]) / ntok,
                "generation_restarts": generation.num_remote_worker_restarts(),
                "elapsed_s": time.perf_counter() - t_start,
                **info,
                **{f"time/{k}": v for k, v in times.items()},
                **{f"memory/{k}_peak_gb": v for k, v in mem.items()},
            }
            if "time/generation" in row:
                gen_tokens = int(traj["generation_lengths"].sum())
                row["throughput/tokens_per_s"] = gen_tokens / max(row["time/generation"], 1e-9)
            train_tokens = int(data["input_lengths"].sum())  # prompt + response, no padding
            row["train/tokens"] = train_tokens
            row["throughput/train_tokens_per_s"] = train_tokens / max(times["training"], 1e-9)
            row["time/step"] = time.perf_counter() - t0  # the evaluation included
            metrics.log(step, row)
            history.append({"step": step, **row})
            bar.update(
                step, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
            )

            # 9. checkpoint
            if step % cfg.checkpoint_every == 0 or last:
                with bar.waiting("checkpoint"):
                    _checkpoint(cfg, policy, task, step)
            if out_of_time:
                bar.log(f"[grpo] time limit {cfg.time_limit_s:.0f} s reached after step {step}")
                break
    except BaseException:  # an error or an interrupt: a worker stuck in a call is not waited for
        failed = True
        raise
    finally:
        bar.close()
        metrics.close()
        deadline = time.monotonic() + (5.0 if failed else 60.0)  # for the whole clean-up

        def grace_s() -> float:
            return max(0.5, deadline - time.monotonic())

        if rollouts is not None:
            rollouts.close()
        if generation is not None:
            generation.shutdown(timeout=grace_s())
        if refitter is not None:
            refitter.close()  # its shared-memory ring goes
        policy.worker_group.shutdown(cleanup_method="shutdown", timeout=grace_s())
        if isinstance(rollouts, AsyncRollouts):
            rollouts.join(grace_s())
        if phase is not None:
            phase.close()
    from phalanx.observe.metrics import read_metrics
    from phalanx.observe.plots import plot_learning_curve

    curve: str | None = os.path.join(cfg.run_dir, "curve.png")
    if not plot_learning_curve(read_metrics(cfg.run_dir), curve, f"GRPO {cfg.task}"):
        curve = None
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


@dataclass
class TrainGRPO:
    """GRPO on a language model. With --model tiny the tiny preset's values are the
    defaults; with --resume the checkpoint's config is; a --config YAML file sets any
    GRPOConfig field (or its flag name) and flags win over it."""

    grpo: GRPOConfig
    config: Path | None = None
    """YAML file of GRPOConfig fields or their flag names (unknown keys are an error)"""
    trace: bool = False
    """record a trace of group calls into the run folder (open it in ui.perfetto.dev)"""


def _defaults(argv: list[str]) -> TrainGRPO:
    """What flags not given fall back to: the checkpoint's config (``--resume``), the tiny
    preset (``--model tiny``) or the pretrained defaults, then the ``--config`` file."""
    known = harness.preparse(argv, "--model", "--run-dir", "--name", "--runs-dir", "--resume",
                             "--config")  # fmt: skip
    from_file = harness.read_config_file(known.config, GRPOConfig) if known.config else {}
    from_file = expand_async_grpo(from_file)
    if known.resume:
        run_dir = known.run_dir or from_file.get("run_dir")
        name = known.name or from_file.get("name")
        if run_dir is None and not name:
            raise ValueError("--resume needs --name or --run-dir (the run to continue)")
        run_dir = run_dir or os.path.join(known.runs_dir or GRPOConfig.runs_dir, name)
        ckpt = _latest_checkpoint(run_dir)
        if ckpt is None:
            raise ValueError(f"--resume: no checkpoint under {run_dir}/checkpoints")
        with open(os.path.join(ckpt, "state.json")) as f:
            saved = json.load(f)["config"]
        saved = harness.check_keys(saved, GRPOConfig, f"checkpoint {ckpt}")
        return TrainGRPO(GRPOConfig(**{**saved, **from_file, "run_dir": run_dir, "resume": True}))
    base = GRPOConfig.tiny if (known.model or from_file.get("model")) == TINY else GRPOConfig
    return TrainGRPO(base(**from_file))


def cli(argv: list[str]) -> int:
    """``phalanx train grpo [flags]``; returns the exit status (``_harness.EXIT_CODES``)."""
    prog = "phalanx train grpo"
    try:
        default = _defaults(argv)
        args = harness.parse_flags(TrainGRPO, argv, default, prog, TrainGRPO.__doc__ or "")
        args.grpo.validate()
        cfg = resolve_run_dir(args.grpo)
    except SystemExit as e:  # --help, or a usage error tyro explained
        return int(e.code or 0)
    except (ValueError, TypeError, OSError) as e:
        return harness.bad_input(prog, e, GRPOConfig)
    run_dir = Path(cfg.run_dir or "")
    return harness.run_command(prog, GRPOConfig, run_dir, lambda: _run(cfg, args.trace, run_dir))


def _run(cfg: GRPOConfig, trace: bool, run_dir: Path) -> int:
    """Train and print the reward and accuracy; DONE."""
    with harness.tracing(trace, run_dir):
        result = train(cfg)
    hist = result["history"]
    if hist:
        first, last = hist[0]["reward_mean"], hist[-1]["reward_mean"]
        print(f"[grpo] reward {first:.3f} -> {last:.3f}; metrics in {run_dir}/metrics.jsonl")
    ev = result["eval_accuracy"]
    if ev:
        print(
            f"[grpo] held-out greedy accuracy {ev[0][1]:.3f} at step {ev[0][0]} -> "
            f"{ev[-1][1]:.3f} at step {ev[-1][0]} ({len(result['history'])} steps, "
            f"{result['wall_s']:.0f} s)"
        )
    if result["curve"]:
        print(f"[grpo] curve: {result['curve']}")
    return harness.DONE


__all__ = [
    "GRPOConfig",
    "cli",
    "derive_max_total_sequence_length",
    "evaluate_accuracy",
    "group_normalized_advantages",
    "resolve_run_dir",
    "train",
]
