"""Pure batching: request signatures, batch collection and forming, output splitting.

Nothing here touches Redis, torch or a clock of its own: the consumer passes
in a ``read`` function and a clock, so every rule is unit-tested in
microseconds with fakes.

Two requests can share a batch when their *signature* is equal: the same
input spec (:mod:`inferfleet.worker.runtime.signature`: form, dtypes and
trailing shapes) and the same params. Their tensors are then concatenated
row-wise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from inferfleet.worker.errors import OutputError
from inferfleet.worker.runtime.signature import spec_of

__all__ = [
    "Request",
    "signature_of",
    "collect",
    "form_batches",
    "concat_inputs",
    "split_outputs",
    "predict_isolated",
]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(slots=True)
class Request:
    """One decoded request, ready to be batched."""

    entry_id: bytes
    rid: str
    reply_key: str
    inputs: Any  # np.ndarray | list[np.ndarray] | dict[str, np.ndarray]
    params: dict
    rows: int
    signature: Hashable
    enqueued_ms: int = 0
    picked_ms: float = 0.0
    extra: dict = field(default_factory=dict)
    lane: int = 1  # 0 high, 1 normal (the contract's stream), 2 low: the stream its XACK goes to


def signature_of(inputs: Any, params: dict, spec: Hashable | None = None) -> Hashable:
    """Requests with equal signatures can be concatenated into one batch.

    Pass ``spec`` when already computed (``spec_of(inputs)``) to save the work.
    """
    return (spec if spec is not None else spec_of(inputs), repr(params) if params else "")


def collect(
    read: Callable[[int, float | None], list[T]],
    max_rows: int,
    max_wait_s: float,
    rows_of: Callable[[T], int],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    linger_s: float = 0.0005,
) -> list[T]:
    """Gather items for one round of batching.

    ``read(max_items, timeout_s)`` returns what has arrived: ``timeout_s`` None
    means "block for the idle period", 0.0 "do not block". After the first
    item, keep reading while items keep coming, until ``max_rows`` rows or
    ``max_wait_s``. A batch also closes once nothing new arrived for
    ``linger_s`` (not at all if the first item itself had to be waited for):
    when no more requests are on their way (a closed loop of a few clients
    waiting on us), waiting out ``max_wait_s`` would only add latency. Under
    load, reads keep returning items and batches fill up.
    """
    started = clock()
    items = read(max_rows, None)
    if not items:
        return []
    rows = sum(rows_of(item) for item in items)
    deadline = clock() + max_wait_s
    # If we had to wait for the first item, requests are sparse: lingering would
    # mostly add latency, so close at the first empty poll.
    lingered = deadline - max_wait_s - started > linger_s
    while rows < max_rows:
        remaining = deadline - clock()
        if remaining <= 0:
            break
        more = read(max_rows - rows, 0.0)
        if more:
            items.extend(more)
            rows += sum(rows_of(item) for item in more)
            lingered = False
        elif lingered:
            break  # quiet for a whole linger: the batch is complete
        else:
            sleep(min(linger_s, remaining))
            lingered = True
    return items


def form_batches(requests: Sequence[Request], max_rows: int) -> list[list[Request]]:
    """Group requests by signature, in arrival order, into batches of at most max_rows.

    A request larger than ``max_rows`` is never split: it runs as a batch of its own.
    """
    groups: dict[Hashable, list[list[Request]]] = {}
    rows: dict[Hashable, int] = {}
    for req in requests:
        batches = groups.setdefault(req.signature, [[]])
        if batches[-1] and rows[req.signature] + req.rows > max_rows:
            batches.append([])
            rows[req.signature] = 0
        batches[-1].append(req)
        rows[req.signature] = rows.get(req.signature, 0) + req.rows
    return [batch for batches in groups.values() for batch in batches]


def concat_inputs(batch: Sequence[Request]) -> Any:
    """Concatenate the inputs of same-signature requests row-wise (always a fresh copy)."""
    first = batch[0].inputs
    if isinstance(first, np.ndarray):
        return np.concatenate([r.inputs for r in batch])
    if isinstance(first, dict):
        return {k: np.concatenate([r.inputs[k] for r in batch]) for k in first}
    return [np.concatenate([r.inputs[i] for r in batch]) for i in range(len(first))]


def _split_one(arr: Any, bounds: list[int], where: str) -> list[np.ndarray]:
    if not isinstance(arr, np.ndarray) or arr.ndim == 0:
        raise OutputError(f"{where}: a model output must be a tensor with a row dimension")
    if arr.shape[0] != bounds[-1]:
        raise OutputError(
            f"{where}: the model returned {arr.shape[0]} rows for a batch of {bounds[-1]}"
        )
    return [arr[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]


def split_outputs(outputs: Any, row_counts: Sequence[int]) -> list[Any]:
    """Split batched outputs (tensor, list or dict of numpy arrays) back per request."""
    bounds = [0]
    for n in row_counts:
        bounds.append(bounds[-1] + n)
    if isinstance(outputs, dict):
        if not outputs:
            raise OutputError("the model returned an empty map")
        parts = {k: _split_one(v, bounds, f"output {k!r}") for k, v in outputs.items()}
        return [{k: parts[k][i] for k in parts} for i in range(len(row_counts))]
    if isinstance(outputs, (list, tuple)):
        if not outputs:
            raise OutputError("the model returned an empty sequence")
        cols = [_split_one(v, bounds, f"output {j}") for j, v in enumerate(outputs)]
        return [[col[i] for col in cols] for i in range(len(row_counts))]
    return _split_one(outputs, bounds, "output")


def predict_isolated(
    batch: Sequence[R],
    predict: Callable[[Sequence[R]], list[T]],
) -> list[T | Exception]:
    """Run ``predict`` on the batch; if it raises, bisect so only guilty requests fail.

    Returns one result per request: its output or the exception that its
    smallest failing sub-batch (itself alone) raised.
    """
    try:
        results: list[T | Exception] = list(predict(batch))
        return results
    except Exception as exc:  # noqa: BLE001 - any model failure is isolated
        if len(batch) == 1:
            return [exc]
    mid = len(batch) // 2
    return predict_isolated(batch[:mid], predict) + predict_isolated(batch[mid:], predict)
