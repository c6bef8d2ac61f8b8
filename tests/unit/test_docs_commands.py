"""Every command README.md and docs/ show exists as written, and a named test runs it with the
options shown (or a reason says why no test can).

Every line of a shell code block (fenced ``bash``/``sh``/``console``/plain, or indented four
spaces) is a command, except the output under a ``$ `` prompt in a transcript and the lines
:data:`NOT_SHELL` names (a diagram, YAML, Redis commands typed at a Redis prompt). Inline code
spans of the prose are commands when they start like one (``inferfleet``, ``python -m …``,
``./scripts/...``, ``pip install``, ``docker``, ...), after any ``VAR=value`` assignments.

A line is cut into its simple commands the way a shell would: at ``;``, ``&&``, ``||`` and
``|``, after ``VAR=value`` assignments, with redirections dropped, ``do``/``then`` stripped,
and each ``$(...)`` checked as a command of its own. Each simple command is then checked
without running anything (tests/docs_commands.py, which tests/e2e/test_benchmarks_doc.py
shares):

- ``inferfleet ...``: parsed by the click tree of the ``inferfleet`` command itself (each group
  and subcommand, its options, each value's arity, the choices of a choice option, numbers
  where a number is due, required and extra positional arguments);
- a script (``python -m benchmarks.x``, ``tests.fixtures.x``, ``scripts.x``, ``python
  scripts/x.py``): parsed by that script's own argparse parser, taken from its ``main()``
  (options, choices, subcommands, positionals); ``--worker-arg`` values are ``inferfleet
  worker`` options and parsed as such;
- a shell script (``./scripts/x``, ``bash x.sh``, ``.ci/x``): it exists and is executable,
  and the arguments it hands on with ``"$@"`` are parsed by what it hands them to (the
  script's module, or pytest's own parser for ``./scripts/test``);
- ``docker compose``: the ``-f`` files exist, the services named exist, and ``exec SERVICE
  CMD`` / ``run SERVICE ARGS`` are checked as the command the container runs (the image's
  ``inferfleet`` entry point for the fleet's services);
- ``pip install``: from the checkout (the package is not on PyPI) with extras pyproject.toml
  defines; ``kubectl apply -f``: the files exist;
- any other program must be one of ``PROGRAMS``: a misspelt program fails.

An inline span may name a command or an option in passing (``inferfleet save-model``, ``--shards
S``): its options and choices are checked, not that it is complete.

A block command must also match a :data:`RUN_BY` pattern, naming the test that runs it (literally,
as tests/e2e/test_readme.py does, or the same command on the test's own queue and files), or an
:data:`EXEMPT` pattern with the reason no test here can. The named test must use what the command
shows: unless it reads the page and runs its lines, the strings and names its code reaches (its
body, the module's and conftest's helpers and fixtures it names, the ``tests.*`` names it
imports) hold each subcommand, option and choice the command shows (``shown_words``; not
its queue names, paths and numbers, which a test may pick for itself). :data:`NOT_YET_RUN`
lists what a test may not use yet, each entry a TODO. A new command in the docs that neither
covers fails here, and so does a pattern that no longer matches any command.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.docs_commands import (
    SUBSTITUTED,
    DocCommand,
    check,
    doc_commands,
    page_commands,
    shown_words,
    simple_commands,
    use_pytest_config,
    words_of_test,
)


@pytest.fixture(autouse=True)
def _pytest_config(pytestconfig: pytest.Config) -> None:
    use_pytest_config(pytestconfig)  # ./scripts/test's arguments are pytest's


#: "page: line" pattern -> what the lines of a shell-looking block are, if not commands.
# fmt: off
NOT_SHELL: dict[str, str] = {
    r"^docs/architecture\.md: (producer ──|\(producer/\) |heartbeats ──|worker/heartbeat\.py )":
        "a drawing of the request and fleet paths",
    r"^docs/handlers\.md: (x|y|outputs|items|parts) = ":
        "pseudo-code of the hooks a handler overrides",
    r"^docs/deploy\.md: (services:|supervisor:|producer:|volumes:|environment:|- \./my-model|"
    r"INFERFLEET_(NAME|MODEL): )":
        "docker-compose.model.yml, the override file the reader writes",
    r"^docs/deploy\.md: (FROM|COPY) ": "the Dockerfile the reader writes",
    r"^docs/operations\.md: Producer\(": "the Python call, beside the shell commands",
    r"^docs/operations\.md: ( *stage  starts at|\d  (\(inputs\)|blocks\.\d) )":
        "what inferfleet split prints",
    r"^docs/protocol\.md: inferfleet:\{affine\}:\w+(:\S+)? +(the|an) ": "a table of keys",
    r"^docs/protocol\.md: (XADD|XINFO GROUPS|FCALL) ": "a Redis command's syntax",
    r"^docs/protocol\.md: (\(error\) |[0-9a-f]{8}: )": "a reply, as redis-cli and xxd print it",
    r"^docs/protocol\.md: crc32\(RID\) mod S$": "the shard formula, not a command",
    r"^docs/protocol\.md: (float32 \[|-?\d\.\d+,?$|\d\.\d+$|\] \{|queued_ms|infer_ms|"
    r"batch_rows|\}$)":
        "what the Node example prints",
    r"^docs/protocol\.md: (\{\"id\"|\"model\"|\"timing\")": "a reply's fields, as JSON",
    r"^docs/security\.md: (ACL SETUSER |\"\()": "ACL rules, typed at a Redis prompt",
}
# fmt: on

_README = "tests/e2e/test_readme.py::"
_BENCHMARKS = (
    "tests/e2e/test_benchmarks_doc.py::test_every_benchmark_command_parses_and_a_tiny_few_run"
)
_DOCKER = "needs a Docker engine, which the unit and CI machines here do not have"
_RELIABILITY = "tests/integration/test_reliability.py::"
_CLUSTER = "needs a Redis Cluster of 8 shards; tests/integration/test_cluster.py runs the same on 3"
_GPU = "needs an NVIDIA GPU"

#: "page: command" pattern -> the test that runs that command.
# The two tables keep one pattern and its test a row, as the eye reads them: not formatted.
# fmt: off
RUN_BY: dict[str, str] = {
    r"^docs/generation\.md: (python -m tests\.fixtures\.build_models --only tinylm|"
    r"inferfleet (worker --name tokens |enqueue --name tokens ))":
        "tests/e2e/test_generation_doc.py::test_the_generation_page_runs_as_written",
    r"^README\.md: (\./scripts/setup|\. \.venv/bin/activate)$":
        _README + "test_the_readme_usage_block_runs_as_written",
    r"^README\.md: (rid=\$\(inferfleet enqueue --name ctr --input models/features\.npz\)$|"
    r"inferfleet (worker --name ctr(-onnx)? |enqueue --name ctr --input "
    r"models/features\.npz --wait$|"
    r"result|supervise|status|dead|swap|alerts|bench --spawn)|python -m "
    r"tests\.fixtures\.export_onnx)":
        _README + "test_the_readme_usage_block_runs_as_written",
    r"^README\.md: (rid=\$\()?inferfleet (worker --name (ctr|stack) |shadow|bench --name|limit|"
    r"enqueue --name (ctr|stack) "
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
    r"^docs/operations\.md: inferfleet alerts --name ctr$":
        "tests/integration/test_quality.py::test_alerts_command",
    r"^docs/operations\.md: inferfleet alerts --name ctr --kind non_finite --follow$":
        "tests/integration/test_quality.py::test_alerts_follow_prints_each_new_alert_of_its_kind",
    r"^docs/operations\.md: inferfleet limit --name ctr --(show|clear)":
        "tests/integration/test_sharing.py::test_limit_show_and_clear",
    r"^docs/operations\.md: (python -m tests\.fixtures\.build_models|"
    r"inferfleet worker --name stack --pipeline models/stack-split --stage [02]$)":
        "tests/e2e/test_pipeline.py::test_three_stages_answer_like_the_unsplit_model",
    r"^docs/operations\.md: (PYTHONPATH=\. )?inferfleet split ":
        "tests/e2e/test_pipeline.py::test_split_cli_prints_the_stages_and_refuses_bad_points",
    r"^docs/protocol\.md: (redis-cli (-x XADD .* id demo-1 |--no-raw BLPOP .*:reply:demo-1')|"
    r"printf '%s' 81a6\S+ .* \| xxd -r -p > body\.bin$|wc -c < body\.bin$)":
        "tests/e2e/test_raw_protocol.py::test_doc_worked_example_bytes",
    r"^docs/protocol\.md: (redis-cli .*'inferfleet:\{tokens\}:\S+'|"
    r"printf '%s' 82a6\S+ \| xxd -r -p > prompt\.bin$|wc -c < prompt\.bin$)":
        "tests/e2e/test_raw_protocol.py::test_streamed_reply_worked_example",
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
    r"^docs/reliability\.md: python -m benchmarks\.chaos (failover|switchover) --requests \d+$":
        _RELIABILITY
        + "test_a_primary_behind_sentinels_is_followed_and_what_it_loses_is_only_counted",
    r"^docs/reliability\.md: python -m benchmarks\.chaos (failover|switchover) --requests \d+ "
    r"--durable":
        _RELIABILITY + "test_with_durability_a_failover_loses_no_accepted_request",
    r"^docs/reliability\.md: python -m benchmarks\.chaos cluster ":
        _RELIABILITY + "test_a_cluster_master_killed_is_followed_by_the_fleet_and_the_producer",
    r"^docs/reliability\.md: python -m benchmarks\.chaos swap ":
        _RELIABILITY
        + "test_hot_swaps_while_workers_are_killed_lose_nothing_and_name_their_version",
    r"^docs/operations\.md: (pip install -e '\.\[worker,web\]'|inferfleet worker --name affine "
    r"--model models/affine\.pt$|gunicorn --preload |uvicorn --app-dir |curl -s (-X POST )?"
    r"localhost:800[01]/)":
        "tests/e2e/test_web_services.py::test_the_example_app_answers_every_request_with_its_own_output",
    r"^docs/(benchmarks\.md: |metrics\.md: python -m benchmarks\.bench_metrics )": _BENCHMARKS,
    r"^docs/security\.md: redis-server --port 0 --tls-port ":
        "tests/integration/test_security.py::test_tls_worker_and_producer_round_trip",
    r"^README\.md: \./scripts/test$":
        _README + "test_the_readme_test_command_runs_pytest_on_what_it_is_given",
    r"^README\.md: \./scripts/demo$":
        "tests/e2e/test_demo.py::test_the_demo_runs_as_written_answers_every_request_and_stops_what_it_started",
    r"^docs/deploy\.md: (docker compose (build|up -d|run --rm -e|stop|down)|curl -s "
    r"'http://127)":
        "tests/e2e/test_compose.py::test_build_up_bench_stop_up",
}
# fmt: on

#: "page: command" pattern -> why no test here runs it.
# fmt: off
EXEMPT: dict[str, str] = {
    r"^docs/operations\.md: inferfleet (worker|supervise|enqueue|status|dead list) --name ctr "
    r".*--cluster --shards 8":
        _CLUSTER,
    r"^docs/operations\.md: inferfleet worker --name stack --pipeline models/stack-split --stage 1 "
    r"--device cuda:1$":
        _GPU,
    r"^docs/deploy\.md: (docker build|docker compose (up --build|-f|exec supervisor|run --rm "
    r"producer bench)|(INFERFLEET_PUBLISH_\w+=\S+ )+docker compose up -d$|"
    r"curl -s localhost:9100)": _DOCKER,
    r"^docs/deploy\.md: docker compose exec redis redis-cli XPENDING ":
        "needs a Docker engine; tests/e2e/test_compose.py checks the same count (no entry "
        "pending after the drain) from the host, with redis-py's XINFO GROUPS",
    r"^docs/operations\.md: export OTEL_":
        "needs an OTLP collector at otel-collector:4318; tests/integration/test_tracing.py runs "
        "a worker that exports the same spans through the console exporter",
    r"^docs/deploy\.md: kubectl ": "needs a Kubernetes cluster; tests/unit/test_deploy.py "
                                   "validates the manifests against its schemas offline",
}
# fmt: on

#: (page, command, test) -> what the test does not use yet, for a test or page this change may not
#: edit: each entry a TODO.
NOT_YET_RUN: dict[tuple[str, str, str], tuple[str, ...]] = {}


def _covering(command: DocCommand, patterns: dict[str, str]) -> list[str]:
    return [p for p in patterns if re.search(p, f"{command.page}: {command.text}")]


def shell_commands() -> list[DocCommand]:
    """The commands to check: every one but the lines :data:`NOT_SHELL` names."""
    return [c for c in doc_commands() if not _covering(c, NOT_SHELL)]


# ---- the tests ----


def test_the_docs_have_commands_to_check() -> None:
    texts = [c.text for c in doc_commands()]
    assert "inferfleet shadow --name ctr --promote --force" in texts  # a fenced block
    assert "python -m benchmarks.chaos kill --requests 5000" in texts  # an indented block
    assert "pip install -e '.[onnx]'" in texts  # an inline span over two lines
    assert "rid=$(inferfleet enqueue --name ctr --input models/features.npz)" in texts
    assert "redis-cli XLEN 'inferfleet:{affine}:requests'" in texts  # a transcript's prompt
    assert '"workers"' not in " ".join(texts)  # ... and not the output under it
    assert len(shell_commands()) > 200


@pytest.mark.parametrize("command", shell_commands(), ids=str)
def test_each_command_names_what_exists(command: DocCommand) -> None:
    check(command.text, partial=not command.in_block)


@pytest.mark.parametrize(
    ("line", "argvs"),
    [
        (
            "rid=$(inferfleet enqueue --name q --input x.npz) && inferfleet result --name q $rid",
            [
                ["inferfleet", "result", "--name", "q", "$rid"],
                ["inferfleet", "enqueue", "--name", "q", "--input", "x.npz"],
            ],
        ),
        ("PYTHONPATH=. A=1 inferfleet status", [["inferfleet", "status"]]),
        ("OUT=x", []),
        ("for m in a b; do", []),
        (
            "inferfleet bench --model $m -n 3; done; done",
            [["inferfleet", "bench", "--model", "$m", "-n", "3"]],
        ),
        ("printf '%s' ab | xxd -r -p > body.bin", [["printf", "%s", "ab"], ["xxd", "-r", "-p"]]),
        (
            "redis-cli -x XADD k '*' id 1 body < body.bin",
            [["redis-cli", "-x", "XADD", "k", "*", "id", "1", "body"]],
        ),
        ("a 2>&1 | b", [["a"], ["b"]]),
        (
            'echo "$(python -m scripts.x "$(inferfleet status)")"',
            [
                ["echo", SUBSTITUTED],
                ["python", "-m", "scripts.x", SUBSTITUTED],
                ["inferfleet", "status"],
            ],
        ),
    ],
)
def test_a_line_is_cut_into_its_simple_commands(line: str, argvs: list[list[str]]) -> None:
    assert simple_commands(line) == argvs


@pytest.mark.parametrize(
    ("command", "says"),
    [
        ("inferfleet nope --name q", "has no command 'nope'"),
        ("inferfleet dead lists --name q", "inferfleet dead has no command 'lists'"),
        ("inferfleet worker --name q --model m.pt --batch-rows 4", "has no option --batch-rows"),
        ("inferfleet shadow --name q --promote --forced", "has no option --forced"),
        ("inferfleet supervise --name q --model m.pt --policy lagg", "'lagg' is not one of"),
        ("inferfleet worker --name q --model m.pt --max-batch-rows many", "is not a valid integer"),
        ("inferfleet worker --name q --model", "Option '--model' requires an argument"),
        ("inferfleet result --name q", "inferfleet result needs REQUEST_ID"),
        ("inferfleet status --name q extra", "inferfleet status takes no argument 'extra'"),
        ("docker compose exec supervisor inferfleet status --nmae ctr", "has no option --nmae"),
        ("docker compose run --rm producer bench --rat 1000", "bench has no option --rat"),
        ("docker compose up -d redis supervisr", "no service 'supervisr'"),
        (
            "python -m tests.fixtures.export_onnx --out models --int4",
            "unrecognized arguments: --int4",
        ),
        ("python -m benchmarks.bench_cpu --kind sdkk", "invalid choice: 'sdkk'"),
        ("python -m benchmarks.chaos kil --requests 1", "invalid choice: 'kil'"),
        ("python -m benchmarks.bench_autoscale replayy", "invalid choice: 'replayy'"),
        (
            "python -m benchmarks.bench_autoscale real --traces x",
            "unrecognized arguments: --traces",
        ),
        (
            "python -m benchmarks.bench_cpu --worker-arg=--max-batch-row=1",
            "has no option --max-batch-row",
        ),
        ("python -m benchmarks.bench_fleet --requests lots", "invalid int value: 'lots'"),
        ("bash benchmarks/gpu_bench.sh --devices cpu", "unrecognized arguments: --devices"),
        ("./scripts/demo --request 10", "unrecognized arguments: --request"),
        (
            "./scripts/test --no-such-pytest-option",
            "unrecognized arguments: --no-such-pytest-option",
        ),
        ("./scripts/test tests/unit/test_nope.py", "tests/unit/test_nope.py does not exist"),
        ("CI=true .ci/bare-machine --durationz=40", "unrecognized arguments: --durationz=40"),
        ("scripts/compose_env.sh now", "takes no arguments"),
        ("python scripts/nope.py", "does not exist"),
        ("python -m benchmarks.nope", "does not exist"),
        ("python -m http.server", "not a script of this repository"),
        ("./scripts/nope", "does not exist"),
        ("infrefleet status", "infrefleet: no such program here"),
        ("pip install 'inferfleet[otel]'", "not on PyPI"),
        ("pip install -e '.[otle]'", "no extra ['otle']"),
        ("kubectl apply -f deploy/k9s/", "does not exist"),
    ],
)
def test_a_misspelt_command_is_caught(command: str, says: str) -> None:
    with pytest.raises(AssertionError, match=re.escape(says)):
        check(command)


#: One unknown option planted in each form a page may show a command in, with its twin without it.
PLANTED = """\
# A page

    inferfleet worker --name q --model m.pt --batch-rowz 4

