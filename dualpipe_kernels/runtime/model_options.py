"""What a pipeline needs to know about the model beyond its stage modules (one frozen record).

``tied_parameters``: groups of the full model's parameter names that are one
parameter (an embedding and the LM head sharing a weight), for stage modules
built apart on each rank (``build_stage_modules`` with a factory, hand-written
modules): their gradient is summed across the ranks holding a member
(runtime/tied.py).  ``Pipeline.from_sequential`` finds ties by identity itself.
``allow_uneven``: accept a batch whose rows the micro-batch count does not
divide, weighting each micro-batch's loss by its rows.

One of the pipeline's option groups (``PipelineOptions.model_options``):
``Pipeline(..., model_options=ModelOptions(...))`` or the same names as flat
shorthands (``Pipeline(..., tied_parameters=..., allow_uneven=True)``), folded
by the options' one rule (runtime/options.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dualpipe_kernels.runtime.checks import fold_group

__all__ = ["ModelOptions", "model_options", "check_tie_groups"]

TieGroups = tuple[tuple[str, ...], ...]


def check_tie_groups(groups: Iterable[Sequence[str]] | None) -> TieGroups:
    """``groups`` as a tuple of tuples of names, checked: >= 2 distinct names each, no name in two groups."""
    if groups is None:
        return ()
    if isinstance(groups, (str, bytes)):
        raise ValueError("tied_parameters must be a list of groups of names, e.g. [('0.weight', '5.weight')]")
    out: list[tuple[str, ...]] = []
    seen: dict[str, int] = {}
    for gi, g in enumerate(groups):
        if isinstance(g, (str, bytes)) or not all(isinstance(n, str) for n in g):
            raise ValueError(f"tied_parameters group {gi} must be a sequence of parameter names, got {g!r}")
        names = tuple(g)
        if len(set(names)) < 2 or len(set(names)) != len(names):
            raise ValueError(f"tied_parameters group {gi} {list(names)} must hold at least 2 distinct names")
        for n in names:
            if n in seen:
                raise ValueError(f"parameter {n!r} is in tied_parameters groups {seen[n]} and {gi}; merge them")
            seen[n] = gi
        out.append(names)
    return tuple(out)


@dataclass(frozen=True)
class ModelOptions:
    """The model's ties and batch rule (see the module docstring)."""

    tied_parameters: TieGroups = ()
    allow_uneven: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "tied_parameters", check_tie_groups(self.tied_parameters))
        if not isinstance(self.allow_uneven, bool):
            raise ValueError(f"allow_uneven must be True or False, got {self.allow_uneven!r}")

    def agreed_fields(self) -> dict[str, str]:
        """What every rank must share: how a batch is split into micro-batches (the loss weights depend on
        it).  Tie groups are each rank's own view (runtime/tied.py agrees on who holds what)."""
        return {"allow_uneven": str(self.allow_uneven)}


def model_options(
    options: ModelOptions | None, tied_parameters: Any = None, allow_uneven: bool | None = None
) -> ModelOptions:
    """One ModelOptions from a record and/or its flat keywords (the options' one conflict rule,
    :func:`~dualpipe_kernels.runtime.checks.fold_group`)."""
    flat = {"tied_parameters": ("tied_parameters", tied_parameters), "allow_uneven": ("allow_uneven", allow_uneven)}
    out: ModelOptions = fold_group("model_options", ModelOptions, options, flat)
    return out
