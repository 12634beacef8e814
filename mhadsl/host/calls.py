"""What every kernel call shares (prefill, decode, backward): the argument checks a call
and its float64 reference run alike (`check_attention_call`), the torch signature a planned
call is looked up by, streams, and the checks of the tensors a kernel reads and writes
(those of a planned call's addresses skipped where the last passing call had them).

Imported by the call paths (`mhadsl.host.forward`, `serving`, `backward`) and
`mhadsl.analysis.reference`; it imports none of them.
"""
from __future__ import annotations

import operator
import sys
from typing import Callable, NamedTuple

import numpy as np

from mhadsl.abi import OPERAND_PREFIX
from mhadsl.front.attention_spec import AttentionOptions, scale_problem

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}
NO_OPTIONS = (None, None, None, None)
INT32_LIMIT = 2**31  # lengths, row offsets and head counts are int32 in the kernels


class AttentionCall(NamedTuple):
    """A checked call's sizes (`check_attention_call`), and its offsets where they were read."""
    ragged: bool
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int  # dense; 0 ragged
    seqlen_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    total_q: int  # ragged: q's rows; 0 dense
    total_k: int  # ragged: k's rows; 0 dense
    scale: float
    cu_seqlens_q: np.ndarray | None  # the values read (int64); None: left on the device
    cu_seqlens_k: np.ndarray | None


# read(offsets, name, max_seqlen given) -> their values, or None where they stay on the device
ReadOffsets = Callable[[object, str, object], "np.ndarray | None"]


def check_attention_call(options: AttentionOptions, q, k, v, *, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k, scale, read: ReadOffsets
                         ) -> AttentionCall:
    """Refuse, with a ValueError or TypeError saying why, a call `kernel(q, k, v, ...)` of the
    kernel `options` declares: ranks, head dims, head counts, batches, offsets, max_seqlen
    and scale. The kernels' call, its backward and `mhadsl.reference` all check here.

    Tensors are anything with a `.shape`, offsets anything with `.shape` and `.dtype` (device
    tensor views, NumPy, torch, CuPy); `read` gives the offsets' values to check, or None for
    values it leaves on the device."""
    ragged = cu_seqlens_q is not None or cu_seqlens_k is not None
    if ragged and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError("ragged attention needs both cu_seqlens_q and cu_seqlens_k")
    rank = 3 if ragged else 4
    layout = "(total, heads, head_dim) with cu_seqlens" if ragged else \
        "(batch, seqlen, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(t.shape) != rank:
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}; expected rank "
                             f"{rank}: {layout}")
        if t.shape[-1] != options.head_dim:
            raise ValueError(f"tensor {name!r} has head dim {t.shape[-1]}, but kernel "
                             f"'{options.name}' is declared head_dim = {options.head_dim}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if problem := options.heads_problem(heads, kv_heads):
        raise ValueError(problem)
    if heads >= INT32_LIMIT:
        raise ValueError(f"head counts must be below 2**31, got {heads}")
    if not ragged:
        if max_seqlen_q is not None or max_seqlen_k is not None:
            raise ValueError("max_seqlen_q/max_seqlen_k belong to ragged calls (with "
                             "cu_seqlens_q/k); a dense call takes its lengths from q and k")
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"q has batch {q.shape[0]} but k/v have {k.shape[0]}")
        batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        if max(sq, sk) >= INT32_LIMIT:
            raise ValueError("sequence lengths must be below 2**31")
        return AttentionCall(False, batch, heads, kv_heads, sq, sk, sq, sk, 0, 0,
                             softmax_scale(options, scale), None, None)
    cu_q = _offsets(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q, read)
    cu_k = _offsets(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k, read)
    if tuple(cu_seqlens_q.shape) != tuple(cu_seqlens_k.shape):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch "
                         f"+ 1), got {cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    max_q = check_max_seqlen(cu_q, max_seqlen_q, "max_seqlen_q")
    max_k = check_max_seqlen(cu_k, max_seqlen_k, "max_seqlen_k")
    return AttentionCall(True, cu_seqlens_q.shape[0] - 1, heads, kv_heads, 0, 0, max_q, max_k,
                         q.shape[0], k.shape[0], softmax_scale(options, scale), cu_q, cu_k)


