"""Baseline schedules: GPipe, 1F1B, interleaved 1F1B, ZB-H1 (``zb1p``) and ZB-V.

Orders:

* ``gpipe``: every forward, then every backward (micro-batch order).
* ``1f1b`` (PipeDream-flush): rank ``r`` runs ``R-1-r`` warm-up forwards, then
  alternates F and B, then drains the remaining B's.
* ``interleaved1f1b`` (Megatron-LM, Narayanan et al. 2021): ``V`` stage chunks
  per rank, stage ``s`` on rank ``s % R``; micro-batches go through the chunks
  in groups of ``R`` (depth first); warm-up ``(V-1)R + 2(R-1-r)`` forwards.
  Needs ``N % R == 0`` so every group of ``R`` is full.
* ``zb1p`` (ZB-H1, Qi et al. 2024 "Zero Bubble Pipeline Parallelism"): 1F1B with
  the backward split into I and W; rank ``r`` defers its first ``r`` W's, and
  the deferred W's fill the cool-down bubble.  Peak live activations as 1F1B.
* ``zbv`` (ZB-V, same paper, section 6): two stage chunks per rank in a V
  (like DualPipeV), I/W split, the order of torch.distributed.pipelining's
  ``ScheduleZBVZeroBubble``.
"""

from __future__ import annotations

from collections import deque

from ._program import Layout, RankProgram, make_schedule, new_action
from .ir import Action, ActionType, Schedule

__all__ = [
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb1p",
    "zbv",
    "linear_layout",
    "interleaved_layout",
    "v_layout",
    "check_linear",
    "check_interleaved",
]


def linear_layout(ranks: int, microbatches: int) -> Layout:
    """One stage per rank, stage ``s`` on rank ``s``, one path ``0..R-1``."""
    return Layout(tuple(range(ranks)), (tuple(range(ranks)),), (0,) * microbatches)


def interleaved_layout(ranks: int, microbatches: int, chunks: int) -> Layout:
    """``chunks`` stages per rank, stage ``s`` on rank ``s % R``, one path ``0..R*V-1``."""
    S = ranks * chunks
    return Layout(tuple(s % ranks for s in range(S)), (tuple(range(S)),), (0,) * microbatches)


def v_layout(ranks: int, microbatches: int) -> Layout:
    """Two stages per rank in a V: stage ``s`` on rank ``s`` for ``s < R``, else ``2R-1-s``."""
    R = ranks
    return Layout(
        tuple(s if s < R else 2 * R - 1 - s for s in range(2 * R)), (tuple(range(2 * R)),), (0,) * microbatches
    )


def check_linear(name: str, ranks: int, microbatches: int) -> None:
    if ranks < 1:
        raise ValueError(f"{name} needs ranks >= 1, got {ranks}")
    if microbatches < 1:
        raise ValueError(f"{name} needs micro-batches >= 1, got {microbatches}")


def check_interleaved(ranks: int, microbatches: int, chunks: int) -> None:
    check_linear("interleaved1f1b", ranks, microbatches)
    if chunks < 1:
        raise ValueError(f"interleaved1f1b needs stages_per_rank >= 1, got {chunks}")
    if microbatches % ranks:
        raise ValueError(f"interleaved1f1b needs micro-batches to be a multiple of ranks ({ranks}), got {microbatches}")


def gpipe(ranks: int, microbatches: int) -> Schedule:
    check_linear("gpipe", ranks, microbatches)
    programs = []
    for r in range(ranks):
        prog = RankProgram({r: 0})
        for _ in range(microbatches):
            prog.forward(r)
        for _ in range(microbatches):
            prog.backward(r)
        programs.append(prog)
    return make_schedule(
        "gpipe", ranks, microbatches, linear_layout(ranks, microbatches), [p.actions for p in programs]
    )


def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    check_linear("1f1b", ranks, microbatches)
    N = microbatches
    programs = []
    for r in range(ranks):
        prog = RankProgram({r: 0})
        warmup = min(ranks - 1 - r, N)
        for _ in range(warmup):
            prog.forward(r)
        for _ in range(N - warmup):
            prog.forward(r)
            prog.backward(r)
        for _ in range(warmup):
            prog.backward(r)
        programs.append(prog)
    return make_schedule("1f1b", ranks, N, linear_layout(ranks, N), [p.actions for p in programs])


