"""Build worker actors: NeMo-RL's ``RayWorkerBuilder`` on phalanx's worker host.

``RayWorkerBuilder(cls_or_fqn, *args, **kwargs)`` describes a worker class and its init
arguments. With a dotted path the driver never imports the worker's module: an
``IsolatedWorkerInitializer`` actor (running in the class's own runtime environment)
imports it, asks its optional ``configure_worker`` hook for resources, env vars and init
kwargs, and creates the worker. A group launched by name takes a *shared* initializer
(``shared_initializer``: one per Ray session, node, class and runtime environment, kept
while a group uses it and for the two most recently used idle ones): its import (torch and
transformers for a policy worker, seconds of CPU on a launch's critical path) is paid once
for every group of that class launched after it, a relaunched policy included.

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

How the environment reaches the worker. A Ray ``runtime_env`` that differs between actors
keeps Ray from reusing its pooled worker processes: each such actor waits for a process
started for it alone. So the host actor sets the merged environment (1-4, then 5) in
``os.environ`` as the first thing it does, before it loads the worker class (sent as a
name or as pickled bytes, so its module is imported only then) and before the worker's
``__init__`` runs. Only *pre-import* variables go into the actor's ``runtime_env``: those
read when the interpreter starts or when a module the Ray worker process has already
imported is loaded (``is_pre_import``: ``PYTHON*``, ``LD_*``, ``LANG``/``LC_*``/``TZ``,
``MALLOC_*``/``GLIBC_TUNABLES``, thread-count variables of OpenMP/MKL/BLAS, ``RAY_*``,
``CUDA_*``/``PYTORCH_*``/``TORCH_*``), and only those whose value differs from the
environment Ray's worker processes on the target node start with. phalanx learns that
environment once per node (``pool_environ``: from the raylet's process when it runs on
this machine, else from a zero-CPU task on the node); where the node is unknown every
pre-import variable goes into the ``runtime_env``. A group of plain workers whose
pre-import variables match the pool's (the usual case: the driver, the raylets and their
workers share one shell environment) creates actors with no ``runtime_env`` at all, and
Ray reuses pooled processes.

Consequences: ``with_runtime_env(runtime_env=..., py_executable=...)``, a class's own
``@ray.remote(runtime_env=...)`` and ``configure_worker``'s runtime_env are Ray runtime
environments as before (their actors get dedicated processes); variables read while Ray
unpickles the worker's ``__init__`` arguments are set too late unless pre-import; and
actors or tasks that a worker starts itself do not inherit the non-pre-import variables
through Ray (its child *processes* do, through ``os.environ``).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import threading
from collections.abc import Iterable
from typing import Any

import psutil
import ray
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from phalanx.worker.context import RANK_ENV_KEYS, WorkerContext
from phalanx.worker.host import CONTROL_GROUP, WEIGHTS_GROUP, host_class_for, load_class

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


PRE_IMPORT_ENV = frozenset({"LANG", "LANGUAGE", "TZ", "GLIBC_TUNABLES", "GOTO_NUM_THREADS"})
PRE_IMPORT_ENV_PREFIXES = (
    "PYTHON",
    "LD_",
    "LC_",
    "MALLOC_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "RAY_",
    "CUDA_",
    "PYTORCH_",
    "TORCH_",
)


def is_pre_import(name: str) -> bool:
    """True for a variable that must be in a process's environment when it starts."""
    return name in PRE_IMPORT_ENV or name.startswith(PRE_IMPORT_ENV_PREFIXES)


def _pre_import_subset(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if is_pre_import(k)}


def _initial_environ() -> dict[str, str]:
    """The pre-import variables this process was started with (not later changes)."""
    try:
        return _pre_import_subset(psutil.Process().environ())
    except (psutil.Error, OSError):  # no /proc: the current environment is the best guess
        return _pre_import_subset(dict(os.environ))


_probe_environ = ray.remote(num_cpus=0, max_retries=0)(_initial_environ)
_POOL_ENV: dict[str, dict[str, str] | None] = {}
_POOL_ENV_LOCK = threading.Lock()
# Set by Ray for each worker process (or, LD_PRELOAD, for the raylet alone): a raylet's
# environment says nothing about their value in a worker.
_NOT_INHERITED = frozenset({"LD_PRELOAD", "RAY_JOB_ID", "RAY_RAYLET_PID"})