def _offsets(offsets, name: str, rows: int, max_seqlen, read: ReadOffsets
             ) -> np.ndarray | None:
    """A cu_seqlens argument's values (None: not read), checked: int32, 1-D, from 0 up,
    non-decreasing, within the `rows` of its tensor."""
    if dtype_name(offsets) != "int32":
        raise TypeError(f"{name} must be int32, got {dtype_name(offsets)}")
    if len(offsets.shape) != 1 or offsets.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D with batch + 1 entries, got shape "
                         f"{tuple(offsets.shape)}")
    values = read(offsets, name, max_seqlen)
    if values is None:
        return None
    if values[0] < 0:
        raise ValueError(f"{name} must start at 0 or above, got {values[0]}")
    if np.any(np.diff(values) < 0):
        raise ValueError(f"{name} must be non-decreasing, got {values.tolist()}")
    if values[-1] > rows:
        raise ValueError(f"{name} ends at {values[-1]}, beyond the {rows} rows of its tensor")
    return values


def check_integer(value, name: str) -> int:
    """`value` as an int: any integer type but a bool, else a `TypeError` naming `name`."""
    if not isinstance(value, (bool, np.bool_)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an integer, got {value!r}")


def check_max_seqlen(offsets: np.ndarray | None, given, name: str) -> int:
    """A ragged call's longest sequence: `given` (an integer no smaller than any length the
    `offsets` read give), else read from them."""
    lengths = None if offsets is None else np.diff(offsets)
    if given is None:
        return int(lengths.max()) if len(lengths) else 0
    given = check_integer(given, name)
    if not 0 <= given < INT32_LIMIT:
        raise ValueError(f"{name} must be in [0, 2**31), got {given}")
    if lengths is not None and len(lengths) and given < lengths.max():
        raise ValueError(f"{name} = {given} is below the longest sequence "
                         f"({int(lengths.max())})")
    return given


def softmax_scale(options: AttentionOptions, scale) -> float:
    """A call's softmax scale: `scale`, checked, else the declaration's."""
    return options.softmax_scale() if scale is None else check_scale(scale)


def check_flag(value, name: str) -> None:
    """A call's on/off option: True, False, or None (its default)."""
    if value is not None and not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True, False or None, got {value!r}")


def check_shape(t, name: str, shape: tuple) -> None:
    """A tensor that must have q's shape (an output, its gradient)."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} (like q)")


def dtype_name(t) -> str:
    """A tensor's dtype as a plain name ("int32", "bfloat16"), for any kind of tensor."""
    return str(t.dtype).removeprefix("torch.")


TENSOR_OPERAND_DTYPES = {"i32": "int32", "f32": "float32"}
TENSOR_OPERAND_SPAN = 2 ** 31  # elements from a tensor operand's first to its last, at most


AXIS_WORDS = {"batch": "sequences", "heads": "query heads", "queries": "query rows",
              "keys": "keys"}


def check_tensor_operand(operand, t, batch: int, heads: int,
                         rows: tuple[int | None, int | None] = (None, None),
                         ragged_rows: tuple[bool, bool] = (False, False)) -> None:
    """Tensor operand `operand` (`attention_spec.Operand`) as a call passes it (a tensor of
    any kind), against the call's sequences, query heads and `rows` (the query rows and
    keys a `queries` and a `keys` axis hold: a dense call's per sequence, a ragged call's in
    all, `ragged_rows`; None where unknown): its element type, rank, the sizes of those
    axes, no `batch` axis beside a ragged position axis (which already spans every
    sequence); no axis empty (a read outside an axis gives 0, one inside reads the
    tensor)."""
    what = f"tensor operand {operand.name!r} ({operand.declared})"
    want = TENSOR_OPERAND_DTYPES[operand.type]
    if dtype_name(t) != want:
        raise TypeError(f"{what} takes {want} elements, got {dtype_name(t)}")
    shape = tuple(t.shape)
    if len(shape) != len(operand.axes):
        raise ValueError(f"{what} has {len(operand.axes)} axes, got shape {shape}")
    spans = [axis for axis, ragged in zip(("queries", "keys"), ragged_rows)
             if ragged and axis in operand.axes]
    if spans and "batch" in operand.axes:
        raise ValueError(f"{what}: this call is ragged, so its {spans[0]} axis holds every "
                         f"sequence's {AXIS_WORDS[spans[0]]} one after another; the tensor "
                         f"takes no batch axis beside it")
    sizes = {"batch": batch, "heads": heads, "queries": rows[0], "keys": rows[1]}
    for axis, size, n in zip(operand.axes, shape, range(len(shape))):
        need = sizes.get(axis)
        if need is not None and size != need:
            raise ValueError(f"{what}: axis {n} ({axis}) has {size} entries, but the call has "
                             f"{need} {AXIS_WORDS[axis]}")
        if size == 0:
            raise ValueError(f"{what}: axis {n} is empty")


def check_cell(cell) -> tuple[int, int]:
    """`reference_block_classes`'s `cell`: (query rows, keys), two positive integers."""
    if isinstance(cell, (tuple, list)) and len(cell) == 2 and all(
            isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_))
            for n in cell):
        if all(1 <= n < 2**31 for n in cell):
            return int(cell[0]), int(cell[1])
        raise ValueError(f"cell must be two sizes from 1 to 2**31 - 1 (query rows, keys), got "
                         f"{tuple(cell)!r}")
    raise TypeError(f"cell takes (query rows, keys), two ints such as (128, 128), got {cell!r}")


