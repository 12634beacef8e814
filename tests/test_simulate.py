"""The host simulator proves coverage, catches wrong schedulers, and never hangs."""
import random
import re
import time

import pytest

from helpers import EXAMPLES, STD, checked
from mhadsl.cli import main as cli_main
from mhadsl.codegen.scheduler import HOST_LOOP_FUEL, SchedulerSpec
from mhadsl.front.diagnostics import MhaError
from mhadsl.pipeline import front_end
from mhadsl.analysis.simulate import (
    MAX_SIMULATED_CTAS, MAX_SIMULATED_GRID, MAX_SIMULATED_TILES, MAX_SIMULATED_WORK, Batch,
    HostScheduler, simulate,
)

MUST_SHOW = Batch([0, 1, 127, 128, 129, 3000, 8192], heads=5, tile=128, ragged=True)
STD_CASES = [(name, order) for name in ("Transient", "Persistent", "Queued")
             for order in ("DEFAULT", "PROMPT_ROTATE")] + [("LPT", None), ("Adaptive", None)]


@pytest.mark.parametrize("name, order", STD_CASES)
def test_std_schedulers_cover_every_tile_once(name, order):
    spec = SchedulerSpec(name, (("order", order),) if order else (), 128)
    result = simulate(checked(STD), spec, MUST_SHOW, ctas=7)
    assert result.covered_exactly_once, result.message
    assert result.tiles == 5 * sum(-(-n // 128) for n in MUST_SHOW.seqlens)
    assert result.lower_bound <= result.makespan
    assert 0 < result.efficiency <= 1


@pytest.mark.parametrize("name, order", STD_CASES)
def test_random_ragged_batches(name, order):
    rng = random.Random(hash((name, order)) & 0xFFFF)
    program = checked(STD)
    for _ in range(4):
        lens = [rng.choice([0, 1, rng.randrange(1, 5000)]) for _ in range(rng.randrange(1, 7))]
        tile = rng.choice([32, 64, 128])
        batch = Batch(lens, rng.randrange(1, 9), tile, ragged=True)
        spec = SchedulerSpec(name, (("order", order),) if order else (), tile)
        result = simulate(program, spec, batch, ctas=rng.randrange(1, 40))
        assert result.covered_exactly_once, (lens, result.message)


def test_examples_cover_every_tile_once():
    checked_schedulers = 0
    for path in EXAMPLES:
        _, program = front_end(path.read_text(), str(path), path.parent)
        own = [n for n, d in program.schedulers.items() if str(path) in d.span.source.name]
        for name in own:
            result = simulate(program, SchedulerSpec(name, (), 128), MUST_SHOW, ctas=7)
            assert result.covered_exactly_once, (path, name, result.message)
            checked_schedulers += 1
    assert checked_schedulers >= 2  # the examples show schedulers of one's own


def test_seed_mapping_vector():
    """BRIEF §3: tile 32, 3 heads, 8 CTAs, one sequence of 100 tokens, static persistent."""
    program = checked(STD)
    batch = Batch([100], heads=3, tile=32, ragged=False)
    default = simulate(program, SchedulerSpec("Persistent", (("num_ctas", 8),), 32), batch, ctas=8)
    rotate = simulate(program, SchedulerSpec("Persistent", (("num_ctas", 8),
                                                            ("order", "PROMPT_ROTATE")), 32),
                      batch, ctas=8)
    assert default.visits[0] == [(0, 0, 0), (0, 2, 0)]
    assert default.visits[4] == [(0, 1, 0)]
    assert rotate.visits[4] == [(96, 1, 0)]


def test_queued_hands_out_the_short_last_tiles_of_its_last_pairs_last():
    """Queued's DEFAULT order, where every (sequence, head) pair has all its tiles and the
    last is short: the last tiles of the last 16 pairs come after every other tile
    (`short_tiles_last`; plain D64 B4 S4096 on the H200, 192-row tiles: 500 -> 507 TFLOP/s).
    Full last tiles, other orders and uneven ragged batches keep the order as it was."""
    program = checked(STD)

    def handed_out(seqlens, tile, ragged=False, **args):
        spec = SchedulerSpec("Queued", tuple(args.items()), tile)
        result = simulate(program, spec, Batch(seqlens, heads=5, tile=tile, ragged=ragged),
                          ctas=1)
        assert result.covered_exactly_once, result.message
        return result.visits[0]

    def default(seqlens, tile):
        return [(q * tile, h, b) for b, n in enumerate(seqlens) for h in range(5)
                for q in range(-(-n // tile))]
    pairs = default([4096] * 4, 192)  # 20 pairs of 22 tiles, the last of 64 rows
    kept, moved = pairs[:4 * 22], pairs[4 * 22:]
    assert handed_out([4096] * 4, 192) == kept + [t for t in moved if t[0] < 4032] + \
        [t for t in moved if t[0] == 4032]
    assert handed_out([4096] * 4, 192, tail_pairs=0) == pairs
    assert handed_out([4096] * 4, 128) == default([4096] * 4, 128)  # full last tiles
    assert handed_out([4000, 3000], 192, ragged=True) == default([4000, 3000], 192)
    rotated = handed_out([4096] * 4, 192, order="PROMPT_ROTATE")
    assert rotated[:2] == [(0, 0, 0), (192, 0, 0)] and rotated[22] == (4032, 1, 0)


def persistent_variant(advance_body: str, extra: str = "") -> str:
    return STD + f"""
scheduler Wrong {{
    may_advance = true
    schedule = DEFAULT
    grid_dim(batch_size, max_num_prompt_tiles) = (num_sms, 1, 1)
    initial_state(slots, ts) = State(idx = block_idx.x, slots = slots, max_idx = ts.num_work())
    get_current_work_info(ts, state) = ts.work_info(state.idx, schedule)
    advance(ts, state, pipeline_idx) {{
        {advance_body}
        if state.idx >= state.max_idx {{ return none }}
        return ts.seq_info(ts.work_info(state.idx, schedule))
    }}
    unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.idx, schedule))
}}
{extra}"""


@pytest.mark.parametrize("body, problem", [
    ("state.idx += grid_dim.x + 1", "missing"),             # skips tiles
    ("state.idx += grid_dim.x - 1", "repeated"),            # CTAs overlap
    ("if state.idx == 5 { state.idx = 5 } else { state.idx += grid_dim.x }", "terminated"),
])
def test_planted_wrong_scheduler_is_caught(body, problem):
    program = checked(persistent_variant(body))
    result = simulate(program, SchedulerSpec("Wrong", (), 128), MUST_SHOW, ctas=7)
    assert result.covered_exactly_once is False
    if problem == "terminated":
        assert result.terminated is False and "does not terminate" in result.message
    else:
        assert getattr(result, problem), result.message


def test_invalid_tile_is_caught():
    text = persistent_variant("state.idx += grid_dim.x").replace(
        "get_current_work_info(ts, state) = ts.work_info(state.idx, schedule)",
        "get_current_work_info(ts, state) = WorkInfo(prompt_offset = 0, head_idx = 99, "
        "prompt_idx = 0, is_valid = true)").replace(
        "unsafe_seq_info(ts, state) = ts.seq_info(ts.work_info(state.idx, schedule))",
        "unsafe_seq_info(ts, state) = SeqInfo(seq_len = 10, start_of_seq = 0, "
        "prompt_offset = 0, head_idx = 99, prompt_idx = 0)")
    result = simulate(checked(text), SchedulerSpec("Wrong", (), 128), MUST_SHOW, ctas=7)
    assert not result.covered_exactly_once and (0, 99, 0) in result.invalid


def test_endless_while_loop_is_reported_not_hung():
    program = checked(persistent_variant("var i = 0\n while i < 10 { i = i * 1 }\n"
                                         "state.idx += grid_dim.x"))
    result = simulate(program, SchedulerSpec("Wrong", (), 128), MUST_SHOW, ctas=7)
    assert not result.terminated and "never ends" in result.message


def test_lpt_beats_static_stride_on_long_causal():
    program = checked(STD)
    batch = Batch([16384], heads=16, tile=128, ragged=False)
    lpt = simulate(program, SchedulerSpec("LPT", (), 128), batch, ctas=132)
    stride = simulate(program, SchedulerSpec("Persistent", (), 128), batch, ctas=132)
    assert lpt.covered_exactly_once and stride.covered_exactly_once
    assert lpt.makespan < stride.makespan
    assert lpt.efficiency > 0.95



@pytest.mark.parametrize("lengths, takes", [
    ([4096] * 4, "LPT"),               # 64 pairs of 32 tiles on 132 CTAs
    ([16384] + [128] * 64, "LPT"),     # one long sequence's 16 pairs hold most of the work
    ([2048] * 16, "Queued"),           # 256 full-length pairs: more than the CTAs
    ([512] * 40, "Queued"),
])
def test_adaptive_takes_lpt_or_queued_by_the_batch(lengths, takes):
    """Adaptive runs LPT's order where the work is fewer full-length (sequence, head) pairs
    than CTAs, else Queued's: every CTA's visits are the chosen one's, in order."""
    program = checked(STD)
    batch = Batch(lengths, heads=16, tile=128, ragged=True)
    runs = {name: simulate(program, SchedulerSpec(name, (), 128), batch, ctas=132)
            for name in ("Adaptive", "LPT", "Queued")}
    assert all(r.covered_exactly_once for r in runs.values())
    other = "Queued" if takes == "LPT" else "LPT"
    assert runs["Adaptive"].visits == runs[takes].visits
    assert runs["Adaptive"].visits != runs[other].visits

def grid_variant(grid: str) -> str:
    return persistent_variant("state.idx += grid_dim.x").replace(
        "grid_dim(batch_size, max_num_prompt_tiles) = (num_sms, 1, 1)",
        f"grid_dim(batch_size, max_num_prompt_tiles) = {grid}")


def test_many_idle_ctas_do_not_recurse():
    """600 CTAs for 1 tile: 599 start with nothing to do (a RecursionError once)."""
    result = simulate(checked(grid_variant("(600, 1, 1)")), SchedulerSpec("Wrong", (), 128),
                      Batch([1], heads=1, tile=128, ragged=False), ctas=7)
    assert result.covered_exactly_once and result.visits == {0: [(0, 0, 0)]}


@pytest.mark.parametrize("grid, dim", [("(4000000000, 1, 1)", "x below 2^31"),
                                       ("(1, 1, 70000)", "y, z at most 65535")])
def test_grid_past_cuda_limits_is_an_error_at_grid_dim(grid, dim):
    with pytest.raises(MhaError, match=rf"test.mha:\d+:5: error: grid_dim gives .* CUDA "
                                       rf"allows .*{re.escape(dim)}") as err:
        simulate(checked(grid_variant(grid)), SchedulerSpec("Wrong", (), 128), MUST_SHOW, ctas=7)
    assert "grid_dim(batch_size" in str(err.value)  # the source line, with its caret


def test_grid_past_the_simulator_cap_is_an_error():
    with pytest.raises(MhaError, match=f"the simulator runs at most {MAX_SIMULATED_GRID}"):
        simulate(checked(grid_variant("(2000000000, 1, 1)")), SchedulerSpec("Wrong", (), 128),
                 MUST_SHOW, ctas=7)


@pytest.mark.parametrize("seqlens, message", [
    ([2**31], "between 0 and 2147483647"), ([2**32], "between 0 and 2147483647"),
    ([-1], "between 0"), ([2**30, 2**30], "at most 2147483647 rows"),
    ([2**30] * 4, "the simulator takes at most"),
])
def test_batches_past_the_limits_are_value_errors(seqlens, message):
    with pytest.raises(ValueError, match=message):
        Batch(seqlens, heads=64, tile=16, ragged=len(seqlens) == 2)


def test_failed_runs_report_no_efficiency():
    program = checked(persistent_variant("state.idx += grid_dim.x - 1"))  # repeats tiles
    result = simulate(program, SchedulerSpec("Wrong", (), 128), MUST_SHOW, ctas=7)
    assert not result.covered_exactly_once and result.efficiency is None
    assert result.summary()["efficiency"] is None


def test_a_repeating_scheduler_stops_when_it_has_done_more_than_all_tiles():
    program = checked(persistent_variant("state.idx = state.idx"))  # the same tile forever
    result = simulate(program, SchedulerSpec("Wrong", (), 128),
                      Batch([1000], heads=1, tile=128, ragged=False), ctas=7)
    assert not result.covered_exactly_once and result.repeated
    assert "stopped after 9 tiles, more than the batch's 8" in result.message


@pytest.mark.parametrize("name", ["Transient", "Persistent", "Queued", "LPT", "Adaptive"])
def test_ten_thousand_sequences_simulate_in_seconds(name):
    """~1.1M work items; the Python event loop took 25-70 s, the compiled one 1-2 s."""
    rng = random.Random(0)
    batch = Batch([rng.randrange(0, 1700) for _ in range(10_000)], heads=16, tile=128,
                  ragged=True)
    start = time.perf_counter()
    result = simulate(checked(STD), SchedulerSpec(name, (), 128), batch, ctas=132)
    elapsed = time.perf_counter() - start
    assert result.covered_exactly_once and result.tiles > 1_000_000
    assert 0.9 < result.efficiency <= 1
    assert elapsed < 20, f"{name}: {elapsed:.1f} s"


# ---------------------------------------------------------------- stopped runs and empty grids
def test_a_run_stopped_early_is_not_terminated_and_has_no_makespan():
    """An advance that never returns none, on several CTAs: the log fills and the run is
    stopped; it did not terminate, and a stopped run has no makespan."""
    program = checked(persistent_variant("state.idx = (state.idx + grid_dim.x) % ts.num_work()"))
    result = simulate(program, SchedulerSpec("Wrong", (), 128), MUST_SHOW, ctas=7)
    assert result.terminated is False and result.makespan is None
    assert "stopped after" in result.message and result.summary()["terminated"] is False
    assert result.summary()["makespan"] is None and result.efficiency is None


def test_a_grid_of_zero_ctas_is_an_error_at_grid_dim():
    text = persistent_variant("state.idx += grid_dim.x").replace(
        "= (num_sms, 1, 1)", "= (batch_size - 1, 1, 1)")
    with pytest.raises(MhaError, match=r"test.mha:\d+:\d+: error: grid_dim gives \(0, 1, 1\): "
                                       r"no CTAs; CUDA launches at least one"):
        simulate(checked(text), SchedulerSpec("Wrong", (), 128), Batch([9], 2, 128, False))


# ---------------------------------------------------------------- host rules that never end
FOREVER = "fn forever(x: u32) -> u32 {\n var y = x\n while true { y += 1 }\n return y\n}\n"


def test_a_grid_dim_whose_while_never_ends_is_an_error_at_grid_dim(tmp_path, capsys):
    text = grid_variant("(forever(1), 1, 1)") + FOREVER
    with pytest.raises(MhaError, match=r"test.mha:\d+:5: error: grid_dim's `while` loops ran "
                                       rf"{HOST_LOOP_FUEL} iterations without ending"):
        simulate(checked(text), SchedulerSpec("Wrong", (), 128), MUST_SHOW, ctas=7)
    (tmp_path / "forever.mha").write_text(text)
    assert cli_main(["simulate", str(tmp_path / "forever.mha"), "--scheduler", "Wrong",
                     "--seqlen", "300"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and "error: grid_dim's `while` loops ran" in out.err
    assert out.err.count("\n") == 3 and "Traceback" not in out.err  # the line and its caret


def test_a_kv_splits_whose_while_never_ends_is_an_error_at_kv_splits():
    text = grid_variant("(7, 1, 1)").replace(
        "    initial_state", "    kv_splits(batch_size, max_seq_len) = min(forever(1), 4)\n"
                            "    initial_state") + FOREVER
    host = HostScheduler(checked(text), SchedulerSpec("Wrong", (), 1, 8))
    with pytest.raises(MhaError, match=r"test.mha:\d+:5: error: kv_splits's `while` loops ran "
                                       rf"{HOST_LOOP_FUEL} iterations without ending"):
        host.kv_splits(1, 4096, 8, 132)


# ---------------------------------------------------------------- what the simulator takes
def test_a_work_space_past_the_limit_is_a_value_error():
    """Few enough tiles, but a scheduler may step through every work index: one long
    sequence among empty ones makes a work space of its tiles times the sequences."""
    tiles = MAX_SIMULATED_WORK // 32
    with pytest.raises(ValueError, match=rf"^the batch's work space is {tiles * 33} indices "
                                         rf"\(its longest sequence's tiles x heads x "
                                         rf"sequences\); the simulator takes at most "
                                         rf"{MAX_SIMULATED_WORK}$"):
        Batch([16 * tiles] + [0] * 32, heads=1, tile=16, ragged=True)
    Batch([16 * tiles] + [0] * 31, heads=1, tile=16, ragged=True)  # at the limit


def test_more_cta_slots_than_the_limit_is_a_value_error():
    with pytest.raises(ValueError, match=rf"^the simulator runs at most {MAX_SIMULATED_CTAS} "
                                         rf"CTAs at once, not {MAX_SIMULATED_CTAS + 1}$"):
        simulate(checked(STD), SchedulerSpec("Queued", (), 128), MUST_SHOW,
                 ctas=MAX_SIMULATED_CTAS + 1)


@pytest.mark.parametrize("args, message", [
    (["--seqlens", "1000000", "--heads", "512", "--ctas", "16777216"],
     f"error: --ctas must be between 1 and {MAX_SIMULATED_CTAS}, got 16777216\n"),
    (["--seqlens", "1000000000", "--heads", "1", "--ctas", "4"],
     f"error: the batch has 7812500 tiles; the simulator takes at most "
     f"{MAX_SIMULATED_TILES}\n"),
])
def test_a_work_space_the_simulator_cannot_take_is_refused_before_it_runs(args, message,
                                                                           capsys):
    """Both ran for minutes or took 1.4 GB."""
    start = time.perf_counter()
    assert cli_main(["simulate", str(EXAMPLES[0].parent / "queued_rotate.mha"), "--scheduler",
                     "MyQueued", *args]) == 2
    assert capsys.readouterr().err == message
    assert time.perf_counter() - start < 5


def test_the_largest_work_space_runs_in_seconds_and_bounded_memory(tmp_path):
    """All the tiles, the work space's indices and CTA slots the simulator takes, at once:
    under 500 MB and 10 s here (the limits were set by measuring per tile and per CTA)."""
    from test_hostile_input import run_bounded
    sequences = MAX_SIMULATED_WORK // MAX_SIMULATED_TILES  # one long, the others empty
    lens = ",".join([str(16 * MAX_SIMULATED_TILES)] + ["0"] * (sequences - 1))
    stderr, seconds, megabytes = run_bounded(
        ["simulate", "std/schedulers.mha", "--scheduler", "Queued", "--seqlens", lens,
         "--heads", "1", "--tile", "16", "--ctas", str(MAX_SIMULATED_CTAS)], tmp_path)
    assert stderr == ""
    assert seconds < 10 and megabytes < 500, (seconds, megabytes)


def test_while_loops_that_each_end_but_run_long_in_all_are_stopped():
    """Each advance's loop ends well within one call's fuel, but all of them together pass
    the run's budget: the run stops there instead of running on for minutes."""
    from mhadsl.analysis.simulate import MAX_SIMULATED_LOOP_ITERATIONS
    program = checked(persistent_variant("var i = 0\n while i < 1000000 { i += 1 + i % 2 }\n"
                                         "state.idx += grid_dim.x"))
    start = time.perf_counter()
    result = simulate(program, SchedulerSpec("Wrong", (), 128),
                      Batch([1 << 20], heads=1, tile=128, ragged=False), ctas=7)
    assert not result.terminated and result.message == (
        f"scheduler does not terminate: its `while` loops ran more than "
        f"{MAX_SIMULATED_LOOP_ITERATIONS} iterations in all")
    assert time.perf_counter() - start < 10
