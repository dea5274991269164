"""What GRPO's driver asks of its worker groups: a prompt batch split over the generation
workers (once more after a worker died under it), rewards of the responses, the held-out
greedy evaluation, per-phase peak memory, and thread counts and learning rates on the
policy workers."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch


def answer_probability(policy, tokenizer, pairs) -> float:
    """Mean over ``pairs`` of the policy's probability of the exact answer and end token
    (the tiny task's noise-free view of the expected 0/1 reward, from log-probs)."""
    from phalanx.algorithms.grpo_tiny_task import sft_batch

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


def refit_past_generator_deaths(refit: Callable[[], Any], generation: Any, timeout: float) -> Any:
    """``refit()``, once more when it failed because a generation worker had died: a call
    on the group restarts that worker first (its restart hooks give it the sender's last
    weights). A failure with no generation worker restarted is raised."""
    before = generation.num_remote_worker_restarts()
    try:
        return refit()
    except Exception:
        generation.call("is_alive").wait(timeout=timeout)
        if generation.num_remote_worker_restarts() == before:
            raise
        return refit()


def generate(gen_group, data, timeout: float = 300.0, greedy: bool = False, retry: bool = True):
    """Split a prompt batch over the generation workers and put the outputs back in order
    (once more after a worker died under it when ``retry``). After a sampled batch the
    group keeps each rank's sampler state, which a restarted rank is given: the batch a
    death interrupted, or the next one, is sampled with the random numbers the dead rank
    would have used (where the backend's sampler can be restored)."""
    from phalanx.data import BatchedDataDict

    shards = data.shard_by_batch_size(gen_group.world_size, allow_uneven_shards=True)
    calls = [(r, (s,), {"greedy": greedy}) for r, s in enumerate(shards)]
    if retry:
        outs = _retry_once_after_death(lambda: gen_group.call_ranks("generate", calls), timeout)
        if not greedy:
            _retry_once_after_death(lambda: gen_group.call("get_state"), timeout)
    else:
        outs = gen_group.call_ranks("generate", calls).wait(timeout=timeout)
    return BatchedDataDict.from_batches(outs, pad_value_dict={"output_ids": 0})


def score(tokenizer, task, examples, prompts, gen) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Rewards [B] of generated responses, which were truncated (no stop token), and the
    responses' text."""
    B = len(examples)
    rewards, truncated = torch.zeros(B), torch.zeros(B, dtype=torch.bool)
    texts = []
    for i in range(B):
        n, g = int(prompts["input_lengths"][i]), int(gen["generation_lengths"][i])
        tokens = gen["output_ids"][i, n : n + g]
        texts.append(tokenizer.decode(tokens, skip_special_tokens=True))
        truncated[i] = g == 0 or int(tokens[-1]) != tokenizer.eos_token_id
        rewards[i] = task.reward(texts[i], examples[i], bool(truncated[i]))
    return rewards, truncated, texts


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


class PhaseMemory:
    """Peak resident memory of every worker of ``groups`` during each phase (GB, max over
    ranks): the kernel's per-process high-water mark, reset when a phase starts.

    A group with a rank that stays dead is left out (0.0 when no group is left): the
    measurement never ends a run, the group's next call of the run meets the death. A
    measurement and a change of the groups (:meth:`drop`, :meth:`set_group`, from a policy
    relaunch on another thread) take turns, so no measurement calls a group being shut
    down."""

    def __init__(self, groups: dict[str, Any]):
        self.groups = dict(groups)
        self._lock = threading.Lock()

    def _all(self, fn) -> list[float]:
        from phalanx._base.errors import WorkerDiedError

        out = []
        with self._lock:
            for g in self.groups.values():
                calls = [(r, (), {}) for r in range(g.world_size)]
                label = fn.__name__.strip("_")
                try:
                    out.extend(
                        _retry_once_after_death(
                            functools.partial(g.apply, fn, calls, label=label), 60
                        )
                    )
                except WorkerDiedError:
                    continue
        return out

    def reset(self) -> None:
        self._all(_reset_peak_rss)

    def peak(self) -> float:
        return max(self._all(_peak_rss_gb), default=0.0)

    def drop(self, group: Any) -> None:
        """Measure ``group`` no more (once any measurement under way has ended)."""
        with self._lock:
            self.groups = {k: g for k, g in self.groups.items() if g is not group}

    def set_group(self, name: str, group: Any) -> None:
        """Measure ``group`` as ``name`` from now on."""
        with self._lock:
            self.groups = {**self.groups, name: group}


def set_threads(worker: Any, n: int) -> int:
    """(On a worker) use ``n`` torch threads; returns the count torch took."""
    torch.set_num_threads(int(n))
    return torch.get_num_threads()


def pin_to_cpus(worker: Any, cpus: list[int]) -> list[int]:
    """(On a worker) run only on ``cpus`` (Linux CPU affinity); returns the new set."""
    import os

    os.sched_setaffinity(0, cpus)
    return sorted(os.sched_getaffinity(0))


def thread_shares(cfg: Any) -> tuple[int, int, list[int] | None, list[int] | None]:
    """Torch threads of each policy and generation worker, and the CPUs each role is
    pinned to (None: not pinned). Phases that do not overlap (synchronous, shared) each
    take every core; overlapping ones (asynchronous) or pinned ones (disaggregated) get
    half of them each, the policy the first half. Asynchronous and shared, the policy's
    count is the one while a batch is generated: it takes every core while none is
    (:mod:`phalanx.algorithms.phase_threads`)."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    split = cfg.async_grpo or cfg.placement == "disaggregated"
    policy_share, gen_share = (half, len(cpus) - half) if split else (len(cpus), len(cpus))
    policy_threads = cfg.num_threads or max(1, policy_share // cfg.num_policy_workers)
    gen_threads = cfg.num_threads or max(1, gen_share // cfg.num_generation_workers)
    if cfg.placement != "disaggregated":
        return policy_threads, gen_threads, None, None
    return policy_threads, gen_threads, cpus[:half], cpus[half:] or cpus[:half]


def place_group(group: Any, threads: int | None, cpus: list[int] | None) -> None:
    """Set every worker's torch threads (``threads``) and pin it to ``cpus``; a restarted
    worker is pinned again before it takes a call."""

    def place(ranks: list[int]) -> None:
        if threads is not None:
            calls = [(r, (threads,), {}) for r in ranks]
            group.apply(set_threads, calls, label="threads").wait(timeout=60)
        if cpus is not None:
            calls = [(r, (cpus,), {}) for r in ranks]
            group.apply(pin_to_cpus, calls, label="pin_to_cpus").wait(timeout=60)

    place(list(range(group.world_size)))
    if cpus is not None:
        group.add_restart_hook(place)


def set_worker_lr(worker: Any, lr: float) -> None:
    """(On a policy worker) set the optimizer's and the scheduler's learning rate."""
    for group in worker.optimizer.param_groups:
        group["lr"] = lr
        group["initial_lr"] = lr
    if worker.scheduler is not None:
        worker.scheduler.base_lrs = [lr for _ in worker.scheduler.base_lrs]


def reset_worker_optimizer(worker: Any, lr: float) -> None:
    """(On a policy worker) a fresh optimizer (no moments) at learning rate ``lr``."""
    worker._init_optimizer()
    set_worker_lr(worker, lr)


def on_policy_workers(policy: Any, fn: Any, lr: float, label: str) -> None:
    """Run ``fn(worker, lr)`` on every policy worker and wait for it."""
    g = policy.worker_group
    g.apply(fn, [(r, (lr,), {}) for r in range(g.world_size)], label=label).wait(timeout=120)


def evaluate_accuracy(
    generation, tokenizer, task, system_prompt, timeout: float, num_samples: int = 3
) -> tuple[dict[str, float], list[tuple[str, str, float]]]:
    """Greedy accuracy (reward 1) on the held-out split, with truncation and length; and
    ``num_samples`` (prompt, response, reward) triples to show."""
    import phalanx as px
    from phalanx.algorithms.grpo_chat import encode_chat_prompts

    examples = task.heldout
    ids, lengths = encode_chat_prompts(tokenizer, [e.prompt for e in examples], system_prompt)
    prompts = px.BatchedDataDict(input_ids=ids, input_lengths=lengths)
    gen = generate(generation, prompts, timeout=timeout, greedy=True)
    rewards, truncated, texts = score(tokenizer, task, examples, prompts, gen)
    samples = [(e.prompt, t, float(r)) for e, t, r in zip(examples, texts, rewards)]
    return {
        "eval/accuracy": float((rewards >= 1.0).float().mean()),
        "eval/reward": float(rewards.mean()),
        "eval/truncated": float(truncated.float().mean()),
        "eval/response_length": float(gen["generation_lengths"].float().mean()),
    }, samples[:num_samples]
