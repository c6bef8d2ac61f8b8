"""Every command README.md and docs/ show exists as written, and a named test runs it (or a reason
says why not).

The commands are the lines of shell code blocks (fenced ``bash``/``sh``/``console``/plain, or
indented four spaces) and the inline code spans of the prose that start like a command
(``inferfleet``, ``python -m benchmarks.…``, ``./scripts/...``, ``pip install``, ``docker``,
``kubectl``, ``redis-cli``, ``curl``, ``gunicorn``, ``uvicorn``). Each one is checked without
running anything:

- ``inferfleet ...``: the subcommand is in the click tree and each option is one of its options;
- a script (``./scripts/x`` or ``python -m benchmarks.x``, ``tests.fixtures.x``, ``scripts.x``):
  the file exists, and each option is one its argparse or click code declares;
- ``pip install``: it installs from the checkout (the package is not on PyPI) with extras that
  pyproject.toml defines;
- ``kubectl apply -f`` and ``docker compose -f``: the files exist.

A block command must also match a :data:`RUN_BY` pattern, naming the test that runs it (literally,
as tests/e2e/test_readme.py does, or the same command on the test's own queue and files), or an
:data:`EXEMPT` pattern with the reason no test here can. A new command in the docs that neither
covers fails here, and so does a pattern that no longer matches any command.
"""

from __future__ import annotations

import ast
import itertools
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import click
import pytest

from inferfleet.worker.cli import main as cli
from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: How a command starts (after a ``$ `` prompt, if any).
COMMAND = re.compile(
    r"^(inferfleet |python3? (scripts/|-m "
    r"(benchmarks|tests\.fixtures|scripts)\.)|\./scripts/|"
    r"pip install |docker |kubectl |redis-cli |curl |gunicorn |uvicorn |"
    r"for |\. \.venv/)"
)
_SHELL = {"", "bash", "sh", "shell", "console"}
_FENCE = re.compile(r"^\s*```(\w*)\s*$")
_README = "tests/e2e/test_readme.py::"
_BENCHMARK = (
    "a benchmark: minutes of measurement on a quiet machine; the page reports what it printed"
)
_DOCKER = "needs a Docker engine, which the unit and CI machines here do not have"
_RELIABILITY = "tests/integration/test_reliability.py::"
_CLUSTER = "needs a Redis Cluster of 8 shards; tests/integration/test_cluster.py runs the same on 3"
_GPU = "needs an NVIDIA GPU"

