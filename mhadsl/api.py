"""The Python API: `mhadsl.compile(...)` -> `Program`; `program[name]` -> `Kernel`.

    prog = mhadsl.compile("examples/causal.mha")      # a path, or source text
    kern = prog["causal_fwd"]
    o = kern(q, k, v)                                  # q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D)
    o, lse = kern(q, k, v, return_lse=True)
    o = kern(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk)
    o = kern(q, k_cache, v_cache, cache_seqlens=lens, page_table=pages)  # decode (serving)
    dq, dk, dv = kern.backward(q, k, v, o, lse, do)    # the backward pass (mhadsl.backward)

A kernel is built once per (declaration, dtype, head dim, GQA group, arch, layout): batch
size and sequence lengths are run-time values, so new shapes reuse the build. Builds are
kept in memory and in the on-disk cache. Every argument is checked before anything runs.
"""
from __future__ import annotations

import operator
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mhadsl.attention_spec import AttentionOptions, resolve_attention
from mhadsl.build import KernelRequest, build_kernel, plan, tile_index_kernel
from mhadsl.calls import (
    DTYPE_NAMES, INT32_LIMIT, AddressChecks, check_attention_call, check_flag, check_integer,
    check_output,
    check_rows, host_values, index_view, share_memory, span, stream_handle, torch_signature,
    torch_stream, typed_key,
)
from mhadsl.check import CheckedProgram
from mhadsl.codegen import backends
from mhadsl.codegen.backends import (
    Backend, CacheLayout, DeviceTarget, KernelBuild, LaunchShape, Layout,
)
from mhadsl.codegen.scheduler import SchedulerSpec
from mhadsl.pipeline import front_end
from mhadsl.serving import decode
from mhadsl.sources import read_source_file



def compile(source: str | os.PathLike, *, name: str | None = None,  # noqa: A001
            include_dirs: Sequence[str | os.PathLike] = ()) -> Program:
    """Parse and check a `.mha` file (a path) or `.mha` source text.

    Imports are found in the importing file's folder (the current folder for source text),
    then in `include_dirs`; an import outside them is an error.

    An argument of the wrong type is a `TypeError` naming it; an include folder that does
    not exist or is not a folder is a `FileNotFoundError` or `NotADirectoryError` naming it
    (the CLI's `-I` check).
    """
    from mhadsl.sources import check_include_dir
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


@dataclass(frozen=True)
class _Build:
    function: object  # runtime.driver.Function
    config: object  # the backend's config
    launch: LaunchShape
    backend: Backend
    module: object  # keeps the CUDA module loaded


@dataclass
class _Call:
    """A validated call: device views of the tensors and the run-time sizes."""

    q: object
    k: object
    v: object
    cu_q: object | None
    cu_k: object | None
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

    @property
    def lse_shape(self) -> tuple[int, ...]:
        """The LSE's: (batch, heads, seqlen_q) dense, (heads, total_q) ragged."""
        return (self.heads, self.total_q) if self.ragged else (self.batch, self.heads,
                                                                self.seqlen_q)


