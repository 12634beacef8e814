"""BENCHMARKS.md, and README.md's summary table, from the recorded results.

    python3 benchmarks/report.py           # rewrite BENCHMARKS.md and README.md's table
    python3 benchmarks/report.py --check   # exit 1, naming each file that is stale

`benchmarks/results.json` holds the latest measured figures: one row per workload, with
mhadsl's figure and each peer's from the same run, and the date, GPU, software, commit and
command of that run. To record a new measurement, edit the JSON and run this script;
`tests/test_benchmarks_report.py` fails while BENCHMARKS.md or README.md's table differ from
what this script makes of the JSON. The notebook that the figures were taken from is
`benchmarks/log/BENCHMARKS_LOG.md`.

A figure is a number, or a list of numbers (the same row timed several times in turn in one
process): shown as the median, then the range. A ratio is mhadsl's figure over the peer's
(the peer's time over mhadsl's where lower is better), so above 1 means mhadsl is faster;
with lists of the same length its range is over the runs' ratios.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results.json"
BENCHMARKS = REPO / "BENCHMARKS.md"
README = REPO / "README.md"
SUMMARY_BEGIN = "<!-- summary table: written by benchmarks/report.py from benchmarks/results.json -->"
SUMMARY_END = "<!-- end of summary table -->"
SUMMARY_PEERS = ("FlashAttention-4", "cuDNN", "torch flash")
RUN_FIELDS = ("date", "gpu", "software", "commit", "command")


def load(path: Path = RESULTS) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def median(figure) -> float:
    return statistics.median(figure) if isinstance(figure, list) else figure


def fmt(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def cell(figure, digits: int) -> str:
    """A figure: the number, or a list's median and range."""
    if figure is None:
        return "—"
    if isinstance(figure, list):
        lo, hi = min(figure), max(figure)
        spread = "" if lo == hi else f" ({fmt(lo, digits)}–{fmt(hi, digits)})"
        return fmt(median(figure), digits) + spread
    return fmt(figure, digits)


def ratio(ours, peer, better: str) -> float:
    a, b = median(ours), median(peer)
    return a / b if better == "higher" else b / a


def ratio_cell(ours, peer, better: str) -> str:
    if peer is None:
        return "—"
    text = f"{ratio(ours, peer, better):.2f}×"
    if isinstance(ours, list) and isinstance(peer, list) and len(ours) == len(peer):
        per_run = [ratio(a, b, better) for a, b in zip(ours, peer)]
        lo, hi = min(per_run), max(per_run)
        if f"{lo:.2f}" != f"{hi:.2f}":
            text += f" ({lo:.2f}–{hi:.2f})"
    return text


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def groups(rows: list[dict]) -> list[list[dict]]:
    """A kind's rows, split into runs (same date, GPU, software, commit and command) in the
    order they first appear."""
    runs: dict[tuple, list[dict]] = {}
    for row in rows:
        runs.setdefault(tuple(row.get(f) for f in RUN_FIELDS), []).append(row)
    return list(runs.values())


def ordered(rows: list[dict], field: str) -> list[str]:
    names: list[str] = []
    for row in rows:
        names += [n for n in row.get(field, {}) if n not in names]
    return names


def run_line(row: dict) -> str:
    commit = f", commit `{row['commit']}`" if row.get("commit") else ""
    return (f"**{row['gpu']}**, {row['date']} ({row['software']}{commit}). "
            f"Command: `{row['command']}`")


def render_group(kind: dict, rows: list[dict]) -> list[str]:
    digits, better = kind["digits"], kind["better"]
    variants, peers = ordered(rows, "variants"), ordered(rows, "peers")
    detail = any("detail" in r for r in rows)
    header = ["Workload", "Shape", f"{kind['ours']}", *variants, *peers,
              *(f"vs {p}" for p in peers), *(["Notes"] if detail else [])]
    body = []
    for r in rows:
        body.append([r["workload"], r["shape"], cell(r["ours"], digits),
                     *(cell(r.get("variants", {}).get(v), digits) for v in variants),
                     *(cell(r["peers"].get(p), digits) for p in peers),
                     *(ratio_cell(r["ours"], r["peers"].get(p), better) for p in peers),
                     *([r.get("detail", "")] if detail else [])])
    notes: list[str] = []
    for r in rows:
        notes += [n for n in r.get("notes", ()) if n not in notes]
    return [run_line(rows[0]), "", *table(header, body), *([""] if notes else []),
            *(f"- {n}" for n in notes), ""]


