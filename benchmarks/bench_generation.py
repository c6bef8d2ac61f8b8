"""Continuous against static batching of a step-wise model, in-process, closed loop (issue 34).

The example tiny language model (``models/tinylm.pt``, built by ``python -m
tests.fixtures.build_models --only tinylm``) generates a fixed workload of ``--requests``
requests of mixed lengths through :class:`inferfleet.worker.serving.continuous.Generator` as
serving benchmarks drive a server: a CLOSED LOOP of ``--concurrency`` clients, N requests in
flight at all times; the moment one ends (its last token out of an iteration) its client
submits the next of the workload, and that submission is the start of its time to first
token. Five variants, interleaved within each run (medians over ``--runs``):

* ``continuous``: every iteration admits waiting requests into free slots and steps every
  live sequence, in ONE forward pass (the model's ``extend``: the admitted prompts and the
  live sequences' next tokens together); a finished one frees its slot at once;
* ``continuous-split``: the same schedule with the iteration in two passes, a ``prefill`` of
  the admitted prompts and then a ``step`` of the live sequences (the scheduler's calls before
  the fused pass): what the fused pass saves;
* ``static``: a batch is admitted only into an empty batch and runs until its last member ends
  (finished members leave it, so this baseline computes less than a padded static batch);
* ``padded``: the same batches, with a finished member's row computed on (its tokens
  dropped) until the batch's longest ends, as a batched ``generate`` call runs a batch;
* ``sequential``: one request at a time.

Reported per mode and concurrency: generated tokens a second (all tokens over the wall time
from the first submission to the last token), the time to first token of each request from
its own submission at p50 and p99 (nearest rank), the scheduler's iterations, the model's
forward passes, those that carry prompts (``prompt_passes``: a fused pass with prompts in it,
or a ``prefill``), the mean rows of a pass that steps live sequences (``rows_per_step``), the
mean milliseconds of a pass with prompts (``prompt_ms``) and of one that only steps
(``step_ms``), and the share of the wall time spent in the model (the rest is the scheduler's
and this loop's Python). Every mode must produce the same tokens for every request (greedy):
the script checks it. One torch thread and glibc's allocator thresholds fixed, as in a worker.

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
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from inferfleet.worker.runtime.memory import tune_allocator
from inferfleet.worker.runtime.stepwise import StepwiseHandler
from inferfleet.worker.serving.continuous import GenerationParams, Generator, Token

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
    """``model`` with its forward passes counted and timed by kind: passes that carry prompts
    (fused ones with prompts in them, or prefills) and passes that only step live sequences,
    with the rows those step. ``fused``: the model's own ``extend`` (one pass an iteration);
    otherwise a prefill and then a step."""

    def __init__(self, model: StepwiseHandler, fused: bool = True) -> None:
        self.model, self.fused = model, fused
        self.vocab_size, self.eos_token = model.vocab_size, model.eos_token
        self.max_slots, self.max_length = model.max_slots, model.max_length
        self.device = model.device
        self.prompt_passes = self.step_passes = self.stepped = self.stepping_passes = 0
        self.prompt_s = self.step_s = 0.0

    def _count(self, began: float, prompts: int, stepped: int) -> None:
        seconds = time.perf_counter() - began
        if prompts:
            self.prompt_passes += 1
            self.prompt_s += seconds
        else:
            self.step_passes += 1
            self.step_s += seconds
        self.stepped += stepped
        self.stepping_passes += stepped > 0

    def extend(
        self, slots: Sequence[int], tokens: Sequence[np.ndarray], starts: Sequence[bool]
    ) -> np.ndarray:
        """The model's one-pass ``extend`` (``fused``), or a prefill and then a step as the
        scheduler called them before the fused pass (the Generator puts the started rows
        first, and gives a live sequence one token)."""
        if not self.fused:
            started = sum(starts)
            assert list(starts) == [True] * started + [False] * (len(slots) - started)
            parts = []
            if started:
                parts.append(self.prefill(slots[:started], tokens[:started]))
            if started < len(slots):
                parts.append(self.step(slots[started:], np.concatenate(tokens[started:])))
            return np.concatenate(parts) if len(parts) > 1 else parts[0]
        began = time.perf_counter()
        out = self.model.extend(slots, tokens, starts)
        self._count(began, sum(starts), len(slots) - sum(starts))
        return out

    def prefill(self, slots: Sequence[int], prompts: Sequence[np.ndarray]) -> np.ndarray:
        """The model's prefill, counted and timed."""
        began = time.perf_counter()
        out = self.model.prefill(slots, prompts)
        self._count(began, len(slots), 0)
        return out

    def step(self, slots: Sequence[int], tokens: np.ndarray) -> np.ndarray:
        """The model's step, counted with its rows and timed."""
        began = time.perf_counter()
        out = self.model.step(slots, tokens)
        self._count(began, 0, len(slots))
        return out

    def release(self, slot: int) -> None:
        """The model's release."""
        self.model.release(slot)


