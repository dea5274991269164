"""Build worker actors: NeMo-RL's ``RayWorkerBuilder`` on phalanx's worker host.

``RayWorkerBuilder(cls_or_fqn, *args, **kwargs)`` describes a worker class and its init
arguments. With a dotted path the driver never imports the worker's module: an
``IsolatedWorkerInitializer`` actor (running in the class's own runtime environment)
imports it, asks its optional ``configure_worker`` hook for resources, env vars and init
kwargs, and creates the worker.

Environment of a worker, lowest precedence first:

1. allowlisted variables of the driver (``ENV_ALLOWLIST``, ``ENV_ALLOWLIST_PREFIXES``);
2. the builder's ``with_runtime_env(env_vars=...)``;
3. the group's ``env_vars=`` (``launch(..., env_vars=)`` / ``RayWorkerGroup(..., env_vars=)``);
4. env vars returned by the class's ``configure_worker(...)``: as in NeMo-RL, what the
   worker class says it needs wins over what the group was given;
5. phalanx's rank variables (``RANK_ENV_KEYS``: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
   MASTER_PORT, NODE_RANK, ...): setting one of them in 2-4 is a ``ValueError`` (NeMo-RL
   lets ``configure_worker`` overwrite them; phalanx refuses, since a worker whose RANK
   disagrees with its group's dispatch silently breaks collectives).

Unlike NeMo-RL, the rest of the driver's environment is not copied.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from phalanx.worker.host import CONTROL_GROUP, WEIGHTS_GROUP, host_class_for, load_class
from phalanx.worker.worker import RANK_ENV_KEYS, WorkerContext

ENV_ALLOWLIST = frozenset(
    {
        "PYTHONPATH",
        "PYTHONHASHSEED",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "TOKENIZERS_PARALLELISM",
        "CUDA_LAUNCH_BLOCKING",
        "PYTORCH_CUDA_ALLOC_CONF",
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS",
        "HOME",
        "LANG",
        "LC_ALL",
        "TZ",
    }
)
ENV_ALLOWLIST_PREFIXES = ("PHALANX_", "HF_", "TRANSFORMERS_", "NCCL_", "GLOO_", "TORCH_", "WANDB_")


def allowlisted_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The driver variables that workers inherit."""
    environ = os.environ if environ is None else environ
    return {
        k: v
        for k, v in environ.items()
        if (k in ENV_ALLOWLIST or k.startswith(ENV_ALLOWLIST_PREFIXES)) and k not in RANK_ENV_KEYS
    }


def _check_env(env: dict[str, str] | None, arg: str) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise TypeError(f"{arg} must be a dict of str -> str, got {type(env).__name__}")
    bad = sorted(set(env) & RANK_ENV_KEYS)
    if bad:
        raise ValueError(
            f"{arg} may not set {bad}: phalanx sets the rank environment of each worker"
        )
    return {str(k): str(v) for k, v in env.items()}


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _class_options(cls_or_fqn: Any) -> dict[str, Any]:
    """Default Ray options of a ``@ray.remote(...)`` decorated class, if any."""
    meta = getattr(cls_or_fqn, "_default_options", None)
    return dict(meta) if isinstance(meta, dict) else {}


