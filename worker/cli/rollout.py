"""``inferfleet shadow``: publish a candidate version, report on it, promote, canary, stop."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from inferfleet.worker.cli.lifecycle import (
    CandidateInputs,
    candidate_input_options,
    check_model,
    check_wait_and_version,
    fleet_spec,
    serving_pair,
    wait_for,
)
from inferfleet.worker.cli.options import QueueConfig, pass_queue_config
from inferfleet.worker.serving.comparison import Thresholds

#: The comparison options' defaults: the dataclass is their one source.
_THRESHOLDS = Thresholds()

__all__ = ["shadow"]

_D = "INFERFLEET_SHADOW_"


def _threshold_option(name: str, help: str) -> Callable[[Callable], Callable]:
    """A comparison option whose type, default and env var come from :class:`Thresholds`."""
    default = getattr(_THRESHOLDS, name)
    flag = "--" + name.replace("_", "-")
    env = _env(name.upper())
    return click.option(
        flag, type=type(default), default=default, show_default=True, **env, help=help
    )


def _env(name: str) -> dict[str, Any]:
    return {"envvar": _D + name, "show_envvar": True}


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.4g}"
    return str(value)


_COLUMNS = [
    ("live", "live"),
    ("candidate", "candidate"),
    ("compared", "compared"),
    ("agreement", "agree"),
    ("abs_error_max", "max abs"),
    ("rel_error_max", "max rel"),
    ("rank_corr", "rank corr"),
    ("nonfinite_rows", "NaN/Inf"),
    ("candidate_errors", "cand err"),
    ("live_ms_per_batch", "live ms"),
    ("candidate_ms_per_batch", "cand ms"),
    ("canary_requests", "canary"),
    ("canary_failed", "canary fail"),
    ("verdict", "verdict"),
]


def _report(client: Any, shard_list: list, as_json: bool) -> dict[str, Any]:
    """Every shard's candidate, pairs and workers; printed as a table or JSON."""
    from inferfleet.worker.heartbeat import read_heartbeats
    from inferfleet.worker.serving.comparison import verdict
    from inferfleet.worker.serving.rollout import read_candidate, read_pairs

    report: dict[str, Any] = {}
    for keys in shard_list:
        cand = read_candidate(client, keys)
        pairs = []
        for live, version, stats in read_pairs(client, keys, cand.version if cand else None):
            reasons = verdict(stats, cand.thresholds) if cand else []
            pairs.append(
                {
                    "live": live,
                    "candidate": version,
                    **stats.summary(),
                    "verdict": "ok" if not reasons else "; ".join(reasons),
                }
            )
        workers = {info.consumer: info.shadow for info in read_heartbeats(client, keys)}
        report[keys.name] = {
            "candidate": None
            if cand is None
            else {
                "model": cand.model,
                "version": cand.version,
                "state": cand.state,
                "sample": cand.sample,
                "canary_percent": cand.canary,
                "reason": cand.reason,
                "thresholds": cand.thresholds.__dict__,
            },
            "pairs": pairs,
            "workers": workers,
        }
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        _print_report(report)
    return report


