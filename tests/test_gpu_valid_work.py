"""Ragged work without waste, on the GPU: the tile index kernel builds what
`mhadsl.analysis.valid_work.tile_index` defines, and the queued schedulers that read it
(Queued in each order, LPT, with and without head sections) compute causal attention right on both kernel designs,
eagerly and under CUDA-graph replay with new cu_seqlens values (needs a GPU)."""
import numpy as np
import pytest

import mhadsl
from mhadsl.abi import tile_index_words
from mhadsl.analysis.valid_work import tile_counts, tile_index

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

LENGTHS = [0, 1, 127, 129, 3000, 8192, 64, 0, 700]
SOURCE = 'import "std/schedulers.mha"\n' + "\n".join(
    f"attention {name} {{ dtype = bf16  head_dim = 128  scheduler = {binding}\n"
    f"    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }}"
    for name, binding in (("queued", "Queued()"), ("queued_rotate", "Queued(order = PROMPT_ROTATE)"),
                          ("queued_longest", "Queued(order = LONGEST_FIRST, heads_per_section = 1)"),
                          ("queued_interleaved", "Queued(order = INTERLEAVED, heads_per_section = 2)"),
                          ("lpt", "LPT()"), ("lpt_sections", "LPT(heads_per_section = 2)"),
                          ("persistent", "Persistent(num_ctas = 37)"),
                          ("adaptive", "Adaptive()")))
# Queued, whose advance decodes a second index after this step's: on sm90 the producer
# publishes that one last, so the consumers' lookup of this step's misses the handoff's memo
# and decodes it itself (`scheduler._TargetBuiltins.memoized`, `handoff._MEMO_ENTRIES`).
SOURCE += """
scheduler PeekQueued() {
    may_advance = true
    schedule = DEFAULT
    grid_dim(batch_size, max_num_prompt_tiles) =
        (max(min(num_sms * ctas_per_sm, max_num_prompt_tiles * num_heads * batch_size), 1), 1, 1)
    initial_state(slots, ts) =
        State(idx = block_idx.x, slots = slots, max_idx = ts.num_valid_work())
    get_current_work_info(ts, state) = ts.valid_work_info(state.idx, schedule, 0)
    advance(ts, state, pipeline_idx) {
        if producer && thread_idx.x == 0 {
            state.slots[pipeline_idx] = atomic_add(queue, 1) + grid_dim.x
        }
        barrier(sync)
        state.idx = state.slots[pipeline_idx]
        if state.idx >= state.max_idx {
            return none
        }
        let info = ts.valid_work_info(state.idx, schedule, 0)
        let last = ts.valid_work_info(state.max_idx - 1, schedule, 0)
        return ts.seq_info(info)
    }
    unsafe_seq_info(ts, state) = ts.seq_info(ts.valid_work_info(state.idx, schedule, 0))
}
attention queued_peek { dtype = bf16  head_dim = 128  scheduler = PeekQueued()
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
"""
KERNELS = ("queued", "queued_rotate", "queued_longest", "queued_interleaved", "lpt", "lpt_sections", "persistent",
           "queued_peek", "adaptive")


@pytest.fixture(params=["sm80", "sm90"])
def backend(request):
    if request.param == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 kernel runs on compute capability 9.0 only")
    return request.param


_programs = {}


def kernel(name: str, backend: str):
    if backend not in _programs:
        _programs[backend] = mhadsl.compile(SOURCE, name="valid_work.mha")
    kern = _programs[backend][name]
    kern.backend = backend
    return kern


def offsets(lengths) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32,
                        device="cuda")


