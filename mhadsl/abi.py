"""The kernel ABI: what a kernel takes, declared once for both of its sides.

A design lists its parameters once, in order (`KernelABI`). Each `Param` has a kind (the
one type the kernel declares and the host packs), a binding (where the host takes the value
from) and a meaning. From that one list come the kernel's LLVM signature
(`codegen.signature`: types, names, pointer alignment, by-value tensor maps) and the host's
parameter block (`offsets`: each parameter's offset in the block a launch passes, by CUDA's
rule that a parameter sits at a multiple of its alignment). A new design or a new argument
goes here and nowhere else.

Plain data, shared by the code generator and the runtime: it imports neither, nor LLVM.

Bindings, by when the host knows the value:
- per call signature (planned once, `runtime.launch`): `Stride`, `CallValue`;
- per call: `Pointer` (a tensor's address), `Workspace` (the stream's), `TensorMap` (over a
  tensor's address; its box is read from here by the kernel's copies and the host's map alike),
  `Scalar` (an operand's value: every kernel of a declaration with operands takes them after
  its design's parameters, `with_operands`).

The workspace every kernel's `queue` parameter points to (one per device and stream) is laid
out here too, since the kernel writes it and the host reads it:

    word 0      the queue counter: the last thread out of a launch resets it to 0
    word 2..3   u64: threads of the launch that have finished (back to 0 with the counter)
    word 4..6   the fault record: code (kind << 8 | rule; 0: none), scheduler id, CTA
    word 8..9   u64: address of the host's copy of the fault record (0: none), which the
                faulting thread writes too, so the host sees a fault without a copy
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

# ============================================================================ parameters
KIND_BYTES = {"ptr": 8, "i64": 8, "i32": 4, "f32": 4, "tensor_map": 128}
KIND_ALIGN = {"ptr": 8, "i64": 8, "i32": 4, "f32": 4, "tensor_map": 64}


@dataclass(frozen=True)
class Pointer:
    """The device address of a call's tensor ("q", "k", "v", "o", "lse", "cu_seqlens_q",
    "cu_seqlens_k"), or 0 when the call has none."""
    tensor: str


@dataclass(frozen=True)
class Stride:
    """Elements between consecutive `axis` ("batch", "row", "head", or an axis's number, 0
    first) of a call's tensor; a ragged tensor's (rows of all sequences, heads, head_dim: it
    has no batch axis) batch stride is 0."""
    tensor: str
    axis: str | int


@dataclass(frozen=True)
class Extent:
    """The size of axis `axis` (0 first) of a call's tensor."""
    tensor: str
    axis: int


@dataclass(frozen=True)
class CallValue:
    """A number fixed by the call's signature: its sizes, strides of the LSE, the softmax
    scale, the device's multiprocessors and the kernel's CTAs per multiprocessor."""
    name: str


@dataclass(frozen=True)
class Workspace:
    """A per-stream device buffer: "queue" (the workspace above), "tile_index" or
    "block_classes"."""
    name: str


@dataclass(frozen=True)
class TensorMap:
    """A TMA tensor map over a call's tensor, seen as (batch, rows, heads, head_dim) (ragged:
    (1, total rows, heads, head_dim)), whose box is one head's `rows` (a config attribute)
    by `columns` of head_dim, `swizzle`-byte swizzled."""
    tensor: str
    rows: str
    columns: int
    swizzle: int = 128

    def box(self, config) -> tuple[int, int, int, int]:
        """The box, outermost first, for a build of `config`."""
        return 1, getattr(config, self.rows), 1, self.columns

    def box_bytes(self, config, itemsize: int = 2) -> int:
        """Bytes one copy of the box moves (what the kernel's barrier expects)."""
        _, rows, _, columns = self.box(config)
        return rows * columns * itemsize


