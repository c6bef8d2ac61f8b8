#!/usr/bin/env python3
"""Autoscaling to a latency target: the policies replayed on traces, then run for real.

``replay``: every policy against each trace in the replayer
(:mod:`inferfleet.worker.fleet.replay`), the baselines tuned over their knobs
(the cheapest setting that keeps 99% of requests under the target wins),
the target policy at its defaults. Prints a table, writes JSON and plots.

    python -m benchmarks.bench_autoscale replay --seconds 600 --out bench-out/autoscale

``real``: the real supervisor and workers (the simulated-accelerator handler:
a batch of up to 4 rows takes 50 ms, so 80 requests/s a worker and a fleet
of 8 on two cores) on a trace sent open loop through the SDK, one run per
policy; the replayer's prediction for the same arrivals and the measured
warm-up beside each.

    python -m benchmarks.bench_autoscale real --trace diurnal --seconds 600

``zero``: with ``--min-workers 0``, how long the first request after idle waits.

``trace``: write a trace file as a user would supply one (one Unix time a line): bursts of
five times the base rate for 20 s every 90 s, the traffic of a batch job calling a service.

    python -m benchmarks.bench_autoscale trace --out bench-out/autoscale/bursts.txt

    python -m benchmarks.bench_autoscale zero --runs 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import redis

from inferfleet.producer import Producer
from inferfleet.producer.protocol import QueueKeys, decode_reply
from inferfleet.worker.bench.load import OpenLoop
from inferfleet.worker.embedded import EmbeddedRedis
from inferfleet.worker.fleet import traces
from inferfleet.worker.fleet.replay import ReplayResult, ServiceModel, replay
from inferfleet.worker.fleet.scaling import PolicySettings
from inferfleet.worker.fleet.waits import Fleet, predicted_p99_s
from inferfleet.worker.heartbeat import read_heartbeats
from inferfleet.worker.keys import supervisor_key

ROOT = Path(__file__).resolve().parent.parent
HANDLER = "tests.fixtures.example_handlers:SimulatedAccelerator"
#: The settings every run shares: the fleet's bounds and the capacity assumed until measured.
BASE = {"min_workers": 1, "max_workers": 8, "default_capacity_rps": 80.0}
#: Each baseline's knobs, tuned over these (the target policy runs at its defaults).
GRIDS: dict[str, list[dict[str, float]]] = {
    "target": [{}],
    "lag": [
        {"target_drain_s": d, "down_cooldown_s": c, "target_utilization": u, "down_utilization": w}
        for d, c, u, w in itertools.product(
            [0.25, 0.5, 1.0, 2.0, 5.0], [5.0, 10.0, 20.0], [0.75, 0.85, 0.95], [0.4, 0.6, 0.7]
        )
        if w < u
    ],
    "article": [
        {"article_up_queue": u, "article_down_queue": d, "article_interval_s": i}
        for u, d, i in itertools.product([2, 5, 10, 20, 50], [0.5, 1, 2, 5, 10], [1, 2, 5])
        if d < u
    ],
    "keda": [{"keda_lag_count": c} for c in (1, 2, 3, 5, 10, 20, 50)],
}
#: What meeting the target means: at most this share of requests over it.
MISS_ALLOWED = 0.01


# --------------------------------------------------------------------------- the replayer


def trace_times(name: str, seconds: float, peak_rps: float, seed: int) -> np.ndarray:
    """The named trace's arrivals, or a file's (one time a line) when ``name`` is a path."""
    if Path(name).is_file():
        return traces.read_trace_file(name)
    return traces.arrivals(traces.rate_of(name, seconds, peak_rps), seconds, seed)


def tune(
    times: np.ndarray, kind: str, service: ServiceModel, target_s: float, seconds: float
) -> tuple[dict[str, float], ReplayResult, dict[str, float]] | None:
    """The cheapest setting of ``kind`` meeting the target (None if none does)."""
    best = None
    for knobs in GRIDS[kind]:
        settings = PolicySettings(kind=kind, target_p99_ms=target_s * 1000, **BASE, **knobs)
        result = replay(times, settings, service, seconds=seconds)
        summary = result.summary(target_s)
        if summary["over_target"] <= MISS_ALLOWED and (
            best is None or summary["worker_s"] < best[2]["worker_s"]
        ):
            best = (knobs, result, summary)
    return best


def cheapest_failing(
    times: np.ndarray, kind: str, service: ServiceModel, target_s: float, seconds: float
) -> tuple[dict[str, float], dict[str, float]]:
    """For a baseline no setting of which meets the target: its setting that misses least."""
    rows = []
    for knobs in GRIDS[kind]:
        settings = PolicySettings(kind=kind, target_p99_ms=target_s * 1000, **BASE, **knobs)
        rows.append((knobs, replay(times, settings, service, seconds=seconds).summary(target_s)))
    return min(rows, key=lambda row: (row[1]["over_target"], row[1]["worker_s"]))


def replay_trace(name: str, args: argparse.Namespace, service: ServiceModel) -> dict[str, Any]:
    """Every policy on one trace: rows for the table, the results for the plot."""
    times = trace_times(name, args.seconds, args.peak_rps, args.seed)
    seconds = float(times[-1]) if Path(name).is_file() else args.seconds
    target_s = args.target_p99_ms / 1000
    rows, results = [], {}
    for kind in GRIDS:
        best = tune(times, kind, service, target_s, seconds)
        if best is None:
            knobs, summary = cheapest_failing(times, kind, service, target_s, seconds)
            rows.append({"policy": kind, "setting": knobs, "meets": False, **summary})
            continue
        knobs, result, summary = best
        rows.append({"policy": kind, "setting": knobs, "meets": True, **summary})
        results[kind] = result
    oracle = oracle_worker_s(times, seconds, service, target_s)
    return {
        "trace": name,
        "requests": len(times),
        "oracle_worker_s": oracle,
        "rows": rows,
        "results": results,
    }


def oracle_worker_s(
    times: np.ndarray, seconds: float, service: ServiceModel, target_s: float
) -> float:
    """A floor no policy reaches: each second, the fewest workers whose steady p99 at that
    second's arrivals meets the target, as if the arrivals were known and workers warm at once."""
    total = 0
    for count in traces.rates_per_second(times, seconds):
        fleet = Fleet(float(count), service.capacity_rps, 0, 0, 0.0, service.batch_time(1))
        workers = 1
        while predicted_p99_s(replace(fleet, ready=workers), workers) > target_s:
            workers += 1
        total += workers
    return float(total)


