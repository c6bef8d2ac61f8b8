#!/usr/bin/env python3
"""Pipeline stages against one whole-model worker: resident memory, throughput, latency, CPU a
request.

A residual MLP stack (``tests.fixtures.build_models.stack``, width 2048 and 8 blocks by default: 268
MB of float32 weights) is exported whole and split into S stages of equal cost with ``inferfleet
split``'s code. On a private redis-server it then measures, for one whole-model worker and for an
S-stage pipeline (one worker per stage):

* each worker's resident memory (VmRSS, after warm-up) and the weight bytes it holds;
* throughput: N one-row requests enqueued at once, until the last reply (median of --runs);
* latency: sequential one-row requests, one in flight (p50, p99): the cost of the extra hops;
* worker CPU time per request (user + system of every worker process, over the throughput runs).

    python -m benchmarks.bench_pipeline [--width 2048] [--depth 8] [--stages 2] [--requests 600] \\
        [--runs 3]
    python -m benchmarks.bench_pipeline --device cuda  # every stage and the whole model on one GPU
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from inferfleet.producer import Producer
from inferfleet.producer.protocol import QueueKeys, encode_body
from inferfleet.worker.embedded import EmbeddedRedis
from inferfleet.worker.keys import stage_keys
from inferfleet.worker.runtime.split import split_model
from tests.fixtures.build_models import EXTRA, stack

ROOT = Path(__file__).resolve().parent.parent


def export_whole(width: int, depth: int, path: Path) -> np.ndarray:
    model = stack(width, depth)
    example = np.random.default_rng(0).standard_normal((4, 32), dtype=np.float32)
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    program = torch.export.export(model, (torch.from_numpy(example),), dynamic_shapes=({0: batch},))
    torch.export.save(
        program, str(path), extra_files={EXTRA: base64.b64encode(encode_body(example)).decode()}
    )
    return example


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    line = next(
        x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS")
    )
    return int(line.split()[1]) / 1024


def start(url: str, name: str, args: list[str], stream: str) -> subprocess.Popen:
    env = dict(os.environ, REDIS_URL=url, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferfleet",
            "worker",
            "--name",
            name,
            "--max-batch-rows",
            "32",
            "--max-wait-ms",
            "5",
            "--log-level",
            "warning",
            *args,
        ],
        env=env,
        cwd=ROOT,
    )
    import redis

    client = redis.Redis.from_url(url)
    while True:
        try:
            if client.xinfo_consumers(stream, "workers"):
                return proc
        except redis.exceptions.ResponseError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"worker {args} exited {proc.returncode}")
        time.sleep(0.2)


def measure(url: str, name: str, procs: list[subprocess.Popen], requests: int, runs: int) -> dict:
    producer = Producer(url, name)
    x = np.random.default_rng(1).standard_normal((1, 32), dtype=np.float32)
    for _ in range(20):
        producer.result(producer.submit(x), timeout_s=120)  # warm the path
    cpu0 = sum(cpu_s(p.pid) for p in procs)
    rates = []
    for _ in range(runs):
        started = time.perf_counter()
        replies = producer.map([x] * requests, timeout_s=600)
        rates.append(requests / (time.perf_counter() - started))
        assert all(r.ok for r in replies), [r.error_message for r in replies if not r.ok][:3]
    cpu_per_req_ms = (sum(cpu_s(p.pid) for p in procs) - cpu0) / (requests * runs) * 1000
    latencies = []
    for _ in range(200):
        started = time.perf_counter()
        producer.result(producer.submit(x), timeout_s=120)
        latencies.append((time.perf_counter() - started) * 1000)
    latencies.sort()
    return {
        "rps": statistics.median(rates),
        "rps_all": rates,
        "cpu_ms": cpu_per_req_ms,
        "p50": latencies[len(latencies) // 2],
        "p99": latencies[int(len(latencies) * 0.99) - 1],
        "rss": [rss_mb(p.pid) for p in procs],
    }


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--device", default="cpu", help="--device of every worker (cuda: all stages on one GPU)"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    example = export_whole(args.width, args.depth, work / "whole.pt2")
    per = args.depth // args.stages
    points = [f"blocks.{per * k}" for k in range(1, args.stages)]
    manifest = split_model(str(work / "whole.pt2"), example, points, str(work / "split"))
    weights = [s.bytes / 1e6 for s in manifest.stages]
    print(
        f"model: width {args.width}, {args.depth} blocks, {sum(weights):.0f} MB of weights; split "
        f"at {','.join(points)}: stages of {', '.join(f'{w:.0f}' for w in weights)} MB"
    )
    with EmbeddedRedis() as server:
        device = ["--device", args.device]
        whole = [
            start(
                server.url,
                "whole",
                ["--model", str(work / "whole.pt2"), *device],
                QueueKeys("whole").requests,
            )
        ]
        one = measure(server.url, "whole", whole, args.requests, args.runs)
        stop(whole)
        stages = [
            start(
                server.url,
                "piped",
                ["--pipeline", str(work / "split"), "--stage", str(k), *device],
                stage_keys(QueueKeys("piped"), k).requests,
            )
            for k in range(args.stages)
        ]
        piped = measure(server.url, "piped", stages, args.requests, args.runs)
        stop(stages)
    for label, r in (
        ("whole model, 1 worker", one),
        (f"{args.stages} stages, 1 worker each", piped),
    ):
        print(
            f"{label:<28} RSS {' + '.join(f'{m:.0f}' for m in r['rss'])} MB | {r['rps']:.0f} req/s "
            f"(runs {', '.join(f'{v:.0f}' for v in r['rps_all'])}) | CPU {r['cpu_ms']:.2f} ms/req "
            f"| latency p50 {r['p50']:.1f} ms, p99 {r['p99']:.1f} ms"
        )
    print(
        f"ratios: largest stage RSS / whole RSS {max(piped['rss']) / one['rss'][0]:.2f}; "
        f"throughput {piped['rps'] / one['rps']:.2f}x; CPU per request "
        f"{piped['cpu_ms'] / one['cpu_ms']:.2f}x; "
        f"p50 {piped['p50'] / one['p50']:.2f}x"
    )


if __name__ == "__main__":
    main()
