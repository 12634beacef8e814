"""Host simulation of a scheduler: run its host-compiled rules for a grid of CTAs.

The rules are the same LLVM IR the GPU runs, JIT-compiled for this CPU. Each CTA is one
simulated thread (thread 0, the producer), the queue counter and shared slots are host
memory, and a cost model says how long each tile takes. Dynamic schedulers are simulated
event by event: whichever CTA finishes first takes the next index. The result proves
every valid tile was processed exactly once and no invalid tile was, and reports the
makespan against the lower bound max(total / ctas, longest tile).

Speed: the event loop itself is JIT-compiled next to the rules (`mhadsl.codegen.simulator`
emits it): it calls them directly, takes each tile's cost from a table of tile ids, logs
every tile into one array a column, and keeps the busy slots in a heap; coverage, costs and
the lower bound are NumPy over tile ids. A batch of 10,000 ragged sequences (~1.1M work items) takes
1-5 s per standard scheduler. What it takes is bounded (`MAX_SIMULATED_*`): a batch or a
grid past them is refused before anything runs.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from mhadsl.analysis.valid_work import tile_index
from mhadsl.front.semantics import GRID_LIMITS, SLOT_COUNT
from mhadsl.front.check import CheckedProgram
from mhadsl.codegen.handoff import runs_apart
from mhadsl.codegen.scheduler import HOST_LOOP_FUEL, SchedulerSpec, lower_scheduler
from mhadsl.codegen.simulator import (
    ENDLESS_WHILE, LOG_COLUMNS, LOG_FULL, LOOP_BUDGET, LOOP_INTEGERS, LOOP_POINTERS,
    LOOP_RESULTS, RUN_EVENTS, STEP_COSTS, STEP_LIMIT, TOO_MANY_TILES, emit_simulator,
)
from mhadsl.codegen.target import HOST, HostJit, new_module
from mhadsl.analysis.costmodel import KernelCostModel
from mhadsl.front.diagnostics import MhaError
from mhadsl.host.paged import MAX_KV_SPLITS

Tile = tuple[int, int, int]  # (prompt_offset, head_idx, prompt_idx)

MAX_SEQLEN = 2**31 - 1  # lengths and row offsets are int32 in the kernel
# What the simulator takes, measured on a loaded 2-core machine so that the largest run
# stays near 5 s and under 500 MB: about 100 bytes and 1 us a tile (its log and cost),
# 90 bytes a CTA slot, 0.2 us a grid CTA with no work, 0.05 us a work index a scheduler
# steps over.
MAX_SIMULATED_TILES = 1 << 21
MAX_SIMULATED_WORK = 1 << 23  # work indices: the longest sequence's tiles x heads x sequences
MAX_SIMULATED_CTAS = 1 << 16  # CTA slots running at once
MAX_SIMULATED_GRID = 1 << 22  # CTAs of the launch grid
# `while` iterations of all rule calls together (a legitimate loop skips work indices:
# at most MAX_SIMULATED_WORK in all); about 1 ns each.
MAX_SIMULATED_LOOP_ITERATIONS = 1 << 28


# The records the rules take, as `codegen.lower` lays them out for the host.
class _Env(ctypes.Structure):
    _fields_ = [("counter", ctypes.c_void_p), ("num_sms", ctypes.c_uint32),
                ("block_idx", ctypes.c_uint32 * 3), ("grid_dim", ctypes.c_uint32 * 3),
                ("thread_idx", ctypes.c_uint32 * 3), ("fuel", ctypes.c_int64),
                ("ctas_per_sm", ctypes.c_uint32)]


class _TileSummary(ctypes.Structure):
    _fields_ = [("batch_size", ctypes.c_uint32), ("max_num_prompt_tiles", ctypes.c_uint32),
                ("max_seq_len", ctypes.c_uint32), ("num_heads", ctypes.c_uint32),
                ("valid_length", ctypes.c_void_p), ("tile_index", ctypes.c_void_p)]


class _State(ctypes.Structure):
    _fields_ = [("idx", ctypes.c_uint32), ("slots", ctypes.c_void_p),
                ("max_idx", ctypes.c_uint32)]


class _WorkInfo(ctypes.Structure):
    _fields_ = [("prompt_offset", ctypes.c_uint32), ("head_idx", ctypes.c_uint32),
                ("prompt_idx", ctypes.c_uint32), ("is_valid", ctypes.c_uint8)]


class _SeqInfo(ctypes.Structure):
    _fields_ = [("seq_len", ctypes.c_uint32), ("start_of_seq", ctypes.c_uint32),
                ("prompt_offset", ctypes.c_uint32), ("head_idx", ctypes.c_uint32),
                ("prompt_idx", ctypes.c_uint32)]


_P = ctypes.c_void_p
_U32 = ctypes.c_uint32


class HostScheduler:
    """A scheduler specialisation compiled for this CPU, callable rule by rule."""

    def __init__(self, program: CheckedProgram, spec: SchedulerSpec):
        self.spec = spec
        module = new_module(f"host_{spec.name}", HOST)
        lowered = lower_scheduler(module, program, spec, HOST)
        emit_simulator(module, lowered)
        self.may_advance = lowered.may_advance
        self.runs_apart = runs_apart(program, lowered.decl)
        self.grid_rule = next(r for r in lowered.decl.rules if r.name == "grid_dim")
        self.llvm_ir = str(module)
        self.jit = HostJit(module)
        names = {k: fn.name for k, fn in lowered.functions.items()}

        def fn(name: str, restype, *argtypes):
            return ctypes.CFUNCTYPE(restype, *argtypes)(self.jit.address(name))

        self.grid_dim = fn(names["grid_dim"], None, _P, _P, _U32, _U32, _P)
        self.splits_rule = next((r for r in lowered.decl.rules if r.name == "kv_splits"), None)
        self._kv_splits = fn(names["kv_splits"], None, _P, _P, _U32, _U32, _P) \
            if self.splits_rule else None
        self.run_events = fn(RUN_EVENTS, None, _P, _P, _P, _P)
        self.advance = fn(names[lowered.advance_name(True, "ALL")], ctypes.c_bool,
                          _P, _P, _P, _U32, _P)

    def grid(self, batch_size: int, max_num_prompt_tiles: int, max_seq_len: int,
             num_heads: int, num_sms: int, ctas_per_sm: int = 1) -> tuple[int, int, int]:
        """The launch grid from the scheduler's own `grid_dim` rule, within CUDA's limits
        (an `MhaError` at the rule past them)."""
        env = _host_env(num_sms, ctas_per_sm)
        ts = _TileSummary(batch_size, max_num_prompt_tiles, max_seq_len, num_heads)
        out = (ctypes.c_uint32 * 3)()
        self.grid_dim(ctypes.byref(env), ctypes.byref(ts), batch_size, max_num_prompt_tiles, out)
        _require_fuel_left(env, self.grid_rule)
        grid = (out[0], out[1], out[2])
        if 0 in grid and max_num_prompt_tiles:  # with no work nothing is launched
            raise MhaError(f"grid_dim gives {grid}: no CTAs; CUDA launches at least one CTA "
                           f"along each axis ({batch_size} sequences of up to "
                           f"{max_num_prompt_tiles} tiles x {num_heads} heads)",
                           self.grid_rule.span)
        if any(g > limit for g, limit in zip(grid, GRID_LIMITS)):
            raise MhaError(f"grid_dim gives {grid} for {batch_size} sequences of up to "
                           f"{max_num_prompt_tiles} tiles x {num_heads} heads; CUDA allows "
                           f"x below 2^31 and y, z at most 65535", self.grid_rule.span)
        return grid

    def kv_splits(self, batch_size: int, max_seq_len: int, kv_heads: int, num_sms: int,
                  ctas_per_sm: int = 1) -> int | None:
        """The KV splits of a decode launch from the scheduler's `kv_splits` rule (None
        without one, or where it returns 0: the planner's default); an `MhaError` at the rule
        past MAX_KV_SPLITS."""
        if self._kv_splits is None:
            return None
        env = _host_env(num_sms, ctas_per_sm)
        ts = _TileSummary(batch_size, 1, max_seq_len, kv_heads)
        out = ctypes.c_uint32()
        self._kv_splits(ctypes.byref(env), ctypes.byref(ts), batch_size, max_seq_len,
                        ctypes.byref(out))
        _require_fuel_left(env, self.splits_rule)
        if out.value > MAX_KV_SPLITS:
            raise MhaError(f"kv_splits gives {out.value} for {batch_size} sequences of up to "
                           f"{max_seq_len} cached keys x {kv_heads} K/V heads; a decode "
                           f"launch takes at most {MAX_KV_SPLITS}", self.splits_rule.span)
        return out.value or None


def _host_env(num_sms: int, ctas_per_sm: int) -> _Env:
    """The environment of a host rule's call, with a full tank of `while` fuel."""
    env = _Env(None, num_sms)
    env.ctas_per_sm = ctas_per_sm
    env.fuel = HOST_LOOP_FUEL
    return env


