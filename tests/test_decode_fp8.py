"""A float8_e4m3fn KV cache without a GPU: the kernels' conversions (compiled for the host
from the same IR builders) against the reference's NumPy codec, the codec itself, the FP8
builds' PTX (sm_80 and sm_90a, no spills, mma.sync only, the scales last), and the host
checks of the cache's dtype and scales."""
import ctypes

import numpy as np
import pytest
from llvmlite import binding, ir

import mhadsl
from mhadsl.analysis.reference import e4m3_bytes, e4m3_values
from mhadsl.codegen import warp
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.codegen.backends import CacheLayout, decode
from mhadsl.codegen.nvptx import f32, i32
from mhadsl.host.paged import check_decode_call
from mhadsl.host.serving import kv_tile

from test_decode import PROGRAM

needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
FINITE = np.r_[0:127, 128:255]  # every byte but the two NaNs


@pytest.fixture(scope="module")
def host_codec():
    """(encode f32 -> byte, decode word -> f16 pair for odd False/True), JIT-compiled for the
    host from `warp.e4m3_from_f32` and `warp.e4m3_pair_to_f16`."""
    binding.initialize_native_target()
    binding.initialize_native_asmprinter()
    module = ir.Module("codec")
    encode = ir.Function(module, ir.FunctionType(i32, [f32]), "encode")
    b = ir.IRBuilder(encode.append_basic_block())
    b.ret(warp.e4m3_from_f32(b, encode.args[0]))
    for odd in (False, True):
        fn = ir.Function(module, ir.FunctionType(i32, [i32]), f"pair{int(odd)}")
        b = ir.IRBuilder(fn.append_basic_block())
        b.ret(warp.e4m3_pair_to_f16(b, fn.args[0], odd))
    machine = binding.Target.from_default_triple().create_target_machine()
    engine = binding.create_mcjit_compiler(binding.parse_assembly(str(module)), machine)
    engine.finalize_object()
    enc = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_float)(engine.get_function_address("encode"))
    pairs = [ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_uint32)(
        engine.get_function_address(f"pair{k}")) for k in (0, 1)]
    yield enc, pairs, engine


def test_the_codec_round_trips_every_finite_byte_and_saturates():
    values = e4m3_values(np.arange(256))
    assert values[0x7E] == 448 and values[0x08] == 2.0 ** -6 and values[0x01] == 2.0 ** -9
    assert np.isnan(values[0x7F]) and np.isnan(values[0xFF])
    assert np.array_equal(e4m3_bytes(values[FINITE].astype(np.float32)), FINITE)
    assert list(e4m3_bytes(np.float32([449, 1e6, np.inf, -np.inf, np.nan]))) == \
        [0x7E, 0x7E, 0x7E, 0xFE, 0x7F]
    # halfway between neighbours: to the even byte (1.0 = 0x38, next 1.125 = 0x39)
    assert list(e4m3_bytes(np.float32([1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10]))) == \
        [0x38, 0x3A, 0x00, 0x02]


def test_the_kernels_rounding_is_the_references(host_codec):
    encode, _, _ = host_codec
    values = e4m3_values(np.arange(256))
    order = np.argsort(values[FINITE])
    ordered = values[FINITE][order]
    halfway = (ordered[:-1] + ordered[1:]) / 2
    rng = np.random.default_rng(0)
    xs = np.concatenate([values[FINITE], halfway, np.nextafter(halfway, np.inf),
                         np.nextafter(halfway, -np.inf),
                         *(rng.standard_normal(5000) * s for s in (1e-3, 0.1, 3, 100, 1000)),
                         [np.inf, -np.inf, np.nan, -0.0, 464, 465, 1e30, 1e-30]])
    xs = xs.astype(np.float32)
    got = np.array([encode(float(x)) for x in xs], np.uint8)
    want = e4m3_bytes(xs)
    assert np.array_equal(got, want), xs[got != want][:5]


def test_the_kernels_fp8_to_f16_is_exact(host_codec):
    _, pairs, _ = host_codec
    values = e4m3_values(np.arange(256))
    for code in FINITE:
        for odd, pair in enumerate(pairs):
            # the pair's bytes: (code, 0x5a) at bytes (1, 3) for odd, (0, 2) else
            word = (code | 0x5A << 16) << (8 if odd else 0)
            halves = np.array([pair(word) & 0xFFFF, pair(word) >> 16], np.uint16).view(np.float16)
            assert halves.astype(np.float64).tolist() == \
                [values[code] / warp.E4M3_PER_F16, values[0x5A] / warp.E4M3_PER_F16]


