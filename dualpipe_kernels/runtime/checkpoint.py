"""Checkpoints of a pipeline under the full model's parameter names.

A rank's stage modules hold pieces of one model.  :func:`stage_state_dict`
names every parameter and buffer as the full model does (``"7.weight"``, not
stage 3's ``"1.weight"``), taking a model stage once per rank however many
copies of it the rank holds (DualPipe's mirror copies are equal after
``sync_mirror_grads`` and identical optimizer steps).  With those names
``torch.distributed.checkpoint`` (DCP) moves a checkpoint between layouts:
save from a 2-rank pipeline, load into one process's full model, and back.
Across ranks DCP writes a key held by two ranks (a mirrored stage) once.

Names: a :class:`~dualpipe_kernels.runtime.stages.StageLayers` (what
``build_stage_modules`` and ``Pipeline.from_sequential`` build) knows its
first layer; any other stage module needs ``full_name(stage, local_name)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from dualpipe_kernels.runtime.stages import StageLayers
from dualpipe_kernels.schedules.ir import Schedule

__all__ = [
    "stage_state_dict",
    "load_stage_state_dict",
    "save_pipeline",
    "load_pipeline",
    "save_model",
    "load_model",
    "optimizer_state_dict",
]

NameMap = Callable[[int, str], str]


def _namer(modules: Mapping[int, nn.Module], full_name: NameMap | None) -> NameMap:
    if full_name is not None:
        return full_name
    bad = [s for s, m in modules.items() if not isinstance(m, StageLayers)]
    if bad:
        raise ValueError(
            f"stage modules {bad} are not StageLayers (build_stage_modules / Pipeline.from_sequential): "
            "pass full_name(stage, local_name) -> the full model's name"
        )
    return lambda s, local: modules[s].full_name(local)  # type: ignore[operator]


def _copies(schedule: Schedule, modules: Mapping[int, nn.Module]) -> dict[int, list[int]]:
    """Model stage -> this rank's stages holding a copy of it (lowest stage first: the one saved)."""
    out: dict[int, list[int]] = {}
    for s in sorted(modules):
        out.setdefault(schedule.model_stage[s], []).append(s)
    return out


