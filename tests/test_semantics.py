"""The language's integer semantics are defined, and the same in the host JIT (which the
simulator runs), the GPU's IR and the NumPy reference (mhadsl.front.semantics)."""
import ctypes
import math
import operator
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llvmlite import ir

from helpers import STD, checked, host_score
from mhadsl.front.semantics import I32_MAX, I32_MIN, U32_MAX, float_to_int, int_binary
from mhadsl.codegen.scheduler import SchedulerSpec, lower_scheduler
from mhadsl.codegen.trace_kernel import build_trace_kernel
from mhadsl.codegen.nvptx import i32
from mhadsl.codegen.target import gpu_target, new_module, optimize
from mhadsl.front.diagnostics import MhaError
from mhadsl.analysis.reference import evaluate_rule
from mhadsl.analysis.simulate import Batch, HostScheduler, _Env, _TileSummary, simulate
from mhadsl.front.types import I32, U32

SCHEDULER = """
scheduler Eval {{
    may_advance = false
    schedule = DEFAULT
    grid_dim(batch_size, max_num_prompt_tiles) {{
        let x = {ty}(batch_size)
        let y = {ty}(max_num_prompt_tiles)
        return (u32({expr}), 1, 1)
    }}
    initial_state(slots, ts) = State(idx = 0, slots = slots, max_idx = 0)
    get_current_work_info(ts, state) = ts.work_info(state.idx, schedule)
    advance(ts, state, pipeline_idx) = none
    unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.idx, schedule))
}}
"""


def host_jit(expr: str, ty: str):
    """`expr` of x and y (both `ty`) compiled for the host, as the simulator runs rules."""
    sched = HostScheduler(checked(SCHEDULER.format(ty=ty, expr=expr)), SchedulerSpec("Eval"))

    def run(x: int, y: int) -> int:
        env, ts, out = _Env(None, 1), _TileSummary(), (ctypes.c_uint32 * 3)()
        env.fuel = 1000
        sched.grid_dim(ctypes.byref(env), ctypes.byref(ts), x & U32_MAX, y & U32_MAX, out)
        value = out[0]
        return value - 2**32 if ty == "i32" and value > I32_MAX else value
    return run


EDGES = {
    "+": [(I32_MAX, 1), (I32_MIN, -1), (U32_MAX, 1)],
    "-": [(0, 1), (I32_MIN, 1)],
    "*": [(2**31, 2), (65536, 65536), (-3, I32_MAX)],
    "/": [(I32_MIN, -1), (7, 0), (-7, 2), (7, -2), (0, 0)],
    "%": [(I32_MIN, -1), (-7, 0), (-7, 2), (7, -2)],
    "<<": [(1, 31), (1, 32), (1, 40), (3, -1), (U32_MAX, 1)],
    ">>": [(-8, 1), (-8, 32), (-8, 40), (8, 33), (-8, -1), (2**31, 31), (2**31, 32)],
}


@pytest.mark.parametrize("ty", [I32, U32])
@pytest.mark.parametrize("op", EDGES)
def test_host_jit_matches_the_python_meaning(op, ty):
    run = host_jit(f"x {op} y", str(ty))
    for x, y in EDGES[op]:
        x, y = (int_binary("+", v, 0, ty) for v in (x, y))  # as the type holds them
        assert run(x, y) == int_binary(op, x, y, ty), (x, op, y, ty)


def test_the_python_meaning_is_the_documented_one():
    assert int_binary("/", I32_MIN, -1, I32) == I32_MIN
    assert int_binary("%", I32_MIN, -1, I32) == 0
    assert int_binary("/", 5, 0, U32) == 0 and int_binary("%", 5, 0, I32) == 0
    assert int_binary("<<", 1, 32, U32) == 0 and int_binary("<<", 1, 40, I32) == 0
    assert int_binary(">>", -8, 40, I32) == -1 and int_binary(">>", 8, 40, I32) == 0
    assert int_binary(">>", 2**31, 32, U32) == 0
    assert int_binary("+", I32_MAX, 1, I32) == I32_MIN and int_binary("-", 0, 1, U32) == U32_MAX


