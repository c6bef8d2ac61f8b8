"""Commands of README.md and docs/, read and checked the way a shell and each program would take
them, without running anything (tests/unit/test_docs_commands.py says what is checked and why;
tests/e2e/test_benchmarks_doc.py runs some of them).

- :func:`page_commands`: every line of a page's shell code blocks (fenced ``bash``/``sh``/
  ``console``/plain, or indented four spaces; in a transcript only the lines at a ``$ ``
  prompt), and the inline code spans of its prose that start like a command;
- :func:`simple_commands`: a line cut into its simple commands as a shell would (at ``;``,
  ``&&``, ``||``, ``|``; after ``VAR=value``; redirections dropped; each ``$(...)`` on its own);
- :func:`check`: each simple command parsed by what will parse it (the ``inferfleet`` click
  tree, a script's own argparse parser, pytest's parser for ``./scripts/test``, the compose
  file for ``docker compose``), returning what it shows (its subcommands, options and choices);
- :func:`words_of_test`: the strings and names a test's code reaches, to hold what a command
  shows against the test named to run it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import itertools
import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from unittest import mock

import click
import pytest
import yaml

from inferfleet.worker.cli import main as cli
from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: How an inline code span of the prose starts when it is a command (after ``VAR=value``s).
COMMAND = re.compile(
    r"^(inferfleet |python3? (scripts/|-m "
    r"(benchmarks|tests\.fixtures|scripts)\.)|\./scripts/|"
    r"pip install |docker |kubectl |redis-cli |curl |gunicorn |uvicorn |"
    r"for |\. \.venv/)"
)
_ASSIGNMENTS = re.compile(r"^(?:[A-Za-z_]\w*=\S*\s+)+")
_SHELL = {"", "bash", "sh", "shell", "console"}
_FENCE = re.compile(r"^\s*```(\w*)\s*$")

#: Programs a command may run that this check takes as they are (no options of theirs checked).
PROGRAMS = frozenset(
    {"curl", "export", "grep", "gunicorn", "head", "printf", "redis-cli", "redis-server", "tail"}
    | {"uvicorn", "wc", "xxd"}
)


#: The modules a doc runs with ``python -m`` that are this repository's scripts.
MODULE_SCRIPT = r"^(benchmarks|tests\.fixtures|scripts)\.\w+$"

#: What ./scripts/setup makes, so not in a fresh clone.
SETUP_MAKES = {".venv/bin/activate"}

#: Compose files the docs show for the reader to write, so not in the repository.
READER_WRITES = {"docker-compose.model.yml"}

#: The value each ``$(...)`` stands for once its command is taken out to be checked on its own.
SUBSTITUTED = "__SUBSTITUTED__"


@dataclass(frozen=True)
class DocCommand:
    page: str
    line: int
    text: str
    in_block: bool  # a code block's line (needs RUN_BY or EXEMPT), or an inline span of the prose

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def _clean(line: str) -> str:
    """One shell line: the prompt, a trailing comment and ``[optional]`` brackets dropped."""
    line = line.strip().removeprefix("$ ")
    line = re.sub(r"\s+#(?!>).*$", "", line)
    # optional options, not a pip extra such as '.[worker,web]'
    return re.sub(r"\[(--[^\]]*)\]", r"\1", line).strip()


def _joined(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """(first line number, line) with backslash continuations joined."""
    start, parts = 0, list[str]()
    for number, raw in lines:
        start = start if parts else number
        text = raw.strip()
        parts.append(text.removesuffix("\\").strip())
        if not text.endswith("\\"):
            yield start, " ".join(parts)
            parts = []


def _split(page: Path) -> tuple[list[list[tuple[int, str]]], list[tuple[int, str]]]:
    """(the page's shell blocks, fenced or indented, each its lines; the prose lines), each line
    with its number."""
    blocks: list[list[tuple[int, str]]] = []
    prose: list[tuple[int, str]] = []
    fence: str | None = None
    indented = False
    blank = True
    for number, raw in enumerate(page.read_text().splitlines(), 1):
        opened = _FENCE.match(raw)
        if opened:
            fence = opened.group(1) if fence is None else None
            blocks.append([])
        elif fence is not None:
            if fence in _SHELL:
                blocks[-1].append((number, raw))
        elif raw.startswith("    ") and (blank or indented):
            if not indented:
                blocks.append([])
            indented = True
            blocks[-1].append((number, raw))
        else:
            indented = indented and not raw.strip()
            prose.append((number, raw))
        blank = not raw.strip()
    return [b for b in blocks if b], prose


def _typed(block: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """A block's command lines: in a transcript (lines at a ``$ `` prompt), the prompted lines and
    their continuations, not the output under them; otherwise every line."""
    if not any(raw.strip().startswith("$ ") for _, raw in block):
        return block
    kept, going = [], False
    for number, raw in block:
        if going or raw.strip().startswith("$ "):
            kept.append((number, raw))
            going = raw.rstrip().endswith("\\")
    return kept


def page_commands(page: Path, name: str | None = None) -> list[DocCommand]:
    name = name or str(page.relative_to(ROOT))
    blocks, prose = _split(page)
    found = [
        DocCommand(name, n, text, True)
        for block in blocks
        for n, line in _joined(_typed(block))
        if (text := _clean(line)) and not text.startswith("#")
    ]
    text = "\n".join(line for _, line in prose)
    for span in re.finditer(r"`([^`]+)`", text):
        command = _clean(" ".join(span.group(1).split()))
        if COMMAND.match(_ASSIGNMENTS.sub("", command)) and "\\|" not in command:  # \| : a table
            found.append(
                DocCommand(name, prose[text.count("\n", 0, span.start())][0], command, False)
            )
    return found


@cache
def doc_commands() -> tuple[DocCommand, ...]:
    return tuple(c for page in PAGES for c in page_commands(page))


# ---- a line, cut into simple commands as a shell would ----


def _substitutions(line: str) -> tuple[str, list[str]]:
    """The line with each ``$(...)`` made one word, and the lines inside them (nested ones too)."""
    out: list[str] = []
    inner: list[str] = []
    quote = ""
    i = 0
    while i < len(line):
        char = line[i]
        if quote == "'":
            quote = "" if char == "'" else quote
        elif char in "'\"":
            quote = "" if quote == char else (quote or char)
        elif line.startswith("$(", i):
            depth, j = 1, i + 2
            while j < len(line) and depth:
                depth += {"(": 1, ")": -1}.get(line[j], 0)
                j += 1
            assert depth == 0, f"an unclosed $( in {line!r}"
            body, nested = _substitutions(line[i + 2 : j - 1])
            inner += [body, *nested]
            out.append(SUBSTITUTED)
            i = j
            continue
        out.append(char)
        i += 1
    return "".join(out), inner


#: Words that open a compound command or close one: not a program.
_COMPOUND = {"for", "while", "until", "case", "done", "fi", "esac", "{", "}"}
#: Words before a program that are not the program.
_PREFIXES = {"do", "then", "else", "elif", "!", "exec", "time"}


def _program(words: list[str]) -> list[str]:
    """A simple command's argv: leading ``VAR=value`` and ``do``/``then``... dropped; empty for a
    bare assignment or a ``for``... clause."""
    while words and (re.match(r"^[A-Za-z_]\w*=", words[0]) or words[0] in _PREFIXES):
        words = words[1:]
    return [] if not words or words[0] in _COMPOUND else words


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of a line, each as its argv: split at ``;``, ``&&``, ``||``, ``|`` and
    ``&``, redirections dropped, and each ``$(...)``'s own commands after the line's."""
    outer, inner = _substitutions(line)
    found: list[list[str]] = []
    for text in [outer, *inner]:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        tokens, words = list(lexer), list[str]()
        skip = False
        for token in tokens:
            if skip:
                skip = False
            elif token and set(token) <= set(";&|"):
                found.append(_program(words))
                words = []
            elif token and set(token) <= set("<>&"):  # a redirection: it and its target
                skip = True
                if words and words[-1].isdigit():  # 2>
                    words.pop()
            else:
                words.append(token)
        found.append(_program(words))
    return [argv for argv in found if argv]


# ---- what each kind of command must name ----

#: What a shown command asks of the test that runs it: one word of each set.
Shown = list[frozenset[str]]


def _placeholder(value: str) -> bool:
    """A value the page leaves to the reader (``REQUEST_ID``, ``$rid``, a ``$(...)``'s)."""
    return (
        value.startswith("$")
        or SUBSTITUTED in value
        or bool(re.fullmatch(r"[A-Z][A-Z_]*|[a-z]", value))
    )


def _data(value: str) -> bool:
    """A value that names the reader's own data (a number, a path or module, a URL): a test may
    use its own."""
    return bool(re.fullmatch(r"[-+]?[\d.,_eE+:-]+|.*[/.:\[].*", value)) or _placeholder(value)


#: Options whose values are names a test picks for itself (its queue, version, tenant...).
_NAMED = {"name", "version", "tenant", "stage", "shard", "device"}

#: The click parameter types whose values are checked here (others may read files).
_CONVERTED = (click.Choice, click.types.IntParamType, click.types.FloatParamType)


def _given(value: object) -> bool:
    """A parsed value, not a missing one (None, empty, or click's UNSET sentinel)."""
    return value is not None and value != () and value != [] and type(value).__name__ != "Sentinel"


def check_inferfleet(argv: list[str], partial: bool = False) -> Shown:
    """``argv`` (after ``inferfleet``) parsed by the click tree: each group's and command's
    options, value arity, choices and numbers, the command's positional arguments. ``partial``:
    the prose names a command or an option in passing (no value, no arguments)."""
    if partial and argv and argv[-1].startswith("-"):
        argv = [*argv, "VALUE"]
    command: click.Command = cli
    path, parent = "inferfleet", None
    shown: Shown = []
    while True:
        ctx = click.Context(
            command, info_name=path.split()[-1], parent=parent, **command.context_settings
        )
        try:
            opts, rest, _ = command.make_parser(ctx).parse_args(list(argv))
        except click.NoSuchOption as exc:
            raise AssertionError(f"{path} has no option {exc.option_name}") from None
        except click.UsageError as exc:
            raise AssertionError(f"{path}: {exc.format_message()}") from None
        shown += _check_params(command, ctx, opts, argv, path)
        if not isinstance(command, click.Group) or (partial and not rest):
            break
        assert rest, f"{path} needs a command"
        sub = command.get_command(ctx, rest[0])
        assert sub is not None, f"{path} has no command {rest[0]!r}"
        shown.append(frozenset({rest[0]}))
        command, path, parent, argv = sub, f"{path} {rest[0]}", ctx, rest[1:]
    if partial:
        return shown
    missing = [
        p.human_readable_name
        for p in command.params
        if isinstance(p, click.Argument) and p.required and not _given(opts.get(p.name))
    ]
    assert not missing, f"{path} needs {', '.join(missing)}"
    assert not rest or ctx.allow_extra_args, f"{path} takes no argument {rest[0]!r}"
    return shown


def _check_params(
    command: click.Command, ctx: click.Context, opts: dict, argv: list[str], path: str
) -> Shown:
    shown: Shown = []
    for param in command.params:
        if param.name not in opts or not isinstance(param, click.Option):
            continue
        names = frozenset(param.opts + param.secondary_opts)
        if not names & {w.split("=", 1)[0] for w in argv}:
            continue  # parsed from the environment, not given
        shown.append(names)
        if param.is_flag or param.count:
            continue
        value = opts[param.name]
        values = (
            [value]
            if isinstance(value, str)
            else list(
                itertools.chain.from_iterable(
                    v if isinstance(v, (list, tuple)) else [v] for v in value
                )
            )
        )
        for one in (v for v in values if isinstance(v, str) and not _placeholder(v)):
            if isinstance(param.type, _CONVERTED):
                try:
                    param.type.convert(one, param, ctx)
                except click.BadParameter as exc:
                    raise AssertionError(
                        f"{path} {param.opts[0]}: {exc.format_message()}"
                    ) from None
            if isinstance(param.type, click.Choice) or not (_data(one) or param.name in _NAMED):
                shown.append(frozenset({one}))
    return shown


class _Captured(Exception):
    pass


@cache
def script_parser(module: str) -> argparse.ArgumentParser:
    """The argparse parser the script's ``main()`` builds: taken as ``main()`` asks it to parse,
    before anything else runs."""
    loaded = importlib.import_module(module)
    assert "ArgumentParser(" in Path(loaded.__file__ or "").read_text()
    built: list[argparse.ArgumentParser] = []

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        built.append(self)
        raise _Captured

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", capture),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture),
        mock.patch("logging.basicConfig"),
        contextlib.suppress(_Captured),
    ):
        loaded.main()
    assert built, f"{module}.main() parsed no arguments"
    return built[0]


