"""The backward pass without a GPU (codegen/backends/backward.py, mhadsl/backward.py): every
example's backward kernels assemble for sm_80 and sm_90a without spills, the three kernels
take the ABI's parameters in its types and offsets, and a call's mistakes are errors before
anything runs."""
import numpy as np
import pytest

import mhadsl
from helpers import EXAMPLES
from mhadsl.codegen.abi import KIND_ALIGN
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.codegen.backends import Layout
from mhadsl.codegen.backends.backward import (
    ABI, BACKEND, KERNELS, BackwardConfig, build_backward_module, shared_bytes,
)
from mhadsl.codegen.kernel import backward_hooks
from mhadsl.codegen.target import emit_ptx, gpu_target, optimize
from test_abi import offsets, ptx_params

needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="ptxas not found")
DECLARATIONS = [(path, name) for path in EXAMPLES for name in mhadsl.compile(path).attentions]


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("layout", [Layout(), Layout(gqa_group=4, ragged=True)],
                         ids=["dense", "ragged-gqa4"])
@pytest.mark.parametrize("path, name", DECLARATIONS,
                         ids=[f"{p.stem}-{n}" for p, n in DECLARATIONS])
def test_every_example_backward_assembles_without_spills(path, name, layout, arch):
    kern = mhadsl.compile(path)[name]
    build = kern.backward_build(arch, gqa_group=layout.gqa_group, ragged=layout.ragged)
    assert f".target {arch}" in build.ptx
    for instruction in ("mma.sync.aligned.m16n8k16.row.col.f32",
                        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                        "ldmatrix.sync.aligned.m8n8.x4.shared.b16", "cp.async.cg.shared.global",
                        "ex2.approx", "cp.async.ca.shared.global",
                        # dQ's reduction: four columns at a time where the arch has it
                        "red.global.add.v4.f32" if arch == "sm_90a" else "atom.global.add.f32"):
        assert instruction in build.ptx, instruction
    assert set(build.assembled.kernels) == set(KERNELS)
    for resources in build.assembled.kernels.values():
        assert resources.spills == 0 and resources.stack_bytes == 0, resources


def test_the_three_kernels_take_the_abi_in_its_types_and_offsets():
    target = gpu_target("sm_90a")
    ptx = emit_ptx(optimize(build_backward_module(BackwardConfig(), None, target), target),
                   target)
    for kernel_name in KERNELS:
        params = ptx_params(ptx, kernel_name)
        assert len(params) == len(ABI.params)
        assert offsets(params) == [ABI.offsets[p.name] for p in ABI]
        assert [align for *_, align in params] == [KIND_ALIGN[p.kind] for p in ABI]
    assert ABI.size == offsets(params)[-1] + params[-1][2]


def test_config_problems_name_the_setting():
    assert not BackwardConfig(head_dim=64).problems()
    (problem,) = BackwardConfig(head_dim=256).problems()
    assert problem.settings == ("head_dim",) and "256" in problem.message
    assert not BackwardConfig(block_m=32).problems()
    assert BackwardConfig(block_m=48).problems()[0].settings == ("tile",)
    assert shared_bytes(BackwardConfig()) <= 227 * 1024


def test_a_declaration_the_design_cannot_run_is_an_error_at_its_setting():
    kern = mhadsl.compile("attention big { dtype = bf16  head_dim = 256 }")["big"]
    assert BACKEND.problems(kern.options, "sm_90a")
    with pytest.raises(mhadsl.MhaError, match="head_dim"):
        kern.backward_build("sm_90a")
    q = np.zeros((1, 4, 1, 256), np.float32)
    with pytest.raises(mhadsl.MhaError, match="head_dim"):
        kern.backward(q, q, q, q, np.zeros((1, 1, 4), np.float32), q)


def test_a_score_without_a_derivative_is_a_located_error():
    kern = mhadsl.compile("attention t { dtype = bf16  head_dim = 64\n"
                          "  score(s, b, h, q_idx, kv_idx) = s * f32(i32(s)) }")["t"]
    with pytest.raises(mhadsl.MhaError, match="cannot differentiate"):
        kern.backward_build("sm_80")


def test_a_score_rule_lowers_its_derivative_hook():
    program = mhadsl.compile(EXAMPLES[0].parent / "softcap.mha")
    options = program["softcap_causal"].options
    hooks = backward_hooks(program.checked, options.mask, options.score)
    assert hooks.derivative is not None and hooks.score is not None
    plain = mhadsl.compile(EXAMPLES[0].parent / "causal.mha")["causal_fwd"].options
    assert backward_hooks(program.checked, plain.mask, None).derivative is None


def _arrays(batch=1, sq=8, sk=8, heads=2, kv_heads=2, d=128):
    q = np.zeros((batch, sq, heads, d), np.float32)
    kv = np.zeros((batch, sk, kv_heads, d), np.float32)
    return dict(q=q, k=kv, v=kv, out=q, lse=np.zeros((batch, heads, sq), np.float32), dout=q)


@pytest.mark.parametrize("change, error, message", [
    (dict(dout=np.zeros((1, 7, 2, 128), np.float32)), ValueError, "dout has shape"),
    (dict(out=np.zeros((1, 8, 2, 64), np.float32)), ValueError, "out has shape"),
    (dict(lse=np.zeros((1, 8, 2), np.float32)), ValueError, "lse has shape"),
    (dict(lse=np.zeros((1, 2, 8), np.int32)), TypeError, "lse has dtype int32"),
    (dict(k=np.zeros((1, 8, 3, 128), np.float32), v=np.zeros((1, 8, 3, 128), np.float32)),
     ValueError, "multiple of key/value heads"),
    ({}, TypeError, "torch CUDA tensors"),
])
def test_call_mistakes_are_errors_before_any_launch(change, error, message):
    kern = mhadsl.compile(EXAMPLES[0].parent / "causal.mha")["causal_fwd"]
    with pytest.raises(error, match=message):
        kern.backward(**{**_arrays(), **change})


def test_a_bad_scale_is_a_type_error():
    kern = mhadsl.compile(EXAMPLES[0].parent / "causal.mha")["causal_fwd"]
    with pytest.raises(TypeError, match="scale"):
        kern.backward(**_arrays(), scale="0.1")
