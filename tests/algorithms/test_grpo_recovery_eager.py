"""A policy rank that dies while no policy call runs is relaunched as soon as its death is
seen, not when the loop next calls the policy: the group's death listener starts the
relaunch while the generators work, the next policy call waits for it, refits and goes
on; nothing is redone and the death is counted once.

A rank is SIGKILLed at a named point of the loop (as a generation batch starts, or in
the step hook ``train(on_training=...)``), and the loop is held there until the relaunch
has begun (an event its start sets, with a deadline), never after a sleep.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

import phalanx as px
from phalanx.algorithms.grpo import train
from phalanx.algorithms.grpo_recovery import PolicyRecovery
from phalanx.algorithms.grpo_run import GRPORun
from phalanx.observe.metrics import read_metrics
from tests.algorithms.test_grpo_recovery import _weights
from tests.algorithms.test_grpo_recovery_phases import _cfg
from tests.helpers import until


class Relaunches:
    """Every policy relaunch a run starts (``GRPORun.start_policy_from``, run as it is):
    how many began, each one's (start, end) on ``time.monotonic()``, and an event set
    when one begins."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.begun = 0
        self.spans: list[tuple[float, float]] = []
        self.began = threading.Event()
        real = GRPORun.start_policy_from

        def start_policy_from(run: GRPORun, *args: Any) -> Any:
            t = time.monotonic()
            self.begun += 1
            self.began.set()
            try:
                return real(run, *args)
            finally:
                self.spans.append((t, time.monotonic()))

        monkeypatch.setattr(GRPORun, "start_policy_from", start_policy_from)


def policy_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str, float]]:
    """(step, phase, time.monotonic()) of each policy call of the loop as it begins."""
    calls: list[tuple[int, str, float]] = []
    real = PolicyRecovery.call

    def call(recovery: PolicyRecovery, step: int, phase: str, fn: Any) -> Any:
        calls.append((step, phase, time.monotonic()))
        return real(recovery, step, phase, fn)

    monkeypatch.setattr(PolicyRecovery, "call", call)
    return calls


def recovery_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if "recovery/seconds" in r]