def check_module(module: str, argv: list[str]) -> Shown:
    """``argv`` parsed by the script's own parser: options, values, choices, subcommands and
    positionals; ``--worker-arg`` values as ``inferfleet worker`` options. A script with no
    parser takes only the options it looks for in ``sys.argv``."""
    source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
    if "ArgumentParser(" not in source:
        known = set(re.findall(r"\"(--[\w-]+)\" in sys\.argv", source))
        unknown = [word for word in argv if word not in known]
        assert not unknown, f"python -m {module}: unrecognized arguments: {' '.join(unknown)}"
        return [frozenset({module, module.rsplit(".", 1)[-1]}), *(frozenset({w}) for w in argv)]
    parser = script_parser(module)

    def refuse(self: argparse.ArgumentParser, message: str) -> None:
        raise AssertionError(f"python -m {module}: {message}")

    with (
        mock.patch.object(argparse.ArgumentParser, "error", refuse),
        mock.patch.object(argparse.ArgumentParser, "_get_option_tuples", lambda *_: []),
    ):  # a page spells each option out: no abbreviations
        parsed = parser.parse_args(argv)
    shown: Shown = [frozenset({module, module.rsplit(".", 1)[-1]})]
    active = parser
    for word in argv:
        option, _, _ = word.partition("=")
        action = active._option_string_actions.get(option) if word.startswith("-") else None
        if action is not None:  # or its dest: a test may call the script's function with it
            shown.append(frozenset({*action.option_strings, action.dest}))
            value = getattr(parsed, action.dest, None)
            if action.choices and isinstance(value, str):
                shown.append(frozenset({value}))
            continue
        for positional in active._get_positional_actions():
            if positional.choices and word in positional.choices:
                shown.append(frozenset({word}))
                if isinstance(positional, argparse._SubParsersAction):
                    active = positional.choices[word]
    worker_args = getattr(parsed, "worker_arg", None) or []
    if worker_args:
        check_inferfleet(["worker", *worker_args])
    return shown


