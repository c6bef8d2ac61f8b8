#!/usr/bin/env python3
"""Write docs/cli.md from the click commands' own help, so the two never disagree.

    python scripts/gen_cli_docs.py          # rewrite docs/cli.md
    python scripts/gen_cli_docs.py --check  # exit 1 if docs/cli.md is stale (a test runs this)
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inferfleet.worker.cli import main as cli  # noqa: E402

HEADER = """# inferfleet command line

Generated from the commands' own `--help` by `python scripts/gen_cli_docs.py`;
a test fails when this file is stale. Every option can also be set from the
environment variable shown beside it (`REDIS_URL` for the Redis URL).
Exit status: 0 success, 1 a failed request or runtime error, 2 bad usage.

"""


def render() -> str:
    parts = [HEADER]
    ctx = click.Context(cli, info_name="inferfleet", terminal_width=100, max_content_width=100)
    for name in sorted(cli.list_commands(ctx)):
        command = cli.get_command(ctx, name)
        sub = click.Context(command, info_name=f"inferfleet {name}", parent=None,
                            terminal_width=100, max_content_width=100)
        parts.append(f"## inferfleet {name}\n\n```text\n{command.get_help(sub).rstrip()}\n```\n\n")
    return "".join(parts).rstrip() + "\n"


def main() -> None:
    path = ROOT / "docs" / "cli.md"
    text = render()
    if "--check" in sys.argv:
        if not path.exists() or path.read_text() != text:
            print("docs/cli.md is stale: run python scripts/gen_cli_docs.py", file=sys.stderr)
            sys.exit(1)
        return
    path.write_text(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
