"""`mhadsl trace` and the calibrated cost model on the CPU: the recording exists only in a
traced build (and costs no spills), the simulator costs tiles by the declared mask's
classes and charges its step costs, the calibration fit recovers known constants, the
timelines and their PNG come from records, and the CLI fails in one clean line."""
import dataclasses
import os
import re

import numpy as np
import pytest

import mhadsl
from helpers import REPO, STD, checked, finishes_within
from mhadsl import abi
from mhadsl.analysis import costmodel, trace
from mhadsl.build import KernelRequest, build_kernel, plan
from mhadsl.cli import main
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.codegen.backends import Layout
from mhadsl.codegen.scheduler import SchedulerSpec
from mhadsl.analysis.reference import evaluate_rule
from mhadsl.runtime import trace_records
from mhadsl.analysis.simulate import Batch, simulate

needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
COSTS = costmodel.Costs(full_tile=10.0, partial_tile=3.0, per_item=100.0)


@pytest.mark.parametrize("arch, backend", [("sm_80", "sm80"), ("sm_90a", "sm90")])
def test_recording_only_in_traced_builds_and_spill_free(arch, backend):
    program = mhadsl.compile(REPO / "examples/causal.mha")
    builds = {t: build_kernel(program.checked, KernelRequest("causal_fwd", arch, backend,
                                                             Layout(), trace=t))
              for t in (False, True)}
    assert builds[True].config == builds[False].config  # the tile that runs untraced
    # the recording's reads (the SM id into a register: a masked sm90 build also names
    # %smid, in `hopper.hold_next_wait_below`'s store that never runs)
    for pattern in (r"%globaltimer", r"mov\.u32 %r\d+, %smid;", r"trace_scratch"):
        assert not re.search(pattern, builds[False].ptx), pattern
        assert re.search(pattern, builds[True].ptx), pattern
    # one start and one end per work item, in one role only (sm90: the consumers)
    assert builds[True].ptx.count("%globaltimer") == 2
    if find_ptxas() is not None:
        assert [k.spills for k in builds[True].assembled.kernels.values()] == [0]


def _brute_classes(program, mask, n, block_m, block_n):
    """(full, partial) per query tile by evaluating the mask on every pair."""
    keep = np.broadcast_to(evaluate_rule(mask, program, b=0, h=0,
                                         q_idx=np.arange(n)[:, None],
                                         kv_idx=np.arange(n)[None, :], seqlen_q=n,
                                         seqlen_k=n), (n, n))
    rows = []
    for q in range(0, n, block_m):
        full = partial = 0
        for kv in range(0, n, block_n):
            box = keep[q:q + block_m, kv:kv + block_n]
            if box.all() and kv + block_n <= n:
                full += 1
            elif box.any() or (box.all() and kv + block_n > n):
                partial += 1
        rows.append((full, partial))
    return rows


@pytest.mark.parametrize("file, kernel", [("sliding_window.mha", "sliding_window_256"),
                                          ("causal.mha", "causal_fwd")])
def test_tile_classes_follow_the_declared_mask(file, kernel):
    program = mhadsl.compile(REPO / "examples" / file)
    mask = program[kernel].options.mask
    n = 1000  # a tail KV tile too
    batch = Batch([n], heads=1, tile=128, ragged=False)
    offset = np.arange(0, n, 128)
    full, partial = costmodel.tile_classes(program.checked, mask, [n], offset,
                                           np.zeros_like(offset), np.zeros_like(offset), 128, 64)
    assert list(zip(full.tolist(), partial.tolist())) == \
        _brute_classes(program.checked, mask, n, 128, 64)
    model = costmodel.KernelCostModel(COSTS, program.checked, mask, 128, 64)
    result = simulate(program.checked, SchedulerSpec("LPT", (), 128), batch, ctas=4, cost=model)
    assert result.covered_exactly_once and result.unit == "ns"
    assert result.total_work == pytest.approx(float((100 + 10 * full + 3 * partial).sum()))


def test_empty_tiles_cost_nothing():
    """A sliding window's query tiles cost the same far down a long sequence (the tiles
    outside the band are skipped); a causal mask's grow with the offset."""
    def costs(file, kernel):
        program = mhadsl.compile(REPO / "examples" / file)
        model = costmodel.KernelCostModel(COSTS, program.checked,
                                          program[kernel].options.mask, 128, 64)
        offset = np.array([1024, 4096 - 128])
        return model.item_costs([4096], offset, np.zeros(2, int), np.zeros(2, int)).tolist()
    window = costs("sliding_window.mha", "sliding_window_256")
    assert window[0] == window[1] == 100 + 10 * 2 + 3 * 4  # 2 full, 4 partial tiles
    causal = costs("causal.mha", "causal_fwd")
    assert causal[1] > causal[0]


