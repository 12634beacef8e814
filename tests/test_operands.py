"""Operands: run-time i32/f32 values a declaration's mask and score read, passed by name at the
call (`attention windowed(window: i32 = 256) { ... }`, `kern(q, k, v, window=512)`).

The front end checks their declarations; the references and the tile classification take
their values; every kernel of every design takes them as parameters after its design's own;
the host checks a call's values before anything runs and packs them at each launch.
"""
import json
import re

import numpy as np
import pytest

import mhadsl
from helpers import EXAMPLES, checked
from mhadsl import abi
from mhadsl.analysis.classify import (
    SHORT_BAND_TILES, classify_tile, count_visited_kv_tiles, integer_operands, kv_band_tiles,
)
from mhadsl.analysis.reference import attention_reference, attention_reference_backward
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.build import KernelRequest, plan
from mhadsl.codegen.backends import CacheLayout, Layout, backends
from mhadsl.front.attention_spec import Operand, operand_values
from mhadsl.front.diagnostics import MhaError

RUNTIME = next(p for p in EXAMPLES if p.name == "runtime_window.mha")
CONSTANT = '''import "std/schedulers.mha"
attention constant_window {
    dtype    = bf16
    head_dim = 128
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && q_idx - kv_idx < 5
    score(s, b, h, q_idx, kv_idx) = 2.5 * tanh(s / 2.5)
}
'''


@pytest.fixture(scope="module")
def windowed():
    return mhadsl.compile(str(RUNTIME))["runtime_window"]


@pytest.fixture(scope="module")
def constant():
    return mhadsl.compile(CONSTANT)["constant_window"]


def errors_of(text: str) -> list[str]:
    with pytest.raises(MhaError) as info:
        checked('import "std/schedulers.mha"\n' + text, "bad.mha")
    return [d.render() for d in info.value.diagnostics]


# ---------------------------------------------------------------- the language
def test_operands_resolve_with_their_types_and_defaults(windowed):
    assert windowed.options.operands == (Operand("window", "i32", 256),
                                         Operand("cap", "f32", 30.0))
    program = mhadsl.compile('import "std/schedulers.mha"\nattention a(w: i32, c: f32 = -2.0 * 3.0)'
                             ' { mask(b, h, q_idx, kv_idx) = q_idx - kv_idx < w }')
    assert program["a"].options.operands == (Operand("w", "i32"), Operand("c", "f32", -6.0))


@pytest.mark.parametrize("decl, message", [
    ("attention a(w: u32) { mask(b, h, q_idx, kv_idx) = kv_idx < w }",
     "bad.mha:2:16: error: operand 'w' is u32; an attention operand is a run-time i32 or f32"),
    ("attention a(w: bool) { mask(b, h, q_idx, kv_idx) = w }", "operand 'w' is bool"),
    ("attention a(w: i32 = 1.5) { mask(b, h, q_idx, kv_idx) = kv_idx < w }",
     "default of operand 'w' must be i32"),
    ("attention a(w: i32 = 3000000000) { mask(b, h, q_idx, kv_idx) = kv_idx < w }",
     "integer constant 3000000000 does not fit in i32"),
    ("attention a(w: i32 = seqlen_q) { mask(b, h, q_idx, kv_idx) = kv_idx < w }",
     "unknown name 'seqlen_q'"),
    ("attention a(c: f32 = 1e30 * 1e30) { score(s, b, h, q_idx, kv_idx) = s * c }",
     "constant expression is not a finite f32 value"),
    ("attention a(c: f32 = true) { score(s, b, h, q_idx, kv_idx) = s * c }",
     "the default of operand 'c' must be a number"),
    ("attention a(scale: f32) { score(s, b, h, q_idx, kv_idx) = s * scale }",
     "'scale' is an argument of every kernel call; give the operand another name"),
    ("attention a(w: i32, w: i32) { mask(b, h, q_idx, kv_idx) = kv_idx < w }",
     "'w' is already defined here"),
    ("attention a(seqlen_k: i32) { mask(b, h, q_idx, kv_idx) = kv_idx < seqlen_k }",
     "'seqlen_k' is already defined here"),
    ("attention a(w: i32) { mask(b, h, q_idx, w) = q_idx < w }",
     "bad.mha:2:41: error: 'w' is an operand of attention 'a'; give the parameter another name"),
    ("attention a(w: i32) { mask(b, h, q_idx, kv_idx) { w = 3\n return true } }",
     "cannot assign to 'w': it is an operand of the kernel"),
    ("fn f(k: i32) -> bool { return k < w }\n"
     "attention a(w: i32) { mask(b, h, q_idx, kv_idx) = f(kv_idx) }", "unknown name 'w'"),
])
def test_bad_operand_declarations_get_diagnostics(decl, message):
    errors = errors_of(decl)
    assert any(message in e for e in errors), errors
    assert all(re.match(r"bad\.mha:\d+:\d+: error: ", e) and "^" in e for e in errors), errors


