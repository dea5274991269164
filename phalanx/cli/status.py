"""``phalanx status``: the live phalanx groups on a Ray cluster, without disturbing them.

How it looks without Ray's dashboard (the embedded Ray starts without it, and Ray's
state API needs it): phalanx names every worker actor ``<group>:<rank>`` in the
``phalanx`` namespace, so ``ray.util.list_named_actors(all_namespaces=True)`` finds the
groups; each worker answers ``_px_status`` from its control concurrency group, which runs
even while a long method is busy (the answer names that method and since when). Restarts
come from the GCS actor table (``ray._private.state``, no dashboard needed): phalanx
restarts a worker by creating a new actor under the same name, so every dead actor of
that name in the same job is one restart.

Health: ``healthy`` (answered), ``unresponsive`` (alive for Ray but no answer within the
timeout, e.g. stuck in C code holding the GIL), ``dead``/``restarting`` (Ray's state),
``missing`` (a rank of the group has no live actor).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from phalanx._base.checks import check_number

NAMESPACE = "phalanx"
BAD_INPUT = 1  # exit status: no cluster at the address, a bad flag
RUNTIME_FAILURE = 4  # exit status: the cluster is there but refused this client
TOKEN_HELP = (
    "pass the cluster's token with RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<token>, "
    "RAY_AUTH_TOKEN_PATH=<file> or the file ~/.ray/auth_token"
)


@dataclass
class WorkerStatus:
    """One worker of a group as seen now."""

    rank: int
    health: str
    node_ip: str = ""
    node_id: str = ""
    pid: int | None = None
    restarts: int = 0
    current_call: str | None = None
    call_seconds: float | None = None
    uptime_s: float | None = None
    worker_class: str = ""


@dataclass
class GroupStatus:
    """A phalanx group: its name, size and workers."""

    name: str
    world_size: int
    workers: list[WorkerStatus] = field(default_factory=list)

    @property
    def num_healthy(self) -> int:
        return sum(1 for w in self.workers if w.health == "healthy")

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self.workers)


def _check_positive(value: Any, arg: str) -> float:
    value = check_number(value, arg)
    if value <= 0:
        raise ValueError(f"{arg} must be > 0, got {value:g}")
    return value


def _split(name: str) -> tuple[str, int] | None:
    group, sep, rank = name.rpartition(":")
    if not sep or not group or not rank.isdigit():
        return None
    return group, int(rank)


def _actor_table() -> dict[str, list[dict[str, Any]]]:
    """Actor-table entries (all states) by actor name, from the GCS."""
    try:
        from ray._private import state

        table = state.actors()
    except Exception:  # noqa: BLE001 - private API: restarts are then unknown
        return {}
    by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for info in table.values():
        if info.get("Name"):
            by_name[info["Name"]].append(info)
    return by_name


def collect_status(timeout_s: float = 5.0, group: str | None = None) -> list[GroupStatus]:
    """Status of every live phalanx group (or only ``group``) on the connected Ray cluster."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    _check_positive(timeout_s, "timeout_s")
    if not ray.is_initialized():
        raise RuntimeError("not connected to Ray: call ray.init(address=...) or px.Cluster() first")
    named = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == NAMESPACE
    ]
    members: dict[str, dict[int, str]] = defaultdict(dict)
    for name in named:
        parsed = _split(name)
        if parsed is None or (group is not None and parsed[0] != group):
            continue
        members[parsed[0]][parsed[1]] = name
    table = _actor_table()
    asks: dict[tuple[str, int], Any] = {}
    for gname, ranks in members.items():
        for rank, name in ranks.items():
            try:
                actor = ray.get_actor(name, namespace=NAMESPACE)
                asks[(gname, rank)] = actor._px_status.remote()
            except Exception:  # noqa: BLE001 - gone between listing and asking
                asks[(gname, rank)] = None
    deadline = time.monotonic() + timeout_s
    answers: dict[tuple[str, int], Any] = {}
    for key, ref in asks.items():
        if ref is None:
            answers[key] = "dead"
            continue
        try:
            answers[key] = ray.get(ref, timeout=max(0.01, deadline - time.monotonic()))
        except GetTimeoutError:
            answers[key] = "unresponsive"
        except RayActorError:
            answers[key] = "dead"
        except Exception:  # noqa: BLE001 - e.g. an actor that is not a phalanx host
            answers[key] = "unknown"
    now = time.time()
    groups = []
    for gname in sorted(members):
        ranks = members[gname]
        workers = []
        world = 0
        for rank in sorted(ranks):
            answer = answers.get((gname, rank))
            entries = table.get(ranks[rank], [])
            alive = [e for e in entries if e.get("State") != "DEAD"]
            current = alive[-1] if alive else (entries[-1] if entries else {})
            job = current.get("JobID")
            restarts = sum(1 for e in entries if e.get("State") == "DEAD" and e.get("JobID") == job)
            restarts += int(current.get("NumRestarts") or 0)
            w = WorkerStatus(rank=rank, health="", restarts=restarts)
            address = current.get("Address") or {}
            w.node_ip = address.get("IPAddress", "")
            w.node_id = address.get("NodeID", "")
            w.pid = current.get("Pid") or None
            w.worker_class = str(current.get("ActorClassName", "")).removeprefix("Host_")
            if isinstance(answer, dict):
                w.health = "healthy"
                world = max(world, int(answer["world_size"]))
                w.pid = answer["pid"]
                w.node_ip = answer["node_ip"] or w.node_ip
                w.node_id = answer["node_id"] or w.node_id
                w.worker_class = answer["class"]
                w.uptime_s = now - answer["started_at"]
                if answer["current"] is not None:
                    w.current_call = answer["current"]["method"]
                    w.call_seconds = max(0.0, now - answer["current"]["since"])
            else:
                state = current.get("State", "")
                if answer == "dead" or state == "DEAD":
                    w.health = "dead"
                elif state in ("RESTARTING", "PENDING_CREATION", "DEPENDENCIES_UNREADY"):
                    w.health = "restarting"
                else:
                    w.health = str(answer)
            workers.append(w)
        world = max(world, max(ranks) + 1)
        for rank in range(world):
            if rank not in ranks:
                workers.append(WorkerStatus(rank=rank, health="missing"))
        workers.sort(key=lambda w: w.rank)
        groups.append(GroupStatus(name=gname, world_size=world, workers=workers))
    return groups


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