def stage_state_dict(
    schedule: Schedule,
    modules: Mapping[int, nn.Module],
    full_name: NameMap | None = None,
    ties: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """``{full model name: tensor}`` of this rank's stage modules; tensors share the modules' storage.

    ``ties``: name -> the first name of its tie group (``Pipeline``'s tied parameters): a tied
    parameter is stored once, under its first name."""
    name = _tied_namer(_namer(modules, full_name), ties)
    out: dict[str, torch.Tensor] = {}
    for stages in _copies(schedule, modules).values():
        s = stages[0]
        for local, t in modules[s].state_dict(keep_vars=False).items():
            key = name(s, local)
            if key in out:
                if ties and key in ties.values():
                    continue  # another member of the same tie group: stored once
                raise ValueError(f"full name {key!r} given to two tensors (stage {s} {local!r})")
            out[key] = t
    return out


def _tied_namer(name: NameMap, ties: Mapping[str, str] | None) -> NameMap:
    if not ties:
        return name
    return lambda s, local: ties.get(name(s, local), name(s, local))


def load_stage_state_dict(
    schedule: Schedule,
    modules: Mapping[int, nn.Module],
    state_dict: Mapping[str, torch.Tensor],
    full_name: NameMap | None = None,
    ties: Mapping[str, str] | None = None,
) -> None:
    """Copy ``state_dict`` (full model names) into every stage module this rank holds, mirror copies included.

    Keys of other ranks' stages are ignored; a key this rank needs and
    ``state_dict`` lacks is an error naming it.  ``ties``: as for :func:`stage_state_dict`.
    """
    name = _tied_namer(_namer(modules, full_name), ties)
    for s, m in modules.items():
        mine = m.state_dict()
        missing = [name(s, k) for k in mine if name(s, k) not in state_dict]
        if missing:
            raise KeyError(f"stage {s}: the state dict has no {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        with torch.no_grad():
            for k, t in mine.items():
                src = state_dict[name(s, k)]
                if t is not src:
                    t.copy_(src)


def _ties_of(pipe: Any) -> dict[str, str]:
    """name -> first name of its tie group, for the groups this rank holds (runtime/reductions.py's ties)."""
    reductions = getattr(pipe, "_reductions", None)
    return reductions.ties.canonical() if reductions is not None else {}


def _pipeline_params(pipe: Any, full_name: NameMap | None) -> dict[str, list[nn.Parameter]]:
    """Canonical full name -> this rank's parameter objects under it (the first copy's first)."""
    name = _tied_namer(_namer(pipe.stage_modules, full_name), _ties_of(pipe))
    out: dict[str, list[nn.Parameter]] = {}
    for s in sorted(pipe.stage_modules):
        for local, p in pipe.stage_modules[s].named_parameters(remove_duplicate=False):
            ps = out.setdefault(name(s, local), [])
            if all(p is not q for q in ps):
                ps.append(p)
    return out


def _model_params(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    from dualpipe_kernels.runtime.tied import canonical_names, find_ties

    canon = canonical_names(find_ties(model))
    out: dict[str, list[nn.Parameter]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        ps = out.setdefault(canon.get(n, n), [])
        if all(p is not q for q in ps):
            ps.append(p)
    return out


_STATE, _GROUPS = "optim.state.", "optim.param_groups."


def optimizer_state_dict(named: Mapping[str, list[nn.Parameter]], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state flattened under parameter names (``optim.state.<name>.<key>`` and
    ``optim.param_groups.<name>.<hyperparameter>``): any layout that names its parameters the same
    way (a pipeline of any size, one process's full model) reads it back.  Tensors are the optimizer's own."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out: dict[str, Any] = {}
    for name, ps in named.items():
        g = group_of.get(id(ps[0]))
        if g is None:
            continue  # not optimised by this optimizer
        for k, v in optimizer.state.get(ps[0], {}).items():
            out[f"{_STATE}{name}.{k}"] = v
        for k, v in g.items():
            if k != "params":
                out[f"{_GROUPS}{name}.{k}"] = v
    return out


def _init_optimizer_state(named: Mapping[str, list[nn.Parameter]], optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter without optimizer state its state tensors (a step with zero gradients at lr 0,
    parameters unchanged) so a checkpoint can be loaded into them in place."""
    params = [p for ps in named.values() for p in ps]
    if all(p in optimizer.state and optimizer.state[p] for p in params):
        return
    grads = {p: p.grad for g in optimizer.param_groups for p in g["params"]}
    lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            g["lr"] = 0.0
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        with torch.no_grad():
            optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr
        for p, grad in grads.items():
            p.grad = grad


def _load_optimizer_state(
    named: Mapping[str, list[nn.Parameter]], optimizer: torch.optim.Optimizer, loaded: Mapping[str, Any]
) -> None:
    """Write the loaded flat entries back (non-tensors, hyperparameters, second copies of a parameter)."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for name, ps in named.items():
        g = group_of.get(id(ps[0]))
        if g is None:
            continue
        state = optimizer.state[ps[0]]
        for k in list(state):
            v = loaded[f"{_STATE}{name}.{k}"]
            if isinstance(v, torch.Tensor) and isinstance(state[k], torch.Tensor):
                if v is not state[k]:
                    state[k].copy_(v)
            else:
                state[k] = v
        for q in ps[1:]:  # another copy of the same parameter on this rank (a mirror copy, a tie)
            optimizer.state[q] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        for k in g:
            key = f"{_GROUPS}{name}.{k}"
            if k != "params" and key in loaded:
                g[k] = loaded[key]


def save_pipeline(
    pipe: Any,
    checkpoint_id: str | os.PathLike[str],
    full_name: NameMap | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Save ``pipe``'s stage modules with DCP under the full model's names (collective over ``pipe.group``).

    A tied parameter is saved once, under its tie group's first name.  ``optimizer``: also save its
    state under the same names (:func:`optimizer_state_dict`), so the run resumes on another number
    of pipeline ranks or in one process (:func:`load_model`)."""
    import torch.distributed.checkpoint as dcp

    sd: dict[str, Any] = dict(stage_state_dict(pipe.schedule, pipe.stage_modules, full_name, _ties_of(pipe)))
    if optimizer is not None:
        sd.update(optimizer_state_dict(_pipeline_params(pipe, full_name), optimizer))
    dcp.save(sd, checkpoint_id=checkpoint_id, process_group=pipe.group)


def load_pipeline(
    pipe: Any,
    checkpoint_id: str | os.PathLike[str],
    full_name: NameMap | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Load a DCP checkpoint with the full model's names into ``pipe``'s stage modules (collective);
    ``optimizer``: also its state (the checkpoint must hold it: ``save_pipeline(..., optimizer=)``)."""
    import torch.distributed.checkpoint as dcp

    ties = _ties_of(pipe)
    sd: dict[str, Any] = dict(stage_state_dict(pipe.schedule, pipe.stage_modules, full_name, ties))
    named = _pipeline_params(pipe, full_name) if optimizer is not None else {}
    if optimizer is not None:
        _init_optimizer_state(named, optimizer)
        sd.update(optimizer_state_dict(named, optimizer))
    dcp.load(sd, checkpoint_id=checkpoint_id, process_group=pipe.group)  # in place: the tensors are the modules'
    load_stage_state_dict(pipe.schedule, pipe.stage_modules, sd, full_name, ties)  # second copies, tie members
    if optimizer is not None:
        _load_optimizer_state(named, optimizer, sd)


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from dualpipe_kernels.runtime.tied import canonical_names, find_ties

    canon = canonical_names(find_ties(model))
    out: dict[str, torch.Tensor] = {}
    for n, t in model.state_dict().items():
        out.setdefault(canon.get(n, n), t)
    return out


def save_model(
    model: nn.Module, checkpoint_id: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None
) -> None:
    """One process's full model (and ``optimizer``'s state) in the pipeline checkpoints' layout."""
    import torch.distributed.checkpoint as dcp

    sd: dict[str, Any] = dict(_model_state(model))
    if optimizer is not None:
        sd.update(optimizer_state_dict(_model_params(model), optimizer))
    dcp.save(sd, checkpoint_id=checkpoint_id)


def load_model(
    model: nn.Module, checkpoint_id: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Load a pipeline checkpoint (any number of ranks) into one process's full ``model`` (and ``optimizer``)."""
    import torch.distributed.checkpoint as dcp

    sd: dict[str, Any] = dict(_model_state(model))
    named = _model_params(model) if optimizer is not None else {}
    if optimizer is not None:
        _init_optimizer_state(named, optimizer)
        sd.update(optimizer_state_dict(named, optimizer))
    dcp.load(sd, checkpoint_id=checkpoint_id)
    with torch.no_grad():
        for n, t in _model_state(model).items():
            if sd[n] is not t:
                t.copy_(sd[n])
    if optimizer is not None:
        _load_optimizer_state(named, optimizer, sd)
