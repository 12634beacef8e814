"""Tile classes found per call for masks that read data (`codegen.block_classes`): which
declarations need them, the classes kernel's walk over a cell and the kernels' lookup, each
compiled for the host from the same IR builders and compared with the mask's NumPy meaning
(`mhadsl.reference_block_classes`), and the builds that take them (no GPU needed)."""
import ctypes

import numpy as np
import pytest
from llvmlite import binding, ir

import mhadsl
from mhadsl.abi import CELL_ALL, CELL_MAY, Extent, Pointer, Stride, operand_params
from mhadsl.codegen import block_classes
from mhadsl.codegen.assemble import find_ptxas
from mhadsl.codegen.kernel import expr_hooks
from mhadsl.codegen.nvptx import i32

from helpers import REPO

SOURCE = """
import "std/schedulers.mha"
attention packed(doc: i32[queries], doc_k: i32[keys]) {
    dtype = bf16  head_dim = 64
    mask(b, h, q_idx, kv_idx) = doc[q_idx] == doc_k[kv_idx] && kv_idx <= q_idx
}
attention per_batch(doc: i32[batch, _]) {
    dtype = bf16  head_dim = 64
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx && doc[b][q_idx] == doc[b][kv_idx]
}
attention per_head(table: i32[heads, _]) {
    dtype = bf16  head_dim = 64
    mask(b, h, q_idx, kv_idx) = table[h][q_idx / 16] >= kv_idx / 16 || kv_idx == 0
}
attention prefix_lm(prefix: i32[batch]) {
    dtype = bf16  head_dim = 64
    mask(b, h, q_idx, kv_idx) = kv_idx < prefix[b] || kv_idx <= q_idx
}
attention shifted(table: i32[heads, _], w: i32) {
    dtype = bf16  head_dim = 64
    mask(b, h, q_idx, kv_idx) = table[h][min(h, w)] > kv_idx
}
attention scored(bias: f32[heads, _]) {
    dtype = bf16  head_dim = 64
    mask(b, h, q_idx, kv_idx) = kv_idx <= q_idx
    score(s, b, h, q_idx, kv_idx) = s + bias[h][q_idx - kv_idx]
}
"""
PROGRAM = mhadsl.compile(SOURCE, name="block_classes")
RNG = np.random.default_rng(0)


@pytest.mark.parametrize("name, reads", [
    ("packed", True), ("per_batch", True), ("per_head", True),
    ("prefix_lm", False),  # one element per sequence: the interval analysis reads it
    ("shifted", False),  # an index of the head and a scalar: one element per tile
    ("scored", False),  # the score reads data, the mask does not
])
def test_which_masks_read_data(name, reads):
    assert PROGRAM[name].options.mask_reads_data is reads


def test_a_data_masks_forward_default_runs_all_heads_in_one_section():
    """Packed documents' query tiles read their document's keys, not their head's: the
    default's LPT order takes every head in one section (`l2_rows = 0`), which the simulator
    finds ahead of the L2-sized sections on a packed batch (and the H100 measured)."""
    from mhadsl.analysis.costmodel import DEFAULT_COSTS, KernelCostModel
    from mhadsl.analysis.simulate import Batch, simulate
    from mhadsl.codegen.scheduler import SchedulerSpec
    from mhadsl.front.attention_spec import BACKWARD_DEFAULT_ARGS, BACKWARD_DEFAULT_SCHEDULER
    options = PROGRAM["per_batch"].options
    assert options.scheduler_for("prefill") == ("Adaptive", (("l2_rows", 0),))
    assert options.scheduler_for("backward") == (BACKWARD_DEFAULT_SCHEDULER,
                                                 BACKWARD_DEFAULT_ARGS)
    assert PROGRAM["scored"].options.scheduler_for("prefill") == ("Adaptive", ())
    named = mhadsl.compile(SOURCE.replace("attention per_batch(doc: i32[batch, _]) {",
                                          "attention per_batch(doc: i32[batch, _]) {\n"
                                          "    scheduler = Adaptive()"), name="named")
    assert named["per_batch"].options.scheduler_for("prefill") == ("Adaptive", ())
    lengths = [3523, 2702, 2219, 1292, 1438, 413, 544, 319, 929, 3005]  # 16,384 rows
    doc = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)[None, :]
    cost = KernelCostModel(DEFAULT_COSTS, PROGRAM.checked, options.mask, 128, 128,
                           operands={"doc": doc}, declared=options.operands)
    batch = Batch([16384], 16, 128, ragged=False)
    efficiency = {args: simulate(PROGRAM.checked, SchedulerSpec("Adaptive", args, 128),
                                 batch, cost=cost).efficiency
                  for args in ((), options.scheduler_for("prefill")[1])}
    assert efficiency[(("l2_rows", 0),)] > efficiency[()] + 0.05, efficiency