_HEALTH_STYLE = {
    "healthy": "green",
    "unresponsive": "yellow",
    "restarting": "yellow",
    "dead": "red",
    "missing": "red",
}


def render(groups: list[GroupStatus], console: Any = None) -> None:
    """Print one rich table per group."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if not groups:
        console.print("no live phalanx groups on this Ray cluster")
        return
    for g in groups:
        table = Table(
            title=f"group [bold]{g.name}[/]: {g.num_healthy}/{g.world_size} healthy, "
            f"{g.restarts} restart(s)",
            title_justify="left",
        )
        for col in ("rank", "health", "node", "pid", "restarts", "current call", "up", "class"):
            # names wrap onto more lines rather than being cut at the terminal's width
            table.add_column(
                col,
                justify="right" if col in ("rank", "pid", "restarts") else "left",
                overflow="fold",
            )
        for w in g.workers:
            call = ""
            if w.current_call:
                call = f"{w.current_call} ({_duration(w.call_seconds)})"
            elif w.health == "healthy":
                call = "[dim]idle[/]"
            style = _HEALTH_STYLE.get(w.health, "yellow")
            node = w.node_ip + (f" {w.node_id[:8]}" if w.node_id else "")
            table.add_row(
                str(w.rank),
                f"[{style}]{w.health}[/]",
                node,
                "" if w.pid is None else str(w.pid),
                str(w.restarts),
                call,
                _duration(w.uptime_s),
                w.worker_class.rsplit(".", 1)[-1],
            )
        console.print(table)


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster address (default: $RAY_ADDRESS, else 'auto': the latest local cluster)",
    )
    parser.add_argument("--group", default=None, help="show only this group")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for workers")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _resolve(address: str) -> tuple[str | None, str | None]:
    """(``host:port`` of the GCS, None) for ``address``, or (None, why there is none);
    (None, None) for a Ray client or jobs address, which ``ray.init`` handles itself."""
    if address.startswith(("ray://", "http://", "https://")):
        return None, None
    try:
        from ray._private.services import canonicalize_bootstrap_address

        resolved = canonicalize_bootstrap_address(address)
    except Exception as e:  # noqa: BLE001 - e.g. "auto" with no local cluster
        return None, str(e).splitlines()[0] if str(e) else type(e).__name__
    if not resolved:
        return None, "no running cluster found"
    return resolved, None


def _unreachable(resolved: str, timeout_s: float = 3.0) -> str | None:
    """Why nothing listens at ``resolved`` (``host:port``), or None.
    ``ray.init`` would retry for minutes."""
    import socket

    host, _, port = resolved.rpartition(":")
    if not port.isdigit():
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError as e:
        return f"cannot connect to {resolved}: {e.strerror or e}"


def _token_source() -> str | None:
    """Where Ray takes this client's token from (Ray's order), or None when it sends none."""
    from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode

    if get_authentication_mode() != AuthenticationMode.TOKEN:
        return None
    if not AuthenticationTokenLoader.instance().has_token():
        return None
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"RAY_AUTH_TOKEN_PATH ({os.environ['RAY_AUTH_TOKEN_PATH']})"
    return "~/.ray/auth_token"


def _auth_failure(resolved: str, timeout_s: float = 5.0) -> str | None:
    """Why the GCS at ``resolved`` refuses this client's token, or None (accepted, no
    authentication, or another problem that ``ray.init`` reports). One RPC over Ray's own
    channel, with the headers Ray would send: ``ray.init`` retries a refused token for a
    minute and logs every try."""
    import grpc
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    from ray.exceptions import AuthenticationError

    channel = init_grpc_channel(resolved)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
    except AuthenticationError:  # raised here, before sending, by Ray's token loader
        return "RAY_AUTH_MODE is 'token' but this client has no token"
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAUTHENTICATED:
            return None
        source = _token_source()
        if source is None:
            return "the cluster requires a token and this client sent none"
        return f"the cluster rejected the token from {source}"
    finally:
        channel.close()
    return None


def _preflight(address: str) -> tuple[int, str] | None:
    """(exit status, one-line message) when this client cannot use a cluster at
    ``address``, else None; fast where ``ray.init`` would retry for a minute."""
    if address == "auto":
        # as ray.init does for a local cluster found automatically: use a token if one exists
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    resolved, problem = _resolve(address)
    problem = problem or (resolved and _unreachable(resolved))
    if problem:
        return BAD_INPUT, f"no Ray cluster at {address!r} ({problem})"
    refused = resolved and _auth_failure(resolved)
    if refused:
        return RUNTIME_FAILURE, f"authentication failed at {address!r}: {refused}; {TOKEN_HELP}"
    return None


def run(args: argparse.Namespace) -> int:
    """``phalanx status``: print the live groups; returns the exit status."""
    import ray
    from ray.exceptions import AuthenticationError

    try:
        _check_positive(args.timeout, "--timeout")
    except ValueError as e:
        print(f"phalanx status: {e}", file=sys.stderr)
        return BAD_INPUT
    connected_here = False
    if not ray.is_initialized():
        address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
        failure = _preflight(address)
        if failure:
            print(f"phalanx status: {failure[1]}")
            return failure[0]
        try:
            context = ray.init(
                address=address,
                namespace=NAMESPACE,
                log_to_driver=False,
                logging_level="ERROR",
                configure_logging=False,
            )
        except AuthenticationError as e:
            print(
                f"phalanx status: authentication failed at {address!r}: {e.message}; {TOKEN_HELP}"
            )
            return RUNTIME_FAILURE
        except (ConnectionError, RuntimeError, ValueError) as e:
            print(f"phalanx status: no Ray cluster at {address!r} ({e})")
            return BAD_INPUT
        connected_here = True
        info = context.address_info
        session = os.path.basename(str(info.get("session_dir", ""))) or "unknown session"
        # stderr: --json output on stdout stays one JSON document
        print(
            f"phalanx status: cluster at {info.get('gcs_address') or address} ({session})",
            file=sys.stderr,
        )
    try:
        groups = collect_status(timeout_s=args.timeout, group=args.group)
    finally:
        if connected_here:
            ray.shutdown()  # disconnects this driver only; the cluster keeps running
    if args.json:
        out = [
            {"name": g.name, "world_size": g.world_size, "workers": [asdict(w) for w in g.workers]}
            for g in groups
        ]
        print(json.dumps(out, indent=2))
    else:
        render(groups)
    return 0