```bash
PYTHONPATH=. inferfleet split --model m:f --example x.npy --split-at b.3 --out o --nope
rid=$(inferfleet enqueue --name q --input x.npz --bogus)
docker compose run --rm producer bench --rate 10 --nope
python -m benchmarks.bench_cpu --kind sdk --requests 10 --nope
inferfleet supervise --name q --model m.pt --policy lagg
```

    $ OUT=x bash benchmarks/gpu_bench.sh --device cpu --nope
    some output
    $ for m in a b; do inferfleet bench --spawn 1 --model $m --nope; done

Inline, `A=1 inferfleet status --nope` too.
"""


def test_an_unknown_option_planted_in_each_form_fails_the_check(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PLANTED)
    planted = page_commands(page, "page.md")
    assert [c.line for c in planted] == [3, 6, 7, 8, 9, 10, 13, 15, 17]
    for command in planted:
        with pytest.raises(
            AssertionError,
            match=r"(no option |unrecognized arguments: )--[\w-]+|'lagg' is not one of",
        ):
            check(command.text)
    page.write_text(re.sub(r" --(batch-rowz 4|nope|bogus)", "", PLANTED).replace("lagg", "lag"))
    twins = page_commands(page, "page.md")
    assert len(twins) == len(planted)
    for command in twins:
        check(command.text)  # the same lines, less what was planted: they pass


def test_each_block_command_is_run_by_a_test_or_exempt_with_a_reason() -> None:
    uncovered = [
        str(c)
        for c in shell_commands()
        if c.in_block and not _covering(c, RUN_BY) + _covering(c, EXEMPT)
    ]
    assert uncovered == [], "add the test that runs each to RUN_BY, or a reason to EXEMPT"


def test_every_pattern_still_matches_a_command() -> None:
    block = [c for c in doc_commands() if c.in_block]
    stale = [
        p for p in [*RUN_BY, *EXEMPT, *NOT_SHELL] if not any(_covering(c, {p: ""}) for c in block)
    ]
    assert stale == []


def test_each_not_yet_run_entry_is_still_needed() -> None:
    """An entry goes once its test uses the word: the command is still shown, still mapped to
    that test, and the word still absent from its code."""
    commands = {(c.page, c.text) for c in shell_commands()}
    for (page, text, test_id), words in NOT_YET_RUN.items():
        assert (page, text) in commands, f"{page} no longer shows {text!r}"
        assert test_id in {RUN_BY[p] for p in _covering(DocCommand(page, 0, text, True), RUN_BY)}
        used = set(words) & words_of_test(test_id)
        assert not used, f"{test_id} uses {sorted(used)} now: drop them from the entry"


def _runs_the_page(test_id: str, page: str) -> bool:
    """The test reads the page and runs its lines as written."""
    return Path(page).name.lower() in words_of_test(test_id)


@pytest.mark.parametrize(
    "command", [c for c in shell_commands() if c.in_block and _covering(c, RUN_BY)], ids=str
)
def test_the_test_that_runs_a_command_uses_what_it_shows(command: DocCommand) -> None:
    """Its program, subcommands, options and choice values (not its queue names, paths and
    numbers: the test may use its own) are in the code of the test named to run it, unless that
    test runs the page's lines themselves."""
    for test_id in (RUN_BY[p] for p in _covering(command, RUN_BY)):
        if _runs_the_page(test_id, command.page):
            continue
        words = words_of_test(test_id)
        later = set(NOT_YET_RUN.get((command.page, command.text, test_id), ()))
        absent = [sorted(s) for s in shown_words(command.text) if not s & (words | later)]
        assert absent == [], f"{test_id} never uses {absent}"


def test_the_words_check_sees_a_test_that_runs_other_options() -> None:
    """The mismatch the check was built for: a supervise line shown with ``--devices auto
    --policy lag``, mapped to a test that runs ``--policy fixed --devices cpu`` only."""
    test_id = (
        "tests/integration/test_supervisor.py::test_a_second_signal_kills_the_draining_workers"
    )
    words = words_of_test(test_id)
    shown = shown_words("inferfleet supervise --name ctr --model m.pt --devices auto --policy lag")
    absent = [sorted(s) for s in shown if not s & words]
    assert absent == [["auto"], ["lag"]]


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
    assert all(len(reason.split()) >= 4 for reason in [*EXEMPT.values(), *NOT_SHELL.values()])
