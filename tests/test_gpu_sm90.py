"""The Hopper kernel (backend "sm90", forced) on the GPU against the float64 reference:
fresh random inputs, output poisoned with NaN first; every mask/score example, dense and
ragged, Sq != Sk, odd lengths, GQA/MQA, head dims 64/128, fp16 and LSE, every standard
scheduler, keys of length zero, CUDA graph replay. Skipped off compute capability 9.0."""
import numpy as np
import pytest

import mhadsl
from helpers import REPO
from test_gpu_attention import RAGGED, SCHEDULED, assert_matches, dense, ragged

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

EXTRA = 'import "std/schedulers.mha"\n' + SCHEDULED + """
attention causal_d64 { dtype = bf16  head_dim = 64  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention lse_fp16 { dtype = fp16  head_dim = 128  return_lse = true
                     mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention plain_lse_d64 { dtype = bf16  head_dim = 64  return_lse = true }
"""


@pytest.fixture(autouse=True)
def _hopper_only():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 kernel runs on compute capability 9.0 only")


def hopper(kern):
    kern.backend = "sm90"
    return kern


def kernel(file: str, name: str):
    return hopper(mhadsl.compile(REPO / "examples" / file)[name])


def extra(name: str):
    return hopper(mhadsl.compile(EXTRA, name="sm90_extra.mha")[name])


@pytest.mark.parametrize("file, name", [
    ("plain.mha", "plain_fwd"), ("plain.mha", "plain_fp16_d64"), ("causal.mha", "causal_fwd"),
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
    assert kern._builds and all(b.backend.name == "sm90" for b in kern._builds.values())


def test_bottom_right_causal_with_longer_keys():
    kern = kernel("bottom_right_causal.mha", "bottom_right_causal")
    assert_matches(kern, dense(kern, 2, 100, 300, 4, 4))
    assert_matches(kern, dense(kern, 1, 700, 260, 2, 2))
    assert_matches(kern, ragged(kern, [5, 0, 127, 64], [300, 7, 129, 64], 2, 2))


@pytest.mark.parametrize("hq, hkv", [(8, 2), (8, 1)])
def test_gqa_and_mqa(hq, hkv):
    kern = kernel("gqa.mha", "gqa_causal") if hkv == 2 else kernel("gqa.mha", "mqa")
    if kern.options.gqa:
        hq = kern.options.gqa * hkv
    assert_matches(kern, dense(kern, 2, 257, 257, hq, hkv))
    assert_matches(kern, ragged(kern, RAGGED, RAGGED, hq, hkv))


@pytest.mark.parametrize("name", ["causal_d64", "lse_fp16", "plain_lse_d64"])
def test_head_dims_fp16_and_lse(name):
    kern = extra(name)
    lse = kern.options.return_lse
    assert_matches(kern, dense(kern, 2, 191, 191, 3, 3), lse=lse)
    assert_matches(kern, dense(kern, 1, 300, 77, 2, 2), lse=lse)
    assert_matches(kern, ragged(kern, RAGGED, RAGGED, 2, 2), lse=lse)


@pytest.mark.parametrize("name", [n for n in mhadsl.compile(EXTRA, name="x").attentions
                                  if n.split("_")[0] in ("transient", "persistent", "queued", "lpt")])
def test_every_standard_scheduler(name):
    kern = extra(name)
    assert_matches(kern, dense(kern, 3, 700, 700, 5, 5))
    assert_matches(kern, ragged(kern, RAGGED, RAGGED, 3, 3))


def test_no_keys_gives_zeros():
    kern = kernel("causal.mha", "causal_fwd")
    no_keys = dense(kern, 1, 16, 0, 2, 2)
    out = kern(**no_keys, out=torch.full_like(no_keys["q"], float("nan")))
    assert torch.all(out == 0)


def test_cuda_graph_replay():
    kern = kernel("causal.mha", "causal_fwd")
    args = dense(kern, 2, 1000, 1000, 4, 4)
    out = torch.empty_like(args["q"])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kern(**args, out=out, stream=stream)  # warm-up: build, load, counter allocation
    stream.synchronize()
    expected = out.clone()
    ref = mhadsl.reference(kern, **args)
    assert np.linalg.norm(expected.float().cpu().numpy() - ref) / np.linalg.norm(ref) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        kern(**args, out=out, stream=stream)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