class Kernel:
    """One attention declaration, callable on tensors."""

    def __init__(self, program: Program, options: AttentionOptions):
        self.program, self.options = program, options
        self._builds: dict[tuple, _Build] = {}
        # (compute capability, forced backend) -> (backend, target): chosen once, not per
        # call (the choice asks each design about the declaration)
        self._designs: dict[tuple, tuple] = {}
        self.builds_compiled = 0  # how many times a kernel was generated (for tests)
        # launch plans by call signature: of validated calls, and of torch calls' tensors
        self._plans: dict[tuple, _Planned] = {}
        self._torch_plans: dict[tuple, _Planned] = {}
        self._decode_plans: dict[tuple, object] = {}  # (mhadsl.serving) by torch signature
        from mhadsl.runtime import faults
        for workload in ("prefill", "decode"):  # remembered, so a fault record names it
            faults.scheduler_id(options.scheduler_for(workload)[0])
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
        self._torch_plans.clear()  # their key does not hold it
        self._decode_plans.clear()

    @property
    def trace(self) -> bool:
        """`mhadsl.trace`: build the kernel that records its work items, and launch it on
        `trace_workspace` (`runtime.trace_records`; the tracer zeroes it), not the stream's."""
        return self._trace

    @trace.setter
    def trace(self, on: bool) -> None:
        self._trace = on
        self._torch_plans.clear()
        self._decode_plans.clear()

    @property
    def recording_workspace(self) -> int | None:
        """The workspace a launch takes in place of its stream's: a traced kernel's
        `trace_workspace`, else None."""
        return self.trace_workspace if self.trace else None

    # ---------------------------------------------------------------- builds
    def config(self, *, gqa_group: int = 1, ragged: bool = False, return_lse: bool = False,
               arch: str = "sm_90a", backend: str | None = None,
               cache: CacheLayout | None = None):
        """The build a call of this layout selects (its key; see `build` for the tile)."""
        layout = self._layout(arch, backend, gqa_group, ragged, return_lse, cache)
        return self._configs(layout, arch, backend)[0]

    def _layout(self, arch, backend, gqa_group, ragged, return_lse, cache, backward=False,
                deterministic=False) -> Layout:
        """A build's layout, checked before any work: a layout no call can select, or a
        design that does not make it, is refused rather than built as something else."""
        if not isinstance(arch, str):
            raise TypeError(f"arch must be a str such as 'sm_90a', got {arch!r}")
        flags = {"ragged": ragged, "return_lse": return_lse, "backward": backward,
                 "deterministic": deterministic}
        for name, flag in flags.items():
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if cache is not None and not isinstance(cache, CacheLayout):
            raise TypeError(f"cache must be a CacheLayout or None, got {cache!r}")
        layout = Layout(self._group(gqa_group), *map(bool, (ragged, return_lse)), cache,
                        *map(bool, (backward, deterministic)))
        if backend is not None:
            if not isinstance(backend, str):
                raise TypeError(f"backend must be a design's name (a str) or None, got "
                                f"{backend!r}")
            if backend in backends.REGISTRY and \
                    (made := backends.backend(backend).workload) != layout.workload:
                takes = " or ".join(repr(b.name) for b in backends.backends(layout.workload))
                raise ValueError(f"backend {backend!r} makes {_BUILDS[made]}, not "
                                 f"{_BUILDS[layout.workload]}, which takes {takes}")
        return layout

    def _group(self, gqa_group) -> int:
        """A build's GQA group: query heads per K/V head, as a call's tensors could have
        them (fewer than 2**31 query heads, the kernels' int32) and the declaration allows."""
        group = check_integer(gqa_group, "gqa_group")
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
                             scheduler=self.options.scheduler_for(layout.workload),
                             trace=self.trace)

    def scheduler_spec(self, config, design: Backend | None = None) -> SchedulerSpec:
        """The scheduler's specialisation for a build of `config` by `design` (None: the
        prefill design's): the scheduler that runs the design's workload
        (`AttentionOptions.scheduler_for`), its tile height and group those of the work space
        the design hands it (`Backend.scheduler_shape`; by default a query tile of a query
        head)."""
        if design is None:
            tile_m, group, workload = config.block_m, config.gqa_group, "prefill"
        else:
            (tile_m, group), workload = design.scheduler_shape(config), design.workload
        return SchedulerSpec(*self.options.scheduler_for(workload), tile_m, group)

    def build(self, arch: str = "sm_90a", *, gqa_group: int = 1, ragged: bool = False,
              return_lse: bool = False, backend: str | None = None,
              cache: CacheLayout | None = None, backward: bool = False,
              deterministic: bool = False) -> KernelBuild:
        """The kernel for `arch` (from the on-disk cache when it holds it): LLVM IR, PTX
        and, with ptxas, the cubin and its resources. With `cache`, the decode kernel of
        calls against a KV cache of that layout; with `backward`, the backward pass's
        (`deterministic`: its bitwise repeatable kernels). `backend` forces a design of
        that build: "sm80" or "sm90" for the forward's, "decode" with `cache`, "backward"
        or "backward_sm90" with `backward`."""
        layout = self._layout(arch, backend, gqa_group, ragged, return_lse, cache, backward,
                              deterministic)
        build = build_kernel(self.program.checked, self._request(layout, arch, backend))
        self.builds_compiled += not build.cached
        return build

    def ptx(self, arch: str = "sm_90a", **config_args) -> str:
        return self.build(arch, **config_args).ptx

    def _build(self, layout: Layout, target: DeviceTarget, backend: Backend) -> _Build:
        key = (layout, target, backend.name)
        if key in self._builds:
            return self._builds[key]
        from mhadsl.runtime import driver
        build = self.build(target.arch, gqa_group=layout.gqa_group, ragged=layout.ragged,
                           return_lse=layout.return_lse, backend=backend.name,
                           cache=layout.cache)
        module = (driver.Module.from_cubin(build.assembled.cubin)
                  if target.load == "cubin" and build.assembled else
                  driver.Module.from_ptx(build.ptx.encode()))
        launch = backend.launch_shape(build.config)
        self._builds[key] = _Build(module.function(launch.kernel_name), build.config, launch,
                                   backend, module)
        return self._builds[key]

    def torch_op(self):
        """This kernel as a PyTorch operator returning (out, lse), which torch.compile traces
        without a graph break (`mhadsl.torch_op`)."""
        from mhadsl.torch_op import torch_op
        return torch_op(self)

    def backward(self, q, k, v, out, lse, dout, *, cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, scale: float | None = None,
                 deterministic: bool | None = None):
        """(dq, dk, dv): the gradients of `self(q, k, v, ...)` for the output gradient `dout`,
        given the forward's `out` and `lse` (`return_lse=True`); torch CUDA tensors, in the
        layouts of q, k and v (`mhadsl.backward`). `deterministic=True`: bitwise the same
        gradients every run (dQ without atomics); None: torch's
        `torch.are_deterministic_algorithms_enabled()`."""
        from mhadsl.backward import backward
        return backward(self, q, k, v, out, lse, dout, cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                        max_seqlen_k=max_seqlen_k, scale=scale, deterministic=deterministic)

    def backward_build(self, arch: str = "sm_90a", *, gqa_group: int = 1,
                       ragged: bool = False, deterministic: bool = False) -> KernelBuild:
        """The backward pass's kernels for `arch` (LLVM IR, PTX, and with ptxas the cubin)."""
        return self.build(arch, gqa_group=gqa_group, ragged=ragged, backward=True,
                          deterministic=deterministic)

    # ---------------------------------------------------------------- calls
    def __call__(self, q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                 max_seqlen_k=None, scale: float | None = None, out=None,
                 return_lse: bool | None = None, stream=None, cache_seqlens=None,
                 page_table=None, num_splits: int | None = None):
        if cache_seqlens is not None or page_table is not None or num_splits is not None:
            # k and v are a KV cache (`mhadsl.serving`)
            if cache_seqlens is None:
                raise ValueError("a call against a KV cache needs cache_seqlens (int32, one "
                                 "length per sequence)")
            if cu_seqlens_k is not None or max_seqlen_k is not None:
                raise ValueError("cu_seqlens_k/max_seqlen_k belong to calls with k and v; a "
                                 "call against a KV cache takes its lengths from "
                                 "cache_seqlens")
            return decode(self, q, k, v, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q,
                          scale, out, return_lse, stream, num_splits)
        key = torch_signature(q, k, v, out, cu_seqlens_q, cu_seqlens_k)
        if key is not None:  # torch tensors: a signature seen before runs its plan
            key = typed_key(key, (max_seqlen_q, max_seqlen_k, scale, return_lse))
            planned = self._torch_plans.get(key)
            if planned is not None:
                return self._run_torch(planned, q, k, v, out, cu_seqlens_q, cu_seqlens_k,
                                       stream)
        return self._call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          scale, out, return_lse, stream, key)

    def _call(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, out, return_lse, stream,
              torch_key):
        """Any call: every check, then the device (without a GPU, NoGpuError before any host
        array is copied or allocated), then the plan of its signature (made once)."""
        from mhadsl.runtime import driver, tensors
        check_flag(return_lse, "return_lse")
        want_lse = self.options.return_lse if return_lse is None else bool(return_lse)
        call = self._validate(q, k, v, cu_q, cu_k, max_q, max_k, scale)
        scale = call.scale
        dtype = DTYPE_NAMES[self.options.dtype]
        device = next((t.device for t in (call.q, call.k, call.v) if not t.on_host), None)
        od = None if out is None else self._check_out(out, call, dtype, device)
        handle = driver.stream_handle(stream, kind=call.q.kind,
                                      device=device if call.q.on_host else call.q.device)
        device = driver.ensure_context(device)
        keep_alive = []

        def on_device(t, name, want=dtype):
            if not t.on_host:
                return t
            dev, buf = tensors.to_device(t.obj, name, dtype=want, device=device)
            keep_alive.append(buf)
            return dev

        if od is None:
            od = tensors.as_device_tensor(
                tensors.empty_like_kind(call.q.obj, call.q.shape, dtype), "out")
        out_obj = od.obj
        qd, kd, vd = on_device(call.q, "q"), on_device(call.k, "k"), on_device(call.v, "v")
        cu_qd = on_device(call.cu_q, "cu_seqlens_q", "int32") if call.ragged else None
        cu_kd = on_device(call.cu_k, "cu_seqlens_k", "int32") if call.ragged else None
        out_dev = on_device(od, "out") if od.on_host else od
        lse_obj = tensors.empty_like_kind(call.q.obj, call.lse_shape, "float32") \
            if want_lse else None
        lse_dev = None
        if want_lse:
            lse_dev = tensors.as_device_tensor(lse_obj, "lse")
            if lse_dev.on_host:
                lse_dev, buf = tensors.to_device(lse_obj, "lse", device=device)
                keep_alive.append(buf)

        views = {"q": qd, "k": kd, "v": vd, "o": out_dev, "lse": lse_dev,
                 "cu_seqlens_q": cu_qd, "cu_seqlens_k": cu_kd}
        if _launches(call):
            # a torch call's signature fixes all its checks but those of its addresses, unless
            # they read lengths on the device
            reusable = torch_key is not None and not self.trace and not (
                call.ragged and (max_q is None or driver.debug_mode()))
            self._launch(call, views, scale, want_lse, handle, torch_key if reusable else None)
        if od.on_host:
            tensors.from_device(out_dev, out_obj, stream=handle)
        if want_lse and lse_dev.kind == "numpy" and isinstance(lse_obj, np.ndarray) \
                and lse_dev.ptr:
            tensors.from_device(lse_dev, lse_obj, stream=handle)
        return (out_obj, lse_obj) if want_lse else out_obj

    def _run_torch(self, planned: _Planned, q, k, v, out, cu_q, cu_k, stream):
        """A call whose signature has a plan: only what depends on its addresses is checked
        (alignment, and whether out overlaps q, k or v), then the plan launches."""
        torch = sys.modules["torch"]
        if out is None:
            # (empty_like keeps q's strides: where q is contiguous, so is the output planned)
            out = torch.empty_like(q) if planned.q_contiguous else q.new_empty(planned.out_shape)
        addresses = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(),
                     "o": out.data_ptr()}
        planned.check_addresses(addresses)
        lse = None
        if planned.want_lse:
            lse = q.new_empty(planned.lse_shape, dtype=torch.float32)
            addresses["lse"] = lse.data_ptr()
        if cu_q is not None:
            addresses["cu_seqlens_q"], addresses["cu_seqlens_k"] = cu_q.data_ptr(), \
                cu_k.data_ptr()
        handle = torch_stream(torch, q.get_device()) if stream is None else \
            stream_handle(stream)
        planned.plan.launch(addresses, handle,
                            workspace=self.recording_workspace)
        return (out, lse) if planned.want_lse else out

    def specialize(self, q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                   max_seqlen_k=None, return_lse: bool | None = None):
        """The build a call with these arguments runs (checks them; launches nothing)."""
        check_flag(return_lse, "return_lse")
        call = self._validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        want_lse = self.options.return_lse if return_lse is None else bool(return_lse)
        return self._config_for(call, want_lse)

    def _config_for(self, call: _Call, want_lse: bool):
        return self.config(gqa_group=call.heads // call.kv_heads, ragged=call.ragged,
                           return_lse=want_lse)

    def _launch(self, call: _Call, views: dict, scale: float, want_lse: bool, stream: int,
                torch_key: tuple | None) -> None:
        """Launch a validated call on device views of its tensors, by its signature's plan
        (remembered for `torch_key`'s calls)."""
        planned = self._planned(call, views, scale, want_lse)
        if torch_key is not None:
            self._torch_plans[torch_key] = planned
        planned.plan.launch({n: t.ptr for n, t in views.items() if t}, stream,
                            workspace=self.recording_workspace)

    def _design(self, device: int, workload: str = "prefill") -> tuple[Backend, DeviceTarget]:
        """The design and target for `device` (asked once per kernel, device and workload)."""
        from mhadsl.runtime import driver
        info = driver.device_info(device)
        design = (info.compute_capability, self.backend)
        if (design, workload) not in self._designs:
            try:
                self._designs[design, workload] = backends.select_backend(
                    *design, self.options, workload)
            except ValueError as err:
                raise RuntimeError(f"kernel '{self.name}': {err}") from None
        return self._designs[design, workload]

    def _planned(self, call: _Call, views: dict, scale: float, want_lse: bool) -> _Planned:
        """The plan of a validated call's signature: made on its first call, then reused."""
        from mhadsl.runtime import driver, tile_index
        from mhadsl.runtime.launch import LaunchPlan, TensorShape
        shapes = {n: TensorShape(tuple(t.shape), tuple(t.strides), t.dtype) if t else None
                  for n, t in views.items()}
        device = views["q"].device
        key = (device, tuple(shapes.items()), call.batch, call.heads, call.kv_heads,
               call.seqlen_q, call.seqlen_k, call.max_seqlen_q, call.max_seqlen_k,
               call.total_q, call.ragged, scale, want_lse, self.backend, self.trace)
        planned = self._plans.get(key)
        if planned is not None:
            return planned
        backend, target = self._design(device)
        build = self._build(Layout(call.heads // call.kv_heads, call.ragged, want_lse), target,
                            backend)
        launch = build.launch
        info = driver.device_info(device)
        ctas_per_sm = build.function.max_active_blocks(launch.threads, launch.shared_bytes)
        grid = self._grid(build.config, call, info.multiprocessor_count, ctas_per_sm)
        if 0 in grid:  # (CUDA's upper limits are checked at the rule, by `_grid`)
            raise ValueError(f"scheduler '{self.options.scheduler}' asked for grid {grid} "
                             f"for {call.batch} sequences x {call.heads} heads; every "
                             f"dimension must be at least 1")
        values = {
            "lse_stride_batch": 0 if call.ragged else call.heads * call.seqlen_q,
            "lse_stride_head": call.total_q if call.ragged else call.seqlen_q,
            "batch": call.batch, "num_heads": call.heads, "max_seqlen_q": call.max_seqlen_q,
            "max_seqlen_k": call.max_seqlen_k, "seqlen_q": call.seqlen_q,
            "seqlen_k": call.seqlen_k, "softmax_scale": scale,
            "num_sms": info.multiprocessor_count, "ctas_per_sm": ctas_per_sm,
        }
        index = tile_index.plan(tile_index_kernel(), call.batch, build.config.block_m,
                                device) if call.ragged else None
        plan = LaunchPlan(build.function, grid, launch.threads, launch.shared_bytes,
                          backend.abi, build.config, device, shapes, values, call.ragged,
                          index)
        planned = self._plans[key] = _Planned(plan, call, want_lse, shapes)
        return planned

    def _grid(self, config, call: _Call, num_sms: int, ctas_per_sm: int
              ) -> tuple[int, int, int]:
        """The scheduler's own grid_dim rule, run on the host."""
        tiles = -(-call.max_seqlen_q // config.block_m)
        return self._host_scheduler(config).grid(call.batch, tiles, call.max_seqlen_q,
                                                 call.heads, num_sms, ctas_per_sm)

    def _host_scheduler(self, config, design: Backend | None = None):
        """The scheduler's rules compiled for the host, for a build of `config` (by
        `design`: `scheduler_spec`)."""
        from mhadsl.simulate import HostScheduler
        spec = self.scheduler_spec(config, design)
        host = _host_schedulers.get((self.program.text, spec))
        if host is None:
            host = _host_schedulers[(self.program.text, spec)] = HostScheduler(
                self.program.checked, spec)
        return host

    # ---------------------------------------------------------------- checks
    def _validate(self, q, k, v, cu_q, cu_k, max_q, max_k, scale=None) -> _Call:
        """Every check of a call's arguments, before anything is copied or launched: those
        `mhadsl.reference` runs too (`check_attention_call`), then those of device memory."""
        from mhadsl.runtime import driver, tensors
        o = self.options
        dtype = DTYPE_NAMES[o.dtype]
        views = {}
        for name, t in (("q", q), ("k", k), ("v", v)):
            view = tensors.as_device_tensor(t, name)
            if view.on_host:
                if view.dtype == "int32":
                    raise TypeError(f"tensor {name!r} has dtype int32; attention needs "
                                    f"{dtype} (or float NumPy arrays, which are converted)")
            elif view.dtype != dtype:
                raise TypeError(f"tensor {name!r} has dtype {view.dtype}, but kernel "
                                f"'{self.name}' is declared {o.dtype} ({dtype})")
            views[name] = view
        devices = {t.device for t in views.values() if not t.on_host}
        if len(devices) > 1:
            raise ValueError(f"q, k and v are on different devices: {sorted(devices)}")
        offsets = {name: None if t is None else index_view(t, name)
                   for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k))}

        def read(view, name: str, max_seqlen):
            """Device values are read (a host sync) only where max_seqlen is not given, or
            under MHADSL_DEBUG=1: a launch given it never synchronises."""
            if not view.on_host and view.strides != (1,):
                raise ValueError(f"{name} must be contiguous")
            if view.on_host or max_seqlen is None or driver.debug_mode():
                return host_values(view)
            return None

        c = check_attention_call(o, views["q"], views["k"], views["v"],
                                 cu_seqlens_q=offsets["cu_seqlens_q"],
                                 cu_seqlens_k=offsets["cu_seqlens_k"], max_seqlen_q=max_q,
                                 max_seqlen_k=max_k, scale=scale, read=read)
        for name, view in views.items():
            if not view.on_host:
                check_rows(view, name)
        for name, view in offsets.items():
            if view is not None and not view.on_host and devices and view.device not in devices:
                raise ValueError(f"{name} is on device {view.device}, q/k/v on "
                                 f"{devices.pop()}")
        return _Call(views["q"], views["k"], views["v"], offsets["cu_seqlens_q"],
                     offsets["cu_seqlens_k"], c.batch, c.heads, c.kv_heads, c.seqlen_q,
                     c.seqlen_k, c.max_seqlen_q, c.max_seqlen_k, c.total_q, c.ragged, c.scale)

    def _check_out(self, out, call: _Call, dtype: str, device: int | None):
        return check_output(out, call.q.shape, dtype, device,
                            {"q": call.q, "k": call.k, "v": call.v})


