"""CPU time per request of each process: worker, redis-server and client.

Wall-clock throughput on a shared 2-core machine moves by 30% between runs;
the CPU each process spends per request does not, so that is the figure to
optimise (issue "The per-request cost"). Every run starts a private
redis-server and the worker(s) under test, and reads their CPU time from
/proc before and after.

Two kinds of run, each repeated ``--runs`` times with the targets interleaved
(ratios are taken within a run, figures are medians):

* ``drain``: the worker is paused (SIGSTOP) while N one-row requests are
  written to its stream, then resumed; the run ends when the group has
  nothing pending or undelivered. Reported: the worker's and redis-server's
  CPU per request while draining, redis-server's per XADD, and the drain
  rate. Targets: ``fleet`` (``inferfleet worker``) and ``plain``
  (``python -m inferfleet.worker.bench.naive --batch N``, the naive server's batched
  yardstick: about thirty lines with none of the guarantees).
* ``sdk``: N requests through the SDK end to end with one fleet worker
  (``Producer.map``, ``submit_many`` + ``results``, ``AsyncProducer.map``):
  the client's CPU per request beside the worker's and redis-server's (and
  the kernel's part of redis-server's, ``redis_sys_us``), and the requests
  per second.

    python -m benchmarks.bench_cpu --kind drain --requests 100000 --runs 3
    python -m benchmarks.bench_cpu --kind sdk --requests 60000 --runs 3
    python -m benchmarks.bench_cpu --model models/ctr.pt --kind sdk   # inputs from its example
    python -m benchmarks.bench_cpu --kind sdk --commandstats   # and redis-server's time per command
    python -m benchmarks.bench_cpu --kind sdk --modes submit_many --calls 12   # 12 calls of 5,000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from benchmarks.callgrind_redis import CallgrindRedis, missing_tools
from inferfleet import AsyncProducer, Producer
from inferfleet.producer.protocol import encode_body, workers_group
from inferfleet.worker.bench.load import bench_inputs
from inferfleet.worker.embedded import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
NAME = "cpu"


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    return sum(cpu_parts(pid))


def cpu_parts(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return int(fields[11]) * TICK_S, int(fields[12]) * TICK_S


def start_worker(
    target: str, url: str, model: str, rows: int, extra: list[str]
) -> subprocess.Popen:
    if target == "plain":
        cmd = [sys.executable, "-m", "inferfleet.worker.bench.naive", "--batch", str(rows)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "inferfleet",
            "worker",
            "--max-batch-rows",
            str(rows),
            "--log-level",
            "warning",
            *extra,
        ]
    cmd += ["--name", NAME, "--model", model, "--redis-url", url, "--consumer", f"{target}-0"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)


def wait_joined(
    client: redis.Redis, proc: subprocess.Popen, consumer: str, timeout_s: float = 120
) -> None:
    deadline = time.monotonic() + timeout_s
    stream = f"inferfleet:{{{NAME}}}:requests"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{consumer} exited with status {proc.returncode}")
        try:
            if any(
                c["name"] == consumer.encode() for c in client.xinfo_consumers(stream, "workers")
            ):
                return
        except redis.exceptions.ResponseError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{consumer} did not join within {timeout_s} s")


def wait_drained(client: redis.Redis, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    stream = f"inferfleet:{{{NAME}}}:requests"
    while time.monotonic() < deadline:
        group = workers_group(client.xinfo_groups(stream))
        if group is not None and group.lag == 0 and group.pending == 0:
            return
        time.sleep(0.02)
    raise TimeoutError(f"the stream was not drained within {timeout_s} s")


def fill(client: redis.Redis, body: bytes, requests: int, chunk: int = 2000) -> None:
    stream = f"inferfleet:{{{NAME}}}:requests"
    for start in range(0, requests, chunk):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(start + chunk, requests)):
            pipe.xadd(stream, {"id": f"r{i}", "body": body})
        pipe.execute()


def drain_run(target: str, args: argparse.Namespace, body: bytes) -> dict[str, float]:
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        proc = start_worker(target, server.url, args.model, args.max_batch_rows, args.worker_arg)
        try:
            wait_joined(client, proc, f"{target}-0")
            proc.send_signal(signal.SIGSTOP)
            redis_before = cpu_s(server.pid)
            fill(client, body, args.requests)
            redis_xadd = cpu_s(server.pid) - redis_before
            worker0, redis0, started = cpu_s(proc.pid), cpu_s(server.pid), time.perf_counter()
            proc.send_signal(signal.SIGCONT)
            wait_drained(client, args.timeout_s)
            wall = time.perf_counter() - started
            worker_s, redis_s = cpu_s(proc.pid) - worker0, cpu_s(server.pid) - redis0
        finally:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            proc.wait(30)
    n = args.requests
    return {
        "worker_us": worker_s / n * 1e6,
        "redis_us": redis_s / n * 1e6,
        "redis_xadd_us": redis_xadd / n * 1e6,
        "drain_rps": n / wall,
    }


def _sdk_call(mode: str, url: str, inputs: list[Any], calls: int = 1) -> Callable[[], int]:
    """One producer sending ``inputs`` by ``mode``, in ``calls`` SDK calls of consecutive parts."""
    size = -(-len(inputs) // calls)
    parts = [inputs[i : i + size] for i in range(0, len(inputs), size)]
    if mode == "map":

        def call() -> int:
            with Producer(url, NAME) as p:
                return sum(r.ok for part in parts for r in p.map(part))
    elif mode == "submit_many":

        def call() -> int:
            with Producer(url, NAME) as p:
                return sum(
                    r.ok for part in parts for r in p.results(p.submit_many(part), timeout_s=120)
                )
    else:

        async def run() -> int:
            p = AsyncProducer(url, NAME)
            try:
                return sum([sum(r.ok for r in await p.map(part)) for part in parts])
            finally:
                await p.close()

        def call() -> int:
            return asyncio.run(run())

    return call


@contextmanager
def fleet_worker(
    server: EmbeddedRedis, args: argparse.Namespace, joined_timeout_s: float = 120
) -> Iterator[tuple[redis.Redis, subprocess.Popen]]:
    """(a client, the worker): one fleet worker on ``server``, joined, Redis's stats reset; stopped
    on exit."""
    client = redis.Redis.from_url(server.url)
    proc = start_worker("fleet", server.url, args.model, args.max_batch_rows, args.worker_arg)
    try:
        wait_joined(client, proc, "fleet-0", joined_timeout_s)
        client.config_resetstat()
        yield client, proc
    finally:
        proc.terminate()
        proc.wait(60)


def sdk_run(mode: str, args: argparse.Namespace, inputs: list[Any]) -> dict[str, float]:
    if args.callgrind:
        return sdk_count(mode, args, inputs)
    with EmbeddedRedis() as server, fleet_worker(server, args) as (client, proc):
        call = _sdk_call(mode, server.url, inputs, args.calls)
        # Every call starts from the same heap: what the earlier calls of this process left made the
        # GC's full collections longer, and the second call measured about 1 us a request more.
        gc.collect()
        gc.freeze()
        worker0, redis0, client0 = cpu_s(proc.pid), cpu_parts(server.pid), time.process_time()
        started = time.perf_counter()
        ok = call()
        wall = time.perf_counter() - started
        client_s = time.process_time() - client0
        redis1 = cpu_parts(server.pid)
        worker_s, redis_s = cpu_s(proc.pid) - worker0, sum(redis1) - sum(redis0)
        redis_sys_s = redis1[1] - redis0[1]  # the kernel's part: socket I/O and page faults
        commands = client.info("commandstats")
    n = len(inputs)
    _check_ok(mode, ok, n)
    row = {
        "client_us": client_s / n * 1e6,
        "worker_us": worker_s / n * 1e6,
        "redis_us": redis_s / n * 1e6,
        "redis_sys_us": redis_sys_s / n * 1e6,
        "rps": n / wall,
    }
    if (
        args.commandstats
    ):  # redis-server's own time per command, a request's share (INFO commandstats)
        row.update(
            {
                f"{name.removeprefix('cmdstat_')}_us": stats["usec"] / n
                for name, stats in commands.items()
                if stats["usec"] / n >= 0.01
            }
        )
        row.update(_calls_per_request(commands, n))
    return row


def sdk_count(mode: str, args: argparse.Namespace, inputs: list[Any]) -> dict[str, float]:
    """redis-server's instructions per request (callgrind) for one SDK call; commands per request
    beside."""
    with (
        CallgrindRedis() as server,
        fleet_worker(server, args, joined_timeout_s=300) as (client, _),
    ):
        call = _sdk_call(mode, server.url, inputs, args.calls)
        with server.counting() as count:
            ok = call()
        commands = client.info("commandstats")
    n = len(inputs)
    _check_ok(mode, ok, n)
    row = {"redis_instructions": count.instructions / n}
    row.update(_calls_per_request(commands, n))
    return row


def _calls_per_request(commands: dict[str, dict[str, float]], n: int) -> dict[str, float]:
    """Each command's calls a request (INFO commandstats), the bench's own CONFIG and INFO left
    out."""
    return {
        f"{name.removeprefix('cmdstat_')}_calls": stats["calls"] / n
        for name, stats in commands.items()
        if name not in ("cmdstat_config", "cmdstat_info") and stats["calls"] / n >= 0.001
    }


def _check_ok(mode: str, ok: int, n: int) -> None:
    if ok != n:
        raise RuntimeError(f"{mode}: {n - ok} of {n} replies were errors")


#: Figures read from /proc (10 ms ticks: a tenth of a us a request at best); commandstats' are in
#: us.
_CPU_COLUMNS = {
    "client_us",
    "worker_us",
    "redis_us",
    "redis_sys_us",
    "redis_xadd_us",
    "rps",
    "drain_rps",
    "redis_instructions",
}


def median_rows(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each target's median of each figure over the runs (a figure some run lacks counts as 0
    there)."""
    return {
        target: {
            k: statistics.median(run[target].get(k, 0.0) for run in runs)
            for k in dict.fromkeys(k for run in runs for k in run[target])
        }
        for target in runs[0]
    }


