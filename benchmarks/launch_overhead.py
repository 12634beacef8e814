"""Benchmark: the host time of one eager call against the kernel's own time, per design.

    python3 benchmarks/launch_overhead.py [KERNEL]     # needs a GPU; default: window

A kernel shorter than its launch's host work waits for the host when called back to back.
For hopper.py's KERNEL on its B4 S4096 H16 D128 shape, each design (sm80, and sm90 on
compute capability 9.0) is timed three ways, three times: the host time of 200 calls queued
without waiting, the CUDA-event median of back-to-back calls (what hopper.py reports), and
the CUDA-graph replay of one call (the kernel alone, no host work).
"""
import sys
import time

import mhadsl
from mhadsl.bench import Problem, make_inputs, require_gpu, time_ms

sys.path.insert(0, "benchmarks")
from hopper import SOURCE  # noqa: E402


def main() -> None:
    torch = require_gpu()
    name = sys.argv[1] if len(sys.argv) > 1 else "window"
    program = mhadsl.compile(SOURCE, name="<launch_overhead>")
    problem = Problem(4, 4096, 4096, 16, 16, 128)
    designs = ("sm80", "sm90") if torch.cuda.get_device_capability() == (9, 0) else ("sm80",)
    for design in designs:
        kernel = program[name]
        kernel.backend = design
        args = make_inputs(torch, kernel, problem)

        def call():
            return kernel(**args)
        call()
        torch.cuda.synchronize()
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.stream(stream):  # the warm-up call gave this stream its workspace
            call()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                call()
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(200):
                call()
            host = (time.perf_counter() - start) / 200
            torch.cuda.synchronize()
            print(f"{name} {design}: host {host * 1e6:.0f} us per call, back to back "
                  f"{time_ms(torch, call) * 1e3:.0f} us, graph replay "
                  f"{time_ms(torch, graph.replay) * 1e3:.0f} us", flush=True)


if __name__ == "__main__":
    main()
