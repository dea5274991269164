"""A PPO run's start-up, checkpoints and end: what ``ppo.train`` needs before its first
iteration, between iterations and after its last, kept out of the loop so that it reads
top to bottom.

``open_run`` validates the config, names the run and reads the checkpoint to resume;
``start_run`` starts Ray and the env runners while a helper thread imports torch and
builds the learner, then gives the runners the learner's weights; ``open_metrics`` opens
the metrics log; ``stop_run`` writes the final checkpoint and stops what ``start_run``
started. A checkpoint
(``run_checkpoints``' folder format, shared with GRPO) holds the policy, the optimizer,
the observation normaliser and the counters.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from phalanx.algorithms import _harness as harness
from phalanx.algorithms.ppo_config import PPOConfig
from phalanx.algorithms.run_checkpoints import (
    STATE_FILE,
    latest_checkpoint,
    read_state,
    remove_unfinished_checkpoints,
    write_checkpoint,
)
from phalanx.observe.breakdown import WallBreakdown

if TYPE_CHECKING:
    import torch

    from phalanx.envs import EnvRunnerGroup
    from phalanx.observe.metrics import MetricsLogger

LEARNER_FILE = "learner.pt"  # a PPO checkpoint's file beside its state.json
KEEP_CHECKPOINTS = 2  # the newest two: rewriting one step's folder always leaves the other


# ---------------------------------------------------------------------------- checkpoints
def save_checkpoint(run_dir: str | os.PathLike[str], policy: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, connector: dict[str, Any], timesteps: int,
                    iteration: int, episodes: int, cfg: PPOConfig,
                    spaces: tuple[Any, Any]) -> str:  # fmt: skip
    """Write ``checkpoints/step_<iteration>`` of ``run_dir`` (``run_checkpoints``' format):
    the counters and the config in its ``state.json``; the policy, the optimizer, the
    observation normaliser and the spaces in ``learner.pt``. The newest two are kept.

    Returns:
        The checkpoint's folder.

    Raises:
        OSError: the write failed (a full disk): the error names the folder and the errno
            (``ENOSPC``); the earlier checkpoints stay and no partial folder is left.
    """
    import torch

    buf = io.BytesIO()  # serialised first: a failed write then is a plain OSError
    torch.save(
        {
            "policy": policy.state_dict(),
            "optimizer": optimizer.state_dict(),
            "connector": connector,
            "observation_space": spaces[0],
            "action_space": spaces[1],
        },
        buf,
    )

    def write_files(folder: str) -> None:
        with open(os.path.join(folder, LEARNER_FILE), "wb") as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())

    state = {
        "timesteps": timesteps,
        "iteration": iteration,
        "episodes": episodes,
        "config": asdict(cfg),
    }
    return write_checkpoint(run_dir, iteration, state, write_files, keep=KEEP_CHECKPOINTS)


_CHECKPOINT_KEYS = ("policy", "optimizer", "connector", "timesteps", "iteration", "episodes",
                    "config", "observation_space", "action_space")  # fmt: skip


def load_checkpoint(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The newest checkpoint of ``run_dir`` (a ``runs/<name>`` folder), or the checkpoint
    folder ``run_dir`` itself: its state and files in one dict, with ``checkpoint``, the
    folder it came from.

    Raises:
        FileNotFoundError: the run has no checkpoint.
        ValueError: the checkpoint is unreadable or not a PPO checkpoint (names the file).
    """
    import torch

    path = Path(run_dir)
    folder = path if (path / STATE_FILE).exists() else latest_checkpoint(path)
    if folder is None:
        raise FileNotFoundError(f"no PPO checkpoint under {path / 'checkpoints'}")
    learner_file = Path(folder) / LEARNER_FILE
    state = read_state(folder)
    if not learner_file.exists():
        raise ValueError(f"checkpoint {folder} is not a PPO checkpoint (no {LEARNER_FILE})")
    try:
        files = torch.load(learner_file, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises many types for a damaged file
        raise ValueError(
            f"checkpoint {learner_file} is corrupt or unreadable ({type(e).__name__}: {e})"
        ) from None
    ckpt = {**files, **state, "checkpoint": str(folder)} if isinstance(files, dict) else {}
    missing = [k for k in _CHECKPOINT_KEYS if k not in ckpt]
    if missing:
        raise ValueError(f"checkpoint {folder} is not a PPO checkpoint (missing {missing})")
    harness.check_keys(ckpt["config"], PPOConfig, f"checkpoint {folder}")
    return ckpt


_NETWORK_FIELDS = ("env", "env_config", "hidden", "activation")  # what shapes the policy


def check_resumable(ckpt: dict[str, Any], cfg: PPOConfig, path: Path) -> None:
    """``ValueError`` naming the field and ``path`` when the checkpoint's policy was built
    for another environment or network than ``cfg``'s (checked before anything starts)."""
    saved = ckpt["config"]
    for name in _NETWORK_FIELDS:
        was, now = saved.get(name), getattr(cfg, name)
        if isinstance(was, list):
            was = tuple(was)
        if name in saved and was != now:
            raise ValueError(
                f"{name}: the checkpoint {path} was trained with {name}={was!r}, not "
                f"{now!r}; --resume continues a run with its own environment and network "
                "(start a new run under another --name)"
            )


def build_policy(cfg: PPOConfig, observation_space: Any, action_space: Any) -> torch.nn.Module:
    """The actor-critic network of ``cfg`` (``hidden``, ``activation``) for these spaces."""
    from phalanx.envs.policy import ActorCritic

    return ActorCritic(
        observation_space, action_space, cfg.hidden, cfg.activation, cfg.init_log_std
    )


def build_optimizer(cfg: PPOConfig, policy: torch.nn.Module) -> torch.optim.Optimizer:
    """Adam over ``policy``'s parameters with ``cfg``'s learning rate and epsilon."""
    import torch

    # foreach: one kernel per step for all tensors (not the CPU default), a shorter update
    return torch.optim.Adam(
        policy.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps, foreach=True
    )


# ---------------------------------------------------------------------------- start-up
@dataclass
class Learner:
    """The learner's state: policy, optimizer, spaces and counters; with
    ``num_learners=1`` also ``remote``, the worker that trains (a ``RemoteLearner``),
    and then the policy and optimizer here are the state it kept after its last update."""

    policy: Any
    optimizer: Any
    spaces: tuple[Any, Any]
    timesteps: int = 0
    iteration: int = 0
    episodes: int = 0
    remote: Any = None


def build_learner(cfg: PPOConfig, ckpt: dict[str, Any] | None) -> Learner:
    """Policy and optimizer (from the checkpoint when given); runs on the start-up thread
    while Ray and the runners start, so torch is imported here."""
    import gymnasium as gym
    import torch

    import phalanx.weights.sender  # noqa: F401  (imported now, not at the first sync)

    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    env = gym.make(cfg.env, disable_env_checker=True, **cfg.env_config)
    spaces = (env.observation_space, env.action_space)
    env.close()
    policy = build_policy(cfg, *spaces)
    optimizer = build_optimizer(cfg, policy)
    learner = Learner(policy, optimizer, spaces)
    if ckpt is not None:
        policy.load_state_dict(ckpt["policy"])
        optimizer.load_state_dict(ckpt["optimizer"])
        learner.timesteps, learner.iteration = ckpt["timesteps"], ckpt["iteration"]
        learner.episodes = ckpt["episodes"]
    return learner


def save_learner(run_dir: Path, learner: Learner, runners: EnvRunnerGroup, cfg: PPOConfig) -> None:
    """``save_checkpoint`` of the learner's state and the runners' normaliser."""
    save_checkpoint(run_dir, learner.policy, learner.optimizer, runners.get_connector_state(),
                    learner.timesteps, learner.iteration, learner.episodes, cfg,
                    learner.spaces)  # fmt: skip


def open_run(cfg: PPOConfig, resume: bool) -> tuple[PPOConfig, Path, dict[str, Any] | None]:
    """The validated config (named when it was not), its run folder and the checkpoint
    to resume (None for a new run).

    Raises:
        ValueError: an invalid config, a new run over an existing checkpoint, or a
            checkpoint of another environment or network.
        FileNotFoundError: ``resume`` without a checkpoint.
    """
    cfg.validate()
    if cfg.name is None:
        cfg = replace(cfg, name=harness.fresh_run_name(f"ppo-{cfg.env}", cfg.runs_dir))
    run_dir = Path(cfg.runs_dir) / cfg.name
    if not resume and latest_checkpoint(run_dir) is not None:
        raise ValueError(
            f"name: {run_dir} already has a checkpoint; pass --resume to continue it or "
            "choose another --name"
        )
    ckpt = load_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        check_resumable(ckpt, cfg, Path(ckpt["checkpoint"]))
    remove_unfinished_checkpoints(run_dir)
    return cfg, run_dir, ckpt


def start_run(
    cfg: PPOConfig,
    ckpt: dict[str, Any] | None,
    cluster: Any,
    times: WallBreakdown,
    start_learner_worker: Callable[[PPOConfig, Any, str], Any] | None = None,
) -> tuple[EnvRunnerGroup, Learner]:
    """The env runners and the learner, the runners holding the learner's weights (and
    the checkpoint's normaliser). Ray (when no ``cluster`` is given) and the runners
    start on this thread while a helper thread builds the learner and, with
    ``num_learners=1``, another runs ``start_learner_worker(cfg, cluster, name)`` (a
    ``RemoteLearner``), which becomes ``learner.remote`` and gets the learner's state;
    everything started is stopped again if anything fails.

    Raises:
        ValueError: the runners' spaces differ from the learner's, or ``num_learners=1``
            without ``start_learner_worker``.
    """
    if cfg.num_learners and start_learner_worker is None:
        raise ValueError("num_learners=1 needs start_learner_worker (the learner's worker)")
    learner_future: Future[Learner] = harness.in_background(
        "ppo-learner-init", _timed, times, "learner init", build_learner, cfg, ckpt
    )
    runners = None
    remote_future: Future[Any] | None = None
    try:
        if cluster is None and (cfg.num_env_runners > 0 or cfg.num_learners > 0):
            from phalanx.resources.ray_start import start_ray

            with times.phase("ray start"):
                runners_and_standby = cfg.num_env_runners + cfg.num_standby_env_runners
                slots = runners_and_standby * cfg.env_runner_config().num_cpus_per_env_runner
                start_ray(math.ceil(slots) + cfg.num_learners + 1)  # the workers' and a spare
        if cfg.num_learners:
            remote_future = harness.in_background(
                "ppo-learner-worker", _timed, times, "learner worker start",
                start_learner_worker, cfg, cluster, f"ppo_learner_{cfg.name}_{os.getpid()}",
            )  # fmt: skip
        from phalanx.envs import EnvRunnerGroup

        with times.phase("env runners start"):
            runners = EnvRunnerGroup(
                config=cfg.env_runner_config(),
                local_env_runner=cfg.num_env_runners == 0,
                cluster=cluster,
                name=f"ppo_{cfg.name}_{os.getpid()}",
            )
        with times.phase("waiting for learner init"):
            learner = harness.result_of(learner_future)
        import torch  # imported by the learner's thread by now

        # The count is kept per thread (OpenMP, MKL): the learner was built on the start-up
        # thread and trains on the caller's.
        torch.set_num_threads(cfg.torch_threads)
        remote_spaces = runners.get_spaces()["__env__"]
        if remote_spaces != learner.spaces:
            raise ValueError(
                f"env: the runners' spaces {remote_spaces} differ from the learner's "
                f"{learner.spaces}"
            )
        if remote_future is not None:
            with times.phase("waiting for the learner worker"):
                learner.remote = harness.result_of(remote_future)
                learner.remote.take(learner)
        with times.phase("first weight sync"):
            if ckpt is not None:
                runners.set_connector_state(ckpt["connector"])
            runners.sync_weights(from_worker_or_learner_group=learner.policy, timeout_seconds=None)
    except BaseException:
        if runners is not None:
            runners.stop()
        if remote_future is not None and remote_future.done() and not remote_future.exception():
            remote_future.result().stop()
        raise
    return runners, learner


def open_metrics(
    cfg: PPOConfig, run_dir: Path, learner: Learner, ckpt: dict[str, Any] | None
) -> MetricsLogger:
    """The run's ``MetricsLogger`` with its config row written. A resumed run's rows of
    iterations after the checkpoint are dropped: those iterations are redone."""
    from phalanx.observe.metrics import MetricsLogger

    log = MetricsLogger(run_dir, use_wandb=cfg.wandb)
    if ckpt is not None:
        log.drop_after(learner.timesteps)
    log.log_config({**asdict(cfg), "resumed_from": learner.timesteps if ckpt else None})
    return log


def stop_run(
    run_dir: Path, learner: Learner, runners: EnvRunnerGroup, cfg: PPOConfig, times: WallBreakdown
) -> int:
    """The end of a run, however it ended: the final checkpoint, then the env runners and
    the learner's worker stopped. Returns the env runners' restart count, read before
    they stop."""
    with times.phase("checkpoints"):
        save_learner(run_dir, learner, runners, cfg)
    restarts = runners.num_remote_worker_restarts()
    with times.phase("env runners stop"):
        runners.stop()
    if learner.remote is not None:
        with times.phase("learner worker stop"):
            learner.remote.stop()
    return restarts


def plot_run(run_dir: Path) -> None:
    """``learning_curve.png`` of the run's ``metrics.jsonl``."""
    from phalanx.observe.metrics import read_metrics
    from phalanx.observe.plots import plot_learning_curve

    plot_learning_curve(read_metrics(run_dir), run_dir / "learning_curve.png", run_dir.name)


def _timed(times: WallBreakdown, phase: str, fn: Any, *args: Any) -> Any:
    with times.phase(phase, overlapped=True):
        return fn(*args)
