"""Benchmark: queued schedulers over the valid tiles only (the tile index) against the same
schedulers over the dense index space with a skip loop (their form before the tile index),
on the skewed ragged batch and dense causal, both kernel designs, in one process.

    python benchmarks/ragged_queue.py        # needs an H100/H200 for the sm90 column
    python benchmarks/ragged_queue.py --warm # only build every kernel (in parallel processes)

TFLOP/s as `benchmarks/hopper.py` counts them (the (q, k) pairs the mask keeps), median of
CUDA-event-timed runs (`mhadsl.host.bench.time_ms`); each kernel is checked against the float64
reference on a small ragged batch first.
"""
import datetime
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import mhadsl
from mhadsl.host.bench import Problem, allowed_pairs, check, make_inputs, require_gpu, time_ms

CAUSAL = "dtype = bf16  head_dim = 128  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx"
# The dense index space with a skip loop: the std library's Queued and LPT before the tile
# index, for the comparison.
SKIPPING = """
fn lpt_work_info(ts: TileSummary, idx: u32) -> WorkInfo {
    let per_tile = num_heads * ts.batch_size
    let q_tile = ts.max_num_prompt_tiles - 1 - idx / per_tile
    let rest = idx % per_tile
    return WorkInfo(prompt_offset = q_tile * tile_m, head_idx = rest % num_heads,
                    prompt_idx = rest / num_heads, is_valid = idx < ts.num_work())
}
scheduler SkippingLPT(num_ctas: u32 = num_sms * ctas_per_sm) {
    may_advance = true
    schedule = DEFAULT
    grid_dim(batch_size, max_num_prompt_tiles) =
        (max(min(num_ctas, max_num_prompt_tiles * num_heads * batch_size), 1), 1, 1)
    initial_state(slots, ts) = State(idx = block_idx.x, slots = slots, max_idx = ts.num_work())
    get_current_work_info(ts, state) = lpt_work_info(ts, state.idx)
    advance(ts, state, pipeline_idx) {
        if producer && thread_idx.x == 0 {
            var idx = atomic_add(queue, 1) + grid_dim.x
            while idx < state.max_idx && !ts.seq_info(lpt_work_info(ts, idx)).is_valid {
                idx = atomic_add(queue, 1) + grid_dim.x
            }
            state.slots[pipeline_idx] = idx
        }
        barrier(sync)
        state.idx = state.slots[pipeline_idx]
        if state.idx >= state.max_idx { return none }
        return ts.seq_info(lpt_work_info(ts, state.idx))
    }
    unsafe_seq_info(ts, state) = ts.seq_info(lpt_work_info(ts, state.idx))
}
"""
KERNELS = {
    "LPT (skip loop)": "SkippingLPT()",
    "MyQueued (skip loop, num_sms CTAs)": "MyQueued(order = DEFAULT)",
    "Queued": "Queued()",
    "LPT": "LPT()",
    "LPT, heads_per_section 4": "LPT(heads_per_section = 4)",
}
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "queued_rotate.mha"
SOURCE = (f'import "std/schedulers.mha"\nimport "{EXAMPLE}"\n' + SKIPPING
          + "\n".join(f"attention k{i} {{ {CAUSAL}  scheduler = {binding} }}"
                      for i, binding in enumerate(KERNELS.values())))
SKEWED = Problem(0, 0, 0, 16, 16, 128, tuple([8192 >> i for i in range(8)] * 2))
WORKLOADS = [("skewed", SKEWED), ("dense causal", Problem(4, 4096, 4096, 16, 16, 128))]
DESIGNS = ("sm80", "sm90")
SMALL = {True: Problem(0, 0, 0, 4, 4, 128, (0, 1, 127, 129, 700)),
         False: Problem(1, 200, 200, 4, 4, 128)}


def warm(job: tuple[int, str, bool]) -> str:
    """Build (or load from the on-disk cache) one kernel for one design and layout."""
    index, design, ragged = job
    torch = require_gpu()
    kern = mhadsl.compile(SOURCE, name="ragged_queue.mha")[f"k{index}"]
    kern.backend = design
    kern(**make_inputs(torch, kern, SMALL[ragged]))
    torch.cuda.synchronize()
    return f"k{index} {design} {'ragged' if ragged else 'dense'}"


def tile_index_times(torch) -> str:
    """Microseconds per tile index build (`runtime.tile_index.prepare`) by batch size."""
    from mhadsl.build import tile_index_kernel
    from mhadsl.runtime import tile_index
    kernel = tile_index_kernel()
    out = []
    for batch in (16, 1024, 10_000):
        cu = torch.arange(0, 100 * (batch + 1), 100, dtype=torch.int32, device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        ms = time_ms(torch, lambda: tile_index.prepare(kernel, cu.data_ptr(), batch, 128, stream))
        out.append(f"B={batch}: {1000 * ms:.1f} us")
    return "tile index build: " + ", ".join(out)


def main() -> None:
    torch = require_gpu()
    programs = {d: mhadsl.compile(SOURCE, name=f"ragged_queue_{d}.mha") for d in DESIGNS}
    print(f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(tile_index_times(torch))
    print("| scheduler | workload | sm80 TFLOP/s | sm90 TFLOP/s | rel. error sm80, sm90 |")
    print("|---|---|---|---|---|")
    for label, problem in WORKLOADS:
        for i, name in enumerate(KERNELS):
            kernels = {}
            for design in DESIGNS:
                kernels[design] = programs[design][f"k{i}"]
                kernels[design].backend = design
            args = make_inputs(torch, kernels["sm90"], problem)
            flops = 4.0 * 128 * 16 * allowed_pairs(kernels["sm90"], problem)
            errors = [check(torch, kernels[d], SMALL[True])[0] for d in DESIGNS]
            tflops = {d: flops / time_ms(torch, lambda k=kernels[d]: k(**args)) / 1e9
                      for d in DESIGNS}
            print(f"| {name} | {label} {problem.describe()} | {tflops['sm80']:.0f} | "
                  f"{tflops['sm90']:.0f} | {errors[0]:.1e}, {errors[1]:.1e} |", flush=True)


if __name__ == "__main__":
    if "--warm" in sys.argv:
        jobs = [(i, d, r) for i in range(len(KERNELS)) for d in DESIGNS for r in (True, False)]
        with ProcessPoolExecutor(6, mp_context=get_context("spawn")) as pool:
            for done in pool.map(warm, jobs):
                print("built", done, flush=True)
    else:
        main()
