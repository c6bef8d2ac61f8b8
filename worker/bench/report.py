"""Benchmark results: per-run summaries, the markdown table, JSON and the PNG.

Pure except for the two writers at the end: a run's latencies become a
:class:`BenchReport` (:func:`summarize`), reports become a markdown table,
a comparison of the fleet against the naive baseline, JSON, and a figure
(latency CDF; QPS against offered load for a ``--rates`` sweep).
"""

from __future__ import annotations

import json
import logging
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "BenchReport",
    "RunSpec",
    "Samples",
    "compare",
    "first_latencies",
    "latency_percentiles_ms",
    "markdown_table",
    "mean_batch_rows",
    "render_markdown",
    "report_json",
    "summarize",
    "write_outputs",
    "write_png",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSpec:
    """One measured run: a closed loop (``concurrency``) or an open loop (``rate``)."""

    concurrency: int | None = None
    rate: float | None = None
    arrival: str = "poisson"

    @property
    def mode(self) -> str:
        """``closed`` or ``open``."""
        return "closed" if self.rate is None else "open"

    @property
    def label(self) -> str:
        """How the run reads in tables and legends."""
        if self.rate is None:
            return f"closed, {self.concurrency} in flight"
        return f"open, {self.arrival} {self.rate:,.0f}/s"


def latency_percentiles_ms(latencies_s: np.ndarray) -> tuple[float, float, float, float]:
    """(p50, p95, p99, max) of latencies given in seconds, in milliseconds."""
    p50, p95, p99 = np.percentile(latencies_s, [50, 95, 99]) * 1000
    return float(p50), float(p95), float(p99), float(np.max(latencies_s) * 1000)


def mean_batch_rows(batch_rows: np.ndarray) -> float:
    """Mean rows of the batches replies came from (replies without the figure left out)."""
    known = batch_rows[batch_rows > 0]
    return float(known.mean()) if known.size else 0.0


@dataclass
class Samples:
    """Raw measurements of one run. ``send_rate``: open loop only, the rate actually sent."""

    latencies_s: np.ndarray
    batch_rows: np.ndarray
    errors: int
    seconds: float
    send_rate: float | None = None


@dataclass
class BenchReport:
    """What one run against one target measured. Times in milliseconds, rates per second."""

    target: str
    mode: str
    concurrency: int | None
    arrival: str | None
    offered_qps: float | None
    sent_qps: float | None
    requests: int
    errors: int
    seconds: float
    qps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    first_ms: float | None
    mean_batch_rows: float
    latencies_ms: np.ndarray = field(repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        """Every figure but the raw latencies, floats rounded to 3 places."""
        shown = {k: v for k, v in asdict(self).items() if k != "latencies_ms"}
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in shown.items()}

    @property
    def spec(self) -> RunSpec:
        """The run this report measured (runs of two targets pair up by it)."""
        return RunSpec(self.concurrency, self.offered_qps, self.arrival or "poisson")


def summarize(
    samples: Samples, target: str, spec: RunSpec, first_ms: float | None = None
) -> BenchReport:
    """Turn one run's samples into its report."""
    p50, p95, p99, top = latency_percentiles_ms(samples.latencies_s)
    count = len(samples.latencies_s)
    return BenchReport(
        target=target,
        mode=spec.mode,
        concurrency=spec.concurrency,
        arrival=spec.arrival if spec.rate is not None else None,
        offered_qps=spec.rate,
        sent_qps=samples.send_rate,
        requests=count,
        errors=samples.errors,
        seconds=samples.seconds,
        qps=count / samples.seconds if samples.seconds > 0 else 0.0,
        p50_ms=p50,
        p95_ms=p95,
        p99_ms=p99,
        max_ms=top,
        first_ms=first_ms,
        mean_batch_rows=mean_batch_rows(samples.batch_rows),
        latencies_ms=samples.latencies_s * 1000,
    )


_COLUMNS = (
    "target",
    "mode",
    "offered/s",
    "QPS",
    "p50 ms",
    "p95 ms",
    "p99 ms",
    "max ms",
    "first ms",
    "mean batch rows",
    "errors",
)


def _offered_cell(report: BenchReport) -> str:
    if report.offered_qps is None:
        return "-"
    cell = f"{report.offered_qps:,.0f}"
    if report.sent_qps is not None and report.sent_qps < 0.95 * report.offered_qps:
        cell += f" (sent {report.sent_qps:,.0f})"
    return cell


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown_table(reports: list[BenchReport]) -> str:
    """One row per run: target, mode, offered rate, QPS, latencies, first request, batch rows,
    errors."""
    lines = [_row(list(_COLUMNS)), _row(["---", "---"] + ["---:"] * (len(_COLUMNS) - 2))]
    for r in reports:
        first = f"{r.first_ms:.2f}" if r.first_ms is not None else "-"
        lines.append(
            _row(
                [
                    r.target,
                    r.spec.label,
                    _offered_cell(r),
                    f"{r.qps:,.0f}",
                    f"{r.p50_ms:.2f}",
                    f"{r.p95_ms:.2f}",
                    f"{r.p99_ms:.2f}",
                    f"{r.max_ms:.2f}",
                    first,
                    f"{r.mean_batch_rows:.1f}",
                    str(r.errors),
                ]
            )
        )
    return "\n".join(lines)


