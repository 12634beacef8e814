"""Host simulation of a scheduler: run its host-compiled rules for a grid of CTAs.

The rules are the same LLVM IR the GPU runs, JIT-compiled for this CPU. Each CTA is one
simulated thread (thread 0, the producer), the queue counter and shared slots are host
memory, and a cost model says how long each tile takes. Dynamic schedulers are simulated
event by event: whichever CTA finishes first takes the next index. The result proves
every valid tile was processed exactly once and no invalid tile was, and reports the
makespan against the lower bound max(total / ctas, longest tile).

Speed: a CTA's first rules (initial_state, get_current_work_info, unsafe_seq_info) run in
one JIT-compiled call (`start_ctas`), for the whole grid at once when CTAs never advance;
each `advance` is one ctypes call on preallocated memory; coverage and costs are NumPy
over tile ids. A batch of 10,000 ragged sequences (~1M work items) takes seconds.
"""
from __future__ import annotations

import ctypes
import heapq
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from llvmlite import ir

from mhadsl.builtins import GRID_LIMITS
from mhadsl.check import CheckedProgram
from mhadsl.codegen import nvptx
from mhadsl.codegen.lower import ENV_FIELDS, record_type
from mhadsl.codegen.nvptx import i8, i32, i64
from mhadsl.codegen.scheduler import (
    HOST_LOOP_FUEL, LoweredScheduler, SchedulerSpec, lower_scheduler,
)
from mhadsl.codegen.target import HOST, HostJit, new_module
from mhadsl.diagnostics import MhaError
from mhadsl.types import SEQ_INFO, WORK_INFO

Tile = tuple[int, int, int]  # (prompt_offset, head_idx, prompt_idx)

MAX_SEQLEN = 2**31 - 1  # lengths and row offsets are int32 in the kernel
MAX_SIMULATED_CTAS = 1 << 24
MAX_SIMULATED_TILES = 1 << 25


class _Env(ctypes.Structure):
    _fields_ = [("counter", ctypes.c_void_p), ("num_sms", ctypes.c_uint32),
                ("block_idx", ctypes.c_uint32 * 3), ("grid_dim", ctypes.c_uint32 * 3),
                ("thread_idx", ctypes.c_uint32 * 3), ("fuel", ctypes.c_int64),
                ("ctas_per_sm", ctypes.c_uint32)]


class _TileSummary(ctypes.Structure):
    _fields_ = [("batch_size", ctypes.c_uint32), ("max_num_prompt_tiles", ctypes.c_uint32),
                ("max_seq_len", ctypes.c_uint32), ("num_heads", ctypes.c_uint32),
                ("valid_length", ctypes.c_void_p)]


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


_SEQ_DTYPE = np.dtype([(name, np.uint32) for name, _ in _SeqInfo._fields_])
_P = ctypes.c_void_p
_U32 = ctypes.c_uint32
_START = "mhadsl.sim.start_ctas"


