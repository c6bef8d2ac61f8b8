"""How many small changes to the core rules the unit tests catch: a mutation run (issue 35).

mutmut 3 (``pip install -e '.[mutation]'``) changes the modules of :data:`TARGETS` one small
edit at a time (an operator, a comparison, a number, a string, a returned value, a dropped
argument), and for each such *mutant* runs the unit tests that reach the changed function. A
mutant that fails a test is killed; one that passes every test *survives*: either the tests lack
an assertion, or the change changes nothing (an *equivalent* mutant), or only the words of a
message. :data:`EQUIVALENT` and :data:`WORDING` name those read so far, with why; any other
survivor is new, and worth a look.

The run works on a copy, never on the checkout: mutmut names a mutant after its file's path,
and the tests import ``inferfleet.producer...`` where the checkout has ``producer/...``, so the
copy is laid out as the wheel installs it (``inferfleet/producer/``, ``inferfleet/worker/``,
beside ``tests/`` and ``docs/``), in ``OUT/work/``, its pyproject.toml given the
``[tool.mutmut]`` table this script writes (the modules to mutate and the test files to run).
Each run starts from a fresh copy.

    python -m benchmarks.mutation --jobs 2
    python -m benchmarks.mutation --modules rowlimit durability --jobs 1

Prints the score of each module (killed / mutants; a timeout counts as killed) and the diff of
every surviving mutant, and writes them to ``--out``: ``summary.json``, ``survivors.diff``, and
mutmut's own output in ``mutmut.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_WIRE_TESTS = (
    "tests/unit/test_protocol_codec.py",
    "tests/unit/test_protocol_envelope.py",
    "tests/unit/test_protocol_fast_paths.py",
    "tests/unit/test_rule_paths.py",
    "tests/unit/test_sharding.py",
    # the worker's admission and the lanes and tenants apply the rules; log lines bound them
    "tests/unit/test_intake.py",
    "tests/unit/test_sharing.py",
    "tests/unit/test_log_bounds.py",
)


@dataclass(frozen=True)
class Target:
    """A module to mutate (its file in the checkout) and the unit tests that pin it.

    One run runs the tests of every module chosen: for each mutant, mutmut picks those of them
    that reached the mutated function when run on the unchanged code.
    """

    source: str
    tests: tuple[str, ...]

    @property
    def staged(self) -> str:
        """The file's path in the copy laid out as the wheel: ``inferfleet/producer/...``."""
        return f"inferfleet/{self.source}"


#: The modules mutated, by the short name ``--modules`` takes: pure ones, tested in
#: microseconds, that hold the rules everything else relies on.
TARGETS: dict[str, Target] = {
    # the wire format: names, ids, deadlines and tenants; keys and shards; the codec; the
    # request envelope; the reply
    "rules": Target("producer/protocol/rules.py", _WIRE_TESTS),
    "names": Target("producer/protocol/names.py", _WIRE_TESTS),
    "codec": Target("producer/protocol/codec.py", _WIRE_TESTS),
    "request": Target("producer/protocol/request.py", _WIRE_TESTS),
    "reply": Target("producer/protocol/reply.py", _WIRE_TESTS),
    # what counts as accepted with durability on
    "durability": Target("producer/durability.py", ("tests/unit/test_durability_rule.py",)),
    # the scaling policy ("lag", "article", "fixed") and the load every policy reads
    "scaling": Target(
        "worker/fleet/scaling.py", ("tests/unit/test_scaling.py", "tests/unit/test_sharing.py")
    ),
    "scaling_load": Target(
        "worker/fleet/scaling_load.py",
        ("tests/unit/test_scaling.py", "tests/unit/test_scaling_target.py"),
    ),
    # batching, and the row limit out-of-memory errors teach
    "batching": Target("worker/serving/batching.py", ("tests/unit/test_batching.py",)),
    "rowlimit": Target("worker/serving/rowlimit.py", ("tests/unit/test_rowlimit.py",)),
}

