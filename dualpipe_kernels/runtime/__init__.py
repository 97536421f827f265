"""Runtime: executes a Schedule on one rank (see executor.Pipeline) plus the local launcher.

``Pipeline`` / ``StepResult``: the per-rank executor, configured with the option
groups ``LayoutOptions``, ``WireOptions``, ``GradientOptions``, ``MemoryOptions``,
``DiagnosticsOptions``, ``ModelOptions`` (tied parameters, uneven batches) and ``GraphOptions`` (per-chunk
CUDA graphs, off by default); ``PipelineOptions`` holds one of each (docs/runtime_options.md).  ``build_stage_modules``:
this rank's stage modules for any schedule.  ``save_pipeline`` / ``load_pipeline``:
DCP checkpoints under the full model's parameter names.  ``run_reference``: the
single-process reference the executor is checked against.  ``spawn`` /
``spawn_outcomes``: start local worker processes, one per rank.
``pipeline_expert_groups``: the process groups of a pipeline x expert-parallel layout.

Layers (bottom first; a module imports only modules below it, held by
tests/unit/test_import_graph.py): foundations (checks, model_options, construction, groups,
launch, microbatch, timeline, memory_plan, memory_store, zero_bubble, graph_options, loss...), the
boundary wing (boundary/), options, the subsystems (fingerprint, stages, memory_records, memory,
reference, mirror, compute, data_parallel, tied, reductions, builders, checkpoint, graphs), the step
(loop, result), the pipeline (conveniences, step, executor), and this package's face.
"""

from dualpipe_kernels.runtime.checkpoint import load_pipeline, load_stage_state_dict, save_pipeline, stage_state_dict
from dualpipe_kernels.runtime.executor import Pipeline
from dualpipe_kernels.runtime.graph_options import GraphOptions
from dualpipe_kernels.runtime.groups import pipeline_expert_groups
from dualpipe_kernels.runtime.launch import RankOutcome, RanksFailed, free_port, spawn, spawn_outcomes
from dualpipe_kernels.runtime.microbatch import merge_microbatches, split_microbatches
from dualpipe_kernels.runtime.model_options import ModelOptions
from dualpipe_kernels.runtime.options import (
    DiagnosticsOptions,
    GradientOptions,
    LayoutOptions,
    MemoryOptions,
    PipelineOptions,
    WireOptions,
)
from dualpipe_kernels.runtime.reference import run_reference
from dualpipe_kernels.runtime.result import StepResult
from dualpipe_kernels.runtime.stages import StageLayers, build_stage_modules, layer_partition
from dualpipe_kernels.runtime.zero_bubble import WeightGradStore, current_store, run_backward

__all__ = [
    "ModelOptions",
    "Pipeline",
    "StepResult",
    "PipelineOptions",
    "LayoutOptions",
    "WireOptions",
    "GradientOptions",
    "MemoryOptions",
    "DiagnosticsOptions",
    "GraphOptions",
    "build_stage_modules",
    "StageLayers",
    "save_pipeline",
    "load_pipeline",
    "stage_state_dict",
    "load_stage_state_dict",
    "layer_partition",
    "run_reference",
    "spawn",
    "spawn_outcomes",
    "RankOutcome",
    "RanksFailed",
    "free_port",
    "split_microbatches",
    "merge_microbatches",
    "WeightGradStore",
    "current_store",
    "run_backward",
    "pipeline_expert_groups",
]
