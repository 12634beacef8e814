"""`mhadsl trace`: run a kernel with per-work-item recording and compare it with the simulator.

The traced build (`KernelRequest(trace=True)`) has one thread per CTA write, for every work
item it runs, the tile, the CTA, the multiprocessor and the %globaltimer before and after
the tile body (`runtime.trace_records`), into a workspace of its own; nothing else in the
kernel changes, and the time it costs is measured (traced against untraced kernel time).
The simulator runs the same scheduler on the same batch with the kernel's cost model
(`mhadsl.analysis.costmodel`: the declared mask's tile classes and calibrated constants), and the
two timelines are drawn one above the other, per multiprocessor, with the makespan
efficiency of each.

Needs a GPU and PyTorch (inputs and timing); the comparison, the fit and the drawing work
on recorded data anywhere (`Timeline`, `costmodel.fit`, `plot`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from mhadsl import abi

from mhadsl.analysis import costmodel
from mhadsl.front.attention_spec import operand_values
from mhadsl.host.api import Kernel, Program
from mhadsl.codegen import backends
from mhadsl.codegen.scheduler import SchedulerSpec
from mhadsl.runtime import trace_records
from mhadsl.host.serving import CHUNKS_PER_SM, decode_work, splits_used
from mhadsl.analysis.simulate import Batch, SimulationResult, simulate
from mhadsl.analysis.valid_work import balanced_splits
from mhadsl.codegen.backends.decode import MIN_SPLIT_TILES

# The calibration runs: one batch per layout, one scheduler per constant it measures.
CALIBRATION_BATCHES = ((4, 4096, None), (0, 0, (8192, 4096, 2048, 1024, 512, 256, 128, 64) * 2))
CALIBRATION_SCHEDULERS = (("Persistent", ()), ("LPT", ()), ("Transient", ()))


@dataclass
class Timeline:
    """Work items on lanes (a multiprocessor's CTA slots, or the simulator's slots): columns
    `lane`, `start`, `end` (ns from the first start) and the tile (`prompt_offset`, `head`,
    `batch`); `slots` is how many CTAs run at once."""

    columns: dict[str, np.ndarray]
    slots: int

    @property
    def makespan(self) -> float:
        c = self.columns
        return float(c["end"].max() - c["start"].min()) if len(c["start"]) else 0.0

    @property
    def busy(self) -> float:
        c = self.columns
        return float((c["end"] - c["start"]).sum())

    @property
    def lower_bound(self) -> float:
        """max(total work / slots, the longest item): no schedule finishes sooner."""
        c = self.columns
        longest = float((c["end"] - c["start"]).max()) if len(c["start"]) else 0.0
        return max(self.busy / self.slots, longest)

    @property
    def efficiency(self) -> float:
        return self.lower_bound / self.makespan if self.makespan else 1.0

    @classmethod
    def from_records(cls, records: dict[str, np.ndarray], num_sms: int, ctas_per_sm: int
                     ) -> Timeline:
        """Measured items onto lanes sm * ctas_per_sm + k: on each multiprocessor, an item
        takes the lane that has been free longest (CTAs resident together get their own)."""
        order = np.lexsort((records["start"], records["sm"]))
        lane = np.zeros(len(order), np.int64)
        free: dict[int, list[int]] = {}
        for i in order.tolist():
            sm = int(records["sm"][i])
            ends = free.setdefault(sm, [])
            start = int(records["start"][i])
            idle = [k for k, e in enumerate(ends) if e <= start]
            k = min(idle, key=lambda k: ends[k]) if idle else (
                len(ends) if len(ends) < ctas_per_sm else int(np.argmin(ends)))
            if k == len(ends):
                ends.append(0)
            ends[k] = int(records["end"][i])
            lane[i] = sm * ctas_per_sm + k
        t0 = records["start"].min() if len(records["start"]) else 0
        columns = {"lane": lane, "start": (records["start"] - t0).astype(np.float64),
                   "end": (records["end"] - t0).astype(np.float64),
                   **{k: records[k] for k in ("prompt_offset", "head", "batch", "cta")}}
        return cls(columns, max(num_sms * ctas_per_sm, 1))

    @classmethod
    def from_simulation(cls, result: SimulationResult) -> Timeline:
        t = result.trace
        keep = t["valid"]
        start = t["start"][keep]
        columns = {"lane": t["slot"][keep], "start": start, "end": start + t["duration"][keep],
                   "prompt_offset": t["offset"][keep], "head": t["head"][keep],
                   "batch": t["b"][keep], "cta": t["cta"][keep]}
        return cls(columns, result.ctas)

    def gaps(self) -> np.ndarray:
        """Idle time between consecutive items of one CTA (its scheduler steps)."""
        c = self.columns
        order = np.lexsort((c["start"], c["cta"]))
        same = c["cta"][order][1:] == c["cta"][order][:-1]
        return (c["start"][order][1:] - c["end"][order][:-1])[same]

    def lane_gaps(self) -> np.ndarray:
        """Idle time between consecutive items of one lane run by different CTAs."""
        c = self.columns
        order = np.lexsort((c["start"], c["lane"]))
        lane, cta = c["lane"][order], c["cta"][order]
        turn = (lane[1:] == lane[:-1]) & (cta[1:] != cta[:-1])
        return (c["start"][order][1:] - c["end"][order][:-1])[turn]


def coverage(records: dict[str, np.ndarray], batch: Batch) -> tuple[list, list, list]:
    """(missing, repeated, invalid) tiles of a trace against the batch's valid tiles."""
    seen: dict[tuple, int] = {}
    for tile in zip(records["prompt_offset"].tolist(), records["head"].tolist(),
                    records["batch"].tolist()):
        seen[tile] = seen.get(tile, 0) + 1
    valid = batch.valid_tiles()
    return (sorted(valid - seen.keys()), sorted(t for t, n in seen.items() if n > 1),
            sorted(seen.keys() - valid))