FP8_BUILDS = [  # kernel, GQA group, cache layout (query rows, page size, KV tile, appends)
    ("causal", 4, CacheLayout(1, 64, fp8=True)),
    ("causal", 8, CacheLayout(1, 16, 32, fp8=True)),
    ("causal", 1, CacheLayout(1, 0, fp8=True)),
    ("causal", 4, CacheLayout(16, 64, fp8=True)),  # 64 rows: still mma.sync on sm_90a
    ("causal", 8, CacheLayout(0, 64, appends=True, fp8=True)),
    ("causal_d64", 8, CacheLayout(2, 32, fp8=True)),
    ("softcap", 4, CacheLayout(4, 16, appends=True, fp8=True)),
    ("plain_d256", 4, CacheLayout(1, 64, fp8=True)),
    ("causal", 32, CacheLayout(1, 64, 128, fp8=True)),  # MQA's 32 rows take 128-row tiles
]


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("name,group,cache", FP8_BUILDS)
def test_fp8_builds_assemble_without_spills(arch, name, group, cache):
    build = PROGRAM[name].build(arch, gqa_group=group, cache=cache)
    config = build.config
    assert config.fp8 and not config.wgmma and config.kv_row_bytes == config.head_dim
    for kernel in build.assembled.kernels.values():
        if config.head_dim < 256:
            assert kernel.spills == 0
    body = build.ptx.split(f".entry {decode.KERNEL_NAME}(")[1]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in body
    assert "wgmma" not in body and ".bf16.bf16" not in body
    # sm_90a converts FP8 by its conversion unit; sm_80, which has none, by integer steps
    assert config.fp8_cvt == ("cvt.rn.f16x2.e4m3x2" in body) == (arch == "sm_90a")
    params = body.split(")")[0].strip().splitlines()
    assert len(params) == len(decode.decode_abi(config).params)
    assert all(".f32" in line for line in params[-2:])  # k_scale, v_scale


def test_the_scales_are_the_last_parameters_of_both_kernels():
    config = PROGRAM["causal"].build("sm_80", gqa_group=4, cache=CacheLayout(
        1, 16, appends=True, fp8=True)).config
    names = [p.name for p in decode.decode_abi(config)]
    assert names[-2:] == ["k_scale", "v_scale"]
    assert names[:-2] == [p.name for p in decode.APPEND_ABI]
    launches = decode.BACKEND.kernels(config)
    assert [k.name for k in launches] == [decode.APPEND_NAME, decode.KERNEL_NAME]
    assert all([p.name for p in k.abi] == names for k in launches)


def test_the_fp8_build_reads_one_byte_rows_and_keeps_twice_the_tiles_in_flight():
    kern = PROGRAM["causal"]
    bf16 = kern.build("sm_80", gqa_group=4, cache=CacheLayout(1, 64)).config
    fp8 = kern.build("sm_80", gqa_group=4, cache=CacheLayout(1, 64, fp8=True)).config
    assert fp8.stage_bytes * 2 == bf16.stage_bytes
    assert fp8.stages == 2 * bf16.stages  # the same bytes in flight
    assert fp8.mma_dtype == "fp16" and bf16.mma_dtype == "bf16"


@pytest.mark.parametrize("rows, want", [(16, 64), (32, 128), (64, 64)])
def test_an_fp8_cache_takes_its_own_kv_tile(rows, want):
    # (a bf16 cache of this shape takes 32-row tiles: many 16-row work tiles)
    assert kv_tile(rows, 10_000, 132, 64, wgmma=True, fp8=True) == want
    assert kv_tile(16, 10_000, 132, 64) == 32


class _Tensor:
    """Shape and dtype, all `check_decode_call` reads of a tensor."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


def _fp8_call(**change):
    args = dict(q=_Tensor((2, 1, 8, 128), "bfloat16"),
                k_cache=_Tensor((2, 64, 2, 128), "float8_e4m3fn"),
                v_cache=_Tensor((2, 64, 2, 128), "float8_e4m3fn"),
                cache_seqlens=np.array([3, 4], np.int32))
    args.update(change)
    return check_decode_call(PROGRAM["causal"].options, args.pop("q"), args.pop("k_cache"),
                             args.pop("v_cache"), **args)


def test_an_fp8_call_carries_its_scales():
    assert _fp8_call().kv_scales == (1.0, 1.0)
    assert _fp8_call(k_scale=0.5, v_scale=2).kv_scales == (0.5, 2.0)
    assert _fp8_call(k_cache=_Tensor((2, 64, 2, 128), "bfloat16"),
                     v_cache=_Tensor((2, 64, 2, 128), "bfloat16")).kv_scales is None
    new = _Tensor((2, 1, 2, 128), "bfloat16")  # the new rows come in q's dtype
    assert _fp8_call(k_new=new, v_new=new).appends


@pytest.mark.parametrize("change, error, match", [
    (dict(v_cache=_Tensor((2, 64, 2, 128), "bfloat16")), TypeError, "both be float8_e4m3fn"),
    (dict(k_scale=0.0), ValueError, "k_scale must be finite and above 0"),
    (dict(v_scale=float("nan")), ValueError, "v_scale must be finite"),
    (dict(k_scale="1"), TypeError, "k_scale must be a float"),
    (dict(k_new=_Tensor((2, 1, 2, 128), "float8_e4m3fn"),
          v_new=_Tensor((2, 1, 2, 128), "float8_e4m3fn")), TypeError, "q's is bfloat16"),
    (dict(k_cache=_Tensor((2, 64, 2, 128), "bfloat16"),
          v_cache=_Tensor((2, 64, 2, 128), "bfloat16"), k_scale=2.0), ValueError,
     "dequantise a float8_e4m3fn cache"),
])
def test_bad_fp8_calls_are_refused(change, error, match):
    with pytest.raises(error, match=match):
        _fp8_call(**change)
