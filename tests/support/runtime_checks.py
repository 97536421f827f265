"""Checks the parent runs on what the ranks of the shared configuration runs returned (``rank_configs``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from toy_models import COS_TOL, RunConfig, Tensors, build_schedule_for, cos_diff


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))


def _describe(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        return f"tensor{tuple(a.shape)} {a.dtype} {a.flatten()[:4].tolist()}"
    if a is None:
        return "None"
    return "(" + ", ".join(_describe(x) for x in a) + ")"


def _expect_same(what: str, got: Any, want: Any, errors: list[str]) -> None:
    if not _same(got, want):
        errors.append(f"{what}: got {_describe(got)}, want {_describe(want)}")


def _count_actions(schedule: Any, rank: int) -> tuple[int, int]:
    """(OVERLAP_F_B pairs, backward halves that are I and defer their W) in ``rank``'s compute actions.

    An I directly followed by its own W in the lowered program runs as one full B (runtime/loop.py
    ``fused_input_weight``): its weight gradients are computed at once, not deferred, so it is not counted.
    """
    from dualpipe_kernels.runtime.loop import fused_input_weight
    from dualpipe_kernels.schedules.lowering import lower_program
    from dualpipe_kernels.schedules.validate import validate

    pairs = inputs_grad = 0
    for a in schedule.compute_actions(rank):
        pairs += a.type.value == "OVERLAP_F_B"
        inputs_grad += sum(c.type.value == "I" for c in a.computes())
    program = validate(schedule)
    lowered = (program if schedule.lowered else lower_program(program)).schedule
    return pairs, inputs_grad - len(fused_input_weight(lowered.actions[rank]))


def _gather(outs: Sequence[Tensors]) -> Any:
    cat = tuple(torch.cat(parts, dim=0) for parts in zip(*outs, strict=True))
    return cat[0] if len(cat) == 1 else cat


def check_config(cfg: RunConfig, results: Sequence[dict[str, Any]]) -> list[str]:
    """Compare every rank's results for ``cfg`` with the reference; return the mismatches (empty: all good)."""
    got = [res.get(cfg.key, {"error": "missing"}) for res in results]
    errors = [f"process {r}: {res['error']}" for r, res in enumerate(got) if "error" in res]
    if errors:
        return errors
    ranks: list[dict[str, Any]] = [{} for _ in range(cfg.ranks)]  # indexed by pipeline rank
    for res in got:
        if not res.get("skipped"):
            ranks[res["pp_rank"]] = res
    after = got[0].get("after_failure")
    note = f" (NB: ran after the failed configuration {after}; may be collateral)" if after else ""
    ref = results[0]["ref:" + cfg.key]
    if "error" in ref:
        return [f"reference failed: {ref['error']}"]
    schedule = build_schedule_for(cfg)
    if cfg.api == "compat":
        _check_compat(cfg, schedule, ranks, ref, errors)
    else:
        _check_native(cfg, schedule, ranks, ref, errors)
    _check_grads(cfg, schedule, ranks, ref, errors)
    if cfg.model == "example":
        for r, res in enumerate(ranks):
            pairs, n_i = _count_actions(schedule, r)
            if res["fb_calls"] != pairs:
                errors.append(
                    f"rank {r}: overlapped_forward_backward ran {res['fb_calls']} times, schedule has {pairs}"
                )
            if res["deferred_w"] != 2 * n_i:
                errors.append(
                    f"rank {r}: WeightGradStore got {res['deferred_w']} deferred weight grads, "
                    f"want 2 per I action = {2 * n_i}"
                )
    return [e + note for e in errors]


