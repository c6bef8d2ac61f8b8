"""Producer-controlled text reaches log lines in bounded size (a 2 MB id is not a 2 MB line)."""

from __future__ import annotations

import io
import logging

import pytest

from inferfleet.producer.protocol import Limits, QueueKeys, encode_body, shown
from inferfleet.worker.logs import MAX_MESSAGE_CHARS, ContextFilter, JsonLogFormatter, clip
from inferfleet.worker.serving.intake import Answer, Intake

BOUND = 1024  # what one line about one entry may take, whatever the entry holds


@pytest.mark.parametrize(
    "rid",
    [b"x" * (2 << 20), b"\xff" * (1 << 20), b"\n" * (1 << 20)],
    ids=["2MB-ascii", "1MB-0xFF", "1MB-newlines"],
)
def test_an_unreadable_id_is_logged_in_bounded_size(rid, caplog):
    caplog.set_level(logging.WARNING, logger="inferfleet.worker.serving.intake")
    import numpy as np

    entry = {b"id": rid, b"body": encode_body(np.ones((1, 4), np.float32))}
    answer = Intake(QueueKeys("q"), Limits(), ("q", "v1")).admit(b"1-1", entry, 0.0)
    assert (
        isinstance(answer, Answer) and answer.reply_key is None
    )  # no readable id: acknowledged, not answered
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(len(line) < BOUND for line in lines)
    assert "long)" in lines[0]  # it says how long the id was


def test_shown_keeps_short_values_and_cuts_long_ones():
    assert shown("abc") == "'abc'"
    assert shown(b"\xff" * 1000) == repr(b"\xff" * 64) + "... (1000 long)"
    assert len(shown(list(range(10_000)))) < 1000


def test_shown_cuts_past_the_limit_and_any_other_repr_past_four_times_it():
    # pinned by the mutation run (issue 35): both bounds, exactly
    assert shown("x" * 64) == repr("x" * 64)
    assert shown("x" * 65) == repr("x" * 64) + "... (65 long)"
    exact = {"k": "v" * (256 - len(repr({"k": ""})))}  # a repr of 4 x 64 characters: whole
    assert shown(exact) == repr(exact)
    longer = {"k": "v" * 300}
    text = repr(longer)
    assert shown(longer) == f"{text[:256]}... ({len(text)} characters)"


def test_clip_says_how_much_it_cut():
    assert clip("short") == "short"
    assert clip("x" * 300, 10) == "x" * 10 + "... [290 more characters]"


def test_every_emitted_message_is_bounded_whatever_the_call_site():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonLogFormatter())
    logger = logging.getLogger("tests.log_bounds")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("request body: %s", "y" * (2 << 20))
    finally:
        logger.removeHandler(handler)
    assert MAX_MESSAGE_CHARS < len(stream.getvalue()) < MAX_MESSAGE_CHARS + 1024
    assert "more characters]" in stream.getvalue()
