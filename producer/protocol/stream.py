"""A streamed reply (contract 1.3): a request's outputs in numbered chunks, in a reply stream.

A request entry with the field ``stream`` set to ``1`` asks for its outputs as they are made.
A worker that streams (a step-wise model: docs/generation.md) appends them to the Redis stream
``PREFIX:{NAME}:chunks:RID`` (:meth:`QueueKeys.chunks`), one entry a chunk, with the fields:

* ``n``: the chunk's number, 0 first, one more for each chunk of the stream;
* ``attempt``: 1, or more once a worker took the request over from one that died: it goes on
  from the chunks already in the stream, numbering on (it never restarts at 0);
* ``final``: ``1`` on the last chunk, else ``0``;
* ``body``: a msgpack map: ``{"id": RID, "ok": true, "outputs": TENSOR}`` for a chunk that is not
  final (its new outputs: int64 token ids for a language model); a final chunk is a reply
  (docs/protocol.md), its ``outputs`` the last new tokens, plus ``finish_reason`` (``stop`` or
  ``length``) when ok; or an error reply (``cancelled``, ``expired``, ``model_error``...) that
  ends the stream.

Workers write a chunk only if it is the stream's next (``n`` one more than the last entry's,
from an ``attempt`` no older, the stream not final), in one script with the check, so a stream
never holds two chunks of one number; the key's TTL is the reply TTL from its last chunk. Any
client reads it with ``XREAD BLOCK MS STREAMS KEY LAST_ID`` from the last entry id it saw (``0``
at first), so one that reconnects resumes where it was. :class:`StreamFold` is that reader's
rule, pure: it accepts the next number, skips what it saw, refuses a gap.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol.codec import OUTPUT_LIMITS, encode_inputs, pack, unpack
from inferfleet.producer.protocol.reply import Reply, decode_reply

__all__ = [
    "FINISH_REASONS",
    "STREAM_FIELD",
    "Chunk",
    "StreamFold",
    "chunk_fields",
    "encode_chunk",
    "encode_final",
    "parse_chunk",
    "wants_stream",
]

#: The request entry field that asks for a streamed reply, and its value.
STREAM_FIELD = "stream"
#: Why an ok stream ended: the model's end token or a stop token, or its length limit.
FINISH_REASONS = ("stop", "length")


def wants_stream(fields: Mapping[bytes, Any]) -> bool:
    """Whether a request entry asks for a streamed reply (``stream`` = ``1``)."""
    return fields.get(STREAM_FIELD.encode()) == b"1"


def chunk_fields(n: int, attempt: int, final: bool, body: bytes) -> dict[str, bytes | str]:
    """The fields of one chunk entry (for ``XADD KEY * ...``)."""
    return {"n": str(n), "attempt": str(attempt), "final": "1" if final else "0", "body": body}


def encode_chunk(rid: str, tokens: Any) -> bytes:
    """The body of a chunk that is not final: its new outputs."""
    return pack({"id": rid, "ok": True, "outputs": encode_inputs(np.asarray(tokens, np.int64))})


def encode_final(
    rid: str,
    tokens: Any,
    finish_reason: str,
    model: tuple[str, str],
    timing: Mapping[str, Any],
) -> bytes:
    """The body of an ok final chunk: a reply with its last tokens and why the stream ended."""
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, not {finish_reason!r}")
    return pack(
        {
            "id": rid,
            "ok": True,
            "outputs": encode_inputs(np.asarray(tokens, np.int64)),
            "finish_reason": finish_reason,
            "model": {"name": model[0], "version": model[1]},
            "timing": dict(timing),
        }
    )


@dataclass(frozen=True)
class Chunk:
    """One decoded chunk: ``reply`` is its body (``outputs`` its new tokens when ok)."""

    entry_id: str
    n: int
    attempt: int
    final: bool
    reply: Reply
    finish_reason: str | None = None

    @property
    def tokens(self) -> np.ndarray:
        """This chunk's new outputs (empty on an error)."""
        outputs = self.reply.outputs
        return np.zeros(0, np.int64) if outputs is None else np.asarray(outputs)


def _number(fields: Mapping[bytes, Any], name: str, least: int) -> int:
    raw = fields.get(name.encode())
    if not isinstance(raw, bytes) or not raw.isdigit() or len(raw) > 18 or int(raw) < least:
        raise ProtocolError(f"chunk field {name!r} must be an integer >= {least}, got {raw!r}")
    return int(raw)


def parse_chunk(entry_id: bytes | str, fields: Mapping[bytes, Any]) -> Chunk:
    """Decode one chunk entry (its id and its fields as Redis returns them, bytes)."""
    final = fields.get(b"final")
    if final not in (b"0", b"1"):
        raise ProtocolError(f"chunk field 'final' must be 0 or 1, got {final!r}")
    body = fields.get(b"body")
    if not isinstance(body, bytes):
        raise ProtocolError("a chunk has no 'body'")
    reply = decode_reply(body)
    reason = None
    if final == b"1" and reply.ok:
        reason = unpack(body, OUTPUT_LIMITS).get("finish_reason")
        if reason not in FINISH_REASONS:
            raise ProtocolError(f"an ok final chunk needs a finish_reason, got {reason!r}")
    return Chunk(
        entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
        _number(fields, "n", 0),
        _number(fields, "attempt", 1),
        final == b"1",
        reply,
        reason,
    )


@dataclass
class StreamFold:
    """A reader's state over one reply stream: the chunks it accepted, where to read on.

    :meth:`take` accepts the next chunk (number ``next_n``), returns None for one it already has
    (a reader that re-reads from an older id) and raises ProtocolError for a gap or a chunk after
    the final one: neither can come from a worker (its script writes only the next chunk).
    """

    last_id: str = "0"
    #: None: a reader that resumes from an id without knowing its number takes the next chunk
    #: as it comes, and counts on from it
    next_n: int | None = 0
    attempt: int = 0
    done: bool = False

    def take(self, chunk: Chunk) -> Chunk | None:
        """``chunk`` if it is the next one (and note it), None if already taken."""
        if self.next_n is None:
            self.next_n = chunk.n
        if chunk.n < self.next_n:
            return None
        if self.done or chunk.n > self.next_n:
            raise ProtocolError(
                f"chunk {chunk.n} of attempt {chunk.attempt} after chunk {self.next_n - 1}"
                f"{' (final)' if self.done else ''}: the stream is not one a worker wrote"
            )
        self.last_id, self.next_n, self.done = chunk.entry_id, chunk.n + 1, chunk.final
        self.attempt = chunk.attempt
        return chunk
