"""PPO on gymnasium environments with phalanx env runners (CleanRL style, one file).

Read top to bottom: the hyperparameters (``PPOConfig``; its field docstrings are the
``phalanx train ppo --help``), tuned starting points per env, advantage estimation
(``gae``), the loss and update (``ppo_update``), checkpoints, start-up, the training loop
(``train``) and the command line (``cli``).

Sampling runs on an :class:`~phalanx.envs.EnvRunnerGroup`: ``num_env_runners`` remote
runners (or the local runner when 0), each stepping ``num_envs_per_env_runner`` envs for
``rollout_fragment_length`` steps per iteration. The learner is this process. In
``async_sampling`` mode the runners sample the next batch while the learner trains on
the current one, so each batch was collected with weights one version behind the
learner (``policy_lag`` in the metrics). A runner that dies is left out of that round,
restarted by the group, and given the current weights and normaliser before it samples
again; ``restarts`` in the metrics counts it.

Start-up overlaps: Ray and the env runners start on a helper thread while this thread
imports torch and builds the learner (torch is therefore imported inside the functions
that use it). Every run ends with a breakdown of its wall time (``WallBreakdown``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
import tyro

from phalanx.algorithms.flags import name_the_flag
from phalanx.observe.breakdown import WallBreakdown, process_age_s

if TYPE_CHECKING:
    import torch

CHECKPOINT_FILE = "checkpoint.pt"


def _flag(*aliases: str) -> Any:
    """Extra command-line spellings of a field (the short flags of earlier releases)."""
    return tyro.conf.arg(aliases=aliases)


# ---------------------------------------------------------------------------- config
@dataclass
class PPOConfig:
    """PPO hyperparameters and run options; PPOConfig.for_env(env) starts from the values
    tuned for that env (TUNED), as the command line does."""

    # --- environment and env runners
    env: str = "CartPole-v1"
    """gymnasium env id"""
    env_config: Annotated[dict[str, Any], tyro.conf.Suppress] = field(default_factory=dict)
    """keyword arguments of gymnasium.make (YAML --config only)"""
    num_env_runners: Annotated[int, _flag("--env-runners")] = 2
    """remote env runner processes; 0 samples in this process"""
    num_envs_per_env_runner: Annotated[int, _flag("--envs-per-runner")] = 8
    """vectorised envs per runner"""
    rollout_fragment_length: Annotated[int, _flag("--rollout-length")] = 32
    """vector steps per runner per iteration"""
    normalize_observations: Annotated[bool, _flag("--normalize-obs")] = False
    """running mean/std observation normaliser, merged across runners"""
    # --- budget and stopping
    max_timesteps: int = 200_000
    """stop after this many env steps"""
    stop_return: float | None = None
    """stop (exit 0) once the mean return of the last stop_window episodes reaches this"""
    stop_window: int = 20
    """episodes averaged for stop_return"""
    stop_min_episodes: int = 10
    """episodes that must have finished before stop_return is checked (capped at stop_window)"""
    seed: int = 1
    """random seed of the learner and the envs"""
    # --- PPO
    learning_rate: Annotated[float, _flag("--lr")] = 2.5e-3
    """Adam learning rate"""
    anneal_lr: bool = True
    """decay the learning rate linearly with timesteps / max_timesteps"""
    lr_floor: float = 0.05
    """annealing never goes below this fraction of learning_rate"""
    adam_eps: float = 1e-5
    """Adam epsilon"""
    gamma: float = 0.99
    """discount"""
    gae_lambda: float = 0.95
    """GAE lambda"""
    minibatch_size: int = 128
    """SGD minibatch size"""
    update_epochs: Annotated[int, _flag("--epochs")] = 4
    """SGD passes over each batch"""
    norm_adv: bool = True
    """normalise advantages per minibatch"""
    clip_coef: float = 0.2
    """PPO ratio clip"""
    clip_vloss: bool = True
    """clip the value loss around the sampling-time values"""
    vf_clip_coef: float | None = None
    """value clip (None: same as clip_coef)"""
    ent_coef: float = 0.0
    """entropy bonus"""
    vf_coef: float = 0.5
    """value loss weight"""
    max_grad_norm: float = 0.5
    """gradient norm clip"""
    target_kl: float | None = None
    """stop the epochs of an update once the approximate KL exceeds this"""
    reward_scale: float = 1.0
    """rewards are multiplied by this before GAE"""
    # --- policy network
    hidden: tuple[int, ...] = (64, 64)
    """hidden layer sizes of the actor and the critic"""
    activation: str = "tanh"
    """tanh or relu"""
    init_log_std: float = 0.0
    """initial log std of a Gaussian policy (continuous actions)"""
    # --- runtime
    async_sampling: Annotated[bool, _flag("--async")] = False
    """sample the next batch while the learner trains (one weights version behind)"""
    restart_failed_env_runners: bool = True
    """restart a dead env runner (the round it died in goes on without it)"""
    max_num_env_runner_restarts: int = 100
    """restarts allowed per runner"""
    sample_timeout_s: float = 60.0
    """seconds to wait for a round of samples before a runner counts as hung"""
    torch_threads: int = 1
    """torch threads of the learner (the networks are tiny; more threads fight the runners)"""
    name: str | None = None
    """run name: output goes to <runs_dir>/<name> (None: a fresh ppo-<env>[-N])"""
    runs_dir: str = "runs"
    """folder of runs"""
    checkpoint_every: int = 10
    """iterations between checkpoints; one is also written at the end"""

    @classmethod
    def for_env(cls, env: str, **overrides: Any) -> PPOConfig:
        """Tuned starting points for a few environments; anything else uses the defaults."""
        return cls(**{"env": env, **TUNED.get(env, {}), **overrides})

    @property
    def batch_size(self) -> int:
        runners = max(self.num_env_runners, 1)
        return runners * self.num_envs_per_env_runner * self.rollout_fragment_length

    def validate(self) -> None:
        """``ValueError``/``TypeError`` naming the first bad option (before anything starts)."""
        ints = (
            "num_env_runners", "num_envs_per_env_runner", "rollout_fragment_length",
            "max_timesteps", "stop_window", "stop_min_episodes", "seed", "minibatch_size",
            "update_epochs", "checkpoint_every", "max_num_env_runner_restarts", "torch_threads",
        )  # fmt: skip
        for name in ints:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if self.num_env_runners < 0:
            raise ValueError(f"num_env_runners must be >= 0, got {self.num_env_runners}")
        for name in ints[1:]:
            if name not in ("seed", "max_num_env_runner_restarts") and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.minibatch_size > self.batch_size:
            raise ValueError(
                f"minibatch_size={self.minibatch_size} is larger than the batch "
                f"({self.batch_size} = max(num_env_runners, 1) * num_envs_per_env_runner * "
                "rollout_fragment_length)"
            )
        ranges = {
            "learning_rate": (0, None), "gamma": (0, 1), "gae_lambda": (0, 1),
            "clip_coef": (0, None), "vf_coef": (0, None), "max_grad_norm": (0, None),
            "reward_scale": (0, None), "sample_timeout_s": (0, None), "adam_eps": (0, None),
            "lr_floor": (0, 1),
        }  # fmt: skip
        for name, (lo, hi) in ranges.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name} must be a number, got {v!r}")
            if v <= lo if name not in ("gae_lambda", "lr_floor") else v < lo:
                raise ValueError(f"{name} must be > {lo}, got {v}")
            if hi is not None and v > hi:
                raise ValueError(f"{name} must be <= {hi}, got {v}")
        if self.ent_coef < 0:
            raise ValueError(f"ent_coef must be >= 0, got {self.ent_coef}")
        for name in ("target_kl", "vf_clip_coef", "stop_return"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise TypeError(f"{name} must be a number or None, got {v!r}")
        if self.target_kl is not None and self.target_kl <= 0:
            raise ValueError(f"target_kl must be > 0 or None, got {self.target_kl}")
        if not self.hidden or not all(
            isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in self.hidden
        ):
            raise ValueError(
                f"hidden must be a non-empty list of positive ints, got {self.hidden!r}"
            )
        if self.activation not in ("tanh", "relu"):
            raise ValueError(f"activation must be 'tanh' or 'relu', got {self.activation!r}")
        if self.name is not None and (
            not isinstance(self.name, str) or not self.name or "/" in self.name
        ):
            raise ValueError(f"name must be a non-empty str without '/', got {self.name!r}")
        if not isinstance(self.env_config, dict):
            raise TypeError(f"env_config must be a mapping, got {self.env_config!r}")
        if not isinstance(self.env, str):
            raise TypeError(f"env must be a gymnasium env id, got {self.env!r}")
        from phalanx.envs.env_runner import check_env_id

        check_env_id(self.env)

    def env_runner_config(self) -> Any:
        from phalanx.envs import EnvRunnerGroupConfig

        return EnvRunnerGroupConfig(
            env=self.env,
            env_config=dict(self.env_config),
            num_env_runners=self.num_env_runners,
            num_envs_per_env_runner=self.num_envs_per_env_runner,
            rollout_fragment_length=self.rollout_fragment_length,
            normalize_observations=self.normalize_observations,
            seed=self.seed,
            policy_config={
                "hidden": tuple(self.hidden),
                "activation": self.activation,
                "init_log_std": self.init_log_std,
            },
            restart_failed_env_runners=self.restart_failed_env_runners,
            max_num_env_runner_restarts=self.max_num_env_runner_restarts,
            sample_timeout_s=self.sample_timeout_s,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "PPO config") -> PPOConfig:
        """A config from a mapping (a YAML file, a checkpoint); unknown keys are an error."""
        return cls(**_check_keys(d, source))


def _check_keys(d: dict[str, Any], source: str) -> dict[str, Any]:
    """``d`` with ``-`` spelled ``_``; ``ValueError`` naming the first key PPOConfig lacks."""
    out = {str(k).replace("-", "_"): v for k, v in d.items()}
    known = {f.name for f in fields(PPOConfig)}
    for key in out:
        if key not in known:
            raise ValueError(f"{source}: unknown PPO config key {key!r} (known: {sorted(known)})")
    if isinstance(out.get("hidden"), list):
        out["hidden"] = tuple(out["hidden"])
    return out


TUNED: dict[str, dict[str, Any]] = {
    # CartPole-v1 (2 runners x 8 envs x 32 steps = 512 steps per update). Start: CleanRL's
    # ppo.py (4 epochs, clip 0.2, tanh 64x64, advantage normalisation) with lr 2.5e-3.
    # A sweep of steps to a 20-episode mean of 450 (seeds 1-3, 2026-11-23; the notes in
    # benchmarks/bench_ppo_cartpole.py) found: value clipping off (returns of ~100 moved at
    # most 0.2 per update held the critic back), gamma 0.98 and lambda 0.9 (RL Zoo's
    # CartPole horizon) and 6 epochs cut the median from ~52k to ~21k steps (seeds 1-5:
    # 21k, 19k, 35k, 30k, 20k); 8 epochs, lr 4e-3, 4 envs per runner or 16-step fragments
    # did not beat it, and RL Zoo's full set (lambda 0.8, 10 epochs, lr 1e-3) was slower.
    # A second sweep (2026-11-25, seeds 1-5: epochs, minibatch, lr, lambda, entropy, clip,
    # value weight, width, activation, fragment length, async sampling) kept these values.
    "CartPole-v1": {
        "clip_vloss": False,
        "gamma": 0.98,
        "gae_lambda": 0.9,
        "update_epochs": 6,
    },
    # Pendulum: normalised observations, small rewards, short horizon, longer updates.
    "Pendulum-v1": {
        "num_envs_per_env_runner": 8,
        "rollout_fragment_length": 128,
        "normalize_observations": True,
        "max_timesteps": 600_000,
        "learning_rate": 1e-3,
        "gamma": 0.95,
        "gae_lambda": 0.95,
        "minibatch_size": 256,
        "update_epochs": 10,
        "ent_coef": 0.0,
        "reward_scale": 0.1,
        "clip_vloss": False,
        "hidden": (64, 64),
        "init_log_std": -0.5,
    },
}


# ---------------------------------------------------------------------------- advantages
def gae(batch: dict[str, np.ndarray], gamma: float, lam: float, reward_scale: float = 1.0):
    """Advantages and value targets of one runner's time-major batch ``[T, N]``.

    Truncated (not terminated) steps get ``gamma * V(final_obs)`` added to their reward:
    the episode was cut, not ended, so its return continues past the cut.
    """
    rewards = batch["rewards"] * reward_scale
    terms, truncs = batch["terminateds"], batch["truncateds"]
    rewards = rewards + gamma * batch["final_values"] * (truncs & ~terms)
    values = batch["values"]
    not_done = 1.0 - (terms | truncs).astype(np.float32)
    adv = np.zeros_like(rewards)
    last = np.zeros(rewards.shape[1], np.float32)
    next_values = batch["last_values"]
    for t in reversed(range(rewards.shape[0])):
        delta = rewards[t] + gamma * next_values * not_done[t] - values[t]
        last = delta + gamma * lam * not_done[t] * last
        adv[t] = last
        next_values = values[t]
    return adv, adv + values


def flatten_batches(batches: list[dict[str, Any]], cfg: PPOConfig) -> dict[str, torch.Tensor]:
    """One learner batch: every runner's steps, with advantages, as flat tensors."""
    import torch

    parts: dict[str, list[np.ndarray]] = {
        k: [] for k in ("obs", "actions", "logp", "values", "adv", "ret")
    }
    for b in batches:
        adv, ret = gae(b, cfg.gamma, cfg.gae_lambda, cfg.reward_scale)
        T, N = b["rewards"].shape
        parts["obs"].append(b["obs"].reshape(T * N, *b["obs"].shape[2:]))
        parts["actions"].append(b["actions"].reshape(T * N, *b["actions"].shape[2:]))
        for k, v in (("logp", b["logp"]), ("values", b["values"]), ("adv", adv), ("ret", ret)):
            parts[k].append(v.reshape(T * N))
    return {k: torch.from_numpy(np.concatenate(v)) for k, v in parts.items()}


