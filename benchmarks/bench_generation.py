"""Continuous against static batching of a step-wise model, in-process (issue 34, first round).

The example tiny language model (``models/tinylm.pt``, built by ``python -m
tests.fixtures.build_models --only tinylm``) generates for N concurrent requests of mixed
lengths, all arriving at once, through :class:`inferfleet.worker.serving.continuous.Generator`
in three modes, interleaved within each run (medians over ``--runs``):

* ``continuous``: every iteration admits waiting requests into free slots and steps every
  live sequence; a finished one frees its slot at once;
* ``static``: a batch is admitted only into an empty batch and runs until its last member ends
  (finished members leave it, so this baseline computes less than a padded static batch);
* ``sequential``: one request at a time.

Reported per mode and concurrency: generated tokens a second, the time to first token of
each request (from the moment all were submitted) at p50 and p99, and forward passes. Every
mode must produce the same tokens for every request (greedy): the script checks it.

    python -m tests.fixtures.build_models --only tinylm
    python -m benchmarks.bench_generation --concurrency 1 8 32 --slots 8 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from inferfleet.worker.serving.continuous import MODES, GenerationParams, Generator

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tinylm.pt"


def workload(n: int, seed: int = 0) -> list[tuple[str, np.ndarray, GenerationParams]]:
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


def one_run(model, mode: str, requests) -> tuple[dict[str, float], dict[str, list[int]]]:
    """Generate ``requests`` in ``mode``; its figures and every request's tokens."""
    generator = Generator(model, mode)
    calls = {"forward": 0}
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    first: dict[str, float] = {}
    started = time.perf_counter()
    for rid, prompt, params in requests:
        generator.submit(rid, prompt, params)
    while not generator.idle:
        made = generator.iterate()
        calls["forward"] += 1
        now = time.perf_counter() - started
        for token in made:
            tokens[token.rid].append(token.token)
            first.setdefault(token.rid, now)
    wall = time.perf_counter() - started
    ttft = sorted(first.values())
    row = {
        "tokens_per_s": round(sum(map(len, tokens.values())) / wall, 1),
        "ttft_p50_ms": round(1000 * ttft[len(ttft) // 2], 1),
        "ttft_p99_ms": round(1000 * ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))], 1),
        "iterations": calls["forward"],
        "tokens": sum(map(len, tokens.values())),
    }
    return row, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--slots", type=int, default=8, help="sequences live at once")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", type=Path, default=MODEL)
    args = parser.parse_args()
    if min(args.concurrency) < 1 or args.slots < 1 or args.runs < 1:
        parser.error("--concurrency, --slots and --runs take 1 or more")
    if not args.model.exists():
        parser.error(
            f"{args.model} is missing: python -m tests.fixtures.build_models --only tinylm"
        )
    from tests.fixtures.tiny_lm import TinyLM

    torch.set_num_threads(1)  # one core, as one worker process has
    model = TinyLM(path=str(args.model), max_slots=args.slots)
    model.setup(torch.device("cpu"))
    for n in args.concurrency:
        requests = workload(n)
        rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for _ in range(args.runs):
            outputs = {}
            for mode in MODES:  # interleaved: a drift of the machine hits every mode
                row, outputs[mode] = one_run(model, mode, requests)
                rows[mode].append(row)
            if not outputs["continuous"] == outputs["static"] == outputs["sequential"]:
                raise SystemExit("the modes generated different tokens: batching changed outputs")
        for mode, runs in rows.items():
            median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            print(json.dumps({"concurrency": n, "slots": args.slots, "mode": mode, **median}))


if __name__ == "__main__":
    main()
