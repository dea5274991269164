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
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from phalanx.algorithms import _harness as harness
from phalanx.algorithms.grpo_config import TINY, GRPOConfig, expand_async_grpo, resolve_run_dir
from phalanx.algorithms.grpo_group_calls import evaluate_accuracy
from phalanx.algorithms.grpo_loss import OnPolicyPGLossFn, behaviour_logprobs
from phalanx.algorithms.grpo_recovery import PolicyRecovery
from phalanx.algorithms.grpo_rollout import (
    group_normalized_advantages,
    rollout_metrics,
    training_batch,
)
from phalanx.algorithms.grpo_run import (
    GRPORun,
    derive_max_total_sequence_length,
    plan_run,
    progress_bar,
    save_checkpoint,
    start_run,
)
from phalanx.algorithms.run_checkpoints import latest_checkpoint, read_state

# ----------------------------------------------------------------------------- the algorithm


def train(
    cfg: GRPOConfig, cluster: Any = None, on_training: Callable[[int, Any], None] | None = None
) -> dict[str, Any]:
    """Run GRPO; returns the per-step metrics, the evaluations and the run directory.

    ``on_training(step, policy)``, if given, runs right after each step's training phase,
    before the refit (a benchmark measures the machine there, between the run's own steps;
    its time is not in ``time/step``).
    """
    from phalanx.llm.loss import ClippedPGLossConfig
    from phalanx.observe.metrics import MetricsLogger
    from phalanx.observe.phases import StepPhases

    t_start = time.perf_counter()
    cfg, task, ckpt = start_run(cfg)
    plan = plan_run(cfg, task, ckpt)
    bar = progress_bar(cfg)
    metrics = MetricsLogger(cfg.run_dir, use_wandb=cfg.wandb)
    run = GRPORun(cfg, plan, task, bar)
    recovery = PolicyRecovery(run, metrics, cfg.max_restarts)
    failed = False
    try:
        run.launch(cluster, ckpt, metrics)
        metrics.log_config(
            {**asdict(cfg), "model_dir": plan.base_dir, "max_total_sequence_length": plan.max_seq}
        )
        start_step = run.warm_up_or_resume(ckpt, metrics)
        if cfg.eval_every and cfg.eval_at_start:
            metrics.log(start_step, run.evaluate(start_step))
        bar.update(start_step)
        rollouts = run.start_rollouts(start_step)
        loss_fn = OnPolicyPGLossFn(
            ClippedPGLossConfig(cfg.clip_eps_low, cfg.clip_eps_high, cfg.kl_beta)
        )
        phases = StepPhases(bar, run.memory)
        with bar.waiting("keeping the policy's state"):
            recovery.snapshot(start_step)
        for step in range(start_step + 1, cfg.steps + 1):
            phases.new_step()
            t0 = time.perf_counter()

            # 1-4. a batch of trajectories: prompts, each repeated samples_per_prompt times
            #      (a group per prompt), responses, rewards, advantages within each group
            with bar.waiting(f"generating {plan.batch} responses"):
                traj, info = rollouts.take(step)
            data = training_batch(traj, step - 1)  # 5. the loss counts the response only

            def learn(step: int = step, data: Any = data) -> dict[str, Any]:
                policy = run.policy  # a new group after a rank died (recovery)
                # 6. log-probs: the old policy's only when several updates share a batch;
                #    the reference's only when the KL penalty is on
                needs_logprobs = not plan.on_policy or cfg.kl_beta > 0
                with phases("logprobs", "log-probs", peak=needs_logprobs):
                    if not plan.on_policy:
                        own = policy.get_logprobs(data)["logprobs"]
                        data["prev_logprobs"] = behaviour_logprobs(own, data)
                        data["policy_logprobs"] = own  # the generator's gap is to these
                    if cfg.kl_beta > 0:
                        ref = policy.get_reference_policy_logprobs(data)
                        data["reference_policy_logprobs"] = ref["reference_logprobs"]

                # 7. policy-gradient step(s), and the state they leave kept (recovery)
                with phases("training", peak=True):
                    out = policy.train(data, loss_fn)
                with phases("keep_state", "keeping the policy's state"):
                    recovery.snapshot(step)
                return out

            out = recovery.call(step, "log-probs and training", learn)
            if on_training is not None:
                t_hook = time.perf_counter()
                on_training(step, run.policy)
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
                    info.update(recovery.call(step, "refit", rollouts.refit))
                if cfg.async_grpo:
                    info["time/refit_wait"] += held_wait
                    info["time/training_wait"] += info["time/refit_wait"]
                if evaluating:
                    info.update(recovery.call(step, "evaluation", lambda s=step: run.evaluate(s)))

            run.log_generation_restarts(step, metrics)
            restarts = {**run.restarts(), "policy_restarts": recovery.restarts}
            row = step_metrics(cfg, traj, data, out, {**info, **restarts}, phases)
            row["elapsed_s"] = time.perf_counter() - t_start
            row["time/step"] = time.perf_counter() - t0  # the evaluation included
            metrics.log(step, row)
            run.history.append({"step": step, **row})
            bar.update(
                step, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
            )

            # 9. checkpoint
            if step % cfg.checkpoint_every == 0 or last:
                with bar.waiting("checkpoint"):
                    recovery.call(
                        step, "checkpoint", lambda s=step: save_checkpoint(cfg, run.policy, task, s)
                    )
            if out_of_time:
                bar.log(f"[grpo] time limit {cfg.time_limit_s:.0f} s reached after step {step}")
                break
    except BaseException:  # an error or an interrupt: a worker stuck in a call is not waited for
        failed = True
        raise
    finally:
        bar.close()
        metrics.close()
        recovery.close()  # first: the groups' shutdown below is no death to act on
        run.close(failed)
    return run.result(t_start)


def step_metrics(
    cfg: GRPOConfig,
    traj: Any,
    data: Any,
    out: dict[str, Any],
    info: dict[str, Any],
    phases: Any,
) -> dict[str, Any]:
    """The metrics row of one step: the rollout's, the loss's (per valid token), the
    phases' seconds and peak memory, and the throughputs."""
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
        "train/gen_logprob_error": sum(mb["gen_logprob_error_sum"]) / ntok,
        **info,
        **{f"time/{k}": v for k, v in phases.times.items()},
        **{f"memory/{k}_peak_gb": v for k, v in phases.memory_gb.items()},
    }
    if "time/generation" in row:
        gen_tokens = int(traj["generation_lengths"].sum())
        row["throughput/tokens_per_s"] = gen_tokens / max(row["time/generation"], 1e-9)
    train_tokens = int(data["input_lengths"].sum())  # prompt + response, no padding
    row["train/tokens"] = train_tokens
    row["throughput/train_tokens_per_s"] = train_tokens / max(phases.times["training"], 1e-9)
    return row


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
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise ValueError(f"--resume: no checkpoint under {run_dir}/checkpoints")
        saved = read_state(ckpt)["config"]
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