def _optimizer_steps(checkpoint: Path) -> tuple[int, float]:
    """(the scheduler's step count, Adam's step count) saved in a GRPO checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = checkpoint.parent.parent / f"optim_{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint / "optim"), str(out))
    saved = torch.load(out, weights_only=False)
    adam = {float(s["step"]) for s in saved["optim"]["state"].values()}
    assert len(adam) == 1, adam  # every parameter stepped together
    return saved["scheduler"]["last_epoch"], adam.pop()


def _check_row(row: dict[str, Any], step: int, rank: int) -> None:
    """One eager recovery's row: nothing redone, counted once, the relaunch started at
    once and the call waited only for what was left of it."""
    assert {k: row[k] for k in ("step", "recovery/group", "recovery/rank", "recovery/repeated",
                                "recovery/count")} == {
        "step": step, "recovery/group": "policy", "recovery/rank": rank,
        "recovery/repeated": "none", "recovery/count": 1,
    }  # fmt: skip
    assert row["recovery/reason"].startswith(f"grpo_policy_{os.getpid()}[rank {rank}] died ("), row
    assert 0.0 <= row["recovery/noticed_seconds"] < 5.0, row
    assert 0.0 <= row["recovery/wait_seconds"] < row["recovery/seconds"], row
    parts = row["recovery/start_seconds"] + row["recovery/load_seconds"]
    assert row["recovery/load_seconds"] > 0 and parts < row["recovery/seconds"], row


@pytest.mark.timeout(120)
def test_a_death_listener_hears_each_death_once_from_the_health_monitor(cluster):
    """``add_death_listener``: told (rank, reason) on the health monitor's thread when a
    rank dies with no call running; one that raises does not stop the others; a removed
    one is not told."""
    from tests.workers import Recorder

    group = Recorder.create_group().launch(cluster, px.NodePlacement(num_workers=2), name="heard")
    heard: list[tuple[int, str, str]] = []
    second = threading.Event()

    def broken(rank: int, reason: str) -> None:
        raise RuntimeError("a listener's own failure")

    def listener(rank: int, reason: str) -> None:
        heard.append((rank, reason, threading.current_thread().name))

    try:
        group.add_death_listener(broken)
        remove = group.add_death_listener(listener)
        group.add_death_listener(lambda rank, reason: second.set() if rank == 0 else None)
        ray.kill(group.actors[1], no_restart=True)
        assert until(lambda: len(heard) == 1, 30), heard
        ((rank, reason, thread),) = heard
        assert (rank, thread) == (1, "phalanx-health-monitor")
        assert reason.startswith("actor died: "), reason
        assert group.health()[1] == px.WorkerHealth.DEAD

        remove()
        ray.kill(group.actors[0], no_restart=True)
        assert second.wait(30)  # the listeners run in order: a removed one came before
        assert len(heard) == 1
        with pytest.raises(TypeError, match="listener must be callable, got NoneType"):
            group.add_death_listener(None)
    finally:
        group.shutdown(timeout=10)


@pytest.mark.slow(reason="a two-step GRPO run with a policy relaunch")
@pytest.mark.timeout(600)
def test_policy_rank_killed_during_generation_is_relaunched_before_the_next_policy_call(
    cluster, tmp_path, monkeypatch
):
    """Rank 1 is SIGKILLed as step 2's generation starts: its relaunch begins while the
    batch is generated (the generation waits for that, no longer), the step's first
    policy call waits for the relaunch and trains on the state kept after step 1; the
    batch is generated once and each checkpoint holds what its step trained."""
    from phalanx.algorithms import grpo_run

    run_dir = tmp_path / "run"
    relaunches = Relaunches(monkeypatch)
    calls = policy_calls(monkeypatch)
    trained: dict[int, dict[str, torch.Tensor]] = {}
    pids: list[int] = []  # the policy's rank 1, read after step 1's training
    batches: list[float] = []  # when each generation batch ended
    began_during_generation: list[bool] = []
    real_generate = grpo_run.generate

    def generate(group: Any, prompts: Any, *args: Any, **kwargs: Any) -> Any:
        if len(batches) == 1:
            os.kill(pids[0], signal.SIGKILL)
            began_during_generation.append(relaunches.began.wait(60))
        out = real_generate(group, prompts, *args, **kwargs)
        batches.append(time.monotonic())
        return out

    def on_training(step: int, policy: Any) -> None:
        trained[step] = policy.state_dict()
        if step == 1:
            pids.append(policy.worker_group.worker_metadata[1]["pid"])

    monkeypatch.setattr(grpo_run, "generate", generate)
    hist = train(_cfg(run_dir), cluster, on_training=on_training)["history"]

    assert began_during_generation == [True]
    assert len(batches) == 2  # the generation is not redone
    assert relaunches.begun == 1
    ((began, _),) = relaunches.spans
    (learn_2,) = [t for step, phase, t in calls if (step, phase) == (2, "log-probs and training")]
    assert began < batches[1] < learn_2
    (row,) = recovery_rows(run_dir)
    _check_row(row, step=2, rank=1)
    assert [h["step"] for h in hist] == [1, 2]
    assert [h["policy_restarts"] for h in hist] == [0, 1]
    name = next(iter(trained[1]))
    assert not torch.equal(trained[1][name], trained[2][name])  # a redone step would show
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step_1", "step_2"]
    for step, weights in trained.items():
        saved = _weights(run_dir, step)
        assert sorted(saved) == sorted(weights)
        for key, tensor in weights.items():
            torch.testing.assert_close(saved[key], tensor, rtol=0, atol=0, msg=key)


@pytest.mark.slow(reason="a three-step asynchronous GRPO run with a policy relaunch")
@pytest.mark.timeout(600)
def test_async_policy_rank_killed_between_steps_is_relaunched_while_the_collector_generates(
    cluster, tmp_path, monkeypatch
):
    """Asynchronous GRPO: the policy's rank is SIGKILLed after step 1's training, the
    collector generating ahead; the relaunch begins before the step's refit calls the
    policy, that refit restores the generators' version under the collector's pause, and
    the run goes on with one optimizer step per GRPO step and no batch dropped."""
    run_dir = tmp_path / "run"
    relaunches = Relaunches(monkeypatch)
    calls = policy_calls(monkeypatch)
    began_before_refit: list[bool] = []

    def on_training(step: int, policy: Any) -> None:
        if step == 1:
            os.kill(policy.worker_group.worker_metadata[0]["pid"], signal.SIGKILL)
            began_before_refit.append(relaunches.began.wait(60))

    cfg = _cfg(run_dir, async_grpo=True, steps=3, num_policy_workers=1)
    hist = train(cfg, cluster, on_training=on_training)["history"]

    assert began_before_refit == [True]
    assert relaunches.begun == 1
    ((began, _),) = relaunches.spans
    (refit_1,) = [t for step, phase, t in calls if (step, phase) == (1, "refit")]
    assert began < refit_1
    (row,) = recovery_rows(run_dir)
    _check_row(row, step=1, rank=0)
    assert [h["step"] for h in hist] == [1, 2, 3]
    assert [h["policy_restarts"] for h in hist] == [1, 1, 1]
    for h in hist:
        assert h["async/trajectory_version"] in (max(h["step"] - 2, 0), h["step"] - 1), h
        assert h["async/dropped_stale"] == 0 and h["async/generation_failures"] == 0
    steps = [_optimizer_steps(run_dir / "checkpoints" / f"step_{s}") for s in (1, 2, 3)]
    assert [sched for sched, _ in steps] == [1, 2, 3]
    assert [adam for _, adam in steps] == [steps[0][1] + i for i in range(3)]
