"""``python -m inferfleet.worker.cli``: the ``inferfleet`` command."""

from __future__ import annotations

from inferfleet.worker.cli import main

main()