def _create_host(
    cls_or_fqn: Any,
    init_args: tuple,
    init_kwargs: dict,
    placement_group: Any,
    placement_group_bundle_index: int | None,
    num_gpus: float,
    bundle_indices: tuple[int, list[int]] | None,
    extra_options: dict[str, Any],
) -> ray.actor.ActorHandle:
    """Shared by the driver path and the isolated initializer: resolve options, create the host."""
    cls = load_class(cls_or_fqn)
    extra = dict(extra_options)
    ctx: WorkerContext | None = extra.pop("px_context", None)
    env_layers: list[dict[str, str]] = extra.pop("px_env_layers", [{}, {}, {}])
    num_gpus_per_node = extra.pop("num_gpus_per_node", None)
    options = _merge(_class_options(cls_or_fqn), extra)
    kwargs = dict(init_kwargs)
    configure_env: dict[str, str] = {}
    if hasattr(cls, "configure_worker"):
        out = (
            cls.configure_worker(
                num_gpus=num_gpus,
                bundle_indices=bundle_indices,
                num_gpus_per_node=num_gpus_per_node,
            )
            if _accepts(cls.configure_worker, "num_gpus_per_node")
            else cls.configure_worker(num_gpus=num_gpus, bundle_indices=bundle_indices)
        )
        resources, env_vars, more_kwargs, *rest = (*out, None) if len(out) == 3 else out
        if resources and "num_gpus" in resources:
            num_gpus = resources["num_gpus"]
        if resources and "num_cpus" in resources:
            options["num_cpus"] = resources["num_cpus"]
        configure_env = _check_env(env_vars, f"{cls.__name__}.configure_worker env_vars")
        if more_kwargs:
            kwargs.update(more_kwargs)
        if rest and rest[0]:
            options["runtime_env"] = _merge(options.get("runtime_env", {}), rest[0])
    allow, builder_env, group_env = env_layers
    env = {**allow, **builder_env, **group_env, **configure_env}
    runtime_env = dict(options.pop("runtime_env", None) or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **env}
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group,
            placement_group_bundle_index=placement_group_bundle_index,
            placement_group_capture_child_tasks=True,
        )
    options["num_gpus"] = num_gpus
    options.setdefault("num_cpus", 1)
    options.setdefault("max_concurrency", 1)
    options["runtime_env"] = runtime_env
    if ctx is None:
        ctx = WorkerContext(
            group_name=options.get("name", "worker").split(":")[0], rank=0, world_size=1
        )
    ctx.env = env
    ctx.bundle_indices = bundle_indices
    return (
        _host_actor_class(cls).options(**options).remote(cls_or_fqn, ctx, tuple(init_args), kwargs)
    )


def _accepts(fn: Any, name: str) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


_HOST_ACTORS: dict[type, Any] = {}


def _host_actor_class(cls: type):
    """The Ray actor class hosting ``cls`` (built once per worker class)."""
    actor = _HOST_ACTORS.get(cls)
    if actor is None:
        # control: one thread for the health monitor's watch call, two for ping/stacks.
        actor = ray.remote(concurrency_groups={CONTROL_GROUP: 3, WEIGHTS_GROUP: 2})(
            host_class_for(cls)
        )
        _HOST_ACTORS[cls] = actor
    return actor


class _Initializer:
    """Imports the worker class in its own runtime environment and creates workers."""

    def __init__(self, ray_actor_class_fqn: str, *init_args: Any, **init_kwargs: Any):
        self.ray_actor_class_fqn = ray_actor_class_fqn
        self.init_args = init_args
        self.init_kwargs = init_kwargs

    def create_worker(
        self,
        placement_group: Any,
        placement_group_bundle_index: int | None,
        num_gpus: float,
        bundle_indices: tuple | None = None,
        **extra_options: Any,
    ) -> ray.actor.ActorHandle:
        return _create_host(
            self.ray_actor_class_fqn,
            self.init_args,
            self.init_kwargs,
            placement_group,
            placement_group_bundle_index,
            num_gpus,
            bundle_indices,
            extra_options,
        )