def test_reference_matches_the_python_meaning():
    program = checked("""
attention a {
    score(s, b, h, q_idx, kv_idx) = f32((q_idx << kv_idx) + (q_idx >> kv_idx) + q_idx / kv_idx)
}""")
    rule = program.attentions["a"].rules[0]
    xs = np.array([[I32_MIN], [-8], [7], [I32_MAX]])
    ys = np.array([[-1, 0, 2, 31, 32, 40]])
    got = evaluate_rule(rule, program, s=0.0, b=0, h=0, q_idx=xs, kv_idx=ys)
    want = [[int_binary("+", int_binary("+", int_binary("<<", x, y, I32),
                                        int_binary(">>", x, y, I32), I32),
                        int_binary("/", x, y, I32), I32) for y in ys[0]] for x in xs[:, 0]]
    assert (got == np.array(want, np.float64)).all()


def test_float_to_int_saturates_the_same_on_the_host():
    run = host_jit("i32(f32(x) * 1.0e10) + i32(f32(y) * -1.0e10) + i32(sqrt(f32(x) - 100.0))",
                   "i32")
    # +inf-ish saturates to I32_MAX, -inf-ish to I32_MIN, NaN (sqrt of a negative) to 0
    assert run(5, 5) == int_binary("+", I32_MAX, I32_MIN, I32)
    assert float_to_int(np.array([1e10, -1e10, np.nan, -2.5]), I32).tolist() == \
        [I32_MAX, I32_MIN, 0, -2]
    assert float_to_int(np.array([-5.0, 1e20]), U32).tolist() == [0, U32_MAX]


@pytest.mark.parametrize("op", ["==", "!=", "<", "<=", ">", ">="])
def test_float_comparisons_with_a_nan_are_ieees_everywhere(op):
    """A comparison with a NaN is false but `!=`, which is true (IEEE 754, NumPy): in the
    host JIT, which lowers rules as the kernels do, and in the reference."""
    meaning = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
               ">": operator.gt, ">=": operator.ge}[op]
    run = host_jit(f"where(sqrt(f32(x) - 100.0) {op} f32(y), 1, 0)", "i32")
    program = checked(f"""
attention a {{
    mask(b, h, q_idx, kv_idx) = sqrt(f32(q_idx) - 100.0) {op} f32(kv_idx)
}}""")
    rule = program.attentions["a"].rules[0]
    for x, y in ((50, 2), (104, 2), (104, 3), (50, 50)):  # sqrt(-50) is a NaN
        want = meaning(math.sqrt(x - 100.0) if x >= 100 else math.nan, float(y))
        assert run(x, y) == int(want), (x, op, y)
        assert bool(evaluate_rule(rule, program, b=0, h=0, q_idx=x, kv_idx=y)) == want


@pytest.mark.parametrize("body, want", [
    ("= where(u32(q_idx - kv_idx) < 100, 1.0, 0.0)", 0.0),  # 4294962313 < 100: unsigned
    ("= f32(u32(kv_idx) % 4294967295)", 4993.0),
    ("= f32(u32(kv_idx) / 4294967295)", 0.0),
    ("= f32((u32(q_idx) - 20) / 2 >> 30)", 1.0),
    ("{ var x = u32(q_idx - kv_idx)\n x /= 2\n return f32(x >> 30) }", 1.0),
    ("{ var x = q_idx - kv_idx\n x /= 2\n return f32(x) }", -2491.0),
])
def test_a_literal_takes_the_other_operands_type_in_rules(body, want):
    """In a mask or score an integer literal beside a u32 is a u32, in the lowering (which
    the kernels run, here JIT-compiled for the host) as in the checker and the reference:
    comparisons, division and compound assignment are unsigned (q_idx 10, kv_idx 4993)."""
    program = checked(f"attention a {{ score(s, b, h, q_idx, kv_idx) {body} }}")
    rule = program.attentions["a"].rules[0]
    assert evaluate_rule(rule, program, s=0.0, b=0, h=0, q_idx=10, kv_idx=4993) == want
    assert host_score(rule, program)(0.0, 0, 0, 10, 4993) == want


# Random integer rules (i32 and u32 mixed through casts, literals at the types' limits, where,
# shifts, division, compound assignment): the lowering the kernels run and the reference
# give the same bits.
INT_ATOMS = ["b", "h", "q_idx", "kv_idx", "0", "1", "-1", "7", "-13", "31", "32", "33",
             "2147483647", "-2147483648", "4294967295", "65537", "u32(q_idx)",
             "u32(q_idx - kv_idx)", "u32(kv_idx - q_idx)", "i32(s)", "u32(s)"]