def _check_native(cfg: RunConfig, schedule: Any, ranks: Sequence[dict], ref: dict, errors: list[str]) -> None:
    n = cfg.microbatches
    for phase, loss_key, out_key in (("train", "losses", "train_outputs"), ("infer", "infer_losses", "infer_outputs")):
        ref_losses = ref["losses"] if phase == "train" else ref["infer_losses"]
        got: dict[int, torch.Tensor] = {}
        for r, res in enumerate(ranks):
            for mb, loss in res[loss_key].items():
                want_rank = schedule.stage_to_rank[schedule.path(mb)[-1]]
                if want_rank != r:
                    errors.append(
                        f"{phase}: loss of micro-batch {mb} returned on rank {r}, its loss stage is on {want_rank}"
                    )
                got[mb] = loss
        if sorted(got) != list(range(n)):
            errors.append(f"{phase}: losses returned for micro-batches {sorted(got)}, want 0..{n - 1}")
        for mb in sorted(got):
            _expect_same(f"{phase} loss of micro-batch {mb}", got[mb], ref_losses[mb], errors)
        if phase == "train" and not cfg.train_outputs:
            continue
        outs: dict[int, Tensors] = {}
        for res in ranks:
            outs.update(res[out_key] or {})
        if sorted(outs) != list(range(n)):
            errors.append(f"{phase}: outputs returned for micro-batches {sorted(outs)}, want 0..{n - 1}")
        for mb in sorted(outs):
            _expect_same(f"{phase} outputs of micro-batch {mb}", tuple(outs[mb]), ref["infer_outputs"][mb], errors)


def _compat_mbs(cfg: RunConfig, rank: int) -> list[int] | None:
    """The micro-batches whose loss/outputs ``step`` returns on ``rank`` (None: it returns nothing)."""
    n, r = cfg.microbatches, cfg.ranks
    if cfg.schedule == "dualpipev":
        return list(range(n)) if rank == 0 else None
    if rank == 0:
        return list(range(n // 2, n))
    if rank == r - 1:
        return list(range(n // 2))
    return None


def _check_compat(cfg: RunConfig, schedule: Any, ranks: Sequence[dict], ref: dict, errors: list[str]) -> None:
    for r, res in enumerate(ranks):
        mbs = _compat_mbs(cfg, r)
        for phase, lk, ok_, rl in (
            ("train", "loss", "outputs", "losses"),
            ("infer", "infer_loss", "infer_outputs", "infer_losses"),
        ):
            want_loss = None if mbs is None else torch.stack([ref[rl][m] for m in mbs])
            _expect_same(f"rank {r} {phase} loss", res[lk], want_loss, errors)
            with_outputs = phase == "infer" or cfg.train_outputs
            want_out = None if mbs is None or not with_outputs else _gather([ref["infer_outputs"][m] for m in mbs])
            _expect_same(f"rank {r} {phase} outputs", res[ok_], want_out, errors)


def _check_grads(cfg: RunConfig, schedule: Any, ranks: Sequence[dict], ref: dict, errors: list[str]) -> None:
    """Per-copy grads bit-exact; DualPipe's mirror copies summed within COS_TOL of the shared-model reference."""
    grads: dict[int, dict[str, torch.Tensor | None]] = {}
    for r, res in enumerate(ranks):
        for s, g in res["grads"].items():
            if schedule.stage_to_rank[s] != r:
                errors.append(f"rank {r} returned grads for stage {s}, which lives on rank {schedule.stage_to_rank[s]}")
            grads[s] = g
    if sorted(grads) != list(range(schedule.num_stages)):
        errors.append(f"grads returned for stages {sorted(grads)}, want 0..{schedule.num_stages - 1}")
        return
    mirrored = "shared_grads" in ref
    synced = mirrored and cfg.api == "native"  # Pipeline's sync_mirror_grads=True default; compat leaves copies alone
    copies: dict[int, list[int]] = {}
    for s in range(schedule.num_stages):
        copies.setdefault(schedule.model_stage[s], []).append(s)
    for ms, stages in copies.items():
        if not synced:
            for s in stages:
                for name, want in ref["grads"][s].items():
                    _expect_same(f"grad of stage {s} {name}", grads[s].get(name), want, errors)
        if not mirrored:
            continue
        for name, want in ref["shared_grads"][ms].items():
            got = [grads[s].get(name) for s in stages]
            if any(g is None for g in got) or want is None:
                if not all(g is None for g in got) or want is not None:
                    errors.append(f"model stage {ms} {name}: None-ness differs: copies {got}, shared reference {want}")
                continue
            total = got[0] if synced else got[0] + got[1]
            if synced and not torch.equal(got[0], got[1]):
                errors.append(f"model stage {ms} {name}: the two synced copies differ (stages {stages})")
            d = cos_diff(total, want)
            if not d < COS_TOL:
                errors.append(
                    f"model stage {ms} {name}: summed copies vs shared reference: cos diff {d:.3e} >= {COS_TOL}"
                )