def compare(reports: list[BenchReport]) -> list[dict[str, Any]]:
    """fleet / naive ratios of QPS and p99 for every run both targets made."""
    naive = {r.spec: r for r in reports if r.target == "naive"}
    pairs = [(r, naive[r.spec]) for r in reports if r.target == "fleet" and r.spec in naive]
    return [
        {
            "run": f.spec.label,
            "qps_ratio": round(f.qps / n.qps, 3) if n.qps else None,
            "p99_ratio": round(f.p99_ms / n.p99_ms, 3) if n.p99_ms else None,
        }
        for f, n in pairs
    ]


def first_latencies(reports: list[BenchReport]) -> dict[str, float]:
    """Each target's first-request latency (ms)."""
    return {r.target: r.first_ms for r in reports if r.first_ms is not None}


def _ratio_text(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def render_markdown(reports: list[BenchReport], heading: str | None = None) -> str:
    """The whole report: the runs table, fleet/naive ratios if any, first-request latencies."""
    parts = [heading] if heading else []
    parts.append(markdown_table(reports))
    ratios = compare(reports)
    if ratios:
        lines = [_row(["run", "QPS fleet/naive", "p99 fleet/naive"]), _row(["---", "---:", "---:"])]
        lines += [
            _row([c["run"], _ratio_text(c["qps_ratio"]), _ratio_text(c["p99_ratio"])])
            for c in ratios
        ]
        parts.append("\n".join(lines))
    firsts = first_latencies(reports)
    if firsts:
        parts.append("first request: " + ", ".join(f"{t} {ms:,.1f} ms" for t, ms in firsts.items()))
    return "\n\n".join(parts) + "\n"


def report_json(reports: list[BenchReport], setup: str = "") -> dict[str, Any]:
    """The machine-readable report: setup, every run, ratios, first-request latencies."""
    return {
        "setup": setup,
        "runs": [r.as_dict() for r in reports],
        "comparison": compare(reports),
        "first_ms": {t: round(ms, 3) for t, ms in first_latencies(reports).items()},
    }


def _is_sweep(reports: list[BenchReport]) -> bool:
    targets = [r.target for r in reports if r.offered_qps is not None]
    return any(targets.count(t) > 1 for t in set(targets))


_LINE_STYLES = ("-", "--", ":", "-.")


def _plot_cdf(ax: Any, reports: list[BenchReport]) -> None:
    targets = list(dict.fromkeys(r.target for r in reports))  # one colour per target
    for i, r in enumerate(reports):
        lat = np.sort(r.latencies_ms)
        nth = sum(1 for other in reports[:i] if other.target == r.target)  # one line style per run
        ax.plot(
            lat,
            np.arange(1, lat.size + 1) / lat.size,
            drawstyle="steps-post",
            color=f"C{targets.index(r.target)}",
            linestyle=_LINE_STYLES[nth % len(_LINE_STYLES)],
            label=f"{r.target}, {r.spec.label}",
        )
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("latency CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")


def _plot_sweep(ax: Any, reports: list[BenchReport]) -> None:
    opened = [r for r in reports if r.offered_qps is not None]
    for target in dict.fromkeys(r.target for r in opened):
        runs = sorted((r for r in opened if r.target == target), key=lambda r: r.offered_qps or 0.0)
        ax.plot([r.offered_qps for r in runs], [r.qps for r in runs], "o-", label=target)
    top = max(r.offered_qps or 0.0 for r in opened)
    ax.plot([0, top], [0, top], "--", color="grey", label="achieved = offered")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("achieved QPS")
    ax.set_title("QPS against offered load")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def _plot_bars(ax: Any, reports: list[BenchReport]) -> None:
    labels = [f"{r.target}\n{r.spec.label}" for r in reports]
    targets = list(dict.fromkeys(r.target for r in reports))
    bars = ax.bar(
        range(len(reports)),
        [r.qps for r in reports],
        color=[f"C{targets.index(r.target)}" for r in reports],
    )
    ax.bar_label(bars, labels=[f"{r.qps:,.0f}" for r in reports])
    ax.set_xticks(range(len(reports)), labels, fontsize="small")
    ax.set_ylabel("achieved QPS")
    ax.set_title("QPS per run")
    ax.grid(True, axis="y", alpha=0.3)


def write_png(reports: list[BenchReport], path: str | Path, title: str = "") -> None:
    """Latency CDF of every run (left) and QPS against offered load, or QPS per run (right)."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    fig = Figure(figsize=(13, 5), layout="constrained")
    left, right = fig.subplots(1, 2)
    _plot_cdf(left, reports)
    (_plot_sweep if _is_sweep(reports) else _plot_bars)(right, reports)
    if title:
        fig.suptitle(textwrap.fill(title, 130), fontsize="medium")
    fig.savefig(str(path), dpi=100, format="png")


def write_outputs(
    out_dir: str | Path, reports: list[BenchReport], markdown: str, setup: str = ""
) -> list[Path]:
    """Write report.md, report.json and report.png into ``out_dir`` (created); return their
    paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.md", out / "report.json", out / "report.png"]
    paths[0].write_text(markdown)
    paths[1].write_text(json.dumps(report_json(reports, setup), indent=2) + "\n")
    write_png(reports, paths[2], setup.replace("`", ""))
    return paths
