"""Memory policies (keep / recompute / compress / offload) on 2 CPU ranks, every schedule.

One spawned group (``memory_workers.all_checks``) trains a dropout MLP for 2
steps under every policy and schedule, the small demo GPT for 50 steps with
keep and compress:fp8, and DualPipeV with offload for 50 steps.  Checks:

* recompute and offload: every loss and gradient bit-exact against keep (both
  steps, so the second step's arena is covered too), on every schedule and both
  zero-bubble modes; their peak resident saved bytes are below keep's;
* compress:fp8: the GPT's loss after 50 steps within 2% of keep's;
* offload over 50 steps: the host arena is allocated once, live tensors and
  the peak resident bytes are flat after the first steps, RSS grows < 4 MiB.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

SCHEDULES = ["dualpipe", "dualpipev", "1f1b", "gpipe", "interleaved1f1b", "zb1p", "zbv"]
EXACT = ["recompute", "offload"]
CASES = [(s, 4, p, "split") for s in SCHEDULES for p in ["keep", *EXACT]]
CASES += [("zbv", 4, p, "store") for p in ["keep", *EXACT]]
GPT_STEPS = 50
LONG_STEPS = 50


@pytest.fixture(scope="module")
def checks() -> list[dict[str, Any]]:
    from memory_workers import all_checks

    from dualpipe_kernels.runtime.launch import spawn

    return spawn(all_checks, 2, CASES, GPT_STEPS, LONG_STEPS, timeout_s=300.0)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("policy", EXACT)
@pytest.mark.parametrize(("schedule", "zb"), [(s, "split") for s in SCHEDULES] + [("zbv", "store")])
def test_bit_exact_against_keep(checks, schedule, policy, zb):
    for rank, res in enumerate(checks):
        got, ref = res["policies"][f"{schedule}/{policy}/{zb}"], res["policies"][f"{schedule}/keep/{zb}"]
        assert got["memory_policy"] == {s: policy for s in got["memory_policy"]}
        assert got["losses"] == ref["losses"], f"rank {rank}: losses differ"
        for step, (g, r) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
            for name in r:
                assert torch.equal(g[name], r[name]), f"rank {rank} step {step}: grad {name} differs"
        assert all(p > 0 for p in ref["peaks"])
        assert max(got["peaks"]) <= max(ref["peaks"]), f"rank {rank}: {policy} holds more than keep"


def test_recompute_and_offload_save_memory_on_dualpipev(checks):
    for res in checks:
        keep = max(res["policies"]["dualpipev/keep/split"]["peaks"])
        for policy in EXACT:
            assert max(res["policies"][f"dualpipev/{policy}/split"]["peaks"]) < keep


def test_compress_fp8_gpt_loss_within_2_percent(checks):
    gpt = checks[0]["gpt"]
    keep, fp8 = gpt["keep"], gpt["compress:fp8"]
    assert len(keep) == len(fp8) == GPT_STEPS
    assert keep[-1] < keep[0]  # it trains
    assert abs(fp8[-1] - keep[-1]) <= 0.02 * keep[-1]
    assert fp8 != keep  # lossy: the policy really ran


def test_offload_50_steps_one_arena_flat_memory(checks):
    for rank, res in enumerate(checks):
        run = res["long"]
        assert run["arena_allocations"] == 1, f"rank {rank}: arena allocated {run['arena_allocations']} times"
        assert run["arena_bytes"] > 0
        assert len(set(run["peaks"][2:])) == 1, f"rank {rank}: resident peak moves: {run['peaks']}"
        assert len(set(run["tensors"][10:])) == 1, f"rank {rank}: live tensors grow: {run['tensors']}"
        assert run["rss"][-1] - run["rss"][10] < 4 << 20
