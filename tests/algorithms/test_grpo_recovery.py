"""A GRPO run survives the death of a policy rank in place: the policy group is
relaunched from the state kept after the last step, the generators are refitted and the
interrupted part of the step is done again, so the run ends with the weights of a run
nobody disturbed. Past ``max_restarts`` the run ends with the death's error (exit 4)
and a folder that resumes.

A rank dies by its own hand at a named point (``os._exit`` installed on that rank by the
step hook ``train(on_training=...)``: ``tests.helpers.kill_plan``), never after a sleep.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.algorithms import _harness as harness
from phalanx.algorithms.grpo import GRPOConfig, train
from phalanx.algorithms.grpo_recovery import PolicyRecovery, RestartBudgetSpentError
from phalanx.algorithms.run_checkpoints import latest_checkpoint
from phalanx.observe.metrics import read_metrics
from tests.helpers import die_in_next_refit, die_in_next_train, kill_plan


def _cfg(run_dir: Path, **overrides: Any) -> GRPOConfig:
    base = dict(
        run_dir=str(run_dir),
        steps=3,
        prompts_per_step=2,
        samples_per_prompt=2,
        train_micro_batch_size=2,
        num_policy_workers=2,  # FSDP over two ranks: a relaunch rebuilds its process group
        warmup_steps=0,
        warmup_batch_size=2,
        eval_every=0,
        checkpoint_every=1,
        progress=False,
    )
    return GRPOConfig.tiny(**{**base, **overrides})


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The policy weights of checkpoint ``step_<step>`` (DCP folder -> one torch file)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run_dir / f"weights_{step}.pt"
    dcp_to_torch_save(str(run_dir / "checkpoints" / f"step_{step}" / "weights"), str(out))
    return torch.load(out, weights_only=True)["model"]


def _recoveries(run_dir: Path) -> list[dict[str, Any]]:
    return [
        {k: r[k] for k in ("step", "recovery/group", "recovery/rank", "recovery/repeated")}
        for r in read_metrics(run_dir)
        if "recovery/seconds" in r
    ]


@pytest.mark.slow(reason="two three-step GRPO runs with two policy relaunches")
@pytest.mark.timeout(600)
def test_policy_rank_killed_in_training_and_in_refit_ends_with_undisturbed_weights(
    cluster, tmp_path
):
    calm = train(_cfg(tmp_path / "calm"), cluster)
    plan = {1: (die_in_next_train, 1), 3: (die_in_next_refit, 0)}
    hit = train(_cfg(tmp_path / "hit"), cluster, on_training=kill_plan(plan))

    assert _recoveries(tmp_path / "hit") == [
        {"step": 2, "recovery/group": "policy", "recovery/rank": 1,
         "recovery/repeated": "log-probs and training"},
        {"step": 3, "recovery/group": "policy", "recovery/rank": 0,
         "recovery/repeated": "refit"},
    ]  # fmt: skip
    for r in read_metrics(tmp_path / "hit"):  # the relaunched ranks read the kept state
        if "recovery/seconds" in r:
            parts = r["recovery/start_seconds"] + r["recovery/load_seconds"]
            assert r["recovery/load_seconds"] > 0 and parts < r["recovery/seconds"], r
    assert [h["step"] for h in hit["history"]] == [1, 2, 3]
    assert [h["policy_restarts"] for h in hit["history"]] == [0, 1, 2]
    assert [h["policy_restarts"] for h in calm["history"]] == [0, 0, 0]
    for key in ("reward_mean", "loss", "train/tokens"):
        assert [h[key] for h in hit["history"]] == [h[key] for h in calm["history"]], key
    for step in (2, 3):  # the redone training step, and the state a refit death restored
        want, got = _weights(tmp_path / "calm", step), _weights(tmp_path / "hit", step)
        assert sorted(got) == sorted(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=name)
    assert not any(
        p.startswith(f"phalanx-recovery-{os.getpid()}-") for p in os.listdir("/dev/shm")
    ), "the kept state outlived the run"


@pytest.mark.slow(reason="a GRPO run with one policy relaunch, then its resume")
@pytest.mark.timeout(600)
def test_a_death_past_max_restarts_ends_the_run_with_exit_4_and_a_resumable_folder(
    cluster, tmp_path, capsys, monkeypatch
):
    """Rank 1 dies in step 2's training (relaunched: the budget of 1 is spent), then the
    relaunched rank 0 is SIGKILLed as step 3's generation starts: its death is seen while
    the generators run, but no relaunch begins; the step's first policy call ends the run."""
    import threading

    from phalanx.algorithms import grpo_run
    from tests.algorithms.test_grpo_recovery_eager import Relaunches

    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, max_restarts=1)
    relaunches = Relaunches(monkeypatch)
    first_death = kill_plan({1: (die_in_next_train, 1)})
    pids: list[int] = []  # the relaunched policy's rank 0
    seen = threading.Event()  # the death was told to the listeners (the recovery's first)
    batches: list[bool] = []  # per batch: whether a death was seen while it ran
    errors: list[BaseException] = []
    real_generate = grpo_run.generate

    def on_training(step: int, policy: Any) -> None:
        first_death(step, policy)
        if step == 2:
            pids.append(policy.worker_group.worker_metadata[0]["pid"])
            policy.worker_group.add_death_listener(lambda rank, reason: seen.set())

    def generate(group: Any, prompts: Any, *args: Any, **kwargs: Any) -> Any:
        if len(batches) == 2:
            os.kill(pids[0], signal.SIGKILL)
        batches.append(seen.wait(60) if len(batches) == 2 else False)
        return real_generate(group, prompts, *args, **kwargs)

    monkeypatch.setattr(grpo_run, "generate", generate)

    def body() -> int:
        try:
            train(cfg, cluster, on_training=on_training)
        except BaseException as e:
            errors.append(e)
            raise
        return harness.DONE

    code = harness.run_command("phalanx train grpo", GRPOConfig, run_dir, body)

    assert code == harness.RUNTIME_FAILURE == 4
    assert batches == [False, False, True]
    assert relaunches.begun == 1  # the first death's; the second started none
    (error,) = errors
    assert isinstance(error, RestartBudgetSpentError)
    assert error.group == f"grpo_policy_{os.getpid()}"
    assert error.rank == 0
    first_line = str(error).splitlines()[0]
    assert first_line.startswith(
        f"grpo_policy_{os.getpid()}[rank 0].get_reference_policy_logprobs() failed with "
    ), first_line
    assert "rank 0 died after the policy group was relaunched 1 time(s) (max_restarts=1)" in (
        first_line
    )
    assert error.remote_traceback == error.__cause__.remote_traceback
    status = json.loads((run_dir / "status.json").read_text())
    assert status == {
        "status": "failed",
        "exit_code": 4,
        "message": f"RestartBudgetSpentError: {first_line}",
    }
    assert f"phalanx train grpo: error: {status['message']}\n" in capsys.readouterr().err
    assert _recoveries(run_dir) == [
        {"step": 2, "recovery/group": "policy", "recovery/rank": 1,
         "recovery/repeated": "log-probs and training"},
    ]  # fmt: skip
    assert latest_checkpoint(str(run_dir)) == str(run_dir / "checkpoints" / "step_2")

    resumed = train(_cfg(run_dir, resume=True), cluster)
    assert [h["step"] for h in resumed["history"]] == [3]
    steps = [r["step"] for r in read_metrics(run_dir) if "reward_mean" in r]
    assert steps == [1, 2, 3]


