"""Tied parameters across pipeline ranks: one gradient all-reduce per tie group per step.

A tie group is one parameter of the full model known under several names (an
embedding and the LM head sharing ``weight``: ``"0.weight"`` and ``"7.weight"``).
When its members land in stages of different ranks, each rank's copy gets only
the gradient of its own uses; one process would sum them.  At construction
every rank finds the members its stage modules hold (names through the modules'
``full_name``, as checkpoints name them), the ranks agree on who holds what
(one ``all_gather_object``), and each group holding members on two or more
ranks gets a process group of just those ranks (created by its members only).

Each step, after the last gradient action of the stages holding a member
(``post_early``: without a ``dp_group``; with one, right after the DP reduction), a rank posts
one async all_reduce of its contribution: the sum of the gradients of the
distinct parameter objects it holds for the group (one object shared by two
stage modules counts once: autograd already summed it).  At the end of the step
every object gets the total, as one process computes it.  DualPipe's mirror
copies of a tied parameter are left out of the mirror sum: the tie group's
all-reduce spans both copies and already sums them.

Like the DP reduction it sums the whole ``.grad``: accumulate over several steps
inside ``Pipeline.no_sync()`` (which pauses it) and let the last step reduce.
A tie the runtime cannot see (ranks that build separate copies of a shared
parameter) is the user's to declare with ``tied_parameters=``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dualpipe_kernels.runtime.data_parallel import last_grad_actions
from dualpipe_kernels.schedules.ir import Action

__all__ = ["TiedGradients", "find_ties", "canonical_names"]


def find_ties(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """Groups of ``model``'s parameter names that are one parameter object (found by identity)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return tuple(tuple(names) for names in by_id.values() if len(names) > 1)


def canonical_names(groups: Sequence[Sequence[str]]) -> dict[str, str]:
    """name -> the first name of its tie group (what a checkpoint stores it under)."""
    return {n: g[0] for g in groups for n in g}


@dataclass
class _Tie:
    """One tie group as this rank sees it."""

    index: int
    names: tuple[str, ...]
    params: list[nn.Parameter]  # the distinct objects this rank holds for it
    stages: list[int]  # this rank's stages holding a member
    holders: tuple[int, ...]  # pipeline ranks holding a member
    group: Any = None  # the holders' process group (None: only this rank holds it)


@dataclass
class _Posted:
    tie: _Tie
    flat: torch.Tensor
    work: Any
    start_s: float


