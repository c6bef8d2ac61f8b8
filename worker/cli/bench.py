"""``inferfleet bench``: measure a fleet's throughput and latency, optionally against a naive
server."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from inferfleet.producer import errors
from inferfleet.worker.cli.options import prefix_option, redis_url_option
from inferfleet.worker.config import ENV_VARS

if TYPE_CHECKING:
    from inferfleet.worker.bench.load import BenchPlan, BenchReport, FleetSetup

__all__ = ["bench"]


@click.command()
@click.option(
    "--name",
    default=None,
    envvar=ENV_VARS["name"],
    show_envvar=True,
    help="Queue (model) name of the fleet to measure (default with --spawn: bench).",
)
@click.option(
    "--model",
    "model_path",
    default=None,
    envvar=ENV_VARS["model"],
    show_envvar=True,
    help="Model file: the inputs' form (its example), and what --spawn and --baseline serve.",
)
@click.option(
    "--input",
    "input_path",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    envvar="INFERFLEET_BENCH_INPUT",
    show_envvar=True,
    help="Take the inputs' form from this .npy/.npz file instead (its first rows).",
)
@click.option(
    "--spawn",
    type=int,
    default=0,
    show_default=True,
    envvar="INFERFLEET_BENCH_SPAWN",
    show_envvar=True,
    help="Start N workers for the run (on a private Redis unless --redis-url) and stop them after.",
)
@click.option(
    "--worker-arg",
    "worker_args",
    multiple=True,
    envvar="INFERFLEET_BENCH_WORKER_ARGS",
    show_envvar=True,
    help="Option for each spawned worker, e.g. --worker-arg=--max-batch-rows=64 (repeat).",
)
@click.option(
    "--baseline",
    type=click.Choice(["none", "naive"]),
    default="none",
    show_default=True,
    envvar="INFERFLEET_BENCH_BASELINE",
    show_envvar=True,
    help="naive: the same load against one process that loads the model on its first "
    "request and serves one request at a time, side by side.",
)
@click.option(
    "--requests",
    "-n",
    type=int,
    default=20_000,
    show_default=True,
    envvar="INFERFLEET_BENCH_REQUESTS",
    show_envvar=True,
    help="Requests per run.",
)
@click.option(
    "--rows",
    type=int,
    default=1,
    show_default=True,
    envvar="INFERFLEET_BENCH_ROWS",
    show_envvar=True,
    help="Rows per request.",
)
@click.option(
    "--concurrency",
    "--window",
    "concurrency",
    type=int,
    default=None,
    envvar="INFERFLEET_BENCH_CONCURRENCY",
    show_envvar=True,
    help="Closed loop: requests in flight, as N clients with one request each (default 256).",
)
@click.option(
    "--rate",
    type=float,
    default=None,
    envvar="INFERFLEET_BENCH_RATE",
    show_envvar=True,
    help="Open loop: requests per second, sent on schedule whatever the replies.",
)
@click.option(
    "--rates",
    default=None,
    envvar="INFERFLEET_BENCH_RATES",
    show_envvar=True,
    help="Open loop at each of these rates in turn, e.g. 1000,2000,4000.",
)
@click.option(
    "--arrival",
    type=click.Choice(["fixed", "poisson"]),
    default=None,
    envvar="INFERFLEET_BENCH_ARRIVAL",
    show_envvar=True,
    help="Open-loop arrivals: fixed spacing or Poisson (default poisson).",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    envvar="INFERFLEET_BENCH_SEED",
    show_envvar=True,
    help="Seed of the random inputs and the Poisson schedule.",
)
@click.option(
    "--warmup",
    type=int,
    default=None,
    envvar="INFERFLEET_BENCH_WARMUP",
    show_envvar=True,
    help="Requests sent before the runs, not counted (default: a fifth of --requests, "
    "at most 1000).",
)
@click.option(
    "--timeout-s",
    type=float,
    default=60.0,
    show_default=True,
    envvar="INFERFLEET_BENCH_TIMEOUT_S",
    show_envvar=True,
    help="Longest wait for a reply before giving up.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    envvar="INFERFLEET_BENCH_JSON",
    show_envvar=True,
    help="Print the report as JSON instead of markdown.",
)
@click.option(
    "--out",
    "out_dir",
    default=None,
    type=click.Path(file_okay=False),
    envvar="INFERFLEET_BENCH_OUT",
    show_envvar=True,
    help="Also write report.md, report.json and report.png into this directory.",
)
@redis_url_option
@prefix_option
def bench(
    name: str | None,
    model_path: str | None,
    input_path: str | None,
    spawn: int,
    worker_args: tuple[str, ...],
    baseline: str,
    requests: int,
    rows: int,
    concurrency: int | None,
    rate: float | None,
    rates: str | None,
    arrival: str | None,
    seed: int,
    warmup: int | None,
    timeout_s: float,
    as_json: bool,
    out_dir: str | None,
    redis_url: str | None,
    prefix: str,
) -> None:
    """Measure a fleet: QPS, p50/p95/p99/max latency, first-request latency, mean batch rows.

    Closed loop (default): --concurrency requests in flight. Open loop: --rate R, or a --rates
    sweep, sent on a fixed or Poisson schedule; latency counts from each request's scheduled send
    time. Measures running workers (--name), or starts them (--spawn N --model PATH). --baseline
    naive runs the same load against a one-request-at-a-time server too. Prints a markdown table
    (or --json); --out DIR adds report.md, report.json and report.png (latency CDF, QPS against
    offered load).
    """
    from inferfleet.worker.bench import load as b

    load = (requests, rows, concurrency)
    try:
        plan = b.BenchPlan(*load, b.parse_rates(rate, rates), arrival, warmup, seed, timeout_s)
        setup = b.FleetSetup(name, model_path, spawn, worker_args, baseline, redis_url, prefix)
        pool = b.bench_inputs(model_path, input_path, rows, seed)
        reports = _run_with_progress(setup, pool, plan)
    except b.BenchError as exc:
        raise click.UsageError(str(exc)) from exc
    # e.g. the first request answered model_error: nothing to measure
    except errors.InferfleetError as exc:
        raise click.ClickException(
            f"bench run failed, nothing measured: {type(exc).__name__}: {exc}"
        ) from exc
    _print_reports(reports, setup, plan, out_dir, as_json)


def _print_reports(
    reports: list[BenchReport],
    setup: FleetSetup,
    plan: BenchPlan,
    out_dir: str | None,
    as_json: bool,
) -> None:
    """The reports as a markdown table (or JSON), and into ``out_dir`` if given."""
    from inferfleet.worker.bench import load as b

    about = f"{setup.describe()}; {plan.describe()}"
    markdown = b.render_markdown(reports, b.heading(setup, plan))
    if out_dir:
        b.write_outputs(out_dir, reports, markdown, about)
    if as_json:
        click.echo(json.dumps(b.report_json(reports, about), indent=2))
    else:
        click.echo(markdown, nl=False)


def _run_with_progress(setup: FleetSetup, pool: list[Any], plan: BenchPlan) -> list[BenchReport]:
    """Every run of ``plan`` on the fleet ``setup`` describes, progress bars on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from inferfleet.worker.bench import load as b

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True)) as display:
        bars = b.ProgressBars(display)
        bars("setting up", 0, 1)
        with b.BenchFleet(setup) as fleet:
            bars("setting up", 1, 1)
            return b.run_all(fleet, pool, plan, bars)