def test_the_interval_analysis_alone_reads_no_classes():
    """A per-call build's classification with `cells=False` (a KV range's first search) is
    the interval analysis's alone: it loads nothing, where the full one loads the tile's
    class byte from the call's classes. Neither reads a document id: the classes are
    exact, so the analysis takes the tensor's elements as any value."""
    from mhadsl.codegen.nvptx import ptr
    from mhadsl.codegen.target import gpu_target, new_module
    options = PROGRAM["per_batch"].options
    hooks = expr_hooks(PROGRAM.checked, options.mask, None, options.operands, per_call=True)
    assert hooks.classify_loads
    for cells in (True, False):
        module = new_module("t", gpu_target("sm_90a"))
        abi = hooks.kernel_abi(block_classes.ABI).params
        fn = ir.Function(module, ir.FunctionType(ir.IntType(8), [
            ptr(1) if p.kind == "ptr" else i32 for p in abi] + [i32] * 8), "classify")
        for arg, p in zip(fn.args, abi):
            arg.name = p.name
        b = ir.IRBuilder(fn.append_basic_block())
        may, every = hooks.classify(b, *fn.args[len(abi):], cells=cells)
        i8 = ir.IntType(8)
        b.ret(b.or_(b.zext(may, i8), b.shl(b.zext(every, i8), i8(1))))
        assert ("load i8" in str(module)) is cells
        assert "load i32" not in str(module)


def _documents(lengths):
    return np.concatenate([np.sort(RNG.integers(0, 3, n)) for n in lengths]).astype(np.int32)


def _call(name, lengths, ragged):
    """A call's q, k, keyword arguments and host operand arrays, heads 4."""
    heads = 4
    if ragged:
        cu = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
        total = int(cu[-1])
        q = np.zeros((total, heads, 64))
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                      max_seqlen_k=max(lengths))
    else:
        total = lengths[0]
        q = np.zeros((len(lengths), total, heads, 64))
        kwargs = {}
    if name == "packed":
        docs = _documents(lengths if ragged else [total])
        operands = dict(doc=docs, doc_k=docs)
    elif name == "per_batch":
        operands = dict(doc=np.stack([_documents([total]) for _ in lengths]))
    else:
        width = -(-max(lengths) // 16)
        operands = dict(table=RNG.integers(-2, width + 2, (heads, width)).astype(np.int32))
    return q, kwargs, operands


def _host_cell_functions(make, name: str, extra: list):
    """A fixture's builder of a classes kernel's cell function compiled for the host per
    (declaration, ragged): `make(module, abi, hooks, ragged)` emits it; it is called as
    fn(*extra args, values) with the ABI's arguments by name in `values`."""
    binding.initialize_native_target()
    binding.initialize_native_asmprinter()
    engines = {}

    def build(declaration, ragged):
        if (declaration, ragged) in engines:
            return engines[declaration, ragged][1]
        options = PROGRAM[declaration].options
        hooks = expr_hooks(PROGRAM.checked, options.mask, None, options.operands)
        abi = hooks.kernel_abi(block_classes.ABI)
        module = ir.Module(name)
        module.triple = binding.get_default_triple()
        make(module, abi, hooks, ragged)
        machine = binding.Target.from_default_triple().create_target_machine()
        engine = binding.create_mcjit_compiler(binding.parse_assembly(str(module)), machine)
        engine.finalize_object()
        kinds = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64}
        fn = ctypes.CFUNCTYPE(ctypes.c_int32, *[kinds[p.kind] for p in abi], *extra)(
            engine.get_function_address(name))

        def call(*args):
            *args, values = args
            return fn(*[values[p.name] for p in abi], *args)
        engines[declaration, ragged] = (engine, call)
        return call
    return build


