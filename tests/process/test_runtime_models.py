"""Models as users write them, each checked against one process (tests/support/model_workers.py).

* Multi-input stages: a decoder LM whose blocks take ``(hidden, attention_mask)`` (bool mask, causal
  attention) plus int64 position ids and a None, some blocks returning a dict, trained 3 SGD steps through
  ``from_sequential`` under DualPipeV, 1F1B, ZB1P and DualPipe with boundary formats none and packed.
  The first step's losses are bit-exact (each micro-batch's forward runs the same ops on the same shapes
  as one process); parameters, and the later steps' losses, within 1e-6 relative (only the order in which
  micro-batch gradients are summed differs).
  The mask and ids reach the last stage bit-exact under every format (bf16 and fp8 too) and get no
  gradient (the gradient messages carry the hidden state's bytes only).
* Tied embedding/head across ranks: from_sequential (found by identity) on 1F1B, ZB1P, DualPipe, DualPipeV
  (2 ranks) and 1F1B, ZB1P (4 ranks), and build_stage_modules with ``tied_parameters=``: parameters after
  3 SGD steps within 1e-6 relative of one process's.
* 30 rows over 8 micro-batches: a one-line error naming both; with allow_uneven=True the gradients equal
  one process's full-batch mean-loss gradients (1e-5 relative: a different reduction tree over 30 rows).
  Labels with fewer rows than the inputs: a one-line error.
* PP 2 x DP 2: reduce_loss=True gives the global batch's mean loss on all 4 ranks.
* Adam state saved after 2 steps on 2 ranks, loaded on 4 ranks and in one process: the third step's
  parameters agree (and match an uninterrupted one-process run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import model_workers as mw
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dualpipe_kernels.runtime import StageLayers, spawn
from dualpipe_kernels.runtime.checkpoint import load_model

REL = 1e-6


def _ok(res: Any, key: str) -> Any:
    assert "error" not in res, f"{key}: {res['error']}"
    return res


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, rel: float = REL) -> None:
    assert sorted(got) == sorted(want), f"{what}: names {sorted(got)} != {sorted(want)}"
    for k, w in want.items():
        err = (got[k] - w).abs().max().item() / max(w.abs().max().item(), 1e-12)
        assert err <= rel, f"{what}: {k} differs by {err:.3g} relative"


def _params(ranks: list[dict[str, Any]], key: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in ranks:
        out.update(_ok(r[key], key)["params"])
    return out


def _losses(ranks: list[dict[str, Any]], key: str, steps: int) -> list[dict[int, torch.Tensor]]:
    return [{m: v for r in ranks for m, v in r[key]["losses"][s].items()} for s in range(steps)]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return spawn(mw.two_rank_cases, 2, timeout_s=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("schedule", ["dualpipev", "1f1b", "zb1p", "dualpipe"])
@pytest.mark.parametrize("fmt", ["none", "packed"])
def test_multi_input_blocks_train_as_one_process(two_ranks: list[dict[str, Any]], schedule: str, fmt: str) -> None:
    key = f"multi:{schedule}:{fmt}"
    ref = mw.reference_run(3, 8, 4, tied=False)
    for s, losses in enumerate(_losses(two_ranks, key, 3)):
        assert sorted(losses) == [0, 1, 2, 3]
        for m, v in losses.items():
            want = ref["losses"][s][m]
            if s == 0:  # the same weights: bit-exact
                assert torch.equal(v, want), f"{key}: step 0 micro-batch {m} loss not bit-exact"
            else:  # weights after SGD steps whose gradients were summed in another order
                assert abs(v.item() - want.item()) <= REL * abs(want.item()), f"{key}: step {s} mb {m}"
    _close(_params(two_ranks, key), ref["params"], key)
    travelled = [t for r in two_ranks for t in r[key]["travelled_exactly"]]
    assert travelled and all(travelled), f"{key}: mask / position ids did not reach the last stage exactly"
    if fmt == "none":
        # Gradient messages hold the hidden state only (2 rows x T x D fp32): no bytes for mask, ids, None, keys.
        for r in two_ranks:
            msgs, nbytes = r[key]["wire"]["gradients"]
            assert nbytes == msgs * 2 * mw.T * mw.D * 4, f"{key}: {msgs} gradient messages carried {nbytes} bytes"


@pytest.mark.timeout(700)
@pytest.mark.parametrize("key", ["lossy:dualpipev:bf16", "lossy:dualpipev:fp8", "lossy:1f1b:bf16", "lossy:1f1b:fp8"])
def test_masks_and_ids_travel_exactly_under_lossy_formats(two_ranks: list[dict[str, Any]], key: str) -> None:
    travelled = [t for r in two_ranks for t in _ok(r[key], key)["travelled_exactly"]]
    assert travelled and all(travelled)
    assert all(torch.isfinite(v).all() for r in two_ranks for v in r[key]["losses"][0].values())


@pytest.mark.timeout(700)
def test_uneven_batch_is_refused_or_weighted_by_rows(two_ranks: list[dict[str, Any]]) -> None:
    for r in two_ranks:
        msg = _ok(r["uneven:refused"], "uneven:refused")["refused"]
        assert msg is not None and "\n" not in msg and "30 rows" in msg and "8 micro-batches" in msg, msg
    grads: dict[str, torch.Tensor] = {}
    for r in two_ranks:
        grads.update(_ok(r["uneven:weighted"], "uneven:weighted")["grads"])
    _close(grads, mw.full_batch_grads(30, tied=False), "allow_uneven gradients", rel=1e-5)


@pytest.mark.timeout(700)
def test_labels_with_fewer_rows_than_inputs_are_refused(two_ranks: list[dict[str, Any]]) -> None:
    for r in two_ranks:
        msg = _ok(r["short_labels"], "short_labels")["refused"]
        assert msg is not None and "\n" not in msg and "6 rows" in msg and "8" in msg, msg


@pytest.mark.timeout(700)
@pytest.mark.parametrize(
    "key", ["tied:1f1b", "tied:zb1p", "tied:dualpipe", "tied:dualpipev", "tied_declared:1f1b", "tied_declared:dualpipe"]
)
def test_tied_embedding_and_head_on_two_ranks(two_ranks: list[dict[str, Any]], key: str) -> None:
    ref = mw.reference_run(3, 8, 4, tied=True)
    got = _params(two_ranks, key)
    assert "5.weight" not in got  # a tied parameter is named once, under its first name
    _close(got, ref["params"], key)


@pytest.mark.timeout(900)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the one-process checkpoint load
def test_four_ranks_tied_global_loss_and_optimizer_state(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "adam")
    ranks = spawn(mw.four_rank_cases, 4, ckpt, timeout_s=800)
    ref = mw.reference_run(3, 16, 8, tied=True)
    for key in ("tied4:1f1b", "tied4:zb1p", "tied4_declared:zb1p"):
        _close(_params(ranks, key), ref["params"], key)

    # PP 2 x DP 2: every rank holds the mean loss of the whole 16-row batch's 8 micro-batches.
    model = mw.make_model()
    full = StageLayers(list(model), 0)
    ids, mask, labels = mw.batch(7, 16)
    with torch.no_grad():
        per_mb = [
            mw.criterion(*full(i, m), lab).double()
            for i, m, lab in zip(ids.split(2), mask.split(2), labels.split(2), strict=True)
        ]
    want = torch.stack(per_mb).mean().float()
    losses = [_ok(r["ppdp:loss"], "ppdp:loss")["loss"] for r in ranks]
    assert all(torch.equal(v, losses[0]) for v in losses), losses
    assert abs(losses[0].item() - want.item()) <= REL * abs(want.item()), (losses[0], want)

    # Adam: saved on 2 ranks after 2 steps, loaded on 4 ranks and in one process; the third step agrees.
    for r in ranks:
        _ok(r["adam:save2"], "adam:save2")
    saved_keys = set(dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    assert "0.emb.weight" in saved_keys and "5.weight" not in saved_keys  # the tie, once under its first name
    assert "optim.state.0.emb.weight.exp_avg" in saved_keys and "optim.param_groups.0.emb.weight.lr" in saved_keys
    four = _params(ranks, "adam:load4")

    one = mw.make_model(seed=9, tied=True)
    opt = torch.optim.Adam(one.parameters(), lr=0.5)
    load_model(one, ckpt, optimizer=opt)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["eps"] == 1e-3  # restored from the checkpoint
    _adam_step(one, opt, 2)
    _close(four, mw.canonical_state(one), "Adam third step: 4 ranks vs one process")

    straight = mw.make_model(tied=True)
    opt2 = torch.optim.Adam(straight.parameters(), lr=0.01, eps=1e-3)
    for step in range(3):
        _adam_step(straight, opt2, step)
    _close(mw.canonical_state(one), mw.canonical_state(straight), "resumed vs uninterrupted", rel=1e-5)


def _adam_step(model: torch.nn.Sequential, opt: torch.optim.Optimizer, step: int) -> None:
    full = StageLayers(list(model), 0)
    ids, mask, labels = mw.batch(step, 8)
    for i, m, lab in zip(ids.split(2), mask.split(2), labels.split(2), strict=True):
        (mw.criterion(*full(i, m), lab) / 4).backward()
    opt.step()
    opt.zero_grad()
