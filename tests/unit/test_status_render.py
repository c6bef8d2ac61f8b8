"""``inferfleet status`` drawn from a QueueStatus: the candidate table and each worker's candidate
column."""

from __future__ import annotations

import json
from dataclasses import asdict

from rich.console import Console

from inferfleet.worker.cli.status import QueueStatus, render
from inferfleet.worker.heartbeat import HeartbeatInfo

CANDIDATE = {
    "model": "tests.handlers:Triple",
    "version": "triple-1",
    "state": "canary",
    "sample": 0.25,
    "canary_percent": 10.0,
    "reason": "",
    "loaded": 1,
    "failed": 1,
    "workers": 2,
}


def _worker(consumer: str, shadow: str, shadow_error: str = "") -> HeartbeatInfo:
    return HeartbeatInfo(
        consumer,
        1,
        "host",
        "cpu",
        "scale-1",
        "serving",
        0,
        0,
        0,
        0.0,
        0.0,
        0,
        0,
        shadow=shadow,
        shadow_error=shadow_error,
    )


def _text(status: QueueStatus) -> list[str]:
    console = Console(width=400, record=True, color_system=None)
    console.print(render(status))
    return [line.rstrip() for line in console.export_text().splitlines()]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("┃│").split("┃" if "┃" in line else "│")]


def test_a_heartbeat_carries_the_workers_copy_of_the_candidate() -> None:
    info = HeartbeatInfo.from_hash(
        {b"consumer": b"w1", b"shadow": b"triple-1 failed", b"shadow_error": b"NOPERM"}
    )
    assert (info.shadow, info.shadow_error) == ("triple-1 failed", "NOPERM")
    assert HeartbeatInfo.from_hash({b"consumer": b"w0"}).shadow == ""  # a worker without the field


def test_the_candidate_gets_a_table_and_each_worker_a_candidate_column() -> None:
    status = QueueStatus(
        "q",
        candidate=CANDIDATE,
        workers=[_worker("w0", "triple-1 loaded"), _worker("w1", "triple-1 failed", "no room")],
    )
    lines = _text(status)
    title = lines.index("candidate")
    header, row = _cells(lines[title + 2]), _cells(lines[title + 4])
    assert header == ["model", "version", "state", "sample", "canary", "loaded", "failed"]
    assert row == ["tests.handlers:Triple", "triple-1", "canary", "0.25", "10%", "1 of 2", "1"]
    title = lines.index("workers")
    header = _cells(lines[title + 2])
    assert header[4:7] == ["version", "candidate", "state"]
    rows = {cells[0]: cells for cells in map(_cells, lines[title + 4 : title + 6])}
    assert rows["w0"][5] == "triple-1 loaded" and rows["w0"][6] == "serving"
    assert rows["w1"][5] == "triple-1 failed (no room)"


def test_without_a_candidate_there_is_no_candidate_table() -> None:
    lines = _text(QueueStatus("q", workers=[_worker("w0", "")]))
    assert "candidate" not in lines
    title = lines.index("workers")
    assert _cells(lines[title + 4])[5] == "-"


def test_json_gives_the_candidate_and_each_workers_shadow_fields() -> None:
    status = QueueStatus(
        "q", candidate=CANDIDATE, workers=[_worker("w1", "triple-1 failed", "no room")]
    )
    parsed = json.loads(json.dumps(asdict(status), default=str))
    assert parsed["candidate"] == CANDIDATE
    assert (parsed["workers"][0]["shadow"], parsed["workers"][0]["shadow_error"]) == (
        "triple-1 failed",
        "no room",
    )


def test_errors_and_reasons_show_literally_even_with_brackets() -> None:
    """Exception texts carry brackets (``[Errno 2]``, tensor shapes); rich must not read them as
    markup."""
    worker = _worker("w1", "triple-1 failed", "[Errno 2] no such file [/red] x[1, 4]")
    worker.swap_error = "version v9: [bold]Missing[/bold]"
    status = QueueStatus(
        "q", candidate={**CANDIDATE, "reason": "rolled back: [red]NaN[/red]"}, workers=[worker]
    )
    text = "\n".join(_text(status))
    assert "failed ([Errno 2] no such file [/red] x[1, 4])" in text
    assert "swap failed: version v9: [bold]Missing[/bold]" in text
    assert "canary (rolled back: [red]NaN[/red])" in text
