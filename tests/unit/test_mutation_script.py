"""benchmarks/mutation.py without mutmut: the config it writes, how it names and scores mutants,
and the errors it gives on bad input (the run itself is by hand: docs/benchmarks.md)."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import mutation
from benchmarks.mutation import TARGETS, Mutant, mutmut_table, scores, survivors_text
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


LINE = "return configured if fits is None else max(2, min(configured, fits))"
ORIGINAL = "return configured if fits is None else max(1, min(configured, fits))"
NAME = "inferfleet.worker.serving.rowlimit.x_ceiling__mutmut_{}"


def test_a_known_survivor_is_matched_on_its_lines_not_its_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mutation, "EQUIVALENT", (("rowlimit", "ceiling", LINE, "why"),))
    survived = [Mutant(NAME.format(n), "rowlimit", "survived", DIFF) for n in (2, 9)]
    assert [(m.original, m.changed) for m in survived] == [(ORIGINAL, LINE)] * 2
    assert [m.verdict() for m in survived] == ["equivalent: why"] * 2
    assert Mutant(NAME.format(3), "batching", "survived", DIFF).verdict() is None
    assert Mutant(NAME.format(3), "rowlimit", "killed", DIFF).verdict() is None
    monkeypatch.setattr(mutation, "EQUIVALENT", ())
    monkeypatch.setattr(mutation, "WORDING", (("rowlimit", "ceiling", ORIGINAL),))
    assert survived[0].verdict() == "wording"  # any mutant of that line


def test_scores_count_timeouts_as_killed_and_known_survivors_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    other = DIFF.replace("max(1", "max(0").replace("max(2", "max(3")
    monkeypatch.setattr(mutation, "EQUIVALENT", (("rowlimit", "ceiling", LINE, "why"),))
    monkeypatch.setattr(mutation, "WORDING", (("rowlimit", "ceiling", "return 0"),))
    mutants = [
        Mutant(NAME.format(1), "rowlimit", "killed", ""),
        Mutant(NAME.format(2), "rowlimit", "timeout", ""),
        Mutant(NAME.format(3), "rowlimit", "survived", DIFF),  # equivalent
        Mutant(
            NAME.format(4),
            "rowlimit",
            "survived",
            DIFF.replace(ORIGINAL, "return 0").replace(LINE, "return 1"),
        ),
        Mutant(NAME.format(5), "rowlimit", "no tests", other),
    ]
    table = scores(mutants, ["rowlimit"])
    assert table["rowlimit"] == table["all"]
    assert table["rowlimit"] == {
        "mutants": 5,
        "killed": 2,
        "equivalent": 1,
        "wording": 1,
        "survived": 1,
        "score": 0.4,
        "score_without_equivalent": 0.5,
    }
    text = survivors_text(mutants, known_diffs=False)
    assert "x_ceiling__mutmut_3 (rowlimit.ceiling): equivalent: why\n" in text
    assert "x_ceiling__mutmut_4 (rowlimit.ceiling): wording\n" in text
    assert "mutmut_5 (rowlimit.ceiling): no tests (new: not in EQUIVALENT or WORDING)" in text
    assert text.count("+++ ") == 1  # the new survivor's diff alone


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
