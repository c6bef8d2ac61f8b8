"""The installed names as an application sees them: no shadowing, and an SDK without torch.

Each test runs a fresh interpreter outside the repository, so only what is
installed (the editable install of .venv) can be imported.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import redis

from inferfleet import Producer
from tests.conftest import stop_process, wait_for_consumer

INFERFLEET = str(Path(sys.executable).with_name("inferfleet"))

#: Run before the code under test: every worker-side module fails to import, as on an SDK-only
#: install.
BLOCK_WORKER_SIDE = textwrap.dedent("""
    import sys
    BLOCKED = {"torch", "click", "rich", "matplotlib", "prometheus_client", "pythonjsonlogger",
               "cachetools"}
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, Block())
""")


def _app_dir(tmp_path: Path) -> Path:
    """An application folder with its own worker.py (a handler) and a producer.py that must never
    load."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "worker.py").write_text(
        textwrap.dedent("""
        import torch
        from inferfleet.worker import Handler

        class Doubler(Handler):
            version = "app-1"

            def predict(self, x, params):
                return x * 2
    """)
    )
    (app / "producer.py").write_text(
        "raise RuntimeError('the application\\'s producer.py was imported')\n"
    )
    return app


def test_an_application_worker_py_does_not_shadow_inferfleet(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    app = _app_dir(tmp_path)
    env = {"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(app), "REDIS_URL": redis_url}
    shown = subprocess.run(
        [INFERFLEET, "--help"], cwd=app, env=env, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0 and "worker" in shown.stdout, shown.stderr
    proc = subprocess.Popen(
        [INFERFLEET, "worker", "--name", "app", "--model", "worker:Doubler", "--consumer", "app-0"],
        cwd=app,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for_consumer(redis_client, "inferfleet:{app}:requests", "app-0", proc)
        with Producer(redis_url, "app") as producer:
            reply = producer.result(
                producer.submit(np.arange(4, dtype=np.float32).reshape(2, 2)), timeout_s=30
            )
        assert reply.model_version == "app-1"
        np.testing.assert_array_equal(
            reply.outputs, np.arange(4, dtype=np.float32).reshape(2, 2) * 2
        )
    finally:
        assert stop_process(proc) == 0, (
            proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        )
        if proc.stderr:
            proc.stderr.close()


def test_the_sdk_enqueues_with_no_worker_side_installed(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    code = BLOCK_WORKER_SIDE + textwrap.dedent(f"""
        import numpy as np
        from inferfleet import Producer
        with Producer({redis_url!r}, "sdk") as p:
            print(p.submit(np.zeros((1, 4), np.float32)))
        assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED
                    or m.startswith("inferfleet.worker")]
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    entries = redis_client.xrange("inferfleet:{sdk}:requests")
    assert [fields[b"id"].decode() for _, fields in entries] == [out.stdout.strip()]


def test_the_cli_without_the_worker_side_names_the_extra_to_install(tmp_path: Path) -> None:
    code = BLOCK_WORKER_SIDE + (
        "import runpy; sys.argv = ['inferfleet', '--help']; "
        "runpy.run_module('inferfleet', run_name='__main__')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, out
    assert "pip install -e '.[worker]' in an inferfleet checkout" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_a_regular_install_carries_every_module_under_inferfleet(tmp_path: Path) -> None:
    """What the Docker image's ``pip install ".[worker]"`` installs: a wheel with every module of
    both folders."""
    import zipfile

    root = Path(__file__).resolve().parents[2]
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = tmp_path.glob("inferfleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {"inferfleet/__init__.py", "inferfleet/__main__.py", "inferfleet/py.typed"}
    for side in ("producer", "worker"):
        expected |= {
            "inferfleet/" + p.relative_to(root).as_posix() for p in (root / side).rglob("*.py")
        }
    assert expected <= names, sorted(expected - names)
    outside = ("worker", "producer", "tests", "scripts", "benchmarks")
    assert not [n for n in names if n.split("/")[0] in outside]
