"""torchtitan: its pipeline config's schedule name picks this package's schedules.

torchtitan (``torchtitan.distributed.pipeline_parallel``) turns
``parallelism.pipeline_parallel_schedule`` into a class with torch's ``get_schedule_class``,
decides the stage placement by comparing that class with torch's ``ScheduleDualPipeV`` /
``ScheduleZBVZeroBubble`` (a V) and builds it as ``cls(stages, n_microbatches=...,
loss_fn=..., scale_grads=False, backward_requires_autograd=True)`` (a single-stage class:
``cls(stages[0], ...)``); its train step calls ``step(arg_mbs=, kwarg_mbs=, target_mbs=,
losses=, loss_kwargs=, return_outputs=False)``, with ``positions`` and ``attention_masks`` in
``kwarg_mbs`` for every stage.  :func:`use_dualpipe_kernels` points those names of that module at
:mod:`dualpipe_kernels.integrations.pipelining` (with ``keyword_inputs=True``), so the same config
(``pipeline_parallel_schedule = "DualPipeV"``) runs on this package's runtime.  Call it once
per process before the trainer is built.  The other way in, ``pipeline_parallel_schedule_csv`` with a file from
``schedules.to_csv``, runs our schedule on torch's runtime (``_PipelineScheduleRuntime``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from dualpipe_kernels.integrations.pipelining import SCHEDULES

__all__ = ["use_dualpipe_kernels", "TORCHTITAN_MODULE"]

#: the torchtitan module that picks and builds the pipeline schedule
TORCHTITAN_MODULE = "torchtitan.distributed.pipeline_parallel"

#: torch class names that torchtitan compares with to choose the V placement
_V_NAMES = {"DualPipeV": "ScheduleDualPipeV", "ZBVZeroBubble": "ScheduleZBVZeroBubble"}


def use_dualpipe_kernels(
    names: Iterable[str] = tuple(SCHEDULES), module: ModuleType | None = None, *, keyword_inputs: bool = True
) -> Callable[[], None]:
    """Make ``module`` (torchtitan's pipeline builder, imported when None) build this package's schedule for
    each of ``names`` (torch's spellings: ``"DualPipeV"``, ``"1F1B"``...); other names keep torch's classes.
    ``keyword_inputs``: the classes' default (torchtitan's train step passes ``positions`` and
    ``attention_masks`` to every stage as keyword arguments).  Returns a function that puts the module's
    previous names back."""
    wanted = list(names)
    unknown = [n for n in wanted if n not in SCHEDULES]
    if unknown or not wanted:
        raise ValueError(f"use_dualpipe_kernels: names must be some of {sorted(SCHEDULES)}, got {wanted}")
    mod = module if module is not None else importlib.import_module(TORCHTITAN_MODULE)
    torch_get = getattr(mod, "get_schedule_class", None)
    if not callable(torch_get):
        raise ValueError(f"use_dualpipe_kernels: {mod.__name__} has no get_schedule_class to replace")
    classes = {n: _with_keyword_default(SCHEDULES[n], keyword_inputs) for n in wanted}
    ours = {n.lower(): c for n, c in classes.items()}

    def get_schedule_class(schedule_name: str) -> Any:
        picked = ours.get(schedule_name.lower()) if isinstance(schedule_name, str) else None
        return picked if picked is not None else torch_get(schedule_name)

    saved = {"get_schedule_class": torch_get}
    mod.get_schedule_class = get_schedule_class  # type: ignore[attr-defined]
    for name, attr in _V_NAMES.items():
        if name in wanted and hasattr(mod, attr):
            saved[attr] = getattr(mod, attr)
            setattr(mod, attr, classes[name])  # so its ``cls in (V classes)`` test still gives the V placement

    def restore() -> None:
        for attr, value in saved.items():
            setattr(mod, attr, value)

    return restore


def _with_keyword_default(cls: type[Any], keyword_inputs: bool) -> type[Any]:
    """``cls`` itself, or a subclass of the same name whose ``keyword_inputs`` defaults to True (torchtitan
    builds the class with torch's arguments only)."""
    if cls.KEYWORD_INPUTS == keyword_inputs:
        return cls
    return type(
        cls.__name__, (cls,), {"KEYWORD_INPUTS": keyword_inputs, "__module__": cls.__module__, "__doc__": cls.__doc__}
    )