_CASE = "a codec's name is case-insensitive"
_FALLS_BACK = "the one-match fast path is skipped, and the check of each id gives the same list"
_ONE_DASH = "a stream entry id has exactly one '-'"
_MSGPACK = "msgpack's own default since 1.0 (pyproject.toml: msgpack>=1.0.5)"
_FLAG = "the value is only read as true or false"
_NO_WORKER = (
    "a smaller fleet of none is weighed only when the peak needs no worker at all (under a "
    "billionth of one's capacity), so busy is never read there"
)

#: Surviving mutants that change nothing a caller can see: (module, function, the mutated
#: line as the diff shows it after ``+``, or ``(dropped) LINE`` for a line taken out; why).
#: Matched on the line rather than on mutmut's number, which shifts whenever the function
#: changes.
EQUIVALENT: tuple[tuple[str, str, str, str], ...] = (
    ("rules", "decode_reply_to", 'return raw.decode("ASCII")  # type: ignore[attr-defined]', _CASE),
    ("rules", "validate_request_id", 'return raw.decode("ASCII")', _CASE),
    ("rules", "validate_request_ids", "if set(map(type, rids)) < {str}:", _FALLS_BACK),
    (
        "rules",
        "validate_request_ids",
        'joined = "XX\\nXX".join([*rids, ""])  # type: ignore[list-item]',
        _FALLS_BACK,
    ),
    (
        "rules",
        "validate_request_ids",
        'joined = "\\n".join([*rids, "XXXX"])  # type: ignore[list-item]',
        _FALLS_BACK,
    ),
    (
        "rules",
        "validate_request_ids",
        'if joined.count("XX\\nXX") == len(rids) and _JOINED_RIDS_STR_RE.match(joined):',
        _FALLS_BACK,
    ),
    ("names", "entry_time_ms", 'return int(text.split("-", )[0])', _ONE_DASH),
    ("names", "entry_time_ms", 'return int(text.rsplit("-", 1)[0])', _ONE_DASH),
    ("names", "entry_time_ms", 'return int(text.split("-", 2)[0])', _ONE_DASH),
    (
        "names",
        "shard_for",
        'return zlib.crc32(request_id.encode("UTF-8")) % _check_shards(shards)',
        _CASE,
    ),
    (
        "codec",
        "encode_inputs",
        "bytes(inputs) if (isinstance(inputs, bytearray)) and False else inputs",
        "msgpack packs a bytearray as the same bin as its bytes",
    ),
    (
        "codec",
        "encode_tensor",
        'data = memoryview(arr).cast("b") if arr.size else b""  # type: ignore[arg-type]',
        "msgpack packs any contiguous buffer as the same bin, whatever its item format",
    ),
    ("codec", "pack", "return msgpack.packb(obj, )", f"use_bin_type=True is {_MSGPACK}"),
    ("codec", "unpack", "raw=None,", _FLAG),
    ("codec", "unpack", "(dropped) raw=False,", f"raw=False is {_MSGPACK}"),
    ("codec", "unpack", "(dropped) strict_map_key=True,", f"strict_map_key=True is {_MSGPACK}"),
    (
        "codec",
        "unpack",
        "(dropped) max_bin_len=limits.max_body_bytes,",
        "the default bound is the body's own length, already checked against max_body_bytes",
    ),
    (
        "codec",
        "unpack",
        "max_ext_len=1,",
        "the ext_hook refuses every extension type, whatever its length",
    ),
    (
        "request",
        "_parse_reply_to",
        'return "XX\\x00XX" if key is None else key  # never an inbox key: the worker refuses it',
        "any key that is no inbox does: the worker refuses it, and its message does not echo it",
    ),
    *(
        (
            "durability",
            "confirmed",
            "seen = min((int(reply) for reply in told if not isinstance(reply, Exception)), "
            f"default={default})",
            "the default is read only when every WAIT failed, and then the failure is raised",
        )
        for default in ("None", "1")
    ),
    (
        "scaling",
        "_article_policy",
        "return finish(obs, settings, state, obs.workers, reason, decided=None)",
        _FLAG,
    ),
    (
        "scaling",
        "_busy_fraction",
        "return 0.0 if (arrivals_rps <= 0) or True else math.inf",
        _NO_WORKER,
    ),
    ("scaling", "_busy_fraction", "return 0.0 if arrivals_rps <= 1 else math.inf", _NO_WORKER),
    (
        "scaling",
        "_desired",
        "return clamp(max(for_arrivals, for_backlog), settings)",
        "clamp raises the count to min_workers anyway",
    ),
    (
        "scaling_load",
        "_growth_rps",
        "if backlog is None or state.last_backlog is None or not 0 < elapsed_s <= math.inf:",
        "a growth over an infinite gap is 0.0, what the guard returns",
    ),
    (
        "scaling_load",
        "ceil_div",
        "if not ratio <= _HUGE_WORKERS:",
        "at exactly the cap, ceil gives the cap as well",
    ),
    (
        "batching",
        "collect",
        "lingered = deadline - max_wait_s - started >= linger_s",
        "differs only when the first read took exactly linger_s, to the last bit of a float",
    ),
    ("batching", "collect", "lingered = None", _FLAG),
    (
        "batching",
        "signature_of",
        "return (spec if (spec is not None) and False else spec_of(inputs), repr(params) if "
        'params else "")',
        "computes the spec it was handed again, the same",
    ),
    *(
        (
            "batching",
            "signature_of",
            f"return (spec if spec is not None else spec_of(inputs), repr(params) if {when} else "
            f'"{empty}")',
            "another mark for no params, the same for every request: every path signs them "
            "with signature_of, and decode_body makes absent params {}",
        )
        for when, empty in (("(params) or True", ""), ("params", "XXXX"))
    ),
)

