"""``inferfleet status``: what a queue and its fleet look like right now.

:func:`gather` reads everything with a few pipelined commands into a
:class:`QueueStatus`; :func:`render` turns it into rich tables. Queues are
found with SCAN when no name is given (on every master of a Redis Cluster);
each shard of a sharded queue (``NAME.s``) is a queue of its own here, and
so is each stage of a pipelined model (:func:`with_stages`): its stream,
lag, workers and rates. A candidate version (``inferfleet shadow``) gets a
table of its own (model, version, state, sample and canary share, how many
workers have it loaded) and each worker's ``candidate`` column says how that
worker has it (``VERSION loaded``, ``loading``, ``failed``: why, ``off``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import redis
from rich.console import Group
from rich.markup import escape
from rich.table import Table

from inferfleet.producer.protocol import GROUP, QueueKeys, workers_group
from inferfleet.producer.sharing import LaneState, read_lanes
from inferfleet.worker.cli.sharing import read_limits
from inferfleet.worker.connections import server_name, too_old
from inferfleet.worker.heartbeat import HeartbeatInfo, read_heartbeats
from inferfleet.worker.keys import MAX_STAGES, StageKeys, stage_keys, supervisor_key
from inferfleet.worker.serving.rollout import read_candidate

__all__ = [
    "QueueStatus",
    "candidate_status",
    "gather",
    "render",
    "find_queues",
    "server_line",
    "with_stages",
]


@dataclass
class QueueStatus:
    """One queue's state: the stream, its group, its consumers and workers."""

    name: str
    length: int = 0
    lag: int | None = None
    pending: int = 0
    dead: int = 0
    consumers: list[dict[str, Any]] = field(default_factory=list)
    workers: list[HeartbeatInfo] = field(default_factory=list)
    supervisor: dict[str, str] = field(default_factory=dict)
    lanes: list[LaneState] = field(default_factory=list)  # high, normal, low
    # read_limits(): limits in force, per-tenant counts
    limits: dict[str, Any] = field(default_factory=dict)
    # the last candidate published (candidate_status()); None: never one
    candidate: dict[str, Any] | None = None


def candidate_status(
    client: redis.Redis, keys: QueueKeys, workers: list[HeartbeatInfo]
) -> dict[str, Any] | None:
    """The queue's candidate (``inferfleet shadow``) and how many of ``workers`` have it loaded or
    failed it."""
    cand = read_candidate(client, keys)
    if cand is None:
        return None
    states = [w.shadow for w in workers]
    return {
        "model": cand.model,
        "version": cand.version,
        "state": cand.state,
        "sample": cand.sample,
        "canary_percent": cand.canary,
        "reason": cand.reason,
        "loaded": states.count(f"{cand.version} loaded"),
        "failed": states.count(f"{cand.version} failed"),
        "workers": len(workers),
    }


def find_queues(client: redis.Redis, prefix: str) -> list[str]:
    """Names of every queue with a request stream under ``prefix``."""
    names = set()
    for key in client.scan_iter(match=f"{prefix}:{{*}}:requests", count=1000):
        text = key.decode()
        names.add(text[text.index("{") + 1 : text.rindex("}")])
    return sorted(names)


def with_stages(client: redis.Redis, keys: QueueKeys) -> list[QueueKeys]:
    """The queue's keys, then those of each pipeline stage 1, 2 ... whose stream exists."""
    found = [keys]
    while len(found) < MAX_STAGES and client.exists(stage_keys(keys, len(found)).requests):
        found.append(stage_keys(keys, len(found)))
    return found


def gather(client: redis.Redis, keys: QueueKeys) -> QueueStatus:
    """Read a queue's status (an empty status if the queue does not exist yet); a stage's, for
    StageKeys."""
    status = QueueStatus(
        f"{keys.name} stage {keys.stage}" if isinstance(keys, StageKeys) else keys.name
    )
    pipe = client.pipeline(transaction=False)
    pipe.xlen(keys.requests)
    pipe.xlen(keys.dead)
    pipe.hgetall(supervisor_key(keys))
    status.length, status.dead, sup = pipe.execute()
    status.supervisor = {k.decode(): v.decode() for k, v in sup.items()}
    if status.length or client.exists(keys.requests):
        try:
            groups = client.xinfo_groups(keys.requests)
            group = workers_group(groups)
            if group is not None:
                status.pending = group.pending
                status.lag = group.lag
                status.consumers = [
                    _consumer(c) for c in client.xinfo_consumers(keys.requests, GROUP)
                ]
            else:
                status.lag = status.length
        except redis.exceptions.ResponseError:
            pass
    status.workers = read_heartbeats(client, keys)
    try:
        status.lanes = read_lanes(client, keys)
    except redis.exceptions.ResponseError:  # a lane without its group yet
        status.lanes = []
    status.limits = read_limits(client, keys)
    status.candidate = candidate_status(client, keys, status.workers)
    return status


def _candidate_table(cand: dict[str, Any]) -> Table:
    """The candidate: what it is, its shares, how many workers have it loaded."""
    table = Table(title="candidate", show_header=True, title_justify="left")
    for column in ("model", "version", "state", "sample", "canary", "loaded", "failed"):
        table.add_column(
            column, justify="left" if column in ("model", "version", "state") else "right"
        )
    state = cand["state"] + (f" ({escape(cand['reason'])})" if cand["reason"] else "")
    table.add_row(
        cand["model"],
        cand["version"],
        state,
        f"{cand['sample']:g}",
        f"{cand['canary_percent']:g}%",
        f"{cand['loaded']} of {cand['workers']}",
        str(cand["failed"]),
    )
    return table


