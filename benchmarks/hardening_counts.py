"""HARDENING.md's test counts, from the suite's own collection, so they cannot go stale.

Each count there is written `N<!-- count: WHAT -->`, WHAT being `cpu` (the tests not marked
`gpu`), a test file (`tests/test_cli.py`) or one test with all its parameters
(`tests/test_cli.py::test_bad_command_lines_are_one_line_and_exit_2`). GPU tests are not
counted: without torch their files are skipped whole, so their number depends on the machine.

    python benchmarks/hardening_counts.py           # rewrite the counts in HARDENING.md
    python benchmarks/hardening_counts.py --check   # exit 1, naming each stale count

`tests/test_hardening_counts.py` runs the check.
"""
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "HARDENING.md"
COUNT = re.compile(r"(\d[\d,]*)<!-- count: (\S+) -->")


class Collector:
    def __init__(self):
        self.cpu: list[str] = []  # node ids of the tests not marked gpu

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.cpu = [i.nodeid for i in session.items if not i.get_closest_marker("gpu")]


def count(what: str, cpu: list[str]) -> int:
    if what == "cpu":
        return len(cpu)
    within = re.compile(re.escape(what) + r"($|::|\[)")  # the file, or the test and its parameters
    return sum(bool(within.match(n)) for n in cpu)


def collect() -> list[str]:
    collector = Collector()
    quiet = ["-o", "addopts=", "-p", "no:terminal", "-p", "no:cacheprovider"]
    code = pytest.main(["--collect-only", *quiet, "--rootdir", str(REPO), str(REPO / "tests")],
                       plugins=[collector])
    if code != 0:
        sys.exit(f"collecting the tests failed (pytest exit code {code})")
    return collector.cpu


def main() -> int:
    check = sys.argv[1:] == ["--check"]
    cpu = collect()
    text = DOC.read_text()
    stale, unknown = [], []

    def fill(match: re.Match) -> str:
        what, n = match.group(2), count(match.group(2), cpu)
        if n == 0:
            unknown.append(what)
        elif f"{n:,}" != match.group(1):
            stale.append(f"{what}: HARDENING.md says {match.group(1)}, the suite has {n:,}")
        return f"{n:,}<!-- count: {what} -->"

    updated = COUNT.sub(fill, text)
    if unknown:
        sys.exit(f"HARDENING.md counts tests that do not exist: {', '.join(unknown)}")
    if check:
        print("\n".join(stale) or "HARDENING.md's counts match the suite")
        return 1 if stale else 0
    DOC.write_text(updated)
    print(f"HARDENING.md: {len(COUNT.findall(text))} counts, {len(stale)} updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
