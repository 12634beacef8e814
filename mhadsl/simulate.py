"""Host simulation of a scheduler: run its host-compiled rules for a grid of CTAs.

The rules are the same LLVM IR the GPU runs, JIT-compiled for this CPU. Each CTA is one
simulated thread (thread 0, the producer), the queue counter and shared slots are host
memory, and a cost model says how long each tile takes. Dynamic schedulers are simulated
event by event: whichever CTA finishes first takes the next index. The result proves
every valid tile was processed exactly once and no invalid tile was, and reports the
makespan against the lower bound max(total / ctas, longest tile).
"""
from __future__ import annotations

import ctypes
import heapq
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from mhadsl.check import CheckedProgram
from mhadsl.codegen.scheduler import HOST_LOOP_FUEL, SchedulerSpec, lower_scheduler
from mhadsl.codegen.target import HOST, HostJit, new_module

Tile = tuple[int, int, int]  # (prompt_offset, head_idx, prompt_idx)


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

    @property
    def is_valid(self) -> bool:
        return self.seq_len > self.prompt_offset

    @property
    def tile(self) -> Tile:
        return (self.prompt_offset, self.head_idx, self.prompt_idx)


_P = ctypes.c_void_p
_U32 = ctypes.c_uint32


class HostScheduler:
    """A scheduler specialisation compiled for this CPU, callable rule by rule."""

    def __init__(self, program: CheckedProgram, spec: SchedulerSpec):
        module = new_module(f"host_{spec.name}", HOST)
        lowered = lower_scheduler(module, program, spec, HOST)
        self.may_advance = lowered.may_advance
        self.llvm_ir = str(module)
        self.jit = HostJit(module)
        names = {k: fn.name for k, fn in lowered.functions.items()}

        def fn(key: str, restype, *argtypes):
            return ctypes.CFUNCTYPE(restype, *argtypes)(self.jit.address(names[key]))

        self.grid_dim = fn("grid_dim", None, _P, _P, _U32, _U32, _P)
        self.initial_state = fn("initial_state", None, _P, _P, _P, _P)
        self.get_current_work_info = fn("get_current_work_info", None, _P, _P, _P, _P)
        self.unsafe_seq_info = fn("unsafe_seq_info", None, _P, _P, _P, _P)
        self.advance = fn(lowered.advance_name(True, "ALL"), ctypes.c_bool, _P, _P, _P, _U32, _P)

    def grid(self, batch_size: int, max_num_prompt_tiles: int, max_seq_len: int,
             num_heads: int, num_sms: int, ctas_per_sm: int = 1) -> tuple[int, int, int]:
        """The launch grid from the scheduler's own `grid_dim` rule."""
        env = _Env(None, num_sms)
        env.ctas_per_sm = ctas_per_sm
        env.fuel = HOST_LOOP_FUEL
        ts = _TileSummary(batch_size, max_num_prompt_tiles, max_seq_len, num_heads)
        out = (ctypes.c_uint32 * 3)()
        self.grid_dim(ctypes.byref(env), ctypes.byref(ts), batch_size, max_num_prompt_tiles, out)
        return (out[0], out[1], out[2])