#: The benchmark's variants: the scheduler's modes, and continuous in two passes an iteration.
VARIANTS = ("continuous", "continuous-split", "static", "padded", "sequential")


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def closed_loop(
    generator: Generator, requests: Sequence[Request], concurrency: int
) -> Iterator[tuple[float, list[Token], dict[str, float]]]:
    """Drive ``generator`` as ``concurrency`` clients would: the next of ``requests`` is
    submitted the moment one ends. Yields each iteration's end time, its tokens, and every
    submission's time so far (the start of its time to first token)."""
    pending = deque(requests)
    submitted: dict[str, float] = {}
    in_flight = 0
    while True:
        while pending and in_flight < concurrency:
            rid, prompt, params = pending.popleft()
            submitted[rid] = time.perf_counter()
            generator.submit(rid, prompt, params)
            in_flight += 1
        if generator.idle:
            return
        made = generator.iterate()
        in_flight -= sum(1 for token in made if token.finished is not None)
        yield time.perf_counter(), made, submitted


def one_run(
    model: StepwiseHandler, mode: str, requests: Sequence[Request], concurrency: int
) -> tuple[dict[str, float], dict[str, list[int]]]:
    """Generate ``requests`` in ``mode``, ``concurrency`` of them in flight at all times (a
    closed loop); its figures and every request's tokens."""
    counted = Counted(model, fused=mode != "continuous-split")
    generator = Generator(counted, mode.removesuffix("-split"))
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    ttft: list[float] = []
    iterations = 0
    started = time.perf_counter()
    for now, made, submitted in closed_loop(generator, requests, concurrency):
        iterations += 1
        for token in made:
            tokens[token.rid].append(token.token)
            if token.index == 0:
                ttft.append(now - submitted[token.rid])
    wall = time.perf_counter() - started
    total = sum(map(len, tokens.values()))
    row = {
        "tokens_per_s": round(total / wall, 1),
        "ttft_p50_ms": round(1000 * percentile(ttft, 0.50), 2),
        "ttft_p99_ms": round(1000 * percentile(ttft, 0.99), 2),
        "iterations": iterations,
        "passes": counted.prompt_passes + counted.step_passes,
        "prompt_passes": counted.prompt_passes,
        "rows_per_step": round(counted.stepped / max(1, counted.stepping_passes), 2),
        "prompt_ms": round(1000 * counted.prompt_s / max(1, counted.prompt_passes), 3),
        "step_ms": round(1000 * counted.step_s / max(1, counted.step_passes), 3),
        "model_share": round((counted.prompt_s + counted.step_s) / wall, 3),
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
    # glibc's thresholds fixed, as a worker's are (--tune-malloc, on by default): untuned, a
    # pass's key-value copies (over 128 KiB at 16 slots) were re-mapped and page-faulted on in
    # some runs and not others, depending on what ran before (a step pass 0.70 or 1.2 ms)
    tune_allocator()
    model = TinyLM(path=str(args.model), max_slots=args.slots)
    model.setup(torch.device("cpu"))
    requests = workload(args.requests)
    for mode in VARIANTS:  # warm-up, not measured: the first passes of a process are slower
        one_run(model, mode, requests[: 2 * args.slots], args.slots)
    for n in args.concurrency:
        rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in VARIANTS}
        for _ in range(args.runs):
            outputs = {}
            for mode in VARIANTS:  # interleaved: a drift of the machine hits every mode
                row, outputs[mode] = one_run(model, mode, requests, n)
                rows[mode].append(row)
            if any(outputs[mode] != outputs["continuous"] for mode in VARIANTS):
                raise SystemExit("the modes generated different tokens: batching changed outputs")
        for mode, runs in rows.items():
            median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            line = {"concurrency": n, "slots": args.slots, "requests": args.requests}
            print(json.dumps({**line, "mode": mode, **median}), flush=True)


if __name__ == "__main__":
    main()
