"""Rank function of the MoE bench tests (module level so spawned workers import it by name)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def native_vs_gloo_all_to_all(rank: int, world: int, rows: int, cols: int, pad_elems: int) -> dict[str, Any]:
    """The same exchanges through the native and the gloo ExpertGroup, forward and backward interleaved as in a
    pair (two in flight at once), with no padding and then ``pad_elems`` per peer block; returns what each
    received and what a true all_to_all must deliver."""
    from dualpipe_kernels.benchmarks.moe_block import ExpertGroup, run_phases
    from dualpipe_kernels.transport.native import NativeTransport

    g_f, g_b = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    native = ExpertGroup(g_f, g_b, world, native=NativeTransport(g_f))
    gloo = ExpertGroup(g_f, g_b, world)

    def tokens(seed: int, src: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=torch.Generator().manual_seed(100 * seed + src))

    def expected(seed: int) -> torch.Tensor:  # block r of every source's tokens lands at rank r, by source
        per = rows // world
        return torch.cat([tokens(seed, src)[rank * per : (rank + 1) * per] for src in range(world)])

    out: dict[str, Any] = {"expected": [expected(s) for s in range(4)], "backend": native.backend}
    try:
        for name, group in (("native", native), ("gloo", gloo)):
            got = []
            for s, pad in ((0, 0), (2, pad_elems)):  # a forward and a backward exchange in flight together
                group.pad_elems = pad
                got += run_phases(group.post(tokens(s, rank), False), group.post(tokens(s + 1, rank), True))
            out[name] = got
    finally:
        native.close()
        gloo.close()
    return out
