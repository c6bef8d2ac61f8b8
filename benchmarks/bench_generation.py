"""Continuous against static batching of a step-wise model, in-process, closed loop (issue 34).

The example tiny language model (``models/tinylm.pt``, built by ``python -m
tests.fixtures.build_models --only tinylm``) generates a fixed workload of ``--requests``
requests of mixed lengths through :class:`inferfleet.worker.serving.continuous.Generator` as
serving benchmarks drive a server: a CLOSED LOOP of ``--concurrency`` clients, N requests in
flight at all times; the moment one ends (its last token out of an iteration) its client
submits the next of the workload, and that submission is the start of its time to first
token. Three modes, interleaved within each run (medians over ``--runs``):

* ``continuous``: every iteration admits waiting requests into free slots and steps every
  live sequence; a finished one frees its slot at once;
* ``static``: a batch is admitted only into an empty batch and runs until its last member ends
  (finished members leave it, so this baseline computes less than a padded static batch);
* ``sequential``: one request at a time.

Reported per mode and concurrency: generated tokens a second (all tokens over the wall time
from the first submission to the last token), the time to first token of each request from
its own submission at p50 and p99 (nearest rank), the scheduler's iterations, the model's
forward passes (``prefill`` and ``step`` calls), the mean rows of a ``step`` pass (the
sequences live in it), the mean milliseconds of each kind of pass and the share of the wall
time spent in the model (the rest is the scheduler's and this loop's Python). Every mode must
produce the same tokens for every request (greedy): the script checks it.

    python -m tests.fixtures.build_models --only tinylm
    python -m benchmarks.bench_generation --concurrency 1 8 32 --slots 8 --requests 256 --runs 3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from inferfleet.worker.runtime.stepwise import StepwiseHandler
from inferfleet.worker.serving.continuous import MODES, GenerationParams, Generator

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tinylm.pt"
#: Requests of one run, whatever the concurrency (see docs/benchmarks.md for the choice).
REQUESTS = 256

Request = tuple[str, np.ndarray, GenerationParams]


def workload(n: int, seed: int = 0) -> list[Request]:
    """``n`` requests: prompts of 8 to 64 bytes of README.md, three in four asking for 16 to
    32 tokens and one in four for 96 to 128 (the mix that makes a static batch wait)."""
    text = np.frombuffer((ROOT / "README.md").read_bytes(), dtype=np.uint8).astype(np.int64)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        start, size = int(rng.integers(0, text.size - 64)), int(rng.integers(8, 65))
        longest = rng.random() < 0.25
        new = int(rng.integers(96, 129) if longest else rng.integers(16, 33))
        out.append((f"r{i}", text[start : start + size], GenerationParams(max_new_tokens=new)))
    return out


class Counted(StepwiseHandler):
    """``model`` with its forward passes counted and timed: ``prefill`` and ``step`` calls,
    the rows of the step passes (the sequences live in each) and the seconds in each kind."""

    def __init__(self, model: StepwiseHandler) -> None:
        self.model = model
        self.vocab_size, self.eos_token = model.vocab_size, model.eos_token
        self.max_slots, self.max_length = model.max_slots, model.max_length
        self.device = model.device
        self.prefills = self.steps = self.step_rows = 0
        self.prefill_s = self.step_s = 0.0

    def prefill(self, slots: Sequence[int], prompts: Sequence[np.ndarray]) -> np.ndarray:
        """The model's prefill, counted and timed."""
        began = time.perf_counter()
        out = self.model.prefill(slots, prompts)
        self.prefill_s += time.perf_counter() - began
        self.prefills += 1
        return out

    def step(self, slots: Sequence[int], tokens: np.ndarray) -> np.ndarray:
        """The model's step, counted with its rows and timed."""
        began = time.perf_counter()
        out = self.model.step(slots, tokens)
        self.step_s += time.perf_counter() - began
        self.steps += 1
        self.step_rows += len(slots)
        return out

    def release(self, slot: int) -> None:
        """The model's release."""
        self.model.release(slot)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def one_run(
    model: StepwiseHandler, mode: str, requests: Sequence[Request], concurrency: int
) -> tuple[dict[str, float], dict[str, list[int]]]:
    """Generate ``requests`` in ``mode``, ``concurrency`` of them in flight at all times (a
    closed loop); its figures and every request's tokens."""
    counted = Counted(model)
    generator = Generator(counted, mode)
    pending = deque(requests)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    submitted: dict[str, float] = {}
    ttft: list[float] = []
    iterations = 0
    started = time.perf_counter()

    def feed(in_flight: int) -> int:
        while pending and in_flight < concurrency:
            rid, prompt, params = pending.popleft()
            submitted[rid] = time.perf_counter()
            generator.submit(rid, prompt, params)
            in_flight += 1
        return in_flight

    in_flight = feed(0)
    while not generator.idle:
        made = generator.iterate()
        iterations += 1
        now = time.perf_counter()
        for token in made:
            tokens[token.rid].append(token.token)
            if token.index == 0:
                ttft.append(now - submitted[token.rid])
            if token.finished is not None:
                in_flight -= 1
        in_flight = feed(in_flight)
    wall = time.perf_counter() - started
    total = sum(map(len, tokens.values()))
    row = {
        "tokens_per_s": round(total / wall, 1),
        "ttft_p50_ms": round(1000 * percentile(ttft, 0.50), 2),
        "ttft_p99_ms": round(1000 * percentile(ttft, 0.99), 2),
        "iterations": iterations,
        "prefills": counted.prefills,
        "steps": counted.steps,
        "rows_per_step": round(counted.step_rows / max(1, counted.steps), 2),
        "step_ms": round(1000 * counted.step_s / max(1, counted.steps), 3),
        "prefill_ms": round(1000 * counted.prefill_s / max(1, counted.prefills), 3),
        "model_share": round((counted.step_s + counted.prefill_s) / wall, 3),
        "tokens": total,
        "wall_s": round(wall, 3),
    }
    return row, tokens