# ---------------------------------------------------------------- a call's values
def test_a_calls_values_are_checked_with_defaults_filled_in(windowed):
    o = windowed.options
    assert operand_values(o, {}) == {"window": 256, "cap": 30.0}
    assert operand_values(o, {"window": np.int64(7), "cap": 2}) == {"window": 7, "cap": 2.0}
    for given, error, match in (
            ({"windw": 3}, TypeError, "unexpected keyword argument 'windw': kernel "
                                      "'runtime_window' has no such operand \\(its operands: "
                                      "window, cap\\)"),
            ({"window": True}, TypeError, "operand 'window' is i32: it takes an int, got bool"),
            ({"window": 2.0}, TypeError, "takes an int, got float"),
            ({"cap": "3"}, TypeError, "operand 'cap' is f32: it takes a number, got str"),
            ({"window": 2 ** 31}, ValueError, "out of its range"),
            ({"cap": float("nan")}, ValueError, "must be a finite f32"),
            ({"cap": 1e39}, ValueError, "must be a finite f32")):
        with pytest.raises(error, match=match):
            operand_values(o, given)
    required = Operand("w", "i32")
    with pytest.raises(TypeError, match="the call needs operand 'w' \\(i32\\)"):
        required.value(None)


def test_a_bad_operand_is_refused_before_anything_runs(windowed, constant):
    q = np.zeros((1, 4, 2, 128), np.float32)
    with pytest.raises(TypeError, match="unexpected keyword argument 'depth'"):
        windowed(q, q, q, depth=3)
    with pytest.raises(ValueError, match="out of its range"):
        windowed(q, q, q, window=-2 ** 40)
    with pytest.raises(TypeError, match="'window': kernel 'constant_window' has no such "
                                        "operand \\(its operands: none\\)"):
        constant(q, q, q, window=3)


# ---------------------------------------------------------------- the references
def test_the_reference_with_operands_is_the_constant_declarations(windowed, constant):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 19, 4, 128)) for _ in range(3))
    got = mhadsl.reference(windowed, q, k, v, window=5, cap=2.5)
    np.testing.assert_array_equal(got, mhadsl.reference(constant, q, k, v))
    assert not np.allclose(mhadsl.reference(windowed, q, k, v, window=6, cap=2.5), got)
    dout = rng.standard_normal(q.shape)
    for a, b in zip(mhadsl.reference_backward(windowed, q, k, v, dout, window=5, cap=2.5),
                    mhadsl.reference_backward(constant, q, k, v, dout)):
        np.testing.assert_array_equal(a, b)


def test_the_decode_reference_takes_operands(windowed, constant):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 1, 4, 128))
    cache = [rng.standard_normal((2, 24, 4, 128)) for _ in range(2)]
    lengths = np.array([24, 13], np.int32)
    got = mhadsl.reference_decode(windowed, q, *cache, cache_seqlens=lengths, window=5, cap=2.5)
    np.testing.assert_array_equal(got, mhadsl.reference_decode(constant, q, *cache,
                                                               cache_seqlens=lengths))
    with pytest.raises(TypeError, match="unexpected keyword argument 'page'"):
        mhadsl.reference_decode(windowed, q, *cache, cache_seqlens=lengths, page=3)


def test_attention_reference_needs_the_operands_the_rules_read(windowed):
    q = np.ones((1, 3, 1, 128))
    with pytest.raises(ValueError, match="needs a value for"):
        attention_reference(q, q, q, mask_rule=windowed.options.mask,
                            program=windowed.program.checked)
    attention_reference_backward(q, q, q, q, mask_rule=windowed.options.mask,
                                 program=windowed.program.checked, operands={"window": 2})


# ---------------------------------------------------------------- classification
def test_tiles_are_classified_for_the_calls_values_and_unknown_ones_stay_partial(windowed):
    mask, program = windowed.options.mask, windowed.program.checked
    assert integer_operands(mask, program) == ("window",)
    box = dict(b=0, h=0, q_lo=1000, q_hi=1063, kv_lo=0, kv_hi=63, seqlen_q=4096, seqlen_k=4096)
    assert classify_tile(mask, program, **box) == "partial"
    assert classify_tile(mask, program, **box, operands={"window": 256}) == "empty"
    assert classify_tile(mask, program, **box, operands={"window": 4096}) == "full"
    tile = dict(q_tile=20, block_m=128, block_n=128, seqlen_q=8192, seqlen_k=8192)
    assert count_visited_kv_tiles(mask, program, **tile) == 21
    assert count_visited_kv_tiles(mask, program, **tile, operands={"window": 256}) == 3
    assert kv_band_tiles(mask, program) is None  # no band the build may assume


# ---------------------------------------------------------------- the kernels
def _params(ptx: str, kernel: str) -> list[str]:
    entry = ptx[ptx.index(f".entry {kernel}("):]
    return re.findall(r"\.param \.(\w+)", entry[:entry.index(")")])