def render_benchmarks(data: dict) -> str:
    out = [
        "# Benchmarks",
        "",
        "The latest measured figures, each row beside its peers timed in the same run (one",
        "process, every column of a row timed in turn over several rounds, medians: a",
        "power-capped GPU's clock drifts, so kernels timed apart are not comparable). Ratios are",
        "mhadsl's speed over the peer's: above 1 means mhadsl is faster. Where a figure is a",
        "median with a range, the row was timed several times in turn and the range is over",
        "those runs.",
        "",
        "This file is generated: `python3 benchmarks/report.py` writes it from",
        "[benchmarks/results.json](benchmarks/results.json) (edit that, then run the script;",
        "`tests/test_benchmarks_report.py` fails while the two differ). How every figure was",
        "arrived at, and what was tried and not kept, is in the notebook",
        "[benchmarks/log/BENCHMARKS_LOG.md](benchmarks/log/BENCHMARKS_LOG.md) (with",
        "[HOPPER_NOTES.md](benchmarks/log/HOPPER_NOTES.md) and",
        "[ATTENTION_NOTES.md](benchmarks/log/ATTENTION_NOTES.md)).",
        "",
        "Peers: cuDNN and torch flash are torch SDPA's backends; FlashAttention-4 is the",
        "FlashAttention-4 package's Hopper (sm90) path, timed where it is installed;",
        "FlexAttention is torch.compile'd `flex_attention`.",
        "",
    ]
    kinds = data["kinds"]
    out += ["Tables: " + ", ".join(f"[{k['title']}](#{anchor(k['title'])})" for k in kinds)
            + ".", ""]
    for kind in kinds:
        rows = [r for r in data["rows"] if r["kind"] == kind["id"]]
        if not rows:
            continue
        out += [f"## {kind['title']}", "", f"Unit: {kind['unit']}. {kind['intro']}", ""]
        for group in groups(rows):
            out += render_group(kind, group)
    return "\n".join(out).rstrip("\n") + "\n"


def anchor(title: str) -> str:
    """GitHub's anchor of a heading."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def render_summary(data: dict) -> str:
    """README.md's one table: the rows marked `summary`, medians only."""
    kinds = {k["id"]: k for k in data["kinds"]}
    body = []
    for r in data["rows"]:
        if not r.get("summary"):
            continue
        kind = kinds[r["kind"]]
        digits, better = kind["digits"], kind["better"]
        peers = {p: f for p, f in r["peers"].items() if p in SUMMARY_PEERS}
        best = (max if better == "higher" else min)(peers.values(), key=median)
        body.append([r["summary"], r["shape"], kind["unit"], fmt(median(r["ours"]), digits),
                     *(fmt(median(peers[p]), digits) if p in peers else "—"
                       for p in SUMMARY_PEERS),
                     f"{ratio(r['ours'], best, better):.2f}×"])
    header = ["Workload", "Shape", "Unit", "mhadsl", *SUMMARY_PEERS, "mhadsl ÷ best peer"]
    return "\n".join(table(header, body)) + "\n"


def with_summary(readme: str, summary: str) -> str:
    """README.md's text with the table between the markers replaced."""
    head, sep, rest = readme.partition(SUMMARY_BEGIN + "\n")
    _, sep2, tail = rest.partition(SUMMARY_END)
    if not sep or not sep2:
        raise SystemExit(f"README.md lacks the summary markers ({SUMMARY_BEGIN!r} ... "
                         f"{SUMMARY_END!r})")
    return head + SUMMARY_BEGIN + "\n" + summary + SUMMARY_END + tail


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print(__doc__, file=sys.stderr)
        return 2
    data = load()
    wanted = {BENCHMARKS: render_benchmarks(data),
              README: with_summary(README.read_text(encoding="utf-8"), render_summary(data))}
    stale = [p for p, text in wanted.items()
             if not p.exists() or p.read_text(encoding="utf-8") != text]
    if check:
        for p in stale:
            print(f"{p.relative_to(REPO)} is stale: run `python3 benchmarks/report.py`")
        return 1 if stale else 0
    for p in stale:
        p.write_text(wanted[p], encoding="utf-8")
        print(f"wrote {p.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
