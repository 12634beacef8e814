"""The `mhadsl` command line: check, compile, simulate, run, trace, bench.

Mistakes in a .mha file print `file:line:col: error: ...` with the line and a caret and
exit 1; a bad command line prints one line `error: ...` and exits 2, before any work is
done. Nothing a user types should end in a Python traceback.

It stays one module: the subcommands share its argument checks (`validate`), its guards
on output paths and `main`, the one place an error becomes an exit code.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import stat
import sys
import time
from pathlib import Path

from mhadsl import __version__
from mhadsl.abi import TRACE_WORK_ITEM
from mhadsl.front.attention_spec import operand_values, resolve_attention
from mhadsl.build import RequestError
from mhadsl.front.semantics import GRID_LIMITS
from mhadsl.codegen import backends
from mhadsl.codegen.assemble import AssemblerError, find_ptxas, ptxas_timeout
from mhadsl.codegen.backends.backward import BackwardConfig
from mhadsl.codegen.scheduler import SchedulerSpec
from mhadsl.codegen.target import GPU_ARCHS
from mhadsl.front.diagnostics import MhaError
from mhadsl.host.paged import MAX_DECODE_ROWS, MAX_KV_SPLITS, PAGE_SIZES
from mhadsl.front.parse import STD_PREFIX, std_file
from mhadsl.pipeline import (
    PASSES, CompileOptions, compile_stages, front_end, kernel_launches, tile_shape,
)
from mhadsl.analysis.simulate import (
    COST_MODELS, MAX_SEQLEN, MAX_SIMULATED_CTAS, Batch, plot_timeline, simulate,
)
from mhadsl.front.sources import check_include_dir, read_source_file


class UsageError(Exception):
    """A bad command-line value: printed as `error: ...`, exit 2."""


def source_path(path: str) -> Path:
    """The file a source's name means: a standard-library file for a name like
    `std/schedulers.mha` when there is no such file here."""
    file = Path(path)
    if path.startswith(STD_PREFIX) and not os.path.exists(file):  # False for a name too long
        file = std_file(path) or file
    return file


def read_source(path: str) -> tuple[str, Path]:
    """A .mha file's text and folder (see `source_path`)."""
    file = source_path(path)
    try:
        return read_source_file(file, path).text, file.resolve().parent
    except OSError as err:
        raise UsageError(f"cannot read {path}: {err.strerror}") from None


def cmd_check(args: argparse.Namespace) -> int:
    """Every file is checked, whatever happened to the ones before it: exit 2 when one
    could not be read, else 1 when one has errors."""
    failed = unreadable = False
    for path in args.files:
        try:
            text, base = read_source(path)
            _, program = front_end(text, path, base, args.include)
        except UsageError as err:
            print(f"error: {err}", file=sys.stderr)
            unreadable = True
            continue
        except MhaError as err:
            print(err.render(), file=sys.stderr)
            failed = True
            continue
        print(f"{path}: ok ({len(program.schedulers)} schedulers, {len(program.fns)} fns, "
              f"{len(program.attentions)} attention kernels)")
    return 2 if unreadable else 1 if failed else 0


EXTENSIONS = {"llvm": ".ll", "ptx": ".ptx", "cubin": ".cubin"}


def cmd_compile(args: argparse.Namespace) -> int:
    text, base = read_source(args.file)
    passes = PASSES if args.pass_name == "all" else (args.pass_name,)
    if args.deterministic and "backward" not in passes:
        raise UsageError("--deterministic selects the backward pass's kernels: give it with "
                         "--pass backward or --pass all")
    options = CompileOptions(arch=args.arch, tile_m=args.tile, passes=passes,
                             deterministic=args.deterministic)
    start = time.perf_counter()
    try:  # a bad $MHADSL_PTXAS or $MHADSL_PTXAS_TIMEOUT is found before compiling
        until = "cubin" if args.emit == "cubin" or find_ptxas() else "ptx"
        ptxas_timeout()
        comp = compile_stages(text, args.file, options, until=until, base_dir=base,
                              include_dirs=args.include,
                              progress=lambda stage: print(f"{args.file}: {stage}...",
                                                           file=sys.stderr, flush=True),
                              attentions=[args.kernel] if args.kernel else None)
    except (AssemblerError, RequestError) as err:
        raise UsageError(str(err)) from None
    elapsed = time.perf_counter() - start
    units = _units(comp, args.emit)
    if args.kernel:  # its units alone: the scheduler trace kernels belong to no declaration
        units = {name: unit for name, unit in units.items()
                 if name in comp.kernels or name in comp.classes}
    if not units:
        raise UsageError(f"{args.file} declares no scheduler and no attention kernel")
    if any(v is None for v in units.values()):
        raise UsageError("--emit cubin needs ptxas: pip install 'mhadsl[test]'")
    _write_units(units, args, [source_path(m.span.source.name) for m in comp.artifacts["parse"]])
    summary = sys.stderr if not args.output and not args.quiet else sys.stdout
    what = ", ".join(units)
    print(f"{args.file}: compiled {what} for {args.arch} in {elapsed * 1000:.0f} ms",
          file=summary)
    if until != "cubin":
        print("  ptxas not found: no register/spill summary (pip install 'mhadsl[test]')",
              file=summary)
        return 0
    resources = [(k.name, k) for k in comp.artifacts["cubin"].kernels.values()] \
        if "cubin" in comp.artifacts else []
    for unit, build in comp.kernels.items():
        launches = kernel_launches(build)
        rows, kv_rows = tile_shape(build)
        for kernel, launch in launches.items():  # a backward unit's: named each
            name = unit if len(launches) == 1 else f"{unit} {kernel}"
            resources.append((f"{name} ({build.backend}, {rows}x{kv_rows} tile, "
                              f"{launch.threads} threads, {launch.shared_bytes} B dynamic "
                              f"shared)", build.assembled.kernels[kernel]))
    for unit, classes in comp.classes.items():
        resources.append((f"{unit} ({classes.name}, a warp per tile, {classes.threads} "
                          f"threads)", classes.assembled.kernels[classes.name]))
    for name, k in resources:
        print(f"  {name}: {k.registers} registers, {k.spills} bytes spilled, "
              f"{k.shared_bytes} bytes shared, {k.stack_bytes} bytes stack", file=summary)
    return 0


