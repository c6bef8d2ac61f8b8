"""``inferfleet`` and ``python -m inferfleet``: the command line.

The command line is the worker side's (``pip install -e '.[worker]'`` in a
checkout: the package is not published on PyPI);
on an SDK-only install it says so in one line instead of a traceback.
"""

from __future__ import annotations

import sys

#: Top-level modules the worker side needs beyond the SDK's (the ``worker`` extra).
WORKER_MODULES = frozenset(
    {"torch", "click", "rich", "matplotlib", "prometheus_client", "pythonjsonlogger", "cachetools"}
)


def main() -> None:
    """Run the ``inferfleet`` click group, or exit 2 naming the missing extra."""
    try:
        from inferfleet.worker.cli import main as cli
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in WORKER_MODULES:
            raise
        sys.stderr.write(
            f"inferfleet: the command line is part of the worker side, and {exc.name} is not "
            f"installed: run pip install -e '.[worker]' in an inferfleet checkout\n"
        )
        sys.exit(2)
    cli()


if __name__ == "__main__":
    main()
