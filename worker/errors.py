"""The worker's exceptions.

::

    InferfleetError                (inferfleet.producer.errors)
    └── WorkerError
        ├── ConfigError            an invalid setting; the message lists what is allowed
        ├── ModelLoadError         the model cannot be loaded, placed or warmed up
        ├── SplitError             ``inferfleet split`` cannot cut the model as asked
        └── OutputError            a model output breaks the contract (answered model_error)

Redis and torch exceptions are translated where they are caught: redis-py's
in ``inferfleet.worker.serving.consumer`` (a connection loss is retried, never fatal) and
torch's in ``inferfleet.worker.runtime.loading`` (a load failure becomes ModelLoadError).
"""

from __future__ import annotations

from inferfleet.producer.errors import InferfleetError

__all__ = ["WorkerError", "ConfigError", "ModelLoadError", "OutputError", "SplitError"]


class WorkerError(InferfleetError):
    """Base class of the worker's own exceptions."""


class ConfigError(WorkerError, ValueError):
    """A setting is out of range or of the wrong kind."""


class ModelLoadError(WorkerError):
    """The model cannot be loaded, placed on its device or warmed up."""


class SplitError(WorkerError):
    """A model cannot be split where asked, or its stages do not reproduce it."""


class OutputError(WorkerError):
    """A model output does not fit the contract (wrong rows, dtype or form)."""