# ---------------------------------------------------------------------------- update
def ppo_update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: dict[str, torch.Tensor],
    cfg: PPOConfig,
) -> dict[str, float]:
    """``update_epochs`` passes of clipped-surrogate minibatch SGD over ``data``."""
    import torch

    n = data["obs"].shape[0]
    mb = min(cfg.minibatch_size, n)
    vf_clip = cfg.clip_coef if cfg.vf_clip_coef is None else cfg.vf_clip_coef
    stats: dict[str, list[torch.Tensor]] = {
        k: [] for k in ("policy", "value", "entropy", "kl", "clipfrac")
    }
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for _epoch in range(cfg.update_epochs):
        perm = torch.randperm(n)
        for start in range(0, n - mb + 1, mb):
            idx = perm[start : start + mb]
            logp, entropy, values = policy.evaluate(data["obs"][idx], data["actions"][idx])
            log_ratio = logp - data["logp"][idx]
            ratio = log_ratio.exp()
            adv = data["adv"][idx]
            if cfg.norm_adv and len(idx) > 1:
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            # clipped surrogate
            pg_loss = torch.max(
                -adv * ratio, -adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)
            ).mean()
            # value loss, optionally clipped around the sampling-time values
            ret = data["ret"][idx]
            if cfg.clip_vloss:
                old_v = data["values"][idx]
                v_clipped = old_v + (values - old_v).clamp(-vf_clip, vf_clip)
                v_loss = 0.5 * torch.max((values - ret) ** 2, (v_clipped - ret) ** 2).mean()
            else:
                v_loss = 0.5 * ((values - ret) ** 2).mean()
            ent = entropy.mean()
            loss = pg_loss - cfg.ent_coef * ent + cfg.vf_coef * v_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm, foreach=True)
            optimizer.step()
            with torch.no_grad():  # kept as tensors: one sync per update, not per minibatch
                stats["kl"].append(((ratio - 1) - log_ratio).mean())
                stats["clipfrac"].append(((ratio - 1).abs() > cfg.clip_coef).float().mean())
                stats["policy"].append(pg_loss.detach())
                stats["value"].append(v_loss.detach())
                stats["entropy"].append(ent.detach())
        if cfg.target_kl is not None:
            epoch_kl = torch.stack(stats["kl"][-(n // mb) :]).mean().item()
            if epoch_kl > cfg.target_kl:
                break
    y, v = data["ret"].numpy(), data["values"].numpy()
    var_y = float(np.var(y))
    means = {k: float(torch.stack(s).mean()) for k, s in stats.items()}
    out = {f"loss/{k}": means[k] for k in ("policy", "value", "entropy", "kl")}
    out["clipfrac"] = means["clipfrac"]
    out["explained_variance"] = float("nan") if var_y == 0 else 1 - float(np.var(y - v)) / var_y
    return out


# ---------------------------------------------------------------------------- checkpoints
def save_checkpoint(path: Path, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    connector: dict[str, Any], timesteps: int, iteration: int, episodes: int,
                    cfg: PPOConfig, spaces: tuple[Any, Any]) -> None:  # fmt: skip
    """Policy, optimizer, normaliser and counters; written atomically."""
    import torch

    tmp = path.with_suffix(".tmp")
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
        tmp,
    )
    os.replace(tmp, path)


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
    _check_keys(ckpt["config"], f"checkpoint {path}")
    return ckpt


def build_policy(cfg: PPOConfig, observation_space: Any, action_space: Any) -> torch.nn.Module:
    from phalanx.envs.policy import ActorCritic

    return ActorCritic(
        observation_space, action_space, cfg.hidden, cfg.activation, cfg.init_log_std
    )


# ---------------------------------------------------------------------------- start-up
def start_ray(logical_cpus: int | None = None) -> None:
    """An embedded local Ray for this process, unless Ray is up or ``RAY_ADDRESS`` is set.

    A fresh local Ray even when a ``ray start`` cluster runs on this machine (plain
    ``ray.init()`` would join it), with ``logical_cpus`` CPU slots (None: phalanx's
    embedded default). Ray pre-starts one idle worker process per slot as soon as this
    driver connects, and each imports torch and gymnasium before it takes work, so the
    runners find a process with their heavy imports done instead of starting one after
    Ray is up; ``train`` therefore asks for just the runners' slots plus one spare.
    Workers run at nice 0, not Ray's
    15: on a small, shared machine the runners are this job's work. Called on the main
    thread: Ray's daemons die with the thread that started them.
    """
    import ray

    from phalanx.resources.cluster import DEFAULT_EMBEDDED_CPUS, NAMESPACE

    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        return
    prestart = logical_cpus is not None
    if logical_cpus is None:
        logical_cpus = max(DEFAULT_EMBEDDED_CPUS, os.cpu_count() or 1)
    for attempt in (1, 2):
        try:
            ray.init(
                address="local",
                num_cpus=logical_cpus,
                num_gpus=0,
                include_dashboard=False,
                namespace=NAMESPACE,
                _system_config={
                    "prestart_worker_first_driver": prestart,
                    "worker_niceness": 0,
                    # an idle worker process has the runners' heavy imports done, so a
                    # runner restarted there skips them (benchmarks/bench_recovery.py)
                    "preload_python_modules": ["torch", "gymnasium"],
                },
            )
            return
        except Exception as e:  # Ray gives its raylet a fixed 30 s to register
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            print(f"phalanx: {e} Starting Ray once more.", file=sys.stderr, flush=True)
            ray.shutdown()


@dataclass
class Learner:
    """The learner's state: policy, optimizer, spaces and counters."""

    policy: Any
    optimizer: Any
    spaces: tuple[Any, Any]
    timesteps: int = 0
    iteration: int = 0
    episodes: int = 0


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
    # foreach: one kernel per step for all tensors (not the CPU default), ~5% of an update
    optimizer = torch.optim.Adam(
        policy.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps, foreach=True
    )
    learner = Learner(policy, optimizer, spaces)
    if ckpt is not None:
        policy.load_state_dict(ckpt["policy"])
        optimizer.load_state_dict(ckpt["optimizer"])
        learner.timesteps, learner.iteration = ckpt["timesteps"], ckpt["iteration"]
        learner.episodes = ckpt["episodes"]
    return learner


# ---------------------------------------------------------------------------- training
def train(
    cfg: PPOConfig,
    *,
    resume: bool = False,
    cluster: Any = None,
    progress: bool | None = None,
    on_iteration: Callable[[dict[str, Any], Any], bool | None] | None = None,
    times: WallBreakdown | None = None,
) -> dict[str, Any]:
    """Run PPO until ``max_timesteps`` or ``stop_return``; returns a summary dict.

    Writes ``runs_dir/name/metrics.jsonl``, ``checkpoint.pt`` and ``learning_curve.png``.
    ``resume`` continues from that checkpoint (step count, policy, optimizer, normaliser).
    ``on_iteration(metrics, env_runner_group)`` is called after every iteration; a true
    return value stops the run there. ``times`` collects the wall-time breakdown (the
    summary's ``breakdown``; a new one when not given).
    """
    t_start = time.perf_counter()
    times = times if times is not None else WallBreakdown()
    cfg.validate()
    if cfg.name is None:
        cfg = replace(cfg, name=fresh_run_name(cfg.env, cfg.runs_dir))
    run_dir = Path(cfg.runs_dir) / cfg.name
    ckpt_path = run_dir / CHECKPOINT_FILE
    if not resume and ckpt_path.exists():
        raise ValueError(
            f"name: {run_dir} already has a checkpoint; pass --resume to continue it or "
            "choose another --name"
        )

    ckpt = load_checkpoint(ckpt_path) if resume else None

    # 1. start-up: the learner is built on a helper thread while Ray and the runners start
    pool = ThreadPoolExecutor(1, thread_name_prefix="ppo-learner-init")
    learner_future: Future[Learner] = pool.submit(
        _timed, times, "learner init", build_learner, cfg, ckpt
    )
    pool.shutdown(wait=False)
    runners = None
    try:
        if cluster is None and cfg.num_env_runners > 0:
            with times.phase("ray start"):
                slots = cfg.num_env_runners * cfg.env_runner_config().num_cpus_per_env_runner
                start_ray(math.ceil(slots) + 1)
        from phalanx.envs import EnvRunnerGroup

        with times.phase("env runners start"):
            runners = EnvRunnerGroup(
                config=cfg.env_runner_config(),
                local_env_runner=cfg.num_env_runners == 0,
                cluster=cluster,
                name=f"ppo_{cfg.name}_{os.getpid()}",
            )
        with times.phase("waiting for learner init"):
            learner = learner_future.result()
        policy, optimizer = learner.policy, learner.optimizer
        obs_space, act_space = learner.spaces
        timesteps, iteration, episodes = learner.timesteps, learner.iteration, learner.episodes
        remote_spaces = runners.get_spaces()["__env__"]
        if remote_spaces != learner.spaces:
            raise ValueError(
                f"env: the runners' spaces {remote_spaces} differ from the learner's "
                f"{learner.spaces}"
            )
        with times.phase("first weight sync"):
            if ckpt is not None:
                runners.set_connector_state(ckpt["connector"])
            runners.sync_weights(from_worker_or_learner_group=policy, timeout_seconds=None)
    except BaseException:
        if runners is not None:
            runners.stop()
        raise
    from phalanx._base import trace
    from phalanx.observe.metrics import MetricsLogger
    from phalanx.observe.progress import Progress

    log = MetricsLogger(run_dir, use_tensorboard=False)
    log.log_config({**asdict(cfg), "resumed_from": timesteps if ckpt else None})
    bar = Progress(
        total=cfg.max_timesteps, start=timesteps, title=f"PPO {cfg.env}", enabled=progress
    )
    recent: deque[float] = deque(maxlen=cfg.stop_window)
    min_episodes = min(cfg.stop_window, cfg.stop_min_episodes)
    first_iteration_at = timesteps
    t_loop = time.perf_counter()
    pending = runners.sample_async()
    reached = stopped = False
    reached_at: float | None = None
    synced = True  # the runners hold the learner's current weights
    last: dict[str, Any] = {}
    try:
        while timesteps < cfg.max_timesteps and not (reached or stopped):
            t_iter = time.perf_counter()
            # 1. collect the round in flight
            with bar.waiting("rollouts from the env runners"), times.phase("sampling (waited)"):
                batches = runners.collect_samples(pending)
            t_sampled = time.perf_counter()
            t_sync = 0.0
            with times.phase("weight sync"):
                if cfg.normalize_observations:
                    runners.sync_env_runner_states(env_steps_sampled=timesteps)
                if cfg.async_sampling:
                    # The runners are idle now: give them the weights trained on the previous
                    # batch and start the next round, which samples while we train on this one.
                    if not synced:
                        runners.sync_weights(
                            from_worker_or_learner_group=policy, timeout_seconds=None
                        )
                        synced = True
                    t_sync = time.perf_counter() - t_sampled
                    pending = runners.sample_async()
            if not batches:  # every runner died during the round; they are being restarted
                if not cfg.async_sampling:
                    pending = runners.sample_async()
                continue
            # 2. learn
            learner_version = runners.weights_version
            steps = sum(b["timesteps"] for b in batches)
            timesteps += steps
            iteration += 1
            new_returns = [r for b in batches for r in b["episode_returns"]]
            episodes += len(new_returns)
            recent.extend(new_returns)
            mean_recent = float(np.mean(recent)) if recent else float("nan")
            if (
                cfg.stop_return is not None
                and len(recent) >= min_episodes
                and mean_recent >= cfg.stop_return
            ):
                reached = True  # this batch's policy made it; the update below still runs
                reached_at = time.perf_counter() - t_start
            if cfg.anneal_lr:
                frac = max(1.0 - timesteps / cfg.max_timesteps, cfg.lr_floor)
                optimizer.param_groups[0]["lr"] = frac * cfg.learning_rate
            t_learn = time.perf_counter()
            with times.phase("learning"), trace.span("ppo.update", iteration=iteration):
                stats = ppo_update(policy, optimizer, flatten_batches(batches, cfg), cfg)
            synced = False
            t_trained = time.perf_counter()
            # 3. synchronous mode: weights out, next round in
            if not cfg.async_sampling:
                with times.phase("weight sync"):
                    runners.sync_weights(from_worker_or_learner_group=policy, timeout_seconds=None)
                    synced = True
                    t_sync = time.perf_counter() - t_trained
                    pending = runners.sample_async()
            with times.phase("metrics and progress"):
                lengths = [x for b in batches for x in b["episode_lengths"]]
                metrics = {
                    "timesteps": timesteps,
                    "iteration": iteration,
                    "episodes": episodes,
                    "return_mean": float(np.mean(new_returns)) if new_returns else float("nan"),
                    "return_std": float(np.std(new_returns)) if new_returns else float("nan"),
                    "return_mean_recent": mean_recent,
                    "episode_len_mean": float(np.mean(lengths)) if lengths else float("nan"),
                    **stats,
                    "lr": optimizer.param_groups[0]["lr"],
                    "time/rollout": t_sampled - t_iter,
                    "time/train": t_trained - t_learn,
                    "time/weight_sync": t_sync,
                    "time/step": time.perf_counter() - t_iter,
                    "time/total": time.perf_counter() - t_start,
                    "throughput/steps_per_s": (timesteps - first_iteration_at)
                    / max(time.perf_counter() - t_loop, 1e-9),
                    "restarts": runners.num_remote_worker_restarts(),
                    "healthy_env_runners": runners.num_healthy_remote_workers(),
                    "weights_version": runners.weights_version,
                    # versions the learner was ahead of the weights that sampled this batch
                    "policy_lag": learner_version - min(b["weights_version"] for b in batches),
                    "batch_runners": len(batches),
                }
                log.log(timesteps, metrics)
                bar.update(timesteps, {**metrics, "return_mean": mean_recent})
            last = metrics
            if on_iteration is not None and on_iteration(metrics, runners):
                stopped = True
            if iteration % cfg.checkpoint_every == 0 and not (reached or stopped):
                with times.phase("checkpoints"):
                    save_checkpoint(ckpt_path, policy, optimizer, runners.get_connector_state(),
                                    timesteps, iteration, episodes, cfg, (obs_space, act_space))  # fmt: skip
    finally:
        bar.close()
        log.close()
        t_loop_end = time.perf_counter()
        with times.phase("checkpoints"):
            save_checkpoint(ckpt_path, policy, optimizer, runners.get_connector_state(),
                            timesteps, iteration, episodes, cfg, (obs_space, act_space))  # fmt: skip
        restarts = runners.num_remote_worker_restarts()
        with times.phase("env runners stop"):
            runners.stop()
    with times.phase("plotting"):
        plot_learning_curve(run_dir)
    wall = time.perf_counter() - t_start
    times.save(run_dir, wall)
    return {
        "timesteps": timesteps,
        "iterations": iteration,
        "episodes": episodes,
        "return_mean_recent": float(np.mean(recent)) if recent else float("nan"),
        "reached_stop_return": reached,
        "stopped_by_callback": stopped,
        "time_to_stop_return_s": reached_at,
        "wall_time_s": wall,
        "train_loop_s": t_loop_end - t_loop,
        "steps_per_s": last.get("throughput/steps_per_s", float("nan")),
        "restarts": restarts,
        "run_dir": str(run_dir),
        "breakdown": times.as_dict(wall),
    }


def _timed(times: WallBreakdown, phase: str, fn: Callable[..., Any], *args: Any) -> Any:
    with times.phase(phase, overlapped=True):
        return fn(*args)


def fresh_run_name(env: str, runs_dir: str) -> str:
    """``ppo-<env>``, or ``ppo-<env>-2``, ... : the first one without a checkpoint."""
    name, i = f"ppo-{env}", 1
    while (Path(runs_dir) / name / CHECKPOINT_FILE).exists():
        i += 1
        name = f"ppo-{env}-{i}"
    return name


def plot_learning_curve(run_dir: Path) -> Path | None:
    """``run_dir/learning_curve.png``: mean return of recent episodes vs timesteps."""
    from phalanx.observe.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir) if r.get("return_mean_recent") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure  # no pyplot: no GUI backend machinery to import

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.plot([r["timesteps"] for r in rows], [r["return_mean_recent"] for r in rows])
    ax.set_xlabel("timesteps")
    ax.set_ylabel("mean return (recent episodes)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    out = run_dir / "learning_curve.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


# ---------------------------------------------------------------------------- command line
@dataclass
class TrainPPO:
    """PPO on a gymnasium env with phalanx env runners. Defaults shown are the values tuned
    for --env; a --config YAML file sets any PPOConfig field (env_config too) and flags win
    over it. Exit status: 0 done or --stop-return reached, 2 budget spent first, 1 bad input."""

    ppo: PPOConfig
    config: Path | None = None
    """YAML file of PPOConfig fields (unknown keys are an error)"""
    resume: bool = False
    """continue <runs-dir>/<name> from its checkpoint (step count, policy, optimizer, normaliser)"""
    trace: bool = False
    """record a trace of group calls into the run folder (open it in ui.perfetto.dev)"""
    progress: bool = True
    """live progress display (--no-progress: none)"""


def _defaults(argv: list[str]) -> TrainPPO:
    """What flags not given fall back to: the checkpoint's config (``--resume``) or the
    tuned values of the env, then the ``--config`` file on top."""
    import yaml

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--env", "--config", "--name", "--runs-dir"):
        pre.add_argument(flag)
    pre.add_argument("--resume", action="store_true")
    known, _ = pre.parse_known_args(argv)
    from_file: dict[str, Any] = {}
    if known.config:
        try:
            with open(known.config, encoding="utf-8") as f:
                loaded = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--config: cannot read {known.config}: {e}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"--config: {known.config} must hold a mapping of PPOConfig fields")
        from_file = _check_keys(loaded, f"--config {known.config}")
    name = known.name or from_file.get("name")
    if known.resume:
        if not name:
            raise ValueError("--resume needs --name (the run to continue)")
        runs_dir = known.runs_dir or from_file.get("runs_dir") or PPOConfig.runs_dir
        ckpt = load_checkpoint(Path(runs_dir) / name)
        base = {**ckpt["config"], **from_file}
        if isinstance(base.get("hidden"), list):
            base["hidden"] = tuple(base["hidden"])
        return TrainPPO(ppo=PPOConfig(**base), resume=True)
    env = known.env or from_file.get("env") or PPOConfig.env
    return TrainPPO(
        ppo=PPOConfig.for_env(env, **{k: v for k, v in from_file.items() if k != "env"})
    )


def cli(argv: list[str]) -> int:
    """``phalanx train ppo [flags]``; returns the exit status (see ``TrainPPO``)."""
    try:
        default = _defaults(argv)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"phalanx train ppo: error: {e}", file=sys.stderr)
        return 1
    try:
        args = tyro.cli(
            TrainPPO,
            args=argv,
            default=default,
            prog="phalanx train ppo",
            config=(tyro.conf.OmitArgPrefixes,),
        )
    except SystemExit as e:  # --help (0) or a bad flag (tyro printed why)
        return 0 if e.code in (0, None) else 1
    cfg = args.ppo
    try:
        cfg.validate()
        if args.resume and default.resume is False:
            raise ValueError("--resume needs --name (the run to continue)")
        if cfg.name is None:
            cfg = replace(cfg, name=fresh_run_name(cfg.env, cfg.runs_dir))
    except (ValueError, TypeError) as e:
        print(f"phalanx train ppo: error: {name_the_flag(str(e), PPOConfig)}", file=sys.stderr)
        return 1
    started_s = process_age_s()  # interpreter start-up, imports and parsing
    times = WallBreakdown()
    times.add("python start-up and imports", started_s)
    try:
        with _tracing(args.trace, Path(cfg.runs_dir) / cfg.name):
            summary = train(cfg, resume=args.resume, progress=args.progress, times=times)
    except (ValueError, FileNotFoundError) as e:
        print(f"phalanx train ppo: error: {e}", file=sys.stderr)
        return 1
    total = process_age_s()
    if summary["time_to_stop_return_s"] is not None:
        summary["time_to_stop_return_s"] += started_s
    summary["process_wall_s"] = total
    summary["breakdown"] = times.as_dict(total)
    times.save(summary["run_dir"], total)
    print(json.dumps(summary, indent=2))
    print(times.table(total, title="wall time since the process started"))
    reached = summary["time_to_stop_return_s"]
    print(
        f"{cfg.env}: {summary['timesteps']:,} timesteps, mean return "
        f"{summary['return_mean_recent']:.1f}"
        + (f" (stop return reached {reached:.1f} s after start)" if reached is not None else "")
        + f", {summary['steps_per_s']:,.0f} env steps/s, {summary['restarts']} restarts; "
        f"run folder {summary['run_dir']}"
    )
    if cfg.stop_return is not None and not summary["reached_stop_return"]:
        print(f"stop return {cfg.stop_return} not reached within {cfg.max_timesteps} timesteps")
        return 2
    return 0


@contextlib.contextmanager
def _tracing(enabled: bool, run_dir: Path) -> Iterator[None]:
    """Trace group calls into ``run_dir/trace.json`` (Perfetto) when ``--trace`` is given."""
    if not enabled:
        yield
        return
    from phalanx._base import trace

    path = trace.enable(run_dir / "trace.json")
    try:
        yield
    finally:
        trace.dump(path)
        trace.disable()
        print(f"trace written to {path} (open it in https://ui.perfetto.dev)")
