"""The row limit learned from out-of-memory errors: halve below the failed batch, double back
later."""

from __future__ import annotations

import pytest

from inferfleet.worker.serving.rowlimit import RECOVER_AFTER, RowLimit, ceiling


def computed(limit: RowLimit, batches: int) -> list[bool]:
    return [limit.batch_computed() for _ in range(batches)]


def test_starts_at_the_configured_rows_and_stays_there_without_errors():
    limit = RowLimit(64)
    assert limit.rows == 64
    assert not any(computed(limit, 1000))
    assert limit.rows == 64


def test_an_out_of_memory_error_halves_below_the_batch_that_failed():
    limit = RowLimit(64)
    assert limit.out_of_memory(64)
    assert limit.rows == 32
    assert limit.out_of_memory(20)  # a smaller batch failed: below it, not below the limit
    assert limit.rows == 10


def test_a_failed_batch_already_above_the_limit_leaves_it():
    limit = RowLimit(64)
    limit.out_of_memory(16)
    assert limit.rows == 8
    assert not limit.out_of_memory(32)  # half of 32 is over 8: a stale, larger batch
    assert not limit.out_of_memory(16)  # half is the limit itself
    assert limit.rows == 8


def test_the_limit_never_drops_below_one_row():
    limit = RowLimit(4)
    assert limit.out_of_memory(1)
    assert limit.rows == 1
    assert not limit.out_of_memory(1)
    assert limit.rows == 1


def test_it_doubles_back_after_exactly_one_hundred_batches():
    assert RECOVER_AFTER == 100
    limit = RowLimit(64)
    limit.out_of_memory(64)
    assert computed(limit, 99) == [False] * 99
    assert limit.rows == 32
    assert limit.batch_computed()
    assert limit.rows == 64


def test_each_doubling_needs_another_hundred_batches_and_stops_at_the_configured_rows():
    limit = RowLimit(48)
    limit.out_of_memory(10)
    assert limit.rows == 5
    seen = []
    for _ in range(5 * RECOVER_AFTER):
        if limit.batch_computed():
            seen.append(limit.rows)
    assert seen == [10, 20, 40, 48]  # capped at 48, never 80
    assert limit.rows == 48


def test_an_error_starts_the_count_toward_doubling_over():
    limit = RowLimit(64)
    limit.out_of_memory(64)
    computed(limit, 99)
    assert not limit.out_of_memory(
        64
    )  # not lowered (32 already), but the run of good batches is broken
    assert computed(limit, 99) == [False] * 99
    assert limit.rows == 32
    assert limit.batch_computed()
    assert limit.rows == 64


def test_a_custom_recovery_count():
    limit = RowLimit(8, recover_after=3)
    limit.out_of_memory(8)
    assert computed(limit, 3) == [False, False, True]
    assert limit.rows == 8


@pytest.mark.parametrize("max_rows,recover_after", [(0, 100), (8, 0)])
def test_nonsense_is_refused(max_rows, recover_after):
    with pytest.raises(ValueError, match="at least 1"):
        RowLimit(max_rows, recover_after)


def test_the_ceiling_is_what_the_warm_up_found_fits_never_more_than_configured():
    assert ceiling(256, None) == 256  # every size fitted
    assert ceiling(256, 64) == 64
    assert ceiling(32, 64) == 32


def test_a_lower_ceiling_caps_the_limit_and_the_doubling_back():
    limit = RowLimit(64, recover_after=2)
    limit.set_ceiling(16)
    assert limit.rows == 16 and limit.max_rows == 16
    assert limit.out_of_memory(16) and limit.rows == 8
    assert not computed(limit, 1)[0] and computed(limit, 1) == [True] and limit.rows == 16
    assert not any(computed(limit, 10)) and limit.rows == 16  # never past the ceiling
    limit.set_ceiling(64)  # a model that fits more: the limit doubles back up to the new one
    assert computed(limit, 2) == [False, True] and limit.rows == 32
    with pytest.raises(ValueError, match="at least 1"):
        limit.set_ceiling(0)


def test_one_row_is_the_least_limit_ceiling_and_recovery_count():
    limit = RowLimit(1, recover_after=1)
    assert limit.rows == 1 and limit.max_rows == 1
    limit.set_ceiling(1)
    assert limit.rows == 1
    assert ceiling(256, 1) == 1


def test_the_limit_is_a_whole_number_of_rows():
    limit = RowLimit(64)
    assert limit.out_of_memory(5)
    assert limit.rows == 2 and isinstance(limit.rows, int)


def test_a_raised_ceiling_doubles_back_after_recover_after_batches_counted_from_the_start():
    limit = RowLimit(64, recover_after=2)
    limit.set_ceiling(16)
    limit.set_ceiling(64)  # below its ceiling with no error yet: the count starts at zero
    assert computed(limit, 2) == [False, True] and limit.rows == 32