OPERATORS = ["+", "-", "*", "/", "%", "&", "|", "^", "<<", ">>"]


@st.composite
def int_rules(draw, depth: int = 3):
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        return draw(st.sampled_from(INT_ATOMS))
    a, b = draw(int_rules(depth - 1)), draw(int_rules(depth - 1))
    kind = draw(st.sampled_from(["binary", "literal", "call", "call2", "where", "cast",
                                 "unary"]))
    if kind == "binary":
        return f"({a} {draw(st.sampled_from(OPERATORS))} {b})"
    if kind == "literal":  # (a literal takes the other operand's type)
        op = draw(st.sampled_from(OPERATORS + ["<", ">="]))
        literal = draw(st.sampled_from(["3", "31", "33", "2147483647", "3000000000"]))
        return f"where(u32({a}) {op} {literal}, 1, 0)" if op in ("<", ">=") else \
            f"(u32({a}) {op} {literal})"
    if kind == "call":
        return f"abs({a})"
    if kind == "call2":
        return f"{draw(st.sampled_from(['min', 'max', 'cdiv']))}({a}, {b})"
    if kind == "where":
        cmp = draw(st.sampled_from(["<", "==", ">=", "!="]))
        return f"where({a} {cmp} {b}, {draw(int_rules(depth - 1))}, {b})"
    if kind == "cast":
        return f"{draw(st.sampled_from(['i32', 'u32']))}({a})"
    return f"{draw(st.sampled_from(['-', '~']))}{a}"


@st.composite
def int_bodies(draw):
    if draw(st.booleans()):
        return f"= f32(i32(u32({draw(int_rules())}) & 65535))"
    ty, op = draw(st.sampled_from(["i32", "u32"])), draw(st.sampled_from(OPERATORS))
    return (f"{{ var x = {ty}({draw(int_rules(2))})\n x {op}= {draw(st.sampled_from(INT_ATOMS))}"
            f"\n return f32(i32(u32(x) & 65535)) }}")


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(body=int_bodies(), seed=st.integers(0, 2**32 - 1))
def test_the_lowering_is_the_reference_on_random_integer_rules(body, seed):
    try:
        program = checked(f"attention a {{ score(s, b, h, q_idx, kv_idx) {body} }}")
    except MhaError:
        return  # (a literal that does not fit its type, say)
    rule = program.attentions["a"].rules[0]
    run = host_score(rule, program)
    rng = np.random.default_rng(seed)
    for s in (float(np.float32(rng.uniform(-1e10, 1e10))), 2.5, math.nan, -3e9):
        b, h, q_idx, kv_idx = (int(v) for v in rng.integers(0, (4, 8, 5000, 5000)))
        want = evaluate_rule(rule, program, s=s, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx)
        assert run(s, b, h, q_idx, kv_idx) == want, (body, s, b, h, q_idx, kv_idx)


@st.composite
def logic_bodies(draw):
    """A score choosing between two i32 terms by `&&` and `||` over comparisons of others,
    whose right sides divide by 0, shift past 31 and read the tensor `t` (50 elements)
    past its ends where the left sides decide; reads' indices are sums with constants."""
    def term(depth):
        if depth == 0 or draw(st.integers(0, 3)) == 0:
            return draw(st.sampled_from(["q_idx", "kv_idx", "b", "h", "0", "3", "40"]))
        if draw(st.integers(0, 3)) == 0:
            return f"t[{term(depth - 1)}]"
        return f"({term(depth - 1)} {draw(st.sampled_from(OPERATORS))} {term(depth - 1)})"

    def condition(depth):
        if depth == 0 or draw(st.integers(0, 2)) == 0:
            return f"{term(2)} {draw(st.sampled_from(['<', '==', '>=', '!=']))} {term(2)}"
        return f"({condition(depth - 1)} {draw(st.sampled_from(['&&', '||']))} " \
               f"{condition(depth - 1)})"
    return f"= f32(where({condition(3)}, {term(2)}, {term(1)}) & 65535)"


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(body=logic_bodies(), seed=st.integers(0, 2**32 - 1))
def test_per_element_is_the_reference_on_random_rules(body, seed):
    """Masks and scores evaluate a right side of `&&` and `||` that reads a tensor without
    a branch, and take the constants out of a read's index: the same values as the
    language's meaning, where the right side would divide by 0, shift past 31 or read
    outside the tensor too, and where the index sums wrap."""
    try:
        program = checked(f"attention a(t: i32[_]) {{ score(s, b, h, q_idx, kv_idx) {body} }}")
    except MhaError:
        return
    rule = program.attentions["a"].rules[0]
    rng = np.random.default_rng(seed)
    t = rng.integers(-60, 60, 50).astype(np.int32)
    run = host_score(rule, program, per_element=True, tensors={"t": t})
    for _ in range(4):
        b, h, q_idx, kv_idx = (int(v) for v in rng.integers(0, (4, 8, 64, 64)))
        want = evaluate_rule(rule, program, operands={"t": t.astype(np.int64)}, s=1.5, b=b,
                             h=h, q_idx=q_idx, kv_idx=kv_idx)
        assert run(1.5, b, h, q_idx, kv_idx) == want, (body, b, h, q_idx, kv_idx)


