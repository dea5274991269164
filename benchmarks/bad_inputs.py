"""Bad-input tally: a fixed list of wrong arguments across phalanx's public API.

Each row calls one public entry point with one wrong argument and checks four things:

1. an exception was raised (for the command lines: a non-zero exit status);
2. its type is the documented one (``ValueError`` for a wrong value, ``TypeError`` for a
   wrong type, the API's own error where it documents one);
3. its message names the offending argument (every listed word appears in it);
4. where remote work could have started, none did: a group call refused by the driver
   reached no worker (each worker counts the calls it ran; counted again afterwards with a
   call queued behind any stray one), a refused launch left no actor of that name, a
   refused ``EnvRunnerGroup`` left no runner.

A row is *clear* when all of its checks hold. The script prints one line per row and
``bad inputs tried N / clear M``.

    python benchmarks/bad_inputs.py [--only AREA[,AREA...]]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

import phalanx as px

# --------------------------------------------------------------------------- workers


class Recorder(px.Worker):
    """Counts the calls that reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def rec(self, *args: Any, **kwargs: Any) -> int:
        self.calls += 1
        return self.rank

    def count(self) -> int:
        return self.calls

    def try_comm(self, op: str, *args: Any) -> tuple[str, str] | None:
        """Run one p2p call with bad arguments here; the error comes back as (type, text)."""
        try:
            if op == "send":
                self.send(*args)
            elif op == "recv":
                self.recv(*args)
            elif op == "recv_tensor":
                self.recv_tensor(*args)
            elif op == "send_tensor":
                self.send_tensor(*args)
            elif op == "broadcast":
                self.broadcast(*args)
        except Exception as e:  # noqa: BLE001 - returned to the driver
            return type(e).__name__, str(e)
        return None


class Holder(px.Worker):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 4)

    def weight_sum(self) -> float:
        return float(self.model.weight.sum())


