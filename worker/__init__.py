"""inferfleet worker: consumer processes that batch requests through a private model copy.

Its names are imported when first used, so that a command that never serves a
model (``inferfleet status``, ``enqueue``...) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inferfleet.worker.config import WorkerSettings
    from inferfleet.worker.handler import Handler, pad_batch

__all__ = ["Handler", "WorkerSettings", "pad_batch", "save_model"]

_HOMES = {
    "Handler": "inferfleet.worker.handler",
    "pad_batch": "inferfleet.worker.handler",
    "WorkerSettings": "inferfleet.worker.config",
    "save_model": "inferfleet.worker.runtime.saving",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