@pytest.fixture(scope="module")
def host_walk():
    """The classes kernel's walk over a cell (`block_classes.cell_function`), compiled for
    the host per (declaration, ragged): walk(cell, lane, lanes, values) -> class bits."""
    return _host_cell_functions(
        lambda module, abi, hooks, ragged: block_classes.cell_function(
            module, abi, hooks, ragged, ir.PointerType()),
        block_classes.CELL_FUNCTION, [ctypes.c_int64, ctypes.c_int32, ctypes.c_int32])


@pytest.fixture(scope="module")
def host_bounds():
    """The classes kernel's analysis of a cell with its reads bounded
    (`block_classes.bounds_function`), one lane reading every element, compiled for the
    host per (declaration, ragged): bounds(cell, 0, values) -> class bits or UNDECIDED."""
    return _host_cell_functions(
        lambda module, abi, hooks, ragged: block_classes.bounds_function(
            module, abi, hooks, ragged, ir.PointerType(), 1),
        block_classes.BOUNDS_FUNCTION, [ctypes.c_int64, ctypes.c_int32])


def _values(name, q, kwargs, operands, want, cell):
    """The walk's arguments by parameter name, for a call (`want`: the reference table) and
    cells of `cell`."""
    options = PROGRAM[name].options
    batch, heads, rows, cols = want.shape
    ragged = "cu_seqlens_q" in kwargs
    held = []

    def address(array):
        array = np.ascontiguousarray(array)
        held.append(array)
        return array.ctypes.data
    values = {"batch": batch, "block_heads": heads, "block_rows": rows, "block_cols": cols,
              "seqlen_q": 0 if ragged else q.shape[1], "seqlen_k": 0 if ragged else q.shape[1],
              "block_classes": 0, "cell_rows": cell[0], "cell_keys": cell[1]}
    for offsets in ("cu_seqlens_q", "cu_seqlens_k"):
        values[offsets] = address(kwargs[offsets]) if ragged else 0
    arrays = {"operand_" + n: np.ascontiguousarray(v) for n, v in operands.items()}
    for p in operand_params(options.operands):
        b = p.binding
        if isinstance(b, Pointer):
            values[p.name] = address(arrays[b.tensor])
        elif isinstance(b, Extent):
            values[p.name] = arrays[b.tensor].shape[b.axis]
        elif isinstance(b, Stride):
            values[p.name] = arrays[b.tensor].strides[b.axis] // 4
    return values, held


# calls and cells: ragged and dense, cells that are the kernels' tiles and others
CELL_CASES = pytest.mark.parametrize("name, lengths, ragged, cell", [
    ("packed", [1, 300, 129, 64, 70], True, (64, 64)),
    ("packed", [400, 400], False, (128, 112)),
    ("per_batch", [450, 450, 450], False, (192, 128)),
    ("per_head", [130, 7, 256], True, (64, 128)),
    ("per_head", [150], False, (128, 176)),
])


@CELL_CASES
def test_the_walk_over_a_cell_is_the_masks_meaning(host_walk, name, lengths, ragged, cell):
    """Every cell's class, from the walk of one lane over all its keys and from 32 lanes'
    walks joined as the kernel's vote joins them, is the class of its pairs under the
    mask's NumPy meaning (cells outside their sequence 0, the sequences' edges inside)."""
    q, kwargs, operands = _call(name, lengths, ragged)
    want = mhadsl.reference_block_classes(PROGRAM[name], q, q, cell=cell, **kwargs,
                                          **operands)
    values, _held = _values(name, q, kwargs, operands, want, cell)
    walk = host_walk(name, ragged)
    got = np.zeros_like(want)
    joined = np.zeros_like(want)
    for cell in range(want.size):
        got.flat[cell] = walk(cell, 0, 1, values)
        lanes = [walk(cell, lane, 32, values) for lane in range(32)]
        some = any(bits & CELL_MAY for bits in lanes)
        every = all(bits & CELL_ALL for bits in lanes)
        joined.flat[cell] = (CELL_MAY | (CELL_ALL if every else 0)) if some else 0
    assert CELL_MAY in want  # partial cells, which the walk decides pair by pair
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(joined, want)


