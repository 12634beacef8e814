"""Decode on heavy-tailed batches through the default split (no `num_splits`), on the GPU,
against the float64 `mhadsl.reference_decode`: most cache lengths around a median and a few
30 to 60 times it; paged caches (16- and 64-row pages in random order) and contiguous ones;
GQA 32:8 and MQA 32:1; 1 and 4 query rows and ragged query rows; one long sequence among
length-1 ones; every length 0 but one; the fused append of the step's rows; the LSE; one plan
called with short uniform lengths, then heavy-tailed ones, on the same shapes (each
sequence's split is decided on the device from its length); and a CUDA graph replayed with
new lengths.

Every cache position past a sequence's keys holds NaN (a cache never written there), so a
split that reads past its sequence's end shows. Outputs are poisoned with NaN before every
call and compared sequence by sequence: a long sequence's output has the smallest norm, so
a batch-wide error would hide it."""
from types import SimpleNamespace

import numpy as np
import pytest

import mhadsl
from mhadsl.codegen.backends.decode import SPLITS_NAME
from mhadsl.host.serving import CHUNKS_PER_SM

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from helpers import REPO  # noqa: E402
from test_gpu_decode import PROGRAM  # noqa: E402

KERN = PROGRAM["causal"]  # bottom-right causal, D128 bf16, return_lse = true; any GQA group
MQA_EXAMPLE = mhadsl.compile(str(REPO / "examples" / "gqa.mha"))["mqa"]  # kv_heads = 1, no mask
REF_PAGE = 16  # the page of the reference's compact copy of a contiguous cache
HQ = 32


