"""Attention kernels on the GPU against the float64 reference (fresh random inputs,
poisoned outputs), once per kernel design: `sm80` (FlashAttention-2 on mma.sync, every GPU)
and `sm90` (TMA + wgmma, compute capability 9.0 only; its ids skip elsewhere), each forced.
Dense and ragged with sequence lengths 0, 1, 127, 129 and 3000, Sq != Sk, every mask/score
example, GQA/MQA, head dims 64/128/256, fp16 and LSE, every standard scheduler and user-written ones, CUDA graphs and concurrent streams."""
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
EXTRA = f'import "std/schedulers.mha"\nimport "{REPO / "examples/queued_rotate.mha"}"\n' \
    + SCHEDULED + """
// A user scheduler: a few persistent CTAs stride through the work from its last index.
scheduler Reversed(num_ctas: u32 = 5) {
    may_advance = true
    schedule = DEFAULT
    grid_dim(batch_size, max_num_prompt_tiles) = (num_ctas, 1, 1)
    initial_state(slots, ts) = State(idx = block_idx.x, slots = slots, max_idx = ts.num_work())
    get_current_work_info(ts, state) = ts.work_info(state.max_idx - 1 - state.idx, schedule)
    advance(ts, state, pipeline_idx) {
        state.idx += grid_dim.x
        if state.idx >= state.max_idx { return none }
        return ts.seq_info(ts.work_info(state.max_idx - 1 - state.idx, schedule))
    }
    unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.max_idx - 1 - state.idx, schedule))
}
attention user_reversed { dtype = bf16  head_dim = 128  scheduler = Reversed()
                          mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention user_queued { dtype = bf16  head_dim = 128  scheduler = MyQueued()
                        mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention user_queued_3_ctas { dtype = bf16  head_dim = 128  scheduler = MyQueued(num_ctas = 3)
                               mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention plain_d256 { dtype = bf16  head_dim = 256 }
attention causal_lse_d256 { dtype = fp16  head_dim = 256  return_lse = true
                            mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention tile_64_rows { dtype = bf16  head_dim = 128  tile = (64, 64) }
attention causal_d64 { dtype = bf16  head_dim = 64  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention lse_fp16 { dtype = fp16  head_dim = 128  return_lse = true
                     mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention plain_lse_d64 { dtype = bf16  head_dim = 64  return_lse = true }
attention window_d64 { dtype = bf16  head_dim = 64
                       mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && q_idx - kv_idx < 300 }
attention causal_holes { dtype = bf16  head_dim = 128
                         mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && kv_idx / 128 % 3 != 1 }
attention unsigned_window { dtype = bf16  head_dim = 128
                            mask(b, h, q_idx, kv_idx) = u32(q_idx - kv_idx) < 300 }
"""
SCHEDULER_KERNELS = [n for n in mhadsl.compile(EXTRA, name="x").attentions
                     if n.split("_")[0] in ("transient", "persistent", "queued", "lpt", "user")]


@pytest.fixture(params=["sm80", "sm90"])
def backend(request):
    """The kernel design every kernel of the test is forced to."""
    if request.param == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 kernel runs on compute capability 9.0 only")
    return request.param


def kernel(file: str, name: str, backend: str):
    kern = mhadsl.compile(REPO / "examples" / file)[name]
    kern.backend = backend
    return kern


_programs = {}


def extra(name: str, backend: str):
    if backend not in _programs:  # one program per design: its kernels are forced to it
        _programs[backend] = mhadsl.compile(EXTRA, name="extra.mha")
    kern = _programs[backend][name]
    kern.backend = backend
    return kern


def rand(*shape, dtype=torch.bfloat16, seed=None):
    gen = torch.Generator(device="cuda").manual_seed(seed if seed is not None else
                                                     np.random.randint(1 << 30))
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)


def dense(kern, b, sq, sk, hq, hkv, **kw):
    d = kern.options.head_dim
    dt = torch.bfloat16 if kern.options.dtype == "bf16" else torch.float16
    q, k, v = rand(b, sq, hq, d, dtype=dt), rand(b, sk, hkv, d, dtype=dt), rand(b, sk, hkv, d, dtype=dt)
    return dict(q=q, k=k, v=v, **kw)


def ragged(kern, lens_q, lens_k, hq, hkv, one_offsets=False, **kw):
    """A ragged call; `one_offsets`: one offsets tensor for Q and K, as self-attention passes
    (the kernels then take K's rows from Q's, `WorkTile._key_rows`), else two."""
    d = kern.options.head_dim
    dt = torch.bfloat16 if kern.options.dtype == "bf16" else torch.float16
    cq = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    ck = cq if one_offsets else \
        torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    q = rand(sum(lens_q), hq, d, dtype=dt)
    k, v = rand(sum(lens_k), hkv, d, dtype=dt), rand(sum(lens_k), hkv, d, dtype=dt)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, **kw)


def assert_matches(kern, args, lse=False):
    out = torch.full_like(args["q"], float("nan"))  # poison: every row must be written
    result = kern(**args, out=out, return_lse=lse)
    got, got_lse = (result if lse else (result, None))
    assert got is out
    if kern.backend:
        assert_ran_on(kern, kern.backend)
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