def main() -> None:
    """Parse the options, run every concurrency's modes interleaved, print JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8, 32], help="requests in flight"
    )
    parser.add_argument("--slots", type=int, default=8, help="sequences live at once")
    parser.add_argument(
        "--requests", type=int, default=REQUESTS, help="requests a run, at every concurrency"
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", type=Path, default=MODEL)
    args = parser.parse_args()
    if min(args.concurrency) < 1 or min(args.slots, args.requests, args.runs) < 1:
        parser.error("--concurrency, --slots, --requests and --runs take 1 or more")
    if not args.model.exists():
        parser.error(
            f"{args.model} is missing: python -m tests.fixtures.build_models --only tinylm"
        )
    from tests.fixtures.tiny_lm import TinyLM

    torch.set_num_threads(1)  # one core, as one worker process has
    model = TinyLM(path=str(args.model), max_slots=args.slots)
    model.setup(torch.device("cpu"))
    requests = workload(args.requests)
    for mode in MODES:  # warm-up, not measured: the first passes of a process are slower
        one_run(model, mode, requests[: 2 * args.slots], args.slots)
    for n in args.concurrency:
        rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for _ in range(args.runs):
            outputs = {}
            for mode in MODES:  # interleaved: a drift of the machine hits every mode
                row, outputs[mode] = one_run(model, mode, requests, n)
                rows[mode].append(row)
            if not outputs["continuous"] == outputs["static"] == outputs["sequential"]:
                raise SystemExit("the modes generated different tokens: batching changed outputs")
        for mode, runs in rows.items():
            median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            line = {"concurrency": n, "slots": args.slots, "requests": args.requests}
            print(json.dumps({**line, "mode": mode, **median}), flush=True)


if __name__ == "__main__":
    main()