def _print_report(report: dict[str, Any]) -> None:
    for name, shard in report.items():
        cand = shard["candidate"]
        if cand is None:
            click.echo(f"{name}: no candidate published")
            continue
        click.echo(
            f"{name}: candidate {cand['version']} ({cand['model']}) {cand['state']}, sample "
            f"{cand['sample']:g}, canary {cand['canary_percent']:g}%"
            + (f" -- {cand['reason']}" if cand["reason"] else "")
        )
        rows = [[_fmt(p[key]) for key, _ in _COLUMNS] for p in shard["pairs"]]
        table = [[title for _, title in _COLUMNS], *rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(_COLUMNS) - 1)]
        for row in table:
            click.echo("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
        if not rows:
            click.echo("  nothing compared yet")
        for consumer, state in sorted(shard["workers"].items()):
            click.echo(f"  worker {consumer}: {state or 'no candidate'}")


def _promote(client: Any, shard_list: list, force: bool, wait_s: float) -> None:
    """Swap every shard to its candidate if the evidence meets the thresholds (or ``force``)."""
    from inferfleet.worker.serving.lifecycle import publish
    from inferfleet.worker.serving.rollout import end_candidate, read_candidate

    candidates = []
    for keys in shard_list:
        cand = read_candidate(client, keys)
        if cand is None or not cand.active:
            raise click.ClickException(f"{keys.name}: no active candidate to promote")
        reasons = _evidence_against(client, keys, cand, 0.0 if force else wait_s)
        if reasons and not force:
            raise click.ClickException(
                f"{keys.name}: candidate {cand.version} not promoted: "
                f"{'; '.join(reasons)} (--force promotes it anyway)"
            )
        candidates.append((keys, cand, reasons))
    for keys, cand, reasons in candidates:
        swapped = publish(client, keys, cand.model, cand.version, serving_pair(client, keys))
        end_candidate(
            client, keys, "promoted", "forced: " + "; ".join(reasons) if reasons else "evidence met"
        )
        click.echo(
            f"{keys.name}: candidate {cand.version} promoted: published as #{swapped.seq}"
            + (" (forced)" if reasons else "")
        )
    if wait_s and not wait_for(client, shard_list, candidates[0][1].version, wait_s):
        sys.exit(1)


def _evidence_against(client: Any, keys: Any, cand: Any, wait_s: float) -> list[str]:
    """Why ``cand`` may not be promoted on the comparisons in Redis (empty: it may).

    Workers add their comparisons to Redis once a housekeeping tick, so traffic sent just
    before ``--promote`` may not be counted yet: while the only reason is too few requests
    compared, wait up to ``wait_s`` for them. Divergence is final at once.
    """
    from inferfleet.worker.serving.comparison import verdict
    from inferfleet.worker.serving.lifecycle import read_published
    from inferfleet.worker.serving.rollout import read_pairs

    deadline, told = time.monotonic() + wait_s, False
    while True:
        published = read_published(client, keys)
        live = published.version if published else serving_pair(client, keys)[1]
        stats = [s for lv, _, s in read_pairs(client, keys, cand.version) if not live or lv == live]
        short = not stats or any(s.compared < cand.thresholds.min_compared for s in stats)
        if not short or time.monotonic() >= deadline:
            return (
                [r for s in stats for r in verdict(s, cand.thresholds)]
                if stats
                else ["nothing compared yet"]
            )
        if not told:
            click.echo(
                f"{keys.name}: waiting up to {wait_s:g} s for "
                f"{cand.thresholds.min_compared} requests compared "
                f"({sum(s.compared for s in stats)} so far)"
            )
            told = True
        time.sleep(0.2)


def _wait_loaded(client: Any, shard_list: list, version: str, timeout_s: float) -> bool:
    """Until every live worker has loaded candidate ``version`` (or failed to); print each one's
    state."""
    from inferfleet.worker.heartbeat import read_heartbeats

    done = (f"{version} loaded", f"{version} failed")
    deadline = time.monotonic() + timeout_s
    while True:
        states = {
            w.consumer: w.shadow for keys in shard_list for w in read_heartbeats(client, keys)
        }
        if all(s in done for s in states.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for consumer, state in sorted(states.items()):
        click.echo(f"  {consumer}: {state or 'no candidate yet'}")
    if not states:
        click.echo("  no live workers (new ones load the candidate at start)")
    return all(s == done[0] for s in states.values())


@click.command()
@pass_queue_config
@click.option(
    "--model",
    default=None,
    **_env("MODEL"),
    help="Publish this candidate: a file every worker can read, or module:Handler.",
)
@click.option(
    "--version",
    "version",
    default=None,
    **_env("VERSION"),
    help="Its version (default: the file's hash).",
)
@click.option(
    "--sample",
    type=float,
    default=0.1,
    show_default=True,
    **_env("SAMPLE"),
    help="Share of each worker's batches the candidate also computes, after their "
    "replies are written.",
)
@click.option(
    "--canary",
    type=float,
    default=None,
    **_env("CANARY"),
    help="Percent of requests the candidate answers (0: shadow only); alone, changes "
    "the running one's.",
)
@click.option(
    "--report", is_flag=True, help="Print the comparison of the candidate with the live version."
)
@click.option("--json", "as_json", is_flag=True, **_env("JSON"), help="With --report: as JSON.")
@click.option(
    "--promote", is_flag=True, help="Swap to the candidate if the comparison meets the thresholds."
)
@click.option("--force", is_flag=True, help="With --promote: promote even if it does not.")
@click.option("--stop", is_flag=True, help="Unload the candidate from every worker.")
@click.option(
    "--check/--no-check",
    default=True,
    show_default=True,
    **_env("CHECK"),
    help="Load the candidate here first, so a broken file never reaches the fleet.",
)
@_threshold_option(
    "min_agreement",
    "Least share of rows whose top-1 class (or decision) agrees.",
)
@_threshold_option(
    "max_rel_error",
    "Largest relative error of any request (over its largest live output).",
)
@_threshold_option(
    "min_rank_corr",
    "Least mean Spearman correlation of the scores.",
)
@_threshold_option(
    "decision_threshold",
    "Decision threshold of one-score outputs, for agreement.",
)
@_threshold_option(
    "max_error_rate",
    "Largest share of requests the candidate may fail (raise, NaN/Inf); a canary over it rolls "
    "back.",
)
@_threshold_option(
    "min_compared",
    "Requests compared before a promotion, a divergence alert or a rollback on divergence.",
)
@click.option(
    "--wait-s",
    type=float,
    default=60.0,
    show_default=True,
    **_env("WAIT_S"),
    help="Wait this long for every live worker to load the candidate (--model), or for "
    "--min-compared requests compared and every worker to switch (--promote); exit "
    "status 1 if one did not (0: do not wait).",
)
@candidate_input_options("SHADOW")
def shadow(
    queue: QueueConfig,
    model: str | None,
    version: str | None,
    sample: float,
    canary: float | None,
    report: bool,
    as_json: bool,
    promote: bool,
    force: bool,
    stop: bool,
    check: bool,
    min_agreement: float,
    max_rel_error: float,
    min_rank_corr: float,
    decision_threshold: float,
    max_error_rate: float,
    min_compared: int,
    wait_s: float,
    input_spec: str | None,
    warmup_input: str | None,
) -> None:
    """Run a candidate model version beside the live one, compare, then promote or stop it.

    --model publishes a candidate: every worker loads it in the background (the
    command waits until each has, up to --wait-s) and runs it on --sample of its
    batches after their replies are written;
    --canary makes it answer that percent of requests, rolled back
    automatically past the thresholds. --report shows the comparison,
    --promote swaps to it (through inferfleet swap) when the thresholds are
    met, --stop unloads it.
    """
    import redis

    _check_shadow_options(model, version, report, promote, stop, force, sample, canary, wait_s)
    limits = (min_agreement, max_rel_error, min_rank_corr, decision_threshold, max_error_rate)
    try:
        thresholds = Thresholds(*limits, min_compared)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    client, shard_list = queue.connect()
    flags = (report, as_json, promote, force, stop, wait_s)
    try:
        inputs = CandidateInputs(input_spec, warmup_input) if check else None
        _act(client, shard_list, model, version, inputs, sample, canary, thresholds, flags)
    except redis.exceptions.RedisError as exc:
        raise click.ClickException(f"Redis error: {exc}") from exc


def _check_shadow_options(
    model: str | None,
    version: str | None,
    report: bool,
    promote: bool,
    stop: bool,
    force: bool,
    sample: float,
    canary: float | None,
    wait_s: float,
) -> None:
    """One action at a time, and each value in its range (a usage error names the option)."""
    actions = [model is not None, report, promote, stop, canary is not None and model is None]
    if sum(actions) != 1:
        raise click.UsageError("give one of --model, --report, --promote, --stop or --canary alone")
    if force and not promote:
        raise click.UsageError("--force goes with --promote")
    if not 0.0 <= sample <= 1.0:
        raise click.BadParameter("must be from 0 to 1", param_hint="--sample")
    if canary is not None and not 0.0 <= canary <= 100.0:
        raise click.BadParameter("must be a percent from 0 to 100", param_hint="--canary")
    check_wait_and_version(wait_s, version)


def _act(
    client: Any,
    shard_list: list,
    model: str | None,
    version: str | None,
    check: CandidateInputs | None,
    sample: float,
    canary: float | None,
    thresholds: Any,
    flags: tuple,
) -> None:
    """Do what the options ask; ``check`` is None with --no-check."""
    from inferfleet.worker.serving.rollout import end_candidate, publish_candidate, set_canary

    report, as_json, promote, force, stop, wait_s = flags
    if report:
        _report(client, shard_list, as_json)
    elif promote:
        _promote(client, shard_list, force, wait_s)
    elif stop:
        for keys in shard_list:
            ended = end_candidate(client, keys, "stopped", "stopped by inferfleet shadow --stop")
            click.echo(f"{keys.name}: " + ("candidate stopped" if ended else "no active candidate"))
    elif model is not None:
        if check is not None:  # with what the fleet's workers declare
            declared = fleet_spec(client, shard_list[0])
            check = CandidateInputs(check.input_spec, check.warmup_input, declared)
        version = check_model(model, version, check is not None, inputs=check)
        for keys in shard_list:
            cand = publish_candidate(
                client, keys, model, version, sample, canary or 0.0, thresholds
            )
            click.echo(
                f"{keys.name}: candidate {cand.version} ({cand.model}) published: sample "
                f"{cand.sample:g}, canary {cand.canary:g}%"
            )
        if wait_s and not _wait_loaded(client, shard_list, cand.version, wait_s):
            sys.exit(1)
    else:
        for keys in shard_list:
            changed = set_canary(client, keys, canary or 0.0)
            if changed is None:
                raise click.ClickException(
                    f"{keys.name}: no active candidate (publish one with --model)"
                )
            click.echo(
                f"{keys.name}: candidate {changed.version} now answers {changed.canary:g}% "
                "of requests"
            )
