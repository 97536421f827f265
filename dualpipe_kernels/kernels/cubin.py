"""What a compiled CUDA kernel asks of a multiprocessor, read from its cubin (no GPU, no CUDA tool needed).

Triton builds a kernel's cubin for a GPU target without a device
(``triton.compile(..., target=GPUTarget("cuda", 90, 32))``); the registers a
thread holds decide how many programs share a multiprocessor, and so whether a
grid sized for that many keeps the memory system busy.  The pack kernels' tests
hold their variants to bounds read here.
"""

from __future__ import annotations

__all__ = ["registers_per_thread", "fit_per_sm"]

#: registers in a multiprocessor, threads a multiprocessor holds at most (sm_80 and sm_90: A100, H100,
#: H200; sm_86 and sm_89 hold 1536 threads: pass ``max_threads``)
SM_REGISTERS, SM_THREADS = 65536, 2048


def registers_per_thread(cubin: bytes) -> int:
    """Registers per thread of the (one) kernel in a CUDA ``cubin``: its ``.nv.info`` REGCOUNT attribute, what
    ``cuobjdump --dump-resource-usage`` prints as REG.  Reads the ELF itself, so it needs no CUDA tool."""
    import struct

    if cubin[:5] != b"\x7fELF\x02":
        raise ValueError("registers_per_thread: not a 64-bit ELF cubin")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]
    found = []
    for sec in sections:
        name_at = names + sec[0]
        if not cubin[name_at : cubin.index(b"\0", name_at)].startswith(b".nv.info"):
            continue
        pos, end = sec[4], sec[4] + sec[5]
        while pos < end:  # attributes: format byte, attribute byte, then a 2-byte value or a sized body
            fmt, attr = cubin[pos], cubin[pos + 1]
            if fmt == 0x04:  # sized: u16 size, body (REGCOUNT 0x2f: u32 function symbol, u32 registers)
                (size,) = struct.unpack_from("<H", cubin, pos + 2)
                if attr == 0x2F:
                    found.append(struct.unpack_from("<II", cubin, pos + 4)[1])
                pos += 4 + size
            else:
                pos += 4
    if len(found) != 1:
        raise ValueError(f"registers_per_thread: expected one REGCOUNT attribute, found {len(found)}")
    return found[0]


def fit_per_sm(registers: int, num_warps: int, max_threads: int = SM_THREADS) -> int:
    """Programs of ``num_warps`` warps that fit one multiprocessor at ``registers`` per thread (registers are
    given to a warp in units of 256; at most ``max_threads`` threads)."""
    per_warp = -(-registers * 32 // 256) * 256
    return max(1, min(SM_REGISTERS // (per_warp * num_warps), max_threads // (32 * num_warps)))