def _require_fuel_left(env: _Env, rule) -> None:
    """A host rule whose `while` loops emptied the tank was stopped, not finished: what it
    returned means nothing."""
    if env.fuel <= 0:
        raise MhaError(f"{rule.name}'s `while` loops ran {HOST_LOOP_FUEL} iterations without "
                       f"ending", rule.span)


@dataclass
class Batch:
    """The sequences of one launch: their query lengths, head count and tile height."""

    seqlens: list[int]
    heads: int
    tile: int
    ragged: bool

    def __post_init__(self):
        self.seqlens = [int(n) for n in self.seqlens]
        if self.heads < 1 or self.tile < 1:
            raise ValueError("a batch needs at least 1 head and a tile of at least 1 row")
        if any(not 0 <= n <= MAX_SEQLEN for n in self.seqlens):
            raise ValueError(f"sequence lengths must be between 0 and {MAX_SEQLEN}")
        if self.ragged and sum(self.seqlens) > MAX_SEQLEN:
            raise ValueError(f"a ragged batch holds at most {MAX_SEQLEN} rows (int32 offsets)")
        if self.num_tiles > MAX_SIMULATED_TILES:
            raise ValueError(f"the batch has {self.num_tiles} tiles; the simulator takes at "
                             f"most {MAX_SIMULATED_TILES}")
        if self.num_work > MAX_SIMULATED_WORK:
            raise ValueError(f"the batch's work space is {self.num_work} indices (its longest "
                             f"sequence's tiles x heads x sequences); the simulator takes at "
                             f"most {MAX_SIMULATED_WORK}")

    @property
    def tiles_per_seq(self) -> np.ndarray:
        return -(-np.asarray(self.seqlens, np.int64) // self.tile)

    @property
    def num_tiles(self) -> int:
        return int(self.tiles_per_seq.sum()) * self.heads

    @property
    def max_num_prompt_tiles(self) -> int:
        return int(self.tiles_per_seq.max(initial=0))

    @property
    def num_work(self) -> int:
        """The work indices of a launch (`ts.num_work()`)."""
        return self.max_num_prompt_tiles * self.heads * len(self.seqlens)

    def valid_tiles(self) -> set[Tile]:
        return {(q * self.tile, h, b) for b, n in enumerate(self.tiles_per_seq.tolist())
                for h in range(self.heads) for q in range(n)}


# The cost of a tile in KV-tile iterations (`_TileIds.costs`); a callable on a Tile, or a
# kernel's calibrated `costmodel.KernelCostModel` (nanoseconds, its declared mask) also work.
COST_MODELS = {"causal": "the KV tiles a causal query tile visits (Sq == Sk): the default",
               "uniform": "all KV tiles of its sequence (non-causal)"}
Cost = str | Callable[[Tile], float] | KernelCostModel


class _TileIds:
    """Valid tiles numbered densely: sequence-major, then head, then query tile."""

    def __init__(self, batch: Batch):
        self.batch = batch
        self.counts = batch.tiles_per_seq
        per_seq = self.counts * batch.heads
        self.base = np.concatenate(([0], np.cumsum(per_seq)[:-1])).astype(np.int64)
        self.total = int(per_seq.sum())

    def ids(self, offset: np.ndarray, head: np.ndarray, b: np.ndarray) -> np.ndarray:
        """The id of each tile, -1 where it is not a valid tile."""
        batch = self.batch
        if not batch.seqlens:
            return np.full(len(offset), -1, np.int64)
        in_batch = b < len(batch.seqlens)
        bb = np.where(in_batch, b, 0)
        q = offset // batch.tile
        valid = in_batch & (head < batch.heads) & (offset % batch.tile == 0) & \
            (q < self.counts[bb])
        return np.where(valid, self.base[bb] + head * self.counts[bb] + q, -1)

    def tiles(self, ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offset, head, b) of each of `ids` (default: every id)."""
        batch = self.batch
        if ids is None:
            b = np.repeat(np.arange(len(batch.seqlens)), self.counts * batch.heads)
            rank = np.arange(self.total) - self.base[b]
        else:  # a sequence without tiles shares its base with the next: take the last
            b = np.searchsorted(self.base, ids, side="right") - 1
            rank = ids - self.base[b]
        counts = self.counts[b]
        return (rank % np.maximum(counts, 1)) * batch.tile, rank // np.maximum(counts, 1), b

    def costs(self, cost: Cost, block_n: int) -> np.ndarray:
        offset, head, b = self.tiles()
        if isinstance(cost, KernelCostModel):
            return cost.item_costs(self.batch.seqlens, offset, head, b)
        lens = np.asarray(self.batch.seqlens, np.int64)[b]
        if cost == "causal":
            return -(-np.minimum(offset + self.batch.tile, lens) // block_n).astype(np.float64)
        if cost == "uniform":
            return (-(-lens // block_n)).astype(np.float64)
        if isinstance(cost, str):
            raise ValueError(f"unknown cost model {cost!r} (have {', '.join(COST_MODELS)})")
        return np.array([float(cost(t)) for t in zip(offset.tolist(), head.tolist(),
                                                     b.tolist())], np.float64)


@dataclass
class SimulationResult:
    scheduler: str
    grid: tuple[int, int, int]
    ctas: int
    covered_exactly_once: bool
    terminated: bool  # False when a rule never ended or the simulator stopped the run
    makespan: float | None  # None for a run that did not terminate: it measures nothing
    lower_bound: float
    efficiency: float | None  # lower_bound / makespan; None when coverage failed
    total_work: float
    tiles: int
    missing: list[Tile] = field(default_factory=list)
    repeated: list[Tile] = field(default_factory=list)
    invalid: list[Tile] = field(default_factory=list)
    per_cta_load: list[float] = field(default_factory=list)
    message: str = ""
    unit: str = "KV-tile iterations"  # of every time; "ns" under a KernelCostModel
    # Every processed tile in order: grid CTA, simulated slot, start, duration, tile.
    trace: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def visits(self) -> dict[int, list[Tile]]:
        """Grid CTA -> the tiles it processed, in order."""
        out: dict[int, list[Tile]] = {}
        t = self.trace
        for cta, tile in zip(t["cta"].tolist(), zip(t["offset"].tolist(), t["head"].tolist(),
                                                   t["b"].tolist())):
            out.setdefault(cta, []).append(tile)
        return out

    @property
    def timeline(self) -> list[tuple[int, float, float, Tile]]:
        """(slot, start, end, tile) of every valid tile processed."""
        t = self.trace
        keep = t["valid"]
        return [(slot, start, start + d, tile) for slot, start, d, tile in zip(
            t["slot"][keep].tolist(), t["start"][keep].tolist(), t["duration"][keep].tolist(),
            zip(t["offset"][keep].tolist(), t["head"][keep].tolist(), t["b"][keep].tolist()))]

    def summary(self) -> dict:
        return {"scheduler": self.scheduler, "grid": list(self.grid), "ctas": self.ctas,
                "covered_exactly_once": self.covered_exactly_once,
                "terminated": self.terminated, "makespan": self.makespan,
                "lower_bound": self.lower_bound, "efficiency": self.efficiency,
                "total_work": self.total_work, "tiles": self.tiles,
                "missing": [list(t) for t in self.missing[:20]],
                "repeated": [list(t) for t in self.repeated[:20]],
                "invalid": [list(t) for t in self.invalid[:20]],
                "per_cta_load": self.per_cta_load, "message": self.message}


class _NoTermination(Exception):
    pass


class _Run:
    """One simulation's host memory and its record of processed tiles."""

    def __init__(self, sched: HostScheduler, batch: Batch, ctas: int, num_sms: int,
                 grid: tuple[int, int, int], ctas_per_sm: int = 1):
        self.sched, self.ctas, self.grid = sched, ctas, grid
        self.counter = ctypes.c_uint32(0)
        self.offsets = np.concatenate(([0], np.cumsum(batch.seqlens, dtype=np.int64))
                                      ).astype(np.int32)
        # What the tile index kernel builds on the GPU before a ragged launch.
        self.tile_index = tile_index(batch.tiles_per_seq)
        self.ts = _TileSummary(len(batch.seqlens), batch.max_num_prompt_tiles,
                               max(batch.seqlens, default=0), batch.heads,
                               self.offsets.ctypes.data if batch.ragged else None,
                               self.tile_index.ctypes.data if batch.ragged else None)
        self.env = _Env(ctypes.addressof(self.counter), num_sms)
        self.env.ctas_per_sm = ctas_per_sm
        self.env.grid_dim[:] = grid
        self.env_p, self.ts_p = ctypes.addressof(self.env), ctypes.addressof(self.ts)
        # Per simulated slot: the running CTA's state, shared slots and last SeqInfo.
        self.states = (_State * ctas)()
        self.slot_words = (ctypes.c_uint32 * (SLOT_COUNT * ctas))()
        self.seqs = (_SeqInfo * ctas)()
        self.info = _WorkInfo()
        self.valid = ctypes.c_uint8()
        self.busy: list[float] = []
        self.makespan = 0.0
        # A row per processed tile (its SeqInfo valid): LOG_COLUMNS -> column.
        self.log = {name: np.zeros(0) for name in LOG_COLUMNS}
        self.stopped = ""  # why the simulator stopped the run, when no rule failed


def simulate(program: CheckedProgram, spec: SchedulerSpec, batch: Batch, *, ctas: int = 132,
             cost: Cost = "causal", block_n: int | None = None,
             num_sms: int | None = None, max_steps: int | None = None,
             ctas_per_sm: int = 1) -> SimulationResult:
    """Run the scheduler over `batch` on `ctas` simulated slots (each runs one CTA at a
    time); `num_sms` and `ctas_per_sm` are the values the rules see (default: `ctas`, 1).
    A `KernelCostModel` also charges its step costs (`STEP_COSTS`) between tiles.

    Not terminating means a `while` loop that runs HOST_LOOP_FUEL iterations in one rule
    call, `while` loops that run MAX_SIMULATED_LOOP_ITERATIONS in all, a CTA that takes more
    tiles than all the work plus one (the GPU's own bound), or more than `max_steps`
    advances in all (default 2 x (work + CTAs) + 10,000).
    """
    if ctas < 1:
        raise ValueError("the simulator needs at least 1 CTA slot")
    if ctas > MAX_SIMULATED_CTAS:
        raise ValueError(f"the simulator runs at most {MAX_SIMULATED_CTAS} CTAs at once, not "
                         f"{ctas}")
    sched = HostScheduler(program, spec)
    ids = _TileIds(batch)
    costs = ids.costs(cost, block_n or batch.tile)
    grid = sched.grid(len(batch.seqlens), batch.max_num_prompt_tiles,
                      max(batch.seqlens, default=0), batch.heads, num_sms or ctas, ctas_per_sm)
    n_ctas = grid[0] * grid[1] * grid[2]
    if n_ctas > MAX_SIMULATED_GRID:
        raise MhaError(f"grid_dim gives {grid}: {n_ctas} CTAs; the simulator runs at most "
                       f"{MAX_SIMULATED_GRID}", sched.grid_rule.span)
    run = _Run(sched, batch, ctas, num_sms or ctas, grid, ctas_per_sm)
    num_work = batch.num_work
    result = SimulationResult(spec.name, grid, ctas, False, True, 0.0, 0.0, None, 0.0,
                              ids.total)
    step_costs = np.zeros(len(STEP_COSTS))
    if isinstance(cost, KernelCostModel):
        result.unit = "ns"
        step_costs[:] = [getattr(cost.costs, name) for name in STEP_COSTS]
        if cost.producer_ahead and sched.runs_apart:  # the atomic is a work tile ahead
            step_costs[STEP_COSTS.index("queue_op")] = 0.0
    try:
        _run_events(run, ids, costs, step_costs, n_ctas, num_work,
                    max_steps or 2 * (num_work + n_ctas) + 10_000)
    except _NoTermination as stop:
        result.terminated = False
        result.message = f"scheduler does not terminate: {stop}"
    _finish(result, run, ids, costs)
    return result


def _run_events(run: _Run, ids: _TileIds, costs: np.ndarray, step_costs: np.ndarray,
                n_ctas: int, num_work: int, step_limit: int) -> None:
    """The grid on the slots, event by event, in the JIT-compiled loop
    (`mhadsl.codegen.simulator`)."""
    n = run.ctas
    arrays = {"time": np.zeros(n), "ticket": np.zeros(n, np.int64),
              "heap": np.zeros(n, np.int32), "linear": np.zeros(n, np.int32),
              "pipe": np.zeros(n, np.int32), "taken": np.zeros(n, np.int64),
              "counts": ids.counts.astype(np.int64), "base": ids.base.astype(np.int64),
              "lens": np.asarray(ids.batch.seqlens, np.int64), "cost": costs,
              # A correct run records each tile once: one row more proves a repeat.
              **{name: np.zeros(ids.total + 1) for name in LOG_COLUMNS},
              "busy": np.zeros(n), "out": np.zeros(len(LOOP_RESULTS), np.int64),
              "step_costs": np.asarray(step_costs, np.float64)}
    a = ctypes.addressof
    memory = {"states": a(run.states), "slot_words": a(run.slot_words), "seqs": a(run.seqs),
              "info": a(run.info), "valid": a(run.valid)}
    ptrs = np.array([memory[k] if k in memory else arrays[k].ctypes.data for k in LOOP_POINTERS],
                    np.uint64).view(np.int64)
    ints = np.array([{"n_slots": n, "n_ctas": n_ctas, "num_work": num_work,
                      "step_limit": step_limit, "loop_budget": MAX_SIMULATED_LOOP_ITERATIONS,
                      "n_seqs": len(ids.batch.seqlens), "heads": ids.batch.heads,
                      "tile": ids.batch.tile, "log_cap": ids.total + 1}[k]
                     for k in LOOP_INTEGERS], np.int64)
    run.sched.run_events(run.env_p, run.ts_p, ptrs.ctypes.data, ints.ctypes.data)
    status, steps, log_n, makespan_bits, cta = arrays["out"].tolist()
    run.log = {name: arrays[name][:log_n] for name in LOG_COLUMNS}
    run.busy = arrays["busy"].tolist()
    run.makespan = float(np.int64(makespan_bits).view(np.float64))
    if status == ENDLESS_WHILE:
        raise _NoTermination("a `while` loop in the scheduler never ends")
    if status == LOOP_BUDGET:
        raise _NoTermination(f"its `while` loops ran more than {MAX_SIMULATED_LOOP_ITERATIONS} "
                             f"iterations in all")
    if status == TOO_MANY_TILES:
        raise _NoTermination(f"CTA {cta} took more than all {num_work} work items plus one")
    if status == STEP_LIMIT:
        raise _NoTermination(f"more than {step_limit} advance steps for {num_work} work items")
    if status == LOG_FULL:
        run.stopped = (f"stopped after {log_n} tiles, more than the batch's {ids.total}: "
                       f"some tile was processed twice")


def _finish(result: SimulationResult, run: _Run, ids: _TileIds, costs: np.ndarray) -> None:
    """Coverage over tile ids, the lower bound, efficiency and the message."""
    # The log's integer columns become int64 one by one, each f64 column let go once it is
    # converted: the log's memory, not twice it, is the simulator's peak.
    trace = {}
    for name in LOG_COLUMNS:
        column = run.log.pop(name)
        trace[name] = column if name in ("start", "duration") else column.astype(np.int64)
        del column
    visited = ids.ids(trace["offset"], trace["head"], trace["b"])
    trace["valid"] = visited >= 0
    result.trace = trace
    times = np.bincount(visited[visited >= 0], minlength=ids.total)

    def tiles(where: np.ndarray) -> list[Tile]:
        offset, head, b = ids.tiles(np.flatnonzero(where))
        return list(zip(offset.tolist(), head.tolist(), b.tolist()))

    result.missing = sorted(tiles(times == 0))
    result.repeated = sorted(tiles(times > 1))
    bad = visited < 0
    result.invalid = sorted(set(zip(trace["offset"][bad].tolist(), trace["head"][bad].tolist(),
                                    trace["b"][bad].tolist())))
    result.terminated = result.terminated and not run.stopped
    result.covered_exactly_once = (result.terminated and not result.missing
                                   and not result.repeated and not result.invalid)
    result.makespan = run.makespan if result.terminated else None
    result.total_work = float(costs.sum())
    result.lower_bound = max(result.total_work / run.ctas, float(costs.max(initial=0.0)))
    if result.covered_exactly_once:  # a wrong run's makespan measures nothing
        result.efficiency = result.lower_bound / result.makespan if result.makespan else 1.0
    result.per_cta_load = run.busy
    if not result.message:
        problems = [f"{len(v)} {k}" for k, v in (("missing", result.missing),
                    ("repeated", result.repeated), ("invalid", result.invalid)) if v]
        result.message = ("every valid tile processed exactly once" if not problems
                          else "; ".join(problems) + " tiles")
        if run.stopped:
            result.message += f" ({run.stopped})"


def plot_timeline(result: SimulationResult, path: str) -> None:
    """Draw one row per simulated CTA slot, one bar per tile (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'mhadsl[plot]'") from None
    fig, ax = plt.subplots(figsize=(12, max(2.0, result.ctas * 0.12)))
    for slot, start, end, (_, head, seq) in result.timeline:
        ax.barh(slot, end - start, left=start, height=0.8,
                color=plt.cm.tab20((head * 7 + seq) % 20), edgecolor="black", linewidth=0.2)
    ax.axvline(result.lower_bound, color="red", linestyle="--", label="lower bound")
    ax.set_xlabel(f"time ({result.unit})")
    ax.set_ylabel("CTA slot")
    efficiency = "n/a" if result.efficiency is None else f"{result.efficiency:.1%}"
    makespan = "stopped" if result.makespan is None else f"{result.makespan:g}"
    ax.set_title(f"{result.scheduler}: makespan {makespan}, efficiency {efficiency}")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
