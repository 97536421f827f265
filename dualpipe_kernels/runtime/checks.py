"""Checks of what a Pipeline is given, run before any rank takes a step (fail fast, naming the culprit).

* :func:`check_timeout`: a finite number of seconds > 0 (NaN and inf are refused;
  the transports' own check, ``transport.base.check_timeout``).
* :func:`check_stage_devices`: no parameter or buffer on the ``meta`` device
  (a module built without data fails at construction, naming its stage).
* :func:`fold_group`: an option group and the flat shorthands of its fields, with the one conflict rule
  (``PipelineOptions.fold`` applies it to every group).
* :func:`call_criterion`: a criterion that cannot take the stage's outputs and
  the labels given gets a message saying what it was given, not a bare TypeError.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dualpipe_kernels.transport.base import check_timeout

__all__ = ["check_timeout", "check_stage_devices", "call_criterion"]


def check_stage_devices(stage_modules: Mapping[int, nn.Module]) -> None:
    """ValueError naming the stage and tensor when a stage module holds a tensor on the ``meta`` device."""
    for stage, module in stage_modules.items():
        for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
            if t.device.type == "meta":
                raise ValueError(
                    f"stage {stage}: {name!r} is on the meta device (a shape without data); materialise the "
                    "module first, e.g. module.to_empty(device=...) and initialise its weights"
                )


def call_criterion(
    criterion: Callable[..., torch.Tensor], outputs: Sequence[Any], labels: Sequence[Any], where: str
) -> Any:
    """``criterion(*outputs, *labels)``; a call its signature cannot take raises ValueError saying why.

    ``where`` names the call site (pipeline rank, stage, micro-batch).  Only a
    failed call pays for the signature check.
    """
    try:
        return criterion(*outputs, *labels)
    except TypeError as exc:
        try:
            inspect.signature(criterion).bind(*outputs, *labels)
        except TypeError as bind_exc:
            raise ValueError(
                f"{where}: criterion(*outputs, *labels) got {len(outputs)} output(s) and {len(labels)} label(s) "
                f"and cannot take them ({bind_exc}); pass labels= (or microbatch_labels=) to step() on the rank "
                "holding the loss stage"
            ) from exc
        except ValueError:  # no inspectable signature (a builtin): keep the original error
            pass
        raise


def fold_group(name: str, cls: type[Any], given: object | None, flat: Mapping[str, tuple[str, object | None]]) -> Any:
    """The option group ``name`` (a frozen dataclass ``cls``) from ``given`` (an instance or None) and its
    shorthands ``flat`` (``{keyword: (field, value or None)}``; None: not given).

    A shorthand sets its field (a group left out starts from its defaults); a shorthand whose group is given
    too must agree with the group's field once both are normalised (``__post_init__``), else a ValueError
    names both.
    """
    if not flat:  # a group without shorthands: nothing to fold (its holder checks its type)
        return given if given is not None else cls()
    values = {f: v for f, v in flat.values() if v is not None}
    if given is None:
        return cls(**values)
    if not isinstance(given, cls):
        raise ValueError(f"{name} must be a {cls.__name__} or None, got {type(given).__name__}")
    merged = dataclasses.replace(given, **values)  # the shorthands normalised as the group stores them
    for key, (f, v) in flat.items():
        if v is not None and getattr(merged, f) != getattr(given, f):
            raise ValueError(
                f"{key}= and {name}={cls.__name__}(...) both given with different values: {key}={v!r} "
                f"both as a keyword and in {name} as {f}={getattr(given, f)!r}; set the field in {cls.__name__} only"
            )
    return given
