"""Hopper (sm_90a) instructions for llvmlite: TMA, mbarrier, wgmma, setmaxnreg.

Each helper emits one PTX instruction (or a short fixed sequence) and is what the
warp-specialised backend is built from. LLVM 22 intrinsics are used where they exist
(`mbarrier.init`, `fence.mbarrier_init`, `wgmma.fence/commit_group/wait_group`,
`setmaxnreg`); the rest is inline asm. Beware: LLVM silently turns an `llvm.nvvm.*` name
it does not know into an external function (`.extern .func` in the PTX, a link error at
load time), so every name used here was checked, and the tests reject `.extern` in the PTX.

Conventions
- Shared-memory operands (barriers, tiles) are `ptr addrspace(3)` values; the asm gets
  their 32-bit shared-window address (`shared_address`).
- Tensor maps are kernel parameters `ptr byval(<128 x i8>) align 64 "nvvm.grid_constant"`
  (`mark_tensor_map_param`); their generic address (`cvta.param`, no local copy) is the
  operand of `cp.async.bulk.tensor` (`tensor_map_address`).
- Coordinates and shapes are outermost first, as a tensor's shape (the instruction wants
  innermost first; `tma_load` reverses them), matching `mhadsl.runtime.tensormap`.
- Inline-asm constraint strings have no spaces (LLVM rejects them), and braces `{ }` scope
  the `.reg` declarations of a multi-instruction asm, so unrolled copies never collide.

wgmma, 128-byte swizzle. A tile of R rows x 64 16-bit elements (128 B a row), as TMA
writes it with 128-byte swizzle, keeps element (r, c) in 16-byte chunk (c / 8) xor (r % 8)
of row r; the pattern repeats every 8 rows (1024 B), so tiles start 1024-byte aligned.
- K-major operand (Q and K for S = Q K^T: rows are M or N, the 64-wide K slice is
  contiguous): `smem_descriptor(tile, stride_bytes=1024)`; the k-th 16-wide slice of a
  64-wide K tile starts 32 k bytes further. A wider K (head dim 128) is several such
  tiles, one per TMA box of 64 columns.
- MN-major B (V for O = P V: rows are K = kv positions, N = head dim contiguous):
  `smem_descriptor(tile, stride_bytes=1024, leading_bytes=<bytes of one 64-column tile>)`
  with `trans_b=True`; the k-th 16-row slice starts 16 * 128 = 2048 k bytes further, and
  the next 64 columns of N are `leading_bytes` further (the next TMA box).

Serialisation (ptxas C7519). ptxas says "warpgroup.arrive is injected ... to allow use of
registers in GMMA" when an ordinary instruction writes a wgmma's registers after the last
`wgmma_fence`; the injected arrive serialises the pipeline. LLVM sinks pure arithmetic
(zeroing or rescaling accumulators, packing P) to its first use, past the fence intrinsic,
so: start a chain with `acc=None` (scale-d false: no zeroing at all), pass values written
by ordinary instructions through `fence_operands` before `wgmma_fence`, feed each wgmma's
results straight into the next, then `wgmma_commit_group`, `wgmma_wait_group` and
`fence_operands` on the results before any other use. Zero-initialised accumulators
without that fence do trigger C7519 (benchmarks/log/HOPPER_NOTES.md); the tests require none.
"""
from __future__ import annotations

from typing import Callable

from llvmlite import ir

from mhadsl.codegen import nvptx
from mhadsl.codegen.nvptx import call, f32, i32, i64, void
from mhadsl.codegen.warp import DTYPES, pack2

WARPGROUP_THREADS = 128
TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGN = 64
SWIZZLE_BYTES = 128  # the row width of a 128-byte-swizzled tile: 64 bf16/fp16 elements
SWIZZLE_ATOM_BYTES = 1024  # 8 rows of 128 B: the swizzle's period and a tile's alignment
MBARRIER_BYTES = 8

# wgmma shared-memory descriptor fields (PTX ISA "Matrix Descriptor Format")
_DESC_LAYOUT_SHIFT = 62  # bits 62-63: 0 none, 1 128-byte, 2 64-byte, 3 32-byte swizzle
_DESC_SWIZZLE_128B = 1
_DESC_FIELD_MASK = 0x3FFF  # 14-bit fields, in units of 16 bytes


