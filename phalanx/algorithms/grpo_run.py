"""A GRPO run around its step: the model and worker configs it is built from, the worker
groups and their placement, the supervised warm-up or the resume, where each step's
rollouts come from, the held-out evaluation, checkpoints, the clean-up and the result.

``grpo.train`` holds the step itself; everything here runs once per run, or between steps.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from phalanx.algorithms.grpo_async import AsyncRollouts
from phalanx.algorithms.grpo_config import TINY, GRPOConfig, resolve_run_dir
from phalanx.algorithms.grpo_group_calls import (
    PhaseMemory,
    answer_probability,
    evaluate_accuracy,
    generate,
    on_policy_workers,
    place_group,
    refit_past_generator_deaths,
    reset_worker_optimizer,
    set_worker_lr,
    thread_shares,
)
from phalanx.algorithms.grpo_rollout import SyncRollouts, rollout
from phalanx.algorithms.phase_threads import PhaseThreads, follow_phase_threads
from phalanx.algorithms.run_checkpoints import (
    latest_checkpoint,
    read_state,
    remove_unfinished_checkpoints,
    write_checkpoint,
)
from phalanx.algorithms.worker_recoveries import RestartWatch, recovery_row


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


VLLM_START_TIMEOUT_S = 600.0  # a vLLM generation worker's start: engine and compiled graphs


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


def start_run(cfg: GRPOConfig) -> tuple[GRPOConfig, Any, str | None]:
    """The checked config with its run folder, the task and the checkpoint to resume (if
    any); seeds Python and torch. A bad task file is refused before anything is written."""
    from phalanx.algorithms.grpo_tasks import make_task

    cfg.validate()
    cfg = resolve_run_dir(cfg)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    ckpt = latest_checkpoint(cfg.run_dir) if cfg.resume else None
    if cfg.resume and ckpt is None:
        raise ValueError(f"resume: no checkpoint under {cfg.run_dir}/checkpoints")
    if not cfg.resume and latest_checkpoint(cfg.run_dir) is not None:
        raise ValueError(
            f"run_dir {cfg.run_dir} already has checkpoints; pass --resume to continue it or "
            "choose another --name"
        )
    task = make_task(cfg.task, cfg.seed, cfg.eval_size, cfg.reward, cfg.format_reward)
    os.makedirs(cfg.run_dir, exist_ok=True)
    remove_unfinished_checkpoints(cfg.run_dir)
    return cfg, task, ckpt


@dataclass
class RunPlan:
    """What the workers are built from: the model folder, tokenizer, sizes, configs and
    each role's threads and cores."""

    base_dir: str
    sft_dir: str
    tokenizer: Any
    max_seq: int
    batch: int
    on_policy: bool
    warm: bool
    policy_cfg: dict[str, Any]
    gen_cfg: dict[str, Any]
    policy_threads: int | None
    gen_threads: int | None
    policy_cpus: Any
    gen_cpus: Any


def plan_run(cfg: GRPOConfig, task: Any, ckpt: str | None) -> RunPlan:
    """The model, tokenizer, sequence length, thread shares and worker configs of a run."""
    from transformers import AutoConfig, AutoTokenizer

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
    gen_cfg = {
        "model_name": base_dir,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "seed": cfg.seed,
        "precision": generation_precision,
        "num_threads": gen_threads,
    }
    if cfg.generation_backend == "vllm":
        gen_cfg.update(
            backend="vllm",
            vllm_cfg={
                **cfg.vllm_cfg,
                "max_model_len": max_seq,
                "async_engine": cfg.vllm_async_engine,
            },
            vllm_kwargs=dict(cfg.vllm_kwargs),
        )
    return RunPlan(
        base_dir, sft_dir, tokenizer, max_seq, batch, gbs == batch, warm, policy_cfg, gen_cfg,
        policy_threads, gen_threads, policy_cpus, gen_cpus,
    )  # fmt: skip


