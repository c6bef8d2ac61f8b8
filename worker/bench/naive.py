"""A deliberately naive model server: the baseline of ``inferfleet bench --baseline naive``.

The article's "synchronous batch processing", kept on purpose so the fleet
has something honest to be compared with:

* one process reads ONE request at a time from its queue
  (``XREADGROUP COUNT 1`` in group ``workers``);
* the model is loaded only when the first request arrives, so that request
  pays the load (and the first forward pass);
* each request runs alone under ``torch.no_grad`` (no batching), then the
  reply is pushed (to ``reply_to`` or the default reply key) and the entry
  acknowledged, and only then is the next request read.

It speaks the same wire protocol as the fleet (``inferfleet.producer.protocol``), so
the same producer drives both. It checks no deadlines, reclaims nothing and
never trims its stream: it is a yardstick, not a server. Torch runs with one
intra-op thread by default, like each fleet worker.

With ``--batch N`` it is instead the batched yardstick of benchmarks/bench_cpu.py's
``plain`` target (:func:`serve_batched`): what a first batched worker would be, the model
loaded at the start, none of the fleet's guarantees.

    python -m inferfleet.worker.bench.naive --name ctr-naive --model models/ctr.pt --redis-url \\
        redis://127.0.0.1:6390/0
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import redis
import torch

from inferfleet.producer.connections import DEFAULT_REDIS_URL
from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import (
    DEFAULT_PREFIX,
    DEFAULT_REPLY_TTL_S,
    GROUP,
    QueueKeys,
    decode_body,
    encode_reply_error,
    encode_reply_ok,
    pack,
    parse_entry,
    row_count,
    unpack,
)
from inferfleet.worker.connections import admin_client
from inferfleet.worker.handler import Handler
from inferfleet.worker.runtime.loading import to_numpy
from inferfleet.worker.runtime.readers import load_model
from inferfleet.worker.serving.consumer import ensure_group
from inferfleet.worker.signals import on_signals

__all__ = ["NaiveServer", "main", "serve_batched"]

log = logging.getLogger(__name__)

_BLOCK_MS = 200  # longest wait for a request before checking whether to stop


class NaiveServer:
    """One request at a time, model loaded on the first one, no batching."""

    def __init__(self, client: redis.Redis, keys: QueueKeys, model: str, consumer: str) -> None:
        self.redis = client
        self.keys = keys
        self.model = model
        self.consumer = consumer
        self.handler: Handler | None = None
        self.version = ""
        self.served = 0

    def serve(self, stop: threading.Event) -> int:
        """Serve until ``stop`` is set; return how many requests were answered."""
        ensure_group(self.redis, self.keys.requests)
        self.redis.xgroup_createconsumer(
            self.keys.requests, GROUP, self.consumer
        )  # visible before it reads
        while not stop.is_set():
            self.serve_one(_BLOCK_MS)
        return self.served

    def serve_one(self, block_ms: int) -> bool:
        """Read one request, answer it, acknowledge it. False when none came within ``block_ms``."""
        got = self.redis.xreadgroup(
            GROUP, self.consumer, {self.keys.requests: ">"}, count=1, block=block_ms
        )
        if not got or not got[0][1]:
            return False
        entry_id, fields = got[0][1][0]
        reply_key, payload = self.answer(fields)
        pipe = self.redis.pipeline(transaction=False)
        if reply_key is not None:
            pipe.rpush(reply_key, payload)
            pipe.expire(reply_key, DEFAULT_REPLY_TTL_S)
        pipe.xack(self.keys.requests, GROUP, entry_id)
        pipe.execute()
        self.served += 1
        return True

    def answer(self, fields: Mapping[bytes, bytes]) -> tuple[str | None, bytes]:
        """The reply key and payload for one entry (None: no readable id, nothing to answer)."""
        try:
            env = parse_entry(fields)
        except ProtocolError as exc:
            rid = getattr(exc, "rid", None)
            key = self.keys.reply(rid) if rid else None
            return key, encode_reply_error(rid or "-", exc.code, exc.message)
        key = (
            env.reply_to
            if env.reply_to and self.keys.is_inbox(env.reply_to)
            else self.keys.reply(env.rid)
        )
        try:
            inputs, params = decode_body(env.body)
        except ProtocolError as exc:
            return key, encode_reply_error(env.rid, exc.code, exc.message)
        return key, self._compute(env.rid, inputs, params)

    def _compute(self, rid: str, inputs: Any, params: dict) -> bytes:
        started = time.perf_counter()
        try:
            outputs = self.predict(inputs, params)
        except Exception as exc:  # noqa: BLE001 - answered, like the fleet does
            return encode_reply_error(rid, "model_error", f"{type(exc).__name__}: {exc}")
        timing = {
            "infer_ms": (time.perf_counter() - started) * 1000,
            "batch_rows": row_count(inputs),
        }
        return encode_reply_ok(rid, outputs, (self.keys.name, self.version), timing)

    def predict(self, inputs: Any, params: dict) -> Any:
        """Run one request alone, loading the model first if this is the first request."""
        if self.handler is None:
            self.handler = self._load()
        with torch.no_grad():
            x = self.handler.preprocess(inputs, params)
            return to_numpy(self.handler.postprocess(self.handler.predict(x, params), params))

    def _load(self) -> Handler:
        started = time.perf_counter()
        handler, _, self.version = load_model(self.model, torch.device("cpu"))
        log.info(
            "naive server: model %s loaded on the first request in %.0f ms",
            self.model,
            (time.perf_counter() - started) * 1000,
        )
        return handler


def serve_batched(
    client: redis.Redis,
    keys: QueueKeys,
    handler: Handler,
    count: int,
    consumer: str,
    stop: threading.Event,
) -> int:
    """The batched yardstick: read ``count`` entries, one forward pass, pipelined replies.

    About thirty lines of serving, what a first batched worker would be: one bounded
    msgpack decode per entry, the rows concatenated, one RPUSH + EXPIRE per reply and one XACK
    for the read. No validation, deadlines, error isolation or exactly-once replies:
    what the fleet worker adds costs what it costs against this (benchmarks/bench_cpu.py).
    """
    ensure_group(client, keys.requests)
    client.xgroup_createconsumer(keys.requests, GROUP, consumer)
    meta, served = {"name": keys.name, "version": "plain"}, 0
    while not stop.is_set():
        read = client.xreadgroup(
            GROUP, consumer, {keys.requests: ">"}, count=count, block=_BLOCK_MS
        )
        if not read:
            continue
        entries = read[0][1]
        bodies = [unpack(fields[b"body"])["inputs"] for _, fields in entries]
        x = np.concatenate(
            [np.frombuffer(b["data"], b["dtype"]).reshape(b["shape"]) for b in bodies]
        )
        with torch.inference_mode():
            y = to_numpy(handler.predict(torch.from_numpy(x), {}))
        pipe = client.pipeline(transaction=False)
        for (_, fields), row in zip(entries, y):
            rid = fields[b"id"].decode()
            out = {"dtype": str(row.dtype), "shape": [1, *row.shape], "data": row.tobytes()}
            timing = {"queued_ms": 0.0, "infer_ms": 0.0, "batch_rows": len(y)}
            reply = {"id": rid, "ok": True, "outputs": out, "model": meta, "timing": timing}
            pipe.rpush(keys.reply(rid), pack(reply))
            pipe.expire(keys.reply(rid), DEFAULT_REPLY_TTL_S)
        pipe.xack(keys.requests, GROUP, *[entry_id for entry_id, _ in entries])
        pipe.execute()
        served += len(entries)
    return served


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m inferfleet.worker.bench.naive", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--name", required=True, help="queue name (bench uses NAME-naive)")
    parser.add_argument(
        "--model", required=True, help="TorchScript or .pt2 file, or module:Handler"
    )
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL)
    parser.add_argument("--prefix", default=DEFAULT_PREFIX)
    parser.add_argument("--consumer", default=f"naive-{socket.gethostname()}-{os.getpid()}")
    parser.add_argument(
        "--batch", type=int, default=1, help="N > 1: the batched yardstick, N entries a read"
    )
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch must be 1 or more, not {args.batch}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m inferfleet.worker.bench.naive --name Q --model PATH [--redis-url
    URL]``."""
    args = _parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s naive %(message)s"
    )
    torch.set_num_threads(args.torch_threads)
    torch.set_num_interop_threads(1)
    stop = threading.Event()
    on_signals((signal.SIGTERM, signal.SIGINT), lambda _: stop.set())
    client, keys = admin_client(args.redis_url), QueueKeys(args.name, args.prefix)
    if args.batch > 1:
        handler = load_model(args.model, torch.device("cpu"))[0]
        served = serve_batched(client, keys, handler, args.batch, args.consumer, stop)
    else:
        served = NaiveServer(client, keys, args.model, args.consumer).serve(stop)
    log.info("naive server on %s: %d requests served", args.name, served)


if __name__ == "__main__":
    main()
