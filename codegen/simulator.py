"""The host simulator's LLVM IR: the event loop `mhadsl.analysis.simulate` JIT-compiles next to a
scheduler's host rules (`codegen.scheduler`), so a simulation calls them without Python in
between.

`emit_simulator` adds two functions to the host module of a scheduler specialisation:
`START_CTAS` runs the first rules of a range of CTAs, and `RUN_EVENTS` runs the whole grid
on the simulated slots, event by event. The tables below are their interface with the
Python side: what each i64 of its argument arrays holds, the log it writes and why it
stopped.
"""
from __future__ import annotations

from llvmlite import ir

from mhadsl.front.semantics import SLOT_COUNT
from mhadsl.codegen import nvptx
from mhadsl.codegen.lower import ENV_FIELDS, alloca, record_type
from mhadsl.codegen.nvptx import i8, i32, i64
from mhadsl.codegen.scheduler import HOST_LOOP_FUEL, LoweredScheduler
from mhadsl.front.types import SEQ_INFO, WORK_INFO

START_CTAS = "mhadsl.sim.start_ctas"
RUN_EVENTS = "mhadsl.sim.run_events"

# The log of processed tiles: one f64 array a column, a row a tile.
LOG_COLUMNS = ("cta", "slot", "start", "duration", "offset", "head", "b")
# The event loop's inputs: pointers (`LOOP_POINTERS`) and integers (`LOOP_INTEGERS`), each
# an i64 array in this order.
LOOP_POINTERS = ("time", "ticket", "heap", "linear", "pipe", "taken", "states", "slot_words",
                 "seqs", "info", "valid", "counts", "base", "lens", "cost", "busy", "out",
                 "step_costs", *LOG_COLUMNS)
STEP_COSTS = ("advance", "queue_op", "cta_start", "empty_cta")  # f64s at ptrs.step_costs
# `loop_budget`: the `while` iterations all rule calls together may run.
LOOP_INTEGERS = ("n_slots", "n_ctas", "num_work", "step_limit", "loop_budget", "n_seqs",
                 "heads", "tile", "log_cap")
LOOP_RESULTS = ("status", "steps", "log_n", "makespan_bits", "cta")  # i64s at ptrs.out
# Why the event loop stopped.
DONE, ENDLESS_WHILE, TOO_MANY_TILES, STEP_LIMIT, LOG_FULL, LOOP_BUDGET = range(6)


def emit_simulator(module: ir.Module, lowered: LoweredScheduler) -> None:
    """Add `START_CTAS` and `RUN_EVENTS` to the module of `lowered`'s host rules."""
    _emit_start_ctas(module, lowered)
    _emit_event_loop(module, lowered)


def _emit_start_ctas(module: ir.Module, lowered: LoweredScheduler) -> None:
    """`i32 start_ctas(env*, ts*, i32 first, i32 count, slots*, State*, WorkInfo*,
    SeqInfo* seq_out, i8* valid_out, i64* spent)`: the first rules of CTAs first ..
    first+count-1.

    Each CTA's block_idx comes from its linear id and env.grid_dim; CTA k writes whether
    its WorkInfo is valid to valid_out[k] and, if so, its SeqInfo to seq_out[k] (count 1
    writes the CTA's own state). Every rule call gets a full tank of `while` fuel, and adds
    what it burnt to *spent; the result is the number of CTAs started before a tank ran dry
    (count when none did).
    """
    p = nvptx.ptr()
    fn = ir.Function(module, ir.FunctionType(i32, [p, p, i32, i32, p, p, p, p, p, p]),
                     START_CTAS)
    env, ts, first, count, slots, state, info, seq_out, valid_out, spent = fn.args
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
        left = b.load(env_field("fuel"), typ=i64)
        b.cbranch(b.icmp_signed("<=", left, i64(0)), dry, ok)
        b.position_at_end(ok)
        burnt = b.sub(i64(HOST_LOOP_FUEL), left)
        b.store(b.add(b.load(spent, typ=i64), burnt), spent)

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


