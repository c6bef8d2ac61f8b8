"""The row limit of one consumer: what it learns from out-of-memory errors.

A batch that runs out of device memory is bisected and retried by
:func:`inferfleet.worker.serving.batching.predict_isolated`; the limit also
drops to half the rows of the batch that failed, so the next batches fit the
first time. After ``recover_after`` batches computed since the last failure,
the limit doubles back toward the configured one (a transient spike, another
process on the device, should not cost throughput for ever).

Pure: no Redis, no torch, no clock. The consumer frees the device's cached
memory and logs; this only decides the number.
"""

from __future__ import annotations

__all__ = ["RECOVER_AFTER", "RowLimit", "ceiling"]

#: Batches computed after an out-of-memory error before the limit doubles back.
RECOVER_AFTER = 100


def ceiling(configured: int, fits: int | None) -> int:
    """The most rows a batch may ever have: the configured limit, or less where the model's
    warm-up found that no larger batch fits the device (``fits``; None: every size fitted)."""
    return configured if fits is None else max(1, min(configured, fits))


class RowLimit:
    """The most rows a batch may have now, between 1 and the configured ``max_rows``."""

    def __init__(self, max_rows: int, recover_after: int = RECOVER_AFTER) -> None:
        if max_rows < 1 or recover_after < 1:
            raise ValueError(
                f"max_rows and recover_after must be at least 1, not {max_rows} and {recover_after}"
            )
        self.max_rows = max_rows
        self.recover_after = recover_after
        self.rows = max_rows
        self._good_batches = 0

    def set_ceiling(self, max_rows: int) -> None:
        """Batches of at most ``max_rows`` from now on (the model's warm-up found no larger one
        fits, or a new model fits more); the limit doubles back up to it, never past it."""
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, not {max_rows}")
        self.max_rows = max_rows
        self.rows = min(self.rows, max_rows)

    def out_of_memory(self, rows: int) -> bool:
        """A batch of ``rows`` did not fit: the limit drops below it. True if it dropped.

        The count toward doubling back starts over either way.
        """
        self._good_batches = 0
        lowered = max(1, rows // 2)
        if lowered >= self.rows:
            return False
        self.rows = lowered
        return True

    def batch_computed(self) -> bool:
        """One more batch computed (after any bisection): True if the limit doubled back."""
        if self.rows >= self.max_rows:
            return False
        self._good_batches += 1
        if self._good_batches < self.recover_after:
            return False
        self.rows = min(self.max_rows, self.rows * 2)
        self._good_batches = 0
        return True