#: Lines of prose, whose surviving mutants change only the words of an error message or of a
#: scaling decision's reason: (module, function, the line as the source has it, minus ``-``).
#: Left on purpose: the tests pin what an error is (its type, its code, the facts a caller
#: reads in it, the messages docs/protocol.md shows), not the rest of its prose.
WORDING: tuple[tuple[str, str, str], ...] = (
    (
        "rules",
        "parse_deadline",
        'raise ProtocolError(f"deadline must be decimal unix epoch milliseconds, got '
        '{raw[:32]!r}")',
    ),
    ("codec", "encode_inputs", 'raise ProtocolError("inputs map is empty")'),
    ("codec", "encode_inputs", 'raise ProtocolError("inputs list is empty")'),
    (
        "codec",
        "encode_tensor",
        "raise ProtocolError(f\"unsupported dtype {arr.dtype}: use one of {', '.join(DTYPES)}\")",
    ),
    (
        "codec",
        "encode_tensor",
        'raise ProtocolError("a tensor needs at least one dimension: shape[0] is the row count")',
    ),
    (
        "request",
        "decode_body",
        "raise ProtocolError(\"body must be a map with 'inputs' and optionally 'params'\")",
    ),
    ("request", "parse_entry", "raise ProtocolError(\"entry has no 'id' field\")"),
    ("request", "parse_entry", "raise ProtocolError(\"entry has no 'body' field\")"),
    (
        "reply",
        "encode_reply_error",
        "raise ValueError(f\"unknown error code {code!r}: use one of {', '.join(ERROR_CODES)}\")",
    ),
    (
        "durability",
        "not_replicated",
        '"it, and it may still be computed. Send it again (a new id) if you still need it; the "',
    ),
    (
        "durability",
        "not_replicated",
        '"next call reconnects (docs/reliability.md, section Durability)"',
    ),
)

#: mutmut's statuses that count as killed.
_KILLED = {"killed", "timeout", "caught by type check", "segfault"}


# --------------------------------------------------------------------------- the copy


def _ignored(_folder: str, names: list[str]) -> set[str]:
    return {n for n in names if n in ("__pycache__", ".hypothesis", ".pytest_cache")}


def mutmut_table(targets: list[Target]) -> str:
    """The ``[tool.mutmut]`` table of the copy's pyproject.toml."""
    tests = sorted({test for target in targets for test in target.tests})
    return "\n".join(
        [
            "",
            "# written by benchmarks/mutation.py for this copy only",
            "[tool.mutmut]",
            'source_paths = ["inferfleet"]',
            # a test may read a page (test_sharding: the shard table of docs/protocol.md)
            'also_copy = ["docs"]',
            f"only_mutate = {json.dumps([t.staged for t in targets])}",
            f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
            # the same examples every run, so that two runs score the same mutants alike
            'pytest_add_cli_args = ["--hypothesis-seed=0", "-p", "no:cacheprovider"]',
            "",
        ]
    )