def _asm(builder: ir.IRBuilder, ret: ir.Type, text: str, constraints: str,
         args: list[ir.Value]) -> ir.Value:
    """Volatile inline asm (never moved, merged or dropped)."""
    assert " " not in constraints, constraints
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.asm(fnty, text, constraints, args, side_effect=True)


def shared_address(builder: ir.IRBuilder, ptr: ir.Value) -> ir.Value:
    """The 32-bit shared-window address of an addrspace(3) pointer (the asm `r` operand)."""
    return builder.ptrtoint(ptr, i32)


# ============================================================ programmatic dependent launch
GRID_WAIT = "griddepcontrol.wait;"


def waits_for_prior_grids(ptx: str) -> bool:
    """Whether the kernels of `ptx` wait for the grids before them themselves
    (`begin_after_prior_grids`): the runtime then launches them with programmatic stream
    serialization."""
    return GRID_WAIT in ptx


def begin_after_prior_grids(module: ir.Module, target) -> None:
    """Where `target` can (`Target.grid_dependent`), make every kernel of `module` begin
    by letting the stream's next grid launch and then
    waiting for the grids before it in the stream to finish, their writes visible
    (programmatic dependent launch; the runtime launches such kernels with programmatic
    stream serialization). The next grid's CTAs then take the multiprocessors this one's
    CTAs leave and run to their own wait, so a launch's latency hides under the end of the
    one before; the signal completes only when every CTA of this grid has started, so they
    never take a place this grid needs. The wait precedes every read and write of memory."""
    if not target.grid_dependent:
        return
    for fn in module.functions:
        if fn.calling_convention == "ptx_kernel":
            b = ir.IRBuilder()
            b.position_at_start(fn.entry_basic_block)
            _asm(b, void, "griddepcontrol.launch_dependents;", "~{memory}", [])
            _asm(b, void, GRID_WAIT, "~{memory}", [])


# ============================================================================ tensor maps
def mark_tensor_map_param(arg: ir.Argument) -> None:
    """Make kernel parameter `arg` (type `ptr`) a CUtensorMap passed by value:
    `ptr byval(<128 x i8>) align 64 "nvvm.grid_constant"`, which becomes
    `.param .align 64 .b8 name[128]`. The launch passes `TensorMap.kernel_arg()`."""
    # llvmlite knows neither a typed byval under opaque pointers nor string attributes.
    set.add(arg.attributes, f"byval(<{TENSOR_MAP_BYTES} x i8>)")
    set.add(arg.attributes, '"nvvm.grid_constant"')
    arg.attributes.align = TENSOR_MAP_ALIGN


def tensor_map_address(builder: ir.IRBuilder, arg: ir.Argument) -> ir.Value:
    """The generic address (i64) of a grid-constant tensor-map parameter."""
    return builder.ptrtoint(arg, i64)


def prefetch_tensor_map(builder: ir.IRBuilder, tensor_map: ir.Value) -> None:
    """Bring the tensor map's 128 bytes into the descriptor cache ahead of the first copy."""
    _asm(builder, void, "prefetch.tensormap [$0];", "l,~{memory}", [tensor_map])


def map_batch(ragged: bool, batch: Callable[[], ir.Value]) -> ir.Value:
    """The batch coordinate of a sequence, whose index `batch()` gives, in a tensor map over
    a call's tensor: a ragged tensor's map is (1, total rows, H, D), its sequences rows of
    batch 0 (`runtime.launch.map_request`). (A callable: a kernel that parks the index in
    shared memory reads it only for a dense map.)"""
    return i32(0) if ragged else batch()


def _box_coords(coords: list[ir.Value], first: int) -> tuple[int, str]:
    """A box copy's rank and its coordinate operands (`$first`, ...) as PTX lists them."""
    rank = len(coords)
    if not 2 <= rank <= 5:
        raise ValueError(f"tensor copies have 2 to 5 dimensions, not {rank}")
    return rank, ",".join(f"${first + i}" for i in range(rank))


