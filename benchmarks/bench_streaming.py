"""Generation streamed through Redis against the same workload in-process (issue 34).

A private redis-server and one real ``inferfleet worker`` serving the example tiny language
model (``models/tinylm.pt``) with ``--slots`` key-value cache slots and one torch thread, the
worker's continuous batching: each iteration admits requests read from the stream, runs one
:meth:`~inferfleet.worker.serving.continuous.Generator.iterate` and writes every chunk it made
in one script call. Clients stream the requests of :func:`benchmarks.bench_generation.workload`
(``--requests`` of mixed lengths, greedy) in a CLOSED LOOP of ``--concurrency`` threads, each
with its own :class:`~inferfleet.producer.Producer`: the moment a client reads its request's
final chunk it sends the next of the workload (``Producer.stream``), and that call is the start
of that request's time to first token, which ends when its first chunk is read.

Beside it, in the same run, the same workload at the same concurrency through the in-process
:class:`~inferfleet.worker.serving.continuous.Generator` in continuous mode with no queue (the
``no queue`` row: a model of the same slots in this process, one torch thread, the allocator
tuned as the worker's, tokens taken from each iteration's return), so the pair shows what Redis
and the worker's loop add: the tokens a second of the streamed run over the in-process one, and
the time to first token's difference. Every streamed request's tokens must equal the in-process
run's (greedy): the script checks it and fails otherwise.

Reported per concurrency and kind (medians over ``--runs``; the ratios are taken within each
run, then their median): generated tokens a second (every token over the wall time from the
first submission to the last token), the time to first token p50 and p99 (nearest rank), the
time per token between a request's chunks p50 and p99 (each gap over the tokens of the chunk
that ends it), the time between a request's chunks p50 and p99 (not over its tokens: how
long a reader waits for its next chunk), the tokens a chunk, the in-process iterations' mean
wall time and tokens, and the worker's script calls' (the wall time over them: one an
iteration that writes a chunk, so one an iteration at ``--chunk-ms 0``), the CPU microseconds
a generated token of the worker, the redis-server and the client process (``/proc``, as
benchmarks/bench_cpu.py), the share of the wall time the worker was on a CPU
(``worker_busy``), and, from redis-server's ``INFO commandstats``, the commands a token:
``EVALSHA`` (the worker's script calls), ``XREAD`` (a client's wake-ups), ``XREADGROUP`` (the
worker's reads) and ``XADD`` (the chunks the script writes, and the requests).

``--chunk-ms`` is the worker's own option (a streamed sequence's tokens made within that long go
out as one chunk, its first and last tokens at once; 0 a chunk a token); several values start
one worker each, on its own queue of the same redis-server, and the streamed runs of each are
interleaved with the others' and the in-process one within every run (one in-process run a
concurrency serves as the baseline of all). A worker waits idle, blocked in its read, while
another's run goes.

    python -m tests.fixtures.build_models --only tinylm
    python -m benchmarks.bench_streaming --concurrency 1 8 32 --runs 3 --chunk-ms 0 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import redis
import torch

from benchmarks.bench_cpu import cpu_s
from benchmarks.bench_generation import (
    MODEL,
    REQUESTS,
    Request,
    closed_loop,
    percentile,
    workload,
)
from inferfleet.producer import Producer
from inferfleet.worker.embedded import EmbeddedRedis
from inferfleet.worker.runtime.memory import tune_allocator
from inferfleet.worker.runtime.stepwise import StepwiseHandler
from inferfleet.worker.serving.continuous import Generator
from tests.fixtures.tiny_lm import TinyLM

ROOT = Path(__file__).resolve().parent.parent
NAME = "tokens"
#: The environment variable that gives the worker's model (:class:`BenchLM`) its slots.
SLOTS_ENV = "BENCH_STREAMING_SLOTS"
#: The longest a client waits for a chunk before the run fails.
CHUNK_TIMEOUT_S = 60.0
#: The most client threads, and the most slots (each holds a key-value cache of 256 positions).
MAX_CONCURRENCY, MAX_SLOTS = 1024, 256
#: redis-server's commands counted a generated token.
COMMANDS = ("evalsha", "xread", "xreadgroup", "xadd")
#: The most ``--chunk-ms`` values (a worker each), and the longest (the worker's own bound).
MAX_CHUNK_VALUES, MAX_CHUNK_MS = 4, 10_000.0


class BenchLM(TinyLM):
    """The worker's model: :class:`TinyLM` from ``models/tinylm.pt`` with the slots that
    :data:`SLOTS_ENV` says (8 if unset), so ``--slots`` reaches the worker process."""

    def __init__(self) -> None:
        super().__init__(path=str(MODEL), max_slots=int(os.environ.get(SLOTS_ENV, "8")))


class Outcome:
    """What one closed-loop run measured: each request's tokens, its time to first token, the
    seconds a token between its chunks, the seconds between its chunks, the chunks, the wall
    time and the generator's iterations."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self.tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
        self.ttft: list[float] = []
        self.gaps: list[float] = []
        self.chunk_gaps: list[float] = []
        self.chunks = 0
        self.wall = 0.0
        self.iterations = 0

    @property
    def total(self) -> int:
        """Tokens generated in all."""
        return sum(map(len, self.tokens.values()))

    def row(self) -> dict[str, float]:
        """The run's figures (ms, tokens a second; an iteration's only where counted)."""
        row = {
            "tokens_per_s": round(self.total / self.wall, 1),
            "ttft_p50_ms": round(1000 * percentile(self.ttft, 0.50), 3),
            "ttft_p99_ms": round(1000 * percentile(self.ttft, 0.99), 3),
            "tpot_p50_ms": round(1000 * percentile(self.gaps, 0.50), 3),
            "tpot_p99_ms": round(1000 * percentile(self.gaps, 0.99), 3),
            "chunk_gap_p50_ms": round(1000 * percentile(self.chunk_gaps, 0.50), 3),
            "chunk_gap_p99_ms": round(1000 * percentile(self.chunk_gaps, 0.99), 3),
            "tokens_per_chunk": round(self.total / max(1, self.chunks), 2),
            "tokens": self.total,
            "wall_s": round(self.wall, 3),
        }
        if self.iterations:
            row["iteration_ms"] = round(1000 * self.wall / self.iterations, 3)
            row["tokens_per_iteration"] = round(self.total / self.iterations, 2)
        return row


