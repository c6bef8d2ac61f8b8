"""The ``inferfleet`` command line: one click group, its commands split by family."""

from __future__ import annotations

from inferfleet.worker.cli.app import main
from inferfleet.worker.cli.serving import child_main

__all__ = ["child_main", "main"]