def _sharing_tables(status: QueueStatus) -> list[Table]:
    """The lanes (backlog, wait), the limits in force and the per-tenant counts."""
    lanes = Table(title="lanes", show_header=True, title_justify="left")
    for column in ("lane", "length", "waiting", "pending", "oldest wait"):
        lanes.add_column(column, justify="left" if column == "lane" else "right")
    for lane in status.lanes:
        lanes.add_row(
            lane.name,
            str(lane.length),
            "unknown" if lane.lag is None else str(lane.lag),
            str(lane.pending),
            _age(lane.wait_s * 1000),
        )
    limits = status.limits or {}
    quotas = limits.get("tenants", {})
    counts = limits.get("counts", {})
    backlog = limits.get("max_backlog")
    tenants = Table(
        title=f"limits: max_backlog {backlog if backlog else 'none'}",
        show_header=True,
        title_justify="left",
    )
    for column in ("tenant", "rate/s", "burst", "accepted", "refused"):
        tenants.add_column(column, justify="left" if column == "tenant" else "right")
    for name in sorted(set(quotas) | set(counts)):
        quota, count = quotas.get(name, {}), counts.get(name, {})
        tenants.add_row(
            name,
            f"{quota['rate']:g}" if "rate" in quota else "-",
            f"{quota['burst']:g}" if "burst" in quota else "-",
            str(count.get("accepted", 0)),
            str(count.get("refused", 0)),
        )
    return [lanes, tenants]


def _consumer(raw: dict) -> dict[str, Any]:
    name = raw["name"]
    return {
        "name": name.decode() if isinstance(name, bytes) else name,
        "pending": int(raw["pending"]),
        "idle_ms": int(raw["idle"]),
    }


def _age(ms: float) -> str:
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"


def render(status: QueueStatus) -> Group:
    """Tables for one queue, readable at a glance."""
    candidate = [_candidate_table(status.candidate)] if status.candidate else []
    return Group(
        _summary_table(status), *_sharing_tables(status), *candidate, _workers_table(status)
    )


def _summary_table(status: QueueStatus) -> Table:
    """The queue's one row: its stream, lag, pending, dead letters, workers and supervisor."""
    summary = Table(title=f"queue {status.name}", show_header=True, title_justify="left")
    for column in ("stream length", "lag", "pending", "dead letters", "workers", "supervisor"):
        summary.add_column(column, justify="right" if column != "supervisor" else "left")
    sup = status.supervisor
    sup_text = (
        f"{sup.get('live', '?')} live, wants {sup.get('desired', '?')} ({sup.get('policy', '?')})"
        if sup
        else "none"
    )
    if sup.get("disabled"):
        sup_text += f" [red]{sup['disabled']}[/red]"
    summary.add_row(
        str(status.length),
        "unknown" if status.lag is None else str(status.lag),
        str(status.pending),
        str(status.dead),
        str(len(status.workers)),
        sup_text,
    )
    return summary


#: The workers table's columns, and those of them that are text (left-justified).
_WORKER_COLUMNS = [
    "consumer",
    "pid",
    "host",
    "device",
    "version",
    "candidate",
    "state",
    "req/s",
    "busy",
    "requests",
    "cache_hits",
    "pending",
    "idle",
    "seen",
]
_TEXT_COLUMNS = {"consumer", "host", "device", "version", "candidate", "state"}


def _workers_table(status: QueueStatus) -> Table:
    """One row a worker with a heartbeat, then one a group consumer without (gone or foreign)."""
    workers = Table(show_header=True, title="workers", title_justify="left")
    for column in _WORKER_COLUMNS:
        text = column in _TEXT_COLUMNS
        workers.add_column(column.replace("_", " "), justify="left" if text else "right")
    consumers = {c["name"]: c for c in status.consumers}
    now_ms = time.time() * 1000
    for w in sorted(status.workers, key=lambda w: w.consumer):
        c = consumers.pop(w.consumer, {"pending": 0, "idle_ms": 0})
        version = w.version + (
            f" [red](swap failed: {escape(w.swap_error)})[/red]" if w.swap_error else ""
        )
        hits = "off" if w.cache_hit_rate is None else f"{w.cache_hit_rate:.0%}"
        copy = (w.shadow or "-") + (
            f" [red]({escape(w.shadow_error)})[/red]" if w.shadow_error else ""
        )
        workers.add_row(
            *(w.consumer, str(w.pid), w.host, w.device, version, copy, w.state),
            *(f"{w.rate_rps:,.0f}", f"{w.busy:.0%}", f"{w.requests:,}", hits),
            *(str(c["pending"]), _age(c["idle_ms"]), _age(now_ms - w.last_seen_ms) + " ago"),
        )
    for name, c in sorted(consumers.items()):
        workers.add_row(
            f"[yellow]{name}[/yellow]", *["-"] * 5, "no heartbeat", *["-"] * 4,
            str(c["pending"]), _age(c["idle_ms"]), "-",
        )  # fmt: skip
    return workers


def server_line(client: Any) -> str:
    """The server's name and version, and why the fleet cannot run on it if it cannot."""
    try:
        info = client.info("server")
    except redis.exceptions.NoPermissionError:
        return "version hidden by the ACL (INFO refused)"
    if info and all(isinstance(value, dict) for value in info.values()):
        info = next(iter(info.values()))  # a cluster: the first node's
    why = too_old(info)
    return server_name(info) if why is None else f"{server_name(info)}: TOO OLD: {why}"
