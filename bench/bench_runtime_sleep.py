#!/usr/bin/env python
"""Runtime step time on sleep-timed stages vs the simulator, and the share of communication hidden.

Usage: python bench/bench_runtime_sleep.py [--ranks 4 --microbatches 16 --f 0.03 --b 0.06 --w 0.03
                                            --activation-bytes 1048576 --steps 5 --transport torch] [--json]

Also available as a bench suite: ``dualpipe_kernels.benchmarks.runtime_sleep``
(see that module for what is measured and against what).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dualpipe_kernels.benchmarks import runtime_sleep  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runtime_sleep.add_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--quick", action="store_true", help="few micro-batches and steps (smoke run)")
    args = p.parse_args(argv)
    try:
        result = runtime_sleep.run(args)
    except ValueError as e:
        print(f"bench_runtime_sleep: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(runtime_sleep.to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
