"""The CI switch (tests/ci.py): CI set to anything but empty, 0 or false."""

from __future__ import annotations

import pytest

from tests.ci import in_ci


@pytest.mark.parametrize("value", ["true", "1", "yes", "TRUE", "True", "on", "github"])
def test_any_other_non_empty_value_means_ci(value: str) -> None:
    assert in_ci({"CI": value})


@pytest.mark.parametrize("environ", [{}, {"CI": ""}, {"CI": "0"}, {"CI": "false"}, {"CI": "FALSE"}, {"CI": " "}])
def test_unset_empty_0_and_false_mean_a_developer_machine(environ: dict[str, str]) -> None:
    assert not in_ci(environ)