#: The session's pytest configuration: its parser knows every option ./scripts/test hands on.
_PYTEST: list[pytest.Config] = []


def use_pytest_config(config: pytest.Config) -> None:
    """Give :func:`check_pytest` the session's configuration (a test module's autouse fixture
    calls this)."""
    _PYTEST[:] = [config]


def check_pytest(argv: list[str]) -> Shown:
    """``argv`` parsed by pytest's own parser (this session's, plugins included); the files and
    tests it names exist."""
    assert _PYTEST, "call use_pytest_config(pytestconfig) first, from a fixture"
    try:
        parsed = _PYTEST[0]._parser.parse(argv)
    except pytest.UsageError as exc:
        raise AssertionError(f"pytest: {exc}") from None
    for target in parsed.file_or_dir:
        assert (ROOT / target.split("::")[0]).exists(), f"pytest: {target} does not exist"
    return []


@cache
def hands_on(path: Path) -> tuple[str, str] | None:
    """What a shell script hands its arguments to with ``"$@"``: ("module", name) for ``python
    -m NAME``, ("script", path) for another script of the repository; None if it takes none."""
    for line in path.read_text().splitlines():
        module = re.search(r"-m ([\w.]+)\b.*\"\$@\"", line)
        if module:
            return "module", module.group(1)
        script = re.search(r"(\./[\w/.-]+|scripts/[\w.-]+) \"\$@\"", line)
        if script:
            return "script", script.group(1)
    return None


