"""Worker settings: one frozen dataclass, validated on construction.

Defaults live here and only here; the CLI reads them (and the environment
variable of every option, :data:`ENV_VARS`) from this module.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field, fields

from inferfleet.producer.client import DEFAULT_REDIS_URL
from inferfleet.producer.protocol import (DEFAULT_PREFIX, DEFAULT_REPLY_TTL_S, Limits, QueueKeys, shard_name, validate_name,
                               validate_prefix)
from inferfleet.producer.errors import ProtocolError
from inferfleet.worker.errors import ConfigError

__all__ = ["WorkerSettings", "ENV_VARS", "DEVICE_CHOICES", "PRECISIONS", "default_consumer_name"]

#: fp32 as trained; fp16 and bf16 run under torch.autocast (GPU, and CPU where the ops support it);
#: int8 is dynamic quantization of the linear layers (CPU only).
PRECISIONS = ("fp32", "fp16", "bf16", "int8")

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_DEVICE_RE = re.compile(r"(auto|cpu|cuda|cuda:\d{1,3})\Z")
_CONSUMER_RE = re.compile(r"[A-Za-z0-9._:@-]{1,128}\Z")


def default_consumer_name() -> str:
    """``host-pid``: unique among live processes, readable in XINFO CONSUMERS."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WorkerSettings:
    """Everything one consumer process needs. Units are in the names."""

    name: str
    model: str
    redis_url: str = field(default_factory=lambda: os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL)
    prefix: str = DEFAULT_PREFIX
    device: str = "auto"
    max_batch_rows: int = 64
    max_wait_ms: float = 5.0
    consumer: str = field(default_factory=default_consumer_name)
    model_version: str | None = None
    warmup_input: str | None = None
    warmup_iters: int = 3
    torch_threads: int = 1
    reply_ttl_s: int = DEFAULT_REPLY_TTL_S
    max_body_bytes: int = 16 * 1024 * 1024
    idle_block_ms: int = 1000
    claim_idle_s: float = 2.0
    max_deliveries: int = 3
    housekeeping_s: float = 1.0
    heartbeat_s: float = 1.0
    precision: str = "fp32"
    compile: bool = False
    empty_cache_every: int = 0
    prefetch: str = "auto"
    tune_malloc: bool = True
    # result cache (inferfleet.worker.serving.cache): 0 entries turns the per-worker LFU off; a TTL of 0 the fleet cache
    cache_size: int = 0
    fleet_cache_ttl_s: int = 0
    # result checks (inferfleet.worker.serving.validation): 0 turns a check off
    min_confidence: float = 0.0
    consistency_tol: float = 0.0
    nan_guard: bool = True
    # observability: Prometheus /metrics on this port (0: off)
    metrics_port: int = 0
    # Redis Cluster sharding: this worker serves shard `shard` of `shards` (queue NAME.shard)
    shards: int = 1
    shard: int = 0
    cluster: bool = False  # connect with redis-py's RedisCluster (the URL names any one node)

    def __post_init__(self) -> None:
        try:
            validate_name(self.name)
            validate_prefix(self.prefix)
        except ProtocolError as exc:
            raise ConfigError(str(exc)) from exc
        if not self.model:
            raise ConfigError("model is required: a TorchScript file, a .pt2 export or module:attr")
        if not _DEVICE_RE.match(self.device):
            raise ConfigError(f"device {self.device!r} is not one of {DEVICE_CHOICES}")
        if not _CONSUMER_RE.match(self.consumer):
            raise ConfigError(f"consumer {self.consumer!r}: use 1 to 128 of A-Z a-z 0-9 . _ : @ -")
        self._check_range("max_batch_rows", 1, 1 << 20)
        self._check_range("max_wait_ms", 0, 60_000)
        self._check_range("warmup_iters", 0, 1000)
        self._check_range("torch_threads", 1, 1024)
        self._check_range("reply_ttl_s", 1, 30 * 86400)
        self._check_range("max_body_bytes", 64, 1 << 31)
        self._check_range("idle_block_ms", 1, 60_000)
        self._check_range("claim_idle_s", 0.1, 86400)
        self._check_range("max_deliveries", 1, 1000)
        self._check_range("housekeeping_s", 0.01, 3600)
        self._check_range("heartbeat_s", 0.05, 600)
        self._check_range("empty_cache_every", 0, 10**9)
        self._check_range("cache_size", 0, 10**8)
        self._check_range("fleet_cache_ttl_s", 0, 30 * 86400)
        self._check_range("min_confidence", 0.0, 1.0)
        self._check_range("consistency_tol", 0.0, 1e30)
        self._check_range("metrics_port", 0, 65535)
        if self.fleet_cache_ttl_s and not self.cache_size:
            raise ConfigError("fleet_cache_ttl_s needs cache_size: the fleet cache is a tier of the worker's cache")
        self._check_range("shards", 1, 1024)
        self._check_range("shard", 0, self.shards - 1)
        try:
            shard_name(self.name, self.shard, self.shards)  # the shard's name must fit 64 characters too
        except ProtocolError as exc:
            raise ConfigError(str(exc)) from exc
        if self.prefetch not in ("auto", "on", "off"):
            raise ConfigError(f"prefetch {self.prefetch!r} is not one of auto, on, off")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")

    def _check_range(self, name: str, low: float, high: float) -> None:
        value = getattr(self, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
            raise ConfigError(f"{name} must be a number from {low} to {high}, got {value!r}")

    @property
    def limits(self) -> Limits:
        """The decoder bounds that follow from these settings."""
        return Limits(max_body_bytes=self.max_body_bytes)

    @property
    def queue_keys(self) -> QueueKeys:
        """The keys this worker serves: its shard's (``NAME.shard``), or the queue's own when unsharded."""
        return QueueKeys(shard_name(self.name, self.shard, self.shards), self.prefix)

    @property
    def max_wait_s(self) -> float:
        return self.max_wait_ms / 1000.0


#: The environment variable of each setting (REDIS_URL is also honoured).
ENV_VARS: dict[str, str] = {f.name: f"INFERFLEET_{f.name.upper()}" for f in fields(WorkerSettings)}
ENV_VARS["redis_url"] = "REDIS_URL"
