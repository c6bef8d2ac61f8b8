"""The worker's templates: request bodies decoded and ok replies encoded without msgpack.

Both are derived from the general codec, never written as msgpack bytes by
hand. :class:`BodyTemplate` is learnt from a body that was decoded in full
and proved on it; :class:`ReplyTemplate` encodes sample replies with
:func:`~inferfleet.producer.protocol.encode_reply_ok`, locates the slots
that change (the id, the data, the queue wait) by varying each one, and
proves the result on another sample. tests/unit/test_columns.py and
tests/unit/test_rule_paths.py hold both to the general path.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import (
    STR_HEADERS,
    Inputs,
    decode_body,
    encode_reply_ok,
    pack,
    reply_timing,
)

__all__ = ["QUEUED_SIZE", "BodyTemplate", "ReplyTemplate"]

_DOUBLE = struct.Struct(">d")
#: The bytes of a reply's packed ``queued_ms``, a big-endian double (the slot's size).
QUEUED_SIZE = _DOUBLE.size
# Two queue waits whose doubles differ in every byte, to locate the slot they fill.
_WAITS = (_DOUBLE.unpack(b"\x40" + b"\x11" * 7)[0], _DOUBLE.unpack(b"\x41" + b"\x22" * 7)[0])
# Where a batch's timing tail starts in its packed timing map: just after queued_ms's double.
_TAIL_AT = pack(reply_timing(_WAITS[0], 0.0, 0)).index(_DOUBLE.pack(_WAITS[0])) + QUEUED_SIZE


@dataclass(frozen=True)
class BodyTemplate:
    """The bytes every body of one input spec shares, so the worker can skip decoding them.

    Learnt from a body that was fully decoded and admitted: a map with only
    ``inputs`` (or empty ``params``) holding one tensor, a list or a map of
    them (no bool tensors: their data bytes are checked one by one). Another
    body of the same length with the same bytes outside the tensors' data
    (``consts``) has the same structure, dtypes and shapes byte for byte, so
    it decodes to the same checks passed: only the data differ.

    The data ranges are found by searching the body for each tensor's bytes
    and then proved: the body with every data byte flipped must decode to
    exactly the flipped tensors, or nothing is learnt.
    """

    length: int
    consts: tuple[tuple[int, bytes], ...]  # (offset, bytes) every fitting body repeats
    tensors: tuple[
        tuple[int, np.dtype, tuple[int, ...]], ...
    ]  # (offset, dtype, shape) of each tensor's data
    names: tuple[str, ...] | None  # a map's keys in order; None for one tensor or a list
    single: bool  # one tensor, not a list of one

    @property
    def rows(self) -> int:
        """Rows of every fitting body's request."""
        return self.tensors[0][2][0]

    @classmethod
    def learn(cls, body: bytes, inputs: Inputs, params: dict) -> BodyTemplate | None:
        """The template of ``body`` (decoded to ``inputs``, ``params``), or None if it has none."""
        arrays = _tensors_of(inputs)
        if params or arrays is None:
            return None
        tensors, start = [], 0
        for arr in arrays:
            at = body.find(arr.tobytes(), start)
            if at < 0:
                return None
            tensors.append((at, arr.dtype, arr.shape))
            start = at + arr.nbytes
        ranges = [(at, at + int(np.prod(shape)) * dtype.itemsize) for at, dtype, shape in tensors]
        ends = [0] + [end for _, end in ranges]
        consts = tuple(
            (end, body[end:at]) for end, (at, _) in zip(ends, [*ranges, (len(body), 0)]) if at > end
        )
        template = cls(
            len(body),
            consts,
            tuple(tensors),
            tuple(inputs) if isinstance(inputs, dict) else None,
            isinstance(inputs, np.ndarray),
        )
        return template if template._proved(body, ranges) else None

    def _proved(self, body: bytes, ranges: list[tuple[int, int]]) -> bool:
        """Flip every data byte: the body must decode to exactly the flipped tensors, as before."""
        flipped = np.frombuffer(body, np.uint8).copy()
        for start, end in ranges:
            flipped[start:end] ^= 0xFF
        try:
            inputs, params = decode_body(flipped.tobytes())
        except ProtocolError:
            return False
        if isinstance(inputs, dict):
            same_form = self.names == tuple(inputs)
        else:
            same_form = self.names is None and self.single == isinstance(inputs, np.ndarray)
        got = _tensors_of(inputs)
        want = _tensors_of(self._inputs_of(flipped.reshape(1, -1)))
        return (
            not params
            and same_form
            and got is not None
            and want is not None
            and len(got) == len(want)
            and all(
                a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
                for a, b in zip(got, want)
            )
        )

    def fitting(self, bodies: np.ndarray) -> np.ndarray:
        """Which rows of ``bodies`` (uint8, one body of ``length`` bytes a row) fit: a bool each."""
        fits = np.ones(len(bodies), bool)
        for at, const in self.consts:
            fits &= (bodies[:, at : at + len(const)] == np.frombuffer(const, np.uint8)).all(axis=1)
        return fits

    def _inputs_of(self, bodies: np.ndarray) -> Inputs:
        """The inputs of fitting ``bodies`` (uint8 rows), concatenated row-wise, in this form."""
        arrays = []
        for at, dtype, shape in self.tensors:
            nbytes = int(np.prod(shape)) * dtype.itemsize
            # a copy, always: a one-row slice counts as contiguous, so ascontiguousarray would keep
            # its row stride (the body's length), which is no multiple of the dtype's size
            arr = bodies[:, at : at + nbytes].copy().view(dtype)
            arrays.append(arr.reshape((len(bodies) * shape[0],) + shape[1:]))
        if self.single:
            return arrays[0]
        return dict(zip(self.names, arrays)) if self.names is not None else arrays

    def inputs_many(self, bodies: np.ndarray) -> Inputs:
        """Every fitting body's inputs (``bodies``: uint8, one a row), concatenated row-wise.

        One copy a tensor.
        """
        return self._inputs_of(bodies)

    def inputs_of(self, body: bytes) -> Inputs | None:
        """``body``'s inputs if it fits this template, else None."""
        if len(body) != self.length or not all(
            body.startswith(const, at) for at, const in self.consts
        ):
            return None
        if self.single:
            at, dtype, shape = self.tensors[0]
            return np.frombuffer(body, dtype, offset=at, count=int(np.prod(shape))).reshape(shape)
        return self._inputs_of(np.frombuffer(body, np.uint8).reshape(1, -1))