@pytest.mark.parametrize("lengths, tile", [
    (LENGTHS, 128), (LENGTHS, 64), ([5], 128), ([0, 0, 0], 128),
    (np.random.default_rng(1).choice([0, 1, 63, 64, 65, 5000], 10_000).tolist(), 128),
])
def test_tile_index_kernel_builds_the_definition(lengths, tile):
    from mhadsl.build import tile_index_kernel
    from mhadsl.runtime import driver, tile_index as device_index
    cu = offsets(lengths)
    ptr = device_index.prepare(tile_index_kernel(), cu.data_ptr(), len(lengths), tile,
                               torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    host = np.empty(tile_index_words(len(lengths)), np.uint32)
    driver.memcpy_dtoh(host, ptr)
    assert host.tolist() == tile_index(tile_counts(lengths, tile)).tolist()


def random_batch(lengths, heads=4, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = int(sum(lengths))
    q, k, v = (torch.randn(total, heads, 128, device="cuda", dtype=torch.bfloat16,
                           generator=gen) for _ in range(3))
    return q, k, v


def sdpa_reference(q, k, v, lengths) -> torch.Tensor:
    """torch SDPA per sequence (causal, float32)."""
    out = torch.zeros(q.shape, device="cuda")
    start = 0
    for n in lengths:
        if n:
            rows = slice(start, start + n)
            out[rows] = torch.nn.functional.scaled_dot_product_attention(
                *(t[rows].float().transpose(0, 1) for t in (q, k, v)), is_causal=True
            ).transpose(0, 1)
        start += n
    return out


def rel_err(got, want) -> float:
    return float(torch.linalg.norm(got.float() - want) / torch.linalg.norm(want))


@pytest.mark.parametrize("name", KERNELS)
def test_ragged_causal_against_sdpa(name, backend):
    kern = kernel(name, backend)
    q, k, v = random_batch(LENGTHS)
    cu = offsets(LENGTHS)
    out = torch.full_like(q, float("nan"))  # poison: every row must be written
    kern(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, out=out)
    mhadsl.synchronize()  # and no scheduler fault
    assert {b.design.name for b in kern.launcher.loaded.values()} == {backend}
    assert torch.isfinite(out).all()
    assert rel_err(out, sdpa_reference(q, k, v, LENGTHS)) < 1e-2


def test_adaptive_in_queueds_order_against_sdpa(backend):
    """Adaptive takes LPT's order on LENGTHS (few pairs, one long sequence:
    `test_ragged_causal_against_sdpa`) and Queued's on many short sequences (more
    full-length pairs than CTAs): each order's launch writes every row right."""
    lengths = [96, 1, 130] * 100
    kern = kernel("adaptive", backend)
    q, k, v = random_batch(lengths, seed=5)
    cu = offsets(lengths)
    out = torch.full_like(q, float("nan"))
    kern(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, out=out)
    mhadsl.synchronize()
    assert torch.isfinite(out).all()
    assert rel_err(out, sdpa_reference(q, k, v, lengths)) < 1e-2


def test_ragged_matches_the_float64_reference(backend):
    kern = kernel("lpt", backend)
    lengths = [0, 1, 127, 129, 300]
    q, k, v = random_batch(lengths, heads=2, seed=3)
    cu = offsets(lengths)
    out = kern(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    ref = mhadsl.reference(kern, q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    got = out.float().cpu().numpy()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.parametrize("name", ["queued", "lpt"])
def test_graph_replay_with_new_cu_seqlens(name, backend):
    """The graph holds the tile index kernel too: each replay re-reads cu_seqlens."""
    kern = kernel(name, backend)
    first = [3000, 0, 1, 129, 8192, 64]
    q, k, v = random_batch(first, seed=5)
    cu = offsets(first)
    out = torch.empty_like(q)
    args = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=8192, max_seqlen_k=8192,
                out=out)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kern(q, k, v, **args, stream=stream)  # warm-up: build, load, workspace, index
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        kern(q, k, v, **args, stream=stream)
    for lengths in (first, [8192, 3000, 129, 64, 1, 0], [2000] * 5 + [1386],
                    [0, 0, 8192, 3000, 194, 0]):
        assert sum(lengths) == sum(first)  # the same q, k, v rows, split anew
        cu.copy_(offsets(lengths))
        out.fill_(float("nan"))
        graph.replay()
        mhadsl.synchronize()
        assert rel_err(out, sdpa_reference(q, k, v, lengths)) < 1e-2, lengths