def test_no_mask_counts_full_tiles_and_the_tail():
    full, partial = costmodel.tile_classes(None, None, [1000, 128], np.array([0, 0]),
                                           np.zeros(2, int), np.array([0, 1]), 128, 64)
    assert full.tolist() == [15, 2] and partial.tolist() == [1, 0]


PROGRAM = checked(STD)


# Ragged [512, 256], 2 heads, 128-row tiles, no mask: 12 valid tiles (the standard
# schedulers run over valid tiles only), 8 of 100 + 8 x 10 ns of work and 4 of 100 + 4 x 10.
# On one slot:
@pytest.mark.parametrize("scheduler, steps", [
    ("Persistent", lambda c: 11 * c.advance),  # every advance but the last
    ("Queued", lambda c: 11 * (c.advance + c.queue_op)),  # each took one index
    # the grid's 16 CTAs (4 query tiles x 2 heads x 2 sequences): each after the first
    # pays to start, less the 4 past seq 1's end
    ("Transient", lambda c: 11 * c.cta_start + 4 * c.empty_cta)])
def test_simulator_charges_step_costs(scheduler, steps):
    costs = costmodel.Costs(full_tile=10.0, partial_tile=3.0, per_item=100.0, advance=7.0,
                            queue_op=20.0, cta_start=50.0, empty_cta=3.0)
    model = costmodel.KernelCostModel(costs, None, None, 128, 64)
    batch = Batch([512, 256], heads=2, tile=128, ragged=True)
    result = simulate(PROGRAM, SchedulerSpec(scheduler, (), 128), batch, ctas=1, cost=model)
    assert result.covered_exactly_once
    assert result.total_work == 8 * 180 + 4 * 140
    assert result.makespan == pytest.approx(result.total_work + steps(costs))


def test_fit_recovers_known_constants():
    rng = np.random.default_rng(0)
    full = rng.integers(0, 64, 500)
    partial = rng.integers(0, 4, 500)
    truth = costmodel.Costs(full_tile=3000.0, partial_tile=4200.0, per_item=5000.0,
                            advance=150.0, queue_op=600.0, cta_start=900.0)
    duration = truth.per_item + truth.full_tile * full + truth.partial_tile * partial
    noise = rng.normal(0, 20, 500)
    fitted = costmodel.fit(full, partial, duration + noise,
                           step_gaps=np.full(50, 150.0), queue_gaps=np.full(50, 750.0),
                           cta_gaps=np.r_[np.full(50, 900.0), 1e6])
    for name, value in vars(truth).items():
        assert getattr(fitted, name) == pytest.approx(value, rel=0.02), name


def test_fit_when_partial_tiles_cannot_be_told_apart():
    """Under a causal mask every query tile has the same diagonal: the fit then prices a
    partial tile at PARTIAL_RATIO full ones and still predicts the durations."""
    full = np.arange(0, 64)
    partial = np.full(64, 2)
    duration = 5000.0 + 3000.0 * full + 4000.0 * partial
    fitted = costmodel.fit(full, partial, duration)
    assert fitted.partial_tile == pytest.approx(costmodel.PARTIAL_RATIO * fitted.full_tile)
    predicted = fitted.per_item + fitted.full_tile * full + fitted.partial_tile * partial
    assert np.allclose(predicted, duration, rtol=1e-6)


def test_calibration_is_stored_where_the_simulator_finds_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    program = mhadsl.compile(REPO / "examples/causal.mha")
    backend = plan(program.checked, KernelRequest("causal_fwd", "sm_90a")).backend.name
    key = costmodel.kernel_key(program.checked, "causal_fwd", backend, "sm_90a")
    assert costmodel.load(key) == (costmodel.DEFAULT_COSTS, "defaults")
    path = costmodel.store([COSTS], key, "NVIDIA H200")
    assert costmodel.load(key, "NVIDIA H200") == (COSTS, str(path))
    narrow, _ = costmodel.load(key, "NVIDIA H200", block_n=32)  # scaled by the tile's keys
    assert (narrow.full_tile, narrow.partial_tile, narrow.per_item) == (5.0, 1.5, 100.0)
    assert costmodel.load(key) == (COSTS, str(path))  # any GPU's, without one
    assert costmodel.load(key, "NVIDIA A100")[1] == "defaults"
    rc = main(["simulate", str(REPO / "examples/causal.mha"), "--kernel", "causal_fwd",
               "--scheduler", "LPT", "--seqlens", "300,100", "--heads", "2", "--ctas", "2"])
    out = capsys.readouterr()
    assert rc == 0 and str(path) in out.err and " ns, efficiency" in out.out