def heavy_tail(batch: int, median: int, *, long=(30, 45, 60), edges=(), low: int = 1,
               seed: int = 0) -> list[int]:
    """`batch` cache lengths: a lognormal draw around `median` (sigma 0.6, clipped to
    low .. 4 x median); `long` multiples of the median (plus a few keys: not whole tiles) at
    places spread over the batch (the first, the last, between); `edges` (each at least
    `low`) at the places after the first."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(np.log(median), 0.6, batch)), low, 4 * median)
    lengths = lengths.astype(np.int64)
    for i, n in enumerate(edges):
        lengths[1 + i] = max(low, n)
    places = np.linspace(0, batch - 1, len(long)).round().astype(np.int64)
    for at, times in zip(places, long):
        lengths[at] = times * median + int(rng.integers(1, 64))
    return lengths.tolist()


def make_cache(valid, kv_heads: int, *, page_size=None, extra: int = 0, seed: int = 0,
               d: int = 128):
    """A cache holding random keys at each sequence's first `valid[b]` positions and NaN at
    every other position (unused table entries name a page of NaN), with room for `extra`
    positions more per sequence (rows a step appends); `cache_seqlens` = `valid`.

    `k`, `v`, `seqlens`, `table`: the kernel's call, paged by `page_size` (pages in random
    order) or contiguous (None). `ref_k`, `ref_v`, `ref_table`: the same keys for the
    reference, the same tensors for a paged cache, else a compact copy paged by REF_PAGE
    (a contiguous cache holds batch x its longest sequence, most of it unused)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    valid = np.asarray(valid, np.int64)
    batch = len(valid)
    page = page_size or REF_PAGE
    room = valid + extra
    pages = np.maximum(1, -(-room // page))
    total = int(pages.sum()) + 1  # the last page in `order`: NaN, for the unused entries
    order = torch.randperm(total, generator=g, device="cuda").cpu().numpy()
    table = np.full((batch, int(pages.max()) + 1), order[-1], np.int64)
    starts = np.concatenate([[0], np.cumsum(pages)])
    for b in range(batch):
        table[b, :pages[b]] = order[starts[b]:starts[b + 1]]
    shape = (total, page, kv_heads, d)
    k = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)
    # positions 0 .. room - 1 of each sequence, and where they live in the pool
    seq = np.repeat(np.arange(batch), room)
    pos = np.arange(int(room.sum())) - np.repeat(starts_of(room), room)
    at_page, at_slot = table[seq, pos // page], pos % page
    holds_key = np.zeros((total, page), bool)
    holds_key[at_page[pos < valid[seq]], at_slot[pos < valid[seq]]] = True
    empty = torch.from_numpy(~holds_key).to("cuda")
    k[empty], v[empty] = float("nan"), float("nan")
    seqlens = torch.tensor(valid, dtype=torch.int32, device="cuda")
    table_t = torch.tensor(table, dtype=torch.int32, device="cuda")
    c = SimpleNamespace(seqlens=seqlens, ref_k=k, ref_v=v, ref_table=table_t,
                        page_size=page_size, table_np=table, sync=lambda: None)
    if page_size is not None:
        c.k, c.v, c.table = k, v, table_t
        return c
    capacity = max(int(room.max()), 1)
    c.k = torch.full((batch, capacity, kv_heads, d), float("nan"), device="cuda",
                     dtype=torch.bfloat16)
    c.v = torch.full_like(c.k, float("nan"))
    c.table = None
    idx = [torch.from_numpy(x).to("cuda") for x in (seq, pos, at_page, at_slot)]
    c.k[idx[0], idx[1]] = k[idx[2], idx[3]]
    c.v[idx[0], idx[1]] = v[idx[2], idx[3]]

    def sync():  # what the kernel wrote into the contiguous cache, into the reference's copy
        c.ref_k[idx[2], idx[3]] = c.k[idx[0], idx[1]]
        c.ref_v[idx[2], idx[3]] = c.v[idx[0], idx[1]]
    c.sync = sync
    return c


def starts_of(counts) -> np.ndarray:
    """Each run's first index when runs of `counts` lie one after another."""
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def queries(lead, heads: int = HQ, seed: int = 1, d: int = 128):
    """Random bf16 rows of shape (*lead, heads, d)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*lead, heads, d, generator=g, device="cuda").to(torch.bfloat16)


def offsets(rows) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(rows)]), dtype=torch.int32,
                        device="cuda")


def compare(got, ref, row_offsets, got_lse=None, ref_lse=None):
    """Every output row written, each sequence's rows within 1e-2 relative error of the
    reference, and the LSE's finite entries where the reference's are and close to them."""
    got = got.float().cpu().numpy().astype(np.float64)
    got, ref = got.reshape(-1, *got.shape[-2:]), ref.reshape(-1, *ref.shape[-2:])
    assert np.isfinite(got).all(), "NaN or unwritten output"
    for b, (lo, hi) in enumerate(zip(row_offsets[:-1], row_offsets[1:])):
        if hi > lo:
            err = np.linalg.norm(got[lo:hi] - ref[lo:hi]) / max(np.linalg.norm(ref[lo:hi]),
                                                                 1e-30)
            assert err < 1e-2, f"sequence {b}: relative error {err:.3g}"
    if ref_lse is not None:
        g = got_lse.cpu().numpy().astype(np.float64)
        finite = np.isfinite(ref_lse)
        assert np.array_equal(np.isfinite(g), finite)
        assert np.allclose(g[finite], ref_lse[finite], atol=2e-2, rtol=1e-3)


def balanced_build(kern, page_size, group: int, rows: int) -> bool:
    """Whether `kern` loaded a decode build whose splits follow the lengths
    (`config.balanced`) for this cache layout, GQA group and dense query rows."""
    return any(getattr(b.config, "balanced", False)
               and getattr(b.config, "page_size", None) == (page_size or 0)
               and getattr(b.config, "gqa_group", None) == group
               and getattr(b.config, "query_rows", None) == rows
               for b in kern.launcher.loaded.values())


def check(c, q, *, kern=KERN, cu_q=None, max_q=None, lse=True, **kw):
    """The default-split call on cache `c` (out poisoned with NaN) against the reference on
    the same keys; `kw`: the call's other arguments (k_new, v_new), which the reference
    takes too. Returns the call's output."""
    out = torch.full_like(q, float("nan"))
    result = kern(q, c.k, c.v, cache_seqlens=c.seqlens, page_table=c.table, cu_seqlens_q=cu_q,
                  max_seqlen_q=max_q, out=out, return_lse=lse, **kw)
    got, got_lse = result if lse else (result, None)
    assert got is out
    ref = mhadsl.reference_decode(kern, q, c.ref_k, c.ref_v, cache_seqlens=c.seqlens,
                                  page_table=c.ref_table, cu_seqlens_q=cu_q, return_lse=lse,
                                  **kw)
    ref, ref_lse = ref if lse else (ref, None)
    c.sync()  # rows the call appended, for a later step's reference
    rows = cu_q.tolist() if cu_q is not None else [b * q.shape[1] for b in range(q.shape[0] + 1)]
    compare(got, ref, rows, got_lse, ref_lse)
    return out


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("kv_heads", [8, 1])
@pytest.mark.parametrize("sq", [1, 4])
def test_heavy_tails(page_size, kv_heads, sq):
    """32 sequences around 256 keys, three of them 30, 45 and 60 times that (the first, the
    middle and the last), with lengths at a 64-row boundary +-1 and the fewest keys the query
    rows allow; the LSE too."""
    lengths = heavy_tail(32, 256, edges=(sq, 63, 64, 65), low=sq, seed=sq)
    c = make_cache(lengths, kv_heads, page_size=page_size, seed=kv_heads)
    check(c, queries((32, sq)))
    assert balanced_build(KERN, page_size, HQ // kv_heads, sq), \
        "the default path loaded no build whose splits follow the lengths"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if kv_heads == 8 and sq == 1 and page_size != 16 and 32 * 8 >= 1.5 * sms:
        # 256 16-row work tiles take two-warp CTAs, several of which fit a multiprocessor
        # (`serving.kv_tile`); the launch plans a CTA for each chunk the split aims at
        grids = {planned.plans[-1].grid for planned in KERN.launcher.fast_plans.values()
                 if planned.plans[-1].threads == 64
                 and any(p.function.name == SPLITS_NAME for p in planned.plans)}
        assert grids == {(CHUNKS_PER_SM * sms, 1, 1)}


@pytest.mark.parametrize("page_size", [None, 16, 64])
def test_ragged_query_rows(page_size):
    """Chunked prefill on a heavy-tailed batch: 0 to 33 query rows a sequence (more than
    a dense call takes), a sequence with no keys and no rows, 0 rows beside a long cache."""
    lengths = heavy_tail(24, 256, edges=(0, 40), low=0, seed=5)
    pattern = [1, 0, 4, 16, 33, 2, 7, 0, 1, 9]
    rows = [min(n, pattern[b % len(pattern)]) for b, n in enumerate(lengths)]
    rows[0] = 0  # the longest sequence, with no query row
    c = make_cache(lengths, 8, page_size=page_size, seed=5)
    check(c, queries((sum(rows),)), cu_q=offsets(rows), max_q=max(rows))


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("kv_heads", [8, 1])
@pytest.mark.parametrize("at", [0, 63])
def test_one_long_sequence_among_length_one(page_size, kv_heads, at):
    """One sequence of 16421 keys and 63 of one key each: the long one spread over the
    GPU, the short ones finished at once, first and last in the batch."""
    lengths = [1] * 64
    lengths[at] = 16384 + 37
    c = make_cache(lengths, kv_heads, page_size=page_size, seed=at)
    check(c, queries((64, 1)))


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("rows", [1, 4])
def test_every_length_zero_but_one(page_size, rows):
    """31 sequences without keys and one of 9000: a sequence with query rows needs as
    many cached keys (the host checks refuse fewer), so the empty ones have none (ragged
    query rows)."""
    lengths = [0] * 32
    lengths[17] = 9000
    per = [0] * 32
    per[17] = rows
    c = make_cache(lengths, 8, page_size=page_size, seed=rows)
    check(c, queries((rows,)), cu_q=offsets(per), max_q=rows)


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("sq", [1, 4])
def test_every_cache_empty_but_one_with_appended_rows(page_size, sq):
    """Dense query rows with the step's rows appended (k_new/v_new): 31 empty caches attend
    over their new rows alone, one over 9000 keys and its new rows."""
    lengths = [0] * 32
    lengths[17] = 9000
    c = make_cache(lengths, 8, page_size=page_size, extra=sq, seed=sq)
    k_new, v_new = queries((32, sq), 8, seed=2), queries((32, sq), 8, seed=3)
    check(c, queries((32, sq)), k_new=k_new, v_new=v_new)


def assert_appended(c, lengths, per, k_new, v_new):
    """The cache holds the step's rows at positions lengths[b] .. lengths[b] + per[b] - 1."""
    seq = np.repeat(np.arange(len(per)), per)
    pos = np.asarray(lengths, np.int64)[seq] + np.arange(len(seq)) - np.repeat(starts_of(per),
                                                                               per)
    where = (seq, pos) if c.table is None else (c.table_np[seq, pos // c.page_size],
                                                pos % c.page_size)
    where = tuple(torch.from_numpy(x).to("cuda") for x in where)
    for cache, new in ((c.k, k_new), (c.v, v_new)):
        assert torch.equal(cache[where], new.reshape(-1, *new.shape[-2:])[:len(seq)])


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("rows", [1, 4, 0])  # 0: ragged, 0 to 5 rows a sequence
def test_append_heavy_tails(page_size, rows):
    """Two decode steps that append their rows on a heavy-tailed batch (an empty cache and
    a 1-key one among them): the rows land at each sequence's end, and each step attends
    over them; the second step runs the planned path."""
    lengths = heavy_tail(24, 256, edges=(0, 1, 63, 64, 65), low=0, seed=9)
    per = [rows] * 24 if rows else [[1, 3, 0, 2, 5][b % 5] for b in range(24)]
    c = make_cache(lengths, 8, page_size=page_size, extra=2 * max(per), seed=9)
    for step in range(2):
        lead = (24, rows) if rows else (sum(per),)
        q, k_new, v_new = (queries(lead, h, seed=10 * step + i) for i, h in enumerate((HQ, 8, 8)))
        cu = None if rows else offsets(per)
        before = c.seqlens.clone()
        check(c, q, cu_q=cu, max_q=None if rows else max(per), k_new=k_new, v_new=v_new)
        assert torch.equal(c.seqlens, before)  # the caller advances it
        assert_appended(c, c.seqlens.tolist(), per, k_new, v_new)
        c.seqlens += torch.tensor(per, dtype=torch.int32, device="cuda")


def length_profiles(batch: int) -> dict[str, list[int]]:
    """Length profiles for one batch size: short and uniform, heavy-tailed, the same rolled
    (the long ones elsewhere), one long sequence among length-1 ones."""
    heavy = heavy_tail(batch, 256, seed=21)
    one_long = [1] * batch
    one_long[batch // 3] = 12000 + 5
    return {"short": [100] * batch, "heavy": heavy, "heavy, rolled": np.roll(heavy, 7).tolist(),
            "one long": one_long}


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("kv_heads", [8, 1])
def test_one_plan_short_then_heavy_tails(page_size, kv_heads):
    """The plan is keyed by shapes, and each sequence's split is decided on the device from
    its length: calls on the same tensors with short uniform lengths, then heavy-tailed ones
    (and back) are all right, and none makes a new plan."""
    profiles = length_profiles(32)
    c = make_cache(np.max(list(profiles.values()), axis=0), kv_heads, page_size=page_size,
                   seed=4)
    q = queries((32, 1))
    plans = None
    for name in ("short", "heavy", "one long", "short", "heavy, rolled"):
        c.seqlens.copy_(torch.tensor(profiles[name], dtype=torch.int32))
        check(c, q)
        if plans is None:
            plans = set(KERN.launcher.fast_plans)
        assert set(KERN.launcher.fast_plans) == plans, f"{name}: a new plan"


@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("kv_heads", [8, 1])
def test_graph_replay_heavy_tails(page_size, kv_heads):
    """A decode captured in a CUDA graph with short uniform lengths replays heavy-tailed
    ones, one long sequence among length-1 ones and the short ones again, written into
    cache_seqlens between replays: output and LSE right each time."""
    profiles = length_profiles(32)
    c = make_cache(np.max(list(profiles.values()), axis=0), kv_heads, page_size=page_size,
                   seed=6)
    q = queries((32, 1))
    out = torch.empty_like(q)
    c.seqlens.copy_(torch.tensor(profiles["short"], dtype=torch.int32))
    KERN(q, c.k, c.v, cache_seqlens=c.seqlens, page_table=c.table, out=out, return_lse=True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            _, lse = KERN(q, c.k, c.v, cache_seqlens=c.seqlens, page_table=c.table, out=out,
                          return_lse=True)
    for name in ("heavy", "one long", "short", "heavy, rolled"):
        c.seqlens.copy_(torch.tensor(profiles[name], dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = mhadsl.reference_decode(KERN, q, c.ref_k, c.ref_v,
                                               cache_seqlens=c.seqlens,
                                               page_table=c.ref_table, return_lse=True)
        compare(out, ref, list(range(33)), lse, ref_lse)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("sq", [1, 4])
def test_mqa_example(page_size, sq):
    """examples/gqa.mha's `mqa` (one K/V head, no mask: every query row sees every cached
    key) on a heavy-tailed batch."""
    lengths = heavy_tail(32, 256, edges=(sq, 63, 64, 65), low=sq, seed=31)
    c = make_cache(lengths, 1, page_size=page_size, seed=31)
    check(c, queries((32, sq)), kern=MQA_EXAMPLE, lse=False)


@pytest.mark.parametrize("batch", [64, 128])
def test_serving_sized_batches(batch):
    """The shape of benchmarks/decode.py's heavy-tailed rows (1 query row, 64-row pages, a
    median of 1536 keys, one sequence in 16 of 30 to 60 times it), with MQA 32:1 (one K/V
    head keeps the float64 reference small)."""
    lengths = heavy_tail(batch, 1536, long=np.linspace(30, 60, batch // 16).round().astype(int),
                         low=64, seed=batch)
    c = make_cache(lengths, 1, page_size=64, seed=batch)
    check(c, queries((batch, 1)))