def check_script(argv: list[str], through_bash: bool = False) -> Shown:
    """``argv[0]`` is a script of the repository, executable unless bash runs it, and what it
    hands its arguments to takes them."""
    path = ROOT / argv[0].removeprefix("./")
    assert path.is_file(), f"{argv[0]} does not exist"
    if path.suffix == ".py":
        return check_module(str(path.relative_to(ROOT).with_suffix("")).replace("/", "."), argv[1:])
    assert through_bash or path.stat().st_mode & 0o111, f"{argv[0]} is not executable"
    target = hands_on(path)
    if target is None:
        assert not argv[1:], f"{argv[0]} takes no arguments"
        return []
    kind, name = target
    if kind == "script":
        return check_script([name, *argv[1:]])
    return check_pytest(argv[1:]) if name == "pytest" else check_module(name, argv[1:])


def check_python(argv: list[str]) -> Shown:
    """``python -m MODULE ...`` (a script of the repository, or pytest) or ``python FILE ...``."""
    if argv[:1] == ["-c"]:
        return []
    if argv[:1] != ["-m"]:
        return check_script(argv, through_bash=True)
    module, rest = argv[1], argv[2:]
    if module == "pytest":
        return check_pytest(rest)
    assert re.match(MODULE_SCRIPT, module), f"python -m {module}: not a script of this repository"
    assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), f"{module} does not exist"
    return check_module(module, rest)


