"""benchmarks/ncu_loop.py's reading of ncu's source page, on a made-up export."""
import csv
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "ncu_loop.py"
spec = importlib.util.spec_from_file_location("ncu_loop", SCRIPT)
ncu_loop = importlib.util.module_from_spec(spec)
sys.modules["ncu_loop"] = ncu_loop  # its dataclass looks its module up
spec.loader.exec_module(ncu_loop)

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "stall_barrier", "stall_long_sb", "stall_wait", "stall_barrier (Not Issued)"]
# (source, samples, executions, barrier, long_sb, wait)
OURS = [
    ("LDC R1, c[0x0][0x28]", 1, 2112, 0, 0, 1),
    ("@!P0  BRA 0x10", 50, 3000, 0, 50, 0),  # a retry loop: run most often, but alone
    ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT", 5, 1000, 0, 0, 5),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 70, 1000, 69, 0, 1),
    ("FMNMX R7, R24, R25, !PT", 2, 1000, 0, 0, 2),
    ("@P1  FMNMX R8, R26, R27, !PT", 1, 1000, 0, 0, 1),
    ("MUFU.EX2 R28, R28", 3, 1000, 0, 0, 3),
    ("EXIT", 0, 2112, 0, 0, 0),
]
THEIRS = [
    ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT", 4, 500, 0, 0, 4),
    ("MUFU.EX2 R30, R30", 9, 500, 0, 0, 9),
]


def export(path: Path) -> Path:
    with open(path, "w", newline="") as f:
        out = csv.writer(f, quoting=csv.QUOTE_ALL)
        for name, rows in (("mha_fwd_sm90", OURS), ("flash_fwd_sm90", THEIRS)):
            out.writerow(["Kernel Name", name])
            out.writerow(HEADER)
            for i, (source, samples, executed, barrier, long_sb, wait) in enumerate(rows):
                out.writerow([hex(16 * i), f"      {source}", samples, executed, barrier, long_sb,
                              wait, barrier])
    return path


def test_the_hot_loop_is_the_count_that_runs_most_instructions(tmp_path):
    ours, theirs = ncu_loop.read_source_page(export(tmp_path / "sass.csv"))
    assert (ours.name, theirs.name) == ("mha_fwd_sm90", "flash_fwd_sm90")
    assert ours.loop_trips == 1000  # five instructions a trip beat the retry loop's one
    assert ours.loop_opcodes() == {"HGMMA": 1, "WARPGROUP": 1, "FMNMX": 2, "MUFU": 1}
    assert theirs.loop_trips == 500 and sum(theirs.loop_opcodes().values()) == 2


def test_stall_sites_are_the_most_sampled_in_program_order(tmp_path):
    ours, _ = ncu_loop.read_source_page(export(tmp_path / "sass.csv"))
    sites = ours.stall_sites(2)
    assert [index for index, _, _ in sites] == [1, 3]
    # issued and not-issued columns apart: only the former counted
    assert sites[1][2] == [("barrier", 69), ("wait", 1)]
    assert ncu_loop.opcode("@!P0  BRA 0x10") == "BRA"


def test_summary_names_each_kernel_and_its_loop(tmp_path, capsys):
    ncu_loop.summarize(export(tmp_path / "sass.csv"), sites=1)
    out = capsys.readouterr().out
    assert "[0] mha_fwd_sm90: loop trips 1000, 5 instructions a trip" in out
    assert "[1] flash_fwd_sm90: loop trips 500, 2 instructions a trip" in out
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x0" in out and "barrier 69" in out


def test_run_rejects_a_row_hopper_py_lacks_before_needing_a_gpu():
    with pytest.raises(SystemExit, match="no dense hopper.py row for nope"):
        ncu_loop.run(["plain_d64", "nope"])
