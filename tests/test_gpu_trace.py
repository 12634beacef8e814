"""`mhadsl trace` on the GPU: the traced kernel records every valid tile exactly once, for
every standard scheduler, dense and ragged, on both kernel designs; a traced decode launch
with KV splits, paged and contiguous, records every (sequence, K/V head, q tile, split)
once and each split group's one combine after its last split (needs a GPU)."""
import pytest

import mhadsl
from helpers import REPO
from mhadsl import abi
from mhadsl.analysis import trace

pytestmark = pytest.mark.gpu

SCHEDULERS = [("Transient", ()), ("Persistent", ()),
              ("Persistent", (("order", "PROMPT_ROTATE"),)), ("Queued", ()), ("LPT", ())]
WORKLOADS = [trace.Workload(heads=3, batch=2, seqlen=1000),
             trace.Workload(heads=3, seqlens=(0, 1, 127, 128, 129, 3000, 700))]


@pytest.fixture(scope="module")
def program():
    return mhadsl.compile(REPO / "examples/causal.mha")


def _backends():
    from mhadsl.runtime import driver
    return ["sm80", "sm90"] if driver.device_info().compute_capability == (9, 0) else ["sm80"]


@pytest.mark.parametrize("scheduler,args", SCHEDULERS)
@pytest.mark.parametrize("workload", WORKLOADS, ids=["dense", "ragged"])
def test_trace_records_every_valid_tile_once(program, scheduler, args, workload):
    for backend in _backends():
        run = trace.run_trace(program, "causal_fwd", workload, scheduler=scheduler, args=args,
                              backend=backend, reps=1)
        assert run.backend == backend
        assert run.written == len(run.records["start"]) == len(run.batch.valid_tiles())
        assert (run.missing, run.repeated, run.invalid) == ([], [], [])
        assert (run.records["end"] >= run.records["start"]).all()
        assert len(set(run.records["sm"].tolist())) > 1  # the work spread over the GPU


def test_trace_prediction_is_comparable(program):
    run = trace.run_trace(program, "causal_fwd", trace.Workload(heads=4, batch=2, seqlen=2048),
                          scheduler="LPT", reps=3)
    model = trace.cost_model(program, run)
    result = trace.predict(program, run, model)
    assert result.covered_exactly_once
    comparison = trace.compare(run, result)
    assert 0 < comparison.measured.efficiency <= 1
    assert 0 < comparison.predicted.efficiency <= 1
    # The recording's cost is a benchmark figure (benchmarks/trace_table.py, docs/TRACE.md),
    # not a timed assertion: on a 0.3 ms launch it swung from -3% to +23% between runs.


DECODE = """
import "std/schedulers.mha"
attention decode { dtype = bf16  head_dim = 128
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q }
attention persistent_decode { dtype = bf16  head_dim = 128  scheduler = Persistent()
    mask(b, h, q_idx, kv_idx, seqlen_q, seqlen_k) = kv_idx <= q_idx + seqlen_k - seqlen_q }
"""


@pytest.mark.parametrize("kernel, workload", [
    # paged, one query row: caches that run 1, 2, 5 and 6 of the 6 splits
    ("decode", trace.DecodeWorkload(kv_heads=2, cache_lens=(1, 100, 1000, 3000, 4096),
                                    kv_splits=6, gqa=4, page_size=64)),
    # contiguous, 16 rows x 16 query heads: two q tiles per K/V head
    ("persistent_decode", trace.DecodeWorkload(kv_heads=1, cache_lens=(700, 2500, 64),
                                               kv_splits=3, gqa=16, query_rows=16)),
], ids=["paged", "contiguous"])
def test_decode_trace_covers_every_split_once_and_combines_after_the_last(kernel, workload):
    program = mhadsl.compile(DECODE, name="decode_trace")
    run = trace.run_decode_trace(program, kernel, workload, reps=1)
    assert run.backend == "decode" and run.work.num_splits == workload.kv_splits
    assert run.written == len(run.records["start"])
    items = trace.record_kind(run.records, abi.TRACE_WORK_ITEM)
    assert len(items["start"]) == len(run.batch.valid_tiles())
    assert (run.missing, run.repeated, run.invalid) == ([], [], [])
    used = run.work.splits_used()
    assert 1 in used.values() and max(used.values()) == workload.kv_splits
    assert run.combines.needed == sum(n > 1 for n in used.values())
    assert run.combines.problems() == []
    assert len(trace.record_kind(run.records, abi.TRACE_COMBINE)["start"]) == \
        run.combines.needed
    assert trace.predict(program, run, "uniform").covered_exactly_once


@pytest.mark.parametrize("kernel", ["decode", "persistent_decode"])
def test_a_decode_trace_by_length_covers_each_sequences_own_splits_once(kernel):
    """Splits that follow the lengths (no `num_splits`): the split index kernel's counts
    are `balanced_splits`' (the work items the launch records are exactly those), the long
    sequences split and the short ones do not, and every split group combines once, after
    its last split; a declaration that names no scheduler runs it by LPT."""
    program = mhadsl.compile(DECODE, name="decode_trace")
    workload = trace.DecodeWorkload(kv_heads=2, cache_lens=(50, 900, 60000, 1200, 30000, 1),
                                    kv_splits=0, gqa=4, page_size=64)
    run = trace.run_decode_trace(program, kernel, workload, reps=1)
    assert run.scheduler == ("LPT" if kernel == "decode" else "Persistent")
    splits = run.work.by_length
    assert splits[2] > splits[4] > 1 and splits[0] == splits[-1] == 1
    assert run.written == len(run.records["start"])
    items = trace.record_kind(run.records, abi.TRACE_WORK_ITEM)
    assert len(items["start"]) == len(run.batch.valid_tiles()) == 2 * sum(splits)
    assert (run.missing, run.repeated, run.invalid) == ([], [], [])
    assert run.combines.needed == 2 * sum(n > 1 for n in splits)
    assert run.combines.problems() == []
