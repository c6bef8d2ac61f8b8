"""The ``inferfleet`` command line: one click group, its commands split by family."""

from __future__ import annotations

from inferfleet.worker.cli.commands import child_main, main

__all__ = ["child_main", "main"]