def _units(comp, emit: str) -> dict[str, str | bytes | None]:
    """What `--emit` writes: the scheduler trace kernels' module and each attention unit (a
    declaration's build for a pass, and its classes kernel where its mask reads data)."""
    units: dict[str, str | bytes | None] = {}
    if "llvm" in comp.artifacts:
        units["schedulers"] = comp.text(emit) if emit in comp.artifacts else None
    for name, build in (*comp.kernels.items(), *comp.classes.items()):
        units[name] = {"llvm": build.llvm, "ptx": build.ptx,
                       "cubin": build.assembled.cubin if build.assembled else None}[emit]
    return units


def _check_output(text: str, flag: str, inputs: list[Path], *, folder: bool = False) -> None:
    """An output option's value, checked before any work (see `_check_writable`); with
    `folder`, it may name a folder: an existing one, or a new one when it ends in /."""
    if not text:
        raise UsageError(f"{flag} takes a {'file or folder' if folder else 'file'} name, got ''")
    shown = text if flag == "-o" else f"{flag} {text}"  # -o is named alone, as compilers do
    out = Path(text)
    if folder and text.endswith(("/", os.sep)) and os.path.exists(out) and \
            not os.path.isdir(out):
        raise UsageError(f"cannot write {shown}: it is not a folder")
    _check_writable(out, shown, inputs, folder=folder)


def _check_writable(out: Path, shown: str, inputs: list[Path], *, folder: bool = False
                    ) -> None:
    """`out` may be written: not a FIFO, device or socket (writing one waits for a reader,
    or goes who knows where), not one of the `inputs` (even through a link), not a folder
    unless `folder`, and in an existing folder that may be written."""
    try:
        status = os.stat(out)
    except (FileNotFoundError, NotADirectoryError):  # the folder is judged below
        status = None
    except OSError as err:  # a name too long, a loop of links, a folder not searchable
        raise UsageError(f"cannot write {shown}: {err.strerror}") from None
    if status is not None and stat.S_ISDIR(status.st_mode):
        if folder:
            return
        raise UsageError(f"cannot write {shown}: it is a folder")
    if status is not None and not stat.S_ISREG(status.st_mode):
        raise UsageError(f"cannot write {shown}: it is not a regular file (a FIFO, device or "
                         f"socket)")
    for source in inputs if status is not None else ():
        try:
            same = os.path.samestat(status, os.stat(source))
        except OSError:
            continue
        if same:
            raise UsageError(f"cannot write {shown}: it is the input {source}")
    parent = out.parent
    if not os.path.isdir(parent):
        why = "is not a folder" if os.path.exists(parent) else "does not exist"
        raise UsageError(f"cannot write {shown}: folder {parent} {why}")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"cannot write {shown}: folder {parent} is not writable")


def _write_units(units: dict, args: argparse.Namespace, inputs: list[Path]) -> None:
    """Compiler convention: one unit goes to -o FILE; into a folder go one unit when -o
    names an existing folder or ends in /, and several units (as NAME.ll/.ptx/.cubin) when
    -o names a folder, created when new (its name ends in / or has no extension); without
    -o, text goes to stdout. No file written is one of the `inputs`."""
    binary = args.emit == "cubin"
    extension = EXTENSIONS[args.emit]
    if not args.output:
        if binary:
            raise UsageError("--emit cubin writes binary: give -o FILE")
        if not args.quiet:
            for name, data in units.items():
                if len(units) > 1:
                    sys.stdout.write(f"// ===== {name}\n")
                sys.stdout.write(data)
        return
    out = Path(args.output)
    ends_in_slash = args.output.endswith(("/", os.sep))
    if len(units) == 1 and not ends_in_slash and not os.path.isdir(out):
        ((name, data),) = units.items()
        _write(out, data, inputs)
        return
    names_a_folder = os.path.isdir(out) or ends_in_slash or (
        not os.path.exists(out) and not out.suffix)
    if not names_a_folder:
        raise UsageError(f"{args.file} compiles to {len(units)} units ({', '.join(units)}): "
                         f"pick one with --kernel NAME, or give -o a folder (-o DIR/)")
    try:
        out.mkdir(exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create folder {out}: {err.strerror}") from None
    for name, data in units.items():
        _write(out / f"{name}{extension}", data, inputs)


def _write(path: Path, data: str | bytes, inputs: list[Path]) -> None:
    _check_writable(path, str(path), inputs)  # again: a compile learns its imports late
    try:
        path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror}") from None


# What a command line's integers are written with: int() would also read "1_000", " 12" and
# other scripts' digits ("١٢").
DECIMAL = re.compile(r"-?[0-9]+")
AUTO = "auto"  # `simulate --kv-splits auto`
PARAM_INTEGER = re.compile(r"-?(0[xX][0-9a-fA-F]+|0[oO][0-7]+|0[bB][01]+|[0-9]+)")


def _int(text: str) -> int:
    """An integer option's value (argparse's `type`)."""
    if not DECIMAL.fullmatch(text):
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}")
    return int(text)


def _splits(text: str) -> int | str:
    """`--kv-splits`: a count, or auto (simulate: the splits follow the lengths)."""
    return AUTO if text == AUTO else _int(text)


def _parse_params(texts: list[str]) -> tuple[tuple[str, object], ...]:
    params: dict[str, object] = {}
    for text in texts:
        name, value = _parse_param(text)
        if name in params:
            raise UsageError(f"--param {name} is given twice")
        params[name] = value
    return tuple(params.items())


def _parse_operands(texts: list[str]) -> dict[str, object]:
    """`--operand NAME=VALUE`s: an integer, else a number; a tensor as numbers separated by
    commas (one axis) or a `.npy` file (checked against the kernel's declaration where it
    is known)."""
    operands: dict[str, object] = {}
    for text in texts:
        name, sep, value = text.partition("=")
        if not sep or not name:
            raise UsageError(f"--operand takes NAME=VALUE, got {text!r}")
        if name in operands:
            raise UsageError(f"--operand {name} is given twice")
        if value.endswith(".npy"):
            operands[name] = _load_npy(name, value)
        elif "," in value:
            operands[name] = tuple(_number(name, v) for v in value.split(","))
        else:
            operands[name] = _number(name, value)
    return operands


