"""A synthetic transformer-like layer table, for benchmarking the planner without a model.

``python -m dualpipe_kernels.planner.synthetic OUT.json [--blocks N]`` writes an
embedding, ``N`` identical blocks and a heavier head (figures loosely shaped like
a 7B-parameter decoder at micro-batch 1, sequence 4096, bf16); the numbers are
illustrative inputs, not measurements.
"""

from __future__ import annotations

import argparse
import sys

from .layers import LayerCost, LayerTable, save_layers

__all__ = ["synthetic_table"]


def synthetic_table(blocks: int = 32) -> LayerTable:
    act_block, hidden = 0.25e9, 4096 * 4096 * 2.0  # saved bytes per block; one [T, D] bf16 boundary
    rows = [LayerCost("embedding", 0.002, 0.004, 0.002, 0.05e9, 0.26e9, hidden)]
    rows += [LayerCost(f"block{i}", 0.030, 0.060, 0.030, act_block, 0.40e9, hidden) for i in range(blocks)]
    rows.append(LayerCost("head", 0.045, 0.090, 0.045, 1.0e9, 0.26e9, 4096 * 32000 * 4.0))
    return LayerTable(tuple(rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dualpipe_kernels.planner.synthetic")
    p.add_argument("out")
    p.add_argument("--blocks", type=int, default=32)
    args = p.parse_args(argv)
    if args.blocks < 1:
        p.error("--blocks must be >= 1")
    save_layers(synthetic_table(args.blocks), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
