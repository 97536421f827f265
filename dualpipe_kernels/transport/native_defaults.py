"""The native transport's defaults that follow the host: how long a waiter spins and how large a message
the posting thread copies itself, by whether every local rank has a CPU of its own."""

from __future__ import annotations

import os

__all__ = [
    "SPIN_US_OWN_CORE",
    "SPIN_US_SHARED",
    "INLINE_MAX_BYTES_OWN_CORE",
    "cpus_shared",
    "default_spin_us",
    "default_inline_max_bytes",
]

#: A waiter's spin before it sleeps when every local rank has a CPU, and when ranks share CPUs.
SPIN_US_OWN_CORE, SPIN_US_SHARED = 500.0, 50.0
#: Sends up to this size are copied by the posting thread when every local rank has a CPU
#: (:func:`default_inline_max_bytes`).
INLINE_MAX_BYTES_OWN_CORE = 64 * 1024


def cpus_shared(group_size: int) -> bool:
    """True when this host has fewer CPUs than local ranks (``LOCAL_WORLD_SIZE`` where a launcher set it,
    else ``group_size``)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", group_size))
    except ValueError:
        local = group_size
    return (os.cpu_count() or 1) < local


def default_spin_us(group_size: int) -> float:
    """``NativeTransport``'s default ``spin_us``: :data:`SPIN_US_OWN_CORE` when this host's CPUs are at least
    its ranks (:func:`cpus_shared`), else :data:`SPIN_US_SHARED`."""
    return SPIN_US_SHARED if cpus_shared(group_size) else SPIN_US_OWN_CORE


def default_inline_max_bytes(group_size: int, slot_bytes: int) -> int:
    """``NativeTransport``'s default ``inline_max_bytes``: the largest message the posting thread copies
    into the ring itself (and the waiting thread out of it), instead of handing it to the engine's worker.

    :data:`INLINE_MAX_BYTES_OWN_CORE` (capped at a slot) when every local rank has a CPU: a larger message
    goes to the worker, which copies it (or posts it for the receiver to read in place, single copy) while
    the rank works on.  A whole slot when ranks share CPUs (:func:`cpus_shared`): a hand-off then costs a
    wake-up on each side that waits for a CPU.  Measured on 2 CPUs, DualPipeV 4 x 16 of 1/2/1 ms sleep
    chunks with 256 KiB activations, the two settings taking turns step by step in the same processes: 5-6%
    shorter steps with a slot (and 18-30% less CPU per rank); with two ranks, a CPU each, 2% longer.
    """
    return slot_bytes if cpus_shared(group_size) else min(INLINE_MAX_BYTES_OWN_CORE, slot_bytes)
