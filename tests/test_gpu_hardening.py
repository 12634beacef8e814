"""The GPU under real use: schedulers that would hang the kernel come back as exceptions
within a second and leave the context usable; 1,000 back-to-back queued launches on random
ragged batches, two streams at once and CUDA-graph replay of new data are each checked
against torch's SDPA."""
import time

import numpy as np
import pytest

import mhadsl
from helpers import STD

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
F = torch.nn.functional

_GRID = ("grid_dim(batch_size, max_num_prompt_tiles) = "
         "(max(min(num_ctas, max_num_prompt_tiles * num_heads * batch_size), 1), 1, 1)")
_COMMON = f"""
    may_advance = true
    schedule = DEFAULT
    {_GRID}
    initial_state(slots, ts) = State(idx = block_idx.x, slots = slots, max_idx = ts.num_work())
    get_current_work_info(ts, state) = ts.work_info(state.idx, schedule)
    unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.idx, schedule))
"""
SOURCE = STD + f"""
// advance never returns none: it cycles through the tiles for ever
scheduler Forever(num_ctas: u32 = num_sms * ctas_per_sm) {{
    {_COMMON}
    advance(ts, state, pipeline_idx) {{
        state.idx += grid_dim.x
        return ts.seq_info(ts.work_info(state.idx % state.max_idx, schedule))
    }}
}}

// the producer thread spins on the queue for ever, the others wait at the barrier
scheduler EndlessWhile(num_ctas: u32 = num_sms * ctas_per_sm) {{
    {_COMMON}
    advance(ts, state, pipeline_idx) {{
        if producer && thread_idx.x == 0 {{
            var idx = atomic_add(queue, 1)
            while idx != 4294967295 {{
                idx = atomic_add(queue, 0)
            }}
            state.slots[pipeline_idx] = idx
        }}
        barrier(sync)
        state.idx = state.slots[pipeline_idx]
        return ts.seq_info(ts.work_info(state.idx, schedule))
    }}
}}

attention spin {{ dtype = bf16  head_dim = 64  scheduler = Forever() }}
attention endless {{ dtype = bf16  head_dim = 64  scheduler = EndlessWhile() }}
attention queued {{ dtype = bf16  head_dim = 64  scheduler = Queued()
                    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }}
"""
D = 64


@pytest.fixture(scope="module")
def program():
    return mhadsl.compile(SOURCE, name="hardening.mha")


def rand(*shape, gen=None):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)


