"""Log formats (text or one JSON object a line) and the context records carry.

Modules log as usual (``logging.getLogger(__name__)``, %-style arguments);
only the CLI calls :func:`setup_logging`. Two kinds of context are added to
every record by a filter on the handler, so they reach the JSON output
without touching the call sites:

* process fields, set once with :func:`bind` (``consumer=NAME`` in a worker);
* the batch being computed, set by the consumer around each batch with
  :func:`batch_context`: ``batch`` (the worker's batch sequence number) and
  ``request_ids`` (the request ids of that batch). Only the current thread
  sees it, and the ids are listed only when a record is actually emitted.

Every message is bounded (:data:`MAX_MESSAGE_CHARS`, the rest cut with a
note of how much): text a producer controls (an id, a body, the message of
an exception its input raised) can never make a log line of megabytes.
Call sites that log such text pass it through :func:`clip` as well.

A JSON line looks like::

    {"time": "2025-01-02T03:04:05.678+00:00", "level": "DEBUG", "logger":
    "inferfleet.worker.serving.consumer",
     "message": "...", "process": 4242, "consumer": "ctr-s0", "batch": 17, "request_ids": ["r1",
     "r2"]}

with ``exception`` (the formatted traceback) when the record has one.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone
from types import TracebackType
from typing import Any

from pythonjsonlogger.json import JsonFormatter

from inferfleet.worker.errors import ConfigError

__all__ = [
    "LOG_FORMATS",
    "TEXT_FORMAT",
    "MAX_MESSAGE_CHARS",
    "JsonLogFormatter",
    "ContextFilter",
    "batch_context",
    "bind",
    "clip",
    "setup_logging",
]

LOG_FORMATS = ("text", "json")
#: The longest message a record keeps once emitted; longer ones are cut (:func:`clip`).
MAX_MESSAGE_CHARS = 4096
#: What :func:`clip` keeps of one piece of producer-controlled text by default.
MAX_FIELD_CHARS = 512
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"

_process_fields: dict[str, Any] = {}
_batch: ContextVar[tuple[int, Sequence[Any]] | None] = ContextVar("inferfleet_batch", default=None)


def clip(value: object, limit: int = MAX_FIELD_CHARS) -> str:
    """``str(value)`` in at most ``limit`` characters plus a note of how many were cut."""
    text = str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


def bind(**fields: Any) -> None:
    """Add fields to every record of this process from now on (``consumer=NAME``)."""
    _process_fields.update(fields)


@contextmanager
def batch_context(number: int, requests: Sequence[Any]) -> Iterator[None]:
    """Records logged inside (by this thread) carry ``batch`` and ``request_ids``.

    ``requests`` holds request ids or objects with a ``rid``; it is only read
    when a record is emitted, so an unlogged batch costs no list of ids.
    """
    token = _batch.set((number, requests))
    try:
        yield
    finally:
        _batch.reset(token)


def _request_ids(requests: Sequence[Any]) -> list[str | None]:
    return [item if isinstance(item, str) else getattr(item, "rid", None) for item in requests]


class ContextFilter(logging.Filter):
    """Adds the process fields and the current batch to each record (never overriding ``extra=``),
    and cuts a message longer than :data:`MAX_MESSAGE_CHARS`."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > MAX_MESSAGE_CHARS:
            record.msg, record.args = clip(message, MAX_MESSAGE_CHARS), None
        for key, value in _process_fields.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        current = _batch.get()
        if current is not None:
            if not hasattr(record, "batch"):
                record.batch = current[0]
            if not hasattr(record, "request_ids"):
                record.request_ids = _request_ids(current[1])
        return True


class JsonLogFormatter(JsonFormatter):
    """One JSON object per record: time (ISO 8601, UTC), level, logger, message, process,
    any context or ``extra=`` fields, and ``exception`` when there is one."""

    def __init__(self) -> None:
        super().__init__(
            "{levelname}{name}{message}{process}",
            style="{",
            timestamp=False,
            rename_fields={"levelname": "level", "name": "logger", "exc_info": "exception"},
        )

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        log_data["time"] = datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(
            timespec="milliseconds"
        )
        super().add_fields(log_data, record, message_dict)


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    logging.getLogger("inferfleet").critical(
        "uncaught %s: %s", kind.__name__, exc, exc_info=(kind, exc, tb)
    )


def setup_logging(level: str, fmt: str = "text") -> None:
    """Log to stderr at ``level`` in ``fmt`` (text or json). In json, warnings and
    uncaught exceptions become records too, so every line of stderr is JSON."""
    if fmt not in LOG_FORMATS:
        raise ConfigError(f"log format {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonLogFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])
    if fmt == "json":
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