def tma_load(builder: ir.IRBuilder, dst: ir.Value, tensor_map: ir.Value,
             coords: list[ir.Value], barrier: ir.Value) -> None:
    """`cp.async.bulk.tensor.{2..5}d` global -> shared of one box of `tensor_map` at
    `coords` (i32 element indices, outermost first; out-of-bounds elements land as zero).
    Completion is counted on `barrier` in bytes: the full box's bytes, out of bounds or
    not, which the issuing thread announces with `mbarrier_arrive_expect_tx` first."""
    rank, inner_first = _box_coords(coords, 2)
    text = (f"cp.async.bulk.tensor.{rank}d.shared::cluster.global.tile"
            f".mbarrier::complete_tx::bytes [$0], [$1, {{{inner_first}}}], [${2 + rank}];")
    constraints = ",".join(["r", "l"] + ["r"] * rank + ["r", "~{memory}"])
    _asm(builder, void, text, constraints,
         [shared_address(builder, dst), tensor_map, *reversed(coords),
          shared_address(builder, barrier)])


def bulk_load(builder: ir.IRBuilder, dst: ir.Value, src: ir.Value, nbytes: int,
              barrier: ir.Value) -> None:
    """`cp.async.bulk` global -> shared of `nbytes` contiguous bytes (a multiple of 16, both
    addresses 16-byte aligned, no bounds: the source must hold them all), counted on
    `barrier` in bytes as `tma_load`'s."""
    _asm(builder, void, "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
         "[$0], [$1], $2, [$3];", "r,l,n,r,~{memory}",
         [shared_address(builder, dst), builder.ptrtoint(src, i64), i32(nbytes),
          shared_address(builder, barrier)])


def tma_store(builder: ir.IRBuilder, tensor_map: ir.Value, coords: list[ir.Value],
              src: ir.Value) -> None:
    """`cp.async.bulk.tensor` shared -> global of one box (out-of-bounds parts are not
    written). The writers of `src` run `fence_proxy_async` and a barrier first; the issuing
    thread then runs `bulk_commit_group` and `bulk_wait_group_read` before `src` is reused."""
    rank, inner_first = _box_coords(coords, 1)
    text = (f"cp.async.bulk.tensor.{rank}d.global.shared::cta.tile.bulk_group"
            f" [$0, {{{inner_first}}}], [${1 + rank}];")
    constraints = ",".join(["l"] + ["r"] * rank + ["r", "~{memory}"])
    _asm(builder, void, text, constraints,
         [tensor_map, *reversed(coords), shared_address(builder, src)])


def bulk_commit_group(builder: ir.IRBuilder) -> None:
    _asm(builder, void, "cp.async.bulk.commit_group;", "~{memory}", [])


def bulk_wait_group_read(builder: ir.IRBuilder, pending: int = 0) -> None:
    """Wait until at most `pending` bulk groups of this thread still read shared memory."""
    _asm(builder, void, f"cp.async.bulk.wait_group.read {pending};", "~{memory}", [])


def bulk_wait_group(builder: ir.IRBuilder, pending: int = 0) -> None:
    """Wait until at most `pending` bulk groups of this thread are incomplete, their writes
    to global memory done."""
    _asm(builder, void, f"cp.async.bulk.wait_group {pending};", "~{memory}", [])


def bulk_reduce_add_f32(builder: ir.IRBuilder, dst: ir.Value, src: ir.Value, nbytes: int) -> None:
    """`cp.reduce.async.bulk` of `nbytes` (a multiple of 16; both addresses 16-byte aligned)
    of f32 from shared `src` added into global `dst`, in this thread's bulk group. The
    writers of `src` run `fence_proxy_async` and a barrier first, as for `tma_store`."""
    _asm(builder, void, "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 "
         "[$0], [$1], $2;", "l,r,n,~{memory}",
         [builder.ptrtoint(dst, i64), shared_address(builder, src), i32(nbytes)])


def fence_proxy_async_global(builder: ir.IRBuilder) -> None:
    """Order this thread's global-memory accesses in the generic proxy (an acquire load, say)
    before its later async-proxy ones (a bulk reduce-add)."""
    _asm(builder, void, "fence.proxy.async.global;", "~{memory}", [])


