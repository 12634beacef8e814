"""BENCHMARKS.md and README.md's summary table are what `benchmarks/report.py` makes of
`benchmarks/results.json`, so neither can go stale: edit the JSON and run the script."""
import copy
import importlib.util
import subprocess
import sys

from helpers import REPO

_spec = importlib.util.spec_from_file_location("report", REPO / "benchmarks/report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

KEYS = {"kind", "workload", "shape", "ours", "peers", "date", "gpu", "software", "command"}


def test_benchmarks_md_is_generated_from_the_results():
    data = report.load()
    assert (REPO / "BENCHMARKS.md").read_text(encoding="utf-8") == report.render_benchmarks(data), \
        "BENCHMARKS.md is stale: run `python3 benchmarks/report.py`"


def test_readme_table_is_generated_from_the_results():
    data = report.load()
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert report.render_summary(data) in readme
    assert report.with_summary(readme, report.render_summary(data)) == readme, \
        "README.md's summary table is stale: run `python3 benchmarks/report.py`"


def test_the_check_passes():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks/report.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_row_says_what_when_where_and_how():
    data = report.load()
    kinds = {k["id"] for k in data["kinds"]}
    for row in data["rows"]:
        assert KEYS <= row.keys(), row
        assert row["kind"] in kinds
        assert row["peers"], f"{row['workload']} {row['shape']}: no peer from the same run"
        assert row["command"].startswith("python3 benchmarks/")
        assert row["gpu"] and len(row["date"]) == 10
    assert {"dense", "masked", "gqa", "decode", "backward", "host"} <= kinds


def test_a_changed_figure_changes_the_output():
    data = report.load()
    before = report.render_benchmarks(data), report.render_summary(data)
    changed = copy.deepcopy(data)
    row = next(r for r in changed["rows"] if r.get("summary"))
    row["ours"] = [f + 111 for f in row["ours"]] if isinstance(row["ours"], list) \
        else row["ours"] + 111
    after = report.render_benchmarks(changed), report.render_summary(changed)
    assert after[0] != before[0] and after[1] != before[1]
    peer = next(iter(row["peers"]))
    row["peers"][peer] = 1e-3
    assert report.render_benchmarks(changed) != after[0]


def test_figures_and_ratios():
    assert report.cell([710, 712, 700], 0) == "710 (700–712)"
    assert report.cell(4.3, 2) == "4.30"
    assert report.ratio_cell([2.0, 4.0], [1.0, 1.0], "higher") == "3.00× (2.00–4.00)"
    assert report.ratio_cell(10.0, 20.0, "lower") == "2.00×"  # a time: the peer's over ours
    assert report.ratio_cell(1.0, None, "higher") == "—"
