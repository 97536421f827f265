"""Search schedule x PP x DP x micro-batches under a memory budget, ranked by the simulator.

Step model (seconds, or the table's unit): ``simulated_step_s`` = the
simulator's makespan of the pipeline (``schedules.simulate`` with per-stage
costs from the optimal partition and a ``CommModel`` with the cluster's
intra/inter-node links) + the data-parallel gradient all-reduce, not
overlapped (a ring over the DP group, DualPipe's two copies of a stage
included, on the inter-node link when the group spans nodes).

With a parameter-count table (unit ``params``, no sample input) there are
no seconds to add link times to: the step is the simulated compute alone.

Scaling with the micro-batch size ``b`` (profiled at ``b0``): every layer time,
activation and boundary byte count is multiplied by ``b / b0``; parameters do
not change.  Device layout: a pipeline's ranks are consecutive devices, so
PP traffic stays inside a node when ``pp <= devices_per_node``.

Memory (planner/memory.py over ``schedules.memory_model``): parameter state +
the predicted peak of saved activations under the candidate's memory policy.
With ``memory_policy="auto"`` every layout is tried under keep, recompute and
offload; a policy's extra time (recompute: an F per backward; offload: reloads
the host link cannot hide) comes from ``memory_model.policy_costs``.  Those
only add time, so a layout where keep fits is never tried under another policy.

Search: candidates sorted by a lower bound (per rank: the forward time before
its first input can arrive + its compute; + the all-reduce); a candidate is
simulated only while its bound beats the ``top``-th best simulated step, so the
result equals exhaustive simulation.  Schedules and simulations are cached per
call (no module state).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from ..schedules import CommModel, CostModel, build_schedule, schedule_fits, simulate
from ..schedules.limits import MAX_RANK_MICROBATCHES
from ..schedules.memory_model import ChunkBytes, policy_costs
from .candidates import Candidate, Cluster, PlanError, PlanResult
from .explain import explain
from .layers import LayerTable
from .memory import PLAN_MEMORY_POLICIES, activation_peaks, chunk_bytes
from .stages import PLAN_SCHEDULES, StagePlan, stage_plan, stages_per_rank

__all__ = ["Cluster", "Candidate", "PlanError", "PlanResult", "plan", "enumerate_candidates", "MEMORY_POLICIES"]

MEMORY_POLICIES = ("auto", *PLAN_MEMORY_POLICIES)  # "auto": search all of PLAN_MEMORY_POLICIES
_GB = 1e9
#: Largest global batch (samples per step) and device count the planner serves.
MAX_GLOBAL_BATCH = 1 << 24
MAX_DEVICES = 1 << 16


def _divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order (O(sqrt n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def ring_allreduce_s(members: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Ring all-reduce: ``2 (n-1)/n x bytes / bandwidth + 2 (n-1) x latency``; 0 for one member."""
    if members <= 1:
        return 0.0
    return 2 * (members - 1) / members * nbytes / bandwidth + 2 * (members - 1) * latency


def _allreduce(sp: StagePlan, dp: int, cluster: Cluster) -> float:
    copies = 2 if sp.schedule == "dualpipe" else 1
    members = dp * copies
    span = sp.pp * dp if dp > 1 else sp.pp
    intra = span <= cluster.devices_per_node
    bw = cluster.intra_bandwidth if intra else cluster.inter_bandwidth
    lat = cluster.intra_latency if intra else cluster.inter_latency
    return ring_allreduce_s(members, sp.grad_bytes(), bw, lat)


def enumerate_candidates(
    table: LayerTable,
    cluster: Cluster,
    global_batch: int,
    schedules: tuple[str, ...] = PLAN_SCHEDULES,
    pp_degrees: tuple[int, ...] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[Candidate], dict[tuple[str, int], StagePlan]]:
    """Every structurally valid configuration (not yet evaluated) and the stage plans they use.

    ``pp_degrees``: only these pipeline degrees (default: every divisor of the device count).  Layouts of
    more than ``MAX_RANK_MICROBATCHES`` ranks x micro-batches are left out (the simulator's limit).
    ``progress``: called with a line before each partition is computed.
    """
    n_layers = len(table.layers)
    plans: dict[tuple[str, int], StagePlan] = {}
    out = []
    for pp in _divisors(cluster.devices):
        if pp_degrees is not None and pp not in pp_degrees:
            continue
        dp = cluster.devices // pp
        if global_batch % dp:
            continue
        per_pipe = global_batch // dp
        for name in schedules:
            if pp * stages_per_rank(name) > n_layers or (name == "dualpipe" and pp % 2):
                continue
            for mbs in _divisors(per_pipe):
                n = per_pipe // mbs
                if pp * n > MAX_RANK_MICROBATCHES or not schedule_fits(name, pp, n):
                    continue  # beyond the simulator's limit: a larger micro-batch serves the same batch
                if (name, pp) not in plans:
                    if progress is not None:
                        progress(f"partitioning {n_layers} layers for {name} pp={pp}")
                    plans[(name, pp)] = stage_plan(table, name, pp)
                out.append(Candidate(name, pp, dp, n, mbs, partition=plans[(name, pp)].partition.sizes))
    return out, plans