def _interval_decided(name, lengths, ragged, operands, shape, cell):
    """Which cells of `packed` or `per_batch` (sorted document ids) the analysis with the
    cells' reads bounded decides, in NumPy: `kv_idx <= q_idx` empty or the documents' id
    intervals apart (no pair kept), or the causal part full and one id on both sides (every
    pair kept); cells outside their sequence too (0)."""
    batch, _, rows, cols = shape
    decided = np.zeros(shape, bool)
    starts = np.concatenate(([0], np.cumsum(lengths))) if ragged else [0] * len(lengths)
    for b, qc, kc in np.ndindex(batch, rows, cols):
        n = lengths[b] if ragged else lengths[0]
        q_lo, kv_lo = qc * cell[0], kc * cell[1]
        if q_lo >= n or kv_lo >= n:
            decided[b, :, qc, kc] = True
            continue
        q_hi, kv_hi = min(q_lo + cell[0], n) - 1, min(kv_lo + cell[1], n) - 1
        ids = operands["doc"][b] if name == "per_batch" else operands["doc"][starts[b]:]
        dq, dk = ids[q_lo:q_hi + 1], ids[kv_lo:kv_hi + 1]
        may = kv_lo <= q_hi and dq.min() <= dk.max() and dk.min() <= dq.max()
        every = kv_hi <= q_lo and dq.min() == dq.max() == dk.min() == dk.max()
        decided[b, :, qc, kc] = not may or every
    return decided


@CELL_CASES
def test_the_bounded_reads_decide_cells_without_their_pairs(host_bounds, name, lengths,
                                                            ragged, cell):
    """The analysis the classes kernel runs before any walk, each tensor read bounded by
    the elements the cell can read: every cell it decides has the class of its pairs under
    the mask's NumPy meaning, and for sorted document ids it decides exactly the cells
    whose id intervals decide them (the rest, partial ones among them, are walked)."""
    q, kwargs, operands = _call(name, lengths, ragged)
    want = mhadsl.reference_block_classes(PROGRAM[name], q, q, cell=cell, **kwargs,
                                          **operands)
    values, _held = _values(name, q, kwargs, operands, want, cell)
    bounds = host_bounds(name, ragged)
    got = np.array([bounds(c, 0, values) for c in range(want.size)]).reshape(want.shape)
    decided = got != block_classes.UNDECIDED
    np.testing.assert_array_equal(got[decided], want[decided])
    assert not decided[want == CELL_MAY].any()  # (implied: a partial cell is never decided)
    if name != "per_head":
        np.testing.assert_array_equal(
            decided, _interval_decided(name, lengths, ragged, operands, want.shape, cell))
        assert decided[want == 0].sum() > decided[want == 0].size // 2


@pytest.mark.parametrize("name", ["packed", "per_batch"])
def test_a_cell_the_indices_decide_reads_no_element(name):
    """The classes kernel's bounded analysis evaluates the causal test first (it reads no
    tensor, wherever it stands in the mask) and reads the document ids only where it may
    hold: every load of the (dense) bounds function lies behind that branch, so a cell
    above the diagonal reads nothing."""
    options = PROGRAM[name].options
    hooks = expr_hooks(PROGRAM.checked, options.mask, None, options.operands)
    module = ir.Module(name)
    fn = block_classes.bounds_function(module, hooks.kernel_abi(block_classes.ABI), hooks,
                                       False, ir.PointerType(), 32)
    successors = {block.name: [op.name for op in block.terminator.operands
                               if isinstance(op, ir.Block)] for block in fn.blocks}
    reached, todo = set(), [fn.blocks[0].name]
    while todo:  # (from the entry, never through the branch taken where reads are needed)
        name_ = todo.pop()
        if name_ in reached or name_.endswith(".if"):
            continue
        reached.add(name_)
        todo.extend(successors[name_])
    loads = [block.name for block in fn.blocks for inst in block.instructions
             if isinstance(inst, ir.LoadInstr)]
    assert loads and not set(loads) & reached


