"""Attention kernels on the GPU against the float64 reference (fresh random inputs,
poisoned outputs): dense and ragged, every mask/score example, GQA/MQA, head dims, every
standard scheduler, CUDA graphs and concurrent streams."""
import numpy as np
import pytest

import mhadsl
from helpers import REPO

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

RAGGED = [0, 1, 127, 129, 3000]
SCHEDULED = "\n".join(
    f"attention {name.lower()}_{order.lower()} {{ dtype = bf16  head_dim = 128  "
    f"scheduler = {name}({'' if name == 'LPT' else f'order = {order}'})  "
    f"mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }}"
    for name in ("Transient", "Persistent", "Queued", "LPT")
    for order in (("DEFAULT",) if name == "LPT" else ("DEFAULT", "PROMPT_ROTATE")))
EXTRA = 'import "std/schedulers.mha"\n' + SCHEDULED + """
attention plain_d256 { dtype = bf16  head_dim = 256 }
attention causal_d64 { dtype = bf16  head_dim = 64  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention lse_fp16 { dtype = fp16  head_dim = 128  return_lse = true
                     mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
"""


def kernel(file: str, name: str):
    return mhadsl.compile(REPO / "examples" / file)[name]


def extra(name: str):
    return _extra()[name]


_cache = {}


def _extra():
    if "p" not in _cache:
        _cache["p"] = mhadsl.compile(EXTRA, name="extra.mha")
    return _cache["p"]


def rand(*shape, dtype=torch.bfloat16, seed=None):
    gen = torch.Generator(device="cuda").manual_seed(seed if seed is not None else
                                                     np.random.randint(1 << 30))
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)


def dense(kern, b, sq, sk, hq, hkv, **kw):
    d = kern.options.head_dim
    dt = torch.bfloat16 if kern.options.dtype == "bf16" else torch.float16
    q, k, v = rand(b, sq, hq, d, dtype=dt), rand(b, sk, hkv, d, dtype=dt), rand(b, sk, hkv, d, dtype=dt)
    return dict(q=q, k=k, v=v, **kw)


def ragged(kern, lens_q, lens_k, hq, hkv, **kw):
    d = kern.options.head_dim
    dt = torch.bfloat16 if kern.options.dtype == "bf16" else torch.float16
    cq = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    ck = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    q = rand(sum(lens_q), hq, d, dtype=dt)
    k, v = rand(sum(lens_k), hkv, d, dtype=dt), rand(sum(lens_k), hkv, d, dtype=dt)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, **kw)


def assert_matches(kern, args, lse=False):
    out = torch.full_like(args["q"], float("nan"))  # poison: every row must be written
    result = kern(**args, out=out, return_lse=lse)
    got, got_lse = (result if lse else (result, None))
    assert got is out
    ref = mhadsl.reference(kern, **args, return_lse=lse)
    ref, ref_lse = (ref if lse else (ref, None))
    got = got.float().cpu().numpy().astype(np.float64)
    rows = _covered_rows(args)
    assert np.isfinite(got[rows]).all(), "NaN or unwritten output"
    err = np.linalg.norm(got[rows] - ref[rows]) / max(np.linalg.norm(ref[rows]), 1e-30)
    assert err < 1e-2, err
    if lse:
        g = got_lse.cpu().numpy().astype(np.float64)
        finite = np.isfinite(ref_lse)
        assert np.array_equal(np.isfinite(g), finite) or not finite.all()
        assert np.allclose(g[finite], ref_lse[finite], atol=2e-2, rtol=1e-3)


def _covered_rows(args):
    if "cu_seqlens_q" not in args:
        return slice(None)
    return slice(0, int(args["cu_seqlens_q"][-1]))


@pytest.mark.parametrize("file, name", [
    ("plain.mha", "plain_fwd"), ("causal.mha", "causal_fwd"),
    ("sliding_window.mha", "sliding_window_256"), ("softcap.mha", "softcap_causal"),
    ("alibi.mha", "alibi_causal"),
])
@pytest.mark.parametrize("layout", ["dense", "ragged"])
def test_examples_against_reference(file, name, layout):
    kern = kernel(file, name)
    if layout == "dense":
        assert_matches(kern, dense(kern, 2, 129, 129, 4, 4))
        assert_matches(kern, dense(kern, 1, 3000, 3000, 2, 2))
    else:
        assert_matches(kern, ragged(kern, RAGGED, RAGGED, 3, 3))


