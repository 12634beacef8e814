"""The scheduler IR compiled for NVPTX visits the same tiles as on the host (needs a GPU)."""
import numpy as np
import pytest

from helpers import STD, checked
from mhadsl.codegen.scheduler import SchedulerSpec, lower_scheduler
from mhadsl.codegen.trace_kernel import TRACE_ABI, TRACE_FIELDS, build_trace_kernel
from mhadsl.codegen.target import emit_ptx, gpu_target, new_module, optimize
from mhadsl.analysis.simulate import Batch, HostScheduler, simulate

pytestmark = pytest.mark.gpu

RAGGED = Batch([0, 1, 127, 128, 129, 3000, 8192], heads=5, tile=128, ragged=True)
SEED = Batch([100], heads=3, tile=32, ragged=False)


def gpu_trace(spec: SchedulerSpec, batch: Batch, num_sms: int, threads: int = 128):
    """Run the trace kernel; returns {cta: [tiles in visit order]}."""
    from mhadsl.build import tile_index_kernel
    from mhadsl.runtime import driver, tile_index
    from mhadsl.runtime.launch import LaunchPlan

    info = driver.device_info()
    arch = "sm_90a" if info.compute_capability >= (9, 0) else "sm_80"
    program = checked(STD)
    target = gpu_target(arch)
    module = new_module("trace", target)
    lowered = lower_scheduler(module, program, spec, target)
    kernel_name = build_trace_kernel(module, lowered).name
    ptx = emit_ptx(optimize(module, target), target)

    grid = HostScheduler(program, spec).grid(len(batch.seqlens), batch.max_num_prompt_tiles,
                                             max(batch.seqlens), batch.heads, num_sms)
    n_ctas = grid[0] * grid[1] * grid[2]
    max_steps = len(batch.valid_tiles()) * 2 + 4

    offsets = np.array([0] + list(np.cumsum(batch.seqlens)), dtype=np.int32)
    out = np.full(n_ctas * max_steps * TRACE_FIELDS, 0xFFFFFFFF, dtype=np.uint32)  # poison
    d_out = driver.DeviceBuffer.from_numpy(out)
    d_vl = driver.DeviceBuffer.from_numpy(offsets)
    d_overflow = driver.DeviceBuffer.from_numpy(np.zeros(1, np.uint32))
    device = driver.ensure_context()
    fn = driver.Module.from_ptx(ptx, device).function(kernel_name)
    values = {"num_sms": num_sms, "batch": len(batch.seqlens),
              "max_num_prompt_tiles": batch.max_num_prompt_tiles,
              "max_seqlen_q": max(batch.seqlens), "num_heads": batch.heads,
              "max_steps": max_steps}
    # a ragged launch builds its tile index over cu_seqlens_q first
    index = tile_index.plan(tile_index_kernel(), len(batch.seqlens), batch.tile, device) \
        if batch.ragged else None
    plan = LaunchPlan(fn, grid, threads, 0, TRACE_ABI, config=None, device=device, tensors={},
                      values=values, tile_index=index)
    # on the legacy default stream (which the copies below wait for), with its workspace
    plan.launch({"cu_seqlens_q": d_vl.ptr if batch.ragged else 0, "trace": d_out.ptr,
                 "overflow": d_overflow.ptr}, stream=0)
    d_out.copy_to_numpy(out)
    overflow = np.zeros(1, np.uint32)
    d_overflow.copy_to_numpy(overflow)
    assert overflow[0] == 0
    steps = out.reshape(n_ctas, max_steps, TRACE_FIELDS)
    visits = {}
    for cta in range(n_ctas):
        tiles = [tuple(int(v) for v in row[:3]) for row in steps[cta] if row[3] == 1]
        if tiles:
            visits[cta] = tiles
    return visits


@pytest.mark.parametrize("order", ["DEFAULT", "PROMPT_ROTATE"])
def test_seed_vector_on_gpu(order):
    spec = SchedulerSpec("Persistent", (("num_ctas", 8), ("order", order)), 32)
    visits = gpu_trace(spec, SEED, num_sms=8)
    assert visits[0] == [(0, 0, 0), (0, 2, 0)]
    assert visits[4] == [(0, 1, 0) if order == "DEFAULT" else (96, 1, 0)]
    host = simulate(checked(STD), spec, SEED, ctas=8)
    assert visits == host.visits


@pytest.mark.parametrize("name, args", [
    ("Transient", (("order", "DEFAULT"),)), ("Persistent", (("order", "PROMPT_ROTATE"),)),
    ("Persistent", (("order", "LONGEST_FIRST"), ("heads_per_section", 2)))])
def test_static_schedulers_match_host_order(name, args):
    spec = SchedulerSpec(name, args, 128)
    visits = gpu_trace(spec, RAGGED, num_sms=7)
    host = simulate(checked(STD), spec, RAGGED, ctas=7)
    assert host.covered_exactly_once
    assert visits == host.visits


@pytest.mark.parametrize("name, args", [("Queued", (("order", "DEFAULT"),)), ("LPT", ()),
                                        ("Adaptive", ())])
@pytest.mark.parametrize("threads", [32, 256])
def test_dynamic_schedulers_cover_every_tile_once_on_gpu(name, args, threads):
    spec = SchedulerSpec(name, args, 128)
    visits = gpu_trace(spec, RAGGED, num_sms=132, threads=threads)
    done = [t for tiles in visits.values() for t in tiles]
    assert sorted(done) == sorted(RAGGED.valid_tiles())
