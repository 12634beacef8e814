"""The blocks every design builds its work tiles from (FlashAttention-4's `seqlen_info`,
`block_info` and `mask`):

- `sequence_rows`, `last_index`: a sequence's rows, a tile's last row inside it;
- `TileRules`: the declaration's rules on one work tile's sequence: the mask of a pair, the
  score hook, the classes of a box of query rows by keys (empty, partial, full), and the
  softmax's log2 scale. Forward, decode and the backward all apply the declaration
  through it;
- `WorkTile`: a forward work tile's sequence, heads, query rows and KV range (sm80, sm90).
  Decode (a split of a packed GQA tile) and the backward (a K/V tile stepping over query
  tiles) derive their own tiles and hand them to `TileRules`.
"""
from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

from llvmlite import ir

from mhadsl.codegen import warp
from mhadsl.codegen.backends import ExprHooks, KernelArgs, TileSeq, masked_unless
from mhadsl.codegen.nvptx import i1, i32, i64


def sequence_rows(b: ir.IRBuilder, ragged: bool, cu_seqlens: ir.Value, dense_len: ir.Value,
                  batch: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(first row, length) of sequence `batch`: from the row offsets, or (0, dense_len)."""
    if not ragged:
        return i32(0), dense_len
    start = b.load(b.gep(cu_seqlens, [batch], inbounds=True, source_etype=i32), typ=i32)
    end = b.load(b.gep(cu_seqlens, [b.add(batch, i32(1))], inbounds=True, source_etype=i32),
                 typ=i32)
    return start, b.sub(end, start)


def last_index(b: ir.IRBuilder, first: ir.Value, size: int | ir.Value,
               length: ir.Value) -> ir.Value:
    """The last index of the tile [first, first + size) that lies below `length`."""
    end = b.add(first, size if isinstance(size, ir.Value) else i32(size))
    return b.sub(b.select(b.icmp_signed("<", end, length), end, length), i32(1))


class TileSequence(NamedTuple):
    """A work tile's sequence as values already read (`TileRules.seq`)."""

    bidx: ir.Value | None
    seqlen_q: ir.Value | None = None
    seqlen_k: ir.Value | None = None
    q_start: ir.Value | None = None
    k_start: ir.Value | None = None


class TileRules:
    """The declaration's mask, score and tile classification (`ExprHooks`) on one work
    tile's sequence. `seq` gives the tile's `bidx`, `seqlen_q` and `seqlen_k` (i32), read
    where a rule needs them, and its first query row and key among the call's (`q_start`,
    `k_start`) where a rule reads an operand along them: a design that keeps them in shared
    memory, where each read is a load (the backward's `_parked`), hands a `TileSequence` of
    the values it read once."""

    def __init__(self, hooks: ExprHooks, seq):
        self.hooks, self.seq = hooks, seq

    def _extents(self) -> dict:
        """The hooks' `extents` keyword where an operand follows the query rows or keys."""
        if not self.hooks.positions:
            return {}
        seq = self.seq
        return {"extents": (seq.q_start, seq.seqlen_q, seq.k_start, seq.seqlen_k)}

    def classify(self, b: ir.IRBuilder, heads: Iterable[ir.Value], q_lo: ir.Value,
                 q_hi: ir.Value | int, kv_lo: ir.Value, kv_rows: int,
                 kv_end: ir.Value | None = None, inside: ir.Value | None = None,
                 cells: bool = True,
                 q_tile: tuple[ir.Value, int] | None = None) -> tuple[ir.Value, ir.Value]:
        """(may hold a kept pair, every pair kept) for the box of query rows q_lo to q_hi
        (an int: the box's height from q_lo, cut at seqlen_q) by the `kv_rows` keys from
        kv_lo, of each query head in `heads` (a generator emits each head as the box asks
        for it). No key from `kv_end` on (by default seqlen_k) is kept: a box reaching past
        it is never all kept (`inside`: whether it does not, where the caller knows);
        `cells` False: without the call's classes; `q_tile`: the call's tile holding the
        box's rows (`ExprHooks.classify`)."""
        seqlen_q, seqlen_k = self.seq.seqlen_q, self.seq.seqlen_k
        end = seqlen_k if kv_end is None else kv_end
        if inside is None:
            inside = b.icmp_signed("<=", b.add(kv_lo, i32(kv_rows)), end)
        if self.hooks.classify is None:
            return ir.Constant(i1, 1), inside if self.hooks.mask is None else ir.Constant(i1, 0)
        bidx = self.seq.bidx
        q_rows = q_hi if isinstance(q_hi, int) else None
        if q_rows is not None:
            q_hi = last_index(b, q_lo, q_rows, seqlen_q)
        kv_hi = last_index(b, kv_lo, kv_rows, end)
        options = {} if cells else {"cells": False}
        if q_tile is not None:
            options["q_tile"] = q_tile
        may = always = None
        for h in heads:
            m, a = self.hooks.classify(b, bidx, h, q_lo, q_hi, kv_lo, kv_hi, seqlen_q, seqlen_k,
                                       q_rows=q_rows, kv_rows=kv_rows, **options)
            may, always = (m, a) if may is None else (b.or_(may, m), b.and_(always, a))
        return may, b.and_(always, inside)

    def keeps(self, b: ir.IRBuilder, h: ir.Value, q_idx, kv_idx: ir.Value,
              kv_end: ir.Value | None = None, bounds: bool = True,
              mask: bool = True) -> ir.Value | None:
        """Whether the pair (q_idx, kv_idx) of head h is kept: its key lies before `kv_end`
        (by default seqlen_k) and the mask keeps it; either test left out where the caller
        knows it holds (None where both are). `q_idx` may be a function of the builder that
        emits the row: only a mask asks for it."""
        keeps = []
        if bounds:
            end = self.seq.seqlen_k if kv_end is None else kv_end
            keeps.append(b.icmp_signed("<", kv_idx, end))
        if mask and self.hooks.mask is not None:
            seq = self.seq
            row = q_idx(b) if callable(q_idx) else q_idx
            keeps.append(self.hooks.mask(b, seq.bidx, h, row, kv_idx, seq.seqlen_q,
                                         seq.seqlen_k, **self._extents()))
        if not keeps:
            return None
        return keeps[0] if len(keeps) == 1 else b.and_(*keeps)

    def masked(self, b: ir.IRBuilder, s: ir.Value, h: ir.Value, q_idx: ir.Value,
               kv_idx: ir.Value, **keeps) -> ir.Value:
        """`s` where the pair is kept (`keeps`, with its keyword arguments), else -inf."""
        keep = self.keeps(b, h, q_idx, kv_idx, **keeps)
        return s if keep is None else b.select(keep, s, warp.fconst(warp.NEG_INF))

    def _lengths(self) -> tuple[ir.Value, ...]:
        """The lengths a score hook takes: where it reads them."""
        return (self.seq.seqlen_q, self.seq.seqlen_k) if self.hooks.score_reads_lengths else ()

    def score(self, b: ir.IRBuilder, scaled: ir.Value, h: ir.Value, q_idx: ir.Value,
              kv_idx: ir.Value) -> ir.Value:
        """The score hook on the scaled score (q.k * scale) of the pair."""
        return self.hooks.score(b, scaled, self.seq.bidx, h, q_idx, kv_idx, *self._lengths(),
                                **self._extents())

    def derivative(self, b: ir.IRBuilder, scaled: ir.Value, h: ir.Value, q_idx: ir.Value,
                   kv_idx: ir.Value) -> ir.Value:
        """d score / d s of the score hook at the scaled score `scaled` of the pair."""
        return self.hooks.derivative(b, scaled, self.seq.bidx, h, q_idx, kv_idx,
                                     *self._lengths(), **self._extents())

    def scatter_reads(self, b: ir.IRBuilder, pairs, h: ir.Value) -> None:
        """The pairs' share of the gradients of the f32 tensors the score reads, for the
        thread's pairs of head h in one tile, each (dz: the gradient of its scored logit, its
        scaled score, q_idx, kv_idx): dz times d score / d each element read. Every lane of
        the warp calls it (a warp sum)."""
        self.hooks.scatter_reads(b, pairs, self.seq.bidx, h, *self._lengths(),
                                 **self._extents())

    def sink_log2(self, b: ir.IRBuilder, h: ir.Value) -> ir.Value | None:
        """Query head h's sink logit in the log2 domain, or None without a sink rule."""
        if self.hooks.sink is None:
            return None
        seq = self.seq
        sink = self.hooks.sink(b, seq.bidx, h, seq.seqlen_q, seq.seqlen_k, **self._extents())
        return b.fmul(sink, warp.fconst(warp.LOG2E))

    @staticmethod
    def finish_row(b: ir.IRBuilder, row_max: ir.Value, scale_log2: ir.Value, partial: ir.Value,
                   sink_log2: ir.Value | None) -> tuple[ir.Value, Callable[[], ir.Value]]:
        """A row's end from its running max and this thread's part of its sum (`partial`,
        summed over the row's quad): (what O's accumulators are multiplied by, a function
        that emits the row's LSE where it is called), with the sink's logit in the
        denominator where there is one (`sink_log2`)."""
        total, empty, inv = warp.row_sum(b, partial)
        if sink_log2 is None:
            return inv, lambda: warp.row_lse(b, row_max, scale_log2, total, empty)
        return warp.sink_finish(b, row_max, scale_log2, total, empty, sink_log2)

    def scale_log2(self, b: ir.IRBuilder, softmax_scale: ir.Value) -> ir.Value:
        """What the softmax multiplies a score by for the log2 domain (ex2): the softmax
        scale times log2(e) on raw scores; log2(e) alone after a score hook (whose input
        was scaled)."""
        if self.hooks.score is None:
            return b.fmul(softmax_scale, warp.fconst(warp.LOG2E))
        return warp.fconst(warp.LOG2E)


class WorkTile:
    """What the forward designs derive from the scheduler's SeqInfo (`TileSeq`) for one work
    tile: its sequence (`bidx`), query head (`h`) and K/V head (`hk`), its query rows from
    `q0` to `q_hi`, the sequence's first rows in Q (`q_start`) and K/V (`k_start`), its
    lengths and its number of KV tiles; and which KV tiles the declaration's mask proves
    empty. `config` is the design's build config (block_m, block_n, gqa_group, ragged)."""

    def __init__(self, b: ir.IRBuilder, config, args: KernelArgs, hooks: ExprHooks,
                 seq: TileSeq):
        self.c, self.hooks = config, hooks
        self.rules = TileRules(hooks, self)
        self.bidx, self.h, self.q0 = seq.prompt_idx, seq.head_idx, seq.prompt_offset
        self.seqlen_q, self.q_start = seq.seq_len, seq.start_of_seq
        self.hk = b.udiv(self.h, i32(config.gqa_group)) if config.gqa_group > 1 else self.h
        self.k_start, self.seqlen_k = self._key_rows(b, args)
        self.n_blocks = b.udiv(b.add(self.seqlen_k, i32(config.block_n - 1)),
                               i32(config.block_n))
        self.q_hi = last_index(b, self.q0, config.block_m, self.seqlen_q)

    def _key_rows(self, b: ir.IRBuilder, args: KernelArgs) -> tuple[ir.Value, ir.Value]:
        """(first row, length) of the sequence in K and V: from cu_seqlens_k, but the query
        rows' (the SeqInfo's, which are cu_seqlens_q's) where the call passes the same
        offsets for both, as self-attention does: no dependent global loads at every work
        tile's start (it pays on the H200 together with the sm90 epilogue's uniform branch)."""
        if not self.c.ragged:
            return sequence_rows(b, False, args.cu_seqlens_k, args.seqlen_k, self.bidx)
        same = b.icmp_unsigned("==", b.ptrtoint(args.cu_seqlens_k, i64),
                               b.ptrtoint(args.cu_seqlens_q, i64))
        return tuple(masked_unless(b, same, [self.q_start, self.seqlen_q], lambda bb: list(
            sequence_rows(bb, True, args.cu_seqlens_k, args.seqlen_k, self.bidx))))

    # Whether the design finds a work tile's KV range with the warp's lanes asking of 32
    # tiles at once: a sliding window's query tile skips the tiles before its band, and a
    # causal one those after the diagonal, in a round or two where one tile a round took a
    # round per tile skipped (faster on sm90 for a sliding window). Off, the range is found
    # one tile a round from 0, to `n_blocks` (sm80: the search's registers moved a build
    # onto its fallback tile).
    finds_range_together = False

    def kv_range(self, b: ir.IRBuilder) -> tuple[ir.Value, ir.Value]:
        """(the first KV tile that may hold a kept pair, one past the last; the first is the
        end where none may): together, each asks of its end tile alone first (tile 0 under
        a causal mask, the last of a sequence without a window's right edge), then
        searches."""
        if self.hooks.classify is None:
            return i32(0), self.n_blocks
        if not self.finds_range_together:
            return self.next_nonempty(b, i32(0), self.n_blocks), self.n_blocks
        start, end = i32(0), self.n_blocks
        if self.hooks.classify_loads:
            # the interval analysis's range first (arithmetic: a search round costs no
            # load), then the call's classes inside it only
            start, end = self._range(b, start, end,
                                     lambda bb, n: self.classify(bb, n, cells=False)[0])
        return self._range(b, start, end, self.may_keep)

    def _range(self, b: ir.IRBuilder, start: ir.Value, end: ir.Value, may):
        """(the first KV tile n in [start, end) for which `may(b, n)` holds, else `end`; one
        past the last, from the first)."""
        first = masked_unless(b, may(b, start), [start], lambda bb: [
            warp.first_true(bb, bb.add(start, i32(1)), end, may)])[0]
        return first, self.kept_end(b, first, end, may)

    @staticmethod
    def kept_end(b: ir.IRBuilder, first: ir.Value, end: ir.Value, may) -> ir.Value:
        """One past the last KV tile n in [first, end) for which `may(b, n)` holds, `first`
        where none does (`first` <= `end`): the warp's lanes ask of tile `end - 1` alone
        first, then search down together."""
        last = b.sub(end, i32(1))
        return masked_unless(b, may(b, last), [end], lambda bb: [
            warp.last_true(bb, first, last, may)])[0]

    def may_keep(self, b: ir.IRBuilder, n: ir.Value) -> ir.Value:
        """Whether KV tile n may hold a kept pair (`classify`'s first answer)."""
        return self.classify(b, n)[0]

    def classify(self, b: ir.IRBuilder, n: ir.Value,
                 rows: tuple[ir.Value, ir.Value] | None = None,
                 cells: bool = True) -> tuple[ir.Value, ir.Value]:
        """(may hold a kept pair, every pair kept) for KV tile n, the sequence's tail
        included (a tile past `seqlen_k` is never all kept), over the work tile's query rows
        or those from `rows[0]` to `rows[1]` (a part of them: a warpgroup's own); `cells`
        False: the interval analysis's alone, without the call's classes."""
        q_lo, q_hi = rows or (self.q0, self.q_hi)
        kv_lo = b.mul(n, i32(self.c.block_n))
        # (the work tile's rows are the call's tile q0 / block_m, whose cell holds them)
        q_tile = (self.q0, self.c.block_m) if self.hooks.classify_loads else None
        return self.rules.classify(b, (self.h,), q_lo, q_hi, kv_lo, self.c.block_n,
                                   inside=self.in_bounds(b, n), cells=cells, q_tile=q_tile)

    def in_bounds(self, b: ir.IRBuilder, n: ir.Value) -> ir.Value:
        """Whether KV tile n lies inside the K/V sequence (no key past `seqlen_k`)."""
        kv_end = b.mul(b.add(n, i32(1)), i32(self.c.block_n))
        return b.icmp_signed("<=", kv_end, self.seqlen_k)

    def scored(self, b: ir.IRBuilder, scaled: ir.Value, q_idx: ir.Value,
               kv_idx: ir.Value) -> ir.Value:
        """The declaration's score hook on the scaled score (q.k * scale) of the pair
        (q_idx, kv_idx)."""
        return self.rules.score(b, scaled, self.h, q_idx, kv_idx)

    def masked(self, b: ir.IRBuilder, s: ir.Value, q_idx: ir.Value, kv_idx: ir.Value,
               bounds: bool = True, mask: bool = True) -> ir.Value:
        """`s` where the pair (q_idx, kv_idx) is kept (inside the K/V sequence and the mask;
        either left out where the caller knows it holds), else -inf."""
        return self.rules.masked(b, s, self.h, q_idx, kv_idx, bounds=bounds, mask=mask)

    def row_keys(self, b: ir.IRBuilder, q_idx: ir.Value,
                 first_key: ir.Value) -> tuple[ir.Value | None, ir.Value]:
        """The keys the row of `q_idx` keeps (`hooks.kv_limits`), as offsets [lo, hi] from
        `first_key` (lo None: from key 0 on), the sequence's end folded into hi."""
        lo, hi = self.hooks.kv_limits(b, self.bidx, self.h, q_idx, self.seqlen_q,
                                      self.seqlen_k)
        last = b.sub(self.seqlen_k, i32(1))
        hi = last if hi is None else b.select(b.icmp_signed("<", hi, last), hi, last)
        return (None if lo is None else b.sub(lo, first_key)), b.sub(hi, first_key)

    def next_nonempty(self, b: ir.IRBuilder, start: ir.Value, end: ir.Value) -> ir.Value:
        """The first KV tile index n in [start, end) that may hold a kept pair, else `end`
        (the range's end, `kv_range`): how every design skips the KV tiles the mask proves
        empty (never loaded, never computed). One candidate per round: inside the KV loop
        the warp's search (`together`) measured slower on causal prefill (sm90) and moved
        sm80 builds onto fallback tiles."""
        if self.hooks.classify is None:
            return start
        return warp.first_true(b, start, end, self.may_keep, together=False)
