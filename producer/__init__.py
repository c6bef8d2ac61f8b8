"""inferfleet producer SDK: enqueue inference requests and collect replies.

Import only this package in a service that sends work to the fleet; it never
imports the worker (or torch).

    from inferfleet.producer import Producer
    with Producer("redis://localhost:6379/0", "ctr") as p:
        reply = p.result(p.submit(features), timeout_s=5)
"""

from __future__ import annotations

from inferfleet.producer.aio import AsyncProducer
from inferfleet.producer.connections import DEFAULT_REDIS_URL
from inferfleet.producer.durability import Durability
from inferfleet.producer.errors import (
    BadRequest,
    Cancelled,
    ConnectionError,
    DeadLetter,
    Expired,
    InferfleetError,
    ModelError,
    NotReplicated,
    Overloaded,
    ProtocolError,
    QueueFull,
    RateLimited,
    ReplyError,
    ReplyTimeout,
    Throttled,
    TooLarge,
)
from inferfleet.producer.protocol import CONTRACT_VERSION, DEFAULT_PREFIX, QueueKeys, Reply
from inferfleet.producer.sync import Producer

__all__ = [
    "AsyncProducer",
    "BadRequest",
    "CONTRACT_VERSION",
    "Cancelled",
    "ConnectionError",
    "DEFAULT_PREFIX",
    "DEFAULT_REDIS_URL",
    "DeadLetter",
    "Durability",
    "Expired",
    "InferfleetError",
    "ModelError",
    "NotReplicated",
    "Overloaded",
    "Producer",
    "ProtocolError",
    "QueueFull",
    "QueueKeys",
    "RateLimited",
    "Reply",
    "ReplyError",
    "ReplyTimeout",
    "Throttled",
    "TooLarge",
]