def _emit_start_ctas(module: ir.Module, lowered: LoweredScheduler) -> None:
    """`i32 start_ctas(env*, ts*, i32 first, i32 count, slots*, State*, WorkInfo*,
    SeqInfo* seq_out, i8* valid_out)`: the first rules of CTAs first .. first+count-1.

    Each CTA's block_idx comes from its linear id and env.grid_dim; CTA k writes whether
    its WorkInfo is valid to valid_out[k] and, if so, its SeqInfo to seq_out[k] (count 1
    writes the CTA's own state). Every rule call gets a full tank of `while` fuel; the
    result is the number of CTAs started before a tank ran dry (count when none did).
    """
    p = nvptx.ptr()
    fn = ir.Function(module, ir.FunctionType(i32, [p, p, i32, i32, p, p, p, p, p]), _START)
    env, ts, first, count, slots, state, info, seq_out, valid_out = fn.args
    rules = lowered.functions
    b = ir.IRBuilder(fn.append_basic_block("entry"))

    def env_field(name: str, axis: int | None = None) -> ir.Value:
        idx = [i32(0), i32(ENV_FIELDS.index(name))] + ([i32(axis)] if axis is not None else [])
        return b.gep(env, idx, source_etype=lowered.env_struct)

    gx, gy = (b.load(env_field("grid_dim", k), typ=i32) for k in (0, 1))
    head, body, done, dry = (fn.append_basic_block(n) for n in ("head", "body", "done", "dry"))
    entry = b.block
    b.branch(head)
    b.position_at_end(head)
    k = b.phi(i32)
    k.add_incoming(i32(0), entry)
    b.cbranch(b.icmp_unsigned("<", k, count), body, done)

    b.position_at_end(body)
    linear = b.add(first, k)
    for axis, v in enumerate((b.urem(linear, gx), b.urem(b.udiv(linear, gx), gy),
                              b.udiv(linear, b.mul(gx, gy)))):
        b.store(v, env_field("block_idx", axis))

    def call(rule: str, *args: ir.Value) -> None:
        b.store(i64(HOST_LOOP_FUEL), env_field("fuel"))
        b.call(rules[rule], [env, ts, *args])
        ok = fn.append_basic_block(f"{rule}_ok")
        b.cbranch(b.icmp_signed("<=", b.load(env_field("fuel"), typ=i64), i64(0)), dry, ok)
        b.position_at_end(ok)

    call("initial_state", slots, state)
    call("get_current_work_info", state, info)
    is_valid = b.load(b.gep(info, [i32(0), i32(3)], source_etype=record_type(WORK_INFO)),
                      typ=i8)
    b.store(is_valid, b.gep(valid_out, [k], source_etype=i8))
    seq = b.gep(seq_out, [k], source_etype=record_type(SEQ_INFO))
    with b.if_then(b.icmp_unsigned("!=", is_valid, i8(0))):
        call("unsafe_seq_info", state, seq)
    k.add_incoming(b.add(k, i32(1)), b.block)
    b.branch(head)

    b.position_at_end(done)
    b.ret(count)
    b.position_at_end(dry)
    b.ret(k)