def check_operand_grads(options: AttentionOptions, program, names) -> tuple[str, ...]:
    """The f32 tensor operands whose gradients a backward call asks for (`operand_grads`:
    names), in declaration order, checked: each an operand of the declaration, an f32
    tensor, not read by a sink rule, and the score differentiable with respect to what it
    reads of them (`mhadsl.analysis.derivative`, worked out once per declaration:
    `_score_reads`); what fails is a TypeError or ValueError naming it (with the rule's
    diagnostic)."""
    from mhadsl.front.attention_spec import rule_reads
    if not isinstance(names, (str, bytes)):
        try:  # any iterable of names, read once (a generator too)
            names = tuple(names)
        except TypeError:
            pass
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"operand_grads takes operand names (a tuple of str), got {names!r}")
    known = {o.name: o for o in options.operands}
    for name in names:
        operand = known.get(name)
        if operand is None:
            raise TypeError(f"operand_grads: kernel '{options.name}' has no operand {name!r}")
        if operand.type != "f32" or not operand.axes:
            raise ValueError(f"operand_grads: operand {name!r} ({operand.declared}) has no "
                             f"gradient: only f32 tensor operands have one")
        if options.sink is not None and rule_reads(options.sink, name):
            raise ValueError(f"operand_grads: the sink rule reads {name!r}; gradients through "
                             f"a sink rule are not supported yet")
    for name, error in _score_reads(options, program):
        if error is not None and name in names:
            raise ValueError(f"operand_grads: the score cannot be differentiated with respect "
                             f"to the tensors it reads:\n{error}")
    return tuple(o.name for o in options.operands if o.name in set(names))


def score_read_floats(options: AttentionOptions, program) -> tuple[str, ...]:
    """The f32 tensor operands the declaration's score rule reads, in declaration order:
    those a backward build can add the gradients of (`Layout.operand_grads`)."""
    read = {name for name, _ in _score_reads(options, program)}
    return tuple(o.name for o in options.operands if o.name in read)


# (program id, options) -> (program, its score's reads): kept with the program, whose id
# names it only while it lives; the oldest go past SCORE_READS_KEPT declarations
_SCORE_READS: dict = {}
SCORE_READS_KEPT = 256


def _score_reads(options: AttentionOptions, program) -> tuple[tuple[str, str | None], ...]:
    """Each read of an f32 tensor operand in the score rule, in source order: the operand's
    name and why the score cannot be differentiated with respect to it (the diagnostic,
    rendered), else None. Worked out once per declaration: a backward call asks again."""
    key = (id(program), options)
    cached = _SCORE_READS.get(key)
    if cached is not None and cached[0] is program:
        return cached[1]
    from mhadsl.analysis.derivative import differentiate_score, float_reads, read_operand
    from mhadsl.front.diagnostics import MhaError
    reads = []
    for read in float_reads(options.score, program) if options.score is not None else ():
        try:
            differentiate_score(options.score, program, read)
            reads.append((read_operand(read), None))
        except MhaError as err:
            reads.append((read_operand(read), err.render()))
    if len(_SCORE_READS) >= SCORE_READS_KEPT:
        del _SCORE_READS[next(iter(_SCORE_READS))]
    _SCORE_READS[key] = (program, tuple(reads))
    return tuple(reads)