def _emit_event_loop(module: ir.Module, lowered: LoweredScheduler) -> None:
    """`void run_events(env*, ts*, i64* ptrs, i64* ints)`: the persistent simulation.

    Each slot (simulated multiprocessor) holds one CTA and its next event: the end time of
    its current tile and a ticket (ties go to the older event); a binary heap of the busy
    slots, earliest event first, keeps each step logarithmic in the slots. The loop takes
    the earliest event, calls `advance` for that CTA, records the tile (its cost from the
    tile-id table), and when a CTA is done starts the next CTA of the grid in its slot
    (`start_ctas`).
    Each advance that returns work delays the tile by the step costs (`STEP_COSTS`: the
    step, and each atomic it made on the queue counter), and a CTA started after the first
    wave with a real first tile by `cta_start`. Results and the reason it stopped go to
    ptrs.out (`LOOP_RESULTS`).
    """
    p, f64 = nvptx.ptr(), ir.DoubleType()
    fn = ir.Function(module, ir.FunctionType(nvptx.void, [p, p, p, p]), RUN_EVENTS)
    env, ts, ptrs, ints = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    seq_t, state_t = record_type(SEQ_INFO), lowered.state_struct

    def arg(table, names, name):
        v = b.load(b.gep(table, [i32(names.index(name))], source_etype=i64), typ=i64)
        return b.inttoptr(v, p) if table is ptrs else v

    P = {n: arg(ptrs, LOOP_POINTERS, n) for n in LOOP_POINTERS}
    N = {n: arg(ints, LOOP_INTEGERS, n) for n in LOOP_INTEGERS}
    step_cost = {n: b.load(b.gep(P["step_costs"], [i32(k)], source_etype=f64), typ=f64)
                 for k, n in enumerate(STEP_COSTS)}
    n_slots, n_ctas = (b.trunc(N[k], i32) for k in ("n_slots", "n_ctas"))

    def at(name, index, ty):
        return b.gep(P[name], [index], source_etype=ty)

    def var(ty, init):
        """A local in the entry block (where mem2reg finds it), set to `init` here."""
        entry = fn.entry_basic_block
        with b.goto_block(entry):
            b.position_before(entry.instructions[0])
            slot = alloca(b, ty)
        b.store(init, slot)
        return slot

    next_cta, ticket, steps = var(i32, i32(0)), var(i64, i64(0)), var(i64, i64(0))
    log_n, makespan = var(i64, i64(0)), var(f64, f64(0.0))
    blocks = {n: fn.append_basic_block(n) for n in ("fill", "fill_start", "tile", "next",
                                                   "pop", "stop")}
    status, fail_cta = var(i64, i64(DONE)), var(i32, i32(0))
    # `fill` and `tile` are shared code: where they go back to is `resume`.
    cur_slot, now = var(i32, i32(0)), var(f64, f64(0.0))
    init_slot = var(i32, i32(0))
    resume = var(i32, i32(0))  # 0: initial fill loop, 1: main loop
    heap_n = var(i32, i32(0))  # busy slots, in `heap`
    spent = var(i64, i64(0))  # `while` iterations of all rule calls so far

    def stop(code, cta=None):
        b.store(i64(code), status)
        if cta is not None:
            b.store(cta, fail_cta)
        b.branch(blocks["stop"])

    def branch_if(cond, then_code, then_cta=None):
        ok = fn.append_basic_block("ok")
        bad = fn.append_basic_block("bad")
        b.cbranch(cond, bad, ok)
        b.position_at_end(bad)
        stop(then_code, then_cta)
        b.position_at_end(ok)

    # ---- initial fill: slots 0 .. n_slots-1 in order, all at time 0
    init_head = fn.append_basic_block("init")
    b.branch(init_head)
    b.position_at_end(init_head)
    k = b.load(init_slot, typ=i32)
    init_body = fn.append_basic_block("init_body")
    b.cbranch(b.icmp_unsigned("<", k, n_slots), init_body, blocks["next"])
    b.position_at_end(init_body)
    b.store(k, cur_slot)
    b.store(f64(0.0), now)
    b.store(i32(0), resume)
    b.branch(blocks["fill"])

    # ---- fill(cur_slot, now): start grid CTAs in the slot until one has a first tile
    b.position_at_end(blocks["fill"])
    slot, linear = b.load(cur_slot, typ=i32), b.load(next_cta, typ=i32)
    has_cta = b.icmp_unsigned("<", linear, n_ctas)
    idle = fn.append_basic_block("idle")
    b.cbranch(has_cta, blocks["fill_start"], idle)
    b.position_at_end(idle)  # the slot stays out of the heap
    b.branch(blocks["next"])
    b.position_at_end(blocks["fill_start"])
    b.store(b.add(linear, i32(1)), next_cta)
    b.store(linear, at("linear", slot, i32))
    b.store(i32(0), at("pipe", slot, i32))
    b.store(i64(0), at("taken", slot, i64))
    started = b.call(module.globals[START_CTAS], [
        env, ts, linear, i32(1), at("slot_words", b.mul(slot, i32(SLOT_COUNT)), i32),
        at("states", slot, state_t), P["info"], at("seqs", slot, seq_t), P["valid"], spent])
    branch_if(b.icmp_unsigned("!=", started, i32(1)), ENDLESS_WHILE, linear)
    branch_if(b.icmp_signed(">", b.load(spent, typ=i64), N["loop_budget"]), LOOP_BUDGET)
    first = b.icmp_unsigned("!=", b.load(P["valid"], typ=i8), i8(0))
    # After the first wave a CTA takes over its slot from the last: `cta_start` when it
    # has a tile, `empty_cta` when its first one lies past its sequence's end (or it has
    # none at all); the GPU retires those much faster.
    after_first_wave = b.icmp_unsigned("!=", b.load(resume, typ=i32), i32(0))
    no_tile, first_tile = fn.append_basic_block("no_tile"), fn.append_basic_block("first_tile")
    b.cbranch(first, first_tile, no_tile)

    def start_cost(real: ir.Value) -> None:
        t = b.load(now, typ=f64)
        cost = b.select(real, step_cost["cta_start"], step_cost["empty_cta"])
        b.store(b.select(after_first_wave, b.fadd(t, cost), t), now)
    b.position_at_end(first_tile)
    seq = at("seqs", slot, record_type(SEQ_INFO))
    seq_len, offset = (b.load(b.gep(seq, [i32(0), i32(j)], source_etype=record_type(SEQ_INFO)),
                              typ=i32) for j in (0, 2))
    start_cost(b.icmp_unsigned(">", seq_len, offset))
    b.branch(blocks["tile"])
    b.position_at_end(no_tile)
    start_cost(ir.Constant(ir.IntType(1), 0))
    t = b.load(now, typ=f64)
    b.store(b.select(b.fcmp_ordered(">", t, b.load(makespan, typ=f64)), t,
                     b.load(makespan, typ=f64)), makespan)
    b.branch(blocks["fill"])

    # ---- tile(cur_slot, now): record the slot's SeqInfo as a tile, schedule its end
    b.position_at_end(blocks["tile"])
    slot, t = b.load(cur_slot, typ=i32), b.load(now, typ=f64)
    seq = at("seqs", slot, seq_t)
    field = [b.load(b.gep(seq, [i32(0), i32(j)], source_etype=seq_t), typ=i32)
             for j in range(5)]
    seq_len, offset, head, batch = field[0], field[2], field[3], field[4]
    duration = var(f64, f64(0.0))
    with b.if_then(b.icmp_unsigned(">", seq_len, offset)):  # else the kernel skips it
        n = b.load(log_n, typ=i64)
        branch_if(b.icmp_signed(">=", n, N["log_cap"]), LOG_FULL)
        b64, h64, o64 = (b.zext(v, i64) for v in (batch, head, offset))
        in_batch = b.icmp_signed("<", b64, N["n_seqs"])
        safe_b = b.select(in_batch, b64, i64(0))
        count = b.load(at("counts", safe_b, i64), typ=i64)
        valid = b.and_(in_batch, b.icmp_signed("<", h64, N["heads"]))
        valid = b.and_(valid, b.icmp_signed("==", b.srem(o64, N["tile"]), i64(0)))
        valid = b.and_(valid, b.icmp_signed("<", o64, b.load(at("lens", safe_b, i64),
                                                                 typ=i64)))
        tile_id = b.add(b.add(b.load(at("base", safe_b, i64), typ=i64), b.mul(h64, count)),
                        b.sdiv(o64, N["tile"]))
        with b.if_then(valid):
            d = b.load(at("cost", tile_id, f64), typ=f64)
            b.store(d, duration)
            busy = at("busy", slot, f64)
            b.store(b.fadd(b.load(busy, typ=f64), d), busy)
        cta = b.load(at("linear", slot, i32), typ=i32)
        for column, v in zip(LOG_COLUMNS, (b.uitofp(cta, f64), b.uitofp(slot, f64), t,
                                           b.load(duration, typ=f64), b.uitofp(offset, f64),
                                           b.uitofp(head, f64), b.uitofp(batch, f64))):
            b.store(v, at(column, n, f64))
        b.store(b.add(n, i64(1)), log_n)
    tk = b.add(b.load(ticket, typ=i64), i64(1))
    b.store(tk, ticket)
    b.store(b.fadd(t, b.load(duration, typ=f64)), at("time", slot, f64))
    b.store(tk, at("ticket", slot, i64))
    _emit_heap_push(b, fn, at, var, heap_n, slot)
    b.branch(blocks["next"])

    # ---- next: back to the initial fill, or the earliest event
    b.position_at_end(blocks["next"])
    in_init = b.icmp_unsigned("==", b.load(resume, typ=i32), i32(0))
    init_next = fn.append_basic_block("init_next")
    b.cbranch(in_init, init_next, blocks["pop"])
    b.position_at_end(init_next)
    k = b.load(init_slot, typ=i32)
    b.store(b.add(k, i32(1)), init_slot)
    b.cbranch(b.icmp_unsigned("<", b.add(k, i32(1)), n_slots), init_head, blocks["pop"])
    # (leaving the initial fill: from now on `next` goes to the heap)
    b.position_at_end(blocks["pop"])
    b.store(i32(1), resume)
    have = fn.append_basic_block("have")
    b.cbranch(b.icmp_unsigned("==", b.load(heap_n, typ=i32), i32(0)), blocks["stop"], have)
    b.position_at_end(have)
    slot = _emit_heap_pop(b, fn, at, var, heap_n)
    n_steps = b.add(b.load(steps, typ=i64), i64(1))
    b.store(n_steps, steps)
    branch_if(b.icmp_signed(">", n_steps, N["step_limit"]), STEP_LIMIT)
    t = b.load(at("time", slot, f64), typ=f64)
    b.store(slot, cur_slot)
    b.store(t, now)
    finished = fn.append_basic_block("finished")
    if lowered.may_advance:
        _emit_advance(b, fn, lowered, env, ts, at, slot, N, branch_if, blocks["tile"], finished,
                      now, step_cost, spent)
    else:  # one tile per CTA: its slot goes to the next CTA of the grid
        b.branch(finished)
    b.position_at_end(finished)
    m = b.load(makespan, typ=f64)
    b.store(b.select(b.fcmp_ordered(">", t, m), t, m), makespan)
    b.branch(blocks["fill"])

    b.position_at_end(blocks["stop"])
    out = P["out"]
    for j, v in enumerate((b.load(status, typ=i64), b.load(steps, typ=i64),
                           b.load(log_n, typ=i64), b.bitcast(b.load(makespan, typ=f64), i64),
                           b.zext(b.load(fail_cta, typ=i32), i64))):
        b.store(v, b.gep(out, [i32(j)], source_etype=i64))
    b.ret_void()