# ------------------------------------------------------------------ the GPU side
@dataclass
class Workload:
    """One launch's shape: dense (`batch` x `seqlen`) or ragged (`seqlens`), `heads`."""

    heads: int
    batch: int = 0
    seqlen: int = 0
    seqlens: tuple[int, ...] | None = None

    @property
    def lengths(self) -> list[int]:
        return list(self.seqlens) if self.seqlens is not None else [self.seqlen] * self.batch

    def describe(self) -> str:
        if self.seqlens is None:
            return f"dense B{self.batch} S{self.seqlen} H{self.heads}"
        return f"ragged {len(self.seqlens)} seqs, {sum(self.seqlens)} tokens, H{self.heads}"


@dataclass
class TraceRun:
    """One traced launch and what was measured around it."""

    kernel: str
    scheduler: str
    scheduler_args: tuple
    workload: Workload
    gpu: str
    backend: str
    arch: str
    block_m: int
    block_n: int
    num_sms: int
    ctas_per_sm: int
    grid: tuple[int, int, int]
    records: dict[str, np.ndarray]
    written: int  # records the kernel tried to write (== len(records) unless it overflowed)
    ms_untraced: float
    ms_traced: float
    flops: float
    missing: list = field(default_factory=list)
    repeated: list = field(default_factory=list)
    invalid: list = field(default_factory=list)
    gqa_group: int = 1  # the scheduler's `gqa_group` (a decode launch's query heads per K/V head)
    operands: dict = field(default_factory=dict)  # the values of the kernel's operands

    @property
    def overhead(self) -> float:
        """Traced kernel time over untraced, minus 1."""
        return self.ms_traced / self.ms_untraced - 1.0

    @property
    def tflops(self) -> float:
        return self.flops / (self.ms_untraced * 1e-3) / 1e12

    @property
    def batch(self) -> Batch:
        return Batch(self.workload.lengths, self.workload.heads, self.block_m,
                     ragged=self.workload.seqlens is not None)

    def timeline(self) -> Timeline:
        return Timeline.from_records(self.records, self.num_sms, self.ctas_per_sm)


