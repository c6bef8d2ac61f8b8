"""The supervisor: runs consumer processes for one queue and sizes the fleet from lag.

Process management is kept apart from the decision (as rq's WorkerPool
does): every ``interval_s`` the supervisor observes the stream and the
workers' heartbeats, asks the pure policy (:func:`inferfleet.worker.fleet.scaling.desired_workers`)
how many workers there should be, and only applies the difference:

* a new worker is a *slot* with a consumer name stable across its restarts
  (``NAME-sN-TOKEN``, the token drawn once per supervisor), so a restarted
  worker replays its own pending entries; slots are placed on
  devices round-robin (one process per GPU by default, through
  ``CUDA_VISIBLE_DEVICES``); children use the ``spawn`` start method and
  load their own model copy;
* a worker that dies unexpectedly is restarted with exponential backoff; N
  deaths within M seconds stop that slot, with an error saying why;
* scale-down and shutdown send SIGTERM: the worker finishes its batch,
  replies, acknowledges and leaves the group. A second stop signal kills.

One supervisor manages a queue on a host: it holds a lease in Redis, and
its workers drain and exit if it dies; a supervisor started after a dead
one first drains what that one left running
(:mod:`inferfleet.worker.fleet.succession`).

A queue sharded into S streams (``WorkerSettings.shards``) is one fleet:
slot i serves shard i mod S, the lag observed is the sum over the shards,
and at least S workers run so that every shard has one (none with ``min_workers`` 0).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

import redis

from inferfleet.producer.protocol import shard_keys
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.connections import admin_client
from inferfleet.worker.errors import ConfigError, DeviceBroken, ServerTooOld
from inferfleet.worker.fleet.observe import observe
from inferfleet.worker.fleet.placement import child_visible_devices
from inferfleet.worker.fleet.restarts import restart_backoff
from inferfleet.worker.fleet.scaling import (
    Decision,
    Observation,
    PolicySettings,
    PolicyState,
    desired_workers,
)
from inferfleet.worker.fleet.succession import (
    SupervisorLease,
    incarnation_token,
    pid_alive,
    predecessor_workers,
    prune_consumers,
    slot_consumer,
)
from inferfleet.worker.heartbeat import read_heartbeats
from inferfleet.worker.keys import stage_keys, supervisor_key

if TYPE_CHECKING:
    from inferfleet.worker.metrics import FleetMetrics

__all__ = ["SupervisorSettings", "Supervisor", "observe"]

log = logging.getLogger(__name__)

#: A child's entry point: (worker settings, CUDA_VISIBLE_DEVICES value or None).
ChildTarget = Callable[[WorkerSettings, "str | None"], None]


@dataclass(frozen=True)
class SupervisorSettings:
    """How the supervisor runs its fleet. The worker template's consumer name is replaced per slot.

    A field with a CLI option (``inferfleet supervise``) holds its help in its metadata.
    """

    worker: WorkerSettings
    policy: PolicySettings
    # the CLI's --devices is a spec (auto, cpu, cuda:0,...) resolved by resolve_devices
    devices: tuple[str, ...] = ("cpu",)
    workers_per_device: int = field(default=1, metadata={"help": "Workers per GPU."})
    interval_s: float = field(
        default=1.0, metadata={"help": "How often the supervisor observes and decides."}
    )
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 30.0
    crash_loop_deaths: int = field(
        default=5, metadata={"help": "Stop restarting a slot after this many deaths..."}
    )
    crash_loop_window_s: float = field(
        default=60.0, metadata={"help": "...within this many seconds."}
    )
    drain_timeout_s: float = field(
        default=60.0, metadata={"help": "Kill workers still draining after this."}
    )

    def __post_init__(self) -> None:
        if not self.devices:
            raise ConfigError("devices is empty: use auto, cpu or cuda:N[,cuda:M...]")
        for name, low in (
            ("workers_per_device", 1),
            ("interval_s", 0.05),
            ("restart_backoff_s", 0.0),
            ("crash_loop_deaths", 1),
            ("crash_loop_window_s", 0.1),
            ("drain_timeout_s", 0.1),
        ):
            if getattr(self, name) < low:
                raise ConfigError(f"{name} must be at least {low}, got {getattr(self, name)}")
        if 0 < self.policy.min_workers < self.worker.shards:
            raise ConfigError(
                f"min_workers {self.policy.min_workers} is fewer than the {self.worker.shards} "
                f"shards: every shard needs a worker"
            )
        gpus = [d for d in self.devices if d != "cpu"]
        if gpus and self.policy.max_workers > len(gpus) * self.workers_per_device:
            raise ConfigError(
                f"max_workers {self.policy.max_workers} is more than {len(gpus)} GPUs x "
                f"{self.workers_per_device} workers per device"
            )


@dataclass
class Slot:
    """One place for a worker process; keeps its consumer name across restarts."""

    index: int
    consumer: str
    device: str
    shard: int = 0
    process: BaseProcess | None = None
    wanted: bool = False
    draining: bool = False
    deaths: deque = field(default_factory=deque)
    next_start_s: float = 0.0
    disabled: str | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()


class Supervisor:
    """Runs and sizes the worker processes of one queue until stopped."""

    def __init__(
        self,
        settings: SupervisorSettings,
        child_target: ChildTarget,
        client: redis.Redis | None = None,
        metrics: FleetMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics  # the host's /metrics endpoint, started before the first child
        self.child_target = child_target
        worker = settings.worker
        self.shard_keys = tuple(
            stage_keys(keys, worker.stage or 0)  # --stage K: that stage's stream
            for keys in shard_keys(worker.name, worker.shards, worker.prefix)
        )
        self.keys = self.shard_keys[0]
        #: What each GPU slot's child gets as CUDA_VISIBLE_DEVICES (ConfigError if one is not
        #: visible).
        self.visible = child_visible_devices(
            settings.devices, os.environ.get("CUDA_VISIBLE_DEVICES")
        )
        self.redis = client or admin_client(worker.redis_url, worker.cluster)
        self.context = multiprocessing.get_context("spawn")
        self.slots: list[Slot] = []
        self.state = PolicyState()
        self.last_decision: Decision | None = None
        self.kill_now = threading.Event()
        self.token = incarnation_token()  # in every slot's consumer name: unique per incarnation
        self.lease = SupervisorLease(
            self.redis, self.keys, self.token, ttl_s=max(5 * settings.interval_s, 5.0)
        )
        self._next_prune_s = 0.0

    # -- the loop ----------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Supervise until ``stop`` is set, then drain every worker."""
        log.info(
            "supervising %s (%d shards): %d-%d workers on %s, policy %s",
            self.keys.requests,
            len(self.shard_keys),
            self.settings.policy.min_workers,
            self.settings.policy.max_workers,
            ",".join(self.settings.devices),
            self.settings.policy.kind,
        )
        self.take_over(stop)
        while not stop.is_set():
            self.tick(time.monotonic())
            if not self._renew_lease():
                break
            stop.wait(self.settings.interval_s)
        self.shutdown()

    def take_over(self, stop: threading.Event) -> None:
        """Take the queue's lease on this host (:class:`LeaseHeld` if a live supervisor has it),
        then drain what a dead predecessor left running here before starting anything."""
        while True:
            try:
                self.lease.acquire()
                break
            except redis.exceptions.RedisError as exc:
                log.warning("cannot take the supervisor lease (%s): retrying", exc)
                if stop.wait(self.settings.interval_s):
                    return
        try:
            beats = [b for keys in self.shard_keys for b in read_heartbeats(self.redis, keys)]
        except redis.exceptions.RedisError as exc:
            log.warning("cannot read heartbeats for a predecessor's workers (%s)", exc)
            return
        self._drain_predecessors(beats)

    def _drain_predecessors(self, beats: list) -> None:
        left = [
            p
            for p in predecessor_workers(
                beats, self.settings.worker.name, self.lease.host, self.token
            )
            if pid_alive(p.pid)
        ]
        if not left:
            return
        log.warning(
            "a previous supervisor left %d workers running (%s): draining them first",
            len(left),
            ", ".join(f"{p.consumer} pid {p.pid}" for p in left),
        )
        for orphan in left:
            os.kill(orphan.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while any(pid_alive(p.pid) for p in left) and time.monotonic() < deadline:
            time.sleep(0.05)
        for orphan in left:
            if pid_alive(orphan.pid):
                log.warning(
                    "killing %s (pid %s): it did not drain in time", orphan.consumer, orphan.pid
                )
                os.kill(orphan.pid, signal.SIGKILL)

    def _renew_lease(self) -> bool:
        try:
            if self.lease.renew():
                return True
        except redis.exceptions.RedisError as exc:
            log.warning("cannot renew the supervisor lease (%s): holding the fleet as it is", exc)
            return True
        log.error(
            "another supervisor holds the lease of %s now: stopping this one", self.keys.requests
        )
        return False

    def tick(self, now_s: float) -> None:
        """One step: reap dead children, decide the fleet size, start what is due."""
        self._reap(now_s)
        obs: Observation | None = None
        try:
            obs = observe(self.redis, self.shard_keys, self.live_workers(), now_s)
        except redis.exceptions.RedisError as exc:
            log.warning(
                "cannot observe %s (%s): holding the fleet as it is", self.keys.requests, exc
            )
        else:
            self._decide(obs)
        self._start_due(now_s)
        self._publish(now_s)
        if now_s >= self._next_prune_s:
            self._next_prune_s = now_s + 30.0
            self._prune()
        if self.metrics is not None:
            self.metrics.observed(
                sum(1 for s in self.slots if s.alive),
                obs.lag if obs else None,
                obs.pending if obs else None,
                self.last_decision.workers if self.last_decision else None,
            )

    def _prune(self) -> None:
        """Delete the group's consumers that dead workers left, holding nothing (best effort)."""
        try:
            for keys in self.shard_keys:
                live = {b.consumer for b in read_heartbeats(self.redis, keys)}
                live |= {s.consumer for s in self.slots}
                gone = prune_consumers(self.redis, keys, self.settings.worker.name, live, 60_000)
                if gone:
                    log.info(
                        "deleted %d consumers of dead workers from %s: %s",
                        len(gone),
                        keys.requests,
                        ", ".join(gone),
                    )
        except redis.exceptions.RedisError as exc:
            log.warning("cannot prune the consumers of dead workers (%s)", exc)

    def live_workers(self) -> int:
        """Slots that should run and are running or about to be (re)started."""
        return sum(1 for s in self.slots if s.wanted and not s.disabled)

    # -- deciding ----------------------------------------------------------

    def _decide(self, obs: Observation) -> None:
        decision = desired_workers(obs, self.settings.policy, self.state)
        self.state = decision.state
        current = obs.workers
        if 0 < decision.workers < self.settings.worker.shards:  # up from zero: every shard one
            decision = replace(decision, workers=self.settings.worker.shards)
        if decision.workers > current:
            log.info("scaling up %d -> %d: %s", current, decision.workers, decision.reason)
            self._want(decision.workers - current)
        elif decision.workers < current:
            log.info("scaling down %d -> %d: %s", current, decision.workers, decision.reason)
            self._unwant(current - decision.workers)
        self.last_decision = decision

    def _want(self, count: int) -> None:
        for _ in range(count):
            slot = next(
                (s for s in self.slots if not s.wanted and not s.alive and not s.disabled), None
            )
            if slot is None and any(s.disabled for s in self.slots):
                return  # a crash loop: more copies of the same failure would not help
            if slot is None:
                index = len(self.slots)
                slot = Slot(
                    index,
                    slot_consumer(self.settings.worker.name, index, self.token),
                    self._device_for(index),
                    shard=index % self.settings.worker.shards,
                )
                self.slots.append(slot)
            slot.wanted = True

    def _unwant(self, count: int) -> None:
        for slot in sorted((s for s in self.slots if s.wanted), key=lambda s: -s.index)[:count]:
            slot.wanted = False
            if slot.alive:
                self._drain(slot)

    def _device_for(self, index: int) -> str:
        devices = self.settings.devices
        return devices[index % len(devices)]

    # -- processes ---------------------------------------------------------

    def _start_due(self, now_s: float) -> None:
        for slot in self.slots:
            if slot.wanted and not slot.disabled and not slot.alive and now_s >= slot.next_start_s:
                self._start(slot)

    def _start(self, slot: Slot) -> None:
        visible = None
        worker = replace(
            self.settings.worker,
            consumer=slot.consumer,
            shard=slot.shard,
            heartbeat_file=_per_consumer(self.settings.worker.heartbeat_file, slot.consumer),
        )
        if slot.device.startswith("cuda:"):
            visible = self.visible[slot.device]
            worker = replace(worker, device="cuda:0")  # the one GPU the child can see
        elif worker.device == "auto":
            worker = replace(worker, device="cpu")
        slot.process = self.context.Process(
            target=self.child_target,
            args=(worker, visible),
            name=f"inferfleet-{slot.consumer}",
            daemon=False,
        )
        slot.process.start()
        slot.draining = False
        log.info(
            "started worker %s (pid %s) on %s for %s",
            slot.consumer,
            slot.process.pid,
            slot.device,
            worker.queue_keys.requests,
        )

    def _drain(self, slot: Slot) -> None:
        if slot.process is not None and slot.process.pid is not None and not slot.draining:
            slot.draining = True
            log.info("draining worker %s (pid %s)", slot.consumer, slot.process.pid)
            os.kill(slot.process.pid, signal.SIGTERM)

    def _reap(self, now_s: float) -> None:
        for slot in self.slots:
            proc = slot.process
            if proc is None or proc.is_alive():
                continue
            code = proc.exitcode
            proc.join(0)
            slot.process = None
            if self.metrics is not None:
                self.metrics.process_exited(proc.pid)
            if slot.draining or not slot.wanted:
                log.info("worker %s exited (status %s) after draining", slot.consumer, code)
                slot.draining = False
                continue
            self._record_death(slot, now_s, code)

    def _record_death(self, slot: Slot, now_s: float, code: int | None) -> None:
        settings = self.settings
        if code == ServerTooOld.exit_status:  # a restart would meet the same server
            slot.disabled = f"worker {slot.consumer} cannot run on this Redis server (see its log)"
            log.error("%s; not restarting it", slot.disabled)
            return
        backoff = restart_backoff(
            slot.deaths,
            now_s,
            window_s=settings.crash_loop_window_s,
            max_deaths=settings.crash_loop_deaths,
            first_s=settings.restart_backoff_s,
            most_s=settings.max_restart_backoff_s,
        )
        if backoff is None:
            slot.disabled = (
                f"worker {slot.consumer} died {len(slot.deaths)} times in "
                f"{settings.crash_loop_window_s:.0f} s (last exit status {code}); not restarting it"
            )
            log.error(
                "CRASH LOOP: %s. Fix the cause (see the worker's log) and restart the supervisor.",
                slot.disabled,
            )
            return
        slot.next_start_s = now_s + backoff
        if self.metrics is not None:
            self.metrics.restarted()
        broke = code == DeviceBroken.exit_status
        why = ": its GPU broke (a sticky CUDA error, see its log)" if broke else ""
        log.warning(
            "worker %s died (exit status %s%s); restarting in %.1f s",
            slot.consumer,
            code,
            why,
            backoff,
        )

    def _publish(self, now_s: float) -> None:
        """The supervisor's own view, for ``inferfleet status`` (best effort)."""
        decision = self.last_decision
        info = {
            "live": self.live_workers(),
            "running": sum(1 for s in self.slots if s.alive),
            "desired": decision.workers if decision else self.live_workers(),
            "reason": decision.reason if decision else "",
            "policy": self.settings.policy.kind,
            "disabled": "; ".join(s.disabled for s in self.slots if s.disabled),
            "pid": os.getpid(),
            "updated_ms": int(time.time() * 1000),
        }
        try:
            # one transaction per shard: a cluster's spans one slot only
            for keys in self.shard_keys:
                pipe = self.redis.pipeline(transaction=True)
                pipe.hset(supervisor_key(keys), mapping=info)
                pipe.pexpire(supervisor_key(keys), int(max(5 * self.settings.interval_s, 5) * 1000))
                pipe.execute()
        except redis.exceptions.RedisError:
            pass

    # -- stopping ----------------------------------------------------------

    def shutdown(self) -> None:
        """Drain every worker; kill the rest after the drain timeout or on ``kill_now``."""
        for slot in self.slots:
            slot.wanted = False
            if slot.alive:
                self._drain(slot)
        deadline = time.monotonic() + self.settings.drain_timeout_s
        renew_at = time.monotonic()
        while (
            any(s.alive for s in self.slots)
            and time.monotonic() < deadline
            and not self.kill_now.is_set()
        ):
            # still managing: no successor may start while these drain
            if time.monotonic() >= renew_at:
                renew_at += self.settings.interval_s
                self._renew_lease()
            time.sleep(0.05)
        for slot in self.slots:
            if slot.alive and slot.process is not None:
                log.warning("killing worker %s: it did not drain in time", slot.consumer)
                slot.process.kill()
            if slot.process is not None:
                slot.process.join(5)
                if self.metrics is not None:
                    self.metrics.process_exited(slot.process.pid)
        try:
            for keys in self.shard_keys:
                self.redis.delete(supervisor_key(keys))
            self.lease.release()
        except redis.exceptions.RedisError:
            pass
        log.info("supervisor stopped; every worker has exited")


def _per_consumer(path: str, consumer: str) -> str:
    """A supervised child's own heartbeat file: ``PATH.CONSUMER`` (one file each, never shared)."""
    return f"{path}.{consumer}" if path else ""
