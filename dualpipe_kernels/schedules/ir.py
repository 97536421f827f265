"""Schedule IR: per-rank ordered action lists.

Notation follows torch.distributed.pipelining: ``{stage}{F|B|I|W}{microbatch}``
(``0F3``, ``5I2``, ``5W2``), the overlapped pair ``(0F7;7B3)OVERLAP_F_B`` and
communication ``{stage}SEND_F{mb}`` / ``{stage}RECV_B{mb}``.  For a SEND the
stage is the sender's stage; for a RECV it is the receiver's stage (the stage
that consumes the data).

Stages are *stage chunks*: the pieces of the model that one rank runs.  A
schedule maps each stage to the rank that holds it (``stage_to_rank``) and each
micro-batch to the ordered path of stages it traverses (``paths`` and
``microbatch_path``).  Most schedules have a single path ``0..S-1``.  DualPipe
is bidirectional: micro-batches ``0..N/2-1`` traverse stages ``0..R-1``
(stage ``s`` on rank ``s``) and micro-batches ``N/2..N-1`` traverse stages
``R..2R-1`` (stage ``R+s`` is the second copy of model stage ``s`` and lives on
rank ``R-1-s``).  ``model_stage`` names the model piece each stage computes, so
copies of one piece can be found (``model_stage[R+s] == s``).

This module is pure data: no torch, no processes.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

__all__ = [
    "ActionType",
    "Action",
    "Schedule",
    "COMPUTE_TYPES",
    "COMM_TYPES",
    "parse_action",
    "format_actions",
    "parse_actions",
    "T_F",
    "T_B",
    "T_I",
    "T_W",
    "T_PAIR",
    "T_SEND_F",
    "T_RECV_F",
    "T_SEND_B",
    "T_RECV_B",
]


class ActionType(enum.Enum):
    F = "F"  # forward of one stage chunk for one micro-batch
    B = "B"  # full backward (input grads + weight grads)
    I = "I"  # noqa: E741  input-gradient part of the backward
    W = "W"  # weight-gradient part of the backward
    OVERLAP_F_B = "OVERLAP_F_B"  # F of one chunk paired with B (or I) of another
    SEND_F = "SEND_F"  # send activations to the next stage
    RECV_F = "RECV_F"  # receive activations from the previous stage
    SEND_B = "SEND_B"  # send input gradients to the previous stage
    RECV_B = "RECV_B"  # receive output gradients from the next stage

    def __str__(self) -> str:
        return self.value


# Module-level names for the types, for hot loops (a global beats an enum attribute lookup); defined here only.
T_F, T_B, T_I, T_W, T_PAIR = ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.OVERLAP_F_B
T_SEND_F, T_RECV_F, T_SEND_B, T_RECV_B = ActionType.SEND_F, ActionType.RECV_F, ActionType.SEND_B, ActionType.RECV_B

COMPUTE_TYPES = frozenset({T_F, T_B, T_I, T_W, T_PAIR})
COMM_TYPES = frozenset({T_SEND_F, T_RECV_F, T_SEND_B, T_RECV_B})


@dataclass(frozen=True, slots=True)
class Action:
    """One entry of a rank's action list.

    ``sub_actions`` is used only by OVERLAP_F_B: ``(F action, B-or-I action)``;
    its own ``stage``/``microbatch`` are those of the F.  ``peer`` is the other
    rank of a communication action (filled in by the lowering pass); it is not
    part of the string form, which matches torch.distributed.pipelining.
    """

    type: ActionType
    stage: int
    microbatch: int
    sub_actions: tuple[Action, ...] = ()
    peer: int | None = field(default=None, compare=False)

    @staticmethod
    def overlap(f: Action, b: Action) -> Action:
        if f.type is not ActionType.F or b.type not in (ActionType.B, ActionType.I):
            raise ValueError(f"OVERLAP_F_B pairs an F with a B or I, got {f} and {b}")
        return Action(ActionType.OVERLAP_F_B, f.stage, f.microbatch, (f, b))

    @property
    def is_compute(self) -> bool:
        # Anything that is not a transfer computes: a new action kind needs no entry here.
        return self.type not in COMM_TYPES

    @property
    def is_comm(self) -> bool:
        return self.type in COMM_TYPES

    def computes(self) -> tuple[Action, ...]:
        """The plain compute actions this action performs (the pair's halves for OVERLAP_F_B)."""
        if self.type is ActionType.OVERLAP_F_B:
            return self.sub_actions
        return (self,) if self.type not in COMM_TYPES else ()

    def __str__(self) -> str:
        if self.type is ActionType.OVERLAP_F_B:
            return "(" + ";".join(str(a) for a in self.sub_actions) + ")OVERLAP_F_B"
        return f"{self.stage}{self.type.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"


_SIMPLE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")
_PAIR = re.compile(r"^\((.+)\)OVERLAP_F_B$")


def parse_action(text: str) -> Action:
    """Parse ``0F3``, ``5I2``, ``3SEND_F1`` or ``(0F7;7B3)OVERLAP_F_B``."""
    s = text.strip()
    m = _PAIR.match(s)
    if m:
        parts = [parse_action(p) for p in m.group(1).split(";")]
        if len(parts) != 2:
            raise ValueError(f"OVERLAP_F_B needs exactly two sub-actions: {text!r}")
        return Action.overlap(parts[0], parts[1])
    m = _SIMPLE.match(s)
    if not m:
        raise ValueError(
            f"cannot parse action {text!r} (expected e.g. '0F3', '5W2', '(0F7;7B3)OVERLAP_F_B', '3SEND_F1')"
        )
    return Action(ActionType(m.group(2)), int(m.group(1)), int(m.group(3)))


def format_actions(actions: Sequence[Action]) -> str:
    return " ".join(str(a) for a in actions)


def parse_actions(text: str) -> list[Action]:
    return [parse_action(t) for t in text.split()]


@dataclass
class Schedule:
    """A pipeline schedule as data.

    ``actions[r]`` is rank ``r``'s ordered action list.  Generators produce
    compute-only lists; ``lower_comms`` (schedules.lowering) returns a copy with
    SEND/RECV actions inserted and ``lowered = True``.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    paths: tuple[tuple[int, ...], ...]
    microbatch_path: tuple[int, ...]
    actions: list[list[Action]]
    model_stage: tuple[int, ...] = ()
    lowered: bool = False

    def __post_init__(self) -> None:
        if not self.model_stage:
            self.model_stage = tuple(range(len(self.stage_to_rank)))
        if len(self.microbatch_path) != self.num_microbatches:
            raise ValueError(
                f"microbatch_path has {len(self.microbatch_path)} entries for {self.num_microbatches} micro-batches"
            )
        if len(self.actions) != self.num_ranks:
            raise ValueError(f"actions has {len(self.actions)} rank lists for {self.num_ranks} ranks")

    # ---- topology -------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def path(self, microbatch: int) -> tuple[int, ...]:
        return self.paths[self.microbatch_path[microbatch]]

    def next_stage(self, stage: int, microbatch: int) -> int | None:
        p = self.path(microbatch)
        i = p.index(stage)
        return p[i + 1] if i + 1 < len(p) else None

    def prev_stage(self, stage: int, microbatch: int) -> int | None:
        p = self.path(microbatch)
        i = p.index(stage)
        return p[i - 1] if i > 0 else None

    def is_first_stage(self, stage: int, microbatch: int) -> bool:
        return self.path(microbatch)[0] == stage

    def is_loss_stage(self, stage: int, microbatch: int) -> bool:
        return self.path(microbatch)[-1] == stage

    def microbatches_of_stage(self, stage: int) -> list[int]:
        return [m for m in range(self.num_microbatches) if stage in self.path(m)]

    # ---- iteration / printing ------------------------------------------
    def compute_actions(self, rank: int) -> Iterator[Action]:
        return (a for a in self.actions[rank] if a.is_compute)

    def to_strings(self) -> list[list[str]]:
        return [[str(a) for a in acts] for acts in self.actions]

    def __str__(self) -> str:
        lines = [
            f"{self.name}: {self.num_ranks} ranks, {self.num_stages} stages, {self.num_microbatches} micro-batches"
        ]
        for r, acts in enumerate(self.actions):
            lines.append(f"  rank {r}: {format_actions(acts)}")
        return "\n".join(lines)