def _emit_earlier(b: ir.IRBuilder, at, one: ir.Value, other: ir.Value) -> ir.Value:
    """Whether slot `one`'s event comes before slot `other`'s: it ends first, or at the same
    time with an older ticket (tickets are unique, so the order is total)."""
    f64 = ir.DoubleType()
    t1, t2 = (b.load(at("time", s, f64), typ=f64) for s in (one, other))
    k1, k2 = (b.load(at("ticket", s, i64), typ=i64) for s in (one, other))
    return b.or_(b.fcmp_ordered("<", t1, t2),
                 b.and_(b.fcmp_ordered("==", t1, t2), b.icmp_signed("<", k1, k2)))


def _emit_heap_push(b: ir.IRBuilder, fn: ir.Function, at, var, heap_n, slot: ir.Value) -> None:
    """Put `slot` in the heap of busy slots (`heap[0 .. heap_n)`), sifting it up."""
    n = b.load(heap_n, typ=i32)
    b.store(b.add(n, i32(1)), heap_n)
    where = var(i32, n)
    head, move, done = (fn.append_basic_block(f"push_{name}") for name in ("head", "move", "done"))
    b.branch(head)
    b.position_at_end(head)
    i = b.load(where, typ=i32)
    parent = b.udiv(b.sub(i, i32(1)), i32(2))
    has_parent = b.icmp_unsigned(">", i, i32(0))
    up = fn.append_basic_block("push_compare")
    b.cbranch(has_parent, up, done)
    b.position_at_end(up)
    above = b.load(at("heap", parent, i32), typ=i32)
    b.cbranch(_emit_earlier(b, at, slot, above), move, done)
    b.position_at_end(move)
    b.store(above, at("heap", i, i32))
    b.store(parent, where)
    b.branch(head)
    b.position_at_end(done)
    b.store(slot, at("heap", b.load(where, typ=i32), i32))


