"""The Python API: `mhadsl.compile(...)` -> `Program`; `program[name]` -> `Kernel`.

    prog = mhadsl.compile("examples/causal.mha")      # a path, or source text
    kern = prog["causal_fwd"]
    o = kern(q, k, v)                                  # q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D)
    o, lse = kern(q, k, v, return_lse=True)
    o = kern(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk)
    o = kern(q, k_cache, v_cache, cache_seqlens=lens, page_table=pages)  # decode (serving)
    dq, dk, dv = kern.backward(q, k, v, o, lse, do)    # the backward pass (mhadsl.host.backward)

A kernel is built once per (declaration, dtype, head dim, GQA group, arch, layout): batch
size and sequence lengths are run-time values, so new shapes reuse the build. Builds are
kept in memory and in the on-disk cache. Every argument is checked before anything runs.
A `Kernel` is the declaration's handle: its builds, and its calls, which `mhadsl.host.forward`,
`mhadsl.host.serving` (decode) and `mhadsl.host.backward` check and plan through its launcher
(`mhadsl.host.launcher`).
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from mhadsl.front.attention_spec import AttentionOptions, operand_values, resolve_attention
from mhadsl.build import KernelRequest, build_kernel, plan
from mhadsl.host.calls import INT32_LIMIT, check_flag, check_integer, score_read_floats
from mhadsl.front.check import CheckedProgram
from mhadsl.codegen import backends
from mhadsl.codegen.backends import Backend, CacheLayout, KernelBuild, Layout
from mhadsl.codegen.scheduler import SchedulerSpec
from mhadsl.host.forward import check_call, forward
from mhadsl.host.launcher import Launcher
from mhadsl.pipeline import front_end
from mhadsl.host.serving import decode
from mhadsl.front.sources import read_source_file


def compile(source: str | os.PathLike, *, name: str | None = None,  # noqa: A001
            include_dirs: Sequence[str | os.PathLike] = ()) -> Program:
    """Parse and check a `.mha` file (a path) or `.mha` source text.

    Imports are found in the importing file's folder (the current folder for source text),
    then in `include_dirs`; an import outside them is an error.

    An argument of the wrong type is a `TypeError` naming it; an include folder that does
    not exist or is not a folder is a `FileNotFoundError` or `NotADirectoryError` naming it
    (the CLI's `-I` check).
    """
    from mhadsl.front.sources import check_include_dir
    if name is not None and not isinstance(name, str):
        raise TypeError(f"mhadsl.compile(): name takes a str, not {type(name).__name__}")
    if isinstance(include_dirs, (str, bytes)) or not isinstance(include_dirs, Sequence):
        raise TypeError(f"mhadsl.compile(): include_dirs takes a list of folders, not "
                        f"{type(include_dirs).__name__}")
    for folder in include_dirs:
        if not isinstance(folder, (str, os.PathLike)):
            raise TypeError(f"mhadsl.compile(): include_dirs takes folders (str or "
                            f"os.PathLike), not {type(folder).__name__}")
        try:
            check_include_dir(folder)
        except OSError as err:  # the same class: FileNotFoundError, NotADirectoryError
            raise type(err)(f"mhadsl.compile(): include_dirs: {folder}: {err.strerror}"
                            ) from None
    text, base, label = _read(source)
    modules, checked = front_end(text, name or label, base, include_dirs)
    return Program(text, name or label, checked)


def _read(source: str | os.PathLike) -> tuple[str, Path, str]:
    """(text, folder imports are found in, name) of a path or of source text."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        raise TypeError("mhadsl.compile() takes .mha source text (str) or a path, not bytes: "
                        "decode them (data.decode()) or pass the file's path")
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"mhadsl.compile() takes .mha source text (str) or a path (str or "
                        f"os.PathLike), not {type(source).__name__}")
    if isinstance(source, os.PathLike) or _looks_like_a_path(source):
        path = Path(source)
        try:
            return read_source_file(path).text, path.resolve().parent, str(path)
        except OSError as err:  # same class (FileNotFoundError, IsADirectoryError, ...)
            raise type(err)(f"cannot read {path}: {err.strerror}") from None
    if not source.strip():
        raise ValueError("empty .mha source: mhadsl.compile() takes .mha source text or the "
                         "path of a .mha file")
    return source, Path.cwd(), "<string>"