def test_bottom_right_causal_with_longer_keys():
    kern = kernel("bottom_right_causal.mha", "bottom_right_causal")
    assert_matches(kern, dense(kern, 2, 100, 300, 4, 4))
    assert_matches(kern, ragged(kern, [5, 0, 127, 64], [300, 7, 129, 64], 2, 2))


@pytest.mark.parametrize("hq, hkv", [(8, 2), (8, 1)])
def test_gqa_and_mqa(hq, hkv):
    kern = kernel("gqa.mha", "gqa_causal") if hkv == 2 else kernel("gqa.mha", "mqa")
    if kern.options.gqa:
        hq = kern.options.gqa * hkv
    assert_matches(kern, dense(kern, 2, 257, 257, hq, hkv))
    assert_matches(kern, ragged(kern, RAGGED, RAGGED, hq, hkv))


@pytest.mark.parametrize("name", ["plain_d256", "causal_d64", "lse_fp16"])
def test_head_dims_fp16_and_lse(name):
    kern = extra(name)
    lse = kern.options.return_lse
    assert_matches(kern, dense(kern, 2, 191, 191, 3, 3), lse=lse)
    assert_matches(kern, ragged(kern, RAGGED, RAGGED, 2, 2), lse=lse)


def test_fp16_d64_plain_example_with_lse():
    kern = kernel("plain.mha", "plain_fp16_d64")
    assert_matches(kern, dense(kern, 2, 300, 77, 4, 4), lse=True)


@pytest.mark.parametrize("name", [n for n in mhadsl.compile(EXTRA, name="x").attentions
                                  if n.split("_")[0] in ("transient", "persistent", "queued", "lpt")])
def test_every_standard_scheduler(name):
    kern = extra(name)
    assert_matches(kern, dense(kern, 3, 700, 700, 5, 5))
    assert_matches(kern, ragged(kern, RAGGED, RAGGED, 3, 3))


def test_zero_length_inputs():
    kern = kernel("causal.mha", "causal_fwd")
    empty = dense(kern, 0, 16, 16, 2, 2)
    assert kern(**empty).shape == (0, 16, 2, 128)
    no_keys = dense(kern, 1, 16, 0, 2, 2)
    out = kern(**no_keys, out=torch.full_like(no_keys["q"], float("nan")))
    assert torch.all(out == 0)


def test_numpy_inputs_round_trip():
    kern = kernel("causal.mha", "causal_fwd")
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 65, 2, 128)).astype(np.float32) for _ in range(3))
    out = kern(q, k, v)
    assert isinstance(out, np.ndarray)
    ref = mhadsl.reference(kern, q, k, v)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def test_one_build_for_five_shapes():
    kern = mhadsl.compile(EXTRA, name="builds.mha")["causal_d64"]
    for b, s in [(1, 1), (2, 127), (3, 129), (1, 3000), (5, 64)]:
        assert_matches(kern, dense(kern, b, s, s, 2, 2))
    assert kern.builds_compiled <= 1  # 0 when the on-disk cache already held it
    assert len(kern._builds) == 1


def test_cuda_graph_replay():
    kern = kernel("causal.mha", "causal_fwd")
    args = dense(kern, 2, 1000, 1000, 4, 4)
    out = torch.empty_like(args["q"])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kern(**args, out=out, stream=stream)  # warm-up: build, load, counter allocation
    stream.synchronize()
    expected = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        kern(**args, out=out, stream=stream)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


def test_two_streams_at_once():
    kern = kernel("causal.mha", "causal_fwd")
    a, b = dense(kern, 2, 2000, 2000, 8, 8), dense(kern, 1, 3000, 3000, 8, 8)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        oa = kern(**a, stream=s1)
    with torch.cuda.stream(s2):
        ob = kern(**b, stream=s2)
    torch.cuda.synchronize()
    for args, out in ((a, oa), (b, ob)):
        ref = mhadsl.reference(kern, **args)
        got = out.float().cpu().numpy()
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


def test_cupy_fp16_inputs_come_back_as_cupy():
    cupy = pytest.importorskip("cupy")
    kern = extra("lse_fp16")
    rng = np.random.default_rng(2)
    host = [rng.standard_normal((2, 130, 2, 128)).astype(np.float16) for _ in range(3)]
    q, k, v = (cupy.asarray(a) for a in host)
    out, lse = kern(q, k, v)
    assert isinstance(out, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    ref, ref_lse = mhadsl.reference(kern, *host, return_lse=True)
    got = cupy.asnumpy(out).astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2
    assert np.allclose(cupy.asnumpy(lse), ref_lse, atol=2e-2)