def _emit_heap_pop(b: ir.IRBuilder, fn: ir.Function, at, var, heap_n) -> ir.Value:
    """Take the slot of the earliest event off a heap that is not empty, sifting the last
    slot down into its place."""
    top = b.load(at("heap", i32(0), i32), typ=i32)
    n = b.sub(b.load(heap_n, typ=i32), i32(1))
    b.store(n, heap_n)
    last = b.load(at("heap", n, i32), typ=i32)
    where, child_var = var(i32, i32(0)), var(i32, i32(0))
    head, pick, move, done = (fn.append_basic_block(f"pop_{name}")
                              for name in ("head", "pick", "move", "done"))
    b.branch(head)
    b.position_at_end(head)
    i = b.load(where, typ=i32)
    left = b.add(b.mul(i, i32(2)), i32(1))
    b.cbranch(b.icmp_unsigned("<", left, n), pick, done)
    b.position_at_end(pick)
    right = b.add(left, i32(1))
    b.store(left, child_var)
    with b.if_then(b.icmp_unsigned("<", right, n)):
        right_slot, left_slot = (b.load(at("heap", c, i32), typ=i32) for c in (right, left))
        with b.if_then(_emit_earlier(b, at, right_slot, left_slot)):
            b.store(right, child_var)
    child = b.load(child_var, typ=i32)
    below = b.load(at("heap", child, i32), typ=i32)
    b.cbranch(_emit_earlier(b, at, below, last), move, done)
    b.position_at_end(move)
    b.store(below, at("heap", i, i32))
    b.store(child, where)
    b.branch(head)
    b.position_at_end(done)
    b.store(last, at("heap", b.load(where, typ=i32), i32))
    return top