def _tensors_of(inputs: Inputs) -> list[np.ndarray] | None:
    """The tensors of decoded inputs in body order, or None where a template cannot hold them."""
    arrays = (
        [inputs]
        if isinstance(inputs, np.ndarray)
        else list(inputs.values())
        if isinstance(inputs, dict)
        else list(inputs)
        if isinstance(inputs, list)
        else None
    )
    if not arrays or not all(
        isinstance(a, np.ndarray) and a.size and a.dtype.kind != "b" for a in arrays
    ):
        return None
    return arrays


class ReplyTemplate:
    """Encodes the ok replies of one model and one output spec from precomputed bytes.

    The result equals :func:`encode_reply_ok` byte for byte (a test holds
    them together) for outputs that are one tensor of ``dtype`` and ``shape``,
    at a fraction of its cost: per reply only the id, the data and the
    queue wait change; the batch's timing tail is encoded once per batch.
    Raises ProtocolError for outputs the template cannot hold (the general
    encoder answers those).
    """

    def __init__(self, model: tuple[str, str], dtype: np.dtype, shape: tuple[int, ...]) -> None:
        data = _sample_data(dtype, shape)
        self.nbytes = data[0].nbytes
        self._model = model
        parts = self._located(data)
        self._head, self._ok_outputs, self._model_queued = parts
        self._prove(dtype, shape, data[1])

    def _sample(self, rid: str, data: np.ndarray, queued: float, infer: float, rows: int) -> bytes:
        return encode_reply_ok(rid, data, self._model, reply_timing(queued, infer, rows))

    def _located(self, data: tuple[np.ndarray, np.ndarray]) -> tuple[bytes, bytes, bytes]:
        """The fixed parts around the id, the data and the queue wait of a sample reply."""
        rid, other = "a" * 8, "b" * 8
        whole = self._sample(rid, data[0], _WAITS[0], 1.5, 3)
        id_at = _slot(whole, self._sample(other, data[0], _WAITS[0], 1.5, 3))
        data_at = _slot(whole, self._sample(rid, data[1], _WAITS[0], 1.5, 3))
        wait_at = _slot(whole, self._sample(rid, data[0], _WAITS[1], 1.5, 3))
        header = STR_HEADERS[len(rid)]
        if not (
            id_at[1] <= data_at[0]
            and data_at[1] <= wait_at[0]
            and whole[wait_at[0] : wait_at[1]] == _DOUBLE.pack(_WAITS[0])
            and whole[: id_at[0]].endswith(header)
            and whole[wait_at[1] :] == self.batch_tail(1.5, 3)
        ):
            raise ProtocolError("the reply's slots could not be located in their usual order")
        return (
            whole[: id_at[0] - len(header)],
            whole[id_at[1] : data_at[0]],
            whole[data_at[1] : wait_at[0]],
        )

    def _prove(self, dtype: np.dtype, shape: tuple[int, ...], data: np.ndarray) -> None:
        """Encode another sample (long id, other data, wait, tail) both ways: they must agree."""
        rid = "p" * 40
        want = self._sample(rid, data, 7.25, 2.5, 9)
        if self.encode(rid, data.tobytes(), 7.25, self.batch_tail(2.5, 9)) != want:
            raise ProtocolError(f"no reply template for {dtype} {shape}: the proof failed")

    @staticmethod
    def batch_tail(infer_ms: float, batch_rows: int) -> bytes:
        """The end of every reply of one batch: its infer_ms and batch_rows."""
        return pack(reply_timing(0.0, float(infer_ms), int(batch_rows)))[_TAIL_AT:]

    def payload_parts(self, id_length: int, tail: bytes) -> tuple[bytes, bytes, bytes, bytes]:
        """The fixed bytes of an ok reply whose ASCII id is ``id_length`` bytes long.

        The reply is ``parts[0] + rid + parts[1] + data + parts[2] + queued + parts[3]``, with
        ``queued`` the wait packed by :meth:`queued_bytes`.
        """
        if not 0 < id_length < len(STR_HEADERS):
            raise ValueError(f"id_length must be 1 to {len(STR_HEADERS) - 1}, got {id_length}")
        return (self._head + STR_HEADERS[id_length], self._ok_outputs, self._model_queued, tail)

    def reply_length(self, id_length: int, tail: bytes) -> int:
        """The length of an ok reply whose ASCII id is ``id_length`` bytes long."""
        fixed = sum(map(len, self.payload_parts(id_length, tail)))
        return fixed + id_length + self.nbytes + QUEUED_SIZE

    @staticmethod
    def queued_bytes(queued_ms: np.ndarray) -> bytes:
        """Queue waits in ms as the replies' packed ``queued_ms`` (QUEUED_SIZE bytes each).

        Negative waits become 0.0, as :func:`reply_timing` writes them (``+ 0.0``: never -0.0).
        """
        return (np.maximum(queued_ms, 0.0) + 0.0).astype(">f8").tobytes()

    def encode(self, rid: str, data: bytes, queued_ms: float, tail: bytes) -> bytes:
        """One ok reply: ``data`` is the request's outputs (``nbytes`` bytes, C order)."""
        short = len(rid) < len(STR_HEADERS) and rid.isascii()
        packed_id = STR_HEADERS[len(rid)] + rid.encode() if short else pack(rid)
        wait = _DOUBLE.pack(max(0.0, queued_ms))
        return b"".join(
            (self._head, packed_id, self._ok_outputs, data, self._model_queued, wait, tail)
        )


def _sample_data(dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Two arrays of ``dtype`` and ``shape`` whose bytes differ everywhere (bool: 0 and 1)."""
    size = int(np.prod(shape)) * dtype.itemsize
    if size == 0:
        raise ProtocolError("an empty output has no data slot: the general encoder answers it")
    flip = 1 if dtype.kind == "b" else 0xFF
    pattern = ((np.arange(size) * 37 + 11) & flip).astype(np.uint8)
    first, second = (bits.view(dtype).reshape(shape) for bits in (pattern, pattern ^ flip))
    return first, second


def _slot(a: bytes, b: bytes) -> tuple[int, int]:
    """Where two replies of one layout differ: the slot of the one value they vary."""
    if len(a) != len(b) or a == b:
        raise ProtocolError("a varied value changed the reply's layout")
    start = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    end = len(a) - next(i for i, (x, y) in enumerate(zip(reversed(a), reversed(b))) if x != y)
    return start, end
