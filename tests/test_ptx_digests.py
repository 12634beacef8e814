"""benchmarks/ptx_digests.py --compare: the proof a refactor changed no PTX fails on any
build whose digest differs or that only one side has."""
import json
import subprocess
import sys

from helpers import REPO

SCRIPT = REPO / "benchmarks" / "ptx_digests.py"


def compare(tmp_path, before: dict, after: dict) -> subprocess.CompletedProcess:
    paths = []
    for name, digests in (("before", before), ("after", after)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(digests))
        paths.append(str(path))
    return subprocess.run([sys.executable, str(SCRIPT), "--compare", *paths],
                          capture_output=True, text=True)


def test_the_same_digests_pass(tmp_path):
    digests = {"causal.mha causal_fwd sm_90a sm90 dense": "ab", "tile-index sm_80": "cd"}
    result = compare(tmp_path, digests, dict(digests))
    assert result.returncode == 0 and "2 builds the same, 0 not" in result.stdout


def test_a_changed_or_missing_build_fails_and_is_named(tmp_path):
    before = {"a dense": "1", "b ragged": "2", "c lse": "3"}
    after = {"a dense": "1", "b ragged": "9"}
    result = compare(tmp_path, before, after)
    assert result.returncode == 1
    assert "differs: b ragged" in result.stdout and "only one side: c lse" in result.stdout
    assert "1 builds the same, 2 not" in result.stdout
