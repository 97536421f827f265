"""DualPipe and DualPipeV (DeepSeek-V3) as per-rank compute lists.

Both follow the eight phases of the reference implementation
(github.com/deepseek-ai/DualPipe, ``DualPipe.step`` / ``DualPipeV.step``), the
same order on every rank:

1. ``nF0``      warm-up forwards of phase 0
2. ``nF0F1``    forwards of both phases, alternating
3. ``nI1W1F1``  zero bubble: input-grad backward of phase 1, its W at once, a forward
4. ``nF0B1F1B0`` main step: two overlapped F&B pairs per iteration; the first
   iteration on the middle ranks (DualPipe) / last rank (DualPipeV) runs F0 and
   B1 unpaired, which the reference does to shrink the bubble
5. ``nB1F1B0``  a backward, then an F&B pair
6. ``nB1B0``    backwards of both phases; the second half switches to I (W deferred)
7. ``nWB0``     a deferred W, then an I of phase 0
8. ``nW``       the remaining deferred W's

"Phase 0/1" is the reference's rank-local naming of the two stage chunks a rank
holds.  Reference ``_backward_chunk(enable_zb=True)`` is our I, its
``_weight_chunk`` (FIFO pop of WeightGradStore) is our W of the oldest pending
I, and ``_forward_backward_chunk`` is ``OVERLAP_F_B(F, B)``.  Only the compute
order is generated here; communication comes from the lowering pass, which
posts each SEND right after its producer (the reference's middle ranks hold a
few sends back by one step; the order of computes is the same).

DualPipeV is DualPipe folded: one copy of the model, ``2R`` stage chunks in a
V (stage ``s`` on rank ``s`` for ``s < R``, else on rank ``2R-1-s``), so its
phase loops are DualPipe's with "half rank" replaced by the rank itself.
"""

from __future__ import annotations

from ._program import Layout, RankProgram, make_schedule
from .ir import Schedule

__all__ = ["dualpipe", "dualpipev", "dualpipe_layout", "dualpipev_layout", "check_dualpipe", "check_dualpipev"]


def _eight_phases(prog: RankProgram, s0: int, s1: int, h: int, H: int, n: int, unpaired_first: bool) -> None:
    """Append one rank's eight phases to ``prog``.

    ``s0``/``s1``: this rank's phase-0 / phase-1 stage; ``h``: position among
    ``H`` (half-)ranks (0 = the end that feeds the pipe); ``n``: micro-batches
    per direction; ``unpaired_first``: run the first main-step pair unpaired.
    """
    # Phase 1: nF0
    for _ in range((H - h - 1) * 2):
        prog.forward(s0)

    # Phase 2: nF0F1
    for _ in range(h + 1):
        prog.forward(s0)
        prog.forward(s1)

    # Phase 3: nI1W1F1 (zero bubble: the W pops the I just made)
    for _ in range(H - h - 1):
        prog.backward(s1, zero_bubble=True)
        prog.weight()
        prog.forward(s1)

    # Phase 4 (main step): nF0B1F1B0
    for i in range(n - 2 * H + h + 1):
        if i == 0 and unpaired_first:
            prog.forward(s0)
            prog.backward(s1)
        else:
            prog.overlap(s0, s1)
        prog.overlap(s1, s0)

    # Phase 5: nB1F1B0
    for _ in range(H - h - 1):
        prog.backward(s1)
        prog.overlap(s1, s0)

    # Phase 6: nB1B0, the second half with zero bubble; where the switch falls
    # depends on the parity of h, exactly as in the reference.
    steps = h + 1
    zb = False
    for i in range(steps):
        if i == steps // 2 and h % 2 == 1:
            zb = True
        prog.backward(s1, zero_bubble=zb)
        if i == steps // 2 and h % 2 == 0:
            zb = True
        prog.backward(s0, zero_bubble=zb)

    # Phase 7: nWB0 (zero bubble)
    for _ in range(H - h - 1):
        prog.weight()
        prog.backward(s0, zero_bubble=True)

    # Phase 8: nW
    for _ in range(h + 1):
        prog.weight()
    if prog.pending_weights:
        raise RuntimeError(f"generator bug: {prog.pending_weights} W left pending")


def check_dualpipe(ranks: int, microbatches: int) -> None:
    if ranks < 2 or ranks % 2:
        raise ValueError(f"dualpipe needs an even number of ranks >= 2, got {ranks}")
    if microbatches % 2:
        raise ValueError(f"dualpipe needs an even number of micro-batches, got {microbatches}")
    if microbatches < 2 * ranks:
        raise ValueError(f"dualpipe needs micro-batches >= 2 * ranks = {2 * ranks}, got {microbatches}")


def check_dualpipev(ranks: int, microbatches: int) -> None:
    if ranks < 1:
        raise ValueError(f"dualpipev needs ranks >= 1, got {ranks}")
    if microbatches < 2 * ranks:
        raise ValueError(f"dualpipev needs micro-batches >= 2 * ranks = {2 * ranks}, got {microbatches}")


def dualpipe_layout(ranks: int, microbatches: int) -> Layout:
    """Stages ``0..R-1`` (down, mbs ``0..N/2-1``) and ``R..2R-1`` (up, mbs ``N/2..N-1``).

    Stage ``R+s`` is the second copy of model stage ``s`` and lives on rank ``R-1-s``.
    """
    R, half = ranks, microbatches // 2
    stage_to_rank = tuple(range(R)) + tuple(R - 1 - s for s in range(R))
    paths = (tuple(range(R)), tuple(range(R, 2 * R)))
    mb_path = (0,) * half + (1,) * (microbatches - half)
    model_stage = tuple(range(R)) * 2
    return Layout(stage_to_rank, paths, mb_path, model_stage)


def dualpipev_layout(ranks: int, microbatches: int) -> Layout:
    """One path ``0..2R-1``; stage ``s`` on rank ``s`` for ``s < R``, else on rank ``2R-1-s``."""
    R = ranks
    stage_to_rank = tuple(s if s < R else 2 * R - 1 - s for s in range(2 * R))
    return Layout(stage_to_rank, (tuple(range(2 * R)),), (0,) * microbatches)


def dualpipe(ranks: int, microbatches: int) -> Schedule:
    """The bidirectional DualPipe order: two copies of each model stage per rank pair."""
    check_dualpipe(ranks, microbatches)
    R, H, n = ranks, ranks // 2, microbatches // 2
    programs = []
    for r in range(R):
        down, up = r, 2 * R - 1 - r
        prog = RankProgram({down: 0, up: n})
        h = min(r, R - 1 - r)
        # The reference's phase 0 is the down direction on the first half of the
        # ranks and the up direction on the second half.
        s0, s1 = (down, up) if r < H else (up, down)
        _eight_phases(prog, s0, s1, h, H, n, unpaired_first=(h == H - 1))
        programs.append(prog)
    return make_schedule("dualpipe", R, microbatches, dualpipe_layout(R, microbatches), [p.actions for p in programs])


def dualpipev(ranks: int, microbatches: int) -> Schedule:
    """DualPipeV: ``2R`` stage chunks in a V over ``R`` ranks, every micro-batch down and back."""
    check_dualpipev(ranks, microbatches)
    R = ranks
    programs = []
    for r in range(R):
        s0, s1 = r, 2 * R - 1 - r
        prog = RankProgram({s0: 0, s1: 0})
        _eight_phases(prog, s0, s1, r, R, microbatches, unpaired_first=(r == R - 1))
        programs.append(prog)
    return make_schedule("dualpipev", R, microbatches, dualpipev_layout(R, microbatches), [p.actions for p in programs])