def saving(rows: list[dict[str, Any]]) -> str:
    """How many fewer worker-seconds the target policy spent than the best baseline meeting it."""
    target = next(r for r in rows if r["policy"] == "target")
    meeting = [r for r in rows if r["policy"] != "target" and r["meets"]]
    if not target["meets"]:
        return "target policy misses the target"
    if not meeting:
        return "no baseline meets the target"
    best = min(meeting, key=lambda r: r["worker_s"])
    return f"{1 - target['worker_s'] / best['worker_s']:.0%} fewer than {best['policy']}"


def table(trace: dict[str, Any], target_ms: float) -> str:
    """The trace's rows as markdown."""
    lines = [
        f"**{trace['trace']}** ({trace['requests']:,} requests; target p99 {target_ms:g} ms: "
        f"{saving(trace['rows'])}; the oracle's floor {trace['oracle_worker_s']:,.0f} worker-s)",
        "",
        "| policy | setting (tuned) | meets | worker-s | p50 ms | p99 ms | over target | events |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in trace["rows"]:
        setting = ", ".join(f"{k}={v:g}" for k, v in r["setting"].items()) or "defaults"
        lines.append(
            f"| {r['policy']} | {setting} | {'yes' if r['meets'] else 'no'} | "
            f"{r['worker_s']:,.0f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
            f"{r['over_target']:.2%} | {r['scale_events']:.0f} |"
        )
    return "\n".join(lines)


def windowed_p99_ms(arrivals_s: np.ndarray, latencies_s: np.ndarray, step_s: float) -> list:
    """(window start, p99 ms) of the requests arriving in each ``step_s`` window."""
    out = []
    edges = np.arange(0.0, float(arrivals_s[-1]) + step_s, step_s) if len(arrivals_s) else []
    for start in edges:
        mask = (arrivals_s >= start) & (arrivals_s < start + step_s)
        if mask.any():
            out.append((float(start), float(np.percentile(latencies_s[mask], 99)) * 1000))
    return out


def plot(path: Path, title: str, rate: np.ndarray, runs: dict[str, dict], target_ms: float):
    """Load, workers and p99 over time, one line per policy, into a PNG."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    fig = Figure(figsize=(10, 8))
    load, workers, p99 = fig.subplots(3, 1, sharex=True)
    load.plot(np.arange(len(rate)), rate, color="grey")
    load.set_ylabel("arrivals / s")
    for name, run in runs.items():
        workers.step(run["t"], run["workers"], where="post", label=name)
        window = run["p99"]
        p99.plot([t for t, _ in window], [min(v, 5 * target_ms) for _, v in window], label=name)
    p99.axhline(target_ms, color="red", linestyle="--", label="target")
    workers.set_ylabel("workers")
    p99.set_ylabel("p99 ms (10 s windows)")
    p99.set_xlabel("seconds")
    workers.legend(loc="upper left", fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=80)


def cmd_replay(args: argparse.Namespace) -> None:
    service = ServiceModel(args.batch_ms / 1000, 0.0, args.max_rows, args.warm_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = []
    for name in args.traces.split(","):
        trace = replay_trace(name, args, service)
        print(table(trace, args.target_p99_ms) + "\n", flush=True)
        runs = {
            kind: {
                "t": [t.now_s for t in result.ticks],
                "workers": [t.decided for t in result.ticks],
                "p99": windowed_p99_ms(result.arrivals_s, result.latencies_s, 10.0),
            }
            for kind, result in trace.pop("results").items()
        }
        times = trace_times(name, args.seconds, args.peak_rps, args.seed)
        rate = traces.rates_per_second(times, float(times[-1]) if len(times) else 0.0)
        label = Path(name).stem
        plot(out / f"replay-{label}.png", f"replayed: {label}", rate, runs, args.target_p99_ms)
        report.append(trace)
    (out / "replay.json").write_text(json.dumps(report, indent=1))


# --------------------------------------------------------------------------- the real fleet


class TracedLoop(OpenLoop):
    """The open loop, keeping each reply's send offset beside its latency."""

    def _samples(self) -> Any:
        offsets, latencies, errors = [], [], 0
        for raw, taken in self.received:
            reply = decode_reply(raw)
            due = self.due_at.pop(reply.id, None)
            if due is not None:
                offsets.append(due - self.start)
                latencies.append(taken - due)
                errors += not reply.ok
        order = np.argsort(offsets)
        return np.array(offsets)[order], np.array(latencies)[order], errors


@dataclass
class FleetWatch:
    """Samples the supervisor's view (processes running, workers wanted) and the warm-ups."""

    client: redis.Redis
    keys: QueueKeys
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    warm_s: dict[str, float] = field(default_factory=dict)
    batch_ms: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, start: float) -> None:
        while not self.stop.wait(0.5):
            info = self.client.hgetall(supervisor_key(self.keys))
            running = int(info.get(b"running", 0))
            desired = int(info.get(b"desired", 0))
            self.samples.append((time.perf_counter() - start, running, desired))
            for beat in read_heartbeats(self.client, self.keys):
                if beat.warm_s is not None:
                    self.warm_s[beat.consumer] = beat.warm_s
                if beat.batch_ms and beat.busy > 0.3:
                    self.batch_ms.append(beat.batch_ms)

    def worker_seconds(self) -> float:
        """Processes running, integrated over the samples."""
        pairs = zip(self.samples, self.samples[1:], strict=False)
        return sum((b[0] - a[0]) * a[1] for a, b in pairs)

    def scale_events(self) -> int:
        return sum(1 for a, b in zip(self.samples, self.samples[1:], strict=False) if a[2] != b[2])


