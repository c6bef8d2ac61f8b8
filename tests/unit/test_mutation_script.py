"""benchmarks/mutation.py without mutmut: the config it writes, how it names and scores mutants,
and the errors it gives on bad input (the run itself is by hand: docs/benchmarks.md)."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import mutation
from benchmarks.mutation import TARGETS, Mutant, mutmut_table, scores
from tests.conftest import ROOT

DIFF = """--- inferfleet/worker/serving/rowlimit.py
+++ inferfleet/worker/serving/rowlimit.py
@@ -1,3 +1,3 @@
 def ceiling(configured, fits):
-    return configured if fits is None else max(1, min(configured, fits))
+    return configured if fits is None else max(2, min(configured, fits))"""


def test_every_target_and_its_tests_exist() -> None:
    for target in TARGETS.values():
        assert (ROOT / target.source).is_file()
        assert target.staged == f"inferfleet/{target.source}"
        assert all((ROOT / test).is_file() for test in target.tests)


def test_the_table_names_the_staged_modules_and_the_union_of_their_tests() -> None:
    chosen = [TARGETS["rowlimit"], TARGETS["scaling"], TARGETS["scaling_load"]]
    text = mutmut_table(chosen)
    assert "\n[tool.mutmut]\n" in text
    # each value a JSON list or string, which TOML reads the same (no tomllib on Python 3.10)
    table = {
        key: json.loads(value)
        for key, _, value in (line.partition(" = ") for line in text.splitlines())
        if value
    }
    assert table["source_paths"] == ["inferfleet"]
    assert table["only_mutate"] == [
        "inferfleet/worker/serving/rowlimit.py",
        "inferfleet/worker/fleet/scaling.py",
        "inferfleet/worker/fleet/scaling_load.py",
    ]
    assert table["pytest_add_cli_args_test_selection"] == [
        "tests/unit/test_rowlimit.py",
        "tests/unit/test_scaling.py",
        "tests/unit/test_scaling_target.py",
        "tests/unit/test_sharing.py",
    ]


def test_a_mutant_is_named_after_its_function_or_method() -> None:
    function = Mutant("inferfleet.worker.serving.rowlimit.x_ceiling__mutmut_2", "rowlimit", "", "")
    method = Mutant(
        "inferfleet.worker.serving.rowlimit.x\u01c1RowLimit\u01c1out_of_memory__mutmut_7",
        "rowlimit",
        "",
        "",
    )
    assert function.function == "ceiling"
    assert method.function == "RowLimit.out_of_memory"


def test_an_equivalent_mutant_is_matched_on_its_line_not_its_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = "inferfleet.worker.serving.rowlimit.x_ceiling__mutmut_{}"
    line = "return configured if fits is None else max(2, min(configured, fits))"
    monkeypatch.setattr(mutation, "EQUIVALENT", (("rowlimit", "ceiling", line, "why"),))
    survived = [Mutant(name.format(n), "rowlimit", "survived", DIFF) for n in (2, 9)]
    assert [m.changed for m in survived] == [line, line]
    assert [m.equivalent() for m in survived] == ["why", "why"]
    other = Mutant(name.format(3), "batching", "survived", DIFF)
    assert other.equivalent() is None


def test_scores_count_timeouts_as_killed_and_equivalents_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    line = "return configured if fits is None else max(2, min(configured, fits))"
    monkeypatch.setattr(mutation, "EQUIVALENT", (("rowlimit", "ceiling", line, "why"),))
    name = "inferfleet.worker.serving.rowlimit.x_ceiling__mutmut_{}"
    mutants = [
        Mutant(name.format(1), "rowlimit", "killed", ""),
        Mutant(name.format(2), "rowlimit", "timeout", ""),
        Mutant(name.format(3), "rowlimit", "survived", DIFF),  # equivalent
        Mutant(name.format(4), "rowlimit", "no tests", DIFF.replace("max(2", "max(3")),
    ]
    table = scores(mutants, ["rowlimit"])
    assert table["rowlimit"] == table["all"]
    assert table["rowlimit"] == {
        "mutants": 4,
        "killed": 2,
        "survived": 1,
        "equivalent": 1,
        "score": 0.5,
        "score_without_equivalent": 0.6667,
    }


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--jobs", "0"], "--jobs must be at least 1"),
        (["--modules", "nope"], "invalid choice: 'nope'"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    monkeypatch.setattr(sys, "argv", ["mutation", *argv])
    with pytest.raises(SystemExit) as exc:
        mutation.main()
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
