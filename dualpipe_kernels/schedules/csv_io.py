"""CSV in torch.distributed.pipelining's format: one row per rank, one action per cell.

The cells are the actions' string form (``0F3``, ``5I2``, ``(0F7;7B3)OVERLAP_F_B``),
which ``torch.distributed.pipelining.schedules._Action.from_str`` parses, so
``_PipelineScheduleRuntime._load_csv(path, format="compute_only")`` (and
torchtitan's ``pipeline_parallel_schedule_csv``) can run a schedule made here.
``to_csv`` writes the compute-only form by default; ``include_comms=True``
writes a lowered schedule's comm actions too (torch's ``compute_comms``), plus
one ``{stage}REDUCE_GRAD`` right after each stage's last B/W: torch's
``_PipelineScheduleRuntime`` runs a ``compute_comms`` file as written, and it is
at REDUCE_GRAD that it divides the gradients by the micro-batch count (its
``scale_grads``); without it they come out N x too large.  torch runs a
schedule only when every micro-batch passes through stages ``0..S-1`` in order
(:func:`torch_incompatibility` says why not otherwise, e.g. DualPipe's two
directions); ``include_comms=True`` writes such a schedule for this package's
own reader but warns (:class:`TorchCSVWarning`) that torch cannot run it.

Reading accepts torch's own ``compute_comms`` dump: its ``UNSHARD``,
``RESHARD`` (FSDP) and ``REDUCE_GRAD`` cells are skipped (this runtime has no
FSDP, and scales gradients with ``Pipeline(scale_grads=True)``).

The file holds no topology, so :func:`load_csv` rebuilds it:

* with ``name`` (one of ``SCHEDULE_NAMES``): the generator's own layout for
  that many ranks (rows) and micro-batches (largest index + 1, or given);
* without: stage ``s`` lives on the rank whose row holds it; a micro-batch's
  path is the stages it has actions on, in increasing order (true of every
  generator here); identical paths are shared.  When there are exactly two
  disjoint paths of equal length (DualPipe's two directions) the ``k``-th
  stage of the second path is taken as a copy of the ``k``-th stage of the
  first (``model_stage``), as in DualPipe.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import re
import warnings
from typing import IO

from ._program import make_schedule
from .deps import Topology
from .generators import schedule_layout
from .ir import Action, Schedule, parse_action

__all__ = [
    "to_csv",
    "load_csv",
    "csv_text",
    "schedule_to_rows",
    "schedule_from_rows",
    "torch_incompatibility",
    "TorchCSVWarning",
]

PathOrFile = str | os.PathLike[str] | IO[str]

# torch's per-stage actions without a micro-batch (FSDP and the gradient reduction): no-ops here.
_TORCH_STAGE_ONLY = re.compile(r"^\d+(UNSHARD|RESHARD|REDUCE_GRAD)$")


class TorchCSVWarning(UserWarning):
    """A compute_comms CSV was written for a schedule torch.distributed.pipelining cannot run."""


def torch_incompatibility(schedule: Schedule) -> str | None:
    """Why torch.distributed.pipelining cannot run ``schedule`` (None when it can).

    torch's stages form one chain: every micro-batch goes through stages
    ``0..S-1`` in order, and each stage module exists once.
    """
    chain = tuple(range(schedule.num_stages))
    bad = sorted({m for m in range(schedule.num_microbatches) if schedule.path(m) != chain})
    if bad:
        return (
            f"schedule {schedule.name!r}: micro-batch {bad[0]} takes stages {list(schedule.path(bad[0]))}, but torch "
            f"runs every micro-batch through stages 0..{schedule.num_stages - 1} in order (DualPipe's second "
            "direction has no torch equivalent)"
        )
    if len(set(schedule.model_stage)) != schedule.num_stages:
        return f"schedule {schedule.name!r} holds copies of a model stage; torch has one module per stage"
    return None


def _reduce_grad_rows(schedule: Schedule) -> list[list[str]]:
    """Each rank's cells with ``{stage}REDUCE_GRAD`` after the action holding that stage's last B or W."""
    rows = []
    n = schedule.num_microbatches
    for acts in schedule.actions:
        done: dict[int, int] = {}
        row = []
        for a in acts:
            row.append(str(a))
            for c in a.computes():
                if c.type.value in ("B", "W"):  # what torch counts (an I is followed by its W)
                    done[c.stage] = done.get(c.stage, 0) + 1
                    if done[c.stage] == n:
                        row.append(f"{c.stage}REDUCE_GRAD")
        rows.append(row)
    return rows


def schedule_to_rows(schedule: Schedule, include_comms: bool = False) -> list[list[str]]:
    """CSV cells per rank: compute actions, or (``include_comms``) the lowered list with REDUCE_GRAD."""
    if not include_comms:
        return [[str(a) for a in acts if a.is_compute] for acts in schedule.actions]
    if not schedule.lowered:
        raise ValueError(
            f"include_comms needs a lowered schedule (schedules.lower_comms); {schedule.name!r} is compute-only"
        )
    reason = torch_incompatibility(schedule)
    if reason is not None:
        warnings.warn(f"torch's _PipelineScheduleRuntime cannot run this CSV: {reason}", TorchCSVWarning, stacklevel=3)
    return _reduce_grad_rows(_recvs_in_send_order(schedule))


def _recvs_in_send_order(schedule: Schedule) -> Schedule:
    """The lowered ``schedule`` with each rank's RECVs from a peer in the order that peer SENDs them.

    torch's runtime posts every transfer untagged, so between two ranks a receive takes whichever message
    comes next: a RECV order that differs from the peer's SEND order (ZBV's second rank expects the
    first's B0 before its F2) silently hands a tensor of the same shape to the wrong micro-batch.  Where
    the orders differ, a RECV moves earlier, to just before the first RECV from the same peer that would
    otherwise overtake it.  Posting a receive earlier adds no wait (torch waits for it at the compute that
    needs it; the validator's blocking RECV waits for a SEND its peer makes before the one it waited for),
    so the schedule stays valid and deadlock-free.
    """
    from .explain import comm_pairs

    # Per receiving rank and peer: the RECV indices in the order the peer sends them.
    queues: dict[tuple[int, int], list[int]] = {}
    for pair in sorted(comm_pairs(schedule), key=lambda p: (p.send_rank, p.send_index)):
        queues.setdefault((pair.recv_rank, pair.send_rank), []).append(pair.recv_index)
    src_of = {(p.recv_rank, p.recv_index): p.send_rank for p in comm_pairs(schedule)}
    new_actions: list[list[Action]] = []
    for r, acts in enumerate(schedule.actions):
        heads = {src: 0 for (dst, src) in queues if dst == r}
        placed: set[int] = set()
        out: list[Action] = []
        for i, a in enumerate(acts):
            if (r, i) not in src_of:
                out.append(a)
                continue
            if i in placed:
                continue
            src = src_of[(r, i)]
            queue = queues[(r, src)]
            while i not in placed:  # every RECV the peer sends before this one, then this one
                j = queue[heads[src]]
                heads[src] += 1
                placed.add(j)
                out.append(acts[j])
        new_actions.append(out)
    if all(list(a) == b for a, b in zip(schedule.actions, new_actions, strict=True)):
        return schedule
    return dataclasses.replace(schedule, actions=new_actions)


def to_csv(schedule: Schedule, path_or_file: PathOrFile, include_comms: bool = False) -> None:
    """Write ``schedule`` as CSV (compute actions only unless ``include_comms``; see the module docstring)."""
    rows = schedule_to_rows(schedule, include_comms)
    if isinstance(path_or_file, (str, os.PathLike)):
        with open(path_or_file, "w", newline="") as fh:
            csv.writer(fh).writerows(rows)
    else:
        csv.writer(path_or_file).writerows(rows)


def _read_rows(path_or_file: PathOrFile) -> list[list[str]]:
    if isinstance(path_or_file, (str, os.PathLike)):
        with open(path_or_file, newline="") as fh:
            return list(csv.reader(fh))
    return list(csv.reader(path_or_file))


def load_csv(
    path_or_file: PathOrFile,
    name: str | None = None,
    microbatches: int | None = None,
    stages_per_rank: int | None = None,
) -> Schedule:
    """Read a CSV written by :func:`to_csv` (or by torch) back into a :class:`Schedule`.

    Empty cells (torch writes its idle slots as empty) and torch's UNSHARD,
    RESHARD and REDUCE_GRAD cells are skipped.  A file with
    comm actions gives a schedule with ``lowered=True`` whose comm actions get
    their ``peer`` from the topology (the string form has no peer).
    """
    return schedule_from_rows(_read_rows(path_or_file), name, microbatches, stages_per_rank)


def schedule_from_rows(
    rows: list[list[str]],
    name: str | None = None,
    microbatches: int | None = None,
    stages_per_rank: int | None = None,
) -> Schedule:
    actions: list[list[Action]] = []
    for r, row in enumerate(rows):
        acts = []
        for c, cell in enumerate(row):
            if not cell.strip() or _TORCH_STAGE_ONLY.match(cell.strip()):
                continue
            try:
                acts.append(parse_action(cell))
            except ValueError as e:
                raise ValueError(f"CSV row {r} (rank {r}), column {c}: {e}") from None
        actions.append(acts)
    if not actions:
        raise ValueError("CSV has no rows (one row per rank expected)")
    computes = [c for acts in actions for a in acts for c in a.computes()]
    if not computes:
        raise ValueError("CSV has no compute actions")
    n_mb = max(c.microbatch for c in computes) + 1
    if microbatches is not None:
        if microbatches < n_mb:
            raise ValueError(f"CSV uses micro-batch {n_mb - 1}, but microbatches={microbatches}")
        n_mb = microbatches
    lowered = any(a.is_comm for acts in actions for a in acts)
    if name is not None:
        layout = schedule_layout(name, len(actions), n_mb, stages_per_rank)
        sched = make_schedule(name, len(actions), n_mb, layout, actions, lowered)
    else:
        sched = _infer(actions, computes, n_mb, lowered)
    return _with_peers(sched) if lowered else sched


def _with_peers(schedule: Schedule) -> Schedule:
    """Fill in ``peer`` of comm actions (the string form does not carry it) from the topology."""
    topo = Topology(schedule)
    s2r = topo.stage_to_rank
    for acts in schedule.actions:
        for i, a in enumerate(acts):
            if not a.is_comm or not topo.stage_on_path(a.stage, a.microbatch):
                continue
            other = topo.comm_other_stage(a)
            if other >= 0:
                acts[i] = Action(a.type, a.stage, a.microbatch, (), s2r[other])
    return schedule


def _infer(actions: list[list[Action]], computes: list[Action], n_mb: int, lowered: bool) -> Schedule:
    S = max(c.stage for c in computes) + 1
    stage_to_rank = [-1] * S
    for r, acts in enumerate(actions):
        for a in acts:
            for c in a.computes():
                if stage_to_rank[c.stage] not in (-1, r):
                    raise ValueError(f"stage {c.stage} appears on ranks {stage_to_rank[c.stage]} and {r}")
                stage_to_rank[c.stage] = r
    unused = [s for s in range(S) if stage_to_rank[s] < 0]
    if unused:
        raise ValueError(f"stages {unused} have no actions; cannot place them")
    stages_of_mb: list[set[int]] = [set() for _ in range(n_mb)]
    for c in computes:
        stages_of_mb[c.microbatch].add(c.stage)
    paths: list[tuple[int, ...]] = []
    index: dict[tuple[int, ...], int] = {}
    mb_path = []
    for m, st in enumerate(stages_of_mb):
        if not st:
            raise ValueError(f"micro-batch {m} has no actions")
        p = tuple(sorted(st))
        if p not in index:
            index[p] = len(paths)
            paths.append(p)
        mb_path.append(index[p])
    model_stage = list(range(S))
    if len(paths) == 2 and len(paths[0]) == len(paths[1]) and not set(paths[0]) & set(paths[1]):
        for original, copy in zip(paths[0], paths[1], strict=True):
            model_stage[copy] = original
    return Schedule(
        name="csv",
        num_ranks=len(actions),
        num_microbatches=n_mb,
        stage_to_rank=tuple(stage_to_rank),
        paths=tuple(paths),
        microbatch_path=tuple(mb_path),
        actions=actions,
        model_stage=tuple(model_stage),
        lowered=lowered,
    )


def csv_text(schedule: Schedule, include_comms: bool = False) -> str:
    """The CSV as a string (handy in tests and for printing)."""
    buf = io.StringIO()
    to_csv(schedule, buf, include_comms)
    return buf.getvalue()
