"""benchmarks/sass_loop.py's reading of the KV loop's SASS, on made-up listings."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "sass_loop.py"
spec = importlib.util.spec_from_file_location("sass_loop", SCRIPT)
sass_loop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_loop)


def listing(*instructions: str) -> str:
    return "\n".join(f"        /*{16 * i:04x}*/                   {text} ;  /* 0x0 */"
                     for i, text in enumerate(instructions))


FIRST_TILE = ("WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R1, R1")  # before the loop: ignored
LOOP_HEAD = ("HGMMA.64x128x16.F32.BF16 R24, R180, gdesc[UR8], R24", "BAR.ARV 0x2, 0x100",
             "WARPGROUP.DEPBAR.LE gsb0, 0x1", "FMNMX R3, R24, R25, !PT")


def test_exponentials_under_p_v_are_counted_apart_from_those_after_its_wait():
    sass = listing(*FIRST_TILE, *LOOP_HEAD, "MUFU.EX2 R4, R4", "MUFU.EX2 R5, R5",
                   "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R6, R6",
                   "HGMMA.64x128x16.F32.BF16 R24, R176, gdesc[UR8], R24", "MUFU.EX2 R7, R7")
    assert sass_loop.loop_exponentials(sass) == (2, 1)


def test_a_wait_hoisted_above_the_softmax_leaves_none_under_p_v():
    sass = listing(*LOOP_HEAD, "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R4, R4",
                   "@P0 MUFU.EX2 R5, R5", "HGMMA.64x128x16.F32.BF16 R24, R176, gdesc[UR8], R24")
    assert sass_loop.loop_exponentials(sass) == (0, 2)


def test_no_loop_is_none():
    assert sass_loop.loop_exponentials(listing(*FIRST_TILE)) is None
    assert sass_loop.loop_exponentials(listing(*LOOP_HEAD, "MUFU.EX2 R4, R4")) is None