class HostScheduler:
    """A scheduler specialisation compiled for this CPU, callable rule by rule."""

    def __init__(self, program: CheckedProgram, spec: SchedulerSpec):
        module = new_module(f"host_{spec.name}", HOST)
        lowered = lower_scheduler(module, program, spec, HOST)
        _emit_start_ctas(module, lowered)
        self.may_advance = lowered.may_advance
        self.grid_rule = next(r for r in lowered.decl.rules if r.name == "grid_dim")
        self.llvm_ir = str(module)
        self.jit = HostJit(module)
        names = {k: fn.name for k, fn in lowered.functions.items()}

        def fn(name: str, restype, *argtypes):
            return ctypes.CFUNCTYPE(restype, *argtypes)(self.jit.address(name))

        self.grid_dim = fn(names["grid_dim"], None, _P, _P, _U32, _U32, _P)
        self.start_ctas = fn(_START, _U32, _P, _P, _U32, _U32, _P, _P, _P, _P, _P)
        self.advance = fn(names[lowered.advance_name(True, "ALL")], ctypes.c_bool,
                          _P, _P, _P, _U32, _P)

    def grid(self, batch_size: int, max_num_prompt_tiles: int, max_seq_len: int,
             num_heads: int, num_sms: int, ctas_per_sm: int = 1) -> tuple[int, int, int]:
        """The launch grid from the scheduler's own `grid_dim` rule, within CUDA's limits
        (an `MhaError` at the rule past them)."""
        env = _Env(None, num_sms)
        env.ctas_per_sm = ctas_per_sm
        env.fuel = HOST_LOOP_FUEL
        ts = _TileSummary(batch_size, max_num_prompt_tiles, max_seq_len, num_heads)
        out = (ctypes.c_uint32 * 3)()
        self.grid_dim(ctypes.byref(env), ctypes.byref(ts), batch_size, max_num_prompt_tiles, out)
        grid = (out[0], out[1], out[2])
        if any(g > limit for g, limit in zip(grid, GRID_LIMITS)):
            raise MhaError(f"grid_dim gives {grid} for {batch_size} sequences of up to "
                           f"{max_num_prompt_tiles} tiles x {num_heads} heads; CUDA allows "
                           f"x below 2^31 and y, z at most 65535", self.grid_rule.span)
        return grid


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

    @property
    def tiles_per_seq(self) -> np.ndarray:
        return -(-np.asarray(self.seqlens, np.int64) // self.tile)

    @property
    def num_tiles(self) -> int:
        return int(self.tiles_per_seq.sum()) * self.heads

    @property
    def max_num_prompt_tiles(self) -> int:
        return int(self.tiles_per_seq.max(initial=0))

    def valid_tiles(self) -> set[Tile]:
        return {(q * self.tile, h, b) for b, n in enumerate(self.tiles_per_seq.tolist())
                for h in range(self.heads) for q in range(n)}


# The cost of a tile in KV-tile iterations (`_TileIds.costs`); a callable on a Tile also works.
COST_MODELS = {"causal": "the KV tiles a causal query tile visits (Sq == Sk): the default",
               "uniform": "all KV tiles of its sequence (non-causal)"}


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

    def tiles(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offset, head, b) of every id."""
        batch = self.batch
        b = np.repeat(np.arange(len(batch.seqlens)), self.counts * batch.heads)
        rank = np.arange(self.total) - self.base[b]
        counts = self.counts[b]
        return (rank % np.maximum(counts, 1)) * batch.tile, rank // np.maximum(counts, 1), b

    def costs(self, cost: str | Callable[[Tile], float], block_n: int) -> np.ndarray:
        offset, head, b = self.tiles()
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
    terminated: bool
    makespan: float
    lower_bound: float
    efficiency: float | None  # lower_bound / makespan; None when coverage failed
    total_work: float
    tiles: int
    missing: list[Tile] = field(default_factory=list)
    repeated: list[Tile] = field(default_factory=list)
    invalid: list[Tile] = field(default_factory=list)
    per_cta_load: list[float] = field(default_factory=list)
    message: str = ""
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
                 grid: tuple[int, int, int]):
        self.sched, self.ctas, self.grid = sched, ctas, grid
        self.counter = ctypes.c_uint32(0)
        self.offsets = np.concatenate(([0], np.cumsum(batch.seqlens, dtype=np.int64))
                                      ).astype(np.int32)
        self.ts = _TileSummary(len(batch.seqlens), batch.max_num_prompt_tiles,
                               max(batch.seqlens, default=0), batch.heads,
                               self.offsets.ctypes.data if batch.ragged else None)
        self.env = _Env(ctypes.addressof(self.counter), num_sms)
        self.env.ctas_per_sm = 1  # each simulated multiprocessor runs one CTA at a time
        self.env.grid_dim[:] = grid
        self.env_p, self.ts_p = ctypes.addressof(self.env), ctypes.addressof(self.ts)
        # Per simulated slot: the running CTA's state, shared slots and last SeqInfo.
        self.states = (_State * ctas)()
        self.slot_words = (ctypes.c_uint32 * (2 * ctas))()
        self.seqs = (_SeqInfo * ctas)()
        self.info = _WorkInfo()
        self.valid = ctypes.c_uint8()
        self.busy = [0.0] * ctas
        self.makespan = 0.0
        # One row per processed tile (its SeqInfo valid): LOG_COLUMNS.
        self.log: list[tuple] = []

    def start_one(self, linear: int, slot: int) -> bool:
        """Run CTA `linear`'s first rules in `slot`: True when it has a first tile."""
        a = ctypes.addressof
        started = self.sched.start_ctas(
            self.env_p, self.ts_p, linear, 1, a(self.slot_words) + 8 * slot,
            a(self.states[slot]), a(self.info), a(self.seqs[slot]), a(self.valid))
        if started != 1:
            raise _NoTermination("a `while` loop in the scheduler never ends")
        return bool(self.valid.value)


LOG_COLUMNS = ("cta", "slot", "start", "duration", "offset", "head", "b")


def simulate(program: CheckedProgram, spec: SchedulerSpec, batch: Batch, *, ctas: int = 132,
             cost: str | Callable[[Tile], float] = "causal", block_n: int | None = None,
             num_sms: int | None = None, max_steps: int | None = None) -> SimulationResult:
    """Run the scheduler over `batch` on `ctas` simulated multiprocessors.

    Not terminating means a `while` loop that runs HOST_LOOP_FUEL iterations in one rule
    call, a CTA that takes more tiles than all the work plus one (the GPU's own bound), or
    more than `max_steps` advances in all (default 2 x (work + CTAs) + 10,000).
    """
    if ctas < 1:
        raise ValueError("the simulator needs at least 1 CTA slot")
    sched = HostScheduler(program, spec)
    ids = _TileIds(batch)
    costs = ids.costs(cost, block_n or batch.tile)
    grid = sched.grid(len(batch.seqlens), batch.max_num_prompt_tiles,
                      max(batch.seqlens, default=0), batch.heads, num_sms or ctas)
    n_ctas = grid[0] * grid[1] * grid[2]
    if n_ctas > MAX_SIMULATED_CTAS:
        raise MhaError(f"grid_dim gives {grid}: {n_ctas} CTAs; the simulator runs at most "
                       f"{MAX_SIMULATED_CTAS}", sched.grid_rule.span)
    run = _Run(sched, batch, ctas, num_sms or ctas, grid)
    num_work = batch.max_num_prompt_tiles * batch.heads * len(batch.seqlens)
    result = SimulationResult(spec.name, grid, ctas, False, True, 0.0, 0.0, None, 0.0,
                              ids.total)
    try:
        if sched.may_advance:
            _run_persistent(run, ids, costs, n_ctas, num_work,
                            max_steps or 2 * (num_work + n_ctas) + 10_000)
        else:
            _run_transient(run, ids, costs, n_ctas)
    except _NoTermination as stop:
        result.terminated = False
        result.message = f"scheduler does not terminate: {stop}"
    _finish(result, run, ids, costs)
    return result


def _run_transient(run: _Run, ids: _TileIds, costs: np.ndarray, n_ctas: int) -> None:
    """CTAs that do one tile each: their first rules run in one batched call per chunk,
    then list scheduling on the slots, in grid order."""
    chunk = 1 << 16
    seqs = np.zeros(min(n_ctas, chunk), _SEQ_DTYPE)
    valid = np.zeros(min(n_ctas, chunk), np.uint8)
    scratch = (ctypes.c_uint32 * 2)()
    heap = [(0.0, k, k) for k in range(run.ctas)]  # (free at, tie-break, slot)
    ticket = run.ctas
    busy, log = run.busy, run.log
    for first in range(0, n_ctas, chunk):
        count = min(chunk, n_ctas - first)
        started = run.sched.start_ctas(run.env_p, run.ts_p, first, count,
                                       ctypes.addressof(scratch), ctypes.addressof(run.states[0]),
                                       ctypes.addressof(run.info), seqs.ctypes.data,
                                       valid.ctypes.data)
        if started != count:
            raise _NoTermination("a `while` loop in the scheduler never ends")
        s = seqs[:count]
        works = np.flatnonzero((valid[:count] != 0) & (s["seq_len"] > s["prompt_offset"]))
        offset, head, b = (s[f][works].astype(np.int64) for f in
                           ("prompt_offset", "head_idx", "prompt_idx"))
        tile = ids.ids(offset, head, b)
        durations = np.where(tile >= 0, costs[np.maximum(tile, 0)] if len(costs) else 0, 0.0)
        for k, duration, o, h, bb in zip((works + first).tolist(), durations.tolist(),
                                         offset.tolist(), head.tolist(), b.tolist()):
            now, _, slot = heap[0]
            log.append((k, slot, now, duration, o, h, bb))
            if duration:  # a zero-length tile leaves the slot free at the same time
                heapq.heapreplace(heap, (now + duration, ticket, slot))
                ticket += 1
                busy[slot] += duration
                if now + duration > run.makespan:
                    run.makespan = now + duration


def _run_persistent(run: _Run, ids: _TileIds, costs: np.ndarray, n_ctas: int, num_work: int,
                    step_limit: int) -> None:
    """CTAs that advance: event by event, the CTA that finishes first takes the next step.

    The hot loop: one ctypes call per step, SeqInfo read through a memoryview, the tile's
    cost from the tile-id table."""
    advance, env_p, ts_p, env = run.sched.advance, run.env_p, run.ts_p, run.env
    seq_words = memoryview(run.seqs).cast("B").cast("I")  # 5 u32 per slot
    state_p = [ctypes.addressof(s) for s in run.states]
    seq_p = [ctypes.addressof(s) for s in run.seqs]
    cost_list, lens, counts = costs.tolist(), ids.batch.seqlens, ids.counts.tolist()
    base, heads, tile, n_seqs = ids.base.tolist(), ids.batch.heads, ids.batch.tile, len(lens)
    linear_of, pipeline, taken = [0] * run.ctas, [0] * run.ctas, [0] * run.ctas
    gx, gy = run.grid[0], run.grid[1]
    busy, log = run.busy, run.log
    free = list(range(run.ctas))[::-1]
    events: list[tuple[float, int, int]] = []  # (time, tie-break, slot)
    ticket = next_cta = steps = 0

    def run_tile(slot: int, now: float) -> None:
        nonlocal ticket
        k = 5 * slot
        seq_len, offset, head, b = seq_words[k], seq_words[k + 2], seq_words[k + 3], \
            seq_words[k + 4]
        duration = 0.0
        if seq_len > offset:  # the kernel skips a tile past its sequence's end
            if b < n_seqs and head < heads and offset % tile == 0 and offset < lens[b]:
                duration = cost_list[base[b] + head * counts[b] + offset // tile]
                busy[slot] += duration
            log.append((linear_of[slot], slot, now, duration, offset, head, b))
        ticket += 1
        heapq.heappush(events, (now + duration, ticket, slot))

    def fill(now: float) -> None:
        """Start pending CTAs on free slots; one with no first tile frees its slot again."""
        nonlocal next_cta
        while free and next_cta < n_ctas:
            slot = free.pop()
            linear, next_cta = next_cta, next_cta + 1
            linear_of[slot], pipeline[slot], taken[slot] = linear, 0, 0
            if run.start_one(linear, slot):
                run_tile(slot, now)
            else:
                free.append(slot)
                run.makespan = max(run.makespan, now)

    fill(0.0)
    block_idx = env.block_idx
    while events:
        now, _, slot = heapq.heappop(events)
        steps += 1
        if steps > step_limit:
            raise _NoTermination(f"more than {step_limit} advance steps for {num_work} work "
                                 f"items")
        linear = linear_of[slot]
        block_idx[0], block_idx[1], block_idx[2] = \
            linear % gx, (linear // gx) % gy, linear // (gx * gy)
        env.fuel = HOST_LOOP_FUEL
        more = advance(env_p, ts_p, state_p[slot], pipeline[slot], seq_p[slot])
        if env.fuel <= 0:
            raise _NoTermination("a `while` loop in the scheduler never ends")
        pipeline[slot] ^= 1
        if more:
            taken[slot] += 1
            if taken[slot] > num_work:  # the GPU's bound (emit_work_loop)
                raise _NoTermination(f"CTA {linear} took more than all {num_work} work items "
                                     f"plus one")
            run_tile(slot, now)
        else:
            free.append(slot)
            run.makespan = max(run.makespan, now)
            fill(now)


def _finish(result: SimulationResult, run: _Run, ids: _TileIds, costs: np.ndarray) -> None:
    """Coverage over tile ids, the lower bound, efficiency and the message."""
    rows = np.array(run.log, np.float64).reshape(-1, len(LOG_COLUMNS))
    trace = {name: rows[:, k] if name in ("start", "duration") else rows[:, k].astype(np.int64)
             for k, name in enumerate(LOG_COLUMNS)}
    visited = ids.ids(trace["offset"], trace["head"], trace["b"])
    trace["valid"] = visited >= 0
    result.trace = trace
    times = np.bincount(visited[visited >= 0], minlength=ids.total)
    offset, head, b = ids.tiles()

    def tiles(where: np.ndarray) -> list[Tile]:
        return list(zip(offset[where].tolist(), head[where].tolist(), b[where].tolist()))

    result.missing = sorted(tiles(times == 0))
    result.repeated = sorted(tiles(times > 1))
    bad = visited < 0
    result.invalid = sorted(set(zip(trace["offset"][bad].tolist(), trace["head"][bad].tolist(),
                                    trace["b"][bad].tolist())))
    result.covered_exactly_once = (result.terminated and not result.missing
                                   and not result.repeated and not result.invalid)
    result.makespan = run.makespan
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
    ax.set_xlabel("time (KV-tile iterations)")
    ax.set_ylabel("CTA slot")
    efficiency = "n/a" if result.efficiency is None else f"{result.efficiency:.1%}"
    ax.set_title(f"{result.scheduler}: makespan {result.makespan:g}, efficiency {efficiency}")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