def _emit_advance(b: ir.IRBuilder, fn: ir.Function, lowered: LoweredScheduler, env, ts, at,
                  slot, N, branch_if, tile_bb: ir.Block, finished_bb: ir.Block, now,
                  step_cost: dict, spent) -> None:
    """Call `advance` for the CTA in `slot`: on to tile_bb with a SeqInfo (at `now` plus the
    step's costs), else finished_bb. The fuel it burnt adds to *spent."""
    state_t, seq_t = lowered.state_struct, record_type(SEQ_INFO)
    linear = b.load(at("linear", slot, i32), typ=i32)
    gx = b.load(b.gep(env, [i32(0), i32(ENV_FIELDS.index("grid_dim")), i32(0)],
                      source_etype=lowered.env_struct), typ=i32)
    gy = b.load(b.gep(env, [i32(0), i32(ENV_FIELDS.index("grid_dim")), i32(1)],
                      source_etype=lowered.env_struct), typ=i32)
    for axis, v in enumerate((b.urem(linear, gx), b.urem(b.udiv(linear, gx), gy),
                              b.udiv(linear, b.mul(gx, gy)))):
        b.store(v, b.gep(env, [i32(0), i32(ENV_FIELDS.index("block_idx")), i32(axis)],
                         source_etype=lowered.env_struct))
    fuel = b.gep(env, [i32(0), i32(ENV_FIELDS.index("fuel"))], source_etype=lowered.env_struct)
    b.store(i64(HOST_LOOP_FUEL), fuel)
    pipe = at("pipe", slot, i32)
    p_idx = b.load(pipe, typ=i32)
    counter = b.load(b.gep(env, [i32(0), i32(ENV_FIELDS.index("counter"))],
                           source_etype=lowered.env_struct), typ=nvptx.ptr())
    queue_before = b.load(counter, typ=i32)
    more = b.call(lowered.functions[lowered.advance_name(True, "ALL")],
                  [env, ts, at("states", slot, state_t), p_idx, at("seqs", slot, seq_t)])
    left = b.load(fuel, typ=i64)
    branch_if(b.icmp_signed("<=", left, i64(0)), ENDLESS_WHILE, linear)
    burnt = b.add(b.load(spent, typ=i64), b.sub(i64(HOST_LOOP_FUEL), left))
    b.store(burnt, spent)
    branch_if(b.icmp_signed(">", burnt, N["loop_budget"]), LOOP_BUDGET)
    b.store(b.xor(p_idx, i32(1)), pipe)
    advanced = fn.append_basic_block("advanced")
    b.cbranch(more, advanced, finished_bb)
    b.position_at_end(advanced)
    taken = at("taken", slot, i64)
    n_taken = b.add(b.load(taken, typ=i64), i64(1))
    b.store(n_taken, taken)
    branch_if(b.icmp_signed(">", n_taken, N["num_work"]), TOO_MANY_TILES, linear)  # the GPU's
    atomics = b.uitofp(b.sub(b.load(counter, typ=i32), queue_before), ir.DoubleType())
    delay = b.fadd(step_cost["advance"], b.fmul(atomics, step_cost["queue_op"]))
    b.store(b.fadd(b.load(now, typ=ir.DoubleType()), delay), now)
    b.branch(tile_bb)
