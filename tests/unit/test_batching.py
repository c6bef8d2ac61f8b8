"""inferfleet.worker.serving.batching: signatures, batch forming, concat/split, collect,
isolation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from inferfleet.worker.errors import OutputError
from inferfleet.worker.runtime.signature import describe_spec, spec_of
from inferfleet.worker.serving.batching import (
    Request,
    collect,
    concat_inputs,
    form_batches,
    predict_isolated,
    signature_of,
    split_outputs,
)


def f32(rows: int, *trailing: int, start: float = 0.0) -> np.ndarray:
    shape = (rows, *trailing)
    return (np.arange(math.prod(shape), dtype=np.float32) + start).reshape(shape)


def req(name: str, inputs: Any, params: dict | None = None) -> Request:
    params = params or {}
    arrays = (
        [inputs]
        if isinstance(inputs, np.ndarray)
        else (list(inputs.values()) if isinstance(inputs, dict) else list(inputs))
    )
    return Request(
        entry_id=f"{len(name)}-0".encode(),
        rid=name,
        reply_key=f"inferfleet:{{q}}:reply:{name}",
        inputs=inputs,
        params=params,
        rows=arrays[0].shape[0],
        signature=signature_of(inputs, params),
    )


def rid_batches(batches: list[list[Request]]) -> list[list[str]]:
    return [[r.rid for r in batch] for batch in batches]


# --------------------------------------------------------------------------- signatures


def test_equal_forms_dtypes_and_trailing_shapes_share_a_signature() -> None:
    assert signature_of(f32(1, 4), {}) == signature_of(f32(7, 4), {})
    assert signature_of([f32(2, 3), np.zeros(2, np.int64)], {}) == signature_of(
        [f32(9, 3), np.zeros(9, np.int64)], {}
    )
    assert signature_of({"a": f32(1, 2), "b": f32(1)}, {"t": 1}) == signature_of(
        {"b": f32(5), "a": f32(5, 2)}, {"t": 1}
    )


@pytest.mark.parametrize(
    "a,b",
    [
        (f32(2, 4), f32(2, 5)),  # trailing shape
        (f32(2, 4), f32(2, 4, 1)),  # rank
        (f32(2, 4), f32(2, 4).astype(np.float64)),  # dtype
        (f32(2, 4), [f32(2, 4)]),  # tensor vs list
        (f32(2, 4), {"x": f32(2, 4)}),  # tensor vs map
        ([f32(2, 4)], {"x": f32(2, 4)}),  # list vs map
        ([f32(2, 4), f32(2)], [f32(2), f32(2, 4)]),  # positional order
        ({"x": f32(2, 4)}, {"y": f32(2, 4)}),  # keyword names
        ([f32(2, 4)], [f32(2, 4), f32(2, 4)]),  # arity
    ],
    ids=[
        "trailing",
        "rank",
        "dtype",
        "tensor-list",
        "tensor-map",
        "list-map",
        "order",
        "names",
        "arity",
    ],
)
def test_different_inputs_get_different_signatures(a: Any, b: Any) -> None:
    assert signature_of(a, {}) != signature_of(b, {})


def test_different_params_get_different_signatures() -> None:
    x = f32(2, 4)
    assert signature_of(x, {"t": 1}) != signature_of(x, {"t": 2})
    assert signature_of(x, {"t": 1}) != signature_of(x, {})
    assert signature_of(x, {}) == signature_of(x, {})
    hash(signature_of(x, {"nested": [1, {"a": 2}]}))


def test_describe_spec_is_readable() -> None:
    assert describe_spec(spec_of(f32(3, 16))) == "float32[N,16]"
    assert (
        describe_spec(spec_of([f32(3, 2, 2), np.zeros(3, np.int64)]))
        == "(float32[N,2,2], int64[N])"
    )
    assert describe_spec(spec_of({"x": np.zeros((3, 26), np.int64)})) == "{x: int64[N,26]}"


# --------------------------------------------------------------------------- form_batches


def test_form_batches_respects_max_rows_in_arrival_order() -> None:
    reqs = [req(f"r{i}", f32(2, 3)) for i in range(7)]
    batches = form_batches(reqs, max_rows=4)
    assert rid_batches(batches) == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"], ["r6"]]
    assert all(sum(r.rows for r in b) <= 4 for b in batches)


def test_form_batches_packs_uneven_rows_without_exceeding_max_rows() -> None:
    rows = [3, 1, 2, 2, 4, 1]
    reqs = [req(f"r{i}", f32(n, 2)) for i, n in enumerate(rows)]
    batches = form_batches(reqs, max_rows=4)
    assert rid_batches(batches) == [["r0", "r1"], ["r2", "r3"], ["r4"], ["r5"]]
    flat = [r.rid for b in batches for r in b]
    assert flat == [r.rid for r in reqs]


def test_form_batches_separates_signatures_and_keeps_order_within_each() -> None:
    reqs = [
        req("a0", f32(1, 3)),
        req("b0", f32(1, 5)),
        req("a1", f32(1, 3)),
        req("c0", f32(1, 3), {"p": 1}),
        req("b1", f32(1, 5)),
        req("a2", f32(1, 3)),
    ]
    batches = form_batches(reqs, max_rows=64)
    assert sorted(rid_batches(batches)) == [["a0", "a1", "a2"], ["b0", "b1"], ["c0"]]
    for batch in batches:
        assert len({r.signature for r in batch}) == 1


@pytest.mark.parametrize("position", [0, 1, 2])
def test_form_batches_never_splits_an_oversized_request(position: int) -> None:
    reqs = [req(f"s{i}", f32(1, 2)) for i in range(2)]
    big = req("big", f32(10, 2))
    reqs.insert(position, big)
    batches = form_batches(reqs, max_rows=4)
    alone = [b for b in batches if big in b]
    assert alone == [[big]]
    assert sum(len(b) for b in batches) == 3
    assert all(sum(r.rows for r in b) <= 4 for b in batches if big not in b)


def test_form_batches_of_nothing_is_nothing() -> None:
    assert form_batches([], max_rows=8) == []


def test_form_batches_exact_fit() -> None:
    reqs = [req(f"r{i}", f32(4, 1)) for i in range(3)]
    assert rid_batches(form_batches(reqs, max_rows=8)) == [["r0", "r1"], ["r2"]]


# --------------------------------------------------------------------------- concat / split


def test_concat_inputs_tensor() -> None:
    batch = [req("a", f32(2, 3)), req("b", f32(1, 3, start=100))]
    out = concat_inputs(batch)
    np.testing.assert_array_equal(out, np.concatenate([f32(2, 3), f32(1, 3, start=100)]))
    assert not np.shares_memory(out, batch[0].inputs)


def test_concat_inputs_list() -> None:
    batch = [
        req("a", [f32(2, 3), np.array([1, 2], np.int64)]),
        req("b", [f32(1, 3, start=9), np.array([3], np.int64)]),
    ]
    out = concat_inputs(batch)
    assert isinstance(out, list) and len(out) == 2
    np.testing.assert_array_equal(out[0], np.concatenate([f32(2, 3), f32(1, 3, start=9)]))
    np.testing.assert_array_equal(out[1], [1, 2, 3])


def test_concat_inputs_map() -> None:
    batch = [
        req("a", {"x": f32(1, 2), "y": np.array([True])}),
        req("b", {"y": np.array([False, True]), "x": f32(2, 2, start=5)}),
    ]
    out = concat_inputs(batch)
    assert set(out) == {"x", "y"}
    np.testing.assert_array_equal(out["x"], np.concatenate([f32(1, 2), f32(2, 2, start=5)]))
    np.testing.assert_array_equal(out["y"], [True, False, True])


def test_concat_then_split_gives_each_request_its_rows_back() -> None:
    rows = [2, 1, 3]
    batch = [req(f"r{i}", f32(n, 2, start=10 * i)) for i, n in enumerate(rows)]
    parts = split_outputs(concat_inputs(batch) * 2, rows)
    assert len(parts) == 3
    for part, r in zip(parts, batch):
        np.testing.assert_array_equal(part, r.inputs * 2)


def test_split_outputs_tensor_row_boundaries() -> None:
    out = np.arange(6).reshape(6, 1)
    parts = split_outputs(out, [1, 3, 2])
    assert [p.ravel().tolist() for p in parts] == [[0], [1, 2, 3], [4, 5]]


def test_split_outputs_list_and_tuple() -> None:
    a, b = np.arange(5), np.arange(10).reshape(5, 2)
    for outputs in ([a, b], (a, b)):
        parts = split_outputs(outputs, [2, 3])
        assert len(parts) == 2
        assert isinstance(parts[0], list) and len(parts[0]) == 2
        assert parts[0][0].tolist() == [0, 1] and parts[1][0].tolist() == [2, 3, 4]
        assert parts[1][1].tolist() == [[4, 5], [6, 7], [8, 9]]


def test_split_outputs_dict() -> None:
    outputs = {"p": np.arange(4, dtype=np.float32), "k": np.arange(8).reshape(4, 2)}
    parts = split_outputs(outputs, [1, 3])
    assert [set(p) for p in parts] == [{"p", "k"}, {"p", "k"}]
    assert parts[0]["p"].tolist() == [0.0]
    assert parts[1]["k"].tolist() == [[2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("rows", [3, 5])
def test_split_outputs_wrong_row_count_is_output_error(rows: int) -> None:
    with pytest.raises(OutputError, match="rows"):
        split_outputs(np.zeros((rows, 2)), [2, 2])
    with pytest.raises(OutputError, match="rows"):
        split_outputs([np.zeros(4), np.zeros(rows)], [2, 2])
    with pytest.raises(OutputError, match="'k'"):
        split_outputs({"ok": np.zeros(4), "k": np.zeros(rows)}, [2, 2])


@pytest.mark.parametrize(
    "outputs",
    [
        [1.0, 2.0, 3.0],  # python floats
        np.float32(1.0),  # a numpy scalar
        np.array(3.0),  # a 0-d array
        "text",
        None,
        {"a": [1, 2, 3]},
        [np.zeros(3), 5],
        [],
    ],
    ids=["floats", "np-scalar", "0d", "str", "none", "dict-of-list", "list-with-int", "empty-list"],
)
def test_split_outputs_non_array_outputs_are_output_error(outputs: Any) -> None:
    with pytest.raises(OutputError):
        split_outputs(outputs, [1, 2])


def test_split_outputs_empty_dict_is_output_error() -> None:
    # OUTPUTS has the same forms as INPUTS, and an empty map is not one.
    with pytest.raises(OutputError):
        split_outputs({}, [1, 2])


# --------------------------------------------------------------------------- collect


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeRead:
    """Serves scripted batches of items; each call may advance the fake clock."""

    def __init__(self, clock: FakeClock, script: list[list[int]], advance_s: float = 0.0) -> None:
        self.clock = clock
        self.script = list(script)
        self.advance_s = advance_s
        self.calls: list[tuple[int, float | None]] = []

    def __call__(self, max_items: int, timeout_s: float | None) -> list[int]:
        self.calls.append((max_items, timeout_s))
        assert len(self.calls) < 1000, "collect keeps reading after its deadline"
        self.clock.now += self.advance_s
        return list(self.script.pop(0)) if self.script else []


def rows_of(item: int) -> int:
    return item


def test_collect_returns_nothing_when_the_first_read_is_empty() -> None:
    clock = FakeClock()
    read = FakeRead(clock, [[], [5]])
    assert collect(read, max_rows=8, max_wait_s=1.0, rows_of=rows_of, clock=clock) == []
    assert read.calls == [(8, None)]


def test_collect_stops_at_max_rows() -> None:
    clock = FakeClock()
    read = FakeRead(clock, [[2], [3], [3], [7]])
    items = collect(read, max_rows=8, max_wait_s=10.0, rows_of=rows_of, clock=clock)
    assert items == [2, 3, 3]
    assert len(read.calls) == 3


def test_collect_first_read_over_max_rows_returns_at_once() -> None:
    clock = FakeClock()
    read = FakeRead(clock, [[9]])
    assert collect(read, max_rows=8, max_wait_s=10.0, rows_of=rows_of, clock=clock) == [9]
    assert len(read.calls) == 1


class FakeSleep:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        self.clock.now += seconds


def test_collect_reads_without_blocking_and_passes_the_row_budget() -> None:
    clock = FakeClock()
    read = FakeRead(clock, [[1], [2], [], [1]], advance_s=0.01)
    sleep = FakeSleep(clock)
    items = collect(
        read, max_rows=10, max_wait_s=1.0, rows_of=rows_of, clock=clock, sleep=sleep, linger_s=0.1
    )
    assert items == [1, 2, 1]
    assert [c[0] for c in read.calls] == [10, 9, 7, 7, 6, 6]
    assert [c[1] for c in read.calls] == [None, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert sleep.calls == [
        0.1,
        0.1,
    ]  # lingered after each empty read; closed on the second quiet one


def test_collect_closes_the_batch_after_a_quiet_linger() -> None:
    clock = FakeClock()
    read = FakeRead(clock, [[1], [], [], [5]])
    sleep = FakeSleep(clock)
    items = collect(
        read, max_rows=8, max_wait_s=10.0, rows_of=rows_of, clock=clock, sleep=sleep, linger_s=0.001
    )
    assert items == [1]  # did not wait out the 10 s for the [5]
    assert sleep.calls == [0.001] and clock.now - 1000.0 < 0.01


def test_collect_does_not_linger_after_waiting_for_the_first_item() -> None:
    clock = FakeClock()
    read = FakeRead(clock, [[1], [], [5]])

    def idle_first(max_items: int, timeout_s: float | None) -> list[int]:
        if timeout_s is None:
            clock.now += 0.2  # the queue was empty: we blocked for the first item
        return read(max_items, timeout_s)

    sleep = FakeSleep(clock)
    items = collect(
        idle_first,
        max_rows=8,
        max_wait_s=1.0,
        rows_of=rows_of,
        clock=clock,
        sleep=sleep,
        linger_s=0.001,
    )
    assert items == [1] and sleep.calls == []  # sparse traffic: closed at the first empty poll


def test_collect_never_lingers_past_the_deadline() -> None:
    clock = FakeClock()
    read = FakeRead(clock, [[1], [], []], advance_s=0.0)
    sleep = FakeSleep(clock)
    collect(
        read,
        max_rows=8,
        max_wait_s=0.0002,
        rows_of=rows_of,
        clock=clock,
        sleep=sleep,
        linger_s=0.001,
    )
    assert sleep.calls == [pytest.approx(0.0002)]


def test_collect_stops_when_max_wait_passes() -> None:
    clock = FakeClock()
    read = FakeRead(clock, [[1]] * 100, advance_s=0.3)
    items = collect(
        read, max_rows=1000, max_wait_s=1.0, rows_of=rows_of, clock=clock, sleep=FakeSleep(clock)
    )
    # First read (t=0.3, starts the wait), then reads at remaining 1.0, 0.7, 0.4, 0.1.
    assert items == [1] * 5


def test_collect_with_zero_wait_reads_once() -> None:
    clock = FakeClock()
    read = FakeRead(clock, [[1], [1]])
    assert collect(read, max_rows=8, max_wait_s=0.0, rows_of=rows_of, clock=clock) == [1]
    assert len(read.calls) == 1


def test_collect_wait_starts_after_the_first_item() -> None:
    clock = FakeClock()
    read = FakeRead(clock, [[1], [1]], advance_s=0.5)

    def slow_first(max_items: int, timeout_s: float | None) -> list[int]:
        if timeout_s is None:
            clock.now += 100.0  # a long idle block before the first item
        return read(max_items, timeout_s)

    items = collect(
        slow_first, max_rows=8, max_wait_s=1.0, rows_of=rows_of, clock=clock, sleep=FakeSleep(clock)
    )
    assert items == [1, 1]  # the second read came 0.5 s after the first: inside the 1 s wait


# --------------------------------------------------------------------------- predict_isolated


class PoisonModel:
    """A batch predict that raises whenever the batch contains a poison item."""

    def __init__(self, poison: set[int]) -> None:
        self.poison = poison
        self.calls = 0

    def __call__(self, batch: Sequence[int]) -> list[int]:
        self.calls += 1
        bad = [x for x in batch if x in self.poison]
        if bad:
            raise RuntimeError(f"poison {bad}")
        return [x * 10 for x in batch]


def test_predict_isolated_without_failure_calls_predict_once() -> None:
    model = PoisonModel(set())
    assert predict_isolated(list(range(8)), model) == [x * 10 for x in range(8)]
    assert model.calls == 1


@pytest.mark.parametrize(
    "n,poison",
    [
        (1, {0}),
        (8, {3}),
        (64, {0}),
        (64, {63}),
        (64, {5, 40}),
        (100, {1, 2, 3}),
        (37, {0, 18, 36}),
        (128, {7, 70, 71, 127}),
    ],
)
def test_predict_isolated_fails_only_poison_items(n: int, poison: set[int]) -> None:
    model = PoisonModel(poison)
    results = predict_isolated(list(range(n)), model)
    assert len(results) == n
    for i, result in enumerate(results):
        if i in poison:
            assert isinstance(result, RuntimeError)
            assert str(result) == f"poison [{i}]"  # raised by the item alone
        else:
            assert result == i * 10
    k = len(poison)
    assert model.calls <= 1 + 2 * k * math.ceil(math.log2(n))


def test_predict_isolated_all_poison() -> None:
    model = PoisonModel(set(range(4)))
    results = predict_isolated(list(range(4)), model)
    assert all(isinstance(r, RuntimeError) for r in results)
    assert [str(r) for r in results] == [f"poison [{i}]" for i in range(4)]


def test_predict_isolated_call_count_grows_logarithmically() -> None:
    counts = {}
    for n in (16, 256, 4096):
        model = PoisonModel({n // 3})
        predict_isolated(list(range(n)), model)
        counts[n] = model.calls
    assert counts[16] <= 1 + 2 * 4
    assert counts[256] <= 1 + 2 * 8
    assert counts[4096] <= 1 + 2 * 12


# --------------------------------------------------------------------------- pinned by the mutation
# run (issue 35, docs/benchmarks.md): each rule below had a mutant that no test told apart


def _arrays(inputs: Any) -> list[np.ndarray]:
    if isinstance(inputs, dict):
        return list(inputs.values())
    return list(inputs) if isinstance(inputs, list) else [inputs]


@pytest.mark.parametrize(
    "inputs",
    [f32(2, 3), [f32(2, 3), np.array([1, 2], np.int64)], {"x": f32(1, 2)}],
    ids=["tensor", "list", "map"],
)
def test_a_batch_of_one_is_its_own_inputs_copied(inputs: Any) -> None:
    out = concat_inputs([req("a", inputs)])
    assert type(out) is type(inputs)
    for got, want in zip(_arrays(out), _arrays(inputs), strict=True):
        np.testing.assert_array_equal(got, want)
        assert not np.shares_memory(got, want)


@pytest.mark.parametrize(
    ("outputs", "says"),
    [
        (np.zeros((3, 2)), "output: the model returned 3 rows for a batch of 4"),
        ([np.zeros(4), np.zeros(5)], "output 1: the model returned 5 rows for a batch of 4"),
        (
            {"ok": np.zeros(4), "k": np.zeros(3)},
            "output 'k': the model returned 3 rows for a batch of 4",
        ),
        (np.array(3.0), "output: a model output must be a tensor with a row dimension"),
        ({}, "the model returned an empty map"),
        ((), "the model returned an empty sequence"),
    ],
    ids=["tensor", "list", "map", "0d", "empty-map", "empty-sequence"],
)
def test_a_bad_output_says_which_output_and_what_was_wrong(outputs: Any, says: str) -> None:
    with pytest.raises(OutputError) as info:
        split_outputs(outputs, [1, 3])
    assert str(info.value) == says


def test_collect_lingers_half_a_millisecond_unless_told() -> None:
    # the consumer leaves linger_s at its default: a quiet poll waits 0.5 ms for a straggler
    clock = FakeClock()
    read = FakeRead(clock, [[1], [], []])
    sleep = FakeSleep(clock)
    assert collect(read, 8, 10.0, rows_of, clock=clock, sleep=sleep) == [1]
    assert sleep.calls == [0.0005]