def assert_ran_on(kern, design: str):
    """Every build the kernel loaded is `design`'s (a launch never swaps designs quietly)."""
    loaded = kern.launcher.loaded.values()
    assert loaded and {b.design.name for b in loaded} == {design}


def _covered_rows(args):
    if "cu_seqlens_q" not in args:
        return slice(None)
    return slice(0, int(args["cu_seqlens_q"][-1]))


@pytest.mark.parametrize("file, name", [
    ("plain.mha", "plain_fwd"), ("plain.mha", "plain_fp16_d64"), ("causal.mha", "causal_fwd"),
    ("sliding_window.mha", "sliding_window_256"), ("softcap.mha", "softcap_causal"),
    ("alibi.mha", "alibi_causal"),
])
@pytest.mark.parametrize("layout", ["dense", "ragged"])
def test_examples_against_reference(file, name, layout, backend):
    kern = kernel(file, name, backend)
    if layout == "dense":
        assert_matches(kern, dense(kern, 2, 129, 129, 4, 4))
        assert_matches(kern, dense(kern, 1, 3000, 3000, 2, 2))
    else:
        assert_matches(kern, ragged(kern, RAGGED, RAGGED, 3, 3))
        assert_matches(kern, ragged(kern, RAGGED, RAGGED, 3, 3, one_offsets=True))


def test_bottom_right_causal_with_longer_keys(backend):
    kern = kernel("bottom_right_causal.mha", "bottom_right_causal", backend)
    assert_matches(kern, dense(kern, 2, 100, 300, 4, 4))
    assert_matches(kern, dense(kern, 1, 700, 260, 2, 2))
    assert_matches(kern, ragged(kern, [5, 0, 127, 64], [300, 7, 129, 64], 2, 2))


@pytest.mark.parametrize("hq, hkv", [(8, 2), (8, 1)])
def test_gqa_and_mqa(hq, hkv, backend):
    kern = kernel("gqa.mha", "gqa_causal" if hkv == 2 else "mqa", backend)
    if kern.options.gqa:
        hq = kern.options.gqa * hkv
    assert_matches(kern, dense(kern, 2, 257, 257, hq, hkv))
    assert_matches(kern, ragged(kern, RAGGED, RAGGED, hq, hkv))


@pytest.mark.parametrize("name", ["causal_d64", "lse_fp16", "plain_lse_d64", "plain_d256",
                                  "causal_lse_d256"])
def test_head_dims_fp16_and_lse(name, backend):
    kern = extra(name, backend)
    lse = kern.options.return_lse
    assert_matches(kern, dense(kern, 2, 191, 191, 3, 3), lse=lse)
    assert_matches(kern, dense(kern, 1, 300, 77, 2, 2), lse=lse)
    assert_matches(kern, ragged(kern, RAGGED, RAGGED, 2, 2), lse=lse)


@pytest.mark.parametrize("name", ["window_d64", "causal_holes"])
def test_kv_ranges_past_one_round_of_the_tile_search(name, backend):
    """9000 keys (71 KV tiles of 128): a late query tile's window starts more than 32 tiles
    in and an early one's last causal tile lies more than 32 before the end, so the warp's
    search for a work tile's KV range (`WorkTile.kv_range`) takes several rounds; every
    third KV tile of `causal_holes` is empty, skipped inside the range."""
    kern = extra(name, backend)
    assert_matches(kern, dense(kern, 1, 9000, 9000, 1, 1))
    assert_matches(kern, ragged(kern, [9000, 40, 4500], [9000, 40, 4500], 1, 1))


def test_a_literal_beside_a_u32_is_a_u32(backend):
    """`u32(q_idx - kv_idx) < 300` is a causal window of 300 keys (a key after its query
    wraps to a huge u32): the kernels compare unsigned, as the reference does."""
    kern = extra("unsigned_window", backend)
    assert_matches(kern, dense(kern, 1, 1000, 1000, 2, 2))
    assert_matches(kern, ragged(kern, RAGGED, RAGGED, 2, 2))


@pytest.mark.parametrize("name", ["lse_fp16", "causal_lse_d256", "plain_lse_d64"])
def test_scores_growing_along_the_keys(name, backend):
    """Keys whose scale grows along the sequence, so a row's max grows tile after tile, by
    less than 2**8 in some tiles and more in others: the sm90 build keeps a row's max
    through the first (P up to 256, in fp16 here) and rescales O in the others
    (`lazy_rescale`; at head dim 64 with the old sums, alpha raised there: `defer_alpha`);
    O and the LSE match the reference either way."""
    kern = extra(name, backend)
    sk = 1200
    args = dense(kern, 2, sk, sk, 2, 2)
    ramp = torch.linspace(0.25, 5.0, sk, device="cuda").view(1, sk, 1, 1)
    args["q"] = args["q"] * 2
    args["k"] = (args["k"].float() * ramp).to(args["k"].dtype)
    assert_matches(kern, args, lse=True)


