"""Lowering to LLVM IR, PTX emission and assembly with ptxas (sm_80 and sm_90a)."""
import ctypes
import re

import pytest

from helpers import EXAMPLES, REPO, STD, checked
from mhadsl import abi
from mhadsl.codegen.assemble import find_ptxas, parse_resources
from mhadsl.codegen.scheduler import SchedulerSpec, lower_scheduler
from mhadsl.codegen.trace_kernel import build_trace_kernel
from mhadsl.codegen.target import HOST, HostJit, emit_ptx, gpu_target, new_module, optimize
from mhadsl.pipeline import CompileOptions, compile_stages

SOURCES = [("std/schedulers.mha", (REPO / "mhadsl/std/schedulers.mha").read_text(), REPO)] + \
    [(str(p), p.read_text(), p.parent) for p in EXAMPLES]


def test_ptxas_is_available():
    assert find_ptxas(), "the test extra installs nvidia-cuda-nvcc, which ships ptxas"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("name, text, base", SOURCES, ids=[s[0] for s in SOURCES])
def test_every_file_assembles_without_spills(name, text, base, arch):
    comp = compile_stages(text, name, CompileOptions(arch=arch), until="cubin", base_dir=base)
    ptx = comp.artifacts["ptx"]
    assert f".target {arch}" in ptx and ".version 8.5" in ptx
    kernels = comp.artifacts["cubin"].kernels
    assert set(kernels) == {f"trace_{s}" for s in comp.checked.schedulers}
    for k in kernels.values():
        assert k.spills == 0 and k.stack_bytes == 0, k
    assert comp.artifacts["cubin"].cubin[:4] == b"\x7fELF"


def test_every_stage_artifact_is_kept():
    comp = compile_stages(STD, "t.mha", CompileOptions(), until="ptx", base_dir=REPO)
    assert list(comp.artifacts) == ["parse", "check", "llvm", "llvm-opt", "ptx"]
    assert 'define ptx_kernel void @"trace_Queued"' in comp.text("llvm")
    assert "atom.global.add.u32" in comp.text("ptx")  # the queue counter
    assert "bar.sync" in comp.text("ptx")  # advance's barrier(sync) with sync = ALL


def test_golden_ir_fragments():
    program = checked(STD)
    module = new_module("g", gpu_target("sm_90a"))
    lowered = lower_scheduler(module, program, SchedulerSpec("Persistent", (("num_ctas", 7),), 64),
                              gpu_target("sm_90a"))
    text = str(module)
    # GPU rule functions are internal, always inlined, and read special registers.
    assert 'define internal void @"Persistent.64.1.num_ctas=7initial_state"' in text
    assert "alwaysinline" in text
    assert "call i32 @\"llvm.nvvm.read.ptx.sreg.nctaid.x\"()" in text
    assert lowered.may_advance is True
    # the prompt offset is the query tile times the tile height
    assert "mul i32" in text and ", 64" in text
    host = new_module("h", HOST)
    lower_scheduler(host, program, SchedulerSpec("Queued", (), 128), HOST)
    host_text = str(host)
    assert "llvm.nvvm" not in host_text  # the host reads block/grid ids from its env
    assert "atomicrmw add" in host_text


def spinning(initial_state_body: str, advance_body: str) -> str:
    """A scheduler with the given initial_state and advance bodies."""
    return STD + f"""scheduler Spin(num_ctas: u32 = 4) {{
    may_advance = true
    schedule = DEFAULT
    grid_dim(batch_size, max_num_prompt_tiles) = (num_ctas, 1, 1)
    initial_state(slots, ts) {{ {initial_state_body} }}
    get_current_work_info(ts, state) = ts.work_info(state.idx, schedule)
    advance(ts, state, pipeline_idx) {{ {advance_body} }}
    unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.idx, schedule))
}}
"""


def test_host_while_loops_burn_fuel():
    """Each iteration of a host `while` burns a unit of the environment's fuel and the loop
    stops when it runs out (the simulator then reports it): with 5 units, a loop that would
    run a million times runs 4."""
    from mhadsl.analysis.simulate import _Env, _State, _TileSummary
    program = checked(spinning(
        "var n = 0\n while n < 1000000 { n += 1 }\n"
        "return State(idx = n, slots = slots, max_idx = 0)", "return none"))
    module = new_module("fuel", HOST)
    rule = lower_scheduler(module, program, SchedulerSpec("Spin"), HOST).functions[
        "initial_state"]
    jit = HostJit(module)
    initial_state = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 4)(jit.address(rule.name))
    env, ts, state, slots = _Env(), _TileSummary(), _State(), (ctypes.c_uint32 * 2)()
    env.fuel = 5
    initial_state(ctypes.byref(env), ctypes.byref(ts), slots, ctypes.byref(state))
    assert (state.idx, env.fuel) == (4, 0)