def _looks_like_a_path(text: str) -> bool:
    """A string meant as a path, not as source: one line without braces (every declaration
    has them) that names something on disk, ends in a file suffix, or ends with a slash."""
    if "\n" in text or "{" in text:
        return False
    return (text.endswith(("/", os.sep)) or re.search(r"\.\w+$", text) is not None
            or os.path.exists(text))


class Program(Mapping):
    """A checked `.mha` program: its schedulers, and a mapping of its attention kernels'
    names to `Kernel`s (`prog["causal_fwd"]`, `"causal_fwd" in prog`, `list(prog)`)."""

    # A program is itself, not the names it maps: equal only to itself, and hashable.
    __eq__, __hash__ = object.__eq__, object.__hash__

    def __init__(self, text: str, name: str, checked: CheckedProgram):
        self.text, self.name, self.checked = text, name, checked
        self._kernels: dict[str, Kernel] = {}

    @property
    def schedulers(self) -> list[str]:
        return list(self.checked.schedulers)

    @property
    def attentions(self) -> list[str]:
        return list(self.checked.attentions)

    def __getitem__(self, name: str) -> Kernel:
        if not isinstance(name, str):
            raise TypeError(f"an attention kernel name must be a str, got "
                            f"{type(name).__name__} {name!r}")
        if name not in self.checked.attentions:
            raise KeyError(f"no attention kernel named {name!r} in {self.name} (it has: "
                           f"{', '.join(self.checked.attentions) or 'none'})")
        if name not in self._kernels:
            self._kernels[name] = Kernel(self, resolve_attention(self.checked.attentions[name]))
        return self._kernels[name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.checked.attentions

    def __iter__(self):
        return iter(self.checked.attentions)

    def __len__(self) -> int:
        return len(self.checked.attentions)


class Kernel:
    """One attention declaration, callable on tensors."""

    def __init__(self, program: Program, options: AttentionOptions):
        self.program, self.options = program, options
        self.builds_compiled = 0  # how many times a kernel was generated (for tests)
        self.launcher = Launcher(self)  # loaded builds and launch plans
        from mhadsl.runtime import faults
        for workload, balanced, exact in (("prefill", False, False), ("decode", False, False),
                                          ("decode", True, False), ("backward", False, False),
                                          ("backward", False, True)):
            # remembered, so a fault record names it
            faults.scheduler_id(options.scheduler_for(workload, balanced, exact)[0])
        self._backend: str | None = None
        self._trace = False
        self.trace_workspace: int | None = None

    @property
    def name(self) -> str:
        return self.options.name

    @property
    def backend(self) -> str | None:
        """A forced kernel design ("sm80"); None: the device's choice."""
        return self._backend

    @backend.setter
    def backend(self, name: str | None) -> None:
        self._backend = name
        self.launcher.fast_plans.clear()  # their key does not hold it

    @property
    def trace(self) -> bool:
        """`mhadsl.analysis.trace`: build the kernel that records its work items, and launch it on
        `trace_workspace` (`runtime.trace_records`; the tracer zeroes it), not the stream's."""
        return self._trace

    @trace.setter
    def trace(self, on: bool) -> None:
        self._trace = on
        self.launcher.fast_plans.clear()

    @property
    def recording_workspace(self) -> int | None:
        """The workspace a launch takes in place of its stream's: a traced kernel's
        `trace_workspace`, else None."""
        return self.trace_workspace if self.trace else None

    # ---------------------------------------------------------------- builds
    def config(self, *, gqa_group: int | None = None, ragged: bool = False,
               return_lse: bool = False, arch: str = "sm_90a", backend: str | None = None,
               cache: CacheLayout | None = None, short_band: bool = False,
               narrow_kv: bool = False):
        """The build a call of this layout selects (its key; see `build` for the tile)."""
        layout = self._layout(arch, backend, gqa_group, ragged, return_lse, cache,
                              short_band=short_band, narrow_kv=narrow_kv)
        return self._configs(layout, arch, backend)[0]

    def _layout(self, arch, backend, gqa_group, ragged, return_lse, cache, backward=False,
                deterministic=False, operand_grads=False, short_band=False,
                narrow_kv=False) -> Layout:
        """A build's layout, checked before any work: a layout no call can select, or a
        design that does not make it, is refused rather than built as something else."""
        if not isinstance(arch, str):
            raise TypeError(f"arch must be a str such as 'sm_90a', got {arch!r}")
        flags = {"ragged": ragged, "return_lse": return_lse, "backward": backward,
                 "deterministic": deterministic, "operand_grads": operand_grads,
                 "short_band": short_band, "narrow_kv": narrow_kv}
        for name, flag in flags.items():
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if operand_grads and not backward:
            raise ValueError("operand_grads is a backward build's (backward=True)")
        if short_band and not self.launcher.band_operands:
            raise ValueError(f"short_band: kernel '{self.name}' has no i32 operand that decides "
                             f"whether its mask is a short band of keys")
        for name in ("short_band", "narrow_kv"):
            if flags[name] and (backward or cache is not None):
                raise ValueError(f"{name} is a forward build's (no cache, not backward)")
        if operand_grads and not score_read_floats(self.options, self.program.checked):
            raise ValueError(f"operand_grads: kernel '{self.name}' has no score rule that "
                             f"reads an f32 tensor operand")
        if cache is not None and not isinstance(cache, CacheLayout):
            raise TypeError(f"cache must be a CacheLayout or None, got {cache!r}")
        layout = Layout(self._group(gqa_group), *map(bool, (ragged, return_lse)), cache,
                        *map(bool, (backward, deterministic, operand_grads, short_band,
                                    narrow_kv)))
        if backend is not None:
            if not isinstance(backend, str):
                raise TypeError(f"backend must be a design's name (a str) or None, got "
                                f"{backend!r}")
            if backend in backends.REGISTRY and \
                    (made := backends.backend(backend).workload) != layout.workload:
                takes = " or ".join(repr(b.name) for b in backends.backends(layout.workload))
                raise ValueError(f"backend {backend!r} makes {_BUILDS[made]}, not "
                                 f"{_BUILDS[layout.workload]}, which takes {takes}")
        if layout.narrow_kv:  # only where the design would give a call of few keys one
            wide = replace(layout, narrow_kv=False)
            design = plan(self.program.checked, self._request(wide, arch, backend)).backend
            if layout not in design.sibling_layouts(self.options, wide):
                raise ValueError(f"narrow_kv: no call of kernel '{self.name}' selects a "
                                 f"narrower KV tile on the {design.name} design (sm90's dense "
                                 f"calls without a mask or a declared tile do)")
        return layout

    def _group(self, gqa_group) -> int:
        """A build's GQA group: query heads per K/V head, as a call's tensors could have
        them (fewer than 2**31 query heads, the kernels' int32) and the declaration allows;
        None: the declared `gqa`, else 1."""
        group = (self.options.gqa or 1) if gqa_group is None else \
            check_integer(gqa_group, "gqa_group")
        if not 1 <= group < INT32_LIMIT:
            raise ValueError(f"gqa_group must be from 1 to 2**31 - 1, got {group}")
        declared, kv_heads = self.options.gqa, self.options.kv_heads
        if declared is not None and group != declared:
            raise ValueError(f"gqa_group = {group} does not fit kernel '{self.name}', "
                             f"declared gqa = {declared}: its builds take gqa_group = "
                             f"{declared}")
        if kv_heads is not None and group * kv_heads >= INT32_LIMIT:
            raise ValueError(f"gqa_group = {group} does not fit kernel '{self.name}', "
                             f"declared kv_heads = {kv_heads}: {group * kv_heads} query "
                             f"heads, and head counts must be below 2**31")
        return group

    def _configs(self, layout: Layout, arch: str, backend: str | None) -> tuple:
        return plan(self.program.checked, self._request(layout, arch, backend)).configs

    def _request(self, layout: Layout, arch: str, backend: str | None) -> KernelRequest:
        return KernelRequest(self.name, arch, backend or self.backend, layout,
                             scheduler=self.options.scheduler_for_layout(layout),
                             trace=self.trace)

    def scheduler_spec(self, config, design: Backend | None = None) -> SchedulerSpec:
        """The scheduler's specialisation for a build of `config` by `design` (None: the
        prefill design's): the scheduler that drives the design's build (`Backend.scheduler_of`),
        its tile height and group those of the work space
        the design hands it (`Backend.scheduler_shape`; by default a query tile of a query
        head)."""
        if design is None:
            (tile_m, group), scheduler = (config.block_m, config.gqa_group), \
                self.options.scheduler_for("prefill")
        else:
            (tile_m, group), scheduler = design.scheduler_shape(config), \
                design.scheduler_of(self.options, config)
        return SchedulerSpec(*scheduler, tile_m, group)

    def build(self, arch: str = "sm_90a", *, gqa_group: int | None = None, ragged: bool = False,
              return_lse: bool = False, backend: str | None = None,
              cache: CacheLayout | None = None, backward: bool = False,
              deterministic: bool = False, operand_grads: bool = False,
              short_band: bool = False, narrow_kv: bool = False) -> KernelBuild:
        """The kernel for `arch` (from the on-disk cache when it holds it): LLVM IR, PTX
        and, with ptxas, the cubin and its resources. With `cache`, the decode kernel of
        calls against a KV cache of that layout; with `backward`, the backward pass's
        (`deterministic`: its bitwise repeatable kernels; `operand_grads`: those adding the
        gradients of the f32 tensors the score reads too); with `short_band`, the forward
        of calls whose i32 operands make the mask a short band of keys (a run-time window:
        docs/language.md); with `narrow_kv`, the dense forward without the design's wide KV
        tile (what a call of few keys runs: `Backend.call_layout`). `backend` forces a
        design of that build: "sm80" or "sm90" for the forward's, "decode" with `cache`,
        "backward" or "backward_sm90" with `backward`."""
        layout = self._layout(arch, backend, gqa_group, ragged, return_lse, cache, backward,
                              deterministic, operand_grads, short_band, narrow_kv)
        build = build_kernel(self.program.checked, self._request(layout, arch, backend))
        self.builds_compiled += not build.cached
        return build

    def ptx(self, arch: str = "sm_90a", **config_args) -> str:
        return self.build(arch, **config_args).ptx

    def torch_op(self):
        """This kernel as a PyTorch operator returning (out, lse), which torch.compile traces
        without a graph break; `out=` a preallocated output (`mhadsl.host.torch_op`)."""
        from mhadsl.host.torch_op import torch_op
        return torch_op(self)

    def torch_decode_op(self):
        """This kernel's calls against a KV cache as a PyTorch operator returning (out, lse):
        `op(q, k_cache, v_cache, cache_seqlens, page_table=None, cu_seqlens_q=None,
        max_seqlen_q=None, scale=None, num_splits=None, k_new=None, v_new=None, k_scale=None,
        v_scale=None, *operands, out=None)`, which torch.compile traces without a graph break
        (`mhadsl.host.torch_op`)."""
        from mhadsl.host.torch_op import torch_decode_op
        return torch_decode_op(self)

    def backward(self, q, k, v, out, lse, dout, *, cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, scale: float | None = None,
                 deterministic: bool | None = None, operand_grads=(), **operands):
        """(dq, dk, dv): the gradients of `self(q, k, v, ...)` for the output gradient `dout`,
        given the forward's `out` and `lse` (`return_lse=True`); torch CUDA tensors, in the
        layouts of q, k and v (`mhadsl.host.backward`). `deterministic=True`: bitwise the same
        gradients every run (dQ without atomics); None: torch's
        `torch.are_deterministic_algorithms_enabled()`. The declaration's operands by name,
        as the forward call had them. A declaration with a sink rule adds a fourth result:
        the gradient of each sequence's and query head's sink logit, (batch, heads).
        `operand_grads`: names of f32 tensor operands the score reads (a learned bias
        table); then the last result is a dict of their float32 gradients, in their shapes.
        """
        from mhadsl.host.backward import backward
        return backward(self, q, k, v, out, lse, dout, cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                        max_seqlen_k=max_seqlen_k, scale=scale, deterministic=deterministic,
                        operand_grads=operand_grads, **operands)

    def backward_build(self, arch: str = "sm_90a", *, gqa_group: int | None = None,
                       ragged: bool = False, deterministic: bool = False,
                       operand_grads: bool = False) -> KernelBuild:
        """The backward pass's kernels for `arch` (LLVM IR, PTX, and with ptxas the cubin);
        `operand_grads`: those that add the f32 tensor operands' gradients too."""
        return self.build(arch, gqa_group=gqa_group, ragged=ragged, backward=True,
                          deterministic=deterministic, operand_grads=operand_grads)

    # ---------------------------------------------------------------- calls
    def __call__(self, q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                 max_seqlen_k=None, scale: float | None = None, out=None,
                 return_lse: bool | None = None, stream=None, cache_seqlens=None,
                 page_table=None, num_splits: int | None = None, k_new=None, v_new=None,
                 k_scale: float | None = None, v_scale: float | None = None,
                 block_classes=None, **operands):
        # the declaration's operands by name, checked before anything else (None: it has none)
        values = operand_values(self.options, operands) \
            if operands or self.options.operands else None
        if cache_seqlens is not None or page_table is not None or num_splits is not None \
                or k_new is not None or v_new is not None or k_scale is not None \
                or v_scale is not None:
            if block_classes is not None:
                raise TypeError("block_classes= is for calls with k and v; a call against a "
                                "KV cache classifies its tiles at compile time")
            # k and v are a KV cache (`mhadsl.host.serving`)
            if cache_seqlens is None:
                raise ValueError("a call against a KV cache needs cache_seqlens (int32, one "
                                 "length per sequence)")
            if cu_seqlens_k is not None or max_seqlen_k is not None:
                raise ValueError("cu_seqlens_k/max_seqlen_k belong to calls with k and v; a "
                                 "call against a KV cache takes its lengths from "
                                 "cache_seqlens")
            return decode(self, q, k, v, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q,
                          scale, out, return_lse, stream, num_splits, values, k_new, v_new,
                          k_scale, v_scale)
        return forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       scale, out, return_lse, stream, values, block_classes)

    def block_classes(self, q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None,
                      max_seqlen_q=None, max_seqlen_k=None, scale: float | None = None,
                      out=None, return_lse: bool | None = None, stream=None, **operands):
        """The tile classes of the call `self(q, k, v, ...)` with these arguments, for a
        declaration whose mask reads tensor operands per pair: made once on the device (on
        `stream`), passed to many calls as `block_classes=` (each then runs no classes
        kernel of its own). Device tensors only; `scale` and `out` are taken so that a
        call's arguments pass as they are, and not used; what they are keyed by:
        `mhadsl.host.forward.BlockClasses`."""
        from mhadsl.host.forward import block_classes
        values = operand_values(self.options, operands) \
            if operands or self.options.operands else None
        return block_classes(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, return_lse, stream, values)

    def specialize(self, q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                   max_seqlen_k=None, return_lse: bool | None = None):
        """The build a call with these arguments runs (checks them; launches nothing)."""
        check_flag(return_lse, "return_lse")
        call = check_call(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k)
        want_lse = self.options.return_lse if return_lse is None else bool(return_lse)
        sizes = call.sizes
        return self.config(gqa_group=sizes.heads // sizes.kv_heads, ragged=sizes.ragged,
                           return_lse=want_lse)


# what the designs of each workload build (`Kernel.build`'s words)
_BUILDS = {"prefill": "a forward build",
           "decode": "a build against a KV cache (Kernel.build(cache=CacheLayout(...)))",
           "backward": "the backward pass's kernels (Kernel.backward_build())"}