def test_what_sm90_cannot_run_falls_back_to_sm80(backend):
    kern = extra("tile_64_rows", backend)
    args = dense(kern, 2, 191, 191, 3, 3)
    if backend == "sm80":
        assert_matches(kern, args)
        return
    with pytest.raises(mhadsl.MhaError, match="two or three consumer warpgroups take 128 or 192"):
        kern(**args)
    unforced = mhadsl.compile(EXTRA, name="fallback.mha")["tile_64_rows"]
    assert_matches(unforced, args)
    assert_ran_on(unforced, "sm80")


def test_fp16_d64_plain_example_with_lse(backend):
    kern = kernel("plain.mha", "plain_fp16_d64", backend)
    assert_matches(kern, dense(kern, 2, 300, 77, 4, 4), lse=True)


@pytest.mark.parametrize("name", SCHEDULER_KERNELS)
def test_every_standard_and_user_scheduler(name, backend):
    kern = extra(name, backend)
    assert_matches(kern, dense(kern, 3, 700, 700, 5, 5))
    assert_matches(kern, ragged(kern, RAGGED, RAGGED, 3, 3))


def test_zero_length_inputs(backend):
    kern = kernel("causal.mha", "causal_fwd", backend)
    assert kern(**dense(kern, 0, 16, 16, 2, 2)).shape == (0, 16, 2, 128)
    assert kern(**dense(kern, 2, 0, 16, 2, 2)).shape == (2, 0, 2, 128)
    no_keys = dense(kern, 1, 16, 0, 2, 2)
    out = kern(**no_keys, out=torch.full_like(no_keys["q"], float("nan")))
    assert torch.all(out == 0)
    assert_ran_on(kern, backend)


def test_numpy_inputs_round_trip(backend):
    kern = kernel("causal.mha", "causal_fwd", backend)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 65, 2, 128)).astype(np.float32) for _ in range(3))
    out = kern(q, k, v)
    assert isinstance(out, np.ndarray)
    assert_ran_on(kern, backend)
    ref = mhadsl.reference(kern, q, k, v)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def test_one_build_for_five_shapes(backend):
    kern = mhadsl.compile(EXTRA, name="builds.mha")["causal_d64"]
    kern.backend = backend
    for b, s in [(1, 1), (2, 127), (3, 129), (1, 3000), (5, 64)]:
        assert_matches(kern, dense(kern, b, s, s, 2, 2))
    assert kern.builds_compiled <= 1  # 0 when the on-disk cache already held it
    assert len(kern.launcher.loaded) == 1


def test_a_plain_call_runs_the_kv_tile_its_keys_select(backend):
    """The first call of a plain dense declaration loads every build its calls may select: on
    sm90 the wide KV tile's and the 128-key one that calls of few keys run
    (`Layout.narrow_kv`); a call of many keys then runs the other, and builds nothing."""
    kern = kernel("plain.mha", "plain_fwd", backend)
    assert_matches(kern, dense(kern, 2, 512, 512, 2, 2))
    loaded, built = dict(kern.launcher.loaded), kern.builds_compiled
    narrow = {False, True} if backend == "sm90" else {False}
    assert {key[0].narrow_kv for key in loaded} == narrow
    assert_matches(kern, dense(kern, 1, 4000, 4000, 2, 2))
    assert kern.launcher.loaded == loaded and kern.builds_compiled == built

    def ran(planned):
        return next(key[0].narrow_kv for key, build in loaded.items()
                    if any(f is planned.plans[-1].function for f in build.functions.values()))
    assert {ran(p) for p in kern.launcher.plans.values()} == narrow


def test_cuda_graph_replay(backend):
    kern = kernel("causal.mha", "causal_fwd", backend)
    args = dense(kern, 2, 1000, 1000, 4, 4)
    out = torch.empty_like(args["q"])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kern(**args, out=out, stream=stream)  # warm-up: build, load, counter allocation
    stream.synchronize()
    assert_ran_on(kern, backend)
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


def test_two_streams_at_once(backend):
    kern = kernel("causal.mha", "causal_fwd", backend)
    a, b = dense(kern, 2, 2000, 2000, 8, 8), dense(kern, 1, 3000, 3000, 8, 8)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        oa = kern(**a, stream=s1)
    with torch.cuda.stream(s2):
        ob = kern(**b, stream=s2)
    torch.cuda.synchronize()
    assert_ran_on(kern, backend)
    for args, out in ((a, oa), (b, ob)):
        ref = mhadsl.reference(kern, **args)
        got = out.float().cpu().numpy()
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


def test_cupy_fp16_inputs_come_back_as_cupy(backend):
    cupy = pytest.importorskip("cupy")
    kern = extra("lse_fp16", backend)
    rng = np.random.default_rng(2)
    host = [rng.standard_normal((2, 130, 2, 128)).astype(np.float16) for _ in range(3)]
    q, k, v = (cupy.asarray(a) for a in host)
    out, lse = kern(q, k, v)
    assert isinstance(out, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    assert_ran_on(kern, backend)
    ref, ref_lse = mhadsl.reference(kern, *host, return_lse=True)
    got = cupy.asnumpy(out).astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2
    assert np.allclose(cupy.asnumpy(lse), ref_lse, atol=2e-2)
