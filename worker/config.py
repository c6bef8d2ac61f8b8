"""Worker settings: one frozen dataclass, validated on construction.

Defaults live here and only here: the CLI builds each option from its field, with the
field's default, its environment variable (:data:`ENV_VARS`) and the help in its metadata.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from dataclasses import Field, dataclass, field, fields
from typing import Any

from inferfleet.producer.connections import DEFAULT_REDIS_URL
from inferfleet.producer.durability import Durability
from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import (
    DEFAULT_PREFIX,
    DEFAULT_REPLY_TTL_S,
    Limits,
    QueueKeys,
    shard_name,
    validate_name,
    validate_prefix,
)
from inferfleet.worker.errors import ConfigError
from inferfleet.worker.keys import MAX_STAGES, stage_keys

__all__ = [
    "WorkerSettings",
    "ENV_VARS",
    "DEVICE_CHOICES",
    "PRECISIONS",
    "TF32_CHOICES",
    "default_consumer_name",
    "env_var",
]

#: fp32 as trained; fp16 and bf16 cast the weights (``model.half()``: half the memory) and the
#: floating inputs (integer ids stay as they are); amp runs the fp32 model under torch.autocast
#: (fp16 where it is safe); int8 is dynamic quantization of the linear layers (CPU only).
PRECISIONS = ("fp32", "fp16", "bf16", "amp", "int8")
#: TF32 for fp32 matmuls and convolutions on Ampere and newer: torch's defaults (matmuls off,
#: cuDNN convolutions on), both on, or both off (exact fp32).
TF32_CHOICES = ("torch", "on", "off")

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_DEVICE_RE = re.compile(r"(auto|cpu|cuda|cuda:\d{1,3})\Z")
_CONSUMER_RE = re.compile(r"[A-Za-z0-9._:@-]{1,128}\Z")


def default_consumer_name() -> str:
    """``host-pid``: unique among live processes, readable in XINFO CONSUMERS."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WorkerSettings:
    """Everything one consumer process needs. Units are in the names.

    Each field's metadata holds the help of its CLI option (``help``) and, where it is not
    ``INFERFLEET_<FIELD>``, its environment variable (``env``): see :func:`env_var`.
    """

    name: str = field(metadata={"help": "Queue (model) name: 1-64 of A-Z a-z 0-9 . _ -"})
    model: str = field(
        metadata={
            "help": "TorchScript file, torch.export .pt2 file, ONNX .onnx file, or module:Handler; "
            "with --stage, the directory `inferfleet split` wrote (--pipeline)."
        }
    )
    redis_url: str = field(
        default_factory=lambda: os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL,
        metadata={
            "help": f"Redis URL (redis://, rediss://, unix://, redis+sentinel://HOST:PORT,.../"
            f"SERVICE/DB); default {DEFAULT_REDIS_URL}.",
            "env": "REDIS_URL",
        },
    )
    prefix: str = field(default=DEFAULT_PREFIX, metadata={"help": "Key prefix of every Redis key."})
    device: str = field(default="auto", metadata={"help": f"One of {DEVICE_CHOICES}."})
    max_batch_rows: int = field(default=64, metadata={"help": "Most rows in one forward pass."})
    max_wait_ms: float = field(default=5.0, metadata={"help": "Longest wait for a batch to fill."})
    consumer: str = field(
        default_factory=default_consumer_name,
        metadata={"help": "Consumer name in the group (default host-pid)."},
    )
    model_version: str | None = field(
        default=None, metadata={"help": "Version reported in replies (default: file hash)."}
    )
    warmup_input: str | None = field(
        default=None,
        metadata={"help": ".npy/.npz inputs to warm up with (default: the model's example)."},
    )
    input_spec: str | None = field(
        default=None,
        metadata={
            "help": "The inputs the model takes, where its file does not say (TorchScript): e.g. "
            "'float32[N,16]', 'int64[N,L]' (L varies), "
            "'{ids: int64[N,L], mask: bool[N,L]}'. Requests are checked against it "
            "and the worker warms up on zeros of it."
        },
    )
    warmup_iters: int = field(
        default=3, metadata={"help": "Forward passes at each warm-up batch size (0: no warm-up)."}
    )
    torch_threads: int = field(
        default=1, metadata={"help": "Intra-op threads of each worker process."}
    )
    reply_ttl_s: int = field(
        default=DEFAULT_REPLY_TTL_S, metadata={"help": "TTL of each reply list."}
    )
    wait_replicas: int = field(
        default=0,
        metadata={
            "help": "After each round of replies, WAIT until this many replicas have them "
            "(0: no wait). With 1 and one replica, a failover keeps every reply and "
            "acknowledgement a worker made (docs/reliability.md, 'Durability')."
        },
    )
    wait_timeout_ms: int = field(
        default=1000,
        metadata={"help": "The longest --wait-replicas waits a round (a shortfall is counted)."},
    )
    max_body_bytes: int = field(
        default=16 * 1024 * 1024, metadata={"help": "Larger bodies are answered too_large."}
    )
    idle_block_ms: int = field(
        default=1000,
        metadata={
            "help": "Longest an idle worker blocks reading the stream before it checks for a stop "
            "(a request wakes it at once)."
        },
    )
    chunk_ms: float = field(
        default=0.0,
        metadata={
            "help": "A step-wise model's streamed tokens made within this long go out as one "
            "chunk (its first and last tokens at once); 0: a chunk a token."
        },
    )
    claim_idle_s: float = field(
        default=2.0,
        metadata={"help": "Take over entries of a consumer with no heartbeat once idle this long."},
    )
    max_deliveries: int = field(
        default=3, metadata={"help": "Dead-letter an entry delivered more often than this."}
    )
    housekeeping_s: float = field(
        default=1.0,
        metadata={
            "help": "How often a worker takes over entries of dead consumers, trims the stream and "
            "looks for a new model version."
        },
    )
    heartbeat_s: float = field(
        default=1.0,
        metadata={
            "help": "How often a worker publishes its heartbeat (which expires after 3 of these, "
            "at least 2 s)."
        },
    )
    precision: str = field(
        default="fp32",
        metadata={
            "help": "fp16/bf16 cast the weights and floating inputs (integer inputs stay); "
            "amp runs under torch.autocast; int8 quantizes the linear layers dynamically (CPU; "
            ".pt2, .onnx, handlers); outputs stay float32."
        },
    )
    tf32: str = field(
        default="torch",
        metadata={
            "help": "TF32 for fp32 on NVIDIA Ampere+: torch (its defaults: matmuls off, cuDNN "
            "convolutions on), on, off (exact fp32). The worker logs what it runs."
        },
    )
    compile: bool = field(
        default=False, metadata={"help": "torch.compile the model (torch.export .pt2 models)."}
    )
    empty_cache_every: int = field(
        default=0, metadata={"help": "Return cached GPU memory every N batches (0: never)."}
    )
    prefetch: str = field(
        default="auto",
        metadata={"help": "Read and decode the next batch while one computes (auto: on GPUs)."},
    )
    tune_malloc: bool = field(
        default=True,
        metadata={
            "help": "Fix glibc's mmap/trim thresholds so batch buffers are reused, not re-mapped."
        },
    )
    # result cache (inferfleet.worker.serving.cache): 0 entries turns the per-worker LFU off; a TTL
    # of 0 the fleet cache
    cache_size: int = field(
        default=0, metadata={"help": "Entries of the per-worker LFU result cache (0: off)."}
    )
    fleet_cache_ttl_s: int = field(
        default=0,
        metadata={
            "help": "Also share results fleet-wide in Redis for this long (0: off; needs "
            "--cache-size)."
        },
    )
    # result checks (inferfleet.worker.serving.validation): 0 turns a check off
    min_confidence: float = field(
        default=0.0, metadata={"help": "Alert when a reply's top score is below this (0: off)."}
    )
    consistency_tol: float = field(
        default=0.0,
        metadata={
            "help": "Alert when identical inputs on one version differ by more than this (0: off)."
        },
    )
    nan_guard: bool = field(
        default=True,
        metadata={"help": "Answer model_error (and alert) for outputs holding NaN or Inf."},
    )
    # observability: Prometheus /metrics on this port (0: off)
    metrics_port: int = field(
        default=0, metadata={"help": "Serve Prometheus metrics on this port (0: off)."}
    )
    heartbeat_file: str = field(
        default="",
        metadata={
            "help": "Also write each heartbeat to this file (JSON: last_seen_ms, loop_ms, the "
            "consumer loop's last round), for a liveness probe ('': off)."
        },
    )
    metrics_address: str = field(
        default="0.0.0.0",
        metadata={
            "help": "Address the metrics port binds to: 0.0.0.0 every IPv4 interface, :: every "
            "interface, 127.0.0.1 this host only."
        },
    )
    # Redis Cluster sharding: this worker serves shard `shard` of `shards` (queue NAME.shard)
    shards: int = field(
        default=1,
        metadata={
            "help": "Streams the queue is sharded into (queues NAME.0, NAME.1 ...); a request's "
            "shard is CRC-32 of its id mod this."
        },
    )
    shard: int = field(
        default=0, metadata={"help": "With --shards: the shard this worker serves (0 to shards-1)."}
    )
    cluster: bool = field(
        default=False,
        metadata={  # connect with redis-py's RedisCluster
            "help": "Connect to a Redis Cluster (the URL names any one node)."
        },
    )
    # pipeline parallelism: this worker serves one stage of a split model (inferfleet split)
    stage: int | None = field(
        default=None,
        metadata={
            "help": "Serve stage K of the split model in --pipeline DIR: stage 0 reads the queue's "
            "requests, stage K the stream PREFIX:{NAME}:stage:K."
        },
    )

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
        self._check_range("wait_replicas", 0, 64)
        self._check_range("wait_timeout_ms", 1, 60_000)
        self._check_range("idle_block_ms", 1, 60_000)
        self._check_range("chunk_ms", 0, 10_000)
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
        _check_ip_address("metrics_address", self.metrics_address)
        if self.fleet_cache_ttl_s and not self.cache_size:
            raise ConfigError(
                "fleet_cache_ttl_s needs cache_size: the fleet cache is a tier of the worker's "
                "cache"
            )
        self._check_range("shards", 1, 1024)
        self._check_range("shard", 0, self.shards - 1)
        try:
            shard_name(
                self.name, self.shard, self.shards
            )  # the shard's name must fit 64 characters too
        except ProtocolError as exc:
            raise ConfigError(str(exc)) from exc
        if self.stage is not None:
            self._check_range("stage", 0, MAX_STAGES - 1)
        self._check_choices()

    def _check_choices(self) -> None:
        """Each setting with a fixed set of values holds one of them."""
        for name, choices in (
            ("prefetch", ("auto", "on", "off")),
            ("tf32", TF32_CHOICES),
            ("precision", PRECISIONS),
        ):
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(f"{name} {value!r} is not one of {', '.join(choices)}")

    def _check_range(self, name: str, low: float, high: float) -> None:
        value = getattr(self, name)
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not low <= value <= high
        ):
            raise ConfigError(f"{name} must be a number from {low} to {high}, got {value!r}")

    @property
    def limits(self) -> Limits:
        """The decoder bounds that follow from these settings."""
        return Limits(max_body_bytes=self.max_body_bytes)

    @property
    def queue_keys(self) -> QueueKeys:
        """The keys this worker serves: its shard's (``NAME.shard``), or the queue's own when
        unsharded; with a ``stage`` over 0, that stage's keys
        (:class:`~inferfleet.worker.keys.StageKeys`)."""
        keys = QueueKeys(shard_name(self.name, self.shard, self.shards), self.prefix)
        return stage_keys(keys, self.stage) if self.stage else keys

    @property
    def max_wait_s(self) -> float:
        return self.max_wait_ms / 1000.0

    @property
    def durability(self) -> Durability | None:
        """What the reply writers wait for after each round (None: nothing)."""
        if not self.wait_replicas:
            return None
        return Durability(self.wait_replicas, self.wait_timeout_ms)


def _check_ip_address(name: str, value: str) -> None:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ConfigError(
            f"{name} {value!r} is not an IP address (e.g. 0.0.0.0, ::, 127.0.0.1)"
        ) from None


def env_var(setting: Field[Any]) -> str:
    """The environment variable of a settings field's option: ``INFERFLEET_<FIELD>`` unless its
    metadata names one."""
    return setting.metadata.get("env") or f"INFERFLEET_{setting.name.upper()}"


#: The environment variable of each setting (the Redis URL's is REDIS_URL); each is read by a CLI
#: option.
ENV_VARS: dict[str, str] = {f.name: env_var(f) for f in fields(WorkerSettings)}
