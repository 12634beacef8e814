"""The launch path on the GPU: plans per call signature with torch tensors, the kernel's own
reset of the queue counter (graph replays, many launches), and the torch operator under
torch.compile (fullgraph, reduce-overhead, dynamic lengths)."""
import numpy as np
import pytest

import mhadsl
from mhadsl.runtime import launch

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

SOURCE = '''import "std/schedulers.mha"
attention queued { dtype = bf16  head_dim = 64  scheduler = Queued()
                   mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }
attention plain { dtype = bf16  head_dim = 64 }
'''
D = 64


@pytest.fixture(scope="module")
def program():
    return mhadsl.compile(SOURCE)


def rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def reference(q, k, v, causal):
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    return sdpa(*(t.transpose(1, 2).float() for t in (q, k, v)),
                is_causal=causal).transpose(1, 2)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def test_a_torch_signature_is_planned_once_and_its_calls_stay_correct(program, monkeypatch):
    kern = program["queued"]
    made = []
    init = launch.LaunchPlan.__init__
    monkeypatch.setattr(launch.LaunchPlan, "__init__",
                        lambda self, *a, **kw: (made.append(1), init(self, *a, **kw))[1])
    for step in range(6):  # fresh tensors each call: new addresses, the same signature
        q, k, v = rand(2, 300, 4, D), rand(2, 300, 4, D), rand(2, 300, 4, D)
        out = kern(q, k, v)
        assert rel_err(out, reference(q, k, v, True)) < 1e-2, step
    assert len(made) == 1
    kern(rand(2, 301, 4, D), rand(2, 301, 4, D), rand(2, 301, 4, D))
    assert len(made) == 2  # a new length is a new signature
    q, k, v = rand(2, 300, 4, D), rand(2, 300, 4, D), rand(2, 300, 4, D)
    kern(q, k, v, out=torch.empty_like(q))  # plans calls given an output
    made.clear()
    with pytest.raises(ValueError, match="out overlaps q"):  # the same signature: its plan
        kern(q, k, v, out=q)
    misaligned = rand(2 * 300 * 4 * D + 4)[4:].view(2, 300, 4, D)  # 8 bytes in
    with pytest.raises(ValueError, match="16-byte aligned"):
        kern(misaligned, k, v)
    assert made == []  # both were planned calls, checked per address
    with pytest.raises(TypeError, match="declared bf16"):  # another dtype: not this plan
        kern(q.half(), k.half(), v.half())
    mhadsl.synchronize()


def test_the_kernel_resets_the_queue_counter_for_the_next_launch_and_replay(program):
    """No memset between launches: a counter left behind would skip the next launch's tiles."""
    kern = program["queued"]
    q, k, v = rand(3, 777, 4, D), rand(3, 777, 4, D), rand(3, 777, 4, D)
    ref = reference(q, k, v, True)
    outs = [kern(q, k, v) for _ in range(50)]
    for out in outs:
        assert rel_err(out, ref) < 1e-2
    out = torch.full_like(q, float("nan"))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kern(q, k, v, out=out)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            kern(q, k, v, out=out)
    for _ in range(5):
        new_q = rand(3, 777, 4, D)
        q.copy_(new_q)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference(new_q, k, v, True)) < 1e-2
    mhadsl.synchronize()


