"""The issue-12 measurement scripts run as docs/benchmarks.md runs them, on a tiny load.

Their figures are only as good as what they measure: every reply-script
variant must acknowledge every entry it answers (the script checks nothing is
left pending), and an unknown variant is refused rather than measured as
the default script.
"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = str(ROOT / "scripts" / "bench_reply_script.py")


def test_every_reply_script_variant_answers_and_acknowledges_every_entry():
    done = subprocess.run([sys.executable, SCRIPT, "--entries", "600", "--batch", "256", "--runs", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = {line.split()[0] for line in done.stdout.splitlines()[1:] if line.strip()}
    assert measured == {"script", "inline", "grouped", "runs", "pcheck", "script-inbox", "inline-inbox",
                        "grouped-inbox", "runs-inbox", "pcheck-inbox", "function", "no-expire", "plain"}


def test_an_unknown_variant_is_refused():
    done = subprocess.run([sys.executable, SCRIPT, "--variants", "script,fastest"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown variant(s) fastest" in done.stderr