def cli_options(kind: str, knobs: dict[str, float], target_ms: float) -> list[str]:
    """The supervise options for a policy and its tuned knobs."""
    options = ["--policy", kind, "--target-p99-ms", f"{target_ms:g}"]
    for name, value in knobs.items():
        options += [f"--{name.replace('_', '-')}", f"{value:g}"]
    return options


def supervise(url: str, options: list[str], log: Path, min_workers: int = 1) -> subprocess.Popen:
    """``inferfleet supervise`` on the simulated accelerator: 4-row batches of 50 ms. Its log,
    every scaling decision with its reason, goes to ``log``."""
    env = dict(os.environ, REDIS_URL=url, PYTHONPATH=str(ROOT), BATCH_S="0.05")
    cmd = [sys.executable, "-m", "inferfleet", "supervise", "--name", "auto", "--model", HANDLER]
    cmd += ["--max-batch-rows", "4", "--devices", "cpu", "--log-level", "info"]
    cmd += ["--interval-s", "1", "--min-workers", str(min_workers), "--max-workers", "8"]
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([*cmd, *options], env=env, cwd=ROOT, stderr=out, stdout=out)


def wait_for_workers(client: redis.Redis, proc: subprocess.Popen, count: int) -> None:
    deadline = time.monotonic() + 120
    while len(read_heartbeats(client, QueueKeys("auto"))) < count:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("the supervisor's workers did not start")
        time.sleep(0.1)