@dataclass
class TiedGradients:
    """The tie groups of one pipeline rank and their per-step reduction (see the module docstring): one of
    the step's gradient reductions (runtime/reductions.py)."""

    rank: int
    ties: list[_Tie]
    timeout_s: float
    post_at: dict[int, list[_Tie]] = field(default_factory=dict)  # action index -> ties posted after it
    paused: bool = False

    @classmethod
    def build(
        cls,
        groups: Sequence[Sequence[str]],
        *,
        rank: int,
        group: dist.ProcessGroup,
        rank_mapping: Sequence[int],
        to_group_rank: Sequence[int],
        modules: Mapping[int, nn.Module],
        actions: Sequence[Action],
        timeout_s: float,
        post_early: bool,
    ) -> TiedGradients:
        """The tie groups ``groups`` (full model names) of this rank's stage ``modules`` (collective over the
        pipeline ``group`` when non-empty).  ``rank_mapping`` / ``to_group_rank``: group rank <-> pipeline
        rank; ``actions``: this rank's lowered action list (where each tie's reduction is posted);
        ``post_early``: post each tie after its last gradient action (False: at the step's end, after the
        data-parallel reduction, on the replica-summed gradients)."""
        if not groups:
            return cls(rank, [], timeout_s)
        wanted = canonical_names(groups)
        found: dict[str, list[tuple[int, nn.Parameter]]] = {}
        for s, m in sorted(modules.items()):
            namer = getattr(m, "full_name", None)
            if not callable(namer):
                raise ValueError(
                    f"tied_parameters: stage {s}'s module ({type(m).__name__}) has no full_name(local_name) "
                    "method to name its parameters as the full model does (StageLayers has one)"
                )
            for local, p in m.named_parameters(remove_duplicate=False):
                full = namer(local)
                if full in wanted:
                    found.setdefault(full, []).append((s, p))
        table: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(table, sorted(found), group=group)
        holders_of: dict[str, set[int]] = {}
        for g, names in enumerate(table):
            for n in names:
                holders_of.setdefault(n, set()).add(rank_mapping[g])
        missing = [n for n in wanted if n not in holders_of]
        if missing:
            raise ValueError(f"tied_parameters: no pipeline rank holds a parameter named {missing[:5]}")
        pp_globals = dist.get_process_group_ranks(group)
        backend = dist.get_backend(group)
        made: dict[tuple[int, ...], Any] = {}
        ties: list[_Tie] = []
        for i, names in enumerate(groups):
            holders = tuple(sorted(set().union(*(holders_of[n] for n in names))))
            if rank not in holders:
                continue
            params: list[nn.Parameter] = []
            stages: list[int] = []
            for n in names:
                for s, p in found.get(n, []):
                    if all(p is not q for q in params):
                        params.append(p)
                    if s not in stages:
                        stages.append(s)
            tie = _Tie(i, tuple(names), params, sorted(stages), holders)
            if len(holders) > 1:
                if len(holders) == len(pp_globals):
                    made.setdefault(holders, group)  # every pipeline rank holds it: the pipeline group
                if holders not in made:
                    members = sorted(pp_globals[to_group_rank[r]] for r in holders)
                    pg = dist.new_group(members, backend=backend, use_local_synchronization=True)
                    if not isinstance(pg, dist.ProcessGroup):
                        raise RuntimeError(f"pipeline rank {rank}: not a member of its tie group {members}")
                    made[holders] = pg
                tie.group = made[holders]
            ties.append(tie)
        out = cls(rank, ties, timeout_s)
        for tie in out.reduced() if post_early else ():
            # posted right after the last gradient action of this rank's stages holding a member
            at = max(last_grad_actions(actions, tie.stages).values(), default=len(actions) - 1)
            out.post_at.setdefault(at, []).append(tie)
        return out

    def reduced(self) -> list[_Tie]:
        """The ties with work to do: held on other ranks too, or as several objects here (one object on
        one rank only, such as DualPipeV's two ends, is already summed by autograd)."""
        return [t for t in self.ties if t.group is not None or len(t.params) > 1]

    def param_ids(self) -> set[int]:
        """ids of this rank's tied parameter objects (left out of DualPipe's mirror sum)."""
        return {id(p) for t in self.ties for p in t.params}

    def canonical(self) -> dict[str, str]:
        """name -> first name of its group, for the groups this rank holds."""
        return canonical_names([t.names for t in self.ties])

    def begin(self, t0: float) -> _StepTies | None:
        """This step's reductions (None when there is no tie to reduce or inside ``no_sync``)."""
        if not self.reduced() or self.paused:
            return None
        return _StepTies(self, t0)

    @contextmanager
    def pause(self) -> Iterator[None]:
        before, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = before


@dataclass
class _StepTies:
    owner: TiedGradients
    t0: float
    posted: list[_Posted] = field(default_factory=list)
    started: set[int] = field(default_factory=set)

    def hooks(self) -> Mapping[int, Any]:
        """Action index -> post the ties whose gradient work ends there (the loop's ``done_hooks``)."""
        return {i: (lambda ts=ts: self._post_all(ts)) for i, ts in self.owner.post_at.items()}

    def _post_all(self, ties: Sequence[_Tie]) -> None:
        for t in ties:
            self._post(t)

    def _post(self, tie: _Tie) -> None:
        if tie.index in self.started:
            return
        self.started.add(tie.index)
        grads = [p.grad for p in tie.params if p.grad is not None]
        if grads:
            flat = grads[0].detach().clone()
            for g in grads[1:]:
                flat += g
        else:
            p0 = tie.params[0]
            flat = torch.zeros_like(p0)
        work = dist.all_reduce(flat, group=tie.group, async_op=True) if tie.group is not None else None
        self.posted.append(_Posted(tie, flat, work, time.perf_counter()))

    def finish(self) -> None:
        """Post what is not posted yet, wait, write the totals into ``.grad``."""
        for t in self.owner.reduced():
            self._post(t)
        for x in self.posted:
            if x.work is not None:
                try:
                    x.work.wait(timeout=timedelta(seconds=self.owner.timeout_s))
                except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise several types
                    raise RuntimeError(
                        f"pipeline rank {self.owner.rank}: gradient all-reduce of tied parameters "
                        f"{list(x.tie.names)} over pipeline ranks {list(x.tie.holders)} failed or timed out "
                        f"after {self.owner.timeout_s:.3g} s: {exc}"
                    ) from exc
            with torch.no_grad():
                for p in x.tie.params:
                    if p.grad is None:
                        p.grad = x.flat.clone()
                    else:
                        p.grad.copy_(x.flat)
        self.posted.clear()
