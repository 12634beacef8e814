"""The backward pass without a GPU (codegen/backends/backward.py, mhadsl/host/backward.py): every
example's backward kernels, atomic and deterministic, assemble for sm_80 and sm_90a without
spills, the kernels take the ABI's parameters in its types and offsets, the main kernel runs
the declaration's scheduler over K/V tiles, the simulator proves that work space covered
exactly once, and a call's mistakes are errors before anything runs."""
import json
import random
import re

import numpy as np
import pytest

import mhadsl
from helpers import EXAMPLES, REPO
from mhadsl.abi import KIND_ALIGN
from mhadsl.host.backward import backward_work
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.codegen import backends
from mhadsl.codegen.backends import Layout
from mhadsl.codegen.backends.backward import (
    BACKEND, DQ, MAIN, POSTPROCESS, PREPROCESS, BackwardConfig, dq_shared_bytes, pass_swizzle,
    shared_bytes,
)
from mhadsl.codegen.backends.backward_sm90 import adds_in_order
from mhadsl.codegen.kernel import backward_hooks
from mhadsl.codegen.scheduler import SchedulerSpec
from mhadsl.analysis.simulate import simulate
from mhadsl.analysis.valid_work import tile_counts, valid_work_order
from test_abi import offsets, ptx_params

needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="ptxas not found")
DECLARATIONS = [(path, name) for path in EXAMPLES for name in mhadsl.compile(path).attentions]