def real_run(
    kind: str, knobs: dict[str, float], times: np.ndarray, target_ms: float, out: Path
) -> dict:
    """One policy on the real fleet: what happened, and what the replayer predicts of it."""
    with EmbeddedRedis() as server:
        log = out / f"supervise-{kind}.log"
        proc = supervise(server.url, cli_options(kind, knobs, target_ms), log)
        client = redis.Redis.from_url(server.url)
        try:
            wait_for_workers(client, proc, 1)
            watch = FleetWatch(client, QueueKeys("auto"))
            with Producer(server.url, "auto") as producer:
                loop = TracedLoop(producer, [np.ones((1, 4), np.float32)], times, 120.0, None)
                watcher = threading.Thread(target=watch.run, args=(loop.start,), daemon=True)
                watcher.start()
                offsets, latencies, errors = loop.run()
            watch.stop.set()
            watcher.join()
        finally:
            proc.terminate()
            proc.wait(120)
    return measured(kind, knobs, times, target_ms, watch, (offsets, latencies, errors))


def measured(kind, knobs, times, target_ms, watch: FleetWatch, got) -> dict:
    offsets, latencies, errors = got
    warm = float(np.median(list(watch.warm_s.values()))) if watch.warm_s else 5.0
    batch = float(np.median(watch.batch_ms)) / 1000 if watch.batch_ms else 0.05
    predicted = replay(
        times,
        PolicySettings(kind=kind, target_p99_ms=target_ms, **BASE, **knobs),
        ServiceModel(batch, 0.0, 4, warm),
        seconds=float(times[-1]),
    ).summary(target_ms / 1000)
    return {
        "policy": kind,
        "setting": knobs,
        "requests": len(times),
        "answered": len(latencies),
        "errors": errors,
        "worker_s": round(watch.worker_seconds(), 1),
        "p50_ms": float(np.percentile(latencies, 50) * 1000),
        "p99_ms": float(np.percentile(latencies, 99) * 1000),
        "over_target": float(np.mean(latencies > target_ms / 1000)),
        "scale_events": watch.scale_events(),
        "warm_s": warm,
        "batch_ms": batch * 1000,
        "predicted": predicted,
        "timeline": watch.samples,
        "p99_windows": windowed_p99_ms(offsets, latencies, 10.0),
    }


def real_table(rows: list[dict], target_ms: float) -> str:
    lines = [
        "| policy | setting | worker-s (replayer) | p50 ms | p99 ms (replayer) "
        "| over target (replayer) | events | warm-up s | lost |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p = r["predicted"]
        setting = ", ".join(f"{k}={v:g}" for k, v in r["setting"].items()) or "defaults"
        lines.append(
            f"| {r['policy']} | {setting} | {r['worker_s']:,.0f} ({p['worker_s']:,.0f}) | "
            f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} ({p['p99_ms']:.0f}) | "
            f"{r['over_target']:.2%} ({p['over_target']:.2%}) | {r['scale_events']} | "
            f"{r['warm_s']:.1f} | {r['requests'] - r['answered']} |"
        )
    return "\n".join(lines)


def tuned_settings(path: Path, trace: str) -> dict[str, dict[str, float]]:
    """The replayer's tuned setting of each policy for ``trace`` (its JSON), if there is one."""
    if not path.is_file():
        return {}
    for entry in json.loads(path.read_text()):
        if entry["trace"] == trace:
            return {r["policy"]: r["setting"] for r in entry["rows"]}
    return {}