@st.composite
def sums(draw, depth: int = 3):
    """An add/subtract tree over x, y, z and i32 constants: (builder -> IR value, its
    value as a function of (x, y, z), wrapped)."""
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        leaf = draw(st.sampled_from(["x", "y", "z", "c"]))
        if leaf == "c":
            c = draw(st.integers(-2**31, 2**31 - 1))
            return (lambda b, args: i32(c)), (lambda xyz: c)
        k = "xyz".index(leaf)
        return (lambda b, args: args[k]), (lambda xyz: xyz[k])
    (emit_l, value_l), (emit_r, value_r) = draw(sums(depth - 1)), draw(sums(depth - 1))
    op = draw(st.sampled_from(["+", "-"]))
    sign = 1 if op == "+" else -1
    return ((lambda b, args: (b.add if op == "+" else b.sub)(emit_l(b, args), emit_r(b, args))),
            (lambda xyz: value_l(xyz) + sign * value_r(xyz)))


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(left=sums(), right=sums(), op=st.sampled_from(["+", "-"]),
       xyz=st.tuples(*[st.integers(-2**31, 2**31 - 1)] * 3))
def test_a_sum_with_its_constants_taken_out_is_the_sum(left, right, op, xyz):
    """`FunctionLowering.offset_sum` (a tensor read's index in a mask or score): the wrapped
    sum or difference, whatever the constants and terms under either side."""
    from mhadsl.codegen.lower import Builtins, FunctionLowering
    from mhadsl.codegen.target import HOST, HostJit
    module = new_module("sum", HOST)
    fn = ir.Function(module, ir.FunctionType(i32, [i32] * 3), "sum")
    b = ir.IRBuilder(fn.append_basic_block())
    lower = FunctionLowering(b, checked("attention a { }"), Builtins(), {}, per_element=True)
    b.ret(lower.offset_sum(op, left[0](b, fn.args), right[0](b, fn.args)))
    jit = HostJit(module)
    run = ctypes.CFUNCTYPE(ctypes.c_int32, *[ctypes.c_int32] * 3)(jit.address("sum"))
    sign = 1 if op == "+" else -1
    want = (left[1](xyz) + sign * right[1](xyz) + 2**31) % 2**32 - 2**31
    assert run(*xyz) == want


def test_a_mask_reading_a_tensor_has_no_branch():
    """A packed-document mask lowers to selects: no branch per element (the right side of
    its `&&` reads the tensor, which stays inside it whatever the index), while a
    scheduler rule's `&&` keeps its short circuit."""
    from mhadsl.codegen.kernel import MASK_ROLES, expr_hooks
    from mhadsl.codegen.nvptx import ptr
    from mhadsl.front.attention_spec import resolve_attention
    program = checked(STD + """
attention docs(doc: i32[batch, _]) {
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && doc[b][q_idx] == doc[b][kv_idx]
}""")
    options = resolve_attention(program.attentions["docs"])
    hooks = expr_hooks(program, options.mask, None, options.operands)
    module = new_module("t", gpu_target("sm_90a"))
    params = [i32] * len(MASK_ROLES) + [ptr(1) if p.kind == "ptr" else i32
                                         for p in hooks.operands]
    fn = ir.Function(module, ir.FunctionType(ir.IntType(1), params), "keeps")
    for arg, param in zip(fn.args[len(MASK_ROLES):], hooks.operands):
        arg.name = param.name
    b = ir.IRBuilder(fn.append_basic_block())
    b.ret(hooks.mask(b, *fn.args[:len(MASK_ROLES)]))
    text = str(module)
    assert "ld.global.nc.b32" in text and "br i1" not in text, text  # (a predicated load)
    assert "br i1" in gpu_ir("state.idx += where(grid_dim.x > 1 && block_idx.y < 2, 1, 0)",
                             optimized=False)


