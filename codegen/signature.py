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


def kernel(module: ir.Module, abi: KernelABI, name: str, threads: int | None = None,
           min_ctas: int | None = None) -> tuple[ir.Function, dict[str, ir.Argument]]:
    """Kernel `name` of `module` taking `abi`'s parameters (`declare`: the function and its
    arguments by name), bounded to `threads` threads a CTA and `min_ctas` CTAs a
    multiprocessor (which caps its registers) where given."""
    fn = ir.Function(module, ir.FunctionType(nvptx.void, llvm_types(abi)), name=name)
    nvptx.mark_kernel(fn)
    # (NVVM's launch bounds are string attributes, which llvmlite has no class for)
    if threads is not None:
        set.add(fn.attributes, f'"nvvm.maxntid"="{threads}"')
    if min_ctas is not None:
        set.add(fn.attributes, f'"nvvm.minctasm"="{min_ctas}"')
    return fn, declare(abi, fn)
