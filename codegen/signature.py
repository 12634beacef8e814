"""A kernel's LLVM signature, from its parameters as the ABI lists them (`mhadsl.abi`)."""
from __future__ import annotations

from llvmlite import ir

from mhadsl.abi import KernelABI, Param
from mhadsl.codegen import hopper, nvptx
from mhadsl.codegen.nvptx import GLOBAL, f32, i32, i64


def llvm_type(param: Param) -> ir.Type:
    return {"ptr": nvptx.ptr(GLOBAL), "i64": i64, "i32": i32, "f32": f32,
            "tensor_map": nvptx.ptr()}[param.kind]


def llvm_types(abi: KernelABI) -> list[ir.Type]:
    return [llvm_type(p) for p in abi]


def declare(abi: KernelABI, fn: ir.Function) -> dict[str, ir.Argument]:
    """Name the kernel's arguments and give them what the ABI promises: pointers are
    `noalias` with their alignment, tensor maps come by value (`grid_constant`)."""
    for p, arg in zip(abi, fn.args):
        arg.name = p.name
        if p.kind == "tensor_map":
            hopper.mark_tensor_map_param(arg)
        elif p.kind == "ptr":
            arg.add_attribute("noalias")
            if p.align:
                arg.attributes.align = p.align
    return {p.name: arg for p, arg in zip(abi, fn.args)}