# ---- the in-process baseline: no queue ----


def in_process(model: StepwiseHandler, requests: Sequence[Request], concurrency: int) -> Outcome:
    """``requests`` through a continuous :class:`Generator` on ``model`` in this process,
    ``concurrency`` in flight at all times (bench_generation's loop, on the model itself)."""
    generator = Generator(model, "continuous")
    out = Outcome(requests)
    last: dict[str, float] = {}
    started = time.perf_counter()
    for now, made, submitted in closed_loop(generator, requests, concurrency):
        out.iterations += 1
        out.chunks += len(made)  # a token a chunk
        for token in made:
            out.tokens[token.rid].append(token.token)
            if token.index == 0:
                out.ttft.append(now - submitted[token.rid])
            else:
                out.gaps.append(now - last[token.rid])
                out.chunk_gaps.append(now - last[token.rid])
            last[token.rid] = now
    out.wall = time.perf_counter() - started
    return out


# ---- streamed through Redis and a worker ----


def streamed(url: str, requests: Sequence[Request], concurrency: int, name: str = NAME) -> Outcome:
    """``requests`` streamed to queue ``name`` by ``concurrency`` client threads, each with its
    own Producer, each sending its next request once it has read the last one's final chunk."""
    pending = deque(requests)
    lock = threading.Lock()
    out = Outcome(requests)
    failures: list[BaseException] = []
    producers = [Producer(url, name) for _ in range(concurrency)]
    for producer in producers:  # connected before the clock starts
        producer.redis.ping()
    start = threading.Barrier(concurrency + 1)

    def client(producer: Producer) -> None:
        try:
            start.wait()
            while True:
                with lock:
                    if not pending or failures:
                        return
                    rid, prompt, params = pending.popleft()
                mine, gaps, chunk_gaps = out.tokens[rid], [], []
                sent = time.perf_counter()
                chunks = producer.stream(
                    prompt, {"max_new_tokens": params.max_new_tokens}, timeout_s=CHUNK_TIMEOUT_S
                )
                first: float | None = None
                previous = 0.0
                for chunk in chunks:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    elif chunk.tokens.size:
                        gaps.append((now - previous) / chunk.tokens.size)
                        chunk_gaps.append(now - previous)
                    previous = now
                    mine.extend(int(t) for t in chunk.tokens)
                with lock:
                    out.ttft.append((first or previous) - sent)
                    out.gaps.extend(gaps)
                    out.chunk_gaps.extend(chunk_gaps)
                    out.chunks += 1 + len(chunk_gaps)
        except BaseException as exc:  # noqa: BLE001 - raised again by the main thread
            with lock:
                failures.append(exc)

    threads = [threading.Thread(target=client, args=(p,), daemon=True) for p in producers]
    for thread in threads:
        thread.start()
    start.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    out.wall = time.perf_counter() - started
    for producer in producers:
        producer.close()
    if failures:
        raise RuntimeError(f"a streaming client failed: {failures[0]!r}") from failures[0]
    return out