def tensor_operands(options: AttentionOptions, operands: dict | None) -> dict:
    """A call's tensor operands among its operand values, by the name the kernels' parameters
    and the call's tensors give them (`operand_<name>`)."""
    if not operands:
        return {}
    return {OPERAND_PREFIX + o.name: operands[o.name] for o in options.operands if o.axes}


def operand_views(options: AttentionOptions, operands: dict | None, batch: int, heads: int,
                  device: int | None, rows: tuple[int | None, int | None] = (None, None),
                  ragged_rows: tuple[bool, bool] = (False, False)) -> dict:
    """Views of a call's tensor operands (`tensor_operands`), each checked against the call
    (`check_tensor_operand`) and on the device of its other tensors where it is on one."""
    from mhadsl.runtime import tensors
    views = {}
    for o in options.operands:
        if not o.axes:
            continue
        view = tensors.as_device_tensor(operands[o.name], o.name)
        check_tensor_operand(o, view, batch, heads, rows, ragged_rows)
        span = sum((n - 1) * abs(s) for n, s in zip(view.shape, view.strides))
        if span >= TENSOR_OPERAND_SPAN:  # (the kernels' offsets into it are 32-bit)
            raise ValueError(f"tensor operand {o.name!r} spans {span + 1} elements; at most "
                             f"{TENSOR_OPERAND_SPAN}")
        if not view.on_host and device is not None and view.device != device:
            raise ValueError(f"tensor operand {o.name!r} is on device {view.device}, the "
                             f"call's other tensors on {device}")
        views[OPERAND_PREFIX + o.name] = view
    return views


def index_view(obj, name: str):
    """The call's view of an int32 index argument (offsets, lengths, page table); a NumPy
    array of another dtype is refused in the words of the checks that follow."""
    from mhadsl.runtime import tensors
    if isinstance(obj, np.ndarray) and obj.dtype != np.int32:
        raise TypeError(f"{name} must be int32, got {obj.dtype}")
    return tensors.as_device_tensor(obj, name)


def typed_key(signature: tuple, options: tuple) -> tuple:
    """A planned call's key: its tensors' signature, and its options typed where any is
    given (3.0 == 3 and True == 1, yet one of each is refused)."""
    if options == NO_OPTIONS:
        return signature
    return (signature, *((type(x), x) for x in options))


def check_output(out, shape, dtype: str, device: int | None, reads: dict):
    """The output's view, checked: q's shape, the kernel's dtype and device, aligned rows,
    no element written twice, and no element shared with a tensor the kernel `reads`
    (name -> view)."""
    from mhadsl.runtime import tensors
    view = tensors.as_device_tensor(out, "out")
    check_shape(view, "out", shape)
    if not view.on_host:
        if view.dtype != dtype:
            raise TypeError(f"out has dtype {view.dtype}, expected {dtype}")
        if device is not None and view.device != device:
            raise ValueError(f"out is on device {view.device}, {'/'.join(reads)} on {device}")
        check_rows(view, "out")
        if self_overlapping(view):
            raise ValueError(f"out has strides {view.strides} for shape {view.shape}: "
                             "its elements overlap, so the kernel's writes would collide")
        for name, t in reads.items():
            if not t.on_host and share_memory(view, t):
                raise ValueError(f"out overlaps {name}: the kernel reads {name} while it "
                                 "writes out; pass a separate output")
    return view


def span(shape, strides, itemsize: int) -> int:
    """Bytes from a non-empty tensor's first element to its last (non-negative strides)."""
    return sum((n - 1) * s for n, s in zip(shape, strides)) * itemsize + itemsize - 1