class _Evaluator:
    """Per-call caches of activation peaks (at the profiled size) and simulations."""

    def __init__(
        self, table: LayerTable, cluster: Cluster, plans: dict[tuple[str, int], StagePlan], state_multiplier: float
    ) -> None:
        self.table, self.cluster, self.plans, self.mult = table, cluster, plans, state_multiplier
        self.peaks: dict[tuple[str, int, int, str], list[float]] = {}
        self.sims: dict[tuple[object, ...], float] = {}

    def bound(self, c: Candidate) -> None:
        """Fill the lower bound, the all-reduce and the parameter state (no schedule built)."""
        sp = self.plans[(c.schedule, c.pp)]
        scale = c.microbatch_size / self.table.microbatch_size
        busy = sp.busy(c.microbatches, scale)
        c.compute_s = max(busy)
        # Fallback tables (unit "params") have no seconds to add link times to: compute only.
        c.allreduce_s = _allreduce(sp, c.dp, self.cluster) if self.table.unit == "s" else 0.0
        c.lower_bound_s = max(h * scale + x for h, x in zip(sp.head_f, busy, strict=True)) + c.allreduce_s
        c.param_state_bytes = max(sp.param_state(self.mult))

    def memory(self, c: Candidate) -> None:
        sp = self.plans[(c.schedule, c.pp)]
        key = (c.schedule, c.pp, _profile_microbatches(c.schedule, c.pp, c.microbatches), c.memory_policy)
        if key not in self.peaks:
            sizes = chunk_bytes(sp.activation, sp.inputs)
            self.peaks[key] = activation_peaks(build_schedule(*key[:3]), c.memory_policy, sizes, sp.model_stage)
        scale = c.microbatch_size / self.table.microbatch_size
        act = [x * scale for x in self.peaks[key]]  # the peaks are linear in the chunk sizes
        state = sp.param_state(self.mult)
        total = [a + p for a, p in zip(act, state, strict=True)]
        worst = max(range(len(total)), key=total.__getitem__)
        c.peak_memory_bytes, c.activation_bytes = total[worst], act[worst]
        c.activation_bytes_per_rank = tuple(act)
        c.feasible = c.peak_memory_bytes <= self.cluster.memory_bytes

    def simulate(self, c: Candidate) -> None:
        sp = self.plans[(c.schedule, c.pp)]
        scale = c.microbatch_size / self.table.microbatch_size
        # CostModel needs F, B > 0 and 0 < W < B per stage; keep free layers' zeros off those edges.
        eps = 1e-12 * max(sum(sp.f) + sum(sp.b), 1e-300)
        f = tuple(max(x * scale, eps) for x in sp.f)
        b = tuple(max(x * scale, 2 * eps) for x in sp.b)
        w = tuple(min(max(x * scale, eps * 0.5), bb * (1 - 1e-9)) for x, bb in zip(sp.w, b, strict=True))
        act = sp.boundary * scale
        key = (c.schedule, c.pp, c.microbatches, c.memory_policy, f, b, w, act)
        if key not in self.sims:
            cl = self.cluster
            comm = (
                CommModel(
                    latency=cl.intra_latency,
                    bandwidth=cl.intra_bandwidth,
                    activation_bytes=act,
                    ranks_per_node=cl.devices_per_node,
                    inter_latency=cl.inter_latency,
                    inter_bandwidth=cl.inter_bandwidth,
                )
                if self.table.unit == "s"
                else CommModel()
            )
            sched = build_schedule(c.schedule, c.pp, c.microbatches)
            costs = self._policy_costs(c, sched, CostModel(f=f, b=b, w=w), scale)
            self.sims[key] = float(simulate(sched, costs, comm).makespan)
        c.pipeline_s = self.sims[key]
        c.simulated_step_s = c.pipeline_s + c.allreduce_s

    def _policy_costs(self, c: Candidate, sched: object, costs: CostModel, scale: float) -> CostModel:
        """The memory model's time for the policy (recompute: an F more per backward; offload: unhidden reloads)."""
        if c.memory_policy == "keep":
            return costs
        sp = self.plans[(c.schedule, c.pp)]
        sizes = [ChunkBytes(x.saved * scale, x.kept * scale) for x in chunk_bytes(sp.activation, sp.inputs)]
        # A parameter-count table has no seconds for a host link: offload is then free, as links are.
        host = self.cluster.host_bandwidth if self.table.unit == "s" else math.inf
        per_ir = [sizes[m] for m in sp.model_stage]
        return policy_costs(sched, costs, c.memory_policy, per_ir, host_bandwidth=host)  # type: ignore[arg-type]


