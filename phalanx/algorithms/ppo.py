"""PPO on gymnasium environments with phalanx env runners (CleanRL style, one file).

Read top to bottom: the hyperparameters (``PPOConfig``), advantage estimation (``gae``),
the loss and update (``ppo_update``), the training loop (``train``), checkpoints, and
the ``phalanx train ppo`` command line (``add_arguments``/``run``).

Sampling runs on an :class:`~phalanx.envs.EnvRunnerGroup`: ``num_env_runners`` remote
runners (or the local runner when 0), each stepping ``num_envs_per_env_runner`` envs for
``rollout_fragment_length`` steps per iteration. The learner is this process. In
``async_sampling`` mode the runners sample the next batch while the learner trains on
the current one, so each batch was collected with weights one version behind the
learner (``policy_lag`` in the metrics). A runner that dies is left out of that round,
restarted by the group, and given the current weights and normaliser before it samples
again; ``restarts`` in the metrics counts it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_FILE = "checkpoint.pt"


# ---------------------------------------------------------------------------- config
@dataclass
class PPOConfig:
    """Every knob of a PPO run. ``PPOConfig.for_env(env_id)`` starts from tuned values."""

    # environment and runners
    env: str = "CartPole-v1"
    env_config: dict[str, Any] = field(default_factory=dict)
    num_env_runners: int = 2
    num_envs_per_env_runner: int = 8
    rollout_fragment_length: int = 32  # vector steps per runner per iteration
    normalize_observations: bool = False
    # budget and stopping
    max_timesteps: int = 200_000
    stop_return: float | None = (
        None  # stop once the mean of the last stop_window returns reaches it
    )
    stop_window: int = 20
    seed: int = 1
    # PPO
    learning_rate: float = 2.5e-3
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    minibatch_size: int = 128
    update_epochs: int = 4
    norm_adv: bool = True
    clip_coef: float = 0.2
    clip_vloss: bool = True
    vf_clip_coef: float | None = None  # None: same as clip_coef
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = None
    reward_scale: float = 1.0
    # policy network
    hidden: tuple[int, ...] = (64, 64)
    activation: str = "tanh"
    init_log_std: float = 0.0
    # runtime
    async_sampling: bool = False
    restart_failed_env_runners: bool = True
    max_num_env_runner_restarts: int = 100
    sample_timeout_s: float = 60.0
    name: str = "ppo"
    runs_dir: str = "runs"
    checkpoint_every: int = 10  # iterations; a checkpoint is also written at the end

    @classmethod
    def for_env(cls, env: str, **overrides: Any) -> PPOConfig:
        """Tuned starting points for a few environments; anything else uses the defaults."""
        tuned = _TUNED.get(env, {})
        return cls(**{"env": env, **tuned, **overrides})

    @property
    def batch_size(self) -> int:
        runners = max(self.num_env_runners, 1)
        return runners * self.num_envs_per_env_runner * self.rollout_fragment_length

    def validate(self) -> None:
        """``ValueError``/``TypeError`` naming the first bad option (before anything starts)."""
        ints = (
            "num_env_runners", "num_envs_per_env_runner", "rollout_fragment_length",
            "max_timesteps", "stop_window", "seed", "minibatch_size", "update_epochs",
            "checkpoint_every", "max_num_env_runner_restarts",
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
            "reward_scale": (0, None), "sample_timeout_s": (0, None),
        }  # fmt: skip
        for name, (lo, hi) in ranges.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name} must be a number, got {v!r}")
            if v <= lo if name != "gae_lambda" else v < lo:
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
        if not self.hidden or not all(isinstance(h, int) and h > 0 for h in self.hidden):
            raise ValueError(
                f"hidden must be a non-empty list of positive ints, got {self.hidden!r}"
            )
        if self.activation not in ("tanh", "relu"):
            raise ValueError(f"activation must be 'tanh' or 'relu', got {self.activation!r}")
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"name must be a non-empty str without '/', got {self.name!r}")
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
    def from_dict(cls, d: dict[str, Any]) -> PPOConfig:
        d = {k.replace("-", "_"): v for k, v in d.items()}
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"unknown PPO config keys {unknown} (known: {sorted(known)})")
        if "hidden" in d:
            d["hidden"] = tuple(d["hidden"])
        return cls(**d)


_TUNED: dict[str, dict[str, Any]] = {
    # Many envs, short fragments and a high learning rate: CartPole-v1 reaches ~500 in
    # well under 100k steps.
    "CartPole-v1": {},
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
    n = data["obs"].shape[0]
    mb = min(cfg.minibatch_size, n)
    vf_clip = cfg.clip_coef if cfg.vf_clip_coef is None else cfg.vf_clip_coef
    stats: dict[str, list[float]] = {
        k: [] for k in ("policy", "value", "entropy", "kl", "clipfrac")
    }
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
            torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            optimizer.step()
            with torch.no_grad():
                approx_kl = ((ratio - 1) - log_ratio).mean().item()
                stats["kl"].append(approx_kl)
                stats["clipfrac"].append(((ratio - 1).abs() > cfg.clip_coef).float().mean().item())
            stats["policy"].append(pg_loss.item())
            stats["value"].append(v_loss.item())
            stats["entropy"].append(ent.item())
        if cfg.target_kl is not None and np.mean(stats["kl"][-(n // mb) :]) > cfg.target_kl:
            break
    y, v = data["ret"].numpy(), data["values"].numpy()
    var_y = float(np.var(y))
    out = {f"loss/{k}": float(np.mean(s)) for k, s in stats.items() if k != "clipfrac"}
    out["clipfrac"] = float(np.mean(stats["clipfrac"]))
    out["explained_variance"] = float("nan") if var_y == 0 else 1 - float(np.var(y - v)) / var_y
    return out


# ---------------------------------------------------------------------------- checkpoints
def save_checkpoint(path: Path, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    connector: dict[str, Any], timesteps: int, iteration: int, episodes: int,
                    cfg: PPOConfig, spaces: tuple[Any, Any]) -> None:  # fmt: skip
    """Policy, optimizer, normaliser and counters; written atomically."""
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


def load_checkpoint(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint of ``run_dir`` (a ``runs/<name>`` folder or the file itself)."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / CHECKPOINT_FILE
    if not path.exists():
        raise FileNotFoundError(f"no PPO checkpoint at {path}")
    return torch.load(path, map_location="cpu", weights_only=False)


def build_policy(cfg: PPOConfig, observation_space: Any, action_space: Any) -> torch.nn.Module:
    from phalanx.envs.policy import ActorCritic

    return ActorCritic(
        observation_space, action_space, cfg.hidden, cfg.activation, cfg.init_log_std
    )


# ---------------------------------------------------------------------------- training
def train(
    cfg: PPOConfig,
    *,
    resume: bool = False,
    cluster: Any = None,
    progress: bool | None = None,
    on_iteration: Callable[[dict[str, Any], Any], bool | None] | None = None,
) -> dict[str, Any]:
    """Run PPO until ``max_timesteps`` or ``stop_return``; returns a summary dict.

    Writes ``runs_dir/name/metrics.jsonl``, ``checkpoint.pt`` and ``learning_curve.png``.
    ``resume`` continues from that checkpoint (step count, policy, optimizer, normaliser).
    ``on_iteration(metrics, env_runner_group)`` is called after every iteration; a true
    return value stops the run there.
    """
    from phalanx._base import trace
    from phalanx.envs import EnvRunnerGroup
    from phalanx.observe.metrics import MetricsLogger
    from phalanx.observe.progress import Progress

    t_start = time.perf_counter()
    cfg.validate()
    run_dir = Path(cfg.runs_dir) / cfg.name
    ckpt_path = run_dir / CHECKPOINT_FILE
    ckpt = None
    if resume:
        ckpt = load_checkpoint(ckpt_path)
    elif ckpt_path.exists():
        raise ValueError(
            f"name: {run_dir} already has a checkpoint; pass --resume to continue it or "
            "choose another --name"
        )
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)

    runners = EnvRunnerGroup(
        config=cfg.env_runner_config(),
        local_env_runner=cfg.num_env_runners == 0,
        cluster=cluster,
        name=f"ppo_{cfg.name}_{os.getpid()}",
    )
    obs_space, act_space = runners.get_spaces()["__env__"]
    policy = build_policy(cfg, obs_space, act_space)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.learning_rate, eps=1e-5)
    timesteps, iteration, episodes = 0, 0, 0
    if ckpt is not None:
        policy.load_state_dict(ckpt["policy"])
        optimizer.load_state_dict(ckpt["optimizer"])
        runners.set_connector_state(ckpt["connector"])
        timesteps, iteration, episodes = ckpt["timesteps"], ckpt["iteration"], ckpt["episodes"]
    runners.sync_weights(from_worker_or_learner_group=policy, timeout_seconds=None)

    log = MetricsLogger(run_dir, use_tensorboard=False)
    log.log_config({**asdict(cfg), "resumed_from": timesteps if ckpt else None})
    bar = Progress(
        total=cfg.max_timesteps, start=timesteps, title=f"PPO {cfg.env}", enabled=progress
    )
    recent: deque[float] = deque(maxlen=cfg.stop_window)
    first_iteration_at = timesteps
    t_loop = time.perf_counter()
    pending = runners.sample_async()
    reached = stopped = False
    synced = True  # the runners hold the learner's current weights
    last: dict[str, Any] = {}
    try:
        while timesteps < cfg.max_timesteps and not reached:
            t_iter = time.perf_counter()
            # 1. collect the round in flight
            with bar.waiting(
                f"rollouts from {max(runners.num_healthy_remote_workers(), 1)} env runners"
            ):
                batches = runners.collect_samples(pending)
            t_sampled = time.perf_counter()
            t_sync = 0.0
            if cfg.normalize_observations:
                runners.sync_env_runner_states(env_steps_sampled=timesteps)
            if cfg.async_sampling:
                # The runners are idle now: give them the weights trained on the previous
                # batch and start the next round, which samples while we train on this one.
                if not synced:
                    runners.sync_weights(from_worker_or_learner_group=policy, timeout_seconds=None)
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
            if cfg.anneal_lr:
                frac = max(1.0 - timesteps / cfg.max_timesteps, 0.05)
                optimizer.param_groups[0]["lr"] = frac * cfg.learning_rate
            t_learn = time.perf_counter()
            with trace.span("ppo.update", iteration=iteration):
                stats = ppo_update(policy, optimizer, flatten_batches(batches, cfg), cfg)
            synced = False
            t_trained = time.perf_counter()
            # 3. synchronous mode: weights out, next round in
            if not cfg.async_sampling:
                runners.sync_weights(from_worker_or_learner_group=policy, timeout_seconds=None)
                synced = True
                t_sync = time.perf_counter() - t_trained
                pending = runners.sample_async()
            mean_recent = float(np.mean(recent)) if recent else float("nan")
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
                reached = stopped = True
            if (
                cfg.stop_return is not None
                and len(recent) >= min(cfg.stop_window, 10)
                and mean_recent >= cfg.stop_return
            ):
                reached = True
            if iteration % cfg.checkpoint_every == 0:
                save_checkpoint(ckpt_path, policy, optimizer, runners.get_connector_state(),
                                timesteps, iteration, episodes, cfg, (obs_space, act_space))  # fmt: skip
    finally:
        bar.close()
        log.close()
        save_checkpoint(ckpt_path, policy, optimizer, runners.get_connector_state(),
                        timesteps, iteration, episodes, cfg, (obs_space, act_space))  # fmt: skip
        restarts = runners.num_remote_worker_restarts()
        runners.stop()
    wall = time.perf_counter() - t_start
    plot_learning_curve(run_dir)
    return {
        "timesteps": timesteps,
        "iterations": iteration,
        "episodes": episodes,
        "return_mean_recent": float(np.mean(recent)) if recent else float("nan"),
        "reached_stop_return": reached and cfg.stop_return is not None,
        "stopped_by_callback": stopped,
        "wall_time_s": wall,
        "train_loop_s": time.perf_counter() - t_loop,
        "steps_per_s": last.get("throughput/steps_per_s", float("nan")),
        "restarts": restarts,
        "run_dir": str(run_dir),
    }


def plot_learning_curve(run_dir: Path) -> Path | None:
    """``run_dir/learning_curve.png``: mean return of recent episodes vs timesteps."""
    from phalanx.observe.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir) if r.get("return_mean_recent") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["timesteps"] for r in rows], [r["return_mean_recent"] for r in rows])
    ax.set_xlabel("timesteps")
    ax.set_ylabel("mean return (recent episodes)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    out = run_dir / "learning_curve.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------- command line
_FLAGS: list[tuple[str, str, Any, str]] = [
    # flag, PPOConfig field, type, help
    ("--env", "env", str, "gymnasium env id (default CartPole-v1)"),
    ("--env-runners", "num_env_runners", int, "remote env runner processes; 0 samples in this process (default 2)"),
    ("--envs-per-runner", "num_envs_per_env_runner", int, "vectorised envs per runner"),
    ("--rollout-length", "rollout_fragment_length", int, "vector steps per runner per iteration"),
    ("--seed", "seed", int, "random seed (default 1)"),
    ("--max-timesteps", "max_timesteps", int, "stop after this many env steps"),
    ("--stop-return", "stop_return", float, "stop once the mean return of the last --stop-window episodes reaches R (exit 0)"),
    ("--stop-window", "stop_window", int, "episodes averaged for --stop-return (default 20)"),
    ("--lr", "learning_rate", float, "Adam learning rate"),
    ("--minibatch-size", "minibatch_size", int, "SGD minibatch size"),
    ("--epochs", "update_epochs", int, "SGD passes over each batch"),
    ("--name", "name", str, "run name: output goes to <runs-dir>/<name> (default ppo-<env>)"),
    ("--runs-dir", "runs_dir", str, "folder of runs (default runs)"),
]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``phalanx train ppo``."""
    parser.epilog = (
        "Every PPOConfig field can also be set with --set FIELD=VALUE or in a YAML file "
        "given with --config (flags win over the file). Fields: "
        + ", ".join(f.name for f in fields(PPOConfig))
    )
    for flag, dest, kind, help_text in _FLAGS:
        if "default" not in help_text:
            help_text += " (default: PPOConfig.for_env(env), tuned per env)"
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=help_text)
    parser.add_argument("--async", dest="async_sampling", action="store_const", const=True,
                        default=None, help="sample the next batch while the learner trains")  # fmt: skip
    parser.add_argument("--normalize-obs", dest="normalize_observations", action="store_const",
                        const=True, default=None, help="running observation normaliser")  # fmt: skip
    parser.add_argument("--config", dest="config_file", default=None,
                        help="YAML file of PPOConfig fields")  # fmt: skip
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="set any PPOConfig field (repeatable), e.g. --set ent_coef=0.01")  # fmt: skip
    parser.add_argument("--resume", action="store_true",
                        help="continue <runs-dir>/<name> from its checkpoint (step count, policy, optimizer, normaliser)")  # fmt: skip
    parser.add_argument("--trace", action="store_true",
                        help="record a trace of group calls into the run folder (phalanx._base.trace)")  # fmt: skip
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                        help="no live progress display")  # fmt: skip


