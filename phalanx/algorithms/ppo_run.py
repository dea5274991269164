"""A PPO run's start-up and checkpoints: what ``ppo.train`` needs before its first
iteration and between iterations, kept out of the loop so that it reads top to bottom.

``open_run`` validates the config, names the run and reads the checkpoint to resume;
``start_run`` starts Ray and the env runners while a helper thread imports torch and
builds the learner, then gives the runners the learner's weights. A checkpoint holds the
policy, the optimizer, the observation normaliser and the counters, written atomically.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from phalanx.algorithms import _harness as harness
from phalanx.algorithms.ppo_config import PPOConfig
from phalanx.observe.breakdown import WallBreakdown

if TYPE_CHECKING:
    import torch

    from phalanx.envs import EnvRunnerGroup

CHECKPOINT_FILE = "checkpoint.pt"


# ---------------------------------------------------------------------------- checkpoints
def save_checkpoint(path: Path, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    connector: dict[str, Any], timesteps: int, iteration: int, episodes: int,
                    cfg: PPOConfig, spaces: tuple[Any, Any]) -> None:  # fmt: skip
    """Policy, optimizer, normaliser and counters; written atomically.

    A write that fails (a full disk) raises ``OSError`` naming ``path`` and the errno
    (``ENOSPC``); the previous checkpoint stays and no partial file is left.
    """
    import torch

    tmp = path.with_suffix(".tmp")
    buf = io.BytesIO()  # serialised first: a failed write then is a plain OSError
    torch.save(
        {
            "policy": policy.state_dict(),
            "optimizer": optimizer.state_dict(),
            "connector": connector,
            "timesteps": timesteps,
            "iteration": iteration,
            "episodes": episodes,
            "config": asdict(cfg),
            "observation_space": spaces[0],
            "action_space": spaces[1],
        },
        buf,
    )
    try:
        with open(tmp, "wb") as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise harness.checkpoint_write_error(path, e) from None


_CHECKPOINT_KEYS = ("policy", "optimizer", "connector", "timesteps", "iteration", "episodes",
                    "config", "observation_space", "action_space")  # fmt: skip


def load_checkpoint(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint of ``run_dir`` (a ``runs/<name>`` folder or the file itself).

    ``FileNotFoundError`` or ``ValueError`` naming the file when it is missing, unreadable
    or not a PPO checkpoint.
    """
    import torch

    path = Path(run_dir)
    if path.is_dir() or (not path.exists() and path.suffix != ".pt"):
        path = path / CHECKPOINT_FILE
    if not path.exists():
        raise FileNotFoundError(f"no PPO checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises many types for a damaged file
        raise ValueError(
            f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}: {e})"
        ) from None
    missing = [k for k in _CHECKPOINT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ValueError(f"checkpoint {path} is not a PPO checkpoint (missing {missing})")
    harness.check_keys(ckpt["config"], PPOConfig, f"checkpoint {path}")
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


def save_learner(path: Path, learner: Learner, runners: EnvRunnerGroup, cfg: PPOConfig) -> None:
    """``save_checkpoint`` of the learner's state and the runners' normaliser."""
    save_checkpoint(path, learner.policy, learner.optimizer, runners.get_connector_state(),
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
    ckpt_path = run_dir / CHECKPOINT_FILE
    if not resume and ckpt_path.exists():
        raise ValueError(
            f"name: {run_dir} already has a checkpoint; pass --resume to continue it or "
            "choose another --name"
        )
    ckpt = load_checkpoint(ckpt_path) if resume else None
    if ckpt is not None:
        check_resumable(ckpt, cfg, ckpt_path)
    return cfg, run_dir, ckpt


def start_run(
    cfg: PPOConfig, ckpt: dict[str, Any] | None, cluster: Any, times: WallBreakdown
) -> tuple[EnvRunnerGroup, Learner]:
    """The env runners and the learner, the runners holding the learner's weights (and
    the checkpoint's normaliser). Ray (when no ``cluster`` is given) and the runners
    start on this thread while a helper thread builds the learner and, with
    ``num_learners=1``, another starts the learner's worker (``learner.remote``), which
    then gets the learner's state; everything started is stopped again if anything fails.

    Raises:
        ValueError: the runners' spaces differ from the learner's.
    """
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
            from phalanx.algorithms.ppo_learner import RemoteLearner

            remote_future = harness.in_background(
                "ppo-learner-worker", _timed, times, "learner worker start", RemoteLearner,
                cfg, cluster, f"ppo_learner_{cfg.name}_{os.getpid()}",
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


def _timed(times: WallBreakdown, phase: str, fn: Any, *args: Any) -> Any:
    with times.phase(phase, overlapped=True):
        return fn(*args)
