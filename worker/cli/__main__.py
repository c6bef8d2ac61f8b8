"""``python -m inferfleet.worker.cli``: the ``inferfleet`` command."""

from inferfleet.worker.cli import main

main()
