"""The ``inferfleet`` click group, with every command family registered on it.

One module per family: :mod:`.serving` (worker), :mod:`.supervise`, :mod:`.scaler`,
:mod:`.requests` (enqueue, result), :mod:`.admin` (status, dead), :mod:`.sharing` (limit,
cancel), :mod:`.bench`, :mod:`.lifecycle` (swap, alerts), :mod:`.pipeline` (split) and
:mod:`.rollout` (shadow); the options they share are in :mod:`.options`. Only the commands that
need torch import it, when run.

Every option has an environment variable (shown in ``--help``); bad input exits with a clear
message and status 2, a failed request with status 1. The command line is the only part of
inferfleet that configures logging or prints.
"""

from __future__ import annotations

import click

from inferfleet.worker.cli import (
    admin,
    bench,
    lifecycle,
    models,
    pipeline,
    requests,
    rollout,
    scaler,
    serving,
    sharing,
    supervise,
)
from inferfleet.worker.cli.group import InferfleetGroup

__all__ = ["main"]

EXAMPLES = """\b
Examples (every command reads REDIS_URL, default redis://localhost:6379/0):
  inferfleet worker --name ctr --model models/ctr.pt
  inferfleet enqueue --name ctr --input models/features.npz --wait
  inferfleet status
  inferfleet dead list --name ctr
  inferfleet save-model tests.fixtures.build_models:CTR --example models/features.npz \\
      --out ctr-packed.pt2

Guides: README.md ("Bring your own model"), docs/handlers.md, docs/cli.md."""


@click.group(
    cls=InferfleetGroup,
    epilog=EXAMPLES,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(package_name="inferfleet")
def main() -> None:
    """inferfleet: PyTorch inference workers fed by Redis Streams."""


for _command in (
    serving.worker,
    supervise.supervise,
    scaler.scaler,
    requests.enqueue,
    requests.result,
    admin.status,
    admin.dead,
    bench.bench,
    lifecycle.swap,
    lifecycle.alerts,
    pipeline.split,
    rollout.shadow,
    sharing.limit,
    sharing.cancel,
):
    main.add_command(_command)
main.add_command(models.save_model_command)