def progress_bar(cfg: GRPOConfig) -> Any:
    """The run's live progress display (a no-op with ``progress=False``)."""
    from phalanx.observe.progress import Progress

    return Progress(
        total=cfg.steps,
        start=0,
        title=f"GRPO {cfg.task}",
        enabled=cfg.progress,
        keys=["reward_mean", "accuracy", "eval/accuracy", "response_length", "time/step"],
    )


class GRPORun:
    """The workers of one GRPO run and what the loop does with them besides its step:
    launch and placement, the supervised warm-up or the resume, rollouts, evaluation,
    clean-up and the result."""

    def __init__(self, cfg: GRPOConfig, plan: RunPlan, task: Any, bar: Any) -> None:
        self.cfg, self.plan, self.task, self.bar = cfg, plan, task, bar
        self.policy: Any = None
        self.generation: Any = None
        self.refitter: Any = None
        self.rollouts: Any = None
        self.phase: PhaseThreads | None = None
        self.memory: Any = None
        self.history: list[dict[str, Any]] = []
        self.evals: list[tuple[int, float]] = []
        self.p_correct: list[tuple[int, float]] = []
        self.warmed_up = False  # the warm-up ran before the policy (LoRA)
        self.cluster: Any = None
        self._generation_restarts = RestartWatch(lambda: self.generation)

    def launch(self, cluster: Any, ckpt: str | None, metrics: Any) -> None:
        """The policy (from checkpoint ``ckpt`` when resuming) and generation groups, placed
        on their cores, and the refitter.

        A fresh LoRA run with a warm-up first warms up the whole model (a policy without
        adapters, dropped afterwards): LoRA's reference is its frozen base, so the adapters
        go on the warm-up's result (``sft_dir``), which is then the reference.
        """
        import phalanx as px
        from phalanx.llm.generation import HFGenerationWorker
        from phalanx.llm.refit import Refitter
        from phalanx.llm.vllm_generation import VllmGenerationWorker

        cfg, plan = self.cfg, self.plan
        cluster = self.cluster = cluster if cluster is not None else px.Cluster()
        if plan.warm and cfg.lora_rank and ckpt is None:
            whole = {k: v for k, v in plan.policy_cfg.items() if k != "dtensor_cfg"}
            full = self._start_policy(cluster, whole, None, init_reference_model=False)
            try:
                self._warm_up(full, metrics)
            finally:
                full.worker_group.shutdown(cleanup_method="shutdown", timeout=60)
            plan.policy_cfg = {**plan.policy_cfg, "model_name": plan.sft_dir}
            self.warmed_up = True
        self.policy = self._start_policy(
            cluster, plan.policy_cfg, ckpt, init_reference_model=cfg.kl_beta > 0 or plan.warm
        )
        with self.bar.waiting(f"{cfg.num_generation_workers} generation worker(s) loading"):
            worker = (
                VllmGenerationWorker if cfg.generation_backend == "vllm" else HFGenerationWorker
            )
            self.generation = worker.create_group(plan.gen_cfg, plan.tokenizer).launch(
                cluster,
                px.NodePlacement(num_workers=cfg.num_generation_workers),
                name=f"grpo_generation_{os.getpid()}",
                # A dead generation worker is restarted, and refitted before it is called.
                restart_policy=px.RestartPolicy(),
                # vLLM's engine compiles its graphs as it starts: minutes on a small CPU.
                timeout_s=VLLM_START_TIMEOUT_S if cfg.generation_backend == "vllm" else None,
            )
        place_group(self.generation, None, plan.gen_cpus)  # its threads are in gen_cfg
        if cfg.async_grpo and cfg.placement != "disaggregated" and not cfg.num_threads:
            # every core for the policy while no generation batch runs (phase_threads)
            idle = max(1, len(os.sched_getaffinity(0)) // cfg.num_policy_workers)
            self.phase = PhaseThreads(busy=plan.policy_threads, idle=idle)
        self._place_policy(self.policy)
        # Overlapping phases: the generators' memory is not a phase's (not measured).
        pg = self.policy.worker_group
        groups = {"policy": pg} if cfg.async_grpo else {"policy": pg, "generation": self.generation}
        self.memory = PhaseMemory(groups)
        self.refitter = Refitter(self.policy, self.generation, cfg.refit_transport)

    def _place_policy(self, policy: Any) -> None:
        """The policy workers' threads and cores, and the phase's thread count to follow."""
        pg = policy.worker_group
        place_group(pg, self.plan.policy_threads, self.plan.policy_cpus)
        if self.phase is not None:
            calls = [(r, (self.phase.path,), {}) for r in range(pg.world_size)]
            pg.apply(follow_phase_threads, calls, label="follow_threads").wait(timeout=60)

    def start_policy_from(self, old: Any, root: str, slot: int) -> tuple[Any, dict[str, float]]:
        """Shut the policy group ``old`` down (one of its ranks died) and start a new policy
        that restores the state kept in ``slot`` under ``root`` (``Policy.keep_state``),
        placed as the old one; the new policy and the seconds its predecessor's shutdown,
        its start and the state's load took.

        It touches no group but these two (the loop may go on meanwhile, on another
        thread): :meth:`install_policy` makes the new policy the run's. The reference is
        built as a resumed run builds it. A new policy that fails to load is shut down.
        """
        cfg, plan = self.cfg, self.plan
        t = time.perf_counter()
        self.memory.drop(old)  # no measurement calls the old group from now on
        # No clean-up call: the live ranks are stuck in a collective with the dead one.
        old.shutdown(timeout=5.0, force=True)
        t_down = time.perf_counter()
        policy_cfg = (
            {**plan.policy_cfg, "model_name": plan.sft_dir} if plan.warm else plan.policy_cfg
        )
        policy = self._start_policy(
            self.cluster,
            policy_cfg,
            None,
            shown=False,  # it may run beside the loop
            init_reference_model=cfg.kl_beta > 0 or plan.warm,
        )
        t_load = time.perf_counter()
        try:
            policy.restore_kept_state(root, slot)
            self._place_policy(policy)
        except BaseException:
            policy.worker_group.shutdown(timeout=5.0, force=True)
            raise
        return policy, {
            "shutdown": t_down - t,
            "start": t_load - t_down,
            "load": time.perf_counter() - t_load,
        }

    def install_policy(self, policy: Any) -> None:
        """Make ``policy`` (from :meth:`start_policy_from`) the run's: the loop's calls,
        the memory measurement and the refits go to it."""
        self.policy = policy
        self.memory.set_group("policy", policy.worker_group)
        self.refitter.replace_policy(policy)

    def _start_policy(
        self,
        cluster: Any,
        policy_cfg: dict[str, Any],
        ckpt: str | None,
        shown: bool = True,
        **kwargs: Any,
    ) -> Any:
        """A new policy group; ``shown``: the progress display says so (the loop's thread
        only: its waits nest)."""
        from phalanx.llm.policy import Policy

        cfg = self.cfg
        what = f"{cfg.num_policy_workers} policy worker(s) loading {cfg.model}"
        with self.bar.waiting(what) if shown else contextlib.nullcontext():
            return Policy(
                cluster,
                policy_cfg,
                self.plan.tokenizer,
                num_workers=cfg.num_policy_workers,
                name_prefix=f"grpo_policy_{os.getpid()}",
                weights_path=os.path.join(ckpt, "weights") if ckpt else None,
                optimizer_path=os.path.join(ckpt, "optim") if ckpt else None,
                timeout_s=cfg.policy_timeout_s,
                **kwargs,
            )

    def _warm_up(self, policy: Any, metrics: Any) -> None:
        """Supervised steps on the task's answers; the result is saved to ``sft_dir``."""
        from phalanx.algorithms.grpo_tiny_task import sft_batch
        from phalanx.llm.loss import NLLLoss

        cfg, plan = self.cfg, self.plan
        on_policy_workers(policy, set_worker_lr, cfg.warmup_lr, "set_lr")
        sft = {"gbs": cfg.warmup_batch_size, "mbs": cfg.warmup_batch_size // cfg.num_policy_workers}
        with self.bar.waiting(f"supervised warm-up, {cfg.warmup_steps} steps"):
            for i in range(cfg.warmup_steps):
                pairs = [(e.prompt, e.answer) for e in self.task.sample(cfg.warmup_batch_size)]
                out = policy.train(sft_batch(plan.tokenizer, pairs), NLLLoss(), **sft)
                if i == cfg.warmup_steps - 1 or i % 10 == 0:
                    metrics.log(-cfg.warmup_steps + i, {"sft_loss": float(out["loss"].mean())})
            _save_hf_model(policy, plan.base_dir, plan.sft_dir, plan.tokenizer)

    def warm_up_or_resume(self, ckpt: str | None, metrics: Any) -> int:
        """A fresh tiny run's supervised warm-up (its result becomes the reference), or a
        resumed run's step and random states; returns the step to continue from."""
        cfg, plan, policy = self.cfg, self.plan, self.policy
        start_step = 0
        if ckpt is None and plan.warm and not self.warmed_up:
            self._warm_up(policy, metrics)
            policy.worker_group.call("update_reference_model").wait(timeout=300)
            on_policy_workers(policy, reset_worker_optimizer, cfg.lr, "reset_optimizer")
        elif ckpt is not None:
            state = read_state(ckpt)
            start_step = state["step"]
            metrics.drop_after(start_step)  # steps after the checkpoint are redone now
            self.task.rng.setstate(_to_rng_state(state["task_rng"]))
            torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        if start_step or plan.warm:
            self.refitter.refit()  # the generators start from the base model's weights
        return start_step

    def start_rollouts(self, start_step: int) -> Any:
        """Where each step's batch comes from: made on demand (sync) or by a collector
        that runs ahead with older weights (async)."""
        cfg = self.cfg

        def make_batch() -> Any:
            # Asynchronous: a failed batch is dropped, the collector counts the failure.
            return rollout(cfg, self.task, self.plan.tokenizer, lambda prompts: generate(
                self.generation, prompts, cfg.generation_timeout_s, retry=not cfg.async_grpo
            ))  # fmt: skip

        if cfg.async_grpo:
            self.rollouts = AsyncRollouts(
                make_batch, self.refitter.refit, self.generation,
                max_trajectory_age_steps=cfg.max_trajectory_age_steps,
                max_generation_failures=cfg.max_generation_failures,
                start_version=start_step, timeout_s=cfg.generation_timeout_s,
                on_generating=self.phase.generating if self.phase is not None else None,
            )  # fmt: skip
        else:
            self.rollouts = SyncRollouts(make_batch, self.refit, self.memory)
        return self.rollouts

    def refit(self) -> Any:
        """Refit the generators, once more after a generation worker that had died was
        restarted."""
        return refit_past_generator_deaths(
            self.refitter.refit, self.generation, self.cfg.generation_timeout_s
        )

    def refit_restored(self, version: int) -> None:
        """Refit the generators with a relaunched policy's state, which is the policy's
        version ``version`` (the step it was kept after); the collector of asynchronous
        GRPO takes that version under the same pause."""
        if isinstance(self.rollouts, AsyncRollouts):
            self.rollouts.restore(version)
        else:
            self.refit()

    def evaluate(self, step: int) -> dict[str, Any]:
        """Greedy accuracy on the held-out split (and the tiny task's answer probability)."""
        cfg, task = self.cfg, self.task
        with self.bar.waiting(f"held-out evaluation ({len(task.heldout)} problems, greedy)"):
            t = time.perf_counter()
            if self.phase is not None:  # async, shared: nothing else runs, every core
                every = len(os.sched_getaffinity(0)) // cfg.num_generation_workers
                place_group(self.generation, max(1, every), None)
            try:
                row, samples = evaluate_accuracy(
                    self.generation, self.plan.tokenizer, task, cfg.system_prompt,
                    cfg.generation_timeout_s,
                )  # fmt: skip
            finally:
                if self.phase is not None:
                    place_group(self.generation, self.plan.gen_threads, None)
            if cfg.task == "tiny-addition":
                pairs = [(e.prompt, e.answer) for e in task.heldout]
                row["p_correct"] = answer_probability(self.policy, self.plan.tokenizer, pairs)
                self.p_correct.append((step, row["p_correct"]))
            row["time/eval"] = time.perf_counter() - t
        self.evals.append((step, row["eval/accuracy"]))
        self.bar.log(f"[grpo] step {step}: held-out accuracy {row['eval/accuracy']:.3f}")
        for prompt, response, reward in samples:
            self.bar.log(f"  {prompt!r} -> {response!r} (reward {reward:g})")
        return row

    def restarts(self) -> dict[str, int]:
        """Restart counts for the step's metrics row."""
        return {"generation_restarts": self.generation.num_remote_worker_restarts()}

    def log_generation_restarts(self, step: int, metrics: Any) -> None:
        """A ``recovery/*`` row at ``step`` and a console line for each generation worker
        its group restarted (and refitted) since the last call."""
        for r in self._generation_restarts.new():
            reason = f"{self.generation.name}[rank {r.rank}]: {r.reason}"
            metrics.log(step, recovery_row(r, "generation", step, **{"recovery/reason": reason}))
            self.bar.log(
                f"[grpo] step {step}: generation worker {reason}; restarted and refitted in "
                f"{r.seconds:.1f} s (its new process: {r.start_seconds:.1f} s)"
            )

    def close(self, failed: bool) -> None:
        """Stop the collector and every group; after a failure a stuck worker gets a short
        grace (5 s for the whole clean-up, else 60 s)."""
        deadline = time.monotonic() + (5.0 if failed else 60.0)

        def grace_s() -> float:
            return max(0.5, deadline - time.monotonic())

        if self.rollouts is not None:
            self.rollouts.close()
        if self.generation is not None:
            self.generation.shutdown(timeout=grace_s())
        if self.refitter is not None:
            self.refitter.close()  # its shared-memory ring goes
        if self.policy is not None:
            self.policy.worker_group.shutdown(cleanup_method="shutdown", timeout=grace_s())
        if isinstance(self.rollouts, AsyncRollouts):
            self.rollouts.join(grace_s())
        if self.phase is not None:
            self.phase.close()

    def result(self, t_start: float) -> dict[str, Any]:
        """What ``train`` returns; writes the learning curve."""
        from phalanx.observe.metrics import read_metrics
        from phalanx.observe.plots import plot_learning_curve

        cfg = self.cfg
        curve: str | None = os.path.join(cfg.run_dir, "curve.png")
        if not plot_learning_curve(read_metrics(cfg.run_dir), curve, f"GRPO {cfg.task}"):
            curve = None
        return {
            "history": self.history,
            "eval_accuracy": self.evals,
            "p_correct": self.p_correct,
            "run_dir": cfg.run_dir,
            "model_dir": self.plan.base_dir,
            "curve": curve,
            "wall_s": time.perf_counter() - t_start,
        }


def save_checkpoint(cfg: GRPOConfig, policy: Any, task: Any, step: int) -> None:
    """Write ``checkpoints/step_<step>`` (``run_checkpoints``' format): the policy's
    weights, optimizer and tokenizer, and in its state the task's and torch's random
    states and the config (what resuming reads).

    A write that fails (a full disk, here or on a policy worker) raises ``OSError``
    naming the folder and the errno (``ENOSPC``); the previous checkpoints stay.
    """

    def write_files(folder: str) -> None:
        policy.save_checkpoint(
            os.path.join(folder, "weights"),
            os.path.join(folder, "optim"),
            os.path.join(folder, "tokenizer"),
        )

    state = {
        "task_rng": task.rng.getstate(),
        "torch_rng": torch.get_rng_state().tolist(),
        "config": asdict(cfg),
    }
    write_checkpoint(cfg.run_dir, step, state, write_files)