def bulk_writes_released(builder: ir.IRBuilder, counter: ir.Value) -> None:
    """Once this thread's bulk groups are complete, their global writes made visible
    before global u32 `counter` goes up by one (release at GPU scope): a thread that reads
    the new count with acquire (`wait_for_count`) sees those writes."""
    bulk_wait_group(builder, 0)
    _asm(builder, void, "fence.proxy.async.global; red.release.gpu.global.add.u32 [$0], 1;",
         "l,~{memory}", [builder.ptrtoint(counter, i64)])


def release_count(builder: ir.IRBuilder, counter: ir.Value) -> None:
    """Global u32 `counter` up by one (release at GPU scope), after this thread's writes and
    those of the threads it met at a barrier since: a thread that reads the new count with
    acquire (`wait_for_count`) sees them."""
    _asm(builder, void, "red.release.gpu.global.add.u32 [$0], 1;", "l,~{memory}",
         [builder.ptrtoint(counter, i64)])


def wait_for_count(builder: ir.IRBuilder, counter: ir.Value, count: ir.Value,
                   timeout_ns: int, abandon: ir.Value) -> ir.Value:
    """Spin (acquire loads at GPU scope, backing off between them) until global u32
    `counter` equals `count`; returns whether it gave up instead: at once where global u32
    `abandon` is not zero, else after `timeout_ns` (below 2^32) of %globaltimer. A count
    already there costs one load (`abandon` and the clock are read only after a miss)."""
    fn = builder.function
    first = builder.block
    slow, loop, back_off, done = (fn.append_basic_block(f"count_wait.{n}")
                                  for n in ("slow", "poll", "sleep", "done"))
    arrived = builder.icmp_unsigned("==", _ld_acquire_u32(builder, counter), count)
    builder.cbranch(arrived, done, slow)
    builder.position_at_end(slow)
    given_up = _asm(builder, i32, "ld.relaxed.gpu.global.u32 $0, [$1];", "=r,l,~{memory}",
                    [builder.ptrtoint(abandon, i64)])
    start = nvptx.opaque_special_register(builder, "globaltimer_lo")
    builder.cbranch(builder.icmp_unsigned("!=", given_up, i32(0)), done, loop)
    builder.position_at_end(loop)
    now = _ld_acquire_u32(builder, counter)
    waited = builder.sub(nvptx.opaque_special_register(builder, "globaltimer_lo"), start)
    late = builder.icmp_unsigned(">", waited, i32(timeout_ns))
    builder.cbranch(builder.or_(builder.icmp_unsigned("==", now, count), late), done, back_off)
    builder.position_at_end(back_off)
    _asm(builder, void, "nanosleep.u32 64;", "~{memory}", [])
    builder.branch(loop)
    builder.position_at_end(done)
    result = builder.phi(ir.IntType(1))
    result.add_incoming(ir.Constant(ir.IntType(1), 0), first)
    result.add_incoming(ir.Constant(ir.IntType(1), 1), slow)
    result.add_incoming(late, loop)
    return result


def _ld_acquire_u32(builder: ir.IRBuilder, address: ir.Value) -> ir.Value:
    """Global u32 at `address`, loaded with acquire at GPU scope."""
    return _asm(builder, i32, "ld.acquire.gpu.global.u32 $0, [$1];", "=r,l,~{memory}",
                [builder.ptrtoint(address, i64)])


def fence_proxy_async(builder: ir.IRBuilder) -> None:
    """Order this thread's ordinary shared-memory writes before later async-proxy reads
    (TMA store, wgmma); each writing thread runs it before the barrier."""
    _asm(builder, void, "fence.proxy.async.shared::cta;", "~{memory}", [])


# ============================================================================ mbarrier
def mbarrier_init(builder: ir.IRBuilder, barrier: ir.Value, arrivals: int) -> None:
    """One thread initialises; then `fence_mbarrier_init` and a CTA barrier before use."""
    call(builder, "llvm.nvvm.mbarrier.init.shared", void, [barrier, i32(arrivals)])


def fence_mbarrier_init(builder: ir.IRBuilder) -> None:
    call(builder, "llvm.nvvm.fence.mbarrier_init.release.cluster", void, [])