LAYOUTS = {"prefill": dict(), "decode": dict(cache=CacheLayout(1, 64, 64), gqa_group=4),
           "backward": dict(backward=True)}


@pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
@pytest.mark.parametrize("design", [d.name for w in LAYOUTS for d in backends(w)])
def test_every_kernel_of_every_design_takes_the_operands_after_its_own(windowed, design):
    design_ = next(d for w in LAYOUTS for d in backends(w) if d.name == design)
    arch = design_.targets[0]
    build = windowed.build(arch, backend=design, **LAYOUTS[design_.workload])
    assert build.backend == design
    for kernel in design_.kernels(build.config):
        params = _params(build.ptx, kernel.name)
        assert len(params) == len(kernel.abi.params) + 2, kernel.name
        assert params[-2:] == ["u32", "f32"], kernel.name  # window, then cap
        assembled = build.assembled.kernels[kernel.name]
        assert assembled.spills == 0, (kernel.name, assembled)
    assert "operand_window" in build.llvm and "operand_cap" in build.llvm


def test_operand_parameters_follow_the_designs_in_the_hosts_layout():
    design = next(d for d in backends("prefill"))
    operands = abi.operand_params((Operand("window", "i32"), Operand("cap", "f32")))
    full = abi.with_operands(design.abi, operands)
    assert [p.name for p in full][-2:] == ["operand_window", "operand_cap"]
    assert full.offsets["operand_cap"] == full.offsets["operand_window"] + 4
    assert full.offsets["operand_window"] == -(-design.abi.size // 4) * 4
    assert abi.with_operands(design.abi, ()) is design.abi


def test_the_torch_operators_schema_ends_with_the_operands(windowed):
    from mhadsl.host.torch_op import BACKWARD_SCHEMA, SCHEMA, given, with_operands
    assert with_operands(SCHEMA, windowed).endswith(
        "bool? deterministic=None, int? window=None, float? cap=None) -> (Tensor, Tensor)")
    assert with_operands(BACKWARD_SCHEMA, windowed).endswith(
        "int? window=None, float? cap=None) -> (Tensor, Tensor, Tensor)")
    assert given(windowed, (None, 3.0)) == {"cap": 3.0}


def test_the_operators_operands_follow_its_fixed_arguments(windowed):
    from mhadsl.host.torch_op import DECODE_SCHEMA, FIRST_OPERAND, SCHEMA, with_operands
    arguments = SCHEMA[1:SCHEMA.index(") -> ")].split(", ")
    assert len(arguments) == FIRST_OPERAND  # autograd finds an operand's gradient slot by it
    decode = with_operands(DECODE_SCHEMA, windowed)
    assert "Tensor(a!) k_cache, Tensor(b!) v_cache" in decode  # the append writes them
    assert decode.endswith("float? v_scale=None, int? window=None, float? cap=None) -> "
                           "(Tensor, Tensor)")


def test_the_out_operators_take_out_last_written_under_a_letter_of_its_own(windowed):
    from mhadsl.host.torch_op import DECODE_SCHEMA, SCHEMA, with_operands, with_out
    assert with_out(with_operands(SCHEMA, windowed)).endswith(
        "bool? deterministic=None, int? window=None, float? cap=None, *, Tensor(a!) out) -> "
        "Tensor")
    decode = with_out(with_operands(DECODE_SCHEMA, windowed))
    assert "Tensor(a!) k_cache, Tensor(b!) v_cache" in decode
    assert decode.endswith("float? cap=None, *, Tensor(c!) out) -> Tensor")


def test_an_out_call_refuses_inputs_that_need_a_gradient(windowed):
    torch = pytest.importorskip("torch")
    op = windowed.torch_op()
    q, k, v = (torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    with pytest.raises(RuntimeError, match="autograd cannot differentiate"):
        op(q, k, v, out=torch.empty_like(q))


# ---------------------------------------------------------------- the host
HOST_SOURCE = '''import "std/schedulers.mha"
attention h64(window: i32 = 256, cap: f32) {
    dtype = fp16
    head_dim = 64
    scheduler = Queued()
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && q_idx - kv_idx < window
    score(s, b, h, q_idx, kv_idx) = cap * tanh(s / cap)
}
'''


@pytest.fixture
def host_kernel(monkeypatch):
    from test_launch_host_path import stand_in
    yield from stand_in(monkeypatch, mhadsl.compile(HOST_SOURCE)["h64"])


def _operands_in(kern, block: bytes) -> tuple[int, float]:
    import struct
    window = struct.unpack_from("<i", block, kern.abi.offsets["operand_window"])[0]
    cap = struct.unpack_from("<f", block, kern.abi.offsets["operand_cap"])[0]
    return window, cap


def test_each_launch_packs_its_calls_operands_into_one_plan(host_kernel):
    from test_hostile_tensors import dense
    args = dense()
    host_kernel(**args, cap=2.5)
    # the builds for a window that is a short band of keys and for any other, at once
    assert host_kernel.calls["build"] == 2
    host_kernel(**args, window=-7, cap=30)
    host_kernel(**dense(batch=3), window=9, cap=0.5)
    assert len(host_kernel.launcher.plans) == 2  # a new value is not a new plan
    host_kernel(**args, window=1 << 20, cap=1.0)  # the other build's: its own plan
    assert host_kernel.launches == 4
    assert [_operands_in(host_kernel, b) for b in host_kernel.blocks] == [
        (256, 2.5), (-7, 30.0), (9, 0.5), (1 << 20, 1.0)]
    assert len(host_kernel.launcher.plans) == 3
    assert host_kernel.calls["build"] == 2  # nor a new build
    with pytest.raises(TypeError, match="the call needs operand 'cap'"):
        host_kernel(**args)
    assert host_kernel.launches == 4


# ---------------------------------------------------------------- the command line
def _simulate(capsys, *extra):
    from mhadsl.cli import main
    status = main(["simulate", str(RUNTIME), "--scheduler", "LPT", "--kernel", "runtime_window",
                   "--seqlen", "4096", "--heads", "4", "--json", *extra])
    out, err = capsys.readouterr()
    return status, out, err


def test_simulate_costs_tiles_for_the_operands_values(capsys):
    import json
    costs = {}
    for window in ("256", "4096"):
        status, out, _ = _simulate(capsys, "--operand", f"window={window}")
        assert status == 0
        costs[window] = json.loads(out)["makespan"]
    status, out, _ = _simulate(capsys)  # the declared default: 256
    assert json.loads(out)["makespan"] == costs["256"] < costs["4096"] / 4


@pytest.mark.parametrize("extra, message", [
    (["--operand", "windw=3"], "--operand: unexpected keyword argument 'windw': kernel "
                               "'runtime_window' has no such operand"),
    (["--operand", "window=1.5"], "operand 'window' is i32: it takes an int, got float"),
    (["--operand", "window=x"], "--operand window takes a number, got 'x'"),
    (["--operand", "window"], "--operand takes NAME=VALUE"),
    (["--operand", "window=3", "--operand", "window=4"], "--operand window is given twice"),
])
def test_bad_operands_on_the_command_line_are_usage_errors(capsys, extra, message):
    status, _, err = _simulate(capsys, *extra)
    assert status == 2 and message in err, err


# ---------------------------------------------------------------- a row's run of keys
def test_a_run_of_keys_with_an_operand_bound_is_the_mask_for_every_value(windowed):
    """`q_idx - kv_idx < window` keeps one run of keys per row whatever the window: the
    kernel's row limits (run on the host) hold exactly the keys the mask keeps."""
    import ctypes

    from llvmlite import ir

    from mhadsl.analysis.kv_limits import emit_kv_limits, kv_limits, operand_term
    from mhadsl.analysis.reference import evaluate_rule
    from mhadsl.codegen.target import HOST, HostJit, new_module
    mask, program = windowed.options.mask, windowed.program.checked
    limits = kv_limits(mask, program)
    assert limits.lows == ((("", 1), (operand_term("window"), -1), ("q_idx", 1)),)
    i32, i64 = ir.IntType(32), ir.IntType(64)
    module = new_module("operand_limits", HOST)
    fn = ir.Function(module, ir.FunctionType(i64, [i32] * 3), name="limits")
    b = ir.IRBuilder(fn.append_basic_block())
    q_idx, seqlen, window = fn.args
    lo, hi = emit_kv_limits(b, limits, {"b": i32(0), "h": i32(0), "q_idx": q_idx,
                                        "seqlen_q": seqlen, "seqlen_k": seqlen,
                                        operand_term("window"): window})
    b.ret(b.or_(b.zext(lo, i64), b.shl(b.zext(hi, i64), ir.Constant(i64, 32))))
    jit = HostJit(module)
    run = ctypes.CFUNCTYPE(ctypes.c_int64, *[ctypes.c_int32] * 3)(jit.address("limits"))
    rng = np.random.default_rng(3)
    for q, w in [(0, 1), (5, 1), (700, 256), (700, -3), (700, 0), (3000, 2 ** 31 - 1),
                 (3000, -2 ** 31), *zip(rng.integers(0, 4000, 40), rng.integers(-50, 5000, 40))]:
        bits = run(int(q), 4000, int(w))
        lo_, hi_ = ((bits & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000, bits >> 32
        kv = np.arange(4000)
        kept = evaluate_rule(mask, program, {"window": int(w)}, b=0, h=0, q_idx=np.int64(q),
                             kv_idx=kv, seqlen_q=4000, seqlen_k=4000)
        assert np.array_equal(kept, (kv >= lo_) & (kv <= hi_)), (q, w, lo_, hi_)
    unbounded = mhadsl.compile('import "std/schedulers.mha"\nattention a(w: i32) '
                               '{ mask(b, h, q_idx, kv_idx) = kv_idx + w > q_idx }')
    assert kv_limits(unbounded["a"].options.mask, unbounded.checked) is None  # may wrap


@pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
def test_a_window_operand_masks_by_bits_where_a_literal_window_would():
    """At head dim 64 the sm90 design masks a run of keys by bits: with the window an
    operand too, from the row limits the kernel computes from its parameter."""
    program = mhadsl.compile('import "std/schedulers.mha"\nattention w64(window: i32 = 256) '
                             '{ dtype = bf16  head_dim = 64\n  mask(b, h, q_idx, kv_idx) = '
                             'kv_idx <= q_idx && q_idx - kv_idx < window }')
    build = program["w64"].build("sm_90a")
    assert build.backend == "sm90" and build.config.bit_mask
    assert "operand_window" in build.llvm
    assert all(k.spills == 0 for k in build.assembled.kernels.values())


WINDOW = ('import "std/schedulers.mha"\nattention w {{ dtype = bf16  head_dim = 128\n'
          '  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && q_idx - kv_idx < {} }}')


@pytest.mark.parametrize("window", [-3, 1, 256, 385, 386, 1024, 1 << 30])
def test_a_run_time_window_selects_the_build_a_literal_window_of_its_value_gets(windowed,
                                                                              window):
    """A forward call whose window operand makes the mask a short band of keys selects the
    build for one (`Layout.short_band`: on sm_90a more stages and the mask by bits), and any
    other value the general build: what the same window written as a literal gets."""
    literal = mhadsl.compile(WINDOW.format(window))["w"]
    assert literal.launcher.band_operands == ()  # its band is the declaration's
    short = windowed.launcher.short_band({"window": window, "cap": 1.0})
    band = kv_band_tiles(literal.options.mask, literal.program.checked)
    assert short == (band is not None and band <= SHORT_BAND_TILES)
    got = plan(windowed.program.checked, KernelRequest(
        "runtime_window", "sm_90a", layout=Layout(short_band=short))).configs
    want = plan(literal.program.checked, KernelRequest("w", "sm_90a")).configs
    assert [(c.stages, c.bit_mask) for c in got] == [(c.stages, c.bit_mask) for c in want]
    assert windowed.launcher.short_bands[(window,)] == short  # decided once per value


def test_only_a_mask_whose_band_an_i32_operand_decides_has_band_operands(windowed,
                                                                         prefix_lm):
    assert windowed.launcher.band_operands == ("window",)
    assert prefix_lm.launcher.band_operands == ()  # a tensor's elements bound no band
    causal = mhadsl.compile('import "std/schedulers.mha"\nattention c(cap: f32) {\n'
                            '  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx\n'
                            '  score(s, b, h, q_idx, kv_idx) = cap * tanh(s / cap) }')["c"]
    assert causal.launcher.band_operands == ()
    assert not causal.launcher.short_band({"cap": 2.0})


# ---------------------------------------------------------------- tensor operands
TENSORS = '''import "std/schedulers.mha"
attention prefix_lm(prefix: i32[batch], bias: f32[heads, _]) {
    dtype    = bf16
    head_dim = 128
    mask(b, h, q_idx, kv_idx) = kv_idx < prefix[b] || kv_idx <= q_idx
    score(s, b, h, q_idx, kv_idx) = s + bias[h][q_idx - kv_idx + 4]
}
'''


@pytest.fixture(scope="module")
def prefix_lm():
    return mhadsl.compile(TENSORS)["prefix_lm"]


def test_tensor_operands_resolve_with_their_axes(prefix_lm):
    assert prefix_lm.options.operands == (Operand("prefix", "i32", None, ("batch",)),
                                          Operand("bias", "f32", None, ("heads", "_")))


@pytest.mark.parametrize("decl, message", [
    ("attention a(t: i32[seq]) { mask(b, h, q_idx, kv_idx) = kv_idx < t[b] }",
     "unknown axis 'seq' of tensor operand 't'"),
    ("attention a(t: i32[_, _, _, _]) { mask(b, h, q_idx, kv_idx) = true }",
     "tensor operand 't' has 4 axes; at most 3"),
    ("attention a(t: i32[batch] = 3) { mask(b, h, q_idx, kv_idx) = kv_idx < t[b] }",
     "tensor operand 't' takes no default"),
    ("attention a(t: u32[batch]) { mask(b, h, q_idx, kv_idx) = true }", "operand 't' is u32"),
    ("attention a(t: i32[batch]) { mask(b, h, q_idx, kv_idx) = kv_idx < t }",
     "operator '<' does not apply to i32 and i32[batch]"),
    ("attention a(t: f32[heads, _]) { score(s, b, h, q_idx, kv_idx) = s + t[h] }",
     "f32[_]"),
    ("attention a(t: i32[batch]) { mask(b, h, q_idx, kv_idx) = kv_idx < t[1.5] }",
     "a tensor index is an integer, not f32"),
    ("attention a(t: i32[batch]) { mask(b, h, q_idx, kv_idx) = kv_idx < t[3000000000] }",
     "does not fit in i32"),
    ("fn f(t: i32[batch]) -> i32 { return 0 }\nattention a { mask(b, h, q_idx, kv_idx) = true }",
     "'i32[...]' is a tensor: only an attention declaration's operand is one"),
])
def test_bad_tensor_operands_get_diagnostics(decl, message):
    errors = errors_of(decl)
    assert any(message in e for e in errors), errors


def _prefix_reference(q, k, v, prefix, bias):
    import math
    out = np.zeros_like(q)
    sq, sk = q.shape[1], k.shape[1]
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            s = q[b, :, h] @ k[b, :, h].T / math.sqrt(q.shape[-1])
            index = i - j + 4
            s = s + np.where((index >= 0) & (index < bias.shape[1]),
                             bias[h][np.clip(index, 0, bias.shape[1] - 1)], 0.0)
            s = np.where((j < prefix[b]) | (j <= i), s, -np.inf)
            p = np.exp(s - s.max(1, keepdims=True))
            out[b, :, h] = (p / p.sum(1, keepdims=True)) @ v[b, :, h]
    return out


def test_the_reference_reads_tensor_operands_and_zero_outside_them(prefix_lm):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 11, 2, 128)) for _ in range(3))
    prefix = np.array([5, 0], np.int32)
    bias = rng.standard_normal((2, 9)).astype(np.float32)  # q - k + 4 outside [0, 9): 0
    got = mhadsl.reference(prefix_lm, q, k, v, prefix=prefix, bias=bias)
    np.testing.assert_allclose(got, _prefix_reference(q, k, v, prefix, bias), atol=1e-12)
    for given, error, match in (
            (dict(prefix=prefix.astype(np.int64), bias=bias), TypeError,
             "tensor operand 'prefix' \\(i32\\[batch\\]\\) takes int32 elements, got int64"),
            (dict(prefix=np.zeros(3, np.int32), bias=bias), ValueError,
             "axis 0 \\(batch\\) has 3 entries, but the call has 2 sequences"),
            (dict(prefix=prefix, bias=bias[:1]), ValueError,
             "axis 0 \\(heads\\) has 1 entries, but the call has 2 query heads"),
            (dict(prefix=prefix, bias=bias[:, :0]), ValueError, "axis 1 is empty"),
            (dict(prefix=prefix, bias=bias[0]), ValueError, "has 2 axes, got shape \\(9,\\)"),
            (dict(bias=bias), TypeError, "the call needs operand 'prefix' \\(i32\\[batch\\]\\)"),
            (dict(prefix=5, bias=bias), TypeError, "expected a NumPy array")):
        with pytest.raises(error, match=match):
            mhadsl.reference(prefix_lm, q, k, v, **given)


@pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
@pytest.mark.parametrize("design", ["sm80", "sm90", "decode", "backward", "backward_sm90"])
def test_every_design_reads_tensor_operands_without_spills(prefix_lm, design):
    design_ = next(d for w in LAYOUTS for d in backends(w) if d.name == design)
    build = prefix_lm.build(design_.targets[0], backend=design, **LAYOUTS[design_.workload])
    assert build.backend == design
    for kernel in design_.kernels(build.config):
        params = _params(build.ptx, kernel.name)
        # prefix: address, size, stride; bias: address, two sizes, two strides
        assert params[len(kernel.abi.params):] == ["u64", "u32", "u32", "u64", "u32", "u32",
                                                   "u32", "u32"], kernel.name
        assert build.assembled.kernels[kernel.name].spills == 0
    assert "operand_bias_stride1" in build.llvm


HOST_TENSORS = '''import "std/schedulers.mha"
attention h64(prefix: i32[batch], bias: f32[heads, _]) {
    dtype = fp16
    head_dim = 64
    scheduler = Queued()
    mask(b, h, q_idx, kv_idx) = kv_idx < prefix[b] || kv_idx <= q_idx
    score(s, b, h, q_idx, kv_idx) = s + bias[h][q_idx - kv_idx + 16]
}
'''


@pytest.fixture
def host_tensor_kernel(monkeypatch):
    from test_launch_host_path import stand_in
    yield from stand_in(monkeypatch, mhadsl.compile(HOST_TENSORS)["h64"])


def test_each_launch_passes_its_tensor_operands_address_sizes_and_strides(host_tensor_kernel):
    import struct

    from test_hostile_tensors import FakeDevice, dense
    kern = host_tensor_kernel
    args = dense()  # 2 sequences, 4 query heads
    prefix = FakeDevice((2,), "<i4")
    bias = FakeDevice((4, 33), "<f4", strides=(40, 1))
    kern(**args, prefix=prefix, bias=bias)
    kern(**args, prefix=FakeDevice((2,), "<i4"), bias=bias)  # the same plan, a new address
    assert kern.launches == 2 and len(kern.launcher.plans) == 1

    def word(block, name, fmt):
        return struct.unpack_from(fmt, block, kern.abi.offsets[name])[0]
    first, second = kern.blocks
    assert word(first, "operand_prefix", "<Q") == prefix.ptr
    assert word(second, "operand_prefix", "<Q") != prefix.ptr
    assert [word(first, f"operand_bias_{f}", fmt) for f, fmt in (
        ("size0", "<i"), ("size1", "<i"), ("stride0", "<i"), ("stride1", "<i"))] == [4, 33, 40, 1]
    for bad, error, match in (
            (dict(prefix=FakeDevice((2,), "<f4")), TypeError, "takes int32 elements"),
            (dict(prefix=FakeDevice((3,), "<i4")), ValueError, "has 3 entries, but the call "
                                                               "has 2 sequences"),
            (dict(prefix=FakeDevice((2,), "<i4", device=1)), ValueError,
             "is on device 1, the call's other tensors on 0"),
            (dict(bias=FakeDevice((4, 3), "<f4", strides=(2 ** 30, 1))), ValueError,
             "tensor operand 'bias' spans 3221225475 elements; at most 2147483648")):
        with pytest.raises(error, match=match):
            kern(**args, **{"prefix": prefix, "bias": bias, **bad})
    assert kern.launches == 2


def test_a_tile_classifies_by_the_tensor_element_its_mask_reads_at_one_index(prefix_lm):
    """`prefix[b]` is one element per tile: the kernel's classification reads it (run here
    on the host, over a NumPy array) and is exact for it, so a prefix-LM's tiles past both
    the prefix and the diagonal are empty; a read at many indices stays unknown."""
    import ctypes

    from llvmlite import ir

    from mhadsl.analysis.classify import emit_classify
    from mhadsl.codegen.kernel import TensorArgs
    from mhadsl.codegen.target import HOST, HostJit, new_module
    mask, program = prefix_lm.options.mask, prefix_lm.program.checked
    i32, i64 = ir.IntType(32), ir.IntType(64)
    module = new_module("tensor_classes", HOST)
    fn = ir.Function(module, ir.FunctionType(i32, [i32] * 6 + [ir.PointerType(), i32]),
                     name="classes")
    b = ir.IRBuilder(fn.append_basic_block())
    bidx, q_lo, q_hi, kv_lo, kv_hi, seqlen, pointer, size = fn.args
    tensor = TensorArgs(pointer, (size,), (ir.Constant(i64, 1),))
    may, must = emit_classify(b, mask, program, bidx, None, q_lo, q_hi, kv_lo, kv_hi, seqlen,
                              seqlen, {"prefix": tensor})
    b.ret(b.or_(b.zext(may, i32), b.shl(b.zext(must, i32), ir.Constant(i32, 1))))
    jit = HostJit(module)
    run = ctypes.CFUNCTYPE(ctypes.c_int32, *[ctypes.c_int32] * 6, ctypes.c_void_p,
                           ctypes.c_int32)(jit.address("classes"))
    prefix = np.array([0, 300, 2000, -5], np.int32)
    address = prefix.ctypes.data
    cases = 0
    for bb in range(5):  # sequence 4 lies past the tensor: its prefix reads 0
        for q0 in range(0, 1024, 128):
            for kv0 in range(0, 1024, 128):
                got = run(bb, q0, q0 + 127, kv0, kv0 + 127, 1024, address, len(prefix))
                keep = evaluate_box(mask, program, bb, q0, kv0, prefix)
                assert (bool(got & 1), bool(got & 2)) == (keep.any(), keep.all()), (bb, q0, kv0)
                cases += not keep.any()
    assert cases > 40  # the empty tiles above the diagonal, past the prefix


def evaluate_box(mask, program, b, q0, kv0, prefix):
    from mhadsl.analysis.reference import evaluate_rule
    value = np.asarray(prefix, np.int64)
    return np.broadcast_to(evaluate_rule(
        mask, program, {"prefix": value}, b=b, h=0, q_idx=np.arange(q0, q0 + 128)[:, None],
        kv_idx=np.arange(kv0, kv0 + 128)[None, :], seqlen_q=1024, seqlen_k=1024), (128, 128))


def test_packed_documents_see_their_own_document_alone():
    kern = mhadsl.compile(str(next(p for p in EXAMPLES if p.name == "document_mask.mha")))[
        "document_mask"]
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 10, 1, 128)) for _ in range(3))
    doc = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3]], np.int32)
    got = mhadsl.reference(kern, q, k, v, doc=doc)
    for start, end in ((0, 3), (3, 5), (5, 9), (9, 10)):  # each document alone, causal
        alone = mhadsl.reference(kern, q[:, start:end], k[:, start:end], v[:, start:end],
                                 doc=doc[:, start:end])
        np.testing.assert_allclose(got[:, start:end], alone, atol=1e-12)


