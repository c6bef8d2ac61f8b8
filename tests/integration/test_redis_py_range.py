"""Both ends of the supported redis-py range (``pyproject.toml``: ``redis>=LOW,<HIGH``).

The newest end is what the test environment installs (the suite runs on
it). This module installs the oldest supported redis-py beside it (``pip
install --target``, kept in ``.venv/`` for the next run) from the wheel
``./scripts/setup`` fetched into ``.venv/redis-py-wheels`` (``--no-index``:
the suite never needs the registry) and runs the wait and
stall tests (tests/integration/test_waits.py) again on it: redis-py 5 to 7
read without a timeout by default, redis-py 8 with 5 s, and neither may
decide how long a client waits or whether a partition is noticed. The
worker's hand-packed calls (the columnar path's replies, replies held
behind reads) run there too.

About 60 s on the 2-core CI machine (install 2 s when not cached): slow.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import redis

from tests.conftest import ROOT

_BOUNDS = re.compile(r'"redis\[hiredis\]>=([0-9.]+),<([0-9]+)"')


def redis_py_bounds() -> tuple[str, int]:
    """(oldest supported version, first unsupported major) from pyproject.toml."""
    found = _BOUNDS.search((ROOT / "pyproject.toml").read_text())
    assert found, "pyproject.toml must bound redis-py at both ends: redis[hiredis]>=X.Y.Z,<N"
    return found.group(1), int(found.group(2))


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3])


def test_pyproject_bounds_redis_py_at_both_ends_and_the_suite_runs_inside_them():
    oldest, first_unsupported = redis_py_bounds()
    assert _major_minor(oldest) <= _major_minor(redis.__version__)
    assert int(redis.__version__.split(".")[0]) < first_unsupported


#: Where scripts/_venv.sh (run by ./scripts/setup, ./scripts/test and CI) keeps the oldest
#: supported redis-py's wheel.
WHEELS = ROOT / ".venv" / "redis-py-wheels"


def _oldest_installed(version: str) -> str:
    """A folder holding redis-py ``version``, installed offline from the set-up's wheel."""
    target = ROOT / ".venv" / f"redis-py-{version}"
    if not (target / "redis" / "__init__.py").exists():
        if not list(WHEELS.glob(f"redis-{version}-*.whl")):
            pytest.fail(
                f"no redis=={version} wheel in {WHEELS}: run ./scripts/setup, which fetches the "
                "oldest supported redis-py there once (pyproject.toml's lower bound)"
            )
        done = subprocess.run(
            [
                *(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"),
                *("--disable-pip-version-check", "--no-index", "--find-links", str(WHEELS)),
                *("--target", str(target), f"redis=={version}"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            pytest.fail(
                f"cannot install redis=={version} from {WHEELS} to test the oldest supported "
                f"redis-py:\n{done.stderr}"
            )
    return str(target)


def test_the_set_up_fetches_the_oldest_redis_py_for_an_offline_install():
    # scripts/_venv.sh reads the same bound the range test installs: one version, two readers
    oldest, _ = redis_py_bounds()
    setup = (ROOT / "scripts" / "_venv.sh").read_text()
    assert "--dest .venv/redis-py-wheels" in setup
    assert list(WHEELS.glob(f"redis-{oldest}-*.whl")), f"run ./scripts/setup: no {oldest} wheel"


#: The worker's calls packed and read by hand on a pooled connection (the fast path's replies, and
#: the replies held behind reads): how a connection is checked out changed in redis-py 5.3.
_HAND_PACKED = ("tests/integration/test_columnar.py", "tests/integration/test_behind.py")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_waits_and_stalls_on_the_oldest_supported_redis_py():
    oldest, _ = redis_py_bounds()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [_oldest_installed(oldest), str(ROOT), env.get("PYTHONPATH")])
    )
    env["INFERFLEET_EXPECT_REDIS_PY"] = oldest  # test_waits checks the import really found it
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "tests/integration/test_waits.py",
            *_HAND_PACKED,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