@cache
def extras() -> frozenset[str]:
    """The extras pyproject.toml defines."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: what the installed project declares
        from importlib.metadata import distribution

        return frozenset(distribution("inferfleet").metadata.get_all("Provides-Extra") or [])
    return frozenset(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )


def check_pip(argv: list[str]) -> Shown:
    """``pip install`` from the checkout (inferfleet is not on PyPI) with extras that exist."""
    specs = [w for w in argv[2:] if not w.startswith("-")]
    assert argv[1:2] == ["install"] and specs, "pip install of nothing"
    for spec in specs:
        found = re.fullmatch(r"\.(?:\[([\w,]+)\])?", spec)
        assert found, (
            f"{spec!r} is not on PyPI: install from the checkout, e.g. pip install -e '.[otel]'"
        )
        unknown = set((found.group(1) or "").split(",")) - {""} - extras()
        assert not unknown, f"pyproject.toml has no extra {sorted(unknown)}"
    return [frozenset({w}) for w in argv[1:] if w.startswith("-")]


def check_files(argv: list[str]) -> Shown:
    """The files ``-f`` names (``kubectl apply``, ``docker compose``) are in the repository."""
    for flag, value in itertools.pairwise(argv):
        if flag == "-f" and value not in READER_WRITES:
            assert (ROOT / value).exists(), f"{value} does not exist"
    return []


@cache
def entry_point() -> tuple[str, ...]:
    """The image's ENTRYPOINT (the Dockerfile's exec form)."""
    found = re.search(r"^ENTRYPOINT (\[.*\])$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert found, "the Dockerfile has no ENTRYPOINT in exec form"
    return tuple(json.loads(found.group(1)))


@cache
def compose_services(files: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The services the compose files define -> the entry point their containers run (empty:
    the image's own, unknown here)."""
    services: dict[str, tuple[str, ...]] = {}
    for name in files:
        if name in READER_WRITES:
            continue
        for service, spec in yaml.safe_load((ROOT / name).read_text())["services"].items():
            if "entrypoint" in spec:
                services[service] = tuple(spec["entrypoint"])
            elif "build" in spec or service not in services:
                services[service] = entry_point() if "build" in spec else ()
    return services


#: docker compose run/exec options that take a value.
_COMPOSE_VALUED = {"-e", "--env", "-v", "--volume", "-w", "--workdir", "-u", "--user", "--name"}
_COMPOSE_VALUED |= {"--entrypoint", "-p", "--publish", "-l", "--label", "-t", "--timeout"}


def check_docker(argv: list[str], partial: bool = False) -> Shown:
    """``docker compose``: its files exist, each service it names is one of theirs, and the
    command ``exec``/``run`` hands a container is checked as that container runs it."""
    check_files(argv)
    shown: Shown = [frozenset({w}) for w in argv[1:] if w.startswith("-") and "=" not in w]
    if argv[:2] != ["docker", "compose"]:
        return shown
    rest, files = argv[2:], list[str]()
    while rest and rest[0].startswith("-"):
        flag, value, *rest = rest
        files += [value] if flag in ("-f", "--file") else []
    if not rest:
        return shown
    services = compose_services(tuple(files or ["docker-compose.yml"]))
    sub, rest = rest[0], rest[1:]
    shown.append(frozenset({sub}))
    while rest and rest[0].startswith("-"):
        rest = rest[2:] if rest[0] in _COMPOSE_VALUED else rest[1:]
    named = rest[:1] if sub in ("exec", "run") else rest
    for service in named:
        assert service in services, (
            f"docker compose: no service {service!r} in {files or 'docker-compose.yml'}"
        )
    if sub in ("exec", "run") and rest[1:]:
        command = [*services[rest[0]], *rest[1:]] if sub == "run" else rest[1:]
        shown += check_argv(command, partial)
    return shown


