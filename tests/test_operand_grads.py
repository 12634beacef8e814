"""Gradients of the f32 tensors a score reads, without a GPU: the derivative with respect to
one read (`differentiate_score(..., read)`), the float64 reference's gradients against
central differences of the reference forward (dense, ragged, reads along the query rows,
slopes that depend on s, reads on s's branches), the backward build that adds them
(`mha_bwd_operand_grads`: a predicated reduction per read and pair, 0 spills on sm_80 and
sm_90a, the sm80-style design on Hopper too), and the call's refusals before anything
runs."""
import numpy as np
import pytest

import mhadsl
from helpers import REPO, STD
from mhadsl.front.attention_spec import RULE_ROLES, read_over_tile
from mhadsl.front.check import ATTENTION_RULES
from mhadsl.analysis.derivative import differentiate_score, float_reads, read_operand
from mhadsl.analysis.reference import attention_reference, evaluate_rule
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.codegen.backends.backward import ABI, OPERAND_GRADS
from mhadsl.front.diagnostics import MhaError
from mhadsl.abi import declaration_params, float_tensors, with_operands
from mhadsl.codegen import backends

from mhadsl.host.calls import check_operand_grads, score_read_floats
from test_abi import ptx_params

needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="ptxas not found")

# (the GPU tests, tests/test_gpu_operand_grads.py, run these too)
SCORES = """
import "std/schedulers.mha"
attention scaled(gain: f32[heads]) {
    dtype = bf16
    head_dim = 64
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
    score(s, b, h, q_idx, kv_idx) = s * gain[h]
}
attention capped(table: f32[heads, _]) {
    dtype = bf16
    head_dim = 128
    score(s, b, h, q_idx, kv_idx) = 4.0 * tanh((s + table[h][kv_idx - q_idx + 512]) / 4.0)
}
attention branchy(low: f32[heads], high: f32[heads]) {
    dtype = bf16
    head_dim = 64
    score(s, b, h, q_idx, kv_idx) {
        if s > 0.0 {
            return s * high[h]
        }
        return s + low[h] * 2.0
    }
}
attention log_prior(prior: f32[heads, keys]) {
    dtype = bf16
    head_dim = 64
    score(s, b, h, q_idx, kv_idx) = s + log(prior[h][kv_idx])
}
attention row_gain(gain: f32[queries]) {
    dtype = bf16
    head_dim = 64
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
    score(s, b, h, q_idx, kv_idx) = s * gain[q_idx]
}
"""


def scores():
    return mhadsl.compile(SCORES, name="scores.mha")


def relative_bias():
    return mhadsl.compile(REPO / "examples" / "relative_bias.mha")["relative_bias"]


# ---------------------------------------------------------------- the derivative of a read
def test_the_derivative_with_respect_to_a_read():
    kern = scores()["scaled"]
    program, rule = kern.program.checked, kern.options.score
    (read,) = float_reads(rule, program)
    assert read_operand(read) == "gain"
    slope = differentiate_score(rule, program, read)
    s = np.array([[-2.0, 0.5, 3.0]])
    gain = np.array([1.5, -4.0])
    for h in (0, 1):  # d (s * gain[h]) / d gain[h] = s; d / ds = gain[h]
        np.testing.assert_array_equal(evaluate_rule(*slope, {"gain": gain}, s=s, h=h), s)
        np.testing.assert_array_equal(evaluate_rule(
            *differentiate_score(rule, program), {"gain": gain}, s=s, h=h), gain[h] + 0 * s)


def test_branches_give_each_read_its_own_path():
    kern = scores()["branchy"]
    program, rule = kern.program.checked, kern.options.score
    low, high = float_reads(rule, program)[::-1] if read_operand(
        float_reads(rule, program)[0]) == "high" else float_reads(rule, program)
    s = np.array([-1.0, 2.0])
    values = {"low": np.array([0.0]), "high": np.array([0.0])}
    np.testing.assert_array_equal(evaluate_rule(*differentiate_score(rule, program, high),
                                                values, s=s, h=0), [0.0, 2.0])
    np.testing.assert_array_equal(evaluate_rule(*differentiate_score(rule, program, low),
                                                values, s=s, h=0), [2.0, 0.0])


