"""A plain batched worker: the yardstick of the per-request cost (benchmarks/bench_cpu.py).

About thirty lines of serving: XREADGROUP COUNT N, one msgpack decode per
entry, one forward pass over the concatenated rows, one RPUSH + EXPIRE per
reply in a pipeline and one XACK for the batch. It has no deadlines, no
validation, no exactly-once replies and no error isolation: what the fleet
worker adds is measured against it, on the same stream and the same client.
The installed ``inferfleet.worker.bench.naive`` is another yardstick: one
request at a time, the model loaded on the first (``inferfleet bench
--baseline naive``), the article's unbatched server; this one is batched.

    python -m benchmarks.plain_worker --name bench --model models/affine.pt \\
        --redis-url redis://127.0.0.1:6390/0
"""

from __future__ import annotations

import argparse
import signal

import msgpack
import numpy as np
import redis
import torch


def serve(
    client: redis.Redis, name: str, model: torch.jit.ScriptModule, count: int, consumer: str
) -> None:
    stream = f"inferfleet:{{{name}}}:requests"
    try:
        client.xgroup_create(stream, "workers", id="0", mkstream=True)
    except redis.exceptions.ResponseError:
        pass  # BUSYGROUP: created already
    client.xgroup_createconsumer(stream, "workers", consumer)
    meta = {"name": name, "version": "plain"}
    while True:
        read = client.xreadgroup("workers", consumer, {stream: ">"}, count=count, block=1000)
        if not read:
            continue
        entries = read[0][1]
        bodies = [msgpack.unpackb(fields[b"body"]) for _, fields in entries]
        x = np.concatenate(
            [
                np.frombuffer(b["inputs"]["data"], b["inputs"]["dtype"]).reshape(
                    b["inputs"]["shape"]
                )
                for b in bodies
            ]
        )
        with torch.inference_mode():
            y = model(torch.from_numpy(x)).numpy()
        pipe = client.pipeline(transaction=False)
        for (_, fields), row in zip(entries, y):
            rid = fields[b"id"].decode()
            out = {"dtype": "float32", "shape": [1, *row.shape], "data": row.tobytes()}
            key = f"inferfleet:{{{name}}}:reply:{rid}"
            pipe.rpush(
                key,
                msgpack.packb(
                    {
                        "id": rid,
                        "ok": True,
                        "outputs": out,
                        "model": meta,
                        "timing": {"queued_ms": 0.0, "infer_ms": 0.0, "batch_rows": len(y)},
                    }
                ),
            )
            pipe.expire(key, 300)
        pipe.xack(stream, "workers", *[entry_id for entry_id, _ in entries])
        pipe.execute()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument(
        "--model", required=True, help="a TorchScript file of one tensor in, one tensor out"
    )
    parser.add_argument("--redis-url", default="redis://localhost:6379/0")
    parser.add_argument("--count", type=int, default=256, help="most entries per read (the batch)")
    parser.add_argument("--consumer", default="plain-0")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: exit(0))
    torch.set_num_threads(1)
    model = torch.jit.load(args.model)
    serve(redis.Redis.from_url(args.redis_url), args.name, model, args.count, args.consumer)


if __name__ == "__main__":
    main()
