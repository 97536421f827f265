"""The torch transport over gloo with its two directions on two process groups (``split_directions``).

Three ranks exchange a distinct tensor between every ordered pair, on several
tags, with receives posted before and after the sends: transfers to a higher
rank travel over the transport's group, transfers to a lower rank over its
second gloo group, and each must still pair up with the receive of the same
tag.  A second transport on the same group, built after the first one closed
(as a process that builds one Pipeline after another does), shares the second
group and exchanges the same way; so does a transport with the split turned
off.  ``ordered=True`` refuses the split.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dualpipe_kernels.runtime import spawn
from dualpipe_kernels.transport.torch_dist import TorchDistTransport

TAGS = (3, 11, 12)


def _payload(src: int, dst: int, tag: int) -> torch.Tensor:
    return torch.arange(16 + tag, dtype=torch.float32) + 1000 * src + 100 * dst + 10000 * tag


def _exchange(t: TorchDistTransport, rank: int, world: int) -> list[str]:
    """Every ordered pair, every tag; half the receives posted before the sends, half after a pause."""
    peers = [p for p in range(world) if p != rank]
    bufs = {(p, tag): torch.empty(16 + tag) for p in peers for tag in TAGS}
    early = [(p, tag) for p in peers for tag in TAGS if tag != TAGS[-1]]
    handles = {k: t.irecv(bufs[k], k[0], k[1], f"from {k[0]} tag {k[1]}") for k in early}
    sends = [t.isend(_payload(rank, p, tag), p, tag, f"to {p} tag {tag}") for p in peers for tag in reversed(TAGS)]
    time.sleep(0.2)
    for k in bufs:
        if k not in handles:
            handles[k] = t.irecv(bufs[k], k[0], k[1], f"from {k[0]} tag {k[1]}")
    for h in sends:
        h.wait()
    errors = []
    for (p, tag), h in handles.items():
        h.wait()
        if not torch.equal(bufs[(p, tag)], _payload(p, rank, tag)):
            errors.append(f"rank {rank}: message from {p} on tag {tag} has wrong data")
    return errors


def _in_order_exchange(t: Any, rank: int, world: int) -> list[str]:
    """Every ordered pair, four messages of different sizes each way, received in the order they are sent
    (the tags are ignored: the posting order pairs them, as over NCCL)."""
    peers = [p for p in range(world) if p != rank]
    bufs = {(p, k): torch.empty(16 + k) for p in peers for k in range(4)}
    handles = {key: t.irecv(buf, key[0], 999, f"from {key[0]} #{key[1]}") for key, buf in bufs.items()}
    sends = [t.isend(_payload(rank, p, k), p, 999, f"to {p} #{k}") for p in peers for k in range(4)]
    errors = []
    for h in sends:
        h.wait()
    for (p, k), h in handles.items():
        h.wait()
        if not torch.equal(bufs[(p, k)], _payload(p, rank, k)):
            errors.append(f"rank {rank}: in-order message #{k} from {p} has wrong data")
    return errors


def _worker(rank: int, world: int) -> list[str]:
    errors: list[str] = []
    split = TorchDistTransport(timeout_s=30.0)
    down = split._down
    if down is None or down.size() != world or down.rank() != rank:
        errors.append(f"rank {rank}: no second group of every rank numbered as the first ({down})")
    errors += _exchange(split, rank, world)
    split.close()
    again = TorchDistTransport(timeout_s=30.0)
    if again._down is not down:
        errors.append(f"rank {rank}: a second transport on the group made another second group")
    errors += _exchange(again, rank, world)
    again.close()
    plain = TorchDistTransport(timeout_s=30.0, split_directions=False)
    if plain._down is not None:
        errors.append(f"rank {rank}: split_directions=False made a second group")
    errors += _exchange(plain, rank, world)
    plain.close()
    # Ordered over gloo (NCCL's pairing, for tests) splits the directions of its in-order channels too.
    ordered = TorchDistTransport(timeout_s=30.0, ordered=True)
    if ordered._down is not down:
        errors.append(f"rank {rank}: ordered=True did not share the group's second group")
    errors += _in_order_exchange(ordered.in_order(0), rank, world)
    ordered.close()
    return errors


def test_both_directions_pair_up_with_and_without_the_split() -> None:
    assert spawn(_worker, 3, timeout_s=120) == [[], [], []]


class _DoneWork:
    """A finished transfer: its wait returns at once (what gloo's work does once the data is in)."""

    def wait(self, timeout: object = None) -> bool:
        return True


def test_a_waiter_is_idle_before_its_completion_settles_the_transfer() -> None:
    """close() cancels when a transfer is in flight or a waiter thread is busy; it reads the two in that
    order.  A waiter counted busy after its transfer settled made close() cancel a finished step, which
    closed the group's gloo pairs under the next collective (1 run in 3-5 of the 2-rank bit-exactness set
    failed that way).  So by the time a completion's callbacks run, the pool counts the thread idle."""
    from dualpipe_kernels.transport.gloo_waiters import WaiterPool

    pool = WaiterPool(5.0)
    seen: list[int] = []
    try:
        for _ in range(200):
            done = pool.submit(_DoneWork())
            done.add_callback(lambda _err: seen.append(pool.busy()))
            assert done.event.wait(5.0)
        deadline = time.monotonic() + 5.0
        while len(seen) < 200 and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        pool.close(1.0)
    # a callback added after completion runs at once on this thread (busy 0 too); one added before runs on
    # the waiter, which must already count itself idle
    assert len(seen) == 200 and set(seen) == {0}, seen
