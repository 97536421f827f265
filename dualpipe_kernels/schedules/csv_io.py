"""CSV in torch.distributed.pipelining's format: one row per rank, one action per cell.

The cells are the actions' string form (``0F3``, ``5I2``, ``(0F7;7B3)OVERLAP_F_B``),
which ``torch.distributed.pipelining.schedules._Action.from_str`` parses, so
``_PipelineScheduleRuntime._load_csv(path, format="compute_only")`` (and
torchtitan's ``pipeline_parallel_schedule_csv``) can run a schedule made here.
``to_csv`` writes the compute-only form by default; ``include_comms=True``
writes a lowered schedule's comm actions too (torch's ``compute_comms``).

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
import io
import os
from typing import IO

from ._program import make_schedule
from .deps import Topology
from .generators import schedule_layout
from .ir import Action, Schedule, parse_action

__all__ = ["to_csv", "load_csv", "csv_text", "schedule_to_rows", "schedule_from_rows"]

PathOrFile = str | os.PathLike[str] | IO[str]


def schedule_to_rows(schedule: Schedule, include_comms: bool = False) -> list[list[str]]:
    rows = []
    for acts in schedule.actions:
        rows.append([str(a) for a in acts if include_comms or a.is_compute])
    return rows


def to_csv(schedule: Schedule, path_or_file: PathOrFile, include_comms: bool = False) -> None:
    """Write ``schedule`` as CSV (compute actions only unless ``include_comms``)."""
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

    Empty cells (torch writes its idle slots as empty) are skipped.  A file with
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
            if not cell.strip():
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