def test_a_read_the_score_makes_an_integer_of_cannot_be_differentiated():
    program = mhadsl.compile("""
import "std/schedulers.mha"
attention bucketed(t: f32[heads], bins: f32[_]) {
    dtype = bf16
    head_dim = 64
    score(s, b, h, q_idx, kv_idx) = s + bins[i32(t[h])]
}
""", name="bucketed.mha")["bucketed"]
    rule, checked = program.options.score, program.program.checked
    reads = {read_operand(r): r for r in float_reads(rule, checked)}
    with pytest.raises(MhaError, match="operand 't': 'i32' makes an integer") as err:
        differentiate_score(rule, checked, reads["t"])
    assert err.value.diagnostics[0].span.line == 6
    differentiate_score(rule, checked, reads["bins"])  # (bins' element itself is fine)
    with pytest.raises(ValueError, match="(?s)cannot be differentiated.*bucketed.mha:6:46"):
        check_operand_grads(program.options, checked, ("t",))
    assert check_operand_grads(program.options, checked, ("bins",)) == ("bins",)
    # the build adds what it can differentiate: bins' gradient, none of t's
    build = program.backward_build("sm_80", operand_grads=True)
    grads = build.ptx[build.ptx.index(f".entry {OPERAND_GRADS}"):]
    assert grads.count("red.global.add.f32") == 32


def test_a_gradient_parameter_never_meets_an_operand_of_the_same_name():
    kern = mhadsl.compile(STD + """
attention named(table: f32[heads, _], grad_table: f32[heads], operand_grad_table: f32[_]) {
    dtype = bf16
    head_dim = 64
    score(s, b, h, q_idx, kv_idx) = s + table[h][0] + grad_table[h] + operand_grad_table[0]
}
""", name="named.mha")["named"]
    names = [p.name for p in declaration_params(kern.options, "backward", operand_grads=True)]
    assert len(names) == len(set(names))


# ---------------------------------------------------------------- the reference
def _loss_and_grads(kern, args: dict, dout, names, operands: dict, ragged=None):
    """The reference's operand gradients and a function giving <O, dout> for new operand
    values (float64)."""
    offsets = {} if ragged is None else dict(cu_seqlens_q=ragged, cu_seqlens_k=ragged)
    *_, grads = mhadsl.reference_backward(kern, **args, dout=dout, operand_grads=names,
                                          **offsets, **operands)
    opts = kern.options

    def loss(values: dict) -> float:
        from mhadsl.analysis.reference import _Positions
        axes = {o.name: o.axes for o in opts.operands}
        wrapped = {n: _Positions(v, axes[n], (True, True))
                   if ragged is not None and {"queries", "keys"} & set(axes[n]) else v
                   for n, v in values.items()}
        out = attention_reference(*(args[n].astype(np.float64) for n in ("q", "k", "v")),
                                  mask_rule=opts.mask, score_rule=opts.score,
                                  program=kern.program.checked, operands=wrapped, **offsets)
        return float((out * dout).sum())
    return loss, grads


def _central_differences(loss, operands: dict, name: str, step=1e-6) -> np.ndarray:
    base = {n: np.asarray(v, np.float64) for n, v in operands.items()}
    out = np.zeros_like(base[name])
    for idx in np.ndindex(*out.shape):
        up, down = dict(base), dict(base)
        up[name], down[name] = base[name].copy(), base[name].copy()
        up[name][idx] += step
        down[name][idx] -= step
        out[idx] = (loss(up) - loss(down)) / (2 * step)
    return out