def _profile_microbatches(schedule: str, pp: int, microbatches: int) -> int:
    """Micro-batch count whose action order has the same activation peaks as ``microbatches``.

    The planned schedules' peaks stop changing once ``N >= 2 pp`` (memory.py; a test checks it), so a
    long step is profiled on the first valid count from ``4 pp`` on: cheaper, same numbers.
    """
    for n in range(4 * pp, microbatches):
        if schedule_fits(schedule, pp, n):
            return n
    return microbatches


def _check_inputs(table: LayerTable, cluster: Cluster, global_batch: int, state_multiplier: float) -> None:
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global batch must be an integer >= 1, got {global_batch!r}")
    if global_batch > MAX_GLOBAL_BATCH:
        raise ValueError(
            f"global batch {global_batch} is beyond what the planner serves (at most {MAX_GLOBAL_BATCH:,} samples)"
        )
    if cluster.devices > MAX_DEVICES:
        raise ValueError(f"{cluster.devices} devices are beyond what the planner serves (at most {MAX_DEVICES:,})")
    if not (math.isfinite(state_multiplier) and state_multiplier >= 1):
        raise ValueError(f"state multiplier must be a finite number >= 1, got {state_multiplier!r}")
    per_sample = 1.0 / table.microbatch_size
    for layer in table.layers:
        need = layer.param_bytes * state_multiplier + layer.activation_bytes * per_sample
        if need > cluster.memory_bytes:
            raise PlanError(
                f"layer {layer.name!r} fits on no device: its parameter state ({state_multiplier:g} x "
                f"{layer.param_bytes / _GB:.3g} GB) plus one sample's activations need {need / _GB:.3g} GB "
                f"> {cluster.memory_bytes / _GB:.3g} GB; raise the memory budget by at least "
                f"{(need - cluster.memory_bytes) / _GB:.3g} GB"
            )


def plan(
    table: LayerTable,
    cluster: Cluster,
    global_batch: int,
    *,
    schedules: tuple[str, ...] = PLAN_SCHEDULES,
    state_multiplier: float = 4.0,
    memory_policy: str = "auto",
    top: int = 10,
    pp_degrees: tuple[int, ...] | None = None,
    progress: Callable[[str], None] | None = None,
) -> PlanResult:
    """The fastest feasible plan and the ``top`` runners-up (PlanError when none fits).

    ``memory_policy``: one of PLAN_MEMORY_POLICIES for every stage, or ``"auto"`` to search them all
    (a tie in step time goes to the earlier policy: keep, then recompute, then offload).
    ``pp_degrees`` restricts the pipeline degrees searched (default: all divisors of the device count).
    ``progress``: called with a line at each stage of the search (partitions, simulations).
    """
    t0 = time.perf_counter()
    if memory_policy not in MEMORY_POLICIES:
        raise ValueError(f"memory policy {memory_policy!r} is not supported; choose {', '.join(MEMORY_POLICIES)}")
    policies = PLAN_MEMORY_POLICIES if memory_policy == "auto" else (memory_policy,)
    unknown = [s for s in schedules if s not in PLAN_SCHEDULES]
    if unknown or not schedules:
        raise ValueError(f"schedules must be among {', '.join(PLAN_SCHEDULES)}, got {', '.join(schedules) or 'none'}")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    _check_inputs(table, cluster, global_batch, state_multiplier)
    if pp_degrees is not None and not any(cluster.devices % p == 0 for p in pp_degrees):
        raise ValueError(f"no PP degree in {list(pp_degrees)} divides {cluster.devices} devices")
    layouts, plans = enumerate_candidates(table, cluster, global_batch, schedules, pp_degrees, progress)
    if not layouts:
        raise PlanError(_no_layout_message(table, cluster, global_batch))
    cands = [dataclasses.replace(c, memory_policy=p) for c in layouts for p in policies]
    ev = _Evaluator(table, cluster, plans, state_multiplier)
    for c in cands:
        ev.bound(c)
    cands.sort(key=lambda c: (c.lower_bound_s, c.pp, c.schedule, c.microbatch_size, _policy_rank(c)))
    feasible: list[Candidate] = []
    rejected: list[Candidate] = []
    keep_fits: dict[tuple[str, int, int], bool] = {}  # per layout, when keep is searched: does keep fit?
    for c in cands:  # a layout's keep comes before its other policies (same bound, policy last in the sort)
        cutoff = feasible[top - 1].simulated_step_s if len(feasible) >= top else math.inf
        if c.lower_bound_s >= cutoff:  # type: ignore[operator]
            break
        if c.param_state_bytes > cluster.memory_bytes:
            continue
        layout = (c.schedule, c.pp, c.microbatches)
        if c.memory_policy != "keep" and keep_fits.get(layout) is True:
            continue  # recompute and offload only add time: where keep fits they cannot win
        ev.memory(c)
        if c.memory_policy == "keep":
            keep_fits[layout] = c.feasible
        if not c.feasible:
            if layout not in keep_fits or c.memory_policy == "keep":
                rejected.append(c)  # "faster but over budget" lists a layout once, as keep
            continue
        if progress is not None and len(ev.sims) % 25 == 0:
            progress(f"simulated {len(ev.sims)} of up to {len(cands)} candidates")
        ev.simulate(c)
        feasible.append(c)
        feasible.sort(key=_rank_key)
    if not feasible:
        raise PlanError(_memory_message(cands, ev, cluster))
    best = feasible[0]
    faster_rejected = _faster_rejected(rejected, best, ev, top)
    shown = feasible[:top] + faster_rejected[:top]
    explanation = explain(best, feasible[1:top], faster_rejected, cluster.memory_bytes, table.unit)
    part = plans[(best.schedule, best.pp)].partition
    if not part.exact:
        explanation.append(
            f"partition: the slowest rank's load {part.max_load:.6g} is within {part.gap:.3%} of the optimum "
            f"(a bounded search: {len(table.layers)} layers are beyond the exact one)"
        )
    return PlanResult(
        best=best,
        candidates=shown,
        unit=table.unit,
        considered=len(cands),
        simulated=len(ev.sims),
        elapsed_s=time.perf_counter() - t0,
        explanation=explanation,
    )


