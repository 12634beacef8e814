"""The Hopper backward design without a GPU (codegen/backends/backward_sm90.py): which calls
it runs, its configs' problems and shared memory, its ABI (tensor maps first), its builds
assembling without spills, its producer and consumer warpgroups, its hand-over to the sm80
design's build (and that build read back from the cache as the sm80 design's), and the
wgmma operand forms it adds."""
import pytest
from llvmlite import ir

import mhadsl
from helpers import EXAMPLES
from mhadsl.codegen import hopper, nvptx
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.codegen.backends import SHARED_MEMORY_LIMIT, Layout, backend_for_arch
from mhadsl.codegen.backends import backward_sm90 as H
from mhadsl.codegen.backends.backward import BackwardConfig

needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="ptxas not found")
CAUSAL = EXAMPLES[0].parent / "causal.mha"


def _options(source: str):
    return mhadsl.compile(source)["t"].options


@pytest.mark.parametrize("layout, arch, expected", [
    (Layout(backward=True), "sm_90a", "backward_sm90"),
    (Layout(gqa_group=4, backward=True), "sm_90a", "backward_sm90"),
    (Layout(ragged=True, backward=True), "sm_90a", "backward"),
    (Layout(deterministic=True, backward=True), "sm_90a", "backward"),
    (Layout(backward=True), "sm_80", "backward"),
])
def test_the_hopper_design_runs_dense_atomic_calls_on_sm90a(layout, arch, expected):
    options = _options("attention t { dtype = bf16  head_dim = 128 }")
    assert backend_for_arch(arch, None, options, "backward", layout).name == expected


def test_a_head_dim_the_hopper_design_cannot_run_takes_the_sm80_design():
    options = _options("attention t { dtype = bf16  head_dim = 256 }")
    assert H.BACKEND.problems(options, "sm_90a")[0].settings == ("head_dim",)
    assert backend_for_arch("sm_90a", None, options, "backward",
                            Layout(backward=True)).name == "backward"


def test_config_problems_and_shared_memory():
    assert not H.HopperBackwardConfig().problems()
    assert not H.HopperBackwardConfig(head_dim=64).problems()
    assert H.HopperBackwardConfig(head_dim=256).problems()[0].settings == ("head_dim",)
    assert H.HopperBackwardConfig(block_m=32).problems()[0].settings == ("tile",)
    assert H.HopperBackwardConfig(ragged=True).problems()
    assert H.HopperBackwardConfig(deterministic=True).problems()
    for d in (64, 128):
        config = H.HopperBackwardConfig(head_dim=d)
        assert H.shared_bytes(config) <= SHARED_MEMORY_LIMIT["sm_90a"]
        assert H.launch_shapes(config)[H.MAIN].threads == 384  # a producer, two consumers


def test_the_tensor_maps_come_first_at_multiples_of_128_bytes():
    maps = [p for p in H.ABI if p.kind == "tensor_map"]
    assert [p.name for p in H.ABI][:4] == ["q_map", "k_map", "v_map", "dout_map"]
    assert [H.ABI.offsets[p.name] for p in maps] == [0, 128, 256, 384]
    assert H.kernel_abi(H.MAIN) is H.ABI and H.kernel_abi(H.PREPROCESS) is not H.ABI


@needs_ptxas
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_causal_build_assembles_without_spills(head_dim, monkeypatch, tmp_path):
    """Causal at head dims 64 and 128: wgmma, dQ by red.global.add.v2.f32 from registers."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    source = ('import "std/schedulers.mha"\nattention t { dtype = bf16  head_dim = '
              f'{head_dim}\n mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }}')
    build = mhadsl.compile(source)["t"].backward_build("sm_90a")
    assert build.backend == "backward_sm90"
    assert "red.global.add.v2.f32" in build.ptx
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in build.ptx
    for resources in build.assembled.kernels.values():
        assert resources.spills == 0 and resources.stack_bytes == 0, resources
    assert "C7519" not in build.assembled.log  # no injected warpgroup.arrive


@needs_ptxas
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_producer_warpgroup_feeds_two_consumers(head_dim, tmp_path, monkeypatch):
    """FlashAttention-3's layout: the producer gives registers back and loads each query
    step (TMA, and cp.async arriving on the stage's full mbarrier); the consumers take
    registers, meet at one named barrier per step (dS^T is complete) and free the stage."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    source = ('import "std/schedulers.mha"\nattention t { dtype = bf16  head_dim = '
              f'{head_dim}\n mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }}')
    build = mhadsl.compile(source)["t"].backward_build("sm_90a", gqa_group=4)
    assert build.backend == "backward_sm90"
    producer, consumers = H.REGISTERS
    for text in (f"setmaxnreg.dec.sync.aligned.u32 \t{producer};",
                 f"setmaxnreg.inc.sync.aligned.u32 \t{consumers};",
                 "cp.async.mbarrier.arrive.noinc.shared.b64",
                 f"bar.sync \t{nvptx.DS_BARRIER}, 256;", "mbarrier.arrive.shared::cta.b64"):
        assert text in build.ptx, text
    assert "C7508" not in build.assembled.log  # setmaxnreg honoured
    main = build.assembled.kernels["mha_bwd"]
    assert main.spills == 0 and main.stack_bytes == 0, main


@needs_ptxas
def test_a_build_the_hopper_design_cannot_fit_is_the_sm80_designs(monkeypatch, tmp_path):
    """Softcap's G beside P^T leaves the Hopper build a stack frame in every IR shape: the
    backend hands over to the sm80 design's build, which the cache gives back as that
    design's (its config type), so the host launches its kernels."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    kern = mhadsl.compile(EXAMPLES[0].parent / "softcap.mha")["softcap_causal"]
    first = kern.backward_build("sm_90a")
    again = mhadsl.compile(EXAMPLES[0].parent / "softcap.mha")["softcap_causal"] \
        .backward_build("sm_90a")
    for build in (first, again):
        assert build.backend == "backward"
        assert type(build.config) is BackwardConfig
    assert again.cached and again.config == first.config


def test_wgmma_takes_a_transposed_shared_a_operand():
    module = ir.Module()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ir.IntType(64)] * 2), "f")
    b = ir.IRBuilder(fn.append_basic_block())
    hopper.wgmma(b, "bf16", 64, fn.args[0], fn.args[1], None, trans_b=True, trans_a=True)
    b.ret_void()
    assert "d, 1,1,1,1;" in str(module)
    with pytest.raises(ValueError, match="transpose"):
        hopper.wgmma(b, "bf16", 64, [fn.args[0]] * 4, fn.args[1], trans_a=True)