def _tensors(rng, shape_q, shape_kv, d):
    return dict(q=rng.standard_normal((*shape_q, d)).astype(np.float32),
                k=rng.standard_normal((*shape_kv, d)).astype(np.float32),
                v=rng.standard_normal((*shape_kv, d)).astype(np.float32))


CASES = [  # (kernel, its operands, dense (B, S) or ragged lengths, heads, kv heads)
    ("relative_bias", lambda r: {"table": r.standard_normal((4, 6))}, (2, 7), 4, 2),
    ("scaled", lambda r: {"gain": r.random(2) + 0.5}, (2, 6), 2, 2),
    ("capped", lambda r: {"table": r.standard_normal((2, 1024))}, (1, 5), 2, 1),
    ("branchy", lambda r: {"low": r.standard_normal(2), "high": r.standard_normal(2)},
     (2, 6), 2, 2),
    ("relative_bias", lambda r: {"table": r.standard_normal((2, 9))}, [3, 0, 1, 8], 2, 2),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_gradients_are_the_forwards_central_differences(case):
    name, make, shape, hq, hkv = CASES[case]
    kern = relative_bias() if name == "relative_bias" else scores()[name]
    rng = np.random.default_rng(case)
    d = kern.options.head_dim
    if isinstance(shape, list):
        cu = np.concatenate([[0], np.cumsum(shape)]).astype(np.int32)
        args = _tensors(rng, (int(cu[-1]), hq), (int(cu[-1]), hkv), d)
    else:
        cu = None
        args = _tensors(rng, (*shape, hq), (*shape, hkv), d)
    operands = {n: v.astype(np.float32) for n, v in make(rng).items()}
    dout = rng.standard_normal(args["q"].shape)
    loss, grads = _loss_and_grads(kern, args, dout, tuple(operands), operands, cu)
    moved = 0
    for n in operands:
        want = _central_differences(loss, operands, n)
        np.testing.assert_allclose(grads[n], want, atol=1e-6, rtol=1e-5)
        moved += np.abs(want).max() > 1e-3
    assert moved  # (the check is not 0 == 0)


def test_a_gain_along_the_query_rows_of_a_ragged_batch():
    kern = scores()["row_gain"]
    rng = np.random.default_rng(7)
    lens = [2, 0, 5]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    args = _tensors(rng, (7, 2), (7, 2), 64)
    gain = (rng.random(7) + 0.5).astype(np.float32)
    dout = rng.standard_normal(args["q"].shape)
    loss, grads = _loss_and_grads(kern, args, dout, ("gain",), {"gain": gain}, cu)
    want = _central_differences(loss, {"gain": gain}, "gain")
    np.testing.assert_allclose(grads["gain"], want, atol=1e-6)
    assert abs(grads["gain"][0]) < 1e-12 and np.abs(want[1:]).max() > 1e-2  # (row 0: P = 1)


# ---------------------------------------------------------------- the build
def test_which_reads_are_one_element_over_a_tile():
    """By the parameters' roles, whatever the rule names them (`b` here is q_idx's)."""
    program = mhadsl.compile(STD + """
attention renamed(t: f32[_], u: f32[heads, _], n: i32) {
    dtype = bf16
    head_dim = 64
    score(s, x, y, b, h) = s + t[b] + u[y][n] + u[y][seqlen_q - 1] + u[y][h]
}
""", name="renamed.mha")["renamed"]
    rule, operands = program.options.score, program.options.operands
    reads = float_reads(rule, program.program.checked)
    assert [read_over_tile(r, rule, operands) for r in reads] == [False, True, True, False]
    assert RULE_ROLES == {name: tuple(role for role, _ in max(shapes, key=len))
                          for name, shapes in ATTENTION_RULES.items()}


@needs_ptxas
@pytest.mark.parametrize("name, ragged, arch", [
    ("relative_bias", False, "sm_80"), ("relative_bias", False, "sm_90a"),
    ("relative_bias", True, "sm_90a"), ("capped", False, "sm_90a"), ("branchy", True, "sm_80"),
    ("row_gain", True, "sm_90a"), ("scaled", True, "sm_90a")])
def test_the_build_that_adds_operand_gradients(name, ragged, arch):
    kern = relative_bias() if name == "relative_bias" else scores()[name]
    group = 2 if name == "relative_bias" else 1
    build = kern.backward_build(arch, gqa_group=group, ragged=ragged, operand_grads=True)
    plain = kern.build(arch, gqa_group=group, ragged=ragged, backward=True, backend="backward")
    assert build.backend == "backward" and build.config.operand_grads
    assert set(build.assembled.kernels) == set(plain.assembled.kernels) | {OPERAND_GRADS}
    for resources in build.assembled.kernels.values():
        assert resources.spills == 0 and resources.stack_bytes == 0, resources
    grads = build.ptx[build.ptx.index(f".entry {OPERAND_GRADS}"):]
    assert "mma.sync.aligned.m16n8k16.row.col.f32" in grads
    # a predicated reduction per read and pair of this thread's tile (16 rows x 64 keys
    # over 32 lanes at head dim 64 and 128 alike); one per warp for a read of one element
    # over the tile, after a warp sum; none elsewhere
    rule, opts = kern.options.score, kern.options
    over_tile = [read_over_tile(r, rule, opts.operands)
                 for r in float_reads(rule, kern.program.checked)]
    assert any(over_tile) == (name in ("scaled", "branchy"))
    reductions = sum(1 if over else 32 for over in over_tile)
    assert grads.count("red.global.add.f32") == reductions
    assert build.ptx.count("red.global.add.f32") == reductions
    assert grads.count("shfl.sync.bfly") == 5 * sum(over_tile)
    # every kernel of the build takes the gradients' addresses last, one per f32 tensor
    takes = declaration_params(kern.options, "backward", operand_grads=True)
    assert [p.name for p in takes[-len(float_tensors(kern.options.operands)):]] == [
        f"grad_{n}" for n in float_tensors(kern.options.operands)]
    for name in build.assembled.kernels:
        want = with_operands(backends.backend("backward").kernels(build.config)[0].abi
                             if name == "mha_bwd_preprocess" else ABI, takes)
        assert len(ptx_params(build.ptx, name)) == len(want.params), name


def test_an_operand_grads_build_is_a_backward_one_of_a_score_that_reads_floats():
    kern = relative_bias()
    with pytest.raises(ValueError, match="backward build's"):
        kern.build("sm_90a", operand_grads=True)
    plain = mhadsl.compile(REPO / "examples" / "document_mask.mha")["document_mask"]
    with pytest.raises(ValueError, match="no score rule that reads an f32 tensor"):
        plain.backward_build("sm_90a", operand_grads=True)
    with pytest.raises(TypeError, match="operand_grads must be True or False"):
        kern.backward_build("sm_90a", operand_grads="yes")


# ---------------------------------------------------------------- the call's checks
def test_which_operands_have_gradients():
    kern = relative_bias()
    opts, program = kern.options, kern.program.checked
    assert check_operand_grads(opts, program, ()) == ()
    assert check_operand_grads(opts, program, ["table"]) == ("table",)
    with pytest.raises(TypeError, match="no operand 'bias'"):
        check_operand_grads(opts, program, ("bias",))
    with pytest.raises(TypeError, match="operand names"):
        check_operand_grads(opts, program, "table")
    docs = mhadsl.compile(REPO / "examples" / "document_mask.mha")["document_mask"]
    (doc,) = (o.name for o in docs.options.operands)
    with pytest.raises(ValueError, match="only f32 tensor operands"):
        check_operand_grads(docs.options, docs.program.checked, (doc,))
    sinks = mhadsl.compile(REPO / "examples" / "sinks.mha")["sinks"]
    with pytest.raises(ValueError, match="sink rule reads 'sink_logits'"):
        check_operand_grads(sinks.options, sinks.program.checked, ("sink_logits",))
    branchy = scores()["branchy"]
    assert score_read_floats(branchy.options, branchy.program.checked) == ("low", "high")


def test_a_read_passed_to_a_fn_is_named_when_its_gradient_is_asked_for():
    kern = mhadsl.compile("""
import "std/schedulers.mha"
fn shifted(s: f32, x: f32) -> f32 { return s + x }
attention through_fn(t: f32[heads], u: f32[heads]) {
    dtype = bf16
    head_dim = 64
    score(s, b, h, q_idx, kv_idx) = shifted(s, t[h]) + u[h]
}
""", name="fn.mha")["through_fn"]
    opts, program = kern.options, kern.program.checked
    assert check_operand_grads(opts, program, ("u",)) == ("u",)
    with pytest.raises(ValueError, match=r"fn.mha:7:37: error: cannot differentiate the score "
                                         r"through fn 'shifted'"):
        check_operand_grads(opts, program, ("t",))
    with pytest.raises(ValueError, match="through fn 'shifted'"):  # (asked again: same answer)
        check_operand_grads(opts, program, ("t", "u"))


def test_a_declarations_score_is_differentiated_once(monkeypatch):
    """Every backward call checks its operand_grads; the derivatives behind that answer are
    worked out at the first call of a declaration, not at each."""
    from mhadsl.analysis import derivative
    calls = []

    def counted(*args):
        calls.append(args)
        return differentiate_score(*args)
    monkeypatch.setattr(derivative, "differentiate_score", counted)
    kern = scores()["branchy"]
    opts, program = kern.options, kern.program.checked
    for _ in range(3):
        assert check_operand_grads(opts, program, ("low", "high")) == ("low", "high")
        assert score_read_floats(opts, program) == ("low", "high")
    assert len(calls) == len(float_reads(opts.score, program)) > 0


def test_reference_backward_refuses_what_the_call_refuses():
    kern = relative_bias()
    rng = np.random.default_rng(0)
    args = _tensors(rng, (1, 4, 8), (1, 4, 8), 128)
    dout = rng.standard_normal(args["q"].shape)
    table = rng.standard_normal((8, 4)).astype(np.float32)
    with pytest.raises(TypeError, match="no operand 'tabel'"):
        mhadsl.reference_backward(kern, **args, dout=dout, table=table,
                                  operand_grads=("tabel",))
    assert len(mhadsl.reference_backward(kern, **args, dout=dout, table=table)) == 3


# ---------------------------------------------------------------- the scatter, on the host
HOST_SCORE = STD + """
attention per_pair(table: f32[heads, _], hi: f32[_], lo: f32[_], n: i32) {
    dtype = bf16
    head_dim = 64
    score(s, b, h, q_idx, kv_idx) {
        let x = s + table[h][q_idx - kv_idx + n]
        if s > 0.0 {
            return x * x + hi[kv_idx]
        }
        return x * lo[q_idx] * 2.0
    }
}
"""


def test_the_scatter_adds_each_pairs_terms_where_its_reads_pick():
    """The kernels' scatter hook (`codegen.kernel.scatter_hook`), compiled for the host with
    a plain add for the GPU's predicated reduction, over random pairs: each pair adds dz *
    d score / d each element into the element it reads, on the branch the pair takes, where
    the read is inside its tensor, as the reference's evaluation gives them; a gradient
    whose address is null gets nothing."""
    import ctypes

    from llvmlite import binding, ir

    from mhadsl.codegen import signature
    from mhadsl.codegen.kernel import scatter_hook

    kern = mhadsl.compile(HOST_SCORE, name="host.mha")["per_pair"]
    opts, program = kern.options, kern.program.checked
    params = declaration_params(opts, "backward", operand_grads=True)
    f32, i32 = ir.FloatType(), ir.IntType(32)
    module = ir.Module("scatter")
    module.triple = binding.get_default_triple()
    spare = ir.GlobalVariable(module, f32, "spare")  # where a predicated-off term goes
    spare.initializer = ir.Constant(f32, 0.0)
    types = [ir.PointerType() if p.kind == "ptr" else signature.llvm_type(p) for p in params]
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), types + [f32, f32, i32, i32, i32,
                                                                       i32]), "scatter")
    for p, arg in zip(params, fn.args):
        arg.name = p.name
    dz, s, b, h, q, k = fn.args[-6:]
    builder = ir.IRBuilder(fn.append_basic_block("entry"))

    def add_if(bb, pointer, value, predicate):
        at = bb.select(predicate, pointer, bb.bitcast(spare, pointer.type))
        bb.store(bb.fadd(bb.load(at, typ=f32), value), at)
    scatter_hook(program, opts.score, opts.operands, add_if)(builder, [(dz, s, q, k)], b, h)
    builder.ret_void()
    binding.initialize_native_target()
    binding.initialize_native_asmprinter()
    machine = binding.Target.from_default_triple().create_target_machine()
    engine = binding.create_mcjit_compiler(binding.parse_assembly(str(module)), machine)
    engine.finalize_object()
    kinds = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32}
    run = ctypes.CFUNCTYPE(None, *[kinds[p.kind] for p in params], ctypes.c_float,
                           ctypes.c_float, *[ctypes.c_int32] * 4)(
        engine.get_function_address("scatter"))

    rng = np.random.default_rng(3)
    shapes = {"table": (3, 20), "hi": (12,), "lo": (9,)}
    tensors = {n: rng.standard_normal(shape).astype(np.float32) for n, shape in shapes.items()}
    grads = {n: np.zeros(shape, np.float32) for n, shape in shapes.items()}
    scalars = {"n": 4}
    values = {}
    for name, t in tensors.items():
        values[f"operand_{name}"] = t.ctypes.data
        for axis, (size, stride) in enumerate(zip(t.shape, t.strides)):
            values[f"operand_{name}_size{axis}"] = size
            values[f"operand_{name}_stride{axis}"] = stride // 4
        values[f"grad_{name}"] = grads[name].ctypes.data if name != "lo" else None
    values["operand_n"] = scalars["n"]
    pairs = 400
    pair = dict(dz=rng.standard_normal(pairs).astype(np.float32),
                s=rng.standard_normal(pairs).astype(np.float32),
                b=np.zeros(pairs, int), h=rng.integers(0, 4, pairs),  # (h 3: past table's)
                q_idx=rng.integers(0, 14, pairs), kv_idx=rng.integers(0, 14, pairs))
    pair["dz"][:40] = 0.0
    for i in range(pairs):
        run(*[values[p.name] for p in params], *(pair[n][i].item() for n in
                                                ("dz", "s", "b", "h", "q_idx", "kv_idx")))

    # the reference's terms at the same pairs (float64), at the elements the reads pick
    rule = opts.score
    env = {**{n: t.astype(np.float64) for n, t in tensors.items()}, **scalars}
    roles = {n: pair[n] for n in ("b", "h", "q_idx", "kv_idx")}
    where = {r: None for r in float_reads(rule, program)}
    evaluate_rule(rule, program, env, reads=where, s=pair["s"].astype(np.float64), **roles)
    want = {n: np.zeros(shape) for n, shape in shapes.items()}
    for read, (indices, inside) in where.items():
        slope = evaluate_rule(*differentiate_score(rule, program, read), env,
                              s=pair["s"].astype(np.float64), **roles)
        term = pair["dz"] * slope
        take = inside & (term != 0)
        np.add.at(want[read_operand(read)], tuple(i[take] for i in indices), term[take])
    for name in ("table", "hi"):
        assert np.abs(want[name]).max() > 0.1, name  # (many pairs reach it)
        np.testing.assert_allclose(grads[name], want[name], rtol=2e-5, atol=2e-5)
    assert not grads["lo"].any() and np.abs(want["lo"]).max() > 0.1  # (null: nothing added)