def test_the_elements_of_a_diagonal_read_one_address():
    """`examples/relative_bias.mha`'s Hopper kernel reads its table once per diagonal of
    a thread's elements, not once per element: the sums' constants are taken out of
    `q_idx - kv_idx`, so LLVM merges the loads of elements whose rows and keys differ
    by the same amount (a thread's 64 elements of a 128 x 128 tile lie on 34 diagonals;
    the score runs in two places, full tiles and partial ones). Each load is predicated
    and its address is one multiply-add from the place's shared row address (no select
    of an address per element). So the wide tile assembles without spills, with Q in
    shared memory (`sm90._q_and_tiles`)."""
    from helpers import REPO
    import mhadsl
    kern = mhadsl.compile(REPO / "examples" / "relative_bias.mha")["relative_bias"]
    build = kern.build("sm_90a")
    assert (build.config.block_m, build.config.block_n) == (128, 128)
    assert not build.config.q_in_registers
    kernel = build.ptx[build.ptx.index(".entry mha_fwd_sm90"):]
    assert kernel.count("ld.global.nc") == 2 * 34
    loads = re.findall(r"mov\.b64 %a, (%rd\d+); (.*?)mov\.b32 %r\d+, 0; "
                       r"@%p\d+ ld\.global\.nc\.b32", kernel)
    assert len(loads) == 2 * 34
    assert len({row for row, _ in loads}) == 2  # one row address per place
    assert max(offset.count("mad.wide.s32") for _, offset in loads) == 1
    assert "selp.b64" not in kernel


def gpu_ir(body: str, optimized: bool = True) -> str:
    from test_simulate import persistent_variant
    program = checked(persistent_variant(body))
    target = gpu_target("sm_80")
    module = new_module("t", target)
    lowered = lower_scheduler(module, program, SchedulerSpec("Wrong", (), 128), target)
    build_trace_kernel(module, lowered)
    return str(optimize(module, target)) if optimized else str(module)


def test_gpu_ir_keeps_the_shift_guard():
    """After O3 the GPU's IR still selects 0 for a count of 32 or more (PTX's shl.b32
    itself clamps such counts to 32, so the backend may then fold the select away)."""
    text = gpu_ir("state.idx += grid_dim.x << block_idx.y")
    shl = re.search(r"(%[\w.]+) = shl i32 %[\w.]+, (%[\w.]+)\n", text)
    assert shl, "no variable shift"
    assert re.search(rf"icmp (samesign )?ugt i32 {re.escape(shl.group(2))}, 31", text)
    assert re.search(rf"select i1 %[\w.]+, i32 0, i32 {re.escape(shl.group(1))}\b", text)


def test_gpu_ir_guards_signed_division():
    text = gpu_ir("state.idx += grid_dim.x + u32(i32(state.idx) / (i32(block_idx.z) - 1))")
    assert "icmp eq i32" in text and re.search(r"sdiv i32 %[\w.]+, %[\w.]+", text)
    assert re.search(r"icmp eq i32 %[\w.]+, -2147483648", text)  # the INT_MIN / -1 guard


# ------------------------------------------------------------------ edge cases in scheduler rules
def persistent(body: str, extra_params: str = "") -> str:
    from test_simulate import persistent_variant
    text = persistent_variant(body)
    return text.replace("scheduler Wrong {", f"scheduler Wrong({extra_params}) {{") \
        if extra_params else text


MUST_SHOW = Batch([0, 1, 127, 128, 129, 3000, 8192], heads=5, tile=128, ragged=True)


def run(text: str, args=()) -> object:
    return simulate(checked(text), SchedulerSpec("Wrong", args, 128), MUST_SHOW, ctas=7)