def cmd_real(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    times = trace_times(args.trace, args.seconds, args.peak_rps, args.seed)
    tuned = tuned_settings(out / "replay.json", args.trace)
    rows = []
    for kind in args.policies.split(","):
        row = real_run(kind, tuned.get(kind, {}), times, args.target_p99_ms, out)
        rows.append(row)
        print(real_table([row], args.target_p99_ms).splitlines()[-1], flush=True)
        (out / f"real-{args.trace}.json").write_text(json.dumps(rows, indent=1))
    print(real_table(rows, args.target_p99_ms))
    runs = {
        r["policy"]: {
            "t": [t for t, _, _ in r["timeline"]],
            "workers": [n for _, n, _ in r["timeline"]],
            "p99": r["p99_windows"],
        }
        for r in rows
    }
    rate = traces.rates_per_second(times, float(times[-1]))
    label = f"real fleet: {args.trace}"
    plot(out / f"real-{args.trace}.png", label, rate, runs, args.target_p99_ms)


def cmd_zero(args: argparse.Namespace) -> None:
    """Scale to zero, then one request: how long it waits, ``runs`` times."""
    waits = []
    with EmbeddedRedis() as server:
        options = ["--policy", "target", "--down-cooldown-s", "5"]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        proc = supervise(server.url, options, out / "supervise-zero.log", min_workers=0)
        client = redis.Redis.from_url(server.url)
        try:
            with Producer(server.url, "auto") as producer:
                for _ in range(args.runs):
                    idle_until_zero(client, proc)
                    started = time.perf_counter()
                    producer.result(producer.submit(np.ones((1, 4), np.float32)), 120)
                    waits.append(time.perf_counter() - started)
                    print(f"first request after idle: {waits[-1]:.2f} s", flush=True)
        finally:
            proc.terminate()
            proc.wait(120)
    print(f"median {float(np.median(waits)):.2f} s over {len(waits)} runs")


def idle_until_zero(client: redis.Redis, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180
    while True:
        info = client.hgetall(supervisor_key(QueueKeys("auto")))
        if info and int(info.get(b"running", 1)) == 0:
            return
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("the fleet did not scale to zero")
        time.sleep(0.2)


def bursts(seconds: float, peak_rps: float) -> traces.Rate:
    """Five times the base rate for 20 s every 90 s (the first 30 s in), else the base."""

    def rate(t: float) -> float:
        return peak_rps if (t - 30.0) % 90.0 < 20.0 and t >= 30.0 else peak_rps / 5

    return rate


#: Where the written trace's times start: a Unix time, as a user's log export would have them.
TRACE_EPOCH_S = 1_796_000_000.0


def cmd_trace(args: argparse.Namespace) -> None:
    """Write the bursts trace as a file of Unix times, one a line."""
    times = traces.arrivals(bursts(args.seconds, args.peak_rps), args.seconds, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        "# bursts: Unix times of arrivals\n" + "".join(f"{TRACE_EPOCH_S + t:.4f}\n" for t in times)
    )
    print(f"{len(times):,} arrivals over {args.seconds:g} s written to {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("replay", "real", "zero", "trace"):
        one = sub.add_parser(name)
        one.add_argument("--out", default="bench-out/autoscale")
        one.add_argument("--seconds", type=float, default=600.0)
        one.add_argument("--peak-rps", type=float, default=400.0)
        one.add_argument("--seed", type=int, default=1)
        one.add_argument("--target-p99-ms", type=float, default=200.0)
    replay_cmd = sub.choices["replay"]
    replay_cmd.add_argument("--traces", default="diurnal,flash,ramp")
    replay_cmd.add_argument("--batch-ms", type=float, default=50.0)
    replay_cmd.add_argument("--max-rows", type=int, default=4)
    replay_cmd.add_argument("--warm-s", type=float, default=5.0)
    sub.choices["real"].add_argument("--trace", default="diurnal")
    sub.choices["real"].add_argument("--policies", default="target,lag,keda,article")
    sub.choices["zero"].add_argument("--runs", type=int, default=3)
    sub.choices["trace"].set_defaults(out="bench-out/autoscale/bursts.txt")
    args = parser.parse_args(argv)
    unknown = [k for k in getattr(args, "policies", "").split(",") if k and k not in GRIDS]
    if unknown:
        parser.error(f"unknown policies {unknown}: one of {', '.join(GRIDS)}")
    commands = {"replay": cmd_replay, "real": cmd_real, "zero": cmd_zero, "trace": cmd_trace}
    try:
        commands[args.command](args)
    except ValueError as exc:  # a trace name or file that is not one, a bad number
        parser.error(str(exc))


if __name__ == "__main__":
    main()
