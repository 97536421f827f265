"""The multi-node recipe on one host: two ``torchrun --nnodes 2 --nproc-per-node 2`` commands (node ranks 0 and 1).

``python/train_gpt_dualpipev.py --dp 2`` runs DualPipeV PP=2 x DP=2: the
replicas of a pipeline rank share a node, the two pipeline ranks of a replica
sit on different nodes.  Each rank saves its gradients after step 1; they must
equal a single-process reference on the full global batch:

* bit-exact (``torch.equal``) against each replica's micro-batches run in
  order on a fresh model (each a mean over its micro-batches: scale_grads), the
  two replicas' gradients then averaged (dp_op "mean": an all_reduce of 2 ranks
  is one IEEE addition, which commutes, and halving is exact);
* cosine distance <= 1e-12 against all 8 micro-batches accumulated in order in
  one process: that sums in another order ((m0+...+m3)+(m4+...+m7) against one
  running sum), so float32 rounding differs in the last bits.

Transport: torchrun's node rank makes the two nodes different hosts for the
runtime (transport/hosts.py), so each pipeline peer is on the other node and
the activations go through torch.distributed (gloo), not shared memory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dualpipe_kernels.demo_data import SyntheticTokens
from dualpipe_kernels.models.gpt import GPTConfig, gpt_loss, stage_modules_for
from dualpipe_kernels.runtime import free_port, run_reference
from dualpipe_kernels.schedules.generators import build_schedule

#: the longest tests of the suite (leave them out with -m "not slow")
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "python", "train_gpt_dualpipev.py")
PP, DP, N, BS = 2, 2, 4, 1
ARGS = ["--dp", str(DP), "--steps", "1", "--seq-len", "8", "--d-model", "16", "--batch-size", str(BS)]
ARGS += ["--microbatches", str(N), "--device", "cpu", "--transport", "auto", "--seed", "0"]
TIMEOUT_S = 300


def _launch(tmp: str) -> list[tuple[int | None, str]]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
        cmd += ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        cmd += [SCRIPT, *ARGS, "--dump-grads", tmp]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        )
    out: list[tuple[int | None, str]] = []
    deadline = time.monotonic() + TIMEOUT_S  # one budget for both: a node whose peer died waits in rendezvous
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the torchrun we started and its workers (own session)
            text, _ = p.communicate()
        out.append((p.returncode, text.decode(errors="replace")))
    return out


def _reference(dp_shards: list[int]) -> dict[int, list[torch.Tensor]]:
    """Stage -> gradients of one process running the micro-batches of the given replicas, in order.

    One intra-op thread, as each torchrun worker has (OMP_NUM_THREADS=1): a
    GEMM's blocking, hence its rounding, depends on the thread count.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_1t(dp_shards)
    finally:
        torch.set_num_threads(threads)


def _reference_1t(dp_shards: list[int]) -> dict[int, list[torch.Tensor]]:
    cfg = GPTConfig(seq_len=8, d_model=16, n_layers=max(4, 2 * PP))
    ids, targets = SyntheticTokens(cfg.vocab_size, cfg.seq_len, 0).batch(0, DP * N * BS)
    rows = torch.cat([torch.arange(d * N * BS, (d + 1) * N * BS) for d in dp_shards])
    schedule = build_schedule("dualpipev", PP, N * len(dp_shards))
    modules = stage_modules_for(schedule, cfg, 0)
    run_reference(modules, schedule, (ids[rows],), (targets[rows],), gpt_loss)
    return {s: [p.grad.clone() for p in m.parameters()] for s, m in modules.items()}


def _cosine_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return float(1 - 2 * (a * b).sum() / ((a * a).sum() + (b * b).sum()))


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_pp_dp_under_two_torchrun_nodes(tmp_path):
    runs = _launch(str(tmp_path))
    for node, (rc, text) in enumerate(runs):
        assert rc == 0, f"torchrun node {node} exited {rc}:\n{text[-3000:]}"
    dumps = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(PP * DP)]
    assert [(d["pp_rank"], d["dp_rank"]) for d in dumps] == [(r // DP, r % DP) for r in range(PP * DP)]
    for d in dumps:
        # The pipeline peer is on the other node: no shared-memory peer, torch.distributed carries the activations.
        assert d["transport"] == "NativeTransport" and d["native_peers"] == [], d
    per_replica = [_reference([d]) for d in range(DP)]
    # scale_grads=True (each replica: mean over its micro-batches) and dp_op "mean" (its default then):
    # (a + b) / 2, exact in floating point, equals the global batch's mean-loss gradients up to summation order.
    exact = {s: [(a + b) / DP for a, b in zip(*(r[s] for r in per_replica), strict=True)] for s in per_replica[0]}
    full = _reference(list(range(DP)))
    for d in dumps:
        for s, grads in d["grads"].items():
            for i, g in enumerate(grads):
                assert torch.equal(g, exact[s][i]), f"rank {d['rank']} stage {s} param {i}: not bit-exact"
                dist_ = _cosine_distance(g, full[s][i])
                assert dist_ <= 1e-12, f"rank {d['rank']} stage {s} param {i}: cosine distance {dist_}"