def sdpa(q, k, v, causal):
    """torch SDPA in float32 on (S, H, D) tensors of one sequence, GQA by repetition."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(0, 1)


def rel_err(got, ref):
    return ((got.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def dense_args(b=2, s=300, h=4):
    return rand(b, s, h, D), rand(b, s, h, D), rand(b, s, h, D)


def dense_ref(q, k, v, causal):
    return torch.stack([sdpa(q[i], k[i], v[i], causal) for i in range(q.shape[0])])


@pytest.mark.parametrize("name, rule", [("spin", "advance"), ("endless", "advance")])
def test_hanging_scheduler_raises_within_a_second_and_the_context_stays_usable(
        program, name, rule):
    bad, good = program[name], program["queued"]
    q, k, v = dense_args()
    bad(q, k, v)  # builds and loads the kernel; its fault is reported below
    with pytest.raises(mhadsl.SchedulerError):
        mhadsl.synchronize()

    start = time.perf_counter()
    bad(q, k, v)
    with pytest.raises(mhadsl.SchedulerError) as info:
        mhadsl.synchronize()
    elapsed = time.perf_counter() - start
    print(f"{name}: SchedulerError {elapsed * 1000:.1f} ms after the launch")
    assert elapsed < 1.0, elapsed
    scheduler = {"spin": "Forever", "endless": "EndlessWhile"}[name]
    assert (info.value.scheduler, info.value.rule) == (scheduler, rule)
    assert f"scheduler '{scheduler}': rule '{rule}'" in str(info.value)

    out = good(q, k, v)  # the record was cleared when reported: this launch is clean
    mhadsl.synchronize()
    assert rel_err(out, dense_ref(q, k, v, True)) < 1e-2


ENDLESS_RULES = {
    "score": "score(s, b, h, q_idx, kv_idx) { var x = s  while true { x = x + 1.0 }  return x }",
    "mask through a fn": "mask(b, h, q_idx, kv_idx) = spin(kv_idx) <= q_idx",
}


@pytest.mark.parametrize("rule", ENDLESS_RULES)
def test_an_endless_loop_in_an_attention_rule_is_refused_and_the_next_launch_is_right(
        program, rule):
    source = STD + ("fn spin(i: i32) -> i32 { var j = i  while true { j = j + 1 }  return j }\n"
                    f"attention K {{ dtype = bf16  head_dim = 64\n  {ENDLESS_RULES[rule]} }}\n")
    start = time.perf_counter()
    with pytest.raises(mhadsl.MhaError, match="`while` loops are not allowed"):
        mhadsl.compile(source, name="endless_rule.mha")
    assert time.perf_counter() - start < 2.0
    q, k, v = dense_args()
    out = program["queued"](q, k, v)
    mhadsl.synchronize()
    assert rel_err(out, dense_ref(q, k, v, True)) < 1e-2


def test_fault_is_reported_at_the_next_launch_once_the_faulty_one_finished(program):
    bad, good = program["spin"], program["queued"]
    q, k, v = dense_args()
    bad(q, k, v)
    torch.cuda.synchronize()  # not mhadsl.synchronize: the record stays for the next launch
    with pytest.raises(mhadsl.SchedulerError, match="'Forever': rule 'advance' never returned"):
        good(q, k, v)
    out = good(q, k, v)
    mhadsl.synchronize()
    assert rel_err(out, dense_ref(q, k, v, True)) < 1e-2


def test_debug_mode_reports_at_the_launch_itself(program, monkeypatch):
    q, k, v = dense_args()
    monkeypatch.setenv("MHADSL_DEBUG", "1")
    with pytest.raises(mhadsl.SchedulerError, match="EndlessWhile"):
        program["endless"](q, k, v)
    out = program["queued"](q, k, v)
    assert rel_err(out, dense_ref(q, k, v, True)) < 1e-2


def random_ragged_batch(rng, gen):
    batch = int(rng.integers(1, 5))
    heads, kv_heads = [(2, 2), (4, 2), (4, 1), (3, 3)][int(rng.integers(4))]
    lens_q = rng.integers(0, 400, batch)
    lens_k = rng.integers(1, 400, batch)
    cq = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32,
                      device="cuda")
    ck = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32,
                      device="cuda")
    q = rand(int(lens_q.sum()), heads, D, gen=gen)
    k, v = rand(int(lens_k.sum()), kv_heads, D, gen=gen), rand(int(lens_k.sum()), kv_heads, D,
                                                                 gen=gen)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck,
                max_seqlen_q=int(lens_q.max()), max_seqlen_k=int(lens_k.max()))


def ragged_ref(args):
    cq, ck = args["cu_seqlens_q"].tolist(), args["cu_seqlens_k"].tolist()
    out = torch.zeros(args["q"].shape, device="cuda")
    for b in range(len(cq) - 1):
        if cq[b + 1] > cq[b]:
            out[cq[b]:cq[b + 1]] = sdpa(args["q"][cq[b]:cq[b + 1]], args["k"][ck[b]:ck[b + 1]],
                                        args["v"][ck[b]:ck[b + 1]], True)
    return out


def test_a_thousand_queued_launches_on_random_ragged_batches(program):
    kern = program["queued"]
    rng, gen = np.random.default_rng(6), torch.Generator(device="cuda").manual_seed(6)
    batches = [random_ragged_batch(rng, gen) for _ in range(1000)]
    outs = [torch.full_like(a["q"], float("nan")) for a in batches]
    for args, out in zip(batches, outs):  # back to back: no host sync in between
        kern(**args, out=out)
    mhadsl.synchronize()  # and no scheduler fault
    errors = [rel_err(out, ragged_ref(args)) for args, out in zip(batches, outs)
              if args["q"].shape[0]]
    assert len(errors) > 990 and max(errors) < 1e-2, max(errors)


def test_two_streams_launching_at_once(program):
    kern = program["queued"]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    work = [[dense_args(2, 700 + 100 * i, 4) for i in range(10)] for _ in streams]
    torch.cuda.synchronize()
    outs = [[], []]
    for step in range(10):  # interleaved: both streams' queued kernels run together
        for s, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                outs[s].append(kern(*work[s][step], stream=stream))
    mhadsl.synchronize()
    for s in range(2):
        for args, out in zip(work[s], outs[s]):
            assert rel_err(out, dense_ref(*args, True)) < 1e-2


def test_cuda_graph_replays_new_data(program):
    kern = program["queued"]
    q, k, v = dense_args(2, 500, 4)
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kern(q, k, v, out=out, stream=stream)  # warm-up: build, load, workspace
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        kern(q, k, v, out=out, stream=stream)
    for _ in range(3):
        new = dense_args(2, 500, 4)
        for static, fresh in zip((q, k, v), new):
            static.copy_(fresh)
        out.fill_(float("nan"))
        graph.replay()
        mhadsl.synchronize()
        assert rel_err(out, dense_ref(*new, True)) < 1e-2