def mbarrier_arrive_expect_tx(builder: ir.IRBuilder, barrier: ir.Value,
                              nbytes: int | ir.Value) -> None:
    """Arrive once and announce `nbytes` of copies that will complete on `barrier`."""
    count = i32(nbytes) if isinstance(nbytes, int) else nbytes
    _asm(builder, void, "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
         "r,r,~{memory}", [shared_address(builder, barrier), count])


def mbarrier_arrive(builder: ir.IRBuilder, barrier: ir.Value) -> None:
    """Arrive once (a consumer releasing a stage, say)."""
    _asm(builder, void, "mbarrier.arrive.shared::cta.b64 _, [$0];", "r,~{memory}",
         [shared_address(builder, barrier)])


def mbarrier_wait(builder: ir.IRBuilder, barrier: ir.Value, parity: int | ir.Value) -> None:
    """Wait until the phase of `barrier` with parity `parity` (0 for its first phase) has
    completed. Waiting on parity 1 of a fresh barrier returns at once (the phase before the
    first counts as complete), so a producer waits on its empty slots with parity
    `(round & 1) ^ 1` from the first round on. Leaves `builder` after the loop."""
    parity = i32(parity) if isinstance(parity, int) else parity
    address = shared_address(builder, barrier)
    fn = builder.function
    loop = fn.append_basic_block("mbarrier_wait")
    done = fn.append_basic_block("mbarrier_done")
    builder.branch(loop)
    builder.position_at_end(loop)
    ready = _asm(builder, i32,
                 "{.reg .pred p;mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2;"
                 "selp.u32 $0, 1, 0, p;}",
                 "=r,r,r,~{memory}", [address, parity])
    builder.cbranch(builder.icmp_unsigned("!=", ready, i32(0)), done, loop)
    builder.position_at_end(done)


# ============================================================================ wgmma
def smem_descriptor(builder: ir.IRBuilder, tile: ir.Value, stride_bytes: int = SWIZZLE_ATOM_BYTES,
                    leading_bytes: int = 16) -> ir.Value:
    """The 64-bit wgmma descriptor of a 128-byte-swizzled operand starting at `tile`
    (16-byte aligned; the tile's 1024-byte swizzle atom must be 1024-byte aligned):
    bits 0-13 address / 16, 16-29 leading byte offset / 16, 32-45 stride byte offset / 16,
    62-63 layout (1 = 128-byte swizzle). K-major: stride = 1024 (8 rows of 128 B), leading
    unused (1 by convention). MN-major: stride = 1024 (8 K rows), leading = bytes from one
    64-wide MN column block to the next."""
    for name, value in (("stride_bytes", stride_bytes), ("leading_bytes", leading_bytes)):
        if value % 16 or not 0 < value >> 4 <= _DESC_FIELD_MASK:
            raise ValueError(f"{name} = {value}: a multiple of 16 below {16 << 14}")
    fixed = ((leading_bytes >> 4) << 16 | (stride_bytes >> 4) << 32
             | _DESC_SWIZZLE_128B << _DESC_LAYOUT_SHIFT)
    start = builder.and_(builder.lshr(shared_address(builder, tile), i32(4)), i32(_DESC_FIELD_MASK))
    return builder.or_(builder.zext(start, i64), i64(fixed))


def smem_descriptors(builder: ir.IRBuilder, tile: ir.Value, offsets: list[int],
                     stride_bytes: int = SWIZZLE_ATOM_BYTES, leading_bytes: int = 16
                     ) -> list[ir.Value]:
    """The descriptors of the operands at `tile` + each of `offsets` (bytes, multiples of
    16): one base descriptor, taken through a volatile move where it is used, plus each
    offset / 16 in the address field (no carry: shared addresses stay below 256 KiB). So
    LLVM cannot hoist a loop-invariant operand's descriptors out of the loop, where each
    would hold two registers for the whole loop (at head dim 256, 32 of them for Q alone)."""
    base = _asm(builder, i64, "mov.b64 $0, $1;", "=l,l",
                [smem_descriptor(builder, tile, stride_bytes, leading_bytes)])
    for offset in offsets:
        if offset % 16:
            raise ValueError(f"offset {offset}: a multiple of 16")
    return [builder.add(base, i64(offset >> 4)) for offset in offsets]