def zb1p(ranks: int, microbatches: int) -> Schedule:
    check_linear("zb1p", ranks, microbatches)
    N = microbatches
    programs = [_zb1p_rank(ranks, r, N) for r in range(ranks)]
    return make_schedule("zb1p", ranks, N, linear_layout(ranks, N), [p.actions for p in programs])


def _zb1p_rank(ranks: int, r: int, N: int) -> RankProgram:
    prog = RankProgram({r: 0})
    warmup = min(ranks - 1 - r, N)
    backwards = 0

    def input_grad() -> None:
        nonlocal backwards
        prog.backward(r, zero_bubble=True)
        # Rank r keeps its first r W's back; they fill the cool-down bubble.
        if backwards >= r:
            prog.weight()
        backwards += 1

    for _ in range(warmup):
        prog.forward(r)
    for _ in range(N - warmup):
        prog.forward(r)
        input_grad()
    for _ in range(warmup):
        input_grad()
    while prog.pending_weights:
        prog.weight()
    return prog


def interleaved_1f1b(ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    check_interleaved(ranks, microbatches, chunks)
    R, N, V = ranks, microbatches, chunks
    total = N * V  # compute units per rank, per direction

    def unit(k: int, backward: bool) -> tuple[int, int]:
        """(chunk, micro-batch) of the rank's k-th forward / backward unit (Megatron's order)."""
        chunk = (k // R) % V
        if backward:
            chunk = V - 1 - chunk
        return chunk, (k // (R * V)) * R + k % R

    per_rank: list[list[Action]] = []
    for r in range(R):
        prog_actions: list[Action] = []
        warmup = (R - 1 - r) if V == 1 else (V - 1) * R + 2 * (R - 1 - r)
        warmup = min(warmup, total)

        def f(k: int, r: int = r) -> Action:
            c, m = unit(k, backward=False)
            return new_action(ActionType.F, c * R + r, m)

        def b(k: int, r: int = r) -> Action:
            c, m = unit(k, backward=True)
            return new_action(ActionType.B, c * R + r, m)

        prog_actions.extend(f(k) for k in range(warmup))
        for k in range(total - warmup):
            prog_actions.append(f(warmup + k))
            prog_actions.append(b(k))
        prog_actions.extend(b(k) for k in range(total - warmup, total))
        per_rank.append(prog_actions)
    return make_schedule("interleaved1f1b", R, N, interleaved_layout(R, N, V), per_rank)


def zbv(ranks: int, microbatches: int) -> Schedule:
    """ZB-V: the order of torch's ScheduleZBVZeroBubble (which pads N up to 2R-1 and drops the extras)."""
    check_linear("zbv", ranks, microbatches)
    R, N = ranks, microbatches
    n_micro = max(2 * R - 1, N)
    per_rank = []
    for r in range(R):
        acts = _zbv_rank(R, r, r, 2 * R - 1 - r, n_micro)
        per_rank.append([a for a in acts if a.microbatch < N])
    return make_schedule("zbv", R, N, v_layout(R, N), per_rank)


def _zbv_rank(R: int, r: int, c0: int, c1: int, n_micro: int) -> list[Action]:
    out: list[Action] = []
    nf = {c0: 0, c1: 0}
    ni = {c0: 0, c1: 0}
    pending: dict[int, deque[int]] = {c0: deque(), c1: deque()}

    def F(c: int) -> None:
        out.append(new_action(ActionType.F, c, nf[c]))
        nf[c] += 1

    def I(c: int) -> None:  # noqa: E743
        out.append(new_action(ActionType.I, c, ni[c]))
        pending[c].append(ni[c])
        ni[c] += 1

    def W(c: int) -> None:
        out.append(new_action(ActionType.W, c, pending[c].popleft()))

    # Warm-up: chunk-0 forwards, then alternate, then chunk-1 F I W.
    for _ in range(2 * (R - r) - 1):
        F(c0)
    for _ in range(r):
        F(c1)
        F(c0)
    for _ in range(R - r):
        F(c1)
        I(c1)
        W(c1)
    # Steady state: F0 I0 W0 F1 I1 W1.
    while nf[c1] < nf[c0] or nf[c0] < n_micro:
        if nf[c0] < n_micro:
            F(c0)
        I(c0)
        W(c0)
        F(c1)
        I(c1)
        W(c1)
    # Cool-down: input grads first, weight grads fill the tail.
    for _ in range(r):
        I(c0)
        I(c1)
    for _ in range(R - r):
        I(c0)
        W(c0)
    while pending[c1]:
        W(c1)
    while pending[c0]:
        W(c0)
    return out
