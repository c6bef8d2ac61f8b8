"""inferfleet worker: consumer processes that batch requests through a private model copy."""

from __future__ import annotations

from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.handler import Handler

__all__ = ["Handler", "WorkerSettings"]