def start_worker(url: str, slots: int, chunk: float = 0.0, name: str = NAME) -> subprocess.Popen:
    """One ``inferfleet worker`` of queue ``name`` serving :class:`BenchLM` with ``slots``
    slots, one torch thread, its streamed tokens gathered ``chunk`` ms into a chunk (its
    ``--chunk-ms``)."""
    cmd = [
        sys.executable,
        "-m",
        "inferfleet",
        "worker",
        *("--name", name, "--model", "benchmarks.bench_streaming:BenchLM"),
        *("--redis-url", url, "--consumer", "stream-0", "--torch-threads", "1"),
        *("--chunk-ms", repr(chunk), "--log-level", "warning"),
    ]
    env = {**os.environ, SLOTS_ENV: str(slots)}
    env.pop("REDIS_URL", None)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)


def wait_joined(
    client: redis.Redis, worker: subprocess.Popen, timeout_s: float = 120, name: str = NAME
) -> None:
    """Until the worker has joined queue ``name``'s group (it has loaded its model)."""
    deadline = time.monotonic() + timeout_s
    stream = f"inferfleet:{{{name}}}:requests"
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited with status {worker.returncode}")
        try:
            if client.xinfo_consumers(stream, "workers"):
                return
        except redis.exceptions.ResponseError:
            pass  # no stream or group yet
        time.sleep(0.05)
    raise TimeoutError(f"the worker did not join within {timeout_s} s")


def command_calls(client: redis.Redis) -> dict[str, int]:
    """redis-server's calls so far of each of :data:`COMMANDS`."""
    stats = client.info("commandstats")
    return {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in COMMANDS}


def streamed_run(
    server: EmbeddedRedis,
    worker: subprocess.Popen,
    requests: Sequence[Request],
    n: int,
    name: str = NAME,
) -> tuple[dict[str, float], Outcome]:
    """One streamed run to queue ``name`` (``worker``'s) with each process's CPU and
    redis-server's commands a token."""
    assert server.pid is not None
    client = redis.Redis.from_url(server.url)
    calls = command_calls(client)
    before = (cpu_s(worker.pid), cpu_s(server.pid), time.process_time())
    out = streamed(server.url, requests, n, name)
    after = (cpu_s(worker.pid), cpu_s(server.pid), time.process_time())
    done = command_calls(client)
    client.close()
    script_calls = max(1, done["evalsha"] - calls["evalsha"])
    per_token = 1e6 / out.total
    row = {
        **out.row(),
        "script_call_ms": round(1000 * out.wall / script_calls, 3),
        "tokens_per_script_call": round(out.total / script_calls, 2),
        "worker_busy": round((after[0] - before[0]) / out.wall, 3),
        "worker_us": round((after[0] - before[0]) * per_token, 1),
        "redis_us": round((after[1] - before[1]) * per_token, 1),
        "client_us": round((after[2] - before[2]) * per_token, 1),
    }
    for name in COMMANDS:
        row[f"{name}_per_token"] = round((done[name] - calls[name]) / out.total, 3)
    return row, out


def in_process_run(
    model: StepwiseHandler, requests: Sequence[Request], n: int
) -> tuple[dict[str, float], Outcome]:
    """One in-process run with this process's CPU a token."""
    before = time.process_time()
    out = in_process(model, requests, n)
    cpu = time.process_time() - before
    return {**out.row(), "client_us": round(cpu * 1e6 / out.total, 1)}, out


def check_equal(streamed_out: Outcome, local: Outcome, n: int) -> None:
    """Fail unless every request streamed the tokens the in-process run made (greedy)."""
    wrong = [rid for rid, tokens in local.tokens.items() if streamed_out.tokens[rid] != tokens]
    if wrong:
        rid = wrong[0]
        raise SystemExit(
            f"at concurrency {n}, {len(wrong)} streamed request(s) differ from the in-process "
            f"run, first {rid}: streamed {streamed_out.tokens[rid][:12]}... "
            f"in-process {local.tokens[rid][:12]}..."
        )


def median_row(rows: list[dict[str, float]]) -> dict[str, float]:
    """The median of each figure over the runs."""
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def chunk_ms(text: str) -> float:
    """An argparse type: the worker's ``--chunk-ms``, a number of 0 to :data:`MAX_CHUNK_MS`."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not 0 <= value <= MAX_CHUNK_MS:
        raise argparse.ArgumentTypeError(f"{value} is not within 0 and {MAX_CHUNK_MS:g}")
    return value


def positive(text: str) -> int:
    """An argparse type: an int of 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not 1 or more")
    return value