def test_a_calibration_that_is_a_fifo_or_forged_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    costmodel.calibration_dir().mkdir()
    os.mkfifo(costmodel.calibration_dir() / "k--fifo.json")
    assert finishes_within(5, lambda: costmodel.load("k")) == (costmodel.DEFAULT_COSTS,
                                                               "defaults")
    (costmodel.calibration_dir() / "k--deep.json").write_text("[" * 100_000)
    assert costmodel.load("k") == (costmodel.DEFAULT_COSTS, "defaults")


def test_decode_records():
    words = np.zeros(trace_records.workspace_words(4), np.uint32)
    words[trace_records.COUNT_WORD] = 5  # one more than fit: an overflow
    words[trace_records.CAPACITY_WORD] = 4
    for k in range(4):
        at = trace_records.HEADER_WORDS + k * trace_records.RECORD_WORDS
        start = (7 << 32) + 1000 * k
        words[at:at + trace_records.RECORD_WORDS] = [128 * k, 1, 2, 10 + k, 3, 500, start & 0xFFFFFFFF,
                                                     start >> 32, k % 2]
    records, written = trace_records.decode(words)
    assert written == 5 and len(records["start"]) == 4
    assert records["prompt_offset"].tolist() == [0, 128, 256, 384]
    assert records["kind"].tolist() == [abi.TRACE_WORK_ITEM, abi.TRACE_COMBINE] * 2
    assert (records["end"] - records["start"]).tolist() == [500] * 4
    assert records["start"][1] == (7 << 32) + 1000


def test_lanes_keep_resident_ctas_apart():
    records = {"sm": np.array([0, 0, 0, 1]), "start": np.array([0, 5, 12, 0]),
               "end": np.array([10, 20, 30, 4]), "cta": np.arange(4),
               **{k: np.zeros(4, int) for k in ("prompt_offset", "head", "batch")}}
    tl = trace.Timeline.from_records(records, num_sms=2, ctas_per_sm=2)
    assert tl.columns["lane"].tolist() == [0, 1, 0, 2]
    assert tl.makespan == 30 and tl.slots == 4
    assert tl.lower_bound == pytest.approx(max((10 + 15 + 18 + 4) / 4, 18))


def _synthetic_run(program, scheduler="LPT", costs=costmodel.DEFAULT_COSTS,
                   workload=trace.Workload(heads=4, seqlens=(2048, 1024, 300, 64))):
    """A TraceRun whose 'measured' records are the simulator's own timeline."""
    model = costmodel.KernelCostModel(costs, program.checked,
                                      program["causal_fwd"].options.mask, 128, 64)
    run = trace.TraceRun("causal_fwd", scheduler, (), workload, "test GPU", "sm80", "sm_90a",
                         128, 64, 4, 2, (8, 1, 1), {}, 0, 1.0, 1.01, 1e9)
    result = trace.predict(program, run, model)
    t = result.trace
    keep = t["valid"]
    run.records = {"prompt_offset": t["offset"][keep], "head": t["head"][keep],
                   "batch": t["b"][keep], "cta": t["cta"][keep], "sm": t["slot"][keep] // 2,
                   "start": t["start"][keep].astype(np.int64),
                   "end": (t["start"][keep] + t["duration"][keep]).astype(np.int64)}
    run.records["duration"] = run.records["end"] - run.records["start"]
    run.written = len(run.records["start"])
    return run, result, model