def wgmma_fence(builder: ir.IRBuilder) -> None:
    """Before the first wgmma, and whenever accumulator or A registers were written by
    other instructions since the last one."""
    call(builder, "llvm.nvvm.wgmma.fence.sync.aligned", void, [])


def wgmma_commit_group(builder: ir.IRBuilder) -> None:
    call(builder, "llvm.nvvm.wgmma.commit_group.sync.aligned", void, [])


def wgmma_wait_group(builder: ir.IRBuilder, pending: int = 0) -> None:
    """Wait until at most `pending` committed wgmma groups of this warpgroup are in flight."""
    call(builder, "llvm.nvvm.wgmma.wait_group.sync.aligned", void, [i64(pending)])


def hold_next_wait_below(builder: ir.IRBuilder, values: list[ir.Value]) -> None:
    """Keep the next `wgmma_wait_group` below the arithmetic that computes `values` (f32),
    so that it runs under the wgmmas in flight. ptxas hoists a wgmma wait up to the
    previous memory operation, never above one; this is a shared-memory store of `values`
    that depends on them but never runs (%smid < %nsmid always; ptxas cannot know).
    See benchmarks/log/HOPPER_NOTES.md."""
    count = len(values)
    vector = f".v{count}" if count > 1 else ""
    registers = ", ".join(f"${i}" for i in range(count))
    _asm(builder, void,
         "{.reg .pred never; .reg .u32 sm, sms; mov.u32 sm, %smid; mov.u32 sms, %nsmid; "
         "setp.ge.u32 never, sm, sms; "
         f"@never st.shared{vector}.f32 [sm], {{{registers}}};}}",
         ",".join(["f"] * count) + ",~{memory}", values)


def fence_operands(builder: ir.IRBuilder, values: list[ir.Value]) -> list[ir.Value]:
    """`values` through one empty volatile asm: LLVM cannot move their uses above it (use
    after `wgmma_wait_group`) nor their definitions below it."""
    if not values:
        return []
    n = len(values)
    # (an asm with one output returns it bare: LLVM rejects a struct of one)
    ret = values[0].type if n == 1 else ir.LiteralStructType([v.type for v in values])
    kinds = ["=f" if v.type == f32 else "=r" for v in values]
    res = _asm(builder, ret, "", ",".join(kinds + [str(i) for i in range(n)]), values)
    return [res] if n == 1 else [builder.extract_value(res, i) for i in range(n)]


def accumulator_count(n: int) -> int:
    """f32 accumulators per thread of an m64nN tile."""
    return n // 2