def test_the_command_line_takes_a_tensor_operand_checked_before_it_runs(capsys, tmp_path):
    """run and trace take a tensor operand as simulate does (a tensor has no default: one
    is required), checked against the batch before anything runs; without a GPU, `run
    --no-gpu-ok` then says so and exits 0, trace exits 2."""
    from mhadsl.cli import main
    path = str(next(p for p in EXAMPLES if p.name == "prefix_lm.mha"))
    base = ["run", path, "--kernel", "prefix_lm", "--seqlen", "128", "--batch", "2",
            "--no-gpu-ok"]
    assert main(base) == 2
    assert "reads tensor operand 'prefix' (i32[batch]): give --operand prefix=" in \
        capsys.readouterr().err
    assert main(base + ["--operand", "prefix=10,20,30"]) == 2
    assert "axis 0 (batch) has 3 entries, but the call has 2 sequences" in \
        capsys.readouterr().err
    assert main(base + ["--operand", "prefix=10,20"]) == 0
    assert "skipped the run" in capsys.readouterr().out
    np.save(tmp_path / "prefix.npy", np.array([5, 60, 7], np.int32))
    trace = ["trace", path, "--kernel", "prefix_lm", "--seqlens", "100,200,300"]
    assert main(trace + ["--operand", f"prefix={tmp_path / 'prefix.npy'}"]) == 2
    assert "runs the kernel" in capsys.readouterr().err  # checked; then no GPU here
    assert main(trace + ["--operand", "prefix=1,2"]) == 2
    assert "has 2 entries, but the call has 3 sequences" in capsys.readouterr().err
    assert main(["trace", path, "--kernel", "prefix_lm", "--calibrate"]) == 2
    assert "--calibrate runs batches of its own" in capsys.readouterr().err
    assert main(["simulate", path, "--scheduler", "LPT", "--kernel", "prefix_lm", "--seqlen",
                 "1024", "--json"]) == 0  # the cost model takes the tensor's values as unknown
    capsys.readouterr()


