"""Reading a streamed reply (contract 1.3): :class:`ChunkStream` and :class:`AsyncChunkStream`.

``Producer.stream(inputs)`` enqueues a request that asks for a stream and returns a
:class:`ChunkStream`: iterate it for the request's chunks as the worker writes them (each a
:class:`~inferfleet.producer.protocol.stream.Chunk`: ``tokens``, ``n``, ``attempt``,
``final``). It reads with ``XREAD BLOCK`` from the last entry it saw, so a read cut off by a
lost connection resumes where it was, and ``Producer.read_stream(request_id, after=ENTRY_ID)``
attaches any process to a stream (from its start, or from an id it saw). A final error chunk
(``cancelled``, ``expired``...) raises its :class:`~inferfleet.producer.errors.ReplyError`
after the chunks before it; a wait longer than ``timeout_s`` between two chunks raises
:class:`~inferfleet.producer.errors.ReplyTimeout`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np

from inferfleet.producer import errors
from inferfleet.producer.connections import block_slices, translate_errors
from inferfleet.producer.protocol import Chunk, StreamFold, parse_chunk

__all__ = ["AsyncChunkStream", "ChunkStream", "take_chunks"]

#: Chunks one XREAD takes at most.
READ_COUNT = 256


def take_chunks(response: Any, fold: StreamFold) -> list[Chunk]:
    """The new chunks in an XREAD answer for one key, through ``fold`` (in order)."""
    taken = []
    if isinstance(response, dict):  # RESP3's form
        response = response.items()
    for _key, entries in response or ():
        for entry_id, fields in entries:
            chunk = fold.take(parse_chunk(entry_id, fields))
            if chunk is not None:
                taken.append(chunk)
    return taken


def _checked(chunk: Chunk) -> Chunk:
    """``chunk``, or its error raised when it is a final error chunk."""
    if not chunk.reply.ok:
        chunk.reply.raise_for_error()
    return chunk


class _Base:
    def __init__(self, request_id: str, key: str, timeout_s: float, after: str) -> None:
        if timeout_s <= 0:
            raise errors.ProtocolError(f"timeout_s must be positive, got {timeout_s}")
        self.request_id, self.key, self.timeout_s = request_id, key, timeout_s
        self.fold = StreamFold(last_id=after, next_n=0 if after == "0" else None)
        self._ready: list[Chunk] = []

    @property
    def done(self) -> bool:
        """Whether the final chunk was read."""
        return self.fold.done and not self._ready

    def _timeout(self) -> errors.ReplyTimeout:
        return errors.ReplyTimeout(
            f"no chunk of request {self.request_id!r} in {self.timeout_s:g} s after entry "
            f"{self.fold.last_id} of {self.key}: is a worker serving a step-wise model up?"
        )


class ChunkStream(_Base):
    """The chunks of one request as they come (an iterator); see the module docstring."""

    def __init__(
        self, client: Any, request_id: str, key: str, timeout_s: float, after: str = "0"
    ) -> None:
        super().__init__(request_id, key, timeout_s, after)
        self._redis = client

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        if not self._ready:
            if self.fold.done:
                raise StopIteration
            self._read()
        return _checked(self._ready.pop(0))

    def _read(self) -> None:
        with translate_errors():
            for block_s in block_slices(self.timeout_s):
                got = self._redis.xread(
                    {self.key: self.fold.last_id}, count=READ_COUNT, block=int(block_s * 1000)
                )
                self._ready = take_chunks(got, self.fold)
                if self._ready:
                    return
        raise self._timeout()

    def tokens(self) -> np.ndarray:
        """Every token still to come, to the end of the stream (int64)."""
        parts = [chunk.tokens for chunk in self]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class AsyncChunkStream(_Base):
    """:class:`ChunkStream` for asyncio (an async iterator)."""

    def __init__(
        self, client: Any, request_id: str, key: str, timeout_s: float, after: str = "0"
    ) -> None:
        super().__init__(request_id, key, timeout_s, after)
        self._redis = client

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self

    async def __anext__(self) -> Chunk:
        if not self._ready:
            if self.fold.done:
                raise StopAsyncIteration
            await self._read()
        return _checked(self._ready.pop(0))

    async def _read(self) -> None:
        with translate_errors():
            for block_s in block_slices(self.timeout_s):
                got = await self._redis.xread(
                    {self.key: self.fold.last_id}, count=READ_COUNT, block=int(block_s * 1000)
                )
                self._ready = take_chunks(got, self.fold)
                if self._ready:
                    return
        raise self._timeout()

    async def tokens(self) -> np.ndarray:
        """Every token still to come, to the end of the stream (int64)."""
        parts = [chunk.tokens async for chunk in self]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)
