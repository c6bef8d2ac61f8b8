"""The JSON log formatter and the context filter: one valid JSON object per record, with the ids."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from datetime import datetime
from types import SimpleNamespace

import pytest

from inferfleet.worker import logs
from inferfleet.worker.errors import ConfigError


@pytest.fixture
def capture(monkeypatch) -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A private logger whose handler is set up as setup_logging's is (json)."""
    monkeypatch.setattr(logs, "_process_fields", {})
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(logs.ContextFilter())
    handler.setFormatter(logs.JsonLogFormatter())
    logger = logging.getLogger("test.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, out
    logger.removeHandler(handler)


def lines(out: io.StringIO) -> list[dict]:
    text = out.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_a_record_is_one_json_line_with_the_basic_fields(capture):
    logger, out = capture
    logger.info("served %d requests\nin two lines", 3)
    (record,) = lines(out)
    assert record["message"] == "served 3 requests\nin two lines"
    assert record["level"] == "INFO"
    assert record["logger"] == "test.logs"
    assert isinstance(record["process"], int)
    assert datetime.fromisoformat(record["time"]).utcoffset() is not None  # ISO 8601 with a zone
    assert "exception" not in record


def test_exception_text_is_carried(capture):
    logger, out = capture
    try:
        raise ValueError("bad row")
    except ValueError:
        logger.exception("request failed")
    (record,) = lines(out)
    assert record["level"] == "ERROR"
    assert "Traceback" in record["exception"] and "ValueError: bad row" in record["exception"]


def test_process_fields_and_batch_context_are_added(capture):
    logger, out = capture
    logs.bind(consumer="ctr-s0")
    requests = [SimpleNamespace(rid="r-1"), SimpleNamespace(rid="r-2")]
    with logs.batch_context(17, requests):
        logger.debug("batch of %d", 2)
    logger.info("after the batch")
    inside, after = lines(out)
    assert inside["consumer"] == "ctr-s0"
    assert inside["batch"] == 17
    assert inside["request_ids"] == ["r-1", "r-2"]
    assert after["consumer"] == "ctr-s0"
    assert "batch" not in after and "request_ids" not in after


def test_extra_fields_win_over_the_context(capture):
    logger, out = capture
    with logs.batch_context(1, ["a", "b"]):
        logger.info("one request", extra={"request_ids": ["b"]})
    (record,) = lines(out)
    assert record["request_ids"] == ["b"]
    assert record["batch"] == 1


def test_the_batch_context_is_restored_when_nested(capture):
    logger, out = capture
    with logs.batch_context(1, ["a"]):
        with logs.batch_context(2, ["b"]):
            pass
        logger.info("outer")
    (record,) = lines(out)
    assert record["batch"] == 1 and record["request_ids"] == ["a"]


def test_text_format_is_unchanged_by_the_context(monkeypatch):
    monkeypatch.setattr(logs, "_process_fields", {})
    logs.bind(consumer="c")
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello %s", ("w",), None)
    logs.ContextFilter().filter(record)
    text = logging.Formatter(logs.TEXT_FORMAT).format(record)
    assert text.endswith(f"INFO x [{record.process}] hello w")


def test_an_unknown_format_is_refused():
    with pytest.raises(ConfigError, match="text, json"):
        logs.setup_logging("info", "xml")
