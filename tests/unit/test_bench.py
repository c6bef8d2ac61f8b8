"""``inferfleet bench``: schedules, figures, tables, option checks, the picture, open-loop pacing on
a fake clock."""

from __future__ import annotations

import json

import numpy as np
import pytest

from inferfleet.worker.bench.load import (
    BenchError,
    BenchPlan,
    BenchReport,
    FleetSetup,
    RunSpec,
    Samples,
    compare,
    latency_percentiles_ms,
    markdown_table,
    mean_batch_rows,
    parse_rates,
    render_markdown,
    report_json,
    send_schedule,
    summarize,
    write_outputs,
    write_png,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def report(
    target: str,
    spec: RunSpec,
    qps: float,
    p99_ms: float,
    first_ms: float | None = None,
    sent_qps: float | None = None,
) -> BenchReport:
    latencies_s = np.linspace(0.5, p99_ms, 200) / 1000
    samples = Samples(latencies_s, np.full(200, 8.0), 0, 200 / qps, sent_qps)
    return summarize(samples, target, spec, first_ms)


# --------------------------------------------------------------------------- schedules


def test_fixed_schedule_is_exactly_evenly_spaced():
    offsets = send_schedule(5, 100.0, "fixed")
    np.testing.assert_allclose(offsets, [0.0, 0.01, 0.02, 0.03, 0.04])


def test_poisson_schedule_has_the_mean_rate_and_exponential_gaps():
    offsets = send_schedule(20_000, 1000.0, "poisson", seed=7)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert (len(offsets) - 1) / offsets[-1] == pytest.approx(1000.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(
        1.0, rel=0.05
    )  # exponential: coefficient of variation 1


def test_poisson_schedule_is_reproducible_from_its_seed():
    np.testing.assert_array_equal(
        send_schedule(100, 50.0, "poisson", 3), send_schedule(100, 50.0, "poisson", 3)
    )
    assert not np.array_equal(
        send_schedule(100, 50.0, "poisson", 3), send_schedule(100, 50.0, "poisson", 4)
    )


def test_one_request_is_due_at_once_and_unknown_arrivals_are_refused():
    np.testing.assert_array_equal(send_schedule(1, 10.0, "poisson"), [0.0])
    with pytest.raises(BenchError, match="fixed, poisson"):
        send_schedule(10, 10.0, "bursty")


# --------------------------------------------------------------------------- figures


def test_percentiles_are_in_milliseconds():
    p50, p95, p99, top = latency_percentiles_ms(np.arange(1, 101) / 1000)
    assert (p50, p95, p99, top) == pytest.approx((50.5, 95.05, 99.01, 100.0))


def test_mean_batch_rows_leaves_out_replies_without_the_figure():
    assert mean_batch_rows(np.array([0.0, 4.0, 8.0])) == 6.0
    assert mean_batch_rows(np.zeros(3)) == 0.0


def test_summarize_computes_qps_and_keeps_the_run_description():
    samples = Samples(np.full(500, 0.002), np.full(500, 16.0), 3, 0.25, send_rate=1900.0)
    r = summarize(samples, "fleet", RunSpec(rate=2000.0, arrival="fixed"), first_ms=4.5)
    assert (r.target, r.mode, r.offered_qps, r.arrival, r.sent_qps) == (
        "fleet",
        "open",
        2000.0,
        "fixed",
        1900.0,
    )
    assert r.qps == pytest.approx(2000.0) and r.p99_ms == pytest.approx(2.0)
    assert (r.requests, r.errors, r.first_ms, r.mean_batch_rows) == (500, 3, 4.5, 16.0)
    closed = summarize(samples, "naive", RunSpec(concurrency=16))
    assert (closed.mode, closed.concurrency, closed.arrival, closed.offered_qps) == (
        "closed",
        16,
        None,
        None,
    )


# --------------------------------------------------------------------------- tables


def test_markdown_table_has_one_row_per_run_and_marks_a_client_behind():
    reports = [
        report("fleet", RunSpec(rate=1000.0), 990, 3.0, first_ms=2.0),
        report("fleet", RunSpec(rate=4000.0), 3000, 9.0, sent_qps=3100.0),
        report("naive", RunSpec(rate=1000.0), 700, 80.0, first_ms=300.0),
    ]
    lines = markdown_table(reports).splitlines()
    assert lines[0].startswith("| target | mode | offered/s | QPS | p50 ms")
    assert len(lines) == 2 + 3
    assert lines[2].startswith("| fleet | open, poisson 1,000/s | 1,000 | 990 |")
    assert "| 4,000 (sent 3,100) |" in lines[3]  # sent below 95% of offered: shown
    assert "| 1,000 |" in lines[4] and "(sent" not in lines[4]
    assert (
        lines[2].split("|")[9].strip() == "2.00" and lines[3].split("|")[9].strip() == "-"
    )  # first ms


def test_comparison_pairs_the_same_runs_and_gives_fleet_over_naive():
    closed = RunSpec(concurrency=64)
    reports = [
        report("fleet", closed, 1000, 2.0, first_ms=2.0),
        report("naive", closed, 100, 20.0, first_ms=300.0),
    ]
    assert compare(reports) == [
        {"run": "closed, 64 in flight", "qps_ratio": 10.0, "p99_ratio": 0.1}
    ]
    text = render_markdown(reports, "# title")
    assert text.startswith("# title\n\n| target |")
    assert "| closed, 64 in flight | 10.00x | 0.10x |" in text
    assert "first request: fleet 2.0 ms, naive 300.0 ms" in text


def test_json_report_is_serialisable_and_leaves_out_raw_latencies():
    reports = [report("fleet", RunSpec(concurrency=8), 500, 4.0, first_ms=1.0)]
    data = json.loads(json.dumps(report_json(reports, "setup")))
    assert data["setup"] == "setup" and data["first_ms"] == {"fleet": 1.0}
    assert data["runs"][0]["qps"] == pytest.approx(500.0) and "latencies_ms" not in data["runs"][0]


# --------------------------------------------------------------------------- the picture


@pytest.mark.parametrize("sweep", [False, True])
def test_png_is_written_without_warnings(tmp_path, sweep):
    specs = [RunSpec(rate=r) for r in (500.0, 1000.0)] if sweep else [RunSpec(concurrency=16)]
    reports = [
        report(t, s, 400 * (i + 1), 5.0 * (i + 1), first_ms=1.0)
        for t in ("fleet", "naive")
        for i, s in enumerate(specs)
    ]
    write_png(reports, tmp_path / "r.png", "a title")
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC


def test_write_outputs_writes_the_three_files(tmp_path):
    reports = [report("fleet", RunSpec(concurrency=16), 400, 5.0, first_ms=1.0)]
    paths = write_outputs(tmp_path / "out", reports, "# md\n", "setup")
    assert [p.name for p in paths] == ["report.md", "report.json", "report.png"]
    assert (
        paths[0].read_text() == "# md\n"
        and json.loads(paths[1].read_text())["runs"][0]["target"] == "fleet"
    )


# --------------------------------------------------------------------------- option checks


def test_rates_parse_and_bad_rates_are_refused():
    assert parse_rates(None, "1000, 2000,4000") == (1000.0, 2000.0, 4000.0)
    assert parse_rates(250.0, None) == (250.0,) and parse_rates(None, None) == ()
    for rate, rates, message in [
        (None, "100,0", "positive"),
        (-5.0, None, "positive"),
        (None, "1k", "numbers"),
        (100.0, "200", "not both"),
        (None, ",", "at least one"),
    ]:
        with pytest.raises(BenchError, match=message):
            parse_rates(rate, rates)


def test_plan_refuses_contradictions_and_names_the_option():
    for kwargs, message in [
        ({"requests": 0}, "--requests"),
        ({"concurrency": 0}, "--concurrency"),
        ({"concurrency": 8, "rates": (100.0,)}, "contradicts"),
        ({"arrival": "fixed"}, "--arrival needs"),
        ({"rows": 0}, "--rows"),
        ({"warmup": -1}, "--warmup"),
        ({"timeout_s": 0.0}, "--timeout-s"),
    ]:
        with pytest.raises(BenchError, match=message):
            BenchPlan(**{"requests": 100, **kwargs})


def test_plan_runs_and_warmup_defaults():
    assert BenchPlan(100).runs() == [RunSpec(concurrency=256)]
    plan = BenchPlan(10_000, rates=(100.0, 200.0), arrival="fixed")
    assert plan.runs() == [
        RunSpec(rate=100.0, arrival="fixed"),
        RunSpec(rate=200.0, arrival="fixed"),
    ]
    assert plan.warmup_requests == 1000 and BenchPlan(300).warmup_requests == 60
    assert BenchPlan(300, warmup=0).warmup_requests == 0


def test_fleet_setup_refuses_contradictions():
    for kwargs, message in [
        ({"spawn": 1}, "--spawn needs --model"),
        ({"worker_args": ("--x",)}, "needs --spawn"),
        ({"baseline": "naive"}, "needs --model"),
        ({"name": None}, "--name is required"),
        ({"spawn": -1, "model": "m.pt"}, "at least 0"),
        ({"name": "a b"}, "invalid queue name"),
    ]:
        with pytest.raises(BenchError, match=message):
            FleetSetup(**{"name": "q", **kwargs})


def test_fleet_setup_targets_the_fleet_then_the_naive_queue():
    setup = FleetSetup(None, "m.pt", spawn=2, baseline="naive")
    assert setup.targets() == [("fleet", "bench"), ("naive", "bench-naive")]
    assert FleetSetup("ctr").targets() == [("fleet", "ctr")]


# --------------------------------------------------------------------------- open-loop pacing, on a
# fake clock


def test_open_loop_sends_each_request_at_its_time_and_overdue_ones_together():
    """Paced by the schedule, never early; after a stall (one sleep overran by 0.25 s) the
    requests that fell due meanwhile go out at once in one pipeline, not spread later."""
    import fakeredis

    from inferfleet.producer import Producer
    from inferfleet.worker.bench.load import OpenLoop

    now = [0.0]
    offsets = send_schedule(10, 10.0, "fixed")  # 0, 0.1 ... 0.9 s
    with Producer(client=fakeredis.FakeRedis(), name="q") as producer:
        loop = OpenLoop(
            producer, [np.ones((1, 4), np.float32)], offsets, 5.0, None, clock=lambda: now[0]
        )
        sleeps: list[float] = []

        def pause(seconds: float) -> bool:
            sleeps.append(seconds)
            now[0] += seconds + (
                0.25 if len(sleeps) == 3 else 0.0
            )  # the third sleep overruns: a loaded machine
            return False

        pipelines: list[tuple[float, int, int]] = []  # (when, first, end)
        send = loop._send
        loop.pause = pause
        loop._send = lambda first, end: (pipelines.append((now[0], first, end)), send(first, end))[
            1
        ]
        loop._send_all()
        assert producer.redis.xlen(producer.keys.requests) == 10
    assert [i for _, first, end in pipelines for i in range(first, end)] == list(
        range(10)
    )  # each once, in order
    for when, first, end in pipelines:
        assert when >= offsets[end - 1] - 1e-9, (when, first, end)  # none sent before it was due
    assert [(first, end) for _, first, end in pipelines] == [
        (0, 1),
        (1, 2),
        (2, 3),
        (3, 6),
        (6, 7),
        (7, 8),
        (8, 9),
        (9, 10),
    ]  # 3, 4 and 5 fell due in the stall
    assert sorted(loop.due_at.values()) == pytest.approx(list(offsets))  # latency counts from these
    assert loop._send_rate() == pytest.approx(9 / 0.9)  # the last request went out on time: 10/s