def test_the_reference_classes_of_packed_documents():
    """Two documents of 64 rows each, causal inside, in cells of 32 by 32: partial on the
    diagonal, full below it inside a document, empty across documents."""
    doc = np.repeat(np.array([0, 1], np.int32), 64)
    q = np.zeros((1, 128, 4, 64))
    got = mhadsl.reference_block_classes(PROGRAM["per_batch"], q, q, cell=(32, 32),
                                         doc=doc[None])
    assert got.shape == (1, 1, 4, 4)
    full = CELL_MAY | CELL_ALL
    np.testing.assert_array_equal(got[0, 0], [[CELL_MAY, 0, 0, 0], [full, CELL_MAY, 0, 0],
                                              [0, 0, CELL_MAY, 0], [0, 0, full, CELL_MAY]])
    with pytest.raises(ValueError, match="classifies its tiles at compile time"):
        mhadsl.reference_block_classes(PROGRAM["prefix_lm"], q, q, cell=(64, 64),
                                       prefix=np.array([3]))


@pytest.fixture(scope="module")
def host_lookup():
    """`block_classes.lookup` compiled for the host: lookup(table, rows, cols, heads,
    cell_rows, cell_keys, b, h, q_lo, q_hi, kv_lo, kv_hi) -> may | every << 1, by whether
    the classes differ by head and the box's static extents (`TILE` or None); under "part",
    the form for part of a tile (`q_tile`), whose first row comes in place of h."""
    binding.initialize_native_target()
    binding.initialize_native_asmprinter()
    module = ir.Module("lookup")
    module.triple = binding.get_default_triple()
    names = ("block_classes", "block_rows", "block_cols", "block_heads", "cell_rows",
             "cell_keys", "b", "h", "q_lo", "q_hi", "kv_lo", "kv_hi")
    variants = [(per_head, tile) for per_head in (False, True) for tile in (None, TILE)]
    for i, variant in enumerate([*variants, "part"]):
        fn = ir.Function(module, ir.FunctionType(i32, [ir.PointerType()] + [i32] * 11),
                         f"lookup{i}")
        for arg, n in zip(fn.args, names):
            arg.name = n
        a = dict(zip(names, fn.args))
        b = ir.IRBuilder(fn.append_basic_block())
        box = a["b"], a["q_lo"], a["q_hi"], a["kv_lo"], a["kv_hi"]
        if variant == "part":
            may, every = block_classes.lookup(b, box[0], None, *box[1:], None, TILE[1],
                                              q_tile=(a["h"], TILE[0]))
        else:
            per_head, tile = variant
            may, every = block_classes.lookup(b, box[0], a["h"] if per_head else None,
                                              *box[1:], *(tile or (None, None)))
        b.ret(b.or_(b.zext(may, i32), b.shl(b.zext(every, i32), i32(1))))
    machine = binding.Target.from_default_triple().create_target_machine()
    engine = binding.create_mcjit_compiler(binding.parse_assembly(str(module)), machine)
    engine.finalize_object()
    yield {variant: ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, *[ctypes.c_int32] * 11)(
        engine.get_function_address(f"lookup{i}"))
        for i, variant in enumerate([*variants, "part"])}
    del engine


TILE = (64, 112)  # the box's static extents of the lookup's second form (a design's tile)


def test_a_boxs_class_is_its_cells(host_lookup):
    """A box inside one cell takes the cell's class; one across cells, or in a cell past
    the table (a sequence longer than the call said: never read), is partial; an empty box
    keeps nothing."""
    seen = set()
    for trial in range(600):
        batch, heads, rows, cols = (int(x) for x in RNG.integers(1, 5, 4))
        cell_rows, cell_keys = (int(x) for x in RNG.choice([64, 112, 128, 192], 2))
        table = RNG.choice([0, CELL_MAY, CELL_MAY | CELL_ALL], (batch, heads, rows, cols),
                           p=[0.3, 0.3, 0.4]).astype(np.uint8)
        per_head = bool(trial % 2)
        b, h = int(RNG.integers(batch)), int(RNG.integers(heads))
        qc, kc = int(RNG.integers(rows + 1)), int(RNG.integers(cols + 1))
        q_lo = qc * cell_rows + int(RNG.integers(0, cell_rows))
        kv_lo = kc * cell_keys + int(RNG.integers(0, cell_keys))
        q_hi = q_lo + int(RNG.integers(-1, cell_rows))
        kv_hi = kv_lo + int(RNG.integers(-1, cell_keys))
        if q_hi < q_lo or kv_hi < kv_lo:
            want, case = CELL_ALL, "empty"
        elif q_hi // cell_rows != qc or kv_hi // cell_keys != kc:
            want, case = CELL_MAY, "across"
        elif qc >= rows or kc >= cols:
            want, case = CELL_MAY, "past"
        else:
            want, case = int(table[b, h if per_head else 0, qc, kc]), "inside"
        seen.add(case)
        got = host_lookup[per_head, None](table.ctypes.data, rows, cols, heads, cell_rows,
                                          cell_keys, b, h if per_head else 0, q_lo, q_hi,
                                          kv_lo, kv_hi)
        assert got == want, (trial, case)
    assert seen == {"empty", "across", "past", "inside"}


