"""PP x DP on spawned CPU processes: gradients equal a single-process full-batch reference; reductions overlap.

PP=2 x DP=2 on 4 processes (gloo, float64, a ("dp", "pp") DeviceMesh).
DualPipeV: every stage's gradient is bit-exact (``torch.equal``) against the
sharded reference (each replica's micro-batches accumulated in order, then the
two replicas added: the all_reduce of 2 ranks is one IEEE addition, which
commutes).  Against the full-batch reference (one forward/backward of the
whole batch) the summation order differs (one GEMM over all rows instead of
a sum of per-micro-batch GEMMs, then the replica sum), so there the bound is
a cosine distance <= 1e-12.  DualPipe (mirror copies on both pipeline ranks):
one all_reduce over the 4 copies of a model stage (2 copies x 2 replicas)
replaces the DP sum and the mirror exchange; its summation order (gloo's ring,
micro-batches grouped by copy direction) differs from both references, so
cosine distance <= 1e-12 against both, and every copy of a model stage
bit-identical on all 4 ranks.
"""

from __future__ import annotations

import pytest
import torch
from ppdp_workers import TIED, full_batch_reference, ppdp_ranks, sharded_reference, tied_uneven_reference

from dualpipe_kernels.runtime import spawn

PP, DP, N = 2, 2, 4


def cosine_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return float(1 - 2 * (a * b).sum() / ((a * a).sum() + (b * b).sum()))


@pytest.fixture(scope="module")
def runs():
    configs = {
        "dualpipev": ("dualpipev", "sum", PP, DP, N),
        "dualpipe": ("dualpipe", "sum", PP, DP, N),
        "dualpipev/mean": ("dualpipev", "mean", PP, DP, N),
        "dualpipe/pp4": ("dualpipe", "sum", 4, 1, 8),
    }
    per_rank = spawn(ppdp_ranks, PP * DP, tuple(configs.values()), "auto", timeout_s=240)
    out = {label: [r[c] for r in per_rank] for label, c in configs.items()}
    out["errors"] = [r["errors"] for r in per_rank]
    out["tied_uneven"] = [r["tied_uneven"] for r in per_rank]
    return out


def _stages(results, num_model):
    """(rank, stage, model stage, grads) of every stage of every rank."""
    for r, res in enumerate(results):
        for s, grads in res["grads"].items():
            yield r, s, res["model_stage"][s], grads


@pytest.mark.timeout(400)
def test_dualpipev_grads_equal_full_batch_reference(runs):
    results = runs["dualpipev"]
    num_model = 2 * PP
    exact = sharded_reference(PP, DP, N, num_model)
    full = full_batch_reference(PP, DP, N, num_model)
    assert sorted((res["pp_rank"], res["dp_rank"]) for res in results) == [(p, d) for p in range(PP) for d in range(DP)]
    for r, s, m, grads in _stages(results, num_model):
        assert len(grads) == len(exact[m])
        for g, e, f in zip(grads, exact[m], full[m], strict=True):
            assert torch.equal(g, e), f"rank {r} stage {s}: not bit-exact against the sharded reference"
            assert cosine_distance(g, f) <= 1e-12, f"rank {r} stage {s}: {cosine_distance(g, f)}"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("label,pp,dp,n", [("dualpipe", PP, DP, N), ("dualpipe/pp4", 4, 1, 8)])
def test_dualpipe_mirror_and_dp_reduction(runs, label, pp, dp, n):
    results = runs[label]
    num_model = pp
    exact = sharded_reference(pp, dp, n, num_model)
    full = full_batch_reference(pp, dp, n, num_model)
    # Each copy's all_reduce spans both copies of all replicas (no separate mirror exchange).
    assert all(res["folds_mirrors"] and len(res["dp_reductions"]) == len(res["grads"]) for res in results)
    copies: dict[int, list[list[torch.Tensor]]] = {}
    for r, s, m, grads in _stages(results, num_model):
        copies.setdefault(m, []).append(grads)
        for g, e, f in zip(grads, exact[m], full[m], strict=True):
            assert cosine_distance(g, e) <= 1e-12 and cosine_distance(g, f) <= 1e-12, f"rank {r} stage {s}"
    for m, cs in copies.items():
        assert len(cs) == 2 * dp, f"model stage {m}: {len(cs)} copies"
        for c in cs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(cs[0], c, strict=True)), f"model stage {m}: copies differ"