def _local_raylet_environ(node_ids: list[str]) -> dict[str, dict[str, str]]:
    """Environments of the raylets of ``node_ids`` that run on this machine.

    A raylet starts its node's worker processes with its own environment; reading it
    costs no worker process. Nodes on other machines (or unreadable) are left out.
    """
    flags = {f"--node_id={n}": n for n in node_ids}
    found: dict[str, dict[str, str]] = {}
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] != "raylet" or not proc.info["cmdline"]:
            continue
        node = next((flags[a] for a in proc.info["cmdline"] if a in flags), None)
        if node is None:
            continue
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        found[node] = {k: v for k, v in _pre_import_subset(env).items() if k not in _NOT_INHERITED}
    return found


def pool_environ(
    node_ids: Iterable[str], timeout_s: float = 60.0
) -> dict[str, dict[str, str] | None]:
    """Pre-import variables Ray's worker processes on each node start with (``None``: unknown).

    A node whose raylet runs on this machine: read from the raylet's process environment.
    Another node: one zero-CPU task reads its own process's initial environment (all such
    tasks in parallel). Cached for the life of this process (node ids are never reused);
    a node that does not answer in ``timeout_s`` stays unknown. The ``env_vars`` of the
    caller's Ray ``runtime_env`` (the job's, or the actor's when an actor asks), which the
    actors it creates inherit, are laid over the result.
    """
    wanted = [n for n in dict.fromkeys(node_ids) if n]
    with _POOL_ENV_LOCK:
        missing = [n for n in wanted if n not in _POOL_ENV]
    if missing:
        found: dict[str, dict[str, str] | None] = dict(_local_raylet_environ(missing))
        remote = [n for n in missing if n not in found]
        refs = [
            _probe_environ.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)
            ).remote()
            for n in remote
        ]
        for n, ref in zip(remote, refs):
            try:
                env = ray.get(ref, timeout=timeout_s)
                found[n] = {k: v for k, v in env.items() if k not in _NOT_INHERITED}
            except Exception:  # noqa: BLE001 - node gone or too slow: send every variable
                found[n] = None
        with _POOL_ENV_LOCK:
            _POOL_ENV.update(found)
    inherited = _pre_import_subset(
        dict(ray.get_runtime_context().runtime_env.get("env_vars") or {})
    )
    with _POOL_ENV_LOCK:
        known = {n: _POOL_ENV[n] for n in wanted}
    return {n: None if e is None else {**e, **inherited} for n, e in known.items()}


def pre_import_runtime_env(
    env: dict[str, str], node_id: str | None, own_env_vars: dict[str, str] | None = None
) -> dict[str, str]:
    """The variables of ``env`` that must go into a Ray ``runtime_env`` on ``node_id``.

    ``own_env_vars``: those the actor's ``runtime_env`` already sets (they start with it).
    """
    pre = _pre_import_subset(env)
    if not pre:
        return {}
    pool = pool_environ([node_id])[node_id] if node_id else None
    if pool is None:
        return pre
    start = {**pool, **(own_env_vars or {})}
    return {k: v for k, v in pre.items() if start.get(k) != v}


def _bundle_node(placement_group: Any, bundle_index: int | None) -> str | None:
    """The node holding a placement group's bundle (``None`` when not yet placed)."""
    if placement_group is None or bundle_index is None or bundle_index < 0:
        return None
    try:
        nodes = placement_group_table(placement_group).get("bundles_to_node_id", {})
    except Exception:  # noqa: BLE001 - removed or not yet known
        return None
    return nodes.get(bundle_index)


def _deferred(cls_or_fqn: Any) -> str | bytes:
    """The worker class as the host loads it after setting the environment.

    A name stays a name; a class is pickled here exactly as Ray would pickle it and
    unpickled by the host, so the modules it needs are imported after the environment is
    set instead of while Ray unpickles the actor's arguments.
    """
    if isinstance(cls_or_fqn, str):
        return cls_or_fqn
    return ray.cloudpickle.dumps(cls_or_fqn)


