"""The pack kernels' host path per call, without a GPU: ``python bench/pack_host_us.py``.

Runs ``pack`` / ``unpack`` through the Triton backend on CPU tensors
(``TRITON_INTERPRET=1``) with the kernel launch replaced by a no-op, so what is
timed is this library's own host work per call.  The same tensors and ``out``
every call: after the first (checked) call each one replays its prepared launch
(one look-up keyed on the arguments; docs/kernels.md, "Host work per call").
On a GPU that work comes on top of Triton's launch and, for tensors at new
addresses, the table's staging and copy.  Median of five
rounds of 2000 calls, 1 / 8 / 64 tensors of 1024 fp32 each, lossless format, the
same tensors every call (as ``bench kernels`` calls it).
"""

from __future__ import annotations

import os
import statistics
import time

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import torch  # noqa: E402

from dualpipe_kernels.kernels import pack, unpack  # noqa: E402
from dualpipe_kernels.kernels.layout import LayoutCache  # noqa: E402
from dualpipe_kernels.kernels.pack_triton import host_only  # noqa: E402


def _us_per_call(fn: object, calls: int = 2000, rounds: int = 5) -> float:
    for _ in range(50):
        fn()  # type: ignore[operator]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()  # type: ignore[operator]
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times) * 1e6


def main() -> None:
    print("tensors  pack host us  unpack host us")
    with host_only():  # every host step of a call, no kernel launch
        for n in (1, 8, 64):
            p, u = _row([torch.randn(1024) for _ in range(n)])
            print(f"{n:7d}  {p:12.1f}  {u:14.1f}")


def _row(ts: list[torch.Tensor]) -> tuple[float, float]:
    """(pack, unpack) host microseconds per call for ``ts``."""
    cache = LayoutCache()
    buf, layout = pack(ts, None, cache=cache, backend="torch")
    outs = [torch.empty_like(t) for t in ts]
    p = _us_per_call(lambda: pack(ts, None, out=buf, cache=cache, backend="triton"))
    u = _us_per_call(lambda: unpack(buf, layout, out=outs, backend="triton"))
    return p, u


if __name__ == "__main__":
    main()