class RayWorkerBuilder:
    """A worker class (or ``"pkg.module.Class"``) plus its ``__init__`` arguments."""

    IsolatedWorkerInitializer = ray.remote(num_cpus=0)(_Initializer)

    def __init__(self, ray_actor_class_fqn: str | type, *args: Any, **kwargs: Any):
        if not isinstance(ray_actor_class_fqn, (str, type)) and not hasattr(
            ray_actor_class_fqn, "__ray_actor_class__"
        ):
            raise TypeError(
                f"ray_actor_class_fqn must be a class or 'module.Class' string, got {type(ray_actor_class_fqn).__name__}"
            )
        if isinstance(ray_actor_class_fqn, str) and "." not in ray_actor_class_fqn:
            raise ValueError(
                f"ray_actor_class_fqn must be 'module.Class', got {ray_actor_class_fqn!r}"
            )
        self.ray_actor_class_fqn = ray_actor_class_fqn
        self.args = args
        self.kwargs = kwargs
        self.env_vars: dict[str, str] = {}
        self.runtime_env: dict[str, Any] = {}

    @property
    def class_name(self) -> str:
        c = self.ray_actor_class_fqn
        if isinstance(c, str):
            return c.rpartition(".")[2]
        return load_class(c).__name__

    @property
    def isolated(self) -> bool:
        """True when the class is given by name: the driver does not import it."""
        return isinstance(self.ray_actor_class_fqn, str)

    def with_runtime_env(
        self,
        env_vars: dict[str, str] | None = None,
        py_executable: str | None = None,
        runtime_env: dict[str, Any] | None = None,
    ) -> RayWorkerBuilder:
        """Per-class runtime environment: env vars, a Python executable, or a Ray runtime_env."""
        self.env_vars.update(_check_env(env_vars, "env_vars"))
        if runtime_env:
            if not isinstance(runtime_env, dict):
                raise TypeError("runtime_env must be a dict")
            _check_env(runtime_env.get("env_vars"), "runtime_env['env_vars']")
            self.runtime_env = _merge(self.runtime_env, runtime_env)
        if py_executable:
            if py_executable != sys.executable and not os.path.exists(py_executable):
                raise ValueError(f"py_executable {py_executable!r} does not exist")
            self.runtime_env["py_executable"] = py_executable
        return self

    def _initializer_runtime_env(self) -> dict[str, Any]:
        env = {k: v for k, v in self.runtime_env.items() if k != "env_vars"}
        env["env_vars"] = {
            **allowlisted_env(),
            **self.runtime_env.get("env_vars", {}),
            **self.env_vars,
        }
        return env

    def _options(self, extra_options: dict[str, Any]) -> dict[str, Any]:
        options = dict(extra_options)
        if self.runtime_env:
            options["runtime_env"] = _merge(
                {k: v for k, v in self.runtime_env.items() if k != "env_vars"},
                options.get("runtime_env", {}),
            )
        layers = options.get("px_env_layers") or [allowlisted_env(), {}, {}]
        layers = [
            layers[0],
            {**self.runtime_env.get("env_vars", {}), **self.env_vars, **layers[1]},
            layers[2],
        ]
        options["px_env_layers"] = layers
        return options

    def new_initializer(self) -> ray.actor.ActorHandle:
        """An ``IsolatedWorkerInitializer`` actor in this class's runtime environment."""
        return self.IsolatedWorkerInitializer.options(
            runtime_env=self._initializer_runtime_env()
        ).remote(self.ray_actor_class_fqn, *self.args, **self.kwargs)

    def create_worker_async(
        self,
        placement_group: Any,
        placement_group_bundle_index: int | None,
        num_gpus: float | int,
        bundle_indices: tuple[int, list[int]] | None = None,
        initializer: ray.actor.ActorHandle | None = None,
        **extra_options: Any,
    ) -> tuple[ray.ObjectRef, ray.actor.ActorHandle | None]:
        """Start creating a worker; returns ``(ref to its handle, the initializer or None)``.

        Keep the initializer alive as long as the worker: it owns the worker actor.
        """
        options = self._options(extra_options)
        if self.isolated:
            initializer = initializer or self.new_initializer()
            ref = initializer.create_worker.remote(
                placement_group, placement_group_bundle_index, num_gpus, bundle_indices, **options
            )
            return ref, initializer
        handle = _create_host(
            self.ray_actor_class_fqn,
            self.args,
            self.kwargs,
            placement_group,
            placement_group_bundle_index,
            num_gpus,
            bundle_indices,
            options,
        )
        return ray.put(handle), None

    def __call__(
        self,
        placement_group: Any,
        placement_group_bundle_index: int | None,
        num_gpus: float | int,
        bundle_indices: tuple[int, list[int]] | None = None,
        **extra_options: Any,
    ) -> ray.actor.ActorHandle:
        """Create a worker and return its actor handle."""
        ref, initializer = self.create_worker_async(
            placement_group, placement_group_bundle_index, num_gpus, bundle_indices, **extra_options
        )
        handle = ray.get(ref, timeout=120)
        if initializer is not None:
            handle._px_initializer = initializer
        return handle

    def __repr__(self) -> str:
        return f"RayWorkerBuilder({self.ray_actor_class_fqn!r})"
