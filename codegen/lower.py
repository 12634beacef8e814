"""Lowering of checked `.mha` statements and expressions to LLVM IR.

One `FunctionLowering` turns a rule or fn body into IR inside the function being built.
Values are `ir.Value`s (i1 for bool, i32 for u32/i32, float for f32); records are dicts
of field -> value; `State` and the tile summary are pointers to their structs. What a
builtin means on a target (a special register on the GPU, a field of the host
environment) is answered by a `Builtins` object, so the same rules compile for both.
Locals live in allocas that LLVM's mem2reg turns into registers.
"""
from __future__ import annotations

from typing import Callable

from llvmlite import ir

from mhadsl.codegen import nvptx, tensor_reads
from mhadsl.codegen.nvptx import f32, i1, i32, i64
from mhadsl.codegen.target import NVPTX_TRIPLE
from mhadsl.codegen.tensor_reads import linear_terms
from mhadsl.codegen.valid_work import DenseIndex, RaggedIndex, TileIndex, schedule_is
from mhadsl.front import ast
from mhadsl.front.builtin_functions import DEVICE_FUNCTIONS, FUNCTIONS
from mhadsl.front.semantics import SLOT_COUNT
from mhadsl.front.check import CheckedProgram, Symbol
from mhadsl.front.types import (
    BOOL, COUNTER, DIM3, F32, I32, INT_LITERAL, RECORD_FIELDS, SCHEDULE, SCHEDULES, SEQ_INFO,
    STATE, SYNC, SYNCS, TILE_SUMMARY, TYPE_NAMES, U32, TensorTy, Ty,
)

Value = object  # ir.Value | dict (record) | _Dim3


LLVM_TYPES = {U32: i32, I32: i32, BOOL: i1, F32: f32, SCHEDULE: i32, SYNC: i32}

# Memory layout of the structs the rules exchange, shared by the GPU kernels and the host.
STATE_FIELDS = ("idx", "slots", "max_idx")
TS_FIELDS = ("batch_size", "max_num_prompt_tiles", "max_seq_len", "num_heads", "valid_length",
             "tile_index")
ENV_FIELDS = ("counter", "num_sms", "block_idx", "grid_dim", "thread_idx", "fuel",
              "ctas_per_sm")


def record_type(ty: Ty) -> ir.LiteralStructType:
    """WorkInfo / SeqInfo as they sit in memory (bool stored as i8)."""
    return ir.LiteralStructType([ir.IntType(8) if t == BOOL else LLVM_TYPES[t]
                                 for t in RECORD_FIELDS[ty].values()])


def state_type(slots_space: int) -> ir.LiteralStructType:
    return ir.LiteralStructType([i32, nvptx.ptr(slots_space), i32])


def ts_type(global_space: int) -> ir.LiteralStructType:
    return ir.LiteralStructType([i32, i32, i32, i32, nvptx.ptr(global_space),
                                 nvptx.ptr(global_space)])


def env_type(global_space: int) -> ir.LiteralStructType:
    dim3 = ir.ArrayType(i32, 3)
    return ir.LiteralStructType([nvptx.ptr(global_space), i32, dim3, dim3, dim3, i64, i32])


def alloca(builder: ir.IRBuilder, ty: ir.Type, name: str = "") -> ir.AllocaInstr:
    """A stack slot typed as an opaque `ptr`, as LLVM 22 wants (llvmlite types them)."""
    slot = builder.alloca(ty, name=name)
    slot.type = nvptx.ptr()
    return slot


def load(builder: ir.IRBuilder, slot: ir.AllocaInstr) -> ir.Value:
    return builder.load(slot, typ=slot.allocated_type)


class _Dim3:
    def __init__(self, group: str):
        self.group = group


class Builtins:
    """What target-dependent builtins lower to. Subclassed per target by the scheduler."""

    gpu = False  # f32 math through the GPU's approximations (mhadsl.front.builtin_functions)

    def value(self, lower: FunctionLowering, name: str) -> Value:
        raise NotImplementedError(name)

    def dim3(self, lower: FunctionLowering, group: str, axis: str) -> ir.Value:
        raise NotImplementedError(group)

    def barrier(self, lower: FunctionLowering, sync: int) -> None:
        raise NotImplementedError

    def loop_fuel(self, lower: FunctionLowering) -> ir.Value | None:
        """An i1 that is true while a `while` loop may go on (None: no bound)."""
        return None

    def memoized(self, lower: FunctionLowering, name: str, key: list[ir.Value],
                 compute: Callable[[], dict[str, ir.Value]]) -> dict[str, ir.Value]:
        """The values of pure builtin `name` at `key`, as `compute()` emits them (a target
        may take them from where another thread published them instead)."""
        return compute()


