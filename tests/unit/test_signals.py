"""Stop signals take effect wherever they land in the main thread, a lock it holds included.

Each case runs in a child process (signal handlers are process-wide) that
holds the stop event's own lock while the signal arrives: the state the
main thread is in inside ``Event.set()`` or ``Event.wait()``, and the state
a second parent-death signal found a worker in while the first one's handler
was setting ``stop``. A handler that set the event itself waited for that
lock forever (the child never finishes, and the test times out).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from tests.conftest import ROOT

CHILD_TIMEOUT_S = 30


def run_child(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter from the repo root; fail the test if it hangs."""
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"the child hung (a signal handler deadlocked?):\n{exc.stderr}"
        ) from exc


def test_parent_death_signals_that_land_inside_stop_set_still_stop_the_worker():
    done = run_child("""
        import signal, threading
        from inferfleet.worker.fleet.succession import watch_parent
        stop = threading.Event()
        watch_parent(stop, interval_s=3600)  # the pid check would not notice within the test
        # the main thread inside stop.set(): where the kernel's second signal landed
        with stop._cond:
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGUSR1)
        print("stopped" if stop.wait(10) else "still serving")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped"
    assert done.stderr.count("the supervisor (pid") == 1  # said once, however many signals came


def test_a_worker_drains_on_the_first_sigterm_and_exits_on_the_second_wherever_they_land():
    done = run_child("""
        import logging, signal, threading, time
        from inferfleet.worker.cli.process import install_stop_handlers
        logging.basicConfig(level=logging.INFO)
        stop = threading.Event()
        install_stop_handlers(stop)
        with stop._cond:
            signal.raise_signal(signal.SIGTERM)
        print("draining" if stop.wait(10) else "serving", flush=True)
        with stop._cond:
            signal.raise_signal(signal.SIGTERM)
        time.sleep(10)
        print("still running")
    """)
    assert done.stdout.split() == ["draining"]
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "SIGTERM received: finishing the current batch" in done.stderr
    assert "second SIGTERM: exiting without draining" in done.stderr


def test_a_supervisor_drains_on_the_first_sigint_and_kills_on_the_second_wherever_they_land():
    done = run_child("""
        import signal, threading, types
        from inferfleet.worker.cli.supervise import _install_fleet_stop_handlers
        stop, kill_now = threading.Event(), threading.Event()
        _install_fleet_stop_handlers(stop, types.SimpleNamespace(kill_now=kill_now))
        with stop._cond:
            signal.raise_signal(signal.SIGINT)
        print("draining" if stop.wait(10) else "running")
        with stop._cond:
            signal.raise_signal(signal.SIGINT)
        print("killing" if kill_now.wait(10) else "waiting")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["draining", "killing"]


def test_an_action_that_raises_is_logged_and_the_next_signal_is_still_handled():
    done = run_child("""
        import logging, signal, threading
        from inferfleet.worker.signals import on_signals
        logging.basicConfig()
        seen, second = [], threading.Event()
        def action(signum):
            seen.append(signum)
            if len(seen) == 1:
                raise RuntimeError("the first one fails")
            second.set()
        on_signals((signal.SIGUSR2,), action)
        signal.raise_signal(signal.SIGUSR2)
        signal.raise_signal(signal.SIGUSR2)
        print("handled twice" if second.wait(10) else "lost")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "handled twice"
    assert "handling SIGUSR2 failed" in done.stderr and "the first one fails" in done.stderr
