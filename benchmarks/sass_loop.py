"""Does the sm90 kernel's softmax run under P V? Reads the SASS of the KV loop.

    python3 benchmarks/sass_loop.py        # needs cuobjdump (CUDA toolkit) and ptxas

Builds hopper.py's declarations for sm_90a (dense, the default tiles), disassembles each
cubin with `cuobjdump -sass` and follows the consumer's KV loop: from S's wait
(`WARPGROUP.DEPBAR.LE gsb0, 0x1`) to P V's wait (`gsb0, 0x0`), and from there to the next
wgmma. FlashAttention-3's intra-warpgroup overlap wants the softmax's exponentials
(`MUFU.EX2`) in the first stretch, under the P V of the previous KV tile; the 2026-11-30
builds have all of them in the second (benchmarks/log/HOPPER_NOTES.md, version 7). Needs no GPU.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mhadsl

sys.path.insert(0, str(Path(__file__).parent))
from hopper import SOURCE  # noqa: E402

KERNELS = ("plain_d128", "causal_d128", "plain_d64", "causal_d64", "plain_d256", "causal_d256")
INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4}\*/\s+(.*?)\s*;")


def loop_exponentials(sass: str) -> tuple[int, int] | None:
    """(MUFU.EX2 between S's wait and P V's wait, MUFU.EX2 after P V's wait until the next
    wgmma) in the KV loop, or None where the SASS has no such loop."""
    instructions = INSTRUCTION.findall(sass)
    starts = [i for i, text in enumerate(instructions) if "DEPBAR.LE gsb0, 0x1" in text]
    if not starts:
        return None
    under, after, stretch = 0, 0, "under"
    for text in instructions[starts[0] + 1:]:
        if "DEPBAR.LE gsb0, 0x0" in text:
            stretch = "after"
        elif "HGMMA" in text and stretch == "after":
            return under, after
        elif "MUFU.EX2" in text:
            under, after = (under + 1, after) if stretch == "under" else (under, after + 1)
    return None


def main() -> int:
    if shutil.which("cuobjdump") is None:
        print("cuobjdump not found: install the CUDA toolkit or put it on PATH")
        return 1
    program = mhadsl.compile(SOURCE, name="<sass_loop>")
    print("| kernel | tile | MUFU.EX2 under P V | after P V's wait |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in KERNELS:
            build = program[name].build("sm_90a", backend="sm90")
            cubin = Path(tmp) / f"{name}.cubin"
            cubin.write_bytes(build.assembled.cubin)
            sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True,
                                  text=True, check=True).stdout
            found = loop_exponentials(sass)
            tile = f"{build.config.block_m} x {build.config.block_n}"
            cells = ("no loop found", "—") if found is None else map(str, found)
            print(f"| {name} | {tile} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