def torch_signature(*tensors) -> tuple | None:
    """What a call's torch tensors fix of its checks and its launch (everything but their
    addresses); None unless every tensor given is a torch tensor."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    signature = []
    for t in tensors:
        if t is None:
            signature.append(None)
        elif isinstance(t, torch.Tensor):
            signature.append((t.dtype, t.shape, t.stride(), t.get_device()))  # -1: the CPU
        else:
            return None
    return tuple(signature)


_current_stream = None  # torch's accessor of a device's current raw stream, found once


def torch_stream(torch, device: int) -> int:
    """torch's current stream on `device`, as a raw handle (its C accessor is the cheap way;
    looked up on the first call, as a lookup per call costs host time)."""
    global _current_stream
    if _current_stream is None:
        _current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda device: torch.cuda.current_stream(device).cuda_stream)
    return _current_stream(device)


class AddressChecks:
    """What a planned call signature checks of a call's tensor addresses, skipped where the
    ones it checks (`checked_addresses`, an `operator.itemgetter` over the call's address
    dict) are the last passing call's: a serving loop's usually are. A subclass raises from
    `check_new_addresses` for addresses it refuses, so a refused call's are never
    remembered. (A base class, not a helper object: a call that skips costs one method
    call and a comparison, as if the subclass wrote it itself.)"""

    _passed: tuple = ()

    def check_addresses(self, addresses: dict) -> None:
        key = self.checked_addresses(addresses)
        if key != self._passed:
            self.check_new_addresses(addresses)
            self._passed = key


class DeviceCopies:
    """One call's host arrays copied to `device` (`copies(view, name, dtype)`: a device view
    is returned as it is), their buffers kept until the call is done with them."""

    def __init__(self, device: int):
        self.device, self.buffers = device, []

    def __call__(self, view, name: str, dtype: str):
        if not view.on_host:
            return view
        from mhadsl.runtime import tensors
        copy, buffer = tensors.to_device(view.obj, name, dtype=dtype, device=self.device)
        self.buffers.append(buffer)
        return copy


def stream_handle(stream) -> int:
    from mhadsl.runtime import driver
    return driver.stream_handle(stream)


def check_rows(t, name: str) -> None:
    """The kernel copies rows in 16-byte pieces: a contiguous last dimension, aligned rows."""
    if t.strides[-1] != 1:
        raise ValueError(f"tensor {name!r}: the last dimension must be contiguous (stride 1), "
                         f"got strides {t.strides}")
    if t.ptr == 0 and 0 not in t.shape:
        raise ValueError(f"tensor {name!r} has a null data pointer")
    if any(s < 0 for s in t.strides):
        raise ValueError(f"tensor {name!r} has negative strides {t.strides}; pass a copy "
                         "with non-negative strides")
    per_row = 16 // t.itemsize  # elements in 16 bytes
    if t.ptr % 16 or any(s % per_row for s in t.strides[:-1]):
        raise ValueError(f"tensor {name!r}: rows must be 16-byte aligned (pointer and strides "
                         f"multiples of {per_row} elements), got strides {t.strides}")


def self_overlapping(t) -> bool:
    """Whether two elements of `t` may share memory: sorted by stride, each dimension of
    more than one element must step past the whole of the dimensions inside it."""
    dims = sorted((s, n) for s, n in zip(t.strides, t.shape) if n > 1)
    span = 1
    for stride, extent in dims:
        if stride < span:
            return True
        span = stride * extent
    return False


def share_memory(a, b) -> bool:
    """Whether device tensors `a` and `b` have an element in common (exact, by NumPy's
    solver over their addresses and strides: packed QKV views side by side do not)."""
    def alias(t):  # a NumPy view of t's addresses, never read
        holder = type("Alias", (), {})()
        holder.__array_interface__ = {
            "shape": tuple(t.shape), "typestr": f"|V{t.itemsize}", "data": (t.ptr, True),
            "strides": tuple(s * t.itemsize for s in t.strides), "version": 3}
        return np.asarray(holder)
    def extent(t):  # [first byte, last byte] (strides are non-negative: check_rows)
        return t.ptr, t.ptr + span(t.shape, t.strides, t.itemsize)
    if 0 in a.shape or 0 in b.shape:
        return False
    (a_lo, a_hi), (b_lo, b_hi) = extent(a), extent(b)
    if a_hi < b_lo or b_hi < a_lo:
        return False  # separate allocations, the usual case: no NumPy views to build (a
        # launch's host work bounds how fast short kernels run back to back)
    try:
        return bool(np.shares_memory(alias(a), alias(b), max_work=10**6))
    except np.exceptions.TooHardError:
        return True  # cannot tell: refuse rather than risk a kernel reading its own output


def check_scale(scale) -> float:
    if problem := scale_problem(scale):
        raise TypeError(problem)
    return float(scale)


def host_values(view) -> np.ndarray:
    from mhadsl.runtime import tensors
    if view.on_host:
        return np.asarray(view.obj, dtype=np.int64)
    return tensors.from_device(view).astype(np.int64)
