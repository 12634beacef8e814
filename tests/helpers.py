"""Small helpers shared by the tests."""
import ctypes
import threading
from pathlib import Path

import pytest
from llvmlite import ir

from mhadsl.codegen.kernel import SCORE_ROLES
from mhadsl.codegen.lower import Builtins, FunctionLowering
from mhadsl.codegen.nvptx import f32, i32
from mhadsl.codegen.target import HOST, HostJit, new_module
from mhadsl.front.check import CheckedProgram
from mhadsl.front.types import F32, I32
from mhadsl.pipeline import front_end

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.mha"))
STD = 'import "std/schedulers.mha"\n'


def checked(text: str, name: str = "test.mha") -> CheckedProgram:
    return front_end(text, name, REPO)[1]


def finishes_within(seconds: float, work):
    """`work()`'s result, or a test failure when it has not returned after `seconds` (it
    is left running on a daemon thread: a read that blocks for good cannot be interrupted)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(work()), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running after {seconds} s")
    assert result, "it raised (see the thread's traceback above)"
    return result[0]


def fake_launcher(launch, grid_dependent: list | None = None):
    """A fake `driver.Function.launcher` that calls `launch(grid, threads, shared_bytes,
    stream, params)` at each launch (when the plan's parameter block holds the call's), and
    appends to `grid_dependent` whether each launch was planned grid-dependent."""
    def launcher(grid, threads, shared_bytes, params, dependent=False):
        def run(stream):
            if grid_dependent is not None:
                grid_dependent.append(dependent)
            launch(grid, threads, shared_bytes, stream, params)
        return run
    return launcher


def host_score(rule, program, per_element: bool = False, tensors: dict | None = None):
    """`rule` lowered through the LLVM lowering and compiled for the host (f32, libm math),
    as a Python callable of (s, b, h, q_idx, kv_idx); it keeps its JIT alive. `per_element`:
    as a mask or score hook lowers it (`FunctionLowering.per_element`). `tensors`: the
    declaration's i32 tensor operands by name, C-contiguous int32 arrays."""
    from mhadsl.codegen.kernel import TensorArgs
    from mhadsl.front.attention_spec import operand_key
    module = new_module("score", HOST)
    fn = ir.Function(module, ir.FunctionType(f32, [f32] + [i32] * 4), "score")
    builder = ir.IRBuilder(fn.append_basic_block())
    bindings = dict(zip(SCORE_ROLES, fn.args))
    for name, array in (tensors or {}).items():
        address = builder.inttoptr(ir.Constant(ir.IntType(64), array.ctypes.data),
                                   ir.PointerType(i32))
        bindings[operand_key(name)] = TensorArgs(
            address, tuple(i32(n) for n in array.shape),
            tuple(i32(n // array.itemsize) for n in array.strides))
    lower = FunctionLowering(builder, program, Builtins(), bindings, default_int=I32,
                             per_element=per_element, branch_free_reads=per_element)
    builder.ret(lower.load_value(lower.lower_body(rule.body, F32)))
    jit = HostJit(module)
    call = ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_float, *[ctypes.c_int32] * 4)(
        jit.address("score"))
    return lambda *args: (jit, tensors, call(*args))[2]