def check_argv(argv: list[str], partial: bool = False) -> Shown:
    """One simple command: what its program must name, and what the test that runs it must use."""
    program = argv[0]
    if program == "inferfleet":  # a test may run it as python -m inferfleet, or through CliRunner
        return check_inferfleet(argv[1:], partial)
    if program in ("python", "python3"):
        return check_python(argv[1:])
    if program == "pip":
        return check_pip(argv)
    if program == "docker":
        return check_docker(argv, partial)
    if program == "kubectl":
        return check_files(argv)
    if program == "bash":
        return check_script(argv[1:], through_bash=True)
    if program in (".", "source"):
        made = argv[1] in SETUP_MAKES
        assert made or (ROOT / argv[1]).is_file(), f"{argv[1]} does not exist"
        return []
    if "/" in program:
        return check_script(argv)
    assert program in PROGRAMS, f"{program}: no such program here (a typo, or add it to PROGRAMS)"
    if program == "redis-cli":  # the Redis command, not redis-cli's own options
        return [frozenset({w.lower()}) for w in argv[1:] if re.fullmatch(r"[A-Z]+", w)][:1]
    if program in ("gunicorn", "redis-server", "uvicorn"):  # not curl's -s: how it prints
        return [frozenset({w.split("=", 1)[0]}) for w in argv[1:] if w.startswith("-")]
    return []


def check(command: str, partial: bool = False) -> Shown:
    """Every simple command of the line names what exists; returns what the line shows (each
    program, subcommand, option and choice) for :func:`shown_words`. ``partial``: a mention in
    the prose, which may leave out values and arguments."""
    return [shown for argv in simple_commands(command) for shown in check_argv(argv, partial)]


def shown_words(command: str) -> Shown:
    return check(command)


# ---- what a test's code holds ----


@cache
def _definitions(path: Path) -> dict[str, list[ast.AST]]:
    """A module's top-level names -> the statements that bind them."""
    found: dict[str, list[ast.AST]] = {}
    for node in ast.parse(path.read_text()).body:
        names: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif isinstance(node, ast.ImportFrom):
            names = [a.asname or a.name for a in node.names]
        for name in names:
            found.setdefault(name, []).append(node)
    return found


def _conftests(path: Path) -> list[Path]:
    return [d / "conftest.py" for d in path.parents if d.is_relative_to(ROOT / "tests")]


def _words(text: str) -> set[str]:
    text = text.lower()
    return {text, *re.split(r"[\s=,]+", text)}


def _names(name: str) -> set[str]:
    """An identifier and its parts: ``xinfo_groups`` (redis-py's XINFO GROUPS), ``scenario_kill``
    (the chaos script's ``kill``)."""
    return {name.lower(), *name.lower().split("_")}


@cache
def words_of_test(test_id: str) -> frozenset[str]:
    """Every string and name the test's code reaches, lowercased: its body and decorators, the
    module's and conftest's definitions it names (fixtures included), the ``tests.*`` names it
    imports, and theirs in turn."""
    path, _, name = test_id.partition("::")
    todo, seen, words = [(ROOT / path, name)], set[tuple[Path, str]](), set[str]()
    while todo:
        file, name = todo.pop()
        if (file, name) in seen:
            continue
        seen.add((file, name))
        nodes = _definitions(file).get(name)
        for conftest in [] if nodes else [c for c in _conftests(file) if c.is_file()]:
            todo.append((conftest, name))
        for node in nodes or []:
            if isinstance(node, ast.ImportFrom):
                words.update(_words(node.module or ""), *(_words(a.name) for a in node.names))
                target = ROOT / ((node.module or "").replace(".", "/") + ".py")
                if (node.module or "").startswith("tests") and target.is_file():
                    todo += [(target, a.name) for a in node.names if (a.asname or a.name) == name]
                continue
            for sub in ast.walk(node):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    words.update(_words(sub.value))
                elif isinstance(sub, ast.Name):
                    todo.append((file, sub.id))
                    words.update(_names(sub.id))
                elif isinstance(sub, ast.arg):
                    todo.append((file, sub.arg))
                elif isinstance(sub, (ast.Attribute, ast.keyword)):
                    words.update(_names(getattr(sub, "attr", None) or sub.arg or ""))
    return frozenset(words)