@pytest.mark.timeout(400)
def test_dp_reduction_overlaps_the_schedule(runs):
    """Some stage's reduction is posted before the rank's last action starts, and never before its last W ends."""
    overlapped = 0
    for res in runs["dualpipev"]:
        timeline = res["timeline"]
        last_start = max(start for _r, _a, start, _e in timeline)
        for s, start, end in res["dp_reductions"]:
            label = res["last_grad_action"][s]
            ends = [e for _r, a, _s, e in timeline if a == label]
            assert ends and max(ends) <= start <= end, (s, label, start, ends)
            overlapped += start < last_start
        assert {s for s, _a, _b in res["dp_reductions"]} == set(res["grads"])
    assert overlapped >= PP * DP, "every rank should start one reduction before its last action"


@pytest.mark.timeout(400)
def test_dp_mean_divides_the_sum(runs):
    for mean, total in zip(runs["dualpipev/mean"], runs["dualpipev"], strict=True):
        for s, grads in mean["grads"].items():
            for g, t in zip(grads, total["grads"][s], strict=True):
                assert torch.equal(g, t / DP), f"rank {mean['pp_rank']} stage {s}"


@pytest.mark.timeout(400)
def test_bad_layouts_name_the_problem(runs):
    for errors in runs["errors"]:
        mesh_error, op_error = errors
        assert "'pp' and 'dp'" in mesh_error and "('world',)" in mesh_error, mesh_error
        assert "dp_op" in op_error and "'avg'" in op_error, op_error


@pytest.mark.timeout(400)
@pytest.mark.parametrize("label", ["dualpipev", "dualpipe"])
def test_no_sync_accumulates_then_reduces_once(runs, label):
    """A step under no_sync() reduces nothing; the next reduces the accumulated sum: twice one step's sum."""
    for res in runs[label]:
        assert res["no_sync_reductions"] == []
        for s, grads in res["accumulated"].items():
            for acc, one in zip(grads, res["grads"][s], strict=True):
                assert cosine_distance(acc, 2 * one) <= 1e-12, f"stage {s}"
                assert abs(float(acc.norm() / (2 * one).norm()) - 1) <= 1e-12, f"stage {s}"


@pytest.mark.timeout(400)
def test_from_mesh_with_tied_parameters_and_uneven_batches_trains_as_one_process(runs):
    """``from_mesh(..., model_options=ModelOptions(tied_parameters, allow_uneven=True))``, PP=2 x DP=2, 1F1B
    (the tied layers 0 and 6 on different pipeline ranks), 7 rows per replica in 4 micro-batches: two SGD
    steps of the global batch's mean loss match one process whose tied weight is one Parameter (gradients and
    weights within cosine distance 1e-12: the sums run in another order; the float32 step loss within one
    ulp), and both copies of the tied weight stay bit-identical."""
    ref = tied_uneven_reference(DP)
    results = runs["tied_uneven"]
    assert all(r["microbatch_rows"] == [2, 2, 2, 1] for r in results)  # the batch is uneven indeed
    seen: set[str] = set()
    for r in results:
        for got, want in zip(r["losses"], ref["losses"], strict=True):
            # StepResult.loss is float32 (the float64 mean rounded): within one float32 ulp
            assert abs(got - want) <= 2**-23 * abs(want), (r["losses"], ref["losses"])
        for name, grad in r["grads"].items():
            seen.add(name)
            assert cosine_distance(grad, ref["grads"][name]) <= 1e-12, name
            assert abs(float(grad.norm() / ref["grads"][name].norm()) - 1) <= 1e-12, name
            assert cosine_distance(r["params"][name], ref["params"][name]) <= 1e-12, name
    assert seen == set(ref["grads"])  # every parameter of the model, the tied weight under both names
    holders = {name: r for r in results for name in r["grads"] if name in TIED}
    a, b = (holders[n] for n in TIED)
    assert torch.equal(a["grads"][TIED[0]], b["grads"][TIED[1]]), "the two copies of the tied weight differ"
    assert torch.equal(a["params"][TIED[0]], b["params"][TIED[1]])
