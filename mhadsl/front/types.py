"""The types of the `.mha` language and the shapes of its records."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ty:
    name: str

    def __str__(self) -> str:
        return self.name


U32, I32, BOOL, F32 = Ty("u32"), Ty("i32"), Ty("bool"), Ty("f32")


@dataclass(frozen=True)
class TensorTy(Ty):
    """A tensor operand of an attention declaration (or what indexing its first axes leaves):
    `element` (I32 or F32) values along `axes`, each "batch", "heads", "queries", "keys" or
    "_" (any size)."""

    element: Ty = None
    axes: tuple[str, ...] = ()


def tensor_type(element: Ty, axes: tuple[str, ...]) -> TensorTy:
    return TensorTy(f"{element}[{', '.join(axes)}]", element, axes)


# A tensor operand's axes: the call's sequences, its query heads, its query rows or keys (as
# q and k lay them out; a rule reads them by position in the sequence), or any size.
TENSOR_AXES = ("batch", "heads", "queries", "keys", "_")
POSITION_AXES = ("queries", "keys")
INT_LITERAL = Ty("integer literal")  # adopts the integer type it meets (u32 on its own)
WORK_INFO, SEQ_INFO, STATE = Ty("WorkInfo"), Ty("SeqInfo"), Ty("State")
TILE_SUMMARY, SLOTS, COUNTER = Ty("TileSummary"), Ty("Slots"), Ty("Counter")
SCHEDULE, SYNC, DIM3 = Ty("Schedule"), Ty("Sync"), Ty("Dim3")
NONE, VOID, GRID = Ty("none"), Ty("void"), Ty("(u32, u32, u32)")
DTYPE, SCHEDULER = Ty("dtype"), Ty("scheduler")
ERROR = Ty("<error>")  # stops one mistake from cascading into more messages

INTEGERS = (U32, I32, INT_LITERAL)
NUMBERS = INTEGERS + (F32,)

# Field name -> type, in the order records are laid out in memory and in LLVM IR.
RECORD_FIELDS: dict[Ty, dict[str, Ty]] = {
    WORK_INFO: {"prompt_offset": U32, "head_idx": U32, "prompt_idx": U32, "is_valid": BOOL},
    SEQ_INFO: {"seq_len": U32, "start_of_seq": U32, "prompt_offset": U32, "head_idx": U32,
               "prompt_idx": U32},
    STATE: {"idx": U32, "slots": SLOTS, "max_idx": U32},
}
# Read-only properties computed from a record's fields.
RECORD_PROPERTIES: dict[Ty, dict[str, Ty]] = {
    SEQ_INFO: {"is_valid": BOOL},
}
MUTABLE_FIELDS = {STATE: {"idx", "max_idx"}}

TILE_SUMMARY_FIELDS = {"batch_size": U32, "max_num_prompt_tiles": U32, "max_seq_len": U32,
                       "num_heads": U32, "has_valid_length": BOOL}
# ts.method(args) -> result
TILE_SUMMARY_METHODS: dict[str, tuple[tuple[Ty, ...], Ty]] = {
    "num_work": ((), U32),
    "work_info": ((U32, SCHEDULE), WORK_INFO),
    "seq_info": ((WORK_INFO,), SEQ_INFO),
    "seq_len": ((U32,), U32),
    "seq_start": ((U32,), U32),
    "num_prompt_tiles": ((U32,), U32),
    "num_valid_work": ((), U32),
    "valid_work_info": ((U32, SCHEDULE, U32), WORK_INFO),
}

SCHEDULES = ("DEFAULT", "PROMPT_ROTATE", "LONGEST_FIRST", "INTERLEAVED")
SYNCS = ("NONE", "PRODUCER", "ALL")

TYPE_NAMES = {"u32": U32, "i32": I32, "bool": BOOL, "f32": F32, "Schedule": SCHEDULE,
              "WorkInfo": WORK_INFO, "SeqInfo": SEQ_INFO, "State": STATE,
              "TileSummary": TILE_SUMMARY}


def unify(a: Ty, b: Ty) -> Ty | None:
    """The common type of two operands, or None when they do not mix."""
    if a == b:
        return a
    if INT_LITERAL in (a, b):
        other = b if a == INT_LITERAL else a
        return other if other in NUMBERS else None
    if F32 in (a, b) and {a, b} <= set(NUMBERS):
        return F32  # integers promote to f32 in score arithmetic, as in C
    return None
