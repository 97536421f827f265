"""Every schedule on spawned CPU processes (gloo, fp32) is bit-exact against the same model in one process.

Per configuration (``toy_models.configs_for_world``, toy Linear+tanh stages):
a training step's per-micro-batch losses and every parameter gradient equal
(``torch.equal``) those of a single-process run over the same micro-batches
(forward and backward per micro-batch, in order); an inference step under
``torch.no_grad()`` returns bit-equal losses and outputs.  DualPipe holds two
copies of each model stage: each copy's own gradient is bit-exact against a
reference with the copies kept apart, and the two summed (by the runtime's
``sync_mirror_grads`` or, for compat, by the test as reference users do) are
within 1 - 2 sum(xy) / (sum(xx) + sum(yy)) < 1e-13 (float64) of one shared
module's gradient.  Native API and compat, "torch" and "native" transports.
"""

from __future__ import annotations

import pytest
from runtime_checks import check_config
from toy_models import configs_for_world

CONFIGS = [c for world in (1, 2, 3, 4) for c in configs_for_world(world) if c.model == "toy"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.key)
def test_bit_exact_against_single_process(cfg, spawned_runs):
    errors = check_config(cfg, spawned_runs(cfg))
    assert not errors, f"{cfg.key}:\n" + "\n".join(errors)


def test_matrix_covers_the_issue():
    """DualPipeV 1-4 ranks, DualPipe 2 and 4, 1F1B/GPipe/ZB1P/interleaved on 2 and 4, native transport, compat."""
    have = {(c.schedule, c.ranks, c.api, c.transport) for c in CONFIGS}
    for r in (1, 2, 3, 4):
        assert ("dualpipev", r, "native", "torch") in have and ("dualpipev", r, "compat", "torch") in have
    for r in (2, 4):
        assert ("dualpipe", r, "native", "torch") in have and ("dualpipe", r, "compat", "torch") in have
        assert ("dualpipev", r, "native", "native") in have
        for name in ("1f1b", "gpipe", "zb1p", "interleaved1f1b"):
            assert (name, r, "native", "torch") in have
    assert ("1f1b", 2, "native", "native") in have
