"""The ``inferfleet`` command line: worker, enqueue, result, bench.

This is the only module that configures logging or prints. Every option has
an environment variable (shown in ``--help``); bad input exits with a clear
message and status 2, a failed request with status 1.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable

import click
import numpy as np

from inferfleet.producer import Producer, errors
from inferfleet.producer.protocol import Reply
from inferfleet.worker.cli import lifecycle as lifecycle_commands
from inferfleet.worker.cli.options import _cluster, _name, _prefix, _redis_url, _shards, queue_context
from inferfleet.worker.config import DEVICE_CHOICES, ENV_VARS, PRECISIONS, WorkerSettings
from inferfleet.worker.errors import ConfigError, ModelLoadError
from inferfleet.worker.npfiles import load_inputs, save_outputs

if TYPE_CHECKING:
    from inferfleet.worker.metrics import FleetMetrics

log = logging.getLogger("inferfleet")


def _setup_logging(level: str, fmt: str = "text") -> None:
    from inferfleet.worker.logs import setup_logging

    setup_logging(level, fmt)


def _install_stop_handlers(stop: threading.Event) -> None:
    """First SIGTERM/SIGINT: finish the current batch and leave. Second: exit now."""

    def handle(signum: int, frame: Any) -> None:
        if stop.is_set():
            log.warning("second %s: exiting without draining", signal.Signals(signum).name)
            os._exit(128 + signum)
        log.info("%s received: finishing the current batch, then stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


_log_level = click.option("--log-level", default="info", envvar="INFERFLEET_LOG_LEVEL", show_envvar=True,
                          type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False))
_log_format = click.option("--log-format", default="text", envvar="INFERFLEET_LOG_FORMAT", show_envvar=True,
                           show_default=True, type=click.Choice(["text", "json"]),
                           help="json: one JSON object a line, with consumer, batch and request ids.")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="inferfleet")
def main() -> None:
    """inferfleet: PyTorch inference workers fed by Redis Streams."""


# --------------------------------------------------------------------------- worker


def _env(name: str) -> dict:
    return {"envvar": ENV_VARS[name], "show_envvar": True, "show_default": True}


def _options(*decorators: Callable) -> Callable:
    """Apply a list of click option decorators (shared by worker and supervise)."""

    def apply(func: Callable) -> Callable:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


_worker_options = _options(
    _name,
    click.option("--model", required=True,
                 help="TorchScript file, torch.export .pt2 file, ONNX .onnx file, or module:Handler.",
                 envvar=ENV_VARS["model"], show_envvar=True),
    _redis_url,
    _prefix,
    click.option("--max-batch-rows", type=int, default=64, help="Most rows in one forward pass.",
                 **_env("max_batch_rows")),
    click.option("--max-wait-ms", type=float, default=5.0, help="Longest wait for a batch to fill.",
                 **_env("max_wait_ms")),
    click.option("--model-version", default=None, help="Version reported in replies (default: file hash).",
                 envvar=ENV_VARS["model_version"], show_envvar=True),
    click.option("--warmup-input", default=None,
                 help=".npy/.npz inputs to warm up with (default: the model's example).",
                 envvar=ENV_VARS["warmup_input"], show_envvar=True),
    click.option("--torch-threads", type=int, default=1, help="Intra-op threads of each worker process.",
                 **_env("torch_threads")),
    click.option("--precision", type=click.Choice(list(PRECISIONS)), default="fp32",
                 help="fp16/bf16 run the model under torch.autocast; int8 quantizes its linear layers "
                      "dynamically (CPU; .pt2, .onnx, handlers); outputs stay float32.",
                 **_env("precision")),
    click.option("--compile/--no-compile", default=False,
                 help="torch.compile the model (torch.export .pt2 models).", **_env("compile")),
    click.option("--prefetch", type=click.Choice(["auto", "on", "off"]), default="auto",
                 help="Read and decode the next batch while one computes (auto: on GPUs).", **_env("prefetch")),
    click.option("--tune-malloc/--no-tune-malloc", default=True,
                 help="Fix glibc's mmap/trim thresholds so batch buffers are reused, not re-mapped.",
                 **_env("tune_malloc")),
    click.option("--empty-cache-every", type=int, default=0,
                 help="Return cached GPU memory every N batches (0: never).", **_env("empty_cache_every")),
    click.option("--reply-ttl-s", type=int, default=300, help="TTL of each reply list.", **_env("reply_ttl_s")),
    click.option("--max-body-bytes", type=int, default=16 * 1024 * 1024,
                 help="Larger bodies are answered too_large.", **_env("max_body_bytes")),
    click.option("--claim-idle-s", type=float, default=2.0,
                 help="Take over entries of a consumer with no heartbeat once idle this long.",
                 **_env("claim_idle_s")),
    click.option("--max-deliveries", type=int, default=3,
                 help="Dead-letter an entry delivered more often than this.", **_env("max_deliveries")),
    click.option("--cache-size", type=int, default=0,
                 help="Entries of the per-worker LFU result cache (0: off).", **_env("cache_size")),
    click.option("--fleet-cache-ttl-s", type=int, default=0,
                 help="Also share results fleet-wide in Redis for this long (0: off; needs --cache-size).",
                 **_env("fleet_cache_ttl_s")),
    click.option("--min-confidence", type=float, default=0.0,
                 help="Alert when a reply's top score is below this (0: off).", **_env("min_confidence")),
    click.option("--consistency-tol", type=float, default=0.0,
                 help="Alert when identical inputs on one version differ by more than this (0: off).",
                 **_env("consistency_tol")),
    click.option("--nan-guard/--no-nan-guard", default=True,
                 help="Answer model_error (and alert) for outputs holding NaN or Inf.", **_env("nan_guard")),
    click.option("--metrics-port", type=int, default=0,
                 help="Serve Prometheus metrics on this port (0: off).", **_env("metrics_port")),
    _shards,
    _cluster,
    _log_level,
    _log_format,
)


def _worker_settings(options: dict[str, Any]) -> WorkerSettings:
    try:
        return WorkerSettings(**{k: v for k, v in options.items() if v is not None})
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc


@main.command()
@_worker_options
@click.option("--device", default="auto", help=f"One of {DEVICE_CHOICES}.", **_env("device"))
@click.option("--consumer", default=None, help="Consumer name in the group (default host-pid).",
              envvar=ENV_VARS["consumer"], show_envvar=True)
@click.option("--shard", type=int, default=0, help="With --shards: the shard this worker serves (0 to shards-1).",
              **_env("shard"))
def worker(log_level: str, log_format: str, **options: Any) -> None:
    """Serve one queue: load and warm the model, then batch requests from the stream."""
    _setup_logging(log_level, log_format)
    from inferfleet.worker.serving.serve import serve  # torch is imported only by commands that need it

    settings = _worker_settings(options)
    stop = threading.Event()
    _install_stop_handlers(stop)
    try:
        serve(settings, stop)
    except (ModelLoadError, ConfigError) as exc:  # ConfigError: the metrics port is taken
        raise click.ClickException(str(exc)) from exc


def child_main(settings: WorkerSettings, visible_device: str | None) -> None:
    """Entry point of a supervised worker process (spawn start method)."""
    if visible_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_device  # before torch touches CUDA
    _setup_logging(os.environ.get("INFERFLEET_LOG_LEVEL", "info"), os.environ.get("INFERFLEET_LOG_FORMAT", "text"))
    from inferfleet.worker.serving.serve import serve

    stop = threading.Event()
    _install_stop_handlers(stop)
    try:
        serve(settings, stop)
    except ModelLoadError as exc:
        log.error("worker %s cannot start: %s", settings.consumer, exc)
        sys.exit(3)


@main.command()
@_worker_options
@click.option("--min-workers", type=int, default=1, show_default=True, envvar="INFERFLEET_MIN_WORKERS",
              show_envvar=True, help="Fewest workers, even when idle.")
@click.option("--max-workers", type=int, default=None, envvar="INFERFLEET_MAX_WORKERS", show_envvar=True,
              help="Most workers (default: one per GPU, or the CPU count).")
@click.option("--devices", default="auto", show_default=True, envvar="INFERFLEET_DEVICES", show_envvar=True,
              help="auto, cpu, or cuda:0,cuda:1,... (workers are placed round-robin).")
@click.option("--workers-per-device", type=int, default=1, show_default=True,
              envvar="INFERFLEET_WORKERS_PER_DEVICE", show_envvar=True, help="Workers per GPU.")
@click.option("--policy", type=click.Choice(["lag", "article", "fixed"]), default="lag", show_default=True,
              envvar="INFERFLEET_POLICY", show_envvar=True,
              help="lag: drain-time target with cooldowns; article: queue>50 +1, <10 -1 every 5 s; fixed: min.")
@click.option("--target-drain-s", type=float, default=5.0, show_default=True, envvar="INFERFLEET_TARGET_DRAIN_S",
              show_envvar=True, help="Scale up when the backlog would take longer than this to drain.")
@click.option("--up-cooldown-s", type=float, default=2.0, show_default=True, envvar="INFERFLEET_UP_COOLDOWN_S",
              show_envvar=True, help="Least time between two scale-ups.")
@click.option("--down-cooldown-s", type=float, default=20.0, show_default=True,
              envvar="INFERFLEET_DOWN_COOLDOWN_S", show_envvar=True, help="Least time after a change before scaling down.")
@click.option("--max-step", type=int, default=2, show_default=True, envvar="INFERFLEET_MAX_STEP",
              show_envvar=True, help="Most workers added or removed at once.")
@click.option("--interval-s", type=float, default=1.0, show_default=True, envvar="INFERFLEET_INTERVAL_S",
              show_envvar=True, help="How often the supervisor observes and decides.")
@click.option("--drain-timeout-s", type=float, default=60.0, show_default=True,
              envvar="INFERFLEET_DRAIN_TIMEOUT_S", show_envvar=True, help="Kill workers still draining after this.")
@click.option("--crash-loop-deaths", type=int, default=5, show_default=True, envvar="INFERFLEET_CRASH_LOOP_DEATHS",
              show_envvar=True, help="Stop restarting a slot after this many deaths...")
@click.option("--crash-loop-window-s", type=float, default=60.0, show_default=True,
              envvar="INFERFLEET_CRASH_LOOP_WINDOW_S", show_envvar=True, help="...within this many seconds.")
def supervise(log_level: str, log_format: str, min_workers: int, max_workers: int | None, devices: str, workers_per_device: int,
              policy: str, target_drain_s: float, up_cooldown_s: float, down_cooldown_s: float, max_step: int,
              interval_s: float, drain_timeout_s: float, crash_loop_deaths: int, crash_loop_window_s: float,
              **options: Any) -> None:
    """Run and size a fleet of workers for one queue from the stream's lag."""
    _setup_logging(log_level, log_format)
    os.environ["INFERFLEET_LOG_LEVEL"] = log_level  # children inherit both
    os.environ["INFERFLEET_LOG_FORMAT"] = log_format
    from inferfleet.worker.fleet.scaling import PolicySettings
    from inferfleet.worker.fleet.supervisor import Supervisor, SupervisorSettings, resolve_devices

    min_workers = _cover_shards(min_workers, options["shards"])
    try:
        device_list = resolve_devices(devices)
        gpus = [d for d in device_list if d != "cpu"]
        default_max = len(gpus) * workers_per_device if gpus else (os.cpu_count() or 1)
        policy_settings = PolicySettings(kind=policy, min_workers=min_workers,
                                         max_workers=max_workers or max(default_max, min_workers),
                                         target_drain_s=target_drain_s, up_cooldown_s=up_cooldown_s,
                                         down_cooldown_s=down_cooldown_s, max_step=max_step)
        settings = SupervisorSettings(worker=_worker_settings(options), policy=policy_settings,
                                      devices=tuple(device_list), workers_per_device=workers_per_device,
                                      interval_s=interval_s, drain_timeout_s=drain_timeout_s,
                                      crash_loop_deaths=crash_loop_deaths,
                                      crash_loop_window_s=crash_loop_window_s)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    stop = threading.Event()
    metrics = _fleet_metrics(settings.worker)  # before the first child: it sets PROMETHEUS_MULTIPROC_DIR
    supervisor = Supervisor(settings, child_main, metrics=metrics)

    def handle(signum: int, frame: Any) -> None:
        if stop.is_set():
            log.warning("second %s: killing every worker now", signal.Signals(signum).name)
            supervisor.kill_now.set()
            return
        log.info("%s received: draining every worker", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    try:
        supervisor.run(stop)
    finally:
        if metrics is not None:
            metrics.close()


def _fleet_metrics(worker_settings: WorkerSettings) -> FleetMetrics | None:
    """With --metrics-port: the host's one /metrics endpoint (the children's, summed, and the fleet's)."""
    if not worker_settings.metrics_port:
        return None
    from inferfleet.worker.metrics import FleetMetrics

    metrics = FleetMetrics(worker_settings.name, worker_settings.metrics_port)
    try:
        metrics.start()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    return metrics


def _cover_shards(min_workers: int, shards: int) -> int:
    """Every shard needs a worker: raise --min-workers to --shards, and say so."""
    if min_workers < shards:
        log.warning("--min-workers %d is fewer than --shards %d: running at least %d workers so that every "
                    "shard has one (slot i serves shard i mod %d)", min_workers, shards, shards, shards)
    return max(min_workers, shards)


# --------------------------------------------------------------------------- enqueue / result


def _parse_params(pairs: tuple[str, ...]) -> dict:
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--param")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


def _describe(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        text = {"dtype": str(value.dtype), "shape": list(value.shape)}
        if value.size <= 32:
            text["values"] = value.tolist()
        return text
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in value.items()}
    return [_describe(v) for v in value]


def _show_reply(reply: Reply, output: str | None) -> None:
    summary: dict[str, Any] = {"id": reply.id, "ok": reply.ok,
                               "model": {"name": reply.model_name, "version": reply.model_version},
                               "timing": reply.timing}
    if reply.ok:
        summary["outputs"] = _describe(reply.outputs)
        if output:
            save_outputs(output, reply.outputs)
    else:
        summary["error"] = {"code": reply.error_code, "message": reply.error_message}
    click.echo(json.dumps(summary, indent=2))
    if not reply.ok:
        sys.exit(1)


def _producer(redis_url: str | None, name: str, prefix: str, shards: int = 1, cluster: bool = False) -> Producer:
    try:
        return Producer(redis_url, name, prefix=prefix, shards=shards, cluster=cluster)
    except errors.ProtocolError as exc:
        raise click.BadParameter(str(exc)) from exc
    except errors.InferfleetError as exc:  # a cluster client connects at once
        raise click.ClickException(str(exc)) from exc


@main.command()
@_name
@click.option("--input", "input_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help=".npy (one tensor) or .npz (arr_0.. positional, other names keyword) inputs.")
@click.option("--param", "params", multiple=True, help="KEY=VALUE (VALUE parsed as JSON if it can be).")
@click.option("--deadline-s", type=float, default=None, help="Answer 'expired' if not picked up in time.")
@click.option("--request-id", default=None, help="Choose the request id (default: a fresh one).")
@click.option("--wait/--no-wait", default=False, help="Wait for the reply and print it.")
@click.option("--timeout-s", type=float, default=30.0, show_default=True, help="With --wait: longest wait.")
@click.option("--output", default=None, help="With --wait: save outputs to this .npy/.npz file.")
@_redis_url
@_prefix
@_shards
@_cluster
def enqueue(name: str, input_path: str, params: tuple[str, ...], deadline_s: float | None,
            request_id: str | None, wait: bool, timeout_s: float, output: str | None,
            redis_url: str | None, prefix: str, shards: int, cluster: bool) -> None:
    """Enqueue one request from a .npy/.npz file; print its request id (or, with --wait, the reply)."""
    try:
        inputs = load_inputs(input_path)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--input") from exc
    with _producer(redis_url, name, prefix, shards, cluster) as producer:
        try:
            rid = producer.submit(inputs, _parse_params(params), deadline_s, request_id=request_id)
            if not wait:
                click.echo(rid)
                return
            _show_reply(producer.result(rid, timeout_s, raise_errors=False), output)
        except errors.ProtocolError as exc:
            raise click.BadParameter(str(exc)) from exc
        except errors.InferfleetError as exc:
            raise click.ClickException(str(exc)) from exc


@main.command()
@_name
@click.argument("request_id")
@click.option("--timeout-s", type=float, default=30.0, show_default=True, help="Longest wait for the reply.")
@click.option("--output", default=None, help="Save outputs to this .npy/.npz file.")
@_redis_url
@_prefix
@_shards
@_cluster
def result(name: str, request_id: str, timeout_s: float, output: str | None,
           redis_url: str | None, prefix: str, shards: int, cluster: bool) -> None:
    """Wait for the reply to REQUEST_ID and print it (exit 1 if it failed)."""
    with _producer(redis_url, name, prefix, shards, cluster) as producer:
        try:
            reply = producer.result(request_id, timeout_s, raise_errors=False)
        except errors.ProtocolError as exc:
            raise click.BadParameter(str(exc), param_hint="REQUEST_ID") from exc
        except errors.InferfleetError as exc:
            raise click.ClickException(str(exc)) from exc
    _show_reply(reply, output)


# --------------------------------------------------------------------------- status


@main.command()
@click.option("--name", default=None, envvar=ENV_VARS["name"], show_envvar=True,
              help="One queue (default: every queue under the prefix).")
@click.option("--watch", is_flag=True, help="Refresh until interrupted.")
@click.option("--interval-s", type=float, default=1.0, show_default=True, help="Refresh period with --watch.")
@_redis_url
@_prefix
@_shards
@_cluster
def status(name: str | None, watch: bool, interval_s: float, redis_url: str | None, prefix: str,
           shards: int, cluster: bool) -> None:
    """Show each queue: length, lag, pending, dead letters, consumers and workers.

    A sharded queue shows each shard (NAME.0, NAME.1 ...) as a queue of its own.
    """
    import time

    import redis
    from rich.console import Console
    from rich.live import Live

    from inferfleet.producer.protocol import QueueKeys, shard_keys
    from inferfleet.worker.cli.status import find_queues, gather, render
    from inferfleet.worker.connections import admin_client

    try:
        keys_list = list(shard_keys(name, shards, prefix)) if name else None
        client = admin_client(redis_url, cluster)
    except (errors.ProtocolError, ValueError) as exc:
        raise click.BadParameter(str(exc)) from exc
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
        raise click.ClickException(f"Redis error: {exc}") from exc

    def snapshot() -> Any:
        from rich.console import Group

        queues = keys_list or [QueueKeys(q, prefix) for q in find_queues(client, prefix)]
        if not queues:
            return f"no queues under prefix {prefix!r}"
        return Group(*(render(gather(client, k)) for k in queues))

    console = Console()
    try:
        if not watch:
            console.print(snapshot())
            return
        with Live(snapshot(), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(interval_s)
                live.update(snapshot())
    except redis.exceptions.RedisError as exc:
        raise click.ClickException(f"Redis error: {exc}") from exc
    except KeyboardInterrupt:
        pass


# --------------------------------------------------------------------------- dead letters


def _find_dead_in(client: Any, shards: list, ident: str) -> tuple[Any, Any]:
    """(shard keys, dead letter) of IDENT in the first shard that holds it, else a clear error."""
    from inferfleet.worker.serving.deadletter import find_dead

    for keys in shards:
        letter = find_dead(client, keys, ident)
        if letter is not None:
            return keys, letter
    raise click.ClickException(f"no dead letter {ident!r} in {', '.join(k.dead for k in shards)}")


@main.group()
def dead() -> None:
    """Inspect, replay or purge a queue's dead letters (requests given up on)."""


@dead.command("list")
@_name
@click.option("--count", type=int, default=100, show_default=True, help="Most entries to show.")
@_redis_url
@_prefix
@_shards
@_cluster
def dead_list(name: str, count: int, redis_url: str | None, prefix: str, shards: int, cluster: bool) -> None:
    """List dead letters, oldest first (shard by shard)."""
    from datetime import datetime, timezone

    from rich.console import Console
    from rich.table import Table

    from inferfleet.worker.serving.deadletter import list_dead

    client, shard_keys = queue_context(name, redis_url, prefix, shards, cluster)
    table = Table(title=f"dead letters of {name}", title_justify="left")
    for column in ("dead id", "request id", "when (UTC)", "deliveries", "reason") + ("queue",) * (shards > 1):
        table.add_column(column)
    for keys in shard_keys:
        for letter in list_dead(client, keys, count):
            when = datetime.fromtimestamp(letter.dead_ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            table.add_row(letter.dead_id, letter.request_id, when, str(letter.deliveries), letter.reason,
                          *[keys.name] * (shards > 1))
    Console().print(table if table.row_count else f"no dead letters in {', '.join(k.dead for k in shard_keys)}")


@dead.command("show")
@_name
@click.argument("ident")
@_redis_url
@_prefix
@_shards
@_cluster
def dead_show(name: str, ident: str, redis_url: str | None, prefix: str, shards: int, cluster: bool) -> None:
    """Show one dead letter (IDENT: its dead id or its request id) as JSON."""
    client, shard_keys = queue_context(name, redis_url, prefix, shards, cluster)
    _, letter = _find_dead_in(client, shard_keys, ident)
    shown = {k: v for k, v in vars(letter).items() if k != "fields"}
    shown["fields"] = sorted(k.decode(errors="replace") for k in letter.fields)
    click.echo(json.dumps(shown, indent=2))


@dead.command("replay")
@_name
@click.argument("ident", required=False)
@click.option("--all", "replay_all", is_flag=True, help="Replay every dead letter.")
@_redis_url
@_prefix
@_shards
@_cluster
def dead_replay(name: str, ident: str | None, replay_all: bool, redis_url: str | None, prefix: str,
                shards: int, cluster: bool) -> None:
    """Put a dead letter (or --all) back on the request stream it came from, same request id."""
    from inferfleet.worker.serving.deadletter import list_dead, replay_dead

    if bool(ident) == replay_all:
        raise click.UsageError("give a dead id or request id, or --all")
    client, shard_keys = queue_context(name, redis_url, prefix, shards, cluster)
    found = ([(keys, letter) for keys in shard_keys for letter in list_dead(client, keys, 1_000_000)]
             if replay_all else [_find_dead_in(client, shard_keys, ident or "")])
    for keys, letter in found:
        new_id = replay_dead(client, keys, letter)
        click.echo(f"replayed {letter.request_id} as entry {new_id.decode()}")


@dead.command("purge")
@_name
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@_redis_url
@_prefix
@_shards
@_cluster
def dead_purge(name: str, yes: bool, redis_url: str | None, prefix: str, shards: int, cluster: bool) -> None:
    """Delete every dead letter of the queue (of every shard)."""
    from inferfleet.worker.serving.deadletter import purge_dead

    client, shard_keys = queue_context(name, redis_url, prefix, shards, cluster)
    streams = ", ".join(k.dead for k in shard_keys)
    if not yes:
        click.confirm(f"delete every dead letter in {streams}?", abort=True)
    click.echo(f"purged {sum(purge_dead(client, keys) for keys in shard_keys)} dead letters")


# --------------------------------------------------------------------------- bench


@main.command()
@click.option("--name", default=None, envvar=ENV_VARS["name"], show_envvar=True,
              help="Queue (model) name of the fleet to measure (default with --spawn: bench).")
@click.option("--model", "model_path", default=None, envvar=ENV_VARS["model"], show_envvar=True,
              help="Model file: the inputs' form (its example), and what --spawn and --baseline serve.")
@click.option("--input", "input_path", default=None, type=click.Path(exists=True, dir_okay=False),
              envvar="INFERFLEET_BENCH_INPUT", show_envvar=True,
              help="Take the inputs' form from this .npy/.npz file instead (its first rows).")
@click.option("--spawn", type=int, default=0, show_default=True, envvar="INFERFLEET_BENCH_SPAWN", show_envvar=True,
              help="Start N workers for the run (on a private Redis unless --redis-url) and stop them after.")
@click.option("--worker-arg", "worker_args", multiple=True, envvar="INFERFLEET_BENCH_WORKER_ARGS",
              show_envvar=True, help="Option for each spawned worker, e.g. --worker-arg=--max-batch-rows=64 "
              "(repeat).")
@click.option("--baseline", type=click.Choice(["none", "naive"]), default="none", show_default=True,
              envvar="INFERFLEET_BENCH_BASELINE", show_envvar=True,
              help="naive: the same load against one process that loads the model on its first request "
              "and serves one request at a time, side by side.")
@click.option("--requests", "-n", type=int, default=20_000, show_default=True, envvar="INFERFLEET_BENCH_REQUESTS",
              show_envvar=True, help="Requests per run.")
@click.option("--rows", type=int, default=1, show_default=True, envvar="INFERFLEET_BENCH_ROWS", show_envvar=True,
              help="Rows per request.")
@click.option("--concurrency", "--window", "concurrency", type=int, default=None,
              envvar="INFERFLEET_BENCH_CONCURRENCY", show_envvar=True,
              help="Closed loop: requests in flight, as N clients with one request each (default 256).")
@click.option("--rate", type=float, default=None, envvar="INFERFLEET_BENCH_RATE", show_envvar=True,
              help="Open loop: requests per second, sent on schedule whatever the replies.")
@click.option("--rates", default=None, envvar="INFERFLEET_BENCH_RATES", show_envvar=True,
              help="Open loop at each of these rates in turn, e.g. 1000,2000,4000.")
@click.option("--arrival", type=click.Choice(["fixed", "poisson"]), default=None,
              envvar="INFERFLEET_BENCH_ARRIVAL", show_envvar=True,
              help="Open-loop arrivals: fixed spacing or Poisson (default poisson).")
@click.option("--seed", type=int, default=0, show_default=True, envvar="INFERFLEET_BENCH_SEED", show_envvar=True,
              help="Seed of the random inputs and the Poisson schedule.")
@click.option("--warmup", type=int, default=None, envvar="INFERFLEET_BENCH_WARMUP", show_envvar=True,
              help="Requests sent before the runs, not counted (default: a fifth of --requests, at most 1000).")
@click.option("--timeout-s", type=float, default=60.0, show_default=True, envvar="INFERFLEET_BENCH_TIMEOUT_S",
              show_envvar=True, help="Longest wait for a reply before giving up.")
@click.option("--json", "as_json", is_flag=True, envvar="INFERFLEET_BENCH_JSON", show_envvar=True,
              help="Print the report as JSON instead of markdown.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False), envvar="INFERFLEET_BENCH_OUT",
              show_envvar=True, help="Also write report.md, report.json and report.png into this directory.")
@_redis_url
@_prefix
def bench(name: str | None, model_path: str | None, input_path: str | None, spawn: int,
          worker_args: tuple[str, ...], baseline: str, requests: int, rows: int, concurrency: int | None,
          rate: float | None, rates: str | None, arrival: str | None, seed: int, warmup: int | None,
          timeout_s: float, as_json: bool, out_dir: str | None, redis_url: str | None, prefix: str) -> None:
    """Measure a fleet: QPS, p50/p95/p99/max latency, first-request latency, mean batch rows.

    Closed loop (default): --concurrency requests in flight. Open loop: --rate R, or a --rates sweep,
    sent on a fixed or Poisson schedule; latency counts from each request's scheduled send time.
    Measures running workers (--name), or starts them (--spawn N --model PATH). --baseline naive runs
    the same load against a one-request-at-a-time server too. Prints a markdown table (or --json);
    --out DIR adds report.md, report.json and report.png (latency CDF, QPS against offered load).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from inferfleet.worker.bench import load as b

    try:
        plan = b.BenchPlan(requests, rows, concurrency, b.parse_rates(rate, rates), arrival, warmup, seed, timeout_s)
        setup = b.FleetSetup(name, model_path, spawn, worker_args, baseline, redis_url, prefix)
        pool = b.bench_inputs(model_path, input_path, rows, seed)
    except b.BenchError as exc:
        raise click.UsageError(str(exc)) from exc
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=Console(stderr=True)) as display:
            bars = b.ProgressBars(display)
            bars("setting up", 0, 1)
            with b.BenchFleet(setup) as fleet:
                bars("setting up", 1, 1)
                reports = b.run_all(fleet, pool, plan, bars)
    except b.BenchError as exc:
        raise click.UsageError(str(exc)) from exc
    except errors.InferfleetError as exc:
        raise click.ClickException(str(exc)) from exc
    about = f"{setup.describe()}; {plan.describe()}"
    markdown = b.render_markdown(reports, b.heading(setup, plan))
    if out_dir:
        b.write_outputs(out_dir, reports, markdown, about)
    if as_json:
        click.echo(json.dumps(b.report_json(reports, about), indent=2))
    else:
        click.echo(markdown, nl=False)


# the model lifecycle commands live in their own module (swap, alerts)
main.add_command(lifecycle_commands.swap)
main.add_command(lifecycle_commands.alerts)
