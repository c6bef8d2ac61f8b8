"""The ``traceparent`` entry field: W3C Trace Context from the caller's OpenTelemetry context.

When ``opentelemetry-api`` is installed and a span is current, every request
the SDK sends carries that span's context as ``traceparent``
(``00-TRACEID-SPANID-FLAGS``), so the worker's spans join the caller's trace.
Without the package, or with no current span, nothing is added. The SDK asks
once per call (once per round of its bulk calls), never per request.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["TRACEPARENT_RE", "current_traceparent", "traceparent_fields"]

#: A version-00 traceparent: lowercase hex; the reader checks the ids are not all zero.
TRACEPARENT_RE = re.compile(rb"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})\Z")

_api: Any = None  # the opentelemetry.trace module, False when it is not installed


def _trace_api() -> Any:
    global _api
    if _api is None:
        try:
            from opentelemetry import trace

            _api = trace
        except ImportError:
            _api = False
    return _api


def current_traceparent() -> str | None:
    """The current span's context as a ``traceparent`` value, or None (no API, no valid span)."""
    api = _trace_api()
    if not api:
        return None
    ctx = api.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def traceparent_fields() -> list[tuple[str, str]]:
    """``[("traceparent", value)]`` under a current span, else ``[]``: a call's extra fields."""
    value = current_traceparent()
    return [("traceparent", value)] if value else []
