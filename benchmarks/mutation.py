"""How many small changes to the core rules the unit tests catch: a mutation run (issue 35).

mutmut 3 (``pip install -e '.[mutation]'``) changes the modules of :data:`TARGETS` one small
edit at a time (an operator, a comparison, a number, a string, a returned value, a dropped
argument), and for each such *mutant* runs the unit tests that reach the changed function. A
mutant that fails a test is killed; one that passes every test *survives*: either the tests lack
an assertion, or the change changes nothing (an *equivalent* mutant; :data:`EQUIVALENT` names
those found so far, with why).

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

#: Surviving mutants that change nothing a caller can see: (module, function, the mutated
#: line(s) as the diff shows them, why). Matched on the line rather than mutmut's number,
#: which shifts whenever the function changes.
EQUIVALENT: tuple[tuple[str, str, str, str], ...] = ()

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

    @property
    def changed(self) -> str:
        """The mutated line(s), as the diff shows them after ``+``."""
        return "\n".join(
            line[1:].strip()
            for line in self.diff.splitlines()
            if line.startswith("+") and not line.startswith("+++")
        )

    def equivalent(self) -> str | None:
        """Why this mutant changes nothing, when :data:`EQUIVALENT` says so."""
        for module, function, changed, why in EQUIVALENT:
            if (module, function, changed) == (self.module, self.function, self.changed):
                return why
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
    """Per module: mutants, killed, survived (not equivalent), equivalent, score."""
    table: dict[str, dict[str, float | int]] = {}
    for module in [*modules, "all"]:
        mine = [m for m in mutants if module in ("all", m.module)]
        killed = sum(m.status in _KILLED for m in mine)
        equivalent = sum(m.status not in _KILLED and m.equivalent() is not None for m in mine)
        table[module] = {
            "mutants": len(mine),
            "killed": killed,
            "survived": len(mine) - killed - equivalent,
            "equivalent": equivalent,
            "score": round(killed / len(mine), 4) if mine else 0.0,
            "score_without_equivalent": (
                round(killed / (len(mine) - equivalent), 4) if len(mine) > equivalent else 0.0
            ),
        }
    return table


def survivors_text(mutants: list[Mutant]) -> str:
    parts = []
    for m in mutants:
        if m.status in _KILLED:
            continue
        why = m.equivalent()
        label = f"equivalent: {why}" if why else m.status
        parts.append(f"# {m.name} ({m.module}.{m.function}): {label}\n{m.diff}\n")
    return "\n".join(parts)


def print_table(table: dict[str, dict[str, float | int]]) -> None:
    print("module | mutants | killed | survived | equivalent | score | without equivalent")
    for module, row in table.items():
        print(
            f"{module} | {row['mutants']} | {row['killed']} | {row['survived']} | "
            f"{row['equivalent']} | {row['score']:.1%} | {row['score_without_equivalent']:.1%}"
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
    survivors = survivors_text(mutants)
    (out / "survivors.diff").write_text(survivors)
    summary = {
        "started": started.isoformat(timespec="seconds"),
        "modules": {name: t.source for name, t in chosen.items()},
        "tests": sorted({test for t in chosen.values() for test in t.tests}),
        "jobs": args.jobs,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "scores": table,
        "survivors": [
            {"name": m.name, "status": m.status, "equivalent": m.equivalent()}
            for m in mutants
            if m.status not in _KILLED
        ],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(survivors)
    print_table(table)
    print(f"{wall:.0f} s wall, {cpu:.0f} s CPU on {args.jobs} jobs; written to {out}")


if __name__ == "__main__":
    main()