#: "page: command" pattern -> the test that runs that command.
# The two tables keep one pattern and its test a row, as the eye reads them: not formatted.
# fmt: off
RUN_BY: dict[str, str] = {
    r"^README\.md: (\./scripts/setup|\. \.venv/bin/activate)$":
        _README + "test_the_readme_usage_block_runs_as_written",
    r"^README\.md: (inferfleet (worker --name ctr(-onnx)? |enqueue --name ctr --input "
    r"models/features\.npz --wait$|"
    r"result|supervise|status|dead|swap|alerts|bench --spawn)|python -m "
    r"tests\.fixtures\.export_onnx)":
        _README + "test_the_readme_usage_block_runs_as_written",
    r"^README\.md: inferfleet (worker --name (ctr|stack) |shadow|bench --name|limit|enqueue --name "
    r"(ctr|stack) "
    r"--input models/(features\.npz --priority|stack\.npy)|cancel|split)":
        _README + "test_the_readme_rollout_lanes_and_pipeline_block_runs_as_written",
    r"^docs/handlers\.md: inferfleet worker --name (tabular|text) ":
        "tests/e2e/test_handlers_doc.py::test_each_handler_example_runs_as_written",
    r"^docs/operations\.md: inferfleet worker --name ctr --model models/ctr\.pt( "
    r"--max-batch-rows|$)":
        "tests/e2e/test_worker_cli.py::test_replies_equal_direct_forward_single_and_mixed_batches",
    r"^docs/operations\.md: inferfleet supervise --name ctr --model models/ctr\.pt "
    r"--min-workers 1 ":
        "tests/e2e/test_supervisor_restart.py::test_a_restarted_supervisor_does_not_double_the_fleet",
    r"^docs/operations\.md: inferfleet status --name ctr$":
        "tests/e2e/test_worker_cli.py::test_status_shows_the_queue_and_its_workers",
    r"^docs/operations\.md: inferfleet status --watch$":
        _README + "test_the_readme_usage_block_runs_as_written",
    r"^docs/operations\.md: inferfleet dead (list|show|replay|purge) --name ctr( REQUEST_ID| "
    r"--yes)?$":
        "tests/integration/test_consumer.py::test_dead_letter_commands",
    r"^docs/operations\.md: inferfleet swap ":
        "tests/integration/test_lifecycle.py::test_the_swap_sequence_ends_on_the_version_the_fleet_served",
    r"^docs/operations\.md: inferfleet shadow --name ctr --(model|report|promote)":
        "tests/integration/test_shadow.py::test_an_equal_candidate_agrees_fully_and_is_promoted",
    r"^docs/operations\.md: inferfleet shadow --name ctr --stop":
        "tests/integration/test_shadow.py::test_a_worker_started_later_loads_the_candidate_and_stop_unloads_it",
    r"^docs/operations\.md: inferfleet alerts ":
        "tests/integration/test_quality.py::test_alerts_command",
    r"^docs/operations\.md: inferfleet limit --name ctr --(show|clear)":
        "tests/integration/test_sharing.py::test_limit_show_and_clear",
    r"^docs/operations\.md: (python -m tests\.fixtures\.build_models|inferfleet split |"
    r"inferfleet worker --name stack --pipeline models/stack-split --stage [02]$)":
        "tests/e2e/test_pipeline.py::test_three_stages_answer_like_the_unsplit_model",
    r"^docs/protocol\.md: redis-cli (-x XADD .* id demo-1 |--no-raw BLPOP .*:reply:demo-1')":
        "tests/e2e/test_raw_protocol.py::test_doc_worked_example_bytes",
    r"^docs/protocol\.md: redis-cli (XINFO GROUPS|XLEN|XPENDING) ":
        "tests/e2e/test_raw_protocol.py::test_requests_written_before_any_worker_are_served",
    r"^docs/protocol\.md: redis-cli .*(demo-2 reply_to|inbox:client-7)":
        "tests/e2e/test_raw_protocol.py::test_reply_to_an_inbox",
    r"^docs/protocol\.md: redis-cli .*demo-3":
        "tests/e2e/test_raw_protocol.py::test_reply_to_outside_the_inbox_prefix_is_refused_on_the_default_key",
    r"^docs/protocol\.md: redis-cli .*demo-4": "tests/e2e/test_raw_protocol.py::test_deadline",
    r"^docs/protocol\.md: redis-cli .*demo-5":
        "tests/e2e/test_raw_protocol.py::test_malformed_requests_get_bad_request",
    r"^docs/protocol\.md: redis-cli -x XADD .*id demo-9 traceparent ":
        "tests/integration/test_tracing.py::test_a_bulk_call_carries_the_trace_and_a_bad_traceparent_is_ignored",
    r"^docs/protocol\.md: redis-cli -x XADD 'inferfleet:\{affine\}:requests:high' ":
        "tests/e2e/test_sharing_cli.py::test_limits_lanes_and_status_through_the_cli_and_a_raw_client",
    r"^docs/protocol\.md: redis-cli -c -p 7000 ":
        "tests/integration/test_cluster.py::test_raw_protocol_per_shard",
    r"^docs/protocol\.md: redis-cli (-x )?FCALL ":
        "tests/e2e/test_sharing_cli.py::test_a_raw_client_cancels_a_request_waiting_in_the_queue",
    r"^docs/reliability\.md: python -m benchmarks\.chaos kill ":
        _RELIABILITY + "test_sigkill_a_random_worker_every_second_loses_nothing",
    r"^docs/reliability\.md: python -m benchmarks\.chaos redis ":
        _RELIABILITY + "test_redis_crash_and_restart_with_aof_loses_no_accepted_request",
    r"^docs/reliability\.md: python -m benchmarks\.chaos poison ":
        _RELIABILITY + "test_a_request_that_kills_its_worker_is_dead_lettered_while_others_flow",
    r"^docs/reliability\.md: python -m benchmarks\.chaos (failover|switchover) ":
        _RELIABILITY
        + "test_a_primary_behind_sentinels_is_followed_and_what_it_loses_is_only_counted",
    r"^docs/reliability\.md: python -m benchmarks\.chaos swap ":
        _RELIABILITY
        + "test_hot_swaps_while_workers_are_killed_lose_nothing_and_name_their_version",
    r"^docs/operations\.md: (pip install -e '\.\[worker,web\]'|inferfleet worker --name affine "
    r"--model models/affine\.pt$|gunicorn --preload |uvicorn --app-dir |curl -s (-X POST )?"
    r"localhost:800[01]/)":
        "tests/e2e/test_web_services.py::test_the_example_app_answers_every_request_with_its_own_output",
    r"^README\.md: \./scripts/demo$":
        "tests/e2e/test_demo.py::test_the_demo_runs_as_written_answers_every_request_and_stops_what_it_started",
    r"^docs/deploy\.md: (docker compose (build|up -d|run --rm -e|stop|exec redis|down)|curl -s "
    r"'http://127)":
        "tests/e2e/test_compose.py::test_build_up_bench_stop_up",
}
# fmt: on