def test_comparison_and_png_from_a_synthetic_trace(tmp_path):
    pytest.importorskip("matplotlib")
    program = mhadsl.compile(REPO / "examples/causal.mha")
    run, result, _ = _synthetic_run(program)
    assert trace.coverage(run.records, run.batch) == ([], [], [])
    comparison = trace.compare(run, result)
    # the same items measured as simulated: the same efficiency by both definitions
    assert comparison.measured.efficiency == pytest.approx(result.efficiency, abs=1e-3)
    assert comparison.predicted.efficiency == pytest.approx(result.efficiency, abs=1e-9)
    assert any(note.startswith("makespan: measured") for note in comparison.differences)
    out = tmp_path / "trace.png"
    trace.plot(run, comparison, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_calibration_fit_from_synthetic_runs():
    """fit_runs reads each scheduler's gaps: Persistent's steps, LPT's queue, Transient's
    CTA turnover, from records made with known constants."""
    program = mhadsl.compile(REPO / "examples/causal.mha")
    truth = costmodel.Costs(full_tile=2000.0, partial_tile=2000 * costmodel.PARTIAL_RATIO,
                            per_item=4000.0, advance=300.0, queue_op=700.0, cta_start=1100.0)
    dense = trace.Workload(heads=4, batch=2, seqlen=1024)  # no skipped indices: one step a gap
    runs = [_synthetic_run(program, scheduler, truth, dense)[0]
            for scheduler in ("Persistent", "LPT", "Transient")]
    (fitted,) = trace.fit_runs(program, "causal_fwd", runs)
    for name in ("full_tile", "per_item", "advance", "queue_op", "cta_start"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.02), name


def test_empty_cta_cost_is_fitted_from_efficiency():
    """CTAs without a tile leave no record; their cost is found from the efficiency of a
    launch that has many (a transient grid over a skewed ragged batch)."""
    program = mhadsl.compile(REPO / "examples/causal.mha")
    truth = dataclasses.replace(costmodel.DEFAULT_COSTS, empty_cta=700.0)
    skewed = trace.Workload(heads=2, seqlens=(4096, 1024, 256, 64, 64, 64))
    run, result, _ = _synthetic_run(program, "Transient", truth, skewed)
    target = trace.Timeline.from_simulation(result).efficiency
    fitted = trace.fit_empty_cta(program, run, dataclasses.replace(truth, empty_cta=0.0),
                                 target)
    assert fitted == pytest.approx(700.0, rel=0.05)
    dense = trace.Workload(heads=2, batch=2, seqlen=1024)  # no CTA without a tile
    run, result, _ = _synthetic_run(program, "Transient", truth, dense)
    assert trace.fit_empty_cta(program, run, truth, 0.9) is None


@pytest.mark.parametrize("argv, message", [
    (["--kernel", "causal_fwd"], "give --seqlen S"),
    (["--kernel", "nope", "--seqlen", "64"], "no attention kernel 'nope'"),
    (["--kernel", "causal_fwd", "--seqlen", "64", "--scheduler", "Nope"], "no scheduler 'Nope'"),
    (["--kernel", "causal_fwd", "--seqlen", "64", "--param", "order=PROMPT_ROTATE"],
     "--param binds a parameter of --scheduler"),
    (["--kernel", "causal_fwd", "--seqlen", "64", "--out", "/nonexistent/x.png"],
     "folder /nonexistent does not exist"),
])
def test_trace_usage_errors_are_one_line(argv, message, capsys):
    rc = main(["trace", str(REPO / "examples/causal.mha"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and message in err
    assert err.count("\n") == 1


def test_trace_without_gpu_is_one_line(capsys):
    from mhadsl.runtime.driver import gpu_available
    if gpu_available():
        pytest.skip("a GPU is present")
    rc = main(["trace", str(REPO / "examples/causal.mha"), "--kernel", "causal_fwd",
               "--seqlen", "256"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: no NVIDIA GPU found (") \
        and "`mhadsl trace` runs the kernel" in err and err.count("\n") == 1


def test_a_producer_ahead_takes_the_queue_atomics_off_the_path_where_roles_run_apart():
    """sm90's producer takes each next index a work tile ahead of its consumers
    (`Backend.producer_ahead`), where the scheduler lets the roles run apart: the simulator
    charges a queue atomic nothing there, its full cost where the design steps its roles
    together (sm80) or the scheduler keeps them in step (MyQueued: a `while` in advance)."""
    from mhadsl.codegen.backends import backend
    assert backend("sm90").producer_ahead and not backend("sm80").producer_ahead
    program = mhadsl.compile(f'import "std/schedulers.mha"\nimport "{REPO}/examples/'
                             'queued_rotate.mha"\nattention a { head_dim = 128 '
                             'mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }\n')
    costs = dataclasses.replace(costmodel.DEFAULT_COSTS, queue_op=5000.0)
    batch = Batch([2048, 1024, 300, 64], 4, 128, ragged=True)

    def makespan(scheduler: str, ahead: bool) -> float:
        model = costmodel.KernelCostModel(costs, program.checked, program["a"].options.mask,
                                          128, 128, producer_ahead=ahead)
        result = simulate(program.checked, SchedulerSpec(scheduler), batch, ctas=8, cost=model)
        assert result.covered_exactly_once
        return result.makespan

    assert makespan("Queued", True) < makespan("Queued", False)
    assert makespan("MyQueued", True) == makespan("MyQueued", False)  # lock-step roles
    assert makespan("Persistent", True) == makespan("Persistent", False)  # no atomics


@pytest.mark.parametrize("design", ["sm80", "sm90"])
def test_a_runs_cost_model_is_its_kernels_as_it_ran(design, tmp_path, monkeypatch):
    """`trace.cost_model` gives the run's kernel its calibration on the run's GPU (else the
    defaults), its tile and its design's producer (sm90's is a work tile ahead)."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    program = mhadsl.compile(REPO / "examples/causal.mha")
    run = trace.TraceRun("causal_fwd", "LPT", (), trace.Workload(heads=2, batch=1, seqlen=512),
                         "NVIDIA H200", design, "sm_90a", 128, 96, 4, 1, (4, 1, 1), {}, 0,
                         1.0, 1.0, 1e9)
    model = trace.cost_model(program, run)
    assert (model.costs, model.source) == (costmodel.DEFAULT_COSTS.for_block_n(96), "defaults")
    assert (model.block_m, model.block_n, model.producer_ahead) == (128, 96, design == "sm90")
    key = costmodel.kernel_key(program.checked, "causal_fwd", design, "sm_90a")
    path = costmodel.store([dataclasses.replace(COSTS, block_n=96)], key, "NVIDIA H200")
    assert trace.cost_model(program, run).source == str(path)
    given = trace.cost_model(program, run, COSTS)
    assert (given.costs, given.source) == (COSTS, "given")


# ---------------------------------------------------------------- decode with split-KV
# 2 sequences' caches of 300 and 40 positions, 2 K/V heads, 2 q tiles, 4 splits of 128:
# the first sequence runs 3 splits per group (its groups combine), the second 1 (none).
DECODE_WORK = trace.DecodeWork(kv_heads=2, cache_lens=(300, 40), q_tiles=2, num_splits=4,
                               kv_chunk=128)


def _decode_records(work: trace.DecodeWork) -> list[dict]:
    """A correct decode trace: every work item once, each split of a group ending later
    than the one before, and one combine per group that ran more than one split, starting
    when its last split ended."""
    rows, clock = [], 0
    for (b, h, q), used in work.splits_used().items():
        splits = work.splits_of(b)
        for split in range(splits):
            rows.append(dict(prompt_offset=q * splits + split, head=h, batch=b,
                             start=clock, end=clock + 100, kind=abi.TRACE_WORK_ITEM))
            clock += 10
        if used > 1:
            last_end = max(r["end"] for r in rows[-splits:][:used])
            rows.append(dict(prompt_offset=q * splits + used - 1, head=h, batch=b,
                             start=last_end, end=last_end + 50, kind=abi.TRACE_COMBINE))
    return rows


def _columns(rows: list[dict]) -> dict[str, np.ndarray]:
    return {k: np.array([r[k] for r in rows], np.int64) for k in rows[0]}


def _is_combine_of(row, b, h, q):
    return row["kind"] == abi.TRACE_COMBINE and (row["batch"], row["head"],
                                                 row["prompt_offset"] // 4) == (b, h, q)


def _duplicate_item(rows):
    return rows + [rows[3]]


def _drop_item(rows):
    return [r for r in rows if (r["batch"], r["head"], r["prompt_offset"]) != (1, 1, 5)]


def _drop_combine(rows):
    return [r for r in rows if not _is_combine_of(r, 0, 1, 1)]


def _combine_twice(rows):
    return rows + [r for r in rows if _is_combine_of(r, 0, 0, 0)]


def _combine_before_last_split(rows):
    return [dict(r, start=r["start"] - 1) if _is_combine_of(r, 0, 1, 0) else r for r in rows]


def _combine_a_single_split(rows):
    item = next(r for r in rows if (r["batch"], r["head"], r["prompt_offset"]) == (1, 0, 0))
    return rows + [dict(item, kind=abi.TRACE_COMBINE)]


def _drop_a_used_split(rows):
    return [r for r in rows if (r["batch"], r["head"], r["prompt_offset"]) != (0, 0, 1)]


@pytest.mark.parametrize("damage, coverage_found, combines_found", [
    (None, ([], [], []), {}),
    (_duplicate_item, ([], [(3, 0, 0)], []), {}),
    (_drop_item, ([(5, 1, 1)], [], []), {}),
    (_drop_combine, ([], [], []), {"missing": [(0, 1, 1)]}),
    (_combine_twice, ([], [], []), {"repeated": [(0, 0, 0)]}),
    (_combine_before_last_split, ([], [], []), {"early": [(0, 1, 0)]}),
    (_combine_a_single_split, ([], [], []), {"unexpected": [(1, 0, 0)]}),
    # a split without a record: its combine is not proven to follow it
    (_drop_a_used_split, ([(1, 0, 0)], [], []), {"early": [(0, 0, 0)]}),
])
def test_decode_trace_checks_every_split_once_and_every_combine(damage, coverage_found,
                                                                combines_found):
    rows = _decode_records(DECODE_WORK)
    records = _columns(damage(rows) if damage else rows)
    items = trace.record_kind(records, abi.TRACE_WORK_ITEM)
    assert trace.coverage(items, DECODE_WORK.batch) == coverage_found
    check = trace.check_combines(records, DECODE_WORK)
    assert check.needed == 4  # sequence 0's 2 K/V heads x 2 q tiles
    found = {k: getattr(check, k) for k in ("missing", "repeated", "early", "unexpected")
             if getattr(check, k)}
    assert found == combines_found
    assert bool(check.problems()) == bool(combines_found)


# splits that follow the lengths: 3, 1 and 6 splits of 2 q tiles; a ragged work space
BY_LENGTH = trace.DecodeWork(kv_heads=2, cache_lens=(300, 40, 5000), q_tiles=2, num_splits=8,
                             kv_chunk=0, by_length=(3, 1, 6))


def _late(rows, b, h, q):
    return [dict(r, start=r["start"] - 1) if r["kind"] == abi.TRACE_COMBINE and
            (r["batch"], r["head"], r["prompt_offset"] // BY_LENGTH.by_length[b]) == (b, h, q)
            else r for r in rows]


@pytest.mark.parametrize("damage, coverage_found, combines_found", [
    (None, ([], [], []), {}),
    (lambda rows: [r for r in rows if (r["batch"], r["head"], r["prompt_offset"], r["kind"])
                   != (2, 1, 11, abi.TRACE_COMBINE)], ([], [], []), {"missing": [(2, 1, 1)]}),
    (lambda rows: _late(rows, 0, 0, 1), ([], [], []), {"early": [(0, 0, 1)]}),
    # a split past a sequence's own count is no work item of the launch
    (lambda rows: rows + [dict(rows[0], batch=1, prompt_offset=2)], ([], [], [(2, 0, 1)]), {}),
])
def test_a_trace_by_length_checks_each_sequences_own_splits(damage, coverage_found,
                                                            combines_found):
    assert BY_LENGTH.batch.ragged and len(BY_LENGTH.batch.valid_tiles()) == 2 * 2 * (3 + 1 + 6)
    rows = _decode_records(BY_LENGTH)
    records = _columns(damage(rows) if damage else rows)
    items = trace.record_kind(records, abi.TRACE_WORK_ITEM)
    assert trace.coverage(items, BY_LENGTH.batch) == coverage_found
    check = trace.check_combines(records, BY_LENGTH)
    assert check.needed == 8  # sequences 0 and 2: 2 K/V heads x 2 q tiles each
    found = {k: getattr(check, k) for k in ("missing", "repeated", "early", "unexpected")
             if getattr(check, k)}
    assert found == combines_found


def test_decode_work_counts_the_splits_the_kernel_runs():
    used = trace.DecodeWork(kv_heads=1, cache_lens=(0, 1, 128, 129, 1000), q_tiles=1,
                            num_splits=4, kv_chunk=128).splits_used()
    assert [used[b, 0, 0] for b in range(5)] == [1, 1, 1, 2, 4]
    assert len(DECODE_WORK.batch.valid_tiles()) == 2 * 2 * 2 * 4


@pytest.mark.parametrize("argv, message", [
    (["--kv-splits", "0"], "--kv-splits takes 1 to 128 splits"),
    (["--kv-splits", "129"], "--kv-splits takes 1 to 128 splits"),
    (["--kv-splits", "4", "--out", "t.png"], "drop --out"),
    (["--kv-splits", "4", "--backend", "sm80"], "drop --backend"),
    (["--kv-splits", "4", "--calibrate"], "drop --calibrate"),
    (["--query-rows", "2"], "--query-rows belongs to a decode trace: give --kv-splits N"),
    (["--page-size", "64"], "--page-size belongs to a decode trace"),
    (["--gqa", "4"], "--gqa belongs to a decode trace"),
    (["--kv-splits", "4", "--query-rows", "17"], "--query-rows must be between 1 and 16"),
    (["--kv-splits", "4", "--page-size", "48"], "--page-size takes 16, 32, 64, 128, 256, 512"),
])
def test_decode_trace_usage_errors_are_one_line(argv, message, capsys):
    rc = main(["trace", str(REPO / "examples/bottom_right_causal.mha"), "--kernel",
               "bottom_right_causal", "--seqlens", "100,3000", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and message in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("kernel, argv, message", [
    ("gqa_causal", ["--gqa", "2"], "--gqa 2 contradicts kernel gqa_causal's gqa = 4"),
    ("mqa", ["--heads", "2"], "--heads 2 (the K/V heads of a decode trace) contradicts "
                              "kernel mqa's kv_heads = 1"),
])
def test_decode_trace_heads_must_agree_with_the_kernel(kernel, argv, message, capsys):
    """Before any GPU is asked for: the same line with or without one."""
    rc = main(["trace", str(REPO / "examples/gqa.mha"), "--kernel", kernel, "--seqlen", "64",
               "--kv-splits", "2", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"error: {message}\n"


@pytest.mark.parametrize("damage, rc, line", [
    (None, 0, "  combines: 4 groups ran more than one split: each combined once, after its "
              "last split"),
    (_combine_before_last_split, 3, "  combines: 4 groups ran more than one split: 1 "
                                    "combines before their group's last split ended"),
    (_duplicate_item, 3, "  trace: 33 work items, 1 repeated work items"),
])
def test_decode_trace_report(damage, rc, line, monkeypatch, capsys, tmp_path):
    """`mhadsl trace --kv-splits` prints the checks of the run's records (here synthetic:
    the GPU's part is tests/test_gpu_trace.py) and exits 3 when one fails."""
    import json

    import mhadsl.host.bench
    rows = _decode_records(DECODE_WORK)
    rows = damage(rows) if damage else rows
    records = _columns([dict(r, cta=k, sm=k % 4) for k, r in enumerate(rows)])

    def run_decode_trace(program, kernel, workload, scheduler=None, args=(), operands=None):
        run = trace.DecodeTraceRun(kernel, "Queued", (), workload, "test GPU", "decode",
                                   "sm_90a", 1, 64, 4, 2, (8, 1, 1), records, len(rows),
                                   0.010, 0.011, 0.0, gqa_group=workload.gqa,
                                   work=DECODE_WORK, kv_bytes=10 ** 7)
        run.check()
        return run
    monkeypatch.setattr(mhadsl.host.bench, "require_gpu", lambda: None)
    monkeypatch.setattr(trace, "run_decode_trace", run_decode_trace)
    out_json = tmp_path / "trace.json"
    assert main(["trace", str(REPO / "examples/bottom_right_causal.mha"), "--kernel",
                 "bottom_right_causal", "--seqlens", "300,40", "--heads", "2", "--gqa", "4",
                 "--kv-splits", "4", "--json", str(out_json)]) == rc
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("bottom_right_causal under Queued on decode B2 cache 40..300 "
                             "(contiguous) Sq1 H8:2, 4 KV splits: 4 splits of 128 positions")
    assert line in out
    assert "  kernel 0.010 ms untraced (1.00 TB/s of K/V), 0.011 ms traced: recording " \
           "costs +10.0%" in out
    assert any(o.startswith("  makespan efficiency: measured ") for o in out)
    saved = json.loads(out_json.read_text())
    assert saved["combines"]["needed"] == 4 and saved["q_tiles"] == 2
    assert saved["covered_exactly_once"] == (damage is not _duplicate_item)
    assert len(saved["records"]["kind"]) == len(rows)


# ---------------------------------------------------------------- the launches it traces
def test_a_traced_scheduler_launches_as_the_declaration_that_names_it(monkeypatch):
    """`trace.scheduler_kernel(..., "LPT")` (what `mhadsl trace --scheduler LPT` runs,
    untraced and traced) launches exactly what a declaration with `scheduler = LPT()` does
    for the same call (a tensor operand passed as a NumPy array, as the CLI passes it): a
    build for the same scheduler and arguments, then the classes kernel and the scheduled
    kernel, with the same grids and parameter blocks but for the traced launch's workspace.
    No GPU: the driver is replaced by recorders."""
    import ctypes
    from types import SimpleNamespace
    from helpers import fake_launcher
    from test_hostile_tensors import FakeDevice
    from mhadsl.codegen.backends import KernelBuild
    from mhadsl.runtime import driver, launch as runtime_launch, tensormap, tensors

    text = (REPO / "examples/document_mask.mha").read_text().replace("bf16", "fp16")
    named = text.replace("dtype    = fp16", "dtype    = fp16\n    scheduler = LPT()")
    launched = []
    real_launch = runtime_launch.LaunchPlan.launch

    def recorded(self, addresses, stream, workspace=None, scalars=None):
        real_launch(self, addresses, stream, workspace, scalars)
        launched.append((self.grid, self.threads, bytes(self.block.data)))

    def fake_copy(array, name="array", *, dtype=None, stream=None, device=None):
        host, dtype = tensors._host_copy(array, name, dtype)
        return tensors.DeviceTensor(7 << 32, host.shape, tensors.contiguous_strides(
            host.shape), dtype, 0, "numpy", array), None

    function = SimpleNamespace(max_active_blocks=lambda *a: 1,
                               launcher=fake_launcher(lambda *a: None),
                               set_max_dynamic_shared=lambda nbytes: None)
    monkeypatch.setattr(runtime_launch.LaunchPlan, "launch", recorded)
    monkeypatch.setattr(driver.Module, "from_ptx", staticmethod(
        lambda ptx, device=None: SimpleNamespace(function=lambda name: function)))
    monkeypatch.setattr(tensors, "pointer_device", lambda ptr: ptr >> 40)
    monkeypatch.setattr(tensors, "to_device", fake_copy)
    monkeypatch.setattr(driver, "device_info", lambda device=None: SimpleNamespace(
        compute_capability=(9, 0), multiprocessor_count=132))
    monkeypatch.setattr(driver, "workspace", lambda stream, device: SimpleNamespace(
        ptr=1 << 20))
    monkeypatch.setattr(driver, "ensure_context", lambda device=None: device or 0)
    monkeypatch.setattr(driver, "stream_buffer", lambda name, nbytes, handle, device, what:
                        {"block_classes": 2 << 20, "tile_index": 3 << 20}[name])
    monkeypatch.setattr(tensormap, "encode_tiled", lambda *a, device=None, **k:
                        SimpleNamespace(kernel_arg=lambda: (ctypes.c_ubyte * 128)()))
    tensormap.launch_arg.cache_clear()

    def launches(kern, traced: bool) -> list:
        def build(layout, arch):  # the real choice of design and config, no code generated
            request = kern._request(layout, arch, kern.backend)
            launched.append(request.scheduler)  # the scheduler the build's code would run
            resolved = plan(kern.program.checked, request)
            return KernelBuild(resolved.backend.name, arch, "", "", None, resolved.configs[0])
        monkeypatch.setattr(kern.launcher, "build", build)
        kern.trace, kern.trace_workspace = traced, 5 << 20
        shape = (1, 4096, 16, 128)
        q, k, v, out = (FakeDevice(shape, ptr=n << 36) for n in range(1, 5))
        doc = np.repeat(np.arange(4, dtype=np.int32), 1024)[None]
        launched.clear()
        kern(q, k, v, out=out, doc=doc)
        return list(launched)

    try:
        for traced in (False, True):
            got = launches(trace.scheduler_kernel(mhadsl.compile(text), "document_mask",
                                                  "LPT", trace=traced), traced)
            want = launches(mhadsl.compile(named)["document_mask"], traced)
            (scheduler, _), *runs = got
            assert scheduler == "LPT"
            assert [(g, t) for g, t, _ in runs] == [((256, 1, 1), 128), ((132, 1, 1), 384)]
            assert got == want
            assert (5 << 20 if traced else 1 << 20).to_bytes(8, "little") in got[-1][2]
    finally:
        tensormap.launch_arg.cache_clear()