def _faster_rejected(rejected: list[Candidate], best: Candidate, ev: _Evaluator, top: int) -> list[Candidate]:
    """Over-budget plans that would beat ``best`` (simulated only when their bound says they might)."""
    out: list[Candidate] = []
    for c in rejected:  # in lower-bound order
        if c.lower_bound_s >= best.simulated_step_s or len(out) >= top:  # type: ignore[operator]
            break
        ev.simulate(c)
        if c.simulated_step_s < best.simulated_step_s:  # type: ignore[operator]
            out.append(c)
    return sorted(out, key=_rank_key)


def _policy_rank(c: Candidate) -> int:
    return PLAN_MEMORY_POLICIES.index(c.memory_policy)


def _rank_key(c: Candidate) -> tuple[object, ...]:
    return (c.simulated_step_s, _policy_rank(c), c.peak_memory_bytes, c.pp, c.schedule, c.microbatch_size)


def _no_layout_message(table: LayerTable, cluster: Cluster, global_batch: int) -> str:
    n = cluster.devices
    ok_dp = [d for d in _divisors(n) if global_batch % d == 0 and n // d <= len(table.layers)]
    if not ok_dp:
        return (
            f"no pipeline layout: the global batch {global_batch} must be divisible by dp = devices / pp for some "
            f"pp <= {len(table.layers)} layers dividing {n} devices; use a global batch that is a multiple of "
            f"{n // min(n, _largest_divisor_at_most(n, len(table.layers)))}"
        )
    return (
        f"no schedule fits {len(table.layers)} layers on {n} devices with global batch {global_batch} (micro-batch "
        f"counts too small for the schedules' minimums); raise the global batch (e.g. to {global_batch * 4})"
    )


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in _divisors(n) if d <= cap)


def _memory_message(cands: list[Candidate], ev: _Evaluator, cluster: Cluster) -> str:
    """Least memory any candidate needs (smallest micro-batch of each layout: activations grow with it)."""
    smallest: dict[tuple[str, int, str], Candidate] = {}
    for c in cands:
        k = (c.schedule, c.pp, c.memory_policy)
        if k not in smallest or c.microbatch_size < smallest[k].microbatch_size:
            smallest[k] = c
    for c in smallest.values():
        ev.memory(c)
    need = min(smallest.values(), key=lambda c: c.peak_memory_bytes)
    budget = cluster.memory_bytes
    return (
        f"no plan fits {budget / _GB:.4g} GB per device: the least memory any plan needs is "
        f"{need.peak_memory_bytes / _GB:.4g} GB ({need.label}); raise the memory budget by at least "
        f"{(need.peak_memory_bytes - budget) / _GB:.4g} GB, or add devices"
    )
