"""An element of a tensor operand read where a rule runs (`FunctionLowering.tensor_read`):
the bounds of its indices, its address, its load.

An index outside its axis reads 0, never another address. Where the load is not
predicated, its address is the tensor's first element then (the call checked that no axis
is empty) and a select gives the 0. Where it is (the GPU's forward and decode kernels), an
index's constant (`FunctionLowering.offset_sum` builds a per-element index as a tile's base
plus one) stays out of the address LLVM computes and joins it inside the load
(`nvptx.load_global_if`): the elements of a tile share the address but one multiply-add.
"""
from __future__ import annotations

from typing import Callable

from llvmlite import ir

from mhadsl.codegen import nvptx
from mhadsl.codegen.nvptx import i32

Address = tuple[ir.Value, tuple[tuple[ir.Value, int], ...]]  # (offset, (stride, constant)s)


def linear_terms(value: ir.Value) -> tuple[list[tuple[int, ir.Value]], int]:
    """`value` as a signed sum of values plus a constant, through the adds and subtractions
    that built it wherever a constant lies below them (elsewhere a value stays whole)."""
    if isinstance(value, ir.Constant) and isinstance(value.constant, int):
        return [], value.constant
    if isinstance(value, ir.Instruction) and value.opname in ("add", "sub"):
        (left, left_const), (right, right_const) = map(linear_terms, value.operands)
        if left_const or right_const:
            sign = 1 if value.opname == "add" else -1
            return left + [(sign * s, v) for s, v in right], left_const + sign * right_const
    return [(1, value)], 0


def split_constant(value: ir.Value) -> tuple[ir.Value, int]:
    """`value` as a value plus a constant, where it is an add of a constant (as
    `FunctionLowering.offset_sum` builds its sums)."""
    if isinstance(value, ir.Instruction) and value.opname == "add" and \
            isinstance(value.operands[1], ir.Constant):
        return value.operands[0], (value.operands[1].constant + 2**31) % 2**32 - 2**31
    return value, 0


def bounds(b: ir.IRBuilder, tensor, indices: list[Callable[[], ir.Value]], predicated: bool
           ) -> tuple[ir.Value, Address, list[ir.Value]]:
    """Whether every index lies inside its axis (i1), the element's address, and its
    index along each axis of the tensor (`indices` lower them, outermost axis first)."""
    inside, offset, constants, at_axes = None, i32(0), [], []
    positions = tensor.positions or (None,) * len(tensor.sizes)
    for index, size, stride, rows in zip(indices, tensor.sizes, tensor.strides, positions):
        v = index()
        base, const = split_constant(v) if predicated else (v, 0)
        if rows is None:
            ok = b.icmp_unsigned("<", v, size)  # (a negative i32 is a huge u32)
        else:  # the sequence's own rows of the axis
            first, count = rows
            ok = b.icmp_unsigned("<", v, count)
            base = b.add(first, base)
            v = base if const == 0 else b.add(base, i32(const))
            ok = b.and_(ok, b.icmp_unsigned("<", v, size))
        inside = ok if inside is None else b.and_(inside, ok)
        offset = b.add(offset, b.mul(base, stride))  # (inside the tensor: below 2**31)
        if const:
            constants.append((stride, const))
        at_axes.append(v)
    return inside, (offset, tuple(constants)), at_axes


def load(b: ir.IRBuilder, tensor, element: ir.Type, inside: ir.Value, address: Address,
         predicated: bool) -> ir.Value:
    """The element at `address` (`bounds`) where `inside` holds, else 0."""
    offset, constants = address
    if predicated:
        bits = nvptx.load_global_if(b, b.gep(tensor.pointer, [offset], source_etype=element),
                                    inside, constants)
        return bits if element == i32 else b.bitcast(bits, element)
    at = b.gep(tensor.pointer, [b.select(inside, offset, i32(0))], source_etype=element)
    return b.select(inside, b.load(at, typ=element), ir.Constant(element, 0))
