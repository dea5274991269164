"""One GRPO rollout: prompts -> responses -> rewards -> group-normalised advantages, as a
batch of trajectories; the training batch made from trajectories; their metrics.

A trajectory batch is a ``BatchedDataDict`` of ``prompts_per_step * samples_per_prompt``
rows, each prompt's samples consecutive (one group):

    input_ids            prompt and response, right-padded to the longest row
    input_lengths        prompt + response tokens per row
    prompt_lengths       prompt tokens per row
    generation_logprobs  log-prob of each response token under the generating weights,
                         recorded while sampling (0 elsewhere), same layout as input_ids
    generation_lengths   response tokens per row (the stop token included)
    rewards, truncated   the task's reward, and whether the response hit max_new_tokens
    advantages           (reward - its group's mean) / (its group's std + 1e-6)

Asynchronous GRPO adds ``version`` (the weights version that generated each row).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from phalanx.data import BatchedDataDict


def group_normalized_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + 1e-6); groups are consecutive rows."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    g = rewards.view(-1, group_size)
    adv = (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)
    return adv.view(-1)


def rollout(
    cfg: Any,
    task: Any,
    tokenizer: Any,
    generate_fn: Callable[[BatchedDataDict], BatchedDataDict],
) -> BatchedDataDict:
    """Sample ``cfg.prompts_per_step`` problems, ``cfg.samples_per_prompt`` responses each
    through ``generate_fn`` (prompt batch -> generation output), and score them."""
    from phalanx.algorithms.grpo_chat import encode_chat_prompts
    from phalanx.algorithms.grpo_group_calls import score

    problems = task.sample(cfg.prompts_per_step)
    ids, lengths = encode_chat_prompts(tokenizer, [e.prompt for e in problems], cfg.system_prompt)
    prompts = BatchedDataDict(input_ids=ids, input_lengths=lengths)
    prompts = prompts.repeat_interleave(cfg.samples_per_prompt)
    examples = [e for e in problems for _ in range(cfg.samples_per_prompt)]
    gen = generate_fn(prompts)
    rewards, truncated, _ = score(tokenizer, task, examples, prompts, gen)
    T = int(gen["unpadded_sequence_lengths"].max())
    return BatchedDataDict(
        input_ids=gen["output_ids"][:, :T],
        input_lengths=gen["unpadded_sequence_lengths"],
        prompt_lengths=prompts["input_lengths"],
        generation_logprobs=gen["logprobs"][:, :T],
        generation_lengths=gen["generation_lengths"],
        rewards=rewards,
        truncated=truncated,
        advantages=group_normalized_advantages(rewards, cfg.samples_per_prompt),
    )


def training_batch(traj: BatchedDataDict, version: int) -> BatchedDataDict:
    """The policy's input: the loss counts the response tokens only. The generator's
    log-probs go with it, and ``generation_is_current`` [B]: 1 where the row's ``version``
    is the policy's ``version`` now (every row without versions: synchronous GRPO)."""
    T = int(traj["input_lengths"].max())
    pos = torch.arange(T)[None]
    token_mask = (pos >= traj["prompt_lengths"][:, None]) & (pos < traj["input_lengths"][:, None])
    current = traj["version"] == version if "version" in traj else torch.ones(traj.size)
    return BatchedDataDict(
        input_ids=traj["input_ids"][:, :T],
        input_lengths=traj["input_lengths"],
        token_mask=token_mask.float(),
        sample_mask=torch.ones(traj.size),
        advantages=traj["advantages"],
        generation_logprobs=traj["generation_logprobs"][:, :T],
        generation_is_current=current.float(),
    )


def rollout_metrics(traj: BatchedDataDict, group_size: int) -> dict[str, float]:
    """Reward, accuracy (reward >= 1), truncation, groups with a reward spread, length."""
    rewards = traj["rewards"]
    groups = rewards.view(-1, group_size)
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "accuracy": float((rewards >= 1.0).float().mean()),
        "truncated": float(traj["truncated"].float().mean()),
        "groups_with_signal": float((groups.std(1) > 0).float().mean()),
        "response_length": float(traj["generation_lengths"].float().mean()),
    }


class SyncRollouts:
    """Rollouts made when the trainer asks, one phase after another (synchronous GRPO);
    the same face as ``grpo_async.AsyncRollouts``."""

    def __init__(
        self, make_batch: Callable[[], BatchedDataDict], refit: Callable[[], Any], memory: Any
    ) -> None:
        self._make_batch, self._refit, self._memory = make_batch, refit, memory

    def take(self, step: int) -> tuple[BatchedDataDict, dict[str, float]]:
        """A fresh rollout for ``step``, with its generation time and peak memory."""
        t = time.perf_counter()
        self._memory.reset()
        batch = self._make_batch()
        return batch, {
            "time/generation": time.perf_counter() - t,
            "memory/generation_peak_gb": self._memory.peak(),
        }

    def paused(self) -> contextlib.nullcontext:
        """Nothing runs beside the trainer: nothing to pause."""
        return contextlib.nullcontext(0.0)

    def refit(self) -> dict[str, float]:
        """Refit the generators with the policy's new weights."""
        t = time.perf_counter()
        self._refit()
        return {"time/refit": time.perf_counter() - t}

    def close(self) -> None:
        """Nothing to stop."""
