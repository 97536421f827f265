"""Every way to build a pipeline takes Pipeline's option groups, spelled as Pipeline spells them, so the
builders cannot drift from the constructor: ``Pipeline.from_sequential`` and ``Pipeline.from_mesh`` take all
of them; compat's ``DualPipe`` / ``DualPipeV`` and the torch.distributed.pipelining drop-ins (which
torchtitan's hook builds) take all but the groups they set from their own API's arguments, which each
declares with the reason (``FIXED_OPTION_GROUPS``).  And Pipeline's flat shorthands are exactly the one
table they are folded from (``options.SHORTHANDS``).

Read with ``inspect.signature`` (names, kinds, annotations as written, defaults); nothing is built.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import pytest

from dualpipe_kernels.compat import DualPipe, DualPipeV
from dualpipe_kernels.integrations import pipelining, torchtitan
from dualpipe_kernels.runtime import Pipeline
from dualpipe_kernels.runtime.options import GROUP_NAMES, SHORTHANDS, PipelineOptions


def _params(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


PIPELINE = _params(Pipeline.__init__)


def _torchtitan_classes() -> dict[str, type[Any]]:
    """The classes torchtitan's hook hands out (a fake builder module stands in for torchtitan's)."""
    fake = types.ModuleType("fake_torchtitan_pipeline")
    fake.get_schedule_class = lambda name: None  # type: ignore[attr-defined]
    torchtitan.use_dualpipe_kernels(module=fake, keyword_inputs=True)
    return {n: fake.get_schedule_class(n) for n in pipelining.SCHEDULES}  # type: ignore[attr-defined]


BUILDERS: dict[str, tuple[Callable[..., Any], frozenset[str]]] = {
    "Pipeline.from_sequential": (Pipeline.from_sequential, frozenset()),
    "Pipeline.from_mesh": (Pipeline.from_mesh, frozenset()),
    **{f"compat.{c.__name__}": (c.__init__, frozenset(c.FIXED_OPTION_GROUPS)) for c in (DualPipe, DualPipeV)},
    **{
        f"pipelining.{c.__name__}": (c.__init__, frozenset(c.FIXED_OPTION_GROUPS))
        for c in pipelining.SCHEDULES.values()
    },
    **{f"torchtitan {n}": (c.__init__, frozenset(c.FIXED_OPTION_GROUPS)) for n, c in _torchtitan_classes().items()},
}


def test_the_option_groups_are_pipeline_options_fields_and_pipelines_keywords():
    assert GROUP_NAMES == tuple(f.name for f in PipelineOptions.__dataclass_fields__.values())
    assert {"layout", "wire", "gradients", "memory", "diagnostics", "model_options", "graphs"} == set(GROUP_NAMES)
    keyword_only = [n for n, p in PIPELINE.items() if p.kind is p.KEYWORD_ONLY]
    # the groups, then the shorthands in the table's order: one table, nothing else
    assert keyword_only == [*GROUP_NAMES, *SHORTHANDS]
    for name in (*GROUP_NAMES, *SHORTHANDS):
        assert PIPELINE[name].default is None, name  # None: not given (the fold's rule)


def test_every_shorthand_names_a_field_of_its_group():
    for key, (group, field) in SHORTHANDS.items():
        cls = PipelineOptions.__dataclass_fields__[group].default_factory  # type: ignore[misc]
        assert field in cls.__dataclass_fields__, f"{key} -> {group}.{field}"  # type: ignore[union-attr]


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_each_builder_takes_pipelines_option_groups_as_pipeline_spells_them(builder):
    fn, fixed = BUILDERS[builder]
    params = _params(fn)
    assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params.values()), builder
    assert fixed < set(GROUP_NAMES), f"{builder}: FIXED_OPTION_GROUPS names {sorted(fixed - set(GROUP_NAMES))}"
    taken = [n for n in params if n in GROUP_NAMES]
    assert taken == [g for g in GROUP_NAMES if g not in fixed], f"{builder} takes groups {taken}"
    for name in taken:
        mine, theirs = params[name], PIPELINE[name]
        assert mine.kind is inspect.Parameter.KEYWORD_ONLY, f"{builder}: {name} must be keyword-only"
        assert (mine.annotation, mine.default) == (theirs.annotation, theirs.default), f"{builder}: {name}"


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_a_builders_shorthands_are_pipelines(builder):
    fn, fixed = BUILDERS[builder]
    params = _params(fn)
    for name in set(params) & set(SHORTHANDS):
        group = SHORTHANDS[name][0]
        if group in fixed:
            continue  # the API's own argument (compat's batch_dim, torch's scale_grads), a group it sets
        assert group in params, f"{builder}: shorthand {name}= without its group {group}="
        assert params[name].default is None, f"{builder}: {name}"