def scheduler_kernel(program: Program, kernel: str, scheduler: str | None = None,
                     args: tuple = (), backend: str | None = None, trace: bool = False
                     ) -> Kernel:
    """A fresh `Kernel` of declaration `kernel`, run by `scheduler` (None: its own)."""
    options = program[kernel].options
    if scheduler is not None:
        options = dataclasses.replace(options, scheduler=scheduler, scheduler_args=tuple(args),
                                      scheduler_named=True)
    k = Kernel(program, options)
    k.backend, k.trace = backend, trace
    return k


def run_trace(program: Program, kernel: str, workload: Workload, *, scheduler: str | None = None,
              args: tuple = (), backend: str | None = None, reps: int = 20,
              operands: dict | None = None) -> TraceRun:
    """Trace one launch of `kernel` on random inputs of `workload` (needs a GPU and torch)
    and its operands' values `operands` (else their defaults): the untraced and traced kernel
    times (medians of `reps`), then the records of one more traced launch, checked for
    coverage."""
    import torch

    from mhadsl.host.bench import Problem, allowed_pairs, make_inputs
    from mhadsl.runtime import driver

    plain = scheduler_kernel(program, kernel, scheduler, args, backend)
    traced = scheduler_kernel(program, kernel, scheduler, args, backend, trace=True)
    w = workload
    problem = Problem(w.batch, w.seqlen, w.seqlen, w.heads, w.heads, plain.options.head_dim,
                      w.seqlens)
    inputs = make_inputs(torch, plain, problem, operands=operands)
    values = {o.name: inputs[o.name] for o in plain.options.operands}
    info = driver.device_info()
    tiles_bound = sum(-(-n // 16) for n in w.lengths) * w.heads  # any tile height >= 16
    records, written, ms_untraced, ms_traced = _record(torch, plain, traced, inputs,
                                                       tiles_bound, reps)
    planned, = traced.launcher.plans.values()  # (the one call signature it ran)
    loaded, ctas_per_sm = _traced_build(traced), planned.plans[-1].ctas_per_sm
    config = loaded.config
    spec = traced.scheduler_spec(config, loaded.design)
    grid = planned.plans[-1].grid
    run = TraceRun(kernel, spec.name, spec.args, workload, info.name, loaded.design.name,
                   loaded.build.arch, config.block_m, config.block_n,
                   info.multiprocessor_count, ctas_per_sm, grid, records, written,
                   ms_untraced, ms_traced,
                   4.0 * allowed_pairs(plain, problem, values) * w.heads
                   * plain.options.head_dim, operands=values)
    run.missing, run.repeated, run.invalid = coverage(records, run.batch)
    return run


def _record(torch, plain: Kernel, traced: Kernel, inputs: dict, items_bound: int, reps: int
            ) -> tuple[dict[str, np.ndarray], int, float, float]:
    """Time `plain(**inputs)` and `traced(**inputs)` (medians of `reps`), then record one
    more traced launch into a workspace of twice `items_bound` records and more (room to see
    a scheduler that repeats tiles): (records, written, ms untraced, ms traced)."""
    from mhadsl.host.bench import time_ms
    from mhadsl.runtime import driver, faults

    capacity = 2 * items_bound + 1024
    buffer = driver.DeviceBuffer(4 * trace_records.workspace_words(capacity))
    traced.trace_workspace = buffer.ptr
    stream = torch.cuda.current_stream().cuda_stream

    def traced_launch():
        driver.memset_d32_async(buffer.ptr, 0, trace_records.HEADER_WORDS, stream)
        driver.memset_d32_async(buffer.ptr + 4 * trace_records.CAPACITY_WORD, capacity, 1,
                                stream)
        traced(**inputs)

    ms_untraced = time_ms(torch, lambda: plain(**inputs), reps=reps)
    ms_traced = time_ms(torch, traced_launch, reps=reps)
    traced_launch()
    torch.cuda.synchronize()
    words = np.zeros(trace_records.workspace_words(capacity), np.uint32)
    buffer.copy_to_numpy(words)
    code, sid, cta = (int(x) for x in words[abi.RECORD_WORD:abi.RECORD_WORD + abi.RECORD_WORDS])
    if code:
        raise faults.SchedulerError(code, sid, cta)
    records, written = trace_records.decode(words)
    return records, written, ms_untraced, ms_traced


def _traced_build(traced: Kernel):
    """The one build a traced kernel ran, loaded."""
    loaded, = traced.launcher.loaded.values()
    return loaded


# ------------------------------------------------------------------ decode with split-KV
@dataclass
class DecodeWorkload:
    """One decode launch's shape: a cache of `cache_lens` positions per sequence (contiguous,
    or pages of `page_size`), `query_rows` per sequence, `kv_heads` K/V heads of `gqa` query
    heads each, and the KV splits asked for (the planner may use fewer: none left empty;
    0: none, the splits follow the lengths as a call's default)."""

    kv_heads: int
    cache_lens: tuple[int, ...]
    kv_splits: int
    gqa: int = 1
    query_rows: int = 1
    page_size: int = 0

    def describe(self) -> str:
        cache = f"pages of {self.page_size}" if self.page_size else "contiguous"
        lens = self.cache_lens
        return (f"decode B{len(lens)} cache {min(lens)}..{max(lens)} ({cache}) "
                f"Sq{self.query_rows} H{self.kv_heads * self.gqa}:{self.kv_heads}, "
                + (f"{self.kv_splits} KV splits" if self.kv_splits else "KV splits by length"))


@dataclass(frozen=True)
class DecodeWork:
    """The work space a decode launch planned (`serving._DecodePlan`): per (sequence, K/V
    head), `q_tiles` x its splits work tiles, prompt_offset = q_tile * splits + split.
    Fixed splits: `num_splits` for every sequence, split s covering cache positions
    [s * kv_chunk, (s + 1) * kv_chunk) (those past its length exit at once). Splits that
    follow the lengths (`by_length`, `valid_work.balanced_splits`): the sequence's own
    count, a ragged work space with no split left empty."""

    kv_heads: int
    cache_lens: tuple[int, ...]
    q_tiles: int
    num_splits: int
    kv_chunk: int
    by_length: tuple[int, ...] = ()  # each sequence's splits, where they follow the lengths

    def splits_of(self, b: int) -> int:
        """The work tiles per q tile of sequence b."""
        return self.by_length[b] if self.by_length else self.num_splits

    @property
    def batch(self) -> Batch:
        """The work space as the simulator sees it (`serving.decode_work`)."""
        if self.by_length:
            return Batch([self.q_tiles * n for n in self.by_length], self.kv_heads, 1, True)
        return decode_work(len(self.cache_lens), self.kv_heads, self.q_tiles * self.num_splits)

    def splits_used(self) -> dict[tuple[int, int, int], int]:
        """(sequence, K/V head, q tile) -> how many of its splits run (`serving.splits_used`)."""
        return {(b, h, q): self.by_length[b] if self.by_length else
                splits_used(n, self.kv_chunk, self.num_splits)
                for b, n in enumerate(self.cache_lens) for h in range(self.kv_heads)
                for q in range(self.q_tiles)}


@dataclass
class CombineCheck:
    """The groups (sequence, K/V head, q tile) whose combine went wrong, against `needed`
    groups that ran more than one split: `missing` (no combine), `repeated` (more than one),
    `early` (it started before one of the group's splits ended, or a split left no record),
    `unexpected` (a combine where one split or none ran)."""

    needed: int
    missing: list
    repeated: list
    early: list
    unexpected: list

    def problems(self) -> list[str]:
        return [f"{len(v)} {what}" for v, what in (
            (self.missing, "groups without a combine"), (self.repeated, "groups combined twice"),
            (self.early, "combines before their group's last split ended"),
            (self.unexpected, "combines where no split needed one")) if v]


def record_kind(records: dict[str, np.ndarray], kind: int) -> dict[str, np.ndarray]:
    """The records of one kind (`abi.TRACE_WORK_ITEM`, `abi.TRACE_COMBINE`)."""
    keep = records["kind"] == kind
    return {name: column[keep] for name, column in records.items()}


def check_combines(records: dict[str, np.ndarray], work: DecodeWork) -> CombineCheck:
    """Every group that ran more than one split combined exactly once, starting no sooner
    than every split of it ended (the traced decode kernel ends a split's record where its
    result is published, before its count; a combine's record starts after the count that
    made it last, so on one clock a correct kernel can only pass); no other group combined."""
    def split(b: int) -> int:
        return work.splits_of(b) if 0 <= b < len(work.cache_lens) else work.num_splits

    ends: dict[tuple, dict[int, int]] = {}
    items = record_kind(records, abi.TRACE_WORK_ITEM)
    for offset, head, b, end in zip(*(items[k].tolist() for k in
                                      ("prompt_offset", "head", "batch", "end"))):
        ends.setdefault((b, head, offset // split(b)), {})[offset % split(b)] = end
    starts: dict[tuple, list[int]] = {}
    combines = record_kind(records, abi.TRACE_COMBINE)
    for offset, head, b, start in zip(*(combines[k].tolist() for k in
                                        ("prompt_offset", "head", "batch", "start"))):
        starts.setdefault((b, head, offset // split(b)), []).append(start)
    used = work.splits_used()
    needed = {g for g, n in used.items() if n > 1}
    check = CombineCheck(len(needed), [], [], [], sorted(starts.keys() - needed))
    for group in sorted(needed):
        found = starts.get(group, [])
        split_ends = [ends.get(group, {}).get(s) for s in range(used[group])]
        if not found:
            check.missing.append(group)
        elif len(found) > 1:
            check.repeated.append(group)
        elif None in split_ends or found[0] < max(split_ends):
            check.early.append(group)
    return check


@dataclass
class DecodeTraceRun(TraceRun):
    """A traced decode launch: its work items are (sequence, K/V head, q tile x split)
    (`work`), its combines checked (`combines`); its throughput is the bytes of K and V it
    reads (`kv_bytes`, `tbps`), not FLOPs."""

    work: DecodeWork | None = None
    combines: CombineCheck | None = None
    kv_bytes: int = 0

    @property
    def batch(self) -> Batch:
        return self.work.batch

    @property
    def tbps(self) -> float:
        return self.kv_bytes / (self.ms_untraced * 1e-3) / 1e12

    def check(self) -> None:
        """Its work items against the work space (`missing`, `repeated`, `invalid`), and its
        combines (`combines`)."""
        items = record_kind(self.records, abi.TRACE_WORK_ITEM)
        self.missing, self.repeated, self.invalid = coverage(items, self.work.batch)
        self.combines = check_combines(self.records, self.work)


def run_decode_trace(program: Program, kernel: str, workload: DecodeWorkload, *,
                     scheduler: str | None = None, args: tuple = (), reps: int = 20,
                     operands: dict | None = None) -> DecodeTraceRun:
    """Trace one decode launch of `kernel` against a random cache of `workload` (needs a GPU
    and torch), as `run_trace` does a prefill launch; its work items are checked for
    coverage of the launch's work space and its combines with `check_combines`."""
    import torch

    from mhadsl.runtime import driver

    plain = scheduler_kernel(program, kernel, scheduler, args)
    traced = scheduler_kernel(program, kernel, scheduler, args, trace=True)
    w = workload
    values = operand_values(plain.options, operands or {})
    inputs = {**_decode_inputs(torch, plain, w), **values}
    rows_bound = -(-w.query_rows * w.gqa // 16)  # any packed tile holds 16 rows or more
    groups_bound = len(w.cache_lens) * w.kv_heads * rows_bound
    info = driver.device_info()
    # a split work tile and its combine, per split; by length, a work tile and a combine
    # per group and one more work tile per chunk aimed at
    records_bound = groups_bound * (w.kv_splits + 1) if w.kv_splits else \
        2 * groups_bound + CHUNKS_PER_SM * info.multiprocessor_count
    records, written, ms_untraced, ms_traced = _record(
        torch, plain, traced, inputs, records_bound, reps)
    planned, = traced.launcher.fast_plans.values()
    loaded, ctas_per_sm = _traced_build(traced), planned.plans[-1].ctas_per_sm
    config = loaded.config
    spec = traced.scheduler_spec(config, loaded.design)
    by_length = () if not config.balanced else tuple(balanced_splits(
        w.cache_lens, w.query_rows, gqa_group=w.gqa, rows=config.rows,
        block_n=config.block_n, capacity=_decode_capacity(w), appends=False,
        kv_heads=w.kv_heads, slots=CHUNKS_PER_SM * info.multiprocessor_count,
        max_splits=planned.num_splits,
        min_tiles=MIN_SPLIT_TILES, max_q_tiles=planned.q_tiles)[1].tolist())
    work = DecodeWork(w.kv_heads, w.cache_lens, planned.q_tiles, planned.num_splits,
                      planned.kv_chunk, by_length)
    head_dim = plain.options.head_dim
    run = DecodeTraceRun(kernel, spec.name, spec.args, workload, info.name,
                         loaded.design.name, loaded.build.arch, config.block_m,
                         config.block_n, info.multiprocessor_count, ctas_per_sm,
                         planned.plans[-1].grid, records, written, ms_untraced, ms_traced,
                         0.0,
                         gqa_group=spec.gqa_group, operands=values, work=work,
                         kv_bytes=2 * sum(w.cache_lens) * w.kv_heads * head_dim * 2)
    run.check()
    return run


def _decode_capacity(w: DecodeWorkload) -> int:
    """The cache positions per sequence `_decode_inputs` makes (whole pages)."""
    capacity = max(max(w.cache_lens), 1)
    return -(-capacity // w.page_size) * w.page_size if w.page_size else capacity


def _decode_inputs(torch, kernel: Kernel, w: DecodeWorkload) -> dict:
    """Random queries and cache for `kernel(**inputs)`: a contiguous cache, or pages in a
    random order (so a page gather is exercised)."""
    dtype = torch.bfloat16 if kernel.options.dtype == "bf16" else torch.float16
    d, batch = kernel.options.head_dim, len(w.cache_lens)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    capacity = max(max(w.cache_lens), 1)
    inputs = {"q": rand(batch, w.query_rows, w.kv_heads * w.gqa, d),
              "cache_seqlens": torch.tensor(w.cache_lens, dtype=torch.int32, device="cuda"),
              "num_splits": w.kv_splits or None}
    if not w.page_size:
        return {**inputs, "k": rand(batch, capacity, w.kv_heads, d),
                "v": rand(batch, capacity, w.kv_heads, d)}
    pages = -(-capacity // w.page_size)
    order = torch.randperm(batch * pages, generator=gen, device="cuda")
    return {**inputs, "k": rand(batch * pages, w.page_size, w.kv_heads, d),
            "v": rand(batch * pages, w.page_size, w.kv_heads, d),
            "page_table": order.reshape(batch, pages).to(torch.int32).contiguous()}


# ------------------------------------------------------------------ prediction
def cost_model(program: Program, run: TraceRun, costs: costmodel.Costs | None = None
               ) -> costmodel.KernelCostModel:
    """The cost model of `run`'s kernel as it ran: its declared mask, tile and design, with
    `costs`, else the constants calibrated for it on the run's GPU, else the defaults."""
    source = "given"
    if costs is None:
        key = costmodel.kernel_key(program.checked, run.kernel, run.backend, run.arch)
        costs, source = costmodel.load(key, run.gpu, run.block_n)
    return costmodel.KernelCostModel(costs, program.checked, program[run.kernel].options.mask,
                                     run.block_m, run.block_n, source,
                                     backends.backend(run.backend).producer_ahead,
                                     run.operands, program[run.kernel].options.operands)


def predict(program: Program, run: TraceRun, model: costmodel.KernelCostModel | str
            ) -> SimulationResult:
    """The simulator on the traced launch's batch, grid and multiprocessors, its tiles
    costed by `model` (or one of `simulate.COST_MODELS`)."""
    spec = SchedulerSpec(run.scheduler, tuple(run.scheduler_args), run.block_m, run.gqa_group)
    return simulate(program.checked, spec, run.batch, ctas=run.num_sms * run.ctas_per_sm,
                    num_sms=run.num_sms, ctas_per_sm=run.ctas_per_sm, cost=model)


def calibrate(program: Program, kernel: str, *, backend: str | None = None, heads: int = 16,
              reps: int = 5, operands: dict | None = None
              ) -> tuple[list[costmodel.Costs], str, list[TraceRun]]:
    """Measure the kernel's constants on this GPU from traced runs (`CALIBRATION_BATCHES`
    under `CALIBRATION_SCHEDULERS`), store them where the simulator finds them; returns
    them (one set per KV tile width the builds chose), the file and the runs."""
    runs = [run_trace(program, kernel, Workload(heads, b, s, lens), scheduler=name, args=args,
                      backend=backend, reps=reps, operands=operands)
            for b, s, lens in CALIBRATION_BATCHES for name, args in CALIBRATION_SCHEDULERS]
    costs = fit_runs(program, kernel, runs)
    first = runs[0]
    key = costmodel.kernel_key(program.checked, kernel, first.backend, first.arch)
    path = costmodel.store(costs, key, first.gpu, {
        "kernel": kernel, "backend": first.backend, "arch": first.arch,
        "runs": [f"{r.scheduler} on {r.workload.describe()}" for r in runs]})
    return costs, str(path), runs


def fit_runs(program: Program, kernel: str, runs: list[TraceRun]) -> list[costmodel.Costs]:
    """`costmodel.fit` over traced runs: item durations against their tile classes, per KV
    tile width (the spill-free search may give schedulers different tiles); step gaps of
    the schedulers without a queue (Persistent), with one (LPT, Queued); CTA turnover of the
    one-tile-per-CTA scheduler (Transient)."""
    options = program[kernel].options
    items: dict[int, tuple[list, list, list]] = {}
    step, queue, turnover = [], [], []
    for r in runs:
        f, p = costmodel.tile_classes(program.checked, options.mask, r.workload.lengths,
                                      r.records["prompt_offset"], r.records["head"],
                                      r.records["batch"], r.block_m, r.block_n)
        for column, values in zip(items.setdefault(r.block_n, ([], [], [])),
                                  (f, p, r.records["duration"])):
            column.append(values)
        timeline = r.timeline()
        if r.scheduler == "Transient":
            turnover.append(timeline.lane_gaps())
        elif r.scheduler in ("LPT", "Queued"):
            queue.append(timeline.gaps())
        else:
            step.append(timeline.gaps())

    def cat(parts):
        return np.concatenate(parts) if parts else None
    fitted = [costmodel.fit(*map(cat, columns), cat(step), cat(queue), cat(turnover),
                            block_n=block_n)
              for block_n, columns in sorted(items.items())]
    # CTAs without a tile leave no record: their cost is what makes the simulated
    # efficiency of the runs that have many match the traced one
    empty = [fit_empty_cta(program, r, next(c for c in fitted if c.block_n == r.block_n),
                           r.timeline().efficiency) for r in runs]
    empty = [e for e in empty if e is not None]
    if not empty:
        return fitted
    return [dataclasses.replace(c, empty_cta=float(np.median(empty))) for c in fitted]


def fit_empty_cta(program: Program, run: TraceRun, costs: costmodel.Costs,
                  target: float) -> float | None:
    """The `empty_cta` (between 0 and 4 x `cta_start`) at which the simulator predicts
    efficiency `target` for `run`'s launch; None when its grid has too few CTAs without a
    tile for that cost to matter."""
    def efficiency(empty: float) -> float:
        model = cost_model(program, run, dataclasses.replace(costs, empty_cta=empty))
        return Timeline.from_simulation(predict(program, run, model)).efficiency
    lo, hi = 0.0, 4.0 * max(costs.cta_start, 1.0)
    if efficiency(lo) - efficiency(hi) < 0.01:
        return None
    for _ in range(16):  # efficiency falls as empty CTAs cost more
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if efficiency(mid) > target else (lo, mid)
    return (lo + hi) / 2


# ------------------------------------------------------------------ comparison
@dataclass
class Comparison:
    measured: Timeline
    predicted: Timeline
    differences: list[str]


def compare(run: TraceRun, result: SimulationResult, top: int = 3) -> Comparison:
    """The two timelines and where they differ most: makespan, total work, the items whose
    predicted duration is furthest from the measured one, and the idle tails."""
    measured, predicted = run.timeline(), Timeline.from_simulation(result)
    m, p = measured.columns, predicted.columns
    notes = [f"makespan: measured {measured.makespan / 1e3:.1f} us, predicted "
             f"{predicted.makespan / 1e3:.1f} us ({_rel(predicted.makespan, measured.makespan)})",
             f"total work: measured {measured.busy / 1e3:.1f} us, predicted "
             f"{predicted.busy / 1e3:.1f} us ({_rel(predicted.busy, measured.busy)})"]
    pred_by_tile = {t: d for t, d in zip(zip(p["prompt_offset"].tolist(), p["head"].tolist(),
                                             p["batch"].tolist()),
                                         (p["end"] - p["start"]).tolist())}
    errors = []
    for t, d in zip(zip(m["prompt_offset"].tolist(), m["head"].tolist(), m["batch"].tolist()),
                    (m["end"] - m["start"]).tolist()):
        if t in pred_by_tile:
            errors.append((abs(pred_by_tile[t] - d), t, d, pred_by_tile[t]))
    for _, t, d, q in sorted(errors, reverse=True)[:top]:
        notes.append(f"tile (offset {t[0]}, head {t[1]}, seq {t[2]}): measured {d / 1e3:.1f} us, "
                     f"predicted {q / 1e3:.1f} us")
    for name, tl in (("measured", measured), ("predicted", predicted)):
        c = tl.columns
        if len(c["lane"]):
            finish = np.zeros(int(c["lane"].max()) + 1)
            np.maximum.at(finish, c["lane"], c["end"])
            tail = tl.makespan + c["start"].min() - finish
            notes.append(f"{name} idle tail per lane: mean {tail.mean() / 1e3:.1f} us, "
                         f"max {tail.max() / 1e3:.1f} us")
    return Comparison(measured, predicted, notes)


def _rel(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.1f}%" if b else "n/a"


def plot(run: TraceRun, comparison: Comparison, path: str, title: str | None = None) -> None:
    """Measured (top) and predicted (bottom) per-lane timelines in one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = run.num_sms * run.ctas_per_sm
    fig, axes = plt.subplots(2, 1, figsize=(13, max(5.0, lanes * 0.05)), sharex=True)
    longest = max(run.batch.max_num_prompt_tiles, 1)
    for ax, (name, tl) in zip(axes, (("measured", comparison.measured),
                                     ("predicted", comparison.predicted))):
        c = tl.columns
        order = np.argsort(c["lane"], kind="stable")
        lane, start, end = c["lane"][order], c["start"][order] / 1e3, c["end"][order] / 1e3
        shade = plt.cm.viridis(c["prompt_offset"][order] / run.block_m / longest)
        for k in np.unique(lane).tolist():
            sel = lane == k
            ax.broken_barh(list(zip(start[sel], end[sel] - start[sel])), (k - 0.4, 0.8),
                           facecolors=shade[sel], edgecolor="black", linewidth=0.1)
        ax.axvline(tl.lower_bound / 1e3 + c["start"].min() / 1e3, color="red", linestyle="--",
                   label="lower bound")
        ax.set_ylabel("SM x CTA slot" if name == "measured" else "simulated slot")
        ax.set_title(f"{name}: makespan {tl.makespan / 1e3:.1f} us, efficiency "
                     f"{tl.efficiency:.1%}")
        ax.set_ylim(-1, lanes)
        ax.legend(loc="upper right")
    axes[1].set_xlabel("time (us); colour: query tile (dark = first)")
    fig.suptitle(title or f"{run.kernel} under {run.scheduler} on {run.workload.describe()} "
                 f"({run.gpu}, {run.backend})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