def _number(name: str, text: str) -> int | float:
    if DECIMAL.fullmatch(text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"--operand {name} takes a number, got {text!r}") from None


def _load_npy(name: str, path: str):
    import numpy as np
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise UsageError(f"--operand {name}: cannot read {path}: {err}") from None


def _parse_param(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise UsageError(f"--param takes NAME=VALUE, got {text!r}")
    if value in ("true", "false"):
        return name, value == "true"
    if PARAM_INTEGER.fullmatch(value):
        try:
            return name, int(value, 0)
        except ValueError:  # a leading zero ("010"): left to the parameter's type check
            pass
    return name, value


def _seqlens(args: argparse.Namespace) -> list[int]:
    if args.seqlens:
        if args.seqlen is not None:
            raise UsageError("give --seqlen or --seqlens, not both")
        if args.batch is not None:
            raise UsageError(f"--seqlens gives the batch: drop --batch {args.batch}")
        entries = [x.strip() for x in args.seqlens.split(",")]
        if not all(DECIMAL.fullmatch(x) for x in entries):
            raise UsageError(f"--seqlens takes comma-separated integers, got {args.seqlens!r}")
        lens = [int(x) for x in entries]
    elif args.seqlen is not None:
        lens = [args.seqlen] * (args.batch or 1)
    else:
        raise UsageError("give --seqlen S (with --batch B) or --seqlens L1,L2,...")
    if not 1 <= len(lens) <= GRID_LIMITS[2]:
        raise UsageError(f"--seqlens takes 1 to {GRID_LIMITS[2]} lengths, got {len(lens)}")
    if any(not 0 <= n <= MAX_SEQLEN for n in lens):
        raise UsageError(f"sequence lengths must be between 0 and {MAX_SEQLEN} (int32)")
    return lens


def cmd_simulate(args: argparse.Namespace) -> int:
    text, base = read_source(args.file)
    _, program = front_end(text, args.file, base, args.include)
    if args.scheduler not in program.schedulers:
        raise UsageError(f"no scheduler '{args.scheduler}' in {args.file} (it has: "
                         f"{', '.join(program.schedulers) or 'none'})")
    try:  # a work space past the simulator's bounds is a usage error, found before any work
        sequences, cost, gqa = _work_space(args, program)
    except ValueError as err:
        raise UsageError(str(err)) from None
    spec = SchedulerSpec(args.scheduler, args.params, sequences.tile, gqa)
    result = simulate(program, spec, sequences, ctas=args.ctas, cost=cost,
                      num_sms=args.num_sms, ctas_per_sm=args.ctas_per_sm)
    if args.plot:
        _save_plot(lambda: plot_timeline(result, args.plot), args.plot, "--plot")
    if args.json:
        print(json.dumps(result.summary()))
    else:
        print(f"scheduler {args.scheduler}: grid {result.grid}, {result.tiles} tiles on "
              f"{args.ctas} CTAs")
        print(f"  {result.message}")
        unit = "" if result.unit == "KV-tile iterations" else f" {result.unit}"
        makespan = "stopped" if result.makespan is None else f"{result.makespan:g}{unit}"
        print(f"  makespan {makespan}, lower bound {result.lower_bound:g}{unit}, "
              f"efficiency {'n/a' if result.efficiency is None else f'{result.efficiency:.1%}'}")
        loads = result.per_cta_load
        if loads:
            print(f"  per-CTA load: min {min(loads):g}, max {max(loads):g}")
        if loads and result.makespan is not None and result.makespan > max(loads):
            print("  (per-CTA load counts tile time only; the makespan also holds the "
                  "scheduler's steps between tiles: advances, queue atomics, CTA starts)")
    return 0 if result.covered_exactly_once else 3


def _work_space(args: argparse.Namespace, program):
    """The work space `simulate` runs the scheduler over, its cost model and GQA group."""
    cost, sequences, gqa = args.cost or "causal", args.sequences, args.gqa or 1
    if args.kernel:
        cost = _kernel_costs(program, args.kernel, args.file, args.operands,
                             len(args.lengths), args.heads, args.lengths)
        sequences = Batch(args.lengths, args.heads, cost.block_m, ragged=sequences.ragged)
        gqa, declared = _kernel_gqa(program, args)
        print(f"cost model of kernel {args.kernel} ({cost.block_m}x{cost.block_n} tile), "
              f"constants from {cost.source}" + (f"; {gqa} query heads per K/V head "
                                                 f"({declared})" if declared else ""),
              file=sys.stderr)
    if args.backward:
        from mhadsl.host.backward import backward_work
        sequences = backward_work(args.lengths, args.heads, args.tile, sequences.ragged)
        print(f"backward work space: {len(args.lengths)} sequences x {args.heads} K/V heads, "
              f"K/V tiles of {args.tile} rows (prompt tile t is K/V tile n-1-t; a work tile "
              f"loops over the query tiles of its K/V head's query heads)", file=sys.stderr)
    if args.kv_splits == AUTO:
        sequences, cost = _balanced_decode_work(args)
    elif args.kv_splits:
        from mhadsl.analysis.valid_work import split_tiles
        from mhadsl.codegen.backends.decode import even_chunk
        from mhadsl.host.serving import decode_work
        sequences = decode_work(len(args.lengths), args.heads, args.kv_splits)
        chunk = even_chunk(max(max(args.lengths, default=0), 1), args.kv_splits, 64)
        tiles = [-(-max(n, 0) // 64) for n in args.lengths]

        def cost(tile) -> int:  # (prompt offset = split, head, sequence): its KV tiles
            offset, _, b = tile
            return split_tiles(tiles[b], chunk // 64, offset)
        print(f"decode work space: {len(args.lengths)} sequences x {args.heads} K/V heads x "
              f"{args.kv_splits} KV splits of {chunk} keys (a work tile packs a K/V head's "
              f"query heads)", file=sys.stderr)
    return sequences, cost, gqa


def _balanced_decode_work(args: argparse.Namespace):
    """`simulate --kv-splits auto`: the work space of a decode launch whose splits follow
    the lengths (`--seqlens`: cache lengths; one query row, 64-row KV tiles, the planner's
    chunks for `--num-sms` multiprocessors), as the split index kernel builds it
    (`valid_work.balanced_splits`), and its cost: the KV tiles of each work tile's split."""
    from mhadsl.analysis.valid_work import balanced_splits, split_tiles
    from mhadsl.codegen.backends.decode import MIN_SPLIT_TILES, packed_rows
    from mhadsl.host.serving import CHUNKS_PER_SM
    group, slots = args.gqa or 1, CHUNKS_PER_SM * (args.num_sms or args.ctas)
    q_tiles, splits = balanced_splits(
        args.lengths, 1, gqa_group=group, rows=packed_rows(1, group), block_n=64,
        capacity=max(args.lengths, default=0), appends=False, kv_heads=args.heads,
        slots=slots, max_splits=MAX_KV_SPLITS, min_tiles=MIN_SPLIT_TILES, max_q_tiles=1)
    print(f"decode work space: {len(args.lengths)} sequences x {args.heads} K/V heads; KV "
          f"splits by length ({slots} chunks, 64-row KV tiles): "
          f"{', '.join(map(str, splits.tolist()))}", file=sys.stderr)
    tiles = [-(-max(n, 0) // 64) for n in args.lengths]

    def cost(tile) -> int:  # (prompt offset = q tile x splits + split, head, sequence)
        offset, _, b = tile
        n, s = tiles[b], int(splits[b])
        return split_tiles(n, -(-n // s), offset % s)
    return Batch((q_tiles * splits).tolist(), args.heads, 1, ragged=True), cost


def _kernel_gqa(program, args: argparse.Namespace) -> tuple[int, str]:
    """Query heads per K/V head as kernel `args.kernel` declares them (`gqa` or `kv_heads`),
    with the declaration in words ("" when it declares neither); a contradicting --gqa or
    a --heads the kernel cannot run is an error."""
    options = resolve_attention(program.attentions[args.kernel])
    if options.gqa is None and options.kv_heads is None:
        return args.gqa or 1, ""
    setting = f"gqa = {options.gqa}" if options.gqa else f"kv_heads = {options.kv_heads}"
    if args.heads % (options.gqa or options.kv_heads):
        raise UsageError(f"--heads {args.heads} is not a multiple of kernel {args.kernel}'s "
                         f"{setting}")
    gqa = options.gqa or args.heads // options.kv_heads
    if args.gqa is not None and args.gqa != gqa:
        raise UsageError(f"--gqa {args.gqa} contradicts kernel {args.kernel}'s {setting}")
    return gqa, f"declared {setting}"


def _operands(options, given: dict, runs: bool = True, batch: int = 0,
              heads: int = 0, lengths=None) -> dict:
    """The values of a kernel's operands: `--operand`s, else their defaults. A tensor
    given is checked against the `batch` sequences and `heads` query heads as a call checks
    it, and, given the sequences' `lengths` (the simulator's), its `queries`/`keys` axes
    against the rows its cost model reads (every sequence's one after another, or with a
    `batch` axis the longest sequence's); a command that `runs` the kernel needs one for
    each tensor operand (a tensor has no default, and the call copies it to the device),
    while the simulator's cost model takes the elements of one not given as unknown."""
    import numpy as np
    from mhadsl.host.calls import TENSOR_OPERAND_DTYPES, check_tensor_operand
    tensors = {}
    for o in options.operands:
        if not o.axes:
            continue
        if runs and o.name not in given:
            raise UsageError(f"kernel '{options.name}' reads tensor operand '{o.name}' "
                             f"({o.declared}): give --operand {o.name}=V1,V2,... (or a "
                             f".npy file)")
        if o.name in given:
            value = np.asarray(given[o.name])
            want = TENSOR_OPERAND_DTYPES[o.type]
            if value.dtype.kind not in ("iu" if o.type == "i32" else "iuf"):
                raise UsageError(f"--operand {o.name}: tensor operand '{o.name}' "
                                 f"({o.declared}) takes {want} elements, got {value.dtype}")
            if o.type == "i32" and value.size and not (
                    -2**31 <= value.min() and value.max() < 2**31):
                raise UsageError(f"--operand {o.name}: an element is out of i32's range")
            if o.type == "f32" and value.dtype.kind == "f":
                with np.errstate(over="ignore"):  # a finite number no f32 holds
                    if np.any(np.isfinite(value) & ~np.isfinite(value.astype(want))):
                        raise UsageError(f"--operand {o.name}: an element is out of f32's "
                                         f"range")
            try:
                tensors[o.name] = value.astype(want)
                rows = None
                if lengths is not None and {"queries", "keys"} & set(o.axes):
                    rows = max(lengths, default=0) if "batch" in o.axes else sum(lengths)
                check_tensor_operand(o, tensors[o.name], batch, heads, (rows, rows))
            except (TypeError, ValueError, OverflowError) as err:
                raise UsageError(f"--operand {o.name}: {err}") from None
    try:
        scalars = operand_values(dataclasses.replace(options, operands=tuple(
            o for o in options.operands if not o.axes)),
            {n: v for n, v in given.items() if n not in tensors})
    except (TypeError, ValueError) as err:
        raise UsageError(f"--operand: {err}") from None
    return {**scalars, **tensors}


def _kernel_costs(program, kernel: str, path: str, operands: dict, batch: int, heads: int,
                  lengths=None):
    """The cost model of attention `kernel` as the preferred sm_90a design builds it: its
    declared mask and tile, with the constants calibrated for it (`mhadsl trace
    --calibrate`, on any GPU), else the defaults."""
    from mhadsl.analysis import costmodel
    from mhadsl.build import KernelRequest, plan
    if kernel not in program.attentions:
        raise UsageError(f"no attention kernel '{kernel}' in {path} (it has: "
                         f"{', '.join(program.attentions) or 'none'})")
    resolved = plan(program, KernelRequest(kernel, "sm_90a"))
    config = resolved.configs[0]
    key = costmodel.kernel_key(program, kernel, resolved.backend.name, "sm_90a")
    costs, source = costmodel.load(key)  # at the tile width it was calibrated with
    block_n = costs.block_n if source != "defaults" else config.block_n
    return costmodel.KernelCostModel(costs.for_block_n(block_n), program,
                                     resolved.options.mask, config.block_m, block_n, source,
                                     resolved.backend.producer_ahead,
                                     _operands(resolved.options, operands, False, batch,
                                               heads, lengths), resolved.options.operands)


def _save_plot(draw, path: str, flag: str) -> None:
    """Run `draw`, which writes the image: the checks before any work cannot foresee
    every refusal (/proc takes no new files, even from root)."""
    try:
        draw()
    except OSError as err:
        raise UsageError(f"cannot write {flag} {path}: {err.strerror or err}") from None


def _load_program(args: argparse.Namespace):
    """The checked program of FILE, as the Python API holds it."""
    from mhadsl.host.api import Program
    text, base = read_source(args.file)
    _, checked = front_end(text, args.file, base, args.include)
    return Program(text, args.file, checked)


def cmd_trace(args: argparse.Namespace) -> int:
    from mhadsl.analysis import trace
    from mhadsl.host.bench import NoTorch, require_gpu
    from mhadsl.runtime.driver import NoGpuError
    program = _load_program(args)
    if args.kernel not in program.attentions:
        raise UsageError(f"no attention kernel '{args.kernel}' in {args.file} (it has: "
                         f"{', '.join(program.attentions) or 'none'})")
    if args.scheduler is not None and args.scheduler not in program.schedulers:
        raise UsageError(f"no scheduler '{args.scheduler}' in {args.file} (it has: "
                         f"{', '.join(program.schedulers) or 'none'})")
    gqa = _decode_gqa(program, args) if args.kv_splits is not None else None
    options = program[args.kernel].options
    if args.calibrate and any(o.axes for o in options.operands):
        raise UsageError(f"--calibrate runs batches of its own: kernel '{args.kernel}' reads "
                         f"a tensor operand, which fits one batch; trace a batch instead")
    operands = _operands(options, args.operands, True, len(args.lengths or ()),
                         args.heads * (gqa or 1))
    try:
        require_gpu()
    except (NoGpuError, NoTorch) as err:
        raise UsageError(f"{err}: `mhadsl trace` runs the kernel (`mhadsl simulate --kernel` "
                         f"predicts without)") from None
    if args.calibrate:
        costs, path, runs = trace.calibrate(program, args.kernel, backend=args.backend,
                                            heads=args.heads, operands=operands)
        print(f"calibrated {args.kernel} on {runs[0].gpu} ({runs[0].backend}) from "
              f"{sum(len(r.records['start']) for r in runs)} work items of {len(runs)} runs:")
        for c in costs:
            print(f"  {c.block_n}-key KV tiles: " + ", ".join(
                f"{k} {v:.0f} ns" for k, v in vars(c).items() if k != "block_n"))
        print(f"  stored in {path}")
    if args.lengths is None:
        return 0
    if args.kv_splits is not None:
        return _trace_decode(args, program, gqa, operands)
    workload = trace.Workload(args.heads, args.batch, args.seqlen or 0,
                              tuple(args.lengths) if args.seqlens else None)
    run = trace.run_trace(program, args.kernel, workload, scheduler=args.scheduler,
                          args=args.params, backend=args.backend, operands=operands)
    model = trace.cost_model(program, run)
    result = trace.predict(program, run, model)
    comparison = trace.compare(run, result)
    problems = _coverage_problems(run)
    _print_trace_header(args, run, "every valid tile exactly once", problems)
    print(f"  kernel {run.ms_untraced:.3f} ms untraced ({run.tflops:.1f} TFLOP/s), "
          f"{run.ms_traced:.3f} ms traced: recording costs {run.overhead:+.1%}")
    print(f"  makespan efficiency: measured {comparison.measured.efficiency:.1%}, predicted "
          f"{comparison.predicted.efficiency:.1%} (constants: {model.source})")
    print("  where they differ:")
    for note in comparison.differences:
        print(f"    {note}")
    if args.out:
        _save_plot(lambda: trace.plot(run, comparison, args.out), args.out, "--out")
        print(f"  wrote {args.out}")
    if args.json:
        _write(Path(args.json), json.dumps(_trace_json(args, run, {
            "measured_efficiency": comparison.measured.efficiency,
            "predicted_efficiency": comparison.predicted.efficiency,
            "costs": vars(model.costs), "costs_from": model.source})), [source_path(args.file)])
    return 0 if not problems and result.covered_exactly_once else 3


def _trace_decode(args: argparse.Namespace, program, gqa: int, operands: dict) -> int:
    """`mhadsl trace --kv-splits N`: a decode launch traced; its work space covered exactly
    once and every combine complete (`trace.check_combines`), next to the simulator's
    proof for the same work space and grid."""
    from mhadsl.analysis import trace
    by_length = args.kv_splits == AUTO
    workload = trace.DecodeWorkload(args.heads, tuple(args.lengths),
                                    0 if by_length else args.kv_splits, gqa,
                                    args.query_rows, args.page_size or 0)
    run = trace.run_decode_trace(program, args.kernel, workload, scheduler=args.scheduler,
                                 args=args.params, operands=operands)
    result = trace.predict(program, run, "uniform")
    work, combines = run.work, run.combines
    problems = _coverage_problems(run)
    splits = f"splits by length {', '.join(map(str, work.by_length))}, " if by_length else \
        f"{work.num_splits} splits of {work.kv_chunk} positions, "
    _print_trace_header(args, run, "every (sequence, K/V head, q tile, split) exactly once",
                        problems, splits)
    wrong = combines.problems()
    print(f"  combines: {combines.needed} groups ran more than one split: "
          + ("each combined once, after its last split" if not wrong else "; ".join(wrong)))
    print(f"  kernel {run.ms_untraced:.3f} ms untraced ({run.tbps:.2f} TB/s of K/V), "
          f"{run.ms_traced:.3f} ms traced: recording costs {run.overhead:+.1%}")
    simulated = "n/a" if result.efficiency is None else f"{result.efficiency:.1%}"
    print(f"  makespan efficiency: measured {run.timeline().efficiency:.1%}; simulated "
          f"{simulated} (uniform tile cost), {result.message}")
    if args.json:
        _write(Path(args.json), json.dumps(_trace_json(args, run, {
            "num_splits": work.num_splits, "kv_chunk": work.kv_chunk,
            "splits_by_length": list(work.by_length),
            "q_tiles": work.q_tiles, "covered_exactly_once": not problems,
            "combines": {"needed": combines.needed, "missing": combines.missing,
                         "repeated": combines.repeated, "early": combines.early,
                         "unexpected": combines.unexpected},
            "simulated_covered_exactly_once": result.covered_exactly_once})),
               [source_path(args.file)])
    return 0 if not problems and not wrong and result.covered_exactly_once else 3


def _decode_gqa(program, args: argparse.Namespace) -> int:
    """Query heads per K/V head of a decode trace (`--heads` counts K/V heads): `--gqa`,
    or the kernel's declared `gqa`; a contradicting one, or `--heads` other than a
    declared `kv_heads`, is an error."""
    options = program[args.kernel].options
    if options.kv_heads is not None and args.heads != options.kv_heads:
        raise UsageError(f"--heads {args.heads} (the K/V heads of a decode trace) contradicts "
                         f"kernel {args.kernel}'s kv_heads = {options.kv_heads}")
    if options.gqa is not None and args.gqa is not None and args.gqa != options.gqa:
        raise UsageError(f"--gqa {args.gqa} contradicts kernel {args.kernel}'s "
                         f"gqa = {options.gqa}")
    return options.gqa or args.gqa or 1


def _coverage_problems(run) -> list[str]:
    return [f"{len(v)} {k}" for k, v in (("missing", run.missing), ("repeated",
            run.repeated), ("invalid", run.invalid)) if v]


def _print_trace_header(args: argparse.Namespace, run, covered: str, problems: list[str],
                        launch: str = "") -> None:
    print(f"{args.kernel} under {run.scheduler} on {run.workload.describe()}: {launch}grid "
          f"{run.grid}, {run.ctas_per_sm} CTAs per SM x {run.num_sms} SMs ({run.gpu}, "
          f"{run.backend})")
    items = int((run.records["kind"] == TRACE_WORK_ITEM).sum())
    print(f"  trace: {items} work items, "
          + (covered if not problems else "; ".join(problems) + " work items"))


def _trace_json(args: argparse.Namespace, run, fields: dict) -> dict:
    return {"kernel": args.kernel, "scheduler": run.scheduler,
            "workload": run.workload.describe(), "gpu": run.gpu, "backend": run.backend,
            "grid": list(run.grid), "ms_untraced": run.ms_untraced,
            "ms_traced": run.ms_traced, **fields,
            "records": {k: v.tolist() for k, v in run.records.items()}}


def _problem(args: argparse.Namespace, kernel):
    from mhadsl.host.bench import Problem
    kv_heads = args.kv_heads or args.heads
    if args.seqlens:
        return Problem(0, 0, 0, args.heads, kv_heads, kernel.options.head_dim,
                       tuple(args.lengths))
    return Problem(args.batch, args.seqlen, args.seqlen_k or args.seqlen, args.heads, kv_heads,
                   kernel.options.head_dim)


def cmd_run(args: argparse.Namespace) -> int:
    from mhadsl.host.bench import NoTorch, check, measure, require_gpu
    from mhadsl.runtime.driver import NoGpuError
    program = _load_program(args)
    if args.kernel not in program.attentions:
        raise UsageError(f"no attention kernel '{args.kernel}' in {args.file} (it has: "
                         f"{', '.join(program.attentions) or 'none'})")
    kernel = program[args.kernel]
    problem = _problem(args, kernel)
    operands = _operands(kernel.options, args.operands, True, args.batch, args.heads)
    try:
        torch = require_gpu()
    except (NoGpuError, NoTorch) as err:
        if args.no_gpu_ok:
            print(f"{err}; skipped the run")
            return 0
        print(f"error: {err}", file=sys.stderr)
        return 2
    error, finite = check(torch, kernel, problem, operands=operands)
    row = measure(torch, kernel, problem, operands)
    ok = finite and error < 1e-2
    print(f"{kernel.name} on {problem.describe()}: relative error {error:.2e} "
          f"({'ok' if ok else 'FAILED'}), {row.ms:.3f} ms, {row.tflops:.1f} TFLOP/s")
    return 0 if ok else 3


def cmd_bench(args: argparse.Namespace) -> int:
    from mhadsl.host.bench import NoTorch, format_table, require_gpu, run_suite
    from mhadsl.runtime.driver import NoGpuError
    try:
        torch = require_gpu()
    except (NoGpuError, NoTorch) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, bf16 forward, TFLOP/s = 4*B*H*Sq*Sk*D over the "
          f"pairs the mask keeps")
    print(format_table(run_suite(torch)))
    return 0


# Integer options: (flag, least, most). Past these a run would only wrap around, exceed a
# CUDA grid limit, or run for minutes.
INT_OPTIONS = {
    "heads": ("--heads", 1, GRID_LIMITS[1]),
    "kv_heads": ("--kv-heads", 1, GRID_LIMITS[1]),
    "batch": ("--batch", 1, GRID_LIMITS[2]),
    "tile": ("--tile", 16, 256),
    "ctas": ("--ctas", 1, MAX_SIMULATED_CTAS),
    "num_sms": ("--num-sms", 1, MAX_SIMULATED_CTAS),
    "ctas_per_sm": ("--ctas-per-sm", 1, 64),
    "gqa": ("--gqa", 1, 1 << 16),
    "seqlen": ("--seqlen", 0, MAX_SEQLEN),
    "seqlen_k": ("--seqlen-k", 0, MAX_SEQLEN),
}


def validate(args: argparse.Namespace) -> None:
    """Every command-line check, right after parsing and before any work; derived values
    (`params`, `lengths`, `sequences`) are stored on `args`."""
    for folder in getattr(args, "include", ()):
        try:
            check_include_dir(folder)
        except OSError as err:
            raise UsageError(f"-I {folder}: {err.strerror}") from None
    for dest, (flag, least, most) in INT_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is not None and not least <= value <= most:
            raise UsageError(f"{flag} must be between {least} and {most}, got {value}")
    if getattr(args, "tile", None) is not None and args.tile % 16:
        raise UsageError(f"--tile must be a multiple of 16, got {args.tile}")
    # What commands write is never what they read: the FILE (imports are known later).
    inputs = [source_path(args.file)] if hasattr(args, "file") else []
    if args.command == "compile" and args.output is not None:
        _check_output(args.output, "-o", inputs, folder=True)
    if args.command == "run" and args.kv_heads is not None and args.heads % args.kv_heads:
        raise UsageError(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if args.command in ("simulate", "run", "trace"):
        args.operands = _parse_operands(args.operand)
        if args.command == "simulate" and args.operands and not args.kernel:
            raise UsageError("--operand gives a value to an operand of --kernel's "
                             "declaration: give --kernel")
    if args.command in ("simulate", "run"):
        args.lengths = _seqlens(args)
        args.batch = len(args.lengths)
    if args.command == "trace":
        _check_decode_trace(args)
        args.params = _parse_params(args.param)
        args.lengths = (_seqlens(args) if args.seqlens or args.seqlen is not None
                        else None)
        args.batch = len(args.lengths or ())
        if args.lengths is None and not args.calibrate:
            raise UsageError("give --seqlen S (with --batch B) or --seqlens L1,L2,... "
                             "(or --calibrate alone)")
        if args.params and args.scheduler is None:
            raise UsageError("--param binds a parameter of --scheduler: give --scheduler")
        if args.out is not None:
            _check_plot(args.out, "--out", inputs)
        if args.json is not None:
            _check_output(args.json, "--json", inputs)
    if args.command == "simulate":
        if args.kernel and args.cost:
            raise UsageError("--kernel costs tiles as that kernel runs them: drop --cost")
        if args.kv_splits is not None and (args.kernel or args.kv_splits != AUTO and
                                           not 1 <= args.kv_splits <= MAX_KV_SPLITS):
            raise UsageError(f"--kv-splits takes 1 to {MAX_KV_SPLITS} splits or auto, "
                             f"without --kernel")
        if args.backward and (args.kernel or args.kv_splits is not None or args.gqa):
            raise UsageError("--backward simulates the backward's K/V tiles of --heads K/V "
                             "heads: without --kernel, --kv-splits or --gqa")
        if args.tile is None:  # the query tile, or the backward's K/V tile
            args.tile = BackwardConfig.block_n if args.backward else 128
        if args.gqa and args.heads % args.gqa:
            raise UsageError(f"--gqa {args.gqa} must divide --heads {args.heads}")
        args.params = _parse_params(args.param)
        try:
            args.sequences = Batch(args.lengths, args.heads, args.tile,
                                   ragged=args.seqlens is not None)
        except ValueError as err:
            raise UsageError(str(err)) from None
        if args.plot is not None:
            _check_plot(args.plot, "--plot", inputs)


def _check_decode_trace(args: argparse.Namespace) -> None:
    """The options of a decode trace (`--kv-splits`) go together, and with nothing that
    belongs to a prefill trace."""
    decode_only = [flag for flag, given in (("--gqa", args.gqa is not None),
                                            ("--query-rows", args.query_rows != 1),
                                            ("--page-size", args.page_size is not None))
                   if given]
    if args.kv_splits is None:
        if decode_only:
            raise UsageError(f"{decode_only[0]} belongs to a decode trace: give --kv-splits N")
        return
    if args.kv_splits != AUTO and not 1 <= args.kv_splits <= MAX_KV_SPLITS:
        raise UsageError(f"--kv-splits takes 1 to {MAX_KV_SPLITS} splits or auto, got "
                         f"{args.kv_splits}")
    prefill_only = [flag for flag, given in (("--calibrate", args.calibrate),
                                             ("--out", args.out), ("--backend", args.backend))
                    if given]
    if prefill_only:
        raise UsageError(f"--kv-splits traces a decode launch (the decode design, no cost "
                         f"model): drop {prefill_only[0]}")
    if not 1 <= args.query_rows <= MAX_DECODE_ROWS:
        raise UsageError(f"--query-rows must be between 1 and {MAX_DECODE_ROWS}, got "
                         f"{args.query_rows}")
    if args.page_size is not None and args.page_size not in PAGE_SIZES:
        raise UsageError(f"--page-size takes {', '.join(map(str, PAGE_SIZES))}, got "
                         f"{args.page_size}")


def _check_plot(text: str, flag: str, inputs: list[Path]) -> None:
    """An image matplotlib will write: an output (`_check_output`) named with a suffix of a
    format it writes (it would add .png to a name without one)."""
    _check_output(text, flag, inputs)
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"{flag} needs matplotlib: pip install 'mhadsl[plot]'")
    from matplotlib.backend_bases import FigureCanvasBase  # only here: slow to import
    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(text).suffix[1:].lower() not in formats:
        raise UsageError(f"cannot write {flag} {text}: matplotlib writes only files named "
                         + ", ".join(f".{name}" for name in sorted(formats)))


class _Parser(argparse.ArgumentParser):
    """Command-line mistakes are one line, `error: ...`, and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _include_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("-I", dest="include", action="append", default=[], metavar="DIR",
                   help="a folder imports may also come from (searched after the importing "
                        "file's folder; repeatable)")


def _operand_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--operand", action="append", default=[], metavar="NAME=VALUE",
                   help="the value of an operand of --kernel's declaration (an i32 or f32 its "
                        "mask and score read; default: the declared one), e.g. "
                        "--operand window=512; a tensor operand's elements, comma-separated, "
                        "or a .npy file (--operand prefix=100,2500)")


def _batch_arguments(p: argparse.ArgumentParser) -> None:
    """The batch a scheduler is simulated or a kernel traced on: dense or ragged."""
    p.add_argument("--batch", type=_int, help="sequences (with --seqlen; default 1)")
    p.add_argument("--seqlen", type=_int, help="length of every sequence (dense)")
    p.add_argument("--seqlens", help="ragged lengths, comma-separated, e.g. 8192,4096,0")
    p.add_argument("--heads", type=_int, default=16)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mhadsl", description="Compile .mha attention kernels and tile schedulers.")
    parser.add_argument("--version", action="version", version=f"mhadsl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("check", help="parse and check .mha files")
    p.add_argument("files", nargs="+", metavar="FILE")
    _include_argument(p)
    p.set_defaults(run=cmd_check)

    p = sub.add_parser("compile", help="compile a .mha file to LLVM IR, PTX or cubin")
    p.add_argument("file", metavar="FILE")
    p.add_argument("-o", "--output", metavar="OUT", help="write the artifact here")
    p.add_argument("--emit", choices=("llvm", "ptx", "cubin"), default="ptx")
    p.add_argument("--arch", choices=GPU_ARCHS, default="sm_90a")
    p.add_argument("--tile", type=_int, default=128, help="tile height for schedulers")
    p.add_argument("--kernel", metavar="NAME",
                   help="emit only this attention kernel's units (build no other)")
    p.add_argument("--pass", dest="pass_name", choices=(*PASSES, "all"), default="forward",
                   help="which build of each attention kernel: the forward (default), the "
                        "backward pass's kernels, a decode step against a paged KV cache, "
                        "or all three")
    p.add_argument("--deterministic", action="store_true",
                   help="the backward pass in deterministic mode (bitwise repeatable "
                        "gradients, as a call with deterministic=True runs it)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the summary")
    _include_argument(p)
    p.set_defaults(run=cmd_compile)

    p = sub.add_parser("simulate", help="simulate a scheduler on the host and prove coverage")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--scheduler", required=True, metavar="NAME")
    _batch_arguments(p)
    p.add_argument("--tile", type=_int,
                   help="query tile height (BM, default 128); with --backward the K/V tile's "
                        "(default 64)")
    p.add_argument("--gqa", type=_int,
                   help="query heads per K/V head (the value of gqa_group; divides --heads; "
                        "default 1, or the declared ratio of --kernel)")
    p.add_argument("--ctas", type=_int, default=132, help="simulated multiprocessors")
    p.add_argument("--num-sms", type=_int, help="value of num_sms (default: --ctas)")
    p.add_argument("--ctas-per-sm", type=_int, default=1,
                   help="value of ctas_per_sm (an H200 runs two sm80 D128 CTAs per SM: "
                        "--ctas 264 --num-sms 132 --ctas-per-sm 2)")
    p.add_argument("--cost", choices=tuple(COST_MODELS),
                   help="tile cost: KV tiles visited under a causal mask (default), or all "
                        "(uniform)")
    p.add_argument("--kernel", metavar="NAME",
                   help="cost tiles as attention kernel NAME runs them (ns): its declared "
                        "mask and tile, with its calibration (mhadsl trace --calibrate)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="bind a scheduler parameter, e.g. --param order=PROMPT_ROTATE")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="PNG", help="draw a per-CTA timeline")
    p.add_argument("--kv-splits", type=_splits, metavar="N|auto",
                   help="simulate a decode launch: --heads K/V heads, the lengths cache "
                        "lengths; N KV splits per (sequence, K/V head), or auto: the splits "
                        "follow the lengths, as a call's default does where its cache holds "
                        "more than 2,048 keys a sequence")
    p.add_argument("--backward", action="store_true",
                   help="simulate the backward pass's main kernel: the K/V tiles of the "
                        "lengths (the keys') for --heads K/V heads")
    _operand_argument(p)
    _include_argument(p)
    p.set_defaults(run=cmd_simulate)

    p = sub.add_parser("run", help="run an attention kernel on random inputs (needs a GPU)")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--kernel", required=True, metavar="NAME")
    p.add_argument("--batch", type=_int, help="sequences (with --seqlen; default 1)")
    p.add_argument("--seqlen", type=_int, help="query (and key) length, dense")
    p.add_argument("--seqlen-k", type=_int, help="key length when it differs (dense)")
    p.add_argument("--seqlens", help="ragged lengths, comma-separated")
    p.add_argument("--heads", type=_int, default=16)
    p.add_argument("--kv-heads", type=_int, help="key/value heads (GQA/MQA); default --heads")
    p.add_argument("--no-gpu-ok", action="store_true",
                   help="without a GPU, say so and exit 0 (else exit 2)")
    _operand_argument(p)
    _include_argument(p)
    p.set_defaults(run=cmd_run)

    p = sub.add_parser("trace", help="run a kernel recording every work item; draw the "
                                     "measured timeline next to the simulator's (GPU)")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--kernel", required=True, metavar="NAME")
    _batch_arguments(p)
    p.add_argument("--scheduler", metavar="NAME", help="run it in place of the kernel's own")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="bind a parameter of --scheduler, e.g. --param order=PROMPT_ROTATE")
    p.add_argument("--backend", choices=backends.REGISTRY, help="force a kernel design")
    p.add_argument("--out", metavar="PNG", help="draw measured and predicted timelines")
    p.add_argument("--json", metavar="FILE", help="write the records and both efficiencies")
    p.add_argument("--calibrate", action="store_true",
                   help="first measure the kernel's cost constants on this GPU and store "
                        "them for the simulator")
    p.add_argument("--kv-splits", type=_splits, metavar="N|auto",
                   help="trace a decode launch with N KV splits (the planner may use fewer, "
                        "none empty), or auto: the call's default (splits that follow the "
                        "lengths where the cache holds more than 2,048 keys a sequence); the "
                        "lengths are the sequences' cache lengths, --heads counts K/V heads; "
                        "checks every (sequence, K/V head, q tile, split) ran once and every "
                        "split group combined once, after its last split")
    p.add_argument("--gqa", type=_int,
                   help="with --kv-splits: query heads per K/V head (default 1, or the "
                        "kernel's declared gqa)")
    p.add_argument("--query-rows", type=_int, default=1,
                   help=f"with --kv-splits: query rows per sequence (1 to {MAX_DECODE_ROWS})")
    p.add_argument("--page-size", type=_int,
                   help=f"with --kv-splits: a paged cache with pages of this many positions "
                        f"({', '.join(map(str, PAGE_SIZES))}); default: a contiguous cache")
    _operand_argument(p)
    _include_argument(p)
    p.set_defaults(run=cmd_trace)

    p = sub.add_parser("bench", help="time the standard shapes against torch SDPA (GPU)")
    p.set_defaults(run=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        validate(args)
        return args.run(args)
    except MhaError as err:
        print(err.render(), file=sys.stderr)
        return 1
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
