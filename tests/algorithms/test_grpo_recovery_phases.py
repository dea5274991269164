"""A policy rank that dies in the held-out evaluation or in the checkpoint of a GRPO step
is recovered as one that dies in training: the policy group is relaunched from the last
state kept, and only the interrupted part is done again; nothing is trained twice: each
checkpoint holds the weights its step trained. A generation worker that dies in the
evaluation is restarted by its group and the evaluation done. (A policy rank that dies
while no policy call runs: ``test_grpo_recovery_eager.py``.)

A rank dies by its own hand when the named call reaches it (installed by the step hook
``train(on_training=...)``), or by a SIGKILL as a generation call starts; never after a
sleep.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.algorithms.grpo import GRPOConfig, train
from phalanx.observe.metrics import read_metrics


def die_in_next_logprobs(worker: Any) -> None:
    """(On a policy rank) end this process when the next log-probs call reaches it."""
    worker.get_logprobs = lambda *args, **kwargs: os._exit(1)


def die_in_next_checkpoint(worker: Any) -> None:
    """(On a policy rank) end this process when the next checkpoint call reaches it."""
    worker.save_checkpoint = lambda *args, **kwargs: os._exit(1)


def _cfg(run_dir: Path, **overrides: Any) -> GRPOConfig:
    base = dict(
        run_dir=str(run_dir),
        steps=2,
        prompts_per_step=2,
        samples_per_prompt=2,
        train_micro_batch_size=2,
        num_policy_workers=2,
        warmup_steps=0,
        eval_every=0,
        checkpoint_every=1,
        weight_decay=0.1,  # every step moves the weights, also one without an advantage
        progress=False,
    )
    return GRPOConfig.tiny(**{**base, **overrides})


def _recoveries(run_dir: Path) -> list[dict[str, Any]]:
    return [
        {k: r[k] for k in ("step", "recovery/group", "recovery/rank", "recovery/repeated")}
        for r in read_metrics(run_dir)
        if "recovery/seconds" in r
    ]


def _assert_checkpoints_hold(run_dir: Path, trained: dict[int, dict[str, torch.Tensor]]) -> None:
    """Each step's checkpoint holds exactly the weights its training left (``trained``),
    and a step trained again would show (the steps' weights differ)."""
    name = next(iter(trained[1]))
    assert not torch.equal(trained[1][name], trained[2][name])
    assert sorted(os.listdir(run_dir / "checkpoints")) == [f"step_{s}" for s in sorted(trained)]
    for step, weights in trained.items():
        saved = _weights(run_dir, step)
        assert sorted(saved) == sorted(weights)
        for key, tensor in weights.items():
            torch.testing.assert_close(saved[key], tensor, rtol=0, atol=0, msg=key)


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The policy weights of checkpoint ``step_<step>`` (DCP folder -> one torch file)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run_dir / f"weights_{step}.pt"
    dcp_to_torch_save(str(run_dir / "checkpoints" / f"step_{step}" / "weights"), str(out))
    return torch.load(out, weights_only=True)["model"]


@pytest.mark.slow(reason="a two-step GRPO run with two policy relaunches")
@pytest.mark.timeout(600)
def test_policy_rank_killed_in_evaluation_and_in_checkpoint_redoes_only_that_part(
    cluster, tmp_path
):
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, eval_every=1, eval_size=10, eval_at_start=False)
    trained: dict[int, dict[str, torch.Tensor]] = {}  # the weights each step's training left
    plan = {1: (die_in_next_logprobs, 1), 2: (die_in_next_checkpoint, 0)}

    def on_training(step: int, policy: Any) -> None:
        trained[step] = policy.state_dict()
        fn, rank = plan[step]
        policy.worker_group.apply(fn, [(rank, (), {})], label=fn.__name__).wait(timeout=60)

    hist = train(cfg, cluster, on_training=on_training)["history"]

    assert _recoveries(run_dir) == [
        {"step": 1, "recovery/group": "policy", "recovery/rank": 1,
         "recovery/repeated": "evaluation"},
        {"step": 2, "recovery/group": "policy", "recovery/rank": 0,
         "recovery/repeated": "checkpoint"},
    ]  # fmt: skip
    assert [h["step"] for h in hist] == [1, 2]
    assert [h["policy_restarts"] for h in hist] == [1, 1]  # the second came after its row
    rows = read_metrics(run_dir)
    evals = [(r["step"], 0.0 <= r["p_correct"] <= 1.0) for r in rows if "eval/accuracy" in r]
    assert evals == [(1, True), (2, True)]  # each evaluation once, done in full
    _assert_checkpoints_hold(run_dir, trained)


@pytest.mark.slow(reason="a two-step GRPO run with a generation worker restart")
@pytest.mark.timeout(600)
def test_generation_worker_killed_in_the_evaluation_is_restarted_and_the_evaluation_done(
    cluster, tmp_path, monkeypatch
):
    """The generation worker is SIGKILLed as step 1's held-out evaluation calls it: its
    group restarts and refits it (a call that met the death first is made again), the
    evaluation is done once, and the run goes on."""
    from phalanx.algorithms import grpo_group_calls

    run_dir = tmp_path / "run"
    killed: list[int] = []
    real_generate = grpo_group_calls.generate

    def generate(group: Any, prompts: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("greedy") and not killed:  # the evaluation's call
            killed.append(group.worker_metadata[0]["pid"])
            os.kill(killed[0], signal.SIGKILL)
        return real_generate(group, prompts, *args, **kwargs)

    monkeypatch.setattr(grpo_group_calls, "generate", generate)
    cfg = _cfg(run_dir, num_policy_workers=1, eval_every=1, eval_size=10, eval_at_start=False)
    hist = train(cfg, cluster)["history"]

    assert len(killed) == 1
    rows = read_metrics(run_dir)
    assert [(r["step"], r["recovery/group"], r["recovery/rank"]) for r in rows
            if "recovery/seconds" in r] == [(1, "generation", 0)]  # fmt: skip
    assert [h["step"] for h in hist] == [1, 2]
    assert [h["generation_restarts"] for h in hist] == [1, 1]
    evals = [(r["step"], 0.0 <= r["eval/accuracy"] <= 1.0) for r in rows if "eval/accuracy" in r]
    assert evals == [(1, True), (2, True)]