class RemoteError(Exception):
    """An error raised in a worker and returned as (type name, message)."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


# --------------------------------------------------------------------------- rows


@dataclass
class Row:
    area: str
    what: str
    call: Callable[[], Any]
    expected: tuple[type, ...] | str  # a str: the type name of a remote error, or "exit"
    names: list[str]
    before: str = ""  # "calls", "actors:<name>", "runners:<name>" or "" (not applicable)
    notes: list[str] = field(default_factory=list)


@dataclass
class Fixture:
    cluster: px.Cluster
    group: Any  # 4 Recorders, sharding dp=2 x tp=2
    holder: Any  # 1 Holder with a model


def _calls(fx: Fixture) -> int:
    return sum(fx.group.count().wait(timeout=60))


def _actors(prefix: str) -> list[str]:
    rows = ray.util.list_named_actors(all_namespaces=True)
    return sorted(r["name"] for r in rows if r["name"].startswith(prefix))


def _remote(fx: Fixture, op: str, *args: Any) -> Callable[[], None]:
    def call() -> None:
        out = fx.group.execute_on(0).try_comm(op, *args).wait(timeout=60)[0]
        if out is not None:
            raise RemoteError(*out)

    return call


def _cli(module: str, argv: list[str]) -> Callable[[], None]:
    """Run ``phalanx train <algo>`` in this process; a non-zero status raises SystemExit."""

    def call() -> None:
        import importlib

        mod = importlib.import_module(module)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                status = mod.cli(argv)
            except SystemExit as e:
                status = e.code
        if status not in (0, None):
            raise SystemExit(f"exit {status}: {err.getvalue().strip()[-300:]}")

    return call


def rows(fx: Fixture) -> list[Row]:
    c, g, h = fx.cluster, fx.group, fx.holder
    R = Recorder.create_group
    V, T = ValueError, TypeError
    data4 = px.BatchedDataDict({"x": torch.arange(4)})

    def launch(name: str, **kw: Any) -> Callable[[], Any]:
        placement = kw.pop("placement", px.NodePlacement(num_workers=1))
        return lambda: R().launch(c, placement, name=name, **kw)

    def erg(name: str, **cfg: Any) -> Callable[[], Any]:
        from phalanx.envs import EnvRunnerGroup, EnvRunnerGroupConfig

        def call() -> Any:
            runners = cfg.pop("num_env_runners", 1)
            return EnvRunnerGroup(
                config=EnvRunnerGroupConfig(**cfg),
                num_env_runners=runners,
                local_env_runner=False,
                cluster=c,
                name=name,
            )

        return call

    def bdd(fn: Callable[[px.BatchedDataDict], Any], n: int = 6) -> Callable[[], Any]:
        return lambda: fn(px.BatchedDataDict({"x": torch.arange(n), "y": torch.zeros(n, 2)}))

    def channel(fn: Callable[[Any], Any]) -> Callable[[], Any]:
        def call() -> Any:
            ch = px.create_channel(f"bi_ch_{time.monotonic_ns()}")
            try:
                return fn(ch)
            finally:
                with contextlib.suppress(Exception):
                    ch.close()

        return call

    def closed_put() -> None:
        ch = px.create_channel("bi_ch_closed")
        ch.close()
        ch.put(1)

    def sender_send(weights: dict[str, torch.Tensor]) -> Callable[[], Any]:
        return lambda: px.WeightSender(h, timeout_s=60).send(weights)

    good = {k: v.clone() for k, v in torch.nn.Linear(8, 4).state_dict().items()}
    missing = {"weight": good["weight"]}
    nan = {"weight": torch.full_like(good["weight"], float("nan")), "bias": good["bias"]}
    policy_base = {"model_name": "/nonexistent", "precision": "float32"}
    from phalanx.llm.policy_config import ConfigError, check_policy_config

    return [
        # ---- group launch and placement ------------------------------------------------
        Row(
            "launch",
            "NodePlacement(num_workers=0)",
            lambda: px.NodePlacement(num_workers=0),
            (V,),
            ["num_workers"],
        ),
        Row(
            "launch",
            "NodePlacement(num_workers=-2)",
            lambda: px.NodePlacement(num_workers=-2),
            (V,),
            ["num_workers"],
        ),
        Row(
            "launch",
            "NodePlacement(num_workers='2')",
            lambda: px.NodePlacement(num_workers="2"),
            (T,),
            ["num_workers"],
        ),
        Row(
            "launch",
            "PackedPlacement(start_device=3, end_device=1)",
            lambda: px.PackedPlacement(start_device=3, end_device=1),
            (V,),
            ["end_device"],
        ),
        Row(
            "launch",
            "PackedPlacement(start_device='0')",
            lambda: px.PackedPlacement("0", 1),
            (T,),
            ["start_device"],
        ),
        Row(
            "launch",
            "NodePlacement(num_cpus='1')",
            lambda: px.NodePlacement(num_workers=1, num_cpus="1"),
            (T,),
            ["num_cpus"],
        ),
        Row("launch", "FlexiblePlacement([])", lambda: px.FlexiblePlacement([]), (V,), ["empty"]),
        Row(
            "launch",
            "launch(restart_policy=dict)",
            launch("bi_l_rp", restart_policy={"max_restarts_per_worker": 1}),
            (T,),
            ["restart_policy"],
            "actors:bi_l_rp:",
        ),
        Row(
            "launch",
            "launch(env_vars={'RANK': '3'})",
            launch("bi_l_rank", env_vars={"RANK": "3"}),
            (V,),
            ["RANK"],
            "actors:bi_l_rank:",
        ),
        Row(
            "launch",
            "launch(env_vars={1: 'x'})",
            launch("bi_l_envt", env_vars={1: "x"}),
            (T,),
            ["env_vars"],
            "actors:bi_l_envt:",
        ),
        Row(
            "launch",
            "launch(max_concurrency=0)",
            launch("bi_l_mc", max_concurrency=0),
            (V,),
            ["max_concurrency"],
            "actors:bi_l_mc:",
        ),
        Row(
            "launch",
            "launch(timeout_s=-1)",
            launch("bi_l_to", timeout_s=-1),
            (V,),
            ["timeout_s"],
            "actors:bi_l_to:",
        ),
        Row(
            "launch",
            "launch(sharding 2x2 for 1 worker)",
            launch("bi_l_sh", sharding=px.NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])),
            (V,),
            ["sharding"],
            "actors:bi_l_sh:",
        ),
        Row(
            "launch",
            "launch(placement=3)",
            launch("bi_l_pl", placement=3),
            (T,),
            ["placement"],
            "actors:bi_l_pl:",
        ),
        Row(
            "launch",
            "RestartPolicy(max_restarts_per_worker=-1)",
            lambda: px.RestartPolicy(max_restarts_per_worker=-1),
            (V,),
            ["max_restarts_per_worker"],
        ),
        Row("launch", "Cluster(num_nodes=0)", lambda: px.Cluster(num_nodes=0), (V,), ["num_nodes"]),
        Row(
            "launch",
            "RayVirtualCluster([64]) on 16 CPUs",
            lambda: px.RayVirtualCluster([64], use_gpus=False, name="bi_vc_big"),
            (px.PlacementError, ValueError, RuntimeError, TimeoutError),
            ["CPU"],
        ),
        # ---- dispatch -------------------------------------------------------------------
        Row(
            "dispatch",
            "execute_on(5) of 4 workers",
            lambda: g.execute_on(5).rec(),
            (V, IndexError),
            ["5"],
            "calls",
        ),
        Row(
            "dispatch",
            "execute_on(-1)",
            lambda: g.execute_on(-1).rec(),
            (V, IndexError),
            ["-1"],
            "calls",
        ),
        Row("dispatch", "execute_on('0')", lambda: g.execute_on("0").rec(), (T,), ["'0'"], "calls"),
        Row(
            "dispatch",
            "group.no_such_method()",
            lambda: g.no_such_method(),
            (px.UnknownMethodError, AttributeError),
            ["no_such_method"],
            "calls",
        ),
        Row(
            "dispatch",
            "sharded: in_sharded_axes=['zz']",
            lambda: g.run_all_workers_sharded_data("rec", [1, 2], in_sharded_axes=["zz"]),
            (V,),
            ["zz"],
            "calls",
        ),
        Row(
            "dispatch",
            "sharded: 3 shards for dp=2",
            lambda: g.run_all_workers_sharded_data("rec", [1, 2, 3], in_sharded_axes=["dp"]),
            (V,),
            ["dp"],
            "calls",
        ),
        Row(
            "dispatch",
            "sharded: axis both sharded and replicated",
            lambda: g.run_all_workers_sharded_data(
                "rec", [1, 2], in_sharded_axes=["dp"], replicate_on_axes=["dp"]
            ),
            (V,),
            ["dp"],
            "calls",
        ),
        Row(
            "dispatch",
            "sharded: BatchedDataDict of 4 over axes dp,tp",
            lambda: g.run_all_workers_sharded_data("rec", data4, in_sharded_axes=["dp", "tp"]),
            (V, T),
            ["dp"],
            "calls",
        ),
        Row(
            "dispatch",
            "multiple_data: 3 items for 4 workers",
            lambda: g.run_all_workers_multiple_data("rec", [1, 2, 3]),
            (V,),
            ["3"],
            "calls",
        ),
        Row(
            "dispatch",
            "single_data: run_rank_0_only_axes=['zz']",
            lambda: g.run_all_workers_single_data("rec", run_rank_0_only_axes=["zz"]),
            (V,),
            ["zz"],
            "calls",
        ),
        Row(
            "dispatch",
            "run_single_worker_single_data(worker_idx=9)",
            lambda: g.run_single_worker_single_data("rec", 9),
            (V, IndexError),
            ["worker_idx"],
            "calls",
        ),
        Row(
            "dispatch",
            "foreach_worker(remote_worker_ids=[7])",
            lambda: g.foreach_worker(lambda w: 1, remote_worker_ids=[7]),
            (V,),
            ["remote_worker_ids"],
            "calls",
        ),
        Row(
            "dispatch",
            "foreach_worker(func=3)",
            lambda: g.foreach_worker(3),
            (T,),
            ["func"],
            "calls",
        ),
        Row(
            "dispatch",
            "NamedSharding: duplicate ranks",
            lambda: px.NamedSharding([[0, 0]], ["a", "b"]),
            (V,),
            ["layout"],
        ),
        Row(
            "dispatch",
            "NamedSharding: 1 name for 2 axes",
            lambda: px.NamedSharding([[0, 1]], ["dp"]),
            (V,),
            ["names"],
        ),
        Row(
            "dispatch",
            "NamedSharding: names='dp'",
            lambda: px.NamedSharding([0, 1], "dp"),
            (T,),
            ["names"],
        ),
        Row(
            "dispatch",
            "NamedSharding.get_ranks(zz=0)",
            lambda: px.NamedSharding([[0, 1]], ["dp", "tp"]).get_ranks(zz=0),
            (V,),
            ["zz"],
        ),
        Row(
            "dispatch",
            "NamedSharding: negative rank",
            lambda: px.NamedSharding([-1, 0], ["dp"]),
            (V,),
            ["layout"],
        ),
        # ---- waits and timeouts ---------------------------------------------------------
        Row("wait", "handle.wait(timeout=-1)", lambda: g.rec().wait(timeout=-1), (V,), ["timeout"]),
        Row(
            "wait", "handle.wait(timeout='1')", lambda: g.rec().wait(timeout="1"), (T,), ["timeout"]
        ),
        Row("wait", "set_watchdog(after_seconds=0)", lambda: g.set_watchdog(0), (V,), ["after_s"]),
        Row(
            "wait",
            "foreach_worker(timeout_seconds=-1)",
            lambda: g.foreach_worker(lambda w: 1, timeout_seconds=-1),
            (V,),
            ["timeout_seconds"],
            "calls",
        ),
        # ---- channels -------------------------------------------------------------------
        Row(
            "channel",
            "create_channel(maxsize=-1)",
            lambda: px.create_channel("bi_ch_neg", maxsize=-1),
            (V,),
            ["maxsize"],
        ),
        Row(
            "channel",
            "connect_channel('no_such_channel')",
            lambda: px.connect_channel("bi_no_such_channel"),
            (px.CommError, ValueError),
            ["bi_no_such_channel"],
        ),
        Row(
            "channel",
            "channel.get(timeout=-1)",
            channel(lambda ch: ch.get(timeout=-1)),
            (V,),
            ["timeout"],
        ),
        Row(
            "channel",
            "channel.put(weight='heavy')",
            channel(lambda ch: ch.put(1, weight="x")),
            (T, V),
            ["weight"],
        ),
        Row("channel", "put after close", closed_put, (px.CommError, RuntimeError), ["closed"]),
        # ---- send / recv (called in a worker) -----------------------------------------
        Row(
            "p2p",
            "send(obj, group, rank=-1)",
            _remote(fx, "send", 1, g.name, -1),
            "ValueError",
            ["rank"],
        ),
        Row(
            "p2p",
            "send to a group that does not exist",
            _remote(fx, "send", 1, "bi_no_such_group", 0),
            "PeerNotFoundError",
            ["bi_no_such_group"],
        ),
        Row(
            "p2p",
            "send(obj, dst_group_name=3)",
            _remote(fx, "send", 1, 3, 0),
            "TypeError",
            ["dst_group_name"],
        ),
        Row(
            "p2p",
            "recv(timeout=-1)",
            _remote(fx, "recv", g.name, 1, False, None, -1),
            "ValueError",
            ["timeout"],
        ),
        Row(
            "p2p",
            "recv_tensor(not a tensor)",
            _remote(fx, "recv_tensor", [1], g.name, 1),
            "TypeError",
            ["tensor"],
        ),
        Row(
            "p2p",
            "recv_tensor(non-contiguous)",
            _remote(fx, "recv_tensor", torch.zeros(4, 4).t(), g.name, 1),
            "ValueError",
            ["contiguous"],
        ),
        Row(
            "p2p",
            "send_tensor(not a tensor)",
            _remote(fx, "send_tensor", [1], g.name, 1),
            "TypeError",
            ["tensor"],
        ),
        Row(
            "p2p",
            "broadcast(groups='x')",
            _remote(fx, "broadcast", 1, "x"),
            "TypeError",
            ["groups"],
        ),
        # ---- weights ----------------------------------------------------------------------
        Row(
            "weights",
            "WeightSender(transport='pigeon')",
            lambda: px.WeightSender(h, transport="pigeon"),
            (V,),
            ["transport"],
        ),
        Row(
            "weights", "WeightSender(object())", lambda: px.WeightSender(object()), (T,), ["group"]
        ),
        Row(
            "weights",
            "WeightSender(bucket_size_mb=0)",
            lambda: px.WeightSender(h, bucket_size_mb=0),
            (V,),
            ["bucket_size_mb"],
        ),
        Row(
            "weights",
            "WeightSender(dtype='bf16')",
            lambda: px.WeightSender(h, dtype="bf16"),
            (T,),
            ["dtype"],
        ),
        Row("weights", "WeightSender(model=3)", lambda: px.WeightSender(h, 3), (T,), ["model"]),
        Row(
            "weights",
            "send(state dict lacking 'bias')",
            sender_send(missing),
            (px.WeightMismatchError,),
            ["bias"],
        ),
        Row("weights", "send(NaN weights)", sender_send(nan), (V,), ["weight"]),
        # ---- env runners -------------------------------------------------------------------
        Row(
            "envs",
            "EnvRunnerGroupConfig(rollout_fragment_length=0)",
            erg("bi_erg_rfl", env="CartPole-v1", rollout_fragment_length=0),
            (V,),
            ["rollout_fragment_length"],
            "runners:bi_erg_rfl",
        ),
        Row(
            "envs",
            "EnvRunnerGroupConfig(env=3)",
            erg("bi_erg_env", env=3),
            (T,),
            ["env"],
            "runners:bi_erg_env",
        ),
        Row(
            "envs",
            "EnvRunnerGroupConfig(num_envs_per_env_runner=0)",
            erg("bi_erg_nenv", env="CartPole-v1", num_envs_per_env_runner=0),
            (V,),
            ["num_envs_per_env_runner"],
            "runners:bi_erg_nenv",
        ),
        Row(
            "envs",
            "num_env_runners=-1",
            erg("bi_erg_n", env="CartPole-v1", num_env_runners=-1),
            (V,),
            ["num_env_runners"],
            "runners:bi_erg_n",
        ),
        Row(
            "envs",
            "env='NoSuchEnv-v0'",
            erg("bi_erg_id", env="NoSuchEnv-v0"),
            (Exception,),
            ["NoSuchEnv"],
            "runners:bi_erg_id",
        ),
        Row(
            "envs",
            "EnvRunnerGroupConfig(sample_timeout_s=0)",
            erg("bi_erg_st", env="CartPole-v1", sample_timeout_s=0),
            (V,),
            ["sample_timeout_s"],
            "runners:bi_erg_st",
        ),
        # ---- algorithms' configs and command lines ------------------------------------------
        Row(
            "cli",
            "phalanx train ppo --num-env-runners -1",
            _cli("phalanx.algorithms.ppo", ["--num-env-runners", "-1"]),
            "exit",
            ["num_env_runners"],
        ),
        Row(
            "cli",
            "phalanx train ppo --no-such-flag",
            _cli("phalanx.algorithms.ppo", ["--no-such-flag"]),
            "exit",
            ["--no-such-flag"],
        ),
        Row(
            "cli",
            "phalanx train ppo --lr -1",
            _cli("phalanx.algorithms.ppo", ["--lr", "-1"]),
            "exit",
            ["lr"],
        ),
        Row(
            "cli",
            "phalanx train grpo --samples-per-prompt 1",
            _cli("phalanx.algorithms.grpo", ["--model", "tiny", "--samples-per-prompt", "1"]),
            "exit",
            ["samples_per_prompt"],
        ),
        Row(
            "cli",
            "phalanx train grpo --steps 0",
            _cli("phalanx.algorithms.grpo", ["--model", "tiny", "--steps", "0"]),
            "exit",
            ["steps"],
        ),
        Row(
            "cli",
            "PPOConfig.from_dict({'lr_x': 1})",
            lambda: px.PPOConfig.from_dict({"lr_x": 1}),
            (V,),
            ["lr_x"],
        ),
        Row(
            "cli",
            "PPOConfig(gamma=1.5).validate()",
            lambda: px.PPOConfig(gamma=1.5).validate(),
            (V,),
            ["gamma"],
        ),
        # ---- policy config ------------------------------------------------------------------
        Row(
            "policy",
            "policy config: unknown key",
            lambda: check_policy_config({**policy_base, "bogus_key": 1}),
            (ConfigError,),
            ["bogus_key"],
        ),
        Row(
            "policy",
            "policy config: megatron_cfg.enabled",
            lambda: check_policy_config({**policy_base, "megatron_cfg": {"enabled": True}}),
            (ConfigError,),
            ["megatron_cfg"],
        ),
        Row(
            "policy",
            "policy config: dtensor_cfg=3",
            lambda: check_policy_config({**policy_base, "dtensor_cfg": 3}),
            (ConfigError,),
            ["dtensor_cfg"],
        ),
        Row("policy", "Policy(config=[])", lambda: px.Policy(c, [], None), (T,), ["config"]),
        Row(
            "policy",
            "Policy: model path missing",
            lambda: px.Policy(c, dict(policy_base), None),
            (ConfigError,),
            ["model_name"],
        ),
        # ---- BatchedDataDict ---------------------------------------------------------------
        Row(
            "data",
            "keys of different batch sizes",
            lambda: px.BatchedDataDict({"a": torch.zeros(3), "b": torch.zeros(4)}).size,
            (V,),
            ["batch size"],
        ),
        Row("data", "chunk(rank=2, chunks=2)", bdd(lambda d: d.chunk(2, 2)), (V,), ["rank"]),
        Row("data", "chunk(0, chunks=4) of 6", bdd(lambda d: d.chunk(0, 4)), (V,), ["chunks"]),
        Row("data", "slice(4, 2)", bdd(lambda d: d.slice(4, 2)), (V,), ["end"]),
        Row(
            "data",
            "select_indices([9])",
            bdd(lambda d: d.select_indices([9])),
            (IndexError,),
            ["indices"],
        ),
        Row(
            "data",
            "shard_by_batch_size(4) of 6",
            bdd(lambda d: d.shard_by_batch_size(4)),
            (V,),
            ["shards"],
        ),
        Row(
            "data",
            "make_microbatch_iterator(4) of 6",
            bdd(lambda d: list(d.make_microbatch_iterator(4))),
            (V,),
            ["microbatch_size"],
        ),
        Row(
            "data",
            "from_batches([1])",
            lambda: px.BatchedDataDict.from_batches([1]),
            (T,),
            ["batches"],
        ),
        Row(
            "data",
            "repeat_interleave(0)",
            bdd(lambda d: d.repeat_interleave(0)),
            (V,),
            ["num_repeats"],
        ),
    ]


# --------------------------------------------------------------------------- checking


def check(fx: Fixture, row: Row) -> tuple[bool, str]:
    before = None
    if row.before == "calls":
        before = _calls(fx)
    try:
        row.call()
    except SystemExit as e:
        err: BaseException = e
    except Exception as e:  # noqa: BLE001 - the point of the row
        err = e
    else:
        return False, "no exception"
    text = str(err)
    if isinstance(row.expected, str) and row.expected != "exit":
        type_ok = isinstance(err, RemoteError) and err.type_name == row.expected
        got = err.type_name if isinstance(err, RemoteError) else type(err).__name__
    elif row.expected == "exit":
        type_ok = isinstance(err, SystemExit)
        got = "exit!=0" if type_ok else type(err).__name__
    else:
        type_ok = isinstance(err, row.expected)
        got = type(err).__name__
    named = all(n in text for n in row.names)
    early = True
    if row.before == "calls":
        early = _calls(fx) == before
    elif row.before.startswith(("actors:", "runners:")):
        early = _actors(row.before.split(":", 1)[1]) == []
    ok = type_ok and named and early
    problems = []
    if not type_ok:
        problems.append(f"type {got}")
    if not named:
        problems.append(f"message lacks {[n for n in row.names if n not in text]}")
    if not early:
        problems.append("remote work started")
    first = text.strip().splitlines()[0] if text.strip() else ""
    detail = f"{got}: {first[:90]}"
    return ok, detail + ("" if ok else "  <-- " + "; ".join(problems))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated areas")
    args = parser.parse_args()
    os.environ.setdefault("PHALANX_RUNS_DIR", tempfile.mkdtemp(prefix="px_bad_inputs_"))
    cluster = px.Cluster(num_cpus=16, log_to_driver=False)
    group = Recorder.create_group().launch(
        cluster,
        px.NodePlacement(num_workers=4),
        name="bi_rec",
        sharding=px.NamedSharding([[0, 1], [2, 3]], ["dp", "tp"]),
    )
    holder = Holder.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="bi_h")
    fx = Fixture(cluster, group, holder)
    chosen = [r for r in rows(fx) if not args.only or r.area in args.only.split(",")]
    clear = 0
    for row in chosen:
        ok, detail = check(fx, row)
        clear += ok
        where = {"calls": "no call", "": "-"}.get(row.before, "no actor")
        print(
            f"{row.area:<9} {row.what:<48} {'clear' if ok else 'NOT':<6} {where:<9} {detail}",
            flush=True,
        )
    print(f"bad inputs tried {len(chosen)} / clear {clear}")
    group.shutdown()
    holder.shutdown()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