class Block(torch.nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attention = attention
        self.inp = torch.nn.Linear(D * 4, 3 * D * 4, device="cuda", dtype=torch.bfloat16)
        self.outp = torch.nn.Linear(D * 4, D * 4, device="cuda", dtype=torch.bfloat16)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.inp(x).view(b, s, 3, 4, D).unbind(2)
        out, _ = self.attention(q.contiguous(), k.contiguous(), v.contiguous())
        return self.outp(out.reshape(b, s, 4 * D))


def test_torch_compile_fullgraph_matches_eager_and_does_not_rebuild(program):
    kern = program["queued"]
    block = Block(kern.torch_op())
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    builds = None
    with torch.no_grad():
        for s in (128, 200, 333, 512, 640):
            x = torch.randn(2, s, 4 * D, device="cuda", dtype=torch.bfloat16)
            torch._dynamo.mark_dynamic(x, 1)
            eager, got = block(x), compiled(x)
            assert rel_err(got, eager.float()) < 1e-2, s
            builds = builds or kern.builds_compiled  # the operator's layout, built once
    assert kern.builds_compiled == builds  # five lengths, no rebuild
    explain = torch._dynamo.explain(block)(x)
    assert explain.graph_break_count == 0


def test_torch_compile_reduce_overhead_replays_new_inputs(program):
    block = Block(program["plain"].torch_op())
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for step in range(5):
            x = torch.randn(2, 256, 4 * D, device="cuda", dtype=torch.bfloat16)
            got = compiled(x).clone()
            assert rel_err(got, block(x).float()) < 1e-2, step
    mhadsl.synchronize()


def test_the_operator_writes_out_and_returns_it_as_its_output(program):
    """out=: the kernel writes the caller's tensor, and the call returns it with the LSE,
    bitwise what a call without out= returns, eager and under torch.compile."""
    op = program["queued"].torch_op()

    def attend(q, k, v, out):
        return op(q, k, v, out=out)

    q, k, v = rand(2, 300, 4, D), rand(2, 300, 4, D), rand(2, 300, 4, D)
    want, want_lse = op(q, k, v)
    with torch.no_grad():
        for fn in (attend, torch.compile(attend, fullgraph=True)):
            out = torch.full_like(q, float("nan"))
            got, lse = fn(q, k, v, out)
            assert got.data_ptr() == out.data_ptr()
            assert torch.equal(out, want) and torch.equal(lse, want_lse)
        assert torch._dynamo.explain(attend)(q, k, v, out).graph_break_count == 0
    mhadsl.synchronize()


DECODE_SOURCE = '''attention decode_step { dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q }
'''


def test_a_decode_step_compiles_to_graphs_that_replay_new_lengths_and_page_tables():
    from test_gpu_decode import cache
    kern = mhadsl.compile(DECODE_SOURCE)["decode_step"]
    op = kern.torch_decode_op()
    k, v, lengths, table = cache([700, 33, 2000, 5], 2, 128, page_size=64)

    def step(q, cache_seqlens, page_table):
        out, lse = op(q, k, v, cache_seqlens, page_table=page_table, num_splits=2)
        return out.float() * 2, lse

    q = torch.randn(4, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    assert torch._dynamo.explain(step)(q, lengths, table).graph_break_count == 0
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for i in range(5):
            lens = torch.randint(1, 2001, (4,), generator=g, device="cuda", dtype=torch.int32)
            pages = table[torch.randperm(4, generator=g, device="cuda")].contiguous()
            q = torch.randn(4, 1, 8, 128, generator=g, device="cuda").to(torch.bfloat16)
            out, lse = compiled(q, lens, pages)
            ref, ref_lse = mhadsl.reference_decode(kern, q, k, v, cache_seqlens=lens,
                                                   page_table=pages, return_lse=True)
            assert rel_err(out / 2, torch.from_numpy(ref).float().cuda()) < 1e-2, i
            assert torch.allclose(lse.cpu().double(), torch.from_numpy(ref_lse), atol=2e-2)
    mhadsl.synchronize()


@pytest.mark.parametrize("fp8", [False, True])
def test_a_compiled_decode_step_appends_its_rows_to_the_cache(fp8):
    """Also on a float8_e4m3fn cache, whose new rows are stored as the reference rounds them."""
    from mhadsl.analysis.reference import e4m3_bytes
    from test_gpu_decode import cache
    kern = mhadsl.compile(DECODE_SOURCE)["decode_step"]
    op = kern.torch_decode_op()
    k, v, _, table = cache([300, 300], 2, 128, page_size=16)
    scales = {}
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        scales = dict(k_scale=0.07, v_scale=1.5)
    lengths = torch.tensor([10, 200], dtype=torch.int32, device="cuda")

    def step(q, k_new, v_new, cache_seqlens):
        out, _ = op(q, k, v, cache_seqlens, page_table=table, k_new=k_new, v_new=v_new,
                    **scales)
        return out.float()

    compiled = torch.compile(step, fullgraph=True)
    with torch.no_grad():
        for i in range(3):
            q, k_new, v_new = (torch.randn(2, 1, h, 128, device="cuda").to(torch.bfloat16)
                               for h in (8, 2, 2))
            k_before = k.clone()
            out = compiled(q, k_new, v_new, lengths)
            ref = mhadsl.reference_decode(kern, q, k_before, v, cache_seqlens=lengths,
                                          page_table=table, k_new=k_new, v_new=v_new, **scales)
            bound = 2e-2 if fp8 else 1e-2
            assert rel_err(out, torch.from_numpy(ref).float().cuda()) < bound, i
            for b in range(2):  # the step's row is in the cache, at its sequence's end
                pos = int(lengths[b])
                row = k[int(table[b, pos // 16]), pos % 16]
                if fp8:
                    want = e4m3_bytes(k_new[b, 0].float().cpu().numpy() / np.float32(0.07))
                    assert np.array_equal(row.view(torch.uint8).cpu().numpy(), want)
                else:
                    assert torch.equal(row, k_new[b, 0])
            lengths += 1


def test_the_decode_operator_writes_out_and_returns_it_as_its_output():
    from test_gpu_decode import cache
    kern = mhadsl.compile(DECODE_SOURCE)["decode_step"]
    op = kern.torch_decode_op()
    k, v, lengths, table = cache([700, 33, 2000, 5], 2, 128, page_size=64)

    def step(q, out):
        return op(q, k, v, lengths, page_table=table, num_splits=2, out=out)

    q = torch.randn(4, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    want, want_lse = op(q, k, v, lengths, page_table=table, num_splits=2)
    with torch.no_grad():
        for fn in (step, torch.compile(step, fullgraph=True)):
            out = torch.full_like(q, float("nan"))
            got, lse = fn(q, out)
            assert got.data_ptr() == out.data_ptr()
            assert torch.equal(out, want) and torch.equal(lse, want_lse)
    mhadsl.synchronize()


def test_a_decode_step_replays_its_graph_into_a_static_out():
    """A serving engine's step: a preallocated output at a static address (and the cache,
    which the operator writes), compiled with reduce-overhead, is captured into CUDA graphs
    and written at each replay."""
    from torch._dynamo.utils import counters

    from test_gpu_decode import cache
    kern = mhadsl.compile(DECODE_SOURCE)["decode_step"]
    op = kern.torch_decode_op()
    k, v, _, table = cache([2000] * 4, 2, 128, page_size=64)
    out = torch.empty(4, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    for t in (k, v, out):
        torch._dynamo.mark_static_address(t)

    def step(q, cache_seqlens):
        # (three splits: the split workspace, made at the warm-up's first launch, stays
        # out of the graph pool)
        return op(q, k, v, cache_seqlens, page_table=table, num_splits=3, out=out)[1]

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    counters.clear()
    g = torch.Generator(device="cuda").manual_seed(2)
    with torch.no_grad():
        for i in range(5):
            lens = torch.randint(1, 2001, (4,), generator=g, device="cuda", dtype=torch.int32)
            q = torch.randn(4, 1, 8, 128, generator=g, device="cuda").to(torch.bfloat16)
            out.fill_(float("nan"))
            lse = compiled(q, lens)
            ref, ref_lse = mhadsl.reference_decode(kern, q, k, v, cache_seqlens=lens,
                                                   page_table=table, return_lse=True)
            assert rel_err(out, torch.from_numpy(ref).float().cuda()) < 1e-2, i
            assert torch.allclose(lse.cpu().double(), torch.from_numpy(ref_lse), atol=2e-2)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    mhadsl.synchronize()


def test_the_decode_operator_refuses_what_it_cannot_do():
    from test_gpu_decode import cache
    kern = mhadsl.compile(DECODE_SOURCE)["decode_step"]
    op = kern.torch_decode_op()
    k, v, lengths, table = cache([70, 3], 2, 128, page_size=16)
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="k_new and v_new together"):
        op(q, k, v, lengths, page_table=table, k_new=q[:, :, :2].contiguous())
    with pytest.raises(ValueError, match="expected \\(2, 1, 2, 128\\)"):
        op(q, k, v, lengths, page_table=table, k_new=q, v_new=q)