@dataclass(frozen=True)
class Scalar:
    """The value of the declaration's operand `name` (an i32 or f32 its mask and score read)
    in the call."""
    name: str


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "ptr" (a global address), "i64", "i32", "f32", "tensor_map" (128 B by value)
    binding: Pointer | Stride | Extent | CallValue | Workspace | TensorMap | Scalar
    meaning: str
    align: int = 0  # a pointer's alignment in bytes, which the kernel may assume


class KernelABI:
    """A kernel's parameters in order, and their offsets in the host's parameter block."""

    def __init__(self, *params: Param):
        names = [p.name for p in params]
        assert len(set(names)) == len(names), "parameter names must be unique"
        self.params = params
        self.offsets, offset = {}, 0
        for p in params:  # CUDA's parameter layout: each at a multiple of its alignment
            offset = -(-offset // KIND_ALIGN[p.kind]) * KIND_ALIGN[p.kind]
            self.offsets[p.name] = offset
            offset += KIND_BYTES[p.kind]
        self.size = offset

    def __iter__(self):
        return iter(self.params)

    def __getitem__(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)


OPERAND_PREFIX = "operand_"  # an operand's parameter name: apart from every design's


def operand_params(operands) -> tuple[Param, ...]:
    """The parameters of a declaration's operands (`AttentionOptions.operands`: each a name,
    a type, "i32" or "f32", and a tensor's axes), in their order: a scalar's value; a
    tensor's address (the call's tensor `operand_<name>`), then each axis's size and
    stride (elements, i32: a call's tensor operand spans fewer than 2**31 elements, so a
    read's offset is 32-bit, as cheap as the kernel's other index math)."""
    params = []
    for o in operands:
        name = OPERAND_PREFIX + o.name
        if not o.axes:
            params.append(Param(name, o.type, Scalar(o.name), f"the operand '{o.name}' "
                                                              f"({o.type})"))
            continue
        sizes, strides = tensor_params(o.name, len(o.axes))
        params.append(Param(name, "ptr", Pointer(name), f"the tensor operand '{o.name}'",
                            align=4))
        params += [Param(n, "i32", Extent(name, i), f"its axis {i}'s size")
                   for i, n in enumerate(sizes)]
        params += [Param(n, "i32", Stride(name, i), f"elements between its axis {i}'s entries")
                   for i, n in enumerate(strides)]
    return tuple(params)


# the parameter of an operand's gradient (a call's tensor): apart from the operands' own
# (`OPERAND_PREFIX`) and every design's
GRAD_PREFIX = "grad_"


def float_tensors(operands) -> tuple[str, ...]:
    """The names of the f32 tensor operands among a declaration's operands: those with a
    gradient."""
    return tuple(o.name for o in operands if o.axes and o.type == "f32")


def operand_grad_params(names) -> tuple[Param, ...]:
    """The parameters of a backward build that adds the gradients of f32 tensor operands
    `names` (`Layout.operand_grads`): each one's float32 gradient, contiguous in the
    operand's shape (whose sizes the operand's own parameters give), or null where the
    call asks for none."""
    return tuple(Param(GRAD_PREFIX + n, "ptr", Pointer(GRAD_PREFIX + n),
                       f"float32 gradient of the tensor operand '{n}', contiguous in its "
                       f"shape, which the kernels add into; null: not asked for", align=4)
                 for n in names)


def tensor_params(operand: str, rank: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names of tensor operand `operand`'s size and stride parameters, an axis each (its
    address is `OPERAND_PREFIX + operand`, as a call's tensors are named)."""
    name = OPERAND_PREFIX + operand
    return (tuple(f"{name}_size{i}" for i in range(rank)),
            tuple(f"{name}_stride{i}" for i in range(rank)))


# A call whose mask reads data (`AttentionOptions.mask_reads_data`) classifies its tiles on
# the device before its kernels run (`codegen.block_classes`): a byte per cell of each
# sequence (and query head, where the mask reads `h`), bit 0 set where the mask keeps some
# pair of the cell, bit 1 where it keeps every pair of it (the cell's part inside the
# sequence). A cell is the call's scheduled kernel's tile (query rows by keys), so a tile
# of that kernel reads one byte; a box across cells is partial.
CELL_MAY, CELL_ALL = 1, 2
BLOCK_CLASS_PARAMS: tuple[Param, ...] = (
    Param("block_classes", "ptr", Workspace("block_classes"), "u8 classes of the call's "
          "cells, (B, block_heads, block_rows, block_cols) (codegen/block_classes.py)",
          align=4),
    Param("block_rows", "i32", CallValue("block_rows"), "cells along the query rows: "
          "ceil(max_seqlen_q / cell_rows)"),
    Param("block_cols", "i32", CallValue("block_cols"), "cells along the keys: "
          "ceil(max_seqlen_k / cell_keys)"),
    Param("block_heads", "i32", CallValue("block_heads"), "query heads the classes differ "
          "by: Hq where the mask reads h, else 1"),
    Param("cell_rows", "i32", CallValue("cell_rows"), "query rows of a cell"),
    Param("cell_keys", "i32", CallValue("cell_keys"), "keys of a cell"),
)


def classifies_per_call(options, workload: str) -> bool:
    """Whether a `workload` call of declaration `options` classifies its tiles on the
    device first: a prefill or backward call whose mask reads data (a decode call's KV
    tiles stay classified by the interval analysis alone)."""
    return options.mask_reads_data and workload != "decode"


def declaration_params(options, workload: str, operand_grads: bool = False
                       ) -> tuple[Param, ...]:
    """The parameters every kernel of a `workload` build of declaration `options` takes
    after its design's own: its operands', then the tile classes' where the call makes
    them (`classifies_per_call`), then with `operand_grads` (a backward build's,
    `Layout.operand_grads`) the gradients of its f32 tensor operands."""
    params = operand_params(options.operands)
    if classifies_per_call(options, workload):
        params += BLOCK_CLASS_PARAMS
    if operand_grads:
        params += operand_grad_params(float_tensors(options.operands))
    return params


def block_class_values(call: "CallSizes", per_head: bool,
                       cell: tuple[int, int]) -> dict[str, int]:
    """The `CallValue`s of `BLOCK_CLASS_PARAMS` for a call (`per_head`: the mask reads h,
    `AttentionOptions.mask_reads_head`) and cells of `cell` (query rows, keys)."""
    return {"block_rows": -(-call.max_seqlen_q // cell[0]),
            "block_cols": -(-call.max_seqlen_k // cell[1]),
            "block_heads": call.heads if per_head else 1,
            "cell_rows": cell[0], "cell_keys": cell[1]}


def block_class_bytes(values: dict[str, int], batch: int) -> int:
    """Bytes (cells) of a call's tile classes (`block_class_values`, `batch` sequences)."""
    return batch * values["block_heads"] * values["block_rows"] * values["block_cols"]


def with_operands(abi: KernelABI, operands: tuple[Param, ...]) -> KernelABI:
    """A design kernel's parameters followed by those of the declaration's operands."""
    return KernelABI(*abi, *operands) if operands else abi


@dataclass(frozen=True)
class CallSizes:
    """A call's sizes, from which the host binds the `CallValue`s every design shares
    (`values`). Dense calls have `seqlen_q`/`seqlen_k` rows per sequence; ragged ones
    `total_q` query rows and `total_k` key rows in all. A call against a KV cache adds its
    cache's positions (`cache_capacity`), its query rows per sequence (`query_rows`, 0
    ragged), the page table's row stride (0: a contiguous cache), the KV splits its planner
    asks for (at most that many a sequence, where they follow the lengths, aiming at
    `kv_slots` chunks in all) and an FP8 cache's scales."""

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    total_q: int
    ragged: bool
    scale: float
    query_rows: int = 0
    cache_capacity: int = 0
    page_table_stride: int = 0
    num_splits: int = 1
    kv_scales: tuple[float, float] = (1.0, 1.0)  # an FP8 cache's k_scale, v_scale
    kv_slots: int = 0  # chunks a decode call's batch aims at where its splits follow lengths
    total_k: int = 0  # ragged: k's rows (the backward zeroes gradient rows outside sequences)

    def values(self) -> dict[str, int | float]:
        """The shared call values: sizes, the LSE's strides ((batch, heads, seqlen_q) dense,
        (heads, total_q) ragged) and the softmax scale."""
        return {"lse_stride_batch": 0 if self.ragged else self.heads * self.seqlen_q,
                "lse_stride_head": self.total_q if self.ragged else self.seqlen_q,
                "batch": self.batch, "num_heads": self.heads, "kv_heads": self.kv_heads,
                "max_seqlen_q": self.max_seqlen_q, "max_seqlen_k": self.max_seqlen_k,
                "seqlen_q": self.seqlen_q, "seqlen_k": self.seqlen_k,
                "total_q": self.total_q, "total_k": self.total_k, "softmax_scale": self.scale}


# ============================================================================ the workspace
COUNTER_WORD = 0
EXITED_WORD = 2  # u64
RECORD_WORD = 4  # the fault record's first word (its code)
RECORD_WORDS = 3  # code, scheduler id, CTA
HOST_RECORD_WORD = 8  # u64: the host copy's address
WORKSPACE_WORDS = 16  # 64 bytes: streams' counters never share a 64-byte sector

TOO_MANY_TILES = 1  # advance kept returning work past all the work of the launch, plus one
ENDLESS_WHILE = 2  # a `while` ran past its bound
# a deterministic backward's CTA waited past DQ_ORDER_WAIT_NS for the tiles before it to
# add their gradients (dQ; a split group's dK and dV): the scheduler handed them out after it
DQ_ORDER_WAIT = 3
DQ_ORDER_WAIT_NS = 4_000_000_000  # (below 2**32: the wait reads %globaltimer_lo)
RULES = ("grid_dim", "initial_state", "get_current_work_info", "advance", "unsafe_seq_info")
# The `while` loops of one scheduler step (the first rules, or one advance) may run
# WHILE_SLACK * (ts.num_work() + CTAs) + WHILE_MIN iterations together: a correct rule
# (skipping tiles, scanning sequences or heads) stays far below it.
WHILE_SLACK, WHILE_MIN = 4, 1024


def scheduler_id(name: str) -> int:
    """The id a kernel records for scheduler `name`."""
    return zlib.crc32(name.encode()) or 1


def fault_code(kind: int, rule: str) -> int:
    return kind << 8 | RULES.index(rule)


def tile_index_words(batch: int) -> int:
    """u32 words of the tile index of a ragged launch of `batch` sequences
    (`mhadsl.analysis.valid_work.tile_index`, which a small kernel builds on the device
    before the launch): prefix (B+1), ranked (B), level (B+1)."""
    return 3 * batch + 2


# A traced build (`mhadsl trace`) reaches its record buffer through the same workspace
# pointer; its workspace is larger:
#     word TRACE_COUNT_WORD                 records written so far (atomic; may pass capacity)
#     word TRACE_CAPACITY_WORD              how many records fit
#     words TRACE_HEADER_WORDS + k * TRACE_RECORD_WORDS ...   record k (TRACE_FIELDS, u32)
TRACE_COUNT_WORD = WORKSPACE_WORDS
TRACE_CAPACITY_WORD = TRACE_COUNT_WORD + 1
TRACE_HEADER_WORDS = -(-(TRACE_CAPACITY_WORD + 1) // 8) * 8  # records start 32-byte aligned
TRACE_FIELDS = ("prompt_offset", "head", "batch", "cta", "sm", "duration", "start_lo",
                "start_hi", "kind")
TRACE_RECORD_WORDS = len(TRACE_FIELDS)
# What a record times (its `kind`): a work item's tile body, or the merge of a decode
# group's split results (the tile is that of the split that merged)
TRACE_WORK_ITEM, TRACE_COMBINE = 0, 1
