"""The pipeline's typed options (runtime/options.py): the constructor's signature, each group's checks and
normalisation, the one fold of the flat shorthands, and the fields the ranks' fingerprint compares.

In-process: nothing here needs a process group (every check runs before one is touched).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

from dualpipe_kernels.runtime import (
    DiagnosticsOptions,
    GradientOptions,
    LayoutOptions,
    MemoryOptions,
    ModelOptions,
    Pipeline,
    PipelineOptions,
    StepResult,
    WireOptions,
)
from dualpipe_kernels.runtime.boundary.codec import BoundaryFormat
from dualpipe_kernels.runtime.fingerprint import disagreement, fingerprint
from dualpipe_kernels.runtime.memory_plan import MemoryPolicy
from dualpipe_kernels.runtime.options import SHORTHANDS
from dualpipe_kernels.schedules.generators import build_schedule


def test_pipeline_takes_at_most_three_positional_parameters():
    params = list(inspect.signature(Pipeline).parameters.values())
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert positional == ["schedule", "modules", "group"]
    assert all(p.kind is p.KEYWORD_ONLY for p in params[3:])
    assert not any(p.kind is p.VAR_KEYWORD for p in params)
    # every shorthand is a keyword of Pipeline, and every group too
    names = {p.name for p in params}
    assert set(SHORTHANDS) | {"layout", "wire", "gradients", "memory", "diagnostics"} <= names


@pytest.mark.parametrize("builder", ["from_sequential", "from_mesh"])
def test_builders_take_the_option_groups_not_arbitrary_keywords(builder):
    params = inspect.signature(getattr(Pipeline, builder)).parameters.values()
    assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params)
    keyword_only = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    assert {"layout", "wire", "gradients", "memory", "diagnostics"} <= keyword_only


def test_defaults_are_the_documented_ones():
    opts = PipelineOptions()
    assert opts.layout == LayoutOptions(None, 0, None)
    assert opts.wire.transport == "auto" and opts.wire.format == BoundaryFormat("none", "none")
    assert opts.wire.timeout_s == 120.0 and opts.wire.recv_lookahead is None
    assert opts.wire.early_small_receives is None and opts.wire.inline_limit_bytes is None
    assert opts.gradients == GradientOptions("split", True, True, None, "mean")
    assert opts.memory.policy == MemoryPolicy("keep")
    assert opts.diagnostics.record_timeline is False


def test_groups_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        WireOptions().timeout_s = 1.0  # type: ignore[misc]


def test_loose_values_are_stored_normalised():
    assert WireOptions(boundary_format="fp8,bf16").format == BoundaryFormat("fp8", "bf16")
    assert WireOptions(boundary_format=("packed", "none")).boundary_format == BoundaryFormat("packed", "none")
    assert WireOptions(boundary_format=None).format == BoundaryFormat()
    assert WireOptions(timeout_s=3).timeout_s == 3.0 and isinstance(WireOptions(timeout_s=3).timeout_s, float)
    assert LayoutOptions(rank_mapping=[1, 0]).rank_mapping == (1, 0)
    assert LayoutOptions(device="cpu").device == torch.device("cpu")
    assert GradientOptions(scale_grads=False).dp_op == "sum"  # dp_op follows scale_grads
    assert GradientOptions(scale_grads=False, dp_op="mean").reduce_op == "mean"
    per_stage = MemoryOptions({2: "compress:fp8", 0: "offload"})
    assert dict(per_stage.policy) == {0: MemoryPolicy("offload"), 2: MemoryPolicy("compress", "fp8")}  # type: ignore[arg-type]
    assert per_stage.for_stages((0, 1)) == {0: MemoryPolicy("offload"), 1: MemoryPolicy("keep")}
    assert MemoryOptions("recompute").for_stages((3, 4)) == {3: MemoryPolicy("recompute"), 4: MemoryPolicy("recompute")}


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: LayoutOptions(rank_mapping="01"), r"rank_mapping must be a sequence"),
        (lambda: LayoutOptions(rank_mapping=[0, 0]), r"rank_mapping must not repeat a pipeline rank, got \[0, 0\]"),
        (lambda: LayoutOptions(rank_mapping=[0, -1]), r"rank_mapping entries must be an int >= 0, got -1"),
        (lambda: LayoutOptions(batch_dim=1.0), r"batch_dim must be an int, got 1.0"),
        (lambda: LayoutOptions(batch_dim=True), r"batch_dim must be an int, got True"),
        (lambda: LayoutOptions(device="gpu7"), r"device must be a torch.device or a device name, got 'gpu7'"),
        (lambda: WireOptions(transport="tcp"), r"transport must be one of auto, torch, native or a Transport"),
        (lambda: WireOptions(boundary_format="fp4"), r"unknown format 'fp4' for activations"),
        (lambda: WireOptions(timeout_s=float("nan")), r"timeout_s must be a finite number of seconds, got nan"),
        (lambda: WireOptions(timeout_s=0), r"timeout_s must be > 0"),
        (lambda: WireOptions(recv_lookahead=0), r"recv_lookahead must be >= 1, got 0"),
        (lambda: WireOptions(recv_lookahead=2.5), r"recv_lookahead must be an int >= 1 or None, got 2.5"),
        (lambda: WireOptions(early_small_receives=1), r"early_small_receives must be True, False or None, got 1"),
        (lambda: WireOptions(inline_limit_bytes=-1), r"inline_limit_bytes must be an int >= 0 or None, got -1"),
        (lambda: GradientOptions(zero_bubble="fast"), r"zero_bubble must be 'split' or 'store', got 'fast'"),
        (lambda: GradientOptions(sync_mirror_grads="yes"), r"sync_mirror_grads must be True or False, got 'yes'"),
        (lambda: GradientOptions(scale_grads=None), r"scale_grads must be True or False, got None"),
        (lambda: GradientOptions(dp_op="max"), r"dp_op must be one of sum, mean, got 'max'"),
        (lambda: GradientOptions(dp_group="dp"), r"dp_group must be a torch.distributed ProcessGroup or None"),
        (lambda: MemoryOptions("swap"), r"memory policy 'swap' is unknown"),
        (lambda: MemoryOptions({"0": "keep"}), r"memory_policy: stage keys must be ints >= 0, got '0'"),
        (lambda: MemoryOptions({0: "compress:int4"}), r"memory policy 'compress:int4' is unknown"),
        (lambda: DiagnosticsOptions(record_timeline="on"), r"record_timeline must be True or False, got 'on'"),
        (lambda: PipelineOptions(wire=GradientOptions()), r"wire must be a WireOptions, got GradientOptions"),
    ],
)
def test_each_field_is_checked_where_it_is_written(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_shorthands_fold_into_their_groups():
    opts = PipelineOptions.fold(
        {},
        {"timeout_s": 7, "memory_policy": "offload", "batch_dim": 1, "scale_grads": False, "record_timeline": True},
    )
    assert opts.wire == WireOptions(timeout_s=7.0)
    assert opts.memory == MemoryOptions("offload")
    assert opts.layout == LayoutOptions(batch_dim=1)
    assert opts.gradients == GradientOptions(scale_grads=False, dp_op="sum")
    assert opts.diagnostics == DiagnosticsOptions(True)
    given = WireOptions(transport="torch")
    assert PipelineOptions.fold({"wire": given}, {"batch_dim": 1}).wire is given  # None shorthands: not given


def test_a_group_and_its_shorthand_together_are_refused():
    with pytest.raises(ValueError, match=r"timeout_s= and wire=WireOptions\(...\) both given"):
        PipelineOptions.fold({"wire": WireOptions()}, {"timeout_s": 5.0})
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['timeout'\]"):
        PipelineOptions.fold({}, {"timeout": 5.0})
    with pytest.raises(ValueError, match=r"memory must be a MemoryOptions or None, got str"):
        PipelineOptions.fold({"memory": "keep"}, {})


def test_pipeline_checks_its_options_before_needing_a_process_group():
    sched, mods = build_schedule("1f1b", 2, 2), [nn.Linear(4, 4)]
    with pytest.raises(ValueError, match="zero_bubble must be 'split' or 'store'"):
        Pipeline(sched, mods, zero_bubble="eager")
    with pytest.raises(ValueError, match="dp_op must be one of sum, mean"):
        Pipeline(sched, mods, gradients=GradientOptions(dp_op="avg"))
    with pytest.raises(ValueError, match="record_timeline= and diagnostics=DiagnosticsOptions"):
        Pipeline(sched, mods, diagnostics=DiagnosticsOptions(), record_timeline=True)
    with pytest.raises(TypeError):
        Pipeline(sched, mods, None, "torch")  # type: ignore[misc]  # the transport is keyword-only now


def _agreed(opts: PipelineOptions, rank: int, schedule_name: str = "1f1b"):
    sched = build_schedule(schedule_name, 2, 4)
    shared, stated = opts.agreed_fields(sched.num_stages, schedule_name == "dualpipe")
    return fingerprint(sched, rank, [0, 1], "torch", extra=shared, partial=stated)


def test_the_fingerprint_compares_the_shared_options():
    base = PipelineOptions()
    for changed, field in [
        (PipelineOptions(wire=WireOptions(boundary_format="fp8")), "boundary_format"),
        (PipelineOptions(gradients=GradientOptions(scale_grads=False)), "scale_grads"),
        (PipelineOptions(layout=LayoutOptions(batch_dim=1)), "batch_dim"),
        (PipelineOptions(memory=MemoryOptions("recompute")), "memory_policy[stage 0]"),
    ]:
        err = disagreement([_agreed(base, 0), _agreed(changed, 1)])
        assert err is not None and err.field == field, (field, err)
    # local choices are not compared: each rank may pick its own
    local = PipelineOptions(
        wire=WireOptions(timeout_s=5.0, recv_lookahead=3, early_small_receives=True),
        gradients=GradientOptions(zero_bubble="store"),
        diagnostics=DiagnosticsOptions(True),
    )
    assert disagreement([_agreed(base, 0), _agreed(local, 1)]) is None
    # sync_mirror_grads only matters where the schedule has mirror copies
    no_sync = PipelineOptions(gradients=GradientOptions(sync_mirror_grads=False))
    assert disagreement([_agreed(base, 0), _agreed(no_sync, 1)]) is None
    err = disagreement([_agreed(base, 0, "dualpipe"), _agreed(no_sync, 1, "dualpipe")])
    assert err is not None and err.field == "sync_mirror_grads"


def test_per_stage_memory_policies_are_compared_stage_by_stage():
    def with_policy(policy: object) -> PipelineOptions:
        return PipelineOptions(memory=MemoryOptions(policy))  # type: ignore[arg-type]

    # each rank naming only its own stage: nothing to compare
    assert disagreement([_agreed(with_policy({0: "offload"}), 0), _agreed(with_policy({1: "keep"}), 1)]) is None
    # the same whole-model mapping everywhere, or one policy equal to it
    whole = {0: "recompute", 1: "recompute"}
    assert disagreement([_agreed(with_policy(whole), 0), _agreed(with_policy("recompute"), 1)]) is None
    # two ranks stating different policies for stage 1: named, with both values
    err = disagreement([_agreed(with_policy({0: "keep", 1: "offload"}), 0), _agreed(with_policy({1: "keep"}), 1)])
    assert err is not None and err.field == "memory_policy[stage 1]"
    assert err.values == {0: "offload", 1: "keep"}
    # the same name with other thresholds differs too
    fine = MemoryPolicy("offload", min_bytes=0)
    err = disagreement([_agreed(with_policy({0: fine}), 0), _agreed(with_policy({0: "offload"}), 1)])
    assert err is not None and err.values[0] == "offload (min_bytes=0, lookahead=2)"


def test_a_per_stage_mapping_may_not_name_a_stage_the_schedule_lacks():
    with pytest.raises(ValueError, match=r"memory_policy names stage\(s\) \[5\] but the schedule has stages 0..1"):
        MemoryOptions({5: "keep"}).check_stages(2)


def test_step_result_lives_in_its_own_module():
    assert StepResult.__module__ == "dualpipe_kernels.runtime.result"


def test_one_conflict_rule_for_every_group_model_options_included():
    """A shorthand with its group given too must agree with the group's field (compared normalised)."""
    given = WireOptions(timeout_s=30)
    assert PipelineOptions.fold({"wire": given}, {"timeout_s": 30}).wire is given  # 30 == 30.0: the same
    assert PipelineOptions.fold({"memory": MemoryOptions("offload")}, {"memory_policy": "offload"}).memory == (
        MemoryOptions("offload")
    )
    with pytest.raises(ValueError, match=r"boundary_format= and wire=WireOptions\(...\) both given with different"):
        PipelineOptions.fold({"wire": WireOptions(boundary_format="bf16")}, {"boundary_format": "fp8"})
    folded = PipelineOptions.fold({}, {"tied_parameters": [("0.w", "5.w")], "allow_uneven": True})
    assert folded.model_options == ModelOptions(tied_parameters=(("0.w", "5.w"),), allow_uneven=True)
    with pytest.raises(ValueError, match=r"tied_parameters= and model_options=ModelOptions\(...\) both given"):
        PipelineOptions.fold({"model_options": ModelOptions(allow_uneven=True)}, {"tied_parameters": [("a", "b")]})
    assert PipelineOptions.fold({"model_options": ModelOptions(allow_uneven=True)}, {"allow_uneven": True})
    with pytest.raises(ValueError, match=r"graphs must be a GraphOptions, got str"):
        PipelineOptions.fold({"graphs": "on"}, {})