def test_shift_by_40_is_defined_not_a_crash():
    result = run(persistent("state.idx += grid_dim.x << 40"))  # adds 0: never ends
    assert not result.terminated and "does not terminate" in result.message
    assert result.efficiency is None


def test_param_shift_by_32_is_defined():
    text = persistent("state.idx += (grid_dim.x << s) + grid_dim.x", "s: u32 = 0")
    assert run(text, (("s", 32),)).covered_exactly_once
    assert run(text, (("s", 1),)).covered_exactly_once is False  # a real shift skips tiles


def test_int_min_divided_by_minus_one_is_int_min():
    body = ("let m = i32(2147483648)\n"
            "state.idx += grid_dim.x + u32(m / (i32(pipeline_idx) * 0 - 1) - m)")
    assert run(persistent(body)).covered_exactly_once


def test_constant_slot_index_out_of_range_is_a_diagnostic():
    with pytest.raises(MhaError, match=r"test.mha:\d+:\d+: error: slot index 1000000000 is "
                                       r"out of range: a CTA has 2 slots"):
        checked(persistent("state.slots[1000000000] = 7\nstate.idx += grid_dim.x"))


def test_run_time_slot_index_wraps():
    """`slots[pipeline_idx + 2]` is `slots[pipeline_idx]` on the host and the GPU alike."""
    text = STD + """
scheduler Wrong(num_ctas: u32 = 7) {
    may_advance = true
    schedule = DEFAULT
    grid_dim(batch_size, max_num_prompt_tiles) = (num_ctas, 1, 1)
    initial_state(slots, ts) = State(idx = block_idx.x, slots = slots, max_idx = ts.num_work())
    get_current_work_info(ts, state) = ts.work_info(state.idx, schedule)
    advance(ts, state, pipeline_idx) {
        state.slots[pipeline_idx + 2] = state.idx + grid_dim.x
        state.idx = state.slots[pipeline_idx]
        if state.idx >= state.max_idx { return none }
        return ts.seq_info(ts.work_info(state.idx, schedule))
    }
    unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.idx, schedule))
}"""
    assert run(text).covered_exactly_once
    ir_text = gpu_ir("state.slots[pipeline_idx + 2] = 7\nstate.idx += grid_dim.x", False)
    assert re.search(r'urem i32 %"?[\w.]+"?, 2\n', ir_text)  # the same lowering as the host's


@pytest.mark.parametrize("source, message", [
    ("let x: i32 = 3000000000", "integer constant 3000000000 does not fit in i32"),
    ("let x = -1", "integer constant -1 does not fit in u32"),
    ("state.idx += 5000000000", "integer constant 5000000000 does not fit in u32"),
    ("let x = 1 << 70", "constant expression does not fit in 64 bits"),
    ("let x = 1 << -1", "negative shift count"),
    ("let x = 18446744073709551616", "integer constant does not fit in 64 bits"),
])
def test_literals_past_their_type_are_diagnostics(source, message):
    with pytest.raises(MhaError, match=re.escape(message)):
        checked(persistent(source + "\nstate.idx += grid_dim.x"))


def test_literal_expressions_are_exact_then_wrap_only_when_cast():
    run = host_jit("x + (1 << 40 >> 38) + u32(-1) + y", "u32")  # 4, then 0xFFFFFFFF wraps
    assert run(10, 0) == 13
    program = checked("attention a {\n mask(b, h, q_idx, kv_idx) = -1 < 1 && "
                      "(1 << 40) / 1024 == 1073741824\n}")
    assert evaluate_rule(program.attentions["a"].rules[0], program, q_idx=0, kv_idx=0)


@pytest.mark.parametrize("advance, ok", [
    ("if producer { barrier(sync) }", True),
    ("if sync == ALL && !producer { barrier(sync) }", True),
    ("if thread_idx.x == 0 { barrier(sync) }", False),
    ("while state.idx < 3 { barrier(sync)\n state.idx += 1 }", False),
    ("if state.idx > 99 { return none }\n barrier(sync)", False),
    ("barrier(sync)\n if state.idx > 99 { return none }", True),
])
def test_barrier_only_where_every_thread_reaches_it(advance, ok):
    text = persistent(advance + "\nstate.idx += grid_dim.x")
    if ok:
        checked(text)
    else:
        with pytest.raises(MhaError, match="every thread of the CTA must reach it"):
            checked(text)