def test_a_part_of_a_tile_takes_its_tiles_cell(host_lookup):
    """The lookup's form for part of a design's tile (`q_tile`: a warpgroup's rows): the
    box takes the class of the cell of the tile holding it, where the call's cells are of
    the tile's size and the tile starts at a cell; else partial."""
    rng = np.random.default_rng(2)
    seen = set()
    for trial in range(400):
        rows, cols = (int(x) for x in rng.integers(1, 5, 2))
        cell_rows = TILE[0] if trial % 3 else int(rng.choice([32, 128]))
        table = rng.choice([0, CELL_MAY, CELL_MAY | CELL_ALL], (1, 1, rows, cols)).astype(
            np.uint8)
        qc, kc = int(rng.integers(rows)), int(rng.integers(cols))
        tile_lo = qc * TILE[0] + (0 if trial % 5 else 16)
        q_lo = tile_lo + int(rng.integers(0, TILE[0] // 2))
        q_hi = q_lo + int(rng.integers(0, TILE[0] // 2))
        kv_lo, kv_hi = kc * TILE[1], kc * TILE[1] + TILE[1] - 1
        if cell_rows != TILE[0] or tile_lo % TILE[0]:
            want, case = CELL_MAY, "not a cell"
        else:
            want, case = int(table[0, 0, qc, kc]), "in its cell"
        seen.add(case)
        got = host_lookup["part"](table.ctypes.data, rows, cols, 1, cell_rows, TILE[1], 0,
                                  tile_lo, q_lo, q_hi, kv_lo, kv_hi)
        assert got == want, (trial, case)
    assert seen == {"not a cell", "in its cell"}


def test_a_tiles_box_is_its_cell_where_the_cells_are_its_tiles(host_lookup):
    """The lookup's form for a design's tile (its extents constants): a tile of the cells'
    size starting at a cell takes the cell's class (the sequence's tail cut off or not);
    where the call's cells are of another size, or the box starts inside a cell, partial."""
    rng = np.random.default_rng(1)
    seen = set()
    for trial in range(400):
        rows, cols = (int(x) for x in rng.integers(1, 5, 2))
        cell = TILE if trial % 3 else (128, 112)
        table = rng.choice([0, CELL_MAY, CELL_MAY | CELL_ALL], (2, 1, rows, cols)).astype(
            np.uint8)
        qc, kc = int(rng.integers(rows)), int(rng.integers(cols))
        q_lo, kv_lo = qc * TILE[0], kc * TILE[1]
        shifted = trial % 5 == 0
        if shifted:
            kv_lo += int(rng.integers(1, TILE[1]))
        q_hi = q_lo + int(rng.integers(0, TILE[0]))  # a tail cut by the sequence's end
        kv_hi = kv_lo + int(rng.integers(0, TILE[1]))
        if cell != TILE or shifted:
            want, case = CELL_MAY, "not a cell"
        else:
            want, case = int(table[1, 0, qc, kc]), "cell"
        seen.add(case)
        got = host_lookup[False, TILE](table.ctypes.data, rows, cols, 1, *cell, 1, 0, q_lo,
                                       q_hi, kv_lo, kv_hi)
        assert got == want, (trial, case)
    assert seen == {"cell", "not a cell"}


@pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("ragged", [False, True])
def test_every_build_of_a_data_mask_takes_the_classes(arch, ragged):
    """The forward designs (dense, ragged) and the backward's take the call's classes after
    the operands and assemble without spills; the classes kernel too; a mask the interval
    analysis reads takes none."""
    kern = PROGRAM["packed"]
    builds = [kern.build(arch, ragged=ragged, backend=backend) for backend in
              (("sm80", "sm90") if arch == "sm_90a" else ("sm80",))]
    builds.append(kern.build(arch, ragged=ragged, backward=True))
    for build in builds:
        assert "%\"block_classes\"" in build.llvm, build.backend
        for name, k in build.assembled.kernels.items():
            assert k.spills == 0, (build.backend, name)
    from mhadsl.build import build_block_classes
    from mhadsl.codegen.assemble import assemble
    classes = build_block_classes(PROGRAM.checked, "packed", ragged, arch)
    assert classes.abi["block_classes"].name == "block_classes"
    assert all(k.spills == 0 for k in assemble(classes.ptx, arch).kernels.values())
    plain = PROGRAM["prefix_lm"].build(arch, ragged=ragged)
    assert "block_classes" not in plain.llvm


@pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
@pytest.mark.parametrize("ragged", [False, True])
def test_the_document_example_builds_for_hopper_without_spills(ragged):
    """`examples/document_mask.mha` (head dim 128) on the Hopper design: its build with the
    call's classes takes the planner's first tile (128 x 128, Q in registers, as a causal
    mask's) and keeps every value in registers (a spill there lands in the KV loop of
    every packed-documents call)."""
    kern = mhadsl.compile(REPO / "examples" / "document_mask.mha")["document_mask"]
    build = kern.build("sm_90a", ragged=ragged, backend="sm90")
    assert "block_classes" in build.llvm
    assert (build.config.block_m, build.config.block_n) == (128, 128)
    assert build.config.q_in_registers
    assert all(k.spills == 0 for k in build.assembled.kernels.values())


@pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
def test_the_hopper_consumers_load_a_tiles_class_before_its_scores():
    """The sm90 consumers read a KV tile's class (one byte of the call's classes) before
    they issue the tile's S, so the load runs under the wgmma: after the KV loop's wait for
    S (`wgmma.wait_group 1`) no class is loaded before the tile's P V is waited for."""
    import re
    build = PROGRAM["packed"].build("sm_90a", backend="sm90")
    kernel = build.ptx[build.ptx.index(".entry mha_fwd_sm90"):]
    after_s = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;(.*?)wgmma\.wait_group", kernel,
                         re.S)
    assert after_s and "ld.global.b8" in kernel
    assert not any("ld.global.b8" in stretch for stretch in after_s)


@pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
def test_the_hopper_consumers_ask_of_the_next_tile_before_the_gemms():
    """In the consumers' KV loop (from its head to the branch back to it) two classes are
    loaded before the tile's S is issued, the tile's own and the next tile's (whether the
    loop goes on there), and none after: no class load waits behind the GEMMs on the way
    to the next tile, unless that tile is empty (a search outside the loop's path)."""
    import re
    build = PROGRAM["packed"].build("sm_90a", backend="sm90")
    kernel = build.ptx[build.ptx.index(".entry mha_fwd_sm90"):]
    loops = []
    for head in re.finditer(r"^(\$L__BB\d+_\d+):", kernel, re.M):
        back = re.search(rf"bra(\.uni)?\s+{re.escape(head.group(1))};", kernel[head.end():])
        body = back and kernel[head.end():head.end() + back.start()]
        if body and re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", body):
            loops.append(body)
    kv_loop = min(loops, key=len)
    first_gemm = kv_loop.index("wgmma.mma_async")
    assert kv_loop[:first_gemm].count("ld.global.b8") == 2
    assert "ld.global.b8" not in kv_loop[first_gemm:]


def test_a_calls_cells_are_its_scheduled_kernels_tiles():
    from mhadsl.abi import CallSizes, block_class_bytes, block_class_values
    call = CallSizes(batch=3, heads=8, kv_heads=2, seqlen_q=0, seqlen_k=0, max_seqlen_q=300,
                     max_seqlen_k=129, total_q=500, ragged=True, scale=1.0)
    values = block_class_values(call, False, (128, 64))
    assert values == {"block_rows": 3, "block_cols": 3, "block_heads": 1, "cell_rows": 128,
                      "cell_keys": 64}
    assert block_class_bytes(values, call.batch) == 27
    assert block_class_values(call, True, (64, 64))["block_heads"] == 8


def test_classes_are_refused_where_a_call_makes_none():
    """Without a GPU: the checks that come before the device."""
    q = np.zeros((1, 64, 4, 64), np.float32)
    with pytest.raises(TypeError, match="classifies its tiles at compile time"):
        PROGRAM["prefix_lm"].block_classes(q, q, q, prefix=np.array([3], np.int32))
    with pytest.raises(TypeError, match="a call against a KV cache classifies"):
        PROGRAM["packed"](q[:, :1], q, q, cache_seqlens=np.array([64], np.int32),
                          block_classes=object(), doc=np.zeros(1, np.int32),
                          doc_k=np.zeros(64, np.int32))
    with pytest.raises(mhadsl.MhaError, match="block_classes"):
        mhadsl.compile("attention a(block_classes: i32) { dtype = bf16  head_dim = 64 }",
                       name="bad.mha")


def test_the_cost_model_counts_the_tiles_a_call_classifies(tmp_path, capsys):
    """Given the documents, the simulator's cost model counts each query tile's KV tiles as
    the classes kernel classifies them (`reference_block_classes` with cells of the tile);
    without them every tile under the diagonal is partial. `mhadsl simulate --operand`
    gives the documents; the packed batch's makespan falls with them."""
    import json

    from mhadsl.analysis.costmodel import DEFAULT_COSTS, KernelCostModel
    from mhadsl.cli import main
    kern = PROGRAM["packed"]
    lengths = [700, 1200, 90]
    docs = np.concatenate([np.repeat(np.arange(n // 100 + 1), 100)[:n] for n in lengths])
    cu = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    block_m, block_n = 128, 64
    model = KernelCostModel(DEFAULT_COSTS, PROGRAM.checked, kern.options.mask, block_m,
                            block_n, operands={"doc": docs, "doc_k": docs},
                            declared=kern.options.operands)
    q = np.zeros((cu[-1], 4, 64))
    want = mhadsl.reference_block_classes(kern, q, q, cell=(block_m, block_n),
                                          cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          max_seqlen_q=max(lengths), max_seqlen_k=max(lengths),
                                          doc=docs.astype(np.int32),
                                          doc_k=docs.astype(np.int32))
    tiles = [(b, t) for b, n in enumerate(lengths) for t in range(-(-n // block_m))]
    b = np.array([b for b, _ in tiles])
    offset = np.array([t * block_m for _, t in tiles])
    full, partial = model.classes(lengths, offset, np.zeros(len(tiles), int), b)
    for k, (bb, t) in enumerate(tiles):
        row = want[bb, 0, t]
        inside = np.arange(row.size) * block_n + block_n <= lengths[bb]  # tails: partial
        assert full[k] == ((row == CELL_MAY | CELL_ALL) & inside).sum()
        assert partial[k] == (row != 0).sum() - full[k]
    static = KernelCostModel(DEFAULT_COSTS, PROGRAM.checked, kern.options.mask, block_m,
                             block_n).classes(lengths, offset, np.zeros(len(tiles), int), b)
    assert (full + partial).sum() < 0.5 * (static[0] + static[1]).sum()
    np.save(tmp_path / "doc.npy", docs.astype(np.int32))
    source = tmp_path / "packed.mha"
    source.write_text(SOURCE)
    spans = {}
    for given in ((), ("--operand", f"doc={tmp_path / 'doc.npy'}",
                       "--operand", f"doc_k={tmp_path / 'doc.npy'}")):
        assert main(["simulate", str(source), "--scheduler", "LPT", "--kernel", "packed",
                     "--seqlens", ",".join(map(str, lengths)), "--heads", "4", "--json",
                     *given]) == 0
        spans[bool(given)] = json.loads(capsys.readouterr().out)["makespan"]
    assert spans[True] < 0.7 * spans[False]
