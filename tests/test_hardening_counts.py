"""HARDENING.md's test counts are the suite's: `python benchmarks/hardening_counts.py`
rewrites them, and this test fails while one is stale."""
import subprocess
import sys

from helpers import REPO


def test_hardening_counts_match_the_suite():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks/hardening_counts.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr + \
        "\nrun `python benchmarks/hardening_counts.py` to rewrite them"