def _parse_value(field_: dataclasses.Field, text: str) -> Any:
    import yaml

    value = yaml.safe_load(text)
    if field_.name == "hidden" and isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def config_from_args(args: argparse.Namespace) -> tuple[PPOConfig, bool]:
    """The run's config: tuned values for the env < YAML file < --set < flags.

    With ``--resume`` the checkpoint's config is the base instead.
    """
    import yaml

    values: dict[str, Any] = {}
    if args.config_file:
        try:
            with open(args.config_file, encoding="utf-8") as f:
                loaded = yaml.safe_load(f) or {}
        except OSError as e:
            raise ValueError(f"--config: cannot read {args.config_file}: {e}") from None
        if not isinstance(loaded, dict):
            raise ValueError(
                f"--config: {args.config_file} must hold a mapping of PPOConfig fields"
            )
        values.update({k.replace("-", "_"): v for k, v in loaded.items()})
    known = {f.name: f for f in fields(PPOConfig)}
    for item in args.overrides:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in known:
            raise ValueError(
                f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(known)}"
            )
        values[key] = _parse_value(known[key], text)
    for _, dest, _, _ in _FLAGS:
        if getattr(args, dest, None) is not None:
            values[dest] = getattr(args, dest)
    for dest in ("async_sampling", "normalize_observations"):
        if getattr(args, dest, None) is not None:
            values[dest] = getattr(args, dest)
    if args.resume:
        name = values.get("name")
        runs_dir = values.get("runs_dir", "runs")
        if not name:
            raise ValueError("--resume needs --name (the run to continue)")
        ckpt = load_checkpoint(Path(runs_dir) / name)
        base = {**ckpt["config"], **values}
        return PPOConfig.from_dict(base), True
    env = values.get("env", PPOConfig.env)
    if "name" not in values:  # a fresh folder: ppo-<env>, ppo-<env>-2, ...
        runs_dir = Path(values.get("runs_dir", PPOConfig.runs_dir))
        name, i = f"ppo-{env}", 1
        while (runs_dir / name / CHECKPOINT_FILE).exists():
            i += 1
            name = f"ppo-{env}-{i}"
        values["name"] = name
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"--config: unknown PPO config keys {unknown} (known: {sorted(known)})")
    return PPOConfig.for_env(
        **{"env": env, **{k: v for k, v in values.items() if k != "env"}}
    ), False


def run(args: argparse.Namespace) -> int:
    """``phalanx train ppo``: 0 when done (or ``--stop-return`` reached), 2 when the budget
    ran out before ``--stop-return``, 1 on a configuration error."""
    try:
        cfg, resume = config_from_args(args)
        cfg.validate()
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"phalanx train ppo: error: {e}", file=sys.stderr)
        return 1
    trace_ctx = _tracing(args.trace, Path(cfg.runs_dir) / cfg.name)
    try:
        with trace_ctx:
            summary = train(cfg, resume=resume, progress=args.progress)
    except ValueError as e:
        print(f"phalanx train ppo: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    print(
        f"{cfg.env}: {summary['timesteps']:,} timesteps in {summary['wall_time_s']:.1f}s, "
        f"mean return {summary['return_mean_recent']:.1f}, "
        f"{summary['steps_per_s']:,.0f} env steps/s, {summary['restarts']} restarts; "
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
