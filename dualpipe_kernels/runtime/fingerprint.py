"""What a rank will run, compared across the pipeline's ranks at construction: disagreeing ranks fail at once.

Ranks built with different schedules, micro-batch counts, placements or
transports would otherwise wait for transfers that never come and fail only
after the full timeout with a generic transfer error.  So each rank publishes a
:class:`Fingerprint` in the process group's store and reads everyone's; if any
field differs, every rank raises :class:`RanksDisagree` naming the field and
which ranks hold which value.  A rank that never publishes (it failed before)
makes the others fail after ``timeout_s`` naming it.

Fields, compared in this order (the first one that differs leads the message):
``microbatches``, ``schedule`` (name and a digest of every action and the
stage layout), ``placement`` (stage -> pipeline rank and group rank -> pipeline
rank), ``transport`` (the resolved choice), then any ``extra`` fields a caller
adds (the pipeline's: :meth:`~dualpipe_kernels.runtime.options.PipelineOptions.agreed_fields`,
boundary formats, gradient scaling...: anything every rank must agree on, as
short strings).  ``partial`` fields are stated by some ranks only (a per-stage
memory policy names the stages a rank chose to name): each is compared among
the ranks that state it.

Store keys: ``dpk/fingerprint/<generation>/<group rank>``, where each rank
counts the pipelines it built on the store, so ranks that build pipelines in the
same order meet on the same generation (as the native transport's rendezvous).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from dualpipe_kernels.schedules.ir import Schedule
from dualpipe_kernels.transport.base import group_store, wait_store_key

__all__ = [
    "Fingerprint",
    "RanksDisagree",
    "fingerprint",
    "schedule_digest",
    "resolved_transport",
    "disagreement",
    "exchange",
    "exchange_numbered",
    "agree",
]

_PREFIX = "dpk/fingerprint"


class RanksDisagree(ValueError):
    """The ranks of one pipeline were built differently.

    ``field``: the first field that differs; ``values``: group rank -> that
    field's value on the rank; ``fields``: every field that differs.
    """

    def __init__(self, message: str, field: str, values: dict[int, str], fields: list[str]) -> None:
        super().__init__(message)
        self.field = field
        self.values = values
        self.fields = fields


@dataclass(frozen=True)
class Fingerprint:
    """One rank's view of what the pipeline runs: ``fields`` in comparison order, ``pipeline_rank`` for messages;
    ``partial``: the names of fields compared only among the ranks that have them."""

    pipeline_rank: int
    fields: tuple[tuple[str, str], ...]
    partial: frozenset[str] = frozenset()

    def to_json(self) -> str:
        return json.dumps(
            {"pipeline_rank": self.pipeline_rank, "fields": list(self.fields), "partial": sorted(self.partial)}
        )

    @staticmethod
    def from_json(text: str | bytes) -> Fingerprint:
        data = json.loads(text)
        fields = tuple((str(k), str(v)) for k, v in data["fields"])
        return Fingerprint(int(data["pipeline_rank"]), fields, frozenset(map(str, data.get("partial", ()))))


def schedule_digest(schedule: Schedule) -> str:
    """A hex digest of the schedule's shape, stage layout and every rank's action list (O(actions))."""
    h = hashlib.blake2b(digest_size=12)
    head = (schedule.name, schedule.num_ranks, schedule.num_microbatches, schedule.lowered)
    layout = (schedule.stage_to_rank, schedule.paths, schedule.microbatch_path, schedule.model_stage)
    for part in (head, *layout):
        h.update(repr(part).encode())
    for r, actions in enumerate(schedule.actions):
        h.update(f"|{r}:".encode())
        h.update(" ".join(map(str, actions)).encode())
    return h.hexdigest()


def fingerprint(
    schedule: Schedule,
    pipeline_rank: int,
    rank_mapping: Sequence[int],
    transport: str,
    extra: Mapping[str, str] | None = None,
    partial: Mapping[str, str] | None = None,
) -> Fingerprint:
    """This rank's fingerprint; ``transport`` is the resolved choice (e.g. ``"native"``, never ``"auto"``);
    ``extra``: more fields every rank has; ``partial``: fields compared only among the ranks stating them."""
    fields = [
        ("microbatches", str(schedule.num_microbatches)),
        ("schedule", f"{schedule.name!r} (digest {schedule_digest(schedule)})"),
        ("placement", f"stage->rank {list(schedule.stage_to_rank)}, group rank->pipeline rank {list(rank_mapping)}"),
        ("transport", transport),
    ]
    fields += [(str(k), str(v)) for k, v in (extra or {}).items()]
    fields += [(str(k), str(v)) for k, v in (partial or {}).items()]
    return Fingerprint(pipeline_rank, tuple(fields), frozenset(map(str, partial or ())))


def disagreement(prints: Sequence[Fingerprint]) -> RanksDisagree | None:
    """The error describing how ``prints[g]`` (group rank g) differ, or None when they all agree."""
    per_rank = [dict(p.fields) for p in prints]
    names = list(dict.fromkeys(k for p in prints for k, _ in p.fields))
    partial = frozenset().union(*(p.partial for p in prints))

    def values_of(name: str) -> dict[int, str]:
        if name in partial:  # only the ranks stating it
            return {g: d[name] for g, d in enumerate(per_rank) if name in d}
        return {g: d.get(name, "<missing>") for g, d in enumerate(per_rank)}

    differing = [n for n in names if len(set(values_of(n).values())) > 1]
    if not differing:
        return None
    field = differing[0]
    values = values_of(field)
    by_value: dict[str, list[str]] = {}
    for g, v in values.items():
        by_value.setdefault(v, []).append(f"group rank {g} (pipeline rank {prints[g].pipeline_rank})")
    listed = "; ".join(f"{', '.join(who)}: {v}" for v, who in by_value.items())
    also = f" (also differing: {', '.join(differing[1:])})" if len(differing) > 1 else ""
    message = (
        f"the pipeline's ranks disagree on {field}{also}: {listed}. Every rank must build its Pipeline with the "
        "same schedule, micro-batch count, rank_mapping, transport and shared options (docs/runtime_options.md)"
    )
    return RanksDisagree(message, field, values, differing)


def exchange(
    mine: Fingerprint, group: dist.ProcessGroup, timeout_s: float, rank_mapping: Sequence[int] | None = None
) -> list[Fingerprint]:
    """Publish ``mine`` in ``group``'s store and return every group rank's fingerprint (collective).

    ``rank_mapping[g]``: the pipeline rank of group rank ``g`` (identity when None), used to name a peer
    that never publishes (TransportTimeout after ``timeout_s``).
    """
    return exchange_numbered(mine, group, timeout_s, rank_mapping)[0]


def exchange_numbered(
    mine: Fingerprint, group: dist.ProcessGroup, timeout_s: float, rank_mapping: Sequence[int] | None = None
) -> tuple[list[Fingerprint], int]:
    """:func:`exchange`, and the exchange's generation: its number among the exchanges on the store, the same
    on every rank that made the same exchanges in the same order (a pipeline's number on its group)."""
    store = group_store(group)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    mapping = list(rank_mapping) if rank_mapping is not None else list(range(size))
    generation = store.add(f"{_PREFIX}/generation/{rank}", 1)
    prefix = f"{_PREFIX}/{generation}"
    store.set(f"{prefix}/{rank}", mine.to_json())
    who = f"pipeline rank {mine.pipeline_rank} (group rank {rank}): pipeline construction"
    out: list[Fingerprint] = []
    for g in range(size):
        if g == rank:
            out.append(mine)
            continue
        key = f"{prefix}/{g}"
        peer = f"peer pipeline rank {mapping[g]} (group rank {g})"
        wait_store_key(store, key, timeout_s, who, f"{peer} to build its Pipeline (did it fail?)")
        out.append(Fingerprint.from_json(store.get(key)))
    return out, int(generation)


def agree(
    mine: Fingerprint, group: dist.ProcessGroup, timeout_s: float, rank_mapping: Sequence[int] | None = None
) -> int:
    """Exchange fingerprints over ``group``; raise :class:`RanksDisagree` on every rank if any differ.

    Returns the exchange's generation (:func:`exchange_numbered`)."""
    prints, generation = exchange_numbered(mine, group, timeout_s, rank_mapping)
    err = disagreement(prints)
    if err is not None:
        raise err
    return generation


def resolved_transport(kind: Any, device: Any) -> str:
    """The transport ``make_transport(kind, ...)`` builds, by name (``"auto"`` resolved)."""
    from dualpipe_kernels.transport import auto_kind

    if isinstance(kind, str):
        return auto_kind(device) if kind == "auto" else kind
    return str(getattr(kind, "name", type(kind).__name__))
