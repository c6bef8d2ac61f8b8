"""inferfleet worker: consumer processes that batch requests through a private model copy.

Its names are imported when first used, so that a command that never serves a
model (``inferfleet status``, ``enqueue``...) does not import torch.

This module is the package's public face, above the subpackages, and in no table
of docs/architecture.md: what it imports when imported follows the shared
modules' row (only shared modules and ``producer``), while ``__getattr__`` may
hand out a name from any subpackage (``save_model`` lives in ``runtime/``, the
torch boundary, where it belongs). In return no module of the package imports
these names from here. tests/unit/test_architecture.py reads ``_HOMES`` and
holds both rules.
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