class FunctionLowering:
    """Lowers one body into the current function of `builder`."""

    def __init__(self, builder: ir.IRBuilder, program: CheckedProgram, builtins: Builtins,
                 bindings: dict[object, Value], *, tile_m: int = 0, gqa_group: int = 1,
                 search_ways: int = 2,
                 param_values: dict[str, Callable[[], Value]] | None = None,
                 default_int: Ty = U32, per_element: bool = False,
                 branch_free_reads: bool = False):
        self.b = builder
        # a rule run once per element of a tile: a read's index takes its sums' constants
        # out (`offset_sum`); `branch_free_reads`: `&&` and `||` read at once (`reads_at_will`)
        self.per_element = per_element
        self.branch_free_reads = branch_free_reads
        self.in_index = False  # lowering a tensor read's index
        self.default_int = default_int  # what integer literals are on their own (i32 in masks)
        self.program = program
        self.builtins = builtins
        # Symbol.node (a role string, Param, Let or Constant node) -> value or alloca
        self.bindings = bindings
        self.tile_m = tile_m
        self.gqa_group = gqa_group
        self.search_ways = search_ways
        self.param_values = param_values or {}
        self.locals: dict[ast.Let, object] = {}
        self.ret_slot: object = None
        self.ret_block: ir.Block | None = None
        self.ret_ty: Ty | None = None
        # on_read(read, its index per axis, inside the tensor): `kernel.scatter_hook`'s
        self.on_read: Callable[[ast.Index, list[Value], Value], None] | None = None

    # ------------------------------------------------------------ helpers
    def entry_alloca(self, ty: ir.Type, name: str = "") -> ir.AllocaInstr:
        fn = self.b.function
        with self.b.goto_block(fn.entry_basic_block):
            if fn.entry_basic_block.instructions:
                self.b.position_before(fn.entry_basic_block.instructions[0])
            return alloca(self.b, ty, name)

    def ty(self, e: ast.Expr) -> Ty:
        ty = self.program.types[e]
        return self.default_int if ty == INT_LITERAL else ty

    def operand_types(self, left: ast.Expr, right: ast.Expr) -> tuple[Ty, Ty]:
        """The types two operands of an operator meet in: a literal takes the other's (as
        the checker and the reference give it: `u32(x) < 100` compares unsigned)."""
        lt, rt = self.program.types[left], self.program.types[right]
        if lt == INT_LITERAL and rt != INT_LITERAL:
            lt = rt
        elif rt == INT_LITERAL and lt != INT_LITERAL:
            rt = lt
        return self.ty(left) if lt == INT_LITERAL else lt, \
            self.ty(right) if rt == INT_LITERAL else rt

    def signed(self, e: ast.Expr) -> bool:
        return self.ty(e) == I32

    def new_block(self, name: str) -> ir.Block:
        return self.b.append_basic_block(name)

    # ------------------------------------------------------------ bodies
    def lower_body(self, stmts, result_ty: Ty | None) -> object:
        """Lower a body whose `return`s store into a result slot; returns the slot."""
        saved = self.ret_slot, self.ret_block, self.ret_ty
        self.ret_ty = result_ty
        self.ret_slot = self.alloc_value(result_ty) if result_ty is not None else None
        self.ret_block = self.new_block("return")
        self.block(stmts)
        if not self.b.block.is_terminated:
            self.b.branch(self.ret_block)
        self.b.position_at_end(self.ret_block)
        slot = self.ret_slot
        self.ret_slot, self.ret_block, self.ret_ty = saved
        return slot

    def alloc_value(self, ty: Ty) -> object:
        """Storage for a value of type `ty`: an alloca, or a dict of them for records."""
        if ty in RECORD_FIELDS and ty != STATE:
            return {f: self.entry_alloca(LLVM_TYPES[t], f) for f, t in RECORD_FIELDS[ty].items()}
        if ty in (STATE, TILE_SUMMARY, COUNTER) or ty.name == "Slots":
            return self.entry_alloca(nvptx.ptr(), ty.name)
        return self.entry_alloca(LLVM_TYPES[ty])

    def store_value(self, slot: object, value: Value) -> None:
        if isinstance(slot, dict):
            for f, s in slot.items():
                self.b.store(value[f], s)
        else:
            self.b.store(value, slot)

    def load_value(self, slot: object) -> Value:
        if isinstance(slot, dict):
            return {f: load(self.b, s) for f, s in slot.items()}
        return load(self.b, slot)

    def block(self, stmts) -> None:
        for s in stmts:
            if self.b.block.is_terminated:
                return
            self.stmt(s)

    def stmt(self, s: ast.Stmt) -> None:
        if isinstance(s, ast.Let):
            value = self.expr(s.value) if s.type is None else \
                self.operand(s.value, TYPE_NAMES[s.type.name])
            slot = self.alloc_like(value)
            self.store_value(slot, value)
            self.locals[s] = slot
        elif isinstance(s, ast.Assign):
            self.assign(s)
        elif isinstance(s, ast.If):
            cond = self.expr(s.cond)
            then_bb, else_bb, end_bb = self.new_block("then"), self.new_block("else"), \
                self.new_block("endif")
            self.b.cbranch(cond, then_bb, else_bb)
            for bb, body in ((then_bb, s.then), (else_bb, s.orelse)):
                self.b.position_at_end(bb)
                self.block(body)
                if not self.b.block.is_terminated:
                    self.b.branch(end_bb)
            self.b.position_at_end(end_bb)
        elif isinstance(s, ast.While):
            cond_bb, body_bb, end_bb = self.new_block("while"), self.new_block("body"), \
                self.new_block("endwhile")
            self.b.branch(cond_bb)
            self.b.position_at_end(cond_bb)
            cond = self.expr(s.cond)
            fuel = self.builtins.loop_fuel(self)
            if fuel is not None:
                cond = self.b.and_(cond, fuel)
            self.b.cbranch(cond, body_bb, end_bb)
            self.b.position_at_end(body_bb)
            self.block(s.body)
            if not self.b.block.is_terminated:
                self.b.branch(cond_bb)
            self.b.position_at_end(end_bb)
        elif isinstance(s, ast.Return):
            if self.ret_slot is not None and not isinstance(s.value, ast.NoneLit):
                self.store_value(self.ret_slot, self.operand(s.value, self.ret_ty))
            self.on_return(s)
            self.b.branch(self.ret_block)
        else:
            assert isinstance(s, ast.ExprStmt)
            self.expr(s.expr)

    def on_return(self, s: ast.Return) -> None:
        """Hook for callers that track more than the value (advance's `none`)."""

    def alloc_like(self, value: Value) -> object:
        if isinstance(value, dict):
            return {f: self.entry_alloca(v.type, f) for f, v in value.items()}
        return self.entry_alloca(value.type)

    def assign(self, s: ast.Assign) -> None:
        target = s.target
        value = self.operand(s.value, self.ty(target))
        if s.op != "=":
            current = self.expr(target)  # loads the old value
            value_ty, target_ty = self.operand_types(s.value, target)
            value = self.arith(s.op[:-1], current, value, I32 in (value_ty, target_ty),
                               self.ty(target))
        if isinstance(target, ast.Name):
            sym = self.program.refs[target]
            self.b.store(value, self.locals[sym.node])
        elif isinstance(target, ast.Attr):
            state_ptr = self.expr(target.obj)
            self.b.store(value, self.state_field(state_ptr, target.name))
        else:
            assert isinstance(target, ast.Index)
            self.b.store(value, self.slot_pointer(target))

    # ------------------------------------------------------------ expressions
    def expr(self, e: ast.Expr) -> Value:
        literal = self.program.literals.get(e)
        if literal is not None:  # folded exactly by the checker; it fits where it is used
            return i1(literal) if isinstance(literal, bool) else i32(literal & 0xFFFFFFFF)
        if isinstance(e, ast.FloatLit):
            return f32(e.value)
        if isinstance(e, ast.BoolLit):
            return i1(int(e.value))
        if isinstance(e, ast.Name):
            return self.name(e)
        if isinstance(e, ast.Attr):
            return self.attr(e)
        if isinstance(e, ast.Index):
            if isinstance(self.ty(e.obj), TensorTy):
                return self.tensor_read(e)
            return self.b.load(self.slot_pointer(e), typ=i32)
        if isinstance(e, ast.Unary):
            v = self.operand(e.operand, self.ty(e))
            if e.op == "!":
                return self.b.not_(v)
            if e.op == "~":
                return self.b.not_(v)
            return self.b.fneg(v) if self.ty(e) == F32 else self.b.neg(v)
        if isinstance(e, ast.Binary):
            return self.binary(e)
        if isinstance(e, ast.Tuple):
            return [self.expr(i) for i in e.items]
        assert isinstance(e, ast.Call)
        return self.call(e)

    def coerce(self, v: Value, src: Ty, dst: Ty) -> Value:
        """Integer to f32 promotion (the only implicit conversion)."""
        if src == INT_LITERAL:
            src = self.default_int
        if dst == F32 and src in (U32, I32):
            return self.b.uitofp(v, f32) if src == U32 else self.b.sitofp(v, f32)
        return v

    def tensor_read(self, e: ast.Index) -> Value:
        """An element of a tensor operand (`codegen.kernel.TensorArgs`), 0 where an index
        lies outside its axis (`codegen.tensor_reads`); on the GPU, outside the backward,
        a predicated load whose indices' constants join its address last."""
        indices, node = [], e
        while isinstance(node, ast.Index):
            indices.append(node.index)
            node = node.obj
        tensor = self.bindings[self.program.refs[node].node]
        predicated = self.branch_free_reads and self.b.module.triple == NVPTX_TRIPLE
        inside, address, at_axes = tensor_reads.bounds(
            self.b, tensor, [self.index_value(i) for i in reversed(indices)], predicated)
        if self.on_read:
            self.on_read(e, at_axes, inside)
        return tensor_reads.load(self.b, tensor, LLVM_TYPES[self.ty(e)], inside, address,
                                 predicated)

    def index_value(self, index: ast.Expr):
        """A tensor read's index, lowered when it is needed (`offset_sum` applies)."""
        def value() -> ir.Value:
            self.in_index, outer = True, self.in_index
            v = self.expr(index)
            self.in_index = outer
            return v
        return value

    def operand(self, e: ast.Expr, ty: Ty) -> Value:
        """`e` lowered as a value of type `ty`; a literal meets f32 exactly."""
        literal = self.program.literals.get(e)
        if literal is not None and ty == F32:
            return f32(float(literal))
        return self.coerce(self.expr(e), self.ty(e), ty)

    def binary(self, e: ast.Binary) -> ir.Value:
        """A chain of operators (`ast.left_chain`), in a loop."""
        _, ops = ast.left_chain(e, self.program.literals)
        value = None  # the chain so far: the left operand of the next operator
        for op in ops:
            value = self.binary_step(op, value)
        return value

    def binary_step(self, e: ast.Binary, left: ir.Value | None) -> ir.Value:
        """One operator; `left` is its left operand already lowered (None: lower it)."""
        if e.op in ("&&", "||"):
            return self.short_circuit(e, self.expr(e.left) if left is None else left)
        lt, rt = self.operand_types(e.left, e.right)
        common = F32 if F32 in (lt, rt) else (I32 if I32 in (lt, rt) else lt)
        left = self.operand(e.left, common) if left is None else self.coerce(left, lt, common)
        return self.arith(e.op, left, self.operand(e.right, common), common == I32, common)

    def arith(self, op: str, a: ir.Value, b: ir.Value, signed: bool, ty: Ty) -> ir.Value:
        B = self.b
        if ty == F32 or a.type == f32:
            if op == "!=":  # (IEEE, as NumPy: a NaN is unequal to everything, itself too)
                return B.fcmp_unordered(op, a, b)
            if op in ("==", "<", "<=", ">", ">="):
                return B.fcmp_ordered(op, a, b)
            divide = (lambda x, y: nvptx.divide(B, x, y)) if self.gpu else B.fdiv
            return {"+": B.fadd, "-": B.fsub, "*": B.fmul, "/": divide}[op](a, b)
        if op in ("==", "!=", "<", "<=", ">", ">="):
            return (B.icmp_signed if signed else B.icmp_unsigned)(op, a, b)
        if op in ("/", "%"):
            # LLVM's division by zero and INT_MIN / -1 are undefined (a trap on the host).
            # Dividing by 1 instead gives INT_MIN / -1 its wrapped result (INT_MIN, and 0 for
            # %) for free; a zero divisor then selects 0 (mhadsl.front.semantics).
            zero = B.icmp_unsigned("==", b, b.type(0))
            bad = zero
            if signed:
                overflow = B.and_(B.icmp_signed("==", a, a.type(-2**31)),
                                  B.icmp_signed("==", b, b.type(-1)))
                bad = B.or_(zero, overflow)
            safe = B.select(bad, b.type(1), b)
            q = (B.sdiv if signed else B.udiv)(a, safe) if op == "/" else \
                (B.srem if signed else B.urem)(a, safe)
            return B.select(zero, b.type(0), q)
        if op in ("<<", ">>"):
            return self.shift(op, a, b, signed)
        if op in ("+", "-") and self.per_element and self.in_index:
            return self.offset_sum(op, a, b)
        return {"+": B.add, "-": B.sub, "*": B.mul, "&": B.and_, "|": B.or_,
                "^": B.xor}[op](a, b)

    def offset_sum(self, op: str, a: ir.Value, b: ir.Value) -> ir.Value:
        """`a + b` or `a - b` (wrapping) with the constants of both sides' sums taken out
        and added last: a rule run per element gets its indices as a tile's bases plus the
        element's constants, so an index `q_idx - kv_idx` becomes one difference of the
        bases (the same instructions for every element, which LLVM merges) plus a
        constant, and the elements of a diagonal read one address. (LLVM leaves a base
        plus a constant that has other uses as it is, and so cannot see this itself.)"""
        (terms_a, const_a), (terms_b, const_b) = linear_terms(a), linear_terms(b)
        if const_a == 0 and const_b == 0:
            return self.b.add(a, b) if op == "+" else self.b.sub(a, b)
        sign = 1 if op == "+" else -1
        total = None  # (a sum of no terms: 0)
        for s, v in terms_a + [(sign * s, v) for s, v in terms_b]:
            total = v if s > 0 and total is None else \
                (self.b.add if s > 0 else self.b.sub)(a.type(0) if total is None else total, v)
        total = a.type(0) if total is None else total
        const = (const_a + sign * const_b + 2**31) % 2**32 - 2**31  # (i32's range)
        return total if const == 0 else self.b.add(total, a.type(const))

    def shift(self, op: str, a: ir.Value, count: ir.Value, signed: bool) -> ir.Value:
        """Shifts by 32 or more are poison in LLVM; here they saturate (mhadsl.front.semantics):
        0, or the sign fill for `>>` of an i32. The count is clamped before the shift so
        no poison is ever made, on the host or the GPU."""
        B = self.b
        big = B.icmp_unsigned(">=", count, count.type(32))
        safe = B.select(big, count.type(31), count)
        if op == ">>" and signed:
            return B.ashr(a, safe)  # shifting by 31 is the sign fill
        shifted = B.shl(a, safe) if op == "<<" else B.lshr(a, safe)
        return B.select(big, a.type(0), shifted)

    def short_circuit(self, e: ast.Binary, left: ir.Value) -> ir.Value:
        if self.branch_free_reads and self.reads_at_will(e.right):
            # (a select, not an and: the right side may be poison where the left decides)
            right = self.expr(e.right)
            return self.b.select(left, right, i1(0)) if e.op == "&&" else \
                self.b.select(left, i1(1), right)
        left_bb = self.b.block
        rhs_bb, end_bb = self.new_block("rhs"), self.new_block("sc_end")
        if e.op == "&&":
            self.b.cbranch(left, rhs_bb, end_bb)
        else:
            self.b.cbranch(left, end_bb, rhs_bb)
        self.b.position_at_end(rhs_bb)
        right = self.expr(e.right)
        right_bb = self.b.block
        self.b.branch(end_bb)
        self.b.position_at_end(end_bb)
        phi = self.b.phi(i1)
        phi.add_incoming(i1(0 if e.op == "&&" else 1), left_bb)
        phi.add_incoming(right, right_bb)
        return phi

    def reads_at_will(self, e: ast.Expr) -> bool:
        """Whether `e` reads a tensor and calls no fn, method or device function: reads
        that cannot fault (each stays inside its tensor), which LLVM would not move above
        a short circuit's branch itself."""
        stack, reads = [e], False
        while stack:
            node = stack.pop()
            if isinstance(node, ast.Call) and not (
                    isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS):
                return False
            reads = reads or isinstance(node, ast.Index)
            stack.extend(ast.children(node))
        return reads

    def name(self, e: ast.Name) -> Value:
        sym: Symbol = self.program.refs[e]
        if sym.kind == "local":
            return self.load_value(self.locals[sym.node])
        if sym.kind == "builtin":
            if sym.name in SCHEDULES:
                return i32(SCHEDULES.index(sym.name))
            if sym.name in SYNCS:
                return i32(SYNCS.index(sym.name))
            if sym.name in ("tile_m", "gqa_group"):  # constants of the build
                return i32(getattr(self, sym.name))
            if sym.ty == DIM3:
                return _Dim3(sym.name)
            return self.builtins.value(self, sym.name)
        if sym.kind in ("sched_param", "constant"):
            return self.param_values[sym.name]()
        value = self.bindings[sym.node]
        return self.load_value(value) if sym.kind == "fn_param" else value

    def attr(self, e: ast.Attr) -> Value:
        obj = self.expr(e.obj)
        obj_ty = self.ty(e.obj)
        if isinstance(obj, _Dim3):
            return self.builtins.dim3(self, obj.group, e.name)
        if obj_ty == TILE_SUMMARY:
            if e.name == "has_valid_length":
                vl = self.ts_field(obj, "valid_length")
                return self.b.icmp_unsigned("!=", self.b.ptrtoint(vl, i64), i64(0))
            return self.ts_field(obj, e.name)
        if obj_ty == STATE:
            k = STATE_FIELDS.index(e.name)
            return self.b.load(self.state_field(obj, e.name),
                               typ=self.state_struct().elements[k])
        if obj_ty == SEQ_INFO and e.name == "is_valid":
            return self.b.icmp_unsigned(">", obj["seq_len"], obj["prompt_offset"])
        return obj[e.name]

    def state_field(self, state_ptr: ir.Value, name: str) -> ir.Value:
        return self.b.gep(state_ptr, [i32(0), i32(STATE_FIELDS.index(name))],
                          source_etype=self.state_struct())

    def state_struct(self) -> ir.LiteralStructType:
        return self.builtins.state_struct

    def ts_field(self, ts_ptr: ir.Value, name: str) -> ir.Value:
        k = TS_FIELDS.index(name)
        ptr = self.b.gep(ts_ptr, [i32(0), i32(k)], source_etype=self.builtins.ts_struct)
        return self.b.load(ptr, typ=self.builtins.ts_struct.elements[k])

    def slot_pointer(self, e: ast.Index) -> ir.Value:
        """`slots[i]` is slot i modulo SLOT_COUNT: never outside the CTA's slots."""
        slots = self.expr(e.obj)
        index = self.b.urem(self.expr(e.index), i32(SLOT_COUNT))
        return self.b.gep(slots, [index], source_etype=i32)

    # ------------------------------------------------------------ calls
    def call(self, e: ast.Call) -> Value:
        func = e.func
        if isinstance(func, ast.Attr):
            return self.ts_method(self.expr(func.obj), func.name, [self.expr(a) for a in e.args])
        name = func.id
        if name in self.program.fns:
            fn = self.program.fns[name]
            return self.inline_fn(fn, [self.operand(a, TYPE_NAMES[p.type.name])
                                       for a, p in zip(e.args, fn.params)])
        if TYPE_NAMES.get(name) in RECORD_FIELDS:
            given = {kw.name: self.expr(kw.value) for kw in e.kwargs}
            if name == "State":
                return self.make_state(given)
            return {f: given[f] for f in RECORD_FIELDS[TYPE_NAMES[name]]}
        if name in DEVICE_FUNCTIONS:
            return DEVICE_FUNCTIONS[name].lower(self, e.args)
        return FUNCTIONS[name].lower(self, e.args, self.ty(e))

    @property
    def gpu(self) -> bool:
        """Whether f32 math lowers to the GPU's fast math (`builtin_functions`, `nvptx.divide`)."""
        return self.builtins.gpu

    def intrinsic(self, name: str, *args: ir.Value) -> ir.Value:
        """A call to the f32 intrinsic `name`."""
        return nvptx.call(self.b, name, f32, list(args))

    def cast(self, arg: ast.Expr, dst: Ty) -> ir.Value:
        """`u32(x)`, `i32(x)`, `f32(x)` (mhadsl.front.semantics): integers keep their bits, floats
        truncate and saturate (LLVM's plain fptosi is poison out of range)."""
        src = self.ty(arg)
        if src == BOOL:
            return self.coerce(self.b.zext(self.expr(arg), i32), U32, dst)
        if src != F32 or dst == F32:
            return self.operand(arg, dst)
        kind = "fptosi" if dst == I32 else "fptoui"
        return nvptx.call(self.b, f"llvm.{kind}.sat.i32.f32", i32, [self.expr(arg)])

    def make_state(self, given: dict[str, ir.Value]) -> ir.Value:
        ptr = self.entry_alloca(self.state_struct(), "state")
        for f in STATE_FIELDS:
            self.b.store(given[f], self.state_field(ptr, f))
        return ptr

    def inline_fn(self, fn: ast.FnDecl, args: list[Value]) -> Value:
        # The callee sees the caller's env, ts and step slot (the memo's) but none of its names.
        bindings = {k: v for k, v in self.bindings.items() if k in ("env", "ts", "pipeline_idx")}
        for p, a in zip(fn.params, args):
            slot = self.alloc_like(a)
            self.store_value(slot, a)
            bindings[p] = slot
        inner = FunctionLowering(self.b, self.program, self.builtins, bindings,
                                 tile_m=self.tile_m, gqa_group=self.gqa_group,
                                 search_ways=self.search_ways,
                                 param_values=self.param_values,
                                 default_int=self.default_int)
        slot = inner.lower_body(fn.body, TYPE_NAMES[fn.ret.name])
        return self.load_value(slot)

    # ------------------------------------------------------------ tile summary
    def ts_method(self, ts: ir.Value, name: str, args: list[Value]) -> Value:
        B = self.b
        tiles = self.ts_field(ts, "max_num_prompt_tiles")
        heads = self.ts_field(ts, "num_heads")
        batch = self.ts_field(ts, "batch_size")
        if name == "num_work":
            return B.mul(B.mul(tiles, heads), batch)
        if name == "work_info":
            idx, schedule = args
            one = i32(1)
            tiles_nz = self.umax(tiles, one)
            heads_nz = self.umax(heads, one)
            q_tile = B.urem(idx, tiles_nz)
            rest = B.udiv(idx, tiles_nz)
            head = B.urem(rest, heads_nz)
            seq = B.udiv(rest, heads_nz)
            rotate = B.and_(B.icmp_unsigned("==", schedule, i32(SCHEDULES.index("PROMPT_ROTATE"))),
                            B.trunc(head, i1))
            q_tile = B.select(rotate, B.sub(B.sub(tiles, one), q_tile), q_tile)
            # LONGEST_FIRST: the query tile slowest, from the last; then batch, head fastest.
            # INTERLEAVED: the same from the first query tile.
            longest = B.icmp_unsigned("==", schedule, i32(SCHEDULES.index("LONGEST_FIRST")))
            interleaved = schedule_is(B, schedule, "INTERLEAVED")
            by_level = longest if interleaved is None else B.or_(longest, interleaved)
            per_level = self.umax(B.mul(heads, batch), one)
            level, rest = B.udiv(idx, per_level), B.urem(idx, per_level)
            from_last = B.sub(B.sub(tiles, one), level)
            if interleaved is not None:
                q_tile = B.select(interleaved, level, q_tile)
            q_tile = B.select(longest, from_last, q_tile)
            head = B.select(by_level, B.urem(rest, heads_nz), head)
            seq = B.select(by_level, B.udiv(rest, heads_nz), seq)
            valid = B.icmp_unsigned("<", idx, B.mul(B.mul(tiles, heads), batch))
            return {"prompt_offset": B.mul(q_tile, i32(self.tile_m)), "head_idx": head,
                    "prompt_idx": seq, "is_valid": valid}
        if name == "num_valid_work":
            return self.valid_tiles(ts, lambda index: B.mul(heads, index.total()))
        if name == "valid_work_info":
            return self.valid_work_info(ts, *args)
        if name == "seq_info":
            (wi,) = args
            seq_len, start = self.seq_extent(ts, wi["prompt_idx"])
            return {"seq_len": seq_len, "start_of_seq": start,
                    "prompt_offset": wi["prompt_offset"], "head_idx": wi["head_idx"],
                    "prompt_idx": wi["prompt_idx"]}
        seq_len, start = self.seq_extent(ts, args[0])
        if name == "seq_len":
            return seq_len
        if name == "seq_start":
            return start
        assert name == "num_prompt_tiles"
        m = i32(max(self.tile_m, 1))
        return B.udiv(B.add(seq_len, i32(max(self.tile_m, 1) - 1)), m)

    def umax(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.select(self.b.icmp_unsigned(">", a, b), a, b)

    def umin(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.select(self.b.icmp_unsigned("<", a, b), a, b)

    def valid_tiles(self, ts: ir.Value, emit: Callable[[TileIndex], object]) -> object:
        """`emit(index)` for the launch's tile index: the one built on the device (ragged)
        or the closed form of a dense launch (no tile index); the results are merged."""
        B = self.b
        index = self.ts_field(ts, "tile_index")
        has_index = B.icmp_unsigned("!=", B.ptrtoint(index, i64), i64(0))
        results = []
        with B.if_else(has_index) as (ragged, dense):
            with ragged:
                results.append((emit(RaggedIndex(self, ts, index)), B.block))
            with dense:
                results.append((emit(DenseIndex(self, ts)), B.block))
        return _merge(B, results)

    def valid_work_info(self, ts: ir.Value, idx: ir.Value, schedule: ir.Value,
                        heads_per_section: ir.Value) -> dict[str, ir.Value]:
        """`ts.valid_work_info` (its meaning: `mhadsl.analysis.valid_work.valid_work_order`)."""
        return self.builtins.memoized(
            self, "valid_work_info", [idx, schedule, heads_per_section],
            lambda: self._valid_work_info(ts, idx, schedule, heads_per_section))

    def _valid_work_info(self, ts: ir.Value, idx: ir.Value, schedule: ir.Value,
                         heads_per_section: ir.Value) -> dict[str, ir.Value]:
        B = self.b
        one = i32(1)
        heads = self.ts_field(ts, "num_heads")
        whole = B.or_(B.icmp_unsigned("==", heads_per_section, i32(0)),
                      B.icmp_unsigned(">", heads_per_section, heads))
        section = self.umax(B.select(whole, heads, heads_per_section), one)

        def emit(index: TileIndex) -> dict[str, ir.Value]:
            valid = B.icmp_unsigned("<", idx, B.mul(heads, index.total()))
            found = []
            entry = B.block
            with B.if_then(valid):  # an index past the work reads nothing
                per_section = self.umax(B.mul(section, index.total()), one)
                first_head = B.mul(B.udiv(idx, per_section), section)
                local = B.urem(idx, per_section)
                width = self.umax(self.umin(section, B.sub(heads, first_head)), one)
                longest = B.icmp_unsigned("==", schedule,
                                          i32(SCHEDULES.index("LONGEST_FIRST")))
                interleaved = schedule_is(B, schedule, "INTERLEAVED")
                with B.if_else(longest if interleaved is None else B.or_(longest, interleaved)
                               ) as (by_level, by_sequence):
                    with by_level:
                        found.append((self.by_level(index, local, first_head, width,
                                                    interleaved), B.block))
                    with by_sequence:
                        found.append((self.sequence_order(index, local, first_head, width,
                                                          schedule), B.block))
                q_tile, head, seq = _merge(B, found)
                offset = B.mul(q_tile, i32(self.tile_m))
                done = B.block
            zero = i32(0)
            return {"prompt_offset": _phi(B, [(offset, done), (zero, entry)]),
                    "head_idx": _phi(B, [(head, done), (zero, entry)]),
                    "prompt_idx": _phi(B, [(seq, done), (zero, entry)]),
                    "is_valid": valid}
        return self.valid_tiles(ts, emit)

    def sequence_order(self, index: TileIndex, local: ir.Value, first_head: ir.Value,
                       width: ir.Value, schedule: ir.Value
                       ) -> tuple[ir.Value, ir.Value, ir.Value]:
        """DEFAULT / PROMPT_ROTATE within the section of `width` heads from `first_head`:
        (q tile, head, b)."""
        B = self.b
        seq = index.find_sequence(local, width)
        rest = B.sub(local, B.mul(index.prefix(seq), width))
        count = self.umax(index.count(seq), i32(1))
        head, q_tile = B.add(first_head, B.udiv(rest, count)), B.urem(rest, count)
        rotate = B.and_(B.icmp_unsigned("==", schedule, i32(SCHEDULES.index("PROMPT_ROTATE"))),
                        B.trunc(head, i1))
        q_tile = B.select(rotate, B.sub(B.sub(count, i32(1)), q_tile), q_tile)
        return q_tile, head, seq

    def by_level(self, index: TileIndex, local: ir.Value, first_head: ir.Value,
                 width: ir.Value, from_first: ir.Value | None
                 ) -> tuple[ir.Value, ir.Value, ir.Value]:
        """LONGEST_FIRST, or where `from_first` (i1; None: never) INTERLEAVED, within the
        section of `width` heads from `first_head`: (q tile, head, b). INTERLEAVED is
        LONGEST_FIRST's order of (level, rank) positions run backwards, each level's ranks
        in turn reversed, the head fastest in both."""
        B = self.b
        position, head = B.udiv(local, width), B.add(first_head, B.urem(local, width))
        if from_first is not None:
            position = B.select(from_first, B.sub(B.sub(index.total(), i32(1)), position),
                                position)
        rank = index.find_block(position)  # levels that exactly ranks 0..rank reach
        reach = B.add(rank, i32(1))
        offset = B.sub(position, index.level(rank))
        q_tile = B.sub(B.sub(index.count(index.ranked(rank)), i32(1)), B.udiv(offset, reach))
        within = B.urem(offset, reach)
        if from_first is not None:
            within = B.select(from_first, B.sub(rank, within), within)
        return q_tile, head, index.ranked(within)

    def seq_extent(self, ts: ir.Value, batch_idx: ir.Value) -> tuple[ir.Value, ir.Value]:
        """(seq_len, start) of sequence `batch_idx`; (0, 0) when it is out of range.

        Ragged batches read the row offsets; the indices are clamped so an invalid work
        item never reads past the offsets array.
        """
        extent = self.builtins.memoized(self, "seq_extent", [batch_idx],
                                        lambda: self._seq_extent(ts, batch_idx))
        return extent["seq_len"], extent["start"]

    def _seq_extent(self, ts: ir.Value, batch_idx: ir.Value) -> dict[str, ir.Value]:
        B = self.b
        batch = self.ts_field(ts, "batch_size")
        in_range = B.icmp_unsigned("<", batch_idx, batch)
        vl = self.ts_field(ts, "valid_length")
        has_vl = B.icmp_unsigned("!=", B.ptrtoint(vl, i64), i64(0))
        lo_idx = B.select(in_range, batch_idx, batch)
        hi_idx = B.select(in_range, B.add(batch_idx, i32(1)), batch)
        dense_len = self.ts_field(ts, "max_seq_len")
        with B.if_else(has_vl) as (ragged, dense):
            with ragged:
                start_r = B.load(B.gep(vl, [lo_idx], source_etype=i32), typ=i32)
                end_r = B.load(B.gep(vl, [hi_idx], source_etype=i32), typ=i32)
                ragged_bb = B.block
            with dense:
                dense_bb = B.block
        start = B.phi(i32)
        start.add_incoming(start_r, ragged_bb)
        start.add_incoming(i32(0), dense_bb)
        end = B.phi(i32)
        end.add_incoming(end_r, ragged_bb)
        end.add_incoming(dense_len, dense_bb)
        seq_len = B.select(in_range, B.sub(end, start), i32(0))
        return {"seq_len": seq_len, "start": start}


def _phi(builder: ir.IRBuilder, incoming: list[tuple[ir.Value, ir.Block]]) -> ir.Value:
    phi = builder.phi(incoming[0][0].type)
    for value, block in incoming:
        phi.add_incoming(value, block)
    return phi


def _merge(builder: ir.IRBuilder, results: list[tuple[object, ir.Block]]) -> object:
    """One value (or tuple, or dict of values) from the branches that just joined."""
    first = results[0][0]
    if isinstance(first, dict):
        return {k: _phi(builder, [(r[k], bb) for r, bb in results]) for k in first}
    if isinstance(first, tuple):
        return tuple(_phi(builder, [(r[k], bb) for r, bb in results])
                     for k in range(len(first)))
    return _phi(builder, results)