@dataclass
class Batch:
    """The sequences of one launch: their query lengths, head count and tile height."""

    seqlens: list[int]
    heads: int
    tile: int
    ragged: bool

    @property
    def max_num_prompt_tiles(self) -> int:
        return max((-(-n // self.tile) for n in self.seqlens), default=0)

    def valid_tiles(self) -> set[Tile]:
        return {(q * self.tile, h, b) for b, n in enumerate(self.seqlens)
                for h in range(self.heads) for q in range(-(-n // self.tile))}


def causal_cost(batch: Batch, block_n: int) -> Callable[[Tile], float]:
    """KV tiles a causal query tile visits (Sq == Sk): the default cost model."""
    def cost(tile: Tile) -> float:
        offset, _, b = tile
        return -(-min(offset + batch.tile, batch.seqlens[b]) // block_n)
    return cost


def uniform_cost(batch: Batch, block_n: int) -> Callable[[Tile], float]:
    """Non-causal: every query tile visits all KV tiles of its sequence."""
    return lambda tile: -(-batch.seqlens[tile[2]] // block_n)


COST_MODELS = {"causal": causal_cost, "uniform": uniform_cost}


@dataclass
class SimulationResult:
    scheduler: str
    grid: tuple[int, int, int]
    ctas: int
    covered_exactly_once: bool
    terminated: bool
    makespan: float
    lower_bound: float
    efficiency: float
    total_work: float
    tiles: int
    missing: list[Tile] = field(default_factory=list)
    repeated: list[Tile] = field(default_factory=list)
    invalid: list[Tile] = field(default_factory=list)
    per_cta_load: list[float] = field(default_factory=list)
    visits: dict[int, list[Tile]] = field(default_factory=dict)  # grid CTA -> tiles in order
    timeline: list[tuple[int, float, float, Tile]] = field(default_factory=list)
    message: str = ""

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


class _Cta:
    """One CTA's host-side memory: its state, shared slots and last SeqInfo."""

    def __init__(self, linear: int, grid: tuple[int, int, int]):
        self.linear = linear
        gx, gy, _ = grid
        self.block_idx = (linear % gx, (linear // gx) % gy, linear // (gx * gy))
        self.slots = (ctypes.c_uint32 * 2)()
        self.state = _State()
        self.seq = _SeqInfo()
        self.pipeline_idx = 0
        self.slot = -1  # which simulated SM runs it


def simulate(program: CheckedProgram, spec: SchedulerSpec, batch: Batch, *, ctas: int = 132,
             cost: str | Callable[[Tile], float] = "causal", block_n: int | None = None,
             num_sms: int | None = None, max_steps: int | None = None) -> SimulationResult:
    """Run the scheduler over `batch` on `ctas` simulated multiprocessors."""
    sched = HostScheduler(program, spec)
    cost_fn = COST_MODELS[cost](batch, block_n or batch.tile) if isinstance(cost, str) else cost
    counter = ctypes.c_uint32(0)
    offsets = (ctypes.c_int32 * (len(batch.seqlens) + 1))(
        *[sum(batch.seqlens[:i]) for i in range(len(batch.seqlens) + 1)])
    ts = _TileSummary(len(batch.seqlens), batch.max_num_prompt_tiles,
                      max(batch.seqlens, default=0), batch.heads,
                      ctypes.cast(offsets, ctypes.c_void_p) if batch.ragged else None)
    env = _Env(ctypes.cast(ctypes.pointer(counter), ctypes.c_void_p).value, num_sms or ctas)
    env.ctas_per_sm = 1  # each simulated multiprocessor runs one CTA at a time
    grid = sched.grid(ts.batch_size, ts.max_num_prompt_tiles, ts.max_seq_len, ts.num_heads,
                      env.num_sms)
    n_ctas = grid[0] * grid[1] * grid[2]
    valid = batch.valid_tiles()
    step_limit = max_steps or 8 * (len(valid) + n_ctas) * max(batch.heads, 1) + 10_000
    result = SimulationResult(spec.name, grid, ctas, False, True, 0.0, 0.0, 0.0, 0.0, len(valid))

    events: list[tuple[float, int, int]] = []  # (time, tie-break, cta)
    ticket = 0
    pending = deque(range(n_ctas))
    free_slots = list(range(ctas))[::-1]
    busy = [0.0] * ctas
    done: Counter[Tile] = Counter()
    ctas_by_id: dict[int, _Cta] = {}
    steps = 0

    def call(fn, *args) -> object:
        env.fuel = HOST_LOOP_FUEL
        out = fn(ctypes.byref(env), ctypes.byref(ts), *args)
        if env.fuel <= 0:
            raise _NoTermination("a `while` loop in the scheduler never ends")
        return out

    def enter(cta: _Cta) -> None:
        env.block_idx[:] = cta.block_idx
        env.grid_dim[:] = grid
        env.thread_idx[:] = (0, 0, 0)

    def run_tile(cta: _Cta, now: float) -> None:
        nonlocal ticket
        duration = 0.0
        if cta.seq.is_valid:
            tile = cta.seq.tile
            done[tile] += 1
            result.visits.setdefault(cta.linear, []).append(tile)
            if tile in valid:
                duration = float(cost_fn(tile))
                busy[cta.slot] += duration
                result.timeline.append((cta.slot, now, now + duration, tile))
        ticket += 1
        heapq.heappush(events, (now + duration, ticket, cta.linear))

    def start(linear: int, now: float) -> None:
        cta = _Cta(linear, grid)
        cta.slot = free_slots.pop()
        ctas_by_id[linear] = cta
        enter(cta)
        call(sched.initial_state, cta.slots, ctypes.byref(cta.state))
        info = _WorkInfo()
        call(sched.get_current_work_info, ctypes.byref(cta.state), ctypes.byref(info))
        if not info.is_valid:
            finish(cta, now)
            return
        call(sched.unsafe_seq_info, ctypes.byref(cta.state), ctypes.byref(cta.seq))
        run_tile(cta, now)

    def finish(cta: _Cta, now: float) -> None:
        free_slots.append(cta.slot)
        result.makespan = max(result.makespan, now)
        if pending:
            start(pending.popleft(), now)

    try:
        while pending and free_slots:
            start(pending.popleft(), 0.0)
        while events:
            steps += 1
            if steps > step_limit:
                raise _NoTermination(f"no end after {step_limit} scheduler steps")
            now, _, linear = heapq.heappop(events)
            cta = ctas_by_id[linear]
            if not sched.may_advance:
                finish(cta, now)
                continue
            enter(cta)
            more = call(sched.advance, ctypes.byref(cta.state), cta.pipeline_idx,
                        ctypes.byref(cta.seq))
            cta.pipeline_idx ^= 1
            if more:
                run_tile(cta, now)
            else:
                finish(cta, now)
    except _NoTermination as stop:
        result.terminated = False
        result.message = f"scheduler does not terminate: {stop}"

    result.missing = sorted(valid - set(done))
    result.repeated = sorted(t for t, n in done.items() if n > 1 and t in valid)
    result.invalid = sorted(t for t in done if t not in valid)
    result.covered_exactly_once = (result.terminated and not result.missing
                                   and not result.repeated and not result.invalid)
    costs = [float(cost_fn(t)) for t in valid]
    result.total_work = sum(costs)
    result.lower_bound = max(result.total_work / ctas, max(costs, default=0.0))
    result.efficiency = result.lower_bound / result.makespan if result.makespan else 1.0
    result.per_cta_load = busy
    if not result.message:
        problems = [f"{len(v)} {k}" for k, v in (("missing", result.missing),
                    ("repeated", result.repeated), ("invalid", result.invalid)) if v]
        result.message = ("every valid tile processed exactly once" if not problems
                          else "; ".join(problems) + " tiles")
    return result


class _NoTermination(Exception):
    pass


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
    ax.set_title(f"{result.scheduler}: makespan {result.makespan:g}, "
                 f"efficiency {result.efficiency:.1%}")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