_host_schedulers: dict = {}
# what the designs of each workload build (`Kernel.build`'s words)
_BUILDS = {"prefill": "a forward build",
           "decode": "a build against a KV cache (Kernel.build(cache=CacheLayout(...)))",
           "backward": "the backward pass's kernels (Kernel.backward_build())"}


class _Planned(AddressChecks):
    """A call signature's launch plan (`runtime.launch`) and the validated call it was made
    from; what its calls still check depends on their addresses alone."""

    checked_addresses = operator.itemgetter("q", "k", "v", "o")

    def __init__(self, plan, call: _Call, want_lse: bool, shapes: dict):
        # sizes only: a plan must not keep a call's tensors alive (a CUDA-graph pool's, say)
        self.plan, self.want_lse, self.shapes = plan, want_lse, shapes
        self.out_shape, self.lse_shape = tuple(call.q.shape), call.lse_shape
        from mhadsl.runtime.tensors import ITEMSIZE, contiguous_strides
        self.q_contiguous = shapes["q"].strides == contiguous_strides(shapes["q"].shape)
        self.spans = {n: span(shapes[n].shape, shapes[n].strides, ITEMSIZE[shapes[n].dtype])
                      for n in "qkvo"}  # first to last byte, inclusive
        self.empty = {n: 0 in shapes[n].shape for n in "qkvo"}

    def check_new_addresses(self, addresses: dict) -> None:
        """The checks of `_validate` and `_check_out` that depend on the addresses."""
        for name in "qkvo":
            ptr = addresses[name]
            if ptr == 0 and not self.empty[name]:
                raise ValueError(f"tensor {name!r} has a null data pointer")
            if ptr % 16:
                raise ValueError(f"tensor {name!r}: rows must be 16-byte aligned (pointer and "
                                 f"strides multiples of 8 elements), got a pointer at "
                                 f"{ptr:#x}")
        o_lo = addresses["o"]
        o_hi = o_lo + self.spans["o"]
        for name in "qkv":
            lo = addresses[name]
            if lo <= o_hi and o_lo <= lo + self.spans[name] and not self.empty["o"] \
                    and share_memory(self._view("o", o_lo), self._view(name, lo)):
                raise ValueError(f"out overlaps {name}: the kernel reads {name} while it "
                                 "writes out; pass a separate output")

    def _view(self, name: str, ptr: int):
        from mhadsl.runtime.tensors import DeviceTensor
        t = self.shapes[name]
        return DeviceTensor(ptr, t.shape, t.strides, t.dtype, self.plan.device, "torch", None)


def _launches(call: _Call) -> bool:
    """Whether a call has any work (an empty batch, query or head count launches nothing)."""
    return bool(call.batch and call.max_seqlen_q and call.heads)