@pytest.mark.timeout(60)
def test_chaos_benchmark_splits_each_kill_into_start_up_load_refit_and_rest(monkeypatch):
    """benchmarks/chaos_training.py pairs each kill with the recovery row after it; the
    kill's time to that row is worker start-up + state load + refit + the rest; the kill's
    time to the death being seen is the row's time less its seconds (seen to refitted), and
    to the relaunched group being ready adds noticing, shutdown, start-up and load."""
    from tests.helpers import BENCHMARKS, benchmark_module

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its sibling _common
    chaos = benchmark_module("chaos_training")
    rows = [
        {"wall_time": 130.0, "step": 3, "repeated": "log-probs and training", "seconds": 29.5,
         "noticed_seconds": 0.0, "wait_seconds": 27.75, "shutdown_seconds": 0.5,
         "start_seconds": 25.0, "load_seconds": 1.5, "refit_seconds": 0.25},
        {"wall_time": 260.5, "step": 9, "repeated": "none", "seconds": 20.0,
         "noticed_seconds": 0.25, "wait_seconds": 0.0, "shutdown_seconds": 0.25,
         "start_seconds": 9.0, "load_seconds": 1.0, "refit_seconds": 0.5},
    ]  # fmt: skip
    assert chaos.per_kill([100.0, 240.0], rows) == [
        {"step": 3, "repeated": "log-probs and training", "kill_to_resume_s": 30.0,
         "startup_s": 25.0, "load_s": 1.5, "refit_s": 0.25, "rest_s": 3.25, "seen_s": 0.5,
         "relaunched_s": 27.5, "wait_s": 27.75},
        {"step": 9, "repeated": "none", "kill_to_resume_s": 20.5,
         "startup_s": 9.0, "load_s": 1.0, "refit_s": 0.5, "rest_s": 10.0, "seen_s": 0.5,
         "relaunched_s": 11.0, "wait_s": 0.0},
    ]  # fmt: skip
    assert chaos.per_kill([100.0, 240.0], rows[:1])[0]["step"] == 3  # a kill not recovered


