"""Where Producer and AsyncProducer used to live: kept so old imports work.

The SDK is now :mod:`~inferfleet.producer.base` (what both share),
:mod:`~inferfleet.producer.sync` and :mod:`~inferfleet.producer.aio`.
"""

from __future__ import annotations

from inferfleet.producer.aio import AsyncProducer
from inferfleet.producer.connections import DEFAULT_REDIS_URL
from inferfleet.producer.sync import Producer

__all__ = ["Producer", "AsyncProducer", "DEFAULT_REDIS_URL"]