def test_the_simulators_cost_model_reads_a_tensor_operand_it_is_given():
    from mhadsl.analysis.costmodel import tile_classes
    kern = mhadsl.compile(str(next(p for p in EXAMPLES if p.name == "prefix_lm.mha")))[
        "prefix_lm"]
    program, mask = kern.program.checked, kern.options.mask
    offsets, b = np.array([0, 1024, 0, 1024]), np.array([0, 0, 1, 1])
    prefix = np.array([100, 2500], np.int32)
    unknown = tile_classes(program, mask, [3000, 3000], offsets, np.zeros(4), b, 128, 128)
    known = tile_classes(program, mask, [3000, 3000], offsets, np.zeros(4), b, 128, 128,
                         {"prefix": prefix})
    # each query tile against the mask itself: a KV tile is visited iff it keeps a pair
    for k, (q0, bb) in enumerate(zip(offsets, b)):
        q = np.arange(q0, q0 + 128)[:, None]
        kv = np.arange(3000)[None, :]
        keep = (kv < prefix[bb]) | (kv <= q)
        tiles = [keep[:, n:n + 128] for n in range(0, 3000, 128)]
        full = sum(t.all() and t.shape[1] == 128 for t in tiles)
        visited = sum(t.any() for t in tiles)
        assert (known[0][k], known[0][k] + known[1][k]) == (full, visited)
        assert unknown[0][k] + unknown[1][k] >= visited  # unknown: sound, never exact here
    assert sum(known[1]) < sum(unknown[1])