def _check_env(env: dict[str, str] | None, arg: str) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise TypeError(f"{arg} must be a dict of str -> str, got {type(env).__name__}")
    not_str = [k for k in env if not isinstance(k, str) or not k]
    if not_str:
        raise TypeError(f"{arg} keys must be non-empty str (variable names), got {not_str!r}")
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
    node_id: str | None = extra.pop("px_node_id", None)
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
    # Set by the host in os.environ; only pre-import variables that the node's pooled
    # processes lack need a runtime_env (see the module docstring).
    runtime_env = dict(options.pop("runtime_env", None) or {})
    node_id = node_id or _bundle_node(placement_group, placement_group_bundle_index)
    pre = pre_import_runtime_env(env, node_id, runtime_env.get("env_vars"))
    if pre:
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **pre}
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group,
            placement_group_bundle_index=placement_group_bundle_index,
            placement_group_capture_child_tasks=True,
        )
    options["num_gpus"] = num_gpus
    options.setdefault("num_cpus", 1)
    options.setdefault("max_concurrency", 1)
    if runtime_env:
        options["runtime_env"] = runtime_env
    if ctx is None:
        ctx = WorkerContext(
            group_name=options.get("name", "worker").split(":")[0], rank=0, world_size=1
        )
    ctx.env = env
    ctx.bundle_indices = bundle_indices
    return (
        _host_actor_class(cls)
        .options(**options)
        .remote(_deferred(cls_or_fqn), ctx, tuple(init_args), kwargs)
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
    """Imports the worker class in its own runtime environment and creates workers.

    A shared initializer (:meth:`RayWorkerBuilder.shared_initializer`) is made without init
    arguments; each ``create_worker`` call then brings its group's as ``px_init``.
    """

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
        init_args, init_kwargs = extra_options.pop("px_init", (self.init_args, self.init_kwargs))
        return _create_host(
            self.ray_actor_class_fqn,
            init_args,
            init_kwargs,
            placement_group,
            placement_group_bundle_index,
            num_gpus,
            bundle_indices,
            extra_options,
        )


class _SharedInitializers:
    """Initializers kept per (Ray session, node, class path, runtime environment).

    An initializer's cost is the import of its class's module (torch and transformers for a
    policy worker: seconds of CPU), and it is on a launch's critical path. Groups of one
    class launched after each other (a relaunched policy, a resumed run, the next test)
    reuse one. An initializer owns the workers it creates, so one is killed only when no
    live group uses it, and only beyond the ``keep_idle`` most recently used idle ones.
    Entries of an earlier Ray session (``ray.shutdown`` then ``ray.init``) are dropped, not
    killed: their actors went with that cluster, and their handles are invalid in this one.
    """

    def __init__(self, keep_idle: int = 2):
        self.keep_idle = keep_idle
        self._lock = threading.Lock()
        self._entries: dict[tuple, list] = {}  # key -> [handle, users, last release]
        self._key_locks: dict[tuple, threading.Lock] = {}
        self._clock = 0

    def acquire(self, key: tuple, make: Any) -> ray.actor.ActorHandle:
        """A live initializer for ``key`` (made by ``make()`` if none is), counted as used.

        Acquires of one key are serialised: two restarts that find a dead initializer at once
        must not each make a replacement (the one dropped would take its workers with it).
        """
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                entry = self._entries.get(key)
            alive = entry is not None and _initializer_alive(entry[0])
            with self._lock:
                if not alive or self._entries.get(key) is not entry:
                    entry = [make(), 0, 0]
                    self._entries[key] = entry
                entry[1] += 1
                return entry[0]

    def release(self, handle: ray.actor.ActorHandle) -> None:
        """One group no longer uses ``handle``; idle initializers beyond ``keep_idle`` go."""
        session = _ray_session()
        victims = []
        with self._lock:
            for key in [k for k in self._entries if k[0] != session]:
                del self._entries[key]
                self._key_locks.pop(key, None)
            for entry in self._entries.values():
                if entry[0] is handle:
                    entry[1] = max(0, entry[1] - 1)
                    self._clock += 1
                    entry[2] = self._clock
            idle = sorted((e[2], key) for key, e in self._entries.items() if e[1] == 0)
            for _, key in idle[: max(0, len(idle) - self.keep_idle)]:
                victims.append(self._entries.pop(key)[0])
        for victim in victims:  # ray.kill of a dead actor does nothing
            ray.kill(victim, no_restart=True)

    def is_shared(self, handle: Any) -> bool:
        with self._lock:
            return any(e[0] is handle for e in self._entries.values())


def _ray_session() -> str | None:
    """The connected Ray session's name (job ids restart at 1 in every session), or None."""
    return ray.get_runtime_context().get_session_name() if ray.is_initialized() else None


def _initializer_alive(handle: ray.actor.ActorHandle, timeout: float = 30.0) -> bool:
    """False once the initializer's process is gone; a slow one counts as alive (dropping it
    would kill the workers it owns)."""
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        return True
    except Exception:  # noqa: BLE001 - died (killed, OOM)
        return False
    return True


_SHARED_INITIALIZERS = _SharedInitializers()


class RayWorkerBuilder:
    """A worker class (or ``"pkg.module.Class"``) plus its ``__init__`` arguments.

    Args:
        ray_actor_class_fqn: the worker class, or its ``"pkg.module.Class"`` path.
        *args, **kwargs: the worker's ``__init__`` arguments.
    """

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
        """The worker class's name, without its module."""
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
        """Per-class runtime environment: env vars, a Python executable, or a Ray runtime_env.

        Args:
            env_vars: environment variables of the class's workers.
            py_executable: the Python executable they run.
            runtime_env: a Ray runtime_env merged into theirs.

        Returns:
            This builder.

        Raises:
            TypeError: ``runtime_env`` is not a dict, or an env var is not a str.
            ValueError: ``py_executable`` does not exist.
        """
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
        """An ``IsolatedWorkerInitializer`` actor in this class's runtime environment.

        Returns:
            The initializer actor's handle.
        """
        return self.IsolatedWorkerInitializer.options(
            runtime_env=self._initializer_runtime_env()
        ).remote(self.ray_actor_class_fqn, *self.args, **self.kwargs)

    def shared_initializer(self) -> ray.actor.ActorHandle:
        """An initializer for this class and runtime environment that later groups reuse
        (``_SharedInitializers``); hand it back with :meth:`release_initializer`.

        Unlike :meth:`new_initializer`'s, it holds no init arguments: ``create_worker_async``
        sends this builder's with each worker.

        Returns:
            The initializer actor's handle.
        """
        runtime_env = self._initializer_runtime_env()
        key = (
            _ray_session(),
            ray.get_runtime_context().get_node_id(),
            self.ray_actor_class_fqn,
            json.dumps(runtime_env, sort_keys=True, default=str),
        )
        return _SHARED_INITIALIZERS.acquire(
            key,
            lambda: self.IsolatedWorkerInitializer.options(runtime_env=runtime_env).remote(
                self.ray_actor_class_fqn
            ),
        )

    @staticmethod
    def release_initializer(initializer: ray.actor.ActorHandle) -> None:
        """A group no longer uses a :meth:`shared_initializer` (its workers are killed).

        Args:
            initializer: the handle :meth:`shared_initializer` returned.
        """
        _SHARED_INITIALIZERS.release(initializer)

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

        Args:
            placement_group: the Ray placement group to place the worker in.
            placement_group_bundle_index: its bundle (any if None).
            num_gpus: the GPUs the worker's actor reserves.
            bundle_indices: ``(node, bundle indices)`` of a worker that spans bundles.
            initializer: an ``IsolatedWorkerInitializer`` to create it (one is made if None
                and the class needs its own runtime environment).
            **extra_options: more Ray actor options.

        Returns:
            ``(ref to the worker's handle, the initializer or None)``.
        """
        options = self._options(extra_options)
        if self.isolated:
            initializer = initializer or self.new_initializer()
            if _SHARED_INITIALIZERS.is_shared(initializer):
                options["px_init"] = (self.args, self.kwargs)
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