# what each design's PTX must hold
DESIGN_INSTRUCTIONS = {
    "backward": ("mma.sync.aligned.m16n8k16.row.col.f32",
                 "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                 "ldmatrix.sync.aligned.m8n8.x4.shared.b16", "cp.async.cg.shared.global",
                 "ex2.approx", "cp.async.ca.shared.global"),
    "backward_sm90": ("wgmma.mma_async.sync.aligned.m64n64k16.f32", "cp.async.bulk.tensor.4d",
                      "mbarrier.try_wait.parity", "ex2.approx",
                      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"),
}


@needs_ptxas
@pytest.mark.parametrize("arch, forced", [("sm_80", None), ("sm_90a", None),
                                          ("sm_90a", "backward")],
                         ids=["sm_80", "sm_90a", "sm_90a-sm80design"])
@pytest.mark.parametrize("layout", [Layout(), Layout(gqa_group=4, ragged=True),
                                    Layout(deterministic=True),
                                    Layout(gqa_group=4, ragged=True, deterministic=True)],
                         ids=["dense", "ragged-gqa4", "deterministic",
                              "deterministic-ragged-gqa4"])
@pytest.mark.parametrize("path, name", DECLARATIONS,
                         ids=[f"{p.stem}-{n}" for p, n in DECLARATIONS])
def test_every_example_backward_assembles_without_spills(path, name, layout, arch, forced):
    """On sm_90a a build, dense or ragged, is the Hopper design's (TMA + wgmma), a
    deterministic one where its scheduler hands out each head's K/V tiles in order
    (`adds_in_order`); other deterministic builds, and any build forced to it, the
    sm80-style design's."""
    kern = mhadsl.compile(path)[name]
    # (a declared ratio is the only group its builds take)
    build = kern.build(arch, gqa_group=kern.options.gqa or layout.gqa_group,
                       ragged=layout.ragged, backward=True,
                       deterministic=layout.deterministic, backend=forced)
    scheduler = kern.options.scheduler_for("backward", deterministic=layout.deterministic)
    hopper = arch == "sm_90a" and forced is None and (
        not layout.deterministic or adds_in_order(scheduler))
    # (every example fits the Hopper design's registers, softcap's tanh and its derivative
    # included: test_backward_sm90 holds one that does not to the sm80 design's build; but
    # a mask that reads data, whose tile classes are read per step, may not at head dim 128
    # in a ragged GQA build, where ptxas's allocation at the cap decides)
    if hopper and layout.ragged and kern.options.mask_reads_data:
        assert build.backend in ("backward_sm90", "backward")
    else:
        assert build.backend == ("backward_sm90" if hopper else "backward")
    hopper = build.backend == "backward_sm90"
    assert f".target {arch}" in build.ptx
    for instruction in DESIGN_INSTRUCTIONS[build.backend]:
        assert instruction in build.ptx, instruction
    # dQ's reduction: a bulk reduce-add per warpgroup and step (Hopper, in a fixed order
    # when deterministic), vectors where the arch has them; none in the sm80-style
    # design's deterministic mode (`mha_bwd_dq`)
    reductions = {"red.global.add.v4.f32", "red.global.add.v2.f32", "atom.global.add.f32",
                  "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"
                  } & set(build.ptx.split())
    expected = ("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" if hopper else
                "red.global.add.v4.f32" if arch == "sm_90a" else "atom.global.add.f32")
    # (a split group adds dK and dV too: a deterministic one from 4 query heads per K/V head)
    split = {"red.global.add.v2.f32"} if hopper and build.config.split_group else set()
    assert reductions == (set() if layout.deterministic and not hopper else {expected} | split)
    assert build.config.deterministic == layout.deterministic
    assert set(build.assembled.kernels) == {
        k.name for k in backends.backend(build.backend).kernels(build.config)}
    for resources in build.assembled.kernels.values():
        assert resources.spills == 0 and resources.stack_bytes == 0, resources


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_causal_d128_main_kernel_steps_64_query_rows_without_spills(arch):
    """Not the 32-row fallback (slower on the H200): the build spills if the LPT scheduler's
    work loop holds the last tile's SeqInfo across the tile body."""
    build = mhadsl.compile(EXAMPLES[0].parent / "causal.mha")["causal_fwd"].backward_build(arch)
    assert (build.config.head_dim, build.config.block_m) == (128, 64)
    main = build.assembled.kernels[MAIN]
    assert main.spills == 0 and main.stack_bytes == 0, main


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_kernels_take_the_abi_in_its_types_and_offsets(deterministic):
    kern = mhadsl.compile(EXAMPLES[0].parent / "causal.mha")["causal_fwd"]
    build = kern.backward_build("sm_90a", deterministic=deterministic)
    kernels = backends.backend(build.backend).kernels(build.config)
    assert [k.name for k in kernels] == [PREPROCESS, MAIN, DQ if deterministic else POSTPROCESS]
    for kernel in kernels:
        abi = kernel.abi
        params = ptx_params(build.ptx, kernel.name)
        assert len(params) == len(abi.params)
        assert offsets(params) == [abi.offsets[p.name] for p in abi]
        # (LLVM 22 gives a byval tensor map 128-byte alignment; the sm90 design lists its
        # maps first, at multiples of 128)
        assert all(align % KIND_ALIGN[p.kind] == 0 for (*_, align), p in zip(params, abi))
        assert abi.size == offsets(params)[-1] + params[-1][2]


def _main_kernel(ptx: str) -> str:
    start = ptx.index(f".entry {MAIN}(")
    return ptx[start:ptx.index("\n}\n", start)]


@pytest.mark.parametrize("scheduler, queue", [("LPT", True), ("Queued", True),
                                              ("Persistent", False), ("Transient", False)])
def test_the_main_kernel_runs_the_declarations_scheduler(scheduler, queue):
    """Its K/V tiles come from the scheduler's work loop: a queued scheduler takes them
    with the queue's atomic, a static one without; every launch resets the queue."""
    kern = mhadsl.compile(f'import "std/schedulers.mha"\nattention t {{ dtype = bf16 '
                          f'head_dim = 64  scheduler = {scheduler}() }}')["t"]
    main = _main_kernel(kern.backward_build("sm_80").ptx)
    assert ("atom.global.add.u32" in main) == queue
    assert "count_exit" in main
    config = kern.backward_build("sm_80").config
    assert kern.scheduler_spec(config, BACKEND) == SchedulerSpec(scheduler, (), config.block_n,
                                                                 1)


def test_a_masked_backward_by_default_runs_one_kv_head_at_a_time():
    """A masked declaration's backward (no scheduler named) hands out its K/V tiles longest
    first within sections of one K/V head: a K/V tile rereads its group's Q, dO and dQ rows,
    and one head's stay in L2. LPT's default sections (sized by the forward's K and V) would
    interleave two heads here."""
    kern = mhadsl.compile('import "std/schedulers.mha"\nattention c { dtype = bf16\n'
                          '    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }')["c"]
    spec = kern.scheduler_spec(BackwardConfig(head_dim=128), BACKEND)
    lengths, kv_heads = [4096] * 4, 8
    counts = tile_counts(lengths, spec.tile_m)

    def order(spec: SchedulerSpec) -> list:
        one_cta = SchedulerSpec(spec.name, (("num_ctas", 1),) + spec.args, spec.tile_m, 1)
        result = simulate(STD, one_cta, backward_work(lengths, kv_heads, spec.tile_m), ctas=1)
        assert result.covered_exactly_once, result.message
        return result.visits[0]

    by_head = [(q * spec.tile_m, h, b)
               for q, h, b in valid_work_order(counts, kv_heads, "LONGEST_FIRST", 1)]
    assert spec.name == "LPT" and order(spec) == by_head
    assert order(SchedulerSpec("LPT", (), spec.tile_m, 1)) != by_head


def test_config_problems_name_the_setting():
    assert not BackwardConfig(head_dim=64).problems()
    (problem,) = BackwardConfig(head_dim=96).problems()
    assert problem.settings == ("head_dim",) and "96" in problem.message
    # head dim 256's dK and dV in one pass: 320 f32 accumulators per thread
    (problem,) = BackwardConfig(head_dim=256).problems()
    assert problem.settings == ("tile", "warps") and "320" in problem.message
    assert not BackwardConfig(head_dim=256, column_passes=2).problems()
    assert BackwardConfig(head_dim=256, column_passes=3).problems()[0].settings == ("head_dim",)
    assert not BackwardConfig(block_m=32).problems()
    assert BackwardConfig(block_m=48).problems()[0].settings == ("tile",)
    assert not BackwardConfig(step_passes=2).problems()
    assert BackwardConfig(block_m=32, step_passes=4).problems()[0].settings == ("tile",)
    assert shared_bytes(BackwardConfig()) <= 227 * 1024


@pytest.mark.parametrize("head_dim, warps", [(64, 4), (128, 4), (256, 4), (128, 8), (256, 8)])
def test_every_copy_pass_writes_where_ldmatrix_reads(head_dim, warps):
    """A lane's cp.async of (row, chunk) in pass p lands at the swizzled address the
    products read: row * row_bytes + 16 * (chunk ^ row % 8). At head dim 256 a pass covers
    4 rows, so passes move the row's low bits (without `pass_swizzle`, odd passes would land
    in the wrong chunks and every gradient be wrong)."""
    config = BackwardConfig(head_dim=head_dim, num_warps=warps, block_n=16 * warps)
    chunks, rpp, rb = config.chunks_per_row, config.rows_per_pass, config.row_bytes
    for tid in range(config.threads):
        row0, chunk = divmod(tid, chunks)
        lane_offset = row0 * rb + 16 * (chunk ^ row0 % 8)  # `_Lanes.ld_swz`
        for p in range(64 // rpp):
            row = row0 + p * rpp
            written = (lane_offset ^ pass_swizzle(p, rpp)) + p * rpp * rb
            assert written == row * rb + 16 * (chunk ^ row % 8), (tid, p)


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("layout", [Layout(), Layout(gqa_group=4, ragged=True),
                                    Layout(deterministic=True),
                                    Layout(gqa_group=4, ragged=True, deterministic=True)],
                         ids=["dense", "ragged-gqa4", "deterministic",
                              "deterministic-ragged-gqa4"])
def test_head_dim_256_runs_two_column_passes_without_spills(layout, arch):
    """dK and dV of 256 columns would hold 320 f32 per thread: the main kernel computes them
    (and dQ's columns) in two passes over the query tiles, in the shared memory of sm_80
    (on sm_90a this design's build forced: a call there runs backward_sm90's)."""
    kern = mhadsl.compile("attention wide { dtype = bf16  head_dim = 256\n"
                          "  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }")["wide"]
    assert not BACKEND.problems(kern.options, arch)
    build = kern.build(arch, gqa_group=layout.gqa_group, ragged=layout.ragged, backward=True,
                       deterministic=layout.deterministic, backend="backward")
    assert build.backend == "backward"
    assert build.config.column_passes == 2 and build.config.pass_columns == 128
    assert max(shared_bytes(build.config), dq_shared_bytes(build.config)) <= 163 * 1024
    for resources in build.assembled.kernels.values():
        assert resources.spills == 0 and resources.stack_bytes == 0, resources


def test_a_score_without_a_derivative_is_a_located_error():
    kern = mhadsl.compile("attention t { dtype = bf16  head_dim = 64\n"
                          "  score(s, b, h, q_idx, kv_idx) = s * f32(i32(s)) }")["t"]
    with pytest.raises(mhadsl.MhaError, match="cannot differentiate"):
        kern.backward_build("sm_80")


def test_a_score_rule_lowers_its_derivative_hook():
    program = mhadsl.compile(EXAMPLES[0].parent / "softcap.mha")
    options = program["softcap_causal"].options
    hooks = backward_hooks(program.checked, options.mask, options.score)
    assert hooks.derivative is not None and hooks.score is not None
    plain = mhadsl.compile(EXAMPLES[0].parent / "causal.mha")["causal_fwd"].options
    assert backward_hooks(program.checked, plain.mask, None).derivative is None


def _arrays(batch=1, sq=8, sk=8, heads=2, kv_heads=2, d=128):
    q = np.zeros((batch, sq, heads, d), np.float32)
    kv = np.zeros((batch, sk, kv_heads, d), np.float32)
    return dict(q=q, k=kv, v=kv, out=q, lse=np.zeros((batch, heads, sq), np.float32), dout=q)


@pytest.mark.parametrize("change, error, message", [
    (dict(dout=np.zeros((1, 7, 2, 128), np.float32)), ValueError, "dout has shape"),
    (dict(out=np.zeros((1, 8, 2, 64), np.float32)), ValueError, "out has shape"),
    (dict(lse=np.zeros((1, 8, 2), np.float32)), ValueError, "lse has shape"),
    (dict(lse=np.zeros((1, 2, 8), np.int32)), TypeError, "lse has dtype int32"),
    (dict(k=np.zeros((1, 8, 3, 128), np.float32), v=np.zeros((1, 8, 3, 128), np.float32)),
     ValueError, "multiple of key/value heads"),
    ({}, TypeError, "torch CUDA tensors"),
])
def test_call_mistakes_are_errors_before_any_launch(change, error, message):
    kern = mhadsl.compile(EXAMPLES[0].parent / "causal.mha")["causal_fwd"]
    with pytest.raises(error, match=message):
        kern.backward(**{**_arrays(), **change})


def test_a_bad_scale_is_a_type_error():
    kern = mhadsl.compile(EXAMPLES[0].parent / "causal.mha")["causal_fwd"]
    with pytest.raises(TypeError, match="scale"):
        kern.backward(**_arrays(), scale="0.1")


STD = mhadsl.compile('import "std/schedulers.mha"', name="std").checked


@pytest.mark.parametrize("scheduler, args", [
    ("LPT", ()), ("Queued", ()), ("Persistent", ()), ("Transient", ()),
    ("Queued", (("order", "LONGEST_FIRST"), ("heads_per_section", 2))),
    ("Persistent", (("order", "PROMPT_ROTATE"),))])
def test_the_backward_work_space_is_covered_exactly_once(scheduler, args):
    """Random ragged key lengths (empty sequences, single rows, tile edges): every K/V tile
    of every (sequence, K/V head) is handed out once, none past a sequence's end."""
    rng = random.Random(22)
    for _ in range(4):
        lengths = [rng.choice([0, 1, 63, 64, 65, rng.randrange(1, 3000)])
                   for _ in range(rng.randrange(1, 9))]
        heads = rng.randrange(1, 6)
        result = simulate(STD, SchedulerSpec(scheduler, args, 64, 1),
                          backward_work(lengths, heads), ctas=rng.randrange(1, 20))
        assert result.covered_exactly_once and result.terminated, (lengths, heads)
        assert result.tiles == heads * sum(-(-n // 64) for n in lengths)


def _broken_persistent() -> str:
    """The standard Persistent scheduler with one bug: it strides twice as far."""
    text = (REPO / "mhadsl/std/schedulers.mha").read_text()
    start = text.index("scheduler Persistent")
    rules = text[start:text.index("\n}\n", start) + 3]
    assert "state.idx += grid_dim.x" in rules
    return 'import "std/schedulers.mha"\n' + rules.replace(
        "scheduler Persistent", "scheduler Skips").replace(
        "state.idx += grid_dim.x", "state.idx += 2 * grid_dim.x")


def test_a_scheduler_that_skips_backward_work_is_caught(tmp_path, capsys):
    from mhadsl.cli import main
    path = tmp_path / "broken.mha"
    path.write_text(_broken_persistent())
    program = mhadsl.compile(str(path)).checked
    result = simulate(program, SchedulerSpec("Skips", (("num_ctas", 4),), 64, 1),
                      backward_work([300, 64], 3), ctas=4)
    assert not result.covered_exactly_once and result.missing
    assert main(["simulate", str(path), "--scheduler", "Skips", "--seqlens", "300,64",
                 "--heads", "3", "--ctas", "4", "--backward", "--json"]) == 3
    std = str(REPO / "mhadsl/std/schedulers.mha")
    assert main(["simulate", std, "--scheduler", "LPT", "--seqlens", "300,64", "--heads", "3",
                 "--backward", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["covered_exactly_once"] and out["tiles"] == 3 * (5 + 1)


@pytest.mark.parametrize("extra", [["--gqa", "2"], ["--kv-splits", "2"],
                                   ["--kernel", "causal_fwd"]])
def test_backward_simulation_option_errors(extra, capsys):
    from mhadsl.cli import main
    rc = main(["simulate", str(EXAMPLES[0].parent / "causal.mha"), "--scheduler", "LPT",
               "--seqlens", "300", "--heads", "4", "--backward", *extra])
    assert rc == 2 and "--backward" in capsys.readouterr().err


def test_deterministic_must_be_a_bool():
    kern = mhadsl.compile(EXAMPLES[0].parent / "causal.mha")["causal_fwd"]
    with pytest.raises(TypeError, match="deterministic"):
        kern.backward(**_arrays(), deterministic="yes")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_steps_of_one_query_head_are_found_without_a_division(monkeypatch, tmp_path, arch):
    """With one query head per K/V head a work tile's step s is query tile s: the search for
    the next step the mask may keep (a ballot per 32 candidates) divides nothing; with a GQA
    group a step's head and tile come from dividing by the tile count (the division measured
    slower on the H200)."""
    monkeypatch.setenv("MHADSL_CACHE_DIR", str(tmp_path))
    kernel = mhadsl.compile("attention p { dtype = bf16  head_dim = 128\n"
                            "  mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx }", name="x")["p"]

    def divisions_per_round(gqa_group):
        ptx = kernel.backward_build(arch, gqa_group=gqa_group).ptx
        main = ptx[ptx.index(".entry mha_bwd("):]
        blocks = re.split(r"\n\$L__BB\d+_\d+:", main[:main.index("\n}\n")])
        return [len(re.findall(r"\b(?:div|rem)\.u32", blk)) for blk in blocks
                if "vote.sync.ballot" in blk]

    assert divisions_per_round(1) and not any(divisions_per_round(1))
    assert all(divisions_per_round(2))