def test_gpu_work_loop_records_scheduler_faults_and_stops_every_thread():
    """On the GPU the work loop bounds the tiles a CTA takes and each step's `while` fuel;
    past either it writes the fault record (`abi.RECORD_WORD` of the workspace: kind and
    rule, first fault wins; then the host's copy, code last) and a CTA-wide vote ends the
    loop, without a trap. The last thread out resets the queue counter."""
    program = checked(spinning(
        "return State(idx = block_idx.x, slots = slots, max_idx = ts.num_work())",
        "var i = 0\n while i < state.max_idx { i += 1 }\n"
        "state.idx += i + atomic_add(queue, 1) * 0\n"
        "return ts.seq_info(ts.work_info(state.idx, schedule))"))
    target = gpu_target("sm_90a")
    module = new_module("guard", target)
    build_trace_kernel(module, lower_scheduler(module, program, SchedulerSpec("Spin"), target))
    ptx = emit_ptx(optimize(module, target), target)
    kernel, recorder = ptx.split(".entry trace_Spin(")[1].split(".func mhadsl_$_record_fault(")
    recorder, exit_counter = recorder.split(".func mhadsl_$_count_exit(")
    # The record: a compare-and-swap of its first word (the code) in a function of its own,
    # called from one place, where every step (the first rules, each advance) ends at one vote.
    assert re.search(rf"atom\.\w+\.\w+\.global\.cas\.b32\s+%r\d+, \[%rd\d+\+{4 * abi.RECORD_WORD}\], "
                     r"0, %r\d+;", recorder)
    host_copy = re.findall(r"st\.(\w+)\.sys\.global\.u32 \[%rd\d+\+(\d+)\]", recorder)
    assert host_copy == [("relaxed", "4"), ("relaxed", "8"), ("release", "0")]
    # The end: threads counted out (u64), the last resets the counter and the count.
    assert kernel.count("call.uni mhadsl_$_count_exit") == 1
    exits = re.search(rf"atom\.global\.add\.u64\s+%rd\d+, \[(%rd\d+)\+{4 * abi.EXITED_WORD}\]",
                      exit_counter)
    assert exits and re.search(rf"atom\.global\.exch\.b32\s+%r\d+, \[{exits.group(1)}\], 0;",
                               exit_counter.split(exits.group(0))[1])
    assert kernel.count("call.uni mhadsl_$_record_fault") == 1
    assert kernel.count("bar.red.or.pred") == 1
    # The codes it records: too many tiles, or the negated code `loop_fuel` left in the tank.
    assert re.search(rf"\b{abi.fault_code(abi.TOO_MANY_TILES, 'advance')}\b", kernel)
    assert re.search(rf"-{abi.fault_code(abi.ENDLESS_WHILE, 'advance')}\b", kernel)
    assert "trap" not in ptx


@pytest.mark.parametrize("advance, counted", [
    ("state.idx += atomic_add(queue, 1) * 0 + grid_dim.x", True),
    ("state.idx += grid_dim.x", False)])
def test_only_a_kernel_whose_scheduler_reads_the_queue_counts_its_threads_out(advance, counted):
    """The exit count exists to reset the queue counter for the next launch; a scheduler
    that never reads `queue` skips it (its fence and atomics lengthen every CTA's tail)."""
    program = checked(spinning("return State(idx = block_idx.x, slots = slots, max_idx = 0)",
                               advance + "\n return ts.seq_info(ts.work_info(state.idx, schedule))"))
    target = gpu_target("sm_90a")
    module = new_module("exits", target)
    lowered = lower_scheduler(module, program, SchedulerSpec("Spin"), target)
    assert lowered.uses_queue == counted
    build_trace_kernel(module, lowered)
    ptx = emit_ptx(optimize(module, target), target)
    assert ("call.uni mhadsl_$_count_exit" in ptx) == counted
    exit_count = rf"atom\.global\.add\.u64\s+%rd\d+, \[%rd\d+\+{4 * abi.EXITED_WORD}\]"
    assert bool(re.search(exit_count, ptx)) == counted


def test_bad_scheduler_parameter_is_a_user_error():
    from mhadsl.front.diagnostics import MhaError
    with pytest.raises(MhaError, match="has no parameter 'nope'"):
        lower_scheduler(new_module("x", HOST), checked(STD),
                        SchedulerSpec("Queued", (("nope", 1),), 128), HOST)


def test_parse_resources():
    log = """ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 49152 bytes smem
"""
    (k,) = parse_resources(log).values()
    assert (k.registers, k.spill_stores, k.spill_loads, k.stack_bytes, k.shared_bytes) == \
        (255, 8, 4, 16, 49152)