#: "page: command" pattern -> why no test here runs it.
# fmt: off
EXEMPT: dict[str, str] = {
    r"^README\.md: \./scripts/test$": "how every test here runs: the suite cannot run itself",
    r"^docs/benchmarks\.md: ": _BENCHMARK,
    r"^docs/metrics\.md: python -m benchmarks\.bench_metrics ": _BENCHMARK,
    r"^docs/operations\.md: inferfleet (worker|supervise|enqueue|status|dead list) --name ctr "
    r".*--cluster --shards 8":
        _CLUSTER,
    r"^docs/operations\.md: inferfleet worker --name stack --pipeline models/stack-split --stage 1 "
    r"--device cuda:1$":
        _GPU,
    r"^docs/deploy\.md: (docker build|docker compose (up --build|-f|exec supervisor|run --rm "
    r"producer bench)|"
    r"curl -s localhost:9100)": _DOCKER,
    r"^docs/deploy\.md: kubectl ": "needs a Kubernetes cluster; tests/unit/test_deploy.py "
                                   "validates the manifests against its schemas offline",
}
# fmt: on

#: The modules a doc runs with ``python -m`` that are this repository's scripts.
MODULE_SCRIPT = r"^(benchmarks|tests\.fixtures|scripts)\.\w+$"

#: Compose files the docs show for the reader to write, so not in the repository.
READER_WRITES = {"docker-compose.model.yml"}


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
    if "[--" in line:  # optional options, not a pip extra such as '.[worker,web]'
        line = line.replace("[--", "--").replace("]", "] ")
    return line.strip()


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


