#!/usr/bin/env python3
"""Write docs/cli.md from the click commands' own help, so the two never disagree.

python -m scripts.gen_cli_docs          # rewrite docs/cli.md
python -m scripts.gen_cli_docs --check  # exit 1 if docs/cli.md is stale (a test runs this)
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from inferfleet.worker.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent

HEADER = """# inferfleet command line

Generated from the commands' own `--help` by `python -m scripts.gen_cli_docs`;
a test fails when this file is stale. Every option can also be set from the
environment variable shown beside it (`REDIS_URL` for the Redis URL), but for
one request's own data (`enqueue --input`, `--param`, `--request-id`), the
endless `--watch` and `--follow`, and one-shot actions (`--promote`, `--force`,
`--rollback`, `--yes` ...), which must be typed each time.
Exit status: 0 success, 1 a failed request or runtime error, 2 bad usage.

"""


WIDTH = 100


def _context(command: click.Command, name: str, parent: click.Context | None) -> click.Context:
    """The context ``--help`` runs in: the command's own settings (``-h``, the width) and its
    parents'."""
    settings = {"terminal_width": WIDTH, "max_content_width": WIDTH, **command.context_settings}
    # click (8.1.8+) caches a command's help option from the first context that asks for it; one
    # made
    # without the group as parent (a test parsing a command alone) would leave it without -h
    if getattr(command, "_help_option", None) is not None:
        command._help_option = None
    return click.Context(command, info_name=name, parent=parent, **settings)


def _sections(command: click.Command, ctx: click.Context) -> list[str]:
    """This command's help, then its subcommands' (recursively), each under its full path."""
    parts = [f"## {ctx.command_path}\n\n```text\n{command.get_help(ctx).rstrip()}\n```\n\n"]
    if isinstance(command, click.Group):
        for name in sorted(command.list_commands(ctx)):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                parts += _sections(sub, _context(sub, name, ctx))
    return parts


def command_paths(command: click.Command = cli, path: str = "inferfleet") -> list[str]:
    """Every command's full path (``inferfleet dead list`` ...), walked from click's own tree."""
    paths = [path]
    if isinstance(command, click.Group):
        ctx = click.Context(command, info_name=path)
        for name in sorted(command.list_commands(ctx)):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                paths += command_paths(sub, f"{path} {name}")
    return paths


def render() -> str:
    """The whole page: the group and every command and subcommand, as each one's ``--help`` prints
    it."""
    return HEADER + "".join(_sections(cli, _context(cli, "inferfleet", None))).rstrip() + "\n"


def main() -> None:
    path = ROOT / "docs" / "cli.md"
    text = render()
    if "--check" in sys.argv:
        if not path.exists() or path.read_text() != text:
            print("docs/cli.md is stale: run python -m scripts.gen_cli_docs", file=sys.stderr)
            sys.exit(1)
        return
    path.write_text(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