@pytest.mark.parametrize("value, message", [
    ("100,2500,3", "has 3 entries, but the call has 2 sequences"),
    ("100,2.5", "takes int32 elements, got float64"),
    ("1,4294967296", "out of i32's range"),
    ("missing.npy", "cannot read missing.npy"),
])
def test_the_simulator_refuses_a_bad_tensor_operand(capsys, value, message):
    from mhadsl.cli import main
    path = str(next(p for p in EXAMPLES if p.name == "prefix_lm.mha"))
    status = main(["simulate", path, "--scheduler", "LPT", "--kernel", "prefix_lm",
                   "--seqlens", "3000,3000", "--operand", f"prefix={value}"])
    assert status == 2 and message in capsys.readouterr().err


def test_the_simulator_takes_a_tensor_operand_from_a_list_or_a_file(capsys, tmp_path):
    from mhadsl.cli import main
    path = str(next(p for p in EXAMPLES if p.name == "prefix_lm.mha"))
    np.save(tmp_path / "prefix.npy", np.array([100, 2500], np.int32))
    runs = {}
    for label, extra in (("unknown", []), ("list", ["--operand", "prefix=100,2500"]),
                         ("file", ["--operand", f"prefix={tmp_path / 'prefix.npy'}"])):
        assert main(["simulate", path, "--scheduler", "LPT", "--kernel", "prefix_lm",
                     "--seqlens", "3000,3000", "--heads", "4", "--json", *extra]) == 0
        runs[label] = json.loads(capsys.readouterr().out)
    assert runs["list"] == runs["file"] != runs["unknown"]
