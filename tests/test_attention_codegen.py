"""CPU tests of the attention kernel generator (codegen/backends/sm80.py): every supported
configuration builds, emits PTX for sm_80 and sm_90a, and ptxas reports zero spills."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from llvmlite import ir

import mhadsl
from mhadsl.codegen.backends import CacheLayout, sm80 as A
from mhadsl.codegen.target import emit_ptx, gpu_target, optimize

PTXAS = shutil.which("ptxas")
needs_ptxas = pytest.mark.skipif(PTXAS is None, reason="ptxas not on PATH")

ARCHS = ("sm_80", "sm_90a")
HOOKS = {"none": A.NO_MASK, "causal": A.causal_hooks()}


def _ptxas(ptx: str, arch: str, tmp_path) -> dict:
    src = tmp_path / f"k_{arch}.ptx"
    src.write_text(ptx)
    res = subprocess.run([PTXAS, "-v", f"-arch={arch}", str(src), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    log = res.stderr
    return {
        "regs": int(re.search(r"Used (\d+) registers", log).group(1)),
        "spill_stores": int(re.search(r"(\d+) bytes spill stores", log).group(1)),
        "spill_loads": int(re.search(r"(\d+) bytes spill loads", log).group(1)),
        "stack": int(re.search(r"(\d+) bytes stack frame", log).group(1)),
    }


def _ptx(config, hooks, arch):
    target = gpu_target(arch)
    return emit_ptx(optimize(A.build_attention_module(config, hooks, target), target), target)


CONFIGS = [
    pytest.param(dtype, d, mask, ragged, arch, id=f"{dtype}-d{d}-{mask}-{'ragged' if ragged else 'dense'}-{arch}")
    for dtype in ("bf16", "fp16") for d in (64, 128, 256) for mask in ("none", "causal")
    for ragged in (False, True) for arch in ARCHS
]


@needs_ptxas
@pytest.mark.parametrize("dtype,head_dim,mask,ragged,arch", CONFIGS)
def test_builds_assembles_without_spills(dtype, head_dim, mask, ragged, arch, tmp_path):
    # ragged builds also exercise GQA and the LSE epilogue
    config = A.default_config(dtype, head_dim, gqa_group=4 if ragged else 1,
                              return_lse=ragged, ragged=ragged)
    ptx = _ptx(config, HOOKS[mask], arch)
    assert f".target {arch}" in ptx
    assert ".entry mha_fwd" in ptx
    # the instructions the design promises
    assert "mma.sync.aligned.m16n8k16.row.col.f32" in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    assert "cp.async.cg.shared.global" in ptx
    assert "ex2.approx" in ptx
    assert "shfl.sync.bfly" in ptx
    info = _ptxas(ptx, arch, tmp_path)
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info
    assert info["stack"] == 0, info


def test_config_validation():
    with pytest.raises(ValueError):
        A.AttentionConfig(head_dim=96).validate()
    with pytest.raises(ValueError):
        A.AttentionConfig(block_m=96, num_warps=4).validate()
    with pytest.raises(ValueError):
        A.AttentionConfig(dtype="fp8").validate()
    cfg = A.default_config("bf16", 128)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.stages) == (128, 64, 4, 2)
    assert A.threads(cfg) == 128
    assert A.shared_bytes(cfg) == (128 + 2 * 64) * 128 * 2
    assert A.shared_bytes(A.default_config("bf16", 256)) == (128 + 2 * 64) * 256 * 2
    assert hash(cfg) == hash(A.default_config("bf16", 128))


# The kernel's ABI as the runtime calls it (by name, in this order, each PTX parameter the
# size of the value the host packs: tests/test_abi.py). Written out, not derived from
# the ABI: reordering, retyping, adding or dropping a parameter must change it too.
PTR, I64, I32, F32 = ".u64 .ptr", ".u64", ".u32", ".f32"
KERNEL_ABI = [
    ("q", PTR), ("k", PTR), ("v", PTR), ("o", PTR), ("lse", PTR), ("cu_seqlens_q", PTR),
    ("cu_seqlens_k", PTR),
    *((f"{t}_stride_{d}", I64) for t in "qkvo" for d in ("batch", "row", "head")),
    ("lse_stride_batch", I64), ("lse_stride_head", I64),
    ("batch", I32), ("num_heads", I32), ("max_seqlen_q", I32), ("max_seqlen_k", I32),
    ("seqlen_q", I32), ("seqlen_k", I32), ("softmax_scale", F32), ("queue", PTR),
    ("num_sms", I32), ("ctas_per_sm", I32), ("tile_index", PTR),
]


def test_kernel_parameters_are_the_runtime_abi():
    cfg = A.default_config("bf16", 64)
    ptx = _ptx(cfg, A.NO_MASK, "sm_80")
    entry = ptx[ptx.index(f".entry {A.kernel_name(cfg)}("):]
    declared = re.findall(r"\.param (\.\w+(?: \.ptr)?) [^\n]*_param_(\d+)",
                          entry[:entry.index(")")])
    assert [int(k) for _, k in declared] == list(range(len(KERNEL_ABI)))
    assert [ptx_type for ptx_type, _ in declared] == [t for _, t in KERNEL_ABI]
    assert [p.name for p in A.ABI] == [name for name, _ in KERNEL_ABI]
    assert ".maxntid 128\n" in ptx  # the launcher's block: threads(config)


def test_score_hook_and_custom_work_loop():
    """A score hook (soft-capping-like) and a persistent-style work loop that emits the tile
    body once and twice: the body must be re-entrant, so the second emission is as whole as
    the first (no one-time Q load, barrier or pipeline stage left to the first tile)."""

    def score(b, s, bi, h, q, kv):
        return b.fmul(s, ir.Constant(ir.FloatType(), 0.5))

    def tiles(count):
        def work_loop(builder, args, body):
            for tile in range(count):
                zero = ir.Constant(ir.IntType(32), 0)
                offset = ir.Constant(ir.IntType(32), tile * args.config.block_m)
                body(builder, A.TileSeq(seq_len=args.seqlen_q, start_of_seq=zero,
                                        prompt_offset=offset, head_idx=zero, prompt_idx=zero))
        return work_loop

    hooks = A.ExprHooks(mask=A.causal_hooks().mask, score=score, classify=None)
    cfg = A.default_config("bf16", 64, return_lse=True)
    target = gpu_target("sm_90a")
    one, two = (emit_ptx(optimize(A.build_attention_module(cfg, hooks, target, tiles(n)),
                                  target), target) for n in (1, 2))
    for instruction in ("bar.sync", "cp.async.cg.shared.global", "ldmatrix.sync",
                        "mma.sync.aligned", "ex2.approx"):
        assert two.count(instruction) == 2 * one.count(instruction) > 0, instruction


def test_a_score_divides_with_fast_math_on_the_gpu():
    """A division by a constant is a multiplication by its reciprocal, one by a scalar
    operand a multiplication by its reciprocal computed once (`div.full.f32` of 1), and one
    by a value that varies per element `div.full.f32`: never the IEEE division's subroutine
    (`div.rn.f32`), which cost a softcapped score a tenth of its speed."""
    program = mhadsl.compile('''
        attention by_constant { dtype = bf16  head_dim = 64
            score(s, b, h, q_idx, kv_idx) = 30.0 * tanh(s / 30.0) }
        attention by_operand(cap: f32 = 30.0) { dtype = bf16  head_dim = 64
            score(s, b, h, q_idx, kv_idx) = cap * tanh(s / cap) }
        attention by_element { dtype = bf16  head_dim = 64
            score(s, b, h, q_idx, kv_idx) = s / (1.0 + f32(kv_idx)) }''')
    for arch in ARCHS:
        by_constant = program["by_constant"].build(arch, backend="sm80").ptx
        by_operand = program["by_operand"].build(arch, backend="sm80").ptx
        by_element = program["by_element"].build(arch, backend="sm80").ptx
        assert "div.rn.f32" not in by_constant + by_operand + by_element
        assert "div.full.f32" not in by_constant and "0f3D088889" in by_constant  # 1 / 30
        assert by_operand.count("div.full.f32") == 1 < by_operand.count("tanh.approx.f32")
        assert by_element.count("div.full.f32") > 1
    # the backward's derivative and the decode kernel lower the same rule
    for build in (program["by_constant"].build("sm_90a", backward=True),
                  program["by_operand"].build("sm_90a", cache=CacheLayout())):
        assert "div.rn.f32" not in build.ptx and "tanh.approx.f32" in build.ptx