def ratio(row: dict[str, float], local_row: dict[str, float]) -> dict[str, float]:
    """A streamed run's tokens a second over the in-process run's, and the time to first
    token it adds."""
    return {
        "tokens_per_s_ratio": round(row["tokens_per_s"] / local_row["tokens_per_s"], 3),
        "ttft_p50_added_ms": round(row["ttft_p50_ms"] - local_row["ttft_p50_ms"], 3),
        "ttft_p99_added_ms": round(row["ttft_p99_ms"] - local_row["ttft_p99_ms"], 3),
    }


def main() -> None:
    """Parse the options, start Redis and a worker a ``--chunk-ms``, run every concurrency's
    kinds interleaved, print one JSON line per concurrency and kind."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--concurrency",
        type=positive,
        nargs="+",
        default=[1, 8, 32],
        help="requests in flight (client threads); several: one row each",
    )
    parser.add_argument(
        "--requests", type=positive, default=REQUESTS, help="requests a run, at every concurrency"
    )
    parser.add_argument("--runs", type=positive, default=3, help="runs (figures: medians)")
    parser.add_argument(
        "--slots", type=positive, default=8, help="the model's key-value cache slots"
    )
    parser.add_argument(
        "--chunk-ms",
        type=chunk_ms,
        nargs="+",
        default=[0.0],
        help="the worker's --chunk-ms: its streamed tokens made within this long go out as one "
        "chunk (0: a chunk a token); several: a worker and rows each",
    )
    args = parser.parse_args()
    if max(args.concurrency) > MAX_CONCURRENCY or args.slots > MAX_SLOTS:
        parser.error(
            f"--concurrency takes at most {MAX_CONCURRENCY} (a thread each), --slots at most "
            f"{MAX_SLOTS} (the key-value cache of each slot is allocated in both processes)"
        )
    chunks = list(dict.fromkeys(args.chunk_ms))  # each value once, in order
    if len(chunks) > MAX_CHUNK_VALUES:
        parser.error(f"--chunk-ms takes at most {MAX_CHUNK_VALUES} values (a worker each)")
    if not MODEL.exists():
        parser.error(f"{MODEL} is missing: python -m tests.fixtures.build_models --only tinylm")

    torch.set_num_threads(1)  # as the worker's --torch-threads 1
    tune_allocator()  # as the worker's --tune-malloc (its default)
    model = TinyLM(path=str(MODEL), max_slots=args.slots)
    model.setup(torch.device("cpu"))
    requests = workload(args.requests)
    warm = workload(2 * args.slots, seed=1)
    names = [NAME if i == 0 else f"{NAME}-{i}" for i in range(len(chunks))]  # a queue a worker
    rows: dict[tuple[int, str, float], list[dict[str, float]]] = {}
    ratios: dict[tuple[int, float], list[dict[str, float]]] = {}
    with EmbeddedRedis() as server:
        workers: list[subprocess.Popen] = []
        try:
            for chunk, name in zip(chunks, names):
                workers.append(start_worker(server.url, args.slots, chunk, name))
            for worker, name in zip(workers, names):
                wait_joined(redis.Redis.from_url(server.url), worker, name=name)
                streamed(server.url, warm, args.slots, name)  # warm-up, not measured
            in_process(model, warm, args.slots)
            for run in range(args.runs):
                for n in args.concurrency:  # interleaved: a drift of the machine hits all
                    streamed_rows: dict[float, tuple[dict[str, float], Outcome]] = {}
                    turn = run % len(chunks)  # each worker's runs first in turn
                    for i in [*range(turn, len(chunks)), *range(turn)]:
                        streamed_rows[chunks[i]] = streamed_run(
                            server, workers[i], requests, n, names[i]
                        )
                    local_row, local = in_process_run(model, requests, n)
                    rows.setdefault((n, "no queue", 0.0), []).append(local_row)
                    for chunk in chunks:
                        row, out = streamed_rows[chunk]
                        check_equal(out, local, n)
                        rows.setdefault((n, "redis", chunk), []).append(row)
                        ratios.setdefault((n, chunk), []).append(ratio(row, local_row))
        finally:
            for worker in workers:
                worker.terminate()
            for worker in workers:
                worker.wait(60)
    for n in args.concurrency:
        line = {"concurrency": n, "slots": args.slots, "requests": args.requests}
        for chunk in chunks:
            redis_row = {"chunk_ms": chunk, **median_row(rows[(n, "redis", chunk)])}
            print(json.dumps({**line, "kind": "redis", **redis_row}), flush=True)
        local_row = median_row(rows[(n, "no queue", 0.0)])
        print(json.dumps({**line, "kind": "no queue", **local_row}), flush=True)
        for chunk in chunks:
            runs = ratios[(n, chunk)]
            print(
                json.dumps(
                    {**line, "kind": "ratio", "chunk_ms": chunk, **median_row(runs), "runs": runs}
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
