"""``inferfleet swap`` and ``inferfleet alerts``: the model lifecycle commands."""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any

import click

from inferfleet.worker.cli.options import QueueConfig, pass_queue_config

__all__ = ["VERSION_RE", "alerts", "check_model", "serving_pair", "swap", "wait_for"]

VERSION_RE = re.compile(r"[A-Za-z0-9._:+-]{1,64}\Z")


def check_model(model: str, version: str | None, check: bool) -> str:
    """Validate the model here before the fleet sees it; return its version."""
    from inferfleet.worker.errors import ModelLoadError
    from inferfleet.worker.runtime.loading import file_version, is_handler_spec, load_model

    is_spec = is_handler_spec(model)
    if not is_spec and not os.path.isfile(model):
        if check or version is None:
            raise click.BadParameter(f"model file {model!r} does not exist here (pass --no-check and --version "
                                     f"if only the workers can see it)", param_hint="--model")
        return version
    if check:
        import torch

        try:
            _, _, default_version = load_model(model, torch.device("cpu"))
        except ModelLoadError as exc:
            raise click.BadParameter(f"the model does not load: {exc}", param_hint="--model") from exc
        return version or default_version
    return version or ("1" if is_spec else file_version(model))


def serving_pair(client: Any, keys: Any) -> tuple[str, str]:
    """The (model, version) the live workers run, for a first publish's rollback target."""
    from inferfleet.worker.heartbeat import heartbeat_key, read_heartbeats

    for info in read_heartbeats(client, keys):
        raw = client.hget(heartbeat_key(keys, info.consumer), "model")
        if raw:
            return raw.decode(errors="replace"), info.version
    return "", ""


def wait_for(client: Any, shards: list, version: str, timeout_s: float) -> bool:
    """Until every live worker serves ``version`` or reports a failed load; print each."""
    from inferfleet.worker.heartbeat import read_heartbeats

    deadline = time.monotonic() + timeout_s
    while True:
        workers = [w for keys in shards for w in read_heartbeats(client, keys)]
        failed = [w for w in workers if w.swap_error and version in w.swap_error]
        pending = [w for w in workers if w.version != version and w not in failed]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for w in workers:
        state = "ok" if w.version == version else ("FAILED: " + w.swap_error if w in failed else "still " + w.version)
        click.echo(f"  {w.consumer}: {state}")
    if not workers:
        click.echo("  no live workers (new ones load this version at start)")
    return not failed and not pending


@click.command()
@pass_queue_config
@click.option("--model", default=None, help="The new model: a file every worker can read, or module:Handler.")
@click.option("--version", "version", default=None, help="Its version (default: the file's hash).")
@click.option("--rollback", is_flag=True, help="Return to the version before the current one.")
@click.option("--check/--no-check", default=True, show_default=True,
              help="Load the model here first, so a broken file never reaches the fleet.")
@click.option("--wait-s", type=float, default=60.0, show_default=True,
              help="Wait this long for every live worker to switch (0: do not wait).")
def swap(queue: QueueConfig, model: str | None, version: str | None, rollback: bool, check: bool,
         wait_s: float) -> None:
    """Publish a new model version to a queue's workers (hot swap), or roll back.

    Workers load and warm the new version in the background and switch between
    batches; in-flight batches finish on the old copy. Exit status 1 if a live
    worker failed to load it or did not switch within --wait-s.
    """
    import redis

    from inferfleet.worker.serving.lifecycle import NoPreviousVersion, publish
    from inferfleet.worker.serving.lifecycle import rollback as do_rollback

    if rollback == (model is not None):
        raise click.UsageError("give either --model (to publish a version) or --rollback")
    if wait_s < 0:
        raise click.BadParameter("must be 0 or more", param_hint="--wait-s")
    if version is not None and not VERSION_RE.match(version):
        raise click.BadParameter(f"{version!r}: use 1 to 64 of A-Z a-z 0-9 . _ : + -", param_hint="--version")
    client, shard_list = queue.connect()
    try:
        if model is not None:
            version = check_model(model, version, check)
        for keys in shard_list:  # one shard after another: each shard's switch is atomic, not all of them
            if rollback:
                published = do_rollback(client, keys)
            else:
                assert model is not None and version is not None
                published = publish(client, keys, model, version, serving_pair(client, keys))
            click.echo(f"{keys.name}: version {published.version} ({published.model}) published as "
                       f"#{published.seq}; previous {published.previous_version or 'none'}")
        if wait_s and not wait_for(client, shard_list, published.version, wait_s):
            sys.exit(1)
    except NoPreviousVersion as exc:
        raise click.ClickException(str(exc)) from exc
    except redis.exceptions.RedisError as exc:
        raise click.ClickException(f"Redis error: {exc}") from exc


@click.command()
@pass_queue_config
@click.option("--count", type=int, default=20, show_default=True, help="Most alerts to show.")
@click.option("--kind", default=None,
              type=click.Choice(["low_confidence", "non_finite", "inconsistent", "swap_failed", "shadow_failed",
                                 "shadow_divergence", "canary_rollback", "many"]),
              help="Only alerts of this kind.")
@click.option("--follow", is_flag=True, help="Keep printing new alerts until interrupted.")
def alerts(queue: QueueConfig, count: int, kind: str | None, follow: bool) -> None:
    """Show a queue's alerts: low confidence, NaN/Inf outputs, inconsistent results, failed swaps,
    candidates that failed to load, diverged or were rolled back."""
    import redis

    from inferfleet.worker.serving.alerts import Alert, alerts_key, read_alerts

    if count < 1:
        raise click.BadParameter("must be at least 1", param_hint="--count")
    client, shard_list = queue.connect()

    def show(alert: Alert) -> None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(alert.time_ms / 1000))
        click.echo(f"{when} {alert.kind:<15} v{alert.version} {alert.consumer} {alert.rid or '-'}: {alert.detail}")

    try:
        found = [(keys, a) for keys in shard_list for a in read_alerts(client, keys, count, kind)]
        shown = sorted(found, key=lambda pair: pair[1].time_ms)[-count:]
        for _, alert in shown:
            show(alert)
        if not follow:
            if not shown:
                click.echo(f"no alerts in {', '.join(alerts_key(k) for k in shard_list)}")
            return
        last = {}
        for keys in shard_list:  # from each stream's newest entry ("$" would skip any between two reads)
            newest = client.xrevrange(alerts_key(keys), count=1)
            last[alerts_key(keys)] = newest[0][0] if newest else "0-0"
        while True:  # one XREAD per shard: a cluster cannot read keys of several slots at once
            for stream in last:
                for _, entries in client.xread({stream: last[stream]}, block=1000 // len(last)) or []:
                    for entry_id, raw in entries:
                        last[stream] = entry_id
                        alert = Alert.from_entry(entry_id, raw)
                        if kind is None or alert.kind == kind:
                            show(alert)
    except redis.exceptions.RedisError as exc:
        raise click.ClickException(f"Redis error: {exc}") from exc
    except KeyboardInterrupt:
        pass