@pytest.mark.timeout(60)
def test_report_lists_the_recoveries_and_marks_them_on_the_curve(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from phalanx.cli.report import summarize, write_report
    from phalanx.observe.metrics import MetricsLogger
    from phalanx.observe.plots import _figure, _mark_recoveries

    with MetricsLogger(tmp_path, use_tensorboard=False) as log:
        for step in (1, 2, 3):
            if step == 2:
                log.log(2, {"recovery/seconds": 4.5, "recovery/group": "policy",
                            "recovery/step": 2, "recovery/repeated": "refit"})  # fmt: skip
            log.log(step, {"reward_mean": 0.1 * step, "time/training": 0.5})
    rows = read_metrics(tmp_path)

    assert summarize(tmp_path)["recoveries"] == "step 2 (policy, 4.5 s)"
    ax = _figure(4, 3).add_subplot()
    ax.plot([1, 2, 3], [0.1, 0.2, 0.3])
    ax.set_xlabel("step")
    (handle,) = _mark_recoveries(ax, rows)
    assert handle.get_label() == "recovery (1: a group relaunched, its step redone)"
    assert list(handle.get_xdata()) == [2, 2]
    assert write_report(tmp_path, console=None)["learning_curve"] == str(
        tmp_path / "learning_curve.png"
    )


@pytest.mark.timeout(60)
def test_a_negative_max_restarts_is_refused_naming_the_flag(tmp_path, capsys):
    from phalanx.algorithms.grpo import cli

    run_dir = tmp_path / "run"
    argv = ["--model", "tiny", "--run-dir", str(run_dir), "--max-restarts", "-1"]
    assert cli(argv) == harness.BAD_INPUT
    assert capsys.readouterr().err == (
        "phalanx train grpo: error: max_restarts must be >= 0, got -1 (flag --max-restarts)\n"
    )
    assert not run_dir.exists()


@pytest.mark.timeout(60)
def test_no_state_is_kept_without_a_restart_budget():
    """``max_restarts=0``: no relaunch would read a snapshot, so none is taken (the policy
    is not touched: ``run`` is None here)."""
    recovery = PolicyRecovery(None, None, max_restarts=0)
    recovery.snapshot(1)
    assert (recovery.good, recovery.save_seconds, recovery.restarts) == (None, 0.0, 0)


@pytest.mark.timeout(120)
def test_phase_memory_leaves_out_a_group_whose_rank_died(cluster):
    """A policy rank that dies while another phase runs (generation) does not end the run
    there: the memory measurement skips its group, the policy's next call recovers it."""
    import ray

    import phalanx as px
    from phalanx.algorithms.grpo_group_calls import PhaseMemory, _peak_rss_gb
    from tests.workers import Recorder

    lost = Recorder.create_group().launch(cluster, px.NodePlacement(num_workers=2), name="lost")
    kept = Recorder.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="kept")
    try:
        memory = PhaseMemory({"policy": lost, "generation": kept})
        memory.reset()
        ray.kill(lost.actors[1], no_restart=True)
        memory.reset()
        assert len(memory._all(_peak_rss_gb)) == 1  # the one rank of "kept"
        assert memory.peak() > 0.0
        assert lost.health()[1] == px.WorkerHealth.DEAD
        assert PhaseMemory({"policy": lost}).peak() == 0.0
    finally:
        lost.shutdown(timeout=10)
        kept.shutdown(timeout=10)
