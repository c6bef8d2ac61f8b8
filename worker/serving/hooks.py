"""The consumer loop's one seam for what runs beside serving: the shadow/canary and tracing.

The consumer calls a :class:`Hooks` (when it has one) once per read, per
batch and per round, never per request; with neither a loaded candidate nor
tracing, each call returns after a test or two. serve.py builds one for every
worker process (the shadow must poll for candidates); a bare
:class:`~inferfleet.worker.serving.consumer.Consumer` has none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from inferfleet.worker.runtime.loading import ModelRuntime
from inferfleet.worker.serving.batching import Request
from inferfleet.worker.serving.intake import Answer
from inferfleet.worker.serving.shadow import ShadowRunner
from inferfleet.worker.serving.tracing import Tracing

__all__ = ["Hooks"]


class Hooks:
    """Calls into the shadow runner and the tracing, each optional."""

    def __init__(self, shadow: ShadowRunner | None = None, tracing: Tracing | None = None) -> None:
        self.shadow = shadow
        self.tracing = tracing

    @property
    def active(self) -> bool:
        """Tracing is on or a candidate is loaded: reads take the per-request path, not the columnar
        one."""
        return self.tracing is not None or (self.shadow is not None and self.shadow.ready)

    def read(self, entries: Sequence[tuple[bytes, Any]], items: list[Any]) -> list[Any]:
        """A read's entries were admitted as ``items`` (returned as they are)."""
        if self.tracing is not None:
            self.tracing.read(entries, items)
        return items

    def infer(
        self,
        batch: list[Request],
        live: ModelRuntime,
        compute: Callable[[list[Request]], list[Answer]],
    ) -> list[Answer]:
        """One batch's answers: the canary's when it is due and succeeds, else ``compute``'s (the
        live model)."""
        shadow, tracing = self.shadow, self.tracing
        version = live.version
        started = tracing.now() if tracing is not None else 0
        answers = None
        if shadow is not None and shadow.canary_due():
            answers = shadow.canary(batch, live.version)
            if answers is not None and shadow.spec is not None:
                version = shadow.spec.version
        if answers is None:
            answers = compute(batch)
        if tracing is not None:
            tracing.forward(batch, version, started)
        return answers

    def computed(self, batch: list[Request], results: Sequence[Any]) -> None:
        """The live model computed ``batch`` (results: outputs or exceptions, per request)."""
        if self.shadow is not None and self.shadow.ready:
            self.shadow.offer(batch, results)

    def replied(self, live: ModelRuntime) -> None:
        """The round's replies are written: spans, then the shadow's comparisons."""
        if self.tracing is not None:
            self.tracing.replied()
        if self.shadow is not None and self.shadow.ready:
            self.shadow.run_pending(live)

    def housekeep(self, live: ModelRuntime) -> None:
        """Every housekeeping tick: the shadow follows the published candidate."""
        if self.shadow is not None:
            self.shadow.poll(live)

    def heartbeat_fields(self) -> dict[str, Any]:
        """The candidate as this worker has it."""
        return self.shadow.heartbeat_fields() if self.shadow is not None else {}

    def close(self) -> None:
        """The worker stops: export the last spans."""
        if self.tracing is not None:
            self.tracing.shutdown()
