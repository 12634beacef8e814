"""The valid work of a launch in the scheduler rules' lowering (`codegen.lower`): the tile
index a dense launch computes in closed form or a ragged one reads (`TileIndex`), and which
`Schedule` orders a build can take (`schedule_is`)."""
from __future__ import annotations

from typing import Callable

from llvmlite import ir

from mhadsl.codegen.nvptx import i32
from mhadsl.front.types import SCHEDULES


def schedule_is(builder: ir.IRBuilder, schedule: ir.Value, name: str) -> ir.Value | None:
    """i1: whether `Schedule` value `schedule` is `name`; None where it cannot be (a
    build for other schedules then emits nothing of that order)."""
    if not _may_be(schedule, name):
        return None
    return builder.icmp_unsigned("==", schedule, i32(SCHEDULES.index(name)))


def _may_be(schedule: ir.Value, name: str) -> bool:
    """Whether `schedule` can be `name`: not where it is a constant, or a choice between
    constants, of other schedules."""
    if isinstance(schedule, ir.Constant):
        return schedule.constant == SCHEDULES.index(name)
    if isinstance(schedule, ir.SelectInstr):
        return _may_be(schedule.lhs, name) or _may_be(schedule.rhs, name)
    return True


WIDE_SEARCH = 8  # `RaggedIndex.search`'s ways a step, where a design takes the wide search


class TileIndex:
    """The valid work of a launch, as `mhadsl.analysis.valid_work.tile_index` lays it out:
    `prefix(b)` (tiles of the sequences before b), `count(b)`, `ranked(r)` (the sequence of rank r, most
    tiles first), `level(r)` (where LONGEST_FIRST's block of rank r starts), `total()`, and
    the searches over them. Every index is in range for a valid work index."""

    def __init__(self, lower, ts: ir.Value):
        self.lower, self.b = lower, lower.b
        self.batch = lower.ts_field(ts, "batch_size")
        self.tiles = lower.ts_field(ts, "max_num_prompt_tiles")


class DenseIndex(TileIndex):
    """Every sequence has max_num_prompt_tiles tiles: closed forms, nothing to read."""

    def total(self):
        return self.b.mul(self.batch, self.tiles)

    def prefix(self, seq):
        return self.b.mul(seq, self.tiles)

    def count(self, seq):
        return self.tiles

    def ranked(self, rank):
        return rank

    def level(self, rank):
        return i32(0)

    def find_sequence(self, local, width):
        return self.b.udiv(local, self.lower.umax(self.b.mul(width, self.tiles), i32(1)))

    def find_block(self, position):
        return self.b.sub(self.batch, i32(1))  # all sequences reach every level


class RaggedIndex(TileIndex):
    """The tile index the device built from cu_seqlens before the launch."""

    def __init__(self, lower, ts: ir.Value, words: ir.Value):
        super().__init__(lower, ts)
        self.words = words
        self.ways = lower.search_ways

    def word(self, at: ir.Value) -> ir.Value:
        return self.b.load(self.b.gep(self.words, [at], source_etype=i32), typ=i32)

    def total(self):
        return self.word(self.batch)

    def prefix(self, seq):
        return self.word(seq)

    def count(self, seq):
        return self.b.sub(self.word(self.b.add(seq, i32(1))), self.word(seq))

    def ranked(self, rank):
        return self.word(self.b.add(self.b.add(self.batch, i32(1)), rank))

    def level(self, rank):
        b = self.b
        return self.word(b.add(b.add(b.mul(self.batch, i32(2)), i32(1)), rank))

    def find_sequence(self, local, width):
        return self.search(lambda seq: self.b.mul(self.prefix(seq), width), local)

    def find_block(self, position):
        return self.search(self.level, position)

    def search(self, key: Callable[[ir.Value], ir.Value], target: ir.Value) -> ir.Value:
        """The last r < batch_size with key(r) <= target (key ascending, key(0) <= target):
        a search of `ways`-way steps, ceil(log_ways(batch_size)) of them, each step's
        ways - 1 keys read together (a work tile starts after that many reads' latency,
        each waiting for the one before; more ways hold more registers meanwhile)."""
        b = self.b
        entry = b.block
        head, body, done = (b.append_basic_block(n) for n in ("search", "search_step",
                                                              "search_done"))
        b.branch(head)
        b.position_at_end(head)
        low, size = b.phi(i32), b.phi(i32)  # the answer is in [low, low + size)
        low.add_incoming(i32(0), entry)
        size.add_incoming(self.batch, entry)
        b.cbranch(b.icmp_unsigned(">", size, i32(1)), body, done)
        b.position_at_end(body)
        if self.ways == 2:
            half = b.lshr(size, i32(1))
            middle = b.add(low, half)
            low.add_incoming(b.select(b.icmp_unsigned("<=", key(middle), target), middle,
                                      low), b.block)
            size.add_incoming(b.sub(size, half), b.block)
        else:
            stride = b.udiv(b.add(size, i32(self.ways - 1)), i32(self.ways))
            last = b.sub(b.add(low, size), i32(1))
            passed = i32(0)  # candidates low + j * stride (j >= 1) with key <= target
            for j in range(1, self.ways):
                at = b.add(low, b.mul(stride, i32(j)))
                inside = b.icmp_unsigned("<=", at, last)
                at_most = b.icmp_unsigned("<=", key(b.select(inside, at, last)), target)
                passed = b.add(passed, b.zext(b.and_(inside, at_most), i32))
            start = b.add(low, b.mul(passed, stride))
            low.add_incoming(start, b.block)
            size.add_incoming(self.lower.umin(stride, b.sub(b.add(low, size), start)),
                              b.block)
        b.branch(head)
        b.position_at_end(done)
        return low