def print_table(title: str, rows: dict[str, dict[str, float]]) -> None:
    columns = list(dict.fromkeys(c for row in rows.values() for c in row))
    print(f"\n{title}")
    print(" | ".join(["target", *columns]))
    for target, row in rows.items():
        print(
            " | ".join(
                [
                    target,
                    *(f"{row.get(c, 0.0):,.{1 if c in _CPU_COLUMNS else 2}f}" for c in columns),
                ]
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["drain", "sdk", "all"], default="all")
    parser.add_argument("--model", default=str(ROOT / "models" / "affine.pt"))
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-batch-rows", type=int, default=256)
    parser.add_argument(
        "--targets", default="fleet,plain", help="drain targets, comma-separated: fleet, plain"
    )
    parser.add_argument(
        "--modes", default="map,submit_many,async", help="sdk modes: map, submit_many, async"
    )
    parser.add_argument(
        "--calls",
        type=int,
        default=1,
        help="sdk runs: send the requests in this many SDK calls of consecutive parts (a "
        "submit_many + results call holds its replies in Redis until it collects)",
    )
    parser.add_argument(
        "--worker-arg", action="append", default=[], help="extra inferfleet worker option"
    )
    parser.add_argument(
        "--commandstats",
        action="store_true",
        help="sdk runs: also redis-server's time per command (INFO commandstats), us a request",
    )
    parser.add_argument(
        "--callgrind",
        action="store_true",
        help="sdk runs: count redis-server's instructions per request under valgrind instead "
        "(the same count on a busy machine; about fifty times slower: use --requests 10000)",
    )
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--json", dest="json_out", default=None, help="write every run and the medians here"
    )
    args = parser.parse_args()
    if not 1 <= args.calls <= args.requests:
        parser.error(f"--calls must be from 1 to --requests ({args.requests}), got {args.calls}")
    if args.callgrind and args.kind != "sdk":
        parser.error("--callgrind counts sdk runs only: add --kind sdk")
    if args.callgrind and args.commandstats:
        parser.error(
            "--callgrind reports commands per request already; --commandstats is for CPU runs"
        )
    if args.callgrind and missing_tools():
        parser.error(missing_tools())
    inputs = bench_inputs(args.model, None, 1, seed=0)
    pool = [inputs[i % len(inputs)] for i in range(args.requests)]
    report: dict[str, Any] = {"args": vars(args)}
    if args.kind in ("drain", "all"):
        runs = [
            {t: drain_run(t, args, encode_body(pool[0])) for t in args.targets.split(",")}
            for _ in range(args.runs)
        ]
        report["drain"] = {"runs": runs, "median": median_rows(runs)}
        print_table(
            f"drain {args.requests:,} one-row requests, median of {args.runs} (CPU us a request)",
            report["drain"]["median"],
        )
        if "plain" in runs[0] and "fleet" in runs[0]:
            ratios = [run["fleet"]["drain_rps"] / run["plain"]["drain_rps"] for run in runs]
            print(
                f"fleet/plain drain rate, same run: median {statistics.median(ratios):.2f}x "
                f"({', '.join(f'{r:.2f}' for r in ratios)})"
            )
    if args.kind in ("sdk", "all"):
        runs = [
            {m: sdk_run(m, args, pool) for m in args.modes.split(",")} for _ in range(args.runs)
        ]
        report["sdk"] = {"runs": runs, "median": median_rows(runs)}
        in_calls = f" in {args.calls} calls each" if args.calls > 1 else ""
        print_table(
            f"SDK end to end, {args.requests:,} requests{in_calls}, one worker, median of "
            f"{args.runs}",
            report["sdk"]["median"],
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
