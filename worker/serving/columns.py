"""Columnar admission: the entries of one read that fit a learnt body template, decoded in one pass.

A busy queue's reads are mostly entries that differ only in their ids and
their tensor bytes: one producer (or several of one kind) and one model. For
those, building a :class:`~inferfleet.worker.serving.batching.Request` per
entry, checking each field by itself and decoding each body by itself is
most of a worker's CPU. :func:`admit_read` takes a whole raw XREADGROUP read
and splits it:

* entries whose fields are ``id, body`` followed only by ``deadline`` and
  ``reply_to`` that are fine now (a deadline not yet passed, an inbox the
  intake has already checked), and whose body has the length and the bytes
  outside its tensors' data of a template the intake learnt
  (:class:`~inferfleet.worker.serving.templates.BodyTemplate`): gathered into one
  :class:`Columns` per template. Their ids are checked by one regular
  expression over the joined ids, their fixed bytes by one numpy comparison
  a run, their tensors decoded by one copy each;
* everything else: through :meth:`Intake.admit_fast`, one entry at a time,
  exactly as before.

The outcome for each entry is the one :meth:`Intake.admit` would give (a test
holds the two together on generated reads). Pure: no Redis, no torch, the
time passed in.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from inferfleet.producer.protocol import all_request_ids, deadline_open, is_request_id
from inferfleet.worker.serving.batching import Request
from inferfleet.worker.serving.intake import Answer, Intake, fields_of

__all__ = ["Columns", "admit_read", "merge_columns"]

#: The only fields besides id and body that the columnar path understands.
_EXTRA_FIELDS = frozenset((b"deadline", b"reply_to"))
_UNSEEN = object()


@dataclass(slots=True)
class Columns:
    """Requests of one read (or round) with one body template: one signature, decoded at once.

    ``inputs`` holds every request's rows in order (``rows_each`` each), in
    the form of the requests' bodies (a tensor, a list or a map of tensors);
    ``reply_keys`` is where each one's reply goes.
    """

    entry_ids: list[bytes]
    rids: list[bytes]
    reply_keys: list[bytes]
    inputs: Any
    rows_each: int
    signature: Hashable
    picked_ms: float

    @property
    def rows(self) -> int:
        """Rows of all requests together (what a batch's row limit counts)."""
        return len(self.entry_ids) * self.rows_each

    def __len__(self) -> int:
        return len(self.entry_ids)

    def enqueued_ms(self) -> list[int]:
        """When each entry was added (the millisecond part of its stream id)."""
        return [int(entry_id.partition(b"-")[0]) for entry_id in self.entry_ids]

    def queue_waits_s(self) -> list[float]:
        """Each request's wait in the queue, in seconds (for the metrics)."""
        picked = self.picked_ms
        return [(picked - enqueued) / 1000.0 for enqueued in self.enqueued_ms()]

    def requests(self) -> list[Request]:
        """The same requests as the general path's objects (when a batch leaves the fast path)."""
        return [
            Request(
                entry_id,
                rid.decode("ascii"),
                key.decode("ascii"),
                self._inputs_at(i),
                {},
                self.rows_each,
                self.signature,
                enqueued,
                self.picked_ms,
            )
            for i, (entry_id, rid, key, enqueued) in enumerate(
                zip(self.entry_ids, self.rids, self.reply_keys, self.enqueued_ms())
            )
        ]

    def _inputs_at(self, i: int) -> Any:
        rows = slice(i * self.rows_each, (i + 1) * self.rows_each)
        if isinstance(self.inputs, np.ndarray):
            return self.inputs[rows]
        if isinstance(self.inputs, dict):
            return {name: arr[rows] for name, arr in self.inputs.items()}
        return [arr[rows] for arr in self.inputs]


def merge_columns(parts: Sequence[Columns]) -> list[Columns]:
    """Join the columns of one round that share a signature (several reads of one batch)."""
    by_signature: dict[Hashable, list[Columns]] = {}
    for part in parts:
        by_signature.setdefault((part.signature, part.rows_each), []).append(part)
    merged = []
    for group in by_signature.values():
        if len(group) == 1:
            merged.append(group[0])
            continue
        first = group[0]
        merged.append(
            Columns(
                [e for part in group for e in part.entry_ids],
                [r for part in group for r in part.rids],
                [k for part in group for k in part.reply_keys],
                _concat([part.inputs for part in group]),
                first.rows_each,
                first.signature,
                min(part.picked_ms for part in group),
            )
        )
    return merged


def _concat(parts: list[Any]) -> Any:
    """Inputs of one form concatenated row-wise."""
    first = parts[0]
    if isinstance(first, np.ndarray):
        return np.concatenate(parts)
    if isinstance(first, dict):
        return {name: np.concatenate([part[name] for part in parts]) for name in first}
    return [np.concatenate([part[i] for part in parts]) for i in range(len(first))]


class _Group:
    """The entries of one read that may share one template (same body length)."""

    __slots__ = ("bodies", "entries", "keys", "rids")

    def __init__(self) -> None:
        self.entries: list[Any] = []
        self.rids: list[bytes] = []
        self.bodies: list[bytes] = []
        self.keys: list[bytes | None] = []


def admit_read(
    intake: Intake, entries: Sequence[Any], now_ms: float
) -> list[Request | Answer | Columns]:
    """Admit one raw read: :class:`Columns` for what fits a template, the rest one by one.

    ``entries`` are XREADGROUP's ``[entry id, [name, value, ...]]`` pairs as
    hiredis returns them (fields as a dict, or None, also work: they take the
    general path).
    """
    rest: list[Any] = []
    uniform = _uniform(intake, entries, now_ms)
    groups = (
        {len(uniform.bodies[0]): uniform}
        if uniform is not None
        else _grouped(intake, entries, now_ms, rest)
    )
    admitted: list[Request | Answer | Columns] = []
    for length, group in groups.items():
        columns = _columns(intake, length, group, now_ms, rest)
        if columns is not None:
            admitted.append(columns)
    admitted.extend(_admit_each(intake, rest, now_ms))
    return admitted


def _uniform(intake: Intake, entries: Sequence[Any], now_ms: float) -> _Group | None:
    """The whole read as one group when every entry has the same field names and body length, the
    extra fields are fine and every body is bytes, all checked by passes in C rather than a loop an
    entry (the common read: one producer's round); None: :func:`_grouped` decides entry by entry."""
    try:
        flats = [entry[1] for entry in entries]
        if len(set(map(len, flats))) != 1:
            return None
        columns = list(zip(*flats))
    except TypeError:  # a deleted entry (None) or a field that is not a list
        return None
    names = [set(column) for column in columns[0::2]]
    if len(columns) < 4 or not all(len(name) == 1 for name in names):
        return None
    fields = [next(iter(name)) for name in names]
    if (
        fields[:2] != [b"id", b"body"]
        or len(set(fields)) != len(fields)
        or not _EXTRA_FIELDS.issuperset(fields[2:])
    ):
        return None
    bodies = columns[3]
    if len(set(map(len, bodies))) != 1 or set(map(type, bodies)) != {bytes}:
        return None
    group = _Group()
    group.entries, group.rids, group.bodies = list(entries), list(columns[1]), list(bodies)
    group.keys = [None] * len(flats)
    for name, values in zip(fields[2:], columns[5::2]):
        if not all(
            _extra_verdict(intake, (name, value), now_ms) is not False for value in set(values)
        ):
            return None
        if name == b"reply_to":
            group.keys = list(values)
    return group


def _grouped(
    intake: Intake, entries: Sequence[Any], now_ms: float, rest: list[Any]
) -> dict[int, _Group]:
    """Entries that may share a template, grouped by body length; the others go to ``rest``."""
    groups: dict[int, _Group] = {}
    verdicts: dict[
        tuple, Any
    ] = {}  # the extra fields seen in this read -> reply key, None (default), False
    for entry in entries:
        fields = entry[1]
        if (
            fields.__class__ is not list
            or len(fields) < 4
            or fields[0] != b"id"
            or fields[2] != b"body"
        ):
            rest.append(entry)
            continue
        key = None
        if len(fields) > 4:
            extra = tuple(fields[4:])
            key = verdicts.get(extra, _UNSEEN)
            if key is _UNSEEN:
                key = verdicts[extra] = _extra_verdict(intake, extra, now_ms)
            if key is False:
                rest.append(entry)
                continue
        body = fields[3]
        group = groups.get(len(body))
        if group is None:
            group = groups[len(body)] = _Group()
        group.entries.append(entry)
        group.rids.append(fields[1])
        group.bodies.append(body)
        group.keys.append(key)
    return groups


def _admit_each(intake: Intake, entries: list[Any], now_ms: float) -> list[Request | Answer]:
    admit = intake.admit_fast
    return [
        admit(
            entry_id,
            fields if isinstance(fields, dict) or fields is None else fields_of(fields),
            now_ms,
        )
        for entry_id, fields in entries
    ]


def _extra_verdict(intake: Intake, extra: tuple, now_ms: float) -> bytes | bool | None:
    """The reply key the extra fields ask for (None: the default one).

    False where the general path must decide.
    """
    names = extra[0::2]
    if len(extra) % 2 or len(set(names)) != len(names) or not _EXTRA_FIELDS.issuperset(names):
        return False
    values = dict(zip(names, extra[1::2]))
    deadline = values.get(b"deadline")
    if deadline is not None and not deadline_open(deadline, now_ms):
        return False  # malformed or expired: answered by the general path
    reply_to = values.get(b"reply_to")
    if reply_to is None:
        return None
    checked = intake.checked_inbox(reply_to)
    return False if checked is None else reply_to


def _columns(
    intake: Intake, length: int, group: _Group, now_ms: float, rest: list[Any]
) -> Columns | None:
    """The group's entries that fit the template of their body length, as Columns.

    The others go to ``rest``.
    """
    known = intake.template_for(length)
    if known is None:
        rest.extend(group.entries)
        return None
    template, signature = known
    data = np.frombuffer(b"".join(group.bodies), np.uint8).reshape(len(group.bodies), length)
    fits = template.fitting(data) & _valid_ids(group.rids)
    if not fits.all():
        rest.extend(entry for entry, ok in zip(group.entries, fits.tolist()) if not ok)
        keep = np.flatnonzero(fits).tolist()
        if not keep:
            return None
        data = data[fits]
        for name in ("entries", "rids", "keys"):
            setattr(group, name, [getattr(group, name)[i] for i in keep])
    default = intake.reply_prefix
    keys = [default + rid if key is None else key for rid, key in zip(group.rids, group.keys)]
    return Columns(
        [entry[0] for entry in group.entries],
        group.rids,
        keys,
        template.inputs_many(data),
        template.rows,
        signature,
        now_ms,
    )


def _valid_ids(rids: list[Any]) -> np.ndarray:
    """Which ids are valid request ids: a bool each (one match over all of them, mostly)."""
    if all_request_ids(rids):
        return np.ones(len(rids), bool)
    return np.fromiter(
        (rid.__class__ is bytes and is_request_id(rid) for rid in rids), bool, len(rids)
    )
