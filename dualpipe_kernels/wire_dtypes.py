"""The dtype codes carried on the wire: one table for every message format of the package.

Stage-boundary metadata (``runtime/boundary/header.py``), packed-buffer layouts
(``kernels/layout.py``) and the native engine's message headers
(``transport/native.py``) all name a dtype by its index here.  Both ends of a
message run the same package, so the codes only need to agree within one
version; still, append only, so logs and traces stay readable across versions.
"""

from __future__ import annotations

import torch

__all__ = ["WIRE_DTYPES", "WIRE_DTYPE_CODE"]

#: dtypes by code (index = code)
WIRE_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.complex128,
)
#: dtype -> code
WIRE_DTYPE_CODE: dict[torch.dtype, int] = {d: i for i, d in enumerate(WIRE_DTYPES)}