def wgmma(builder: ir.IRBuilder, dtype: str, n: int, a: ir.Value | list[ir.Value],
          b_desc: ir.Value, acc: list[ir.Value] | None = None,
          trans_b: bool = False, trans_a: bool = False) -> list[ir.Value]:
    """`wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{dtype}.{dtype}`: D = A B (+ acc).

    a: a shared-memory descriptor (i64, K-major) or the A fragment in registers (4 i32 of
       two 16-bit values each, `a_fragment`: the FA3 P V form);
    b_desc: B's descriptor, K-major, or MN-major with `trans_b` (V in O = P V);
    trans_a: A from shared memory is MN-major (M contiguous: dS^T in the backward's dQ = dS K);
    acc: the n/2 f32 accumulators to add to, or None for D = A B (scale-d false).
    Returns the n/2 f32 results (layout: `accumulator_position`). Asynchronous: between
    `wgmma_fence` and `wgmma_wait_group`, feed the results only into the next wgmma."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {DTYPES}")
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma N = {n}: a multiple of 8 from 8 to 256")
    count = accumulator_count(n)
    if acc is not None and len(acc) != count:
        raise ValueError(f"m64n{n} takes {count} accumulators, got {len(acc)}")
    from_registers = isinstance(a, list)
    if from_registers and len(a) != 4:
        raise ValueError(f"the A fragment is 4 registers, got {len(a)}")
    a_ops = a if from_registers else [a]
    ptx_type = "f16" if dtype == "fp16" else "bf16"
    d = ",".join(f"${i}" for i in range(count))
    first = count  # operand number of the first input
    a_text = ("{" + ",".join(f"${first + i}" for i in range(4)) + "}") if from_registers \
        else f"${first}"
    b_text = f"${first + len(a_ops)}"
    scale_d = f"${first + len(a_ops) + 1}"
    # trailing immediates: scale-a, scale-b (1: no negation), [trans-a (0: K-major),] trans-b
    if trans_a and from_registers:
        raise ValueError("a register A operand has no transpose")
    imms = ("1,1," if from_registers else f"1,1,{int(trans_a)},") + ("1" if trans_b else "0")
    text = ("{.reg .pred d;" f"setp.ne.b32 d, {scale_d}, 0;"
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx_type}.{ptx_type} "
            f"{{{d}}}, {a_text}, {b_text}, d, {imms};}}")
    outputs = ["=f"] * count
    inputs = ["r" if from_registers else "l"] * len(a_ops) + ["l", "r"]
    tied = [str(i) for i in range(count)] if acc is not None else []
    args = [*a_ops, b_desc, i32(0 if acc is None else 1), *(acc or [])]
    ret = ir.LiteralStructType([f32] * count)
    res = _asm(builder, ret, text, ",".join(outputs + inputs + tied + ["~{memory}"]), args)
    return [builder.extract_value(res, i) for i in range(count)]


def accumulator_position(thread: int, j: int) -> tuple[int, int]:
    """(row, column) of accumulator `j` of warpgroup thread `thread` (0..127) in an m64nN
    tile: warp w = thread / 32 owns rows 16w..16w+15 and each 8-column block repeats
    mma.m16n8's C layout."""
    w, lane = divmod(thread, 32)
    return (16 * w + lane // 4 + 8 * ((j // 2) % 2), 8 * (j // 4) + 2 * (lane % 4) + j % 2)


def accumulator_row_col(builder: ir.IRBuilder, thread: ir.Value, j: int
                        ) -> tuple[ir.Value, ir.Value]:
    """`accumulator_position` for a run-time warpgroup thread index (i32, 0..127)."""
    lane = builder.and_(thread, i32(31))
    row = builder.add(builder.shl(builder.lshr(thread, i32(5)), i32(4)),
                      builder.add(builder.lshr(lane, i32(2)), i32(8 * ((j // 2) % 2))))
    col = builder.add(builder.shl(builder.and_(lane, i32(3)), i32(1)), i32(8 * (j // 4) + j % 2))
    return row, col


def a_fragment(builder: ir.IRBuilder, dtype: str, acc: list[ir.Value], k: int) -> list[ir.Value]:
    """The register A operand of the k-th 16-column slice of an f32 accumulator tile
    (P = softmax(S) feeding O += P V): accumulators 8k..8k+7, rounded to `dtype` in pairs.
    The m64k16 A fragment has the accumulator's layout, so no data moves between threads."""
    part = acc[8 * k: 8 * k + 8]
    if len(part) != 8:
        raise ValueError(f"slice {k} needs accumulators {8 * k}..{8 * k + 7}; have {len(acc)}")
    return [pack2(builder, dtype, part[i], part[i + 1]) for i in range(0, 8, 2)]


# ============================================================================ registers
def setmaxnreg(builder: ir.IRBuilder, registers: int, increase: bool) -> None:
    """`setmaxnreg.{inc,dec}.sync.aligned.u32`: move this warpgroup's per-thread register
    budget to `registers` (24..256, a multiple of 8). ptxas honours it only when the kernel
    caps registers at entry (function attributes "nvvm.maxntid" and "nvvm.minctasm"="1")
    and each role's call sits in one branch of a single if/else (else warning C7508)."""
    if registers % 8 or not 24 <= registers <= 256:
        raise ValueError(f"setmaxnreg {registers}: a multiple of 8 from 24 to 256")
    which = "inc" if increase else "dec"
    call(builder, f"llvm.nvvm.setmaxnreg.{which}.sync.aligned.u32", void, [i32(registers)])