def _split(page: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(shell lines of the page's code blocks, prose lines), each with its line number."""
    shell: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []
    fence: str | None = None
    indented = False
    blank = True
    for number, raw in enumerate(page.read_text().splitlines(), 1):
        opened = _FENCE.match(raw)
        if opened:
            fence = opened.group(1) if fence is None else None
        elif fence is not None:
            if fence in _SHELL:
                shell.append((number, raw))
        elif raw.startswith("    ") and (blank or indented):
            indented = True
            shell.append((number, raw))
        else:
            indented = indented and not raw.strip()
            prose.append((number, raw))
        blank = not raw.strip()
    return shell, prose


def page_commands(page: Path) -> list[DocCommand]:
    name = str(page.relative_to(ROOT))
    shell, prose = _split(page)
    found = [
        DocCommand(name, n, _clean(line), True)
        for n, line in _joined(shell)
        if COMMAND.match(_clean(line))
    ]
    text = "\n".join(line for _, line in prose)
    for span in re.finditer(r"`([^`]+)`", text):
        command = " ".join(span.group(1).split())
        if COMMAND.match(command) and "\\|" not in command:  # \| : alternatives in a table cell
            found.append(
                DocCommand(name, prose[text.count("\n", 0, span.start())][0], command, False)
            )
    return found


@cache
def doc_commands() -> tuple[DocCommand, ...]:
    return tuple(c for page in PAGES for c in page_commands(page))


def _segments(command: str) -> Iterator[list[str]]:
    """The simple commands of a line (split at ``;``, ``&&``, ``|``), as words."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    words: list[str] = []
    for token in lexer:
        if token and set(token) <= set(";&|"):
            yield words
            words = []
        else:
            words.append(token)
    yield words


# ---- what each kind of command must name ----


def _option_words(argv: list[str]) -> Iterator[str]:
    for word in argv:
        if word.startswith("-") and not re.match(r"^-\d", word):
            yield word.split("=", 1)[0]


def check_inferfleet(argv: list[str]) -> None:
    """``argv`` (after ``inferfleet``) names a command of the click tree and only its options."""
    command: click.Command = cli
    path = "inferfleet"
    while isinstance(command, click.Group) and argv and not argv[0].startswith("-"):
        assert argv[0] in command.commands, f"{path} has no command {argv[0]!r}"
        path, command, argv = f"{path} {argv[0]}", command.commands[argv[0]], argv[1:]
    known = {"--help", "-h"} | {
        o
        for p in command.params
        if isinstance(p, click.Option)
        for o in [*p.opts, *p.secondary_opts]
    }
    for word in _option_words(argv):
        assert word in known, f"{path} has no option {word}"


@cache
def script_options(path: Path) -> frozenset[str]:
    """The option strings a script's argparse or click calls declare."""
    declared: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in (
            "add_argument",
            "option",
        ):
            declared.update(
                a.value
                for a in node.args
                if isinstance(a, ast.Constant)
                and isinstance(a.value, str)
                and a.value.startswith("-")
            )
    declared.update(o for word in list(declared) if "/" in word for o in word.split("/"))
    return frozenset(declared | {"--help", "-h"})


def check_script(argv: list[str]) -> None:
    """``argv[0]`` is a script of the repository; a Python one declares each option given."""
    path = ROOT / argv[0].removeprefix("./")
    assert path.is_file(), f"{argv[0]} does not exist"
    if path.suffix == ".py":
        for word in _option_words(argv[1:]):
            assert word in script_options(path), f"{argv[0]} has no option {word}"
    else:
        assert path.stat().st_mode & 0o111, f"{argv[0]} is not executable"


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


def check_pip(argv: list[str]) -> None:
    """``pip install`` from the checkout (inferfleet is not on PyPI) with extras that exist."""
    specs = [w for w in argv[2:] if not w.startswith("-")]
    assert specs, "pip install of nothing"
    for spec in specs:
        found = re.fullmatch(r"\.(?:\[([\w,]+)\])?", spec)
        assert found, (
            f"{spec!r} is not on PyPI: install from the checkout, e.g. pip install -e '.[otel]'"
        )
        unknown = set((found.group(1) or "").split(",")) - {""} - extras()
        assert not unknown, f"pyproject.toml has no extra {sorted(unknown)}"


def check_files(argv: list[str]) -> None:
    """The files ``-f`` names (``kubectl apply``, ``docker compose``) are in the repository."""
    for flag, value in itertools.pairwise(argv):
        if flag == "-f" and value not in READER_WRITES:
            assert (ROOT / value).exists(), f"{value} does not exist"


def check(command: str) -> None:
    """Every simple command of the line names what exists."""
    for argv in _segments(command):
        words = argv[1:] if argv[:1] in (["python"], ["python3"]) else argv
        # docker compose exec SVC inferfleet
        if "inferfleet" in argv[:5] and argv[0] in ("inferfleet", "docker"):
            check_inferfleet(argv[argv.index("inferfleet") + 1 :])
        elif words[:1] and re.match(r"^(\./)?scripts/", words[0]):
            check_script(words)
        elif words[:1] == ["-m"] and re.match(MODULE_SCRIPT, words[1]):
            check_script([words[1].replace(".", "/") + ".py", *words[2:]])
        elif argv[:2] == ["pip", "install"]:
            check_pip(argv)
        if argv[:1] in (["kubectl"], ["docker"]):
            check_files(argv)


# ---- the tests ----


def test_the_docs_have_commands_to_check() -> None:
    texts = [c.text for c in doc_commands()]
    assert "inferfleet shadow --name ctr --promote --force" in texts  # a fenced block
    assert "python -m benchmarks.chaos kill --requests 5000" in texts  # an indented block
    assert "pip install -e '.[onnx]'" in texts  # an inline span over two lines
    assert len(texts) > 150


@pytest.mark.parametrize("command", doc_commands(), ids=str)
def test_each_command_names_what_exists(command: DocCommand) -> None:
    check(command.text)


@pytest.mark.parametrize(
    ("command", "says"),
    [
        ("inferfleet nope --name q", "has no command 'nope'"),
        ("inferfleet dead lists --name q", "inferfleet dead has no command 'lists'"),
        ("inferfleet worker --name q --model m.pt --batch-rows 4", "has no option --batch-rows"),
        ("inferfleet shadow --name q --promote --forced", "has no option --forced"),
        ("docker compose exec supervisor inferfleet status --nmae ctr", "has no option --nmae"),
        ("python -m tests.fixtures.export_onnx --out models --int4", "has no option --int4"),
        ("python scripts/nope.py", "does not exist"),
        ("python -m benchmarks.nope", "does not exist"),
        ("./scripts/nope", "does not exist"),
        ("pip install 'inferfleet[otel]'", "not on PyPI"),
        ("pip install -e '.[otle]'", "no extra ['otle']"),
        ("kubectl apply -f deploy/k9s/", "does not exist"),
    ],
)
def test_a_misspelt_command_is_caught(command: str, says: str) -> None:
    with pytest.raises(AssertionError, match=re.escape(says)):
        check(command)


def _covering(command: DocCommand, patterns: dict[str, str]) -> list[str]:
    return [p for p in patterns if re.search(p, f"{command.page}: {command.text}")]


def test_each_block_command_is_run_by_a_test_or_exempt_with_a_reason() -> None:
    uncovered = [
        str(c)
        for c in doc_commands()
        if c.in_block and not _covering(c, RUN_BY) + _covering(c, EXEMPT)
    ]
    assert uncovered == [], "add the test that runs each to RUN_BY, or a reason to EXEMPT"


def test_every_pattern_still_matches_a_command() -> None:
    block = [c for c in doc_commands() if c.in_block]
    stale = [p for p in [*RUN_BY, *EXEMPT] if not any(_covering(c, {p: ""}) for c in block)]
    assert stale == []


@cache
def _tests_in(path: Path) -> frozenset[str]:
    return frozenset(
        n.name
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")
    )


@pytest.mark.parametrize("test_id", sorted(set(RUN_BY.values())))
def test_each_named_test_exists(test_id: str) -> None:
    path, _, name = test_id.partition("::")
    assert (ROOT / path).is_file(), path
    assert name in _tests_in(ROOT / path), f"{path} has no test {name}"


def test_each_exemption_says_why() -> None:
    assert all(len(reason.split()) >= 4 for reason in EXEMPT.values())