def stage(work: Path, targets: list[Target]) -> None:
    """A fresh copy of the package, laid out as the wheel, with the tests and the config."""
    if work.exists():
        shutil.rmtree(work)
    package = work / "inferfleet"
    shutil.copytree(ROOT / "inferfleet", package, ignore=_ignored)
    for side in ("producer", "worker"):
        shutil.copytree(ROOT / side, package / side, ignore=_ignored)
    for folder in ("tests", "docs"):
        shutil.copytree(ROOT / folder, work / folder, ignore=_ignored)
    pyproject = (ROOT / "pyproject.toml").read_text()
    if "[tool.mutmut]" in pyproject:
        raise SystemExit(
            "pyproject.toml has a [tool.mutmut] table: this script writes its own into the copy"
        )
    (work / "pyproject.toml").write_text(pyproject + mutmut_table(targets))


# --------------------------------------------------------------------------- the run


def run_mutmut(work: Path, jobs: int, log: Path) -> tuple[float, float]:
    """``mutmut run`` in the copy, its output to ``log``: (wall s, CPU s of it and its children)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MUTANT_UNDER_TEST", "REDIS_URL")}
    # mutmut forks a child a mutant from a process that imported torch: one thread each
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs)],
            cwd=work,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"mutmut run failed (exit {done.returncode}); the end of {log}:\n{tail}")
    return wall, cpu


@contextlib.contextmanager
def _inside(folder: Path) -> Iterator[None]:
    """In ``folder``: mutmut reads its files (``mutants/...``) relative to the working dir."""
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


@dataclass(frozen=True)
class Mutant:
    name: str
    module: str
    status: str
    diff: str

    @property
    def function(self) -> str:
        """The mutated function as the source names it: ``shown``, ``RowLimit.out_of_memory``."""
        mangled = self.name.rpartition(".")[2].partition("__mutmut_")[0]
        if mangled.startswith("x_"):
            return mangled[2:]
        return ".".join(part for part in mangled[1:].split("\u01c1") if part)

    def _lines(self, sign: str) -> str:
        return "\n".join(
            line[1:].strip()
            for line in self.diff.splitlines()
            if line.startswith(sign) and not line.startswith(sign * 3)
        )

    @property
    def changed(self) -> str:
        """The mutated line(s), as the diff shows them after ``+``."""
        return self._lines("+")

    @property
    def original(self) -> str:
        """The line(s) the mutant changed, as the diff shows them after ``-``."""
        return self._lines("-")

    @property
    def mutation(self) -> str:
        """What :data:`EQUIVALENT` matches: the mutated line, or ``(dropped) LINE``."""
        return self.changed or f"(dropped) {self.original}"

    def verdict(self) -> str | None:
        """``equivalent: why`` or ``wording`` for a survivor the tables name; None otherwise."""
        if self.status in _KILLED:
            return None
        where = (self.module, self.function)
        for module, function, changed, why in EQUIVALENT:
            if (module, function) == where and changed == self.mutation:
                return f"equivalent: {why}"
        if any((m, f) == where and line == self.original for m, f, line in WORDING):
            return "wording"
        return None


def read_results(work: Path, chosen: dict[str, Target]) -> list[Mutant]:
    """Every mutant of the chosen modules, with its status and, if it was not killed, its diff."""
    with _inside(work):
        from mutmut.mutation.diff_apply import get_diff_for_mutant
        from mutmut.stats import status_by_exit_code

        found = []
        for module, target in chosen.items():
            meta = Path("mutants") / f"{target.staged}.meta"
            if not meta.is_file():
                raise SystemExit(f"mutmut left no results for {target.source} ({meta})")
            codes = json.loads(meta.read_text())["exit_code_by_key"]
            for name, code in sorted(codes.items(), key=lambda kv: _numbered(kv[0])):
                status = status_by_exit_code[code]
                diff = "" if status in _KILLED else get_diff_for_mutant(name, path=target.staged)
                found.append(Mutant(name, module, status, diff))
    return found


def _numbered(name: str) -> tuple[str, int]:
    function, _, number = name.rpartition("__mutmut_")
    return function, int(number) if number.isdigit() else 0


# --------------------------------------------------------------------------- the report


def scores(mutants: list[Mutant], modules: list[str]) -> dict[str, dict[str, float | int]]:
    """Per module: mutants, killed, equivalent, wording, survived (the rest), and the score
    (killed / mutants), and the score without the equivalent mutants, which no test can kill."""
    table: dict[str, dict[str, float | int]] = {}
    for module in [*modules, "all"]:
        mine = [m for m in mutants if module in ("all", m.module)]
        verdicts = [(m.verdict() or "").partition(":")[0] for m in mine]
        killed = sum(m.status in _KILLED for m in mine)
        equivalent, wording = verdicts.count("equivalent"), verdicts.count("wording")
        killable = len(mine) - equivalent
        table[module] = {
            "mutants": len(mine),
            "killed": killed,
            "equivalent": equivalent,
            "wording": wording,
            "survived": len(mine) - killed - equivalent - wording,
            "score": round(killed / len(mine), 4) if mine else 0.0,
            "score_without_equivalent": round(killed / killable, 4) if killable else 0.0,
        }
    return table


def survivors_text(mutants: list[Mutant], *, known_diffs: bool = True) -> str:
    """Each survivor under a header naming it and its verdict; one not in the tables is *new*.
    Without ``known_diffs``, the survivors the tables name get their header alone."""
    parts = []
    for m in mutants:
        if m.status in _KILLED:
            continue
        verdict = m.verdict()
        label = verdict or f"{m.status} (new: not in EQUIVALENT or WORDING)"
        diff = f"{m.diff}\n" if known_diffs or verdict is None else ""
        parts.append(f"# {m.name} ({m.module}.{m.function}): {label}\n{diff}")
    return "\n".join(parts)


def print_table(table: dict[str, dict[str, float | int]]) -> None:
    print(
        "module | mutants | killed | equivalent | wording | survived | score | without equivalent"
    )
    for module, row in table.items():
        print(
            f"{module} | {row['mutants']} | {row['killed']} | {row['equivalent']} | "
            f"{row['wording']} | {row['survived']} | {row['score']:.1%} | "
            f"{row['score_without_equivalent']:.1%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modules", nargs="+", choices=sorted(TARGETS), default=list(TARGETS), metavar="MODULE"
    )
    parser.add_argument("--jobs", type=int, default=2, help="mutants tested at once")
    parser.add_argument("--out", type=Path, default=Path("bench-out/mutation"))
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if importlib.util.find_spec("mutmut") is None:
        raise SystemExit("mutmut is not installed: pip install -e '.[mutation]'")
    chosen = {name: TARGETS[name] for name in dict.fromkeys(args.modules)}
    for target in chosen.values():
        for path in (target.source, *target.tests):
            if not (ROOT / path).is_file():
                raise SystemExit(f"{path} does not exist: update TARGETS in {__file__}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    stage(work, list(chosen.values()))
    started = datetime.now(timezone.utc)
    wall, cpu = run_mutmut(work, args.jobs, out / "mutmut.log")
    mutants = read_results(work, chosen)
    table = scores(mutants, list(chosen))
    (out / "survivors.diff").write_text(survivors_text(mutants))
    summary = {
        "started": started.isoformat(timespec="seconds"),
        "modules": {name: t.source for name, t in chosen.items()},
        "tests": sorted({test for t in chosen.values() for test in t.tests}),
        "jobs": args.jobs,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "scores": table,
        "survivors": [
            {"name": m.name, "status": m.status, "verdict": m.verdict()}
            for m in mutants
            if m.status not in _KILLED
        ],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(survivors_text(mutants, known_diffs=False))
    print_table(table)
    print(f"{wall:.0f} s wall, {cpu:.0f} s CPU on {args.jobs} jobs; written to {out}")


if __name__ == "__main__":
    main()
