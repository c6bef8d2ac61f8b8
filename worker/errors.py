"""The worker's exceptions.

::

    InferfleetError                (inferfleet.producer.errors)
    └── WorkerError
        ├── ConfigError            an invalid setting; the message lists what is allowed
        ├── ModelLoadError         the model cannot be loaded, placed or warmed up
        ├── SplitError             ``inferfleet split`` cannot cut the model as asked
        ├── OutputError            a model output breaks the contract (answered model_error)
        ├── ServerTooOld           the Redis server predates 7.0 (no Functions): exit 5, and
        │                          the supervisor does not restart it
        └── Cancelled              a request whose cancel mark a round took: the result it
                                   gets in place of outputs (answered cancelled, never computed)

    BaseException
    └── DeviceBroken               the device's context is lost (a sticky CUDA error): the
                                   worker exits without acknowledging, like SystemExit

Redis and torch exceptions are translated where they are caught: redis-py's
in ``inferfleet.worker.serving.consumer`` (a connection loss is retried, never fatal) and
torch's in ``inferfleet.worker.runtime.loading`` (a load failure becomes ModelLoadError).
DeviceBroken is no ``Exception`` on purpose: nothing that isolates a failing
request (the bisection, ``except Exception`` in handlers' callers) may swallow it.
"""

from __future__ import annotations

from inferfleet.producer.errors import InferfleetError

__all__ = [
    "WorkerError",
    "ConfigError",
    "DeviceBroken",
    "ModelLoadError",
    "OutputError",
    "ServerTooOld",
    "SplitError",
    "Cancelled",
]


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


class ServerTooOld(WorkerError):
    """The Redis server is older than 7.0: the fleet cannot run on it (not worth a restart)."""

    #: A supervised worker exits with this status; the supervisor does not restart it.
    exit_status = 5


class DeviceBroken(BaseException):
    """A sticky device error (a device-side assert, an illegal memory access): every later
    call on the device fails too, so the process must exit and be restarted.

    Raised by the consumer instead of answering ``model_error``; ``consumer``
    and ``cause`` say who and why for the exit message.
    """

    #: The process's exit status (the supervisor names it in its restart log line).
    exit_status = 4

    def __init__(self, consumer: str, cause: BaseException) -> None:
        super().__init__(
            f"consumer {consumer}: the device is unusable after {type(cause).__name__}: {cause}"
        )
        self.consumer = consumer
        self.cause = cause


class Cancelled(WorkerError):
    """The result of a request whose cancel mark a round took: answered ``cancelled``."""

    def __init__(self, message: str = "cancelled by the producer before a worker computed it"):
        super().__init__(message)
